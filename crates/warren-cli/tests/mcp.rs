//! MCP over Streamable HTTP, end to end: the official MCP Python SDK (the Python package
//! index's `mcp`, in the venv `scripts/mcp-venv.sh` makes) talks to a real `warren serve`,
//! boots a `dev` VM and runs a Python one-liner in it. Then, with raw HTTP against the real
//! service: an MCP session is bound to the token that opened it (issue 13, item 9: before,
//! any token holder who learnt a session id could read its stream or end it), and session ids
//! never reach the service's log, even at trace level.

mod common;

use std::path::PathBuf;
use std::process::Command;

use common::daemon::{Daemon, Resp};
use common::{mcp_python as python, repo};
use serde_json::{json, Value};

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

// --- Sessions over raw HTTP. ---

/// The protocol version that still has sessions (newer clients are served statelessly).
const LEGACY: &str = "2025-06-18";

/// POSTs one JSON-RPC message to `/mcp` as `token`, in `session` if given.
fn mcp_post(d: &Daemon, token: &str, session: Option<&str>, msg: Value) -> Resp {
    let auth = format!("Bearer {token}");
    let mut h = vec![
        ("Authorization", auth.as_str()),
        ("Accept", "application/json, text/event-stream"),
    ];
    if let Some(id) = session {
        h.extend([("Mcp-Session-Id", id), ("Mcp-Protocol-Version", LEGACY)]);
    }
    d.post("/mcp", &h, msg.to_string().as_bytes())
}

/// The JSON-RPC reply carried by an SSE body (its last `data:` line).
fn sse_reply(r: &Resp) -> Value {
    r.text
        .lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .filter_map(|d| serde_json::from_str::<Value>(d.trim()).ok())
        .next_back()
        .unwrap_or(Value::Null)
}

/// Opens a session as `token`; returns its id.
fn mcp_open(d: &Daemon, token: &str) -> String {
    let init = json!({
        "jsonrpc": "2.0", "id": 1, "method": "initialize",
        "params": {
            "protocolVersion": LEGACY,
            "capabilities": {},
            "clientInfo": {"name": "test", "version": "0"}
        }
    });
    let r = mcp_post(d, token, None, init);
    assert_eq!(r.status, 200, "initialize: {}", r.text);
    assert_eq!(sse_reply(&r)["result"]["serverInfo"]["name"], "warren");
    let sid = r
        .header("mcp-session-id")
        .expect("a session id")
        .to_string();
    let note = json!({"jsonrpc": "2.0", "method": "notifications/initialized"});
    let r = mcp_post(d, token, Some(&sid), note);
    assert_eq!(r.status, 202, "initialized: {}", r.text);
    sid
}

fn mcp_vm_list(d: &Daemon, token: &str, session: &str) -> Resp {
    let msg = json!({
        "jsonrpc": "2.0", "id": 2, "method": "tools/call",
        "params": {"name": "vm_list", "arguments": {}}
    });
    mcp_post(d, token, Some(session), msg)
}

/// The session's GET stream: only its response head is read.
fn mcp_get(d: &Daemon, token: &str, session: &str) -> Resp {
    let auth = format!("Bearer {token}");
    d.request_head(
        "GET",
        "/mcp",
        &[
            ("Authorization", &auth),
            ("Accept", "text/event-stream"),
            ("Mcp-Session-Id", session),
            ("Mcp-Protocol-Version", LEGACY),
        ],
    )
}

fn mcp_delete(d: &Daemon, token: &str, session: &str) -> Resp {
    let auth = format!("Bearer {token}");
    d.request(
        "DELETE",
        "/mcp",
        &[
            ("Authorization", &auth),
            ("Mcp-Session-Id", session),
            ("Mcp-Protocol-Version", LEGACY),
        ],
        b"",
    )
}

/// The session still answers its owner's tool calls.
fn assert_session_serves(d: &Daemon, token: &str, session: &str) {
    let r = mcp_vm_list(d, token, session);
    assert_eq!(r.status, 200, "{}", r.text);
    let reply = sse_reply(&r);
    assert_eq!(reply["result"]["isError"], false, "{reply}");
    assert_eq!(reply["result"]["structuredContent"], json!({"vms": []}));
}

/// Attack: bob (another workspace) and alice's second token each take alice's session id
/// and open its stream (GET), end it (DELETE) and call a tool in it (POST). Each is refused
/// `404 not_found`, as for an id nobody holds, and alice's session keeps serving her.
/// Control: alice's own GET opens the stream, and her DELETE does end the session.
#[test]
fn test_mcp_session_id_of_another_workspace_or_token_refused() {
    let d = Daemon::start("");
    let alice = d.token("alice", &[]);
    let alice2 = d.token("alice", &[]);
    let bob = d.token("bob", &[]);
    let sid = mcp_open(&d, &alice);
    assert_session_serves(&d, &alice, &sid);

    for (who, token) in [("bob", &bob), ("alice's other token", &alice2)] {
        let r = mcp_get(&d, token, &sid);
        assert_eq!(r.status, 404, "GET by {who}: {:?}", r.headers);
        let r = mcp_delete(&d, token, &sid);
        assert_eq!(
            (r.status, r.code()),
            (404, "not_found"),
            "DELETE by {who}: {}",
            r.text
        );
        let r = mcp_vm_list(&d, token, &sid);
        assert_eq!(
            (r.status, r.code()),
            (404, "not_found"),
            "POST by {who}: {}",
            r.text
        );
        assert_session_serves(&d, &alice, &sid);
    }
    // What bob got is what an unknown id gets.
    let r = mcp_delete(&d, &bob, "00000000-0000-0000-0000-000000000000");
    assert_eq!((r.status, r.code()), (404, "not_found"), "{}", r.text);

    // Control: the owner's stream opens and her DELETE takes effect.
    let r = mcp_get(&d, &alice, &sid);
    assert_eq!(r.status, 200, "{:?}", r.headers);
    assert_eq!(r.header("content-type"), Some("text/event-stream"));
    let r = mcp_delete(&d, &alice, &sid);
    assert_eq!(r.status, 202, "{}", r.text);
    let r = mcp_vm_list(&d, &alice, &sid);
    assert_eq!(r.status, 404, "the session ended: {}", r.text);
}

/// Session ids are capabilities for a session's stream: the service at its most verbose
/// (`-vv`, `RUST_LOG=trace`) opens, uses, refuses and ends a session without writing the id.
/// Before, rmcp logged it at info ("create new session") and in its spans. Control: the id is
/// known and non-empty, and the log holds the trace-level detail of that same traffic.
#[test]
fn test_mcp_session_ids_never_logged_at_trace() {
    let dir = tempfile::tempdir().expect("tempdir");
    let log = dir.path().join("serve.log");
    let mut d = Daemon::start_logging("", log.clone());
    let alice = d.token("alice", &[]);
    let bob = d.token("bob", &[]);
    let sid = mcp_open(&d, &alice);
    assert_session_serves(&d, &alice, &sid);
    assert_eq!(mcp_get(&d, &alice, &sid).status, 200);
    assert_eq!(mcp_get(&d, &bob, &sid).status, 404);
    assert_eq!(mcp_delete(&d, &alice, &sid).status, 202);
    // A second session, left open until shutdown closes it.
    let open = mcp_open(&d, &alice);
    d.stop();

    let text = std::fs::read_to_string(&log).expect("the service log");
    for id in [&sid, &open] {
        assert!(id.len() >= 16, "a real session id: {id:?}");
        let bare = id.replace('-', "");
        assert!(
            !text.contains(id.as_str()) && !text.contains(&bare),
            "session id {id} in the log:\n{}",
            text.lines()
                .filter(|l| l.contains(id.as_str()) || l.contains(&bare))
                .collect::<Vec<_>>()
                .join("\n")
        );
    }
    assert!(text.contains("TRACE"), "trace-level lines were written");
    assert!(
        text.contains("tool=\"vm_list\"") || text.contains("tool=vm_list"),
        "the session's tool call was logged"
    );
    assert!(
        text.contains("does not hold refused"),
        "bob's refusal was logged"
    );
}
