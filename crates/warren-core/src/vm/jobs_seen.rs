//! The jobs of a VM as the host last saw them, so a status call on a suspended VM answers
//! without waking it.
//!
//! Just before a running VM is paused or hibernated ([`Warren::suspend_vm`]), the engine
//! asks its guest for the job list and each job's state and retained byte counts (at most
//! the 256 records the guest keeps, 8 calls at a time, within [`RECORD_LIMIT`]) and writes
//! them to `jobs-seen.json` in the VM directory (root's), through a temporary file and a
//! rename. The record of an earlier suspension is removed first, so an answer never comes
//! from an older one; a record that could not be made leaves none. A VM paused and then
//! hibernated keeps its pause's record (its jobs were frozen in between); a fresh boot
//! removes it (its jobs are gone).
//!
//! [`Warren::job_status`] answers from the guest while the VM runs, and from this record
//! (marked stale, with the VM's state and the time it was seen) while it is suspended. It
//! never wakes the VM and never counts as activity.

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use warren_protocol::{GuestResponse, HostRequest, JobId, JobOutput, JobOutputRequest, JobState};
use warren_supervisor::{SupervisorClient, VmDir};

use super::{now_unix, unexpected, Warren};
use crate::error::CoreError;
use crate::store::VmState;

/// How long recording the jobs may delay a suspension; past it, no record is made.
pub const RECORD_LIMIT: Duration = Duration::from_secs(10);
/// Guest calls in flight at once while recording.
const RECORD_CONCURRENCY: usize = 8;
/// How long a forced suspension waits for the job list before going on without a record.
const FORCED_LIST_LIMIT: Duration = Duration::from_secs(5);

/// One job as last seen.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SeenJob {
    pub job_id: String,
    pub state: JobState,
    pub stdout_retained: u64,
    pub stderr_retained: u64,
    pub truncated: bool,
    /// Processes the job had left running after its main process exited (frozen with the
    /// VM). Records made before background processes existed read as 0.
    #[serde(default)]
    pub background_processes: u32,
    /// No more output could come when it was seen.
    #[serde(default)]
    pub output_complete: bool,
}

impl SeenJob {
    fn from_output(job: JobId, o: &JobOutput) -> SeenJob {
        SeenJob {
            job_id: job.to_string(),
            state: o.state,
            stdout_retained: o.stdout_retained,
            stderr_retained: o.stderr_retained,
            truncated: o.truncated,
            background_processes: o.background_processes,
            output_complete: o.output_complete,
        }
    }
}

/// The record written before a suspension.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SeenJobs {
    /// When the jobs were seen (host clock, seconds).
    pub seen_unix: u64,
    pub jobs: Vec<SeenJob>,
}

/// A job's status and where it comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobStatusView {
    pub job: SeenJob,
    /// The VM's state when the call was answered.
    pub vm_state: VmState,
    /// Answered from the record made when the VM was suspended, not from the guest.
    pub stale: bool,
    /// When that record was made (only when `stale`).
    pub seen_unix: Option<u64>,
}

/// Where the record of `dir`'s VM lives.
pub fn path(dir: &VmDir) -> PathBuf {
    dir.path().join("jobs-seen.json")
}

/// The record of `dir`'s VM, if one was made (an unreadable one counts as none).
pub fn read(dir: &VmDir) -> Option<SeenJobs> {
    let b = std::fs::read(path(dir)).ok()?;
    serde_json::from_slice(&b).ok()
}

fn write(dir: &VmDir, seen: &SeenJobs) -> std::io::Result<()> {
    let tmp = dir.path().join("jobs-seen.json.tmp");
    let body = serde_json::to_vec(seen).expect("invariant: the record serialises");
    // Owner-only: job ids and commands are the workspace's business.
    std::io::Write::write_all(
        &mut warren_vmm::sys::private_file::create(&tmp, false)?,
        &body,
    )?;
    std::fs::rename(&tmp, path(dir))
}

/// A status read of one job: no output, no waiting.
fn peek(job: JobId) -> HostRequest {
    HostRequest::JobOutput(JobOutputRequest {
        job,
        stdout_cursor: 0,
        stderr_cursor: 0,
        max_bytes: 0,
        wait_ms: 0,
    })
}

impl Warren {
    /// The jobs as the host last saw them before `id`'s suspension, if it recorded them.
    pub fn jobs_seen(&self, id: &str) -> Option<SeenJobs> {
        read(&self.vm_dir(id))
    }

    /// A job's status without waking the VM or counting as activity: from the guest while
    /// the VM runs, from the record made before its suspension while it is paused,
    /// hibernating, hibernated or resuming (a job frozen while it ran reports `running`).
    /// A suspended VM without a record is `conflict`; a job the record does not hold is
    /// `not_found`.
    pub async fn job_status(&self, id: &str, job: JobId) -> Result<JobStatusView, CoreError> {
        let rec = self.get_vm(id)?;
        match rec.state {
            VmState::Running => {
                let client = self.client(id)?;
                match client.guest(peek(job)).await? {
                    GuestResponse::JobOutput(o) => Ok(JobStatusView {
                        job: SeenJob::from_output(job, &o),
                        vm_state: VmState::Running,
                        stale: false,
                        seen_unix: None,
                    }),
                    _ => Err(unexpected()),
                }
            }
            VmState::Paused | VmState::Hibernating | VmState::Hibernated | VmState::Resuming => {
                let Some(seen) = read(&self.vm_dir(id)) else {
                    return Err(CoreError::VmNotRunning {
                        id: rec.id,
                        state: rec.state.as_str().to_string(),
                        reason: Some(
                            "no job states were recorded when it was suspended; \
                             vm_job_output wakes it"
                                .into(),
                        ),
                    });
                };
                let want = job.to_string();
                let found = seen.jobs.into_iter().find(|j| j.job_id == want);
                let job = found.ok_or_else(|| {
                    CoreError::JobNotFound(format!(
                        "no job {want} among the jobs of {id} when it was suspended"
                    ))
                })?;
                Ok(JobStatusView {
                    job,
                    vm_state: rec.state,
                    stale: true,
                    seen_unix: Some(seen.seen_unix),
                })
            }
            s => Err(CoreError::VmNotRunning {
                id: rec.id,
                state: s.as_str().to_string(),
                reason: rec.reason,
            }),
        }
    }

    /// The job list of a running VM about to be suspended: errors are the caller's unless
    /// `force` (then a list that fails or takes longer than [`FORCED_LIST_LIMIT`] is none).
    pub(super) async fn jobs_before_suspend(
        &self,
        id: &str,
        force: bool,
    ) -> Result<Option<Vec<warren_protocol::JobSummary>>, CoreError> {
        if !force {
            return self.job_list(id).await.map(Some);
        }
        match tokio::time::timeout(FORCED_LIST_LIMIT, self.job_list(id)).await {
            Ok(Ok(list)) => Ok(Some(list)),
            Ok(Err(e)) => {
                tracing::warn!(vm = %id, error = %e, "no job list before a forced suspension");
                Ok(None)
            }
            Err(_) => {
                tracing::warn!(vm = %id, "the job list timed out before a forced suspension");
                Ok(None)
            }
        }
    }

    /// Records `list` (with each job's byte counts) as the jobs last seen; best effort: a
    /// record that cannot be made within [`RECORD_LIMIT`] leaves none.
    pub(super) async fn record_jobs_seen(
        &self,
        id: &str,
        list: Option<&[warren_protocol::JobSummary]>,
    ) {
        let dir = self.vm_dir(id);
        match std::fs::remove_file(path(&dir)) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                tracing::warn!(vm = %id, error = %e, "removing the jobs last seen failed");
                return;
            }
        }
        let Some(list) = list else {
            return;
        };
        let socket = dir.socket();
        let seen = tokio::time::timeout(RECORD_LIMIT, seen_jobs(socket, list)).await;
        let jobs = match seen {
            Ok(Ok(jobs)) => jobs,
            Ok(Err(e)) => {
                tracing::warn!(vm = %id, error = %e, "recording the jobs before a suspension failed");
                return;
            }
            Err(_) => {
                tracing::warn!(vm = %id, "recording the jobs before a suspension timed out");
                return;
            }
        };
        let record = SeenJobs {
            seen_unix: now_unix(),
            jobs,
        };
        if let Err(e) = write(&dir, &record) {
            tracing::warn!(vm = %id, error = %e, "writing the jobs last seen failed");
        }
    }
}

/// Each listed job's status from the guest, in list order.
async fn seen_jobs(
    socket: PathBuf,
    list: &[warren_protocol::JobSummary],
) -> Result<Vec<SeenJob>, CoreError> {
    let mut out = Vec::with_capacity(list.len());
    for chunk in list.chunks(RECORD_CONCURRENCY) {
        let mut asked = tokio::task::JoinSet::new();
        for (i, j) in chunk.iter().enumerate() {
            let (client, job) = (SupervisorClient::new(&socket), j.id);
            asked.spawn(async move { (i, job, client.guest(peek(job)).await) });
        }
        let mut got = Vec::with_capacity(chunk.len());
        while let Some(joined) = asked.join_next().await {
            let (i, job, answer) = joined.map_err(|_| unexpected())?;
            match answer? {
                GuestResponse::JobOutput(o) => got.push((i, SeenJob::from_output(job, &o))),
                _ => return Err(unexpected()),
            }
        }
        got.sort_by_key(|(i, _)| *i);
        out.extend(got.into_iter().map(|(_, j)| j));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_jobs_seen_record_round_trips_and_garbage_is_none() {
        let d = tempfile::tempdir().expect("tempdir");
        let dir = VmDir(d.path().to_path_buf());
        assert!(read(&dir).is_none(), "no record yet");
        let seen = SeenJobs {
            seen_unix: 7,
            jobs: vec![SeenJob {
                job_id: "j-1".into(),
                state: JobState::Running,
                stdout_retained: 3,
                stderr_retained: 0,
                truncated: false,
                background_processes: 1,
                output_complete: false,
            }],
        };
        write(&dir, &seen).expect("write");
        assert_eq!(read(&dir), Some(seen));
        std::fs::write(path(&dir), b"{not json").expect("garbage");
        assert!(read(&dir).is_none(), "an unreadable record is none");
    }
}
