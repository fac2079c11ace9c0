//! Pseudo-terminals for interactive jobs, and the async I/O on their master side.
//!
//! A terminal job's pair is opened by the job manager just before the spawn: the master stays
//! with the agent (non-blocking, close-on-exec, so no other job ever inherits it), the slave
//! becomes the job's stdin, stdout, stderr and controlling terminal (see
//! [`crate::sys::ChildSetup::controlling_terminal`]) and the agent's copy is closed right after
//! the spawn. Once every slave descriptor is closed (the job's processes are gone), reading
//! the master fails with `EIO`: that is the end of the job's output.
//!
//! Everything here uses rustix's safe wrappers.

use std::io;
use std::os::fd::{AsFd, OwnedFd};

use rustix::fs::{Gid, Mode, OFlags, Uid};
use rustix::pty::OpenptFlags;
use rustix::termios::Winsize;
use tokio::io::unix::AsyncFd;
use warren_protocol::WindowSize;

/// The terminal's end-of-file character in its default settings (Ctrl-D).
pub const VEOF_DEFAULT: u8 = 0x04;

/// Both ends of a new pseudo-terminal.
pub struct PtyPair {
    /// Non-blocking, close-on-exec.
    pub master: OwnedFd,
    /// Blocking, close-on-exec (the spawn `dup2`s it onto 0, 1 and 2).
    pub slave: OwnedFd,
}

/// Opens a pseudo-terminal of `size`, its slave owned by `owner` (uid and gid of that number,
/// mode 0620, as `grantpt` does for a login) when given.
pub fn open(size: WindowSize, owner: Option<u32>) -> io::Result<PtyPair> {
    let flags = OpenptFlags::RDWR | OpenptFlags::NOCTTY | OpenptFlags::CLOEXEC;
    let master = rustix::pty::openpt(flags)?;
    rustix::pty::grantpt(&master)?;
    rustix::pty::unlockpt(&master)?;
    // TIOCGPTPEER opens the slave of exactly this master, without a path lookup in /dev/pts.
    let slave = rustix::pty::ioctl_tiocgptpeer(&master, flags)?;
    if let Some(id) = owner {
        rustix::fs::fchown(&slave, Some(Uid::from_raw(id)), Some(Gid::from_raw(id)))?;
        rustix::fs::fchmod(&slave, Mode::from_raw_mode(0o620))?;
    }
    set_size(&master, size)?;
    rustix::fs::fcntl_setfl(&master, OFlags::RDWR | OFlags::NONBLOCK)?;
    Ok(PtyPair { master, slave })
}

/// Sets the terminal's window size; the kernel signals SIGWINCH to its foreground process
/// group when the size changes.
pub fn set_size(master: impl AsFd, size: WindowSize) -> io::Result<()> {
    rustix::termios::tcsetwinsize(
        master,
        Winsize {
            ws_row: size.rows,
            ws_col: size.cols,
            ws_xpixel: 0,
            ws_ypixel: 0,
        },
    )?;
    Ok(())
}

/// The agent's side of a terminal job: the master, registered with the runtime.
pub struct Master(AsyncFd<OwnedFd>);

impl Master {
    pub fn new(fd: OwnedFd) -> io::Result<Self> {
        Ok(Master(crate::sys::register_fd(fd)?))
    }

    pub fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.0.get_ref().as_fd()
    }

    /// Reads what the job wrote; `Ok(0)` once no slave descriptor is open any more (the
    /// kernel answers `EIO` then).
    pub async fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            let mut guard = self.0.readable().await?;
            match guard.try_io(|fd| rustix::io::read(fd.get_ref(), &mut *buf).map_err(Into::into)) {
                Ok(Ok(n)) => return Ok(n),
                Ok(Err(e)) if e.raw_os_error() == Some(libc::EIO) => return Ok(0),
                Ok(Err(e)) if e.kind() == io::ErrorKind::Interrupted => continue,
                Ok(Err(e)) => return Err(e),
                Err(_would_block) => continue,
            }
        }
    }

    /// Writes all of `data` as the terminal's input, waiting while the terminal's input
    /// queue is full.
    pub async fn write_all(&self, mut data: &[u8]) -> io::Result<()> {
        while !data.is_empty() {
            let mut guard = self.0.writable().await?;
            match guard.try_io(|fd| rustix::io::write(fd.get_ref(), data).map_err(Into::into)) {
                Ok(Ok(n)) => data = &data[n..],
                Ok(Err(e)) if e.kind() == io::ErrorKind::Interrupted => continue,
                Ok(Err(e)) => return Err(e),
                Err(_would_block) => continue,
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_open_sets_size_and_cloexec() {
        let pair = open(
            WindowSize {
                rows: 33,
                cols: 101,
            },
            None,
        )
        .expect("open pty");
        let ws = rustix::termios::tcgetwinsize(&pair.slave).expect("winsize");
        assert_eq!((ws.ws_row, ws.ws_col), (33, 101));
        for fd in [&pair.master, &pair.slave] {
            let flags = rustix::io::fcntl_getfd(fd).expect("getfd");
            assert!(flags.contains(rustix::io::FdFlags::CLOEXEC));
        }
        let fl = rustix::fs::fcntl_getfl(&pair.master).expect("getfl");
        assert!(fl.contains(OFlags::NONBLOCK));
        let fl = rustix::fs::fcntl_getfl(&pair.slave).expect("getfl");
        assert!(!fl.contains(OFlags::NONBLOCK));
    }

    #[test]
    fn test_set_size_seen_by_slave() {
        let pair = open(WindowSize { rows: 24, cols: 80 }, None).expect("open pty");
        set_size(
            &pair.master,
            WindowSize {
                rows: 50,
                cols: 132,
            },
        )
        .expect("resize");
        let ws = rustix::termios::tcgetwinsize(&pair.slave).expect("winsize");
        assert_eq!((ws.ws_row, ws.ws_col), (50, 132));
    }

    #[tokio::test]
    async fn test_master_reads_slave_output_then_eof_when_slave_closed() {
        let pair = open(WindowSize { rows: 24, cols: 80 }, None).expect("open pty");
        let master = Master::new(pair.master).expect("master");
        rustix::io::write(&pair.slave, b"hi\n").expect("write slave");
        drop(pair.slave);
        let mut out = Vec::new();
        let mut buf = [0u8; 64];
        loop {
            let n = master.read(&mut buf).await.expect("read");
            if n == 0 {
                break;
            }
            out.extend_from_slice(&buf[..n]);
        }
        // The line discipline turns \n into \r\n on output (OPOST | ONLCR).
        assert_eq!(out, b"hi\r\n");
    }
}
