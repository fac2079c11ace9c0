//! Real-VM tests of the VM lifecycle: failure detection, cleanup, image integrity.

mod common;

use common::*;

#[test]
fn test_lifecycle_qemu_killed_vm_failed_with_reason() {
    let mut vm = TestVm::boot();
    vm.expect_failure = true;
    let pids = vm.qemu_pids();
    assert_eq!(pids.len(), 1, "one QEMU per VM");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pids[0]),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("kill qemu");
    wait_until("failed state", 20, || vm.state() == "failed");
    let rec = vm.env.record(&vm.id).expect("record");
    let reason = rec["reason"].as_str().expect("reason");
    assert!(reason.contains("SIGKILL"), "reason: {reason}");
    let r = vm.sh("true");
    assert_eq!(r.code, 125);
    assert!(r.stderr.contains("failed"), "{}", r.stderr);
}

#[test]
fn test_lifecycle_supervisor_killed_no_orphan_qemu() {
    let mut vm = TestVm::boot();
    vm.expect_failure = true;
    let sup = vm.supervisor_pid();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(sup),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("kill supervisor");
    wait_until("QEMU to die with its supervisor", 20, || {
        vm.qemu_pids().is_empty()
    });
    wait_until("failed state", 20, || vm.state() == "failed");
    let rec = vm.env.record(&vm.id).expect("record");
    assert!(rec["reason"]
        .as_str()
        .expect("reason")
        .contains("supervisor"));
}

#[test]
fn test_lifecycle_destroy_leaves_nothing() {
    let vm = TestVm::boot();
    let dir = vm.env.vm_dir(&vm.id);
    assert!(dir.join("run/disk.qcow2").exists());
    assert!(dir.join("supervisor.sock").exists());
    let qemu = vm.qemu_pids();
    assert_eq!(qemu.len(), 1);
    let sup = vm.supervisor_pid();
    let cg = vm.cgroup_dir();
    if let Some(cg) = &cg {
        assert!(cg.exists(), "VM cgroup exists while running");
    }
    let id = vm.id.clone();
    let state_dir = vm.env.state.path().to_path_buf();
    // destroy() also asserts that the directory, QEMU and the cgroup are gone.
    vm.destroy();
    assert!(!std::path::Path::new(&format!("/proc/{sup}")).exists() || zombie(sup));
    assert!(!state_dir.join("vms").join(&id).exists());
    if let Some(cg) = cg {
        assert!(!cg.exists());
    }
}

fn zombie(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| s.contains(") Z "))
        .unwrap_or(true)
}

#[test]
fn test_lifecycle_vm_list_and_logs() {
    let vm = TestVm::boot();
    assert_eq!(vm.state(), "running");
    let out = vm.warren(&["vm", "logs", &vm.id]);
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains(warren_protocol_ready()));
    let out = vm.warren(&["vm", "exec", "vm-nosuch", "--", "true"]);
    assert_eq!(out.status.code(), Some(125));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not_found"));
}

fn warren_protocol_ready() -> &'static str {
    "warren-guest: ready"
}

/// A kernel whose timer calibration the host disturbed (made certain here: a QEMU wrapper
/// names a wrong APIC clock, or turns the APIC timer off, on the command line of the first
/// boots) is stopped by the agent before anything runs, and the VM is booted again: once is
/// invisible but for the logs, three times in a row fail the create, saying why.
#[test]
fn test_lifecycle_disturbed_timer_calibration_boots_again() {
    use std::os::unix::fs::PermissionsExt;
    ensure_image("minimal");
    let env = TestEnv::new();
    let qemu = std::env::var_os("PATH")
        .and_then(|p| {
            std::env::split_paths(&p)
                .map(|d| d.join("qemu-system-x86_64"))
                .find(|p| p.is_file())
        })
        .expect("qemu-system-x86_64 on PATH");
    // The VMM runs as the VM's uid: the wrapper and its counter must be open to it.
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let counter = dir.path().join("boots-to-disturb");
    let wrapper = dir.path().join("qemu");
    std::fs::write(
        &wrapper,
        format!(
            "#!/bin/bash\nread -r n how < {c}\nif [ \"$n\" -gt 0 ]; then\n  \
             echo \"$((n-1)) $how\" > {c}\n  \
             if [ \"$how\" = rate ]; then to=\"warren.apic_bus_khz=3000000\"; \
             else to=\"warren.apic_bus_khz=1000000 noapictimer\"; fi\n  \
             set -- \"${{@/warren.apic_bus_khz=1000000/$to}}\"\nfi\nexec {q} \"$@\"\n",
            c = counter.display(),
            q = qemu.display()
        ),
    )
    .expect("write wrapper");
    std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let disturb = |n: u32, how: &str| {
        std::fs::write(&counter, format!("{n} {how}\n")).expect("counter");
        std::fs::set_permissions(&counter, std::fs::Permissions::from_mode(0o666)).expect("chmod");
    };
    let image = pinned_image("minimal");
    let create = || {
        env.cmd()
            .env("WARREN_QEMU", &wrapper)
            // The wrapper's counter is in its own directory: in the VMM's view for tests.
            .env("WARREN_TEST_VMM_DIR", dir.path())
            .env("WARREN_ACCEL", "tcg")
            .args(["vm", "create", "--image", &image, "--json"])
            .output()
            .expect("run warren")
    };

    // The first boot's kernel is told a wrong rate: the create succeeds on the second.
    disturb(1, "rate");
    let out = create();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "create: {stderr}");
    assert_eq!(
        std::fs::read_to_string(&counter).expect("counter").trim(),
        "0 rate"
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("create json");
    let id = v["vm_id"].as_str().expect("vm_id").to_string();
    let logs = env.run(&["vm", "logs", &id]);
    let logs = String::from_utf8_lossy(&logs.stdout).into_owned();
    let failed = logs
        .find("guest: clock failed: ")
        .expect("the first boot's line");
    let ready = logs.rfind(warren_protocol_ready()).expect("ready");
    assert!(failed < ready, "{logs}");
    assert!(logs.contains("3000000 kHz"), "{logs}");
    let sup = std::fs::read_to_string(env.vm_dir(&id).join("supervisor.log")).expect("log");
    // Two launches; three when a loaded host also upset the next boot's own calibration
    // (the engine boots again for that too: a loaded run saw it).
    let launched = sup.matches("VMM launched").count();
    assert!((2..=3).contains(&launched), "{launched} launches: {sup}");
    let r = env.run(&["vm", "exec", &id, "--", "echo", "alive"]);
    assert_eq!(String::from_utf8_lossy(&r.stdout).trim(), "alive");
    let r = env.run(&["vm", "destroy", &id]);
    assert!(r.status.success());

    // Every boot's kernel without an APIC timer (the state a failed calibration leaves):
    // three boots, then a refusal that says why.
    disturb(5, "notimer");
    let out = create();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "a create whose kernel never calibrated"
    );
    assert!(stderr.contains("guest: clock failed: "), "{stderr}");
    assert!(stderr.contains("no timer on CPU 0"), "{stderr}");
    assert!(stderr.contains("booted 3 times"), "{stderr}");
    assert_eq!(
        std::fs::read_to_string(&counter).expect("counter").trim(),
        "2 notimer"
    );
}

#[test]
fn test_lifecycle_bad_create_arguments_rejected() {
    ensure_image("minimal");
    let env = TestEnv::new();
    for args in [
        vec!["vm", "create", "--image", "minimal", "--memory-mib", "1"],
        vec!["vm", "create", "--image", "minimal", "--vcpus", "0"],
        vec!["vm", "create", "--image", "no-such-image"],
        vec!["vm", "create", "--image", "minimal", "--accel", "hvf"],
        vec!["vm", "create", "--image", "minimal", "--accel", "xen"],
    ] {
        let out = env.run(&args);
        assert_eq!(out.status.code(), Some(125), "{args:?} accepted");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("error["), "{args:?}: {err}");
    }
    let out = env.run(&["vm", "list", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(
        v.as_array().map(Vec::len),
        Some(0),
        "a rejected create left a record"
    );
}

#[test]
fn test_lifecycle_image_digest_mismatch_refused() {
    ensure_image("minimal");
    let (_store, images) = private_store();
    let env = TestEnv::with_image_dir(images.clone());
    let list = env.run(&["image", "list", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&list.stdout).expect("json");
    let id = v
        .as_array()
        .expect("array")
        .iter()
        .find(|i| i["recipe"] == "minimal")
        .expect("minimal image")["image_id"]
        .as_str()
        .expect("id")
        .to_string();
    // Replace the hard link with a tampered copy.
    let initramfs = images.join(&id).join("initramfs.cpio");
    let mut data = std::fs::read(&initramfs).expect("read");
    let last = data.len() - 1;
    data[last] ^= 0xff;
    std::fs::remove_file(&initramfs).expect("unlink");
    std::fs::write(&initramfs, data).expect("write");
    let out = env.run(&["vm", "create", "--image", &id]);
    assert_eq!(out.status.code(), Some(125));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("integrity") && err.contains("initramfs"),
        "{err}"
    );
}

/// A private copy of the shared image store (hard links: nothing shared is modified).
fn private_store() -> (tempfile::TempDir, std::path::PathBuf) {
    // Next to the shared store, so hard links never cross a file system.
    let parent = image_dir()
        .parent()
        .expect("image dir has a parent")
        .to_path_buf();
    let store = tempfile::tempdir_in(parent).expect("tempdir");
    let images = store.path().join("images");
    let ok = std::process::Command::new("cp")
        .arg("-al")
        .arg(image_dir())
        .arg(&images)
        .status()
        .expect("cp");
    assert!(ok.success());
    (store, images)
}

#[test]
fn test_lifecycle_image_rm_refused_while_in_use() {
    ensure_image("minimal");
    let (_store, images) = private_store();
    let env = TestEnv::with_image_dir(images);
    let vm = env.create_vm("minimal");
    let image = env.record(&vm).expect("record")["image_id"]
        .as_str()
        .expect("image")
        .to_string();
    let out = env.run(&["image", "rm", &image]);
    assert_eq!(out.status.code(), Some(125));
    assert!(String::from_utf8_lossy(&out.stderr).contains("conflict"));
    assert!(env.run(&["vm", "destroy", &vm]).status.success());
    let out = env.run(&["image", "rm", &image]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let list = env.run(&["image", "list", "--json"]);
    assert!(!String::from_utf8_lossy(&list.stdout).contains(&image));
}

/// Another local user who can traverse the state directory (and the 0711 VM directory)
/// still cannot read the database, its WAL, or any of the VM's logs: they are its owner's
/// only. Positive control: a 0644 file in the same VM directory is readable by that user.
#[test]
fn test_lifecycle_database_wal_and_vm_logs_are_owner_only() {
    use std::os::unix::fs::PermissionsExt;
    let vm = TestVm::boot();
    let state = vm.env.state.path().to_path_buf();
    std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o711)).expect("chmod");
    let dir = vm.env.vm_dir(&vm.id);
    let probe = dir.join("probe-readable");
    std::fs::write(&probe, "x\n").expect("write");
    std::fs::set_permissions(&probe, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    let as_other = |path: &std::path::Path| {
        std::process::Command::new("setpriv")
            .args([
                "--reuid",
                "4242",
                "--regid",
                "4242",
                "--clear-groups",
                "cat",
            ])
            .arg(path)
            .output()
            .expect("setpriv")
    };
    assert!(
        as_other(&probe).status.success(),
        "control: the VM directory is traversable"
    );
    // The WAL and shared-memory files exist while a process (here: this test, as the service
    // would) has the database open; SQLite gives them the database file's mode.
    let db = rusqlite::Connection::open(state.join("warren.db")).expect("open db");
    let n: i64 = db
        .query_row("SELECT count(*) FROM vms", [], |r| r.get(0))
        .expect("query");
    assert_eq!(n, 1);
    let private = [
        state.join("warren.db"),
        state.join("warren.db-wal"),
        state.join("warren.db-shm"),
        dir.join("console.log"),
        dir.join("supervisor.log"),
        dir.join("qemu.stderr"),
        // Openable, it could be held shared to keep the VM's next supervisor from starting.
        dir.join("supervisor.lock"),
    ];
    for p in &private {
        let mode = std::fs::metadata(p)
            .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600, "{}", p.display());
        let out = as_other(p);
        assert!(!out.status.success(), "uid 4242 read {}", p.display());
    }
    drop(db);
    std::fs::remove_file(&probe).expect("rm");
    vm.destroy();
}

/// What a process's network namespace holds, as `ip -o link` lines seen from inside it.
fn links_in_netns_of(pid: &str) -> Vec<String> {
    let out = std::process::Command::new("nsenter")
        .args([
            &format!("--net=/proc/{pid}/ns/net"),
            "ip",
            "-o",
            "link",
            "show",
        ])
        .output()
        .expect("nsenter ip link");
    assert!(out.status.success(), "nsenter: {out:?}");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_string)
        .collect()
}

fn only_a_down_lo(links: &[String]) -> bool {
    links.len() == 1 && links[0].contains(": lo:") && !links[0].contains("UP")
}

/// Sockets directly in `dir`.
fn sockets_in(dir: &std::path::Path) -> Vec<String> {
    use std::os::unix::fs::FileTypeExt;
    std::fs::read_dir(dir)
        .expect("read dir")
        .flatten()
        .filter(|e| e.file_type().map(|t| t.is_socket()).unwrap_or(false))
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect()
}

/// A VMM escape gets no network and no path to steer the supervisor: QEMU and virtiofsd of a
/// networked VM with a share sit in network namespaces holding only a down `lo` (while the
/// guest's NIC works, through the TAP descriptor); the VMM's writable `run/` holds no socket
/// (the supervisor's endpoints are owner-only sockets in the root-owned VM directory); and a
/// FIFO or a symlink the VMM plants where the supervisor opens its files (the standby RAM
/// file, flushed at hibernation) is refused without blocking, the VM continuing.
#[test]
fn test_lifecycle_vmm_has_no_network_no_run_sockets_and_planted_files_are_refused() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    common::ensure_image("minimal");
    let share = tempfile::tempdir().expect("tempdir");
    let env = TestEnv::new();
    let mount = format!("{}:/workspace", share.path().display());
    let id = env.create_vm_with("minimal", &["--network", "--ram-file", "--mount", &mount]);
    let vm = TestVm::adopt(env, id);
    assert_eq!(
        vm.sh("cat /sys/class/net/eth0/operstate").stdout.trim(),
        "up",
        "the guest's NIC works through the passed TAP descriptor"
    );

    // Every process of the VM (QEMU, each virtiofsd) is in a namespace of its own.
    let cg = vm.cgroup_dir().expect("the VM's cgroup");
    let procs = std::fs::read_to_string(cg.join("cgroup.procs")).expect("cgroup.procs");
    let pids: Vec<&str> = procs.split_whitespace().collect();
    let comm = |p: &str| {
        std::fs::read_link(format!("/proc/{p}/exe"))
            .map(|e| {
                e.file_name()
                    .unwrap_or_default()
                    .to_string_lossy()
                    .into_owned()
            })
            .unwrap_or_default()
    };
    assert!(
        pids.iter().any(|p| comm(p).starts_with("qemu-system")),
        "{pids:?}"
    );
    assert!(pids.iter().any(|p| comm(p) == "virtiofsd"), "{pids:?}");
    let host_ns = std::fs::read_link("/proc/self/ns/net").expect("own netns");
    // Positive control: the host's namespace is seen to have more than a down lo.
    assert!(!only_a_down_lo(&links_in_netns_of("self")));
    for p in &pids {
        let ns = std::fs::read_link(format!("/proc/{p}/ns/net")).expect("netns");
        assert_ne!(ns, host_ns, "{} ({p}) is in the host's namespace", comm(p));
        let links = links_in_netns_of(p);
        assert!(only_a_down_lo(&links), "{} ({p}): {links:?}", comm(p));
    }

    // QEMU sees only its view of the host's file system (`warren-vmm::sys::view`): its
    // run directory, the image, `/usr`; not the VM directory's other files (the secret, the
    // sockets), the state's database, the share's host directory (virtiofsd serves it),
    // home directories or `/etc`. Control: the host's root holds them.
    let dir = vm.env.vm_dir(&vm.id);
    let qemu = pids
        .iter()
        .find(|p| comm(p).starts_with("qemu-system"))
        .expect("qemu");
    let seen = |root: &str, p: &std::path::Path| {
        std::path::Path::new(root)
            .join(p.strip_prefix("/").expect("absolute"))
            .exists()
    };
    let qroot = format!("/proc/{qemu}/root");
    let hidden = [
        dir.join("secret"),
        dir.join("vmm-channel.sock"),
        vm.env.state.path().join("warren.db"),
        share.path().join("."),
        std::path::PathBuf::from("/etc/passwd"),
        std::path::PathBuf::from("/root"),
    ];
    for p in &hidden {
        assert!(seen("/", p), "control: the host has {}", p.display());
        assert!(!seen(&qroot, p), "QEMU sees {}", p.display());
    }
    for p in [dir.join("run"), std::path::PathBuf::from("/usr/bin")] {
        assert!(seen(&qroot, &p), "QEMU lacks {}", p.display());
    }
    // It runs as a uid of its state directory's own host-wide block (`uid_blocks`): no VM
    // of another state directory runs as it.
    let status = std::fs::read_to_string(format!("/proc/{qemu}/status")).expect("status");
    let uid: u32 = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|u| u.split_whitespace().next())
        .and_then(|u| u.parse().ok())
        .expect("uid");
    let state = std::fs::canonicalize(vm.env.state.path()).expect("state");
    let key = {
        use sha2::Digest;
        hex::encode(sha2::Sha256::digest(state.to_string_lossy().as_bytes()))
    };
    let block: u32 = std::fs::read_to_string(format!("/var/lib/warren-uids/state-{key}"))
        .expect("the state directory's block")
        .trim()
        .parse()
        .expect("block");
    // The block's first id is its templates group; VMs get the ids after it.
    let first = 0x7000_0000 + block * 65_536;
    assert!(
        (first + 1..first + 65_536).contains(&uid),
        "QEMU runs as {uid}, outside block {block}"
    );
    // Its `/proc` is a procfs of its own that lists only its uid's processes. Control: the
    // test's own `/proc` is the host's, without the option.
    let proc_opts = |pid: &str| {
        let info = std::fs::read_to_string(format!("/proc/{pid}/mountinfo")).expect("mountinfo");
        info.lines()
            .find(|l| l.split(' ').nth(4) == Some("/proc"))
            .map(str::to_owned)
            .unwrap_or_default()
    };
    let own = proc_opts("self");
    assert!(
        own.contains(" - proc ") && !own.contains("hidepid"),
        "control: {own}"
    );
    let theirs = proc_opts(qemu);
    assert!(
        theirs.contains("hidepid=invisible"),
        "QEMU's /proc: {theirs}"
    );
    // Its host-wide files that name other processes (lock holders) are covered.
    let info = std::fs::read_to_string(format!("/proc/{qemu}/mountinfo")).expect("mountinfo");
    assert!(
        info.lines()
            .any(|l| l.split(' ').nth(4) == Some("/proc/locks")),
        "QEMU's /proc/locks is not masked: {info}"
    );
    assert_ne!(
        std::fs::read_link(format!("/proc/{qemu}/ns/mnt")).expect("mntns"),
        std::fs::read_link("/proc/self/ns/mnt").expect("own mntns"),
        "QEMU is in the host's mount namespace"
    );

    // No socket in `run/`; the endpoints are root's, owner-only, in a root-owned directory.
    let run = dir.join("run");
    assert_eq!(sockets_in(&run), Vec::<String>::new(), "sockets in run/");
    let mut endpoints = sockets_in(&dir);
    endpoints.sort();
    assert_eq!(
        endpoints,
        [
            "supervisor.sock",
            "vmm-channel.sock",
            "vmm-console.sock",
            "vmm-qmp.sock"
        ],
        "positive control: the sockets check sees sockets"
    );
    let me = nix::unistd::geteuid().as_raw();
    assert_eq!(std::fs::metadata(&dir).expect("vm dir").uid(), me);
    assert_ne!(
        std::fs::metadata(&run).expect("run").uid(),
        me,
        "run/ is the VMM's"
    );
    for e in &endpoints[1..] {
        let m = std::fs::metadata(dir.join(e)).expect("endpoint");
        assert_eq!(
            (m.uid(), m.permissions().mode() & 0o777),
            (me, 0o600),
            "{e}"
        );
    }

    // The VMM plants a FIFO, then a symlink to a host file, as its RAM file.
    let ram = run.join("guest.ram");
    let aside = run.join("guest.ram.aside");
    std::fs::rename(&ram, &aside).expect("move the RAM file aside");
    let secret = tempfile::NamedTempFile::new().expect("host file");
    for planted in ["fifo", "symlink"] {
        if planted == "fifo" {
            nix::unistd::mkfifo(&ram, nix::sys::stat::Mode::from_bits_truncate(0o666))
                .expect("mkfifo");
        } else {
            std::os::unix::fs::symlink(secret.path(), &ram).expect("symlink");
        }
        let t = std::time::Instant::now();
        let out = vm.warren(&["vm", "suspend", &vm.id, "--mode", "hibernate", "--force"]);
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(!out.status.success(), "{planted}: hibernated");
        assert!(
            t.elapsed() < std::time::Duration::from_secs(120),
            "{planted}: blocked"
        );
        let why = if planted == "fifo" {
            "not a regular file"
        } else {
            "symlink"
        };
        assert!(err.contains(why), "{planted}: {err}");
        assert_eq!(vm.state(), "running", "{planted}: {err}");
        assert_eq!(vm.sh("echo alive").stdout, "alive\n", "{planted}");
        std::fs::remove_file(&ram).expect("remove the planted file");
    }
    // Positive control: with the real RAM file back, the same hibernation goes through.
    std::fs::rename(&aside, &ram).expect("put the RAM file back");
    ok(
        vm.warren(&["vm", "suspend", &vm.id, "--mode", "hibernate", "--force"]),
        "standby",
    );
    ok(vm.warren(&["vm", "resume", &vm.id]), "resume");
    assert_eq!(vm.sh("echo back").stdout, "back\n");
}

/// A state directory writable by a primary group users share (`users`, gid 100) is refused
/// even to a user whose primary group it is: another member could plant what the VMs boot.
/// (Before, the running user's primary group was always trusted.) Control: the same
/// directory without the group's write bit is used.
#[test]
fn test_lifecycle_state_directory_writable_by_a_shared_group_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    let top = tempfile::tempdir().expect("tempdir");
    std::fs::set_permissions(top.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let (state, home) = (top.path().join("state"), top.path().join("home"));
    for d in [&state, &home] {
        std::fs::create_dir(d).expect("mkdir");
        std::os::unix::fs::chown(d, Some(4242), Some(100)).expect("chown");
    }
    let as_member = || {
        std::process::Command::new("setpriv")
            .args(["--reuid", "4242", "--regid", "100", "--clear-groups", "env"])
            .arg(format!("HOME={}", home.display()))
            .arg(WARREN)
            .arg("--state-dir")
            .arg(&state)
            .args(["vm", "list"])
            .output()
            .expect("setpriv")
    };
    std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o775)).expect("chmod");
    let out = as_member();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "used: {err}");
    assert!(
        err.contains("[forbidden]") && err.contains("writable by group 100"),
        "{err}"
    );
    assert!(
        !state.join("warren.db").exists(),
        "nothing made in a refused directory"
    );
    std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let out = as_member();
    assert!(
        out.status.success(),
        "control: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}
