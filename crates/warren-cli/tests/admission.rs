//! Admission on resume and wake (issue 14, item 4). A resume from hibernation used to skip
//! the memory admission a create passes: hibernate a VM, create another in the freed memory,
//! resume the first, and the workspace (or host) held more than its limit.

mod common;

use common::daemon::Daemon;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

/// What identifies a checkpoint: its record's bytes, and its state file's size and digest.
fn checkpoint(d: &Daemon, vm: &str) -> (Vec<u8>, u64, String) {
    let dir = d.env.vm_dir(vm);
    let record = std::fs::read(dir.join("checkpoint.json")).expect("checkpoint record");
    let state = std::fs::read(dir.join("run/checkpoint.ram")).expect("checkpoint state");
    (
        record,
        state.len() as u64,
        hex::encode(Sha256::digest(&state)),
    )
}

fn exec(d: &Daemon, t: &str, vm: &str, id: &str, command: &str) -> common::daemon::Resp {
    d.call(
        t,
        "vm_exec",
        json!({"vm_id": vm, "request_id": id, "command": command, "wait_ms": 30000}),
    )
}

fn state(d: &Daemon, t: &str, vm: &str) -> Value {
    d.ok(t, "vm_status", json!({"vm_id": vm}))["state"].clone()
}

#[test]
fn test_admission_resume_and_wake_over_memory_limit_refused_vm_stays_hibernated() {
    let d = Daemon::start("");
    // Room for one 256 MiB VM, not two.
    let t = d.token("tight", &["--max-memory-mib", "384"]);
    let a = d.ok(
        &t,
        "vm_create",
        json!({"request_id": "a", "memory_mib": 256, "idle_seconds": 0}),
    )["vm_id"]
        .as_str()
        .expect("vm_id")
        .to_string();
    // State that only a memory restore brings back: /tmp is a tmpfs.
    let nonce = format!("kept-{}", std::process::id());
    let r = exec(&d, &t, &a, "w", &format!("echo {nonce} > /tmp/marker"));
    assert_eq!(r.body["exit_code"], 0, "{}", r.text);
    let r = d.call(&t, "vm_suspend", json!({"vm_id": a}));
    assert_eq!(r.body["state"], "hibernated", "{}", r.text);
    let before = checkpoint(&d, &a);

    // The hibernated VM's memory is free: a second VM takes it.
    let b = d.ok(
        &t,
        "vm_create",
        json!({"request_id": "b", "memory_mib": 256, "idle_seconds": 0}),
    )["vm_id"]
        .as_str()
        .expect("vm_id")
        .to_string();

    // An explicit resume and a call that would wake it are both refused.
    let r = d.call(&t, "vm_resume", json!({"vm_id": a}));
    assert_eq!((r.status, r.code()), (429, "quota_exceeded"), "{}", r.text);
    assert!(
        r.text.contains("workspace tight"),
        "the refusal names the limit: {}",
        r.text
    );
    let r = exec(&d, &t, &a, "wake", "cat /tmp/marker");
    assert_eq!((r.status, r.code()), (429, "quota_exceeded"), "{}", r.text);
    let r = d.call(
        &t,
        "vm_read_file",
        json!({"vm_id": a, "path": "marker.txt"}),
    );
    assert_eq!((r.status, r.code()), (429, "quota_exceeded"), "{}", r.text);
    assert_eq!(state(&d, &t, &a), "hibernated");
    assert_eq!(
        checkpoint(&d, &a),
        before,
        "a refused resume changed the checkpoint"
    );
    assert!(
        common::pids_matching(&a).is_empty(),
        "a refused resume started a process for {a}"
    );
    assert_eq!(state(&d, &t, &b), "running");

    // Control: with B gone the same wake admits A, which continues from its checkpoint.
    let r = d.call(&t, "vm_destroy", json!({"vm_id": b}));
    assert_eq!(r.body["destroyed"], true, "{}", r.text);
    let r = exec(&d, &t, &a, "wake2", "cat /tmp/marker");
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.body["stdout"], format!("{nonce}\n"), "{}", r.text);
    assert_eq!(state(&d, &t, &a), "running");
    // Running again, A holds its memory: a new VM beside it is refused as at create.
    let r = d.call(
        &t,
        "vm_create",
        json!({"request_id": "c", "memory_mib": 256, "idle_seconds": 0}),
    );
    assert_eq!(r.code(), "quota_exceeded", "{}", r.text);
}
