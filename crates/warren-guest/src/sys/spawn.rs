//! Job spawning with `clone(CLONE_VM | CLONE_VFORK)`, the way glibc's `posix_spawn` works.
//!
//! `fork` copies the agent's page tables and leaves its memory copy-on-write until the child
//! execs; under TCG that costs several milliseconds per job, on top of the faults the agent
//! then takes. A vfork-style child shares the agent's memory and runs on its own small stack
//! while the calling thread is suspended, until it calls `execve` or exits.
//!
//! Rules for the child, which shares memory (and the TLS pointer) with the suspended thread:
//! only raw system calls, no allocation, no locks, no libc state beyond `errno`. All signals
//! are blocked around the `clone` so no handler of the agent ever runs in the child; the child
//! resets handled signals (and Rust's ignored SIGPIPE) to their defaults, then restores the
//! caller's mask just before `execve`.

use std::ffi::{c_int, c_void, CStr, CString};
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::ptr;

use super::ChildSetup;

/// The child's stack: it only runs the setup below before `execve`.
const CHILD_STACK: usize = 64 * 1024;

/// What to run.
pub struct SpawnRequest<'a> {
    /// Path passed to `execve` (absolute, or relative to the job's working directory).
    pub program: &'a CStr,
    pub argv: &'a [CString],
    /// `NAME=VALUE` entries.
    pub envp: &'a [CString],
    pub stdin: BorrowedFd<'a>,
    pub stdout: BorrowedFd<'a>,
    pub stderr: BorrowedFd<'a>,
    pub setup: &'a ChildSetup,
}

/// Everything the child reads, prepared by the parent (the child must not allocate).
#[repr(C)]
struct ChildArgs {
    program: *const libc::c_char,
    argv: *const *const libc::c_char,
    envp: *const *const libc::c_char,
    fds: [c_int; 3],
    new_session: bool,
    controlling_terminal: bool,
    cgroup_procs: c_int,
    user: Option<u32>,
    cwd: c_int,
    /// Null, or the broker directory to bind-mount in a new mount namespace.
    broker_src: *const libc::c_char,
    mask: libc::sigset_t,
    /// Written by the child when a step fails (then it exits 127); read by the parent.
    errno: c_int,
}

/// Starts the job process and returns its pid. On error nothing runs (a child that failed
/// before `execve` has exited; the agent's reaper collects it).
pub fn spawn(req: &SpawnRequest<'_>) -> io::Result<i32> {
    let mut argv: Vec<*const libc::c_char> = req.argv.iter().map(|a| a.as_ptr()).collect();
    argv.push(ptr::null());
    let mut envp: Vec<*const libc::c_char> = req.envp.iter().map(|e| e.as_ptr()).collect();
    envp.push(ptr::null());
    let fd_or_none = |fd: &Option<std::os::fd::OwnedFd>| fd.as_ref().map_or(-1, |f| f.as_raw_fd());
    let mut args = ChildArgs {
        program: req.program.as_ptr(),
        argv: argv.as_ptr(),
        envp: envp.as_ptr(),
        fds: [
            req.stdin.as_raw_fd(),
            req.stdout.as_raw_fd(),
            req.stderr.as_raw_fd(),
        ],
        new_session: req.setup.new_session,
        controlling_terminal: req.setup.controlling_terminal,
        cgroup_procs: fd_or_none(&req.setup.cgroup_procs),
        user: req.setup.user,
        cwd: fd_or_none(&req.setup.cwd),
        broker_src: req
            .setup
            .broker_dir
            .as_ref()
            .map_or(ptr::null(), |d| d.as_ptr()),
        // SAFETY: sigset_t is plain data; all-zero is a valid (empty) set, overwritten below.
        mask: unsafe { std::mem::zeroed() },
        errno: 0,
    };
    let mut stack = vec![0u8; CHILD_STACK];
    // The stack grows down; keep the top 16-byte aligned as the ABI requires.
    let top = (stack.as_mut_ptr() as usize + CHILD_STACK) & !0xf;

    // SAFETY: sigset_t is plain data, initialised by sigfillset before use.
    let mut all: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: `all` and `args.mask` are valid sigset_t locations owned by this frame.
    unsafe {
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut args.mask);
    }
    // SAFETY: `child` only makes raw system calls (see the module rules) and reads `args`,
    // which outlives the call: with CLONE_VFORK this thread is suspended until the child has
    // exec'd or exited, so `args`, `argv`, `envp`, the strings they point to and `stack` are
    // all alive and unchanged while the child uses them. `top` is the aligned end of a
    // CHILD_STACK-byte allocation that is not otherwise used.
    let pid = unsafe {
        libc::clone(
            child,
            top as *mut c_void,
            libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD,
            (&mut args as *mut ChildArgs).cast::<c_void>(),
        )
    };
    let clone_err = io::Error::last_os_error();
    // SAFETY: restores the mask saved above; `args.mask` is a valid sigset_t.
    unsafe {
        libc::pthread_sigmask(libc::SIG_SETMASK, &args.mask, ptr::null_mut());
    }
    drop(stack);
    if pid < 0 {
        return Err(clone_err);
    }
    // SAFETY: the child has exec'd or exited (CLONE_VFORK), so nothing writes this any more;
    // the volatile read keeps the compiler from assuming the value it stored before clone.
    let child_errno = unsafe { ptr::read_volatile(&args.errno) };
    if child_errno != 0 {
        return Err(io::Error::from_raw_os_error(child_errno));
    }
    Ok(pid)
}

/// The child: set itself up, then `execve`. Raw system calls only.
extern "C" fn child(arg: *mut c_void) -> c_int {
    // SAFETY: `arg` is the `ChildArgs` the suspended parent passed to clone and keeps alive.
    let args = unsafe { &mut *arg.cast::<ChildArgs>() };
    // SAFETY: every call below is a system call on values prepared by the parent; none
    // allocates or takes a lock. `libc::syscall` only touches `errno`, which belongs to the
    // suspended parent thread and is meaningless to it after clone returns a pid.
    unsafe {
        reset_signals();
        let fail = |args: &mut ChildArgs| -> c_int {
            ptr::write_volatile(&mut args.errno, *libc::__errno_location());
            libc::syscall(libc::SYS_exit, 127);
            127
        };
        if super::restore_default_priority().is_err() {
            return fail(args);
        }
        if args.new_session && libc::syscall(libc::SYS_setsid) < 0 {
            return fail(args);
        }
        if args.cgroup_procs >= 0
            && libc::syscall(libc::SYS_write, args.cgroup_procs, b"0".as_ptr(), 1) < 0
        {
            return fail(args);
        }
        if !args.broker_src.is_null() {
            let none = ptr::null::<libc::c_char>();
            let no_data = ptr::null::<c_void>();
            if libc::syscall(libc::SYS_unshare, libc::CLONE_NEWNS) < 0
                || libc::syscall(
                    libc::SYS_mount,
                    none,
                    c"/".as_ptr(),
                    none,
                    (libc::MS_REC | libc::MS_SLAVE) as libc::c_ulong,
                    no_data,
                ) < 0
                || libc::syscall(
                    libc::SYS_mount,
                    args.broker_src,
                    super::BROKER_MOUNT_C.as_ptr(),
                    none,
                    libc::MS_BIND as libc::c_ulong,
                    no_data,
                ) < 0
            {
                return fail(args);
            }
        }
        if let Some(id) = args.user {
            let id = id as libc::c_long;
            if libc::syscall(libc::SYS_setgroups, 0, ptr::null::<libc::gid_t>()) < 0
                || libc::syscall(libc::SYS_setresgid, id, id, id) < 0
                || libc::syscall(libc::SYS_setresuid, id, id, id) < 0
            {
                return fail(args);
            }
        }
        if args.cwd >= 0 && libc::syscall(libc::SYS_fchdir, args.cwd) < 0 {
            return fail(args);
        }
        for (target, fd) in args.fds.iter().enumerate() {
            // dup2 onto 0/1/2 clears close-on-exec on the new descriptor.
            if libc::syscall(libc::SYS_dup2, *fd, target as c_int) < 0 {
                return fail(args);
            }
        }
        // Needs the new session (a session leader without a controlling terminal); the
        // terminal is the job's own, so stealing it (argument 1) is never needed.
        if args.controlling_terminal
            && libc::syscall(libc::SYS_ioctl, 0 as c_int, libc::TIOCSCTTY, 0 as c_int) < 0
        {
            return fail(args);
        }
        libc::syscall(
            libc::SYS_rt_sigprocmask,
            libc::SIG_SETMASK,
            &args.mask as *const libc::sigset_t,
            ptr::null_mut::<libc::sigset_t>(),
            8usize,
        );
        libc::syscall(libc::SYS_execve, args.program, args.argv, args.envp);
        fail(args)
    }
}

/// Resets every signal with a handler, and SIGPIPE (which Rust ignores), to the default.
///
/// # Safety
/// Only for the vfork child: the parent's signal handlers are not shared with it (no
/// CLONE_SIGHAND) and all signals are blocked, so changing dispositions here affects only the
/// child.
unsafe fn reset_signals() {
    for sig in 1..libc::SIGRTMAX() {
        if sig == libc::SIGKILL || sig == libc::SIGSTOP {
            continue;
        }
        // SAFETY: zeroed sigaction is a valid "query" buffer; sigaction only reads/writes the
        // two structs on this stack frame.
        unsafe {
            let mut old: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(sig, ptr::null(), &mut old) != 0 {
                continue;
            }
            let handled = old.sa_sigaction != libc::SIG_DFL && old.sa_sigaction != libc::SIG_IGN;
            if handled || (sig == libc::SIGPIPE && old.sa_sigaction == libc::SIG_IGN) {
                let mut dfl: libc::sigaction = std::mem::zeroed();
                dfl.sa_sigaction = libc::SIG_DFL;
                libc::sigaction(sig, &dfl, ptr::null_mut());
            }
        }
    }
}
