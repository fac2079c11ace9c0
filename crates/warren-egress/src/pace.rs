//! How fast one VM's guest may make the host open upstream connections and send DNS
//! queries upstream. [`crate::conns`] bounds what a guest holds at once; these bound the rate,
//! whose costs land on what every VM and the host share and no VM's cgroup covers: a closed
//! upstream connection keeps its host port (towards that destination) in TIME_WAIT for a
//! minute, and its entry in the host's connection tracking table longer; every query reaches
//! the host's one resolver. Without a rate, 256 connections opened and closed in a loop
//! held every host port towards a destination other VMs need, and 64 queries at a time kept
//! the host's resolver busy for every VM (found by a hostile review).
//!
//! Past the burst, a caller waits for its turn (a connection or a lookup is slower, never
//! refused); the waiters are bounded by the counts of [`crate::conns`] and the resolver, so
//! a wait is bounded too (256 connections at [`CONNECT_RATE`]: about 5 s).
//!
//! By hand: a token bucket of a dozen lines, shared by tasks, with waits in tokio's clock.

use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

/// Upstream TCP connections one VM's egress opens per second, past [`CONNECT_BURST`].
pub const CONNECT_RATE: u32 = 50;
/// Upstream TCP connections opened at once before the rate applies.
pub const CONNECT_BURST: u32 = 256;
/// Upstream DNS lookups one VM's resolver makes per second, past [`LOOKUP_BURST`].
pub const LOOKUP_RATE: u32 = 100;
/// Upstream DNS lookups made at once before the rate applies.
pub const LOOKUP_BURST: u32 = 500;

/// A token bucket whose takers wait for their token.
#[derive(Debug)]
pub(crate) struct Pace {
    rate: f64,
    burst: f64,
    /// Tokens (negative: owed to the waiters) and when they were last counted.
    state: Mutex<(f64, Instant)>,
}

impl Pace {
    pub(crate) fn new(rate: u32, burst: u32) -> Pace {
        Pace {
            rate: f64::from(rate.max(1)),
            burst: f64::from(burst),
            state: Mutex::new((f64::from(burst), Instant::now())),
        }
    }

    /// Takes one token, waiting until it is this caller's turn.
    pub(crate) async fn take(&self) {
        let wait = {
            let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
            let now = Instant::now();
            let refill = now.duration_since(s.1).as_secs_f64() * self.rate;
            s.0 = (s.0 + refill).min(self.burst) - 1.0;
            s.1 = now;
            (s.0 < 0.0).then(|| Duration::from_secs_f64(-s.0 / self.rate))
        };
        if let Some(wait) = wait {
            tokio::time::sleep(wait).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The burst goes at once; past it, takers are spread at the rate, each waiting its
    /// turn; after a quiet spell the burst is there again.
    #[tokio::test(start_paused = true)]
    async fn test_takers_past_the_burst_wait_their_turn_at_the_rate() {
        let pace = std::sync::Arc::new(Pace::new(10, 5));
        let t = Instant::now();
        for _ in 0..5 {
            pace.take().await;
        }
        assert_eq!(t.elapsed(), Duration::ZERO);
        let waiters: Vec<_> = (0..10)
            .map(|_| {
                let pace = pace.clone();
                tokio::spawn(async move {
                    pace.take().await;
                    Instant::now()
                })
            })
            .collect();
        let mut ends = Vec::new();
        for w in waiters {
            ends.push(w.await.expect("taker").duration_since(t));
        }
        ends.sort();
        assert!(ends[0] >= Duration::from_millis(99), "{ends:?}");
        assert!(ends[9] >= Duration::from_millis(999), "{ends:?}");
        assert!(ends[9] <= Duration::from_millis(1010), "{ends:?}");
        tokio::time::sleep(Duration::from_secs(10)).await;
        let t = Instant::now();
        for _ in 0..5 {
            pace.take().await;
        }
        assert_eq!(t.elapsed(), Duration::ZERO);
    }
}
