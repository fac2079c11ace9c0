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

#[test]
fn test_service_holds_both_loopback_addresses_and_does_not_start_beside_a_squatter() {
    // Another user's listener on [::1] at the port the service is configured for.
    let squatter = TcpListener::bind("[::1]:0").expect("bind [::1] (the test hosts have it)");
    let port = squatter.local_addr().expect("addr").port();
    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("warren.toml");
    std::fs::write(
        &config,
        format!(
            "state_dir = {:?}\n[http]\nlisten = \"127.0.0.1:{port}\"\n\
             [images.minimal]\nid = \"{}\"\ndefault = true\n",
            dir.path().join("state"),
            "a".repeat(64)
        ),
    )
    .expect("config");
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
