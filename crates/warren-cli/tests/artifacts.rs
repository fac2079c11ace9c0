//! Runtime artifacts on a real VM: the QEMU binary, firmware and kernel a VM was created with
//! are recorded in its directory, and a launch on anything else (here: resuming it from
//! hibernation) is refused with `integrity`, changing nothing; back on the recorded bytes, it
//! resumes. The operator's `vm resume --accept-new-runtime` moves it to the host's QEMU: a
//! fresh boot on its disk, held to the new QEMU from then on.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Output;

use common::{TestEnv, TestVm};

fn with_qemu(env: &TestEnv, qemu: &Path, args: &[&str]) -> Output {
    env.cmd()
        .env("WARREN_QEMU", qemu)
        .args(args)
        .output()
        .expect("run warren")
}

fn ok(out: &Output, what: &str) {
    assert!(
        out.status.success(),
        "{what}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Asserts `out` is the refusal naming `artifact`.
fn refused(out: &Output, artifact: &str) {
    assert_eq!(out.status.code(), Some(125), "{artifact}: not refused");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("error[integrity]") && err.contains(artifact) && err.contains("refused"),
        "{artifact}: {err}"
    );
}

#[test]
fn test_artifacts_changed_qemu_firmware_or_kernel_refuses_launch() {
    common::ensure_image("minimal");
    // A QEMU of our own: a copy of the host's, in a directory the VM's uid may traverse.
    let bin = tempfile::tempdir().expect("tempdir");
    std::fs::set_permissions(bin.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let host_qemu = warren_vmm::accel::find_qemu().expect("qemu");
    let qemu = bin.path().join("qemu-system-x86_64");
    std::fs::copy(&host_qemu, &qemu).expect("copy qemu");
    let original_len = std::fs::metadata(&qemu).expect("stat").len();

    let env = TestEnv::new();
    let image = common::image_id("minimal");
    let out = with_qemu(&env, &qemu, &["vm", "create", "--image", &image, "--json"]);
    ok(&out, "create");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    let vm = TestVm::adopt(env, v["vm_id"].as_str().expect("vm_id").to_string());
    let record_path = vm.env.vm_dir(&vm.id).join("artifacts.json");
    let record = std::fs::read_to_string(&record_path).expect("artifacts record");
    let rec: serde_json::Value = serde_json::from_str(&record).expect("json");
    assert_eq!(rec["qemu"]["path"], qemu.to_str().expect("utf-8"));
    assert_eq!(rec["firmware"]["path"], "/usr/share/qemu/qboot.rom");
    assert!(rec["kernel"]["path"]
        .as_str()
        .is_some_and(|p| p.ends_with(&format!("{image}/vmlinux"))));
    for a in ["qemu", "firmware", "kernel"] {
        assert_eq!(rec[a]["sha256"].as_str().map(str::len), Some(64), "{a}");
    }
    assert_eq!(vm.sh("echo up").stdout.trim(), "up");
    ok(
        &with_qemu(&vm.env, &qemu, &["vm", "suspend", &vm.id, "--force"]),
        "hibernate",
    );
    assert_eq!(vm.state(), "hibernated");

    // Another QEMU binary at the same path (one byte more), and the host's own QEMU at its
    // path: both refused, and the VM stays hibernated.
    {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&qemu)
            .expect("open qemu copy");
        f.write_all(b"\0").expect("append");
    }
    let resume = |q: &Path| with_qemu(&vm.env, q, &["vm", "resume", &vm.id]);
    refused(&resume(&qemu), "QEMU binary");
    assert_eq!(vm.state(), "hibernated");
    refused(&resume(&host_qemu), "QEMU binary");
    assert_eq!(vm.state(), "hibernated");
    std::fs::OpenOptions::new()
        .write(true)
        .open(&qemu)
        .and_then(|f| f.set_len(original_len))
        .expect("truncate back");

    // A firmware or kernel whose digest is not the recorded one: refused the same way.
    for (artifact, name) in [("firmware", "firmware"), ("kernel", "kernel")] {
        let mut changed = rec.clone();
        changed[artifact]["sha256"] = serde_json::json!("0".repeat(64));
        std::fs::write(&record_path, changed.to_string()).expect("edit record");
        refused(&resume(&qemu), name);
        assert_eq!(vm.state(), "hibernated");
    }
    std::fs::write(&record_path, &record).expect("restore record");

    // The recorded bytes again: it resumes where it was.
    ok(&resume(&qemu), "resume on the recorded artifacts");
    assert_eq!(vm.sh("echo back").stdout.trim(), "back");

    // Host updates the operator accepts. State in memory (/tmp is a tmpfs) and on the disk
    // (synced) tells a restore from a fresh boot.
    let mark = || {
        let out = vm.sh("echo mem > /tmp/mem && echo disk > /var/tmp/disk && sync && echo ok");
        assert_eq!(out.stdout.trim(), "ok");
    };
    let check = "test -e /tmp/mem && echo mem kept || echo mem lost; cat /var/tmp/disk";
    let accept = |q: &Path| {
        let out = with_qemu(
            &vm.env,
            q,
            &["vm", "resume", &vm.id, "--accept-new-runtime"],
        );
        ok(&out, "resume, accepting the host's runtime");
        assert_eq!(vm.state(), "running");
    };
    let hibernate = |q: &Path| {
        ok(
            &with_qemu(&vm.env, q, &["vm", "suspend", &vm.id, "--force"]),
            "hibernate",
        );
        assert_eq!(vm.state(), "hibernated");
    };
    let recorded_qemu = || -> serde_json::Value {
        let r: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&record_path).expect("record"))
                .expect("json");
        r["qemu"]["path"].clone()
    };
    // 1. The same bytes at another path (the host's QEMU): refused, then accepted; the
    //    checkpoint is restored (the memory kept).
    mark();
    hibernate(&qemu);
    refused(&resume(&host_qemu), "QEMU binary");
    accept(&host_qemu);
    assert_eq!(vm.sh(check).stdout.trim(), "mem kept\ndisk");
    assert_eq!(recorded_qemu(), host_qemu.to_str().expect("utf-8"));
    // 2. Other bytes (a QEMU one byte longer): the checkpoint cannot be restored under it, so
    //    the VM boots fresh on its disk (memory lost, files kept) and the checkpoint goes.
    let updated = bin.path().join("qemu-updated");
    std::fs::copy(&host_qemu, &updated).expect("copy qemu");
    {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&updated)
            .expect("open");
        f.write_all(b"\0").expect("append");
    }
    hibernate(&host_qemu);
    refused(&resume(&updated), "QEMU binary");
    assert_eq!(vm.state(), "hibernated");
    accept(&updated);
    assert_eq!(vm.sh(check).stdout.trim(), "mem lost\ndisk");
    assert_eq!(recorded_qemu(), updated.to_str().expect("utf-8"));
    assert!(
        !vm.env.vm_dir(&vm.id).join("checkpoint.json").exists(),
        "the checkpoint of the other QEMU was kept"
    );
    // Held to the new QEMU from then on: the old one is refused in turn.
    hibernate(&updated);
    refused(&resume(&host_qemu), "QEMU binary");
    ok(&resume(&updated), "resume on the accepted QEMU");
    assert_eq!(vm.sh("cat /var/tmp/disk").stdout.trim(), "disk");
}
