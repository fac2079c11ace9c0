//! MCP conformance, against a real `warren serve`, with third-party clients only:
//!
//! - the official conformance suite (the npm registry's `@modelcontextprotocol/conformance`,
//!   pinned to 0.1.10, the newest that runs on Node.js 20): every server scenario it lists
//!   (so new ones are picked up when the pin moves) must pass, except those in
//!   `scripts/mcp-conformance/expected-failures.txt`, each with its reason, which must fail
//!   (a scenario that starts passing must leave the file);
//! - the MCP Inspector's CLI mode (`@modelcontextprotocol/inspector-cli` 0.15.0): lists the
//!   tools and calls every tool that takes no required argument;
//! - protocol revision 2026-07-28 (stateless, `server/discover`), which the suite has no
//!   scenarios for yet: the official Python SDK's client and rmcp's client each list the tools
//!   and call them the same way, and both see the same tools as the Inspector.
//!
//! The suite and the Inspector cannot send a bearer token: they talk to the service through
//! `scripts/mcp-conformance/proxy.mjs`, a test-side proxy that adds the workspace's
//! `Authorization` header and nothing else. The tool lists are never hard-coded: tools added
//! later are checked the same way.

mod common;

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use common::daemon::Daemon;
use serde_json::Value;

fn repo() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
}

/// The installed clients (`scripts/mcp-conformance/install.sh`, idempotent).
fn clients_dir() -> PathBuf {
    let st = Command::new(repo().join("scripts/mcp-conformance/install.sh"))
        .status()
        .expect("run scripts/mcp-conformance/install.sh");
    assert!(st.success(), "scripts/mcp-conformance/install.sh failed");
    std::env::var_os("WARREN_MCP_CONFORMANCE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/cache/warren-test/mcp-conformance"))
}

/// The MCP venv's Python (`scripts/mcp-venv.sh`, idempotent).
fn python() -> PathBuf {
    let st = Command::new(repo().join("scripts/mcp-venv.sh"))
        .status()
        .expect("run scripts/mcp-venv.sh");
    assert!(st.success(), "scripts/mcp-venv.sh failed");
    std::env::var_os("WARREN_MCP_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/cache/warren-test/mcp-venv"))
        .join("bin/python")
}

/// The bearer-adding proxy in front of the service; killed on drop.
struct Proxy {
    child: Child,
    url: String,
}

impl Proxy {
    fn start(d: &Daemon, token_file: &Path) -> Proxy {
        let mut child = Command::new("node")
            .arg(repo().join("scripts/mcp-conformance/proxy.mjs"))
            .args(["--upstream", &d.addr, "--token-file"])
            .arg(token_file)
            .stdout(Stdio::piped())
            .spawn()
            .expect("node proxy.mjs");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("stdout"))
            .read_line(&mut line)
            .expect("proxy address");
        let addr = line
            .trim()
            .strip_prefix("listening ")
            .unwrap_or_else(|| panic!("proxy said {line:?}"))
            .to_string();
        Proxy {
            child,
            url: format!("http://{addr}/mcp"),
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `scripts/mcp-conformance/expected-failures.txt`: `scenario: reason` lines.
fn expected_failures() -> Vec<(String, String)> {
    let text =
        std::fs::read_to_string(repo().join("scripts/mcp-conformance/expected-failures.txt"))
            .expect("expected-failures.txt");
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| {
            let (name, reason) = l
                .split_once(':')
                .unwrap_or_else(|| panic!("expected-failures.txt: {l:?} has no reason"));
            let reason = reason.trim();
            assert!(reason.len() >= 20, "expected-failures.txt: {name}: say why");
            (name.trim().to_string(), reason.to_string())
        })
        .collect()
}

/// The suite's server scenarios, from its own `list --server`.
fn server_scenarios(suite: &Path) -> Vec<String> {
    let out = Command::new("node")
        .arg(suite)
        .args(["list", "--server"])
        .output()
        .expect("conformance list");
    assert!(out.status.success(), "conformance list failed");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- "))
        .map(str::to_string)
        .collect()
}

#[test]
fn test_mcp_conformance_suite_scenarios_pass_or_fail_as_recorded() {
    let dir = clients_dir();
    let suite = dir.join("node_modules/@modelcontextprotocol/conformance/dist/index.js");
    // The suite opens an MCP session per scenario and never closes it (no DELETE): the
    // default 16 sessions per token would refuse the later scenarios with quota_exceeded.
    let d = Daemon::start("max_mcp_sessions_per_token = 64");
    let token = d.token_file(&d.token("conformance", &[]));
    let proxy = Proxy::start(&d, &token);
    let scenarios = server_scenarios(&suite);
    assert!(
        scenarios.iter().any(|s| s == "server-initialize"),
        "{scenarios:?}"
    );
    let expected = expected_failures();
    for (name, _) in &expected {
        assert!(
            scenarios.contains(name),
            "expected-failures.txt names {name}, which the suite does not have"
        );
    }
    let out_dir = tempfile::tempdir().expect("tempdir");
    let mut wrong = Vec::new();
    let mut passed = Vec::new();
    for s in &scenarios {
        let out = Command::new("node")
            .arg(&suite)
            .args(["server", "--url", &proxy.url, "--scenario", s, "-o"])
            .arg(out_dir.path().join(s))
            .output()
            .expect("conformance server");
        let ok = out.status.success();
        let reason = expected.iter().find(|(n, _)| n == s).map(|(_, r)| r);
        match (ok, reason) {
            (true, None) => passed.push(s.clone()),
            (false, Some(_)) => {}
            (true, Some(r)) => wrong.push(format!(
                "{s} passes now: remove it from expected-failures.txt (it said: {r})"
            )),
            (false, None) => wrong.push(format!(
                "{s} fails:\n{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            )),
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n\n"));
    for must in ["server-initialize", "ping", "tools-list"] {
        assert!(passed.iter().any(|p| p == must), "{must} not passed");
    }
    eprintln!(
        "conformance: {} passed, {} expected failures",
        passed.len(),
        expected.len()
    );
}

/// Tool names, and those with no required argument (callable with `{}`).
fn tool_sets(tools: &[Value]) -> (BTreeSet<String>, BTreeSet<String>) {
    let mut names = BTreeSet::new();
    let mut bare = BTreeSet::new();
    for t in tools {
        let name = t["name"].as_str().expect("tool name").to_string();
        let schema = &t["inputSchema"];
        assert_eq!(schema["type"], "object", "{name}: {schema}");
        let required = schema["required"].as_array().map(|r| r.len()).unwrap_or(0);
        if required == 0 {
            bare.insert(name.clone());
        }
        names.insert(name);
    }
    (names, bare)
}

fn inspector(dir: &Path, url: &str, args: &[&str]) -> Value {
    let out = Command::new("node")
        .arg(dir.join("node_modules/@modelcontextprotocol/inspector-cli/build/index.js"))
        .args([url, "--transport", "http"])
        .args(args)
        .output()
        .expect("inspector cli");
    assert!(
        out.status.success(),
        "inspector {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "inspector {args:?}: not JSON ({e}): {}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

fn python_client(python: &Path, url: &str, token: &Path, args: &[&str]) -> Value {
    let out = Command::new(python)
        .arg(repo().join("crates/warren-api/tests/mcp_client.py"))
        .args(["--url", url, "--token-file"])
        .arg(token)
        .args(args)
        .output()
        .expect("mcp_client.py");
    assert!(
        out.status.success(),
        "mcp_client.py {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("mcp_client.py prints JSON")
}

/// rmcp's client over the stateless 2026-07-28 protocol: (negotiated version, tools, the
/// results of calling each of `bare` with `{}`).
fn rmcp_stateless(
    url: &str,
    token: &str,
    bare: &BTreeSet<String>,
) -> (String, Vec<Value>, Vec<(String, bool)>) {
    use rmcp::model::{
        CallToolRequestParams, ClientCapabilities, ClientConfig, Implementation, ProtocolVersion,
    };
    use rmcp::service::ClientLifecycleMode;
    use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
    use rmcp::transport::StreamableHttpClientTransport;
    use rmcp::ClientServiceExt;
    // The HTTP client is built without a TLS provider of its own (see `warren`'s main).
    let _ = rustls::crypto::ring::default_provider().install_default();
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let config = StreamableHttpClientTransportConfig::with_uri(url.to_string())
            .auth_header(token.to_string());
        let http = StreamableHttpClientTransport::from_config(config);
        let info = ClientConfig::new(
            ClientCapabilities::default(),
            Implementation::new("warren-conformance-test", env!("CARGO_PKG_VERSION")),
        );
        let lifecycle = ClientLifecycleMode::Discover {
            preferred_versions: vec![ProtocolVersion::V_2026_07_28],
        };
        let client = info
            .serve_with_lifecycle(http, lifecycle)
            .await
            .expect("rmcp client: server/discover");
        let version = client
            .peer_info()
            .and_then(|i| serde_json::to_value(&i.protocol_version).ok())
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_default();
        let tools = client.list_all_tools().await.expect("rmcp: tools/list");
        let tools: Vec<Value> = tools
            .into_iter()
            .map(|t| serde_json::to_value(t).expect("tool as JSON"))
            .collect();
        let mut calls = Vec::new();
        for name in bare {
            let r = client
                .call_tool(
                    CallToolRequestParams::new(name.clone()).with_arguments(serde_json::Map::new()),
                )
                .await
                .unwrap_or_else(|e| panic!("rmcp: tools/call {name}: {e}"));
            calls.push((name.clone(), r.is_error.unwrap_or(false)));
        }
        let _ = client.cancel().await;
        (version, tools, calls)
    })
}

#[test]
fn test_mcp_inspector_and_stateless_clients_see_and_call_the_same_tools() {
    let dir = clients_dir();
    let python = python();
    let d = Daemon::start("");
    let token = d.token("conformance", &[]);
    let token_file = d.token_file(&token);
    let proxy = Proxy::start(&d, &token_file);

    // The Inspector's CLI (a session, through the proxy).
    let listed = inspector(&dir, &proxy.url, &["--method", "tools/list"]);
    let tools = listed["tools"].as_array().expect("tools").clone();
    let (names, bare) = tool_sets(&tools);
    assert!(names.contains("vm_list"), "{names:?}");
    for name in &bare {
        let r = inspector(
            &dir,
            &proxy.url,
            &["--method", "tools/call", "--tool-name", name],
        );
        assert_ne!(r["isError"], true, "inspector: {name}: {r}");
    }

    // The official Python SDK's client, stateless 2026-07-28 (direct, with its token).
    let url = format!("http://{}/mcp", d.addr);
    let py = python_client(
        &python,
        &url,
        &token_file,
        &["--protocol", "discover", "--script", "list"],
    );
    assert_eq!(py["protocol_version"], "2026-07-28", "{py}");
    let py_tools = py["tools"].as_array().expect("tools").clone();
    assert_eq!(tool_sets(&py_tools), (names.clone(), bare.clone()));
    for name in &bare {
        let r = python_client(
            &python,
            &url,
            &token_file,
            &[
                "--protocol",
                "discover",
                "--script",
                "call",
                "--tool",
                name,
                "--args",
                "{}",
            ],
        );
        assert_eq!(r["is_error"], false, "python sdk: {name}: {r}");
    }

    // rmcp's client, stateless 2026-07-28.
    let (version, rmcp_tools, calls) = rmcp_stateless(&url, &token, &bare);
    assert_eq!(version, "2026-07-28");
    assert_eq!(tool_sets(&rmcp_tools), (names, bare));
    for (name, is_error) in calls {
        assert!(!is_error, "rmcp: {name} answered with an error");
    }
}
