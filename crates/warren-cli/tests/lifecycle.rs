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
