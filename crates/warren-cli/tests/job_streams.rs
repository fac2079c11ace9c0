//! Jobs over the service's WebSockets on one real VM: live output (arriving while the job
//! runs, resumable from byte cursors), remote terminals (input, window size, reconnecting
//! without losing the process, a newer attachment replacing an older), refusals before the
//! upgrade, and `warren vm exec` through the service: over HTTP with live output and exit
//! codes, `-i` with streamed and binary input, and through the local socket across a restart
//! of the service in the middle of a job (nothing lost, nothing repeated).

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::daemon::Daemon;
use common::wsclient::{Got, WsClient};
use common::WARREN;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

const WAIT: Duration = Duration::from_secs(120);

fn text_of(got: &[Got], tag: u8) -> String {
    let mut out = Vec::new();
    for g in got {
        if let Got::Binary(b) = g {
            if b.first() == Some(&tag) {
                out.extend_from_slice(&b[1..]);
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Output bytes in `got` (tags not counted).
fn received(got: &[Got]) -> u64 {
    got.iter()
        .map(|g| match g {
            Got::Binary(b) => b.len() as u64 - 1,
            _ => 0,
        })
        .sum()
}

fn exit_event(got: &[Got]) -> Option<Value> {
    got.iter().find_map(|g| match g {
        Got::Text(t) => serde_json::from_str(t).ok(),
        _ => None,
    })
}

fn start(d: &Daemon, t: &str, vm: &str, rid: &str, extra: Value) -> String {
    let mut args = json!({"vm_id": vm, "request_id": rid});
    for (k, v) in extra.as_object().expect("object") {
        args[k] = v.clone();
    }
    d.ok(t, "vm_exec", args)["job_id"]
        .as_str()
        .expect("job_id")
        .to_string()
}

fn exec_http(d: &Daemon, tf: &std::path::Path, vm: &str, extra: &[&str]) -> Command {
    let mut c = Command::new(WARREN);
    c.args(["vm", "exec", vm, "--endpoint"])
        .arg(format!("http://{}", d.addr))
        .arg("--token-file")
        .arg(tf)
        .args(extra);
    c
}

#[test]
fn test_job_streams_live_output_terminals_and_exec_through_the_service() {
    let mut d = Daemon::start("");
    let t = d.token("alice", &[]);
    let other = d.token("bob", &[]);
    let tf = d.token_file(&t);
    let vm = d.ok(&t, "vm_create", json!({"request_id": "c1", "image": "dev"}))["vm_id"]
        .as_str()
        .expect("vm_id")
        .to_string();

    // Live output: each line arrives while the job still runs (it sleeps after each).
    let job = start(
        &d,
        &t,
        &vm,
        "live",
        json!({"command": "for i in 1 2 3; do echo out$i; echo err$i >&2; sleep 2; done; exit 7"}),
    );
    let mut ws = WsClient::connect(&d.addr, &t, &format!("/v1/vms/{vm}/jobs/{job}/output"))
        .expect("output stream");
    let t0 = Instant::now();
    let first = ws.until(WAIT, |g| text_of(g, 1).contains("out1"));
    let first_at = t0.elapsed();
    let rest = ws.until(WAIT, |g| {
        matches!(g.last(), Some(Got::Close(..) | Got::Gone))
    });
    let all_at = t0.elapsed();
    let mut got = first;
    got.extend(rest);
    assert_eq!(text_of(&got, 1), "out1\nout2\nout3\n", "{got:?}");
    assert_eq!(text_of(&got, 2), "err1\nerr2\nerr3\n", "{got:?}");
    assert!(
        all_at - first_at >= Duration::from_secs(3),
        "the first line came {first_at:?}, the end {all_at:?}: not live"
    );
    let ev = exit_event(&got).expect("exit event");
    assert_eq!(ev["exit_code"], 7, "{ev}");
    assert_eq!(
        ev["next_cursor"],
        json!({"stdout": 15, "stderr": 15}),
        "{ev}"
    );
    assert_eq!(
        got.last(),
        Some(&Got::Close(1000, "job finished".into())),
        "{got:?}"
    );

    // Resumed from cursors: only what lies past them, then the end.
    let mut ws = WsClient::connect(
        &d.addr,
        &t,
        &format!("/v1/vms/{vm}/jobs/{job}/output?stdout=5&stderr=10"),
    )
    .expect("resumed");
    let got = ws.until(WAIT, |g| matches!(g.last(), Some(Got::Close(..))));
    assert_eq!(text_of(&got, 1), "out2\nout3\n", "{got:?}");
    assert_eq!(text_of(&got, 2), "err3\n", "{got:?}");

    // Refusals before the upgrade; input to the output stream is a policy violation.
    let path = |job: &str, what: &str| format!("/v1/vms/{vm}/jobs/{job}/{what}");
    assert_eq!(d.upgrade_status(None, &path(&job, "output")).0, 401);
    assert_eq!(
        d.upgrade_status(Some(&other), &path(&job, "output")),
        (404, "not_found".into())
    );
    assert_eq!(
        d.upgrade_status(Some(&t), &path("999999", "output")),
        (404, "not_found".into())
    );
    assert_eq!(
        d.upgrade_status(Some(&t), &path("x", "output")),
        (400, "invalid_argument".into())
    );
    assert_eq!(
        d.upgrade_status(Some(&t), &path(&job, "other")),
        (404, "not_found".into())
    );
    assert_eq!(
        d.upgrade_status(Some(&t), &format!("{}?stdout=99999", path(&job, "output"))),
        (400, "invalid_argument".into())
    );
    assert_eq!(
        d.upgrade_status(Some(&t), &format!("{}?until=never", path(&job, "output"))),
        (400, "invalid_argument".into())
    );
    let long = start(&d, &t, &vm, "long", json!({"argv": ["sleep", "30"]}));
    let mut ws = WsClient::connect(&d.addr, &t, &path(&long, "output")).expect("long");
    ws.send_binary(b"input");
    let got = ws.until(WAIT, |g| matches!(g.last(), Some(Got::Close(..))));
    assert!(
        matches!(got.last(), Some(Got::Close(1008, r)) if r.contains("no input")),
        "{got:?}"
    );
    d.ok(&t, "vm_job_cancel", json!({"vm_id": vm, "job_id": long}));

    // A terminal: input, window size, a reconnection that loses nothing, a takeover.
    let term = start(
        &d,
        &t,
        &vm,
        "term",
        json!({"argv": ["bash", "--norc", "--noprofile", "-i"], "tty": {"rows": 24, "cols": 80},
               "env": {"PS1": "$ "}}),
    );
    // With acknowledgements, the guest keeps what the client has not acknowledged.
    let tpath = format!("{}?ack=true", path(&term, "terminal"));
    let mut a = WsClient::connect(&d.addr, &t, &tpath).expect("terminal");
    a.send_text(r#"{"resize":{"rows":40,"cols":100}}"#);
    a.send_binary(b"stty size; echo marker-$((6*7))\n");
    let got = a.until(WAIT, |g| text_of(g, 1).contains("marker-42\r\n"));
    let seen = text_of(&got, 1);
    assert!(seen.contains("40 100"), "{seen:?}");
    let all = got
        .iter()
        .filter_map(|g| match g {
            Got::Binary(b) => Some(b[1..].to_vec()),
            _ => None,
        })
        .flatten()
        .collect::<Vec<u8>>();
    // The client's connection breaks without acknowledging, having lost (say) the last 5
    // bytes the service sent; the shell runs on. Reattached at its own cursor, the client
    // gets those bytes again: the guest kept all that was not acknowledged.
    a.abandon();
    d.ok(
        &t,
        "vm_exec",
        json!({"vm_id": vm, "request_id": "noop", "argv": ["true"], "wait_ms": 10000}),
    );
    let mut cursor = all.len() as u64 - 5;
    let mut b =
        WsClient::connect(&d.addr, &t, &format!("{tpath}&stdout={cursor}")).expect("reattach");
    let got = b.until(WAIT, |g| received(g) >= 5);
    // (The prompt the shell printed after a's last read may follow them.)
    let again = text_of(&got, 1);
    assert!(
        again.as_bytes().starts_with(&all[all.len() - 5..]),
        "the lost bytes again: {again:?}"
    );
    cursor += received(&got);
    b.send_binary(b"echo again-$((7*6))\n");
    let got = b.until(WAIT, |g| text_of(g, 1).contains("again-42\r\n"));
    let seen = text_of(&got, 1);
    assert!(!seen.contains("marker-42"), "output repeated: {seen:?}");
    cursor += received(&got);
    // b acknowledges all it has: output before that is gone once the service's next read
    // released it.
    b.send_text(&format!(r#"{{"ack":{{"stdout":{cursor},"stderr":0}}}}"#));
    b.send_binary(b"echo acked\n");
    let got = b.until(WAIT, |g| text_of(g, 1).contains("acked\r\n"));
    cursor += received(&got);
    let t0 = Instant::now();
    loop {
        match WsClient::connect(&d.addr, &t, &format!("{tpath}&stdout=0")) {
            Err(400) => break,
            Err(other) => panic!("reading released output: {other}"),
            Ok(_) => {
                assert!(
                    t0.elapsed() < WAIT,
                    "acknowledged output was never released"
                );
                // That attachment replaced b: take the terminal back.
                b = WsClient::connect(&d.addr, &t, &format!("{tpath}&stdout={cursor}"))
                    .expect("reattach");
                b.send_binary(b"\n");
                let got = b.until(WAIT, |g| !g.is_empty());
                cursor += received(&got);
                std::thread::sleep(Duration::from_millis(200));
            }
        }
    }
    // An acknowledgement past what was sent breaks the rules.
    let refused = WsClient::connect(&d.addr, &t, &format!("{tpath}&stdout=999999")).err();
    assert_eq!(refused, Some(400), "a cursor past the output is refused");
    // A newer attachment replaces the older, which is told why.
    let mut c =
        WsClient::connect(&d.addr, &t, &format!("{tpath}&stdout={cursor}")).expect("takeover");
    let got = b.until(WAIT, |g| matches!(g.last(), Some(Got::Close(..))));
    assert_eq!(
        got.last(),
        Some(&Got::Close(1001, "replaced by another attachment".into())),
        "{got:?}"
    );
    c.send_text(r#"{"ack":{"stdout":99999999,"stderr":0}}"#);
    let got = c.until(WAIT, |g| matches!(g.last(), Some(Got::Close(..))));
    assert!(
        matches!(got.last(), Some(Got::Close(1008, r)) if r.contains("acknowledgement")),
        "{got:?}"
    );
    let mut c =
        WsClient::connect(&d.addr, &t, &format!("{tpath}&stdout={cursor}")).expect("attach");
    c.send_binary(b"exit 3\n");
    let got = c.until(WAIT, |g| matches!(g.last(), Some(Got::Close(..))));
    let ev = exit_event(&got).expect("exit event");
    assert_eq!(ev["exit_code"], 3, "{ev}");

    // `warren vm exec` over HTTP: live output, stderr apart, the exit code.
    let mut child = exec_http(
        &d,
        &tf,
        &vm,
        &[
            "--",
            "sh",
            "-c",
            "echo first; sleep 3; echo second >&2; exit 5",
        ],
    )
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .expect("vm exec");
    let mut out = BufReader::new(child.stdout.take().expect("stdout"));
    let t0 = Instant::now();
    let mut line = String::new();
    out.read_line(&mut line).expect("line");
    let first_at = t0.elapsed();
    assert_eq!(line, "first\n");
    let status = child.wait().expect("wait");
    assert!(
        t0.elapsed() - first_at >= Duration::from_secs(2),
        "first line {first_at:?}, exit {:?}: not live",
        t0.elapsed()
    );
    let mut err = String::new();
    child
        .stderr
        .take()
        .expect("stderr")
        .read_to_string(&mut err)
        .expect("stderr");
    assert_eq!((status.code(), err.as_str()), (Some(5), "second\n"));

    // `-i`: stdin streamed to the job, its end closing the job's input.
    let out = exec_http(
        &d,
        &tf,
        &vm,
        &["-i", "--", "sh", "-c", "cat; echo done >&2"],
    )
    .stdin(Stdio::piped())
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .and_then(|mut c| {
        c.stdin.take().expect("stdin").write_all(b"a\nb\n")?;
        c.wait_with_output()
    })
    .expect("exec -i");
    assert_eq!(
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).as_ref(),
            String::from_utf8_lossy(&out.stderr).as_ref()
        ),
        (Some(0), "a\nb\n", "done\n")
    );
    // `--stdin` with binary input larger than a start's own stdin: streamed, checksummed.
    let data: Vec<u8> = (0..300_000u32).map(|i| (i * 7 % 251) as u8).collect();
    let out = exec_http(&d, &tf, &vm, &["--stdin", "--", "sha256sum"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            c.stdin.take().expect("stdin").write_all(&data)?;
            c.wait_with_output()
        })
        .expect("exec --stdin");
    let want = format!("{:x}  -\n", Sha256::digest(&data));
    assert_eq!(String::from_utf8_lossy(&out.stdout), want);

    // Through the local socket as root (the VM is alice's: root acts as its workspace), with
    // the service restarted mid-job: the output arrives whole, once, and the code with it.
    let mut child = d
        .env
        .cmd()
        .args([
            "--socket",
            d.socket.to_str().expect("socket path"),
            "vm",
            "exec",
            &vm,
            "--",
            "sh",
            "-c",
            "for i in 1 2 3 4 5 6; do echo line$i; sleep 1; done; exit 9",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("vm exec via socket");
    let mut out = BufReader::new(child.stdout.take().expect("stdout"));
    let mut line = String::new();
    out.read_line(&mut line).expect("line");
    assert_eq!(line, "line1\n");
    d.stop();
    d.spawn();
    let mut rest = String::new();
    out.read_to_string(&mut rest).expect("rest");
    let status = child.wait().expect("wait");
    let mut err = String::new();
    child
        .stderr
        .take()
        .expect("stderr")
        .read_to_string(&mut err)
        .ok();
    assert_eq!(
        format!("{line}{rest}"),
        "line1\nline2\nline3\nline4\nline5\nline6\n",
        "{err}"
    );
    assert_eq!(status.code(), Some(9), "{err}");

    // The job the terminal ran is complete; nothing is left streaming.
    let last = d.ok(&t, "vm_job_status", json!({"vm_id": vm, "job_id": term}));
    assert_eq!(last["exit_code"], 3, "{last}");
    let st = d.ok(&t, "vm_status", json!({"vm_id": vm}));
    assert_eq!(st["open_streams"], 0, "{st}");
    d.ok(&t, "vm_destroy", json!({"vm_id": vm}));
}
