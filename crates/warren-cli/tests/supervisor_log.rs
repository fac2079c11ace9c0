//! `supervisor.log` is bounded (issue 14, item 3): it used to grow without bound from
//! guest-chosen text. Here the guest's own error messages (which echo what it was asked) are
//! flooded through a real supervisor.

mod common;

use std::time::Duration;

use common::{ensure_image, pinned_image, TestEnv, TestVm};
use warren_protocol::{ExecStart, HostRequest};
use warren_supervisor::log::{BURST, LOG_HALF, MAX_RECORD, PER_SECOND};
use warren_supervisor::SupervisorClient;

/// Guest errors the flood causes.
const FLOOD: usize = 800;
/// How a flood record's text reads in the log: the guest's newline escaped (`\n`) when it
/// entered the host, and that value then quoted, its backslash escaped in turn
/// (`warren-cli::logging`).
const FLOOD_IN_LOG: &str = r"flood\\nFORGED";

fn exec_request(program: &str) -> HostRequest {
    HostRequest::ExecStart(ExecStart {
        argv: vec![program.to_string()],
        env: vec![],
        cwd: None,
        stdin: None,
        timeout_ms: None,
        request_key: None,
    })
}

fn exec_missing(rt: &tokio::runtime::Runtime, client: &SupervisorClient, program: &str) {
    let r = rt.block_on(client.guest(exec_request(program)));
    assert!(r.is_err(), "a missing command started: {r:?}");
}

fn logs(vm: &TestVm) -> (String, String) {
    let dir = vm.env.vm_dir(&vm.id);
    (
        std::fs::read_to_string(dir.join("supervisor.log")).expect("supervisor.log"),
        std::fs::read_to_string(dir.join("supervisor.log.1")).unwrap_or_default(),
    )
}

#[test]
fn test_supervisor_log_guest_text_flood_stays_bounded() {
    ensure_image("minimal");
    let env = TestEnv::new();
    // The supervisor's debug level: it then logs every guest error message (and not the
    // HTTP/2 crate's debug lines, which would share the rate limit).
    let out = env
        .cmd()
        .env("RUST_LOG", "info,warren_supervisor=debug")
        .args([
            "vm",
            "create",
            "--image",
            &pinned_image("minimal"),
            "--json",
        ])
        .output()
        .expect("run warren");
    assert!(
        out.status.success(),
        "vm create: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("create json");
    let vm = TestVm::adopt(env, v["vm_id"].as_str().expect("vm_id").to_string());
    let client = SupervisorClient::new(&vm.env.vm_dir(&vm.id).join("supervisor.sock"));
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    // Let the rate limit refill after the boot's debug lines.
    std::thread::sleep(Duration::from_secs(2));

    // Positive control: a normal guest-caused message is logged whole.
    exec_missing(&rt, &client, "warren-control-before");
    let (cur, _) = logs(&vm);
    assert!(
        cur.contains("command not found: warren-control-before"),
        "the control message is missing:\n{}",
        &cur[cur.len().saturating_sub(2000)..]
    );

    // The flood: 800 messages of 4 KiB, 8 at a time, that also try to forge a log line.
    let flood = format!("flood\nFORGED line {}", "x".repeat(4 * 1024));
    let socket = vm.env.vm_dir(&vm.id).join("supervisor.sock");
    let started = std::time::Instant::now();
    rt.block_on(async {
        let mut tasks = tokio::task::JoinSet::new();
        for _ in 0..8 {
            let (socket, flood) = (socket.clone(), flood.clone());
            tasks.spawn(async move {
                let client = SupervisorClient::new(&socket);
                for _ in 0..FLOOD / 8 {
                    let r = client.guest(exec_request(&flood)).await;
                    assert!(r.is_err(), "a missing command started: {r:?}");
                }
            });
        }
        while let Some(r) = tasks.join_next().await {
            r.expect("flood task");
        }
    });
    let elapsed = started.elapsed().as_secs_f64();
    // Past the flood the bucket refills (10 records per second).
    std::thread::sleep(Duration::from_millis(1500));
    exec_missing(&rt, &client, "warren-control-after");

    let (cur, old) = logs(&vm);
    let total = (cur.len() + old.len()) as u64;
    assert!(
        total <= 2 * LOG_HALF + MAX_RECORD as u64,
        "supervisor.log holds {total} bytes"
    );
    for line in cur.lines().chain(old.lines()) {
        assert!(line.len() <= MAX_RECORD, "a {} byte line", line.len());
        assert!(!line.starts_with("FORGED"), "the guest forged a line");
    }
    let flooded = cur.lines().filter(|l| l.contains(FLOOD_IN_LOG)).count();
    eprintln!(
        "flood: {flooded} of {FLOOD} records written in {elapsed:.1} s; the log holds {total} bytes"
    );
    assert!(flooded > 0, "no flood record was logged");
    assert!(
        cur.lines()
            .filter(|l| l.contains(FLOOD_IN_LOG))
            .all(|l| l.contains("…[+")),
        "a flood record was not truncated"
    );
    // The bucket's bound, however fast this machine sent the flood.
    let bound = f64::from(BURST) + f64::from(PER_SECOND) * elapsed + 2.0;
    assert!(
        flooded as f64 <= bound,
        "{flooded} flood records written in {elapsed:.1} s"
    );
    assert!(
        flooded < FLOOD,
        "every one of the flood's records was written"
    );
    assert!(
        cur.contains("log records suppressed"),
        "no suppression line:\n{}",
        &cur[cur.len().saturating_sub(3000)..]
    );
    assert!(
        cur.contains("command not found: warren-control-after"),
        "the log stopped after the flood"
    );
    vm.destroy();
}
