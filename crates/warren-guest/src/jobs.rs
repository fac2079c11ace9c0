//! The job manager: starts commands, drains and retains their output, enforces limits and
//! timeouts, and reports how they ended. Jobs belong to the agent, not to a session: they and
//! their output survive host reconnections.
//!
//! Per job, on the agent's tokio runtime:
//! - two drain tasks read stdout and stderr to end of file into the job's buffers, keeping at
//!   most `max_retained` bytes across both streams and discarding the rest (`truncated`), so a
//!   command never blocks on output whatever the host does;
//! - an optional stdin task writes the given bytes and closes the pipe;
//! - a supervisor task waits for the main process's status (from the [`Reaper`], never from
//!   `Child::wait`), fires the timeout, kills whatever remains of the job once the main process
//!   ended, waits for both drains, marks the job `Finished`, then removes its cgroup.
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
use std::ffi::CString;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::unix::pipe;
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;
use warren_protocol::limits::{
    MAX_ARGV, MAX_ENV, MAX_JOB_RECORDS, MAX_OUTPUT_WAIT_MS, MAX_READ_PER_STREAM, MAX_REQUEST_KEYS,
    MAX_REQUEST_KEY_BYTES, MAX_RETAINED_OUTPUT, MAX_RUNNING_JOBS, MAX_STDIN_BYTES,
};
use warren_protocol::{
    BenchReply, ErrorCode, ExecStart, GuestError, JobExit, JobId, JobOutput, JobOutputRequest,
    JobState, WindowSize,
};

use crate::files::{self, FilesConfig};
use crate::pty;
use crate::reaper::{ExitStatus, Reaper};
use crate::request_keys::{Lookup, RequestKeys};
use crate::sys::spawn::SpawnRequest;
use crate::sys::ChildSetup;

/// Environment every job starts from; the request's `env` overrides it.
const BASE_ENV: [(&str, &str); 6] = [
    (
        "PATH",
        "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    ),
    ("HOME", "/home/user"),
    ("USER", "user"),
    ("LOGNAME", "user"),
    ("LANG", "C.UTF-8"),
    ("TERM", "dumb"),
];

/// `TERM` of terminal jobs unless the request sets one.
const TERMINAL_TERM: &str = "xterm-256color";

/// Most iterations one `ForkExecWait` bench request may ask for (bounds its duration).
pub const MAX_BENCH_ITERATIONS: u32 = 10_000;

/// How long to keep retrying `rmdir` of a job cgroup the kernel still reports populated.
const CGROUP_RMDIR_ATTEMPTS: u32 = 200;
const CGROUP_RMDIR_PAUSE: Duration = Duration::from_millis(10);

const DRAIN_CHUNK: usize = 64 * 1024;

/// How long an interactive job's remaining output waits for the host once its processes
/// are gone (see `supervise`).
const INTERACTIVE_CLOSE_GRACE: Duration = Duration::from_secs(30);

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
    pub max_retained: u64,
    /// Exec request keys remembered (the most recent ones).
    pub max_request_keys: usize,
}

impl JobsConfig {
    /// The in-guest configuration with the protocol's limits.
    pub fn guest(files: FilesConfig, cgroup_jobs_dir: PathBuf) -> Self {
        Self {
            files,
            containment: Containment::Cgroup(cgroup_jobs_dir),
            max_running: MAX_RUNNING_JOBS,
            max_records: MAX_JOB_RECORDS,
            max_retained: MAX_RETAINED_OUTPUT,
            max_request_keys: MAX_REQUEST_KEYS,
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
}

impl Job {
    fn data(&self) -> MutexGuard<'_, JobData> {
        // Job data stays consistent under every early exit: recover from poisoning.
        self.data.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn is_running(&self) -> bool {
        matches!(self.data().state, JobState::Running)
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

    /// Kills every process of the job; records `reason` unless one was recorded before.
    fn kill(&self, reason: Option<KillReason>) {
        let pid = {
            let mut d = self.data();
            if !matches!(d.state, JobState::Running) {
                return;
            }
            if d.kill.is_none() {
                d.kill = reason;
            }
            d.pid
        };
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
    /// bytes before the cursors (the host has them), making room for more output.
    fn read(&self, req: &JobOutputRequest) -> Result<(JobOutput, bool), GuestError> {
        let max = req.max_bytes.min(MAX_READ_PER_STREAM) as usize;
        let mut d = self.data();
        // Offset of `cursor` in a buffer that starts at absolute position `base`.
        let offset = |buf: &[u8], base: u64, cursor: u64, name: &str| {
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
        if self.io != JobIo::Batch && (out_off > 0 || err_off > 0) {
            d.stdout.drain(..out_off);
            d.stderr.drain(..err_off);
            d.stdout_base = req.stdout_cursor;
            d.stderr_base = req.stderr_cursor;
            (out_off, err_off) = (0, 0);
            self.room.notify_waiters();
        }
        let take =
            |buf: &[u8], off: usize| buf[off..buf.len().min(off.saturating_add(max))].to_vec();
        let caught_up = out_off == d.stdout.len() && err_off == d.stderr.len();
        let running = matches!(d.state, JobState::Running);
        let out = JobOutput {
            stdout: take(&d.stdout, out_off),
            stderr: take(&d.stderr, err_off),
            stdout_retained: d.stdout_base + d.stdout.len() as u64,
            stderr_retained: d.stderr_base + d.stderr.len() as u64,
            state: d.state,
            truncated: d.truncated,
        };
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

/// The job's environment: the base environment (with `TERM=xterm-256color` on a terminal)
/// overridden by the request's entries.
fn job_env(
    base: &[(String, String)],
    extra: &[(String, String)],
    terminal: bool,
) -> Vec<(String, String)> {
    let mut env: BTreeMap<String, String> = BASE_ENV
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .chain(base.iter().cloned())
        .collect();
    if terminal {
        env.insert("TERM".into(), TERMINAL_TERM.into());
    }
    for (k, v) in extra {
        env.insert(k.clone(), v.clone());
    }
    env.into_iter().collect()
}

/// Finds `program` the way `execvp` does: as given when it contains a `/` (relative ones are
/// resolved by `execve` against the job's working directory), otherwise the first executable
/// regular file of that name in the job's `PATH`.
fn resolve_program(program: &str, env: &[(String, String)]) -> io::Result<CString> {
    let nul = || io::Error::new(io::ErrorKind::InvalidInput, "program contains NUL");
    if program.contains('/') {
        return CString::new(program).map_err(|_| nul());
    }
    let path = env
        .iter()
        .find(|(k, _)| k == "PATH")
        .map(|(_, v)| v.as_str())
        .unwrap_or_default();
    for dir in path.split(':').filter(|d| !d.is_empty()) {
        let candidate = PathBuf::from(dir).join(program);
        if let Ok(meta) = fs::metadata(&candidate) {
            if meta.is_file() && meta.permissions().mode() & 0o111 != 0 {
                return CString::new(candidate.into_os_string().into_encoded_bytes())
                    .map_err(|_| nul());
            }
        }
    }
    Err(io::Error::new(io::ErrorKind::NotFound, "not found in PATH"))
}

fn spawn_error(program: &str, err: &io::Error) -> GuestError {
    match err.kind() {
        io::ErrorKind::NotFound => {
            GuestError::new(ErrorCode::NotFound, format!("command not found: {program}"))
        }
        io::ErrorKind::PermissionDenied => GuestError::new(
            ErrorCode::PermissionDenied,
            format!("permission denied: {program}"),
        ),
        _ => GuestError::new(ErrorCode::Io, format!("spawn {program}: {err}")),
    }
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
        if t.jobs.len() >= self.cfg.max_records {
            let oldest_finished = t
                .jobs
                .iter()
                .find(|(_, j)| !j.is_running())
                .map(|(id, _)| *id);
            match oldest_finished {
                Some(id) => {
                    t.jobs.remove(&id);
                }
                None => {
                    return Err(GuestError::new(
                        ErrorCode::QuotaExceeded,
                        "job records are full and none has finished",
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
            }),
            changed: watch::Sender::new(0),
            io,
            input: tokio::sync::Mutex::new(None),
            terminal: Mutex::new(None),
            room: tokio::sync::Notify::new(),
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
        self.start_job(req, JobIo::Batch, key)
    }

    /// Reserves, then launches; shared by batch and interactive starts. `key` is the
    /// request key with the digest of the whole request.
    fn start_job(
        self: &Arc<Self>,
        req: ExecStart,
        io: JobIo,
        key: Option<(String, [u8; 32])>,
    ) -> Result<JobId, GuestError> {
        // Nothing below awaits: on the agent's single-threaded runtime a start runs to its end
        // before another request is polled, so a duplicate never sees a reserved job whose
        // launch then fails.
        let job = match self.reserve(key, io)? {
            Reservation::New(job) => job,
            Reservation::Existing(id) => return Ok(id),
        };
        // The working directory is opened after the key lookup: a retry must find its job even
        // when the job has since removed its own working directory. A single openat2 with the
        // guest user's fs identity (restored before returning): cheap enough to run inline,
        // and a blocking-pool hop costs milliseconds under TCG.
        let launched = files::open_dir(&self.cfg.files, req.cwd.as_deref())
            .and_then(|cwd_fd| self.launch(&job, req, cwd_fd));
        match launched {
            Ok(()) => Ok(job.id),
            Err(e) => {
                let mut t = self.table();
                t.jobs.remove(&job.id);
                t.keys.forget(job.id);
                drop(t);
                if let Some(dir) = &job.cgroup {
                    let _ = fs::remove_dir(dir);
                }
                Err(e)
            }
        }
    }

    fn launch(
        self: &Arc<Self>,
        job: &Arc<Job>,
        req: ExecStart,
        cwd: OwnedFd,
    ) -> Result<(), GuestError> {
        let cgroup_procs = match &job.cgroup {
            Some(dir) => {
                fs::create_dir(dir).map_err(|e| internal("create job cgroup", e))?;
                let procs = OpenOptions::new()
                    .write(true)
                    .open(dir.join("cgroup.procs"))
                    .map_err(|e| internal("open cgroup.procs", e))?;
                Some(OwnedFd::from(procs))
            }
            None => None,
        };
        let terminal_size = match job.io {
            JobIo::Terminal(size) => Some(size),
            JobIo::Batch | JobIo::Pipe => None,
        };
        let base = self
            .extra_env
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let env = job_env(&base, &req.env, terminal_size.is_some());
        let program =
            resolve_program(&req.argv[0], &env).map_err(|e| spawn_error(&req.argv[0], &e))?;
        let to_c = |s: &str| CString::new(s).map_err(|_| invalid("argument contains NUL"));
        let argv = req
            .argv
            .iter()
            .map(|a| to_c(a))
            .collect::<Result<Vec<_>, _>>()?;
        let envp = env
            .iter()
            .map(|(k, v)| to_c(&format!("{k}={v}")))
            .collect::<Result<Vec<_>, _>>()?;
        let pipe = || {
            rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)
                .map_err(|e| internal("pipe", io::Error::from(e)))
        };
        if let Some(size) = terminal_size {
            let pair = pty::open(size, self.cfg.files.user)
                .map_err(|e| internal("open pseudo-terminal", e))?;
            let setup = ChildSetup {
                new_session: true,
                controlling_terminal: true,
                cgroup_procs,
                user: self.cfg.files.user,
                cwd: Some(cwd),
            };
            let spawn_req = SpawnRequest {
                program: &program,
                argv: &argv,
                envp: &envp,
                stdin: pair.slave.as_fd(),
                stdout: pair.slave.as_fd(),
                stderr: pair.slave.as_fd(),
                setup: &setup,
            };
            let master =
                Arc::new(pty::Master::new(pair.master).map_err(|e| internal("terminal", e))?);
            let (pid, exit) = self
                .reaper
                .spawn_with(|| crate::sys::spawn::spawn(&spawn_req))
                .map_err(|e| spawn_error(&req.argv[0], &e))?;
            // Only the job holds the slave now: the master reads EIO once it is gone.
            drop((pair.slave, setup));
            job.data().pid = Some(pid);
            *job.terminal() = Some(master.clone());
            if let Ok(mut input) = job.input.try_lock() {
                *input = Some(InputSink::Terminal(master.clone()));
            }
            let drains = vec![tokio::spawn(interactive::drain_terminal(
                job.clone(),
                master,
                self.cfg.max_retained,
            ))];
            self.supervise(job, exit, drains, req.timeout_ms);
            return Ok(());
        }
        let (out_r, out_w) = pipe()?;
        let (err_r, err_w) = pipe()?;
        let (stdin_child, stdin_parent) = if req.stdin.is_some() || job.io == JobIo::Pipe {
            let (r, w) = pipe()?;
            (r, Some(w))
        } else {
            let null = File::open("/dev/null").map_err(|e| internal("open /dev/null", e))?;
            (OwnedFd::from(null), None)
        };
        let setup = ChildSetup {
            new_session: true,
            controlling_terminal: false,
            cgroup_procs,
            user: self.cfg.files.user,
            cwd: Some(cwd),
        };
        let spawn_req = SpawnRequest {
            program: &program,
            argv: &argv,
            envp: &envp,
            stdin: stdin_child.as_fd(),
            stdout: out_w.as_fd(),
            stderr: err_w.as_fd(),
            setup: &setup,
        };
        let (pid, exit) = self
            .reaper
            .spawn_with(|| crate::sys::spawn::spawn(&spawn_req))
            .map_err(|e| spawn_error(&req.argv[0], &e))?;
        // The child has its copies; closing ours lets the pipes reach end of file.
        drop((stdin_child, out_w, err_w, setup));
        job.data().pid = Some(pid);

        let stdin_parent = match (stdin_parent, job.io) {
            (Some(fd), JobIo::Pipe) => {
                let tx = pipe::Sender::from_owned_fd(fd).map_err(|e| internal("stdin pipe", e))?;
                if let Ok(mut input) = job.input.try_lock() {
                    *input = Some(InputSink::Pipe(tx));
                }
                None
            }
            (fd, _) => fd,
        };

        if let (Some(fd), Some(data)) = (stdin_parent, req.stdin) {
            match pipe::Sender::from_owned_fd(fd) {
                Ok(mut tx) => {
                    tokio::spawn(async move {
                        // EPIPE when the job does not read everything: fine.
                        let _ = tx.write_all(&data).await;
                    });
                }
                Err(e) => crate::console::log(format_args!("job {}: stdin: {e}", job.id)),
            }
        }
        let mut drains = Vec::with_capacity(2);
        for (fd, stream) in [(out_r, Stream::Stdout), (err_r, Stream::Stderr)] {
            let rx = pipe::Receiver::from_owned_fd(fd).map_err(|e| internal("output pipe", e))?;
            drains.push(tokio::spawn(drain(
                job.clone(),
                rx,
                stream,
                self.cfg.max_retained,
            )));
        }
        self.supervise(job, exit, drains, req.timeout_ms);
        Ok(())
    }

    /// Starts the task that ends the job (see [`supervise`]).
    fn supervise(
        &self,
        job: &Arc<Job>,
        exit: oneshot::Receiver<ExitStatus>,
        drains: Vec<JoinHandle<()>>,
        timeout_ms: Option<u64>,
    ) {
        let timeout = timeout_ms.map(|t| Budget {
            start: tokio::time::Instant::now(),
            budget: Duration::from_millis(t),
            frozen_before: self.suspension.borrow().total,
            clock: self.suspension.subscribe(),
        });
        tokio::spawn(supervise(job.clone(), exit, drains, timeout));
    }

    /// Reads output at the request's cursors, long-polling when asked and nothing is new.
    pub async fn output(&self, req: &JobOutputRequest) -> Result<JobOutput, GuestError> {
        let job = self.get(req.job)?;
        // Subscribe before looking, so a change between the look and the wait is not lost.
        let mut changes = job.changed.subscribe();
        let (out, nothing_new) = job.read(req)?;
        if !nothing_new || req.wait_ms == 0 {
            return Ok(out);
        }
        let wait = Duration::from_millis(u64::from(req.wait_ms.min(MAX_OUTPUT_WAIT_MS)));
        let _ = tokio::time::timeout(wait, changes.changed()).await;
        Ok(job.read(req)?.0)
    }

    /// Every retained job and its state, oldest first.
    pub fn list(&self) -> Vec<warren_protocol::JobSummary> {
        let jobs: Vec<Arc<Job>> = self.table().jobs.values().cloned().collect();
        jobs.iter()
            .map(|j| warren_protocol::JobSummary {
                id: j.id,
                state: j.data().state,
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

    /// Kills a running job's processes; a finished job is left as it is.
    pub fn cancel(&self, id: JobId) -> Result<(), GuestError> {
        self.get(id)?.kill(Some(KillReason::Cancel));
        Ok(())
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

async fn drain(job: Arc<Job>, mut rx: pipe::Receiver, stream: Stream, max_retained: u64) {
    let mut buf = vec![0u8; DRAIN_CHUNK];
    loop {
        match rx.read(&mut buf).await {
            Ok(0) => return,
            Ok(n) if job.io == JobIo::Batch => job.append(stream, &buf[..n], max_retained),
            Ok(n) => job.append_flow(stream, &buf[..n], max_retained).await,
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

async fn supervise(
    job: Arc<Job>,
    mut exit: oneshot::Receiver<ExitStatus>,
    drains: Vec<JoinHandle<()>>,
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
    // The main process ended: whatever it left behind goes too.
    job.kill(None);
    let drained = async {
        for d in drains {
            let _ = d.await;
        }
    };
    tokio::pin!(drained);
    // An interactive job's drains wait for the host to read; once its processes are gone,
    // give the host this long before discarding what does not fit.
    let closing = tokio::time::sleep(INTERACTIVE_CLOSE_GRACE);
    tokio::pin!(closing);
    let mut closed = job.io == JobIo::Batch;
    loop {
        tokio::select! {
            () = &mut drained => break,
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
    }
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
    }
    job.bump();
    // Interactive input ends with the job; a pending `JobInput` saw the bump and gives up
    // the lock. Dropping the last reference to a terminal master closes it.
    job.terminal().take();
    job.input.lock().await.take();
    if let Some(dir) = &job.cgroup {
        remove_cgroup(job.id, dir).await;
    }
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

#[path = "jobs_interactive.rs"]
mod interactive;

#[cfg(test)]
#[path = "jobs_tests.rs"]
mod tests;
