//! `/etc/hostname` and `/etc/machine-id` in memory, so that `Rekey` changes them without
//! touching the root disk.
//!
//! A restored copy runs on an empty translation cache: under TCG the first use of any kernel
//! path costs tens of times its warm cost. Replacing a file on ext4 (create, write, rename,
//! and the writeback ext4 starts when a rename replaces a file) was the slowest step of a
//! template clone's start, about 60 ms of its ~450 ms, while the same write on a tmpfs file
//! is a fraction of a millisecond warm and a few cold.
//!
//! At boot, PID 1 ([`bind`]) puts both files on a tmpfs under [`IDENTITY_DIR`] and
//! bind-mounts them over the disk's files, keeping a descriptor of the disk's machine id open
//! underneath. `Rekey` ([`set`]) then rewrites the tmpfs files in place (a bind mount pins the
//! inode, so a rename would not show), and the new machine id reaches the disk
//! [`PERSIST_DELAY`] later, off the start's critical path, through that descriptor, or
//! sooner at a `Freeze` (before a checkpoint or a fork's save) or a power-off (a cold boot
//! of the copy keeps its machine id; the hostname is set at every boot anyway). The disk
//! write is as durable as the earlier rename was: not fsynced. The in-place rewrite is not
//! atomic, but no guest process runs while it happens: `Rekey` comes before `Thaw`, and a
//! fork copy's processes stay frozen until then.
//!
//! An image whose files are not plain files (a link, say) keeps them on the disk: then `set`
//! replaces them there, as before.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{FileExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;
use std::sync::{Mutex, OnceLock, PoisonError};
use std::time::Duration;

use nix::mount::{mount, umount, MsFlags};

/// The tmpfs directory holding the files bound over `/etc`.
pub const IDENTITY_DIR: &str = "/run/warren/identity";
const HOSTNAME: &str = "hostname";
const MACHINE_ID: &str = "machine-id";
/// What the disk's machine id may hold that is copied at boot (a valid one is 33 bytes).
const MAX_MACHINE_ID_FILE: u64 = 64;
/// How long after a `Rekey` its machine id is written to the disk.
pub const PERSIST_DELAY: Duration = Duration::from_secs(2);

/// Set once both files are bound.
struct Bound {
    /// The disk's `/etc/machine-id`, opened before the bind mount covered it.
    disk_machine_id: File,
}

static BOUND: OnceLock<Bound> = OnceLock::new();
/// The machine id the next disk write stores (the newest `Rekey`'s).
static PENDING: Mutex<Option<String>> = Mutex::new(None);

/// Binds both files (PID 1, once, after `/run` is mounted). A failure leaves both on the
/// disk and is logged: `set` then writes there.
pub fn bind() {
    if let Err(e) = try_bind() {
        crate::console::log(format_args!("identity files stay on the root disk: {e}"));
    }
}

fn try_bind() -> io::Result<()> {
    let etc = |name: &str| Path::new("/etc").join(name);
    for name in [HOSTNAME, MACHINE_ID] {
        let path = etc(name);
        match fs::symlink_metadata(&path) {
            Ok(m) if m.file_type().is_file() => {}
            Ok(_) => {
                return Err(io::Error::other(format!(
                    "{} is not a regular file",
                    path.display()
                )))
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                new_file(&path)?;
            }
            Err(e) => return Err(e),
        }
    }
    fs::create_dir_all(IDENTITY_DIR)?;
    fs::set_permissions(IDENTITY_DIR, fs::Permissions::from_mode(0o755))?;
    let disk = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(etc(MACHINE_ID))?;
    let mut current = Vec::new();
    (&disk)
        .take(MAX_MACHINE_ID_FILE)
        .read_to_end(&mut current)?;
    let mut hostname = rustix::system::uname().nodename().to_bytes().to_vec();
    hostname.push(b'\n');
    write_in_place(&Path::new(IDENTITY_DIR).join(HOSTNAME), &hostname)?;
    write_in_place(&Path::new(IDENTITY_DIR).join(MACHINE_ID), &current)?;
    let mut bound = Vec::new();
    for name in [HOSTNAME, MACHINE_ID] {
        let target = etc(name);
        let source = Path::new(IDENTITY_DIR).join(name);
        if let Err(e) = mount(
            Some(&source),
            &target,
            None::<&str>,
            MsFlags::MS_BIND,
            None::<&str>,
        ) {
            for t in &bound {
                let _ = umount(t);
            }
            return Err(io::Error::other(format!(
                "bind-mounting {}: {e}",
                target.display()
            )));
        }
        bound.push(target);
    }
    let _ = BOUND.set(Bound {
        disk_machine_id: disk,
    });
    Ok(())
}

/// Writes the copy's hostname file and machine id (the kernel's hostname is the caller's):
/// in memory when bound, the disk's machine id following later; on the disk otherwise.
pub fn set(hostname: &str, machine_id: &str) {
    let files = [
        (HOSTNAME, format!("{hostname}\n")),
        (MACHINE_ID, format!("{machine_id}\n")),
    ];
    if BOUND.get().is_none() {
        for (name, content) in &files {
            let path = Path::new("/etc").join(name);
            if let Err(e) = replace_file(&path, content.as_bytes()) {
                crate::console::log(format_args!("write {}: {e}", path.display()));
            }
        }
        return;
    }
    for (name, content) in &files {
        let path = Path::new(IDENTITY_DIR).join(name);
        if let Err(e) = write_in_place(&path, content.as_bytes()) {
            crate::console::log(format_args!("write {}: {e}", path.display()));
        }
    }
    let first = PENDING
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .replace(files[1].1.clone())
        .is_none();
    if first {
        // A timer on the agent's runtime, not a thread: creating one is itself a cold path
        // on the start's critical path. `Freeze` and power-off flush sooner.
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                rt.spawn(async move {
                    tokio::time::sleep(PERSIST_DELAY).await;
                    let _ = tokio::task::spawn_blocking(flush).await;
                });
            }
            Err(_) => flush(),
        }
    }
}

/// Writes a pending machine id to the disk now (the timer's work; also run before a
/// checkpoint or a fork's save, and at power-off, so none of them keeps the old one).
pub fn flush() {
    let content = PENDING
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .take();
    if let (Some(c), Some(bound)) = (content, BOUND.get()) {
        if let Err(e) = persist(&bound.disk_machine_id, c.as_bytes()) {
            crate::console::log(format_args!("write /etc/machine-id (disk): {e}"));
        }
    }
}

/// Overwrites `file` with `content` through its descriptor (the path is covered by a mount).
fn persist(file: &File, content: &[u8]) -> io::Result<()> {
    file.write_all_at(content, 0)?;
    file.set_len(content.len() as u64)
}

/// A new root-owned 0444 file, not following a link planted at `path`.
fn new_file(path: &Path) -> io::Result<File> {
    OpenOptions::new()
        .create_new(true)
        .write(true)
        .mode(0o444)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
}

/// Rewrites `path` in place (created 0444 when missing): the inode stays the one mounted.
fn write_in_place(path: &Path, content: &[u8]) -> io::Result<()> {
    let mut f = OpenOptions::new()
        .create(true)
        .write(true)
        .truncate(true)
        .mode(0o444)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)?;
    f.write_all(content)
}

/// Replaces `path` through a temporary file in the same directory renamed over it (root's,
/// 0444: neither is the guest user's to change). Not fsynced: after a crash the file holds
/// the old identity or the new one (ext4 orders the rename after the data).
fn replace_file(path: &Path, content: &[u8]) -> io::Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".warren-tmp");
    let tmp = Path::new(&tmp);
    let _ = fs::remove_file(tmp);
    let mut f = new_file(tmp)?;
    f.write_all(content)?;
    fs::rename(tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_persist_overwrites_through_descriptor_and_trims() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("machine-id");
        fs::write(&path, b"0123456789abcdef0123456789abcdef\nleftover\n").expect("write");
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .expect("open");
        persist(&f, b"fedcba9876543210fedcba9876543210\n").expect("persist");
        assert_eq!(
            fs::read(&path).expect("read"),
            b"fedcba9876543210fedcba9876543210\n"
        );
    }

    #[test]
    fn test_write_in_place_keeps_the_inode() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("hostname");
        write_in_place(&path, b"warren\n").expect("first");
        let ino = fs::metadata(&path).expect("stat").ino();
        write_in_place(&path, b"vm-1\n").expect("second");
        assert_eq!(fs::metadata(&path).expect("stat").ino(), ino);
        assert_eq!(fs::read(&path).expect("read"), b"vm-1\n");
        assert_eq!(
            fs::metadata(&path).expect("stat").permissions().mode() & 0o777,
            0o444
        );
    }

    #[test]
    fn test_replace_and_new_file_refuse_a_planted_link() {
        let dir = tempfile::tempdir().expect("tempdir");
        let outside = dir.path().join("outside");
        fs::write(&outside, b"keep").expect("write");
        let path = dir.path().join("machine-id");
        std::os::unix::fs::symlink(&outside, dir.path().join("machine-id.warren-tmp"))
            .expect("symlink");
        // The planted temp link is removed, not followed.
        replace_file(&path, b"x\n").expect("replace");
        assert_eq!(fs::read(&outside).expect("read"), b"keep");
        assert_eq!(fs::read(&path).expect("read"), b"x\n");
        std::os::unix::fs::symlink(&outside, dir.path().join("link")).expect("symlink");
        assert!(new_file(&dir.path().join("link")).is_err());
        assert!(write_in_place(&dir.path().join("link"), b"y").is_err());
        assert_eq!(fs::read(&outside).expect("read"), b"keep");
    }
}
