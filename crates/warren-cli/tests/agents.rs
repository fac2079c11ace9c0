//! The `agents` image on a real VM: the Claude Code, Codex and opencode CLIs that the recipe
//! installs from the npm registry run in the guest as the guest user and report their pinned
//! versions, and `warren run claude|codex|opencode` in a fresh project starts them (a new
//! session defaults to the `agents` image). The browser block: the Chrome DevTools MCP
//! server, started in the guest as the guest user the way the agents' MCP configuration
//! names it, drives the image's Chromium to a page served inside the guest and returns a
//! screenshot of it. One VM per test.

mod common;

use std::path::Path;
use std::process::{Command, Output, Stdio};

use common::{ok, TestEnv};

/// Deletes the project's session (and so its VM) even when an assertion fails.
struct SessionGuard<'a> {
    env: &'a TestEnv,
}

impl Drop for SessionGuard<'_> {
    fn drop(&mut self) {
        let Ok(out) = self.env.cmd().args(["session", "list", "--json"]).output() else {
            return;
        };
        let Ok(v) = serde_json::from_slice::<serde_json::Value>(&out.stdout) else {
            return;
        };
        for s in v.as_array().into_iter().flatten() {
            if let Some(name) = s["name"].as_str() {
                let _ = self
                    .env
                    .cmd()
                    .args(["session", "delete", name, "--force"])
                    .output();
            }
        }
    }
}

/// A fresh git project directory (canonical path).
fn project() -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().expect("tempdir");
    let proj = dir.path().canonicalize().expect("canonical");
    let git = Command::new("git")
        .args(["init", "-q", "-b", "main"])
        .current_dir(&proj)
        .status()
        .expect("git init");
    assert!(git.success());
    (dir, proj)
}

fn warren_run(env: &TestEnv, proj: &Path, args: &[&str]) -> Output {
    env.cmd()
        .arg("run")
        .args(args)
        .current_dir(proj)
        .stdin(Stdio::null())
        .output()
        .expect("warren run")
}

#[test]
fn test_agents_image_clis_report_pinned_versions() {
    common::ensure_image("agents");
    let env = TestEnv::new();
    let (_dir, proj) = project();
    let _guard = SessionGuard { env: &env };

    // No --image: the first run creates the session, whose VM gets the agents image; the
    // others start another process in the same VM.
    let agents = warren_image::Recipe::builtin("agents").expect("agents recipe");
    let clis = agents.agent_clis();
    for cli in clis
        .iter()
        .filter(|c| ["claude", "codex", "opencode"].contains(&c.command.as_str()))
    {
        let started = std::time::Instant::now();
        let out = warren_run(&env, &proj, &[&cli.command, "--", "--version"]);
        let stdout = ok(out, &format!("warren run {} -- --version", cli.command));
        eprintln!(
            "warren run {} -- --version: {:.1?}: {}",
            cli.command,
            started.elapsed(),
            stdout.trim()
        );
        assert!(stdout.contains(cli.release()), "{}: {stdout}", cli.spec());
    }

    // Installed where the recipe says, run as the guest user, found on the default PATH.
    let commands: Vec<&str> = clis.iter().map(|c| c.command.as_str()).collect();
    let script = format!(
        "id -u; for c in {}; do readlink -f \"$(command -v $c)\"; done",
        commands.join(" ")
    );
    let out = warren_run(&env, &proj, &["shell", "--", "sh", "-c", &script]);
    let stdout = ok(out, "warren run shell");
    let mut lines = stdout.lines();
    assert_eq!(lines.next(), Some("1000"), "{stdout}");
    for (cli, line) in clis.iter().zip(lines) {
        assert_eq!(
            line,
            format!(
                "/usr/local/lib/warren-agents/{}-{}/{}",
                cli.command, cli.version, cli.binary
            ),
            "{stdout}"
        );
    }
    // Codex's configuration as `warren run codex` starts it names the browser's MCP server
    // (read from its own `mcp list`, which starts no server), and not with --no-browser.
    let out = warren_run(&env, &proj, &["codex", "--", "mcp", "list"]);
    let stdout = ok(out, "warren run codex -- mcp list");
    assert!(
        stdout.contains("chrome-devtools") && stdout.contains("/usr/local/bin/warren-browser-mcp"),
        "{stdout}"
    );
    let out = warren_run(&env, &proj, &["--no-browser", "codex", "--", "mcp", "list"]);
    let stdout = ok(out, "warren run --no-browser codex -- mcp list");
    assert!(!stdout.contains("chrome-devtools"), "{stdout}");

    let list = ok(env.run(&["session", "list", "--json"]), "session list");
    let v: serde_json::Value = serde_json::from_str(&list).expect("json");
    assert_eq!(v.as_array().map(Vec::len), Some(1), "{v}");
}

/// An MCP client over the stdio of the server the agents' MCP configuration names: starts a
/// web server on the guest's loopback, opens its page through the server, takes a
/// screenshot, then closes the server's input and checks that the server and its browser
/// are gone. Prints one JSON object; its progress goes to stderr as it happens.
const BROWSER_PROBE: &str = r#"import base64, glob, json, os, re, signal, subprocess, sys, tempfile, time, urllib.request, zlib
signal.alarm(540)
site = tempfile.mkdtemp()
with open(site + '/index.html', 'w') as f:
    f.write('<html><head><title>Warren guest page</title></head>'
            '<body style="background:#00ff00"><h1>served inside the guest</h1></body></html>')
web = subprocess.Popen([sys.executable, '-m', 'http.server', '8765', '--bind', '127.0.0.1',
                        '--directory', site], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
for _ in range(600):
    try:
        urllib.request.urlopen('http://127.0.0.1:8765/', timeout=5).read()
        break
    except OSError:
        time.sleep(0.1)
conf = json.load(open('/etc/warren/mcp.json'))['mcpServers']['chrome-devtools']
out = {'command': conf['command']}
t = time.time()
mcp = subprocess.Popen([conf['command']] + conf.get('args', []), stdin=subprocess.PIPE,
                       stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
ids = iter(range(1, 1000))
def rpc(method, params=None):
    i = next(ids)
    mcp.stdin.write(json.dumps({'jsonrpc': '2.0', 'id': i, 'method': method, 'params': params or {}}) + '\n')
    mcp.stdin.flush()
    while True:
        line = mcp.stdout.readline()
        if not line:
            raise SystemExit('the MCP server closed its output')
        m = json.loads(line)
        if m.get('id') == i:
            if 'error' in m:
                raise SystemExit('%s: %s' % (method, m['error']))
            return m['result']
def text(r):
    return ' '.join(c.get('text', '') for c in r.get('content', []) if c.get('type') == 'text')
def step(name):
    out['t_' + name] = round(time.time() - t, 1)
    print('browser probe: %s after %ss' % (name, out['t_' + name]), file=sys.stderr, flush=True)
init = rpc('initialize', {'protocolVersion': '2025-06-18', 'capabilities': {},
                          'clientInfo': {'name': 'warren-test', 'version': '1'}})
mcp.stdin.write(json.dumps({'jsonrpc': '2.0', 'method': 'notifications/initialized'}) + '\n')
mcp.stdin.flush()
out['server'] = init.get('serverInfo', {})
out['tools'] = [x['name'] for x in rpc('tools/list')['tools']]
step('init')
# No browser yet: the first tool call starts it (the wrapper holds the call until it
# answers), then the server connects to it, within the server's own 60 s bound for that. An
# agent retries a call that ran out of it, and so does this client (the second connect is
# quicker: the server's code is compiled by then); the attempts are reported.
def browsers():
    ps = subprocess.run(['ps', '-eo', 'pid=,args='], capture_output=True, text=True).stdout
    return [l for l in ps.splitlines()
            if any(a.endswith(('/chromium-headless-shell', '/chrome-devtools-mcp',
                               '/warren-browser-mcp', '/chrome_crashpad_handler'))
                   for a in l.split()[1:3])]
out['browser_before_first_call'] = any('chromium' in l for l in browsers())
out['list_pages_attempts'] = 0
while True:
    out['list_pages_attempts'] += 1
    r = rpc('tools/call', {'name': 'list_pages', 'arguments': {}})
    out['list_pages'] = text(r)[:300]
    out['list_pages_error'] = bool(r.get('isError'))
    if not r.get('isError') or time.time() - t > 300:
        break
    print('browser probe: list_pages failed: %s' % out['list_pages'], file=sys.stderr, flush=True)
    time.sleep(5)
step('connected')
r = rpc('tools/call', {'name': 'new_page', 'arguments': {'url': 'http://127.0.0.1:8765/', 'timeout': 120000}})
out['pages'] = text(r)
step('page')
m = re.search(r'(\d+): Warren guest page \(http://127\.0\.0\.1:8765/\)', out['pages'])
r = rpc('tools/call', {'name': 'take_screenshot', 'arguments': {'pageId': int(m.group(1)) if m else 0}})
step('screenshot')
out['screenshot_text'] = text(r)[:300]
imgs = [c for c in r.get('content', []) if c.get('type') == 'image']
if imgs:
    png = base64.b64decode(imgs[0]['data'])
    out['mime'] = imgs[0].get('mimeType')
    out['png_magic'] = png[:8] == b'\x89PNG\r\n\x1a\n'
    # The top-left pixel (raw whatever the first row's filter): the page's background.
    pos, idat, ctype = 8, b'', 0
    while pos < len(png):
        n = int.from_bytes(png[pos:pos + 4], 'big')
        kind, data = png[pos + 4:pos + 8], png[pos + 8:pos + 8 + n]
        if kind == b'IHDR':
            ctype = data[9]
        elif kind == b'IDAT':
            idat += data
        pos += 12 + n
    raw = zlib.decompress(idat)
    out['pixel'] = list(raw[1:4]) if ctype in (2, 6) else None
# End of input ends the server, and the wrapper takes its browser down with it.
mcp.stdin.close()
out['exit'] = mcp.wait(60)
out['browsers_left'] = browsers()
out['profiles_left'] = glob.glob(os.path.join(tempfile.gettempdir(), 'warren-browser-*'))
out['gh'] = subprocess.run(['gh', '--version'], capture_output=True, text=True).stdout.split('\n')[0]
web.kill()
print(json.dumps(out))
"#;

/// The browser block, in a VM of its own (2 vCPUs and 2 GiB: a browser and Node.js start in
/// tens of seconds on an emulated CPU).
#[test]
fn test_agents_image_devtools_mcp_screenshots_a_guest_page() {
    let env = TestEnv::new();
    let (_dir, proj) = project();
    let _guard = SessionGuard { env: &env };
    let image = common::image_id("agents");
    let started = std::time::Instant::now();
    let out = env
        .cmd()
        .args([
            "run",
            "--image",
            &image,
            "--memory-mib",
            "2048",
            "--vcpus",
            "2",
            "shell",
            "--",
            "python3",
            "-c",
            BROWSER_PROBE,
        ])
        .current_dir(&proj)
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .expect("warren run");
    let stdout = ok(out, "browser probe");
    let v: serde_json::Value =
        serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout}"));
    eprintln!(
        "browser probe: {:.1?} in all; {}",
        started.elapsed(),
        serde_json::json!({
            "init": v["t_init"], "connected": v["t_connected"], "page": v["t_page"],
            "screenshot": v["t_screenshot"], "list_pages_attempts": v["list_pages_attempts"]
        })
    );
    assert_eq!(v["command"], warren_image::browser::MCP_WRAPPER, "{v}");
    assert_eq!(v["server"]["name"], "chrome_devtools", "{v}");
    // The browser starts at the first tool call, not with the server.
    assert_eq!(v["browser_before_first_call"], false, "{v}");
    assert_eq!(v["list_pages_error"], false, "{v}");
    let tools: Vec<&str> = v["tools"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|t| t.as_str())
        .collect();
    for tool in ["new_page", "take_screenshot", "navigate_page", "click"] {
        assert!(tools.contains(&tool), "{tool}: {v}");
    }
    assert!(
        v["pages"]
            .as_str()
            .is_some_and(|p| p.contains("Warren guest page (http://127.0.0.1:8765/)")),
        "{v}"
    );
    assert_eq!(v["mime"], "image/png", "{v}");
    assert_eq!(v["png_magic"], true, "{v}");
    // The page's background, so the picture is of the guest's page.
    assert_eq!(v["pixel"], serde_json::json!([0, 255, 0]), "{v}");
    assert_eq!(v["exit"], 0, "{v}");
    assert_eq!(v["browsers_left"], serde_json::json!([]), "{v}");
    assert_eq!(v["profiles_left"], serde_json::json!([]), "{v}");
    assert!(
        v["gh"]
            .as_str()
            .is_some_and(|g| g.starts_with("gh version")),
        "{v}"
    );
}
