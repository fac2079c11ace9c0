//! A guest that plants a FIFO or a link to `/dev/zero` where the host reads its session copy
//! stalls or fails only its own session's calls: host git runs on the service's blocking pool
//! with a deadline, and reads no link the guest planted. Other workspaces are served as before.

mod common;

use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::daemon::Daemon;
use serde_json::{json, Value};

/// The 99th percentile (the largest of fewer than 100 samples but one) of `n` calls.
fn p99(d: &Daemon, token: &str, n: usize) -> Duration {
    let mut samples: Vec<Duration> = (0..n)
        .map(|_| {
            let t = Instant::now();
            let r = d.call(token, "vm_list", json!({}));
            assert_eq!(r.status, 200, "{}", r.text);
            t.elapsed()
        })
        .collect();
    samples.sort();
    samples[(n * 99 / 100).min(n - 1)]
}

/// Files named `name` under `root` that are FIFOs.
fn fifos(root: &Path, name: &str) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut todo = vec![root.to_path_buf()];
    while let Some(dir) = todo.pop() {
        let Ok(rd) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in rd.flatten() {
            let Ok(ft) = e.file_type() else { continue };
            if ft.is_dir() {
                todo.push(e.path());
            } else if ft.is_fifo() && e.file_name() == name {
                out.push(e.path());
            }
        }
    }
    out
}

fn exec(d: &Daemon, vm: &str, id: &str, command: &str) -> Value {
    let r = d.local_call(
        "vm_exec",
        json!({"request_id": id, "vm_id": vm, "wait_ms": 30000, "command": command}),
        &[],
    );
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.body["exit_code"], 0, "{command}: {}", r.text);
    r.body
}

#[test]
fn test_planted_fifo_and_dev_zero_in_a_session_stall_only_that_session() {
    common::ensure_image("minimal");
    let d = Daemon::start("");
    let other = d.token("tok-other", &[]);
    let (_dir, repo) = common::one_commit_repo();
    let r = d.local_call(
        "session_create",
        json!({"repo": repo.to_str().expect("utf-8"), "name": "hostile"}),
        &[],
    );
    assert_eq!(r.status, 200, "{}", r.text);
    let vm = r.body["vm_id"].as_str().expect("vm_id").to_string();
    let status = |d: &Daemon| d.local_call("session_status", json!({"session": "hostile"}), &[]);
    // Positive control: a clean session reports clean.
    let r = status(&d);
    assert_eq!(r.status, 200, "{}", r.text);

    let base = p99(&d, &other, 60);
    eprintln!("other workspace p99 before the attack: {base:?}");

    // A FIFO where host git opens a file by name: every status call blocks in git on it.
    exec(&d, &vm, "fifo", "mkfifo /workspace/.gitignore");
    let state = d.env.state.path().to_path_buf();
    let planted = fifos(&state, ".gitignore");
    assert_eq!(
        planted.len(),
        1,
        "the planted FIFO on the host: {planted:?}"
    );
    let started = Instant::now();
    let callers: Vec<_> = (0..4)
        .map(|_| {
            let socket = d.socket.clone();
            std::thread::spawn(move || {
                let mut s = std::os::unix::net::UnixStream::connect(&socket).expect("connect");
                s.set_read_timeout(Some(Duration::from_secs(300))).ok();
                let body = json!({"session": "hostile"}).to_string();
                let req = format!(
                    "POST /v1/tools/session_status HTTP/1.1\r\nHost: warrend\r\n\
                     Content-Type: application/json\r\nContent-Length: {}\r\n\
                     Connection: close\r\n\r\n{body}",
                    body.len()
                );
                use std::io::{Read, Write};
                s.write_all(req.as_bytes()).expect("send");
                let mut out = Vec::new();
                let _ = s.read_to_end(&mut out);
                (Instant::now(), String::from_utf8_lossy(&out).into_owned())
            })
        })
        .collect();
    std::thread::sleep(Duration::from_secs(3));
    assert!(
        callers.iter().all(|c| !c.is_finished()),
        "the attack must really block host git (positive control)"
    );
    let attacked = p99(&d, &other, 60);
    eprintln!("other workspace p99 while 4 status calls block on a FIFO: {attacked:?}");
    // 2x, with a floor for sub-millisecond baselines on a loaded machine.
    let bound = (base * 2).max(base + Duration::from_millis(100));
    assert!(
        attacked <= bound,
        "{attacked:?} > {bound:?} (baseline {base:?})"
    );

    // Ending the attack from the host (a writer opens and closes the FIFO) lets git go on.
    let unblocked = Instant::now();
    while callers.iter().any(|c| !c.is_finished()) {
        if let Ok(f) = std::fs::OpenOptions::new()
            .write(true)
            .custom_flags(nix::libc::O_NONBLOCK)
            .open(&planted[0])
        {
            drop(f);
        }
        assert!(
            unblocked.elapsed() < Duration::from_secs(60),
            "status calls never finished"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    for c in callers {
        let (done, text) = c.join().expect("caller");
        assert!(done.duration_since(started) >= Duration::from_secs(3));
        assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    }

    // A link to /dev/zero where the host copies a file of the session's git directory is
    // refused at once, and one where git reads patterns is not followed.
    exec(
        &d,
        &vm,
        "zero",
        "rm /workspace/.gitignore && ln -s /dev/zero /workspace/.gitignore && \
         ln -sf /dev/zero /workspace/.git/index",
    );
    let t = Instant::now();
    let r = status(&d);
    eprintln!(
        "status over a /dev/zero index: {} in {:?}",
        r.status,
        t.elapsed()
    );
    assert!(r.status >= 400, "{}", r.text);
    assert!(!r.code().is_empty(), "{}", r.text);
    assert!(t.elapsed() < Duration::from_secs(60));
    exec(&d, &vm, "index", "rm /workspace/.git/index");
    let t = Instant::now();
    let r = status(&d);
    assert_eq!(
        r.status, 200,
        "a /dev/zero .gitignore is not followed: {}",
        r.text
    );
    assert!(t.elapsed() < Duration::from_secs(60));
    let after = p99(&d, &other, 30);
    eprintln!("other workspace p99 after: {after:?}");
    let r = d.local_call(
        "session_delete",
        json!({"session": "hostile", "force": true}),
        &[],
    );
    assert_eq!(r.status, 200, "{}", r.text);
}
