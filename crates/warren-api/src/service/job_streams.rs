//! Job streams for a caller (`crate::job_ws`): a job's live output, and the terminal of an
//! interactive job (input, window size, output). Every refusal comes before the WebSocket
//! upgrade: the VM is the caller's (404), a place under the stream quotas (409 `busy`), then
//! the job exists in the guest and the cursors lie within its output (404, 400).
//!
//! A terminal has one attachment at a time: a newer one replaces the older (which is closed
//! with 1001 `replaced by another attachment`), so a client whose connection broke reattaches
//! at once instead of waiting for the service to notice the old connection is dead.

use warren_protocol::WindowSize;

use super::*;
use crate::streams::Ticket;

/// An attached broker pipe, admitted under the stream quotas.
pub struct BrokerOpen {
    pub vm_id: String,
    pub job: JobId,
    pub ticket: Ticket,
    pub attachment: crate::broker::Attachment,
}

/// A job stream admitted under the quotas.
pub struct JobStream {
    pub vm_id: String,
    pub job: JobId,
    pub ticket: Ticket,
}

impl Service {
    /// Admits a job stream of the caller's VM `vm_id` reading from `at` (waking a suspended
    /// VM); `terminal` makes it the job's one terminal attachment.
    pub async fn open_job_stream(
        &self,
        p: &Principal,
        vm_id: &str,
        job: JobId,
        at: Cursor,
        terminal: bool,
    ) -> Result<JobStream, ApiError> {
        let rec = self.owned(p, vm_id, None)?;
        let key = format!("{}/{job}", rec.id);
        let ticket = if terminal {
            // The holder is replaced only once the newcomer is known to be valid.
            self.streams.check_exclusive(&p.workspace, &rec.id, &key)?;
            self.probe(&rec.id, job, at).await?;
            self.streams.admit_exclusive(&p.workspace, &rec.id, &key)?
        } else {
            let ticket = self.streams.admit(&p.workspace, &rec.id)?;
            self.probe(&rec.id, job, at).await?;
            ticket
        };
        Ok(JobStream {
            vm_id: rec.id,
            job,
            ticket,
        })
    }

    /// The service's broker pipes.
    pub fn broker_pipes(&self) -> &crate::broker::Pipes {
        &self.pipes
    }

    /// Registers the broker pipe `vm_exec` started for `job` in the VM's generation
    /// `generation` (the one `Warren::exec_broker` saw the job start in). A pipe is otherwise
    /// forgotten only when a controller finds its job gone (or the VM is destroyed), so one
    /// never attached would stay for the VM's life: once the VM has more pipes than jobs can
    /// hold processes at once (`MAX_LIVE_JOBS`), those whose jobs are gone are swept.
    pub(crate) async fn register_pipe(
        &self,
        workspace: &str,
        vm: &str,
        generation: u64,
        job: JobId,
        token: &str,
    ) {
        self.pipes.register(workspace, vm, generation, job, token);
        let jobs = self.pipes.jobs_of(vm);
        if jobs.len() <= warren_protocol::limits::MAX_LIVE_JOBS {
            return;
        }
        for other in jobs.into_iter().filter(|&j| j != job) {
            if self.broker_job_done(vm, other).await {
                self.pipes.remove(vm, other);
            }
        }
    }

    /// Attaches the controller holding `token` to job `job`'s broker pipe (see
    /// `crate::broker` for the refusals), waking a suspended VM; a pipe whose job's
    /// processes are all gone is forgotten and refused, and so is one whose boot the wake
    /// ended (the VM booted fresh: the generation moved).
    pub async fn open_broker(
        &self,
        p: &Principal,
        vm_id: &str,
        job: JobId,
        token: &str,
    ) -> Result<BrokerOpen, ApiError> {
        let rec = self.owned(p, vm_id, None)?;
        let attachment = self
            .pipes
            .attach(&p.workspace, &rec.id, rec.generation, job, token)?;
        let ticket = self.streams.admit(&p.workspace, &rec.id)?;
        let done = self.broker_job_done(&rec.id, job).await;
        let not_found = || ApiError::new("not_found", format!("no broker pipe for job {job}"));
        // The answer is about whichever boot gave it.
        if self.warren.get_vm(&rec.id)?.generation != rec.generation {
            return Err(not_found());
        }
        if done {
            self.pipes.end(&rec.id, rec.generation, job);
            return Err(not_found());
        }
        Ok(BrokerOpen {
            vm_id: rec.id,
            job,
            ticket,
            attachment,
        })
    }

    /// `vm_exec`'s answer for a job started with a broker pipe (`asked`): `broker_pipe` says
    /// whether the pipe is there (it is gone once the job's processes are). Only a pipe of the
    /// generation the job started in (`started_in`; `None`: no pipe was kept) counts, and only
    /// while the VM is still in it: after a fresh boot the job's number names another boot's
    /// job, whose pipe is not this request's.
    pub(super) fn with_pipe(
        &self,
        mut page: Value,
        vm: &str,
        job: JobId,
        asked: bool,
        started_in: Option<u64>,
    ) -> Value {
        if asked {
            let there = started_in.is_some_and(|g| {
                matches!(self.warren.get_vm(vm), Ok(r) if r.generation == g)
                    && self.pipes.has(vm, g, job)
            });
            page["broker_pipe"] = Value::Bool(there);
        }
        page
    }

    /// Whether job `job`'s processes are all gone (or the guest no longer knows it), so its
    /// broker pipe has ended.
    pub async fn broker_job_done(&self, vm: &str, job: JobId) -> bool {
        match self
            .job_read(vm, job, Cursor::default(), 0, Duration::ZERO)
            .await
        {
            Ok(o) => o.output_complete,
            Err(e) => e.code == "not_found",
        }
    }

    /// The job exists and the cursors lie within its output: asked without waiting (a
    /// one-byte read: a status read accepts cursors in output already released).
    async fn probe(&self, vm: &str, job: JobId, at: Cursor) -> Result<(), ApiError> {
        self.job_read(vm, job, at, 1, Duration::ZERO)
            .await
            .map(drop)
    }

    /// Reads a job's output at `at`: at most `max_bytes` per stream, waiting up to `wait`
    /// while nothing is new and the job runs.
    pub async fn job_read(
        &self,
        vm: &str,
        job: JobId,
        at: Cursor,
        max_bytes: u32,
        wait: Duration,
    ) -> Result<JobOutput, ApiError> {
        let req = output_request(job, at, max_bytes, wait);
        Ok(self.warren.job_output(vm, req).await?)
    }

    /// [`Service::job_read`] releasing an interactive job's output only before `release`
    /// (what the client acknowledged).
    pub async fn job_read_acked(
        &self,
        vm: &str,
        job: JobId,
        at: Cursor,
        release: Cursor,
        wait: Duration,
    ) -> Result<JobOutput, ApiError> {
        let req = super::output_request(job, at, MAX_READ_PER_STREAM, wait);
        Ok(self
            .warren
            .job_output_acked(vm, req, (release.stdout, release.stderr))
            .await?)
    }

    /// Writes terminal input (at most `MAX_INPUT_CHUNK` bytes), then closes the job's input
    /// when `eof`; answered once the guest wrote it.
    pub async fn job_input(
        &self,
        vm: &str,
        job: JobId,
        data: Vec<u8>,
        eof: bool,
    ) -> Result<(), ApiError> {
        Ok(self.warren.job_input(vm, job, data, eof).await?)
    }

    /// Sets a terminal job's window size.
    pub async fn job_resize(&self, vm: &str, job: JobId, size: WindowSize) -> Result<(), ApiError> {
        Ok(self.warren.job_resize(vm, job, size).await?)
    }
}

#[cfg(test)]
mod tests {
    use serde_json::{json, Value};
    use tokio::net::UnixListener;
    use warren_protocol::JobId;

    use crate::auth::Principal;
    use crate::broker::Pipes;
    use crate::broker_ws::tests::{running_vm, supervisor, VM};

    const TOKEN: &str = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQ";

    #[tokio::test]
    async fn test_pipes_of_jobs_gone_are_swept_once_a_vm_has_many() {
        let dir = tempfile::tempdir().expect("tmp");
        let service = crate::ws::tests::test_service(dir.path());
        let pipes: &Pipes = service.broker_pipes();
        // Never attached, their jobs long gone (the guest knows no such VM or job).
        for j in 1..=40u64 {
            service
                .register_pipe("w", "vm-x", 1, warren_protocol::JobId(j), TOKEN)
                .await;
        }
        let left = pipes.jobs_of("vm-x").len();
        assert!(
            left <= warren_protocol::limits::MAX_LIVE_JOBS + 1,
            "{left} pipes kept for jobs that are gone"
        );
        // Another VM's pipes are not looked at.
        pipes.register("w", "vm-y", 1, warren_protocol::JobId(1), TOKEN);
        service
            .register_pipe("w", "vm-x", 1, warren_protocol::JobId(99), TOKEN)
            .await;
        assert!(pipes.has("vm-y", 1, warren_protocol::JobId(1)));
        assert!(
            pipes.has("vm-x", 1, warren_protocol::JobId(99)),
            "the new pipe stays"
        );
    }

    /// `vm_exec`'s `broker_pipe` (first answer and replay) reports a pipe of the job's own
    /// boot only, while the VM is still in it. (Before, any pipe under the job's number
    /// counted: after a fresh boot a replay reported the lost boot's pipe, or the new boot's
    /// pipe of another job with the same number.)
    #[test]
    fn test_vm_exec_reports_only_a_pipe_of_its_jobs_boot() {
        let dir = tempfile::tempdir().expect("tmp");
        let service = crate::ws::tests::test_service(dir.path());
        let (store, _lock, _) = running_vm(dir.path(), "w");
        let pipe = |started_in: Option<u64>| {
            service.with_pipe(json!({}), VM, JobId(1), true, started_in)["broker_pipe"].clone()
        };
        service.pipes.register("w", VM, 1, JobId(1), TOKEN);
        assert_eq!(pipe(Some(1)), Value::Bool(true), "control");
        assert_eq!(pipe(None), Value::Bool(false), "no pipe was kept");
        assert_eq!(
            service.with_pipe(json!({}), VM, JobId(1), false, Some(1)),
            json!({}),
            "not asked"
        );
        // The VM booted fresh: the lost boot's job 1 and its pipe are gone.
        assert_eq!(store.bump_generation(VM), Ok(2));
        assert_eq!(pipe(Some(1)), Value::Bool(false), "the lost boot's pipe");
        // The new boot's job 1, another job, has a pipe of its own.
        service.pipes.register("w", VM, 2, JobId(1), TOKEN);
        assert_eq!(pipe(Some(1)), Value::Bool(false), "the new boot's pipe");
        assert_eq!(pipe(Some(2)), Value::Bool(true), "its own request's");
    }

    /// An attach whose look at the job woke the VM into a fresh boot is refused: the pipe's
    /// job is of the boot that is gone. Control: the same look in the pipe's boot attaches.
    /// (Before, the attachment was made for the new boot.)
    #[tokio::test]
    async fn test_attach_whose_wake_booted_the_vm_fresh_is_refused() {
        let dir = tempfile::tempdir().expect("tmp");
        let service = crate::ws::tests::test_service(dir.path());
        let p = Principal::local(0);
        let (store, _lock, vm_dir) = running_vm(dir.path(), &p.workspace);
        service.pipes.register(&p.workspace, VM, 1, JobId(1), TOKEN);
        let guest = supervisor(
            UnixListener::bind(vm_dir.socket()).expect("bind"),
            None,
            false,
        );
        let opened = service.open_broker(&p, VM, JobId(1), TOKEN).await;
        assert_eq!(opened.map(|o| o.attachment.generation()).ok(), Some(1));
        guest.await.expect("stand-in");
        std::fs::remove_file(vm_dir.socket()).expect("socket");

        let guest = supervisor(
            UnixListener::bind(vm_dir.socket()).expect("bind"),
            Some(store),
            false,
        );
        let opened = service.open_broker(&p, VM, JobId(1), TOKEN).await;
        assert_eq!(opened.err().map(|e| e.code), Some("not_found"));
        guest.await.expect("stand-in");
    }

    /// The exec page does not spin on a guest that answers the page read with a full page
    /// of a running job and the wait past it with the job's end (each answer alone is not
    /// held: a full page, and a job's last answer): after a wait that saw the end, the next
    /// page is the answer (found by a hostile review: 1,000 of 1,000 turns went unheld).
    #[tokio::test]
    async fn test_exec_page_ends_after_a_wait_that_saw_the_end() {
        use std::sync::atomic::{AtomicU64, Ordering};
        use warren_protocol::{GuestResponse, HostRequest, JobExit, JobOutput, JobState};
        use warren_supervisor::proto::{read_frame, write_frame, Reply, SupervisorRequest};
        let dir = tempfile::tempdir().expect("tmp");
        let service = crate::ws::tests::test_service(dir.path());
        let (_store, _lock, vm_dir) = running_vm(dir.path(), "w");
        let listener = UnixListener::bind(vm_dir.socket()).expect("bind");
        let reads = std::sync::Arc::new(AtomicU64::new(0));
        let counted = reads.clone();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                let counted = counted.clone();
                tokio::spawn(async move {
                    while let Ok(req) = read_frame::<_, SupervisorRequest>(&mut s).await {
                        let SupervisorRequest::Guest(HostRequest::JobOutput(r)) = req else {
                            return;
                        };
                        counted.fetch_add(1, Ordering::SeqCst);
                        let page = warren_protocol::limits::MAX_READ_PER_STREAM as usize;
                        let answer = if r.max_bytes > 0 {
                            JobOutput {
                                stdout: vec![b'x'; page],
                                stderr: Vec::new(),
                                stdout_retained: page as u64 * 2,
                                stderr_retained: 0,
                                state: JobState::Running,
                                truncated: false,
                                output_complete: false,
                                background_processes: 0,
                            }
                        } else {
                            JobOutput {
                                stdout: Vec::new(),
                                stderr: Vec::new(),
                                stdout_retained: r.stdout_cursor,
                                stderr_retained: r.stderr_cursor,
                                state: JobState::Finished(JobExit {
                                    code: Some(0),
                                    signal: None,
                                    timed_out: false,
                                    cancelled: false,
                                }),
                                truncated: false,
                                output_complete: true,
                                background_processes: 0,
                            }
                        };
                        let reply: Reply = Ok(warren_supervisor::SupervisorResponse::Guest(
                            GuestResponse::JobOutput(answer),
                        ));
                        if write_frame(&mut s, &reply).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        let started = std::time::Instant::now();
        service
            .exec_page(VM, JobId(1), 3000)
            .await
            .expect("the page");
        assert_eq!(reads.load(Ordering::SeqCst), 3, "page, wait, page");
        assert!(started.elapsed() < std::time::Duration::from_secs(2));
    }
}
