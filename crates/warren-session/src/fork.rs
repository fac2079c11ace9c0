//! Forking a session: a new session directory whose workspace is a copy of another's.
//!
//! The caller (the engine's `vm_fork`) holds the other session's VM stopped while this runs,
//! so the copy matches the memory its VM's copies restore. The new directory gets the same
//! layout as [`crate::prepare`] makes: `S` (0711), the owner's `S/workspace`, and the
//! host-owned link `S/.warren-source-objects` to the same source object directory (checked as
//! every launch checks it). The workspace, `.git` included, is copied as a tree, as the
//! owner ([`crate::copy`]): every path opened beneath the source workspace without following a
//! symlink, symlinks recreated from their text, regular files with their modes and times,
//! directories even when empty; FIFOs, sockets and device nodes are left out and reported.
//! The walk is bounded in entries and depth: the guest wrote that tree.

use std::path::{Path, PathBuf};

use crate::copy::{as_owner, copy_entries, Entry, Skipped};
use crate::guard::SessionPaths;
use crate::{Owner, SessionError};

/// Most entries (files, directories, links) a fork copies.
pub const MAX_FORK_ENTRIES: usize = 1_000_000;
/// Deepest directory a fork descends into.
const MAX_DEPTH: usize = 256;

/// What [`fork`] copied.
#[derive(Debug, Clone, Default)]
pub struct Forked {
    pub files: u64,
    pub symlinks: u64,
    pub bytes: u64,
    /// Paths not copied (special files), with the reason.
    pub skipped: Vec<Skipped>,
}

/// Makes `to` (which must not exist; its parent must) a session whose workspace is a copy of
/// session `from`'s. On failure nothing of `to` is left.
pub fn fork(from: &Path, to: &Path, owner: Option<Owner>) -> Result<Forked, SessionError> {
    let run_as = crate::git::effective_owner(owner)?;
    let src = SessionPaths::new(from);
    src.check_session()?;
    let objects = crate::source_objects_dir(from)?;
    match std::fs::symlink_metadata(to) {
        Ok(_) => return Err(SessionError::SessionExists(to.to_path_buf())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(SessionError::io("stat", to)(e)),
    }
    std::fs::create_dir(to).map_err(SessionError::io("create directory", to))?;
    let made = (|| {
        use std::os::unix::fs::PermissionsExt;
        let dst = SessionPaths::new(to);
        std::fs::set_permissions(to, std::fs::Permissions::from_mode(0o711))
            .map_err(SessionError::io("chmod", to))?;
        std::fs::create_dir(&dst.workspace)
            .map_err(SessionError::io("create directory", &dst.workspace))?;
        if let Some(o) = run_as {
            std::os::unix::fs::chown(&dst.workspace, Some(o.uid), Some(o.gid))
                .map_err(SessionError::io("chown", &dst.workspace))?;
        }
        std::os::unix::fs::symlink(&objects, &dst.link)
            .map_err(SessionError::io("symlink", &dst.link))?;
        let stats = as_owner(run_as, || {
            let entries = walk(&src.workspace)?;
            copy_entries(&src.workspace, &dst.workspace, &entries, true)
        })?;
        dst.check_session()?;
        Ok(Forked {
            files: stats.files,
            symlinks: stats.symlinks,
            bytes: stats.bytes,
            skipped: stats.skipped,
        })
    })();
    if made.is_err() {
        if let Err(e) = std::fs::remove_dir_all(to) {
            tracing::warn!(error = %e, dir = %to.display(), "removing a half-made session fork");
        }
    }
    made
}

/// Every path under `root` (relative), parents before children; symlinks are listed, never
/// followed.
fn walk(root: &Path) -> Result<Vec<Entry>, SessionError> {
    let mut out = Vec::new();
    let mut stack: Vec<(PathBuf, usize)> = vec![(PathBuf::new(), 0)];
    while let Some((rel, depth)) = stack.pop() {
        let dir = root.join(&rel);
        let rd = std::fs::read_dir(&dir).map_err(SessionError::io("read directory", &dir))?;
        for e in rd {
            let e = e.map_err(SessionError::io("read directory", &dir))?;
            let path = rel.join(e.file_name());
            let kind = e
                .file_type()
                .map_err(SessionError::io("stat", root.join(&path)))?;
            if out.len() >= MAX_FORK_ENTRIES {
                return Err(SessionError::TooLarge {
                    what: format!("the session's workspace {}", root.display()),
                    limit: format!("{MAX_FORK_ENTRIES} entries"),
                });
            }
            if kind.is_dir() {
                if depth + 1 > MAX_DEPTH {
                    return Err(SessionError::TooLarge {
                        what: format!("the depth of {}", root.join(&path).display()),
                        limit: format!("{MAX_DEPTH} directories"),
                    });
                }
                stack.push((path.clone(), depth + 1));
            }
            out.push(Entry {
                path,
                gitlink: false,
            });
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    /// A session directory as prepare lays it out, without git.
    fn session(root: &Path) -> PathBuf {
        let s = root.join("s1");
        let objects = root.join("objects");
        std::fs::create_dir_all(&objects).unwrap();
        std::fs::create_dir_all(s.join("workspace/.git/refs/tags")).unwrap();
        std::os::unix::fs::symlink(
            objects.canonicalize().unwrap(),
            s.join(crate::SOURCE_OBJECTS_LINK),
        )
        .unwrap();
        s
    }

    #[test]
    fn test_fork_copies_the_tree_with_modes_links_empty_dirs_and_times() {
        let t = tempfile::tempdir().unwrap();
        let from = session(t.path());
        let ws = from.join("workspace");
        std::fs::write(ws.join("a.txt"), b"hello").unwrap();
        std::fs::create_dir_all(ws.join("src/deep")).unwrap();
        std::fs::write(ws.join("src/deep/run.sh"), b"#!/bin/sh\n").unwrap();
        std::fs::set_permissions(
            ws.join("src/deep/run.sh"),
            std::fs::Permissions::from_mode(0o750),
        )
        .unwrap();
        std::os::unix::fs::symlink("/etc/passwd", ws.join("link")).unwrap();
        std::os::unix::fs::symlink("src", ws.join("srclink")).unwrap();
        nix::unistd::mkfifo(
            &ws.join("fifo"),
            nix::sys::stat::Mode::from_bits_truncate(0o600),
        )
        .unwrap();
        let old = std::time::SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1_000_000);
        std::fs::File::options()
            .write(true)
            .open(ws.join("a.txt"))
            .unwrap()
            .set_modified(old)
            .unwrap();

        let to = t.path().join("s2");
        let f = fork(&from, &to, None).unwrap();
        let nws = to.join("workspace");
        assert_eq!(std::fs::read(nws.join("a.txt")).unwrap(), b"hello");
        assert_eq!(
            std::fs::metadata(nws.join("a.txt"))
                .unwrap()
                .modified()
                .unwrap(),
            old
        );
        assert_eq!(
            std::fs::metadata(nws.join("src/deep/run.sh"))
                .unwrap()
                .mode()
                & 0o777,
            0o750
        );
        assert_eq!(
            std::fs::read_link(nws.join("link")).unwrap(),
            Path::new("/etc/passwd")
        );
        assert_eq!(
            std::fs::read_link(nws.join("srclink")).unwrap(),
            Path::new("src")
        );
        // Nothing was copied through the directory link.
        assert!(std::fs::symlink_metadata(nws.join("srclink"))
            .unwrap()
            .file_type()
            .is_symlink());
        assert!(
            nws.join(".git/refs/tags").is_dir(),
            "empty directories are kept"
        );
        assert!(!nws.join("fifo").exists());
        assert_eq!(f.skipped.len(), 1, "{:?}", f.skipped);
        assert_eq!(f.files, 2);
        assert_eq!(f.symlinks, 2);
        assert_eq!(
            std::fs::read_link(to.join(crate::SOURCE_OBJECTS_LINK)).unwrap(),
            std::fs::read_link(from.join(crate::SOURCE_OBJECTS_LINK)).unwrap()
        );
        assert_eq!(std::fs::metadata(&to).unwrap().mode() & 0o777, 0o711);
        // The copy is its own: a change in one is not in the other.
        std::fs::write(nws.join("a.txt"), b"changed").unwrap();
        assert_eq!(std::fs::read(ws.join("a.txt")).unwrap(), b"hello");
    }

    #[test]
    fn test_fork_refuses_an_existing_target_and_a_non_session() {
        let t = tempfile::tempdir().unwrap();
        let from = session(t.path());
        let to = t.path().join("taken");
        std::fs::create_dir(&to).unwrap();
        assert!(matches!(
            fork(&from, &to, None),
            Err(SessionError::SessionExists(_))
        ));
        // No objects link: not a session, and nothing is made.
        let plain = t.path().join("plain");
        std::fs::create_dir_all(plain.join("workspace")).unwrap();
        let to2 = t.path().join("s3");
        assert!(fork(&plain, &to2, None).is_err());
        assert!(!to2.exists());
        // Control: the session itself forks.
        fork(&from, &t.path().join("s4"), None).unwrap();
    }
}
