//! Guest networking on real VMs: no NIC by default; with `--network`, a NIC in the VM's own
//! namespace whose traffic all ends at Warren's egress. Stand-in external hosts live in a
//! remote namespace created by the test (the egress crate's fixtures); the egress connects out
//! from the fixtures' world namespace, routed to them, and asks their DNS server, so no packet
//! leaves this machine.

mod common;
#[path = "../../warren-egress/tests/common/mod.rs"]
mod egress_fixtures;

use std::process::Command;
use std::time::Duration;

use common::{ensure_image, TestEnv, TestVm};

const PLACEHOLDER: &str = "WARREN_PLACEHOLDER_api_0123456789";
const REAL: &str = "real-token-5f1e9c";
const ROTATED: &str = "rotated-token-77ab2";
const JSON_PLACEHOLDER: &str = "WARREN_PLACEHOLDER_json_9876543210";
const JSON_REAL: &str = "json-held-token-c0ffee";

/// The interception rule's host command: answers with its uid and the request body.
const INTERCEPT_SCRIPT: &str =
    "req=$(cat); body=\"intercepted uid=$(id -u) ${req##*$(printf '\\r\\n\\r')}\"; \
     printf 'HTTP/1.1 200 OK\\r\\ncontent-length: %d\\r\\n\\r\\n%s' \"${#body}\" \"$body\"";

/// Probes run by one guest Python process (TCG makes every interpreter start cost ~0.5 s).
/// Prints one `name=result` line per probe.
const PROBES: &str = r#"
import socket, ssl, json
def tls(ip, sni):
    try:
        ctx = ssl._create_unverified_context()
        s = socket.create_connection((ip, 443), timeout=10)
        t = ctx.wrap_socket(s, server_hostname=sni)
        t.sendall(b'GET / HTTP/1.1\r\nHost: ' + sni.encode() + b'\r\n\r\n')
        return 'open:' + t.recv(64).decode(errors='replace')[:12]
    except Exception as e:
        return 'refused'
def http(ip, host):
    try:
        s = socket.create_connection((ip, 80), timeout=10)
        s.sendall(b'GET / HTTP/1.1\r\nHost: ' + host.encode() + b'\r\nConnection: close\r\n\r\n')
        s.settimeout(10)
        d = s.recv(64)
        return 'open:' + d.decode(errors='replace')[:12] if d else 'refused'
    except Exception as e:
        return 'refused'
def https(path, headers, body=None):
    import urllib.request
    r = urllib.request.Request('https://' + path, data=body, headers=headers)
    try:
        return urllib.request.urlopen(r, timeout=20).read().decode()
    except Exception as e:
        return 'ERR ' + str(e)
def dns_query(server, name):
    q = b'\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00'
    for label in name.split('.'):
        q += bytes([len(label)]) + label.encode()
    q += b'\x00\x00\x01\x00\x01'
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(5)
    s.sendto(q, (server, 53))
    try:
        d = s.recv(512)
    except Exception:
        return 'no-answer'
    return 'rcode=%d answers=%d' % (d[3] & 15, int.from_bytes(d[6:8], 'big'))
socket.gethostbyname('api.allowed.test')
print('sni_mismatch=' + tls('203.0.113.11', 'api.allowed.test'))
print('host_mismatch=' + http('203.0.113.11', 'api.allowed.test'))
print('shared_tls=' + tls('203.0.113.10', 'shared.denied.test'))
print('shared_http=' + http('203.0.113.10', 'shared.denied.test'))
print('tls_ok=' + tls('203.0.113.10', 'api.allowed.test'))
print('http_ok=' + http('203.0.113.10', 'api.allowed.test'))
print('private=' + http('10.1.2.3', 'private.allowed.test'))
try:
    print('private_dns=' + socket.gethostbyname('private.allowed.test'))
except Exception:
    print('private_dns=refused')
print('foreign_dns_other=' + dns_query('203.0.113.53', 'other.test'))
print('foreign_dns_allowed=' + dns_query('203.0.113.53', 'api.allowed.test'))
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for _ in range(5):
    u.sendto(b'WARREN-UDP-PROBE', ('203.0.113.10', 9999))
print('udp=sent')
print('body=' + json.dumps(https('secret.allowed.test/echo', {'Authorization': 'Bearer PH'}, b'token=PH')))
print('json=' + json.dumps(https('secret.allowed.test/echo', {'Authorization': 'Bearer JPH'})))
print('intercept=' + json.dumps(https('oauth.allowed.test/oauth/token', {'Content-Type': 'application/x-www-form-urlencoded'}, b'grant_type=refresh_token&refresh_token=JPH')))
"#;

fn netns_exists(name: &str) -> bool {
    let out = Command::new("ip")
        .args(["netns", "list"])
        .output()
        .expect("ip netns list");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .any(|l| l.split_whitespace().next() == Some(name))
}

fn ok(out: std::process::Output, what: &str) {
    assert!(
        out.status.success(),
        "{what}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Files under `dir` (recursively, symlinks not followed) that contain any of `needles`;
/// guest disk images and memory files are skipped.
fn files_containing(dir: &std::path::Path, needles: &[&str]) -> Vec<std::path::PathBuf> {
    let mut found = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let path = e.path();
            let Ok(meta) = std::fs::symlink_metadata(&path) else {
                continue;
            };
            let name = e.file_name().to_string_lossy().into_owned();
            if meta.is_dir() {
                stack.push(path);
            } else if meta.is_file()
                && !name.ends_with(".qcow2")
                && !name.ends_with(".ram")
                && !name.ends_with(".cpio")
            {
                let Ok(bytes) = std::fs::read(&path) else {
                    continue;
                };
                let text = String::from_utf8_lossy(&bytes);
                if needles.iter().any(|n| text.contains(n)) {
                    found.push(path);
                }
            }
        }
    }
    found
}

/// Python in the guest: fetches `url` with optional headers; prints the body or `ERR <e>`.
fn fetch(vm: &TestVm, url: &str, header: Option<(&str, &str)>) -> String {
    let hdr = header
        .map(|(k, v)| format!("r.add_header({k:?}, {v:?})"))
        .unwrap_or_default();
    let script = format!(
        "import urllib.request\n\
         r = urllib.request.Request({url:?})\n\
         {hdr}\n\
         try:\n    print(urllib.request.urlopen(r, timeout=20).read().decode())\n\
         except Exception as e:\n    print('ERR', e)\n"
    );
    let r = vm.exec_args(&[], &["python3", "-c", &script]);
    format!("{}{}", r.stdout, r.stderr)
}

#[test]
fn test_network_off_by_default_no_nic() {
    let vm = TestVm::boot();
    let r = vm.sh("ls /sys/class/net");
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(r.stdout.split_whitespace().collect::<Vec<_>>(), ["lo"]);
    let rec = vm.env.record(&vm.id).expect("listed");
    assert_eq!(rec["network"], "off", "{rec}");
    assert!(!netns_exists(&format!("warren-{}", vm.id)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 3)]
async fn test_network_egress_policy_secrets_and_teardown() {
    ensure_image("dev");
    let topo = egress_fixtures::Topology::new("unused")
        .await
        .expect("stand-in world");
    let host = tempfile::tempdir().expect("tempdir");
    let token = host.path().join("token");
    std::fs::write(&token, format!("{REAL}\n")).expect("token");
    let creds = host.path().join("credentials.json");
    std::fs::write(
        &creds,
        format!(r#"{{"claudeAiOauth":{{"accessToken":"{JSON_REAL}","expiresAt":1}}}}"#),
    )
    .expect("creds");
    let roots = host.path().join("roots.pem");
    std::fs::write(&roots, &topo.pki.ca_pem).expect("roots");
    let egress = host.path().join("egress.toml");
    std::fs::write(
        &egress,
        format!(
            "allow = [\"api.allowed.test\", \"secret.allowed.test\", \"meta.allowed.test\", \
                       \"private.allowed.test\", \"oauth.allowed.test\"]\n\
             upstream_dns = \"{}:53\"\n\
             outbound_netns = \"{}\"\n\
             upstream_roots = \"{}\"\n\
             [[secrets]]\n\
             name = \"api\"\n\
             placeholder = \"{PLACEHOLDER}\"\n\
             hosts = [\"secret.allowed.test\"]\n\
             file = \"{}\"\n\
             [[secrets]]\n\
             name = \"json\"\n\
             placeholder = \"{JSON_PLACEHOLDER}\"\n\
             hosts = [\"secret.allowed.test\"]\n\
             file = \"{}\"\n\
             json_pointer = \"/claudeAiOauth/accessToken\"\n\
             [[intercepts]]\n\
             host = \"oauth.allowed.test\"\n\
             method = \"POST\"\n\
             path_prefix = \"/oauth/token\"\n\
             command = [\"/bin/sh\", \"-c\", {:?}]\n\
             uid = 65534\n\
             gid = 65534\n\
             timeout_secs = 10\n",
            egress_fixtures::DNS,
            topo.world.path().display(),
            roots.display(),
            token.display(),
            creds.display(),
            INTERCEPT_SCRIPT,
        ),
    )
    .expect("egress file");

    let env = TestEnv::new();
    let id = env.create_vm_with("dev", &["--egress", egress.to_str().expect("utf-8")]);
    let vm = TestVm::adopt(env, id);
    let ns = format!("warren-{}", vm.id);
    assert!(netns_exists(&ns), "the VM's namespace exists while it runs");
    let rec = vm.env.record(&vm.id).expect("listed");
    assert_eq!(
        rec["network"]["secrets"],
        serde_json::json!(["api", "json"]),
        "{rec}"
    );
    assert_eq!(
        rec["network"]["intercepts"],
        serde_json::json!(["POST oauth.allowed.test /oauth/token"])
    );

    // Guest side: one NIC with the /30 address, IPv6 off, resolver set.
    let r = vm.sh(
        "ls /sys/class/net; cat /proc/sys/net/ipv6/conf/all/disable_ipv6; \
         cat /etc/resolv.conf; cat /proc/net/if_inet6 2>/dev/null | grep -v ' lo$' | wc -l",
    );
    assert_eq!(r.code, 0, "{}", r.stderr);
    let words: Vec<&str> = r.stdout.split_whitespace().collect();
    assert!(words.contains(&"eth0"), "{}", r.stdout);
    assert!(r.stdout.contains("\n1\n"), "IPv6 disabled: {}", r.stdout);
    assert!(r.stdout.contains("nameserver 10.255.0.1"), "{}", r.stdout);
    assert_eq!(words.last(), Some(&"0"), "no IPv6 address: {}", r.stdout);

    // Allowed name reachable by name over HTTP.
    let body = fetch(&vm, "http://api.allowed.test/hello", None);
    assert!(body.contains("GET /hello"), "allowed: {body}");
    // Disallowed name: DNS refused, and so the connection.
    let body = fetch(&vm, "http://other.test/", None);
    assert!(body.starts_with("ERR"), "disallowed: {body}");
    let r = vm.exec_args(
        &[],
        &[
            "python3",
            "-c",
            "import socket; print(socket.gethostbyname('other.test'))",
        ],
    );
    assert_ne!(
        r.code, 0,
        "DNS for a disallowed name answered: {}",
        r.stdout
    );
    // Direct IP of a stand-in (never resolved for an allowed name) refused.
    let body = fetch(&vm, "http://203.0.113.11/", None);
    assert!(body.starts_with("ERR"), "direct IP: {body}");
    // Metadata refused, by address and through an allowed name resolving to it.
    let body = fetch(&vm, "http://169.254.169.254/latest/meta-data/", None);
    assert!(body.starts_with("ERR"), "metadata: {body}");
    let body = fetch(&vm, "http://meta.allowed.test/", None);
    assert!(body.starts_with("ERR"), "metadata by name: {body}");
    // Inbound: a guest listener is unreachable from the host namespace (on machines whose
    // outside network accepts any connection, a connect may succeed, but never reaches the
    // guest: no marker arrives).
    vm.detach(
        "python3 -c \"import socket; s=socket.socket(); s.bind(('0.0.0.0', 8080)); s.listen(); \
         open('/tmp/listening', 'w').close(); c, _ = s.accept(); c.sendall(b'GUEST-MARKER')\"",
    );
    common::wait_until("guest listener", 30, || {
        vm.sh("test -e /tmp/listening").code == 0
    });
    let reached = std::net::TcpStream::connect_timeout(
        &"10.255.0.2:8080".parse().expect("addr"),
        Duration::from_secs(2),
    )
    .ok()
    .and_then(|mut s| {
        use std::io::Read;
        s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
        let mut buf = Vec::new();
        let _ = s.read_to_end(&mut buf);
        Some(String::from_utf8_lossy(&buf).into_owned())
    })
    .unwrap_or_default();
    assert!(!reached.contains("GUEST-MARKER"), "host reached the guest");

    // Placeholder substituted for its host over HTTPS (the guest trusts the Warren CA through
    // SSL_CERT_FILE); refused for another host.
    let auth = format!("Bearer {PLACEHOLDER}");
    let body = fetch(
        &vm,
        "https://secret.allowed.test/echo",
        Some(("Authorization", &auth)),
    );
    assert!(body.contains(REAL), "substituted: {body}");
    assert!(!body.contains(PLACEHOLDER), "placeholder left: {body}");
    let body = fetch(
        &vm,
        "http://api.allowed.test/echo",
        Some(("Authorization", &auth)),
    );
    assert!(
        body.contains("403") && !body.contains(REAL),
        "other host: {body}"
    );
    // Rotation: the next connection uses the new value.
    std::fs::write(&token, format!("{ROTATED}\n")).expect("rotate");
    let body = fetch(
        &vm,
        "https://secret.allowed.test/echo",
        Some(("Authorization", &auth)),
    );
    assert!(body.contains(ROTATED), "rotated: {body}");

    // Mismatches, shared addresses, private ranges, foreign DNS, UDP, bodies, JSON-held
    // secrets and an interception rule, from one guest process.
    let udp = warren_egress::bind_udp_in(
        &topo.remote.path(),
        "203.0.113.10:9999".parse().expect("addr"),
    )
    .expect("world UDP listener");
    udp.set_nonblocking(true).expect("nonblocking");
    let probes = PROBES
        .replace("JPH", JSON_PLACEHOLDER)
        .replace("PH", PLACEHOLDER);
    let r = vm.exec_args(&[], &["python3", "-c", &probes]);
    assert_eq!(r.code, 0, "probes: {}{}", r.stdout, r.stderr);
    let result = |name: &str| -> String {
        r.stdout
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{name}=")))
            .unwrap_or_else(|| panic!("probe {name} missing: {}", r.stdout))
            .to_string()
    };
    for refused in [
        "sni_mismatch",
        "host_mismatch",
        "shared_tls",
        "shared_http",
        "private",
        "private_dns",
    ] {
        assert_eq!(result(refused), "refused", "{refused}: {}", r.stdout);
    }
    // The same probes do connect where policy allows (the refusals above are the policy's).
    assert!(
        result("tls_ok").starts_with("open:HTTP/1.1"),
        "{}",
        r.stdout
    );
    assert!(
        result("http_ok").starts_with("open:HTTP/1.1"),
        "{}",
        r.stdout
    );
    // A foreign resolver's address still reaches Warren's resolver only: a disallowed name
    // gets no address, an allowed one does.
    let other = result("foreign_dns_other");
    assert!(other.ends_with("answers=0"), "foreign DNS: {other}");
    assert_eq!(result("foreign_dns_allowed"), "rcode=0 answers=1");
    let mut buf = [0u8; 64];
    assert!(
        udp.recv_from(&mut buf).is_err(),
        "a guest UDP datagram reached the world"
    );
    let decode = |s: String| -> String { serde_json::from_str(&s).expect("probe JSON") };
    // Placeholder in the header substituted; in the body left alone.
    let echoed = decode(result("body"));
    assert!(
        echoed.contains(&format!("Bearer {REAL}")) || echoed.contains(&format!("Bearer {ROTATED}")),
        "header substituted: {echoed}"
    );
    assert!(
        echoed.contains(&format!("token={PLACEHOLDER}")),
        "body untouched: {echoed}"
    );
    let echoed = decode(result("json"));
    assert!(
        echoed.contains(&format!("Bearer {JSON_REAL}")),
        "JSON-held secret: {echoed}"
    );
    // The rule's command answered (as uid 65534, with the guest's body); no upstream exists.
    let answered = decode(result("intercept"));
    let refresh = format!("grant_type=refresh_token&refresh_token={JSON_PLACEHOLDER}");
    assert_eq!(
        answered.split_whitespace().collect::<Vec<_>>(),
        ["intercepted", "uid=65534", refresh.as_str()]
    );

    // Nothing in the guest knows the real values.
    // (The patterns are assembled from halves in a file outside the searched trees, so no
    // command line carries a whole value.)
    let (a, b) = REAL.split_at(5);
    let (c, d) = ROTATED.split_at(5);
    let (e, f) = JSON_REAL.split_at(5);
    let r = vm.sh(&format!(
        "env | grep -c SSL_CERT_FILE; printf '%s%s\\n%s%s\\n%s%s\\n' {a} {b} {c} {d} {e} {f} > /var/tmp/pat; \
         grep -rlsF -f /var/tmp/pat /etc /home /tmp /workspace /root /proc/[0-9]*/environ \
         /proc/[0-9]*/cmdline 2>/dev/null | wc -l"
    ));
    let lines: Vec<&str> = r.stdout.lines().collect();
    assert_eq!(lines.first(), Some(&"1"), "CA env: {}", r.stdout);
    assert_eq!(
        lines.last(),
        Some(&"0"),
        "secret found in guest: {}",
        r.stdout
    );

    // Figures for the report (printed, not asserted): new-connection HTTP latency and bulk
    // throughput guest -> stand-in host through the proxy.
    let r = vm.exec_args(
        &[],
        &[
            "python3",
            "-c",
            "import time, urllib.request as u\n\
             t = time.time()\n\
             for _ in range(20): u.urlopen('http://api.allowed.test/x').read()\n\
             lat = (time.time() - t) / 20\n\
             t = time.time(); n = len(u.urlopen('http://api.allowed.test/bytes/8388608').read())\n\
             print(f'connection+request {lat*1000:.1f} ms, {n/(time.time()-t)/1e6:.1f} MB/s')",
        ],
    );
    eprintln!(
        "network figures (TCG guest): {} {}",
        r.stdout.trim(),
        r.stderr.trim()
    );

    // Pause keeps the namespace (the egress keeps serving the frozen guest's connections).
    ok(
        vm.warren(&["vm", "suspend", &vm.id, "--mode", "pause", "--force"]),
        "pause",
    );
    assert_eq!(vm.state(), "paused");
    assert!(netns_exists(&ns), "namespace removed by a pause");
    ok(vm.warren(&["vm", "resume", &vm.id]), "resume from pause");
    // No real value in anything Warren keeps on the host for this VM: database, records,
    // logs, console (the guest's disk and memory are searched from inside, above).
    let leaks = files_containing(vm.env.state.path(), &[REAL, ROTATED, JSON_REAL]);
    assert!(leaks.is_empty(), "real secret in host state: {leaks:?}");
    assert!(
        !files_containing(vm.env.state.path(), &[PLACEHOLDER]).is_empty(),
        "the search reads the VM's records (its placeholder is recorded there)"
    );

    // Hibernate removes the namespace; resume rebuilds it and the network works again.
    ok(
        vm.warren(&["vm", "suspend", &vm.id, "--mode", "hibernate", "--force"]),
        "hibernate",
    );
    assert_eq!(vm.state(), "hibernated");
    assert!(!netns_exists(&ns), "namespace left after hibernate");
    ok(vm.warren(&["vm", "resume", &vm.id]), "resume");
    assert!(netns_exists(&ns));
    let body = fetch(
        &vm,
        "https://secret.allowed.test/again",
        Some(("Authorization", &auth)),
    );
    assert!(body.contains(ROTATED), "after resume: {body}");
    // A supervisor that dies without cleaning up (SIGKILL) leaves its namespace; the next
    // listing reconciles the VM to failed and sweeps it.
    let mut vm = vm;
    vm.expect_failure = true;
    let pid = vm.supervisor_pid();
    Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()
        .expect("kill");
    common::wait_until("supervisor gone", 10, || {
        !std::path::Path::new(&format!("/proc/{pid}")).exists()
    });
    assert!(
        netns_exists(&ns),
        "the crash left the namespace (as a real one would)"
    );
    assert_eq!(vm.state(), "failed");
    assert!(!netns_exists(&ns), "stale namespace not swept");
    vm.destroy();
    assert!(!netns_exists(&ns), "namespace left after destroy");
    drop(topo);
}

const CLAUDE_REAL: &str = "sk-ant-oat01-host-only-4d2c";
const CLAUDE_REFRESH_REAL: &str = "sk-ant-ort01-host-only-9e1a";
const CODEX_REFRESH_REAL: &str = "codex-refresh-host-only-51b7";

/// Guest side of the credential wiring test: reads the placeholder files Warren wrote into
/// the agent state directory and uses them the way the agents do.
const AGENT_PROBES: &str = r#"
import json, urllib.request
def call(url, token, body=None):
    h = {'Authorization': 'Bearer ' + token} if token else {'Content-Type': 'application/json'}
    r = urllib.request.Request(url, data=body, headers=h)
    try:
        return urllib.request.urlopen(r, timeout=20).read().decode()
    except urllib.error.HTTPError as e:
        return 'HTTP %d' % e.code
    except Exception as e:
        return 'ERR ' + str(e)
claude = json.load(open('/agent-state/claude/.credentials.json'))['claudeAiOauth']
codex = json.load(open('/agent-state/codex/auth.json'))['tokens']
print(json.dumps({
  'claude_file': claude,
  'codex_file': codex,
  'claude_api': call('https://api.anthropic.com/echo', claude['accessToken']),
  'claude_refresh': call('https://platform.claude.com/v1/oauth/token', None,
      json.dumps({'grant_type': 'refresh_token', 'refresh_token': claude['refreshToken']}).encode()),
  'codex_api': call('https://api.openai.com/echo', codex['access_token']),
  'codex_refresh': call('https://auth.openai.com/oauth/token', None,
      json.dumps({'grant_type': 'refresh_token', 'refresh_token': codex['refresh_token']}).encode()),
  'claude_token_to_openai': call('https://api.openai.com/echo', claude['accessToken']),
}))
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 3)]
async fn test_run_wires_agent_credentials_real_tokens_stay_on_host() {
    use base64::Engine;
    ensure_image("dev");
    let topo = egress_fixtures::Topology::new("unused")
        .await
        .expect("stand-in world");
    let host = tempfile::tempdir().expect("tempdir");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs();
    // The host user's own credential files (as Claude Code and Codex write them).
    let home = host.path().join("home");
    std::fs::create_dir_all(home.join(".claude")).expect("mkdir");
    std::fs::create_dir_all(home.join(".codex")).expect("mkdir");
    let claude_file = home.join(".claude/.credentials.json");
    let claude_doc = serde_json::json!({"claudeAiOauth": {
        "accessToken": CLAUDE_REAL, "refreshToken": CLAUDE_REFRESH_REAL,
        "expiresAt": (now + 3600) * 1000, "scopes": ["user:inference"],
        "subscriptionType": "pro"}});
    std::fs::write(&claude_file, claude_doc.to_string()).expect("claude creds");
    let b64 = |s: &str| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(s);
    let codex_access = format!(
        "{}.{}.host-only-signature",
        b64(r#"{"alg":"none"}"#),
        b64(&format!(r#"{{"exp":{}}}"#, now + 7200))
    );
    let codex_file = home.join(".codex/auth.json");
    let codex_doc = serde_json::json!({"OPENAI_API_KEY": null, "tokens": {
        "id_token": format!("{}.{}.id-signature", b64("{}"), b64(r#"{"email":"u@example.com"}"#)),
        "access_token": codex_access, "refresh_token": CODEX_REFRESH_REAL,
        "account_id": "acct-1"}, "last_refresh": "2026-11-30T00:00:00Z"});
    std::fs::write(&codex_file, codex_doc.to_string()).expect("codex creds");
    let roots = host.path().join("roots.pem");
    std::fs::write(&roots, &topo.pki.ca_pem).expect("roots");
    let egress = host.path().join("egress.toml");
    std::fs::write(
        &egress,
        format!(
            "upstream_dns = \"{}:53\"\noutbound_netns = \"{}\"\nupstream_roots = \"{}\"\n",
            egress_fixtures::DNS,
            topo.world.path().display(),
            roots.display()
        ),
    )
    .expect("egress file");
    let project = host.path().join("project");
    std::fs::create_dir(&project).expect("mkdir");
    ok(
        Command::new("git")
            .args(["init", "-q"])
            .current_dir(&project)
            .output()
            .expect("git"),
        "git init",
    );

    let env = TestEnv::new();
    let run = |args: &[&str]| {
        env.cmd()
            .arg("run")
            .args(args)
            .current_dir(&project)
            .env("HOME", &home)
            .env_remove("CLAUDE_CONFIG_DIR")
            .env_remove("CODEX_HOME")
            .stdin(std::process::Stdio::null())
            .output()
            .expect("warren run")
    };
    let dev = common::image_id("dev");
    let out = run(&[
        "--image",
        &dev,
        "--credentials",
        "claude",
        "--credentials",
        "codex",
        "--egress",
        egress.to_str().expect("utf-8"),
        "shell",
        "--",
        "python3",
        "-c",
        AGENT_PROBES,
    ]);
    assert!(
        out.status.success(),
        "run: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("probe output is JSON");
    let text = |k: &str| v[k].as_str().unwrap_or_default().to_string();
    // The guest's files hold placeholders in the host files' shape.
    assert_eq!(
        v["claude_file"]["accessToken"],
        "warren-placeholder-anthropic-access-v1"
    );
    assert_eq!(v["claude_file"]["subscriptionType"], "pro");
    assert_eq!(
        v["codex_file"]["access_token"],
        "warren-placeholder-openai-access-v1"
    );
    assert_eq!(v["codex_file"]["account_id"], "acct-1");
    // API calls carry the real tokens on the wire (the stand-in echoes what it got).
    assert!(
        text("claude_api").contains(&format!("Bearer {CLAUDE_REAL}")),
        "{v}"
    );
    assert!(
        text("codex_api").contains(&format!("Bearer {codex_access}")),
        "{v}"
    );
    // Refreshes are answered on the host with placeholders and the host token's lifetime.
    let refresh: serde_json::Value =
        serde_json::from_str(&text("claude_refresh")).unwrap_or_else(|e| panic!("{e}: {v}"));
    assert_eq!(
        refresh["access_token"],
        "warren-placeholder-anthropic-access-v1"
    );
    let left = refresh["expires_in"].as_i64().expect("expires_in");
    assert!((3000..=3600).contains(&left), "{refresh}");
    let refresh: serde_json::Value =
        serde_json::from_str(&text("codex_refresh")).unwrap_or_else(|e| panic!("{e}: {v}"));
    assert_eq!(
        refresh["refresh_token"],
        "warren-placeholder-openai-refresh-v1"
    );
    // A provider's placeholder bound for another provider is blocked.
    assert_eq!(text("claude_token_to_openai"), "HTTP 403", "{v}");
    // The host files are untouched.
    assert_eq!(
        std::fs::read_to_string(&claude_file).expect("read"),
        claude_doc.to_string()
    );
    // No real token anywhere in the guest's files, environments or command lines.
    let mut pat = String::new();
    for t in [
        CLAUDE_REAL,
        CLAUDE_REFRESH_REAL,
        CODEX_REFRESH_REAL,
        "host-only-signature",
    ] {
        let (a, b) = t.split_at(6);
        pat.push_str(&format!("{a} {b} "));
    }
    let out = run(&[
        "shell",
        "--",
        "sh",
        "-c",
        &format!(
            "printf '%s%s\\n' {pat} > /var/tmp/pat; grep -rlsF -f /var/tmp/pat /agent-state /etc \
             /home /tmp /workspace /proc/[0-9]*/environ /proc/[0-9]*/cmdline 2>/dev/null | wc -l"
        ),
    ]);
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "0",
        "a real token is in the guest: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let list = common::ok(env.run(&["session", "list", "--json"]), "list");
    let sessions: serde_json::Value = serde_json::from_str(&list).expect("json");
    ok(
        env.run(&[
            "session",
            "delete",
            sessions[0]["name"].as_str().expect("name"),
            "--force",
        ]),
        "delete",
    );
    drop(topo);
}
