//! Per-caller caps: how many requests one credential (a token, or a local uid) may have in
//! flight, and how many of them may be long-polls, so one caller cannot take the service's
//! connections, workers or guest channels from everyone else.
//!
//! - [`CallerCaps::request`] is claimed by `crate::http`'s middleware for every request after
//!   authentication, except an MCP GET (the session's event stream, bounded by the MCP session
//!   caps); its [`Slot`] rides on the response body, so it is released when the response
//!   ends, which for an MCP POST answered as a stream is after the last event.
//!   The middleware shares it ([`HeldSlot`]) with the work a tool call started, which runs to
//!   its end even when the client leaves: the place is released when both have ended.
//! - [`CallerCaps::long_poll`] is claimed by [`crate::Service::call`] for a `vm_exec` or
//!   `vm_job_output` with `wait_ms` > 0, for the call's duration.
//!
//! The excess is answered `429 quota_exceeded` with `Retry-After: 1` and changes nothing.
//! Counts live in one map per kind, each guarded by its mutex, never held across an await;
//! an entry at zero is removed, so the maps hold only callers with something in flight.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use serde_json::Value;

use crate::auth::{counted_via, Principal, Via};
use crate::error::ApiError;
use crate::subuid::Subordinates;

/// Tools whose `wait_ms` makes them wait for a job.
const LONG_POLL_TOOLS: &[&str] = &["vm_exec", "vm_job_output"];

/// Whether a call of `tool` with `args` is a long-poll.
pub fn is_long_poll(tool: &str, args: &Value) -> bool {
    LONG_POLL_TOOLS.contains(&tool) && args.get("wait_ms").and_then(Value::as_u64) > Some(0)
}

/// What a kind of cap counts, for its messages.
#[derive(Debug, Clone, Copy)]
enum Kind {
    Request,
    LongPoll,
}

/// One counter per credential.
#[derive(Debug)]
struct Counter {
    kind: Kind,
    max: usize,
    /// Credential -> its count; entries at zero are removed.
    held: Mutex<HashMap<Via, usize>>,
}

impl Counter {
    fn new(kind: Kind, max: usize) -> Counter {
        Counter {
            kind,
            max,
            held: Mutex::new(HashMap::new()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Via, usize>> {
        // Every update is one statement: the map stays consistent even after a panic.
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn claim(self: &Arc<Self>, via: &Via) -> Result<Slot, ApiError> {
        let mut map = self.lock();
        let n = map.entry(via.clone()).or_insert(0);
        if *n >= self.max {
            let what = match self.kind {
                Kind::Request => "requests in flight",
                Kind::LongPoll => "long-polls (wait_ms > 0) waiting",
            };
            return Err(ApiError::new(
                "quota_exceeded",
                format!(
                    "this credential already has {} {what}; retry when one ends",
                    self.max
                ),
            ));
        }
        *n += 1;
        Ok(Slot {
            counter: self.clone(),
            via: via.clone(),
        })
    }

    fn held(&self, via: &Via) -> usize {
        self.lock().get(via).copied().unwrap_or(0)
    }
}

/// A request's place under the request cap, shared by its response body and the work the
/// request started ([`crate::Service::call_to_end`]): released when both have ended, so work
/// that goes on after its client left still counts against the caller.
#[derive(Debug, Clone)]
pub struct HeldSlot {
    _slot: Arc<Slot>,
}

impl HeldSlot {
    pub fn new(slot: Slot) -> HeldSlot {
        HeldSlot {
            _slot: Arc::new(slot),
        }
    }
}

/// A claimed place under a cap, released when dropped.
#[derive(Debug)]
pub struct Slot {
    counter: Arc<Counter>,
    via: Via,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut map = self.counter.lock();
        if let Some(n) = map.get_mut(&self.via) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                map.remove(&self.via);
            }
        }
    }
}

/// The caps of every caller of one service.
#[derive(Debug)]
pub struct CallerCaps {
    requests: Arc<Counter>,
    long_polls: Arc<Counter>,
    /// Whom a local uid counts as.
    subordinates: Subordinates,
}

impl CallerCaps {
    pub fn new(max_requests: usize, max_long_polls: usize) -> CallerCaps {
        CallerCaps {
            requests: Arc::new(Counter::new(Kind::Request, max_requests)),
            long_polls: Arc::new(Counter::new(Kind::LongPoll, max_long_polls)),
            subordinates: Subordinates::shared(),
        }
    }

    /// These caps with subordinate uids counted as `subordinates` says.
    #[cfg(test)]
    pub(crate) fn with_subordinates(mut self, subordinates: Subordinates) -> CallerCaps {
        self.subordinates = subordinates;
        self
    }

    /// One more request in flight for `p`'s credential (a subordinate uid's is its owner's:
    /// `crate::auth::counted_via`), or `quota_exceeded`.
    pub fn request(&self, p: &Principal) -> Result<Slot, ApiError> {
        self.requests
            .claim(&counted_via(&p.via, &self.subordinates))
    }

    /// One more long-poll for `p`'s credential, or `quota_exceeded`.
    pub fn long_poll(&self, p: &Principal) -> Result<Slot, ApiError> {
        self.long_polls
            .claim(&counted_via(&p.via, &self.subordinates))
    }

    /// Requests `p`'s credential has in flight (for tests and diagnostics).
    pub fn requests_held(&self, p: &Principal) -> usize {
        self.requests.held(&counted_via(&p.via, &self.subordinates))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn token(workspace: &str, id: &str) -> Principal {
        Principal {
            workspace: workspace.into(),
            policy: crate::auth::Policy::default(),
            via: Via::Token {
                token_id: id.into(),
            },
        }
    }

    #[test]
    fn test_caller_caps_excess_refused_other_credentials_served_released_on_drop() {
        let caps = CallerCaps::new(3, 1);
        let a = token("ws", "t1");
        let held: Vec<Slot> = (0..3).map(|_| caps.request(&a).expect("under")).collect();
        let e = caps.request(&a).expect_err("at the cap");
        assert_eq!((e.code, e.status().as_u16()), ("quota_exceeded", 429));
        // Control: another token of the same workspace, and a local uid, are served.
        let other = caps.request(&token("ws", "t2")).expect("another token");
        let local = caps.request(&Principal::local(1000)).expect("a local uid");
        let poll = caps.long_poll(&a).expect("long-polls count apart");
        assert_eq!(
            caps.long_poll(&a).expect_err("one long-poll").code,
            "quota_exceeded"
        );
        drop(held);
        assert_eq!(caps.requests_held(&a), 0);
        let _again = caps.request(&a).expect("released");
        drop((other, local, poll));
        let _poll = caps.long_poll(&a).expect("released");
    }

    /// Subordinate uids of one user (a user namespace's) share that user's caps: one user
    /// cannot hold the caps many times over by acting as many uids (found by a hostile
    /// review). Control: another local user, and a uid in no range, have caps of their own.
    #[test]
    fn test_subordinate_uids_share_their_owners_caps() {
        let caps = CallerCaps::new(2, 1)
            .with_subordinates(Subordinates::fixed(vec![(100_000, 65_536, 1000)]));
        let local = |uid| Principal::local(uid);
        let _a = caps.request(&local(100_001)).expect("first");
        let _b = caps.request(&local(100_002)).expect("second");
        let e = caps
            .request(&local(100_003))
            .expect_err("a third subordinate uid");
        assert_eq!(e.code, "quota_exceeded");
        let e = caps.request(&local(1000)).expect_err("the owner itself");
        assert_eq!(e.code, "quota_exceeded");
        assert_eq!(caps.requests_held(&local(165_535)), 2);
        let _c = caps.request(&local(2000)).expect("another user");
        let _d = caps.request(&local(165_536)).expect("a uid past the range");
        let _p = caps.long_poll(&local(100_004)).expect("a long-poll");
        let e = caps
            .long_poll(&local(1000))
            .expect_err("the owner's second long-poll");
        assert_eq!(e.code, "quota_exceeded");
    }

    #[test]
    fn test_long_poll_is_exec_or_output_with_a_wait() {
        let w = |v: Value| serde_json::json!({ "vm_id": "v", "wait_ms": v });
        assert!(is_long_poll("vm_job_output", &w(1000.into())));
        assert!(is_long_poll("vm_exec", &w(1.into())));
        assert!(!is_long_poll("vm_job_output", &w(0.into())));
        assert!(!is_long_poll("vm_job_output", &serde_json::json!({})));
        assert!(!is_long_poll("vm_status", &w(1000.into())));
    }
}
