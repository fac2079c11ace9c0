//! The job manager: starts commands, drains and retains their output, enforces limits and
//! timeouts, and reports how they ended. Jobs belong to the agent, not to a session: they and
//! their output survive host reconnections.
//!
//! Per job, on the agent's tokio runtime:
//! - two drain tasks read stdout and stderr to end of file into the job's buffers, keeping at
//!   most `max_retained` bytes across both streams and discarding the rest (`truncated`), so a
//!   command never blocks on output whatever the host does;
//! - an optional stdin task writes the given bytes and closes the pipe;
//! - a supervisor task ([`supervise`]) waits for the main process's status (from the
//!   [`Reaper`], never from `Child::wait`) and fires the timeout. When the main process ends the
//!   job is `Finished` at once (exit status, output so far). Whatever it left in its cgroup
//!   (background processes, [`leftovers`]) runs on, and the drains keep reading the pipes
//!   those processes inherited, until the cgroup is empty and both pipes reached end of file
//!   (`output_complete`), the job is cancelled, or its timeout fires (both kill the whole
//!   cgroup). Then the cgroup is removed.
//!
//! Limits: a job takes one of `max_running` slots while its main process runs, and counts
//! against `max_live` (jobs holding processes) until its cgroup is empty. A record is evicted
//! (oldest first, when `max_records` are retained) only once its cgroup is empty, so records
//! never outnumber what they describe.
//!
//! Idempotent starts: an `ExecStart` with a `request_key` is looked up in the table's
//! [`RequestKeys`] and recorded there in the same critical section that takes the running slot
//! and the record, so a retried or duplicated request returns the first job's id (or a
//! `Conflict` when the request differs) instead of starting a second process. A start that
//! fails after that step forgets its key again.
//!
//! Interactive jobs (`ExecInteractive`, in [`interactive`]) keep their input open: a stdin
//! pipe, or a pseudo-terminal ([`crate::pty`]) whose master replaces both output pipes (one
//! drain task reads it into the stdout buffer). Their input is written by `JobInput` requests;
//! when the job finishes, the supervisor task drops the input and the master.
//!
//! Locks: `JobManager::table` guards the set of records and the remembered request keys; each
//! `Job::data` guards that job's buffers and state. Order: table, then job data; never the
//! other way round. `Job::changed` is bumped after every change of `data` and wakes
//! long-polling output readers.

use std::collections::BTreeMap;
use std::fs;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use tokio::net::unix::pipe;
use tokio::sync::watch;
use warren_protocol::limits::{
    MAX_ARGV, MAX_ENV, MAX_JOB_RECORDS, MAX_LISTED_PROCESSES, MAX_LIVE_JOBS, MAX_OUTPUT_WAIT_MS,
    MAX_READ_PER_STREAM, MAX_REQUEST_KEYS, MAX_REQUEST_KEY_BYTES, MAX_RETAINED_OUTPUT,
    MAX_RUNNING_JOBS, MAX_STDIN_BYTES,
};
use warren_protocol::{
    BenchReply, ErrorCode, ExecStart, GuestError, JobId, JobOutput, JobOutputAcked,
    JobOutputRequest, JobState, WindowSize,
};

use crate::files::{self, FilesConfig};
use crate::pty;
use crate::reaper::Reaper;
use crate::request_keys::{Lookup, RequestKeys};
use launch::spawn_error;

/// Most iterations one `ForkExecWait` bench request may ask for (bounds its duration).
pub const MAX_BENCH_ITERATIONS: u32 = 10_000;

const DRAIN_CHUNK: usize = 64 * 1024;

/// How the processes of a job are tracked and killed.
#[derive(Debug, Clone)]
pub enum Containment {
    /// Each job runs in the cgroup v2 `<dir>/<job id>`; kills write `cgroup.kill`, which also
    /// catches descendants that left the job's session.
    Cgroup(PathBuf),
    /// ONLY for unit tests on hosts without a writable cgroup v2: kill the job's process group.
    /// Misses descendants that call `setsid` themselves; the agent never uses it.
    #[cfg_attr(not(test), allow(dead_code))]
    ProcessGroupForTestsOnly,
}

/// Job manager configuration; [`JobsConfig::guest`] is what the agent uses in the VM.
#[derive(Debug, Clone)]
pub struct JobsConfig {
    /// Workspace root and the user jobs run as (`None`: keep the caller's, for tests).
    pub files: FilesConfig,
    pub containment: Containment,
    pub max_running: usize,
    pub max_records: usize,
    /// Jobs whose cgroup holds processes (running, or finished with background processes).
    pub max_live: usize,
    pub max_retained: u64,
    /// Exec request keys remembered (the most recent ones).
    pub max_request_keys: usize,
    /// Where cgroup2 is mounted (job cgroups are named relative to it in `/proc`).
    pub cgroup_mount: PathBuf,
    /// Directory of the broker pipes' directories ([`broker::BROKER_ROOT`]).
    pub broker_root: PathBuf,
}

impl JobsConfig {
    /// The in-guest configuration with the protocol's limits.
    pub fn guest(files: FilesConfig, cgroup_jobs_dir: PathBuf) -> Self {
        Self {
            files,
            containment: Containment::Cgroup(cgroup_jobs_dir),
            max_running: MAX_RUNNING_JOBS,
            max_records: MAX_JOB_RECORDS,
            max_live: MAX_LIVE_JOBS,
            max_retained: MAX_RETAINED_OUTPUT,
            max_request_keys: MAX_REQUEST_KEYS,
            cgroup_mount: PathBuf::from("/sys/fs/cgroup"),
            broker_root: PathBuf::from(broker::BROKER_ROOT),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum KillReason {
    Timeout,
    Cancel,
}

#[derive(Debug, Clone, Copy)]
enum Stream {
    Stdout,
    Stderr,
}

struct JobData {
    stdout: Vec<u8>,
    stderr: Vec<u8>,
    truncated: bool,
    state: JobState,
    kill: Option<KillReason>,
    /// Main process id, once spawned; it leads the job's process group.
    pid: Option<i32>,
    /// Interactive jobs only: bytes already read and released before the buffers' starts
    /// (cursors stay absolute). Always 0 for batch jobs.
    stdout_base: u64,
    stderr_base: u64,
    /// Interactive jobs only: the main process ended and the host did not read the rest in
    /// time, so output beyond the window is discarded instead of waited for.
    closing: bool,
    /// The job's cgroup (or process group) may hold processes: from its reservation until
    /// the supervisor task saw it empty. Counts against `max_live`; blocks eviction.
    live: bool,
    /// Processes left in the cgroup after the main process exited, as last counted.
    background: u32,
    /// No byte can follow: finished, cgroup empty, both drains at end of file.
    output_complete: bool,
}

/// How a job's stdin, stdout and stderr are connected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum JobIo {
    /// `ExecStart`: stdin from the request's bytes or /dev/null, two output pipes.
    Batch,
    /// `ExecInteractive` without a terminal: a stdin pipe kept open for `JobInput`.
    Pipe,
    /// `ExecInteractive` with a terminal of this initial size.
    Terminal(WindowSize),
}

/// The writable end of an interactive job's input.
enum InputSink {
    Pipe(pipe::Sender),
    Terminal(Arc<pty::Master>),
}

struct Job {
    id: JobId,
    cgroup: Option<PathBuf>,
    /// The argv, joined and cut for `JobList`.
    command: String,
    /// Woken by a kill, so the supervisor task counts the remaining processes at once.
    kicked: tokio::sync::Notify,
    /// Bytes the drains read from the pipes or the terminal so far (kept or not).
    read_total: AtomicU64,
    data: Mutex<JobData>,
    /// Bumped after every change of `data`.
    changed: watch::Sender<u64>,
    io: JobIo,
    /// Interactive jobs' input, `None` once closed (`eof`, or the job ended). Held across a
    /// write, so inputs are written whole and in order; the supervisor task empties it after
    /// the job finished.
    input: tokio::sync::Mutex<Option<InputSink>>,
    /// A terminal job's master, for resizes; the supervisor task drops it when the job ends.
    terminal: Mutex<Option<Arc<pty::Master>>>,
    /// Interactive jobs: woken when a read releases output or `closing` is set, so a drain
    /// waiting for room in the window goes on.
    room: tokio::sync::Notify,
    /// The job's broker pipe (`ExecBroker`), until its cgroup is empty.
    broker: Mutex<Option<Arc<broker::Broker>>>,
}

impl Job {
    fn data(&self) -> MutexGuard<'_, JobData> {
        // Job data stays consistent under every early exit: recover from poisoning.
        self.data.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn is_running(&self) -> bool {
        matches!(self.data().state, JobState::Running)
    }

    fn is_live(&self) -> bool {
        self.data().live
    }

    /// Counts bytes a drain read.
    fn consumed(&self, n: usize) {
        self.read_total.fetch_add(n as u64, Ordering::Relaxed);
    }

    fn terminal(&self) -> MutexGuard<'_, Option<Arc<pty::Master>>> {
        self.terminal.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn bump(&self) {
        self.changed.send_modify(|v| *v = v.wrapping_add(1));
    }

    fn append(&self, stream: Stream, bytes: &[u8], max_retained: u64) {
        let mut d = self.data();
        let used = (d.stdout.len() + d.stderr.len()) as u64;
        let room = usize::try_from(max_retained.saturating_sub(used)).unwrap_or(usize::MAX);
        let keep = bytes.len().min(room);
        let was_truncated = d.truncated;
        if keep < bytes.len() {
            d.truncated = true;
        }
        let buf = match stream {
            Stream::Stdout => &mut d.stdout,
            Stream::Stderr => &mut d.stderr,
        };
        buf.extend_from_slice(&bytes[..keep]);
        let changed = keep > 0 || d.truncated != was_truncated;
        drop(d);
        if changed {
            self.bump();
        }
    }

    /// Kills every process of the job: a running one with everything it started, a finished
    /// one's background processes. Records `reason` while the main process runs, unless one
    /// was recorded before (a finished job's exit status stays its main process's).
    fn kill(&self, reason: Option<KillReason>) {
        let pid = {
            let mut d = self.data();
            if !d.live {
                return;
            }
            if d.kill.is_none() && matches!(d.state, JobState::Running) {
                d.kill = reason;
            }
            d.pid
        };
        self.kicked.notify_one();
        match &self.cgroup {
            Some(dir) => {
                if let Err(e) = fs::write(dir.join("cgroup.kill"), b"1") {
                    crate::console::log(format_args!("job {}: cgroup.kill: {e}", self.id));
                }
            }
            None => {
                if let Some(pid) = pid {
                    // ESRCH: the group is already gone.
                    let _ = killpg(Pid::from_raw(pid), Signal::SIGKILL);
                }
            }
        }
    }

    /// Reads at the request's cursors. For interactive jobs the read also releases the
    /// bytes before `release` (at most the cursors: what the host has), making room for
    /// more output.
    fn read(
        &self,
        req: &JobOutputRequest,
        release: (u64, u64),
    ) -> Result<(JobOutput, bool), GuestError> {
        if release.0 > req.stdout_cursor || release.1 > req.stderr_cursor {
            return Err(invalid("a release point lies past its read cursor"));
        }
        let max = req.max_bytes.min(MAX_READ_PER_STREAM) as usize;
        let mut d = self.data();
        // Offset of `cursor` in a buffer that starts at absolute position `base`.
        // A status read (`max_bytes` 0) returns no bytes, so a cursor in output already
        // released is no error there: the job's state is still worth knowing.
        let status_only = req.max_bytes == 0;
        let offset = |buf: &[u8], base: u64, cursor: u64, name: &str| {
            if status_only && cursor < base {
                return Ok(0);
            }
            let off = cursor.checked_sub(base).ok_or_else(|| {
                invalid(format!(
                    "{name} cursor {cursor} is before {base}, which was already read and released"
                ))
            })?;
            usize::try_from(off)
                .ok()
                .filter(|&o| o <= buf.len())
                .ok_or_else(|| invalid(format!("{name} cursor is past the retained output")))
        };
        let mut out_off = offset(&d.stdout, d.stdout_base, req.stdout_cursor, "stdout")?;
        let mut err_off = offset(&d.stderr, d.stderr_base, req.stderr_cursor, "stderr")?;
        // Release points before the bases were released already.
        let out_rel = usize::try_from(release.0.saturating_sub(d.stdout_base)).unwrap_or(0);
        let err_rel = usize::try_from(release.1.saturating_sub(d.stderr_base)).unwrap_or(0);
        if self.io != JobIo::Batch && (out_rel > 0 || err_rel > 0) {
            d.stdout.drain(..out_rel);
            d.stderr.drain(..err_rel);
            d.stdout_base += out_rel as u64;
            d.stderr_base += err_rel as u64;
            out_off -= out_rel;
            err_off -= err_rel;
            self.room.notify_waiters();
        }
        let take =
            |buf: &[u8], off: usize| buf[off..buf.len().min(off.saturating_add(max))].to_vec();
        let caught_up = out_off == d.stdout.len() && err_off == d.stderr.len();
        let out = JobOutput {
            stdout: take(&d.stdout, out_off),
            stderr: take(&d.stderr, err_off),
            stdout_retained: d.stdout_base + d.stdout.len() as u64,
            stderr_retained: d.stderr_base + d.stderr.len() as u64,
            state: d.state,
            truncated: d.truncated,
            output_complete: d.output_complete,
            background_processes: d.background,
        };
        // Waits are for output or the main process's end: once it ended, a read answers at
        // once (background processes' later output is read by polling), so a reader that
        // waits for the end never waits on a background process.
        let running = matches!(d.state, JobState::Running);
        Ok((out, caught_up && running))
    }
}

struct Table {
    next_id: u64,
    jobs: BTreeMap<JobId, Arc<Job>>,
    /// Request keys of the jobs started this boot; outlive the records in `jobs`.
    keys: RequestKeys,
}

/// What [`JobManager::reserve`] decided.
enum Reservation {
    /// A new record holding a running slot; the caller launches it or removes it again.
    New(Arc<Job>),
    /// The same request, with the same key, already started this job.
    Existing(JobId),
}

/// Owns every job of the agent.
pub struct JobManager {
    cfg: JobsConfig,
    reaper: Arc<Reaper>,
    /// Time the jobs spent frozen (suspension), which never counts against their timeouts.
    suspension: watch::Sender<Suspension>,
    /// All job records, by id (ids grow, so iteration order is age order).
    table: Mutex<Table>,
    /// Added to every later job's base environment (the egress CA bundle variables).
    extra_env: Mutex<Vec<(String, String)>>,
    /// Held by each job start so streams give it the vCPU ([`crate::bulk`]).
    pub bulk: Arc<crate::bulk::BulkGate>,
}

fn invalid(msg: impl Into<String>) -> GuestError {
    GuestError::new(ErrorCode::InvalidArgument, msg)
}

/// Checks an exec request against the protocol's limits before anything is created.
pub fn validate_exec(req: &ExecStart) -> Result<(), GuestError> {
    let Some(program) = req.argv.first() else {
        return Err(invalid("argv is empty"));
    };
    if program.is_empty() {
        return Err(invalid("argv[0] is empty"));
    }
    if req.argv.len() > MAX_ARGV {
        return Err(invalid(format!("more than {MAX_ARGV} arguments")));
    }
    if req.argv.iter().any(|a| a.contains('\0')) {
        return Err(invalid("argv contains NUL"));
    }
    if req.env.len() > MAX_ENV {
        return Err(invalid(format!("more than {MAX_ENV} environment entries")));
    }
    for (name, value) in &req.env {
        if name.is_empty() || name.contains('=') || name.contains('\0') {
            return Err(invalid("invalid environment variable name"));
        }
        if value.contains('\0') {
            return Err(invalid("environment value contains NUL"));
        }
    }
    if req
        .stdin
        .as_ref()
        .is_some_and(|s| s.len() > MAX_STDIN_BYTES)
    {
        return Err(invalid(format!("stdin exceeds {MAX_STDIN_BYTES} bytes")));
    }
    if req.timeout_ms == Some(0) {
        return Err(invalid("timeout_ms must be positive"));
    }
    if let Some(cwd) = &req.cwd {
        files::split_rel_path(cwd)?;
    }
    match req.request_key.as_deref() {
        Some("") => return Err(invalid("request_key is empty")),
        Some(k) if k.len() > MAX_REQUEST_KEY_BYTES => {
            return Err(invalid(format!(
                "request_key exceeds {MAX_REQUEST_KEY_BYTES} bytes"
            )))
        }
        _ => {}
    }
    Ok(())
}

fn internal(what: &str, err: impl std::fmt::Display) -> GuestError {
    GuestError::new(ErrorCode::Internal, format!("{what}: {err}"))
}

/// Frozen time so far, and since when the jobs are frozen right now.
#[derive(Debug, Clone, Copy, Default)]
struct Suspension {
    frozen_since: Option<tokio::time::Instant>,
    total: Duration,
}

impl JobManager {
    /// Sets variables every job started from now on gets (requests still override them).
    pub fn set_extra_env(&self, vars: Vec<(String, String)>) {
        *self.extra_env.lock().unwrap_or_else(|p| p.into_inner()) = vars;
    }

    pub fn new(cfg: JobsConfig, reaper: Arc<Reaper>) -> Arc<Self> {
        Arc::new(Self {
            reaper,
            extra_env: Mutex::new(Vec::new()),
            bulk: Arc::default(),
            suspension: watch::Sender::new(Suspension::default()),
            table: Mutex::new(Table {
                next_id: 1,
                jobs: BTreeMap::new(),
                keys: RequestKeys::new(cfg.max_request_keys),
            }),
            cfg,
        })
    }

    fn table(&self) -> MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn get(&self, id: JobId) -> Result<Arc<Job>, GuestError> {
        self.table()
            .jobs
            .get(&id)
            .cloned()
            .ok_or_else(|| GuestError::new(ErrorCode::NotFound, format!("no job {id}")))
    }

    /// Takes a running slot and a record, evicting the oldest finished record if needed, and
    /// remembers the request's key for the new job. A key already remembered short-circuits
    /// everything: its job's id for the same request, `Conflict` for a different one. Refusals
    /// remember nothing. The key is looked up and recorded under one table guard.
    fn reserve(
        &self,
        key: Option<(String, [u8; 32])>,
        io: JobIo,
        argv: &[String],
    ) -> Result<Reservation, GuestError> {
        let mut t = self.table();
        if let Some((k, digest)) = &key {
            match t.keys.lookup(k, digest) {
                Lookup::New => {}
                Lookup::Started(id) => return Ok(Reservation::Existing(id)),
                Lookup::Conflict(id) => {
                    return Err(GuestError::new(
                        ErrorCode::Conflict,
                        format!("request key already started job {id} with a different request"),
                    ))
                }
            }
        }
        let running = t.jobs.values().filter(|j| j.is_running()).count();
        if running >= self.cfg.max_running {
            return Err(GuestError::new(
                ErrorCode::QuotaExceeded,
                format!("at most {} jobs may run at once", self.cfg.max_running),
            ));
        }
        let live = t.jobs.values().filter(|j| j.is_live()).count();
        if live >= self.cfg.max_live {
            return Err(GuestError::new(
                ErrorCode::QuotaExceeded,
                format!(
                    "at most {} jobs may hold processes at once ({} finished with background processes still running); cancel one",
                    self.cfg.max_live,
                    live - running
                ),
            ));
        }
        if t.jobs.len() >= self.cfg.max_records {
            // Only a record whose processes are all gone goes: a job with background
            // processes stays listed (and cancellable) while they run.
            let oldest_done = t.jobs.iter().find(|(_, j)| !j.is_live()).map(|(id, _)| *id);
            match oldest_done {
                Some(id) => {
                    t.jobs.remove(&id);
                }
                None => {
                    return Err(GuestError::new(
                        ErrorCode::QuotaExceeded,
                        "job records are full and every one still has processes",
                    ))
                }
            }
        }
        let id = JobId(t.next_id);
        t.next_id += 1;
        let cgroup = match &self.cfg.containment {
            Containment::Cgroup(dir) => Some(dir.join(id.0.to_string())),
            Containment::ProcessGroupForTestsOnly => None,
        };
        let job = Arc::new(Job {
            id,
            cgroup,
            command: leftovers::command_line(argv),
            kicked: tokio::sync::Notify::new(),
            read_total: AtomicU64::new(0),
            data: Mutex::new(JobData {
                stdout: Vec::new(),
                stderr: Vec::new(),
                truncated: false,
                state: JobState::Running,
                kill: None,
                pid: None,
                stdout_base: 0,
                stderr_base: 0,
                closing: false,
                live: true,
                background: 0,
                output_complete: false,
            }),
            changed: watch::Sender::new(0),
            io,
            input: tokio::sync::Mutex::new(None),
            terminal: Mutex::new(None),
            room: tokio::sync::Notify::new(),
            broker: Mutex::new(None),
        });
        t.jobs.insert(id, job.clone());
        if let Some((k, digest)) = key {
            t.keys.insert(k, id, digest);
        }
        Ok(Reservation::New(job))
    }

    /// Starts a job and returns its id once the process runs; with a remembered request key,
    /// returns the job that key started instead (see [`JobManager::reserve`]).
    pub async fn start(self: &Arc<Self>, req: ExecStart) -> Result<JobId, GuestError> {
        validate_exec(&req)?;
        let key = match &req.request_key {
            Some(k) => {
                let digest = req
                    .digest()
                    .map_err(|e| internal("exec request digest", e))?;
                Some((k.clone(), digest))
            }
            None => None,
        };
        self.start_job(req, JobIo::Batch, key, false)
    }

    /// Starts a job with a broker pipe ([`broker`]); request keys as for
    /// [`JobManager::start`], digested apart from plain starts (the same key for a plain and
    /// a broker start is a `Conflict`).
    pub async fn start_broker(self: &Arc<Self>, req: ExecStart) -> Result<JobId, GuestError> {
        validate_exec(&req)?;
        if !matches!(self.cfg.containment, Containment::Cgroup(_)) {
            return Err(GuestError::new(
                ErrorCode::Internal,
                "a broker pipe needs job cgroups",
            ));
        }
        let key = match &req.request_key {
            Some(k) => {
                let digest = req
                    .digest()
                    .map_err(|e| internal("exec request digest", e))?;
                let mut h = <sha2::Sha256 as sha2::Digest>::new();
                sha2::Digest::update(&mut h, b"warren-broker\0");
                sha2::Digest::update(&mut h, digest);
                Some((k.clone(), sha2::Digest::finalize(h).into()))
            }
            None => None,
        };
        self.start_job(req, JobIo::Batch, key, true)
    }

    /// The broker pipe of job `id`: `NotFound` when it has none (any more).
    pub fn broker(&self, id: JobId) -> Result<Arc<broker::Broker>, GuestError> {
        let job = self.get(id)?;
        let b = job
            .broker
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        b.ok_or_else(|| {
            GuestError::new(ErrorCode::NotFound, format!("job {id} has no broker pipe"))
        })
    }

    /// Reserves, then launches; shared by batch and interactive starts. `key` is the
    /// request key with the digest of the whole request.
    fn start_job(
        self: &Arc<Self>,
        req: ExecStart,
        io: JobIo,
        key: Option<(String, [u8; 32])>,
        with_broker: bool,
    ) -> Result<JobId, GuestError> {
        // Nothing below awaits: on the agent's single-threaded runtime a start runs to its end
        // before another request is polled, so a duplicate never sees a reserved job whose
        // launch then fails.
        let job = match self.reserve(key, io, &req.argv)? {
            Reservation::New(job) => job,
            Reservation::Existing(id) => return Ok(id),
        };
        // The working directory is opened after the key lookup: a retry must find its job even
        // when the job has since removed its own working directory. A single openat2 with the
        // guest user's fs identity (restored before returning): cheap enough to run inline,
        // and a blocking-pool hop costs milliseconds under TCG.
        let launched = self
            .open_broker(&job, with_broker)
            .and_then(|()| files::open_dir(&self.cfg.files, req.cwd.as_deref()))
            .and_then(|cwd_fd| self.launch(&job, req, cwd_fd));
        match launched {
            Ok(()) => {
                let mut changes = job.changed.subscribe();
                let started = job.clone();
                self.bulk.hold_while(async move {
                    let _ = changes.wait_for(|_| !started.is_running()).await;
                });
                Ok(job.id)
            }
            Err(e) => {
                let mut t = self.table();
                t.jobs.remove(&job.id);
                t.keys.forget(job.id);
                drop(t);
                if let Some(dir) = &job.cgroup {
                    let _ = fs::remove_dir(dir);
                }
                job.broker
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .take();
                Err(e)
            }
        }
    }

    /// Opens the job's broker pipe before it starts, when asked.
    fn open_broker(&self, job: &Job, with_broker: bool) -> Result<(), GuestError> {
        if !with_broker {
            return Ok(());
        }
        let Some(dir) = &job.cgroup else {
            return Err(GuestError::new(
                ErrorCode::Internal,
                "a broker pipe needs job cgroups",
            ));
        };
        // The job's cgroup as /proc/<pid>/cgroup names it: relative to the cgroup2 mount.
        let cgroup = match (&self.cfg.containment, dir.file_name()) {
            (Containment::Cgroup(jobs), Some(name)) => {
                let rel = jobs.strip_prefix(&self.cfg.cgroup_mount).unwrap_or(jobs);
                format!("/{}/{}", rel.display(), name.to_string_lossy()).replace("//", "/")
            }
            _ => {
                return Err(internal(
                    "broker cgroup",
                    std::io::Error::other("no cgroup"),
                ))
            }
        };
        let user = self
            .cfg
            .files
            .user
            .unwrap_or(warren_protocol::limits::GUEST_USER_ID);
        let b = broker::Broker::open(&self.cfg.broker_root, job.id, user, cgroup)
            .map_err(|e| internal("open the broker pipe", e))?;
        *job.broker.lock().unwrap_or_else(PoisonError::into_inner) = Some(Arc::new(b));
        Ok(())
    }

    /// Reads output at the request's cursors, long-polling when asked and nothing is new.
    pub async fn output(&self, req: &JobOutputRequest) -> Result<JobOutput, GuestError> {
        self.output_released(req, (req.stdout_cursor, req.stderr_cursor))
            .await
    }

    /// [`JobManager::output`] releasing an interactive job's bytes only before the
    /// acknowledged points (`JobOutputAcked`).
    pub async fn output_acked(&self, req: &JobOutputAcked) -> Result<JobOutput, GuestError> {
        self.output_released(&req.read, (req.release_stdout, req.release_stderr))
            .await
    }

    async fn output_released(
        &self,
        req: &JobOutputRequest,
        release: (u64, u64),
    ) -> Result<JobOutput, GuestError> {
        let job = self.get(req.job)?;
        // Subscribe before looking, so a change between the look and the wait is not lost.
        let mut changes = job.changed.subscribe();
        let (out, nothing_new) = job.read(req, release)?;
        if !nothing_new || req.wait_ms == 0 {
            return Ok(out);
        }
        let wait = Duration::from_millis(u64::from(req.wait_ms.min(MAX_OUTPUT_WAIT_MS)));
        let _ = tokio::time::timeout(wait, changes.changed()).await;
        Ok(job.read(req, release)?.0)
    }

    /// Every retained job with its state and background processes, oldest first.
    pub fn list(&self) -> Vec<warren_protocol::JobSummary> {
        let jobs: Vec<Arc<Job>> = self.table().jobs.values().cloned().collect();
        jobs.iter()
            .map(|j| {
                let (state, background) = {
                    let d = j.data();
                    (d.state, d.live && !matches!(d.state, JobState::Running))
                };
                // Counted afresh (the supervisor task's count may be up to a poll old).
                let (background_processes, processes) = if background {
                    leftovers::processes(j, MAX_LISTED_PROCESSES)
                } else {
                    (0, Vec::new())
                };
                warren_protocol::JobSummary {
                    id: j.id,
                    state,
                    command: j.command.clone(),
                    background_processes,
                    processes,
                }
            })
            .collect()
    }

    /// Freezes every job (the whole `jobs` cgroup subtree) and stops their timeout clocks.
    /// Returns how many jobs are running. Freezing twice is harmless.
    pub fn freeze(&self) -> Result<u32, GuestError> {
        if let Containment::Cgroup(dir) = &self.cfg.containment {
            fs::write(dir.join("cgroup.freeze"), "1").map_err(|e| internal("freeze jobs", e))?;
        }
        self.suspension.send_modify(|s| {
            s.frozen_since.get_or_insert_with(tokio::time::Instant::now);
        });
        let running = self
            .table()
            .jobs
            .values()
            .filter(|j| j.is_running())
            .count();
        Ok(u32::try_from(running).unwrap_or(u32::MAX))
    }

    /// Restarts the timeout clocks (the frozen time is added to every budget) and thaws the
    /// jobs. Thawing jobs that are not frozen is harmless.
    pub fn thaw(&self) -> Result<(), GuestError> {
        self.suspension.send_modify(|s| {
            if let Some(since) = s.frozen_since.take() {
                s.total += since.elapsed();
            }
        });
        if let Containment::Cgroup(dir) = &self.cfg.containment {
            fs::write(dir.join("cgroup.freeze"), "0").map_err(|e| internal("thaw jobs", e))?;
        }
        Ok(())
    }

    /// Kills a job's whole cgroup: a running job and everything it started, or the background
    /// processes of a finished one (its exit status stays). A job whose processes are all
    /// gone is left as it is.
    pub fn cancel(&self, id: JobId) -> Result<(), GuestError> {
        self.get(id)?.kill(Some(KillReason::Cancel));
        Ok(())
    }

    /// Spawns a helper the agent runs for the host outside job accounting (a guest stream's
    /// `tar`): as the guest user, with the jobs' base environment, in `/`. The caller sets
    /// its standard streams and owns the child (kill it to abandon it).
    pub fn spawn_helper(
        &self,
        cmd: &mut Command,
    ) -> std::io::Result<(
        std::process::Child,
        tokio::sync::oneshot::Receiver<crate::reaper::ExitStatus>,
    )> {
        let extra = self
            .extra_env
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        cmd.env_clear()
            .envs(launch::job_env(&extra, &[], false))
            .current_dir("/");
        if let Some(id) = self.cfg.files.user {
            // std's plain fork path: it drops supplementary groups, then sets gid and uid.
            std::os::unix::process::CommandExt::uid(cmd, id);
            std::os::unix::process::CommandExt::gid(cmd, id);
        }
        self.reaper.spawn(cmd)
    }

    /// Times `iterations` spawns and waits of `/bin/true` as the guest user, outside job
    /// accounting.
    pub async fn bench_fork_exec_wait(&self, iterations: u32) -> Result<BenchReply, GuestError> {
        if iterations > MAX_BENCH_ITERATIONS {
            return Err(invalid(format!(
                "at most {MAX_BENCH_ITERATIONS} iterations"
            )));
        }
        let mut samples_ns = Vec::with_capacity(iterations as usize);
        for _ in 0..iterations {
            let mut cmd = Command::new("/bin/true");
            cmd.stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null());
            if let Some(id) = self.cfg.files.user {
                // std's plain fork path: it drops supplementary groups, then sets gid and uid.
                std::os::unix::process::CommandExt::uid(&mut cmd, id);
                std::os::unix::process::CommandExt::gid(&mut cmd, id);
            }
            let started = Instant::now();
            let (_child, exit) = self
                .reaper
                .spawn(&mut cmd)
                .map_err(|e| spawn_error("/bin/true", &e))?;
            exit.await.map_err(|e| internal("bench wait", e))?;
            samples_ns.push(u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX));
        }
        Ok(BenchReply { samples_ns })
    }
}

pub mod broker;
mod interactive;
mod launch;
mod leftovers;
mod supervise;

#[cfg(test)]
mod tests;

#[cfg(test)]
mod leftover_tests;
