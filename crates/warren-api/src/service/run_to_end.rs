//! Calls that run to their end when their client leaves ([`Service::call_to_end`]): which
//! tools, the task each runs in, and the stop's wait for them.

use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;

use super::Service;
use crate::auth::Principal;
use crate::caps::is_long_poll;
use crate::error::ApiError;

/// Tools whose host-side steps must not be cut half-way: a call of one runs to its end when
/// its client leaves ([`Service::call_to_end`]). A cut-off create, fork or session call left
/// a `creating` record, a template's build VM running outside every workspace or copies
/// half-made; a cut-off session status, export or delete left the session's VM paused with
/// its jobs frozen (`with_guest_stopped`).
pub(super) const RUN_TO_END: &[&str] = &[
    "vm_create",
    "vm_fork",
    "vm_destroy",
    "vm_suspend",
    "vm_resume",
    "session_create",
    "session_status",
    "session_export",
    "session_delete",
];

/// Tools that change state in one guest request, which the guest finishes once it has it
/// (`warren-guest::session`): a call cut off before that changed nothing, and one with a
/// `request_id` (`vm_exec`) finds its job again. They end with their client: a guest that
/// stalls its channel would otherwise have every abandoned call hold its caller's request
/// slot until its deadline (up to two minutes), locking the token out of its other VMs.
#[cfg(test)]
const GUEST_FINISHES: &[&str] = &["vm_exec", "vm_job_cancel", "vm_write_file", "vm_edit_file"];

/// Tools that only read: a call of one ends with its client.
#[cfg(test)]
const READS: &[&str] = &[
    "vm_list",
    "vm_status",
    "vm_job_status",
    "vm_job_output",
    "vm_read_file",
    "vm_glob",
    "vm_grep",
    "pool_status",
    "session_list",
];

/// One call running to its end, counted in [`Service::detached`] while it lives.
struct Detached(tokio::sync::watch::Sender<usize>);

impl Drop for Detached {
    fn drop(&mut self) {
        self.0.send_modify(|n| *n = n.saturating_sub(1));
    }
}

impl Service {
    /// Runs one tool for `p`; both transports call this and nothing else. A tool of
    /// `RUN_TO_END` runs to its end even when the caller goes away first: dropping
    /// the returned future (the client disconnected) leaves the call running in a task of its
    /// own, holding `held` (the request's place under its caller's cap), so nothing is left
    /// half-done (a create, a fork or a session cut off mid-way used to leave a `creating`
    /// record, a template's build VM running outside every workspace, or copies half-made). A
    /// retry with the same `request_id` meanwhile answers `busy`, then the recorded outcome.
    /// The others end with their caller.
    pub async fn call_to_end(
        self: &Arc<Self>,
        p: &Principal,
        tool: &str,
        args: Value,
        held: crate::caps::HeldSlot,
    ) -> Result<Value, ApiError> {
        if !RUN_TO_END.contains(&tool) || is_long_poll(tool, &args) {
            // Its place goes with the response (which the HTTP middleware holds too), not
            // with a handler the transport keeps running after a hang-up.
            drop(held);
            return self.call(p, tool, args).await;
        }
        // Calls outliving their connections are capped for the whole service, as connections
        // are: at most `max_connections` of them at once.
        let max = self.cfg.http.max_connections;
        let mut admitted = false;
        self.detached.send_if_modified(|n| {
            admitted = *n < max;
            *n += usize::from(admitted);
            admitted
        });
        if !admitted {
            return Err(ApiError::new(
                "quota_exceeded",
                format!(
                    "the service already runs {max} calls that change state; retry when one ends"
                ),
            ));
        }
        let counted = Detached(self.detached.clone());
        let (service, p, tool) = (self.clone(), p.clone(), tool.to_string());
        let task = tokio::spawn(async move {
            let _held = (held, counted);
            service.call(&p, &tool, args).await
        });
        match task.await {
            Ok(r) => r,
            Err(e) => {
                tracing::error!(error = %e, "a tool call's task failed");
                Err(ApiError::internal("the call failed inside the service"))
            }
        }
    }

    /// Waits, at most `limit`, for the calls running to their end; returns how many still
    /// run (cut when the process exits).
    pub async fn wait_for_detached(&self, limit: Duration) -> usize {
        let mut rx = self.detached.subscribe();
        let _ = tokio::time::timeout(limit, rx.wait_for(|n| *n == 0)).await;
        let left = *rx.borrow();
        left
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_every_tool_is_either_run_to_its_end_or_a_read() {
        let mut named: Vec<&str> = RUN_TO_END
            .iter()
            .chain(GUEST_FINISHES)
            .chain(READS)
            .copied()
            .collect();
        named.sort_unstable();
        let mut tools: Vec<&str> = super::super::tool_defs::tool_defs(&[])
            .iter()
            .map(|t| t.name)
            .collect();
        tools.sort_unstable();
        assert_eq!(named, tools, "a new tool must be classed in run_to_end.rs");
    }
}
