//! Forking a session: a new session directory whose workspace is a copy of another's.
//!
//! The caller (the engine's `vm_fork`) holds the other session's VM stopped while this runs,
//! so the copy matches the memory its VM's copies restore. The new directory gets the same
//! layout as [`crate::prepare`] makes: `S` (0711), the owner's `S/workspace`, and the
//! host-owned link `S/.warren-source-objects` to the same source object directory (checked as
//! every launch checks it). The workspace, `.git` included, is copied as a tree, as the
//! owner ([`crate::copy`]): every path opened beneath the source workspace without following a
//! symlink, symlinks recreated from their text, regular files with their modes and times,
//! directories even when empty, holes and hard links kept (a copy takes no more room than
//! the original); FIFOs, sockets and device nodes are left out and reported. The walk opens
//! every directory beneath the workspace without following a symlink too, and is bounded in
//! entries, bytes of names, depth and time: the guest wrote that tree.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::time::Instant;

use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::sys::stat::Mode;

use crate::copy::{as_owner, beneath, copy_entries, Entry, Skipped, TreeCopy};
use crate::guard::SessionPaths;
use crate::{Owner, SessionError};

/// Most entries (files, directories, links) a fork copies.
pub const MAX_FORK_ENTRIES: usize = 1_000_000;
/// Most bytes of relative path names a fork lists (what the listing holds in memory).
pub const MAX_FORK_PATH_BYTES: usize = 256 << 20;
/// Deepest directory a fork descends into.
const MAX_DEPTH: usize = 256;

/// What [`fork`] copied.
#[derive(Debug, Clone, Default)]
pub struct Forked {
    pub files: u64,
    pub symlinks: u64,
    pub bytes: u64,
    /// Paths not copied (special files), with the reason: the first 1,000 (the rest are
    /// counted).
    pub skipped: Vec<Skipped>,
    /// How many paths were not copied.
    pub skipped_total: u64,
}

/// Makes `to` (which must not exist; its parent must) a session whose workspace is a copy of
/// session `from`'s, refused once `deadline` has passed. On failure nothing of `to` is left.
pub fn fork(
    from: &Path,
    to: &Path,
    owner: Option<Owner>,
    deadline: Instant,
) -> Result<Forked, SessionError> {
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
            let entries = walk(&src.workspace, deadline)?;
            copy_entries(
                &src.workspace,
                &dst.workspace,
                &entries,
                Some(TreeCopy { deadline }),
            )
        })?;
        dst.check_session()?;
        Ok(Forked {
            files: stats.files,
            symlinks: stats.symlinks,
            bytes: stats.bytes,
            skipped: stats.skipped,
            skipped_total: stats.skipped_total,
        })
    })();
    if made.is_err() {
        if let Err(e) = crate::remove_tree(to) {
            tracing::warn!(error = %e, dir = %to.display(), "removing a half-made session fork");
        }
    }
    made
}

/// Every path under `root` (relative), parents before children; symlinks are listed, never
/// followed, and each directory is opened beneath `root` without following one.
fn walk(root: &Path, deadline: Instant) -> Result<Vec<Entry>, SessionError> {
    let too_large = |what: String, limit: String| SessionError::TooLarge { what, limit };
    let root_fd = nix::fcntl::open(
        root,
        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC | OFlag::O_NOFOLLOW,
        Mode::empty(),
    )
    .map_err(|e| SessionError::io("open", root)(e.into()))?;
    let mut out = Vec::new();
    let mut name_bytes = 0usize;
    let mut stack: Vec<(PathBuf, usize)> = vec![(PathBuf::new(), 0)];
    while let Some((rel, depth)) = stack.pop() {
        if Instant::now() > deadline {
            return Err(too_large(
                format!("listing {}", root.display()),
                "the fork's copy deadline".into(),
            ));
        }
        let at = if rel.as_os_str().is_empty() {
            Path::new(".")
        } else {
            rel.as_path()
        };
        let fd = match nix::fcntl::openat2(
            &root_fd,
            at,
            beneath(OFlag::O_RDONLY | OFlag::O_DIRECTORY),
        ) {
            Ok(fd) => fd,
            // Gone, or no longer a directory reached without a link: nothing to list there.
            Err(Errno::ENOENT | Errno::ENOTDIR | Errno::ELOOP) if depth > 0 => continue,
            Err(e) => return Err(SessionError::io("open", root.join(&rel))(e.into())),
        };
        let mut dir = nix::dir::Dir::from_fd(fd)
            .map_err(|e| SessionError::io("read", root.join(&rel))(e.into()))?;
        for e in dir.iter() {
            let e = e.map_err(|e| SessionError::io("read directory", root.join(&rel))(e.into()))?;
            let name = OsStr::from_bytes(e.file_name().to_bytes());
            if name == "." || name == ".." {
                continue;
            }
            let path = rel.join(name);
            name_bytes += path.as_os_str().len();
            if out.len() >= MAX_FORK_ENTRIES || name_bytes > MAX_FORK_PATH_BYTES {
                return Err(too_large(
                    format!("the session's workspace {}", root.display()),
                    format!("{MAX_FORK_ENTRIES} entries or {MAX_FORK_PATH_BYTES} bytes of names"),
                ));
            }
            // The copy stats every entry again beneath the tree; this only decides where to
            // descend (a directory whose type the file system does not report is stat'ed).
            let is_dir = match e.file_type() {
                Some(t) => t == nix::dir::Type::Directory,
                None => nix::sys::stat::fstatat(
                    &root_fd,
                    &path,
                    nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
                )
                .is_ok_and(|st| st.st_mode & nix::libc::S_IFMT == nix::libc::S_IFDIR),
            };
            if is_dir {
                if depth + 1 > MAX_DEPTH {
                    return Err(too_large(
                        format!("the depth of {}", root.join(&path).display()),
                        format!("{MAX_DEPTH} directories"),
                    ));
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

    fn later() -> Instant {
        Instant::now() + std::time::Duration::from_secs(60)
    }

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
        let f = fork(&from, &to, None, later()).unwrap();
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
    fn test_fork_keeps_holes_and_hard_links_and_stops_at_its_deadline() {
        use std::os::unix::fs::FileExt;
        let t = tempfile::tempdir().unwrap();
        let from = session(t.path());
        let ws = from.join("workspace");
        // A 1 GiB sparse file with one page of data, and 50 links to one file.
        let f = std::fs::File::create(ws.join("sparse")).unwrap();
        f.set_len(1 << 30).unwrap();
        f.write_all_at(b"data", 512 << 20).unwrap();
        drop(f);
        std::fs::write(ws.join("big"), vec![9u8; 1 << 20]).unwrap();
        for i in 0..50 {
            std::fs::hard_link(ws.join("big"), ws.join(format!("link{i}"))).unwrap();
        }
        let to = t.path().join("s2");
        let f = fork(&from, &to, None, later()).unwrap();
        let nws = to.join("workspace");
        let sparse = std::fs::metadata(nws.join("sparse")).unwrap();
        assert_eq!(sparse.len(), 1 << 30);
        assert!(
            sparse.blocks() * 512 < 1 << 20,
            "holes kept: {} blocks",
            sparse.blocks()
        );
        let mut buf = [0u8; 4];
        std::fs::File::open(nws.join("sparse"))
            .unwrap()
            .read_exact_at(&mut buf, 512 << 20)
            .unwrap();
        assert_eq!(&buf, b"data");
        let big = std::fs::metadata(nws.join("big")).unwrap();
        assert_eq!(big.nlink(), 51, "one file with all its links");
        assert_eq!(
            std::fs::metadata(nws.join("link7")).unwrap().ino(),
            big.ino()
        );
        assert!(f.bytes < 2 << 20, "copied {} bytes", f.bytes);
        // Past its deadline a fork copies nothing and leaves nothing.
        let late = t.path().join("s3");
        assert!(fork(
            &from,
            &late,
            None,
            Instant::now() - std::time::Duration::from_secs(1)
        )
        .is_err());
        assert!(!late.exists());
    }

    #[test]
    fn test_fork_refuses_an_existing_target_and_a_non_session() {
        let t = tempfile::tempdir().unwrap();
        let from = session(t.path());
        let to = t.path().join("taken");
        std::fs::create_dir(&to).unwrap();
        assert!(matches!(
            fork(&from, &to, None, later()),
            Err(SessionError::SessionExists(_))
        ));
        // No objects link: not a session, and nothing is made.
        let plain = t.path().join("plain");
        std::fs::create_dir_all(plain.join("workspace")).unwrap();
        let to2 = t.path().join("s3");
        assert!(fork(&plain, &to2, None, later()).is_err());
        assert!(!to2.exists());
        // Control: the session itself forks.
        fork(&from, &t.path().join("s4"), None, later()).unwrap();
    }
}
