//! Real-VM tests of command execution through the guest agent.

mod common;

use base64::Engine;
use common::*;

#[test]
fn test_exec_echo_prints_guest_output() {
    let vm = TestVm::boot();
    let r = vm.sh("echo hello from $(uname -s); id -u; pwd");
    assert_eq!(r.code, 0, "stderr: {}", r.stderr);
    assert_eq!(r.stdout, "hello from Linux\n1000\n/workspace\n");
    // The agent (PID 1) runs boosted so a busy guest cannot starve it; its jobs do not.
    let r = vm.sh("awk '{print $19}' /proc/1/stat; nice; awk '{print $19}' /proc/self/stat");
    assert_eq!(r.stdout, "-10\n0\n0\n", "stderr: {}", r.stderr);
    // Under TCG the guest's CPU has no fast-`rep movsb` bits (byte-wise under TCG), so its
    // kernel and libc copy with wider moves; it keeps the x86-64-v3 features of `max`.
    let record = vm.env.record(&vm.id).expect("the VM is listed");
    let config = std::fs::read(vm.env.vm_dir(&vm.id).join("supervisor.json")).expect("config");
    let config: serde_json::Value = serde_json::from_slice(&config).expect("config json");
    let cpu = &config["launch"]["cpu"];
    if record["accel"] != "tcg" {
        assert_eq!(cpu, "host", "{record}");
    } else {
        assert_eq!(cpu, "max,-erms,-fsrm", "the model is recorded with the VM");
        let r = vm.sh("grep -m1 '^flags' /proc/cpuinfo");
        let flags: Vec<&str> = r.stdout.split_whitespace().collect();
        for gone in ["erms", "fsrm"] {
            assert!(!flags.contains(&gone), "{gone} in {flags:?}");
        }
        for kept in ["avx2", "sse4_2", "popcnt", "bmi2", "movbe"] {
            assert!(flags.contains(&kept), "{kept} missing from {flags:?}");
        }
    }
}

#[test]
fn test_exec_streams_separate_and_exit_codes() {
    let vm = TestVm::boot();
    let r = vm.sh("echo out; echo err >&2; exit 3");
    assert_eq!(
        (r.code, r.stdout.as_str(), r.stderr.as_str()),
        (3, "out\n", "err\n")
    );
    let r = vm.sh("kill -TERM $$");
    assert_eq!(r.code, 128 + 15);
    let r = vm.exec_args(&[], &["/no/such/program"]);
    assert_eq!(
        r.code, 125,
        "a missing program is a Warren error: {}",
        r.stderr
    );
    // Environment and cwd reach the command.
    vm.sh("mkdir -p sub");
    let r = vm.exec_args(
        &["--cwd", "sub", "--env", "GREETING=hi"],
        &["sh", "-c", "echo $GREETING; pwd"],
    );
    assert_eq!(r.stdout, "hi\n/workspace/sub\n");
}

#[test]
fn test_exec_50mb_output_truncated_guest_stays_healthy() {
    let vm = TestVm::boot();
    let job = vm.detach("head -c 50000000 /dev/zero | tr '\\0' x; echo done >&2");
    let page = vm.wait_job(job);
    assert_eq!(page["truncated"], true);
    assert_eq!(page["exit_code"], 0);
    // Everything retained is readable, and no more than 256 KiB was kept.
    let mut cursor = (0u64, 0u64);
    let mut total = 0usize;
    loop {
        let p = vm.output(
            job,
            &[
                "--stdout-cursor",
                &cursor.0.to_string(),
                "--stderr-cursor",
                &cursor.1.to_string(),
            ],
        );
        let n = (
            p["next_cursor"]["stdout"].as_u64().expect("c"),
            p["next_cursor"]["stderr"].as_u64().expect("c"),
        );
        total += p["stdout"].as_str().expect("s").len();
        if n == cursor {
            break;
        }
        cursor = n;
    }
    assert!(
        total <= 256 * 1024 && total > 200 * 1024,
        "retained {total}"
    );
    let r = vm.sh("echo still alive");
    assert_eq!(r.stdout, "still alive\n");
}

#[test]
fn test_exec_utf8_split_across_reads_and_base64() {
    let vm = TestVm::boot();
    // "aé" is 61 c3 a9: a 2-byte page ends inside the é.
    let job = vm.detach("printf 'a\\303\\251'; printf '\\000\\377' >&2");
    vm.wait_job(job);
    let p = vm.output(job, &["--max-bytes", "2"]);
    assert_eq!(p["stdout"], "a");
    assert_eq!(
        p["next_cursor"]["stdout"], 1,
        "the split character waits for the next read"
    );
    assert_eq!(p["decoding_errors"]["stdout"], false);
    let p = vm.output(job, &["--stdout-cursor", "1", "--stderr-cursor", "2"]);
    assert_eq!(p["stdout"], "é");
    // Invalid UTF-8 is replaced and flagged; base64 gives the exact bytes.
    let p = vm.output(job, &["--stdout-cursor", "3"]);
    assert_eq!(p["stderr"], "\u{0}\u{FFFD}");
    assert_eq!(p["decoding_errors"]["stderr"], true);
    let p = vm.output(job, &["--encoding", "base64"]);
    let b = base64::engine::general_purpose::STANDARD;
    assert_eq!(
        b.decode(p["stderr_base64"].as_str().expect("b64"))
            .expect("decode"),
        vec![0, 255]
    );
    assert_eq!(
        b.decode(p["stdout_base64"].as_str().expect("b64"))
            .expect("decode"),
        "aé".as_bytes()
    );
    // Re-reading a cursor is non-destructive.
    let again = vm.output(job, &["--encoding", "base64"]);
    assert_eq!(again["stdout_base64"], p["stdout_base64"]);
}

#[test]
fn test_exec_timeout_kills_setsid_grandchild() {
    let vm = TestVm::boot();
    let started = std::time::Instant::now();
    let r = vm.exec_args(
        &["--timeout", "2"],
        &["sh", "-c", "setsid sh -c 'sleep 1000' & sleep 1000"],
    );
    assert_eq!(r.code, 124, "stderr: {}", r.stderr);
    assert!(started.elapsed().as_secs() < 30);
    let r = vm.sh("for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline 2>/dev/null; echo; done | grep -c '^sleep 1000' || true");
    assert_eq!(r.stdout.trim(), "0", "a sleep survived the timeout");
}

#[test]
fn test_exec_cancel_kills_job() {
    let vm = TestVm::boot();
    let job = vm.detach("echo started; sleep 1000");
    let out = vm.warren(&["vm", "cancel", &vm.id, &job.to_string()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let p = vm.wait_job(job);
    assert_eq!(p["cancelled"], true);
    assert_eq!(p["signal"], 9);
    // Unknown jobs are not_found.
    let out = vm.warren(&["vm", "output", &vm.id, "999999"]);
    assert_eq!(out.status.code(), Some(125));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not_found"));
}

#[test]
fn test_exec_concurrent_cli_processes_one_vm() {
    let vm = TestVm::boot();
    let handles: Vec<_> = (0..4)
        .map(|i| {
            let mut c = vm.env.cmd();
            c.args(["vm", "exec", &vm.id, "--", "sh", "-c"])
                .arg(format!("sleep 1; echo job{i}"));
            std::thread::spawn(move || c.output().expect("exec"))
        })
        .collect();
    let started = std::time::Instant::now();
    for (i, h) in handles.into_iter().enumerate() {
        let out = h.join().expect("thread");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(String::from_utf8_lossy(&out.stdout), format!("job{i}\n"));
    }
    assert!(started.elapsed().as_secs_f64() < 20.0);
}

#[test]
fn test_exec_fifth_running_job_quota_exceeded() {
    let vm = TestVm::boot();
    let jobs: Vec<u64> = (0..4).map(|_| vm.detach("sleep 1000")).collect();
    let out = vm.warren(&["vm", "exec", &vm.id, "--detach", "--", "true"]);
    assert_eq!(out.status.code(), Some(125));
    assert!(String::from_utf8_lossy(&out.stderr).contains("quota_exceeded"));
    for j in jobs {
        vm.warren(&["vm", "cancel", &vm.id, &j.to_string()]);
    }
}

/// The `dev` image carries what agents reach for, each tool run for real, and `lo` is up in
/// a VM without a network: a server on 127.0.0.1 answers curl and wget there.
#[test]
fn test_exec_dev_image_runs_python_node_and_agent_tools_over_loopback() {
    let vm = TestVm::boot_image("dev");
    let r =
        vm.sh("python3 -c 'print(6*7)' && node -e 'console.log(1+1)' && gcc --version | head -1");
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(r.stdout.starts_with("42\n2\n"), "{}", r.stdout);

    // Each tool does a small real job; `set -e` stops at the first that fails and the
    // echoed marker names it.
    let script = r#"set -eu
        cd /tmp && mkdir -p t/sub && cd t
        echo 'needle in a haystack' > sub/hay.txt
        step() { echo "step $1" >&2; }
        step jq;      test "$(echo '{"a":[1,2,3]}' | jq -c '.a|add')" = 6
        step rg;      test "$(rg -l needle .)" = ./sub/hay.txt
        step fd;      test "$(fd -t f hay)" = sub/hay.txt
        step zip;     zip -q -r a.zip sub && rm -r sub && unzip -q a.zip && test -f sub/hay.txt
        step xz;      xz -k sub/hay.txt && test "$(xz -dc sub/hay.txt.xz)" = 'needle in a haystack'
        step file;    file sub/hay.txt.xz | grep -q 'XZ compressed'
        step make;    printf 'all:\n\t@echo made\n' > Makefile && test "$(make -s)" = made
        step procps;  ps -o comm= -p $$ | grep -q sh && free -m | grep -q Mem
        step less;    test "$(echo paged | less -FX)" = paged
        step ssh;     ssh -V 2>&1 | grep -q OpenSSH
        step pip;     python3 -m pip --version | grep -q '^pip '
        step venv;    python3 -m venv --without-pip /tmp/v && /tmp/v/bin/python -c 'import sys; assert sys.prefix == "/tmp/v"'
        step npm;     npm --version | grep -Eq '^[0-9]+\.'
        step lo;      cat /sys/class/net/lo/operstate
        python3 -m http.server 18080 --bind 127.0.0.1 --directory /tmp/t >/dev/null 2>&1 &
        server=$!
        step curl;    for i in $(seq 1 100); do curl -fsS -o /dev/null http://127.0.0.1:18080/ && break; sleep 0.2; done
        curl -fsS http://127.0.0.1:18080/sub/hay.txt
        step wget;    wget -q -O - http://127.0.0.1:18080/Makefile | grep -q made
        kill $server
        echo all-tools-ok"#;
    let r = vm.sh(script);
    assert_eq!(r.code, 0, "stdout {}\nstderr {}", r.stdout, r.stderr);
    assert!(
        r.stdout.ends_with("needle in a haystack\nall-tools-ok\n"),
        "{}",
        r.stdout
    );
    // No NIC but `lo`, and `lo` is up (its operstate is `unknown`, as for every loopback).
    assert!(r.stdout.starts_with("unknown\n"), "{}", r.stdout);
    let links = vm.sh("ls /sys/class/net");
    assert_eq!(
        links.stdout.trim(),
        "lo",
        "a VM without a network has no NIC"
    );
}
