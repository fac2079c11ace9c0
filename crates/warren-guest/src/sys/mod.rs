//! Every `unsafe` operation of the agent lives here, each with its safety argument:
//! the vfork-style job spawn ([`spawn`]), the `RNDADDENTROPY` and `RNDRESEEDCRNG` ioctls,
//! the registration of a descriptor with tokio ([`register_fd`]), reads into a tokio
//! buffer's uninitialised part ([`read_into`]) and the read-only mount clone of
//! [`readonly_clone`]. Everything else uses the safe `nix`/`rustix` APIs.
#![deny(unsafe_op_in_unsafe_fn)]

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};

pub mod net;
pub mod spawn;

/// What the spawned child does to itself before `exec`, in this order.
pub struct ChildSetup {
    /// `setsid()`: the job gets its own session and process group.
    pub new_session: bool,
    /// After the new session and the `dup2`s: make stdin (a terminal) the session's
    /// controlling terminal (`TIOCSCTTY`), so the job's foreground process group gets the
    /// terminal's signals (Ctrl-C, SIGWINCH, hangup).
    pub controlling_terminal: bool,
    /// An fd of the job cgroup's `cgroup.procs`, opened by the parent; the child writes "0"
    /// (itself) into it while it is still root.
    pub cgroup_procs: Option<OwnedFd>,
    /// Drop to this uid (and gid of the same number, no supplementary groups).
    pub user: Option<u32>,
    /// `fchdir` here (an `O_PATH` directory resolved beneath the workspace) after dropping
    /// privileges, so that the cwd check and the chdir see the same directory.
    pub cwd: Option<OwnedFd>,
    /// While still root: a mount namespace of the job's own (propagation slave) with this
    /// directory bind-mounted at [`BROKER_MOUNT_C`] (the job's broker pipe).
    pub broker_dir: Option<std::ffi::CString>,
}

/// Most pieces one [`read_into`] asks for.
const MAX_PIECES: usize = 64;

/// One `readv(2)` from `fd` into the unfilled part of `out`, without zeroing it first (the
/// channel reads the port straight into HTTP/2's buffer), cut into pieces of `piece` bytes
/// (at most [`MAX_PIECES`]); what was read becomes filled. A virtio-serial port answers a
/// `read()` with at most one of its buffers (a page), and the kernel serves a `readv` of a
/// device without vectored reads as one such read per piece until one comes back short: a
/// page-sized `piece` gathers every full buffer in one system call instead of one each.
pub fn read_into(
    fd: std::os::fd::BorrowedFd<'_>,
    out: &mut tokio::io::ReadBuf<'_>,
    piece: usize,
) -> io::Result<usize> {
    // SAFETY: the slice is only handed to `readv(2)` below, which writes at most its length
    // and never de-initialises bytes.
    let unfilled = unsafe { out.unfilled_mut() };
    let piece = piece.max(1);
    let mut iov = [libc::iovec {
        iov_base: std::ptr::null_mut(),
        iov_len: 0,
    }; MAX_PIECES];
    let mut count = 0;
    for (slot, chunk) in iov.iter_mut().zip(unfilled.chunks_mut(piece)) {
        slot.iov_base = chunk.as_mut_ptr().cast();
        slot.iov_len = chunk.len();
        count += 1;
    }
    // SAFETY: the first `count` entries of `iov` describe disjoint parts of `unfilled`, which
    // outlives the call and is borrowed mutably for it; `count` <= MAX_PIECES fits an int.
    let n = unsafe { libc::readv(fd.as_raw_fd(), iov.as_ptr(), count as libc::c_int) };
    let n = usize::try_from(n).map_err(|_| io::Error::last_os_error())?;
    // SAFETY: `readv(2)` filled its pieces in order, so it initialised exactly the first `n`
    // bytes of the unfilled part.
    unsafe { out.assume_init(n) };
    out.advance(n);
    Ok(n)
}

/// The agent's scheduling priority (nice value). The agent is the VM's control plane: with
/// the guest's jobs keeping its vCPU busy (a build, a stream's writer) it must still answer
/// the host promptly, and under TCG one vCPU is all there is. At -10 the agent outweighs a
/// job about nine to one. Jobs (and their terminals) start at the default 0
/// ([`restore_default_priority`], in [`spawn`]); the helpers the agent runs for the host
/// outside job accounting (`vm cp`'s `tar`) keep its priority, being its data path (at 0
/// the copy lost a quarter of its rate to the agent feeding it); the deferred module loads
/// run at 19. A guest user could take over such a helper (same uid, `ptrace`) to run at -10
/// during a copy: that only competes with its own VM's agent, as guest root always can.
pub const AGENT_NICE: i32 = -10;

/// Raises the calling process's priority back to the default (nice 0) when it runs boosted:
/// a job's vfork child before `execve`. Raw system calls only (the vfork child's rules, see
/// [`spawn`]): the raw `getpriority` answers `20 - nice`. Raising a nice value needs no
/// privilege, so failing is an error of the spawn.
///
/// # Safety
/// Only in a child the agent spawned, before `execve` (called anywhere else it drops the
/// agent itself to 0). Async-signal-safe: two system calls, no allocation, no locks; a
/// failing `getpriority` (it cannot, for the calling process) leaves the priority alone.
pub(crate) unsafe fn restore_default_priority() -> io::Result<()> {
    // SAFETY: plain system calls on the calling process (`who` 0) with integer arguments.
    unsafe {
        let raw = libc::syscall(libc::SYS_getpriority, libc::PRIO_PROCESS, 0);
        if raw > 20 && libc::syscall(libc::SYS_setpriority, libc::PRIO_PROCESS, 0, 0) < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// `crate::jobs::broker::BROKER_MOUNT` as the child's system calls take it.
pub const BROKER_MOUNT_C: &std::ffi::CStr = c"/run/warren-broker";

/// Registers `fd` with the runtime's reactor for readiness in both directions.
pub fn register_fd(fd: OwnedFd) -> io::Result<tokio::io::unix::AsyncFd<OwnedFd>> {
    let interest = tokio::io::Interest::READABLE | tokio::io::Interest::WRITABLE;
    // SAFETY: the AsyncFd takes ownership of the OwnedFd, so the descriptor stays open and
    // refers to the same open file description until the AsyncFd is dropped, and
    // `OwnedFd::as_raw_fd` always returns that same descriptor.
    unsafe { tokio::io::unix::AsyncFd::register_with_interest(fd, interest) }.map_err(Into::into)
}

/// `RNDRESEEDCRNG` from `<linux/random.h>`: `_IO('R', 0x07)`.
const RNDRESEEDCRNG: libc::c_ulong = 0x5207;

/// Reseeds the kernel's CRNG from its input pool now, so fresh entropy takes effect at once
/// (a resumed checkpoint must not replay the random stream of its previous resume).
pub fn reseed_crng(urandom: &File) -> io::Result<()> {
    // SAFETY: RNDRESEEDCRNG takes no argument; the fd is a valid open file.
    let rc = unsafe { libc::ioctl(urandom.as_raw_fd(), RNDRESEEDCRNG) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
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

/// A private, detached, read-only clone of the mount at `path` (`open_tree(OPEN_TREE_CLONE)`
/// then `mount_setattr(MOUNT_ATTR_RDONLY)`): nothing else sees it, and it goes away with the
/// descriptor. rustix has `open_tree` but no `mount_setattr`, so both are raw syscalls here.
pub fn readonly_clone(path: &std::path::Path) -> io::Result<OwnedFd> {
    use std::os::fd::FromRawFd;
    use std::os::unix::ffi::OsStrExt;
    let c_path = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    let flags = libc::OPEN_TREE_CLONE | libc::OPEN_TREE_CLOEXEC;
    // SAFETY: open_tree reads the NUL-terminated path, which lives until the call returns,
    // and takes no other pointer.
    let fd = unsafe { libc::syscall(libc::SYS_open_tree, libc::AT_FDCWD, c_path.as_ptr(), flags) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    let fd = i32::try_from(fd).map_err(|_| io::Error::from(io::ErrorKind::InvalidData))?;
    // SAFETY: a non-negative open_tree result is a new descriptor owned by nobody else.
    let tree = unsafe { OwnedFd::from_raw_fd(fd) };
    let attr = libc::mount_attr {
        attr_set: libc::MOUNT_ATTR_RDONLY,
        attr_clr: 0,
        propagation: 0,
        userns_fd: 0,
    };
    let empty = c"";
    // SAFETY: the descriptor is open, the empty path and the attribute struct outlive the
    // call, and the size passed is that struct's.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            tree.as_raw_fd(),
            empty.as_ptr(),
            libc::AT_EMPTY_PATH,
            std::ptr::addr_of!(attr),
            std::mem::size_of::<libc::mount_attr>(),
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(tree)
}
