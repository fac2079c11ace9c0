//! Working on a root tree that may hold hostile names: every path is resolved by the kernel
//! relative to the tree's directory descriptor with
//! `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_XDEV)` and `O_NOFOLLOW`, so
//! nothing reached through here can leave the tree or pass through a symlink (or a mount)
//! inside it, whoever made it.
//!
//! Used by the layer unpacker ([`crate::unpack`], also behind `vm cp`), by the finishing
//! steps of a root tree (the guest user, `/workspace`) and by recipe files copied in. The
//! `nix` crate wraps the system calls; this is the thin path-walking layer on top that no
//! crate provides in this shape (confinement plus creating missing directories, reading and
//! replacing small files, and removing subtrees, all descriptor-relative).

use std::ffi::OsStr;
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag, OpenHow, ResolveFlag};
use nix::sys::stat::Mode;
use nix::unistd::{Gid, Uid, UnlinkatFlags};

/// Longest path or link target handled.
pub const MAX_NAME: usize = 4096;
/// Deepest directory nesting handled (by removal).
const MAX_DEPTH: usize = 256;

/// A refused or failed operation, with the path it was about.
#[derive(Debug, thiserror::Error)]
#[error("{path}: {reason}")]
pub struct TreeError {
    pub path: String,
    pub reason: String,
}

pub(crate) fn err(path: &[u8], reason: impl std::fmt::Display) -> TreeError {
    TreeError {
        path: String::from_utf8_lossy(path).into_owned(),
        reason: reason.to_string(),
    }
}

pub(crate) fn c_name(b: &[u8]) -> &Path {
    Path::new(OsStr::from_bytes(b))
}

fn how(flags: OFlag) -> OpenHow {
    OpenHow::new()
        .flags(flags | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC)
        .resolve(
            ResolveFlag::RESOLVE_BENEATH
                | ResolveFlag::RESOLVE_NO_SYMLINKS
                | ResolveFlag::RESOLVE_NO_XDEV,
        )
}

/// The normal components of a relative name: `.` and empty components are skipped; an
/// absolute name or `..` is refused.
pub fn components(name: &[u8]) -> Result<Vec<&[u8]>, TreeError> {
    if name.len() > MAX_NAME {
        return Err(err(
            &name[..64],
            format!("name longer than {MAX_NAME} bytes"),
        ));
    }
    if name.first() == Some(&b'/') {
        return Err(err(name, "absolute name refused"));
    }
    let mut out = Vec::new();
    for c in name.split(|b| *b == b'/') {
        match c {
            b"" | b"." => {}
            b".." => return Err(err(name, "`..` refused: the name leaves the tree")),
            c if c.contains(&0) => return Err(err(name, "NUL in a name")),
            c => out.push(c),
        }
    }
    Ok(out)
}

/// What [`Tree::stat`] reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stat {
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
}

/// A root tree, open as a directory descriptor.
#[derive(Debug)]
pub struct Tree {
    fd: OwnedFd,
}

impl Tree {
    /// Opens the directory `root` (itself not a symlink).
    pub fn open(root: &Path) -> Result<Tree, TreeError> {
        let fd = nix::fcntl::open(
            root,
            OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC | OFlag::O_RDONLY,
            Mode::empty(),
        )
        .map_err(|e| err(root.as_os_str().as_bytes(), e))?;
        Ok(Tree { fd })
    }

    /// The tree of a directory already open (the caller opened it without following a
    /// symlink; every step below it is made relative to it).
    pub fn from_fd(fd: OwnedFd) -> Tree {
        Tree { fd }
    }

    /// Opens the directory at `comps` (the root for none).
    pub fn dir(&self, comps: &[&[u8]]) -> Result<OwnedFd, TreeError> {
        let rel = if comps.is_empty() {
            b".".to_vec()
        } else {
            comps.join(&b'/')
        };
        nix::fcntl::openat2(
            self.fd.as_fd(),
            c_name(&rel),
            how(OFlag::O_DIRECTORY | OFlag::O_RDONLY),
        )
        .map_err(|e| err(&rel, format!("not a directory of the tree ({e})")))
    }

    /// Opens the directory at `comps`, making missing ones (mode 0755, owned by the caller).
    pub fn dir_all(&self, comps: &[&[u8]]) -> Result<OwnedFd, TreeError> {
        let mut fd = self.dir(&[])?;
        for (i, c) in comps.iter().enumerate() {
            match nix::sys::stat::mkdirat(fd.as_fd(), c_name(c), Mode::from_bits_truncate(0o755)) {
                Ok(()) | Err(Errno::EEXIST) => {}
                Err(e) => return Err(err(&comps[..=i].join(&b'/'), format!("mkdir: {e}"))),
            }
            fd = nix::fcntl::openat2(
                fd.as_fd(),
                c_name(c),
                how(OFlag::O_DIRECTORY | OFlag::O_RDONLY),
            )
            .map_err(|e| {
                err(
                    &comps[..=i].join(&b'/'),
                    format!("not a directory of the tree ({e})"),
                )
            })?;
        }
        Ok(fd)
    }

    /// Reads the regular file at `rel` (at most `limit` bytes); `None` if it does not exist.
    pub fn read(&self, rel: &str, limit: u64) -> Result<Option<Vec<u8>>, TreeError> {
        let fd = match nix::fcntl::openat2(
            self.fd.as_fd(),
            Path::new(rel),
            how(OFlag::O_RDONLY | OFlag::O_NONBLOCK),
        ) {
            Ok(fd) => fd,
            Err(Errno::ENOENT) => return Ok(None),
            Err(e) => return Err(err(rel.as_bytes(), e)),
        };
        let f = File::from(fd);
        let meta = f.metadata().map_err(|e| err(rel.as_bytes(), e))?;
        if !meta.is_file() {
            return Err(err(rel.as_bytes(), "not a regular file"));
        }
        let mut out = Vec::new();
        f.take(limit + 1)
            .read_to_end(&mut out)
            .map_err(|e| err(rel.as_bytes(), e))?;
        if out.len() as u64 > limit {
            return Err(err(rel.as_bytes(), format!("larger than {limit} bytes")));
        }
        Ok(Some(out))
    }

    /// Replaces (or creates) the file at `rel` with `data`, `mode` and owner: written to a
    /// temp name in the same directory, then renamed over the old name (which, if it was a
    /// symlink, is replaced, never followed). Missing parents are made.
    pub fn write(
        &self,
        rel: &str,
        data: &[u8],
        mode: u32,
        owner: (u32, u32),
    ) -> Result<(), TreeError> {
        let comps = components(rel.as_bytes())?;
        let Some((last, parents)) = comps.split_last() else {
            return Err(err(rel.as_bytes(), "no file name"));
        };
        let parent = self.dir_all(parents)?;
        let tmp = format!(".warren-tmp-{}", std::process::id());
        let _ = nix::unistd::unlinkat(parent.as_fd(), tmp.as_str(), UnlinkatFlags::NoRemoveDir);
        let fd = nix::fcntl::openat(
            parent.as_fd(),
            tmp.as_str(),
            OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::from_bits_truncate(0o600),
        )
        .map_err(|e| err(rel.as_bytes(), e))?;
        let mut f = File::from(fd);
        let done = f
            .write_all(data)
            .map_err(|e| err(rel.as_bytes(), e))
            .and_then(|()| {
                nix::unistd::fchown(
                    f.as_fd(),
                    Some(Uid::from_raw(owner.0)),
                    Some(Gid::from_raw(owner.1)),
                )
                .map_err(|e| err(rel.as_bytes(), format!("chown: {e}")))
            })
            .and_then(|()| {
                nix::sys::stat::fchmod(f.as_fd(), Mode::from_bits_truncate(mode & 0o7777))
                    .map_err(|e| err(rel.as_bytes(), format!("chmod: {e}")))
            })
            .and_then(|()| {
                nix::fcntl::renameat(parent.as_fd(), tmp.as_str(), parent.as_fd(), c_name(last))
                    .map_err(|e| err(rel.as_bytes(), format!("rename: {e}")))
            });
        if done.is_err() {
            let _ = nix::unistd::unlinkat(parent.as_fd(), tmp.as_str(), UnlinkatFlags::NoRemoveDir);
        }
        done
    }

    /// Makes the directory `rel` (and missing parents) and sets its mode and owner.
    pub fn mkdir(&self, rel: &str, mode: u32, owner: (u32, u32)) -> Result<(), TreeError> {
        let comps = components(rel.as_bytes())?;
        let fd = self.dir_all(&comps)?;
        nix::unistd::fchown(
            fd.as_fd(),
            Some(Uid::from_raw(owner.0)),
            Some(Gid::from_raw(owner.1)),
        )
        .map_err(|e| err(rel.as_bytes(), format!("chown: {e}")))?;
        nix::sys::stat::fchmod(fd.as_fd(), Mode::from_bits_truncate(mode & 0o7777))
            .map_err(|e| err(rel.as_bytes(), format!("chmod: {e}")))
    }

    /// Makes the symlink `rel` -> `target` (replacing a non-directory at `rel`).
    pub fn symlink(&self, rel: &str, target: &str) -> Result<(), TreeError> {
        let comps = components(rel.as_bytes())?;
        let Some((last, parents)) = comps.split_last() else {
            return Err(err(rel.as_bytes(), "no file name"));
        };
        let parent = self.dir_all(parents)?;
        remove_entry(&parent, last, rel.as_bytes(), false)?;
        nix::unistd::symlinkat(Path::new(target), parent.as_fd(), c_name(last))
            .map_err(|e| err(rel.as_bytes(), format!("symlink: {e}")))
    }

    /// Whether something (of any kind) exists at `rel`, without following a final symlink.
    pub fn exists(&self, rel: &str) -> Result<bool, TreeError> {
        let comps = components(rel.as_bytes())?;
        let Some((last, parents)) = comps.split_last() else {
            return Ok(true);
        };
        let parent = match self.dir(parents) {
            Ok(p) => p,
            Err(_) => return Ok(false),
        };
        match nix::sys::stat::fstatat(parent.as_fd(), c_name(last), AtFlags::AT_SYMLINK_NOFOLLOW) {
            Ok(_) => Ok(true),
            Err(Errno::ENOENT) => Ok(false),
            Err(e) => Err(err(rel.as_bytes(), e)),
        }
    }

    /// Mode (with the file type bits), owner and group of `rel`, not following a final
    /// symlink; `None` if nothing is there.
    pub fn stat(&self, rel: &str) -> Result<Option<Stat>, TreeError> {
        let comps = components(rel.as_bytes())?;
        let Some((last, parents)) = comps.split_last() else {
            return Err(err(rel.as_bytes(), "no file name"));
        };
        let parent = match self.dir(parents) {
            Ok(p) => p,
            Err(_) => return Ok(None),
        };
        match nix::sys::stat::fstatat(parent.as_fd(), c_name(last), AtFlags::AT_SYMLINK_NOFOLLOW) {
            Ok(st) => Ok(Some(Stat {
                mode: st.st_mode,
                uid: st.st_uid,
                gid: st.st_gid,
            })),
            Err(Errno::ENOENT) => Ok(None),
            Err(e) => Err(err(rel.as_bytes(), e)),
        }
    }

    /// Directory entries of `rel` (names only, `.` and `..` left out).
    pub fn list(&self, rel: &str) -> Result<Vec<Vec<u8>>, TreeError> {
        let comps = components(rel.as_bytes())?;
        let fd = self.dir(&comps)?;
        list_fd(fd, rel.as_bytes())
    }
}

pub(crate) fn list_fd(fd: OwnedFd, shown: &[u8]) -> Result<Vec<Vec<u8>>, TreeError> {
    let dir = nix::dir::Dir::from_fd(fd).map_err(|e| err(shown, e))?;
    let mut out = Vec::new();
    for e in dir {
        let e = e.map_err(|e| err(shown, e))?;
        let n = e.file_name().to_bytes();
        if n != b"." && n != b".." {
            out.push(n.to_vec());
        }
    }
    Ok(out)
}

/// Removes `name` in `parent`: a non-directory, or with `recursive` a directory and all it
/// holds (never following a symlink). Nothing there is fine.
pub(crate) fn remove_entry(
    parent: &OwnedFd,
    name: &[u8],
    shown: &[u8],
    recursive: bool,
) -> Result<(), TreeError> {
    remove_at(parent, name, shown, recursive, 0)
}

fn remove_at(
    parent: &OwnedFd,
    name: &[u8],
    shown: &[u8],
    recursive: bool,
    depth: usize,
) -> Result<(), TreeError> {
    match nix::unistd::unlinkat(parent.as_fd(), c_name(name), UnlinkatFlags::NoRemoveDir) {
        Ok(()) | Err(Errno::ENOENT) => return Ok(()),
        Err(Errno::EISDIR | Errno::EPERM) if recursive => {}
        Err(Errno::EISDIR) => return Err(err(shown, "a directory is in the way")),
        Err(e) => return Err(err(shown, format!("remove: {e}"))),
    }
    if depth > MAX_DEPTH {
        return Err(err(shown, format!("nested deeper than {MAX_DEPTH}")));
    }
    let fd = nix::fcntl::openat2(
        parent.as_fd(),
        c_name(name),
        how(OFlag::O_DIRECTORY | OFlag::O_RDONLY),
    )
    .map_err(|e| err(shown, format!("not a directory of the tree ({e})")))?;
    let dup = fd.try_clone().map_err(|e| err(shown, e))?;
    for child in list_fd(dup, shown)? {
        remove_at(&fd, &child, shown, true, depth + 1)?;
    }
    match nix::unistd::unlinkat(parent.as_fd(), c_name(name), UnlinkatFlags::RemoveDir) {
        Ok(()) | Err(Errno::ENOENT) => Ok(()),
        Err(e) => Err(err(shown, format!("remove directory: {e}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_tree_write_never_follows_symlinks() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path().join("root");
        let outside = dir.path().join("outside");
        std::fs::create_dir_all(root.join("etc")).expect("mkdir");
        std::fs::write(&outside, "host").expect("write");
        std::os::unix::fs::symlink(&outside, root.join("etc/passwd")).expect("link");
        std::os::unix::fs::symlink(dir.path(), root.join("home")).expect("link");
        let t = Tree::open(&root).expect("open");
        // Reading through the symlink is refused; replacing it replaces the link.
        assert!(t.read("etc/passwd", 100).is_err());
        t.write("etc/passwd", b"x", 0o644, (0, 0)).expect("write");
        assert_eq!(std::fs::read(&outside).expect("read"), b"host");
        assert_eq!(std::fs::read(root.join("etc/passwd")).expect("read"), b"x");
        // A directory reached through a symlink is refused.
        assert!(t.mkdir("home/user", 0o755, (0, 0)).is_err());
        assert!(!dir.path().join("user").exists());
        assert!(components(b"../x").is_err() && components(b"/x").is_err());
    }

    #[test]
    fn test_tree_remove_entry_recursive_stays_inside() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path().join("root");
        std::fs::create_dir_all(root.join("a/b")).expect("mkdir");
        std::fs::write(dir.path().join("keep"), "k").expect("write");
        std::os::unix::fs::symlink(dir.path(), root.join("a/b/up")).expect("link");
        std::fs::write(root.join("a/b/f"), "f").expect("write");
        let t = Tree::open(&root).expect("open");
        let top = t.dir(&[]).expect("root");
        remove_entry(&top, b"a", b"a", true).expect("remove");
        assert!(!root.join("a").exists());
        assert!(dir.path().join("keep").exists());
    }
}
