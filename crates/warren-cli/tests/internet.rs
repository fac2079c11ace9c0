//! Egress modes against the real package registries (issue 15, item 2), the one exception to
//! the rule that tests only reach this machine: a guest makes a handful of ordinary installs
//! per run. Every refusal check uses addresses that stand for what must stay unreachable
//! (private, metadata, the host's own), never another outside host.
//!
//! This machine is behind TLS inspection (its registries present certificates from a CA only
//! the host trusts), so both VMs run with `host_ca_store = true`: without it neither pip nor
//! npm could verify the registries. Installs get generous timeouts and at most one retry
//! for a transient network error (pip's `--retries 1`, npm's `--fetch-retries=1`); the
//! refused npm install is never retried.

mod common;

use common::{ensure_image, TestEnv, TestVm};

/// A small pure-Python package from the Python package index, into a fresh venv, imported.
/// The venv uses the image's pip (`--without-pip --system-site-packages`): seeding a venv
/// with its own pip costs minutes of guest CPU under TCG.
const PIP_INSTALL: &str = "set -e; python3 -m venv --without-pip --system-site-packages /tmp/v; \
    /tmp/v/bin/python -m pip install --no-cache-dir --disable-pip-version-check --no-input \
      --no-compile --timeout 60 --retries 1 six; \
    /tmp/v/bin/python -c 'import six; print(\"imported six\", six.__version__, six.__file__)'";

/// npm installing a small package in a temp directory; `RETRIES` is substituted.
const NPM_INSTALL: &str = "set -e; d=$(mktemp -d); cd \"$d\"; \
    npm install --no-audit --no-fund --no-update-notifier --cache \"$d/.cache\" \
      --fetch-timeout=60000 --fetch-retries=RETRIES is-number; \
    node -e 'const n = require(\"is-number\"); console.log(\"imported is-number\", n(5))'";

/// One guest process probing each address on port 80 with an HTTP request: `open` when
/// anything answers, `refused` when the connection ends without a byte or fails.
const PROBE: &str = r#"
import socket, sys
for ip in sys.argv[1:]:
    try:
        s = socket.create_connection((ip, 80), timeout=10)
        s.sendall(b'GET / HTTP/1.1\r\nHost: ' + ip.encode() + b'\r\nConnection: close\r\n\r\n')
        s.settimeout(10)
        print(ip + '=' + ('open' if s.recv(64) else 'refused'))
    except Exception:
        print(ip + '=refused')
"#;

/// The host's first global IPv4 address (the egress must refuse it as a destination).
fn host_address() -> String {
    let out = std::process::Command::new("ip")
        .args(["-4", "-o", "addr", "show", "scope", "global"])
        .output()
        .expect("ip addr");
    let text = String::from_utf8_lossy(&out.stdout);
    text.split_whitespace()
        .skip_while(|w| *w != "inet")
        .nth(1)
        .and_then(|a| a.split('/').next())
        .map(str::to_string)
        .expect("the host has a global IPv4 address")
}

/// The VM's supervisor log (current and rotated halves), where the egress's decisions go.
fn decisions(env: &TestEnv, id: &str) -> String {
    let dir = env.vm_dir(id);
    let mut text = std::fs::read_to_string(dir.join("supervisor.log.1")).unwrap_or_default();
    text.push_str(&std::fs::read_to_string(dir.join("supervisor.log")).unwrap_or_default());
    text
}

/// Whether some decision line names all of `needles`.
fn logged(log: &str, needles: &[&str]) -> bool {
    log.lines().any(|l| needles.iter().all(|n| l.contains(n)))
}

fn boot_with_egress(egress_toml: &str, network: &[&str]) -> TestVm {
    ensure_image("dev");
    let env = TestEnv::new();
    let file = env.state.path().join("egress.toml");
    std::fs::write(&file, egress_toml).expect("egress file");
    let mut args = network.to_vec();
    args.extend(["--egress", file.to_str().expect("utf-8")]);
    let id = env.create_vm_with("dev", &args);
    TestVm::adopt(env, id)
}

/// [`PIP_INSTALL`] succeeds, and the package comes from the venv, not from the image.
fn pip_installs_into_a_venv(vm: &TestVm) {
    let r = vm.exec_args(&["--timeout", "280"], &["sh", "-c", PIP_INSTALL]);
    assert_eq!(r.code, 0, "pip install: {}\n{}", r.stdout, r.stderr);
    assert!(r.stdout.contains("imported six"), "{}", r.stdout);
    assert!(
        r.stdout.contains("/tmp/v/lib/"),
        "not installed into the venv: {}",
        r.stdout
    );
}

#[test]
fn test_internet_mode_installs_from_registries_and_refuses_private_addresses() {
    let vm = boot_with_egress("host_ca_store = true\n", &["--network", "internet"]);
    let rec = vm.env.record(&vm.id).expect("listed");
    assert_eq!(rec["network"]["mode"], "internet", "{rec}");
    assert_eq!(rec["network"]["host_ca_store"], true, "{rec}");

    pip_installs_into_a_venv(&vm);
    let npm = NPM_INSTALL.replace("RETRIES", "1");
    let r = vm.exec_args(&["--timeout", "280"], &["sh", "-c", &npm]);
    assert_eq!(r.code, 0, "npm install: {}\n{}", r.stdout, r.stderr);
    assert!(r.stdout.contains("imported is-number true"), "{}", r.stdout);

    // Private, metadata and the host's own address stay refused, by the egress's policy.
    let host = host_address();
    let r = vm.exec_args(
        &[],
        &["python3", "-c", PROBE, "10.1.2.3", "169.254.169.254", &host],
    );
    assert_eq!(r.code, 0, "{}", r.stderr);
    for ip in ["10.1.2.3", "169.254.169.254", host.as_str()] {
        assert!(
            r.stdout.contains(&format!("{ip}=refused")),
            "{ip}: {}",
            r.stdout
        );
    }
    let log = decisions(&vm.env, &vm.id);
    assert!(
        logged(&log, &["10.1.2.3:80", "blocked_address"]),
        "private: {log}"
    );
    assert!(
        logged(&log, &["169.254.169.254:80", "blocked_address"]),
        "metadata: {log}"
    );
    assert!(
        logged(&log, &[&format!("{host}:80"), "host_address"]),
        "host address: {log}"
    );
    // The installs were decided by name in internet mode: allowed, no allow list at all.
    assert!(
        logged(&log, &["registry.npmjs.org", "egress allowed"]),
        "npm registry: {log}"
    );
}

#[test]
fn test_allowlist_python_preset_pip_works_npm_refused() {
    let vm = boot_with_egress(
        "allow = [\"preset:python\"]\nhost_ca_store = true\n",
        &["--network"],
    );
    let rec = vm.env.record(&vm.id).expect("listed");
    assert_eq!(rec["network"]["mode"], "allowlist", "{rec}");
    assert_eq!(
        rec["network"]["allow"],
        serde_json::json!(["preset:python"])
    );

    pip_installs_into_a_venv(&vm);

    // The npm registry is outside the preset: refused (no retry: a refusal is final).
    let npm = NPM_INSTALL.replace("RETRIES", "0");
    let r = vm.exec_args(&["--timeout", "150"], &["sh", "-c", &npm]);
    assert_ne!(r.code, 0, "npm install got through: {}", r.stdout);
    assert!(!r.stdout.contains("imported is-number"), "{}", r.stdout);
    let log = decisions(&vm.env, &vm.id);
    assert!(
        logged(&log, &["registry.npmjs.org", "name_not_allowed"]),
        "no refusal of the npm registry logged: {log}"
    );
    // And the package index was allowed by name, through the preset.
    assert!(logged(&log, &["pypi.org", "egress allowed"]), "{log}");
}
