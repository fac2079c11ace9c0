//! A session's own filesystem: what bounds the host storage a guest can fill through its
//! session copy.
//!
//! A session with a storage limit gets a sparse image file of exactly that size,
//! `<sessions>/<id>.img`, formatted ext4 (a 4 MiB journal, a small reserve only host-side
//! work can write: [`RESERVE_ID`]) and mounted
//! `nodev,nosuid` at `<sessions>/<id>.vol` through a loop device. The session directory
//! `S` is `<id>.vol/session`, so the copy `prepare` makes, the guest's writes to
//! `/workspace` and host git's scratch reads all land in it, and a guest that fills it gets
//! `ENOSPC`. The image is sparse: the host file system loses only what was written, and
//! never more than the image's size. This works on any host file system with sparse files
//! (ext4 without project quotas, XFS) and needs only loop devices, e2fsprogs and root.
//!
//! Steps of [`Volume::create`], in order: create the image (`O_EXCL`, 0600) and take an
//! exclusive `flock` on it (held until the caller drops the [`Volume`], so a concurrent
//! [`sweep`] never removes a volume being made), size it, `mkfs.ext4`, attach it to a
//! loop device with autoclear, mount it, make its root 0711. Any failure undoes the earlier
//! steps. [`teardown`] unmounts (the loop device then detaches itself), removes the mount
//! point and the image.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::fcntl::{Flock, FlockArg};

use crate::SessionError;

/// Below this an ext4 with its journal leaves too little room to be useful.
pub const MIN_STORAGE_MIB: u64 = 64;
/// The session directory inside the mounted volume.
const SESSION_SUBDIR: &str = "session";
/// How long an unmount waits for the VM's virtiofsd (and any host git) to let go before it
/// detaches lazily; the device is freed when the last user goes either way.
const UNMOUNT_PATIENCE: Duration = Duration::from_secs(10);

/// The files of session `id`'s volume under the sessions directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumePaths {
    pub image: PathBuf,
    pub mountpoint: PathBuf,
}

impl VolumePaths {
    pub fn new(sessions_dir: &Path, id: &str) -> VolumePaths {
        VolumePaths {
            image: sessions_dir.join(format!("{id}.img")),
            mountpoint: sessions_dir.join(format!("{id}.vol")),
        }
    }

    /// The session directory `S` inside the volume (made by `prepare`).
    pub fn session_dir(&self) -> PathBuf {
        self.mountpoint.join(SESSION_SUBDIR)
    }

    /// Whether the volume is mounted at its mount point now.
    pub fn is_mounted(&self) -> bool {
        is_mountpoint(&self.mountpoint)
    }
}

/// A volume being made; holds the image's lock until dropped.
#[derive(Debug)]
pub struct Volume {
    pub paths: VolumePaths,
    _lock: Flock<File>,
}

fn err(op: &'static str, path: &Path, reason: impl std::fmt::Display) -> SessionError {
    SessionError::Volume {
        op,
        path: path.to_path_buf(),
        reason: reason.to_string(),
    }
}

impl Volume {
    /// Makes and mounts a `size_mib` volume at `paths` (neither may exist).
    pub fn create(paths: &VolumePaths, size_mib: u64) -> Result<Volume, SessionError> {
        if size_mib < MIN_STORAGE_MIB {
            return Err(err(
                "size",
                &paths.image,
                format!("{size_mib} MiB is below the minimum of {MIN_STORAGE_MIB} MiB"),
            ));
        }
        let image = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(nix::libc::O_CLOEXEC)
            .open(&paths.image)
            .map_err(|e| err("create", &paths.image, e))?;
        let lock = match Flock::lock(image, FlockArg::LockExclusiveNonblock) {
            Ok(l) => l,
            Err((_, e)) => {
                let _ = std::fs::remove_file(&paths.image);
                return Err(err("lock", &paths.image, e));
            }
        };
        match make(paths, &lock, size_mib) {
            Ok(()) => Ok(Volume {
                paths: paths.clone(),
                _lock: lock,
            }),
            Err(e) => {
                // Under the lock taken above (a teardown that locked would wait for itself).
                if let Err(t) = teardown_locked(paths) {
                    tracing::warn!(error = %t, "undoing a failed session volume");
                }
                Err(e)
            }
        }
    }

    /// Tears this volume down under the lock it holds (a maker undoing its own volume).
    pub fn teardown(self) -> Result<(), SessionError> {
        teardown_locked(&self.paths)
    }
}

/// Takes the exclusive lock on the image at `paths` (waiting for a holder: a maker until its
/// record is written, a teardown, another mount), and checks that the image locked is still
/// the one at its path, so a teardown that removed it meanwhile is seen. `None`: no image.
fn lock_image(paths: &VolumePaths) -> Result<Option<Flock<File>>, SessionError> {
    let image = match OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(nix::libc::O_CLOEXEC)
        .open(&paths.image)
    {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(err("open", &paths.image, e)),
    };
    let lock = Flock::lock(image, FlockArg::LockExclusive)
        .map_err(|(_, e)| err("lock", &paths.image, e))?;
    let held = lock.metadata().map_err(|e| err("stat", &paths.image, e))?;
    match std::fs::symlink_metadata(&paths.image) {
        Ok(now) if now.dev() == held.dev() && now.ino() == held.ino() => Ok(Some(lock)),
        Ok(_) | Err(_) => Ok(None),
    }
}

fn make(paths: &VolumePaths, image: &File, size_mib: u64) -> Result<(), SessionError> {
    image
        .set_len(size_mib << 20)
        .map_err(|e| err("size", &paths.image, e))?;
    mkfs(&paths.image, size_mib)?;
    mount(paths, image)?;
    std::fs::set_permissions(&paths.mountpoint, std::fs::Permissions::from_mode(0o711))
        .map_err(|e| err("chmod", &paths.mountpoint, e))
}

/// The group (and user) the volume's reserved blocks are for, beside processes with
/// `CAP_SYS_RESOURCE` (the service): 65535, `(uid_t)-1` in 16 bits, which no account has. Host
/// git over a session runs with it as its only supplementary group; the guest's writes (its
/// virtiofsd acts as the owner) never have it.
pub const RESERVE_ID: u32 = 65535;

/// Room on the volume that only host-side work can use ([`RESERVE_ID`]): host git's scratch
/// directory (`scratch.rs`) for a `status` or `export`, so that a session whose guest filled
/// its storage can still be inspected and exported. 4 MiB and 1% of the limit, at most
/// 64 MiB.
fn reserved_blocks(size_mib: u64) -> u64 {
    let bytes = ((4 << 20) + (size_mib << 20) / 100).min(64 << 20);
    bytes / 4096
}

/// `mkfs.ext4` on the image file: 4 KiB blocks, one inode per 16 KiB, a 4 MiB journal, and
/// the blocks [`reserved_blocks`] names kept for [`RESERVE_ID`] (`tune2fs`; ext4's own
/// root reserve would be open to a root-owned session's guest, whose writes are root's).
fn mkfs(image: &Path, size_mib: u64) -> Result<(), SessionError> {
    run_e2fs(
        "mkfs.ext4",
        image,
        &[
            "-q",
            "-F",
            "-b",
            "4096",
            "-i",
            "16384",
            "-m",
            "0",
            "-J",
            "size=4",
            "-L",
            "warren-session",
        ],
    )?;
    let (blocks, id) = (
        reserved_blocks(size_mib).to_string(),
        RESERVE_ID.to_string(),
    );
    run_e2fs("tune2fs", image, &["-r", &blocks, "-u", &id, "-g", &id])
}

/// Runs an e2fsprogs tool on the image file.
fn run_e2fs(tool: &'static str, image: &Path, args: &[&str]) -> Result<(), SessionError> {
    let out = std::process::Command::new(tool)
        .args(args)
        .arg(image)
        .env("PATH", "/usr/sbin:/sbin:/usr/bin:/bin")
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|e| err(tool, image, format!("{e} (is e2fsprogs installed?)")))?;
    if !out.status.success() {
        return Err(err(
            tool,
            image,
            format!(
                "{}: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        ));
    }
    Ok(())
}

/// Attaches the image and mounts it at the mount point (made if missing).
fn mount(paths: &VolumePaths, image: &File) -> Result<(), SessionError> {
    use nix::mount::MsFlags;
    match std::fs::create_dir(&paths.mountpoint) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(err("create", &paths.mountpoint, e)),
    }
    let (dev, held) =
        crate::sys::loopdev::attach(image).map_err(|e| err("attach", &paths.image, e))?;
    nix::mount::mount(
        Some(dev.as_path()),
        &paths.mountpoint,
        Some("ext4"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOATIME,
        None::<&str>,
    )
    .map_err(|e| {
        err(
            "mount",
            &paths.mountpoint,
            format!("{} on it: {e}", dev.display()),
        )
    })?;
    // The mount holds the device from here; closing ours leaves autoclear to the unmount.
    drop(held);
    Ok(())
}

/// Mounts an existing volume again (after a host restart unmounted it); a mounted one is
/// left as it is.
///
/// Done under the image's lock and checked again under it: two callers at once (two
/// requests on one session after a restart, in one process or two) must not each attach the
/// image to a loop device of its own and mount it, which would put two independent ext4
/// instances on one image (writes through one lost, the filesystem corrupted); and a
/// teardown that removed the image meanwhile must not see it mounted again.
pub fn ensure_mounted(paths: &VolumePaths) -> Result<(), SessionError> {
    if paths.is_mounted() {
        return Ok(());
    }
    let Some(image) = lock_image(paths)? else {
        return Err(err(
            "open",
            &paths.image,
            "the session's image is gone (its session is being deleted?)",
        ));
    };
    if paths.is_mounted() {
        return Ok(());
    }
    mount(paths, &image)
}

/// Unmounts the volume, then removes its mount point and image, under the image's lock (so
/// no [`ensure_mounted`] mounts it again half-way). Missing parts are fine, so this also
/// finishes a teardown that was cut short. Not for a holder of the lock: see
/// [`Volume::teardown`].
pub fn teardown(paths: &VolumePaths) -> Result<(), SessionError> {
    let _lock = lock_image(paths)?;
    teardown_locked(paths)
}

/// [`teardown`] by a caller that holds the image's lock (or when there is no image).
fn teardown_locked(paths: &VolumePaths) -> Result<(), SessionError> {
    use nix::mount::{umount2, MntFlags};
    let deadline = std::time::Instant::now() + UNMOUNT_PATIENCE;
    while paths.is_mounted() {
        match umount2(&paths.mountpoint, MntFlags::empty()) {
            Ok(()) => {}
            Err(nix::errno::Errno::EBUSY) if std::time::Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(nix::errno::Errno::EBUSY) => {
                tracing::warn!(mount = %paths.mountpoint.display(), "session volume busy; detaching it lazily");
                umount2(&paths.mountpoint, MntFlags::MNT_DETACH)
                    .map_err(|e| err("unmount", &paths.mountpoint, e))?;
            }
            Err(e) => return Err(err("unmount", &paths.mountpoint, e)),
        }
    }
    for (p, r) in [
        (&paths.mountpoint, std::fs::remove_dir(&paths.mountpoint)),
        (&paths.image, std::fs::remove_file(&paths.image)),
    ] {
        match r {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(err("remove", p, e)),
        }
    }
    Ok(())
}

/// Reconciliation: tears down every session volume under `sessions_dir` whose session
/// `known` does not recognise, and returns their ids. A volume being made is skipped: its
/// maker holds an exclusive lock on the image until the session's record is written, and the
/// sweep holds the same lock while it asks `known` and tears the volume down, so a record
/// written meanwhile is always seen. (A maker that loses the race for the lock fails with a
/// clear error and removes what it made.)
pub fn sweep(sessions_dir: &Path, known: impl Fn(&str) -> bool) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(sessions_dir) else {
        return Vec::new();
    };
    let mut ids: Vec<String> = entries
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let id = name
                .strip_suffix(".img")
                .or_else(|| name.strip_suffix(".vol"))?;
            let plain = id.starts_with("ses-")
                && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-');
            plain.then(|| id.to_string())
        })
        .collect();
    ids.sort();
    ids.dedup();
    let mut removed = Vec::new();
    for id in ids {
        let paths = VolumePaths::new(sessions_dir, &id);
        // Held until the teardown is done (a missing image: a mount point left behind).
        let _lock = match File::open(&paths.image) {
            Ok(f) => match Flock::lock(f, FlockArg::LockExclusiveNonblock) {
                Ok(l) => Some(l),
                Err(_) => continue,
            },
            Err(_) => None,
        };
        if known(&id) {
            continue;
        }
        match teardown_locked(&paths) {
            Ok(()) => removed.push(id),
            Err(e) => {
                tracing::warn!(error = %e, session = %id, "removing an orphaned session volume failed")
            }
        }
    }
    removed
}

/// A directory whose device differs from its parent's is a mount point (a bind mount of the
/// same file system would not be told apart, and the volume is never one).
fn is_mountpoint(p: &Path) -> bool {
    let (Ok(m), Some(Ok(parent))) = (
        std::fs::symlink_metadata(p),
        p.parent().map(std::fs::metadata),
    ) else {
        return false;
    };
    m.is_dir() && m.dev() != parent.dev()
}

/// The allocated bytes of the volume's image on the host (what it costs the host now).
pub fn allocated_bytes(paths: &VolumePaths) -> u64 {
    std::fs::metadata(&paths.image)
        .map(|m| m.blocks() * 512)
        .unwrap_or(0)
}

/// What the host needs for session storage limits, each with whether it has it.
pub fn host_support() -> Vec<(&'static str, Result<(), String>)> {
    let loop_ctl = match std::fs::metadata(crate::sys::loopdev::LOOP_CONTROL) {
        Ok(_) => match OpenOptions::new()
            .read(true)
            .write(true)
            .open(crate::sys::loopdev::LOOP_CONTROL)
        {
            Ok(_) => Ok(()),
            Err(e) => Err(format!("cannot open it: {e}")),
        },
        Err(e) => Err(format!("{e} (modprobe loop)")),
    };
    let mkfs = ["mkfs.ext4", "tune2fs"]
        .iter()
        .all(|tool| {
            ["/usr/sbin", "/sbin"]
                .iter()
                .any(|d| Path::new(d).join(tool).exists())
        })
        .then_some(())
        .ok_or_else(|| "not found (install e2fsprogs)".to_string());
    let root = nix::unistd::geteuid()
        .is_root()
        .then_some(())
        .ok_or_else(|| "mounting needs root".to_string());
    vec![
        (crate::sys::loopdev::LOOP_CONTROL, loop_ctl),
        ("mkfs.ext4 and tune2fs", mkfs),
        ("mount permission", root),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_volume_paths_layout() {
        let p = VolumePaths::new(Path::new("/s/sessions"), "ses-0a");
        assert_eq!(p.image, Path::new("/s/sessions/ses-0a.img"));
        assert_eq!(p.mountpoint, Path::new("/s/sessions/ses-0a.vol"));
        assert_eq!(p.session_dir(), Path::new("/s/sessions/ses-0a.vol/session"));
    }

    #[test]
    fn test_volume_below_minimum_refused_and_nothing_made() {
        let d = tempfile::tempdir().expect("tempdir");
        let p = VolumePaths::new(d.path(), "ses-1");
        let e = Volume::create(&p, MIN_STORAGE_MIB - 1).expect_err("too small");
        assert!(e.to_string().contains("minimum"), "{e}");
        assert!(!p.image.exists() && !p.mountpoint.exists());
    }

    /// A real volume (root, as CI runs): usable space close to the limit, ENOSPC past it,
    /// the image's host allocation bounded by its size, and nothing left after teardown.
    #[test]
    fn test_volume_fills_at_its_size_and_tears_down() {
        if !nix::unistd::geteuid().is_root() {
            panic!("this test needs root, as session volumes do");
        }
        let d = tempfile::tempdir().expect("tempdir");
        let p = VolumePaths::new(d.path(), "ses-2");
        let v = Volume::create(&p, 64).expect("create");
        assert!(p.is_mounted());
        // A sweep leaves a volume alone while it is being made, and a known one always.
        assert!(sweep(d.path(), |_| false).is_empty());
        drop(v);
        assert!(sweep(d.path(), |id| id == "ses-2").is_empty());
        assert!(p.is_mounted());
        fill_and_tear_down(&p);
    }

    /// The same on an XFS host file system (the test's own, on a loop device): sparse
    /// images bound the volume there as on ext4.
    #[test]
    fn test_volume_on_xfs_host_fills_at_its_size() {
        if !nix::unistd::geteuid().is_root() {
            panic!("this test needs root, as session volumes do");
        }
        let d = tempfile::tempdir().expect("tempdir");
        let host = d.path().join("xfs.img");
        File::create(&host)
            .and_then(|f| f.set_len(512 << 20))
            .expect("image");
        let run = |cmd: &mut std::process::Command| {
            let out = cmd.output().expect("spawn");
            assert!(out.status.success(), "{cmd:?}: {out:?}");
        };
        run(std::process::Command::new("mkfs.xfs").arg("-q").arg(&host));
        let mnt = d.path().join("host");
        std::fs::create_dir(&mnt).expect("mkdir");
        run(std::process::Command::new("mount")
            .args(["-t", "xfs", "-o", "loop"])
            .arg(&host)
            .arg(&mnt));
        let p = VolumePaths::new(&mnt, "ses-6");
        let filled = std::panic::catch_unwind(|| {
            drop(Volume::create(&p, 64).expect("create"));
            fill_and_tear_down(&p);
        });
        let _ = teardown(&p);
        run(std::process::Command::new("umount").arg(&mnt));
        if let Err(e) = filled {
            std::panic::resume_unwind(e);
        }
    }

    fn fill_and_tear_down(p: &VolumePaths) {
        let big = p.mountpoint.join("big");
        let mut f = File::create(&big).expect("create");
        let chunk = vec![0x5au8; 1 << 20];
        let mut written = 0u64;
        let e = loop {
            match std::io::Write::write_all(&mut f, &chunk).and_then(|()| f.sync_data()) {
                Ok(()) => written += 1 << 20,
                Err(e) => break e,
            }
            assert!(written <= 128 << 20, "wrote past twice the size");
        };
        assert_eq!(e.raw_os_error(), Some(nix::libc::ENOSPC), "{e}");
        assert!(written > 48 << 20, "only {written} bytes fit");
        assert!(allocated_bytes(p) <= 64 << 20);
        drop(f);
        teardown(p).expect("teardown");
        assert!(!p.is_mounted() && !p.image.exists() && !p.mountpoint.exists());
        // Teardown again is a no-op.
        teardown(p).expect("again");
    }

    /// Loop devices backed by `image`.
    fn loops_backed_by(image: &Path) -> usize {
        std::fs::read_dir("/sys/block")
            .expect("/sys/block")
            .flatten()
            .filter(|e| {
                std::fs::read_to_string(e.path().join("loop/backing_file"))
                    .is_ok_and(|b| Path::new(b.trim()) == image)
            })
            .count()
    }

    /// Waits (10 s at most) until no loop device is backed by `image`.
    fn wait_for_no_loops(image: &Path) {
        let t = std::time::Instant::now();
        while loops_backed_by(image) > 0 && t.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Mounts of `mountpoint` (stacked ones counted).
    fn mounts_at(mountpoint: &Path) -> usize {
        let info = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
        let p = mountpoint.to_string_lossy();
        info.lines()
            .filter(|l| l.split(' ').nth(4) == Some(p.as_ref()))
            .count()
    }

    /// After a restart unmounted a volume, many callers mounting it again at once (requests
    /// on one session) mount it once: before the lock each attached the image to a loop
    /// device of its own and mounted it over the others, several independent ext4 instances
    /// on one image (4 concurrent `session status` left 4 stacked mounts on 4 devices). A
    /// teardown racing them leaves nothing mounted behind it.
    #[test]
    fn test_concurrent_remounts_mount_once_and_teardown_is_not_undone() {
        if !nix::unistd::geteuid().is_root() {
            panic!("this test needs root, as session volumes do");
        }
        let d = tempfile::tempdir().expect("tempdir");
        let p = VolumePaths::new(d.path(), "ses-7");
        drop(Volume::create(&p, 64).expect("create"));
        for round in 0..3 {
            nix::mount::umount(&p.mountpoint).expect("unmount (a restart)");
            assert!(!p.is_mounted());
            // Autoclear detaches the unmounted device asynchronously (later on a busy
            // machine): wait for it, so the count below is of the remounts' devices alone.
            wait_for_no_loops(&p.image);
            assert_eq!(
                loops_backed_by(&p.image),
                0,
                "round {round}: old device left"
            );
            let barrier = std::sync::Barrier::new(8);
            std::thread::scope(|s| {
                for _ in 0..8 {
                    s.spawn(|| {
                        barrier.wait();
                        ensure_mounted(&p).expect("ensure_mounted");
                    });
                }
            });
            assert_eq!(mounts_at(&p.mountpoint), 1, "round {round}: stacked mounts");
            assert_eq!(loops_backed_by(&p.image), 1, "round {round}: loop devices");
        }
        // A teardown racing remounts: afterwards nothing is mounted, attached or left.
        nix::mount::umount(&p.mountpoint).expect("unmount");
        let barrier = std::sync::Barrier::new(5);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    barrier.wait();
                    let _ = ensure_mounted(&p);
                });
            }
            barrier.wait();
            teardown(&p).expect("teardown");
        });
        // A remount that lost the race fails; one that won was undone by the teardown after it.
        assert_eq!(mounts_at(&p.mountpoint), 0);
        assert!(!p.image.exists() && !p.mountpoint.exists());
        let e = ensure_mounted(&p).expect_err("gone");
        assert!(e.to_string().contains("gone"), "{e}");
        // Autoclear frees the devices at the unmount, asynchronously.
        wait_for_no_loops(&p.image);
        assert_eq!(loops_backed_by(&p.image), 0, "loop device left");
    }

    /// An orphaned volume (no session knows it, nobody is making it) is swept: unmounted and
    /// deleted; a leftover mount point alone goes too.
    #[test]
    fn test_sweep_removes_orphaned_volume_and_leftover_mountpoint() {
        if !nix::unistd::geteuid().is_root() {
            panic!("this test needs root, as session volumes do");
        }
        let d = tempfile::tempdir().expect("tempdir");
        let p = VolumePaths::new(d.path(), "ses-3");
        drop(Volume::create(&p, 64).expect("create"));
        let stray = VolumePaths::new(d.path(), "ses-4");
        std::fs::create_dir(&stray.mountpoint).expect("mkdir");
        std::fs::write(d.path().join("ses-5.txt"), "not a volume").expect("write");
        assert_eq!(sweep(d.path(), |_| false), ["ses-3", "ses-4"]);
        assert!(!p.is_mounted() && !p.image.exists() && !p.mountpoint.exists());
        assert!(!stray.mountpoint.exists());
        assert!(
            d.path().join("ses-5.txt").exists(),
            "other files are left alone"
        );
    }
}
