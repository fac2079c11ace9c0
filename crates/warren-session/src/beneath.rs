//! Opening files beneath a directory without following a symlink or crossing a mount.
//!
//! Both sides of a session are read through these helpers: the guest-written git directory
//! (`scratch`) and the source repository (`source`). Every path is resolved by the kernel
//! with `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_XDEV)` relative to a
//! directory descriptor, with `O_NOFOLLOW` and, for files, `O_NONBLOCK` (a FIFO is refused,
//! never waited on); files must be regular files. A refusal is the [`Side`]'s error:
//! [`SessionError::UnsafeGitDir`] for the session, [`SessionError::UnsafeSource`] for the
//! source.

use std::fs;
use std::io::Read;
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use nix::fcntl::{OFlag, OpenHow, ResolveFlag};
use nix::sys::stat::{Mode, SFlag};

use crate::SessionError;

/// Whose directory is read, which decides the error a refusal is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Side {
    /// The session's git directory (the guest's).
    Session,
    /// The source repository.
    Source,
}

impl Side {
    pub(crate) fn refuse(self, path: &Path, reason: impl Into<String>) -> SessionError {
        let (path, reason) = (path.to_path_buf(), reason.into());
        match self {
            Side::Session => SessionError::UnsafeGitDir { path, reason },
            Side::Source => SessionError::UnsafeSource { path, reason },
        }
    }
}

/// What a directory entry is, by `d_type` (or `lstat` where the file system gives none).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Kind {
    Dir,
    Symlink,
    Other,
}

/// A directory, open as a descriptor, and the path it was opened at (for messages).
#[derive(Debug)]
pub(crate) struct Tree {
    fd: OwnedFd,
    path: PathBuf,
    side: Side,
}

pub(crate) fn how(flags: OFlag) -> OpenHow {
    OpenHow::new()
        .flags(flags | OFlag::O_CLOEXEC | OFlag::O_NOFOLLOW)
        .resolve(
            ResolveFlag::RESOLVE_BENEATH
                | ResolveFlag::RESOLVE_NO_SYMLINKS
                | ResolveFlag::RESOLVE_NO_XDEV,
        )
}

impl Tree {
    /// Opens the directory `path` itself; its last component must not be a symlink (callers
    /// pass canonical paths, so no earlier component is one either).
    pub(crate) fn open(path: &Path, side: Side) -> Result<Tree, SessionError> {
        let fd = nix::fcntl::open(
            path,
            OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC | OFlag::O_NOFOLLOW,
            Mode::empty(),
        )
        .map_err(|e| match e {
            nix::errno::Errno::ELOOP | nix::errno::Errno::ENOTDIR => {
                side.refuse(path, "is a symlink or not a directory")
            }
            e => SessionError::io("open", path)(e.into()),
        })?;
        Ok(Tree {
            fd,
            path: path.to_path_buf(),
            side,
        })
    }

    /// `name` (one component or a relative path) beneath `dir`, which must be a directory
    /// reached without a symlink: refused otherwise.
    pub(crate) fn open_at(
        dir: &OwnedFd,
        at: &Path,
        name: &Path,
        side: Side,
    ) -> Result<Tree, SessionError> {
        let fd = nix::fcntl::openat2(dir, name, how(OFlag::O_RDONLY | OFlag::O_DIRECTORY))
            .map_err(|e| side.refuse(&at.join(name), format!("is not a plain directory ({e})")))?;
        Ok(Tree {
            fd,
            path: at.join(name),
            side,
        })
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    pub(crate) fn fd(&self) -> &OwnedFd {
        &self.fd
    }

    /// The error for `rel` beneath this directory.
    pub(crate) fn refuse(&self, rel: impl AsRef<Path>, reason: impl Into<String>) -> SessionError {
        self.side.refuse(&self.path.join(rel), reason)
    }

    /// Opens the regular file `rel` for reading: `None` if it does not exist; refused if it
    /// is a symlink, leads out, crosses a mount or is not a regular file.
    pub(crate) fn file(&self, rel: impl AsRef<Path>) -> Result<Option<OwnedFd>, SessionError> {
        let rel = rel.as_ref();
        let fd = match nix::fcntl::openat2(&self.fd, rel, how(OFlag::O_RDONLY | OFlag::O_NONBLOCK))
        {
            Ok(fd) => fd,
            Err(nix::errno::Errno::ENOENT) => return Ok(None),
            Err(e) => return Err(self.refuse(rel, format!("cannot be opened safely ({e})"))),
        };
        let st = nix::sys::stat::fstat(&fd)
            .map_err(|e| SessionError::io("stat", self.path.join(rel))(e.into()))?;
        if SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT != SFlag::S_IFREG {
            return Err(self.refuse(rel, "not a regular file"));
        }
        Ok(Some(fd))
    }

    /// Reads `rel` (see [`Tree::file`]), refusing more than `cap` bytes.
    pub(crate) fn read(
        &self,
        rel: impl AsRef<Path>,
        cap: u64,
    ) -> Result<Option<Vec<u8>>, SessionError> {
        let rel = rel.as_ref();
        let Some(file) = self.file(rel)? else {
            return Ok(None);
        };
        let mut buf = Vec::new();
        fs::File::from(file)
            .take(cap + 1)
            .read_to_end(&mut buf)
            .map_err(SessionError::io("read", self.path.join(rel)))?;
        if buf.len() as u64 > cap {
            return Err(SessionError::TooLarge {
                what: self.path.join(rel).display().to_string(),
                limit: format!("{cap} bytes"),
            });
        }
        Ok(Some(buf))
    }

    /// The directory `rel` as a descriptor for listing: `None` if it does not exist;
    /// refused if it is a symlink, leads out or is not a directory.
    pub(crate) fn dir_fd(&self, rel: impl AsRef<Path>) -> Result<Option<OwnedFd>, SessionError> {
        let rel = rel.as_ref();
        match nix::fcntl::openat2(&self.fd, rel, how(OFlag::O_RDONLY | OFlag::O_DIRECTORY)) {
            Ok(fd) => Ok(Some(fd)),
            Err(nix::errno::Errno::ENOENT) => Ok(None),
            Err(e) => Err(self.refuse(rel, format!("is not a plain directory ({e})"))),
        }
    }

    /// The directory `rel` as a [`Tree`] of its own (see [`Tree::dir_fd`]).
    pub(crate) fn subtree(&self, rel: impl AsRef<Path>) -> Result<Option<Tree>, SessionError> {
        let rel = rel.as_ref();
        Ok(self.dir_fd(rel)?.map(|fd| Tree {
            fd,
            path: self.path.join(rel),
            side: self.side,
        }))
    }

    /// The names in this directory with their kinds, sorted.
    pub(crate) fn entries(&self) -> Result<Vec<(Vec<u8>, Kind)>, SessionError> {
        let fd = nix::fcntl::openat2(&self.fd, ".", how(OFlag::O_RDONLY | OFlag::O_DIRECTORY))
            .map_err(|e| SessionError::io("open", &self.path)(e.into()))?;
        entries(fd, &self.path)
    }
}

/// The names in a directory descriptor with their kinds (by `d_type`; `lstat` when the file
/// system reports none), sorted. Anything that is not a directory is opened as a file later
/// and checked there.
pub(crate) fn entries(dir: OwnedFd, at: &Path) -> Result<Vec<(Vec<u8>, Kind)>, SessionError> {
    entries_at_most(dir, at, MAX_DIR_ENTRIES)
}

/// Most names listed from one directory: a guest's `refs/heads` or `objects/pack` holding
/// millions of long names would otherwise be listed whole into memory before any budget of
/// the walk applies. No git directory comes near it (a repository of 64 million loose
/// objects has about 250,000 in each fan-out directory).
const MAX_DIR_ENTRIES: usize = 250_000;

fn entries_at_most(
    dir: OwnedFd,
    at: &Path,
    max: usize,
) -> Result<Vec<(Vec<u8>, Kind)>, SessionError> {
    // `Dir` owns its descriptor and lends none: a duplicate serves `fstatat`.
    let probe = dir.try_clone().map_err(SessionError::io("list", at))?;
    let mut d = nix::dir::Dir::from_fd(dir).map_err(|e| SessionError::io("list", at)(e.into()))?;
    let mut out = Vec::new();
    let mut unknown = Vec::new();
    for e in d.iter() {
        let e = e.map_err(|e| SessionError::io("list", at)(e.into()))?;
        let name = e.file_name().to_bytes();
        if name == b"." || name == b".." {
            continue;
        }
        if out.len() >= max {
            return Err(SessionError::TooLarge {
                what: format!("the directory {}", at.display()),
                limit: format!("{max} entries"),
            });
        }
        let kind = match e.file_type() {
            Some(nix::dir::Type::Directory) => Kind::Dir,
            Some(nix::dir::Type::Symlink) => Kind::Symlink,
            Some(_) => Kind::Other,
            None => {
                unknown.push(out.len());
                Kind::Other
            }
        };
        out.push((name.to_vec(), kind));
    }
    for i in unknown {
        let name = std::ffi::OsStr::from_bytes(&out[i].0).to_os_string();
        let st = nix::sys::stat::fstatat(
            &probe,
            name.as_os_str(),
            nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
        )
        .map_err(|e| SessionError::io("stat", at.join(&name))(e.into()))?;
        out[i].1 = match SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT {
            SFlag::S_IFDIR => Kind::Dir,
            SFlag::S_IFLNK => Kind::Symlink,
            _ => Kind::Other,
        };
    }
    out.sort();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A directory with more names than the cap is refused as too large while it is listed,
    /// not after a whole listing; at the cap it is listed.
    #[test]
    fn test_a_listing_stops_at_its_cap() {
        let root = tempfile::tempdir().expect("tmp");
        for i in 0..50 {
            std::fs::write(root.path().join(format!("f{i}")), "x").expect("file");
        }
        let open = || OwnedFd::from(std::fs::File::open(root.path()).expect("open dir"));
        let listed = entries_at_most(open(), root.path(), 50).expect("at the cap");
        assert_eq!(listed.len(), 50);
        match entries_at_most(open(), root.path(), 49) {
            Err(SessionError::TooLarge { limit, .. }) => assert_eq!(limit, "49 entries"),
            other => panic!("{other:?}"),
        }
    }
}
