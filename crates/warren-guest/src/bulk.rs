//! Control before bulk: while a job starts, the agent's streams stop moving bytes for a
//! moment, so the new process gets the vCPU.
//!
//! A stream at full rate keeps the guest's one vCPU busy (under TCG the agent moving its
//! bytes alone takes most of it, at the agent's raised priority). A command started next to
//! it then shares what is left with the stream's own writer, and an exec round trip took
//! three to four times its idle time. The exec is the control plane an agent waits on; the
//! stream is bulk that only slows down. So each job start holds the [`BulkGate`] until its
//! main process ended or [`START_WINDOW`] passed, whichever comes first, and the stream pumps
//! wait at the gate before each read or write of their target: the target's writer then
//! blocks on its full socket buffer or pipe, and the vCPU goes to the new process. A stream
//! loses at most [`START_WINDOW`] per job start; bytes are only delayed, never dropped.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

/// The longest one job start holds the streams back.
pub const START_WINDOW: Duration = Duration::from_millis(50);
/// How long a hold lasts after its job ended: the job's result leaves before the stream's
/// next bytes (a host waiting for the result, then starting the next command, finds the
/// vCPU free again).
const LINGER: Duration = Duration::from_millis(5);
/// The most hold time saved up. Holding spends it, and time the gate is open earns it back at
/// the same rate: with jobs starting back to back, streams still move half of the time,
/// after at most this much in one piece.
const BURST: Duration = Duration::from_millis(100);
/// Once the budget is spent, the gate stays open until it earned this much back: streams
/// then alternate moving and waiting in pieces of this length (the timer's 1 ms resolution
/// would otherwise keep a spent budget from ever reaching zero exactly).
const SLICE: Duration = Duration::from_millis(10);

/// Holds the agent's streams back while jobs start, within a budget.
#[derive(Debug)]
pub struct BulkGate {
    state: Mutex<State>,
    /// Woken when a hold ends.
    released: Notify,
}

#[derive(Debug)]
struct State {
    /// Job starts holding the gate.
    holds: usize,
    /// Hold time left ([`BURST`] at most), as of `at`.
    budget: Duration,
    /// The budget ran out and has not earned back a [`SLICE`] yet: the gate is open.
    spent: bool,
    at: Instant,
}

impl State {
    /// Brings the budget up to `now`: held time spends it, open time earns it back.
    fn advance(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.at);
        self.at = now;
        if self.holds == 0 || self.spent {
            self.budget += elapsed;
        } else if elapsed < self.budget {
            self.budget -= elapsed;
        } else {
            // Spent: open for the rest of the time, which earned that much back.
            self.spent = true;
            self.budget = elapsed - self.budget;
        }
        self.budget = self.budget.min(BURST);
        if self.spent && self.budget >= SLICE {
            self.spent = false;
        }
    }

    /// How long streams wait now: `None` when the gate is open.
    fn closed_for(&self) -> Option<Duration> {
        (self.holds > 0 && !self.spent).then_some(self.budget)
    }
}

impl Default for BulkGate {
    fn default() -> Self {
        Self {
            state: Mutex::new(State {
                holds: 0,
                budget: BURST,
                spent: false,
                at: Instant::now(),
            }),
            released: Notify::new(),
        }
    }
}

impl BulkGate {
    /// Holds the gate until `done` resolves (and [`LINGER`] after) or [`START_WINDOW`]
    /// passed. Without a runtime (unit tests of the job table) it does nothing.
    pub fn hold_while<F>(self: &Arc<Self>, done: F)
    where
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        self.hold_at_most(done, START_WINDOW);
    }

    fn hold_at_most<F>(self: &Arc<Self>, done: F, window: Duration)
    where
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let hold = Hold::new(self.clone());
        // From the hold, not from when its task first runs.
        let deadline = Instant::now() + window;
        rt.spawn(async move {
            if tokio::time::timeout_at(deadline, done).await.is_ok() {
                tokio::time::sleep_until((Instant::now() + LINGER).min(deadline)).await;
            }
            drop(hold);
        });
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Returns at once when the gate is open, else when it opens: the last hold ended or the
    /// budget ran out.
    pub async fn pass(&self) {
        loop {
            let released = self.released.notified();
            let mut released = std::pin::pin!(released);
            released.as_mut().enable();
            let wait = {
                let mut s = self.state();
                s.advance(Instant::now());
                match s.closed_for() {
                    None => return,
                    Some(wait) => wait,
                }
            };
            tokio::select! {
                () = released => {}
                () = tokio::time::sleep(wait) => {}
            }
        }
    }
}

/// One hold of the gate, released on drop (also when its task is dropped with the runtime).
struct Hold(Arc<BulkGate>);

impl Hold {
    fn new(gate: Arc<BulkGate>) -> Self {
        {
            let mut s = gate.state();
            s.advance(Instant::now());
            s.holds += 1;
        }
        Self(gate)
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        {
            let mut s = self.0.state();
            s.advance(Instant::now());
            s.holds = s.holds.saturating_sub(1);
        }
        self.0.released.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn passes_at_once(gate: &BulkGate) -> bool {
        tokio::time::timeout(Duration::ZERO, gate.pass())
            .await
            .is_ok()
    }

    /// A start holds the streams until its job ended and a moment after.
    #[tokio::test(start_paused = true)]
    async fn test_a_start_holds_streams_until_its_job_ended() {
        let gate = Arc::new(BulkGate::default());
        assert!(passes_at_once(&gate).await, "nothing holds it");
        let (end, ended) = tokio::sync::oneshot::channel::<()>();
        gate.hold_at_most(
            async move {
                let _ = ended.await;
            },
            Duration::from_secs(3600),
        );
        let t = Instant::now();
        let passing = tokio::spawn({
            let gate = gate.clone();
            async move { gate.pass().await }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!passing.is_finished(), "held while the start runs");
        let _ = end.send(());
        passing.await.expect("pass");
        assert_eq!(t.elapsed(), Duration::from_millis(20) + LINGER);
        assert!(passes_at_once(&gate).await, "released");
    }

    /// A job that runs on holds them for the window at most.
    #[tokio::test(start_paused = true)]
    async fn test_a_start_holds_streams_for_its_window_at_most() {
        let gate = Arc::new(BulkGate::default());
        let t = Instant::now();
        gate.hold_at_most(std::future::pending(), Duration::from_millis(30));
        assert!(!passes_at_once(&gate).await);
        gate.pass().await;
        assert_eq!(t.elapsed(), Duration::from_millis(30));
        assert!(passes_at_once(&gate).await);
    }

    /// Holds back to back spend the budget: streams go on after [`BURST`], then move half of
    /// the time.
    #[tokio::test(start_paused = true)]
    async fn test_streams_move_half_the_time_under_back_to_back_starts() {
        let gate = Arc::new(BulkGate::default());
        let t = Instant::now();
        gate.hold_at_most(std::future::pending(), Duration::from_secs(3600));
        gate.pass().await;
        assert_eq!(t.elapsed(), BURST);
        // A stream moving a chunk in 1 ms, then passing again: it waits as long as it moved.
        let (mut moving, mut waiting) = (Duration::ZERO, Duration::ZERO);
        for _ in 0..100 {
            tokio::time::sleep(Duration::from_millis(1)).await;
            moving += Duration::from_millis(1);
            let t = Instant::now();
            gate.pass().await;
            waiting += t.elapsed();
        }
        assert_eq!(moving, waiting);
    }

    #[test]
    fn test_the_budget_is_earned_back_while_open() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut s = State {
            holds: 1,
            budget: BURST,
            spent: false,
            at: t0,
        };
        s.advance(t0 + ms(40));
        assert_eq!(s.closed_for(), Some(BURST - ms(40)));
        // A timer that fired late: spent, and the extra time was open.
        s.advance(t0 + BURST + ms(1));
        assert_eq!(s.closed_for(), None, "spent");
        s.advance(t0 + BURST + ms(9));
        assert_eq!(s.closed_for(), None, "open until a slice is earned back");
        s.advance(t0 + BURST + ms(12));
        assert_eq!(s.closed_for(), Some(ms(12)), "earned back while open");
        s.holds = 0;
        s.advance(t0 + BURST * 5);
        assert_eq!(s.budget, BURST, "never more than a burst");
        assert_eq!(s.closed_for(), None, "nothing holds it");
    }
}
