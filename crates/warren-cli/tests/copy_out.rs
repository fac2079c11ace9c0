//! `warren vm cp VM:path DIR` against a hostile guest's archive, without a VM: a stand-in
//! service on a UNIX socket (`--socket`) answers the copy's WebSocket with the bytes a
//! hostile guest's `tar` would send. The unpacker's own rules are tested beside it
//! (`warren-cli` `copy::tests`, `warren-image` `unpack::tests`).

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use futures_util::SinkExt;
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
                    let Ok(mut ws) = tokio_tungstenite::accept_async(conn).await else {
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
