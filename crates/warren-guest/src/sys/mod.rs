//! Every `unsafe` operation of the agent lives here, each with its safety argument:
//! the vfork-style job spawn ([`spawn`]), the `pre_exec` hook used by the fork+exec+wait
//! benchmark (the same setup for a forked child), and the `RNDADDENTROPY` ioctl. Everything else uses the safe `nix`/`rustix` APIs.
#![deny(unsafe_op_in_unsafe_fn)]

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::Command;

use rustix::process::{Gid, Uid};

pub mod spawn;

/// What the forked child does to itself between `fork` and `exec`, in this order.
pub struct ChildSetup {
    /// `setsid()`: the job gets its own session and process group.
    pub new_session: bool,
    /// An fd of the job cgroup's `cgroup.procs`, opened by the parent; the child writes "0"
    /// (itself) into it while it is still root.
    pub cgroup_procs: Option<OwnedFd>,
    /// Drop to this uid (and gid of the same number, no supplementary groups).
    pub user: Option<u32>,
    /// `fchdir` here (an `O_PATH` directory resolved beneath the workspace) after dropping
    /// privileges, so that the cwd check and the chdir see the same directory.
    pub cwd: Option<OwnedFd>,
}

/// Installs `setup` as the child's `pre_exec` hook. The fds are moved into the hook and closed
/// when `cmd` is dropped (they are `O_CLOEXEC`, so the program never sees them).
pub fn configure_child(cmd: &mut Command, setup: ChildSetup) {
    let hook = move || -> io::Result<()> {
        if setup.new_session {
            rustix::process::setsid()?;
        }
        if let Some(procs) = &setup.cgroup_procs {
            rustix::io::write(procs, b"0")?;
        }
        if let Some(id) = setup.user {
            // Per-thread calls are right here: the forked child has exactly one thread.
            rustix::thread::set_thread_groups(&[])?;
            rustix::thread::set_thread_res_gid(
                Gid::from_raw(id),
                Gid::from_raw(id),
                Gid::from_raw(id),
            )?;
            rustix::thread::set_thread_res_uid(
                Uid::from_raw(id),
                Uid::from_raw(id),
                Uid::from_raw(id),
            )?;
        }
        if let Some(dir) = &setup.cwd {
            rustix::process::fchdir(dir)?;
        }
        Ok(())
    };
    // SAFETY: the hook runs in the forked child, where only async-signal-safe work is allowed.
    // It only issues raw system calls through rustix's linux_raw backend (no allocation, no
    // locks, no libc state) on values moved into the closure before the fork, and converts
    // errors with `io::Error::from(Errno)`, which does not allocate.
    unsafe {
        cmd.pre_exec(hook);
    }
}

/// `RNDADDENTROPY` from `<linux/random.h>`: `_IOW('R', 0x03, int[2])`.
const RNDADDENTROPY: libc::c_ulong = 0x4008_5203;

/// `struct rand_pool_info` with a fixed 32-byte payload.
#[repr(C)]
struct RandPoolInfo {
    entropy_count: libc::c_int,
    buf_size: libc::c_int,
    buf: [u32; 8],
}

/// Mixes `bytes` into the kernel pool and credits them as entropy (needs CAP_SYS_ADMIN).
pub fn add_entropy(urandom: &File, bytes: &[u8; 32]) -> io::Result<()> {
    let mut buf = [0u32; 8];
    for (word, chunk) in buf.iter_mut().zip(bytes.chunks_exact(4)) {
        *word = u32::from_ne_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]);
    }
    let info = RandPoolInfo {
        entropy_count: 256,
        buf_size: 32,
        buf,
    };
    // SAFETY: RNDADDENTROPY reads a `struct rand_pool_info` (two ints, then `buf_size` bytes
    // of `__u32 buf[]`) from the pointer. `info` is `repr(C)` with exactly that layout and
    // `buf_size` equal to its payload, and it outlives the call; the fd is a valid open file.
    let rc = unsafe {
        libc::ioctl(
            urandom.as_raw_fd(),
            RNDADDENTROPY,
            &info as *const RandPoolInfo,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
