//! Host disk written on a guest's behalf is bounded (issue 14, item 3): a guest writes 1 GiB
//! into a session copy limited to 256 MiB. The write fails with ENOSPC at most 16 MiB past the
//! limit, the session's agent state (on the same filesystem) is full too, and the host file
//! system holding the state directory loses at most that much.
//!
//! The state directory lives on a file system of the test's own (an ext4 image on a loop
//! device, mounted by the test), so the free space measured is moved by this test alone and
//! not by whatever else the host runs meanwhile.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use common::{git, ok, TestEnv};

const MIB: u64 = 1 << 20;
const LIMIT_MIB: u64 = 256;
const SLACK_MIB: u64 = 16;

/// The test's own host file system, unmounted (lazily, if something still holds it) on drop.
struct HostFs {
    _dir: tempfile::TempDir,
    mount: PathBuf,
}

impl HostFs {
    fn new(size_mib: u64) -> HostFs {
        let dir = tempfile::Builder::new()
            .prefix("warren-storage-test-")
            .tempdir()
            .expect("tempdir");
        let image = dir.path().join("host.img");
        let f = std::fs::File::create(&image).expect("image");
        f.set_len(size_mib * MIB).expect("size");
        drop(f);
        let mkfs = Command::new("mkfs.ext4")
            .args(["-q", "-F", "-m", "0"])
            .arg(&image)
            .output()
            .expect("mkfs.ext4");
        assert!(mkfs.status.success(), "{mkfs:?}");
        let mount = dir.path().join("host");
        std::fs::create_dir(&mount).expect("mkdir");
        // `mount -o loop` attaches the image with autoclear: the device goes with the mount.
        let m = Command::new("mount")
            .args(["-o", "loop"])
            .arg(&image)
            .arg(&mount)
            .output()
            .expect("mount");
        assert!(m.status.success(), "{m:?}");
        HostFs { _dir: dir, mount }
    }

    fn free_bytes(&self) -> u64 {
        // Written-back numbers: delayed allocation would otherwise hide what is pending.
        let f = std::fs::File::open(&self.mount).expect("open");
        nix::unistd::syncfs(&f).expect("syncfs");
        let st = nix::sys::statvfs::statvfs(&self.mount).expect("statvfs");
        st.blocks_available() as u64 * st.fragment_size() as u64
    }
}

impl Drop for HostFs {
    fn drop(&mut self) {
        let out = Command::new("umount").arg(&self.mount).output();
        if !matches!(out, Ok(o) if o.status.success()) {
            let _ = Command::new("umount").arg("-l").arg(&self.mount).status();
        }
    }
}

/// Deletes the session (and with it its VM) however the test ends.
struct SessionGuard<'a> {
    env: &'a TestEnv,
    id: String,
}

impl Drop for SessionGuard<'_> {
    fn drop(&mut self) {
        let _ = self.env.run(&["session", "delete", &self.id, "--force"]);
    }
}

/// A one-commit repository and a session of it limited to `mib` (its `--json` record).
fn limited_session(env: &TestEnv, mib: u64) -> (tempfile::TempDir, serde_json::Value) {
    let src = tempfile::tempdir().expect("tempdir");
    git(src.path(), &["init", "-q", "-b", "main"]);
    std::fs::write(src.path().join("README"), "storage\n").expect("write");
    git(src.path(), &["add", "-A"]);
    git(src.path(), &["commit", "-qm", "initial"]);
    let image = common::image_id("minimal");
    let out = env.run(&[
        "session",
        "create",
        "--repo",
        &src.path().display().to_string(),
        "--image",
        &image,
        "--storage-mib",
        &mib.to_string(),
        "--json",
    ]);
    let s = serde_json::from_str(&ok(out, "session create")).expect("session json");
    (src, s)
}

/// Loop devices whose backing file is `image`.
fn loops_backed_by(image: &Path) -> Vec<String> {
    let mut v = Vec::new();
    for e in std::fs::read_dir("/sys/block")
        .expect("/sys/block")
        .flatten()
    {
        let backing = e.path().join("loop/backing_file");
        if let Ok(b) = std::fs::read_to_string(&backing) {
            if Path::new(b.trim()) == image {
                v.push(e.file_name().to_string_lossy().into_owned());
            }
        }
    }
    v
}

fn mounted(path: &Path) -> bool {
    let info = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
    let p = path.to_string_lossy();
    info.lines()
        .any(|l| l.split(' ').nth(4) == Some(p.as_ref()))
}

#[test]
fn test_guest_fills_session_limit_enospc_and_host_free_space_bounded() {
    let started = Instant::now();
    common::ensure_image("minimal");
    // Room for the VM's disk overlay and the session's 256 MiB, and far less than the 1 GiB
    // the guest tries to write: without the limit the write would fill this file system.
    let host = HostFs::new(1024);
    let env = TestEnv {
        state: tempfile::Builder::new()
            .prefix("warren-test-")
            .tempdir_in(&host.mount)
            .expect("state dir"),
        image_dir: common::image_dir(),
    };
    let (_src, s) = limited_session(&env, LIMIT_MIB);
    let id = s["session_id"].as_str().expect("session_id").to_string();
    let vm = s["vm_id"].as_str().expect("vm_id").to_string();
    let guard = SessionGuard { env: &env, id };
    assert_eq!(s["storage_mib"], LIMIT_MIB, "{s}");
    let sessions = env.state.path().join("sessions");
    let img = sessions.join(format!("{}.img", guard.id));
    let vol = sessions.join(format!("{}.vol", guard.id));
    assert!(mounted(&vol), "the copy is on its own file system");
    assert_eq!(loops_backed_by(&img).len(), 1);
    let booted = started.elapsed();
    let accel = env.record(&vm).map(|r| r["accel"].to_string());

    let before = host.free_bytes();
    let t = Instant::now();
    let out = env.run(&[
        "vm",
        "exec",
        &vm,
        "--",
        "sh",
        "-c",
        "dd if=/dev/zero of=/workspace/fill bs=1M count=1024 2>&1; echo rc=$?; \
         stat -c size=%s /workspace/fill; cat /workspace/README; \
         dd if=/dev/zero of=/agent-state/more bs=1M count=64 2>&1; echo agent-rc=$?; \
         stat -c agent-size=%s /agent-state/more",
    ]);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let wrote_for = t.elapsed();
    let after = host.free_bytes();
    assert!(
        text.contains("No space left on device"),
        "the write must fail with ENOSPC: {text} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!text.contains("rc=0"), "{text}");
    // The agent state is on the session's filesystem: full too, and counted in the same bound.
    assert!(
        text.contains("agent-rc=1"),
        "agent state write must fail: {text}"
    );
    assert!(
        vol.join("agent-state").is_dir(),
        "agent state not on the volume"
    );
    assert!(text.contains("storage\n"), "the copy is there: {text}");
    let size: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix("size="))
        .and_then(|n| n.trim().parse().ok())
        .expect("file size");
    let agent_size: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix("agent-size="))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0);
    let dropped = before.saturating_sub(after);
    let allocated = std::fs::metadata(&img)
        .map(|m| std::os::unix::fs::MetadataExt::blocks(&m) * 512)
        .expect("image");
    eprintln!(
        "wrote {} MiB before ENOSPC (agent state: {} KiB more); host free space dropped {} MiB; image allocates {} MiB; \
         accel {accel:?}, boot {:.1}s, write {:.1}s",
        size / MIB,
        agent_size >> 10,
        dropped / MIB,
        allocated / MIB,
        booted.as_secs_f64(),
        wrote_for.as_secs_f64()
    );
    assert!(
        size + agent_size <= (LIMIT_MIB + SLACK_MIB) * MIB,
        "wrote {size} + {agent_size} bytes"
    );
    // Positive control: the write did reach the limit, and the free space measured moves
    // with what the guest wrote (so the bound below is not vacuous).
    assert!(size >= (LIMIT_MIB - 32) * MIB, "only {size} bytes fit");
    assert!(dropped >= size / 2, "free space did not move: {dropped}");
    assert!(
        dropped <= (LIMIT_MIB + SLACK_MIB) * MIB,
        "host free space dropped {dropped} bytes"
    );
    assert!(allocated <= LIMIT_MIB * MIB, "image allocates {allocated}");

    // Host git's scratch directory for a status or an export is on the session's own file
    // system, not in the host's temp directory, in a reserve the guest cannot write: the guest
    // commits its work and fills the volume to the last block it may use; the reserve is
    // still free, and status and export work.
    let scratch_dirs = || {
        std::fs::read_dir(vol.join("session"))
            .expect("session dir")
            .flatten()
            .filter(|e| {
                e.file_name()
                    .to_string_lossy()
                    .starts_with(".warren-hostgit-")
            })
            .count()
    };
    // The work is committed in the copy (by the host here: the minimal image has no git).
    let copy = vol.join("session/workspace");
    std::fs::write(copy.join("work.txt"), "work\n").expect("write");
    git(&copy, &["-c", "safe.directory=*", "add", "work.txt"]);
    // A gitlink too: host git then rewrites the scratch index (skip-worktree) on the full
    // volume, in the reserve.
    git(
        &copy,
        &[
            "-c",
            "safe.directory=*",
            "update-index",
            "--add",
            "--cacheinfo",
            "160000,0123456789abcdef0123456789abcdef01234567,sub",
        ],
    );
    git(
        &copy,
        &["-c", "safe.directory=*", "commit", "-qm", "guest work"],
    );
    ok(
        env.run(&[
            "vm",
            "exec",
            &vm,
            "--",
            "sh",
            "-c",
            "for i in 1 2 3; do dd if=/dev/zero of=/workspace/fill-$i bs=4k 2>/dev/null; sync; done",
        ]),
        "fill",
    );
    let st = nix::sys::statvfs::statvfs(&vol).expect("statvfs");
    let (free, avail) = (
        st.blocks_free() as u64 * st.fragment_size() as u64,
        st.blocks_available() as u64 * st.fragment_size() as u64,
    );
    eprintln!(
        "full volume: {} KiB free, {} KiB available to the guest",
        free >> 10,
        avail >> 10
    );
    assert!(avail < MIB, "the guest left {avail} bytes");
    assert!(
        free >= 4 * MIB,
        "the guest wrote into the reserve: {free} bytes left"
    );
    let status = ok(
        env.run(&["session", "status", &guard.id, "--json"]),
        "status on the full volume",
    );
    let status: serde_json::Value = serde_json::from_str(&status).expect("status json");
    assert!(status.to_string().contains("fill-1"), "{status}");
    assert_eq!(
        status["unexported"].as_array().map(Vec::len),
        Some(1),
        "{status}"
    );
    let exported = ok(
        env.run(&["session", "export", &guard.id, "--branch", "from-full"]),
        "export from the full volume",
    );
    assert!(exported.contains("from-full"), "{exported}");
    assert_eq!(
        git(_src.path(), &["show", "from-full:work.txt"]).trim(),
        "work"
    );
    assert_eq!(scratch_dirs(), 0, "a scratch directory was left");

    // Deleting the session unmounts the volume, frees its loop device and deletes the image.
    let out = env.run(&["session", "delete", &guard.id, "--force"]);
    ok(out, "session delete");
    assert!(!mounted(&vol), "volume still mounted");
    assert!(!img.exists() && !vol.exists(), "volume files left");
    assert!(loops_backed_by(&img).is_empty(), "loop device left");
    drop(guard);
    eprintln!("total {:.1}s", started.elapsed().as_secs_f64());
}

fn device_of(p: &std::path::Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(p).expect("stat").dev()
}

/// After a host restart a limited session's filesystem is not mounted; resuming its
/// hibernated VM mounts it again first (before, the resume failed with `conflict: invalid
/// share ... is not an existing absolute directory` until some `session status` remounted it),
/// on whatever loop device is free (before, a device other than the first one failed the
/// resume with `conflict: ... another directory is at its path`).
#[test]
fn test_hibernated_session_vm_resumes_after_its_volume_was_unmounted() {
    common::ensure_image("minimal");
    let env = TestEnv::new();
    let (_src, s) = limited_session(&env, 64);
    let id = s["session_id"].as_str().expect("session_id").to_string();
    let vm = s["vm_id"].as_str().expect("vm_id").to_string();
    let _guard = SessionGuard { env: &env, id };
    let vol = env
        .state
        .path()
        .join("sessions")
        .join(format!("{}.vol", _guard.id));
    ok(
        env.run(&[
            "vm",
            "exec",
            &vm,
            "--",
            "sh",
            "-c",
            "echo kept > /workspace/x",
        ]),
        "write",
    );
    ok(
        env.run(&["vm", "suspend", &vm, "--mode", "hibernate"]),
        "hibernate",
    );
    // What a host restart leaves: the volume's mount point, not mounted.
    let before = device_of(&vol.join("session"));
    let u = Command::new("umount").arg(&vol).output().expect("umount");
    assert!(u.status.success(), "{u:?}");
    assert!(!mounted(&vol));
    // The loop device the volume had is taken meanwhile (by another volume, after a real
    // restart), so it comes back on another device number: its shares are the same
    // directories all the same.
    // That very device, not the first free one: other tests free loop devices meanwhile,
    // and the first free one may then be another, leaving the volume's own for it again.
    let holder = tempfile::NamedTempFile::new().expect("temp file");
    holder.as_file().set_len(1 << 20).expect("size");
    let minor = (before & 0xff) | ((before >> 12) & 0xfff00);
    let held = format!("/dev/loop{minor}");
    let t0 = std::time::Instant::now();
    loop {
        // Until the unmount's autoclear has released it, the device is busy.
        let out = Command::new("losetup")
            .arg(&held)
            .arg(holder.path())
            .output()
            .expect("losetup");
        if out.status.success() {
            break;
        }
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(20),
            "{held} stays busy: {out:?}"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let resumed = env.run(&["vm", "resume", &vm]);
    let _ = Command::new("losetup").args(["-d", &held]).status();
    ok(resumed, "resume");
    assert_ne!(
        device_of(&vol.join("session")),
        before,
        "the volume came back on another device"
    );
    assert!(mounted(&vol), "the resume mounted the volume again");
    let out = ok(
        env.run(&["vm", "exec", &vm, "--", "cat", "/workspace/x"]),
        "read",
    );
    assert_eq!(out, "kept\n");
}
