//! A create whose supervisor never comes up (its socket never appears) fails with
//! `BootFailed`, and that supervisor is not left running behind the failed create.

use std::os::unix::fs::PermissionsExt;
use std::time::{Duration, Instant};

use warren_core::{CoreError, CreateVm, Warren, WarrenConfig};

fn image_dir() -> std::path::PathBuf {
    std::env::var_os("WARREN_TEST_IMAGE_DIR")
        .map(Into::into)
        .unwrap_or_else(|| "/var/cache/warren-test/images".into())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_launch_supervisor_without_socket_is_killed_and_create_fails() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let pidfile = tmp.path().join("supervisor.pid");
    // A "supervisor" that starts and then hangs without ever binding its socket.
    let exe = tmp.path().join("hung-supervisor");
    std::fs::write(
        &exe,
        format!(
            "#!/bin/sh\necho $$ > {}\nexec sleep 600\n",
            pidfile.display()
        ),
    )
    .expect("write");
    std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).expect("chmod");

    let mut cfg = WarrenConfig::new(tmp.path().join("state"), exe);
    cfg.image_dir = image_dir();
    cfg.accel = "tcg".parse().expect("accel");
    let w = Warren::open(cfg).expect("open");
    let create = CreateVm {
        image: Some("minimal".into()),
        ..Default::default()
    };
    let t = Instant::now();
    let r = w.create_vm(&create, &mut |_| {}).await;
    assert!(
        matches!(r, Err(CoreError::BootFailed(_))),
        "a supervisor without a socket fails the create: {r:?}"
    );
    eprintln!("create failed after {:?}", t.elapsed());

    let pid: i32 = std::fs::read_to_string(&pidfile)
        .expect("the stand-in supervisor ran")
        .trim()
        .parse()
        .expect("pid");
    // Killed, then reaped by the engine's reaper thread: its /proc entry goes away.
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::path::Path::new(&format!("/proc/{pid}")).exists() {
        assert!(
            Instant::now() < deadline,
            "the supervisor {pid} is still running after the failed create"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    for vm in w.list_vms().expect("list") {
        assert_ne!(vm.state, warren_core::store::VmState::Running, "{vm:?}");
    }
}
