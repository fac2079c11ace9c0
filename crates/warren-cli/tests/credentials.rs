//! Every credential kind `warren run` wires, on one real VM (issue 20): provider API keys
//! (from the environment and from a file named in the user's configuration), a GitHub token
//! (from `gh`'s hosts file) used by `git clone`/`git push` over HTTPS through a credential
//! helper against a stand-in git smart-HTTP server that accepts only the real token, opencode's
//! own logins, and a Claude Code login whose host token has expired, refreshed on the host by
//! a stand-in host CLI against a stand-in OAuth server (two concurrent guest refreshes, one
//! host refresh), next to a Codex login whose host CLI cannot refresh (`invalid_grant` naming
//! the fix). A hostile guest's misuses of each placeholder are refused or left unsubstituted;
//! no real value is in the guest's files, environments or command lines, in Warren's records
//! and logs, or in the supervisor's environment and command line.

mod common;
#[path = "../../warren-egress/tests/common/mod.rs"]
mod egress_fixtures;

use std::io::{BufRead, BufReader, Read, Write};
use std::path::Path;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use base64::Engine as _;
use common::TestEnv;

const ANTHROPIC_KEY: &str = "sk-ant-api03-host-only-key-a41c";
const OPENAI_KEY: &str = "sk-proj-host-only-key-77d0";
const GH_TOKEN: &str = "gho_hostOnlyToken0123456789abcdefXY";
const CLAUDE_OLD: &str = "sk-ant-oat01-expired-host-token-1f";
const CLAUDE_NEW: &str = "sk-ant-oat01-rotated-host-token-2e";
const CLAUDE_REFRESH_OLD: &str = "sk-ant-ort01-host-refresh-old-3d";
const CLAUDE_REFRESH_NEW: &str = "sk-ant-ort01-host-refresh-new-4c";
const CODEX_REFRESH: &str = "codex-refresh-host-only-5b";
const OPENCODE_ACCESS: &str = "opencode-anthropic-access-host-6a";
const OPENCODE_REFRESH: &str = "opencode-anthropic-refresh-host-79";
const OPENCODE_OPENAI_KEY: &str = "sk-opencode-openai-host-key-88";

/// The stand-in host CLI: what `claude` does when its token has expired. It posts its
/// refresh token to the (stand-in) OAuth server, then replaces its credential file by rename.
const STANDIN_CLAUDE: &str = r#"#!/usr/bin/env python3
import json, os, time, urllib.request
path = os.path.join(os.environ['HOME'], '.claude', '.credentials.json')
doc = json.load(open(path))
o = doc['claudeAiOauth']
req = urllib.request.Request(os.environ.get('STANDIN_OAUTH', 'OAUTH_URL'),
    data=json.dumps({'grant_type': 'refresh_token', 'refresh_token': o['refreshToken']}).encode(),
    headers={'Content-Type': 'application/json'})
r = json.load(urllib.request.urlopen(req, timeout=20))
o['accessToken'] = r['access_token']
o['refreshToken'] = r['refresh_token']
o['expiresAt'] = int(time.time() * 1000) + r['expires_in'] * 1000
tmp = path + '.tmp'
with open(tmp, 'w') as f:
    json.dump(doc, f)
os.rename(tmp, path)
"#;

/// The guest's side: uses every placeholder the way the agents and tools do, and misuses
/// them the way a hostile guest would. Prints one JSON object.
const PROBES: &str = r#"
import base64, json, os, subprocess, threading, urllib.request
def call(url, headers=None, body=None):
    r = urllib.request.Request(url, data=body, headers=headers or {})
    try:
        return urllib.request.urlopen(r, timeout=120).read().decode()
    except urllib.error.HTTPError as e:
        return 'HTTP %d %s' % (e.code, e.read().decode(errors='replace'))
    except Exception as e:
        return 'ERR ' + str(e)
def git(*args, extra=None):
    e = dict(os.environ, GIT_TERMINAL_PROMPT='0')
    e.update(extra or {})
    p = subprocess.run(['git', '-c', 'user.name=t', '-c', 'user.email=t@example.com'] + list(args),
                       cwd='/tmp', env=e, capture_output=True, text=True, timeout=600)
    return [p.returncode, p.stdout + p.stderr]
def refresh(url, token):
    return call(url, {'Content-Type': 'application/json'},
                json.dumps({'grant_type': 'refresh_token', 'refresh_token': token}).encode())
ak, ok, gh = (os.environ.get(k, '') for k in ('ANTHROPIC_API_KEY', 'OPENAI_API_KEY', 'GH_TOKEN'))
claude = json.load(open('/agent-state/claude/.credentials.json'))['claudeAiOauth']
codex = json.load(open('/agent-state/codex/auth.json'))['tokens']
oc = json.load(open('/agent-state/data/opencode/auth.json'))
basic = base64.b64encode(('x-access-token:' + gh).encode()).decode()
out = {'env': [ak, ok, gh], 'opencode_file': oc, 'claude_file': claude}
out['anthropic_key'] = call('https://api.anthropic.com/v1/messages', {'x-api-key': ak}, b'{}')
out['anthropic_key_elsewhere'] = call('https://api.anthropic.com/v1/models?key=' + ak,
    {'Authorization': 'Bearer ' + ak, 'X-Debug': ak})
out['anthropic_key_to_openai'] = call('https://api.openai.com/v1/models', {'x-api-key': ak})
out['openai_key'] = call('https://api.openai.com/v1/models', {'Authorization': 'Bearer ' + ok})
out['gh_api'] = call('https://api.github.com/user', {'Authorization': 'token ' + gh})
gh_cli = subprocess.run(['gh', 'api', 'user'], capture_output=True, text=True, timeout=300)
out['gh_cli'] = [gh_cli.returncode, gh_cli.stdout + gh_cli.stderr]
out['gh_basic_to_openai'] = call('https://api.openai.com/v1/models', {'Authorization': 'Basic ' + basic})
out['gh_in_query'] = call('https://github.com/owner/repo.git/info/refs?service=git-upload-pack&access_token=' + gh)
out['git_without_helper'] = git('clone', 'https://github.com/owner/repo.git', '/tmp/nohelper', extra={'GIT_CONFIG_COUNT': '0'})
out['git_clone'] = git('clone', 'https://github.com/owner/repo.git', '/tmp/repo')
with open('/tmp/repo/guest.txt', 'w') as f:
    f.write('pushed from the guest\n')
git('-C', '/tmp/repo', 'add', 'guest.txt')
git('-C', '/tmp/repo', 'commit', '-qm', 'guest commit')
out['git_push'] = git('-C', '/tmp/repo', 'push', 'origin', 'HEAD:main')
out['opencode_api'] = call('https://api.anthropic.com/v1/messages',
    {'Authorization': 'Bearer ' + oc['anthropic']['access']}, b'{}')
out['opencode_key'] = call('https://api.openai.com/v1/models', {'Authorization': 'Bearer ' + oc['openai']['key']})
res = {}
def one(url):
    res[url] = refresh(url, claude['refreshToken'])
ts = [threading.Thread(target=one, args=(u,)) for u in
      ('https://platform.claude.com/v1/oauth/token', 'https://console.anthropic.com/v1/oauth/token')]
for t in ts: t.start()
for t in ts: t.join()
out['claude_refreshes'] = list(res.values())
out['claude_api_after'] = call('https://api.anthropic.com/v1/messages',
    {'Authorization': 'Bearer ' + claude['accessToken']}, b'{}')
out['codex_refresh'] = refresh('https://auth.openai.com/oauth/token', codex['refresh_token'])
out['opencode_refresh'] = refresh('https://console.anthropic.com/v1/oauth/token', oc['anthropic']['refresh'])
out['foreign_refresh'] = refresh('https://console.anthropic.com/v1/oauth/token', 'not-a-placeholder')
print(json.dumps(out))
"#;

/// The stand-in OAuth server on the host's loopback: accepts the host's refresh token once
/// (a second use of it is `invalid_grant`, as real servers rotate refresh tokens), answers
/// slowly enough that concurrent refreshes overlap, and counts the refreshes.
fn oauth_server(count: Arc<AtomicU32>) -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr");
    std::thread::spawn(move || {
        for s in l.incoming().flatten() {
            let mut r = BufReader::new(s);
            let mut len = 0usize;
            loop {
                let mut line = String::new();
                if r.read_line(&mut line).unwrap_or(0) == 0 {
                    break;
                }
                if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                    len = v.trim().parse().unwrap_or(0);
                }
                if line == "\r\n" {
                    break;
                }
            }
            let mut body = vec![0u8; len];
            let _ = r.read_exact(&mut body);
            std::thread::sleep(std::time::Duration::from_secs(1));
            let answer = if String::from_utf8_lossy(&body).contains(CLAUDE_REFRESH_OLD)
                && count.fetch_add(1, Ordering::SeqCst) == 0
            {
                serde_json::json!({"access_token": CLAUDE_NEW, "refresh_token": CLAUDE_REFRESH_NEW,
                    "expires_in": 3600, "token_type": "Bearer"})
            } else {
                serde_json::json!({"error": "invalid_grant"})
            };
            let text = answer.to_string();
            let mut s = r.into_inner();
            let _ = write!(
                s,
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{text}",
                text.len()
            );
        }
    });
    format!("http://{addr}/v1/oauth/token")
}

fn b64url(s: &str) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(s)
}

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs()
}

fn write(path: &Path, text: &str) {
    std::fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
    std::fs::write(path, text).expect("write");
}

/// A bare repository `owner/repo.git` under `root` with one commit on `main`.
fn bare_repo(root: &Path) {
    let bare = root.join("owner/repo.git");
    std::fs::create_dir_all(&bare).expect("mkdir");
    common::git(&bare, &["init", "-q", "--bare", "-b", "main"]);
    let (_d, work) = common::one_commit_repo();
    common::git(
        &work,
        &["push", "-q", bare.to_str().expect("utf-8"), "main"],
    );
}

/// A request straight to the git stand-in from the world namespace (not through any egress)
/// with `token` as the Basic password: the stand-in's own verdict.
async fn git_standin_status(topo: &egress_fixtures::Topology, token: &str) -> u16 {
    let tcp = topo
        .world_out
        .tcp_connect(std::net::SocketAddrV4::new(egress_fixtures::GIT, 443))
        .await
        .expect("connect");
    let cfg = egress_fixtures::client_config(&topo.pki.ca_pem).expect("client config");
    let conn = tokio_rustls::TlsConnector::from(Arc::new(cfg));
    let name = rustls::pki_types::ServerName::try_from("github.com").expect("name");
    let mut tls = conn.connect(name, tcp).await.expect("tls");
    let basic = base64::engine::general_purpose::STANDARD.encode(format!("x-access-token:{token}"));
    let req = egress_fixtures::get(
        "github.com",
        "/owner/repo.git/info/refs?service=git-upload-pack",
        &format!("Authorization: Basic {basic}\r\n"),
    );
    egress_fixtures::exchange(&mut tls, &req)
        .await
        .expect("exchange")
        .expect("response")
        .0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 3)]
async fn test_run_wires_keys_github_opencode_and_refreshes_on_host() {
    let started = std::time::Instant::now();
    // The agents image: the one `warren run` gives agents, with gh.
    let image = common::image_id("agents");
    let topo = egress_fixtures::Topology::new("unused")
        .await
        .expect("stand-in world");
    let host = tempfile::tempdir().expect("tempdir");
    let host = host.path();
    let home = host.join("home");
    let config = home.join(".config");
    let t = now();

    // The host user's logins, as the agents and gh write them.
    let claude_file = home.join(".claude/.credentials.json");
    write(
        &claude_file,
        &serde_json::json!({"claudeAiOauth": {"accessToken": CLAUDE_OLD,
            "refreshToken": CLAUDE_REFRESH_OLD, "expiresAt": (t - 30) * 1000,
            "scopes": ["user:inference"], "subscriptionType": "pro"}})
        .to_string(),
    );
    let codex_access = format!(
        "{}.{}.codex-host-signature",
        b64url(r#"{"alg":"none"}"#),
        b64url(&format!(r#"{{"exp":{}}}"#, t - 30))
    );
    write(
        &home.join(".codex/auth.json"),
        &serde_json::json!({"OPENAI_API_KEY": null, "tokens": {"id_token": "e30.e30.sig",
            "access_token": codex_access, "refresh_token": CODEX_REFRESH,
            "account_id": "acct-1"}})
        .to_string(),
    );
    write(
        &home.join(".local/share/opencode/auth.json"),
        &serde_json::json!({
            "anthropic": {"type": "oauth", "access": OPENCODE_ACCESS,
                          "refresh": OPENCODE_REFRESH, "expires": (t + 7200) * 1000},
            "openai": {"type": "api", "key": OPENCODE_OPENAI_KEY}})
        .to_string(),
    );
    write(
        &config.join("gh/hosts.yml"),
        &format!(
            "github.com:\n    oauth_token: {GH_TOKEN}\n    user: octo\n    git_protocol: https\n"
        ),
    );
    let openai_key_file = host.join("keys/openai");
    write(&openai_key_file, &format!("{OPENAI_KEY}\n"));
    // The stand-in host CLI and Warren's user configuration naming it.
    let refreshes = Arc::new(AtomicU32::new(0));
    let oauth = oauth_server(refreshes.clone());
    let cli = host.join("bin/standin-claude");
    write(&cli, &STANDIN_CLAUDE.replace("OAUTH_URL", &oauth));
    std::fs::set_permissions(&cli, std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .expect("chmod");
    write(
        &config.join("warren/config.toml"),
        &format!(
            "[credentials]\nopenai_api_key_file = \"{}\"\n[refresh]\nclaude = [\"{}\"]\n\
             codex = [\"/bin/false\"]\n",
            openai_key_file.display(),
            cli.display()
        ),
    );
    // The stand-in git host, which accepts only the real token.
    let git_root = host.join("git");
    bare_repo(&git_root);
    let git_seen = topo
        .serve_git(git_root.clone(), GH_TOKEN.to_string())
        .expect("git stand-in");
    let roots = host.join("roots.pem");
    write(&roots, &topo.pki.ca_pem);
    let egress = host.join("egress.toml");
    write(
        &egress,
        &format!(
            "upstream_dns = \"{}:53\"\noutbound_netns = \"{}\"\nupstream_roots = \"{}\"\n",
            egress_fixtures::DNS,
            topo.world.path().display(),
            roots.display()
        ),
    );
    let project = host.join("project");
    std::fs::create_dir(&project).expect("mkdir");
    common::git(&project, &["init", "-q"]);

    let env = TestEnv::new();
    let run = |args: &[&str]| {
        let mut c = env.cmd();
        c.arg("run")
            .args(args)
            .current_dir(&project)
            .env("HOME", &home)
            .env("XDG_CONFIG_HOME", &config)
            .env("ANTHROPIC_API_KEY", ANTHROPIC_KEY)
            .stdin(std::process::Stdio::null());
        for v in [
            "CLAUDE_CONFIG_DIR",
            "CODEX_HOME",
            "XDG_DATA_HOME",
            "WARREN_CONFIG",
            "GH_CONFIG_DIR",
            "GH_TOKEN",
            "GITHUB_TOKEN",
            "OPENAI_API_KEY",
        ] {
            c.env_remove(v);
        }
        c.output().expect("warren run")
    };
    let mut wired = vec!["--image", image.as_str(), "--egress"];
    let egress_arg = egress.to_str().expect("utf-8").to_string();
    wired.push(&egress_arg);
    for c in [
        "claude",
        "codex",
        "opencode",
        "anthropic-api-key",
        "openai-api-key",
        "github-token",
    ] {
        wired.extend(["--credentials", c]);
    }
    // The host's side of git: the stand-in refuses the placeholder and takes the real token.
    let placeholder = "gho_WarrenPlaceholderGitHubTokenxxxxxx01";
    assert_eq!(git_standin_status(&topo, placeholder).await, 401);
    assert_eq!(git_standin_status(&topo, GH_TOKEN).await, 200);

    let mut args = wired.clone();
    args.extend(["shell", "--", "python3", "-c", PROBES]);
    let probes_started = std::time::Instant::now();
    let out = run(&args);
    eprintln!(
        "probes: {:.1?} (test so far {:.1?})",
        probes_started.elapsed(),
        started.elapsed()
    );
    assert!(
        out.status.success(),
        "run: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)));
    let text = |k: &str| v[k].as_str().unwrap_or_default().to_string();

    // 1. API keys: placeholders of the keys' shapes in the environment; the real key only in
    // the provider's header, on the provider's host.
    let ph = |i: usize| v["env"][i].as_str().unwrap_or_default().to_string();
    let (ak, ok) = (ph(0), ph(1));
    assert!(ak.starts_with("sk-ant-api03-") && ak.len() == 108, "{ak}");
    assert!(ok.starts_with("sk-proj-") && ok.len() == 164, "{ok}");
    assert_eq!(ph(2), placeholder);
    assert!(
        text("anthropic_key")
            .to_ascii_lowercase()
            .contains(&format!("x-api-key: {ANTHROPIC_KEY}")),
        "{v}"
    );
    let elsewhere = text("anthropic_key_elsewhere");
    assert!(!elsewhere.contains(ANTHROPIC_KEY), "{elsewhere}");
    for sent in [
        format!("/v1/models?key={ak} "),
        format!("Authorization: Bearer {ak}"),
        format!("X-Debug: {ak}"),
    ] {
        assert!(elsewhere.contains(&sent), "{sent}: {elsewhere}");
    }
    assert!(
        text("anthropic_key_to_openai").starts_with("HTTP 403"),
        "{v}"
    );
    assert!(
        text("openai_key").contains(&format!("Authorization: Bearer {OPENAI_KEY}")),
        "{v}"
    );
    // 2. GitHub: gh's API form, git's Basic form, the placeholder refused elsewhere and left
    // alone in a query string.
    assert!(
        text("gh_api").contains(&format!("Authorization: token {GH_TOKEN}")),
        "{v}"
    );
    // The GitHub CLI in the image, with the placeholder in its environment.
    assert_eq!(v["gh_cli"][0], 0, "{v}");
    assert!(
        v["gh_cli"][1]
            .as_str()
            .is_some_and(|o| o.contains(&format!("Authorization: token {GH_TOKEN}"))),
        "{v}"
    );
    assert!(text("gh_basic_to_openai").starts_with("HTTP 403"), "{v}");
    assert!(text("gh_in_query").starts_with("HTTP 401"), "{v}");
    let status = |k: &str| v[k][0].as_i64().unwrap_or(-1);
    assert_ne!(
        status("git_without_helper"),
        0,
        "{}",
        v["git_without_helper"]
    );
    assert_eq!(status("git_clone"), 0, "{}", v["git_clone"]);
    assert_eq!(status("git_push"), 0, "{}", v["git_push"]);
    let pushed = common::git(
        &git_root.join("owner/repo.git"),
        &["log", "-1", "--format=%s", "main"],
    );
    assert_eq!(pushed.trim(), "guest commit");
    let seen = git_seen.lock().unwrap_or_else(|p| p.into_inner()).clone();
    assert!(
        seen.iter()
            .any(|(line, ok)| *ok && line.starts_with("POST /owner/repo.git/git-receive-pack")),
        "{seen:?}"
    );
    let query = seen
        .iter()
        .find(|(line, _)| line.contains("access_token="))
        .expect("query probe reached the stand-in");
    assert!(
        query.0.contains(placeholder) && !query.0.contains(GH_TOKEN) && !query.1,
        "{query:?}"
    );
    // 3. opencode's logins: its file shaped with placeholders, its tokens substituted.
    assert_eq!(
        v["opencode_file"]["anthropic"]["access"],
        "warren-placeholder-opencode-anthropic-access-v1"
    );
    assert!(
        text("opencode_api").contains(&format!("Authorization: Bearer {OPENCODE_ACCESS}")),
        "{v}"
    );
    assert!(
        text("opencode_key").contains(&format!("Authorization: Bearer {OPENCODE_OPENAI_KEY}")),
        "{v}"
    );
    let oc: serde_json::Value =
        serde_json::from_str(&text("opencode_refresh")).unwrap_or_else(|e| panic!("{e}: {v}"));
    assert_eq!(
        oc["access_token"],
        "warren-placeholder-opencode-anthropic-access-v1"
    );
    // 4. Refresh on the host: both concurrent refreshes answered with placeholders and the
    // new lifetime, after exactly one host refresh; the next API call carries the new token.
    for r in v["claude_refreshes"].as_array().expect("two refreshes") {
        let r: serde_json::Value = serde_json::from_str(r.as_str().unwrap_or_default())
            .unwrap_or_else(|e| panic!("{e}: {r}"));
        assert_eq!(r["access_token"], "warren-placeholder-anthropic-access-v1");
        let left = r["expires_in"].as_i64().expect("expires_in");
        assert!((3000..=3600).contains(&left), "{r}");
    }
    assert_eq!(refreshes.load(Ordering::SeqCst), 1, "host refreshes");
    assert!(
        text("claude_api_after").contains(&format!("Authorization: Bearer {CLAUDE_NEW}")),
        "{v}"
    );
    let rotated = std::fs::read_to_string(&claude_file).expect("read");
    assert!(rotated.contains(CLAUDE_REFRESH_NEW), "{rotated}");
    let codex = text("codex_refresh");
    assert!(
        codex.starts_with("HTTP 401")
            && codex.contains("invalid_grant")
            && codex.contains("run `codex`"),
        "{codex}"
    );
    assert!(text("foreign_refresh").starts_with("HTTP 400"), "{v}");

    // No real value in the guest: files, environments, command lines.
    let reals = [
        ANTHROPIC_KEY,
        OPENAI_KEY,
        GH_TOKEN,
        CLAUDE_OLD,
        CLAUDE_NEW,
        CLAUDE_REFRESH_OLD,
        CLAUDE_REFRESH_NEW,
        CODEX_REFRESH,
        "codex-host-signature",
        OPENCODE_ACCESS,
        OPENCODE_REFRESH,
        OPENCODE_OPENAI_KEY,
    ];
    let mut pat = String::new();
    for r in reals {
        let (a, b) = r.split_at(6);
        pat.push_str(&format!("{a} {b} "));
    }
    let out = run(&[
        "--no-credentials",
        "shell",
        "--",
        "sh",
        "-c",
        &format!(
            "printf '%s%s\\n' {pat} > /var/tmp/pat; grep -rlsF -f /var/tmp/pat /agent-state /etc \
             /home /tmp /root /workspace /proc/[0-9]*/environ /proc/[0-9]*/cmdline 2>/dev/null | wc -l; \
             printf '%s%s\\n' warren-placeholder-opencode- anthropic-access-v1 > /var/tmp/ctl; \
             grep -rlsF -f /var/tmp/ctl /agent-state | wc -l"
        ),
    ]);
    let counts = String::from_utf8_lossy(&out.stdout).into_owned();
    let counts: Vec<&str> = counts.split_whitespace().collect();
    // Positive control: the same search finds a placeholder in the agent state.
    assert_eq!(counts.len(), 2, "{counts:?}");
    assert_ne!(counts[1], "0", "the search finds nothing at all");
    assert_eq!(
        counts[0],
        "0",
        "a real value is in the guest: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Nor in what Warren keeps for the VM (records, logs, console), except the private
    // copies of values taken from the environment and gh's hosts file.
    let store = env.state.path().join("credentials");
    let mut leaks = Vec::new();
    let mut stack = vec![env.state.path().to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            let Ok(m) = std::fs::symlink_metadata(&p) else {
                continue;
            };
            if m.is_dir() && p != store {
                stack.push(p);
            } else if m.is_file() && !p.to_string_lossy().ends_with(".qcow2") {
                let bytes = std::fs::read(&p).unwrap_or_default();
                let text = String::from_utf8_lossy(&bytes);
                if reals.iter().any(|r| text.contains(r)) {
                    leaks.push(p);
                }
            }
        }
    }
    assert!(leaks.is_empty(), "real values in Warren's state: {leaks:?}");
    let me = format!("local-{}", nix::unistd::geteuid().as_raw());
    for (name, value) in [
        ("anthropic-api-key", ANTHROPIC_KEY),
        ("github-token", GH_TOKEN),
    ] {
        let f = store.join(&me).join(name);
        assert_eq!(
            std::fs::read_to_string(&f).expect(name),
            format!("{value}\n")
        );
        let mode = std::os::unix::fs::PermissionsExt::mode(
            &std::fs::metadata(&f).expect("meta").permissions(),
        );
        assert_eq!(mode & 0o777, 0o600, "{name}");
    }
    assert!(
        !store.join(&me).join("openai-api-key").exists(),
        "config files are used in place"
    );
    // Nor in the supervisor's or QEMU's environment or command line.
    let state = env.state.path().to_string_lossy().into_owned();
    let pids = common::pids_matching(&state);
    assert!(!pids.is_empty(), "no supervisor found");
    for pid in pids {
        for f in ["environ", "cmdline"] {
            let bytes = std::fs::read(format!("/proc/{pid}/{f}")).unwrap_or_default();
            let text = String::from_utf8_lossy(&bytes);
            assert!(
                !reals.iter().any(|r| text.contains(r)),
                "a real value in /proc/{pid}/{f}"
            );
        }
    }

    let list = common::ok(env.run(&["session", "list", "--json"]), "list");
    let sessions: serde_json::Value = serde_json::from_str(&list).expect("json");
    common::ok(
        env.run(&[
            "session",
            "delete",
            sessions[0]["name"].as_str().expect("name"),
            "--force",
        ]),
        "delete",
    );
    drop(topo);
    eprintln!(
        "test_run_wires_keys_github_opencode_and_refreshes_on_host: {:.1?}",
        started.elapsed()
    );
}
