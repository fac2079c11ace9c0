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
use crate::stream_link::Opener;

/// Symlinks one walk follows (the kernel's own limit).
const MAX_LINKS: usize = 40;

/// A share a VM can write: its root's identity, its path and the VM.
struct Share {
    dev: u64,
    ino: u64,
    path: PathBuf,
    vm: String,
}

/// The directories VMs can write.
#[derive(Default)]
pub struct Shares(Vec<Share>);

impl Shares {
    /// The host directories the VMs `opener` reaches can write: in process, every
    /// read-write share of the state directory's VMs; through a service, every VM's there
    /// as the service reports them (`GET /v1/host/shares`, identities only), and the shares
    /// of this state directory's VMs when its database is there to read. An error when they
    /// cannot be learned: a copy never goes ahead unchecked.
    pub async fn of(cli: &Cli, opener: &Opener) -> Result<Shares> {
        let mut out = Shares::default();
        match opener {
            Opener::Local(w) => {
                let vms = w
                    .list_vms()
                    .context("listing the VMs whose shares a copy must stay out of")?;
                out.add_vms(vms);
            }
            Opener::Http { .. } | Opener::Socket(_) => {
                // Every VM of the service, whatever its workspace (a direct session of
                // another workspace may write where the caller's path goes).
                let mut tools = opener.tools(None).await?;
                let listed = tools.get("/v1/host/shares").await.context(
                    "asking the service which host directories its VMs write (a copy is \
                     not made unchecked)",
                )?;
                let ids = listed["shares"]
                    .as_array()
                    .context("the service's answer about its shares holds no list")?;
                for id in ids {
                    let (Some(dev), Some(ino)) = (id["dev"].as_u64(), id["ino"].as_u64()) else {
                        bail!("the service's answer about its shares is malformed");
                    };
                    out.0.push(Share {
                        dev,
                        ino,
                        path: PathBuf::from("a directory"),
                        vm: "of the service".into(),
                    });
                }
                let state = cli
                    .state_dir
                    .clone()
                    .unwrap_or_else(crate::commands::default_state_dir);
                let db = state.join("warren.db");
                // Another user's (the service's own, 0600): its VMs are the service's,
                // asked above.
                if let Ok(store) = warren_core::store::Store::open_read_only(&db) {
                    if let Ok(vms) = store.list() {
                        out.add_vms(vms);
                    }
                }
            }
        }
        Ok(out)
    }

    fn add_vms(&mut self, vms: Vec<warren_core::store::VmRecord>) {
        for vm in vms {
            for m in vm.mounts.iter().filter(|m| !m.read_only) {
                self.add(&m.host, m.identity, &vm.id);
            }
        }
    }

    /// Adds the share at `path`: its recorded identity, and what the path names now when it
    /// is a directory itself (`lstat`: a symlink put in its place adds nothing).
    fn add(&mut self, path: &Path, recorded: Option<(u64, u64)>, vm: &str) {
        let now = rustix::fs::lstat(path)
            .ok()
            .filter(|st| FileType::from_raw_mode(st.st_mode) == FileType::Directory)
            .map(|st| (st.st_dev, st.st_ino));
        for (dev, ino) in recorded.into_iter().chain(now) {
            self.0.push(Share {
                dev,
                ino,
                path: path.to_path_buf(),
                vm: vm.to_string(),
            });
        }
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
                 VM (`warren vm exec`), or to or from a directory outside it",
                shown.display(),
                s.path.display(),
                s.vm
            );
        }
        Ok(())
    }
}

/// Opens the directory `path` (missing directories made when `create`, never as the
/// target of a symlink), refusing a walk that enters a directory of `shares` (see the
/// module docs). Directories are opened `O_PATH` (a directory the caller may only search
/// is passed as the kernel passes it); symlinks in a sticky world-writable directory are
/// followed only as the kernel's `protected_symlinks` allows (the caller's own, or the
/// directory owner's).
pub fn open_dir(path: &Path, create: bool, shares: &Shares) -> Result<OwnedFd> {
    let abs = std::path::absolute(path).with_context(|| path.display().to_string())?;
    let shown = || path.display().to_string();
    let open_at = |at: &OwnedFd, name: &OsStr| {
        rustix::fs::openat(
            at,
            name,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )
    };
    let root = || {
        rustix::fs::open(
            "/",
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
    };
    let me = rustix::process::geteuid().as_raw();
    let mut cur = root()?;
    shares.check(&cur, path)?;
    // Names still to walk, each with whether it came from a symlink's target.
    let mut todo: VecDeque<(OsString, bool)> = VecDeque::new();
    push_front(&mut todo, &abs, false);
    let mut links = 0;
    while let Some((name, from_link)) = todo.pop_front() {
        if name.is_empty() {
            // A symlink's absolute target: from the root again.
            cur = root()?;
        } else if name == ".." {
            cur = open_at(&cur, &name).with_context(shown)?;
        } else {
            match rustix::fs::statat(&cur, &name, AtFlags::SYMLINK_NOFOLLOW) {
                Ok(st) if FileType::from_raw_mode(st.st_mode) == FileType::Symlink => {
                    links += 1;
                    if links > MAX_LINKS {
                        bail!("{}: more than {MAX_LINKS} symlinks", path.display());
                    }
                    let dir = rustix::fs::fstat(&cur).with_context(shown)?;
                    let open_sticky = dir.st_mode & 0o1002 == 0o1002;
                    if open_sticky && st.st_uid != me && st.st_uid != dir.st_uid {
                        bail!(
                            "{}: passes through {:?}, a symlink uid {} owns in a sticky \
                             directory anyone can write (not followed, as the kernel's \
                             protected_symlinks)",
                            path.display(),
                            name,
                            st.st_uid
                        );
                    }
                    let target =
                        rustix::fs::readlinkat(&cur, &name, Vec::new()).with_context(shown)?;
                    let target = Path::new(OsStr::from_bytes(target.as_bytes()));
                    push_front(&mut todo, target, true);
                    continue;
                }
                Ok(_) => {}
                Err(Errno::NOENT) if create && !from_link => {
                    match rustix::fs::mkdirat(&cur, &name, Mode::from_raw_mode(0o777)) {
                        Ok(()) | Err(Errno::EXIST) => {}
                        Err(e) => return Err(e).with_context(shown),
                    }
                }
                Err(Errno::NOENT) if create => bail!(
                    "{}: a symlink on the way names {:?}, which does not exist (nothing is \
                     made where a symlink points)",
                    path.display(),
                    name
                ),
                Err(e) => return Err(e).with_context(shown),
            }
            cur = open_at(&cur, &name).with_context(shown)?;
        }
        shares.check(&cur, path)?;
    }
    Ok(cur)
}

/// Puts the components of `p` in front of `todo`, in order, marked `from_link`: an
/// absolute `p` starts with an empty name (back to the root); `.` is dropped.
fn push_front(todo: &mut VecDeque<(OsString, bool)>, p: &Path, from_link: bool) {
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
        todo.push_front((n, from_link));
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

    /// Nothing is made where a symlink points (`mkdir -p` refuses a dangling one too):
    /// another user's link in `/tmp` to a missing directory of the caller's made it.
    /// Control: missing directories below an existing link target are made.
    #[test]
    fn test_nothing_is_made_where_a_dangling_symlink_points() {
        let t = tempfile::tempdir().expect("tmp");
        let gone = t.path().join("victim/newdir");
        std::fs::create_dir_all(t.path().join("victim")).expect("victim");
        std::os::unix::fs::symlink(&gone, t.path().join("out")).expect("link");
        let e = open_dir(&t.path().join("out"), true, &Shares::default()).expect_err("dangling");
        assert!(e.to_string().contains("does not exist"), "{e}");
        assert!(!gone.exists());
        open_dir(&t.path().join("out/../made"), true, &Shares::default()).expect_err("still");
        std::fs::create_dir_all(&gone).expect("now there");
        open_dir(&t.path().join("out/below"), true, &Shares::default()).expect("below");
        assert!(gone.join("below").is_dir());
    }

    /// In a sticky directory anyone can write (`/tmp`), another user's symlink is not
    /// followed, as the kernel's `protected_symlinks` would not (the walk reads links
    /// itself, so the kernel's rule no longer applied). Control: the caller's own is.
    #[test]
    fn test_another_users_symlink_in_a_sticky_directory_is_not_followed() {
        use std::os::unix::fs::PermissionsExt;
        let t = tempfile::tempdir().expect("tmp");
        let tmp = t.path().join("tmp");
        std::fs::create_dir(&tmp).expect("tmp");
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o1777)).expect("chmod");
        let target = t.path().join("target");
        std::fs::create_dir(&target).expect("target");
        std::os::unix::fs::symlink(&target, tmp.join("theirs")).expect("theirs");
        std::os::unix::fs::symlink(&target, tmp.join("mine")).expect("mine");
        let other = 65534;
        rustix::fs::chownat(
            rustix::fs::CWD,
            tmp.join("theirs"),
            Some(rustix::fs::Uid::from_raw(other)),
            None,
            AtFlags::SYMLINK_NOFOLLOW,
        )
        .expect("chown (the tests run as root)");
        let e = open_dir(&tmp.join("theirs"), false, &Shares::default()).expect_err("theirs");
        assert!(e.to_string().contains("protected_symlinks"), "{e}");
        open_dir(&tmp.join("mine"), false, &Shares::default()).expect("mine");
    }
}
