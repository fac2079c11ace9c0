//! CLI commands against a stand-in service on a UNIX socket (`--socket`) that plays what a
//! hostile guest (or another local user) makes the service answer, without a VM: `vm cp
//! VM:path DIR` receiving a copy without end, swapping its staging directory or going
//! silent, `vm exec` following a job whose end never comes, `port-forward` reached by
//! another user. The unpacker's own
//! rules are tested beside them (`warren-cli` `copy::tests`, `warren-image`
//! `unpack::tests`).

mod common;

use std::io::Read;
use std::os::fd::AsRawFd;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::SinkExt;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::Message;

/// Serves every connection on `sock` as a copy out of the guest: a tar header of one file
/// `big/f` claiming `claimed` bytes, then zeros in 256 KiB messages for as long as the
/// client takes them (a guest sends without end). Returns how many bytes were sent.
fn endless_copy(sock: &Path, claimed: u64) -> std::sync::Arc<std::sync::atomic::AtomicU64> {
    let listener = std::os::unix::net::UnixListener::bind(sock).expect("bind");
    listener.set_nonblocking(true).expect("nonblocking");
    let sent = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let counted = sent.clone();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async move {
            let listener = tokio::net::UnixListener::from_std(listener).expect("listener");
            while let Ok((conn, _)) = listener.accept().await {
                let counted = counted.clone();
                tokio::spawn(async move {
                    let Some(mut ws) = ws_or_shares(conn, &[]).await else {
                        return;
                    };
                    let mut h = tar::Header::new_gnu();
                    h.set_entry_type(tar::EntryType::Regular);
                    h.set_size(claimed);
                    h.set_mode(0o644);
                    h.set_path("big/f").expect("path");
                    h.set_cksum();
                    if ws
                        .send(Message::Binary(h.as_bytes().to_vec().into()))
                        .await
                        .is_err()
                    {
                        return;
                    }
                    let zeros = vec![0u8; 256 << 10];
                    while ws.send(Message::Binary(zeros.clone().into())).await.is_ok() {
                        counted.fetch_add(zeros.len() as u64, std::sync::atomic::Ordering::SeqCst);
                    }
                });
            }
        });
    });
    sent
}

/// A stand-in service's connection: the WebSocket a stream opens, or, for the copy asking
/// which host directories the service's VMs write (`GET /v1/host/shares`), the identities
/// of `shared`, and `None`.
async fn ws_or_shares(
    conn: tokio::net::UnixStream,
    shared: &[String],
) -> Option<tokio_tungstenite::WebSocketStream<tokio::net::UnixStream>> {
    use std::os::unix::fs::MetadataExt;
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
    const ASK: &[u8] = b"GET /v1/host/shares ";
    let mut first = [0u8; ASK.len()];
    loop {
        conn.readable().await.ok()?;
        let flags = nix::sys::socket::MsgFlags::MSG_PEEK;
        match nix::sys::socket::recv(conn.as_raw_fd(), &mut first, flags) {
            Ok(n) if n == ASK.len() => break,
            Ok(0) => return None,
            Ok(_) => tokio::time::sleep(Duration::from_millis(5)).await,
            Err(nix::errno::Errno::EAGAIN) => {}
            Err(_) => return None,
        }
    }
    if first != ASK {
        return tokio_tungstenite::accept_async(conn).await.ok();
    }
    let mut r = tokio::io::BufReader::new(conn);
    loop {
        // A GET: the request line and headers, no body.
        loop {
            let mut h = String::new();
            if r.read_line(&mut h).await.ok()? == 0 {
                return None;
            }
            if h.trim_end().is_empty() {
                break;
            }
        }
        let listed: Vec<serde_json::Value> = shared
            .iter()
            .map(|d| {
                let m = std::fs::metadata(d).expect("shared directory");
                serde_json::json!({"dev": m.dev(), "ino": m.ino()})
            })
            .collect();
        let answer = serde_json::json!({ "shares": listed }).to_string();
        let reply = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{answer}",
            answer.len()
        );
        r.get_mut().write_all(reply.as_bytes()).await.ok()?;
    }
}

/// `warren --socket SOCK vm cp SRC DST EXTRA...`, run to its end.
fn vm_cp(
    sock: &Path,
    src: impl AsRef<std::ffi::OsStr>,
    dst: impl AsRef<std::ffi::OsStr>,
    extra: &[&str],
) -> std::process::Output {
    std::process::Command::new(common::WARREN)
        .arg("--socket")
        .arg(sock)
        .args(["vm", "cp"])
        .arg(src)
        .arg(dst)
        .args(extra)
        .output()
        .expect("warren vm cp")
}

/// Everything in `dir`, recursively, as relative paths.
fn listing(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).expect("read_dir").flatten() {
            let p = e.path();
            out.push(p.strip_prefix(dir).expect("inside").display().to_string());
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                todo.push(p);
            }
        }
    }
    out.sort();
    out
}

/// A guest that sends a copy without end: the user stops it with Ctrl-C (or the session
/// ends: SIGTERM, SIGHUP). Before, the process died at the signal and left what it had
/// received in a hidden `.warren-cp-*` directory of the destination, however large; now
/// the copy stops, the staging directory is removed and the exit says so. Control: the
/// copy was receiving (and writing) when it was stopped.
#[test]
fn test_a_copy_out_stopped_by_a_signal_leaves_nothing() {
    let dir = tempfile::tempdir().expect("tmp");
    let sock = dir.path().join("warrend.sock");
    let sent = endless_copy(&sock, 8 << 30);
    let dst = dir.path().join("dst");
    for signal in [nix::sys::signal::SIGINT, nix::sys::signal::SIGTERM] {
        let before = sent.load(std::sync::atomic::Ordering::SeqCst);
        let child = std::process::Command::new(common::WARREN)
            .args(["--socket", sock.to_str().expect("utf-8"), "vm", "cp"])
            .args(["vm-x:/data/big", dst.to_str().expect("utf-8")])
            // Not bounded by this host's free space (the default limit).
            .args(["--max-mib", "65536"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("warren vm cp");
        // Receiving: several MiB written into the staging directory.
        let started = Instant::now();
        while sent.load(std::sync::atomic::Ordering::SeqCst) - before < 16 << 20 {
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "the copy never ran"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        let staged = listing(&dst);
        assert!(
            staged
                .iter()
                .any(|p| p.starts_with(".warren-cp-") && p.ends_with("big/f")),
            "{signal}: the copy was not being written: {staged:?}"
        );
        let pid = nix::unistd::Pid::from_raw(child.id() as i32);
        nix::sys::signal::kill(pid, signal).expect("signal");
        let out = child.wait_with_output().expect("wait");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(listing(&dst), Vec::<String>::new(), "{signal}: left behind");
        assert!(!out.status.success(), "{signal}: {err}");
        assert!(err.contains("nothing of it was kept"), "{signal}: {err}");
    }
}

/// A copy out of the guest holds at most `--max-mib` of file content, and by default what
/// the destination's file system has free less 1 GiB: a file claiming more is
/// refused before any of it is written, the error says which limit, and nothing is left.
/// (Before, a copy had no limit of its own: the guest could fill the host's disk.) Control:
/// `test_a_copy_out_stopped_by_a_signal_leaves_nothing`, where a copy under its limit
/// writes.
#[test]
fn test_a_copy_out_past_its_limit_is_refused_and_leaves_nothing() {
    let dir = tempfile::tempdir().expect("tmp");
    let sock = dir.path().join("warrend.sock");
    // 1 EiB claimed: more than any disk has free.
    endless_copy(&sock, 1 << 60);
    let dst = dir.path().join("dst");
    for (args, says) in [
        (&["--max-mib", "1"][..], "--max-mib 1"),
        (&[][..], "the free space of"),
    ] {
        let out = vm_cp(&sock, "vm-x:/data/big", &dst, args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?}: {err}");
        assert!(err.contains(says), "{args:?}: {err}");
        assert!(err.contains("byte limit"), "{args:?}: {err}");
        assert_eq!(listing(&dst), Vec::<String>::new(), "{args:?}: left behind");
    }
}

/// Serves `sock` as a service whose guest starts a job and never reports its end: `vm_exec`
/// answers job 7, `vm_job_cancel` answers ok (and is counted), the job's output WebSocket
/// stays open and silent. Returns the counts of output streams opened and cancels.
fn endless_job(sock: &Path) -> (Arc<AtomicU64>, Arc<AtomicU64>) {
    use std::io::{BufRead, BufReader, Read, Write};
    let listener = std::os::unix::net::UnixListener::bind(sock).expect("bind");
    std::fs::set_permissions(sock, std::fs::Permissions::from_mode(0o777)).expect("chmod");
    let (streams, cancels) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let (s, c) = (streams.clone(), cancels.clone());
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(conn) = conn else { return };
            let (s, c) = (s.clone(), c.clone());
            std::thread::spawn(move || {
                let mut first = [0u8; 4];
                let peeked = nix::sys::socket::recv(
                    conn.as_raw_fd(),
                    &mut first,
                    nix::sys::socket::MsgFlags::MSG_PEEK,
                );
                if peeked.is_ok_and(|n| n == 4) && &first == b"GET " {
                    // The job's output stream: open, and nothing ever comes.
                    s.fetch_add(1, Ordering::SeqCst);
                    let rt = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                        .expect("runtime");
                    rt.block_on(async move {
                        conn.set_nonblocking(true).expect("nonblocking");
                        let conn = tokio::net::UnixStream::from_std(conn).expect("conn");
                        let Ok(mut ws) = tokio_tungstenite::accept_async(conn).await else {
                            return;
                        };
                        while let Some(Ok(_)) = futures_util::StreamExt::next(&mut ws).await {}
                    });
                    return;
                }
                // Tool calls, one after another on a kept-alive connection.
                let mut r = BufReader::new(conn);
                loop {
                    let mut line = String::new();
                    if r.read_line(&mut line).unwrap_or(0) == 0 {
                        return;
                    }
                    let tool = line.split(' ').nth(1).unwrap_or("").to_string();
                    let mut len = 0usize;
                    loop {
                        let mut h = String::new();
                        if r.read_line(&mut h).unwrap_or(0) == 0 {
                            return;
                        }
                        let h = h.trim_end().to_ascii_lowercase();
                        if h.is_empty() {
                            break;
                        }
                        if let Some(v) = h.strip_prefix("content-length:") {
                            len = v.trim().parse().unwrap_or(0);
                        }
                    }
                    let mut body = vec![0u8; len];
                    if r.read_exact(&mut body).is_err() {
                        return;
                    }
                    let answer = if tool.ends_with("/vm_exec") {
                        r#"{"job_id":"7"}"#
                    } else {
                        c.fetch_add(1, Ordering::SeqCst);
                        r#"{"job_id":"7","cancelled":true}"#
                    };
                    let reply = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\
                         content-length: {}\r\n\r\n{answer}",
                        answer.len()
                    );
                    if r.get_mut().write_all(reply.as_bytes()).is_err() {
                        return;
                    }
                }
            });
        }
    });
    (streams, cancels)
}

/// Waits until `f` holds, at most 30 s.
fn wait_for(what: &str, f: impl Fn() -> bool) {
    let started = Instant::now();
    while !f() {
        assert!(started.elapsed() < Duration::from_secs(30), "{what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A guest that never reports the end of a job it was told to cancel held `vm exec`
/// forever: the first Ctrl-C (or SIGTERM, SIGHUP) cancels the job and waits for its end,
/// which is right, but every later signal was swallowed, so only SIGKILL (or SIGQUIT) got
/// the user's terminal back, and after a closed terminal's one SIGHUP the CLI waited for
/// ever. Now a second signal leaves at once with 128+N, and the end is waited for 10 s at
/// most. Control: after the first signal the CLI cancelled the job and is still waiting
/// for its end. The CLI runs as `nobody` (a non-root caller of the service, as the CLI is
/// for its users).
#[test]
fn test_vm_exec_leaves_a_cancelled_job_whose_end_never_comes() {
    let dir = tempfile::tempdir().expect("tmp");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let sock = dir.path().join("warrend.sock");
    let (streams, cancels) = endless_job(&sock);
    for signal in [nix::sys::signal::SIGINT, nix::sys::signal::SIGTERM] {
        let (s0, c0) = (
            streams.load(Ordering::SeqCst),
            cancels.load(Ordering::SeqCst),
        );
        let mut child = exec_as_nobody(&sock, std::process::Stdio::piped());
        let pid = nix::unistd::Pid::from_raw(child.id() as i32);
        wait_for("the output stream opened", || {
            streams.load(Ordering::SeqCst) > s0
        });
        nix::sys::signal::kill(pid, signal).expect("first signal");
        wait_for("the job cancelled", || cancels.load(Ordering::SeqCst) > c0);
        std::thread::sleep(Duration::from_millis(300));
        assert!(
            child.try_wait().expect("wait").is_none(),
            "{signal}: the first signal waits for the job's end"
        );
        nix::sys::signal::kill(pid, signal).expect("second signal");
        let started = Instant::now();
        let status = loop {
            if let Some(s) = child.try_wait().expect("wait") {
                break Some(s);
            }
            if started.elapsed() > Duration::from_secs(10) {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let mut err = String::new();
        if let Some(mut e) = child.stderr.take() {
            let _ = e.read_to_string(&mut err);
        }
        let status = status
            .unwrap_or_else(|| panic!("{signal}: still waiting after a second signal: {err}"));
        assert_eq!(status.code(), Some(128 + signal as i32), "{signal}: {err}");
    }
    // One signal only (a closed terminal's SIGHUP comes once): the cancelled job's end is
    // waited for 10 s, then the CLI leaves.
    let c0 = cancels.load(Ordering::SeqCst);
    let mut child = exec_as_nobody(&sock, std::process::Stdio::null());
    let pid = nix::unistd::Pid::from_raw(child.id() as i32);
    let s0 = streams.load(Ordering::SeqCst);
    wait_for("the output stream opened", || {
        streams.load(Ordering::SeqCst) > s0
    });
    nix::sys::signal::kill(pid, nix::sys::signal::SIGHUP).expect("hang up");
    wait_for("the job cancelled", || cancels.load(Ordering::SeqCst) > c0);
    let started = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break s;
        }
        if started.elapsed() > Duration::from_secs(20) {
            let _ = child.kill();
            panic!("still waiting 20 s after a hang-up");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let waited = started.elapsed();
    assert_eq!(status.code(), Some(129));
    assert!(waited >= Duration::from_secs(9), "left after {waited:?}");
}

/// `warren vm exec vm-x -- sleep infinity` through the stand-in service at `sock`, run as
/// `nobody`, its stderr as `stderr`.
fn exec_as_nobody(sock: &std::path::Path, stderr: std::process::Stdio) -> std::process::Child {
    std::process::Command::new(common::WARREN)
        .args(["--socket", sock.to_str().expect("utf-8")])
        .args(["vm", "exec", "vm-x", "--", "sleep", "infinity"])
        .uid(65534)
        .gid(65534)
        .env("HOME", "/nonexistent")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(stderr)
        .spawn()
        .expect("warren vm exec")
}

/// Serves every connection on `sock` as a copy out of the guest of `archive`: its first
/// `before` bytes, then, once `gate` is set, the rest and a normal end. Until then it reads
/// nothing from the client (a guest that neither sends nor takes).
fn gated_copy(
    sock: &Path,
    archive: Vec<u8>,
    before: usize,
    gate: Arc<AtomicBool>,
    sessions: Vec<String>,
) {
    let listener = std::os::unix::net::UnixListener::bind(sock).expect("bind");
    listener.set_nonblocking(true).expect("nonblocking");
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async move {
            let listener = tokio::net::UnixListener::from_std(listener).expect("listener");
            while let Ok((conn, _)) = listener.accept().await {
                let (archive, gate, sessions) = (archive.clone(), gate.clone(), sessions.clone());
                tokio::spawn(async move {
                    let Some(mut ws) = ws_or_shares(conn, &sessions).await else {
                        return;
                    };
                    let first = archive[..before].to_vec();
                    if ws.send(Message::Binary(first.into())).await.is_err() {
                        return;
                    }
                    while !gate.load(Ordering::SeqCst) {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    let rest = archive[before..].to_vec();
                    if ws.send(Message::Binary(rest.into())).await.is_err() {
                        return;
                    }
                    let _ = ws
                        .close(Some(CloseFrame {
                            code: CloseCode::Normal,
                            reason: "guest closed".into(),
                        }))
                        .await;
                    while let Some(Ok(_)) = futures_util::StreamExt::next(&mut ws).await {}
                });
            }
        });
    });
}

/// A directory `cfg` holding the file `x` ("guest"), as a guest's `tar` sends it.
fn cfg_archive() -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(tar::EntryType::Directory);
    h.set_mode(0o755);
    h.set_size(0);
    b.append_data(&mut h, "cfg", &b""[..]).expect("dir");
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(tar::EntryType::Regular);
    h.set_mode(0o644);
    h.set_size(5);
    b.append_data(&mut h, "cfg/x", &b"guest"[..]).expect("file");
    b.into_inner().expect("archive")
}

/// A copy out of a guest into a directory the guest can write (a share): while the archive
/// is open, the guest renames the copy's staging directory away and puts a symlink to a
/// host directory holding `cfg` in its place. The copy was moved into place by path, through
/// that symlink: the host's own `cfg` was taken out of its directory and handed to the
/// guest. Now the staging directory is held open from its making and the move is made from
/// it: the guest's `cfg` lands, the host's stays. Control: the staging directory was
/// being written when the swap was made.
#[test]
fn test_a_copy_out_is_moved_from_its_own_staging_directory_not_through_a_swapped_in_symlink() {
    let dir = tempfile::tempdir().expect("tmp");
    let sock = dir.path().join("warrend.sock");
    let gate = Arc::new(AtomicBool::new(false));
    // The directory's header alone: the unpacker makes `cfg` in the staging directory.
    gated_copy(&sock, cfg_archive(), 512, gate.clone(), Vec::new());
    let dst = dir.path().join("dst");
    std::fs::create_dir_all(&dst).expect("dst");
    let victim = dir.path().join("victim");
    std::fs::create_dir_all(victim.join("cfg")).expect("victim");
    std::fs::write(victim.join("cfg/secret"), "host").expect("secret");
    let child = std::process::Command::new(common::WARREN)
        .args(["--socket", sock.to_str().expect("utf-8"), "vm", "cp"])
        .args([
            "vm-x:/data/cfg",
            dst.to_str().expect("utf-8"),
            "--max-mib",
            "16",
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("warren vm cp");
    let staging = || {
        std::fs::read_dir(&dst)
            .expect("dst")
            .flatten()
            .map(|e| e.path())
            .find(|p| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with(".warren-cp-"))
                    && p.join("cfg").is_dir()
            })
    };
    wait_for("the copy staged cfg", || staging().is_some());
    let staged = staging().expect("staging");
    std::fs::rename(&staged, dst.join(".hold")).expect("rename");
    std::os::unix::fs::symlink(&victim, &staged).expect("symlink");
    gate.store(true, Ordering::SeqCst);
    let out = child.wait_with_output().expect("wait");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert_eq!(
        std::fs::read_to_string(victim.join("cfg/secret"))
            .ok()
            .as_deref(),
        Some("host"),
        "the host's cfg was moved: {:?}",
        listing(&dst)
    );
    assert_eq!(
        std::fs::read_to_string(dst.join("cfg/x")).expect("the copy"),
        "guest"
    );
}

/// A stand-in service on `sock` that answers the shares question (none) and then one stream:
/// the upgrade, `payload` and a normal close in one write, the socket closed at once, before
/// the client has read any of it (a guest that answered and closed, passed on at once).
fn hasty_stream(sock: &Path, payload: Vec<u8>) -> std::thread::JoinHandle<()> {
    use std::io::{BufRead, Write};
    let listener = std::os::unix::net::UnixListener::bind(sock).expect("bind");
    std::thread::spawn(move || loop {
        let (conn, _) = listener.accept().expect("accept");
        let mut r = std::io::BufReader::new(conn);
        let (mut first, mut key) = (String::new(), String::new());
        r.read_line(&mut first).expect("request line");
        loop {
            let mut h = String::new();
            r.read_line(&mut h).expect("request");
            if h.trim_end().is_empty() {
                break;
            }
            if let Some(v) = h
                .split_once(':')
                .filter(|(k, _)| k.eq_ignore_ascii_case("sec-websocket-key"))
                .map(|(_, v)| v.trim().to_string())
            {
                key = v;
            }
        }
        if first.starts_with("GET /v1/host/shares ") {
            let answer = r#"{"shares":[]}"#;
            let reply = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{answer}",
                answer.len()
            );
            r.into_inner().write_all(reply.as_bytes()).expect("shares");
            continue;
        }
        let accept = tokio_tungstenite::tungstenite::handshake::derive_accept_key(key.as_bytes());
        let mut out = format!(
            "HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: upgrade\r\n\
             sec-websocket-accept: {accept}\r\n\r\n"
        )
        .into_bytes();
        out.push(0x82);
        out.push(126);
        out.extend_from_slice(&u16::try_from(payload.len()).expect("small").to_be_bytes());
        out.extend_from_slice(&payload);
        let reason = b"guest closed";
        out.push(0x88);
        out.push(u8::try_from(2 + reason.len()).expect("small"));
        out.extend_from_slice(&1000u16.to_be_bytes());
        out.extend_from_slice(reason);
        let mut conn = r.into_inner();
        conn.write_all(&out).expect("answer");
        drop(conn);
        break;
    })
}

/// A copy out of a small file: the service sent the whole archive and its close, and closed
/// the connection, before the client told the guest its input ended (a copy out sends only
/// that). The send failed with a broken pipe and the copy failed with it, although
/// everything had arrived (seen in a full run through a real service). Now the end of input
/// of a copy out may find the connection gone: the archive is read and the copy lands.
#[test]
fn test_a_copy_out_lands_when_the_service_closed_before_the_end_of_input() {
    let dir = tempfile::tempdir().expect("tmp");
    let sock = dir.path().join("warrend.sock");
    let served = hasty_stream(&sock, cfg_archive());
    let dst = dir.path().join("dst");
    let out = vm_cp(&sock, "vm-x:/data/cfg", &dst, &["--max-mib", "16"]);
    served.join().expect("stand-in");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert_eq!(
        std::fs::read_to_string(dst.join("cfg/x")).expect("the copy"),
        "guest"
    );
}

/// The same for `attach`: a guest that answers and closes before the (empty) input's end
/// is sent is a normal close, its answer printed, exit 0.
#[test]
fn test_attach_ends_normally_when_the_guest_closed_before_the_end_of_input() {
    let dir = tempfile::tempdir().expect("tmp");
    let sock = dir.path().join("warrend.sock");
    let served = hasty_stream(&sock, b"answer\n".to_vec());
    let out = std::process::Command::new(common::WARREN)
        .arg("--socket")
        .arg(&sock)
        .args(["attach", "vm-x", "--port", "7000"])
        .stdin(std::process::Stdio::null())
        .output()
        .expect("warren attach");
    served.join().expect("stand-in");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "answer\n");
}

/// Through a service, the directories its VMs write are the service's to say, for every
/// workspace (the caller's own state directory, whose shares the first check read, is not
/// the service's): a copy into or out of one is refused before the stream opens, also
/// through a symlink planted in it. Control: a directory beside it copies.
#[test]
fn test_a_copy_through_a_service_stays_out_of_its_session_directories() {
    let dir = tempfile::tempdir().expect("tmp");
    let sock = dir.path().join("warrend.sock");
    let session = dir.path().join("session");
    std::fs::create_dir_all(&session).expect("session");
    let gate = Arc::new(AtomicBool::new(true));
    let listed = vec![session.to_str().expect("utf-8").to_string()];
    gated_copy(&sock, cfg_archive(), 512, gate, listed);
    let cp = |src: &str, dst: &str| vm_cp(&sock, src, dst, &["--max-mib", "16"]);
    let out = cp(
        "vm-x:/data/cfg",
        session.join("out").to_str().expect("utf-8"),
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("which VM of the service can write"), "{err}");
    assert!(!session.join("out").exists());
    let away = dir.path().join("away");
    std::fs::create_dir_all(&away).expect("away");
    std::os::unix::fs::symlink(&away, session.join("planted")).expect("planted");
    let out = cp(
        "vm-x:/data/cfg",
        session.join("planted").to_str().expect("utf-8"),
    );
    assert!(!out.status.success(), "followed the planted link");
    assert!(!away.join("cfg").exists());
    std::fs::write(session.join("notes"), "x").expect("notes");
    let out = cp(session.join("notes").to_str().expect("utf-8"), "vm-x:/data");
    assert!(!out.status.success(), "a session's file was sent");
    let beside = dir.path().join("beside");
    let out = cp("vm-x:/data/cfg", beside.to_str().expect("utf-8"));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        std::fs::read_to_string(beside.join("cfg/x")).expect("copied"),
        "guest"
    );
}

/// A guest that goes silent in the middle of a copy (out: it sends no more; in: it takes
/// no more) held `vm cp` for ever (the service keeps the WebSocket alive with pings). Now
/// the copy gives up after `--idle-timeout` seconds without progress, says so, and leaves
/// nothing. Control: the copy out had begun (the guest's first bytes came).
#[test]
fn test_a_copy_the_guest_stalls_gives_up_at_the_idle_timeout() {
    let dir = tempfile::tempdir().expect("tmp");
    let sock = dir.path().join("warrend.sock");
    gated_copy(
        &sock,
        cfg_archive(),
        512,
        Arc::new(AtomicBool::new(false)),
        Vec::new(),
    );
    let dst = dir.path().join("dst");
    let big = dir.path().join("big");
    std::fs::File::create(&big)
        .and_then(|f| f.set_len(256 << 20))
        .expect("big");
    let cp = |src: &Path, to: &str| {
        let started = Instant::now();
        let out = vm_cp(&sock, src, to, &["--max-mib", "16", "--idle-timeout", "2"]);
        (out, started.elapsed())
    };
    let (out, took) = cp(Path::new("vm-x:/data/cfg"), dst.to_str().expect("utf-8"));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "out: {err}");
    assert!(err.contains("--idle-timeout"), "out: {err}");
    assert!(
        took < Duration::from_secs(30),
        "out: gave up after {took:?}"
    );
    assert_eq!(listing(&dst), Vec::<String>::new(), "out: left behind");
    let (out, took) = cp(&big, "vm-x:/data");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "in: {err}");
    assert!(err.contains("--idle-timeout"), "in: {err}");
    assert!(took < Duration::from_secs(30), "in: gave up after {took:?}");
}

/// Serves every connection on `sock` as a service refusing a stream with `not_found` and
/// `message`, its head and body in two writes 100 ms apart. Counts the connections.
fn refusing_streams(sock: &Path, message: &'static str) -> Arc<AtomicU64> {
    use std::io::Write;
    let listener = std::os::unix::net::UnixListener::bind(sock).expect("bind");
    let seen = Arc::new(AtomicU64::new(0));
    let counted = seen.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut c) = conn else { return };
            counted.fetch_add(1, Ordering::SeqCst);
            let mut head = Vec::new();
            let mut b = [0u8; 1];
            while !head.ends_with(b"\r\n\r\n") && c.read(&mut b).map(|n| n == 1).unwrap_or(false) {
                head.push(b[0]);
            }
            let body =
                serde_json::json!({"error": {"code": "not_found", "message": message}}).to_string();
            let head = format!(
                "HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\n\
                 content-length: {}\r\nconnection: close\r\n\r\n",
                body.len()
            );
            let _ = c.write_all(head.as_bytes()).and_then(|()| c.flush());
            std::thread::sleep(Duration::from_millis(100));
            let _ = c.write_all(body.as_bytes());
        }
    });
    seen
}

/// `warren port-forward` listens on loopback, which every local user can reach, and each
/// connection acts with the forwarder's credential: another user's connection reached the
/// forwarder's workspace. Now a connection from another uid (here `nobody`) is closed
/// before anything is opened, and says so, also when it sent and closed before the
/// forwarder looked; with `--allow-other-users` it is forwarded.
/// Control: the forwarder's own connection is forwarded (the stand-in service refuses the
/// stream, with its body sent after its head: the refusal is read whole, code and message).
/// python3 as nobody (uid 65534), connected to `host`:`port`, then running `then`.
fn as_nobody(host: &str, port: &str, then: &str) -> std::process::Command {
    let mut c = std::process::Command::new("python3");
    c.args([
        "-c",
        &format!(
            "import socket,sys,time\ns=socket.create_connection(('{host}', int(sys.argv[1])))\n{then}"
        ),
        port,
    ])
    .uid(65534)
    .gid(65534);
    c
}

#[test]
fn test_port_forward_forwards_only_connections_of_its_own_user() {
    use std::io::{BufRead, BufReader};
    let dir = tempfile::tempdir().expect("tmp");
    let sock = dir.path().join("warrend.sock");
    let seen = refusing_streams(&sock, "stand-in refused the stream");
    for allow in [false, true] {
        let mut args = vec!["--socket", sock.to_str().expect("utf-8"), "port-forward"];
        args.extend(["vm-x", "0:80"]);
        if allow {
            args.push("--allow-other-users");
        }
        let mut child = std::process::Command::new(common::WARREN)
            .args(&args)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("warren port-forward");
        let mut out = BufReader::new(child.stdout.take().expect("stdout"));
        let mut addr = String::new();
        out.read_line(&mut addr).expect("address");
        let port = addr.trim().rsplit(':').next().expect("port").to_string();
        // Lines through a channel, so a line that never comes fails the test in 30 s.
        let (lines_tx, lines) = std::sync::mpsc::channel::<String>();
        let err = BufReader::new(child.stderr.take().expect("stderr"));
        std::thread::spawn(move || {
            for line in err.lines().map_while(Result::ok) {
                if lines_tx.send(line).is_err() {
                    return;
                }
            }
        });
        let next_line = |want: &str| loop {
            let line = lines
                .recv_timeout(Duration::from_secs(30))
                .unwrap_or_else(|_| panic!("no {want:?} line"));
            if line.contains(want) {
                break line;
            }
        };
        let before = seen.load(Ordering::SeqCst);
        let mut nobody = as_nobody("127.0.0.1", &port, "time.sleep(3)")
            .spawn()
            .expect("python3 as nobody");
        if allow {
            let line = next_line("connection from");
            assert!(line.contains("stand-in refused the stream"), "{line:?}");
            assert_eq!(seen.load(Ordering::SeqCst), before + 1);
        } else {
            let line = next_line("refused a connection");
            assert!(line.contains("uid 65534"), "{line:?}");
            // A client that sends and closes at once: its socket, closed, was listed as
            // root's (`TIME_WAIT`) when the forwarder looked late. Refused either way.
            let quick = as_nobody(
                "127.0.0.1",
                &port,
                "s.sendall(b'FLUSHALL\\r\\n'); s.close()",
            )
            .status()
            .expect("python3 as nobody");
            assert!(quick.success());
            next_line("refused a connection");
            // Nothing was opened for it; the forwarder's own connection is forwarded, and
            // the refusal's body, sent after its head, is read whole.
            let _own = std::net::TcpStream::connect(addr.trim()).expect("connect");
            let line = next_line("connection from");
            assert!(line.contains("stand-in refused the stream"), "{line:?}");
            assert_eq!(seen.load(Ordering::SeqCst), before + 1);
            // ::1 at the same port is the forwarder's too (a browser told `localhost` may
            // try it first): nobody else can listen there, another user's connection over
            // it is refused, the forwarder's own is forwarded.
            let v6 = format!("[::1]:{port}");
            assert!(
                std::net::TcpListener::bind(&v6).is_err(),
                "another process could listen on {v6}"
            );
            let quick6 = as_nobody("::1", &port, "time.sleep(1)")
                .status()
                .expect("python3 as nobody");
            assert!(quick6.success());
            let line = next_line("refused a connection");
            assert!(
                line.contains("[::1]") && line.contains("uid 65534"),
                "{line:?}"
            );
            let _own6 = std::net::TcpStream::connect(&v6).expect("connect over ::1");
            let line = next_line("connection from");
            assert!(line.contains("[::1]"), "{line:?}");
            assert_eq!(seen.load(Ordering::SeqCst), before + 2);
        }
        let _ = nobody.kill();
        let _ = nobody.wait();
        let _ = child.kill();
        let _ = child.wait();
    }
}
