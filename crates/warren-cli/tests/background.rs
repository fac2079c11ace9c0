//! Real-VM tests of background processes: what a command leaves running (`cmd &`, `nohup`,
//! `setsid`) outlives it, answers later commands, is listed, keeps an idle VM awake, and is
//! stopped by cancel or the job's timeout. Both tests boot the `dev` image (python3) without
//! a network: the server listens on the guest's loopback.

mod common;

use std::time::{Duration, Instant};

use common::daemon::Daemon;
use common::*;
use serde_json::{json, Value};

/// A shell command that prints the page at 127.0.0.1:`port` (curl when the image has it).
fn fetch(port: u16) -> String {
    let url = format!("http://127.0.0.1:{port}/");
    format!(
        "if command -v curl >/dev/null 2>&1; then curl -sS --max-time 10 {url}; \
         else python3 -c 'import sys, urllib.request; \
         sys.stdout.write(urllib.request.urlopen(\"{url}\", timeout=10).read().decode())'; fi"
    )
}

const LISTING: &str = "Directory listing for /";

/// `vm jobs --json`.
fn jobs(vm: &TestVm) -> Vec<Value> {
    let out = vm.warren(&["vm", "jobs", &vm.id, "--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("jobs json")
}

/// The job whose command contains `needle`.
fn job_with(vm: &TestVm, needle: &str) -> Value {
    jobs(vm)
        .into_iter()
        .find(|j| j["command"].as_str().is_some_and(|c| c.contains(needle)))
        .unwrap_or_else(|| panic!("no job runs {needle:?}: {:?}", jobs(vm)))
}

/// How many guest processes have exactly this command line.
fn count_procs(vm: &TestVm, cmdline: &str) -> String {
    let r = vm.sh(&format!(
        "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline 2>/dev/null; echo; done \
         | grep -c '^{cmdline} $' || true"
    ));
    r.stdout.trim().to_string()
}

#[test]
fn test_background_server_outlives_exec_listed_cancelled_timeout_kills_all() {
    let vm = TestVm::boot_image("dev");

    // The exec returns at its main process's exit although the server holds its pipes.
    let started = Instant::now();
    let r = vm.sh("python3 -u -m http.server 8123 --bind 127.0.0.1 & echo started");
    assert_eq!(
        (r.code, r.stdout.as_str()),
        (0, "started\n"),
        "{}",
        r.stderr
    );
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "exec waited on the server"
    );
    // The shell's child becomes python3 by exec, maybe a moment after the exec returned.
    wait_until("the server listed under its name", 30, || {
        job_with(&vm, "http.server 8123")["processes"][0]["name"] == "python3"
    });
    let job = job_with(&vm, "http.server 8123");
    assert_eq!(job["state"], "completed", "{job}");
    assert_eq!(job["exit_code"], 0, "{job}");
    assert_eq!(job["background_processes"], 1, "{job}");
    let id: u64 = job["job_id"].as_str().expect("id").parse().expect("num");

    // A later exec reaches it.
    wait_until("the server answers", 90, || {
        vm.sh(&fetch(8123)).stdout.contains(LISTING)
    });
    // What it wrote after the job finished is the job's output, readable by cursor; more
    // may come (the pipes are still open).
    let p = vm.output(id, &[]);
    assert!(
        p["stdout"]
            .as_str()
            .is_some_and(|s| s.contains("Serving HTTP on 127.0.0.1 port 8123")),
        "{p}"
    );
    assert!(
        p["stderr"]
            .as_str()
            .is_some_and(|s| s.contains("\"GET / HTTP/1.1\" 200")),
        "{p}"
    );
    assert_eq!(
        (
            &p["state"],
            &p["exit_code"],
            &p["output_complete"],
            &p["background_processes"]
        ),
        (&json!("completed"), &json!(0), &json!(false), &json!(1)),
        "{p}"
    );
    let (so, se) = (
        p["next_cursor"]["stdout"].to_string(),
        p["next_cursor"]["stderr"].to_string(),
    );
    assert!(vm.sh(&fetch(8123)).stdout.contains(LISTING));
    wait_until("the second request's log line", 30, || {
        let p = vm.output(id, &["--stdout-cursor", &so, "--stderr-cursor", &se]);
        p["stderr"]
            .as_str()
            .is_some_and(|s| s.starts_with("127.0.0.1") && s.contains("GET /"))
    });

    // nohup and setsid children outlive their job the same way.
    let started = Instant::now();
    let r = vm.sh("nohup sleep 1001 & setsid sleep 1002 & echo ok");
    assert_eq!((r.code, r.stdout.as_str()), (0, "ok\n"), "{}", r.stderr);
    assert!(started.elapsed() < Duration::from_secs(30));
    let sleepers = job_with(&vm, "nohup sleep 1001");
    assert_eq!(sleepers["background_processes"], 2, "{sleepers}");

    // Background processes are work: a plain suspend is refused; a forced pause freezes
    // them and they continue on resume (the next exec wakes the VM).
    let out = vm.warren(&["vm", "suspend", &vm.id, "--mode", "pause"]);
    assert_eq!(out.status.code(), Some(125));
    assert!(String::from_utf8_lossy(&out.stderr).contains("busy"));
    let out = vm.warren(&["vm", "suspend", &vm.id, "--mode", "pause", "--force"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(vm.state(), "paused");
    assert!(
        vm.sh(&fetch(8123)).stdout.contains(LISTING),
        "served after resume"
    );

    // Cancel stops the server (and only it), the job's exit status stays.
    let out = vm.warren(&["vm", "cancel", &vm.id, &id.to_string()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    wait_until("the server's job has no background process", 30, || {
        job_with(&vm, "http.server 8123")["background_processes"] == 0
    });
    // The listing counts afresh; the job's own count follows within a poll (500 ms).
    wait_until("the server's job output is complete", 30, || {
        vm.output(id, &[])["output_complete"] == true
    });
    let p = vm.output(id, &[]);
    assert_eq!(
        (&p["background_processes"], &p["exit_code"], &p["state"]),
        (&json!(0), &json!(0), &json!("completed")),
        "{p}"
    );
    let r = vm.sh(&fetch(8123));
    assert_ne!(r.code, 0, "the server still answers: {}", r.stdout);
    assert_eq!(job_with(&vm, "nohup sleep 1001")["background_processes"], 2);
    let sleepers_id = sleepers["job_id"].as_str().expect("id").to_string();
    assert!(vm
        .warren(&["vm", "cancel", &vm.id, &sleepers_id])
        .status
        .success());
    wait_until("the sleepers are gone", 30, || {
        count_procs(&vm, "sleep 1001") == "0" && count_procs(&vm, "sleep 1002") == "0"
    });

    // An interactive exec (what `warren run` uses) also returns at the main process's exit;
    // its timeout then ends the background sleep (checked below).
    let started = Instant::now();
    let r = vm.exec_args(
        &["-i", "--timeout", "5"],
        &["sh", "-c", "sleep 1005 & echo hi"],
    );
    assert_eq!((r.code, r.stdout.as_str()), (0, "hi\n"), "{}", r.stderr);
    assert!(started.elapsed() < Duration::from_secs(30));
    assert_eq!(
        job_with(&vm, "sleep 1005 & echo hi")["background_processes"],
        1
    );

    // A timeout kills everything: the main process waiting on its child...
    let r = vm.exec_args(&["--timeout", "3"], &["sh", "-c", "sleep 1003 & wait"]);
    assert_eq!(r.code, 124, "stderr: {}", r.stderr);
    wait_until("the timed-out job's child is gone", 10, || {
        count_procs(&vm, "sleep 1003") == "0"
    });
    // ...and the background processes of a job that already exited.
    let r = vm.exec_args(&["--timeout", "3"], &["sh", "-c", "sleep 1004 & true"]);
    assert_eq!(r.code, 0, "stderr: {}", r.stderr);
    wait_until("the timeouts kill the background sleeps", 30, || {
        count_procs(&vm, "sleep 1004") == "0" && count_procs(&vm, "sleep 1005") == "0"
    });
    wait_until("no job has background processes", 10, || {
        jobs(&vm).iter().all(|j| j["background_processes"] == 0)
    });
}

#[test]
fn test_service_background_server_keeps_idle_vm_awake_until_cancelled() {
    let d = Daemon::start("");
    let t = d.token("bg", &["--image", "dev"]);
    // The idle policy of the existing idle test (3 s), pausing to keep this test short.
    let r = d.call(
        &t,
        "vm_create",
        json!({"request_id": "bg", "image": "dev", "idle_seconds": 3, "idle_mode": "pause"}),
    );
    assert_eq!(r.status, 200, "{}", r.text);
    let vm = r.body["vm_id"].as_str().expect("vm").to_string();

    // vm_exec with wait_ms returns at the main process's exit.
    let started = Instant::now();
    let r = d.call(
        &t,
        "vm_exec",
        json!({"vm_id": vm, "request_id": "srv", "wait_ms": 30000,
               "command": "python3 -u -m http.server 8124 --bind 127.0.0.1 & echo started"}),
    );
    assert!(started.elapsed() < Duration::from_secs(20), "{}", r.text);
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(
        (&r.body["state"], &r.body["exit_code"], &r.body["stdout"]),
        (&json!("completed"), &json!(0), &json!("started\n")),
        "{}",
        r.text
    );
    assert_eq!(r.body["output_complete"], false, "{}", r.text);
    let job = r.body["job_id"].as_str().expect("job").to_string();

    // vm_status counts and names it (status calls are not work).
    let status = |d: &Daemon| d.ok(&t, "vm_status", json!({"vm_id": vm}));
    wait_until("the server listed under its name", 30, || {
        status(&d)["background_jobs"][0]["pids"][0]["name"] == "python3"
    });
    let s = status(&d);
    assert_eq!(s["jobs"]["running"], 0, "{s}");
    assert_eq!(s["jobs"]["with_background"], 1, "{s}");
    assert_eq!(s["jobs"]["background_processes"], 1, "{s}");
    assert_eq!(s["background_jobs"][0]["job_id"], job, "{s}");
    assert!(
        s["background_jobs"][0]["command"]
            .as_str()
            .is_some_and(|c| c.contains("http.server 8124")),
        "{s}"
    );
    let r = d.ok(&t, "vm_job_status", json!({"vm_id": vm, "job_id": job}));
    assert_eq!(
        (&r["background_processes"], &r["state"]),
        (&json!(1), &json!("completed"))
    );

    // Four idle periods later (checks every 2 s), it still runs: the server is work.
    let quiet = Instant::now();
    while quiet.elapsed() < Duration::from_secs(12) {
        std::thread::sleep(Duration::from_secs(1));
        let s = status(&d);
        assert_eq!(s["state"], "running", "suspended under its server: {s}");
    }
    assert_eq!(status(&d)["jobs"]["background_processes"], 1);

    // Cancel stops the server; the same policy then suspends the idle VM (the control).
    let r = d.call(&t, "vm_job_cancel", json!({"vm_id": vm, "job_id": job}));
    assert_eq!(r.status, 200, "{}", r.text);
    // A status racing the pause itself may fail (its guest call meets stopped vCPUs), so
    // an error only means "look again".
    wait_until(
        "the idle VM paused once its server was cancelled",
        90,
        || d.call(&t, "vm_status", json!({"vm_id": vm})).body["state"] == "paused",
    );
}

/// A hostile guest user's background processes: they cannot leave their job's cgroup (for
/// the root cgroup, the jobs' parent or another job's), one named with an escape sequence
/// and one whose name is not UTF-8 are both counted and listed (escaped in the table), and
/// cancel kills them all.
#[test]
fn test_background_of_hostile_user_stays_in_its_cgroup_counted_and_cancelled() {
    let vm = TestVm::boot();
    let other = vm.sh("sleep 1200 & echo ok");
    assert_eq!(other.stdout, "ok\n", "{}", other.stderr);
    let other_job = job_with(&vm, "sleep 1200");
    let r = vm.sh(
        "cg=/sys/fs/cgroup$(cut -d: -f3 /proc/self/cgroup); \
         other=$(for p in /proc/[0-9]*; do grep -qx 'sleep' $p/comm 2>/dev/null && \
           tr '\\0' ' ' < $p/cmdline | grep -q '^sleep 1200 $' && cut -d: -f3 $p/cgroup; done | head -1); \
         ln -s /bin/sleep /tmp/\"$(printf '\\033]0;pwn\\007')\"; \
         ln -s /bin/sleep /tmp/\"$(printf '\\377\\376')\"; \
         /tmp/\"$(printf '\\033]0;pwn\\007')\" 1300 >/dev/null 2>&1 & a=$!; \
         /tmp/\"$(printf '\\377\\376')\" 1301 >/dev/null 2>&1 & b=$!; \
         for dst in /sys/fs/cgroup \"$(dirname $cg)\" \"/sys/fs/cgroup$other\"; do \
           if echo $a > \"$dst/cgroup.procs\" 2>/dev/null; then echo \"moved to $dst\"; fi; done; \
         grep -c . \"$cg/cgroup.procs\"; echo \"in $other\"",
    );
    assert!(!r.stdout.contains("moved"), "{}: {}", r.stdout, r.stderr);
    assert!(
        r.stdout.contains("in /"),
        "the other job's cgroup found: {}",
        r.stdout
    );
    wait_until("both listed", 30, || {
        job_with(&vm, "cg=/sys")["processes"]
            .as_array()
            .is_some_and(|p| p.len() == 2 && p.iter().all(|p| p["name"] != "sh"))
    });
    let job = job_with(&vm, "cg=/sys");
    assert_eq!(job["background_processes"], 2, "{job}");
    let names: Vec<&str> = job["processes"]
        .as_array()
        .expect("processes")
        .iter()
        .filter_map(|p| p["name"].as_str())
        .collect();
    assert!(names.contains(&"\u{1b}]0;pwn\u{7}"), "{job}");
    assert!(names.contains(&"\u{fffd}\u{fffd}"), "{job}");
    let out = vm.warren(&["vm", "jobs", &vm.id]);
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        !table.contains('\u{1b}') && table.contains("\\u{1b}]0;pwn"),
        "{table:?}"
    );
    let id = job["job_id"].as_str().expect("id").to_string();
    let out = vm.warren(&["vm", "cancel", &vm.id, &id]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    wait_until("both killed", 30, || {
        job_with(&vm, "cg=/sys")["background_processes"] == 0
            && vm
                .sh(
                    "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline 2>/dev/null; echo; done \
                     | grep -c ' 130[01] $' || true",
                )
                .stdout
                .trim()
                == "0"
    });
    assert_eq!(
        job_with(&vm, "sleep 1200")["background_processes"],
        1,
        "{other_job}"
    );
}
