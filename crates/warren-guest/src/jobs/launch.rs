//! Launching a job: its environment, program lookup, pipes or pseudo-terminal, and the spawn
//! into its cgroup.

use std::collections::BTreeMap;
use std::ffi::CString;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::sync::Arc;

use tokio::io::AsyncWriteExt;
use tokio::net::unix::pipe;
use warren_protocol::{ErrorCode, ExecStart, GuestError};

use super::supervise::drain;
use super::{interactive, internal, invalid, InputSink, Job, JobIo, JobManager, Stream};
use crate::pty;
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

/// The job's environment: the base environment (with `TERM=xterm-256color` on a terminal)
/// overridden by the request's entries.
pub(super) fn job_env(
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
pub(super) fn resolve_program(program: &str, env: &[(String, String)]) -> io::Result<CString> {
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

pub(super) fn spawn_error(program: &str, err: &io::Error) -> GuestError {
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

/// The job's broker directory for the spawn, when it has a pipe; the mount point is made
/// once (an empty directory everyone else sees).
fn broker_dir(job: &Job) -> Result<Option<CString>, GuestError> {
    let broker = job
        .broker
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone();
    let Some(b) = broker else {
        return Ok(None);
    };
    fs::create_dir_all(super::broker::BROKER_MOUNT)
        .map_err(|e| internal("create the broker mount point", e))?;
    CString::new(b.dir().as_os_str().as_encoded_bytes())
        .map(Some)
        .map_err(|_| invalid("broker directory contains NUL"))
}

impl JobManager {
    pub(super) fn launch(
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
        let mut base = base;
        if job
            .broker
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .is_some()
        {
            // Where the job finds its pipe (a request's own `env` may still override it).
            base.push((
                "WARREN_BROKER_SOCKET".into(),
                format!(
                    "{}/{}",
                    super::broker::BROKER_MOUNT,
                    super::broker::BROKER_SOCKET
                ),
            ));
        }
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
                broker_dir: None,
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
            // Duplicated before the spawn: nothing may fail once the job runs.
            let peek = vec![pair
                .master
                .try_clone()
                .map_err(|e| internal("duplicate terminal", e))?];
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
            self.supervise(job, exit, drains, peek, req.timeout_ms);
            return Ok(());
        }
        let (out_r, out_w) = pipe()?;
        let (err_r, err_w) = pipe()?;
        let dup = |fd: &OwnedFd| fd.try_clone().map_err(|e| internal("duplicate pipe", e));
        let peek = vec![dup(&out_r)?, dup(&err_r)?];
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
            broker_dir: broker_dir(job)?,
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
        self.supervise(job, exit, drains, peek, req.timeout_ms);
        Ok(())
    }
}
