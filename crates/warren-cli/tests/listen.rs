//! The service's HTTP listeners against another local user: a client saying `localhost`
//! may connect to 127.0.0.1 or ::1, and any user may bind a port above 1023 on either. The
//! service holds both addresses at its port, and does not start beside a process holding
//! one of them (it would collect the bearer tokens of `localhost` clients). Under systemd it
//! serves the sockets `warren.socket` passes, so the port stays held while no service runs.
//! No VM boots.

mod common;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
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

/// `warren serve --config config` given `passed` as systemd passes sockets (descriptors 3
/// on, `LISTEN_FDS`, `LISTEN_PID` the service's own pid).
fn serve_passed(config: &std::path::Path, passed: &[std::os::fd::BorrowedFd<'_>]) -> Child {
    serve_passed_to(config, passed, "$$", &[])
}

/// As [`serve_passed`], with `LISTEN_PID` set to `pid` (`$$`: the service's) and `envs`.
fn serve_passed_to(
    config: &std::path::Path,
    passed: &[std::os::fd::BorrowedFd<'_>],
    pid: &str,
    envs: &[(&str, &str)],
) -> Child {
    use std::os::fd::AsRawFd;
    let mut cmd = Command::new("sh");
    cmd.args([
        "-c",
        &format!("export LISTEN_PID={pid} LISTEN_FDS=$1; exec \"$0\" serve --config \"$2\""),
        common::WARREN,
        &passed.len().to_string(),
    ])
    .arg(config)
    .envs(envs.iter().copied());
    // Out of the way of descriptors 3 on before they are moved there.
    let high: Vec<_> = passed
        .iter()
        .enumerate()
        .map(|(i, fd)| rustix::io::fcntl_dupfd_cloexec(fd, 100 + i as i32).expect("dup"))
        .collect();
    for (i, fd) in high.iter().enumerate() {
        warren_vmm::sys::process::pass_fd_as(&mut cmd, fd.as_raw_fd(), 3 + i as i32);
    }
    cmd.stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("serve")
}

/// The exit status and standard error of a service that must stop by itself.
fn ends(mut child: Child) -> (std::process::ExitStatus, String) {
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the service did not stop by itself");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut err = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = e.read_to_string(&mut err);
    }
    (status, err)
}

/// Two loopback listeners on one free port.
fn loopback_pair() -> (TcpListener, TcpListener, u16) {
    for _ in 0..16 {
        let v4 = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1");
        let port = v4.local_addr().expect("addr").port();
        if let Ok(v6) = TcpListener::bind(format!("[::1]:{port}")) {
            return (v4, v6, port);
        }
    }
    panic!("no port free on both loopback addresses");
}

/// Socket activation (`warren.socket`): the service serves the sockets systemd passes
/// instead of binding its own, so the port stays held while no service runs. A request sent
/// while the service is down waits in the backlog and is answered by the next one.
#[test]
fn test_service_serves_the_sockets_systemd_passes_and_across_a_restart() {
    use std::os::fd::AsFd;
    let (v4, v6, port) = loopback_pair();
    let env = common::TestEnv::new();
    let minimal = common::daemon::image_id(&env, "minimal");
    let config = env.state.path().join("warren.toml");
    std::fs::write(
        &config,
        format!(
            "state_dir = {:?}\nimage_dir = {:?}\n[http]\nlisten = \"127.0.0.1:{port}\"\n\
             [images.minimal]\nid = \"{minimal}\"\ndefault = true\n",
            env.state.path().join("state"),
            env.image_dir
        ),
    )
    .expect("config");
    // systemd's readiness socket (`Type=notify`).
    let notify_path = env.state.path().join("notify");
    let notify = std::os::unix::net::UnixDatagram::bind(&notify_path).expect("notify socket");
    let notify_env = notify_path.to_str().expect("utf-8 path");
    // Passed in the other order than the service lists them.
    let mut first = serve_passed_to(
        &config,
        &[v6.as_fd(), v4.as_fd()],
        "$$",
        &[("NOTIFY_SOCKET", notify_env)],
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    loop {
        // A service that binds by itself fails (this test holds both): it must use these.
        if let Some(status) = first.try_wait().expect("wait") {
            let (_, err) = ends(first);
            panic!("the service stopped ({status}): {err}");
        }
        let line = status_line(&format!("127.0.0.1:{port}"), port);
        if line.starts_with("HTTP/1.1 401") {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "no answer: {line:?}");
        std::thread::sleep(Duration::from_millis(200));
    }
    let line = status_line(&format!("[::1]:{port}"), port);
    assert!(line.starts_with("HTTP/1.1 401"), "[::1]: {line:?}");
    notify
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let mut buf = [0u8; 64];
    let n = notify
        .recv(&mut buf)
        .expect("the service said nothing to NOTIFY_SOCKET");
    assert_eq!(&buf[..n], b"READY=1");
    let _ = first.kill();
    let _ = first.wait();

    // No service now; the port is still held (here by the test, under systemd by
    // warren.socket): a request sent meanwhile is answered by the next service.
    let mut waiting = TcpStream::connect(format!("127.0.0.1:{port}")).expect("connect");
    write!(
        waiting,
        "GET /v1/openapi.json HTTP/1.1\r\nHost: localhost:{port}\r\nConnection: close\r\n\r\n"
    )
    .expect("request");
    let mut second = serve_passed(&config, &[v4.as_fd(), v6.as_fd()]);
    waiting
        .set_read_timeout(Some(Duration::from_secs(120)))
        .expect("timeout");
    let mut out = Vec::new();
    let _ = waiting.read_to_end(&mut out);
    let _ = second.kill();
    let _ = second.wait();
    let text = String::from_utf8_lossy(&out);
    assert!(
        text.starts_with("HTTP/1.1 401"),
        "the request sent while no service ran: {text:?}"
    );
}

/// Passed sockets that are not exactly `listen` and the loopback address it leaves free
/// keep the service from starting (`invalid_argument`, naming what differs), as does a
/// passed descriptor that is no TCP listener. Control: the right pair gets the service past
/// its listeners (to the preflight the fake image fails). No VM boots.
#[test]
fn test_service_refuses_passed_sockets_that_are_not_what_listen_asks_for() {
    use std::os::fd::AsFd;
    let (v4, v6, port) = loopback_pair();
    let dir = tempfile::tempdir().expect("tempdir");
    let config = config_for(dir.path(), port);
    let (status, err) = ends(serve_passed(&config, &[v4.as_fd()]));
    assert!(!status.success(), "{err}");
    assert!(
        err.contains("error[invalid_argument]") && err.contains(&format!("[::1]:{port}")),
        "only 127.0.0.1 passed: {err}"
    );
    let other_dir = tempfile::tempdir().expect("tempdir");
    let other = config_for(other_dir.path(), port.wrapping_add(1).max(1024));
    let (status, err) = ends(serve_passed(&other, &[v4.as_fd(), v6.as_fd()]));
    assert!(
        !status.success() && err.contains("error[invalid_argument]"),
        "another port passed: {err}"
    );
    let udp = std::net::UdpSocket::bind("127.0.0.1:0").expect("udp");
    let (status, err) = ends(serve_passed(&config, &[v4.as_fd(), udp.as_fd()]));
    assert!(
        !status.success()
            && err.contains("error[invalid_argument]")
            && err.contains("not a stream socket"),
        "a UDP socket passed: {err}"
    );
    let (_, err) = ends(serve_passed(&config, &[v4.as_fd(), v6.as_fd()]));
    assert!(
        err.contains("error[unavailable]: preflight failed"),
        "the right pair: {err}"
    );
}

/// `WARREN_SOCKET_ACTIVATION=required` (as `warren.service` sets it): passed no socket, or
/// sockets meant for another process (`LISTEN_PID` not the service's), the service does not
/// start rather than bind the port itself, and waits before it exits (systemd would start
/// it again at once). Control: without the variable the same service binds by itself.
#[test]
fn test_service_required_to_be_socket_activated_does_not_bind_by_itself() {
    use std::os::fd::AsFd;
    let (v4, v6, port) = loopback_pair();
    let dir = tempfile::tempdir().expect("tempdir");
    let config = config_for(dir.path(), port);
    let required = [("WARREN_SOCKET_ACTIVATION", "required")];
    for (passed, pid) in [(vec![], "$$"), (vec![v4.as_fd(), v6.as_fd()], "1")] {
        let started = std::time::Instant::now();
        let (status, err) = ends(serve_passed_to(&config, &passed, pid, &required));
        assert!(
            !status.success()
                && err.contains("error[invalid_argument]")
                && err.contains("systemd passed no socket"),
            "{} sockets, LISTEN_PID={pid}: {err}",
            passed.len()
        );
        assert!(
            started.elapsed() >= Duration::from_secs(4),
            "exited at once: {:?}",
            started.elapsed()
        );
    }
    drop((v4, v6));
    let (_, err) = ends(serve_passed_to(&config, &[], "$$", &[]));
    assert!(
        err.contains("error[unavailable]: preflight failed"),
        "not required: {err}"
    );
}
