//! Generations and status calls on suspended VMs, end to end through a real service.
//!
//! A session's generation is its memory lineage: it goes up on every `--recreate` (a new
//! VM, same session) and on every fresh boot of its VM after its memory was lost (here: a
//! hibernated VM whose checkpoint was destroyed, so the restore fails for real). A call
//! holding an older generation is refused with `conflict` and changes nothing.
//!
//! `vm_job_status`, `vm_status` and `vm_list` never wake a suspended VM and never count as
//! activity: a suspended VM's job status is the host's record from just before the
//! suspension, marked stale.

mod common;

use std::process::{Command, Stdio};
use std::time::Duration;

use base64::Engine;
use common::daemon::Daemon;
use serde_json::{json, Value};

/// A local call that must succeed; returns its body.
fn local_ok(d: &Daemon, tool: &str, args: Value) -> Value {
    let r = d.local_call(tool, args.clone(), &[]);
    assert_eq!(r.status, 200, "{tool} {args}: {}", r.text);
    r.body
}

fn session_entry(d: &Daemon, name: &str) -> Value {
    let list = local_ok(d, "session_list", json!({}));
    list["sessions"]
        .as_array()
        .expect("sessions")
        .iter()
        .find(|s| s["name"] == name)
        .cloned()
        .unwrap_or_else(|| panic!("no session {name} in {list}"))
}

#[test]
fn test_generation_recreate_and_failed_restore_fresh_boot_refuse_stale_callers() {
    let d = Daemon::start("");
    let (_dir, repo) = common::one_commit_repo();
    let repo_arg = repo.to_str().expect("utf-8");

    // 0. A malformed request_id is refused; a refused create leaves its request_id free
    //    for a corrected retry (other arguments).
    let r = d.local_call(
        "session_create",
        json!({"repo": repo_arg, "name": "gen", "request_id": "no spaces"}),
        &[],
    );
    assert_eq!(r.code(), "invalid_argument", "{}", r.text);
    let r = d.local_call(
        "session_create",
        json!({"repo": repo_arg, "name": "bad name", "request_id": "gen-1"}),
        &[],
    );
    assert_eq!(r.code(), "invalid_argument", "{}", r.text);

    // 1. A new session and its VM are at generation 1.
    let create = json!({"repo": repo_arg, "name": "gen", "request_id": "gen-1"});
    let s = local_ok(&d, "session_create", create.clone());
    assert_eq!(s["generation"], 1, "{s}");
    let (session_id, vm1) = (
        s["session_id"].as_str().expect("id").to_string(),
        s["vm_id"].as_str().expect("vm").to_string(),
    );
    // A retry with the same request_id gets the same session and makes nothing (before,
    // session_create took no request_id and a retry made a second session); the same key
    // with other arguments is a conflict.
    let again = local_ok(&d, "session_create", create);
    assert_eq!(
        (&again["session_id"], &again["vm_id"]),
        (&s["session_id"], &s["vm_id"]),
        "{again}"
    );
    let list = local_ok(&d, "session_list", json!({}));
    assert_eq!(list["sessions"].as_array().map(Vec::len), Some(1), "{list}");
    assert_eq!(d.all_vms().len(), 1, "a retry made a VM");
    let r = d.local_call(
        "session_create",
        json!({"repo": repo_arg, "name": "gen2", "request_id": "gen-1"}),
        &[],
    );
    assert_eq!((r.status, r.code()), (409, "conflict"), "{}", r.text);
    let workspace_dir = std::path::PathBuf::from(s["workspace_dir"].as_str().expect("dir"));
    assert_eq!(session_entry(&d, "gen")["generation"], 1);
    assert_eq!(
        local_ok(&d, "vm_status", json!({"vm_id": vm1}))["generation"],
        1
    );
    let st = local_ok(&d, "session_status", json!({"session": "gen"}));
    assert_eq!(st["generation"], 1, "{st}");

    // 2. `warren run --recreate` replaces the VM: same session, generation 2 on both.
    let out = Command::new(common::WARREN)
        .arg("--state-dir")
        .arg(d.env.state.path())
        .arg("--image-dir")
        .arg(&d.env.image_dir)
        .args(["run", "--recreate", "shell", "--", "true"])
        .current_dir(&repo)
        .stdin(Stdio::null())
        .output()
        .expect("warren run");
    assert!(
        out.status.success(),
        "run --recreate: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let s = session_entry(&d, "gen");
    assert_eq!(s["session_id"], session_id.as_str(), "same session: {s}");
    assert_eq!(s["generation"], 2, "{s}");
    let vm2 = s["vm_id"].as_str().expect("vm").to_string();
    assert_ne!(vm2, vm1, "recreate boots a new VM");
    assert_eq!(
        local_ok(&d, "vm_status", json!({"vm_id": vm2}))["generation"],
        2
    );
    let r = d.local_call("vm_status", json!({"vm_id": vm1}), &[]);
    assert_eq!(r.code(), "not_found", "the old VM is gone: {}", r.text);

    // 3. A caller still at generation 1 is refused and changes nothing; 2 is accepted.
    let content = base64::engine::general_purpose::STANDARD.encode("written\n");
    let write = |generation: u64| {
        d.local_call(
            "vm_write_file",
            json!({"vm_id": vm2, "path": "stale.txt", "content_base64": content,
                   "expected_generation": generation}),
            &[],
        )
    };
    let r = write(1);
    assert_eq!((r.status, r.code()), (409, "conflict"), "{}", r.text);
    assert!(
        r.text.contains("at generation 2"),
        "names the generation: {}",
        r.text
    );
    assert!(
        !workspace_dir.join("stale.txt").exists(),
        "a refused write wrote"
    );
    for (tool, args) in [
        (
            "session_status",
            json!({"session": "gen", "expected_generation": 1}),
        ),
        (
            "session_delete",
            json!({"session": "gen", "force": true, "expected_generation": 1}),
        ),
    ] {
        let r = d.local_call(tool, args, &[]);
        assert_eq!(
            (r.status, r.code()),
            (409, "conflict"),
            "{tool}: {}",
            r.text
        );
    }
    assert_eq!(
        session_entry(&d, "gen")["vm_id"],
        vm2.as_str(),
        "a refused delete deleted"
    );
    let r = write(2);
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(
        std::fs::read_to_string(workspace_dir.join("stale.txt")).expect("written"),
        "written\n"
    );
    let st = local_ok(
        &d,
        "session_status",
        json!({"session": "gen", "expected_generation": 2}),
    );
    assert_eq!(st["generation"], 2, "{st}");

    // 4. State only memory holds (/tmp is a tmpfs, a running process) and state on the
    //    VM's disk (synced), then a hibernation whose checkpoint is destroyed.
    let exec = |rid: &str, command: &str, generation: u64| {
        d.local_call(
            "vm_exec",
            json!({"vm_id": vm2, "request_id": rid, "command": command, "wait_ms": 20000,
                   "expected_generation": generation}),
            &[],
        )
    };
    let r = exec(
        "mark",
        "echo mem > /tmp/mem && echo disk > /var/tmp/disk && sync",
        2,
    );
    assert_eq!(r.body["exit_code"], 0, "{}", r.text);
    let r = d.local_call(
        "vm_exec",
        json!({"vm_id": vm2, "request_id": "sleeper", "argv": ["sleep", "1000"]}),
        &[],
    );
    assert_eq!(r.body["state"], "running", "{}", r.text);
    // The check used after the fresh boot, here while the process runs (control).
    let memory_check = "test -e /tmp/mem && echo mem kept || echo mem lost; cat /var/tmp/disk; \
         grep -qx sleep /proc/[0-9]*/comm 2>/dev/null && echo sleep kept || echo sleep gone";
    let r = exec("before", memory_check, 2);
    assert_eq!(
        r.body["stdout"], "mem kept\ndisk\nsleep kept\n",
        "{}",
        r.text
    );
    let r = local_ok(
        &d,
        "vm_suspend",
        json!({"vm_id": vm2, "mode": "hibernate", "force": true}),
    );
    assert_eq!(r["state"], "hibernated", "{r}");
    let state = d.env.vm_dir(&vm2).join("run/checkpoint.ram");
    assert!(state.exists(), "no checkpoint state at {}", state.display());
    std::fs::write(&state, b"not a migration stream").expect("destroy the checkpoint");

    // 5. The resume cannot restore it: the VM boots fresh on its disk, generation 3.
    let r = local_ok(&d, "vm_resume", json!({"vm_id": vm2}));
    assert_eq!(r["state"], "running", "{r}");
    assert_eq!(r["generation"], 3, "{r}");
    let s = session_entry(&d, "gen");
    assert_eq!(
        (
            s["session_id"].as_str(),
            s["vm_id"].as_str(),
            &s["generation"]
        ),
        (Some(session_id.as_str()), Some(vm2.as_str()), &json!(3)),
        "{s}"
    );
    assert_eq!(
        local_ok(&d, "vm_status", json!({"vm_id": vm2}))["generation"],
        3
    );
    let r = exec("old", "echo ran", 2);
    assert_eq!(
        (r.status, r.code()),
        (409, "conflict"),
        "a generation-2 caller reached the new memory: {}",
        r.text
    );
    let r = exec("after", memory_check, 3);
    assert_eq!(
        r.body["stdout"], "mem lost\ndisk\nsleep gone\n",
        "fresh memory on the same disk: {}",
        r.text
    );
    assert!(
        !d.env.vm_dir(&vm2).join("checkpoint.json").exists(),
        "the unrestorable checkpoint was kept"
    );
}

#[test]
fn test_job_status_of_suspended_vm_answers_stale_never_wakes() {
    let d = Daemon::start("");
    let t = d.token("alice", &[]);
    let vm = d.ok(
        &t,
        "vm_create",
        json!({"request_id": "status", "idle_seconds": 0}),
    )["vm_id"]
        .as_str()
        .expect("vm")
        .to_string();
    let r = d.ok(
        &t,
        "vm_exec",
        json!({"vm_id": vm, "request_id": "sleeper", "argv": ["sleep", "300"]}),
    );
    let sleeper = r["job_id"].as_str().expect("job").to_string();
    let r = d.ok(
        &t,
        "vm_exec",
        json!({"vm_id": vm, "request_id": "done", "command": "echo done; exit 3", "wait_ms": 20000}),
    );
    assert_eq!(r["exit_code"], 3, "{r}");
    let done = r["job_id"].as_str().expect("job").to_string();
    let job_status = |job: &str| d.call(&t, "vm_job_status", json!({"vm_id": vm, "job_id": job}));

    let live = job_status(&sleeper);
    assert_eq!(live.status, 200, "{}", live.text);
    assert_eq!(
        (
            &live.body["state"],
            &live.body["vm_state"],
            &live.body["stale"]
        ),
        (&json!("running"), &json!("running"), &json!(false)),
        "{}",
        live.text
    );
    assert!(live.body.get("seen_unix").is_none(), "{}", live.text);

    for (mode, suspended) in [("pause", "paused"), ("hibernate", "hibernated")] {
        let r = d.ok(
            &t,
            "vm_suspend",
            json!({"vm_id": vm, "mode": mode, "force": true}),
        );
        assert_eq!(r["state"], suspended, "{r}");
        let active = r["last_active_unix"].as_u64().expect("last_active_unix");
        // Activity is counted in seconds: a touch after this would show.
        std::thread::sleep(Duration::from_millis(1500));

        let r = job_status(&sleeper);
        assert_eq!(r.status, 200, "{mode}: {}", r.text);
        assert_eq!(
            (&r.body["state"], &r.body["vm_state"], &r.body["stale"]),
            (&json!("running"), &json!(suspended), &json!(true)),
            "{mode}: {}",
            r.text
        );
        assert!(r.body["seen_unix"].as_u64().is_some(), "{}", r.text);
        let r = job_status(&done);
        assert_eq!(
            (
                &r.body["state"],
                &r.body["exit_code"],
                &r.body["stdout_bytes"]
            ),
            (&json!("completed"), &json!(3), &json!(5)),
            "{mode}: {}",
            r.text
        );
        assert_eq!(r.body["stale"], true, "{}", r.text);
        // A job the record does not hold is not found (without waking the VM either).
        let r = job_status("999999");
        assert_eq!((r.status, r.code()), (404, "not_found"), "{}", r.text);

        let st = d.ok(&t, "vm_status", json!({"vm_id": vm}));
        // Its jobs as the host saw them before the suspension: the sleeper frozen running.
        assert_eq!(
            (&st["jobs"]["running"], &st["jobs_stale"]),
            (&json!(1), &json!(true)),
            "{mode}: {st}"
        );
        assert!(
            st["job_ids"]
                .as_array()
                .is_some_and(|ids| ids.contains(&json!(sleeper)) && ids.contains(&json!(done))),
            "{mode}: {st}"
        );
        assert!(st["jobs_seen_unix"].as_u64().is_some(), "{st}");
        let listed = d.ok(&t, "vm_list", json!({}));
        let in_list = listed["vms"]
            .as_array()
            .expect("vms")
            .iter()
            .find(|v| v["vm_id"] == vm.as_str())
            .cloned()
            .expect("listed");
        for v in [&st, &in_list] {
            assert_eq!(v["state"], suspended, "{mode}: a status call woke it: {v}");
            assert_eq!(
                v["last_active_unix"], active,
                "{mode}: a status call counted as activity: {v}"
            );
        }

        // Control: work wakes it and counts.
        let r = d.ok(
            &t,
            "vm_exec",
            json!({"vm_id": vm, "request_id": format!("wake-{mode}"), "command": "echo woke", "wait_ms": 20000}),
        );
        assert_eq!(r["stdout"], "woke\n", "{r}");
        let st = d.ok(&t, "vm_status", json!({"vm_id": vm}));
        assert_eq!(st["state"], "running", "{st}");
        assert_eq!(st["jobs_stale"], false, "{st}");
        assert!(st.get("jobs_seen_unix").is_none(), "{st}");
        assert!(
            st["last_active_unix"].as_u64().expect("active") > active,
            "work did not count: {st}"
        );
        let r = job_status(&sleeper);
        assert_eq!(
            (&r.body["state"], &r.body["vm_state"], &r.body["stale"]),
            (&json!("running"), &json!("running"), &json!(false)),
            "{mode}: the frozen job runs on: {}",
            r.text
        );
    }
}

/// A call holding the generation a VM had when it was hibernated must not run on the fresh
/// memory its own wake-up makes when the restore fails: the check is made again after the
/// wake.
#[test]
fn test_stale_generation_refused_when_its_own_wake_boots_fresh() {
    let d = Daemon::start("");
    let vm = local_ok(
        &d,
        "vm_create",
        json!({"request_id": "wake-fresh", "idle_seconds": 0}),
    )["vm_id"]
        .as_str()
        .expect("vm")
        .to_string();
    let generation = local_ok(&d, "vm_status", json!({"vm_id": vm}))["generation"]
        .as_u64()
        .expect("generation");
    let r = local_ok(
        &d,
        "vm_exec",
        json!({"vm_id": vm, "request_id": "mark", "command": "echo mem > /tmp/mem",
               "wait_ms": 20000, "expected_generation": generation}),
    );
    assert_eq!(r["exit_code"], 0, "{r}");
    let r = local_ok(
        &d,
        "vm_suspend",
        json!({"vm_id": vm, "mode": "hibernate", "force": true}),
    );
    assert_eq!(r["state"], "hibernated", "{r}");
    let state = d.env.vm_dir(&vm).join("run/checkpoint.ram");
    std::fs::write(&state, b"not a migration stream").expect("destroy the checkpoint");
    // The exec wakes the VM itself; the restore fails and the VM boots fresh.
    let r = d.local_call(
        "vm_exec",
        json!({"vm_id": vm, "request_id": "stale", "command": "test -e /tmp/mem && echo kept || echo lost",
               "wait_ms": 20000, "expected_generation": generation}),
        &[],
    );
    let now = local_ok(&d, "vm_status", json!({"vm_id": vm}))["generation"]
        .as_u64()
        .expect("generation");
    assert_eq!(now, generation + 1, "the restore failed: a fresh boot");
    assert_eq!(
        (r.status, r.code()),
        (409, "conflict"),
        "a generation-{generation} caller ran on generation {now}'s fresh memory: {}",
        r.text
    );
}
