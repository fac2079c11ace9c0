//! Interactive jobs: starting them (`ExecInteractive`), their input (`JobInput`), terminal
//! resizes (`JobResize`) and the drain of a terminal's master.
//!
//! Input backpressure: a `JobInput` is answered once its bytes are written to the pipe or the
//! terminal. While the job does not read, the pipe (64 KiB) or the terminal's input queue
//! (4 KiB) fills and the request waits, so the host, which sends one input at a time, slows
//! down to the job's pace. A request never holds more than `MAX_INPUT_CHUNK` bytes. A pending
//! write gives up when the job finishes (or the host resets the request).

use std::sync::Arc;

use tokio::io::AsyncWriteExt;
use warren_protocol::limits::MAX_INPUT_CHUNK;
use warren_protocol::{ErrorCode, ExecInteractive, GuestError, JobId, JobInput, JobResize};

use super::{invalid, validate_exec, InputSink, Job, JobIo, JobManager, Stream, DRAIN_CHUNK};
use crate::pty;

fn closed(id: JobId, why: &str) -> GuestError {
    GuestError::new(
        ErrorCode::InvalidArgument,
        format!("input of job {id} is closed: {why}"),
    )
}

fn check_size(size: warren_protocol::WindowSize) -> Result<(), GuestError> {
    if size.rows == 0 || size.cols == 0 {
        return Err(invalid("terminal rows and cols must be at least 1"));
    }
    Ok(())
}

impl JobManager {
    /// Starts an interactive job (see `ExecInteractive`); request keys work as for
    /// [`JobManager::start`], digesting the whole interactive request.
    pub async fn start_interactive(
        self: &Arc<Self>,
        req: ExecInteractive,
    ) -> Result<JobId, GuestError> {
        validate_exec(&req.start)?;
        if req.start.stdin.is_some() {
            return Err(invalid(
                "an interactive job takes its input with JobInput, not stdin",
            ));
        }
        if let Some(size) = req.tty {
            check_size(size)?;
        }
        let key = match &req.start.request_key {
            Some(k) => {
                let digest = req.digest().map_err(|e| super::internal("digest", e))?;
                Some((k.clone(), digest))
            }
            None => None,
        };
        let io = match req.tty {
            Some(size) => JobIo::Terminal(size),
            None => JobIo::Pipe,
        };
        self.start_job(req.start, io, key, false)
    }

    /// Writes input to an interactive job, then closes it when `eof`.
    pub async fn input(&self, req: JobInput) -> Result<(), GuestError> {
        if req.data.len() > MAX_INPUT_CHUNK {
            return Err(invalid(format!(
                "input exceeds {MAX_INPUT_CHUNK} bytes per request"
            )));
        }
        let job = self.get(req.job)?;
        if job.io == JobIo::Batch {
            return Err(invalid(format!(
                "job {} is not interactive: it takes no input",
                job.id
            )));
        }
        // Subscribe before looking, so the end of the job is never missed.
        let mut changes = job.changed.subscribe();
        let ended = async {
            while job.is_running() {
                if changes.changed().await.is_err() {
                    break;
                }
            }
        };
        let write = async {
            let mut sink = job.input.lock().await;
            let Some(s) = sink.as_mut() else {
                return Err(closed(job.id, "end of input was sent or the job ended"));
            };
            let written = match s {
                InputSink::Pipe(tx) => tx.write_all(&req.data).await,
                InputSink::Terminal(master) => {
                    let mut r = master.write_all(&req.data).await;
                    if r.is_ok() && req.eof {
                        r = master.write_all(&[pty::VEOF_DEFAULT]).await;
                    }
                    r
                }
            };
            if let Err(e) = written {
                *sink = None;
                return Err(if e.kind() == std::io::ErrorKind::BrokenPipe {
                    closed(job.id, "the job closed its stdin")
                } else {
                    GuestError::new(ErrorCode::Io, format!("job {} input: {e}", job.id))
                });
            }
            if req.eof {
                // Closes a pipe; a terminal master stays open for output and resizes.
                *sink = None;
            }
            Ok(())
        };
        tokio::select! {
            r = write => r,
            () = ended => Err(closed(job.id, "the job has finished")),
        }
    }

    /// Sets a terminal job's window size.
    pub fn resize(&self, req: JobResize) -> Result<(), GuestError> {
        check_size(req.size)?;
        let job = self.get(req.job)?;
        if !matches!(job.io, JobIo::Terminal(_)) {
            return Err(GuestError::new(
                ErrorCode::WrongType,
                format!("job {} has no terminal", job.id),
            ));
        }
        let master = job.terminal().clone();
        match master {
            Some(m) => pty::set_size(m.fd(), req.size)
                .map_err(|e| GuestError::new(ErrorCode::Io, format!("resize: {e}"))),
            None => Err(invalid(format!("job {} has finished", job.id))),
        }
    }
}

impl Job {
    /// Interactive jobs' output is flow-controlled: at most `max_retained` unread bytes are
    /// kept, and a full window makes the drain (and so, once the pipe or terminal buffer is
    /// full, the job) wait until the host reads. Nothing is discarded unless `closing`.
    pub(super) async fn append_flow(&self, stream: Stream, mut bytes: &[u8], max_retained: u64) {
        while !bytes.is_empty() {
            let notified = self.room.notified();
            tokio::pin!(notified);
            // Registered before looking, so a release in between is not missed.
            notified.as_mut().enable();
            let took = {
                let mut d = self.data();
                let used = (d.stdout.len() + d.stderr.len()) as u64;
                let room = usize::try_from(max_retained.saturating_sub(used))
                    .unwrap_or(usize::MAX)
                    .min(bytes.len());
                if room == 0 && d.closing {
                    d.truncated = true;
                    drop(d);
                    self.bump();
                    return;
                }
                let buf = match stream {
                    Stream::Stdout => &mut d.stdout,
                    Stream::Stderr => &mut d.stderr,
                };
                buf.extend_from_slice(&bytes[..room]);
                room
            };
            if took > 0 {
                bytes = &bytes[took..];
                self.bump();
            } else {
                notified.await;
            }
        }
    }
}

/// Reads a terminal's master into the job's stdout buffer until no slave is open any more.
pub(super) async fn drain_terminal(job: Arc<Job>, master: Arc<pty::Master>, max_retained: u64) {
    let mut buf = vec![0u8; DRAIN_CHUNK];
    loop {
        match master.read(&mut buf).await {
            Ok(0) => return,
            Ok(n) => {
                job.consumed(n);
                job.append_flow(Stream::Stdout, &buf[..n], max_retained)
                    .await;
            }
            Err(e) => {
                crate::console::log(format_args!("job {}: read terminal: {e}", job.id));
                return;
            }
        }
    }
}
