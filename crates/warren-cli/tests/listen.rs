//! The service's HTTP listeners against another local user: a client saying `localhost`
//! may connect to 127.0.0.1 or ::1, and any user may bind a port above 1023 on either. The
//! service holds both addresses at its port, and does not start beside a process holding
//! one of them (it would collect the bearer tokens of `localhost` clients). No VM boots.

mod common;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Duration;

/// The status line of an unauthenticated `GET /v1/openapi.json` sent to `addr`.
fn status_line(addr: &str, port: u16) -> String {
    let mut s = TcpStream::connect(addr).unwrap_or_else(|e| panic!("connect {addr}: {e}"));
    s.set_read_timeout(Some(Duration::from_secs(30)))
        .expect("timeout");
    write!(
        s,
        "GET /v1/openapi.json HTTP/1.1\r\nHost: localhost:{port}\r\nConnection: close\r\n\r\n"
    )
    .expect("request");
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    String::from_utf8_lossy(&out)
        .lines()
        .next()
        .unwrap_or_default()
        .to_string()
}

/// A service configuration in `dir` listening on 127.0.0.1:`port`, with an image that does
/// not exist: a service that gets past its listeners stops at preflight.
fn config_for(dir: &std::path::Path, port: u16) -> std::path::PathBuf {
    let config = dir.join("warren.toml");
    std::fs::write(
        &config,
        format!(
            "state_dir = {:?}\n[http]\nlisten = \"127.0.0.1:{port}\"\n\
             [images.minimal]\nid = \"{}\"\ndefault = true\n",
            dir.join("state"),
            "a".repeat(64)
        ),
    )
    .expect("config");
    config
}

#[test]
fn test_service_holds_both_loopback_addresses_and_does_not_start_beside_a_squatter() {
    // Another user's listener on [::1] at the port the service is configured for.
    let squatter = TcpListener::bind("[::1]:0").expect("bind [::1] (the test hosts have it)");
    let port = squatter.local_addr().expect("addr").port();
    let dir = tempfile::tempdir().expect("tempdir");
    let config = config_for(dir.path(), port);
    let mut child = std::process::Command::new(common::WARREN)
        .args(["serve", "--config"])
        .arg(&config)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("serve");
    // A service that starts beside the squatter runs on: it is stopped and the test fails.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break Some(status);
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut err = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = e.read_to_string(&mut err);
    }
    assert!(
        status.is_some_and(|s| !s.success()),
        "served beside the squatter: {err}"
    );
    assert!(
        err.contains("error[conflict]") && err.contains(&format!("[::1]:{port}")),
        "{err}"
    );
    // Nothing was served on the address the service could have had.
    assert!(
        TcpListener::bind(format!("127.0.0.1:{port}")).is_ok(),
        "the refused service left 127.0.0.1:{port} bound"
    );
    drop(squatter);

    // A running service (listening on 127.0.0.1) answers on ::1 at its port as well, and
    // nobody else can bind it there.
    let d = common::daemon::Daemon::start_minimal("");
    let port: u16 = d
        .addr
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no port in {}", d.addr));
    for addr in [format!("127.0.0.1:{port}"), format!("[::1]:{port}")] {
        let line = status_line(&addr, port);
        assert!(line.starts_with("HTTP/1.1 401"), "{addr}: {line:?}");
    }
    assert!(
        TcpListener::bind(format!("[::1]:{port}")).is_err(),
        "another process could bind [::1]:{port} while the service runs"
    );
}

/// Where ::1 is not configured (IPv6 disabled on `lo`, as in many containers), any user can
/// still bind it (`IPV6_FREEBIND`) and receive what is sent there once it is brought up: the
/// service holds it all the same, and does not start beside a user who holds it. Run in a
/// network namespace of its own; the fake image makes a started service stop at preflight,
/// past the listeners. Control: ::1 is really absent there, and present once IPv6 is on.
#[test]
fn test_service_holds_an_unconfigured_ipv6_loopback_too() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = config_for(dir.path(), 8090);
    // In the namespace: ::1's count; the service beside a FREEBIND squatter on [::1]:8090;
    // the service alone; each service's stderr after a marker line.
    let script = r#"
ip link set lo up && sysctl -qw net.ipv6.conf.lo.disable_ipv6=1 || exit 9
ip -6 addr show dev lo | grep -c '::1'
python3 -c '
import socket, time
s = socket.socket(socket.AF_INET6)
s.setsockopt(socket.IPPROTO_IPV6, 78, 1)  # IPV6_FREEBIND
s.bind(("::1", 8090)); s.listen(); print("squatting", flush=True); time.sleep(60)' &
squatter=$!
sleep 1
echo "== beside" >&2
"$0" serve --config "$1"
kill $squatter; wait $squatter 2>/dev/null
echo "== alone" >&2
"$0" serve --config "$1"
sysctl -qw net.ipv6.conf.lo.disable_ipv6=0
ip -6 addr show dev lo | grep -c '::1'
"#;
    let out = std::process::Command::new("unshare")
        .args(["-n", "sh", "-c", script, common::WARREN])
        .arg(&config)
        .output()
        .expect("unshare");
    let (stdout, err) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines, ["0", "squatting", "1"], "{err}");
    let (beside, alone) = err
        .split_once("== alone")
        .unwrap_or_else(|| panic!("no markers: {err}"));
    assert!(
        beside.contains("error[conflict]") && beside.contains("[::1]:8090"),
        "beside the squatter: {beside}"
    );
    assert!(
        alone.contains("error[unavailable]: preflight failed"),
        "alone: {alone}"
    );
}
