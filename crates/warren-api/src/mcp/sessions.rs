//! MCP sessions: who owns each one, and how many each workspace holds.
//!
//! rmcp's session manager knows a session only by its id, and serves any request that names
//! a live one. [`bind`], a middleware in front of rmcp on every `/mcp` request, binds each id
//! to the [`Owner`] (workspace and credential) whose `initialize` opened it:
//! 1. a request without `Mcp-Session-Id` goes through; when its response opens a session
//!    (rmcp answers an `initialize` with the header), the new id is bound to the request's
//!    owner before the response leaves, so no client can name the id before it is bound;
//! 2. a request naming a session (POST, the GET stream, DELETE) goes through only when the
//!    id is bound to the caller's own owner. Anything else (another workspace's or another
//!    token's session, an unknown or malformed id, several ids) is answered here, `404
//!    not_found` or `400 invalid_argument`, and never reaches rmcp, so the session is left as
//!    it was: the same answer for another owner's session as for one that does not exist;
//! 3. a DELETE that rmcp accepted drops the binding; the bindings of sessions that ended
//!    otherwise (idle timeout, shutdown) are pruned whenever a new session is bound;
//! 4. every few seconds ([`spawn_recheck`]) each token's sessions are checked against the
//!    token: a revoked, expired or deleted token's sessions are closed (their event streams
//!    end) and unbound.
//!
//! Session ids are bearer capabilities for the session's stream: nothing here logs them, and
//! the `warren` binary drops rmcp's own log events, which carry them (`docs/logging.md`).
//!
//! [`SessionCounts`] caps how many sessions exist at once: per credential, per workspace and
//! in all; a [`SessionSlot`] lives exactly as long as its session's handler. A session's GET
//! event stream is bounded by these caps (rmcp serves one per session), not by the caps on
//! requests in flight.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::Response;
use rmcp::transport::common::http_header::HEADER_SESSION_ID;
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;

use super::MAX_SESSIONS_PER_WORKSPACE;
use crate::auth::{Principal, Via};
use crate::error::ApiError;

/// Who opened a session: its workspace and the credential that authenticated the
/// `initialize` (a token, or a local uid). Another token of the same workspace is another
/// owner: a leaked session id is no use without the token that opened it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(super) struct Owner {
    pub(super) workspace: String,
    via: Via,
}

impl Owner {
    pub(super) fn of(p: &Principal) -> Owner {
        Owner {
            workspace: p.workspace.clone(),
            via: p.via.clone(),
        }
    }
}

pub(super) fn unauthenticated() -> ApiError {
    ApiError::new(
        "unauthenticated",
        "the request carried no authenticated principal",
    )
}

/// The answer to a request naming a session the caller does not hold, whether it belongs to
/// someone else or does not exist.
fn no_session() -> ApiError {
    ApiError::new(
        "not_found",
        "no such MCP session for this caller; initialize a new one",
    )
}

/// Session id -> owner, for the sessions rmcp's manager holds.
#[derive(Debug)]
pub(super) struct Bindings {
    /// rmcp's session store, consulted only to prune the bindings of ended sessions.
    manager: Arc<LocalSessionManager>,
    /// Guards only this map; never held across an await.
    owners: Mutex<HashMap<String, Owner>>,
}

impl Bindings {
    pub(super) fn new(manager: Arc<LocalSessionManager>) -> Bindings {
        Bindings {
            manager,
            owners: Mutex::new(HashMap::new()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Owner>> {
        // Every update is one statement: the map stays consistent even after a panic.
        self.owners.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Binds a session rmcp just opened, dropping the bindings of sessions it no longer has.
    async fn bind(&self, id: String, owner: Owner) {
        let live = self.manager.sessions.read().await;
        let mut owners = self.lock();
        owners.retain(|k, _| live.contains_key(k.as_str()));
        owners.insert(id, owner);
    }

    fn holds(&self, id: &str, owner: &Owner) -> bool {
        self.lock().get(id) == Some(owner)
    }

    fn unbind(&self, id: &str) {
        self.lock().remove(id);
    }

    /// Ends every session whose credential no longer holds (a token revoked, expired or
    /// deleted since its `initialize`): rmcp closes it, which ends its GET event stream and
    /// its requests in flight, and the binding goes. A local caller's session always holds.
    /// The tokens are looked up in one task on the blocking pool (the database may be busy
    /// with a writer). Returns how many ended.
    pub(super) async fn end_lapsed(&self, service: &Arc<crate::service::Service>) -> usize {
        use rmcp::transport::streamable_http_server::session::SessionManager;
        let held: Vec<(String, String)> = self
            .lock()
            .iter()
            .filter_map(|(sid, o)| match &o.via {
                Via::Token { token_id } => Some((sid.clone(), token_id.clone())),
                Via::Local { .. } => None,
            })
            .collect();
        if held.is_empty() {
            return 0;
        }
        let mut tokens: Vec<String> = held.iter().map(|(_, t)| t.clone()).collect();
        tokens.sort();
        tokens.dedup();
        let svc = service.clone();
        let holds: HashMap<String, bool> = match tokio::task::spawn_blocking(move || {
            tokens
                .into_iter()
                .map(|t| {
                    let ok = match svc.credentials().recheck_token(&t) {
                        Ok(()) => true,
                        // Only a credential known to have lapsed ends its sessions: a
                        // database that is busy now says nothing about the token.
                        Err(e) if e.code == "unauthenticated" => false,
                        Err(e) => {
                            tracing::warn!(error = %e, "rechecking an MCP session's token failed; checked again next round");
                            true
                        }
                    };
                    (t, ok)
                })
                .collect()
        })
        .await
        {
            Ok(h) => h,
            Err(e) => {
                tracing::warn!(error = %e, "rechecking MCP sessions' tokens failed; checked again next round");
                return 0;
            }
        };
        let mut ended = 0;
        for (sid, token) in held {
            let ok = holds.get(&token).copied().unwrap_or(true);
            if ok {
                continue;
            }
            self.unbind(&sid);
            let id: Arc<str> = sid.into();
            // A session whose worker does not answer must not hold up the other sessions'
            // closes (it is unbound already: no request reaches it any more).
            match tokio::time::timeout(CLOSE_WAIT, self.manager.close_session(&id)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "closing an MCP session of a lapsed credential failed")
                }
                Err(_) => tracing::warn!(
                    "closing an MCP session of a lapsed credential took over {CLOSE_WAIT:?}; left to end on its own"
                ),
            }
            ended += 1;
        }
        if ended > 0 {
            tracing::info!(
                ended,
                "MCP sessions of revoked or expired credentials closed"
            );
        }
        ended
    }

    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.lock().len()
    }
}

/// How long one session's close may take before the recheck goes on without it.
const CLOSE_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Ends the sessions of lapsed credentials ([`Bindings::end_lapsed`]) every
/// [`crate::ws::RECHECK`], as long as `bindings` lives (the router that holds them): a
/// revoked token's open event stream closes within that, as a guest stream's does.
pub(super) fn spawn_recheck(bindings: &Arc<Bindings>, service: Arc<crate::service::Service>) {
    let weak = Arc::downgrade(bindings);
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(crate::ws::RECHECK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let Some(b) = weak.upgrade() else {
                return;
            };
            // Each round a task of its own: one that panics is logged, and the next runs.
            let service = service.clone();
            let round = tokio::spawn(async move { b.end_lapsed(&service).await });
            if let Err(e) = round.await {
                tracing::error!(error = %e, "an MCP session recheck round failed");
            }
        }
    });
}

/// The middleware: see the module docs. Needs the [`Principal`] that [`crate::http`]'s
/// authentication attached; a request without one is refused `401`.
pub(super) async fn bind(State(b): State<Arc<Bindings>>, req: Request, next: Next) -> Response {
    let Some(owner) = req.extensions().get::<Principal>().map(Owner::of) else {
        return crate::http::error_response(&unauthenticated());
    };
    let mut named = req.headers().get_all(HEADER_SESSION_ID).iter();
    let (first, more) = (named.next(), named.next().is_some());
    let Some(value) = first else {
        let resp = next.run(req).await;
        let opened = resp
            .headers()
            .get(HEADER_SESSION_ID)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        if let Some(id) = opened {
            b.bind(id, owner).await;
        }
        return resp;
    };
    if more {
        return crate::http::error_response(&ApiError::invalid(
            "a request names at most one Mcp-Session-Id",
        ));
    }
    let id = value.to_str().ok().map(str::to_string);
    let Some(id) = id.filter(|id| b.holds(id, &owner)) else {
        tracing::info!(
            workspace = %owner.workspace,
            method = %req.method(),
            "MCP request naming a session the caller does not hold refused"
        );
        return crate::http::error_response(&no_session());
    };
    let delete = req.method() == http::Method::DELETE;
    let resp = next.run(req).await;
    if delete && resp.status().is_success() {
        b.unbind(&id);
    }
    resp
}

/// How many sessions may exist at once.
#[derive(Debug, Clone, Copy)]
pub(super) struct SessionLimits {
    pub(super) total: usize,
    pub(super) per_token: usize,
    pub(super) per_workspace: usize,
}

impl SessionLimits {
    pub(super) fn from_config(h: &crate::config::HttpConfig) -> SessionLimits {
        SessionLimits {
            total: h.max_mcp_sessions,
            per_token: h.max_mcp_sessions_per_token,
            per_workspace: MAX_SESSIONS_PER_WORKSPACE,
        }
    }
}

/// Live sessions per workspace, per owner and in all.
#[derive(Debug)]
pub(super) struct SessionCounts {
    limits: SessionLimits,
    /// Whom a local uid counts as.
    subordinates: crate::subuid::Subordinates,
    /// Guards only the counts; never held across an await.
    held: Mutex<Held>,
}

/// Entries at zero are removed.
#[derive(Debug, Default)]
struct Held {
    total: usize,
    per_workspace: HashMap<String, usize>,
    per_owner: HashMap<Owner, usize>,
}

fn decrement<K: std::hash::Hash + Eq>(map: &mut HashMap<K, usize>, k: &K) {
    if let Some(n) = map.get_mut(k) {
        *n = n.saturating_sub(1);
        if *n == 0 {
            map.remove(k);
        }
    }
}

impl Default for SessionCounts {
    fn default() -> Self {
        SessionCounts::new(SessionLimits::from_config(
            &crate::config::HttpConfig::default(),
        ))
    }
}

impl SessionCounts {
    pub(super) fn new(limits: SessionLimits) -> SessionCounts {
        SessionCounts {
            limits,
            subordinates: crate::subuid::Subordinates::shared(),
            held: Mutex::new(Held::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Held> {
        // The counts stay consistent even if a holder panicked: every update completes
        // without a panic point in between.
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Counts one more session for `owner`, unless it, its workspace or the service already
    /// holds the maximum.
    pub(super) fn claim(self: &Arc<Self>, owner: Owner) -> Result<SessionSlot, ApiError> {
        // A subordinate uid's sessions count under the user owning its range.
        let counted = Owner {
            workspace: crate::auth::counted_workspace(&owner.workspace, &self.subordinates),
            via: crate::auth::counted_via(&owner.via, &self.subordinates),
        };
        let mut held = self.lock();
        let l = self.limits;
        let workspace = &counted.workspace;
        let in_ws = held.per_workspace.get(workspace).copied().unwrap_or(0);
        let of_owner = held.per_owner.get(&counted).copied().unwrap_or(0);
        let refusal = if of_owner >= l.per_token {
            Some(format!(
                "this credential already holds {} MCP sessions",
                l.per_token
            ))
        } else if in_ws >= l.per_workspace {
            Some(format!(
                "workspace {workspace} already holds {} MCP sessions",
                l.per_workspace
            ))
        } else if held.total >= l.total {
            Some(format!(
                "the service already holds {} MCP sessions, its maximum",
                l.total
            ))
        } else {
            None
        };
        if let Some(m) = refusal {
            return Err(ApiError::new(
                "quota_exceeded",
                format!("{m}; close some (HTTP DELETE) or let them expire"),
            ));
        }
        held.total += 1;
        *held.per_workspace.entry(workspace.clone()).or_insert(0) += 1;
        *held.per_owner.entry(counted.clone()).or_insert(0) += 1;
        Ok(SessionSlot {
            counts: self.clone(),
            owner,
            counted,
        })
    }

    #[cfg(test)]
    pub(super) fn held(&self, workspace: &str) -> usize {
        self.lock()
            .per_workspace
            .get(workspace)
            .copied()
            .unwrap_or(0)
    }

    #[cfg(test)]
    fn is_empty(&self) -> bool {
        let h = self.lock();
        h.total == 0 && h.per_workspace.is_empty() && h.per_owner.is_empty()
    }
}

/// One session's place in [`SessionCounts`], released when the session's handler is dropped
/// (rmcp drops it when the session ends, however it ends).
#[derive(Debug)]
pub(super) struct SessionSlot {
    counts: Arc<SessionCounts>,
    /// Who initialized the session and alone may use it.
    pub(super) owner: Owner,
    /// Whom it counts under (a subordinate uid's owner).
    counted: Owner,
}

impl Drop for SessionSlot {
    fn drop(&mut self) {
        let mut held = self.counts.lock();
        held.total = held.total.saturating_sub(1);
        decrement(&mut held.per_workspace, &self.counted.workspace);
        decrement(&mut held.per_owner, &self.counted);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn owner(workspace: &str, token: &str) -> Owner {
        Owner {
            workspace: workspace.into(),
            via: Via::Token {
                token_id: token.into(),
            },
        }
    }

    #[test]
    fn test_owner_differs_by_workspace_and_by_credential() {
        let a = owner("ws-a", "t1");
        assert_eq!(a, owner("ws-a", "t1"));
        assert_ne!(a, owner("ws-b", "t1"));
        assert_ne!(a, owner("ws-a", "t2"));
        let local = Owner {
            workspace: "ws-a".into(),
            via: Via::Local { uid: 0 },
        };
        assert_ne!(a, local);
    }

    #[test]
    fn test_session_counts_over_limit_refused_and_released_on_drop() {
        let counts = Arc::new(SessionCounts::new(SessionLimits {
            total: 1000,
            per_token: 1000,
            per_workspace: MAX_SESSIONS_PER_WORKSPACE,
        }));
        let slots: Vec<_> = (0..MAX_SESSIONS_PER_WORKSPACE)
            .map(|i| {
                counts
                    .claim(owner("ws-a", &format!("t{}", i % 4)))
                    .expect("under the limit")
            })
            .collect();
        let refused = counts
            .claim(owner("ws-a", "another token"))
            .expect_err("at the limit, whichever token asks");
        assert_eq!(refused.code, "quota_exceeded");
        // Other workspaces are unaffected.
        let other = counts.claim(owner("ws-b", "t")).expect("another workspace");
        drop(slots);
        assert_eq!(counts.held("ws-a"), 0);
        assert_eq!(counts.held("ws-b"), 1);
        drop(other);
        assert!(counts.is_empty());
    }

    #[test]
    fn test_session_counts_per_token_and_total_caps() {
        let counts = Arc::new(SessionCounts::new(SessionLimits {
            total: 3,
            per_token: 2,
            per_workspace: 64,
        }));
        let a1 = counts.claim(owner("ws-a", "t1")).expect("first");
        let a2 = counts.claim(owner("ws-a", "t1")).expect("second");
        let e = counts
            .claim(owner("ws-a", "t1"))
            .expect_err("over the per-token cap");
        assert!(e.message.contains("credential"), "{e}");
        // Control: another token of the same workspace is served, up to the total.
        let b = counts.claim(owner("ws-a", "t2")).expect("another token");
        let e = counts
            .claim(owner("ws-b", "t3"))
            .expect_err("over the total cap");
        assert_eq!(e.code, "quota_exceeded");
        assert!(e.message.contains("service"), "{e}");
        drop(a1);
        let _c = counts.claim(owner("ws-b", "t3")).expect("released");
        drop((a2, b));
    }

    /// Subordinate uids of one user share that user's session caps, per credential and per
    /// workspace, and give their places back under it (found by a hostile review: 32 such
    /// uids held all of the service's sessions). Control: another user has caps of its own.
    #[test]
    fn test_subordinate_uids_share_their_owners_session_caps() {
        let mut counts = SessionCounts::new(SessionLimits {
            total: 100,
            per_token: 2,
            per_workspace: 3,
        });
        counts.subordinates = crate::subuid::Subordinates::fixed(vec![(100_000, 65_536, 1000)]);
        let counts = Arc::new(counts);
        let local = |uid: u32| Owner::of(&Principal::local(uid));
        let a = counts.claim(local(100_001)).expect("first");
        let b = counts.claim(local(100_002)).expect("second");
        let e = counts
            .claim(local(100_003))
            .expect_err("over the owner's per-credential cap");
        assert!(e.message.contains("credential"), "{e}");
        assert_eq!(counts.held("local-1000"), 2);
        assert_eq!(counts.held("local-100001"), 0);
        // The binding stays the exact uid's: only the count is the owner's.
        assert_eq!(a.owner, local(100_001));
        let _c = counts.claim(local(2000)).expect("another user");
        drop((a, b));
        assert_eq!(counts.held("local-1000"), 0);
        let _d = counts.claim(local(1000)).expect("released under the owner");
    }
}
