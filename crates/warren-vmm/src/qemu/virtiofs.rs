//! virtio-fs shares: one sandboxed virtiofsd per shared directory, started before QEMU on a
//! listening socket Warren creates. Warren connects to it itself and removes its name before
//! either process runs, so the vhost-user connection reaches QEMU as a descriptor and no
//! socket of a share is left in any directory.

use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::Stdio;

use crate::backend::{LaunchSpec, Share, StderrPipe};
use crate::error::VmmError;

/// The guest user's uid and gid (the image recipe's `user`).
const GUEST_USER: u32 = 1000;

/// The vhost-user socket of share `tag` in `run_dir` (the raw-QEMU bench only; Warren's
/// backend passes connections, see [`spawn_all`]).
pub fn socket_path(run_dir: &Path, tag: &str) -> PathBuf {
    run_dir.join(format!("fs-{tag}.sock"))
}

/// Checks what the guest and virtiofsd rely on: short alphanumeric tags, unique, absolute
/// existing directories.
pub fn validate(shares: &[Share]) -> Result<(), VmmError> {
    let mut seen = std::collections::HashSet::new();
    for s in shares {
        let ok = !s.tag.is_empty()
            && s.tag.len() <= 16
            && s.tag
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit());
        if !ok {
            return Err(VmmError::BadShare(format!(
                "tag {:?} must be 1-16 characters [a-z0-9]",
                s.tag
            )));
        }
        if !seen.insert(&s.tag) {
            return Err(VmmError::BadShare(format!("tag {:?} used twice", s.tag)));
        }
        if !s.host_dir.is_absolute() || !s.host_dir.is_dir() {
            return Err(VmmError::BadShare(format!(
                "{} is not an existing absolute directory",
                s.host_dir.display()
            )));
        }
        if let Some(want) = s.identity {
            check_identity(&s.host_dir, want)?;
        }
    }
    Ok(())
}

/// Refuses `dir` unless it still is the directory identified as `want` (device, inode) and
/// its path has no symlink anywhere (it is its own canonical path).
pub fn check_identity(dir: &Path, want: (u64, u64)) -> Result<(), VmmError> {
    use std::os::unix::fs::MetadataExt;
    let changed = |why: &str| VmmError::ShareChanged {
        path: dir.to_path_buf(),
        why: why.to_string(),
    };
    let meta = std::fs::symlink_metadata(dir).map_err(|_| changed("it no longer exists"))?;
    if !meta.is_dir() {
        return Err(changed("it is no longer a directory"));
    }
    if std::fs::canonicalize(dir).ok().as_deref() != Some(dir) {
        return Err(changed("its path now goes through a symlink"));
    }
    if (meta.dev(), meta.ino()) != want {
        return Err(changed("another directory is at its path"));
    }
    Ok(())
}

/// Opens the share's directory from `/` without following any symlink on the way, and, when
/// the share was identified at creation, refuses it unless the descriptor is that directory.
/// Checking the descriptor (not the path) leaves no instant in which a swapped path is served.
pub fn open_checked(share: &Share) -> Result<std::os::fd::OwnedFd, VmmError> {
    use nix::fcntl::{OFlag, OpenHow, ResolveFlag};
    use std::os::unix::fs::MetadataExt;
    let changed = |why: &str| VmmError::ShareChanged {
        path: share.host_dir.clone(),
        why: why.to_string(),
    };
    let how = OpenHow::new()
        .flags(OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC)
        .resolve(ResolveFlag::RESOLVE_NO_SYMLINKS | ResolveFlag::RESOLVE_NO_MAGICLINKS);
    let fd =
        nix::fcntl::openat2(nix::fcntl::AT_FDCWD, &share.host_dir, how).map_err(|e| match e {
            nix::errno::Errno::ELOOP => changed("its path now goes through a symlink"),
            nix::errno::Errno::ENOTDIR => changed("it is no longer a directory"),
            nix::errno::Errno::ENOENT => changed("it no longer exists"),
            e => VmmError::io("open", &share.host_dir, e.into()),
        })?;
    if let Some(want) = share.identity {
        let meta = std::fs::File::from(
            fd.try_clone()
                .map_err(|e| VmmError::io("duplicate the descriptor of", &share.host_dir, e))?,
        )
        .metadata()
        .map_err(|e| VmmError::io("stat", &share.host_dir, e))?;
        if (meta.dev(), meta.ino()) != want {
            return Err(changed("another directory is at its path"));
        }
    }
    Ok(fd)
}

/// The (device, inode) of directory `dir`, not following a final symlink.
pub fn identity_of(dir: &Path) -> std::io::Result<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::symlink_metadata(dir)?;
    if !m.is_dir() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "not a directory",
        ));
    }
    Ok((m.dev(), m.ino()))
}

/// The uid and gid a share's virtiofsd runs as: its owner's, unless that is root (or Warren
/// is not root, and so cannot change users: its virtiofsd is already the user's). Running as
/// root, virtiofsd opens whatever the guest names with root's rights (ACLs, other users'
/// files below the directory, a directory swapped in after a check), which the guest's own
/// permission checks, all a guest root can skip, were the only bound on.
fn served_as(share: &Share) -> Option<(u32, u32)> {
    share
        .owner
        .filter(|&(uid, _)| uid != 0 && nix::unistd::geteuid().is_root())
}

/// Whether every user may execute `bin` by its path: every directory on the way searchable
/// and the file executable by others.
fn reachable_by_anyone(bin: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    let Ok(real) = std::fs::canonicalize(bin) else {
        return false;
    };
    real.ancestors()
        .all(|p| std::fs::metadata(p).is_ok_and(|m| m.permissions().mode() & 0o001 != 0))
}

/// `bin` opened for execution through `/proc/self/fd` (close-on-exec, numbered past every
/// descriptor a spawn passes on purpose).
fn program_fd(bin: &Path) -> Result<std::os::fd::OwnedFd, VmmError> {
    use nix::fcntl::OFlag;
    let f = nix::fcntl::open(
        bin,
        OFlag::O_PATH | OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::empty(),
    )
    .map_err(|e| VmmError::io("open", bin, e.into()))?;
    rustix::io::fcntl_dupfd_cloexec(&f, 16)
        .map_err(|e| VmmError::io("duplicate the descriptor of", bin, e.into()))
}

/// virtiofsd's arguments for `share`, listening on fd [`crate::sys::process::PASSED_FD`].
pub fn virtiofsd_args(share: &Share) -> Vec<String> {
    let mut a: Vec<String> = vec![
        format!("--fd={}", crate::sys::process::PASSED_FD),
        format!("--shared-dir={}", share.host_dir.display()),
        // Its own mount namespace with the shared directory as root, plus seccomp.
        "--sandbox=namespace".into(),
        // Names and attributes are trusted for 1 s of guest time, file pages are dropped at
        // each open; the guest agent revalidates what a suspension left cached.
        "--cache=auto".into(),
        // Restoring a hibernated VM after host-side deletions must not fail: the affected
        // files return errors in the guest instead (PLATFORM.md, QEMU 10).
        "--migration-on-error=guest-error".into(),
        "--log-level=error".into(),
        // The kernel clears set-ID bits on writes and refuses device nodes and file
        // capabilities; Warren's seccomp filters refuse setting them (`sys::share_seccomp`).
        "--modcaps=-mknod:-fsetid:-setfcap".into(),
    ];
    if share.read_only {
        a.push("--readonly".into());
    }
    if let Some((uid, gid)) = share.owner {
        for (flag, host) in [("--translate-uid", uid), ("--translate-gid", gid)] {
            // The guest user and the owner are the same person both ways; guest root acts as
            // the owner on the host; every other guest id is refused, so no file ever lands on
            // the host under some unrelated account.
            a.push(format!("{flag}=map:{GUEST_USER}:{host}:1"));
            a.push(format!("{flag}=squash-guest:0:{host}:1"));
            a.push(format!("{flag}=forbid-guest:1:{}", GUEST_USER - 1));
            a.push(format!(
                "{flag}=forbid-guest:{}:{}",
                GUEST_USER + 1,
                u32::MAX - GUEST_USER - 1
            ));
        }
    }
    a
}

/// A started virtiofsd per share, the vhost-user connection to each (in share order) for
/// the VMM, and each one's stderr for the caller to drain.
#[derive(Default)]
pub struct Started {
    pub children: Vec<tokio::process::Child>,
    pub conns: Vec<std::os::unix::net::UnixStream>,
    pub stderr: Vec<StderrPipe>,
}

/// Starts one virtiofsd per share. Each gets a listening socket created here as fd 3, with
/// the VMM's connection already queued on it, joins the VM's cgroup, and dies with the
/// supervisor.
pub fn spawn_all(spec: &LaunchSpec) -> Result<Started, VmmError> {
    if spec.shares.is_empty() {
        return Ok(Started::default());
    }
    validate(&spec.shares)?;
    let bin = spec.virtiofsd.as_ref().ok_or(VmmError::VirtiofsdMissing)?;
    let filters = crate::sys::share_seccomp::share_filters()?;
    let mut started = Started::default();
    // Named only for the instant it takes to connect, beside the VM's other endpoints (a
    // directory the VMM cannot write).
    let dir = spec.run_dir.parent().unwrap_or(&spec.run_dir);
    for share in &spec.shares {
        let (listener, conn) = connected_pair(&dir.join(format!("vmm-fs-{}.sock", share.tag)))?;
        started.conns.push(conn);
        let log = spec
            .stderr_log
            .with_file_name(format!("virtiofsd-{}.log", share.tag));
        // The checked directory, held: virtiofsd serves what this descriptor is, whatever
        // happens to the share's path from now on.
        let held = open_checked(share)?;
        let tree = crate::sys::process::clone_tree(held.as_fd()).map_err(|e| {
            VmmError::BadShare(format!(
                "cannot hold {} for virtiofsd (shares need Warren to run as root): {e}",
                share.host_dir.display()
            ))
        })?;
        let mountpoint = dir.join("shares").join(&share.tag);
        std::fs::create_dir_all(&mountpoint).map_err(|e| VmmError::io("create", &mountpoint, e))?;
        let owner = served_as(share);
        let mut served = share.clone();
        served.host_dir = match owner {
            // Entered before the uid drop: the path to it leads through root's directories.
            Some(_) => PathBuf::from("."),
            None => mountpoint.clone(),
        };
        let (stderr, stderr_write) = StderrPipe::new(log)?;
        // A virtiofsd that runs as the owner but lives where only root can reach it
        // (`/root/.cargo/bin`) is executed through a descriptor opened here.
        let program = match owner {
            Some(_) if !reachable_by_anyone(bin) => Some(program_fd(bin)?),
            _ => None,
        };
        let mut cmd = match &program {
            Some(fd) => {
                use std::os::unix::process::CommandExt;
                let mut c = std::process::Command::new(format!("/proc/self/fd/{}", fd.as_raw_fd()));
                c.arg0(bin);
                c
            }
            None => std::process::Command::new(bin),
        };
        cmd.args(virtiofsd_args(&served))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(stderr_write));
        if let Some(cg) = &spec.cgroup {
            // Joined in the child before exec: virtiofsd's sandbox forks at once, and that
            // child (the one serving the guest) must be inside the VM's limits too.
            crate::sys::process::join_cgroups(&mut cmd, &crate::sys::cgroup::member_dirs(cg));
        }
        // virtiofsd is not run as the VMM's uid. A share of a user's runs as that user (its
        // sandbox in a user namespace of its own, virtiofsd's unprivileged mode), so the
        // kernel checks every access the guest makes as the user; only root's shares have a
        // root virtiofsd.
        crate::sys::process::confine(&mut cmd, None, &[]);
        crate::sys::process::mount_held_dir(&mut cmd, tree.as_raw_fd(), &mountpoint)
            .map_err(|e| VmmError::io("prepare the mount of", &mountpoint, e))?;
        if let Some((uid, gid)) = owner {
            crate::sys::process::take_on(&mut cmd, uid, gid, &mountpoint)
                .map_err(|e| VmmError::io("prepare the owner of", &mountpoint, e))?;
        }
        // Files the guest creates in a share get the guest's modes under the usual 022, not
        // the supervisor's owner-only umask.
        crate::sys::process::set_umask(&mut cmd, 0o022);
        crate::sys::share_seccomp::install_in_child(&mut cmd, filters.clone());
        crate::sys::process::pass_fd(&mut cmd, listener.as_raw_fd());
        let mut cmd = tokio::process::Command::from(cmd);
        let child = cmd
            .kill_on_drop(false)
            .spawn()
            .map_err(|source| VmmError::Spawn {
                program: bin.display().to_string(),
                source,
            })?;
        // The command held the write end of the stderr pipe: virtiofsd's is the only one now.
        drop((listener, held, tree, cmd, program));
        if let (Some(cg), Some(pid)) = (&spec.cgroup, child.id()) {
            crate::sys::cgroup::add_pid(cg, pid)?;
        }
        started.children.push(child);
        started.stderr.push(stderr);
    }
    Ok(started)
}

/// A listening socket with one connection queued on it, and that connection; the name
/// `path` exists only while they are made.
fn connected_pair(path: &Path) -> Result<(UnixListener, std::os::unix::net::UnixStream), VmmError> {
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(VmmError::io("remove", path, e)),
    }
    let listener = UnixListener::bind(path).map_err(|e| VmmError::io("bind", path, e))?;
    let conn = std::os::unix::net::UnixStream::connect(path);
    let removed = std::fs::remove_file(path);
    let conn = conn.map_err(|e| VmmError::io("connect", path, e))?;
    removed.map_err(|e| VmmError::io("remove", path, e))?;
    Ok((listener, conn))
}

/// Finds virtiofsd: `$WARREN_VIRTIOFSD`, then `PATH`, then where `cargo install` and Debian's
/// package put it.
pub fn find_virtiofsd() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("WARREN_VIRTIOFSD") {
        return Some(PathBuf::from(p));
    }
    let mut candidates: Vec<PathBuf> = std::env::var_os("PATH")
        .map(|p| {
            std::env::split_paths(&p)
                .map(|d| d.join("virtiofsd"))
                .collect()
        })
        .unwrap_or_default();
    if let Some(home) = std::env::var_os("HOME") {
        candidates.push(PathBuf::from(home).join(".cargo/bin/virtiofsd"));
    }
    candidates.push(PathBuf::from("/root/.cargo/bin/virtiofsd"));
    candidates.push(PathBuf::from("/usr/local/bin/virtiofsd"));
    candidates.push(PathBuf::from("/usr/libexec/virtiofsd"));
    candidates.into_iter().find(|p| p.is_file())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_share_identity_refuses_replaced_or_redirected_directories() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let dir = tmp.path().canonicalize().expect("canonical").join("d");
        std::fs::create_dir(&dir).expect("mkdir");
        let id = identity_of(&dir).expect("identity");
        check_identity(&dir, id).expect("unchanged");
        let aside = dir.with_file_name("aside");
        std::fs::rename(&dir, &aside).expect("rename");
        assert!(check_identity(&dir, id).is_err(), "gone");
        std::os::unix::fs::symlink(&aside, &dir).expect("symlink");
        assert!(
            check_identity(&dir, id).is_err(),
            "a symlink to the same directory"
        );
        std::fs::remove_file(&dir).expect("rm");
        std::fs::create_dir(&dir).expect("mkdir");
        assert!(check_identity(&dir, id).is_err(), "another directory");
        std::fs::remove_dir(&dir).expect("rmdir");
        std::fs::rename(&aside, &dir).expect("put back");
        check_identity(&dir, id).expect("the same directory again");
    }

    /// The instant between the check and virtiofsd's own lookup: the directory is checked
    /// and held, then its path is swapped for a symlink to `/`; the child still sees the held
    /// directory at its mountpoint. Positive control: by name, the same child sees `/`.
    /// Needs root (a mount namespace), as every share test does.
    #[test]
    fn test_held_share_survives_a_swap_of_its_path_after_the_check() {
        assert!(nix::unistd::geteuid().is_root(), "this test needs root");
        let tmp = tempfile::tempdir().expect("tempdir");
        let base = tmp.path().canonicalize().expect("canonical");
        let dir = base.join("project");
        std::fs::create_dir(&dir).expect("mkdir");
        std::fs::write(dir.join("mine.txt"), "mine").expect("write");
        let mut sh = share("ws0");
        sh.host_dir = dir.clone();
        sh.identity = Some(identity_of(&dir).expect("identity"));
        let held = open_checked(&sh).expect("checked");
        std::fs::rename(&dir, base.join("aside")).expect("move aside");
        std::os::unix::fs::symlink("/", &dir).expect("swap in a symlink to /");
        assert!(open_checked(&sh).is_err(), "the swapped path is refused");
        let mountpoint = base.join("mnt");
        std::fs::create_dir(&mountpoint).expect("mountpoint");
        let list = |path: &Path, held: Option<&std::os::fd::OwnedFd>| {
            let mut cmd = std::process::Command::new("ls");
            cmd.arg(path);
            let tree = held.map(|h| crate::sys::process::clone_tree(h.as_fd()).expect("clone"));
            if let Some(t) = &tree {
                crate::sys::process::mount_held_dir(&mut cmd, t.as_raw_fd(), path).expect("mount");
            }
            let out = cmd.output().expect("ls");
            assert!(out.status.success(), "{out:?}");
            String::from_utf8_lossy(&out.stdout).into_owned()
        };
        let seen = list(&mountpoint, Some(&held));
        assert_eq!(seen.trim(), "mine.txt", "the held directory is served");
        let by_name = list(&dir.join(""), None);
        assert!(
            by_name.contains("etc"),
            "control: by name it is /: {by_name}"
        );
        assert_eq!(
            std::fs::read_dir(&mountpoint).expect("mnt").count(),
            0,
            "the bind exists only in the child's namespace"
        );
    }

    fn share(tag: &str) -> Share {
        Share {
            tag: tag.into(),
            host_dir: PathBuf::from("/tmp"),
            read_only: true,
            owner: Some((1234, 1235)),
            identity: None,
        }
    }

    #[test]
    fn test_virtiofsd_args_readonly_and_owner_mapping() {
        let a = virtiofsd_args(&share("ws0")).join(" ");
        assert!(a.contains("--readonly"));
        assert!(a.contains("--translate-uid=map:1000:1234:1"));
        assert!(a.contains("--translate-gid=map:1000:1235:1"));
        assert!(a.contains("--translate-uid=squash-guest:0:1234:1"));
        assert!(a.contains("--translate-uid=forbid-guest:1:999"));
        assert!(a.contains("--migration-on-error=guest-error"));
        assert!(a.contains("--sandbox=namespace"));
    }

    #[test]
    fn test_validate_rejects_bad_tags_and_duplicates() {
        assert!(validate(&[share("ws0"), share("src")]).is_ok());
        assert!(validate(&[share("WS")]).is_err());
        assert!(validate(&[share("")]).is_err());
        assert!(validate(&[share("a b")]).is_err());
        assert!(validate(&[share("ws0"), share("ws0")]).is_err());
        let mut rel = share("x");
        rel.host_dir = PathBuf::from("relative");
        assert!(validate(&[rel]).is_err());
    }
}
