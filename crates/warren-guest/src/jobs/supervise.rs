//! The end of a job: output drains, the timeout budget, the supervisor task that reports the
//! main process's exit and then follows the processes it left behind, and cgroup removal.

use std::fs;
use std::io;
use std::os::fd::OwnedFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::AsyncReadExt;
use tokio::net::unix::pipe;
use tokio::sync::{oneshot, watch};
use tokio::task::{AbortHandle, JoinHandle};
use warren_protocol::{JobExit, JobId, JobState};

use super::{leftovers, Job, JobIo, JobManager, KillReason, Stream, Suspension, DRAIN_CHUNK};
use crate::reaper::ExitStatus;

/// How long to keep retrying `rmdir` of a job cgroup the kernel still reports populated.
const CGROUP_RMDIR_ATTEMPTS: u32 = 200;
const CGROUP_RMDIR_PAUSE: Duration = Duration::from_millis(10);

/// How long an interactive job's remaining output waits for the host once its main process
/// exited (see [`supervise`]).
const INTERACTIVE_CLOSE_GRACE: Duration = Duration::from_secs(30);

/// How often the processes a finished job left in its cgroup are counted.
const BACKGROUND_POLL: Duration = Duration::from_millis(500);

/// How long the drains may go on once the job's cgroup is empty (see [`supervise`]).
const DRAIN_GRACE: Duration = Duration::from_secs(5);

/// Longest wait for the drains to read what the main process wrote, and the pause between
/// looks (see [`settle`]).
const SETTLE_MAX: Duration = Duration::from_secs(2);
const SETTLE_PAUSE: Duration = Duration::from_millis(5);

impl JobManager {
    /// Starts the task that ends the job (see [`supervise`]).
    pub(super) fn supervise(
        &self,
        job: &Arc<Job>,
        exit: oneshot::Receiver<ExitStatus>,
        drains: Vec<JoinHandle<()>>,
        peek: Vec<OwnedFd>,
        timeout_ms: Option<u64>,
    ) {
        let timeout = timeout_ms.map(|t| Budget {
            start: tokio::time::Instant::now(),
            budget: Duration::from_millis(t),
            frozen_before: self.suspension.borrow().total,
            clock: self.suspension.subscribe(),
        });
        tokio::spawn(supervise(job.clone(), exit, drains, peek, timeout));
    }
}

pub(super) async fn drain(
    job: Arc<Job>,
    mut rx: pipe::Receiver,
    stream: Stream,
    max_retained: u64,
) {
    let mut buf = vec![0u8; DRAIN_CHUNK];
    loop {
        match rx.read(&mut buf).await {
            Ok(0) => return,
            Ok(n) => {
                job.consumed(n);
                if job.io == JobIo::Batch {
                    job.append(stream, &buf[..n], max_retained);
                } else {
                    job.append_flow(stream, &buf[..n], max_retained).await;
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                crate::console::log(format_args!("job {}: read output: {e}", job.id));
                return;
            }
        }
    }
}

/// A job's timeout: `budget` of unfrozen time from `start`.
struct Budget {
    start: tokio::time::Instant,
    budget: Duration,
    /// Frozen time before the job started (not the job's).
    frozen_before: Duration,
    clock: watch::Receiver<Suspension>,
}

impl Budget {
    /// Resolves once the job has run for its budget, not counting frozen time.
    async fn spent(mut self) {
        loop {
            let s = *self.clock.borrow_and_update();
            if s.frozen_since.is_none() {
                let deadline = self.start + self.budget + (s.total - self.frozen_before);
                tokio::select! {
                    () = tokio::time::sleep_until(deadline) => return,
                    r = self.clock.changed() => if r.is_err() { return },
                }
            } else if self.clock.changed().await.is_err() {
                return;
            }
        }
    }
}

/// Ends a job: reports the main process's exit, then follows what it left behind.
///
/// 1. Until the main process exits: fire the timeout (kill the whole cgroup).
/// 2. At its exit, with nothing else left in the cgroup: wait for the drains to reach end of
///    file, then the job is `Finished` with `output_complete` at once (as a job always was).
/// 3. With background processes left: wait until the drains consumed what the pipes held at
///    the exit ([`settle`]), so the output at `Finished` holds everything the main process
///    wrote; then the job is `Finished` (exit status, output so far) and the input of an
///    interactive job closes. While processes remain (counted every [`BACKGROUND_POLL`], and
///    at once after a kill) or the drains still read, the timeout still kills the whole
///    cgroup and a cancel does too ([`Job::kill`]).
/// 4. Either way an interactive job's output stops waiting for the host
///    [`INTERACTIVE_CLOSE_GRACE`] after the exit, and once the cgroup is empty the drains get
///    [`DRAIN_GRACE`] more to reach end of file (only a process of another job, given the pipe
///    over a socket, can hold it longer). Then `output_complete`, the record stops counting as
///    live, and the cgroup is removed.
async fn supervise(
    job: Arc<Job>,
    mut exit: oneshot::Receiver<ExitStatus>,
    drains: Vec<JoinHandle<()>>,
    peek: Vec<OwnedFd>,
    timeout: Option<Budget>,
) {
    let deadline = async {
        match timeout {
            Some(b) => b.spent().await,
            None => std::future::pending().await,
        }
    };
    tokio::pin!(deadline);
    let mut timed_out = false;
    let status = loop {
        tokio::select! {
            status = &mut exit => break status.ok(),
            () = &mut deadline, if !timed_out => {
                timed_out = true;
                job.kill(Some(KillReason::Timeout));
            }
        }
    };
    let mut background = leftovers::count(&job);
    let mut finished = false;
    if background > 0 {
        settle(&job, &peek).await;
        finish(&job, status, background).await;
        finished = true;
    }
    drop(peek);

    let aborts: Vec<AbortHandle> = drains.iter().map(JoinHandle::abort_handle).collect();
    let drained = async {
        for d in drains {
            let _ = d.await;
        }
    };
    tokio::pin!(drained);
    // An interactive job's drains wait for the host to read; once its main process is gone,
    // give the host this long before discarding what does not fit.
    let closing = tokio::time::sleep(INTERACTIVE_CLOSE_GRACE);
    tokio::pin!(closing);
    let mut closed = job.io == JobIo::Batch;
    let grace = tokio::time::sleep(drain_grace(closed));
    tokio::pin!(grace);
    let mut drains_done = false;
    loop {
        if background == 0 && drains_done {
            break;
        }
        tokio::select! {
            () = &mut drained, if !drains_done => drains_done = true,
            () = tokio::time::sleep(BACKGROUND_POLL), if background > 0 => {}
            () = job.kicked.notified(), if background > 0 => {}
            () = &mut grace, if background == 0 && !drains_done => {
                crate::console::log(format_args!(
                    "job {}: output still open with the job's cgroup empty; stopped reading",
                    job.id
                ));
                for a in &aborts {
                    a.abort();
                }
                drains_done = true;
            }
            () = &mut closing, if !closed => {
                closed = true;
                job.data().closing = true;
                job.room.notify_waiters();
            }
            () = &mut deadline, if !timed_out => {
                timed_out = true;
                job.kill(Some(KillReason::Timeout));
            }
        }
        if background > 0 {
            let now = leftovers::count(&job);
            if now != background {
                background = now;
                job.data().background = now;
                job.bump();
                if now == 0 {
                    grace
                        .as_mut()
                        .reset(tokio::time::Instant::now() + drain_grace(closed));
                }
            }
        }
    }
    if !finished {
        finish(&job, status, 0).await;
    }
    {
        let mut d = job.data();
        d.live = false;
        d.background = 0;
        d.output_complete = true;
    }
    job.bump();
    // Nothing of the job is left to connect to its broker pipe.
    let broker = job
        .broker
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .take();
    if let Some(b) = broker {
        b.close();
    }
    if let Some(dir) = &job.cgroup {
        remove_cgroup(job.id, dir).await;
    }
}

/// How long drains may still read once the cgroup is empty: an interactive job's also wait
/// for the host until `closing`.
fn drain_grace(closed: bool) -> Duration {
    if closed {
        DRAIN_GRACE
    } else {
        DRAIN_GRACE + INTERACTIVE_CLOSE_GRACE
    }
}

/// Waits (at most [`SETTLE_MAX`]) until the drains have read every byte `peek` (duplicates of
/// the pipes' or terminal's read ends) held when this is called: all the main process wrote.
/// The pending count and the drains' total are read with no await in between, so on the
/// agent's single-threaded runtime no drain reads in between and the target is exact.
async fn settle(job: &Job, peek: &[OwnedFd]) {
    let pending: u64 = peek
        .iter()
        .map(|fd| rustix::io::ioctl_fionread(fd).unwrap_or(0))
        .sum();
    let target = job.read_total.load(Ordering::Relaxed) + pending;
    let deadline = tokio::time::Instant::now() + SETTLE_MAX;
    while job.read_total.load(Ordering::Relaxed) < target && tokio::time::Instant::now() < deadline
    {
        tokio::time::sleep(SETTLE_PAUSE).await;
    }
}

/// Marks the job `Finished` with the main process's status; closes an interactive job's input.
async fn finish(job: &Job, status: Option<ExitStatus>, background: u32) {
    {
        let mut d = job.data();
        let (code, signal) = match status {
            Some(ExitStatus::Code(c)) => (Some(c), None),
            Some(ExitStatus::Signal(s)) => (None, Some(s)),
            None => (None, None),
        };
        d.state = JobState::Finished(JobExit {
            code,
            signal,
            timed_out: d.kill == Some(KillReason::Timeout),
            cancelled: d.kill == Some(KillReason::Cancel),
        });
        d.background = background;
    }
    job.bump();
    // Interactive input ends with the main process; a pending `JobInput` saw the bump and
    // gives up the lock. The drain holds its own reference to a terminal master.
    job.terminal().take();
    job.input.lock().await.take();
}

async fn remove_cgroup(id: JobId, dir: &std::path::Path) {
    for _ in 0..CGROUP_RMDIR_ATTEMPTS {
        match fs::remove_dir(dir) {
            Ok(()) => return,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return,
            // EBUSY: killed processes are still leaving the cgroup.
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
                tokio::time::sleep(CGROUP_RMDIR_PAUSE).await;
            }
            Err(e) => {
                crate::console::log(format_args!("job {id}: remove cgroup: {e}"));
                return;
            }
        }
    }
    crate::console::log(format_args!(
        "job {id}: cgroup still populated, left in place"
    ));
}
