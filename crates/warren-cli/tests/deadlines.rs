//! Deadlines on supervisor<->guest, supervisor<->VMM and client<->supervisor calls (issue
//! 14, item 2). Before them, a guest that stopped answering held every call made to it
//! forever, and the service's idle loop, which suspended VMs one after another, stopped at
//! it: no other VM was idle-suspended again.
//!
//! The silent guest here is a real one whose QEMU is stopped with SIGSTOP, which silences
//! both its agent channel and its QMP socket while every socket stays open.

mod common;

use std::time::{Duration, Instant};

use common::daemon::Daemon;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use serde_json::{json, Value};

/// The supervisor's deadline for control calls (`warren_supervisor::deadline::CONTROL_LIMIT`).
const CONTROL_LIMIT: Duration = Duration::from_secs(20);
/// The QMP reply deadline (`warren_vmm::qemu::qmp::REPLY_LIMIT`).
const QMP_LIMIT: Duration = Duration::from_secs(15);

/// A stopped QEMU, continued again whatever happens to the test (so cleanup can stop it).
struct Stopped(i32);

impl Stopped {
    fn new(pid: i32) -> Stopped {
        kill(Pid::from_raw(pid), Signal::SIGSTOP).expect("SIGSTOP QEMU");
        common::wait_until("QEMU stopped", 10, || proc_state(pid) == 'T');
        Stopped(pid)
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        let _ = kill(Pid::from_raw(self.0), Signal::SIGCONT);
    }
}

/// The state letter of `/proc/<pid>/stat` (`T`: stopped).
fn proc_state(pid: i32) -> char {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    stat.rsplit_once(") ")
        .and_then(|(_, rest)| rest.chars().next())
        .unwrap_or('?')
}

fn qemu_pid(vm: &str) -> i32 {
    let pids = common::pids_matching(&format!("process=warren-{vm}"));
    assert_eq!(pids.len(), 1, "one QEMU for {vm}: {pids:?}");
    pids[0]
}

fn state(d: &Daemon, vm: &str) -> String {
    d.all_vms()
        .iter()
        .find(|v| v["id"] == vm)
        .and_then(|v| v["state"].as_str().map(str::to_string))
        .unwrap_or_default()
}

fn create(d: &Daemon, t: &str, rid: &str) -> String {
    let r = d.ok(
        t,
        "vm_create",
        json!({"request_id": rid, "idle_seconds": 5, "idle_mode": "pause"}),
    );
    r["vm_id"].as_str().expect("vm id").to_string()
}

fn exec(d: &Daemon, t: &str, vm: &str, rid: &str, command: &str) -> (u16, Value, Duration) {
    let start = Instant::now();
    let r = d.call(
        t,
        "vm_exec",
        json!({"vm_id": vm, "request_id": rid, "command": command, "wait_ms": 20000}),
    );
    (r.status, r.body, start.elapsed())
}

#[test]
fn test_deadline_silent_guest_fails_only_its_calls_others_exec_and_idle_suspend() {
    let d = Daemon::start("");
    let t = d.token("alice", &[]);
    // The VM that goes silent is created first: the idle loop looks at it before the other.
    let a = create(&d, &t, "a");
    let b = create(&d, &t, "b");

    // A job that runs through everything (a running job also keeps `a` from idling).
    let r = d.ok(
        &t,
        "vm_exec",
        json!({"vm_id": a, "request_id": "sleeper", "argv": ["sleep", "900"], "wait_ms": 200}),
    );
    assert_eq!(r["state"], "running", "{r}");
    let sleeper = r["job_id"].as_str().expect("job").to_string();

    // 1. The guest's agent and its VMM stop answering.
    let pid = qemu_pid(&a);
    let stopped = Stopped::new(pid);
    let stuck = {
        let (addr_t, a) = (t.clone(), a.clone());
        let d = &d;
        std::thread::scope(|s| {
            let call = s.spawn(move || exec(d, &addr_t, &a, "stuck", "echo hi"));
            // Meanwhile the other VM works, and its idle policy suspends it: `a` was already
            // idle for the loop when `b` last worked, so the loop reached `a` first.
            std::thread::sleep(Duration::from_secs(3));
            let (status, body, took) = exec(d, &t, &b, "b1", "echo b");
            assert_eq!(status, 200, "{body}");
            assert_eq!(body["stdout"], "b\n", "{body}");
            println!("deadlines: other VM exec while one is silent: {took:?}");
            assert!(
                took < CONTROL_LIMIT,
                "the other VM's exec waited for the silent one: {took:?}"
            );
            let idle_from = Instant::now();
            common::wait_until("the other VM idle-suspended", 90, || {
                state(d, &b) == "paused"
            });
            println!(
                "deadlines: other VM idle-suspended {:?} after its exec",
                idle_from.elapsed()
            );
            call.join().expect("stuck call thread")
        })
    };
    let (status, body, took) = stuck;
    println!(
        "deadlines: call to the silent guest failed after {took:?}: {status} {}",
        body["error"]
    );
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["error"]["code"], "unavailable", "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("did not answer")),
        "{body}"
    );
    assert!(
        took >= CONTROL_LIMIT - Duration::from_secs(2) && took < CONTROL_LIMIT * 3,
        "the silent guest's call ended after {took:?}, not at its deadline"
    );
    assert_eq!(proc_state(pid), 'T', "the guest stayed stopped throughout");
    assert_eq!(state(&d, &a), "running", "a deadline does not fail the VM");

    // 2. It runs again: it answers, the job started before it stopped is alive, and the
    //    retried request (same id: the guest deduplicates it) runs once.
    drop(stopped);
    let (status, body, _) = exec(&d, &t, &a, "stuck", "echo hi");
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["stdout"], "hi\n", "{body}");
    let r = d.ok(&t, "vm_job_status", json!({"vm_id": a, "job_id": sleeper}));
    assert_eq!(r["state"], "running", "the deadline killed the job: {r}");

    // 3. A silent VMM: QMP fails its command at the QMP deadline, and the VM stays as it was.
    let r = d.ok(
        &t,
        "vm_suspend",
        json!({"vm_id": a, "mode": "pause", "force": true}),
    );
    assert_eq!(r["state"], "paused", "{r}");
    let stopped = Stopped::new(pid);
    let start = Instant::now();
    let r = d.call(&t, "vm_resume", json!({"vm_id": a}));
    let took = start.elapsed();
    println!(
        "deadlines: resume of a VM whose VMM is silent failed after {took:?}: {} {}",
        r.status, r.body["error"]
    );
    assert_eq!(r.status, 503, "{}", r.text);
    assert_eq!(r.code(), "unavailable", "{}", r.text);
    assert!(
        took >= QMP_LIMIT - Duration::from_secs(2) && took < QMP_LIMIT * 4,
        "the silent VMM's call ended after {took:?}, not at its deadline"
    );
    assert_eq!(state(&d, &a), "paused");
    drop(stopped);
    let r = d.ok(&t, "vm_resume", json!({"vm_id": a}));
    assert_eq!(r["state"], "running", "{r}");
    let r = d.ok(&t, "vm_job_status", json!({"vm_id": a, "job_id": sleeper}));
    assert_eq!(r["state"], "running", "the job survived both: {r}");
}
