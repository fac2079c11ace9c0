//! Directories in `vms/` that no VM record names, swept when the service starts. An engine
//! that died at the wrong moment leaves one of two kinds:
//!
//! - a create's: its directory is made (and its transition lock taken) before its record is
//!   inserted (`Warren::begin_create`), so a death in between leaves a directory with no
//!   record;
//! - a destroy's: the directory is moved out of its name (`.destroyed-<id>-<pid>`) before it
//!   is removed, so a death in between leaves it there for good.
//!
//! They hold disks and saved RAM (gigabytes) that no limit counts, and a clone's marker in one
//! keeps its template from being collected. A directory is removed only while the sweep holds
//! its transition lock (a create, resume or destroy under way holds it to its end), with no
//! live supervisor, and, for a VM id, with no record once the lock is held and unchanged for
//! [`ORPHAN_AGE`] (a create takes the lock right after it makes the directory). Removal does
//! not follow links and does not recurse (`warren_session::remove_tree`: a VMM shaped `run/`).
//! Other names in `vms/` are left alone.

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
            // Held: a create, resume or destroy is under way.
            let Ok(Some(lock)) = super::suspend::try_transition(&dir) else {
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
            drop(lock);
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
        let crashed_create = mk("vm-00000000000a");
        let crashed_destroy = mk(".destroyed-vm-00000000000b-4242");
        let young = mk("vm-00000000000c");
        let recorded = mk(&rec.id);
        let held = mk(".destroyed-vm-00000000000d-1");
        let other = mk("not-a-vm");
        std::os::unix::fs::symlink(outside.path(), vms.join("vm-00000000000e")).expect("link");
        for p in [&crashed_create, &crashed_destroy, &recorded, &held, &other] {
            age(p);
        }
        let lock = crate::vm::suspend::try_transition(&VmDir(held.clone()))
            .expect("lock")
            .expect("free");
        age(&held);

        let mut removed = w.sweep_vm_dirs().await;
        removed.sort();
        assert_eq!(
            removed,
            vec![
                ".destroyed-vm-00000000000b-4242".to_string(),
                "vm-00000000000a".to_string()
            ]
        );
        assert!(!crashed_create.exists() && !crashed_destroy.exists());
        for p in [&young, &recorded, &held, &other] {
            assert!(p.join("disk.qcow2").exists(), "{} kept", p.display());
        }
        assert!(outside.path().join("keep").exists(), "a link was followed");
        assert!(vms.join("vm-00000000000e").symlink_metadata().is_ok());
        // Control: once its destroy let go, the held one goes too.
        drop(lock);
        assert_eq!(
            w.sweep_vm_dirs().await,
            vec![".destroyed-vm-00000000000d-1".to_string()]
        );
    }
}
