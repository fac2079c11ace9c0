//! What one VM's guest can make its egress hold at once, and for how long.
//!
//! The egress runs in the VM's supervisor, which is held to the VM's host limits with its
//! VMM (`warren-vmm` `sys::cgroup`, whose memory limit leaves room for what is bounded
//! here); everything a guest connection costs there (a task, buffers, two descriptors, a
//! host port towards the destination) is also bounded here, so that one VM's egress stays
//! within that room and never takes its VMM's:
//!
//! - **How many.** The proxy serves at most [`MAX_CONNECTIONS`] guest connections at once and
//!   DNS over TCP at most [`MAX_DNS_TCP_CONNECTIONS`]; past that a new connection is closed as
//!   soon as it is accepted (the guest sees a reset or an immediate end, and a retry succeeds
//!   once a place is free). Each count is the VM's own, so one guest cannot take another's.
//! - **How long.** A proxied connection on which no byte moved between the guest and the
//!   egress for [`IDLE_LIMIT`] is closed, whatever it was waiting for: a silent client, a TLS
//!   handshake, a request body, a slow upstream, a relay in either direction. TLS handshakes
//!   (the guest's with Warren, Warren's with the upstream) must also complete within
//!   [`HANDSHAKE_TIMEOUT`].
//! - **How much kernel memory.** Both sockets of every relay have their send and receive
//!   buffers fixed at [`RELAY_SOCKET_BUFFER`]: the guest's right after accept, the
//!   upstream's before `connect` (so the window scale it offers fits). Left to itself the
//!   kernel grows each buffer towards `tcp_wmem`/`tcp_rmem`'s maximum (4 and 6 MiB by
//!   default, often raised): a guest that reads a fast download and then stops leaves the
//!   guest-facing send queue and the upstream receive queue full: up to 10 MiB per connection
//!   with default limits (3-21 MiB in the test, on a host with raised ones), GiBs at
//!   [`MAX_CONNECTIONS`], far past the VM's memory limit. Fixed, the kernel takes
//!   `min(size, net.core.*mem_max)` and doubles it for its bookkeeping: a buffer holds about
//!   512 KiB at most (one packet more on a send queue), a stalled direction of a connection
//!   1 MiB (two buffers), both directions 2 MiB, so a VM at most 256 MiB of stalled downloads
//!   and 512 MiB in all. The price is throughput on long paths: a connection moves at most
//!   about a window (near the fixed size) per round trip, ~25 MiB/s at 10 ms, ~2.5 MiB/s at
//!   100 ms, far more on the guest's local link and from nearby mirrors. A guest's
//!   DNS-over-TCP connection needs room for one message (64 KiB at most) and gets
//!   [`DNS_SOCKET_BUFFER`]: 4 MiB for all 16 (the resolver's own queries upstream over TCP,
//!   one answer each within 20 s, are left alone). A buffer that cannot be fixed fails its
//!   connection (closed as accepted, or never connected) rather than letting it grow.
//!
//! Activity is the guest side's bytes, counted by [`Activity::touch`] in the stream wrapper
//! every proxied connection reads and writes the guest through.

use std::os::fd::AsFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use crate::decision_log::Kind;
use crate::egress::Inner;
use crate::error::BufferError;
use crate::policy::DenyReason;

/// Guest connections the proxy of one VM serves at once.
pub const MAX_CONNECTIONS: usize = 256;
/// Guest DNS-over-TCP connections one VM's resolver serves at once.
pub const MAX_DNS_TCP_CONNECTIONS: usize = 16;
/// How long a proxied connection may go without a byte moving to or from the guest.
pub const IDLE_LIMIT: Duration = Duration::from_secs(600);
/// How long a TLS handshake (with the guest, or with the upstream) may take.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);
/// The send and receive buffer size (`SO_SNDBUF`, `SO_RCVBUF`) asked of the kernel for both
/// sockets of every relay; the kernel doubles it (see the module's "How much kernel
/// memory").
pub const RELAY_SOCKET_BUFFER: usize = 256 * 1024;
/// The same for a guest's DNS-over-TCP connection: one whole message (at most 64 KiB).
pub const DNS_SOCKET_BUFFER: usize = 64 * 1024;

/// The next guest connection on `listener` that finds a place among `places`, with its
/// place, its kernel buffers fixed at `buffer` ([`fix_buffers`]). An accept error (EMFILE and friends) is
/// logged and retried after a pause rather than ending the service; a connection past the
/// places is closed at once and recorded as `too_many_connections` under `kind` (the decision
/// log's own rate limit bounds these); one whose buffers cannot be fixed is closed and logged.
pub(crate) async fn accept_within(
    inner: &Inner,
    listener: &TcpListener,
    places: &Arc<Semaphore>,
    kind: Kind,
    buffer: usize,
) -> (TcpStream, OwnedSemaphorePermit) {
    loop {
        let conn = match listener.accept().await {
            Ok((c, _)) => c,
            Err(e) => {
                tracing::warn!(vm = %inner.cfg.vm, ?kind, error = %e, "egress accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        match places.clone().try_acquire_owned() {
            Ok(place) => match fix_buffers(&conn, "guest-facing", buffer) {
                Ok(()) => return (conn, place),
                Err(e) => {
                    tracing::warn!(vm = %inner.cfg.vm, ?kind, error = %e, source = %e.source,
                        "egress closed a guest connection");
                    drop(conn);
                }
            },
            Err(_) => {
                drop(conn);
                inner
                    .log
                    .record(kind, None, None, Err(DenyReason::TooManyConnections));
            }
        }
    }
}

/// Fixes both kernel buffers of a `side` socket at `bytes`.
pub(crate) fn fix_buffers<F: AsFd>(
    sock: &F,
    side: &'static str,
    bytes: usize,
) -> Result<(), BufferError> {
    crate::sys::sockopt::fix_buffers(sock, bytes).map_err(|source| BufferError {
        side,
        bytes,
        source,
    })
}

/// When a connection's guest side last moved a byte.
#[derive(Debug)]
pub(crate) struct Activity {
    start: Instant,
    /// Milliseconds after `start` of the last byte.
    last_ms: AtomicU64,
}

impl Activity {
    /// A connection accepted now (its acceptance counts as activity).
    pub(crate) fn new() -> Self {
        Activity {
            start: Instant::now(),
            last_ms: AtomicU64::new(0),
        }
    }

    /// Records that bytes moved now.
    pub(crate) fn touch(&self) {
        let ms = u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_ms.fetch_max(ms, Ordering::Relaxed);
    }

    fn last(&self) -> Instant {
        self.start + Duration::from_millis(self.last_ms.load(Ordering::Relaxed))
    }

    /// Completes once no byte moved for `limit`.
    pub(crate) async fn idle_for(&self, limit: Duration) {
        loop {
            let due = self.last() + limit;
            if Instant::now() >= due {
                return;
            }
            tokio::time::sleep_until(due).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both buffers of a fixed socket read back as what the kernel makes of the size: capped
    /// at `net.core.*mem_max` and doubled, whatever the autotuning limits are.
    #[test]
    fn test_fix_buffers_sets_both_buffers() {
        use nix::sys::socket::{getsockopt, sockopt};
        let max = |name: &str| -> usize {
            std::fs::read_to_string(format!("/proc/sys/net/core/{name}"))
                .expect("sysctl")
                .trim()
                .parse()
                .expect("number")
        };
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let s = std::net::TcpStream::connect(l.local_addr().expect("addr")).expect("connect");
        fix_buffers(&s, "test", RELAY_SOCKET_BUFFER).expect("fix");
        let snd = getsockopt(&s, sockopt::SndBuf).expect("SO_SNDBUF");
        let rcv = getsockopt(&s, sockopt::RcvBuf).expect("SO_RCVBUF");
        assert_eq!(snd, 2 * RELAY_SOCKET_BUFFER.min(max("wmem_max")));
        assert_eq!(rcv, 2 * RELAY_SOCKET_BUFFER.min(max("rmem_max")));
    }

    /// The watch ends `limit` after the last touch, not after the first, and not before.
    #[tokio::test(start_paused = true)]
    async fn test_idle_for_counts_from_the_last_byte() {
        let a = std::sync::Arc::new(Activity::new());
        let limit = Duration::from_secs(10);
        let t0 = Instant::now();
        let toucher = {
            let a = a.clone();
            tokio::spawn(async move {
                for _ in 0..3 {
                    tokio::time::sleep(Duration::from_secs(6)).await;
                    a.touch();
                }
            })
        };
        a.idle_for(limit).await;
        assert_eq!(
            t0.elapsed(),
            Duration::from_secs(28),
            "18 s of touches, then 10 s"
        );
        toucher.await.expect("toucher");
        // An untouched connection ends at the limit.
        let b = Activity::new();
        let t1 = Instant::now();
        b.idle_for(limit).await;
        assert_eq!(t1.elapsed(), limit);
    }
}
