//! MCP over Streamable HTTP, end to end: the official MCP Python SDK (PyPI `mcp`, in the venv
//! `scripts/mcp-venv.sh` makes) talks to a real `warren serve`, boots a `dev` VM and runs a
//! Python one-liner in it.

mod common;

use std::path::PathBuf;
use std::process::Command;

use common::daemon::Daemon;
use serde_json::{json, Value};

fn repo() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
}

/// The venv's Python, creating the venv first if needed (idempotent, ~1 s when it exists).
fn python() -> PathBuf {
    let st = Command::new(repo().join("scripts/mcp-venv.sh"))
        .status()
        .expect("run scripts/mcp-venv.sh");
    assert!(st.success(), "scripts/mcp-venv.sh failed");
    let venv = std::env::var_os("WARREN_MCP_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/cache/warren-test/mcp-venv"));
    venv.join("bin/python")
}

struct Client {
    python: PathBuf,
    url: String,
}

impl Client {
    /// Runs the client; returns (exit code, stdout JSON, stderr).
    fn run(&self, token_file: &std::path::Path, args: &[&str]) -> (i32, Value, String) {
        let out = Command::new(&self.python)
            .arg(repo().join("crates/warren-api/tests/mcp_client.py"))
            .args(["--url", &self.url, "--token-file"])
            .arg(token_file)
            .args(args)
            .output()
            .expect("run mcp_client.py");
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        let v = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
        (out.status.code().unwrap_or(-1), v, stderr)
    }

    fn ok(&self, token_file: &std::path::Path, args: &[&str]) -> Value {
        let (code, v, err) = self.run(token_file, args);
        assert_eq!(code, 0, "mcp_client.py {args:?} failed: {err}");
        v
    }
}

#[test]
fn test_mcp_python_sdk_session_runs_python_in_vm() {
    let python = python();
    let d = Daemon::start("");
    let alice = d.token_file(&d.token("alice", &[]));
    let bob = d.token_file(&d.token("bob", &[]));
    let c = Client {
        python,
        url: format!("http://{}/mcp", d.addr),
    };

    // Discovery: every tool with a complete schema; images as an enum of configured names.
    let list = c.ok(&alice, &["--script", "list"]);
    let tools = list["tools"].as_array().expect("tools");
    let names: Vec<&str> = tools.iter().filter_map(|t| t["name"].as_str()).collect();
    for want in [
        "vm_create",
        "vm_list",
        "vm_status",
        "vm_exec",
        "vm_job_status",
        "vm_job_output",
        "vm_job_cancel",
        "vm_read_file",
        "vm_write_file",
        "vm_destroy",
    ] {
        assert!(names.contains(&want), "{want} missing from {names:?}");
    }
    let create = tools
        .iter()
        .find(|t| t["name"] == "vm_create")
        .expect("vm_create");
    let mut images = create["inputSchema"]["properties"]["image"]["enum"].clone();
    images
        .as_array_mut()
        .expect("enum")
        .sort_by_key(|v| v.to_string());
    assert_eq!(images, json!(["dev", "minimal"]));
    assert_eq!(create["inputSchema"]["additionalProperties"], false);

    // The main job: create a VM, run a Python one-liner, read its output.
    let run = c.ok(
        &alice,
        &[
            "--script",
            "python",
            "--request-id",
            "mcp-1",
            "--image",
            "dev",
        ],
    );
    assert_eq!(run["stdout"], "42\n", "{run}");
    assert_eq!(run["exit_code"], 0);
    let vm = run["vm_id"].as_str().expect("vm_id").to_string();
    // The same VM is visible over HTTP to the same workspace: one implementation.
    let http_token = d.token("alice", &[]);
    let listed = d.ok(&http_token, "vm_list", json!({}));
    assert_eq!(listed["vms"][0]["vm_id"], vm.as_str());

    // Errors are tool results with isError and the same stable codes as HTTP.
    let args = json!({"vm_id": vm}).to_string();
    let r = c.ok(
        &bob,
        &["--script", "call", "--tool", "vm_status", "--args", &args],
    );
    assert_eq!(r["is_error"], true, "{r}");
    assert_eq!(r["structured"]["error"]["code"], "not_found");
    assert!(r["text"].as_str().unwrap_or("").contains("not_found"));
    let r = c.ok(
        &alice,
        &[
            "--script",
            "call",
            "--tool",
            "vm_exec",
            "--args",
            r#"{"vm_id": "x", "bogus": 1}"#,
        ],
    );
    assert_eq!(r["structured"]["error"]["code"], "invalid_argument", "{r}");
    let r = c.ok(&alice, &["--script", "call", "--tool", "nope"]);
    assert_eq!(r["structured"]["error"]["code"], "unknown_tool", "{r}");
    let r = c.ok(
        &alice,
        &["--script", "call", "--tool", "vm_status", "--args", &args],
    );
    assert_eq!(r["is_error"], false, "{r}");
    assert_eq!(r["structured"]["image"], "dev");

    // A revoked workspace cannot even open a session.
    let out = d.env.run(&["token", "revoke-workspace", "bob"]);
    assert!(out.status.success());
    let (code, _, err) = c.run(&bob, &["--script", "list"]);
    assert_ne!(code, 0);
    assert!(
        err.contains("unauthenticated") || err.contains("401"),
        "{err}"
    );
}
