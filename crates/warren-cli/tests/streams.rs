//! Guest streams through the service on one real VM: `warren attach` with half-close, 100 MiB
//! each way through one stream with checksums on both ends, every refusal before the guest, the VM quota, `vm cp` both ways (modes, symlinks, checksums),
//! `warren port-forward` of a guest HTTP server, suspend refused while a stream is open,
//! revocation closing an open stream within the recheck period, and destroy closing with
//! 1001 `destroyed`.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::daemon::{wait_job, Daemon};
use common::WARREN;
use serde_json::json;
use sha2::{Digest, Sha256};

/// A guest listener on 127.0.0.1:5000 that reads to end of input, then answers the input
/// upper-cased and closes (a reply after the client's half-close).
const UPPER: &str = r#"
import socket, threading
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", 5000)); s.listen(16)
def serve(c):
    d = b""
    while True:
        x = c.recv(65536)
        if not x: break
        d += x
    c.sendall(d.upper()); c.close()
while True:
    c, _ = s.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"#;

/// A guest listener on 127.0.0.1:5002 that echoes its input and, once it ended, writes the
/// SHA-256 of what it received to /tmp/echo.sha256 before closing.
const ECHO: &str = r#"
import socket, hashlib
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", 5002)); s.listen(4)
while True:
    c, _ = s.accept()
    h = hashlib.sha256()
    while True:
        x = c.recv(1 << 20)
        if not x: break
        h.update(x); c.sendall(x)
    open("/tmp/echo.sha256", "w").write(h.hexdigest())
    c.close()
"#;

/// Bytes each way through one stream.
const BULK: usize = 100 << 20;

fn attach(
    d: &Daemon,
    token_file: &std::path::Path,
    vm: &str,
    port: &str,
    extra: &[&str],
) -> Command {
    let mut c = Command::new(WARREN);
    c.args(["attach", vm, "--port", port, "--endpoint"])
        .arg(format!("http://{}", d.addr))
        .arg("--token-file")
        .arg(token_file)
        .args(extra);
    c
}

fn wait_exit(child: &mut Child, limit: Duration) -> Option<std::process::ExitStatus> {
    let t = Instant::now();
    while t.elapsed() < limit {
        if let Some(s) = child.try_wait().expect("try_wait") {
            return Some(s);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    None
}

#[test]
fn test_streams_attach_refusals_copy_forward_and_lifecycle_closes() {
    let d = Daemon::start("[streams]\nmax_streams_per_vm = 2\n");
    let t = d.token("alice", &[]);
    let other = d.token("bob", &[]);
    let tf = d.token_file(&t);
    let vm = d.ok(&t, "vm_create", json!({"request_id": "s1", "image": "dev"}))["vm_id"]
        .as_str()
        .expect("vm_id")
        .to_string();
    let started = d.ok(
        &t,
        "vm_exec",
        json!({"vm_id": vm, "request_id": "e1", "argv": ["python3", "-c", UPPER], "wait_ms": 0}),
    );
    assert!(started["job_id"].is_string(), "{started}");
    d.ok(
        &t,
        "vm_exec",
        json!({"vm_id": vm, "request_id": "e0", "argv": ["python3", "-c", ECHO], "wait_ms": 0}),
    );
    // The listeners are up once a connect succeeds.
    let (_, ready) = sh(
        &d,
        &t,
        &vm,
        "r1",
        "for i in $(seq 100); do python3 -c 'import socket; [socket.create_connection((\"127.0.0.1\", p)).close() for p in (5000, 5002)]' 2>/dev/null && exit 0; sleep 0.2; done; exit 1",
    );
    assert_eq!(ready["exit_code"], 0, "{ready}");

    // attach: the input, its end, then the guest's reply after the half-close.
    let out = attach(&d, &tf, &vm, "5000", &[])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            c.stdin.take().expect("stdin").write_all(b"hello stream")?;
            c.wait_with_output()
        })
        .expect("attach");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "HELLO STREAM",
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(out.status.code(), Some(0));

    // 100 MiB each way through one stream: sent, echoed, checksummed on both ends.
    let started = Instant::now();
    let mut echo = attach(&d, &tf, &vm, "5002", &[])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("attach");
    let mut stdin = echo.stdin.take().expect("stdin");
    let writer = std::thread::spawn(move || {
        let mut sent = Sha256::new();
        for i in 0..(BULK >> 20) as u32 {
            let piece: Vec<u8> = (0..1u32 << 20)
                .map(|j| ((i << 20 | j).wrapping_mul(2654435761) >> 13) as u8)
                .collect();
            sent.update(&piece);
            stdin.write_all(&piece).expect("send");
        }
        hex::encode(sent.finalize())
    });
    let mut stdout = echo.stdout.take().expect("stdout");
    let (mut got, mut back) = (0usize, Sha256::new());
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = stdout.read(&mut buf).expect("receive");
        if n == 0 {
            break;
        }
        back.update(&buf[..n]);
        got += n;
    }
    let sent = writer.join().expect("writer");
    let status = echo.wait().expect("attach exit");
    let mut err = String::new();
    let _ = echo.stderr.take().expect("stderr").read_to_string(&mut err);
    assert_eq!((status.code(), got), (Some(0), BULK), "{err}");
    assert_eq!(hex::encode(back.finalize()), sent, "the echo differs");
    let (guest_sum, check) = sh(&d, &t, &vm, "x1", "cat /tmp/echo.sha256");
    assert_eq!(check["exit_code"], 0, "{check}");
    assert_eq!(guest_sum.trim(), sent, "the guest received other bytes");
    eprintln!("100 MiB each way in {:?}", started.elapsed());

    // Refusals, all before the guest is asked to connect anything.
    let path = |port: &str| format!("/v1/vms/{vm}/streams/{port}");
    assert_eq!(d.upgrade_status(None, &path("5000")).0, 401);
    assert_eq!(
        d.upgrade_status(Some(&other), &path("5000")),
        (404, "not_found".into())
    );
    for port in ["1023", "1024", "80", "x"] {
        assert_eq!(
            d.upgrade_status(Some(&t), &path(port)),
            (403, "forbidden".into()),
            "{port}"
        );
    }
    assert_eq!(
        d.upgrade_status(Some(&t), &path("5001")),
        (409, "conflict".into())
    );
    // Not an upgrade at all: refused after the checks that need no guest.
    let r = d.request(
        "GET",
        &path("5000"),
        &[("Authorization", &format!("Bearer {t}"))],
        b"",
    );
    assert_eq!(
        (r.status, r.code()),
        (400, "invalid_argument"),
        "{}",
        r.text
    );

    // Two held streams fill the VM's quota; a third is refused; status counts them.
    let mut held: Vec<Child> = (0..2).map(|_| held_attach(&d, &tf, &vm)).collect();
    let t0 = Instant::now();
    loop {
        let st = d.ok(&t, "vm_status", json!({"vm_id": vm}));
        if st["open_streams"] == 2 {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "streams never opened: {st}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(
        d.upgrade_status(Some(&t), &path("5000")),
        (409, "busy".into())
    );
    let r = d.call(&t, "vm_suspend", json!({"vm_id": vm, "mode": "pause"}));
    assert_eq!(r.code(), "busy", "{}", r.text);
    for mut c in held.drain(..) {
        let _ = c.kill();
        let _ = c.wait();
    }

    // vm cp both ways through the service: modes, symlinks, a checksummed file.
    let host = tempfile::tempdir().expect("tmp");
    let tree = host.path().join("tree");
    std::fs::create_dir_all(tree.join("bin")).expect("mkdir");
    std::fs::write(tree.join("bin/run"), "#!/bin/sh\necho ran\n").expect("write");
    std::fs::set_permissions(tree.join("bin/run"), std::fs::Permissions::from_mode(0o750))
        .expect("chmod");
    std::os::unix::fs::symlink("bin/run", tree.join("run")).expect("symlink");
    let big: Vec<u8> = (0..(8u32 << 20))
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    std::fs::write(tree.join("big"), &big).expect("big");
    let service = [
        "--endpoint".to_string(),
        format!("http://{}", d.addr),
        "--token-file".into(),
        tf.display().to_string(),
    ];
    let cp = |src: &str, dst: &str| {
        let out = Command::new(WARREN)
            .args(["vm", "cp", src, dst])
            .args(&service)
            .output()
            .expect("cp");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, err) = cp(tree.to_str().expect("utf-8"), &format!("{vm}:/tmp/in"));
    assert_eq!(code, Some(0), "{err}");
    let (stdout, check) = sh(
        &d,
        &t,
        &vm,
        "c1",
        "/tmp/in/tree/run && stat -c %a /tmp/in/tree/bin/run && readlink /tmp/in/tree/run && sha256sum /tmp/in/tree/big",
    );
    let sum = hex::encode(Sha256::digest(&big));
    assert_eq!(check["exit_code"], 0, "{check}");
    assert!(stdout.starts_with("ran\n750\nbin/run\n"), "{stdout}");
    assert!(stdout.contains(&sum), "{stdout}");
    // An existing copy is never replaced.
    let (code, err) = cp(tree.to_str().expect("utf-8"), &format!("{vm}:/tmp/in"));
    assert_eq!(code, Some(125), "{err}");
    assert!(err.contains("exists"), "{err}");
    // A directory the guest user cannot make refuses the copy before any byte, with the
    // guest's reason.
    let (code, err) = cp(tree.to_str().expect("utf-8"), &format!("{vm}:/root/denied"));
    assert_ne!(code, Some(0), "{err}");
    assert!(
        err.contains("forbidden") && err.contains("ermission denied"),
        "{err}"
    );
    // Neither copy left its staging directory behind in the guest, and the refused one
    // changed nothing.
    let (listing, check) = sh(
        &d,
        &t,
        &vm,
        "c2",
        "ls -A /tmp/in && sha256sum /tmp/in/tree/big",
    );
    assert_eq!(check["exit_code"], 0, "{check}");
    assert!(listing.starts_with("tree\n"), "{listing}");
    assert!(listing.contains(&sum), "{listing}");
    let back = host.path().join("back");
    let (code, err) = cp(&format!("{vm}:/tmp/in/tree"), back.to_str().expect("utf-8"));
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(std::fs::read(back.join("tree/big")).expect("big back"), big);
    let mode = std::fs::metadata(back.join("tree/bin/run"))
        .expect("run")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o750);
    assert_eq!(
        std::fs::read_link(back.join("tree/run")).expect("link"),
        std::path::Path::new("bin/run")
    );
    assert!(std::fs::read_dir(&back).expect("ls").all(|e| !e
        .expect("entry")
        .file_name()
        .to_string_lossy()
        .starts_with(".warren-cp")));

    // A copy the host cannot pack whole (a tree deeper than the packer walks) is never
    // ended cleanly: the guest places none of it, and removes what it unpacked.
    let partial = host.path().join("partial");
    std::fs::create_dir_all(partial.join("d")).expect("mkdir");
    std::fs::write(partial.join("d/a"), "a").expect("a");
    let deep: std::path::PathBuf = std::iter::repeat_n("x", 300).collect();
    std::fs::create_dir_all(partial.join(deep)).expect("deep");
    let (code, err) = cp(
        partial.to_str().expect("utf-8"),
        &format!("{vm}:/tmp/partial"),
    );
    assert_ne!(code, Some(0), "{err}");
    assert!(err.contains("deeper than"), "{err}");
    let t0 = Instant::now();
    loop {
        let (listing, check) = sh(
            &d,
            &t,
            &vm,
            &format!("p{}", t0.elapsed().as_millis()),
            "ls -A /tmp/partial",
        );
        assert_eq!(check["exit_code"], 0, "{check}");
        assert!(
            !listing.contains("partial"),
            "a partial copy was placed: {listing}"
        );
        if listing.is_empty() {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "staging left: {listing}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }

    // port-forward: a guest HTTP server opens from host loopback.
    d.ok(&t, "vm_exec", json!({"vm_id": vm, "request_id": "e4", "argv": ["sh", "-c",
        "mkdir -p /tmp/site && echo forwarded-page > /tmp/site/index.html && cd /tmp/site && exec python3 -m http.server 8000 --bind 127.0.0.1"],
        "wait_ms": 0}));
    let mut fwd = Command::new(WARREN)
        .args(["port-forward", &vm, "0:8000"])
        .args(&service)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("port-forward");
    let mut line = String::new();
    BufReader::new(fwd.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("address");
    let addr = line.trim().to_string();
    let t0 = Instant::now();
    let page = loop {
        let mut s = std::net::TcpStream::connect(&addr).expect("connect forward");
        s.set_read_timeout(Some(Duration::from_secs(60))).ok();
        s.write_all(b"GET /index.html HTTP/1.0\r\nHost: x\r\n\r\n")
            .expect("request");
        let mut resp = String::new();
        let _ = s.read_to_string(&mut resp);
        if resp.contains("200") {
            break resp;
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "no page: {resp}");
        std::thread::sleep(Duration::from_millis(300));
    };
    assert!(page.contains("forwarded-page"), "{page}");
    let _ = fwd.kill();
    let _ = fwd.wait();

    // Destroy closes an open stream with 1001 destroyed; revocation (on a second VM's
    // stream) closes within the recheck period (5 s) with 1008.
    let vm2 = d.ok(&t, "vm_create", json!({"request_id": "s2", "image": "dev"}))["vm_id"]
        .as_str()
        .expect("vm_id")
        .to_string();
    d.ok(
        &t,
        "vm_exec",
        json!({"vm_id": vm2, "request_id": "e5", "argv": ["python3", "-c", UPPER], "wait_ms": 0}),
    );
    let mut c = held_attach(&d, &tf, &vm);
    std::thread::sleep(Duration::from_secs(2));
    d.ok(&t, "vm_destroy", json!({"vm_id": vm}));
    let err = closed(&mut c, "destroy closes the stream");
    assert!(err.contains("1001 destroyed"), "{err}");

    let before = token_ids(&d);
    let t2 = d.token("alice", &[]);
    let tf2 = d.token_file(&t2);
    let id2 = token_ids(&d)
        .into_iter()
        .find(|i| !before.contains(i))
        .expect("new token id");
    let t0 = Instant::now();
    let mut c = loop {
        let mut c = held_attach(&d, &tf2, &vm2);
        // Until the second VM's listener is up, the attach is refused at once.
        match wait_exit(&mut c, Duration::from_secs(3)) {
            None => break c,
            Some(_) => assert!(t0.elapsed() < Duration::from_secs(60), "no listener on vm2"),
        }
    };
    let out = d.env.run(&["token", "revoke", &id2]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let revoked = Instant::now();
    let err = closed(&mut c, "revocation closes the stream");
    assert!(
        revoked.elapsed() < Duration::from_secs(12),
        "{:?}",
        revoked.elapsed()
    );
    assert!(err.contains("1008"), "{err}");

    // A VM destroyed outside the service (the CLI on the same state directory) closes its
    // streams with 1001 destroyed too, not 1011 (its channel went down under them).
    let mut c = held_attach(&d, &tf, &vm2);
    std::thread::sleep(Duration::from_secs(2));
    assert!(c.try_wait().expect("try_wait").is_none(), "attach ended");
    let out = d.env.run(&["vm", "destroy", &vm2]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let err = closed(&mut c, "a destroy by the CLI closes the stream");
    assert!(err.contains("1001 destroyed"), "{err}");
}

/// An attach to port 5000 held open after its (empty) stdin ends; stderr kept.
fn held_attach(d: &Daemon, token_file: &std::path::Path, vm: &str) -> Child {
    attach(d, token_file, vm, "5000", &["--ignore-stdin-eof"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("attach")
}

/// Waits (at most 30 s) for a held attach the service closed: it exits 1; its stderr.
fn closed(c: &mut Child, what: &str) -> String {
    let status = wait_exit(c, Duration::from_secs(30)).expect(what);
    assert_eq!(status.code(), Some(1));
    let mut err = String::new();
    c.stderr
        .take()
        .expect("stderr")
        .read_to_string(&mut err)
        .expect("stderr");
    err
}

/// Runs a shell script in the guest to its end: its stdout and final output page.
fn sh(d: &Daemon, t: &str, vm: &str, id: &str, script: &str) -> (String, serde_json::Value) {
    let r = d.ok(
        t,
        "vm_exec",
        json!({"vm_id": vm, "request_id": id, "argv": ["sh", "-c", script], "wait_ms": 0}),
    );
    let job = r["job_id"].as_str().expect("job_id").to_string();
    wait_job(d, t, vm, &job)
}

fn token_ids(d: &Daemon) -> Vec<String> {
    let out = d.env.run(&["token", "list", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("token list json");
    v.as_array()
        .expect("array")
        .iter()
        .filter_map(|t| t["id"].as_str().map(str::to_string))
        .collect()
}
