//! The host directory a `vm cp` reads from or writes into, resolved by Warren itself one
//! component at a time and refused the moment the walk enters a directory a VM can write.
//!
//! A guest writing a shared directory controls the names in it: a symlink it plants there,
//! or retargets while the copy starts, would lead a path-based copy wherever it chose (the
//! host's own files moved out to it, or written where cron reads). The kernel's own
//! resolution cannot say which directories it passed, and `openat2` can refuse symlinks
//! but not follow the user's own ones, so this walk is written here: every directory is
//! opened `O_NOFOLLOW` relative to the one before it, each symlink is read and its target
//! walked the same way (at most [`MAX_LINKS`]), and every directory reached is compared by
//! (device, inode) with the roots of the shares that VMs of the caller's state directory
//! can write. What comes back is a descriptor: nothing is resolved by path again.

use std::collections::VecDeque;
use std::ffi::{OsStr, OsString};
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};

use anyhow::{bail, Context, Result};
use rustix::fs::{AtFlags, FileType, Mode, OFlags};
use rustix::io::Errno;

use crate::cli::Cli;

/// Symlinks one walk follows (the kernel's own limit).
const MAX_LINKS: usize = 40;

/// A share a VM can write: its root's identity, its path and the VM.
struct Share {
    dev: u64,
    ino: u64,
    path: PathBuf,
    vm: String,
}

/// The directories VMs of the caller's state directory share read-write.
#[derive(Default)]
pub struct Shares(Vec<Share>);

impl Shares {
    /// The read-write shares of the VMs in the caller's state directory: none when that
    /// directory holds no database the caller can open (another user's service: its VMs'
    /// shares are not the caller's to read).
    pub fn of(cli: &Cli) -> Shares {
        let state = cli
            .state_dir
            .clone()
            .unwrap_or_else(crate::commands::default_state_dir);
        let db = state.join("warren.db");
        if !db.is_file() {
            return Shares::default();
        }
        let Ok(vms) = warren_core::store::Store::open(&db).and_then(|s| s.list()) else {
            return Shares::default();
        };
        let mut out = Vec::new();
        for vm in vms {
            for m in vm.mounts.into_iter().filter(|m| !m.read_only) {
                // The identity recorded at creation, and what the path names now.
                let now = rustix::fs::stat(&m.host)
                    .ok()
                    .map(|st| (st.st_dev, st.st_ino));
                for (dev, ino) in m.identity.into_iter().chain(now) {
                    out.push(Share {
                        dev,
                        ino,
                        path: m.host.clone(),
                        vm: vm.id.clone(),
                    });
                }
            }
        }
        Shares(out)
    }

    /// Refuses the directory `fd` (reached as `shown`) when it is a share's root.
    pub fn check(&self, fd: &OwnedFd, shown: &Path) -> Result<()> {
        let st = rustix::fs::fstat(fd).with_context(|| shown.display().to_string())?;
        if let Some(s) = self
            .0
            .iter()
            .find(|s| s.dev == st.st_dev && s.ino == st.st_ino)
        {
            bail!(
                "{} leads into {}, which VM {} can write: the guest could change it while \
                 the copy runs (and reaches it through the share already); copy within the \
                 VM (`warren vm exec`), or to or from a directory outside the share",
                shown.display(),
                s.path.display(),
                s.vm
            );
        }
        Ok(())
    }
}

/// Opens the directory `path` (missing directories made when `create`), refusing a walk
/// that enters a directory of `shares` (see the module docs).
pub fn open_dir(path: &Path, create: bool, shares: &Shares) -> Result<OwnedFd> {
    let abs = std::path::absolute(path).with_context(|| path.display().to_string())?;
    let open_at = |at: &OwnedFd, name: &OsStr| {
        rustix::fs::openat(
            at,
            name,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )
    };
    let root = || {
        rustix::fs::open(
            "/",
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
    };
    let mut cur = root()?;
    shares.check(&cur, path)?;
    let mut todo: VecDeque<OsString> = VecDeque::new();
    push_front(&mut todo, &abs);
    let mut links = 0;
    while let Some(name) = todo.pop_front() {
        if name.is_empty() {
            // A symlink's absolute target: from the root again.
            cur = root()?;
        } else if name == ".." {
            cur = open_at(&cur, &name).with_context(|| path.display().to_string())?;
        } else {
            match rustix::fs::statat(&cur, &name, AtFlags::SYMLINK_NOFOLLOW) {
                Ok(st) if FileType::from_raw_mode(st.st_mode) == FileType::Symlink => {
                    links += 1;
                    if links > MAX_LINKS {
                        bail!("{}: more than {MAX_LINKS} symlinks", path.display());
                    }
                    let target = rustix::fs::readlinkat(&cur, &name, Vec::new())
                        .with_context(|| path.display().to_string())?;
                    push_front(&mut todo, Path::new(OsStr::from_bytes(target.as_bytes())));
                    continue;
                }
                Ok(_) => {}
                Err(Errno::NOENT) if create => {
                    match rustix::fs::mkdirat(&cur, &name, Mode::from_raw_mode(0o777)) {
                        Ok(()) | Err(Errno::EXIST) => {}
                        Err(e) => {
                            return Err(e).with_context(|| path.display().to_string());
                        }
                    }
                }
                Err(e) => return Err(e).with_context(|| path.display().to_string()),
            }
            cur = open_at(&cur, &name).with_context(|| path.display().to_string())?;
        }
        shares.check(&cur, path)?;
    }
    Ok(cur)
}

/// Puts the components of `p` in front of `todo`, in order: an absolute `p` starts with an
/// empty name (back to the root); `.` is dropped.
fn push_front(todo: &mut VecDeque<OsString>, p: &Path) {
    let names: Vec<OsString> = p
        .components()
        .filter_map(|c| match c {
            Component::RootDir => Some(OsString::new()),
            Component::ParentDir => Some(OsString::from("..")),
            Component::Normal(n) => Some(n.to_owned()),
            Component::CurDir | Component::Prefix(_) => None,
        })
        .collect();
    for n in names.into_iter().rev() {
        todo.push_front(n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shares_of(dirs: &[&Path]) -> Shares {
        Shares(
            dirs.iter()
                .map(|d| {
                    let st = rustix::fs::stat(*d).expect("stat");
                    Share {
                        dev: st.st_dev,
                        ino: st.st_ino,
                        path: d.to_path_buf(),
                        vm: "vm-test".into(),
                    }
                })
                .collect(),
        )
    }

    /// A path through a symlink that lives in a share is refused, also when the symlink
    /// points outside it (the guest can retarget it between any look and the open), as are
    /// paths into the share itself. Control: the user's own symlinks outside shares are
    /// followed, and missing directories are made.
    #[test]
    fn test_a_walk_through_a_share_is_refused() {
        let t = tempfile::tempdir().expect("tmp");
        let share = t.path().join("share");
        let elsewhere = t.path().join("elsewhere");
        std::fs::create_dir_all(share.join("sub")).expect("share");
        std::fs::create_dir_all(&elsewhere).expect("elsewhere");
        std::os::unix::fs::symlink(&elsewhere, share.join("link")).expect("link");
        std::os::unix::fs::symlink(share.join("link"), t.path().join("hop")).expect("hop");
        std::os::unix::fs::symlink(&elsewhere, t.path().join("mine")).expect("mine");
        let shares = shares_of(&[&share]);
        for refused in [
            share.clone(),
            share.join("sub"),
            share.join("new"),
            t.path().join("hop"),
            t.path().join("hop/deeper"),
            elsewhere.join("../share/sub"),
        ] {
            let e = open_dir(&refused, true, &shares).expect_err(&refused.display().to_string());
            assert!(e.to_string().contains("which VM vm-test"), "{e}");
        }
        assert!(!share.join("new").exists());
        assert!(!elsewhere.join("deeper").exists());
        let fd = open_dir(&t.path().join("mine/made/here"), true, &shares).expect("mine");
        let st = rustix::fs::fstat(&fd).expect("fstat");
        let want = rustix::fs::stat(elsewhere.join("made/here")).expect("made");
        assert_eq!((st.st_dev, st.st_ino), (want.st_dev, want.st_ino));
        assert!(open_dir(&t.path().join("absent"), false, &shares).is_err());
    }
}
