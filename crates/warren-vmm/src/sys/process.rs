//! Confinement of VMM child processes.

use std::os::unix::process::CommandExt;

/// Makes `cmd` run in a network namespace of its own (only a down `lo`: a VMM escape reaches
/// no network; a VM's NIC arrives as a TAP descriptor opened in the VM's namespace) and an
/// IPC namespace of its own (no System V or POSIX IPC object of the host or of another VM), as
/// `run_as` (uid, gid) with exactly the supplementary `groups` (normally none; a VM restored
/// from a template gets the templates' group, which may read the template's files), and die with SIGKILL when the process
/// that spawned it (the supervisor) dies, so no VMM is ever orphaned.
///
/// As root the namespace is a plain `CLONE_NEWNET`; an unprivileged caller gets it inside a
/// user namespace that maps only its own uid and gid (so files the VMM creates keep their
/// owner). If the namespace cannot be made the spawn fails: a VMM never runs networked.
///
/// The supervisor must spawn from a thread that lives as long as it does (the parent-death
/// signal fires when the spawning *thread* exits): it runs a current-thread runtime.
pub fn confine(cmd: &mut std::process::Command, run_as: Option<(u32, u32)>, groups: &[u32]) {
    confine_in(cmd, run_as, groups, None)
}

/// [`confine`], and with a `view` the child also gets a mount namespace of its own whose
/// root holds only that view ([`crate::sys::view`]), built before the uid drop. A view
/// that cannot be prepared here is an error; one that cannot be built in the child fails
/// the spawn: a VMM never runs with the host's file system.
pub fn confine_viewed(
    cmd: &mut std::process::Command,
    run_as: Option<(u32, u32)>,
    groups: &[u32],
    view: &crate::sys::view::VmmView,
) -> std::io::Result<()> {
    let prepared = view.prepare()?;
    confine_in(cmd, run_as, groups, Some(prepared));
    Ok(())
}

fn confine_in(
    cmd: &mut std::process::Command,
    run_as: Option<(u32, u32)>,
    groups: &[u32],
    view: Option<crate::sys::view::Prepared>,
) {
    let groups: Vec<nix::unistd::Gid> = groups
        .iter()
        .map(|g| nix::unistd::Gid::from_raw(*g))
        .collect();
    let euid = nix::unistd::geteuid();
    let egid = nix::unistd::getegid();
    // Formatted before the fork: the child may not allocate.
    let maps = (!euid.is_root()).then(|| {
        (
            format!("{euid} {euid} 1\n").into_bytes(),
            format!("{egid} {egid} 1\n").into_bytes(),
        )
    });
    // SAFETY: the closure runs in the forked child before exec and only makes
    // async-signal-safe syscalls (unshare, open, write, close, mount, mkdir, symlink,
    // pivot_root, chdir, setgroups, setgid, setuid, prctl, getppid) on buffers allocated
    // before the fork. Credentials are changed here, after the namespaces and the view
    // (which need them), and the parent-death signal is set last because credential changes
    // clear it.
    unsafe {
        cmd.pre_exec(move || {
            use nix::sched::{unshare, CloneFlags};
            let mounts = if view.is_some() {
                CloneFlags::CLONE_NEWNS
            } else {
                CloneFlags::empty()
            };
            // An IPC namespace of its own: no System V segment, semaphore or message queue
            // of the host (nor POSIX queue) is listed or reachable, and two VMMs cannot meet
            // through one.
            let own = CloneFlags::CLONE_NEWNET | CloneFlags::CLONE_NEWIPC | mounts;
            match &maps {
                None => unshare(own)?,
                Some((uid_map, gid_map)) => {
                    unshare(CloneFlags::CLONE_NEWUSER | own)?;
                    write_proc(c"/proc/self/setgroups", b"deny")?;
                    write_proc(c"/proc/self/uid_map", uid_map)?;
                    write_proc(c"/proc/self/gid_map", gid_map)?;
                }
            }
            if let Some(view) = &view {
                view.enter()?;
            }
            if let Some((uid, gid)) = run_as {
                nix::unistd::setgroups(&groups)?;
                nix::unistd::setgid(nix::unistd::Gid::from_raw(gid))?;
                nix::unistd::setuid(nix::unistd::Uid::from_raw(uid))?;
            }
            nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL)
                .map_err(std::io::Error::from)?;
            // The parent may have died between fork and prctl.
            if nix::unistd::getppid().as_raw() == 1 {
                // No allocation in the forked child: an errno, not a message.
                return Err(std::io::Error::from_raw_os_error(nix::libc::ESRCH));
            }
            Ok(())
        });
    }
}

/// Writes `data` to a `/proc/self` file in one `write` (what the kernel requires of id maps).
/// Async-signal-safe: raw syscalls only.
/// Makes the child join each cgroup directory of `dirs` before it runs anything (before any
/// other `pre_exec` step registered after this one, so before the uid drop): a program that
/// forks at once (virtiofsd's sandbox) cannot leave a child outside its VM's limits. Writing
/// `0` to `cgroup.procs` moves the writing process, in v1 and v2 alike.
pub fn join_cgroups(cmd: &mut std::process::Command, dirs: &[std::path::PathBuf]) {
    use std::os::unix::ffi::OsStrExt;
    // Built before the fork: the child may not allocate.
    let files: Vec<std::ffi::CString> = dirs
        .iter()
        .filter_map(|d| std::ffi::CString::new(d.join("cgroup.procs").as_os_str().as_bytes()).ok())
        .collect();
    // SAFETY: the closure runs in the forked child before exec and only opens, writes and
    // closes files named by buffers allocated before the fork.
    unsafe {
        cmd.pre_exec(move || {
            for f in &files {
                write_proc(f, b"0")?;
            }
            Ok(())
        });
    }
}

fn write_proc(path: &std::ffi::CStr, data: &[u8]) -> std::io::Result<()> {
    // SAFETY: `path` is NUL-terminated; the descriptor is closed before returning.
    let fd = unsafe { nix::libc::open(path.as_ptr(), nix::libc::O_WRONLY | nix::libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `data` is a live buffer of `data.len()` bytes.
    let n = unsafe { nix::libc::write(fd, data.as_ptr().cast(), data.len()) };
    let err = std::io::Error::last_os_error();
    // SAFETY: `fd` is ours and open.
    unsafe { nix::libc::close(fd) };
    if n != data.len() as isize {
        return Err(err);
    }
    Ok(())
}

/// A detached copy of the mount tree at directory `held` (an `O_PATH` descriptor), for
/// [`mount_held_dir`]. Needs root (`CAP_SYS_ADMIN`).
pub fn clone_tree(held: std::os::fd::BorrowedFd<'_>) -> std::io::Result<std::os::fd::OwnedFd> {
    use rustix::mount::{open_tree, OpenTreeFlags};
    Ok(open_tree(
        held,
        c"",
        OpenTreeFlags::OPEN_TREE_CLONE
            | OpenTreeFlags::OPEN_TREE_CLOEXEC
            | OpenTreeFlags::AT_RECURSIVE
            | OpenTreeFlags::AT_EMPTY_PATH,
    )?)
}

/// Makes the child see `tree` (from [`clone_tree`], kept open by the caller until spawn
/// returns) at `mountpoint`, in a mount namespace of its own: the child is given the
/// mountpoint's path, never the original one, so a rename or symlink swap of the original
/// path after it was checked changes nothing. Registered after [`confine`] (the namespace
/// needs its privileges) and before any seccomp filter.
pub fn mount_held_dir(
    cmd: &mut std::process::Command,
    tree: std::os::fd::RawFd,
    mountpoint: &std::path::Path,
) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    // Formatted before the fork: the child may not allocate.
    let target = std::ffi::CString::new(mountpoint.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::other("NUL in a mount path"))?;
    // SAFETY: runs in the forked child before exec; unshare, mount and move_mount are
    // async-signal-safe raw syscalls on a descriptor the caller keeps open and a
    // NUL-terminated buffer made before the fork.
    unsafe {
        cmd.pre_exec(move || {
            use rustix::mount::{move_mount, MoveMountFlags};
            nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNS)?;
            nix::mount::mount(
                None::<&str>,
                "/",
                None::<&str>,
                nix::mount::MsFlags::MS_SLAVE | nix::mount::MsFlags::MS_REC,
                None::<&str>,
            )?;
            let tree = std::os::fd::BorrowedFd::borrow_raw(tree);
            move_mount(
                tree,
                c"",
                rustix::fs::CWD,
                target.as_c_str(),
                MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH,
            )?;
            Ok(())
        });
    }
    Ok(())
}

/// Makes the child take on `uid` and `gid`, with no supplementary group, and work in `dir`
/// (entered first, as root: its path may lead through directories only root can search).
/// Registered after every step that needs root ([`confine`], [`mount_held_dir`]) and before
/// any seccomp filter. What the program then does to the host's files the kernel checks as
/// that uid: its ACLs, its permissions, never root's. The parent-death signal, which a
/// credential change clears, is set again.
pub fn take_on(
    cmd: &mut std::process::Command,
    uid: u32,
    gid: u32,
    dir: &std::path::Path,
) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    // Formatted before the fork: the child may not allocate.
    let dir = std::ffi::CString::new(dir.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::other("NUL in a path"))?;
    // SAFETY: runs in the forked child before exec; chdir, setgroups, setresgid, setresuid,
    // prctl and getppid are async-signal-safe syscalls on a buffer made before the fork.
    unsafe {
        cmd.pre_exec(move || {
            use nix::unistd::{Gid, Uid};
            nix::unistd::chdir(dir.as_c_str())?;
            nix::unistd::setgroups(&[])?;
            let (g, u) = (Gid::from_raw(gid), Uid::from_raw(uid));
            nix::unistd::setresgid(g, g, g)?;
            nix::unistd::setresuid(u, u, u)?;
            nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL)
                .map_err(std::io::Error::from)?;
            if nix::unistd::getppid().as_raw() == 1 {
                // No allocation in the forked child: an errno, not a message.
                return Err(std::io::Error::from_raw_os_error(nix::libc::ESRCH));
            }
            Ok(())
        });
    }
    Ok(())
}

/// Gives the child the file mode creation mask `mask`.
pub fn set_umask(cmd: &mut std::process::Command, mask: u32) {
    // SAFETY: runs in the forked child before exec; umask is async-signal-safe.
    unsafe {
        cmd.pre_exec(move || {
            nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(mask));
            Ok(())
        });
    }
}

/// Has the child killed (SIGKILL) when the thread that spawned it exits. The spawner must not
/// be a thread that ends before the process it waits for.
pub fn die_with_parent(cmd: &mut std::process::Command) {
    let parent = nix::unistd::getpid();
    // SAFETY: runs in the forked child before exec; prctl and getppid are
    // async-signal-safe syscalls.
    unsafe {
        cmd.pre_exec(move || {
            nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL)
                .map_err(std::io::Error::from)?;
            // The parent may have died between fork and prctl.
            // No allocation in the forked child: an errno, not a message.
            if nix::unistd::getppid() != parent {
                return Err(std::io::Error::from_raw_os_error(nix::libc::ESRCH));
            }
            Ok(())
        });
    }
}

/// Marks every descriptor from `first` up close-on-exec (`close_range(CLOSE_RANGE_CLOEXEC)`),
/// so nothing but what a spawn passes on purpose reaches the program it runs.
/// Async-signal-safe (one raw syscall).
pub fn cloexec_from(first: u32) -> std::io::Result<()> {
    // SAFETY: close_range only changes descriptor flags of this process; no pointer is passed.
    let rc = unsafe {
        nix::libc::syscall(
            nix::libc::SYS_close_range,
            first,
            u32::MAX,
            nix::libc::CLOSE_RANGE_CLOEXEC,
        )
    };
    if rc < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// The descriptors systemd passed this process (socket activation), owned by the caller:
/// sd-notify reads `LISTEN_FDS`, checks that `LISTEN_PID` is this process, marks them
/// close-on-exec and unsets `LISTEN_PID`, `LISTEN_FDS` and `LISTEN_FDNAMES`. Empty when none
/// were passed. Call it before any thread starts (it changes the environment).
pub fn take_listen_fds() -> std::io::Result<Vec<std::os::fd::OwnedFd>> {
    use std::os::fd::FromRawFd;
    let fds = sd_notify::listen_fds_with_names(true)?;
    Ok(fds
        // SAFETY: systemd passed these descriptors to this process (sd-notify checked that
        // LISTEN_PID is ours and that each is open), nothing else in the process knows them,
        // and this is the only place that takes them: the variables are unset.
        .map(|(fd, _name)| unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
        .collect())
}

/// The fd number a passed listening socket gets in the child.
pub const PASSED_FD: i32 = 3;

/// Makes `fd` (a listening socket the caller keeps open until spawn returns) the child's fd
/// [`PASSED_FD`], without close-on-exec.
pub fn pass_fd(cmd: &mut std::process::Command, fd: std::os::fd::RawFd) {
    pass_fd_as(cmd, fd, PASSED_FD);
}

/// Makes each `(fd, target)`'s `fd` (kept open by the caller until spawn returns) the
/// child's fd `target`, without close-on-exec. Sources are first moved above every target, so
/// a source whose number is another's target is never overwritten.
pub fn pass_fds(cmd: &mut std::process::Command, fds: &[(std::os::fd::RawFd, i32)]) {
    let pairs: Vec<(i32, i32)> = fds.to_vec();
    let floor = pairs.iter().map(|&(_, t)| t).max().unwrap_or(2) + 1;
    let mut moved: Vec<i32> = vec![-1; pairs.len()];
    // SAFETY: runs in the forked child before exec; fcntl, dup2 and close are
    // async-signal-safe, touch only the child's descriptor table, and write into a buffer
    // sized before the fork.
    unsafe {
        cmd.pre_exec(move || {
            for (i, &(fd, _)) in pairs.iter().enumerate() {
                let m = nix::libc::fcntl(fd, nix::libc::F_DUPFD_CLOEXEC, floor);
                if m < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                moved[i] = m;
            }
            for (i, &(_, target)) in pairs.iter().enumerate() {
                if nix::libc::dup2(moved[i], target) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                nix::libc::close(moved[i]);
            }
            // Whatever the spawning process inherited stays behind.
            cloexec_from(floor as u32)
        });
    }
}

/// Makes `fd` (kept open by the caller until spawn returns) the child's fd `target`, without
/// close-on-exec.
pub fn pass_fd_as(cmd: &mut std::process::Command, fd: std::os::fd::RawFd, target: i32) {
    // SAFETY: runs in the forked child before exec; dup2 and fcntl are async-signal-safe and
    // only touch the child's descriptor table.
    unsafe {
        cmd.pre_exec(move || {
            let rc = if fd == target {
                nix::libc::fcntl(fd, nix::libc::F_SETFD, 0)
            } else {
                nix::libc::dup2(fd, target)
            };
            if rc < 0 {
                return Err(std::io::Error::last_os_error());
            }
            // Whatever the spawning process inherited stays behind.
            cloexec_from(target as u32 + 1)
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    /// A descriptor the spawner inherited without close-on-exec (as a careless parent leaves
    /// one) does not reach the child; control: without `pass_fds` it does.
    #[test]
    fn test_passing_fds_leaves_inherited_descriptors_behind() {
        let f = tempfile::tempfile().expect("file");
        // SAFETY: dup2 onto a free high number; the duplicate is closed below.
        let leaked = unsafe { nix::libc::dup2(f.as_raw_fd(), 77) };
        assert_eq!(leaked, 77, "dup2");
        let listed = |pass: bool| {
            let mut cmd = std::process::Command::new("ls");
            cmd.arg("/proc/self/fd");
            if pass {
                pass_fds(&mut cmd, &[(f.as_raw_fd(), 5)]);
            }
            let out = cmd.output().expect("ls");
            String::from_utf8_lossy(&out.stdout)
                .split_whitespace()
                .map(str::to_string)
                .collect::<Vec<_>>()
        };
        let plain = listed(false);
        assert!(plain.contains(&"77".to_string()), "control: {plain:?}");
        let passed = listed(true);
        assert!(passed.contains(&"5".to_string()), "{passed:?}");
        assert!(!passed.contains(&"77".to_string()), "leaked: {passed:?}");
        // SAFETY: closing the duplicate made above.
        unsafe { nix::libc::close(77) };
    }

    /// A confined program (a VMM, a virtiofsd) shares no System V IPC with the host: a
    /// segment anyone may attach (mode 0666, as desktop and database programs make them)
    /// is neither listed in `/proc/sysvipc/shm` (which names its creator's pid and uid) nor
    /// attachable by its id. Found by a hostile review: the confinement made network and
    /// mount namespaces only, so an escaped QEMU read other processes' and users' segments
    /// and could pass data to another VM's through one. Control: unconfined, the same uid
    /// sees and attaches it.
    #[test]
    fn test_confined_programs_share_no_ipc_with_the_host() {
        assert!(nix::unistd::geteuid().is_root(), "this test needs root");
        // SAFETY: shmget with IPC_PRIVATE makes a new segment; no pointer is passed.
        let id = unsafe {
            nix::libc::shmget(nix::libc::IPC_PRIVATE, 4096, nix::libc::IPC_CREAT | 0o666)
        };
        assert!(id >= 0, "shmget: {}", std::io::Error::last_os_error());
        let script = format!(
            "grep -qw -- {id} /proc/sysvipc/shm && echo LISTED\n\
             python3 -c 'import ctypes,sys; l=ctypes.CDLL(None); l.shmat.restype=ctypes.c_void_p; \
             sys.exit(0 if l.shmat({id}, None, 0) not in (None, 2**64-1) else 1)' && echo ATTACHED\n"
        );
        let run = |confined: bool| {
            let mut cmd = std::process::Command::new("sh");
            cmd.arg("-c").arg(&script);
            if confined {
                confine(&mut cmd, Some((2_999_999, 2_999_999)), &[]);
            } else {
                cmd.uid(2_999_999).gid(2_999_999);
            }
            let out = cmd.output().expect("sh");
            String::from_utf8_lossy(&out.stdout).into_owned()
                + &String::from_utf8_lossy(&out.stderr)
        };
        let confined = run(true);
        let plain = run(false);
        // SAFETY: removes the segment made above; no pointer is read.
        unsafe { nix::libc::shmctl(id, nix::libc::IPC_RMID, std::ptr::null_mut()) };
        assert!(
            plain.contains("LISTED") && plain.contains("ATTACHED"),
            "control: {plain}"
        );
        assert!(!confined.contains("LISTED"), "listed: {confined}");
        assert!(!confined.contains("ATTACHED"), "attached: {confined}");
    }
}
