//! Confinement of VMM child processes.

use std::os::unix::process::CommandExt;

/// Makes `cmd` run as `run_as` (uid, gid) with no supplementary groups, and die with SIGKILL
/// when the process that spawned it (the supervisor) dies, so no VMM is ever orphaned.
///
/// The supervisor must spawn from a thread that lives as long as it does (the parent-death
/// signal fires when the spawning *thread* exits): it runs a current-thread runtime.
pub fn confine(cmd: &mut std::process::Command, run_as: Option<(u32, u32)>) {
    if let Some((uid, gid)) = run_as {
        // std drops supplementary groups itself when a root parent sets a uid.
        cmd.uid(uid).gid(gid);
    }
    // SAFETY: the closure runs in the forked child before exec and only makes async-signal-safe
    // syscalls (prctl, getppid, kill); std applies uid/gid before it, and credential changes
    // clear the parent-death signal, so setting it here is what makes it stick.
    unsafe {
        cmd.pre_exec(|| {
            nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL)
                .map_err(std::io::Error::from)?;
            // The parent may have died between fork and prctl.
            if nix::unistd::getppid().as_raw() == 1 {
                return Err(std::io::Error::other("supervisor exited during spawn"));
            }
            Ok(())
        });
    }
}

/// The fd number a passed listening socket gets in the child.
pub const PASSED_FD: i32 = 3;

/// Makes `fd` (a listening socket the caller keeps open until spawn returns) the child's fd
/// [`PASSED_FD`], without close-on-exec.
pub fn pass_fd(cmd: &mut std::process::Command, fd: std::os::fd::RawFd) {
    pass_fd_as(cmd, fd, PASSED_FD);
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
            Ok(())
        });
    }
}
