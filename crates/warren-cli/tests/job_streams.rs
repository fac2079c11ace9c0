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
    // Streams pass at most 2 MiB/s each way (the rate limit's check below).
    let mut d = Daemon::start("[streams]\nrate_bytes = 2097152\n");
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

    mcp_through_attach(&d, &t, &tf, &vm);
    rate_and_suspend(&d, &t, &tf, &vm);
    broker_pipe(&d, &t, &other, &vm);
    d.ok(&t, "vm_destroy", json!({"vm_id": vm}));
}

/// The broker job: three small exchanges, then 300,000 bytes each way, each on a connection
/// of its own that it half-closes before reading the reply; then it waits to be told to end.
const BROKER_JOB: &str = r#"
import hashlib, os, socket, sys, time
path = os.environ["WARREN_BROKER_SOCKET"]
print("pid", os.getpid(), flush=True)
def call(payload):
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    s.sendall(payload)
    s.shutdown(socket.SHUT_WR)
    got = b""
    while True:
        x = s.recv(65536)
        if not x:
            break
        got += x
    s.close()
    return got
for i in range(3):
    print(call(b"ping %d\n" % i).decode().strip(), flush=True)
big = bytes((i * 7) % 251 for i in range(300000))
reply = call(b"big\n" + big)
digest, echo = reply.split(b"\n", 1)
print("big", digest.decode() == hashlib.sha256(big).hexdigest() and echo == big, flush=True)
while not os.path.exists("/tmp/broker-done"):
    time.sleep(0.1)
"#;

/// Another job trying to reach the broker job's socket: by the job's root, by the agent's
/// directory, and where its own would be.
const INTRUDER: &str = r#"
import socket, sys
pid, job = sys.argv[1], sys.argv[2]
for p in ["/proc/%s/root/run/warren-broker/broker.sock" % pid,
          "/run/warren/broker/%s/broker.sock" % job,
          "/run/warren-broker/broker.sock"]:
    try:
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(10)
        s.connect(p)
        s.sendall(b"ping 9\n")
        s.shutdown(socket.SHUT_WR)
        got = s.recv(100)
        print("served" if got else "closed", flush=True)
    except Exception as e:
        print("refused", type(e).__name__, flush=True)
"#;

/// The controller's frames, as the test reassembles them.
#[derive(Debug)]
enum Frame {
    Open(u32),
    Data(u32, Vec<u8>),
    Close,
}

fn frames(buf: &mut Vec<u8>) -> Vec<Frame> {
    let mut out = Vec::new();
    loop {
        if buf.len() < 5 {
            return out;
        }
        let id = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]);
        match buf[0] {
            1 => {
                out.push(Frame::Open(id));
                buf.drain(..5);
            }
            3 => {
                out.push(Frame::Close);
                buf.drain(..5);
            }
            2 => {
                if buf.len() < 9 {
                    return out;
                }
                let len = u32::from_be_bytes([buf[5], buf[6], buf[7], buf[8]]) as usize;
                if buf.len() < 9 + len {
                    return out;
                }
                out.push(Frame::Data(id, buf[9..9 + len].to_vec()));
                buf.drain(..9 + len);
            }
            k => panic!("frame type {k}"),
        }
    }
}

fn data(id: u32, bytes: &[u8]) -> Vec<u8> {
    let mut v = Vec::new();
    for c in bytes.chunks(65536) {
        v.push(2);
        v.extend_from_slice(&id.to_be_bytes());
        v.extend_from_slice(&(c.len() as u32).to_be_bytes());
        v.extend_from_slice(c);
    }
    v
}

fn close(id: u32) -> Vec<u8> {
    let mut v = vec![3];
    v.extend_from_slice(&id.to_be_bytes());
    v
}

fn broker_pipe(d: &Daemon, t: &str, other: &str, vm: &str) {
    let token = "brokerTOKEN_0123456789-abcdefghijklmnopqrstuvwxyz";
    let r = d.call(
        t,
        "vm_exec",
        json!({"vm_id": vm, "request_id": "bad-token", "argv": ["true"], "broker_pipe_token": "short"}),
    );
    assert_eq!(
        (r.status, r.code()),
        (400, "invalid_argument"),
        "{}",
        r.text
    );
    let started = d.ok(
        t,
        "vm_exec",
        json!({"vm_id": vm, "request_id": "broker", "argv": ["python3", "-c", BROKER_JOB],
               "broker_pipe_token": token}),
    );
    assert_eq!(started["broker_pipe"], true, "{started}");
    let job = started["job_id"].as_str().expect("job").to_string();
    // The token is kept nowhere on disk (receipts, state).
    let hits = Command::new("grep")
        .args(["-rlF", token])
        .arg(d.env.state.path())
        .output()
        .expect("grep");
    assert!(
        hits.stdout.is_empty(),
        "token on disk: {}",
        String::from_utf8_lossy(&hits.stdout)
    );

    let path = format!("/v1/vms/{vm}/jobs/{job}/broker");
    let attach = |who: &str, tok: &str| {
        WsClient::connect_with(&d.addr, who, &path, &[("x-broker-pipe", tok)])
    };
    assert_eq!(attach(t, &token.replace('b', "c")).err(), Some(404));
    assert_eq!(attach(other, token).err(), Some(404));
    assert_eq!(
        WsClient::connect(&d.addr, t, &path).err(),
        Some(404),
        "no token"
    );
    let mut ctl = attach(t, token).expect("attach");
    assert_eq!(attach(t, token).err(), Some(409), "a second controller");

    // Serve: one reply per connection once its request is whole, then close.
    let mut buf = Vec::new();
    let mut reqs: std::collections::HashMap<u32, Vec<u8>> = Default::default();
    let mut served = 0;
    let t0 = Instant::now();
    while served < 4 {
        assert!(t0.elapsed() < WAIT, "served {served} of 4");
        match ctl.next(WAIT) {
            Got::Binary(b) => buf.extend_from_slice(&b),
            other => {
                let o = d.call(t, "vm_job_output", json!({"vm_id": vm, "job_id": job}));
                panic!("controller got {other:?}; the job: {}", o.text)
            }
        }
        for f in frames(&mut buf) {
            match f {
                Frame::Open(id) => {
                    if id == 1 {
                        // A live connection is a stream of its own (the attachment is one).
                        let st = d.ok(t, "vm_status", json!({"vm_id": vm}));
                        assert_eq!(st["open_streams"], 2, "{st}");
                    }
                    reqs.insert(id, Vec::new());
                }
                Frame::Data(id, b) => {
                    let r = reqs.get_mut(&id).expect("data for an opened connection");
                    r.extend_from_slice(&b);
                    let reply = if r.starts_with(b"ping ") && r.ends_with(b"\n") {
                        Some([b"pong".as_slice(), &r[4..]].concat())
                    } else if r.len() == 4 + 300_000 && r.starts_with(b"big\n") {
                        let body = &r[4..];
                        let mut v = format!("{:x}\n", Sha256::digest(body)).into_bytes();
                        v.extend_from_slice(body);
                        Some(v)
                    } else {
                        None
                    };
                    if let Some(reply) = reply {
                        let mut out = data(id, &reply);
                        out.extend(close(id));
                        ctl.send_binary(&out);
                        served += 1;
                    }
                }
                Frame::Close => {}
            }
        }
    }
    // An intruder job gets nothing through, and the controller sees no connection of it.
    let pid = {
        // The job prints its verdict once it read the last reply.
        let t0 = Instant::now();
        let out = loop {
            let o = d.ok(
                t,
                "vm_job_output",
                json!({"vm_id": vm, "job_id": job, "wait_ms": 2000}),
            );
            let out = o["stdout"].as_str().unwrap_or_default().to_string();
            if out.contains("big ") || t0.elapsed() > WAIT {
                break out;
            }
        };
        assert!(
            out.contains("pong 0") && out.contains("pong 2") && out.contains("big True"),
            "{out}"
        );
        out.lines()
            .find_map(|l| l.strip_prefix("pid "))
            .expect("pid line")
            .to_string()
    };
    let o = d.ok(
        t,
        "vm_exec",
        json!({"vm_id": vm, "request_id": "intruder", "argv": ["python3", "-c", INTRUDER, pid, job],
               "wait_ms": 30000}),
    );
    let out = o["stdout"].as_str().unwrap_or_default();
    assert!(!out.contains("served"), "{out}");
    assert_eq!(out.lines().count(), 3, "{o}");
    let extra = ctl.until(Duration::from_secs(2), |g| !g.is_empty());
    assert!(
        !extra
            .iter()
            .any(|g| matches!(g, Got::Binary(b) if b.first() == Some(&1))),
        "the intruder reached the controller: {extra:?}"
    );

    // The job ends: the attachment closes, and the pipe is gone.
    d.ok(
        t,
        "vm_exec",
        json!({"vm_id": vm, "request_id": "done", "argv": ["touch", "/tmp/broker-done"], "wait_ms": 10000}),
    );
    let got = ctl.until(WAIT, |g| matches!(g.last(), Some(Got::Close(..))));
    assert_eq!(
        got.last(),
        Some(&Got::Close(1001, "job finished".into())),
        "{got:?}"
    );
    assert_eq!(attach(t, token).err(), Some(404));
}

/// A guest stdio MCP server with no dependencies: JSON-RPC lines on stdin and stdout, one tool.
const MCP_SERVER: &str = r#"import json, sys
for line in sys.stdin:
    msg = json.loads(line)
    if "id" not in msg:
        continue
    method, mid = msg.get("method"), msg["id"]
    if method == "initialize":
        result = {"protocolVersion": msg["params"]["protocolVersion"],
                  "capabilities": {"tools": {}},
                  "serverInfo": {"name": "guest-upper", "version": "1.0"}}
    elif method == "tools/list":
        result = {"tools": [{"name": "upper", "description": "Upper-cases text",
                             "inputSchema": {"type": "object",
                                             "properties": {"text": {"type": "string"}},
                                             "required": ["text"]}}]}
    elif method == "tools/call":
        text = msg["params"]["arguments"]["text"].upper()
        result = {"content": [{"type": "text", "text": text}], "isError": False}
    elif method == "ping":
        result = {}
    else:
        print(json.dumps({"jsonrpc": "2.0", "id": mid,
                          "error": {"code": -32601, "message": "no such method"}}), flush=True)
        continue
    print(json.dumps({"jsonrpc": "2.0", "id": mid, "result": result}), flush=True)
"#;

/// The one-line listener: each connection gets a fresh server process on its socket.
const MCP_LISTENER: &str = "import socket,subprocess\ns=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);s.bind(('127.0.0.1',5300));s.listen(4)\nwhile 1:\n c,_=s.accept();subprocess.Popen(['python3','/tmp/mcp_server.py'],stdin=c.fileno(),stdout=c.fileno());c.close()";

/// The official MCP SDK's stdio client, running `warren attach` as its server command.
const MCP_CLIENT: &str = r#"import asyncio, json, sys
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client
async def main():
    params = StdioServerParameters(command=sys.argv[1], args=sys.argv[2:])
    async with stdio_client(params) as (r, w):
        async with ClientSession(r, w) as s:
            init = await s.initialize()
            tools = await s.list_tools()
            res = await s.call_tool("upper", {"text": "hello from the host"})
            print(json.dumps({"server": init.server_info.name,
                              "tools": [t.name for t in tools.tools],
                              "text": res.content[0].text}))
asyncio.run(main())
"#;

fn mcp_through_attach(d: &Daemon, t: &str, tf: &std::path::Path, vm: &str) {
    let wrote = d.ok(
        t,
        "vm_exec",
        json!({"vm_id": vm, "request_id": "mcp-server", "argv": ["sh", "-c", "cat > /tmp/mcp_server.py"],
               "stdin": MCP_SERVER, "wait_ms": 20000}),
    );
    assert_eq!(wrote["exit_code"], 0, "{wrote}");
    d.ok(
        t,
        "vm_exec",
        json!({"vm_id": vm, "request_id": "mcp-listener", "argv": ["python3", "-c", MCP_LISTENER]}),
    );
    let ready = d.ok(
        t,
        "vm_exec",
        json!({"vm_id": vm, "request_id": "mcp-ready", "wait_ms": 30000, "command":
               "for i in $(seq 100); do python3 -c 'import socket; socket.create_connection((\"127.0.0.1\", 5300)).close()' 2>/dev/null && exit 0; sleep 0.2; done; exit 1"}),
    );
    assert_eq!(ready["exit_code"], 0, "{ready}");
    let out = Command::new(common::mcp_python())
        .args([
            "-c",
            MCP_CLIENT,
            WARREN,
            "attach",
            vm,
            "--port",
            "5300",
            "--endpoint",
        ])
        .arg(format!("http://{}", d.addr))
        .arg("--token-file")
        .arg(tf)
        .output()
        .expect("MCP client");
    let v: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    assert_eq!(
        v,
        json!({"server": "guest-upper", "tools": ["upper"], "text": "HELLO FROM THE HOST"}),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn rate_and_suspend(d: &Daemon, t: &str, tf: &std::path::Path, vm: &str) {
    // 8 MiB from the guest at 2 MiB/s (after a burst of one second's worth) takes >= 3 s;
    // unlimited it takes a fraction of that.
    const SENDER: &str = "import socket\ns=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);s.bind(('127.0.0.1',5400));s.listen(1)\nc,_=s.accept();c.sendall(b'x'*(8<<20));c.close()";
    d.ok(
        t,
        "vm_exec",
        json!({"vm_id": vm, "request_id": "sender", "argv": ["python3", "-c", SENDER]}),
    );
    let t0 = Instant::now();
    let out = loop {
        let out = Command::new(WARREN)
            .args([
                "attach",
                vm,
                "--port",
                "5400",
                "--ignore-stdin-eof",
                "--endpoint",
            ])
            .arg(format!("http://{}", d.addr))
            .arg("--token-file")
            .arg(tf)
            .stdin(Stdio::null())
            .output()
            .expect("attach");
        // Until the listener is up, the service answers 409 (nothing listens).
        if out.status.success() || t0.elapsed() > WAIT {
            break out;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let took = t0.elapsed();
    assert_eq!(
        out.stdout.len(),
        8 << 20,
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        took >= Duration::from_millis(2900),
        "8 MiB at 2 MiB/s took {took:?}"
    );

    // Suspension closes a job's open output stream with 1001 `suspended`.
    let job = start(d, t, vm, "sleeper", json!({"argv": ["sleep", "60"]}));
    let mut ws =
        WsClient::connect(&d.addr, t, &format!("/v1/vms/{vm}/jobs/{job}/output")).expect("output");
    let r = d.call(t, "vm_suspend", json!({"vm_id": vm, "mode": "pause"}));
    assert_eq!((r.status, r.code()), (409, "busy"), "{}", r.text);
    d.ok(
        t,
        "vm_suspend",
        json!({"vm_id": vm, "mode": "pause", "force": true}),
    );
    let got = ws.until(WAIT, |g| matches!(g.last(), Some(Got::Close(..))));
    assert_eq!(
        got.last(),
        Some(&Got::Close(1001, "suspended".into())),
        "{got:?}"
    );
    // Cancelling wakes the VM; the job ends.
    d.ok(t, "vm_job_cancel", json!({"vm_id": vm, "job_id": job}));
}

/// `warren run` through the service's socket: the project's session is made through
/// `session_create`, the command runs in it with stdin streamed, from the matching
/// directory of the copy, with the agents' state directories in its environment; its exit
/// code is the run's; a second run reuses the session.
#[test]
fn test_run_through_the_service_socket() {
    let d = Daemon::start("");
    let (_guard, repo) = common::one_commit_repo();
    std::fs::create_dir(repo.join("sub")).expect("mkdir");
    std::fs::write(repo.join("sub/b.txt"), "untracked\n").expect("write");
    let run = |script: &str, input: &[u8]| {
        let mut c = d.env.cmd();
        c.args(["--socket", d.socket.to_str().expect("socket")])
            .args(["run", "--", "sh", "-c", script])
            .current_dir(repo.join("sub"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = c.spawn().expect("warren run");
        child
            .stdin
            .take()
            .expect("stdin")
            .write_all(input)
            .expect("input");
        child.wait_with_output().expect("run")
    };
    let out = run(
        "cat ../a.txt; pwd; echo \"$CLAUDE_CONFIG_DIR\"; cat; exit 4",
        b"streamed\n",
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "committed\n/workspace/sub\n/agent-state/claude\nstreamed\n",
        "{stderr}"
    );
    assert_eq!(out.status.code(), Some(4), "{stderr}");
    assert!(stderr.contains("warren: session"), "{stderr}");
    let out = run("echo again", b"");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "again\n");
    assert!(
        !String::from_utf8_lossy(&out.stderr).contains("warren: session"),
        "a second session was made"
    );
    let list = d.local_call("session_list", json!({}), &[]);
    assert_eq!(
        list.body["sessions"].as_array().map(Vec::len),
        Some(1),
        "{}",
        list.text
    );
    let s = &list.body["sessions"][0];
    d.local_call(
        "session_delete",
        json!({"session": s["session_id"], "force": true}),
        &[],
    );
}
