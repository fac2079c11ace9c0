//! The `agents` image on a real VM: the Claude Code, Codex and opencode CLIs that the recipe
//! installs from the npm registry run in the guest as the guest user and report their pinned
//! versions, and `warren run claude|codex|opencode` in a fresh project starts them (a new
//! session defaults to the `agents` image). The browser block: the Chrome DevTools MCP
//! server, started in the guest as the guest user the way the agents' MCP configuration
//! names it, drives the image's Chromium to a page served inside the guest and returns a
//! screenshot of it. One VM for the whole file.

mod common;

use std::path::Path;
use std::process::{Command, Output, Stdio};

use common::{ok, TestEnv};
use warren_image::agent_cli::AGENT_CLIS;
use warren_image::browser;

/// An MCP client over the server's stdio: starts a web server on the guest's loopback and
/// the image's headless Chromium, has the agents' MCP wrapper connect to it (a browser the
/// server launches itself takes longer to start under TCG than its 60 s tool deadline),
/// opens the page, reads its accessibility snapshot and takes a screenshot. Prints one JSON
/// object.
const BROWSER_PROBE: &str = r#"import base64, json, os, re, subprocess, sys, tempfile, time, urllib.request, zlib
# A page served inside the guest.
site = tempfile.mkdtemp()
with open(site + '/index.html', 'w') as f:
    f.write('<html><head><title>Warren guest page</title></head>'
            '<body style="background:#00ff00"><h1>served inside the guest</h1></body></html>')
web = subprocess.Popen([sys.executable, '-m', 'http.server', '8765', '--bind', '127.0.0.1',
                        '--directory', site], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
# The browser, started beside the MCP server (both start slowly on an emulated CPU), which
# the wrapper connects to through WARREN_BROWSER_URL.
browser = subprocess.Popen(['/usr/bin/chromium-headless-shell', '--no-sandbox', '--disable-gpu',
                            '--in-process-gpu', '--no-zygote', '--remote-debugging-port=9222',
                            '--user-data-dir=' + tempfile.mkdtemp(), 'about:blank'],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
mcp = subprocess.Popen(['/usr/local/bin/warren-browser-mcp'],
                       env=dict(os.environ, WARREN_BROWSER_URL='http://127.0.0.1:9222'),
                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
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
out = {}
t = time.time()
init = rpc('initialize', {'protocolVersion': '2025-06-18', 'capabilities': {},
                          'clientInfo': {'name': 'warren-test', 'version': '1'}})
mcp.stdin.write(json.dumps({'jsonrpc': '2.0', 'method': 'notifications/initialized'}) + '\n')
mcp.stdin.flush()
out['server'] = init.get('serverInfo', {})
out['tools'] = [x['name'] for x in rpc('tools/list')['tools']]
out['t_init'] = round(time.time() - t, 1)
for _ in range(60):
    try:
        urllib.request.urlopen('http://127.0.0.1:9222/json/version', timeout=5)
        break
    except Exception:
        time.sleep(2)
out['t_browser'] = round(time.time() - t, 1)
page = None
for attempt in range(4):
    r = rpc('tools/call', {'name': 'new_page', 'arguments': {'url': 'http://127.0.0.1:8765/', 'timeout': 50000}})
    pages = text(rpc('tools/call', {'name': 'list_pages', 'arguments': {}}))
    m = re.search(r'(\d+): [^\n]*\(http://127\.0\.0\.1:8765/\)', pages)
    if m:
        page = int(m.group(1))
        break
out['pages'] = pages
out['t_page'] = round(time.time() - t, 1)
snap = ''
for attempt in range(4):
    snap = text(rpc('tools/call', {'name': 'take_snapshot', 'arguments': {'pageId': page}}))
    if 'served inside the guest' in snap:
        break
    time.sleep(5)
out['snapshot'] = snap[:2000]
r = rpc('tools/call', {'name': 'take_screenshot', 'arguments': {'pageId': page}})
out['t_screenshot'] = round(time.time() - t, 1)
out['screenshot_text'] = text(r)[:300]
imgs = [c for c in r.get('content', []) if c.get('type') == 'image']
if imgs:
    png = base64.b64decode(imgs[0]['data'])
    out['mime'] = imgs[0].get('mimeType')
    out['png_magic'] = png[:8] == b'\x89PNG\r\n\x1a\n'
    # The top-left pixel (stored raw whatever the first row's filter): the page's background.
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
mcp.stdin.close()
for p in (mcp, browser, web):
    p.kill()
print(json.dumps(out))
"#;

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
    let dir = tempfile::tempdir().expect("tempdir");
    let proj = dir.path().canonicalize().expect("canonical");
    let git = Command::new("git")
        .args(["init", "-q", "-b", "main"])
        .current_dir(&proj)
        .status()
        .expect("git init");
    assert!(git.success());
    let _guard = SessionGuard { env: &env };

    // No --image: the first run creates the session, whose VM gets the agents image; the
    // others start another process in the same VM.
    for cli in AGENT_CLIS {
        let started = std::time::Instant::now();
        let out = warren_run(&env, &proj, &[cli.command, "--", "--version"]);
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
    let commands: Vec<&str> = AGENT_CLIS.iter().map(|c| c.command).collect();
    let script = format!(
        "id -u; for c in {}; do readlink -f \"$(command -v $c)\"; done",
        commands.join(" ")
    );
    let out = warren_run(&env, &proj, &["shell", "--", "sh", "-c", &script]);
    let stdout = ok(out, "warren run shell");
    let mut lines = stdout.lines();
    assert_eq!(lines.next(), Some("1000"), "{stdout}");
    for (cli, line) in AGENT_CLIS.iter().zip(lines) {
        assert_eq!(
            line,
            format!(
                "/usr/local/lib/warren-agents/{}-{}/{}",
                cli.command, cli.version, cli.binary
            ),
            "{stdout}"
        );
    }
    // The browser block: the agents' MCP configuration names the wrapper, which runs the
    // pinned DevTools MCP server on Chromium; gh is there too.
    let out = warren_run(
        &env,
        &proj,
        &[
            "shell",
            "--",
            "sh",
            "-c",
            &format!(
                "cat {} {}; gh --version | head -1; readlink -f /usr/local/bin/chrome-devtools-mcp",
                browser::MCP_CONFIG,
                browser::OPENCODE_CONFIG
            ),
        ],
    );
    let stdout = ok(out, "browser files");
    assert!(stdout.contains(browser::MCP_WRAPPER), "{stdout}");
    assert!(stdout.contains("gh version"), "{stdout}");
    assert!(
        stdout.contains(&format!(
            "/usr/local/lib/warren-agents/chrome-devtools-mcp-{}/{}",
            browser::DEVTOOLS_MCP.version,
            browser::DEVTOOLS_MCP.binary
        )),
        "{stdout}"
    );
    let started = std::time::Instant::now();
    let out = warren_run(
        &env,
        &proj,
        &["shell", "--", "python3", "-c", BROWSER_PROBE],
    );
    let stdout = ok(out, "browser probe");
    let v: serde_json::Value =
        serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout}"));
    eprintln!(
        "DevTools MCP screenshot in the guest: {:.1?} (seconds into the probe: MCP server up \
         {}, browser up {}, page open {}, screenshot {})",
        started.elapsed(),
        v["t_init"],
        v["t_browser"],
        v["t_page"],
        v["t_screenshot"]
    );
    assert_eq!(v["server"]["version"], browser::DEVTOOLS_MCP.version, "{v}");
    assert!(
        v["snapshot"]
            .as_str()
            .is_some_and(|s| s.contains("served inside the guest")),
        "{v}"
    );
    assert_eq!(v["mime"], "image/png", "{v}");
    assert_eq!(v["png_magic"], true, "{v}");
    // The page's background, so the image is of the guest's page.
    assert_eq!(v["pixel"], serde_json::json!([0, 255, 0]), "{v}");

    let list = ok(env.run(&["session", "list", "--json"]), "session list");
    let v: serde_json::Value = serde_json::from_str(&list).expect("json");
    assert_eq!(v.as_array().map(Vec::len), Some(1), "{v}");
}
