//! Interactive jobs from the host: the requests (`ExecInteractive`, `JobInput`, `JobResize`)
//! and [`Warren::interactive`], which connects this process's stdin, stdout and stderr to a
//! job the way `ssh` does: for `warren vm exec --tty` and `warren run`.
//!
//! [`Warren::interactive`], in order:
//! 1. starts the job: on a guest pseudo-terminal of the local terminal's size (`tty`), else
//!    with a stdin pipe;
//! 2. with `tty` and a local terminal on stdin, puts it in raw mode; a [`RawMode`] guard
//!    restores it on every way out (return, error, panic unwinding; SIGTERM, SIGHUP and SIGINT
//!    are caught and turned into a return);
//! 3. a thread reads local stdin (raw reads, polled so it stops when the job ends) and a
//!    forwarder task sends each chunk as `JobInput` in order, one at a time (the guest answers
//!    once the bytes are written: backpressure), local end of file as `eof`, and every
//!    SIGWINCH as `JobResize` with the local terminal's new size;
//! 4. the calling task long-polls `JobOutput` and writes what arrives to stdout (and stderr
//!    without `tty`; a terminal merges both into stdout);
//! 5. when the job has finished and its output is drained, stops the reader and the
//!    forwarder, restores the terminal and returns the job's exit code.
//!
//! Ctrl-C: with `tty` and a raw local terminal it is the byte 0x03, sent to the guest's
//! terminal, which signals SIGINT to the job's foreground process group. Otherwise (no
//! terminal) a SIGINT to this process cancels the job, as `warren vm exec` does.

use std::io::Write;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use nix::sys::signal::Signal;
use rustix::termios::{self, OptionalActions, Termios};
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::mpsc;
use warren_protocol::limits::{MAX_INPUT_CHUNK, MAX_READ_PER_STREAM};
use warren_protocol::{
    ExecInteractive, ExecStart, GuestResponse, HostRequest, JobExit, JobId, JobInput, JobOutput,
    JobOutputRequest, JobResize, JobState, WindowSize,
};
use warren_supervisor::SupervisorClient;

use crate::error::CoreError;
use crate::vm::{unexpected, Warren};

/// How long a job cancelled by a signal is waited for (its last output drained) before the
/// CLI leaves anyway: the guest reports the end, and a guest that never does must not hold
/// the CLI (a closed terminal's SIGHUP comes once).
pub const CANCEL_GRACE: std::time::Duration = std::time::Duration::from_secs(10);

/// The pause of an output follower after a turn that brought it nothing towards the end
/// it knows, once the job has ended: a well-behaved agent always sends what lies between a
/// cursor and that end, so only a guest contradicting its own earlier answer does this, and
/// it must not make the follower spin (found by a hostile review).
pub const STALLED_READ_PAUSE: std::time::Duration = std::time::Duration::from_millis(100);

/// Whether a follower's turn stalled (see [`STALLED_READ_PAUSE`]): the job's end is known
/// (`end_known`), the follower did not reach it, and the turn brought less than a full page
/// of either stream towards it (`out`, `err`: the bytes taken). A well-behaved agent sends
/// full pages until the rest fits in one, which then reaches the end.
pub fn stalled(end_known: bool, reached: bool, out: usize, err: usize) -> bool {
    let page = MAX_READ_PER_STREAM as usize;
    end_known && !reached && out < page && err < page
}

/// Resolves at `deadline`, never without one.
pub async fn grace_over(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

/// Exit code when the job's timeout killed it (as coreutils' `timeout`).
pub const EXIT_TIMEOUT: i32 = 124;
/// Exit code when the job ended without an exit code or signal (should not happen).
pub const EXIT_UNKNOWN: i32 = 125;
/// Guest terminal size when there is no local terminal to copy it from.
pub const DEFAULT_WINDOW: WindowSize = WindowSize { rows: 24, cols: 80 };

/// Local stdin is read in chunks of at most this many bytes (well below `MAX_INPUT_CHUNK`).
const READ_CHUNK: usize = 16 * 1024;
/// How often the stdin reader looks whether it should stop.
const STDIN_POLL_MS: u8 = 100;
/// Long-poll of each output read.
const OUTPUT_WAIT_MS: u32 = 5_000;

/// What [`Warren::interactive`] runs.
#[derive(Debug, Clone, Default)]
pub struct InteractiveSpec {
    pub argv: Vec<String>,
    /// Extra environment; with `tty`, the local `TERM` is added unless this sets one.
    pub env: Vec<(String, String)>,
    /// Working directory relative to /workspace.
    pub cwd: Option<String>,
    pub timeout_ms: Option<u64>,
    /// Run on a guest pseudo-terminal (stdout and stderr merged, local terminal raw).
    pub tty: bool,
}

/// The shell convention for a finished job: its code, 128+N for signal N, [`EXIT_TIMEOUT`]
/// when its timeout killed it.
pub fn exit_code(x: &JobExit) -> i32 {
    if x.timed_out {
        return EXIT_TIMEOUT;
    }
    if let Some(sig) = x.signal {
        return signal_exit(i64::from(sig));
    }
    x.code.unwrap_or(EXIT_UNKNOWN)
}

/// 128+N for a job killed by signal N, as a shell says it. The guest names the signal: a
/// number no signal has (Linux's are 1..=64) is [`EXIT_UNKNOWN`] rather than an overflow
/// (a panic in a debug build) or a sum that wraps to another exit status (128 + 128 is
/// status 0).
pub fn signal_exit(sig: i64) -> i32 {
    match sig {
        1..=64 => 128 + sig as i32,
        _ => EXIT_UNKNOWN,
    }
}

/// Whether this process's stdin is a terminal (`warren run` picks `tty` from it).
pub fn stdin_is_terminal() -> bool {
    termios::isatty(std::io::stdin().as_fd())
}

/// The size of the terminal on stdin, else on stdout, else [`DEFAULT_WINDOW`].
pub fn local_window_size() -> WindowSize {
    let stdin = std::io::stdin();
    let stdout = std::io::stdout();
    for fd in [stdin.as_fd(), stdout.as_fd()] {
        if let Ok(ws) = termios::tcgetwinsize(fd) {
            if ws.ws_row > 0 && ws.ws_col > 0 {
                return WindowSize {
                    rows: ws.ws_row,
                    cols: ws.ws_col,
                };
            }
        }
    }
    DEFAULT_WINDOW
}

/// A terminal in raw mode; dropping it restores the settings it found.
pub struct RawMode {
    fd: BorrowedFd<'static>,
    saved: Termios,
}

impl RawMode {
    /// Puts the terminal on `fd` in raw mode (no echo, no line editing, no signal keys, no
    /// output processing), as `cfmakeraw`.
    pub fn enable(fd: BorrowedFd<'static>) -> std::io::Result<RawMode> {
        let saved = termios::tcgetattr(fd)?;
        let mut raw = saved.clone();
        raw.make_raw();
        termios::tcsetattr(fd, OptionalActions::Now, &raw)?;
        Ok(RawMode { fd, saved })
    }
}

impl RawMode {
    /// Puts the terminal on this process's stdin in raw mode.
    pub fn stdin() -> std::io::Result<RawMode> {
        RawMode::enable(rustix::stdio::stdin())
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        if let Err(e) = termios::tcsetattr(self.fd, OptionalActions::Now, &self.saved) {
            tracing::warn!(error = %e, "restoring the terminal settings failed");
        }
    }
}

/// Reads stdin on a thread of its own (a blocking read cannot be cancelled; a polled one
/// can), sending chunks and then `None` at end of file. Stops when `stop` is set or the
/// receiver is gone.
pub fn spawn_stdin_reader(stop: Arc<AtomicBool>) -> mpsc::Receiver<Option<Vec<u8>>> {
    let (tx, rx) = mpsc::channel(4);
    let spawned = std::thread::Builder::new()
        .name("warren-stdin".into())
        .spawn(move || {
            let stdin = std::io::stdin();
            let fd = stdin.as_fd();
            let mut buf = vec![0u8; READ_CHUNK];
            while !stop.load(Ordering::Relaxed) {
                let mut fds = [nix::poll::PollFd::new(fd, nix::poll::PollFlags::POLLIN)];
                match nix::poll::poll(&mut fds, nix::poll::PollTimeout::from(STDIN_POLL_MS)) {
                    Ok(0) => continue,
                    Ok(_) => {}
                    Err(nix::errno::Errno::EINTR) => continue,
                    Err(e) => {
                        tracing::debug!(error = %e, "poll stdin");
                        let _ = tx.blocking_send(None);
                        return;
                    }
                }
                match rustix::io::read(fd, &mut buf) {
                    Ok(0) => {
                        let _ = tx.blocking_send(None);
                        return;
                    }
                    Ok(n) => {
                        if tx.blocking_send(Some(buf[..n].to_vec())).is_err() {
                            return;
                        }
                    }
                    Err(rustix::io::Errno::INTR | rustix::io::Errno::AGAIN) => continue,
                    Err(e) => {
                        tracing::debug!(error = %e, "read stdin");
                        let _ = tx.blocking_send(None);
                        return;
                    }
                }
            }
        });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "cannot start the stdin reader; the job gets no input");
    }
    rx
}

/// Sends local input and window changes to the job, in order, until stopped (aborted).
async fn forward(
    client: SupervisorClient,
    job: JobId,
    mut input: mpsc::Receiver<Option<Vec<u8>>>,
    resize: bool,
) {
    let mut winch = if resize {
        signal(SignalKind::window_change()).ok()
    } else {
        None
    };
    let mut input_open = true;
    loop {
        tokio::select! {
            chunk = input.recv(), if input_open => {
                let (data, eof) = match chunk {
                    Some(Some(data)) => (data, false),
                    Some(None) | None => (Vec::new(), true),
                };
                if eof {
                    input_open = false;
                }
                debug_assert!(data.len() <= MAX_INPUT_CHUNK);
                let req = HostRequest::JobInput(JobInput { job, data, eof });
                if let Err(e) = client.guest(req).await {
                    // The job ended or closed its input: later input has nowhere to go.
                    tracing::debug!(error = %e, "job input");
                    input_open = false;
                }
            }
            Some(()) = async {
                match winch.as_mut() {
                    Some(w) => w.recv().await,
                    None => std::future::pending().await,
                }
            } => {
                let req = HostRequest::JobResize(JobResize { job, size: local_window_size() });
                if let Err(e) = client.guest(req).await {
                    tracing::debug!(error = %e, "job resize");
                }
            }
            else => std::future::pending::<()>().await,
        }
    }
}

impl Warren {
    /// Starts an interactive job (see `ExecInteractive`); waking a suspended VM first.
    pub async fn exec_interactive(
        &self,
        id: &str,
        mut req: ExecInteractive,
    ) -> Result<JobId, CoreError> {
        self.with_image_env(id, &mut req.start)?;
        match self
            .awake_client(id)
            .await?
            .guest(HostRequest::ExecInteractive(req))
            .await?
        {
            GuestResponse::ExecStarted(j) => Ok(j),
            _ => Err(unexpected()),
        }
    }

    /// Writes input to an interactive job (at most `MAX_INPUT_CHUNK` bytes); answered once
    /// the guest wrote it.
    pub async fn job_input(
        &self,
        id: &str,
        job: JobId,
        data: Vec<u8>,
        eof: bool,
    ) -> Result<(), CoreError> {
        match self
            .awake_client(id)
            .await?
            .guest(HostRequest::JobInput(JobInput { job, data, eof }))
            .await?
        {
            GuestResponse::InputWritten => Ok(()),
            _ => Err(unexpected()),
        }
    }

    /// Sets a terminal job's window size.
    pub async fn job_resize(
        &self,
        id: &str,
        job: JobId,
        size: WindowSize,
    ) -> Result<(), CoreError> {
        match self
            .awake_client(id)
            .await?
            .guest(HostRequest::JobResize(JobResize { job, size }))
            .await?
        {
            GuestResponse::Resized => Ok(()),
            _ => Err(unexpected()),
        }
    }

    /// Runs `spec` in VM `id` connected to this process's stdin, stdout and stderr (see the
    /// module documentation) and returns the job's exit code ([`exit_code`]); a SIGTERM,
    /// SIGHUP or SIGINT to this process cancels the job and returns 128 + that signal.
    /// With `tty` but no terminal on stdin the guest still gets a terminal (of stdout's size,
    /// or 24x80), and nothing is put in raw mode.
    ///
    /// Meant for a command-line process: it owns stdin while it runs (one reader thread).
    pub async fn interactive(&self, id: &str, spec: InteractiveSpec) -> Result<i32, CoreError> {
        let local_tty = spec.tty && stdin_is_terminal();
        let mut env = spec.env;
        if spec.tty && !env.iter().any(|(k, _)| k == "TERM") {
            if let Ok(term) = std::env::var("TERM") {
                if !term.is_empty() {
                    env.push(("TERM".into(), term));
                }
            }
        }
        let req = ExecInteractive {
            start: ExecStart {
                argv: spec.argv,
                env,
                cwd: spec.cwd,
                stdin: None,
                timeout_ms: spec.timeout_ms,
                request_key: None,
            },
            tty: spec.tty.then(local_window_size),
        };
        let job = self.exec_interactive(id, req).await?;
        // Raw mode only once the job runs: an error before leaves the terminal untouched.
        let setup = async {
            let client = self.awake_client(id).await?;
            let raw = if local_tty {
                let stdin: BorrowedFd<'static> = rustix::stdio::stdin();
                Some(RawMode::enable(stdin).map_err(|e| CoreError::io("raw mode on", "stdin", e))?)
            } else {
                None
            };
            Ok::<_, CoreError>((client, raw))
        };
        let (client, raw) = match setup.await {
            Ok(x) => x,
            Err(e) => {
                // Nobody would ever read or end the job: do not leave it holding a slot.
                if let Err(c) = self.job_cancel(id, job).await {
                    tracing::warn!(error = %c, job = %job, "cancelling the orphaned job failed");
                }
                return Err(e);
            }
        };
        let stop = Arc::new(AtomicBool::new(false));
        let input = spawn_stdin_reader(stop.clone());
        let forwarder = tokio::spawn(forward(client, job, input, local_tty));
        let result = self.pump_output(id, job, spec.tty).await;
        stop.store(true, Ordering::Relaxed);
        forwarder.abort();
        drop(raw);
        result
    }

    /// Streams the job's output until it finished and everything was written; handles the
    /// signals that end the session early.
    async fn pump_output(&self, id: &str, job: JobId, tty: bool) -> Result<i32, CoreError> {
        let sig = |kind: SignalKind| {
            signal(kind).map_err(|e| CoreError::io("install signal handler", "signal", e))
        };
        let mut term = sig(SignalKind::terminate())?;
        let mut hup = sig(SignalKind::hangup())?;
        let mut int = sig(SignalKind::interrupt())?;
        let mut ended_by: Option<i32> = None;
        let mut grace: Option<tokio::time::Instant> = None;
        let (mut out_cursor, mut err_cursor) = (0u64, 0u64);
        // The retained sizes when the job was first seen finished: the session ends there
        // (background processes it left may write on; that output stays readable).
        let mut end: Option<(u64, u64)> = None;
        loop {
            let req = JobOutputRequest {
                job,
                stdout_cursor: out_cursor,
                stderr_cursor: err_cursor,
                max_bytes: MAX_READ_PER_STREAM,
                wait_ms: OUTPUT_WAIT_MS,
            };
            // The first signal cancels the job and waits for its end; a second leaves at
            // once (a guest that never reports the end holds nobody).
            enum Next {
                Read(JobOutput),
                Signalled(Signal),
                GraceOver,
            }
            let next = tokio::select! {
                r = self.job_output(id, req) => Next::Read(r?),
                Some(()) = term.recv() => Next::Signalled(Signal::SIGTERM),
                Some(()) = hup.recv() => Next::Signalled(Signal::SIGHUP),
                Some(()) = int.recv() => Next::Signalled(Signal::SIGINT),
                () = grace_over(grace) => Next::GraceOver,
            };
            let out = match next {
                Next::Read(out) => out,
                Next::Signalled(sig) if ended_by.is_some() => {
                    tracing::warn!("left without waiting for the cancelled job to end");
                    return Ok(128 + sig as i32);
                }
                Next::GraceOver => {
                    tracing::warn!("the cancelled job did not end in time; left it");
                    return Ok(128 + ended_by.unwrap_or(Signal::SIGTERM as i32));
                }
                Next::Signalled(sig) => {
                    ended_by = Some(sig as i32);
                    grace = Some(tokio::time::Instant::now() + CANCEL_GRACE);
                    self.job_cancel(id, job).await?;
                    continue;
                }
            };
            if matches!(out.state, JobState::Finished(_)) && end.is_none() {
                end = Some((out.stdout_retained, out.stderr_retained));
            }
            let (stdout, stderr) = match end {
                Some((so, se)) => (
                    upto(&out.stdout, out_cursor, so),
                    upto(&out.stderr, err_cursor, se),
                ),
                None => (&out.stdout[..], &out.stderr[..]),
            };
            write_all(std::io::stdout(), stdout)?;
            if !tty {
                write_all(std::io::stderr(), stderr)?;
            }
            out_cursor += stdout.len() as u64;
            err_cursor += stderr.len() as u64;
            let caught_up = end.is_some_and(|(so, se)| out_cursor >= so && err_cursor >= se);
            if let (JobState::Finished(x), true) = (out.state, caught_up) {
                if out.truncated {
                    tracing::warn!("output truncated: the rest was discarded");
                }
                return Ok(match ended_by {
                    Some(s) => 128 + s,
                    None => exit_code(&x),
                });
            }
            if stalled(end.is_some(), caught_up, stdout.len(), stderr.len()) {
                tokio::time::sleep(STALLED_READ_PAUSE).await;
            }
        }
    }
}

/// The part of `bytes`, read at `cursor`, that lies before `end`.
fn upto(bytes: &[u8], cursor: u64, end: u64) -> &[u8] {
    let n = usize::try_from(end.saturating_sub(cursor)).unwrap_or(usize::MAX);
    &bytes[..bytes.len().min(n)]
}

fn write_all(mut w: impl Write, bytes: &[u8]) -> Result<(), CoreError> {
    if bytes.is_empty() {
        return Ok(());
    }
    w.write_all(bytes)
        .and_then(|()| w.flush())
        .map_err(|e| CoreError::io("write", "output", e))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A follower that knows where the job's output ends does not spin on a guest whose
    /// later answers contradict that end (found by a hostile review): each answer here is,
    /// on its own, the job's last (ended, complete, reaching the ends it claims), so the
    /// engine does not hold it, but it brings the follower nothing before the end the first
    /// answer gave. The follower pauses after each such turn: a few reads a second, not
    /// thousands.
    #[tokio::test]
    async fn test_a_follower_pauses_on_answers_short_of_the_end_it_knows() {
        // Past the end the first answer gave, and (found by a hostile review of the first
        // pause) one byte at a time below a far end.
        for far_end in [false, true] {
            follower_against(far_end).await;
        }
    }

    async fn follower_against(far_end: bool) {
        use warren_protocol::{GuestResponse, HostRequest, JobState};
        use warren_supervisor::proto::{read_frame, write_frame, Reply, SupervisorRequest};
        let id = "vm-0123456789ab";
        let (_state, w, _held) = crate::vm::test_engine_with_running_vm(id);
        let listener = tokio::net::UnixListener::bind(w.vm_dir(id).socket()).expect("bind");
        let reads = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let counted = reads.clone();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                let counted = counted.clone();
                tokio::spawn(async move {
                    while let Ok(req) = read_frame::<_, SupervisorRequest>(&mut s).await {
                        let SupervisorRequest::Guest(HostRequest::JobOutput(r)) = req else {
                            panic!("{req:?}");
                        };
                        let first = counted.fetch_add(1, Ordering::SeqCst) == 0;
                        // First: ended with 1,000 bytes of stderr to come (or 2^40 of
                        // stdout); then: one more stdout byte each time and nothing more.
                        let (stdout_end, stderr_end) = match (first, far_end) {
                            (true, true) => (1 << 40, r.stderr_cursor),
                            (true, false) => (r.stdout_cursor + 1, 1000),
                            (false, _) => (r.stdout_cursor + 1, r.stderr_cursor),
                        };
                        let answer = JobOutput {
                            stdout: b"x".to_vec(),
                            stderr: Vec::new(),
                            stdout_retained: stdout_end,
                            stderr_retained: stderr_end,
                            state: JobState::Finished(JobExit {
                                code: Some(0),
                                signal: None,
                                timed_out: false,
                                cancelled: false,
                            }),
                            truncated: false,
                            output_complete: true,
                            background_processes: 0,
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
        let followed = tokio::time::timeout(
            std::time::Duration::from_secs(1),
            w.pump_output(id, JobId(3), false),
        )
        .await;
        assert!(followed.is_err(), "the follower ended: {followed:?}");
        let n = reads.load(Ordering::SeqCst);
        assert!((2..=15).contains(&n), "far end {far_end}: {n} reads in 1 s");
    }

    #[test]
    fn test_exit_code_follows_shell_convention() {
        let x = |code, signal, timed_out| JobExit {
            code,
            signal,
            timed_out,
            cancelled: false,
        };
        assert_eq!(exit_code(&x(Some(7), None, false)), 7);
        assert_eq!(exit_code(&x(None, Some(2), false)), 130);
        assert_eq!(exit_code(&x(None, Some(9), true)), EXIT_TIMEOUT);
        assert_eq!(exit_code(&x(None, None, false)), EXIT_UNKNOWN);
        assert_eq!(exit_code(&x(None, Some(64), false)), 192);
        // The guest names the signal: no number it sends overflows (a debug build panicked
        // at i32::MAX) or wraps to another status (128 + 128 is exit status 0).
        for hostile in [i32::MAX, i32::MIN, 128, 0, -130] {
            assert_eq!(exit_code(&x(None, Some(hostile), false)), EXIT_UNKNOWN);
        }
    }

    #[test]
    fn test_raw_mode_restored_on_drop() {
        // A pseudo-terminal stands in for the user's terminal.
        let flags = rustix::pty::OpenptFlags::RDWR
            | rustix::pty::OpenptFlags::NOCTTY
            | rustix::pty::OpenptFlags::CLOEXEC;
        let master = rustix::pty::openpt(flags).expect("openpt");
        rustix::pty::grantpt(&master).expect("grantpt");
        rustix::pty::unlockpt(&master).expect("unlockpt");
        let slave = rustix::pty::ioctl_tiocgptpeer(&master, flags).expect("slave");
        let slave: &'static std::os::fd::OwnedFd = Box::leak(Box::new(slave));
        let before = termios::tcgetattr(slave).expect("attrs");
        assert!(before
            .local_modes
            .contains(termios::LocalModes::ICANON | termios::LocalModes::ECHO));
        let guard = RawMode::enable(slave.as_fd()).expect("raw");
        let raw = termios::tcgetattr(slave).expect("attrs");
        assert!(!raw.local_modes.intersects(
            termios::LocalModes::ICANON | termios::LocalModes::ECHO | termios::LocalModes::ISIG
        ));
        drop(guard);
        let after = termios::tcgetattr(slave).expect("attrs");
        assert_eq!(after.local_modes, before.local_modes);
        assert_eq!(after.input_modes, before.input_modes);
        assert_eq!(after.output_modes, before.output_modes);
    }
}
