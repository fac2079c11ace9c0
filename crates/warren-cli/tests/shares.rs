//! Host directories shared over virtio-fs on a real VM: edits flow both ways at once, the
//! guest user acts as the owner, read-only is enforced by the host, nothing else of the host
//! shows, and a hibernated VM with a share resumes after host-side changes (deletions too).

mod common;

use std::os::unix::fs::MetadataExt;

use common::{ok, TestEnv, TestVm};

#[test]
fn test_shares_edit_both_ways_ownership_readonly_and_hibernate() {
    common::ensure_image("minimal");
    let rw = tempfile::tempdir().expect("tempdir");
    let ro = tempfile::tempdir().expect("tempdir");
    std::fs::write(rw.path().join("host.txt"), "from host\n").expect("write");
    std::fs::write(ro.path().join("readme"), "read only\n").expect("write");
    let env = TestEnv::new();
    let rw_arg = format!("{}:/workspace", rw.path().display());
    let ro_arg = format!("{}:/data/ref:ro", ro.path().display());
    let id = env.create_vm_with("minimal", &["--mount", &rw_arg, "--mount", &ro_arg]);
    let vm = TestVm::adopt(env, id);
    let owner = nix::unistd::getuid().as_raw();

    // Host files appear as the guest user's and are writable by it.
    let r = vm.sh(
        "set -e; stat -c '%u %n' /workspace/host.txt; echo more >> /workspace/host.txt; \
         echo guest > /workspace/made-in-guest; mkdir -p /workspace/d/e; \
         grep -c virtiofs /proc/mounts",
    );
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(
        r.stdout.starts_with("1000 /workspace/host.txt\n"),
        "{}",
        r.stdout
    );
    assert_eq!(
        r.stdout.lines().last(),
        Some("2"),
        "exactly the two shares: {}",
        r.stdout
    );
    // ...and the guest's edits are on the host as soon as the exec returned, owned by the owner.
    assert_eq!(
        std::fs::read_to_string(rw.path().join("host.txt")).expect("read"),
        "from host\nmore\n"
    );
    let made = rw.path().join("made-in-guest");
    assert_eq!(std::fs::read_to_string(&made).expect("read"), "guest\n");
    assert_eq!(std::fs::metadata(&made).expect("stat").uid(), owner);
    assert_eq!(
        std::fs::metadata(rw.path().join("d/e"))
            .expect("stat")
            .uid(),
        owner
    );

    // Host edits are visible to the next guest read.
    std::fs::write(rw.path().join("host.txt"), "rewritten on host\n").expect("write");
    let r = vm.sh("cat /workspace/host.txt");
    assert_eq!(r.stdout, "rewritten on host\n");

    // Read-only share: readable, every write refused, host unchanged.
    let r = vm.sh("cat /data/ref/readme; echo x > /data/ref/new 2>&1; echo rc=$?; touch /data/ref/readme; echo rc=$?");
    assert!(r.stdout.starts_with("read only\n"), "{}", r.stdout);
    assert_eq!(r.stdout.matches("rc=").count(), 2, "{}", r.stdout);
    assert!(!r.stdout.contains("rc=0"), "{}{}", r.stdout, r.stderr);
    assert!(r.stderr.contains("Read-only file system"), "{}", r.stderr);
    assert_eq!(std::fs::read_dir(ro.path()).expect("ls").count(), 1);

    // No host path is visible: the shares' host names appear nowhere in the guest.
    let r = vm.sh("cat /proc/mounts; ls /");
    assert!(
        !r.stdout.contains(&rw.path().display().to_string()),
        "{}",
        r.stdout
    );
    assert!(!r.stdout.contains("/tmp/."), "{}", r.stdout);

    // Hibernate with a process holding a file open on the share; change and delete files on
    // the host meanwhile; the restore succeeds and the guest sees the new host state.
    std::fs::write(rw.path().join("doomed"), "soon gone\n").expect("write");
    let job = vm.detach(
        "exec 3</workspace/doomed; i=0; while true; do i=$((i+1)); echo $i > /workspace/tick; sleep 0.2; done",
    );
    common::wait_until("ticks", 30, || rw.path().join("tick").exists());
    ok(
        vm.warren(&["vm", "suspend", &vm.id, "--mode", "hibernate", "--force"]),
        "hibernate",
    );
    assert_eq!(vm.state(), "hibernated");
    let before: u64 = std::fs::read_to_string(rw.path().join("tick"))
        .expect("tick")
        .trim()
        .parse()
        .expect("number");
    std::fs::remove_file(rw.path().join("doomed")).expect("rm");
    std::fs::write(rw.path().join("while-asleep"), "hello again\n").expect("write");
    ok(vm.warren(&["vm", "resume", &vm.id]), "resume");
    let r = vm.sh("cat /workspace/while-asleep; test -e /workspace/doomed; echo doomed=$?");
    assert_eq!(r.stdout, "hello again\ndoomed=1\n", "{}", r.stderr);
    common::wait_until("ticking again", 30, || {
        std::fs::read_to_string(rw.path().join("tick"))
            .ok()
            .and_then(|t| t.trim().parse::<u64>().ok())
            .is_some_and(|n| n > before + 2)
    });
    let st = vm.output(job, &[]);
    assert_eq!(st["state"], "running", "{st}");
    vm.destroy();
}
