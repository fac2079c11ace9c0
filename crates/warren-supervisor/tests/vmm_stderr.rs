//! A hostile QEMU stand-in launched by the real backend: it prints 100 MiB of error lines to
//! its stderr (1.1 M lines), then its last words, and exits. What the supervisor's drain leaves on disk is
//! bounded, and the last line is there for the exit reason. (Before the drain, QEMU wrote
//! to `qemu.stderr` itself: 100 MiB on disk.)

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::Duration;

use warren_supervisor::child_log;
use warren_supervisor::rotate::{old_half, LOG_HALF};
use warren_vmm::qemu::QemuBackend;
use warren_vmm::{LaunchSpec, VmBackend};

fn spec(dir: &Path) -> LaunchSpec {
    let run = dir.join("run");
    std::fs::create_dir_all(&run).expect("run dir");
    serde_json::from_value(serde_json::json!({
        "name": "hostile-stderr",
        "run_dir": run,
        "stderr_log": dir.join("qemu.stderr"),
        "kernel": dir.join("vmlinux"),
        "initramfs": dir.join("initramfs"),
        "disk": run.join("disk.qcow2"),
        "memory": 64,
        "vcpus": 1,
        "accel": "tcg",
        "extra_cmdline": [],
        "run_as": null,
        "cgroup": null,
    }))
    .expect("spec")
}

#[tokio::test(flavor = "current_thread")]
async fn test_vmm_stderr_flood_is_bounded_on_disk_and_keeps_the_last_line() {
    let d = tempfile::tempdir().expect("tempdir");
    let dir = d.path().canonicalize().expect("canonical");
    let fake = dir.join("fake-qemu");
    std::fs::write(
        &fake,
        "#!/bin/sh\n\
         yes 'qemu-system-x86_64: virtio-serial-bus: Unexpected port id 4660 for device virtio-serial-bus.0' \
           | head -n 1100000 >&2\n\
         echo 'qemu-system-x86_64: terminating on signal 15' >&2\n\
         exit 1\n",
    )
    .expect("script");
    std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let backend = QemuBackend {
        qemu: fake,
        tsc_khz: 1_000_000,
    };
    let spec = spec(&dir);
    let launched = backend.launch(&spec).expect("launch");
    let mut child = launched.child;
    let mut pipes = launched.stderr.into_iter();
    let vmm = pipes.next().expect("QEMU's stderr");
    assert_eq!(vmm.log, spec.stderr_log);
    assert!(pipes.next().is_none(), "no share, no virtiofsd");
    let drained = child_log::drain(vmm.pipe, &vmm.log);
    let status = tokio::time::timeout(Duration::from_secs(60), child.wait())
        .await
        .expect("the stand-in was never held up by its stderr")
        .expect("wait");
    assert_eq!(status.code(), Some(1));
    // The drain sees the pipe's end once QEMU is gone: nobody else holds its write end.
    tokio::time::timeout(Duration::from_secs(5), drained)
        .await
        .expect("drained at QEMU's exit")
        .expect("drain finished");
    let kept: u64 = [spec.stderr_log.clone(), old_half(&spec.stderr_log)]
        .iter()
        .filter_map(|p| std::fs::metadata(p).ok())
        .map(|m| m.len())
        .sum();
    assert!(kept <= 2 * LOG_HALF, "{kept} bytes of stderr on disk");
    let mode = std::fs::metadata(&spec.stderr_log)
        .expect("stat")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600, "owner-only");
    assert_eq!(
        child_log::last_line(&spec.stderr_log).as_deref(),
        Some("qemu-system-x86_64: terminating on signal 15")
    );
}
