//! What one VM's guest can make its egress hold at once, and for how long.
//!
//! The egress runs in the VM's supervisor, outside the VM's own cgroups, so everything a
//! guest connection costs there (a task, buffers, two descriptors, a host port towards the
//! destination) is bounded here rather than by the VM's limits:
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
//!
//! Activity is the guest side's bytes, counted by [`Activity::touch`] in the stream wrapper
//! every proxied connection reads and writes the guest through.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use crate::decision_log::Kind;
use crate::egress::Inner;
use crate::policy::DenyReason;

/// Guest connections the proxy of one VM serves at once.
pub const MAX_CONNECTIONS: usize = 256;
/// Guest DNS-over-TCP connections one VM's resolver serves at once.
pub const MAX_DNS_TCP_CONNECTIONS: usize = 16;
/// How long a proxied connection may go without a byte moving to or from the guest.
pub const IDLE_LIMIT: Duration = Duration::from_secs(600);
/// How long a TLS handshake (with the guest, or with the upstream) may take.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);

/// The next guest connection on `listener` that finds a place among `places`, with its
/// place. An accept error (EMFILE and friends) is logged and retried after a pause rather
/// than ending the service; a connection past the places is closed at once and recorded as
/// `too_many_connections` under `kind` (the decision log's own rate limit bounds these).
pub(crate) async fn accept_within(
    inner: &Inner,
    listener: &TcpListener,
    places: &Arc<Semaphore>,
    kind: Kind,
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
            Ok(place) => return (conn, place),
            Err(_) => {
                drop(conn);
                inner
                    .log
                    .record(kind, None, None, Err(DenyReason::TooManyConnections));
            }
        }
    }
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
