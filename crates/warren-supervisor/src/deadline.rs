//! Deadlines for every call that crosses a process boundary: supervisor -> guest agent (one
//! HTTP/2 stream per call, [`guest_limit`]) and client -> supervisor (one connection per
//! request, [`client_limit`]).
//!
//! A guest or VMM that stops answering fails only the calls made to it, each after the
//! limit of its kind, never the other VMs' calls (every VM has its own supervisor, and the
//! engine waits on each one separately). A deadline only ends the waiting call: the request's
//! HTTP/2 stream is reset, which abandons the guest's work for that request (a long-poll,
//! a file read), but a job the guest already started keeps running, and so does the VM.
//!
//! Limits are per call kind, fixed, and generous: a healthy guest answers in milliseconds,
//! even under TCG on a loaded host; what needs longer (long-polls, interactive input,
//! searches, checkpoints) has its own bound. The client's limit for a request is the
//! supervisor's own bound for the work behind it plus [`CLIENT_MARGIN`], so a supervisor
//! that answers in time is never cut off by its client, and one that is itself stuck still
//! fails the call.

use std::time::Duration;

use warren_protocol::limits::MAX_OUTPUT_WAIT_MS;
use warren_protocol::{HostRequest, JobOutputAcked};

use crate::proto::SupervisorRequest;

/// Control calls: start, cancel, list, resize, ping, session setup.
pub const CONTROL_LIMIT: Duration = Duration::from_secs(20);
/// One file chunk or a versioned read, write or edit (at most `MAX_VERSIONED_FILE` bytes
/// hashed and written atomically).
pub const FILE_LIMIT: Duration = Duration::from_secs(60);
/// `Freeze`, `Thaw` and `PowerOff`: the guest freezes or thaws every job's cgroup and
/// revalidates its shares.
pub const LIFECYCLE_LIMIT: Duration = Duration::from_secs(120);
/// `Glob` and `Grep`: a bounded walk of `/workspace` (`MAX_SEARCH_ENTRIES`, `MAX_GREP_BYTES`).
pub const SEARCH_LIMIT: Duration = Duration::from_secs(120);
/// Beyond a long-poll's own wait (`JobOutput`'s `wait_ms`, capped at `MAX_OUTPUT_WAIT_MS`).
pub const LONG_POLL_SLACK: Duration = CONTROL_LIMIT;
/// `JobInput` to an interactive job: answered once the job's terminal or pipe took the
/// bytes, so a job that does not read its input for this long fails the write (not the job).
pub const INTERACTIVE_LIMIT: Duration = Duration::from_secs(600);
/// `Bench`, `Discard` and `Source`: the measurement and throughput probes of `warren bench`.
pub const STREAM_LIMIT: Duration = Duration::from_secs(600);

/// How long a request waits for a (re)connecting channel before it is refused.
pub const RECONNECT_WAIT: Duration = Duration::from_secs(30);
/// The longest a checkpoint save or restore may take.
pub const MIGRATION_LIMIT: Duration = Duration::from_secs(600);
/// Requests the supervisor answers from its own state (`Status`, `Stop`).
pub const LOCAL_LIMIT: Duration = Duration::from_secs(10);
/// What a client allows on top of the supervisor's own bound (scheduling on a loaded host).
pub const CLIENT_MARGIN: Duration = Duration::from_secs(10);
/// `Pause` and `Resume`: waiting for the lifecycle lock, the channel, `Freeze` or `Thaw`,
/// and a few QMP commands (each bounded by `warren_vmm::qemu::qmp::REPLY_LIMIT`).
pub const SUSPEND_LIMIT: Duration = Duration::from_secs(300);
/// `Hibernate`: a suspension plus a migration to disk and its fsync.
pub const HIBERNATE_LIMIT: Duration = Duration::from_secs(300 + 600);

/// The deadline of one supervisor -> guest call.
pub fn guest_limit(req: &HostRequest) -> Duration {
    match req {
        HostRequest::Hello(_)
        | HostRequest::Auth(_)
        | HostRequest::Ping
        | HostRequest::ExecStart(_)
        | HostRequest::ExecBroker(_)
        | HostRequest::ExecInteractive(_)
        | HostRequest::JobCancel(_)
        | HostRequest::JobList
        | HostRequest::JobResize(_)
        | HostRequest::InstallCa(_) => CONTROL_LIMIT,
        HostRequest::FileRead(_)
        | HostRequest::FileWrite(_)
        | HostRequest::ReadVersioned(_)
        | HostRequest::WriteChecked(_)
        | HostRequest::Edit(_) => FILE_LIMIT,
        HostRequest::Freeze
        | HostRequest::Thaw(_)
        | HostRequest::Rekey(_)
        | HostRequest::PowerOff => LIFECYCLE_LIMIT,
        HostRequest::Glob(_) | HostRequest::Grep(_) => SEARCH_LIMIT,
        HostRequest::JobOutput(r) | HostRequest::JobOutputAcked(JobOutputAcked { read: r, .. }) => {
            Duration::from_millis(u64::from(r.wait_ms.min(MAX_OUTPUT_WAIT_MS))) + LONG_POLL_SLACK
        }
        HostRequest::JobInput(_) => INTERACTIVE_LIMIT,
        HostRequest::Bench(_) | HostRequest::Discard(_) | HostRequest::Source(_) => STREAM_LIMIT,
    }
}

/// The deadline of one client -> supervisor request, from connecting to the reply.
pub fn client_limit(req: &SupervisorRequest) -> Duration {
    let work = match req {
        SupervisorRequest::Status | SupervisorRequest::Stop => LOCAL_LIMIT,
        SupervisorRequest::WaitReady { timeout_ms } => {
            Duration::from_millis((*timeout_ms).min(crate::proto::MAX_WAIT_READY_MS))
        }
        SupervisorRequest::Guest(r) => RECONNECT_WAIT + guest_limit(r),
        SupervisorRequest::Pause | SupervisorRequest::Resume | SupervisorRequest::ForkRelease => {
            SUSPEND_LIMIT
        }
        SupervisorRequest::Hibernate
        | SupervisorRequest::ForkSave { .. }
        | SupervisorRequest::ForkSaveHeld { .. } => HIBERNATE_LIMIT,
        // Until the stream is open; the open stream itself has no deadline.
        SupervisorRequest::OpenStream(_) | SupervisorRequest::ChannelPing => {
            RECONNECT_WAIT + CONTROL_LIMIT
        }
    };
    work + CLIENT_MARGIN
}

#[cfg(test)]
mod tests {
    use super::*;
    use warren_protocol::{JobId, JobOutputRequest};

    fn output(wait_ms: u32) -> HostRequest {
        HostRequest::JobOutput(JobOutputRequest {
            job: JobId(1),
            stdout_cursor: 0,
            stderr_cursor: 0,
            max_bytes: 1,
            wait_ms,
        })
    }

    #[test]
    fn test_guest_limit_long_poll_outlasts_its_capped_wait() {
        assert_eq!(guest_limit(&output(0)), LONG_POLL_SLACK);
        assert_eq!(
            guest_limit(&output(u32::MAX)),
            Duration::from_millis(u64::from(MAX_OUTPUT_WAIT_MS)) + LONG_POLL_SLACK
        );
        assert!(guest_limit(&output(5_000)) > Duration::from_secs(5));
    }

    #[test]
    fn test_client_limit_covers_the_supervisor_side_bound() {
        for r in [HostRequest::Ping, output(30_000), HostRequest::Freeze] {
            let g = guest_limit(&r);
            assert!(client_limit(&SupervisorRequest::Guest(r)) > RECONNECT_WAIT + g);
        }
        assert!(client_limit(&SupervisorRequest::Hibernate) > MIGRATION_LIMIT);
        let wait = SupervisorRequest::WaitReady {
            timeout_ms: 125_000,
        };
        assert!(client_limit(&wait) > Duration::from_secs(125));
    }
}
