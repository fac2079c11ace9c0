//! Pause, hibernate and resume on a real VM: processes, files, job timeouts and the guest
//! clock all survive, and work wakes a suspended VM.

mod common;

use common::TestVm;

fn suspend(vm: &TestVm, args: &[&str]) -> std::process::Output {
    let mut a = vec!["vm", "suspend", vm.id.as_str()];
    a.extend_from_slice(args);
    vm.warren(&a)
}

fn ok(out: std::process::Output, what: &str) {
    assert!(
        out.status.success(),
        "{what}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Bytes of stdout the job has produced so far (reading wakes the VM).
fn produced(vm: &TestVm, job: u64) -> usize {
    vm.output(job, &[])["stdout"]
        .as_str()
        .map(str::len)
        .unwrap_or(0)
}

#[test]
fn test_suspend_pause_and_hibernate_keep_processes_files_timeouts_and_clock() {
    let vm = TestVm::boot();
    let counter =
        vm.detach("echo pid $$; i=0; while true; do echo $i; i=$((i+1)); sleep 0.2; done");
    let pid = {
        common::wait_until("counter started", 30, || {
            vm.output(counter, &[])["stdout"]
                .as_str()
                .unwrap_or("")
                .starts_with("pid ")
        });
        let out = vm.output(counter, &[]);
        out["stdout"]
            .as_str()
            .expect("stdout")
            .lines()
            .next()
            .expect("line")[4..]
            .to_string()
    };
    ok(
        {
            let mut c = vm.env.cmd();
            c.args(["vm", "write", &vm.id, "notes/before.txt"]);
            c.stdin(std::process::Stdio::piped());
            let mut child = c
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .expect("write");
            use std::io::Write;
            child
                .stdin
                .take()
                .expect("stdin")
                .write_all(b"kept across hibernation\n")
                .expect("stdin write");
            child.wait_with_output().expect("wait")
        },
        "vm write",
    );

    // Active jobs refuse a suspend unless forced.
    let out = suspend(&vm, &["--mode", "pause"]);
    assert_eq!(out.status.code(), Some(125));
    assert!(String::from_utf8_lossy(&out.stderr).contains("error[busy]"));
    assert_eq!(vm.state(), "running");

    // Pause: the guest stands still, then continues.
    ok(suspend(&vm, &["--mode", "pause", "--force"]), "pause");
    assert_eq!(vm.state(), "paused");
    assert!(!vm.qemu_pids().is_empty(), "a paused VM keeps its VMM");
    std::thread::sleep(std::time::Duration::from_millis(500));
    assert_eq!(vm.state(), "paused", "status polling woke the VM");
    ok(vm.warren(&["vm", "resume", &vm.id]), "resume");
    let before = produced(&vm, counter);
    std::thread::sleep(std::time::Duration::from_millis(1500));
    assert!(
        produced(&vm, counter) > before,
        "the counter stopped after resume"
    );

    // A job with a 3 s budget, suspended longer than that, still has its budget.
    let timed = {
        let out = vm.warren(&[
            "vm",
            "exec",
            &vm.id,
            "--detach",
            "--timeout",
            "3",
            "--",
            "sh",
            "-c",
            // 1 s of work in a 3 s budget: 2 s of slack for a loaded TCG guest, while the
            // 4 s spent hibernated below would exhaust the budget if it were counted.
            "sleep 1; echo finished",
        ]);
        assert!(out.status.success());
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
        v["job_id"].as_u64().expect("job")
    };

    // Hibernate: no VMM remains; work wakes it; everything is where it was.
    ok(suspend(&vm, &["--force"]), "hibernate");
    assert_eq!(vm.state(), "hibernated");
    assert!(vm.qemu_pids().is_empty(), "a hibernated VM holds no VMM");
    std::thread::sleep(std::time::Duration::from_secs(4));
    let r = vm.sh(&format!(
        "kill -0 {pid} && echo alive; cat notes/before.txt; date +%s"
    ));
    assert_eq!(r.code, 0, "{}", r.stderr);
    let mut lines = r.stdout.lines();
    assert_eq!(lines.next(), Some("alive"), "{}", r.stdout);
    assert_eq!(lines.next(), Some("kept across hibernation"));
    let guest: i64 = lines.next().and_then(|l| l.parse().ok()).expect("date");
    let host = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs() as i64;
    assert!(
        (host - guest).abs() <= 2,
        "guest clock {guest}, host {host}"
    );
    assert_eq!(vm.state(), "running");
    let page = vm.wait_job(timed);
    assert_eq!(page["timed_out"], false, "suspended time counted: {page}");
    assert_eq!(page["exit_code"], 0);

    // Repeated cycles stay clean.
    for i in 0..10 {
        ok(suspend(&vm, &["--force"]), "hibernate cycle");
        ok(vm.warren(&["vm", "resume", &vm.id]), "resume cycle");
        let r = vm.sh(&format!("kill -0 {pid} && echo {i}"));
        assert_eq!(r.stdout.trim(), i.to_string(), "cycle {i}: {}", r.stderr);
    }
    let before = produced(&vm, counter);
    std::thread::sleep(std::time::Duration::from_millis(1000));
    assert!(
        produced(&vm, counter) > before,
        "the counter stopped after cycles"
    );

    // A checkpoint written by another QEMU is refused, loudly, and stays resumable.
    ok(suspend(&vm, &["--force"]), "hibernate");
    // A hibernated VM's directory (0711: its QEMU reaches `run/`) holds only owner-only
    // files: records, logs, sockets (its checkpoint, exit and job records among them).
    let dir = vm.env.vm_dir(&vm.id);
    let mut seen = Vec::new();
    for e in std::fs::read_dir(&dir).expect("vm dir").flatten() {
        let m = std::fs::symlink_metadata(e.path()).expect("stat");
        let name = e.file_name().to_string_lossy().into_owned();
        if !m.is_dir() {
            use std::os::unix::fs::PermissionsExt;
            assert_eq!(
                m.permissions().mode() & 0o077,
                0,
                "{name} is readable by others"
            );
            seen.push(name);
        }
    }
    for record in ["checkpoint.json", "exit.json", "jobs-seen.json"] {
        assert!(seen.iter().any(|n| n == record), "no {record} in {seen:?}");
    }
    let rec = dir.join("checkpoint.json");
    let original = std::fs::read_to_string(&rec).expect("checkpoint record");
    let v: serde_json::Value = serde_json::from_str(&original).expect("json");
    let digest = v["qemu_sha256"].as_str().expect("digest").to_string();
    std::fs::write(&rec, original.replace(&digest, &"0".repeat(64))).expect("edit");
    let out = vm.warren(&["vm", "resume", &vm.id]);
    assert_eq!(out.status.code(), Some(125));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("error[conflict]") && err.contains("QEMU"),
        "{err}"
    );
    assert_eq!(vm.state(), "hibernated");
    std::fs::write(&rec, original).expect("restore record");
    ok(
        vm.warren(&["vm", "resume", &vm.id]),
        "resume after the refusal",
    );
    assert_eq!(
        vm.sh(&format!("kill -0 {pid} && echo ok")).stdout.trim(),
        "ok"
    );

    // Two resumes of one checkpoint get different random streams (fresh host entropy and a
    // CRNG reseed on every resume). Restoring a checkpoint twice is done here by hand only.
    ok(suspend(&vm, &["--force"]), "hibernate");
    let dir = vm.env.vm_dir(&vm.id);
    let keep = |from: &str, to: &str| {
        let st = std::process::Command::new("cp")
            .args(["-a", "--sparse=always"])
            .arg(dir.join(from))
            .arg(dir.join(to))
            .status()
            .expect("cp");
        assert!(st.success());
    };
    keep("run/checkpoint.ram", "run/checkpoint.ram.keep");
    keep("checkpoint.json", "checkpoint.json.keep");
    let random = || vm.sh("head -c 16 /dev/urandom | od -An -tx1").stdout;
    let first = random();
    ok(suspend(&vm, &["--force"]), "hibernate again");
    keep("run/checkpoint.ram.keep", "run/checkpoint.ram");
    keep("checkpoint.json.keep", "checkpoint.json");
    let second = random();
    assert!(!first.trim().is_empty());
    assert_ne!(
        first, second,
        "two resumes of one checkpoint replayed the same randomness"
    );
}

/// Faults mid-hibernate: a failed save with QEMU still running continues the VM; a supervisor
/// that dies before the checkpoint record leaves the VM failed (never restored onto a state
/// that may be incomplete); one that dies after it leaves the VM hibernated, and it resumes.
#[test]
fn test_suspend_crash_mid_hibernate_failed_or_hibernated_never_reset() {
    common::ensure_image("minimal");
    for (point, survives) in [
        ("hibernate:fail-save", true),
        ("hibernate:after-save", false),
        ("hibernate:after-record", true),
    ] {
        let env = common::TestEnv::new();
        let minimal = common::image_id("minimal");
        let out = env
            .cmd()
            .env("WARREN_TEST_CRASH", point)
            .args(["vm", "create", "--image", &minimal, "--json"])
            .output()
            .expect("create");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
        let mut vm = TestVm::adopt(env, v["vm_id"].as_str().expect("id").to_string());
        let r = vm.sh("echo marker > /tmp/m; echo $$");
        assert_eq!(r.code, 0);
        let out = suspend(&vm, &["--force"]);
        if point == "hibernate:fail-save" {
            // The save failed while QEMU ran: the migration is dropped and the VM continues.
            assert!(!out.status.success());
            assert_eq!(vm.state(), "running");
            assert_eq!(vm.sh("cat /tmp/m").stdout, "marker\n");
        } else if survives {
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            assert_eq!(vm.state(), "hibernated");
            ok(vm.warren(&["vm", "resume", &vm.id]), "resume");
            assert_eq!(vm.sh("cat /tmp/m").stdout, "marker\n");
        } else {
            assert!(
                !out.status.success(),
                "a crashed hibernation reported success"
            );
            assert_eq!(vm.state(), "failed", "{point}");
            assert!(vm.qemu_pids().is_empty(), "QEMU left running after {point}");
            let out = vm.warren(&["vm", "resume", &vm.id]);
            assert!(!out.status.success(), "a failed VM was resumed");
            vm.expect_failure = true;
        }
    }
}

/// Fast standby: guest RAM in the VM's RAM file, the checkpoint holds device state only; the
/// process continues with its PID and memory after each of three cycles, with no QEMU left
/// while hibernated.
#[test]
fn test_suspend_standby_ram_file_small_checkpoint_process_continues() {
    common::ensure_image("minimal");
    let env = common::TestEnv::new();
    let id = env.create_vm_with("minimal", &["--ram-file"]);
    let vm = TestVm::adopt(env, id);
    let job = vm.detach("echo pid $$; i=0; while true; do echo $i; i=$((i+1)); sleep 0.2; done");
    common::wait_until("counter", 30, || produced(&vm, job) > 10);
    let run = vm.env.vm_dir(&vm.id).join("run");
    let pid_line = |vm: &TestVm| {
        vm.output(job, &[])["stdout"]
            .as_str()
            .unwrap_or("")
            .lines()
            .next()
            .unwrap_or("")
            .to_string()
    };
    let first = pid_line(&vm);
    for cycle in 0..3 {
        ok(suspend(&vm, &["--mode", "hibernate", "--force"]), "standby");
        assert_eq!(vm.state(), "hibernated");
        assert!(
            vm.qemu_pids().is_empty(),
            "QEMU still running while hibernated"
        );
        let state = std::fs::metadata(run.join("checkpoint.ram"))
            .expect("state")
            .len();
        assert!(
            state < 1 << 20,
            "cycle {cycle}: device state only, got {state} bytes"
        );
        assert!(run.join("guest.ram").exists(), "the RAM file stays");
        let before = produced(&vm, job);
        assert_eq!(vm.state(), "running", "reading output wakes the VM");
        common::wait_until("counting again", 30, || produced(&vm, job) > before + 5);
    }
    assert_eq!(pid_line(&vm), first, "same process across standby cycles");
    let r = vm.sh("cat /proc/meminfo | head -1");
    assert_eq!(r.code, 0);
    // The channel's own round trip (an HTTP/2 PING) works on the session the resumed VM's
    // new supervisor made, and measures something real.
    let client =
        warren_supervisor::SupervisorClient::new(&vm.env.vm_dir(&vm.id).join("supervisor.sock"));
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    for _ in 0..3 {
        let rtt = rt.block_on(client.channel_ping()).expect("channel ping");
        assert!(
            rtt > std::time::Duration::ZERO && rtt < std::time::Duration::from_secs(20),
            "channel ping took {rtt:?}"
        );
    }
    vm.destroy();
}
