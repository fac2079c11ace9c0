//! Copying working-tree content from the source checkout into the session's workspace.
//!
//! Bytes are copied as they are on disk (no git filters, no checkout), symlinks are recreated
//! from their target text and never followed, and only regular files, symlinks and the
//! directories leading to them are created. Nothing is read through a symlinked directory:
//! git itself treats a path under a symlink as deleted, and following one could leave the
//! repository.
//!
//! When the session has an [`Owner`] and the process is root, the copy runs on a thread whose
//! filesystem uid/gid are the owner's ([`as_owner`]): the kernel checks the owner's permissions
//! when reading the source and makes the owner own everything created.

use std::collections::HashSet;
use std::fs::{self, OpenOptions, Permissions};
use std::io;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};

use nix::fcntl::OFlag;
use nix::unistd::{setfsgid, setfsuid, Gid, Uid};

use crate::{Owner, SessionError};

/// One path to reproduce in the workspace.
#[derive(Debug, Clone)]
pub(crate) struct Entry {
    /// Relative to the working tree; from git, so it has no `..` or absolute components.
    pub path: PathBuf,
    /// A gitlink (submodule): recreated as an empty directory, its content is not copied.
    pub gitlink: bool,
}

/// A path the copy left out, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Skipped {
    pub path: PathBuf,
    pub reason: SkipReason,
}

/// Why a path was not copied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SkipReason {
    /// A submodule: the workspace has an empty directory in its place (an uninitialised
    /// submodule).
    Submodule,
    /// An untracked nested git repository.
    NestedRepository,
    /// A FIFO, socket or device node.
    SpecialFile,
}

/// What the copy did.
#[derive(Debug, Default)]
pub(crate) struct CopyStats {
    pub files: u64,
    pub symlinks: u64,
    pub bytes: u64,
    pub skipped: Vec<Skipped>,
}

/// Runs `f` with the filesystem identity of `owner` (see the module docs); `None` runs it
/// directly. `owner` must already be an effective owner ([`crate::git::effective_owner`]).
pub(crate) fn as_owner<T: Send>(
    owner: Option<Owner>,
    f: impl FnOnce() -> Result<T, SessionError> + Send,
) -> Result<T, SessionError> {
    let Some(o) = owner else { return f() };
    std::thread::scope(|s| {
        s.spawn(|| {
            // fsuid/fsgid are per thread and die with it. Changing fsuid away from 0 also drops
            // the DAC-override capabilities from this thread's effective set.
            setfsgid(Gid::from_raw(o.gid));
            setfsuid(Uid::from_raw(o.uid));
            // Both calls return the previous value: asking again confirms the switch.
            if setfsgid(Gid::from_raw(o.gid)).as_raw() != o.gid
                || setfsuid(Uid::from_raw(o.uid)).as_raw() != o.uid
            {
                return Err(SessionError::OwnerNotPermitted { uid: o.uid });
            }
            f()
        })
        .join()
        .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    })
}

/// Copies `entries` from `src` into `dst` (an existing directory).
pub(crate) fn copy_entries(
    src: &Path,
    dst: &Path,
    entries: &[Entry],
) -> Result<CopyStats, SessionError> {
    let mut copier = Copier {
        src,
        dst,
        src_dirs_ok: HashSet::new(),
        dst_dirs: HashSet::new(),
        stats: CopyStats::default(),
    };
    for e in entries {
        copier.entry(e)?;
    }
    Ok(copier.stats)
}

struct Copier<'a> {
    src: &'a Path,
    dst: &'a Path,
    /// Source directories (relative) known to be real directories, not symlinks.
    src_dirs_ok: HashSet<PathBuf>,
    /// Destination directories (relative) created or checked.
    dst_dirs: HashSet<PathBuf>,
    stats: CopyStats,
}

impl Copier<'_> {
    fn entry(&mut self, e: &Entry) -> Result<(), SessionError> {
        if !e
            .path
            .components()
            .all(|c| matches!(c, Component::Normal(_)))
        {
            // Git never lists such a path; refuse to act on it rather than trust it.
            return Err(SessionError::Io {
                op: "copy unexpected path",
                path: e.path.clone(),
                source: io::Error::from(io::ErrorKind::InvalidInput),
            });
        }
        // A path under a symlinked (or vanished) directory is deleted as far as git is
        // concerned: leave it out.
        if !self.src_parents_are_dirs(&e.path)? {
            return Ok(());
        }
        let from = self.src.join(&e.path);
        let meta = match fs::symlink_metadata(&from) {
            Ok(m) => m,
            Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(()), // deleted
            Err(err) => return Err(SessionError::io("stat", &from)(err)),
        };
        let ft = meta.file_type();
        if e.gitlink {
            if ft.is_dir() {
                self.make_dirs(&e.path)?;
            }
            self.skip(&e.path, SkipReason::Submodule);
            return Ok(());
        }
        let to = self.dst.join(&e.path);
        if ft.is_symlink() {
            self.make_parent(&e.path)?;
            let target = fs::read_link(&from).map_err(SessionError::io("read link", &from))?;
            std::os::unix::fs::symlink(&target, &to).map_err(SessionError::io("symlink", &to))?;
            self.stats.symlinks += 1;
        } else if ft.is_file() {
            self.make_parent(&e.path)?;
            self.stats.bytes += copy_file(&from, &to, meta.permissions().mode())?;
            self.stats.files += 1;
        } else if ft.is_dir() {
            // A tracked path that became a directory: its files are listed as untracked.
        } else {
            self.skip(&e.path, SkipReason::SpecialFile);
        }
        Ok(())
    }

    fn skip(&mut self, path: &Path, reason: SkipReason) {
        tracing::debug!(path = %path.display(), ?reason, "not copied");
        self.stats.skipped.push(Skipped {
            path: path.to_path_buf(),
            reason,
        });
    }

    fn src_parents_are_dirs(&mut self, rel: &Path) -> Result<bool, SessionError> {
        let mut prefix = PathBuf::new();
        let Some(parent) = rel.parent() else {
            return Ok(true);
        };
        for c in parent.components() {
            prefix.push(c);
            if self.src_dirs_ok.contains(&prefix) {
                continue;
            }
            let full = self.src.join(&prefix);
            match fs::symlink_metadata(&full) {
                Ok(m) if m.is_dir() => {
                    self.src_dirs_ok.insert(prefix.clone());
                }
                Ok(_) => return Ok(false),
                Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
                Err(e) => return Err(SessionError::io("stat", &full)(e)),
            }
        }
        Ok(true)
    }

    fn make_parent(&mut self, rel: &Path) -> Result<(), SessionError> {
        match rel.parent() {
            Some(p) if !p.as_os_str().is_empty() => self.make_dirs(p),
            _ => Ok(()),
        }
    }

    /// Creates `rel` and its parents under `dst` with the source directories' permissions.
    /// An existing component must be a real directory: nothing is created through a symlink.
    fn make_dirs(&mut self, rel: &Path) -> Result<(), SessionError> {
        let mut prefix = PathBuf::new();
        for c in rel.components() {
            prefix.push(c);
            if self.dst_dirs.contains(&prefix) {
                continue;
            }
            let to = self.dst.join(&prefix);
            match fs::symlink_metadata(&to) {
                Ok(m) if m.is_dir() => {}
                Ok(_) => {
                    return Err(SessionError::Io {
                        op: "create directory over existing file",
                        path: to,
                        source: io::Error::from(io::ErrorKind::AlreadyExists),
                    })
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    fs::create_dir(&to).map_err(SessionError::io("create directory", &to))?;
                    let from = self.src.join(&prefix);
                    // Keep the source's bits, but the owner must be able to use its copy.
                    let mode = fs::symlink_metadata(&from)
                        .map(|m| m.permissions().mode() & 0o777)
                        .unwrap_or(0o755)
                        | 0o700;
                    fs::set_permissions(&to, Permissions::from_mode(mode))
                        .map_err(SessionError::io("chmod", &to))?;
                }
                Err(e) => return Err(SessionError::io("stat", &to)(e)),
            }
            self.dst_dirs.insert(prefix.clone());
        }
        Ok(())
    }
}

/// Copies one regular file byte for byte with its permission bits (set-id bits dropped);
/// returns the bytes copied. The source is opened without following symlinks and without
/// blocking (a FIFO swapped in after the stat is refused, not waited on).
fn copy_file(from: &Path, to: &Path, mode: u32) -> Result<u64, SessionError> {
    let mut input = OpenOptions::new()
        .read(true)
        .custom_flags((OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK).bits())
        .open(from)
        .map_err(SessionError::io("open", from))?;
    let meta = input.metadata().map_err(SessionError::io("stat", from))?;
    if !meta.is_file() {
        return Err(SessionError::Io {
            op: "copy (changed while copying)",
            path: from.to_path_buf(),
            source: io::Error::from(io::ErrorKind::InvalidInput),
        });
    }
    let mode = mode & 0o777;
    let mut output = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode | 0o600)
        .open(to)
        .map_err(SessionError::io("create", to))?;
    let n = io::copy(&mut input, &mut output).map_err(SessionError::io("copy", from))?;
    // The umask may have masked bits at creation.
    output
        .set_permissions(Permissions::from_mode(mode | 0o600))
        .map_err(SessionError::io("chmod", to))?;
    Ok(n)
}
