//! Copying working-tree content from the source checkout into the session's workspace.
//!
//! Bytes are copied as they are on disk (no git filters, no checkout), symlinks are recreated
//! from their target text and never followed, and only regular files, symlinks and the
//! directories leading to them are created. Nothing is read through a symlinked directory:
//! git itself treats a path under a symlink as deleted, and following one could leave the
//! repository. Every source path is opened beneath the canonical working tree with
//! `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)` (mounts inside a working tree are
//! allowed), so a directory swapped for a symlink mid-copy is not followed either.
//!
//! When the session has an [`Owner`] and the process is root, the copy runs on a thread whose
//! filesystem uid/gid are the owner's ([`as_owner`]): the kernel checks the owner's permissions
//! when reading the source and makes the owner own everything created.

use std::collections::{HashMap, HashSet};
use std::fs::{self, OpenOptions, Permissions};
use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag, OpenHow, ResolveFlag};
use nix::sys::stat::{Mode, SFlag};
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
    /// The first [`MAX_SKIPPED_LISTED`] paths not copied.
    pub skipped: Vec<Skipped>,
    /// How many paths were not copied.
    pub skipped_total: u64,
}

/// Paths not copied that a copy lists (the rest are counted): a tree's owner decides how
/// many special files it has.
pub(crate) const MAX_SKIPPED_LISTED: usize = 1000;

/// Runs `f` with the filesystem identity of `owner` (its uid, its primary gid, no
/// supplementary group; see the module docs); `None` runs it directly. `owner` must already be an effective owner ([`crate::git::effective_owner`]).
///
/// As root it always runs on a thread of its own without `CAP_SYS_RESOURCE`: what it writes
/// (a copy of the project, a fork's files) never spends a session volume's reserve, which
/// ext4 opens to that capability and which host git's scratch work needs
/// ([`as_owner_in_reserve`]).
pub(crate) fn as_owner<T: Send>(
    owner: Option<Owner>,
    f: impl FnOnce() -> Result<T, SessionError> + Send,
) -> Result<T, SessionError> {
    if owner.is_none() && !nix::unistd::geteuid().is_root() {
        return f();
    }
    on_thread(|| {
        drop_sys_resource()?;
        if let Some(o) = owner {
            if nix::unistd::geteuid().is_root() {
                // The owner's primary gid and no supplementary group, as host git has: the
                // service's own groups (root's group 0 from a login shell, say) never open a
                // file to the owner. Per thread, like fsuid, and gone with the thread.
                crate::sys::set_thread_groups(&[])
                    .map_err(SessionError::io("set the groups of", "a copy thread"))?;
            }
            take_owner(o)?;
        }
        f()
    })
}

/// Drops `CAP_SYS_RESOURCE` from this thread's effective set (capabilities are per thread;
/// the thread ends with its work).
fn drop_sys_resource() -> Result<(), SessionError> {
    use rustix::thread::{capabilities, set_capabilities, CapabilitySet};
    let drop_it = || -> std::io::Result<()> {
        let mut sets = capabilities(None)?;
        if sets.effective.contains(CapabilitySet::SYS_RESOURCE) {
            sets.effective.remove(CapabilitySet::SYS_RESOURCE);
            set_capabilities(None, sets)?;
        }
        Ok(())
    };
    drop_it().map_err(SessionError::io(
        "drop CAP_SYS_RESOURCE of",
        "a copy thread",
    ))
}

/// Like [`as_owner`], always on a thread of its own, whose one supplementary group (when
/// the process is root) is a session volume's reserve ([`crate::volume::RESERVE_ID`]): what
/// host git's scratch directory is made with, so that it finds room on a volume the guest
/// filled. Supplementary groups are per thread too (the raw system call, not libc's
/// process-wide one) and die with it.
pub(crate) fn as_owner_in_reserve<T: Send>(
    owner: Option<Owner>,
    f: impl FnOnce() -> Result<T, SessionError> + Send,
) -> Result<T, SessionError> {
    on_thread(|| {
        if nix::unistd::geteuid().is_root() {
            crate::sys::set_thread_groups(&[crate::volume::RESERVE_ID])
                .map_err(SessionError::io("set the groups of", "the scratch thread"))?;
        }
        if let Some(o) = owner {
            take_owner(o)?;
        }
        f()
    })
}

fn on_thread<T: Send>(
    f: impl FnOnce() -> Result<T, SessionError> + Send,
) -> Result<T, SessionError> {
    std::thread::scope(|s| {
        s.spawn(f)
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    })
}

/// This thread's filesystem identity becomes `o`'s.
fn take_owner(o: Owner) -> Result<(), SessionError> {
    // fsuid/fsgid are per thread and die with it. Changing fsuid away from 0 also drops the
    // DAC-override capabilities from this thread's effective set.
    setfsgid(Gid::from_raw(o.gid));
    setfsuid(Uid::from_raw(o.uid));
    // Both calls return the previous value: asking again confirms the switch.
    if setfsgid(Gid::from_raw(o.gid)).as_raw() != o.gid
        || setfsuid(Uid::from_raw(o.uid)).as_raw() != o.uid
    {
        return Err(SessionError::OwnerNotPermitted { uid: o.uid });
    }
    Ok(())
}

/// How a tree is copied by [`copy_entries`] for a fork.
#[derive(Debug, Clone, Copy)]
pub(crate) struct TreeCopy {
    /// The copy fails past this instant.
    pub deadline: std::time::Instant,
}

/// Copies `entries` from `src` into `dst` (an existing directory). `tree`: a whole tree's
/// copy (a fork): directories listed are created even when empty, files keep their
/// modification times (so a git index over them stays valid) and their holes, files with
/// several links in the tree stay one file with several links (so a copy takes no more room
/// than the original), and the copy stops at the deadline.
pub(crate) fn copy_entries(
    src: &Path,
    dst: &Path,
    entries: &[Entry],
    tree: Option<TreeCopy>,
) -> Result<CopyStats, SessionError> {
    let src_fd = nix::fcntl::open(
        src,
        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC | OFlag::O_NOFOLLOW,
        Mode::empty(),
    )
    .map_err(SessionError::source("open", src))?;
    let mut copier = Copier {
        src,
        src_fd,
        dst,
        dst_dirs: HashSet::new(),
        stats: CopyStats::default(),
        tree,
        entries,
        links: HashMap::new(),
    };
    for (i, e) in entries.iter().enumerate() {
        if let Some(t) = tree {
            if std::time::Instant::now() > t.deadline {
                return Err(SessionError::TooLarge {
                    what: format!("copying {}", src.display()),
                    limit: "the fork's copy deadline".into(),
                });
            }
        }
        copier.entry(i, e)?;
    }
    Ok(copier.stats)
}

struct Copier<'a> {
    src: &'a Path,
    /// The working tree everything is opened beneath.
    src_fd: OwnedFd,
    dst: &'a Path,
    /// Destination directories (relative) created or checked.
    dst_dirs: HashSet<PathBuf>,
    stats: CopyStats,
    tree: Option<TreeCopy>,
    /// The entries copied (what `links` points into).
    entries: &'a [Entry],
    /// (device, inode) of files with several links already copied, and the entry of their
    /// copy (an index, not another copy of its path: the listing's size is bounded, and
    /// this map holds up to one key per entry).
    links: HashMap<(u64, u64), usize>,
}

impl Copier<'_> {
    fn entry(&mut self, index: usize, e: &Entry) -> Result<(), SessionError> {
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
        let parent = e.path.parent().unwrap_or(Path::new(""));
        let Some(dir) = self.src_dir(parent)? else {
            return Ok(());
        };
        let name = e
            .path
            .file_name()
            .expect("invariant: normal components only");
        let from = self.src.join(&e.path);
        let st = match nix::sys::stat::fstatat(&dir, name, AtFlags::AT_SYMLINK_NOFOLLOW) {
            Ok(st) => st,
            Err(Errno::ENOENT) => return Ok(()), // deleted
            Err(err) => return Err(SessionError::source("stat", &from)(err)),
        };
        let kind = SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT;
        if e.gitlink {
            if kind == SFlag::S_IFDIR {
                self.make_dirs(&e.path)?;
            }
            self.skip(&e.path, SkipReason::Submodule);
            return Ok(());
        }
        let to = self.dst.join(&e.path);
        if kind == SFlag::S_IFLNK {
            self.make_parent(&e.path)?;
            let target = nix::fcntl::readlinkat(&dir, name)
                .map_err(SessionError::source("read link", &from))?;
            std::os::unix::fs::symlink(&target, &to).map_err(SessionError::io("symlink", &to))?;
            self.stats.symlinks += 1;
        } else if kind == SFlag::S_IFREG {
            self.make_parent(&e.path)?;
            let key = (st.st_dev, st.st_ino);
            if self.tree.is_some() && st.st_nlink > 1 {
                if let Some(&first) = self.links.get(&key) {
                    let first = self.dst.join(&self.entries[first].path);
                    fs::hard_link(&first, &to).map_err(SessionError::io("link", &to))?;
                    self.stats.files += 1;
                    return Ok(());
                }
                self.links.insert(key, index);
            }
            let input =
                nix::fcntl::openat2(&dir, name, beneath(OFlag::O_RDONLY | OFlag::O_NONBLOCK))
                    .map_err(SessionError::source("open", &from))?;
            self.stats.bytes += copy_file(input, &from, &to, st.st_mode, self.tree.is_some())?;
            self.stats.files += 1;
        } else if kind == SFlag::S_IFDIR {
            // In a tree's copy, the directory itself; else a tracked path that became a
            // directory, whose files are listed as untracked.
            if self.tree.is_some() {
                self.make_dirs(&e.path)?;
            }
        } else {
            self.skip(&e.path, SkipReason::SpecialFile);
        }
        Ok(())
    }

    fn skip(&mut self, path: &Path, reason: SkipReason) {
        tracing::debug!(path = %path.display(), ?reason, "not copied");
        self.stats.skipped_total += 1;
        if self.stats.skipped.len() < MAX_SKIPPED_LISTED {
            self.stats.skipped.push(Skipped {
                path: path.to_path_buf(),
                reason,
            });
        }
    }

    /// The source directory `rel` (relative, possibly empty), reached without a symlink:
    /// `None` when it is missing, a symlink or no directory (git takes what is under it as
    /// deleted).
    fn src_dir(&self, rel: &Path) -> Result<Option<OwnedFd>, SessionError> {
        let rel = if rel.as_os_str().is_empty() {
            Path::new(".")
        } else {
            rel
        };
        match nix::fcntl::openat2(
            &self.src_fd,
            rel,
            beneath(OFlag::O_PATH | OFlag::O_DIRECTORY),
        ) {
            Ok(fd) => Ok(Some(fd)),
            Err(Errno::ENOENT | Errno::ENOTDIR | Errno::ELOOP) => Ok(None),
            Err(e) => Err(SessionError::source("open", self.src.join(rel))(e)),
        }
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
                    // Keep the source's bits, but the owner must be able to use its copy.
                    let mode = self
                        .src_dir(&prefix)?
                        .and_then(|fd| nix::sys::stat::fstat(&fd).ok())
                        .map(|st| st.st_mode & 0o777)
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

/// `openat2` resolution for the working tree: beneath it, no symlink anywhere on the way.
pub(crate) fn beneath(flags: OFlag) -> OpenHow {
    OpenHow::new()
        .flags(flags | OFlag::O_CLOEXEC | OFlag::O_NOFOLLOW)
        .resolve(ResolveFlag::RESOLVE_BENEATH | ResolveFlag::RESOLVE_NO_SYMLINKS)
}

/// Copies one regular file, opened by the caller: its data extents (holes stay holes) with
/// its permission bits (set-id bits dropped) and, with `tree`, its access and modification
/// times; returns the data bytes copied. A file swapped for anything but a regular file after the stat is refused (it
/// was opened without blocking, so a FIFO is not waited on).
fn copy_file(
    input: OwnedFd,
    from: &Path,
    to: &Path,
    mode: u32,
    tree: bool,
) -> Result<u64, SessionError> {
    let mut input = fs::File::from(input);
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
    // Only the data extents, always: a project's sparse file (a crafted one can claim a
    // terabyte and allocate nothing) must not become that many written zeros on the host.
    let n =
        copy_data(&mut input, &mut output, meta.len()).map_err(SessionError::io("copy", from))?;
    // The umask may have masked bits at creation.
    output
        .set_permissions(Permissions::from_mode(mode | 0o600))
        .map_err(SessionError::io("chmod", to))?;
    if tree {
        let mut t = fs::FileTimes::new();
        if let Ok(m) = meta.modified() {
            t = t.set_modified(m);
        }
        if let Ok(a) = meta.accessed() {
            t = t.set_accessed(a);
        }
        output
            .set_times(t)
            .map_err(SessionError::io("set times", to))?;
    }
    Ok(n)
}

/// Copies the data extents of `input` (of `len` bytes) to the same offsets of the empty
/// `output`, which ends up `len` bytes long: a sparse file stays sparse.
fn copy_data(input: &mut fs::File, output: &mut fs::File, len: u64) -> io::Result<u64> {
    use io::{Read, Seek, SeekFrom};
    let mut copied = 0u64;
    let mut pos: i64 = 0;
    let end = i64::try_from(len).map_err(|_| io::Error::other("file too large"))?;
    while pos < end {
        let data = match nix::unistd::lseek(&*input, pos, nix::unistd::Whence::SeekData) {
            Ok(off) => off,
            Err(Errno::ENXIO) => break,
            Err(e) => return Err(e.into()),
        };
        let hole = nix::unistd::lseek(&*input, data, nix::unistd::Whence::SeekHole)?.min(end);
        if hole <= data {
            break;
        }
        input.seek(SeekFrom::Start(data as u64))?;
        output.seek(SeekFrom::Start(data as u64))?;
        copied += io::copy(&mut (&mut *input).take((hole - data) as u64), output)?;
        pos = hole;
    }
    output.set_len(len)?;
    Ok(copied)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustix::thread::{capabilities, CapabilitySet};

    /// Work done as an owner (or as root for a root-owned session) has no `CAP_SYS_RESOURCE`,
    /// so it cannot spend a session volume's reserve; the caller's thread keeps what it had.
    /// (Where root lacks the capability altogether, as on some CI hosts, the first half holds
    /// trivially.)
    #[test]
    fn test_owner_work_cannot_spend_the_reserve() {
        let before = capabilities(None).expect("capget").effective;
        for owner in [None, Some(Owner { uid: 0, gid: 0 })] {
            let inside = as_owner(owner, || Ok(capabilities(None).expect("capget").effective))
                .expect("as owner");
            assert!(!inside.contains(CapabilitySet::SYS_RESOURCE), "{owner:?}");
        }
        let reserve =
            as_owner_in_reserve(None, || Ok(capabilities(None).expect("capget").effective))
                .expect("in reserve");
        assert_eq!(
            reserve, before,
            "the scratch thread's capabilities are the caller's"
        );
        assert_eq!(capabilities(None).expect("capget").effective, before);
    }

    /// Work done as an owner reads only what the owner can: a file readable through a group
    /// the service process holds (root's group 0 from a login shell) but the owner does not
    /// is refused. Control: the same read from a thread of the service.
    #[test]
    fn test_owner_work_never_uses_the_services_groups() {
        if !nix::unistd::geteuid().is_root() {
            panic!("this test needs root, as owners do");
        }
        let dir = tempfile::tempdir().expect("tempdir");
        fs::set_permissions(dir.path(), Permissions::from_mode(0o755)).expect("chmod");
        let secret = dir.path().join("group-only");
        fs::write(&secret, "for group 4343 only\n").expect("write");
        std::os::unix::fs::chown(&secret, Some(0), Some(4343)).expect("chown");
        fs::set_permissions(&secret, Permissions::from_mode(0o640)).expect("chmod");
        let owner = Owner {
            uid: 4242,
            gid: 4242,
        };
        // The service's thread holds group 4343 (set per thread: the test's other threads
        // keep theirs); a copy thread it starts inherits it.
        let as_owner = on_thread(|| {
            crate::sys::set_thread_groups(&[4343]).expect("setgroups");
            as_owner(Some(owner), || {
                Ok(fs::read_to_string(&secret).map_err(|e| e.kind()))
            })
        })
        .expect("as owner");
        assert_eq!(
            as_owner,
            Err(io::ErrorKind::PermissionDenied),
            "{as_owner:?}"
        );
        // Control: the owner's fsuid and fsgid with the service's groups (what a copy thread
        // had before) read it.
        let control = on_thread(|| {
            crate::sys::set_thread_groups(&[4343]).expect("setgroups");
            take_owner(owner)?;
            Ok(fs::read_to_string(&secret).map_err(|e| e.kind()))
        })
        .expect("control");
        assert!(control.is_ok(), "{control:?}");
    }
}
