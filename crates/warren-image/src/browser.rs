//! The `agents` recipe's browser block, as the host sees it: where the image keeps the
//! Chrome DevTools MCP server's wrapper and the agents' MCP configuration naming it. The
//! block itself (Debian's `chromium-headless-shell`, the pinned `chrome-devtools-mcp` npm
//! package, the files below) is part of `recipes/agents.toml`, and the files live beside it
//! in `recipes/browser/`; `warren run` points Claude Code, Codex and opencode at them when a
//! session's guest has them.

/// The MCP server command (stdio): starts the headless browser and the DevTools MCP server
/// on it.
pub const MCP_WRAPPER: &str = "/usr/local/bin/warren-browser-mcp";

/// The MCP configuration in the `mcpServers` format Claude Code reads (`--mcp-config`).
pub const MCP_CONFIG: &str = "/etc/warren/mcp.json";

/// opencode's configuration naming the same server (`OPENCODE_CONFIG`).
pub const OPENCODE_CONFIG: &str = "/etc/warren/opencode.json";

/// The server's name in every agent's configuration.
pub const SERVER_NAME: &str = "chrome-devtools";

#[cfg(test)]
mod tests {
    use super::*;
    use crate::recipe::{Recipe, BUILTIN_FILES};

    /// The agents recipe installs the wrapper and both configurations where these constants
    /// say, and each configuration names the wrapper under [`SERVER_NAME`].
    #[test]
    fn test_agents_recipe_holds_the_browser_block_where_run_looks() {
        let agents = Recipe::builtin("agents").expect("agents");
        for path in [MCP_WRAPPER, MCP_CONFIG, OPENCODE_CONFIG] {
            assert!(
                agents.files().iter().any(|f| f.dest == path),
                "{path} not in the agents recipe"
            );
        }
        let wrapper = agents
            .files()
            .iter()
            .find(|f| f.dest == MCP_WRAPPER)
            .expect("wrapper");
        assert_eq!(wrapper.mode, 0o755);
        assert!(agents
            .packages()
            .iter()
            .any(|p| p == "chromium-headless-shell"));
        assert!(agents
            .agent_clis()
            .iter()
            .any(|c| c.package == "chrome-devtools-mcp"));
        let claude: serde_json::Value =
            serde_json::from_slice(BUILTIN_FILES[1].1).expect("mcp.json");
        assert_eq!(claude["mcpServers"][SERVER_NAME]["command"], MCP_WRAPPER);
        let opencode: serde_json::Value =
            serde_json::from_slice(BUILTIN_FILES[2].1).expect("opencode.json");
        assert_eq!(opencode["mcp"][SERVER_NAME]["command"][0], MCP_WRAPPER);
        // The dev recipe has none of it.
        let dev = Recipe::builtin("dev").expect("dev");
        assert!(dev.files().is_empty());
    }

    /// The wrapper itself, run by the host's `python3` with stand-ins for the MCP server (it
    /// answers each request with the time it got it) and for Chromium (it answers on its
    /// debugging port after a second): other messages go through at once, a tool call waits
    /// for the browser, a cancelled held call is dropped, and at the end of input the server,
    /// the browser and the profile are gone and the wrapper exits 0.
    #[test]
    fn test_wrapper_holds_tool_calls_until_the_browser_answers() {
        use std::io::Write;
        let dir = tempfile::tempdir().expect("tempdir");
        let d = dir.path();
        let server = d.join("server.py");
        std::fs::write(
            &server,
            "import json, sys, time\nt0 = time.time()\nfor line in sys.stdin:\n    \
             m = json.loads(line)\n    if 'id' in m:\n        \
             print(json.dumps({'id': m['id'], 'at': time.time() - t0}), flush=True)\n",
        )
        .expect("server");
        let browser = d.join("chromium");
        let marker = d.join("browser.pid");
        std::fs::write(
            &browser,
            format!(
                "#!/usr/bin/python3\nimport http.server, os, sys, time\n\
                 open('{}', 'w').write(str(os.getpid()))\n\
                 port = int([a for a in sys.argv if a.startswith('--remote-debugging-port=')][0].split('=')[1])\n\
                 time.sleep(1)\n\
                 class H(http.server.BaseHTTPRequestHandler):\n    \
                 def do_GET(self):\n        self.send_response(200); self.end_headers(); self.wfile.write(b'{{}}')\n    \
                 def log_message(self, *a): pass\n\
                 http.server.HTTPServer(('127.0.0.1', port), H).serve_forever()\n",
                marker.display()
            ),
        )
        .expect("browser");
        std::fs::set_permissions(
            &browser,
            std::os::unix::fs::PermissionsExt::from_mode(0o755),
        )
        .expect("chmod");
        let wrapper = BUILTIN_FILES[0].1;
        let wrapper = std::str::from_utf8(wrapper).expect("utf-8");
        let server_line = "SERVER = [\"/usr/local/bin/chrome-devtools-mcp\"";
        let browser_line = "CHROMIUM = \"/usr/lib/chromium/chromium-headless-shell\"";
        assert!(wrapper.contains(server_line) && wrapper.contains(browser_line));
        let wrapper = wrapper
            .replace(
                server_line,
                &format!("SERVER = [\"/usr/bin/python3\", \"{}\"", server.display()),
            )
            .replace(
                browser_line,
                &format!("CHROMIUM = \"{}\"", browser.display()),
            );
        let script = d.join("wrapper.py");
        std::fs::write(&script, wrapper).expect("wrapper");
        let tmp = d.join("tmp");
        std::fs::create_dir(&tmp).expect("tmp");
        let mut child = std::process::Command::new("python3")
            .arg(&script)
            .env("TMPDIR", &tmp)
            .env_remove("WARREN_BROWSER_URL")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("python3");
        let mut stdin = child.stdin.take().expect("stdin");
        for line in [
            r#"{"jsonrpc":"2.0","id":1,"method":"initialize"}"#,
            r#"{"jsonrpc":"2.0","id":2,"method":"tools/call"}"#,
            r#"{"jsonrpc":"2.0","id":3,"method":"tools/list"}"#,
            r#"{"jsonrpc":"2.0","id":4,"method":"tools/call"}"#,
            r#"{"jsonrpc":"2.0","method":"notifications/cancelled","params":{"requestId":4}}"#,
        ] {
            writeln!(stdin, "{line}").expect("write");
        }
        stdin.flush().expect("flush");
        // Input stays open until the held call has been answered.
        let mut lines = std::io::BufRead::lines(std::io::BufReader::new(
            child.stdout.take().expect("stdout"),
        ));
        let mut answers = Vec::new();
        for _ in 0..3 {
            let line = lines.next().expect("an answer").expect("read");
            let v: serde_json::Value = serde_json::from_str(&line).expect("json");
            answers.push((v["id"].as_i64().expect("id"), v["at"].as_f64().expect("at")));
        }
        drop(stdin);
        let status = child.wait().expect("wait");
        assert!(status.success(), "{status:?}");
        let ids: Vec<i64> = answers.iter().map(|a| a.0).collect();
        assert_eq!(ids, [1, 3, 2], "{answers:?}");
        assert!(answers[1].1 < 0.9, "tools/list held: {answers:?}");
        assert!(answers[2].1 >= 1.0, "tools/call not held: {answers:?}");
        assert!(lines.next().is_none(), "the cancelled call was sent");
        let pid: i32 = std::fs::read_to_string(&marker)
            .expect("the browser started")
            .parse()
            .expect("pid");
        assert!(
            !std::path::Path::new(&format!("/proc/{pid}")).exists(),
            "the browser outlived the wrapper"
        );
        assert_eq!(
            std::fs::read_dir(&tmp).expect("tmp").count(),
            0,
            "profile left"
        );
    }
}
