//! The virtio-serial port: resynchronisation and one session per host connection.
//!
//! The port is one non-blocking descriptor driven by the agent's runtime: no threads, no
//! queues and no in-memory pipes between the port and HTTP/2 (under TCG every hop between
//! threads or tasks and every extra copy costs the guest's single vCPU dearly).
//! - **Reading** ([`Port::poll_data`]): the port is read straight into the session's HTTP/2
//!   read buffer, gathering what it has (a virtio-serial `read()` returns at most one 4 KiB
//!   buffer, so each system call is a `readv` of page-sized pieces), and unescaped in place
//!   ([`Decoder::decode_in_place`]). `read() == 0` means no
//!   host is attached: it waits [`DETACHED_PAUSE`] and reads again (the port is never
//!   closed: data arriving while it is closed would be lost).
//! - **Writing** ([`Port::poll_write_data`]): what HTTP/2 writes is escaped into one
//!   pending buffer, written once [`WRITE_BATCH`] bytes are pending or HTTP/2 flushes; past
//!   [`MAX_PENDING`] unwritten bytes a write waits. A blocked write (no host) stalls only the session: jobs drain their output
//!   independently.
//! - **Resync**: a `Sync(nonce)` ends the current session: reads fail from then on, so its
//!   HTTP/2 connection ends (and with it every request of the session), and the manager
//!   starts the next one; bytes after the marker are kept for it. The manager first writes
//!   out what the old session left pending (whole, so the host's decoder stays aligned; the
//!   host drops everything before the acknowledgement), then `SyncAck(nonce)`, then serves a
//!   fresh HTTP/2 session. While no session runs the manager reads and drops what arrives,
//!   until a `Sync`: data before the first `Sync` is discarded.

use std::future::Future;
use std::io::{self, IoSlice};
use std::os::fd::{AsFd, OwnedFd};
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{ready, Context, Poll};
use std::time::Duration;

use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::task::JoinHandle;
use warren_protocol::framing::{self, Decoder, Event, SyncNonce};

use crate::session::{self, Agent};

/// Pause after `read() == 0` (no host attached) before reading again.
const DETACHED_PAUSE: Duration = Duration::from_millis(10);
/// Pause after an unexpected read error, to avoid a busy loop.
const ERROR_PAUSE: Duration = Duration::from_millis(100);
/// Unwritten escaped bytes past which a write waits for the port. Small, because a short
/// answer queued behind a stream's data waits for all of it (the exec round trip while a
/// stream runs at full rate).
const MAX_PENDING: usize = 64 * 1024;
/// Escaped bytes written at once before a flush asks for the rest (the port takes at most
/// 32 KiB per `write()`): HTTP/2's small frames (headers, data, window updates) written
/// together go out in one port write, one virtio buffer and one host wakeup.
const WRITE_BATCH: usize = 32 * 1024;
/// The size of a virtio-serial port's receive buffers (one page): the most one `read()`
/// of the port returns.
const PORT_BUFFER: usize = 4096;
/// Most bytes one read gathers before handing them over.
const MAX_GATHER: usize = 256 * 1024;
/// Buffer the manager reads (and drops) into while no session runs.
const IDLE_READ: usize = 64 * 1024;

/// Starts serving the port (any readable and writable descriptor: the virtio-serial port,
/// or a socket in tests) and returns the manager task, which runs forever. Must be called
/// within the agent's tokio runtime.
pub fn start(port: impl Into<OwnedFd>, agent: Arc<Agent>) -> io::Result<JoinHandle<()>> {
    let fd: OwnedFd = port.into();
    rustix::io::ioctl_fionbio(&fd, true)?;
    let port = Arc::new(Port {
        fd: crate::sys::register_fd(fd)?,
        rd: Mutex::new(ReadSide {
            decoder: Decoder::new(),
            stash: Vec::new(),
            sync: None,
            pause: None,
        }),
        wr: Mutex::new(WriteSide {
            buf: Vec::new(),
            pos: 0,
        }),
    });
    Ok(tokio::spawn(manage(port, agent)))
}

/// The port and what is in flight on it, shared by the manager and the current session.
struct Port {
    fd: AsyncFd<OwnedFd>,
    rd: Mutex<ReadSide>,
    wr: Mutex<WriteSide>,
}

struct ReadSide {
    decoder: Decoder,
    /// Undecoded bytes read after a `Sync`: the next session's.
    stash: Vec<u8>,
    /// A `Sync` the manager has not handled yet; reads fail until it does.
    sync: Option<SyncNonce>,
    /// No host attached: read again when this fires.
    pause: Option<Pin<Box<tokio::time::Sleep>>>,
}

struct WriteSide {
    /// Escaped bytes; `buf[pos..]` is not written yet.
    buf: Vec<u8>,
    pos: usize,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Port {
    /// Reads and unescapes data into `out`: at least one byte, or an error once a `Sync`
    /// arrived (the session's end).
    fn poll_data(&self, cx: &mut Context<'_>, out: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let mut rd = lock(&self.rd);
        loop {
            if rd.sync.is_some() {
                return Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::ConnectionReset,
                    "the host resynchronised",
                )));
            }
            if out.remaining() == 0 {
                return Poll::Ready(Ok(()));
            }
            let start = out.filled().len();
            if !rd.stash.is_empty() {
                let n = rd.stash.len().min(out.remaining());
                out.put_slice(&rd.stash[..n]);
                rd.stash.drain(..n);
            } else {
                if let Some(pause) = rd.pause.as_mut() {
                    ready!(pause.as_mut().poll(cx));
                    rd.pause = None;
                }
                match self.poll_gather(cx, out) {
                    Poll::Ready(Ok(0)) => {
                        rd.pause = Some(Box::pin(tokio::time::sleep(DETACHED_PAUSE)));
                        continue;
                    }
                    Poll::Ready(Ok(_)) => {}
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                    Poll::Pending => return Poll::Pending,
                }
            }
            let end = out.filled().len();
            let kept = unescape(&mut rd, &mut out.filled_mut()[start..end]);
            out.set_filled(start + kept);
            if kept > 0 {
                return Poll::Ready(Ok(()));
            }
        }
    }

    /// Reads what the port has into `out` (several `read()`s, up to [`MAX_GATHER`]): the
    /// bytes read, 0 when no host is attached, pending when there is nothing to read.
    fn poll_gather(&self, cx: &mut Context<'_>, out: &mut ReadBuf<'_>) -> Poll<io::Result<usize>> {
        let mut got = 0;
        while out.remaining() > 0 && got < MAX_GATHER {
            let mut guard = match self.fd.poll_read_ready(cx) {
                Poll::Ready(g) => g?,
                Poll::Pending if got > 0 => break,
                Poll::Pending => return Poll::Pending,
            };
            match guard.try_io(|fd| crate::sys::read_into(fd.get_ref().as_fd(), out, PORT_BUFFER)) {
                Ok(Ok(0)) if got > 0 => break,
                Ok(Ok(0)) => return Poll::Ready(Ok(0)),
                Ok(Ok(n)) => got += n,
                Ok(Err(e)) if e.kind() == io::ErrorKind::Interrupted => {}
                Ok(Err(e)) if got > 0 => {
                    crate::console::log(format_args!("port read: {e}"));
                    break;
                }
                Ok(Err(e)) => return Poll::Ready(Err(e)),
                // Drained: readiness is cleared, the next poll registers the waker.
                Err(_would_block) => {}
            }
        }
        Poll::Ready(Ok(got))
    }

    /// Escapes `bufs` into the pending output and writes what the port takes now; waits only
    /// while [`MAX_PENDING`] bytes are unwritten.
    fn poll_write_data(
        &self,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let mut wr = lock(&self.wr);
        if wr.buf.len() - wr.pos >= MAX_PENDING {
            match self.poll_drain(&mut wr, cx) {
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending if wr.buf.len() - wr.pos >= MAX_PENDING => return Poll::Pending,
                _ => {}
            }
        }
        if wr.pos > 0 && wr.pos >= wr.buf.len() / 2 {
            let pos = wr.pos;
            wr.buf.drain(..pos);
            wr.pos = 0;
        }
        let mut n = 0;
        for b in bufs {
            framing::encode_data(b, &mut wr.buf);
            n += b.len();
        }
        // Small writes wait for the flush; what the port does not take now goes with the next
        // write or flush.
        if wr.buf.len() - wr.pos >= WRITE_BATCH {
            if let Poll::Ready(Err(e)) = self.poll_drain(&mut wr, cx) {
                return Poll::Ready(Err(e));
            }
        }
        Poll::Ready(Ok(n))
    }

    /// Writes the pending output until none is left.
    fn poll_drain(&self, wr: &mut WriteSide, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while wr.pos < wr.buf.len() {
            let mut guard = ready!(self.fd.poll_write_ready(cx))?;
            match guard.try_io(|fd| Ok(rustix::io::write(fd.get_ref(), &wr.buf[wr.pos..])?)) {
                Ok(Ok(n)) => wr.pos += n,
                Ok(Err(e)) if e.kind() == io::ErrorKind::Interrupted => {}
                Ok(Err(e)) => return Poll::Ready(Err(e)),
                Err(_would_block) => {}
            }
        }
        wr.buf.clear();
        wr.pos = 0;
        Poll::Ready(Ok(()))
    }

    fn poll_flush(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let mut wr = lock(&self.wr);
        self.poll_drain(&mut wr, cx)
    }

    /// With no session: reads (into `scratch`) and drops data until a `Sync`, and takes it.
    fn poll_idle(&self, cx: &mut Context<'_>, scratch: &mut [u8]) -> Poll<io::Result<SyncNonce>> {
        loop {
            if let Some(nonce) = lock(&self.rd).sync.take() {
                return Poll::Ready(Ok(nonce));
            }
            let mut buf = ReadBuf::new(scratch);
            match self.poll_data(cx, &mut buf) {
                Poll::Ready(Err(e)) if e.kind() != io::ErrorKind::ConnectionReset => {
                    return Poll::Ready(Err(e))
                }
                Poll::Ready(_) => {}
                Poll::Pending => return Poll::Pending,
            }
        }
    }

    /// The newest `Sync` already sent: `nonce`, or a later one found in what the port has
    /// now. The host resends its `Sync` every few milliseconds until one is acknowledged and
    /// takes only the newest nonce's acknowledgement, and it sends nothing else before that; a
    /// guest slow to answer (a boot, a restore on a cold translation cache) would otherwise
    /// begin and end one session per queued `Sync`.
    fn newest_sync(&self, mut nonce: SyncNonce) -> SyncNonce {
        let mut rd = lock(&self.rd);
        let mut chunk = [0u8; 4096];
        let mut drained = 0;
        // What is readable now joins the stash (the manager is the port's only reader here).
        while drained < IDLE_READ {
            match rustix::io::read(self.fd.get_ref(), &mut chunk) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    rd.stash.extend_from_slice(&chunk[..n]);
                    drained += n;
                }
            }
        }
        loop {
            let mut probe = rd.decoder.clone();
            let mut buf = rd.stash.clone();
            let mut at = 0;
            let mut later = None;
            while at < buf.len() {
                let got = probe.decode_in_place(&mut buf[at..]);
                at += got.consumed;
                match got.marker {
                    Some(Event::Sync(n)) => {
                        later = Some(n);
                        break;
                    }
                    Some(_) => {}
                    None => break,
                }
            }
            match later {
                Some(n) => {
                    nonce = n;
                    rd.decoder = probe;
                    rd.stash.drain(..at);
                }
                None => return nonce,
            }
        }
    }

    /// Starts a session: the previous one's pending output goes out whole, then
    /// `SyncAck(nonce)`.
    async fn begin(&self, nonce: &SyncNonce) -> io::Result<()> {
        std::future::poll_fn(|cx| self.poll_flush(cx)).await?;
        lock(&self.wr)
            .buf
            .extend_from_slice(&framing::encode_sync_ack(nonce));
        std::future::poll_fn(|cx| self.poll_flush(cx)).await
    }
}

/// Unescapes `buf` in place (the newly read bytes) and returns how many data bytes are now
/// at its start. A `Sync` stops it: the nonce is recorded and the bytes after the marker are
/// stashed for the next session. Other markers are ignored.
fn unescape(rd: &mut ReadSide, buf: &mut [u8]) -> usize {
    let (mut w, mut r) = (0, 0);
    while r < buf.len() {
        let got = rd.decoder.decode_in_place(&mut buf[r..]);
        if w != r {
            buf.copy_within(r..r + got.data, w);
        }
        w += got.data;
        r += got.consumed;
        match got.marker {
            Some(Event::Sync(nonce)) => {
                rd.sync = Some(nonce);
                let mut rest = buf[r..].to_vec();
                rest.extend_from_slice(&rd.stash);
                rd.stash = rest;
                break;
            }
            Some(_) => {}
            None => break,
        }
    }
    w
}

/// The current session's view of the port.
struct SessionIo(Arc<Port>);

impl AsyncRead for SessionIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        self.0.poll_data(cx, buf)
    }
}

impl AsyncWrite for SessionIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.0.poll_write_data(cx, &[IoSlice::new(buf)])
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.0.poll_write_data(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.0.poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.0.poll_flush(cx)
    }
}

async fn manage(port: Arc<Port>, agent: Arc<Agent>) {
    let mut epoch = 0u64;
    let mut scratch = vec![0u8; IDLE_READ];
    loop {
        let mut nonce = match std::future::poll_fn(|cx| port.poll_idle(cx, &mut scratch)).await {
            Ok(nonce) => nonce,
            Err(e) => {
                crate::console::log(format_args!("port read: {e}"));
                tokio::time::sleep(ERROR_PAUSE).await;
                continue;
            }
        };
        loop {
            epoch += 1;
            nonce = port.newest_sync(nonce);
            if let Err(e) = port.begin(&nonce).await {
                crate::console::log(format_args!("port write: {e}"));
                break;
            }
            let ended = session::serve(agent.clone(), SessionIo(port.clone())).await;
            let resync = lock(&port.rd).sync.take();
            if let (Err(e), None) = (ended, &resync) {
                crate::console::log(format_args!("session {epoch} ended: {e}"));
            }
            match resync {
                Some(next) => nonce = next,
                None => break,
            }
        }
    }
}
