//! Per-VM host limits: a process placed in a VM's host cgroup is held to the VM's memory and
//! pids limits (v2 controllers, or the v1 ones on hybrid hosts), and the VM keeps running;
//! the VM's supervisor is held to them too.

mod common;

use std::path::PathBuf;
use std::process::Command;

use common::TestVm;

/// Where `controller`'s limit `file` of the VM lives: its v2 cgroup, or the v1 peer.
fn home(vm: &TestVm, controller: &str, file: &str) -> PathBuf {
    let v2 = vm
        .cgroup_dir()
        .expect("the VM has a host cgroup (tests run as root)");
    if v2.join(file).exists() {
        return v2;
    }
    let v1 = PathBuf::from("/sys/fs/cgroup")
        .join(controller)
        .join("warren")
        .join(&vm.id);
    assert!(
        v1.join(file).exists(),
        "no {file} for the VM in v2 or v1: {}",
        v1.display()
    );
    v1
}

fn read(dir: &std::path::Path, file: &str) -> String {
    std::fs::read_to_string(dir.join(file))
        .unwrap_or_else(|e| panic!("{}: {e}", dir.join(file).display()))
        .trim()
        .to_string()
}

/// Runs python3 `code`, first joining `cgroups` (none: the test's own cgroup).
fn python_in(cgroups: &[PathBuf], code: &str) -> std::process::Output {
    let mut join = String::new();
    for d in cgroups {
        join.push_str(&format!("echo $$ > '{}/cgroup.procs' && ", d.display()));
    }
    Command::new("sh")
        .arg("-c")
        .arg(format!("{join}exec python3 -c '{code}'"))
        .output()
        .expect("run python3")
}

const HOG: &str = "x = b\"\\x01\" * (3 << 30); print(len(x))";
const FORKS: &str = "
import os, signal, time
kids = []
try:
    for i in range(700):
        pid = os.fork()
        if pid == 0:
            time.sleep(120)
            os._exit(0)
        kids.append(pid)
except OSError:
    pass
print(len(kids), flush=True)
for k in kids:
    os.kill(k, signal.SIGKILL)
for k in kids:
    os.waitpid(k, 0)
";

#[test]
fn test_vm_host_cgroup_limits_memory_and_pids_and_the_vm_survives() {
    common::ensure_image("minimal");
    let env = common::TestEnv::new();
    let share = tempfile::tempdir().expect("tempdir");
    let mount = format!("{}:/mnt/share", share.path().display());
    let id = env.create_vm_with("minimal", &["--mount", &mount]);
    let vm = TestVm::adopt(env, id);
    let rec = vm.env.record(&vm.id).expect("VM record");
    let mib = rec["memory_mib"].as_u64().expect("memory_mib");
    let vcpus = rec["vcpus"].as_u64().expect("vcpus");
    let v2 = vm.cgroup_dir().expect("cgroup");
    let qemu = vm.qemu_pids();
    assert_eq!(qemu.len(), 1, "{qemu:?}");

    // The limits written, where this host enforces them.
    let (mem, mem_file, mem_want) = {
        let v2_file = "memory.max";
        let want = ((2 * mib + 1024) << 20).to_string();
        if v2.join(v2_file).exists() {
            (v2.clone(), v2_file, want)
        } else {
            let d = home(&vm, "memory", "memory.limit_in_bytes");
            (d, "memory.limit_in_bytes", want)
        }
    };
    assert_eq!(read(&mem, mem_file), mem_want);
    let pids = home(&vm, "pids", "pids.max");
    assert_eq!(read(&pids, "pids.max"), "512");
    let cpu_want = ((vcpus + 1) * 100_000).to_string();
    let cpu = if v2.join("cpu.max").exists() {
        assert_eq!(read(&v2, "cpu.max"), format!("{cpu_want} 100000"));
        v2.clone()
    } else {
        let cpu = home(&vm, "cpu", "cpu.cfs_quota_us");
        assert_eq!(read(&cpu, "cpu.cfs_quota_us"), cpu_want);
        cpu
    };
    // QEMU is in every cgroup that limits it.
    for dir in [&v2, &mem, &pids, &cpu] {
        let procs = read(dir, "cgroup.procs");
        assert!(
            procs.lines().any(|l| l.trim() == qemu[0].to_string()),
            "QEMU {} not in {}: {procs}",
            qemu[0],
            dir.display()
        );
    }
    // The supervisor is in each of them's `supervisor` child, so that what it does for the
    // guest (channel, streams, egress) counts against the VM's limits; it is no member of
    // the VM's cgroup itself, which stays its VMM's and helpers'.
    let supervisor = vm.supervisor_pid().to_string();
    for dir in [&v2, &mem, &pids, &cpu] {
        let child = dir.join("supervisor");
        let procs = read(&child, "cgroup.procs");
        assert!(
            procs.lines().any(|l| l.trim() == supervisor),
            "supervisor {supervisor} not in {}: {procs}",
            child.display()
        );
        assert!(
            !read(dir, "cgroup.procs")
                .lines()
                .any(|l| l.trim() == supervisor),
            "the supervisor is a member of {} itself",
            dir.display()
        );
    }
    // So is every virtiofsd process, the sandbox's forked child (which serves the guest)
    // included: each joins in the child before exec.
    let mut daemons = 0;
    for entry in std::fs::read_dir("/proc").expect("proc").flatten() {
        let pid = entry.file_name().to_string_lossy().into_owned();
        let Ok(comm) = std::fs::read_to_string(entry.path().join("comm")) else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let vm_dir = vm.env.vm_dir(&vm.id);
        if comm.trim() != "virtiofsd"
            || !String::from_utf8_lossy(&cmdline).contains(vm_dir.to_str().expect("utf-8"))
        {
            continue;
        }
        daemons += 1;
        for dir in [&v2, &mem, &pids] {
            let procs = read(dir, "cgroup.procs");
            assert!(
                procs.lines().any(|l| l.trim() == pid),
                "virtiofsd {pid} not in {}",
                dir.display()
            );
        }
    }
    assert!(
        daemons >= 2,
        "the share's virtiofsd and its sandbox child: {daemons}"
    );
    let mut joined = vec![v2.clone()];
    for d in [&mem, &pids] {
        if !joined.contains(d) {
            joined.push(d.clone());
        }
    }

    // Positive control: outside the VM's cgroup, 3 GiB are allocated and 700 forks succeed.
    let out = python_in(&[], HOG);
    assert!(out.status.success(), "control hog: {out:?}");
    let out = python_in(&[], FORKS);
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "700",
        "{out:?}"
    );

    // Inside it, the memory hog is OOM-killed ...
    let out = python_in(&joined, HOG);
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(
        out.status.signal(),
        Some(9),
        "the hog was not OOM-killed: {out:?}"
    );
    // ... and the fork loop stops below the pids limit.
    let out = python_in(&joined, FORKS);
    let n: u32 = String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("fork loop output: {out:?}"));
    eprintln!("forks inside the VM's cgroup before the pids limit: {n}");
    assert!(n > 0 && n < 512, "{n} forks");

    // The VM's own processes kept running.
    assert_eq!(vm.qemu_pids(), qemu, "QEMU changed");
    let r = vm.sh("echo alive");
    assert_eq!((r.code, r.stdout.as_str()), (0, "alive\n"), "{}", r.stderr);
    vm.destroy();
    assert!(
        !v2.exists() && !mem.exists() && !pids.exists() && !cpu.exists(),
        "limit cgroups left behind"
    );
}
