//! Open guest streams: admission against the host, workspace and VM quotas of `[streams]`,
//! the per-VM registry that lifecycle operations close (suspend, destroy), and the
//! per-direction rate limit. The WebSocket side is `crate::ws`.
//!
//! A stream holds a [`Ticket`] from admission until it ends; dropping the ticket frees its
//! place. Closing a VM's streams sends each of them its reason over a watch channel; the
//! stream's own task closes the WebSocket with it. A subordinate uid's local workspace
//! counts as its owner's (`crate::auth::counted_workspace`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::sync::watch;

use crate::auth::counted_workspace;
use crate::config::StreamsConfig;
use crate::error::ApiError;
use crate::subuid::Subordinates;

/// Ports below this are never streamed to (the reference keeps 1023 and 1024 for the broker
/// pipe and the guest supervisor; Warren keeps the whole privileged range out).
pub const LOWEST_STREAM_PORT: u16 = 1025;

/// Why the service closes a stream (the WebSocket close reason).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CloseReason {
    Suspended,
    Destroyed,
    /// Another attachment took this one's place (a terminal reattached elsewhere).
    Replaced,
}

impl CloseReason {
    pub fn as_str(self) -> &'static str {
        match self {
            CloseReason::Suspended => "suspended",
            CloseReason::Destroyed => "destroyed",
            CloseReason::Replaced => "replaced by another attachment",
        }
    }
}

struct Entry {
    workspace: String,
    vm: String,
    /// At most one open stream holds a given key (a terminal's job); a newer one replaces it.
    exclusive: Option<String>,
    close: watch::Sender<Option<CloseReason>>,
}

#[derive(Default)]
struct Inner {
    next_id: u64,
    open: HashMap<u64, Entry>,
}

/// Every open stream of the service.
#[derive(Clone)]
pub struct Streams {
    cfg: StreamsConfig,
    inner: Arc<Mutex<Inner>>,
    /// Whom a local uid's workspace counts as.
    subordinates: Subordinates,
}

/// One admitted stream's place; dropping it frees the place.
pub struct Ticket {
    id: u64,
    inner: Arc<Mutex<Inner>>,
    /// Turns `Some` when the service closes the stream.
    pub closed: watch::Receiver<Option<CloseReason>>,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        lock(&self.inner).open.remove(&self.id);
    }
}

fn lock(inner: &Mutex<Inner>) -> MutexGuard<'_, Inner> {
    inner.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Streams {
    pub fn new(cfg: StreamsConfig) -> Streams {
        Streams {
            cfg,
            inner: Arc::default(),
            subordinates: Subordinates::shared(),
        }
    }

    /// These quotas with subordinate uids' workspaces counted as `subordinates` says.
    #[cfg(test)]
    pub(crate) fn with_subordinates(mut self, subordinates: Subordinates) -> Streams {
        self.subordinates = subordinates;
        self
    }

    pub fn config(&self) -> &StreamsConfig {
        &self.cfg
    }

    /// Checks that `port` may be streamed to: `forbidden` otherwise.
    pub fn check_port(&self, port: u16) -> Result<(), ApiError> {
        if self.cfg.allows_port(port) {
            return Ok(());
        }
        Err(ApiError::forbidden(if port < LOWEST_STREAM_PORT {
            format!("port {port}: ports below {LOWEST_STREAM_PORT} are never streamed to")
        } else {
            format!("port {port} is outside the service's stream ports")
        }))
    }

    /// Takes a place for a stream of `workspace` to `vm`, or `busy` when a quota is full.
    pub fn admit(&self, workspace: &str, vm: &str) -> Result<Ticket, ApiError> {
        self.admit_keyed(workspace, vm, None)
    }

    /// As [`Streams::admit`], for a stream that only one client may hold at a time: an open
    /// stream with the same `key` is closed with [`CloseReason::Replaced`] and does not count
    /// against the quotas any more.
    pub fn admit_exclusive(
        &self,
        workspace: &str,
        vm: &str,
        key: &str,
    ) -> Result<Ticket, ApiError> {
        self.admit_keyed(workspace, vm, Some(key))
    }

    /// Whether [`Streams::admit_exclusive`] would admit now: `busy` otherwise. Changes
    /// nothing (the holder of `key` is not replaced yet).
    pub fn check_exclusive(&self, workspace: &str, vm: &str, key: &str) -> Result<(), ApiError> {
        let workspace = counted_workspace(workspace, &self.subordinates);
        self.check(&lock(&self.inner), &workspace, vm, Some(key))
    }

    fn check(
        &self,
        inner: &Inner,
        workspace: &str,
        vm: &str,
        key: Option<&str>,
    ) -> Result<(), ApiError> {
        let replaced = |e: &Entry| key.is_some() && e.exclusive.as_deref() == key;
        let counted = || inner.open.values().filter(|e| !replaced(e));
        let total = counted().count();
        let of_ws = counted().filter(|e| e.workspace == workspace).count();
        let of_vm = counted().filter(|e| e.vm == vm).count();
        for (what, n, max) in [
            ("the host", total, self.cfg.max_streams),
            ("the workspace", of_ws, self.cfg.max_streams_per_workspace),
            ("the VM", of_vm, self.cfg.max_streams_per_vm),
        ] {
            if n >= max {
                // The host's count is every workspace's: not told to one of them.
                let msg = if what == "the host" {
                    format!("the host has all of its {max} streams open; retry later")
                } else {
                    format!("{what} has {n} of its {max} streams open; close one first")
                };
                return Err(ApiError::new("busy", msg));
            }
        }
        Ok(())
    }

    fn admit_keyed(
        &self,
        workspace: &str,
        vm: &str,
        key: Option<&str>,
    ) -> Result<Ticket, ApiError> {
        let workspace = counted_workspace(workspace, &self.subordinates);
        let mut inner = lock(&self.inner);
        self.check(&inner, &workspace, vm, key)?;
        let replaced = |e: &Entry| key.is_some() && e.exclusive.as_deref() == key;
        let mut gone = Vec::new();
        for (id, e) in inner.open.iter() {
            if replaced(e) {
                e.close.send_replace(Some(CloseReason::Replaced));
                gone.push(*id);
            }
        }
        for id in gone {
            inner.open.remove(&id);
        }
        inner.next_id += 1;
        let id = inner.next_id;
        let (close, closed) = watch::channel(None);
        inner.open.insert(
            id,
            Entry {
                workspace,
                vm: vm.to_string(),
                exclusive: key.map(str::to_string),
                close,
            },
        );
        Ok(Ticket {
            id,
            inner: self.inner.clone(),
            closed,
        })
    }

    /// Open streams to `vm`.
    pub fn count(&self, vm: &str) -> usize {
        lock(&self.inner)
            .open
            .values()
            .filter(|e| e.vm == vm)
            .count()
    }

    /// Closes every stream to `vm` with `reason`; returns how many.
    pub fn close_vm(&self, vm: &str, reason: CloseReason) -> usize {
        let inner = lock(&self.inner);
        let mut n = 0;
        for e in inner.open.values().filter(|e| e.vm == vm) {
            e.close.send_replace(Some(reason));
            n += 1;
        }
        n
    }
}

/// A token bucket for one direction of one stream: `rate` bytes a second with a burst of
/// one second's worth (at least 1 MiB); `rate` 0 is unlimited.
pub struct RateLimit {
    rate: u64,
    tokens: f64,
    last: tokio::time::Instant,
}

impl RateLimit {
    pub fn new(rate: u64) -> RateLimit {
        RateLimit {
            rate,
            tokens: Self::burst(rate),
            last: tokio::time::Instant::now(),
        }
    }

    fn burst(rate: u64) -> f64 {
        rate.max(1 << 20) as f64
    }

    /// Waits until `n` bytes may pass.
    pub async fn take(&mut self, n: usize) {
        if let Some(at) = self.debit(n) {
            tokio::time::sleep_until(at).await;
        }
    }

    /// Counts `n` bytes as passed and says when they may go (`None`: now), for a sender
    /// that waits in a race of its own.
    pub fn debit(&mut self, n: usize) -> Option<tokio::time::Instant> {
        if self.rate == 0 {
            return None;
        }
        let now = tokio::time::Instant::now();
        let refill = now.duration_since(self.last).as_secs_f64() * self.rate as f64;
        self.tokens = (self.tokens + refill).min(Self::burst(self.rate));
        self.last = now;
        self.tokens -= n as f64;
        (self.tokens < 0.0).then(|| now + Duration::from_secs_f64(-self.tokens / self.rate as f64))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> StreamsConfig {
        StreamsConfig {
            ports: vec![[2000, 3000]],
            max_streams: 3,
            max_streams_per_workspace: 2,
            max_streams_per_vm: 1,
            rate_bytes: 0,
        }
    }

    /// Subordinate uids' local workspaces share their owner's workspace quota (found by a
    /// hostile review: four such uids held all of the host's streams). Control: another
    /// user's local workspace, and a token's, have quotas of their own.
    #[test]
    fn test_subordinate_uids_share_their_owners_stream_quota() {
        let s = Streams::new(StreamsConfig {
            max_streams: 10,
            ..cfg()
        })
        .with_subordinates(Subordinates::fixed(vec![(100_000, 65_536, 1000)]));
        let _a = s.admit("local-100001", "vm1").expect("first");
        let _b = s.admit("local-100002", "vm2").expect("second");
        let e = s
            .admit("local-100003", "vm3")
            .err()
            .expect("the owner's quota");
        assert!(e.message.contains("the workspace"), "{}", e.message);
        let e = s.admit("local-1000", "vm4").err().expect("the owner's own");
        assert!(e.message.contains("the workspace"), "{}", e.message);
        let _c = s.admit("local-2000", "vm5").expect("another user");
        let _d = s
            .admit("local-165536", "vm6")
            .expect("a uid past the range");
        let _e = s.admit("local-x", "vm7").expect("not a uid");
    }

    #[test]
    fn test_admit_quotas_and_release_on_drop() {
        let s = Streams::new(cfg());
        let a = s.admit("w1", "vm1").expect("first");
        let e = s.admit("w1", "vm1").err().expect("vm quota");
        assert_eq!(e.code, "busy");
        assert!(e.message.contains("the VM"), "{}", e.message);
        let _b = s.admit("w1", "vm2").expect("other vm");
        let e = s.admit("w1", "vm3").err().expect("workspace quota");
        assert!(e.message.contains("the workspace"), "{}", e.message);
        let _c = s.admit("w2", "vm4").expect("other workspace");
        let e = s.admit("w3", "vm5").err().expect("host quota");
        assert!(e.message.contains("the host"), "{}", e.message);
        assert_eq!(s.count("vm1"), 1);
        drop(a);
        assert_eq!(s.count("vm1"), 0);
        s.admit("w1", "vm1").expect("freed");
    }

    #[test]
    fn test_close_vm_signals_only_that_vm() {
        let s = Streams::new(StreamsConfig {
            max_streams_per_vm: 4,
            max_streams_per_workspace: 4,
            ..cfg()
        });
        let a = s.admit("w", "vm1").expect("a");
        let b = s.admit("w", "vm2").expect("b");
        assert_eq!(s.close_vm("vm1", CloseReason::Destroyed), 1);
        assert_eq!(*a.closed.borrow(), Some(CloseReason::Destroyed));
        assert_eq!(*b.closed.borrow(), None);
    }

    #[test]
    fn test_exclusive_admission_replaces_the_holder_and_frees_its_place() {
        let s = Streams::new(cfg());
        let a = s.admit_exclusive("w1", "vm1", "job-1").expect("first");
        // The VM quota (1) is full, but the newcomer takes the holder's place.
        let b = s.admit_exclusive("w1", "vm1", "job-1").expect("replaces");
        assert_eq!(*a.closed.borrow(), Some(CloseReason::Replaced));
        assert_eq!(*b.closed.borrow(), None);
        assert_eq!(s.count("vm1"), 1);
        // The replaced ticket's drop must not free the newcomer's place.
        drop(a);
        assert_eq!(s.count("vm1"), 1);
        let e = s
            .admit_exclusive("w1", "vm1", "job-2")
            .err()
            .expect("quota");
        assert_eq!(e.code, "busy");
    }

    #[test]
    fn test_ports_checked() {
        let s = Streams::new(cfg());
        assert!(s.check_port(2500).is_ok());
        assert_eq!(s.check_port(1999).expect_err("outside").code, "forbidden");
        assert_eq!(s.check_port(1023).expect_err("low").code, "forbidden");
        let open = Streams::new(StreamsConfig::default());
        assert!(open.check_port(1024).is_err() && open.check_port(1025).is_ok());
        assert!(open.check_port(65535).is_ok());
    }

    #[tokio::test]
    async fn test_rate_limit_paces_after_the_burst() {
        let mut r = RateLimit::new(1 << 20);
        r.take(1 << 20).await;
        let t0 = tokio::time::Instant::now();
        r.take(512 << 10).await;
        assert!(
            t0.elapsed() >= Duration::from_millis(400),
            "{:?}",
            t0.elapsed()
        );
        let mut free = RateLimit::new(0);
        let t1 = tokio::time::Instant::now();
        free.take(1 << 30).await;
        assert!(t1.elapsed() < Duration::from_millis(100));
    }
}
