//! Directories in `vms/` that no VM record names, swept in the background once the service
//! serves. An engine that died at the wrong moment leaves one of two kinds:
//!
//! - a create's: its directory (holding an empty `run/` and its transition lock) is made
//!   before its record is inserted (`Warren::begin_create`), so a death in between leaves a
//!   directory with no record;
//! - a destroy's: the directory is moved out of its name (`.destroyed-<id>-<pid>`) before it
//!   is removed, so a death in between leaves it there for good.
//!
//! They take disk that no limit counts, and a clone's marker in one keeps its template from
//! being collected. A directory is removed only when unchanged for [`ORPHAN_AGE`], with its
//! transition lock not held (a create, resume or destroy under way holds it to its end; the
//! lock file is opened, never made, without following a link or blocking) and held by the
//! sweep meanwhile, with no live supervisor; a create's only with exactly what a create makes
//! before its record (an empty `run/`, the lock) and no record once the lock is held, so a
//! VM's directory whose record is gone for another reason (a database lost or restored from
//! an older copy) keeps its disks; a destroy's only when no destroy holds the directory's
//! own lock ([`lock_dir`]: a destroy under way may already have removed the lock file).
//! Removal does not follow links and does not recurse (`warren_session::remove_tree`: a
//! VMM shaped `run/`). Other names in `vms/` are left alone.

use std::path::Path;
use std::time::Duration;

use warren_supervisor::layout::VmDir;

use super::Warren;

/// How long a directory no record names must have gone unchanged before it is removed.
const ORPHAN_AGE: Duration = Duration::from_secs(60);

/// What a name in `vms/` is.
enum Kind<'a> {
    /// A VM's directory (`vm-<hex>`): this VM id.
    Vm(&'a str),
    /// A destroy's directory moved out of its VM's name.
    Destroyed,
}

fn kind(name: &str) -> Option<Kind<'_>> {
    if name.starts_with(".destroyed-vm-") {
        return Some(Kind::Destroyed);
    }
    let hex = name.strip_prefix("vm-")?;
    (!hex.is_empty() && hex.bytes().all(|b| b.is_ascii_hexdigit())).then_some(Kind::Vm(name))
}

/// Whether `path` holds exactly what a create makes before its record: an empty `run/`
/// directory and, at most, the transition lock (a regular file).
fn create_leftover(path: &Path) -> bool {
    let Ok(entries) = std::fs::read_dir(path) else {
        return false;
    };
    let mut run = false;
    for e in entries {
        let Ok(e) = e else { return false };
        let Ok(kind) = e.file_type() else {
            return false;
        };
        match e.file_name().to_str() {
            Some("run") if kind.is_dir() => {
                run = std::fs::read_dir(e.path()).is_ok_and(|mut d| d.next().is_none());
                if !run {
                    return false;
                }
            }
            Some("transition.lock") if kind.is_file() => {}
            _ => return false,
        }
    }
    run
}

/// An exclusive lock on the directory `path` itself (its inode: it follows the directory
/// through a rename, and outlives the removal of any file in it), taken if free: `Ok(None)`
/// when another holds it. A destroy holds it from before it moves the directory aside until
/// the directory is gone, so neither a sweep nor a second destroy removes a tree a destroy is
/// still removing. Not followed if it is a link.
pub(super) fn lock_dir(path: &Path) -> std::io::Result<Option<nix::fcntl::Flock<std::fs::File>>> {
    use std::os::unix::fs::OpenOptionsExt;
    let dir = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_DIRECTORY | nix::libc::O_NOFOLLOW)
        .open(path)?;
    match nix::fcntl::Flock::lock(dir, nix::fcntl::FlockArg::LockExclusiveNonblock) {
        Ok(l) => Ok(Some(l)),
        Err((_, nix::errno::Errno::EWOULDBLOCK)) => Ok(None),
        Err((_, e)) => Err(e.into()),
    }
}

/// The transition lock of `dir`, taken if it is free: `Some(None)` when there is no lock
/// file, `None` when it is held or is not a regular file. Opened, never made, without
/// following a link or blocking (a FIFO there would hang the sweep).
fn take_lock(dir: &VmDir) -> Option<Option<nix::fcntl::Flock<std::fs::File>>> {
    use std::os::unix::fs::OpenOptionsExt;
    let path = dir.transition_lock();
    let file = match std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_NONBLOCK)
        .open(&path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Some(None),
        Err(_) => return None,
    };
    if !file.metadata().is_ok_and(|m| m.is_file()) {
        return None;
    }
    nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock)
        .ok()
        .map(Some)
}

/// Whether `path` (not followed) is a directory unchanged for [`ORPHAN_AGE`].
fn stale_dir(path: &Path) -> bool {
    std::fs::symlink_metadata(path).is_ok_and(|m| {
        m.is_dir()
            && m.modified()
                .ok()
                .and_then(|t| t.elapsed().ok())
                .is_some_and(|age| age > ORPHAN_AGE)
    })
}

impl Warren {
    /// Removes the directories of `vms/` that crashed creates and destroys left (module
    /// docs); returns their names. A directory that cannot be removed is logged and kept.
    pub async fn sweep_vm_dirs(&self) -> Vec<String> {
        let vms = self.cfg.state_dir.join("vms");
        let entries = match std::fs::read_dir(&vms) {
            Ok(e) => e,
            Err(e) => {
                tracing::warn!(dir = %vms.display(), error = %e, "listing VM directories for the sweep");
                return Vec::new();
            }
        };
        let mut removed = Vec::new();
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            let Some(kind) = kind(name) else { continue };
            let path = entry.path();
            if !stale_dir(&path) {
                continue;
            }
            let dir = VmDir(path.clone());
            let shaped = match kind {
                Kind::Vm(_) => create_leftover(&path),
                Kind::Destroyed => true,
            };
            if !shaped {
                if matches!(kind, Kind::Vm(id) if matches!(self.store.get(id), Ok(None))) {
                    tracing::warn!(dir = %path.display(), "a VM directory no record names holds more than a create leaves (a lost database?); left alone");
                }
                continue;
            }
            // Held: a create, resume or destroy is under way.
            let Ok(Some(held)) = lock_dir(&path) else {
                continue;
            };
            let Some(lock) = take_lock(&dir) else {
                continue;
            };
            if dir.supervisor_alive() {
                tracing::warn!(dir = %path.display(), "a VM directory no record names has a live supervisor; left alone");
                continue;
            }
            if let Kind::Vm(id) = kind {
                // Read under the lock: a create inserts its record while it holds it.
                match self.store.get(id) {
                    Ok(None) => {}
                    Ok(Some(_)) => continue,
                    Err(e) => {
                        tracing::warn!(vm = id, error = %e, "reading a VM record for the sweep");
                        continue;
                    }
                }
            }
            let doomed = path.clone();
            let done = tokio::task::spawn_blocking(move || warren_session::remove_tree(&doomed))
                .await
                .unwrap_or_else(|e| Err(std::io::Error::other(e.to_string())));
            drop((lock, held));
            match done {
                Ok(()) => {
                    tracing::info!(dir = %path.display(), "removed a VM directory no record names");
                    removed.push(name.to_string());
                }
                Err(e) => {
                    tracing::warn!(dir = %path.display(), error = %e, "removing a VM directory no record names")
                }
            }
        }
        removed
    }
}

#[cfg(test)]
mod tests {
    use std::time::SystemTime;

    use super::*;

    /// Makes `path` look unchanged for two minutes.
    fn age(path: &Path) {
        let old = SystemTime::now() - Duration::from_secs(120);
        std::fs::File::open(path)
            .and_then(|f| f.set_modified(old))
            .expect("set mtime");
    }

    /// Only directories no record names, unchanged for a while and not held are removed:
    /// a create's and a destroy's leftovers go, a young directory, a recorded VM's, one whose
    /// transition lock is held, a link and other names stay. (Before, nothing removed them.)
    #[tokio::test]
    async fn test_sweep_removes_only_unheld_directories_no_record_names() {
        let (_state, w, rec) = crate::vm::test_engine_with_vm("vm-0123456789ab");
        let vms = w.cfg.state_dir.join("vms");
        let outside = tempfile::tempdir().expect("tmp");
        std::fs::write(outside.path().join("keep"), b"x").expect("write");
        let mk = |name: &str| {
            let p = vms.join(name);
            std::fs::create_dir_all(p.join("run/a/b")).expect("mkdir");
            std::fs::write(p.join("disk.qcow2"), b"disk").expect("write");
            // A link inside is removed, never followed.
            std::os::unix::fs::symlink(outside.path(), p.join("run/a/link")).expect("link");
            p
        };
        // What a create makes before its record: an empty run/ and its lock.
        let crashed_create = vms.join("vm-00000000000a");
        std::fs::create_dir_all(crashed_create.join("run")).expect("mkdir");
        std::fs::write(crashed_create.join("transition.lock"), b"").expect("lock");
        // A destroyer long gone (pids this high are never handed out).
        let crashed_destroy = mk(".destroyed-vm-00000000000b-4294967294");
        let young = vms.join("vm-00000000000c");
        std::fs::create_dir_all(young.join("run")).expect("mkdir");
        let recorded = mk(&rec.id);
        let held = mk(".destroyed-vm-00000000000d-4294967293");
        // A destroy under way (it holds the directory's own lock; its lock file is gone).
        let live = mk(".destroyed-vm-00000000000f-4294967292");
        let live_lock = lock_dir(&live).expect("lock").expect("free");
        // A VM's directory whose record is gone (a lost database): its disk stays.
        let unrecorded = mk("vm-000000000010");
        let other = mk("not-a-vm");
        std::os::unix::fs::symlink(outside.path(), vms.join("vm-00000000000e")).expect("link");
        let lock = crate::vm::suspend::try_transition(&VmDir(held.clone()))
            .expect("lock")
            .expect("free");
        for p in [
            &crashed_create,
            &crashed_destroy,
            &recorded,
            &held,
            &live,
            &unrecorded,
            &other,
        ] {
            age(p);
        }

        let mut removed = w.sweep_vm_dirs().await;
        removed.sort();
        assert_eq!(
            removed,
            vec![
                ".destroyed-vm-00000000000b-4294967294".to_string(),
                "vm-00000000000a".to_string()
            ]
        );
        assert!(!crashed_create.exists() && !crashed_destroy.exists());
        assert!(
            young.join("run").is_dir(),
            "a young create's directory kept"
        );
        for p in [&recorded, &held, &live, &unrecorded, &other] {
            assert!(p.join("disk.qcow2").exists(), "{} kept", p.display());
        }
        assert!(outside.path().join("keep").exists(), "a link was followed");
        assert!(vms.join("vm-00000000000e").symlink_metadata().is_ok());
        // Control: once their destroys let go, the held ones go too.
        drop((lock, live_lock));
        let mut removed = w.sweep_vm_dirs().await;
        removed.sort();
        assert_eq!(
            removed,
            vec![
                ".destroyed-vm-00000000000d-4294967293".to_string(),
                ".destroyed-vm-00000000000f-4294967292".to_string()
            ]
        );
    }
}
