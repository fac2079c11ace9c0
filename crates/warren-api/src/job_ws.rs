//! Jobs over WebSocket, behind the same guard and authentication layers as the tools:
//! - `GET /v1/vms/{vm_id}/jobs/{job_id}/output?stdout=N&stderr=M&until=exit|complete`: a
//!   job's output as it arrives, from byte cursors (so a client that lost its connection
//!   resumes where it was);
//! - `GET /v1/vms/{vm_id}/jobs/{job_id}/terminal?stdout=N&stderr=M`: the same, plus input,
//!   end of input and window sizes for an interactive job (`vm_exec` with `tty` or
//!   `interactive`). Disconnecting never stops the job; a newer attachment replaces an older.
//!
//! Messages from the service:
//! - binary: one byte naming the stream ([`STDOUT`] or [`STDERR`]; a terminal's output is
//!   all stdout), then that stream's next bytes;
//! - text, last: the job's end as JSON (`{"event":"exit", "exit_code", "signal",
//!   "timed_out", "cancelled", "truncated", "next_cursor", "output_complete",
//!   "background_processes"}`), followed by close 1000 `job finished`.
//!
//! With `until=exit` (the default) the stream ends when the job's main process has ended and
//! the output it wrote before is sent, as `warren vm exec` ends; with `until=complete` it
//! also follows what background processes the job left write, until the job's output is
//! complete.
//!
//! Messages to the service (terminal only): binary messages are input (an empty one ends
//! the job's input), text messages are JSON `{"resize": {"rows": R, "cols": C}}`. Input to
//! the output endpoint, or anything else, closes with 1008.
//!
//! Other closes, as for guest streams (`crate::ws`): 1001 `suspended` / `destroyed` /
//! `replaced by another attachment`, 1008 when the credential no longer holds (rechecked
//! every [`crate::ws::RECHECK`]), 1011 when the guest fails. The job's output passes the
//! `[streams] rate_bytes` limit; open and close are logged with byte counts, never payload.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::response::Response;
use futures_util::stream::SplitStream;
use futures_util::StreamExt;
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;
use warren_core::output::Cursor;
use warren_protocol::limits::{MAX_INPUT_CHUNK, MAX_READ_PER_STREAM};
use warren_protocol::{JobExit, JobId, JobOutput, JobState, WindowSize};

use crate::auth::Principal;
use crate::error::ApiError;
use crate::http::error_response;
use crate::service::job_streams::JobStream;
use crate::service::Service;
use crate::streams::RateLimit;
use crate::ws::{Lifeline, GOING_AWAY, INTERNAL, MAX_MESSAGE, NORMAL, POLICY};

/// Tag of a binary message carrying stdout bytes.
pub const STDOUT: u8 = 1;
/// Tag of a binary message carrying stderr bytes.
pub const STDERR: u8 = 2;
/// How long one output read waits for news while the job runs.
const READ_WAIT: Duration = Duration::from_secs(5);
/// How often a finished job's output is polled for what background processes write
/// (`until=complete`; the guest's long-poll only waits while the main process runs).
const BACKGROUND_POLL: Duration = Duration::from_millis(500);

/// Which endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Output,
    Terminal,
}

/// The query of both endpoints.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobQuery {
    #[serde(default)]
    pub stdout: u64,
    #[serde(default)]
    pub stderr: u64,
    /// `exit` (default) or `complete`.
    #[serde(default)]
    pub until: Option<String>,
    /// Terminal only: the client acknowledges what it received (`{"ack": ...}`), and the
    /// guest keeps everything after the last acknowledgement, so a reconnection at the
    /// client's cursors never misses output (the job waits when 256 KiB are unacknowledged).
    /// Without it, output is released as it is read.
    #[serde(default)]
    pub ack: bool,
}

/// The last text message.
#[derive(Debug, Serialize)]
struct ExitEvent {
    event: &'static str,
    exit_code: Option<i32>,
    signal: Option<i32>,
    timed_out: bool,
    cancelled: bool,
    truncated: bool,
    next_cursor: CursorJson,
    output_complete: bool,
    background_processes: u32,
}

#[derive(Debug, Serialize)]
struct CursorJson {
    stdout: u64,
    stderr: u64,
}

/// A terminal's control message: exactly one of its fields.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Control {
    #[serde(default)]
    resize: Option<Resize>,
    #[serde(default)]
    ack: Option<Ack>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Ack {
    stdout: u64,
    stderr: u64,
}

/// Cursors shared between a terminal's tasks: what was sent, and what the client
/// acknowledged having.
#[derive(Default)]
struct Progress {
    sent_stdout: AtomicU64,
    sent_stderr: AtomicU64,
    acked_stdout: AtomicU64,
    acked_stderr: AtomicU64,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Resize {
    rows: u16,
    cols: u16,
}

/// Serves one job stream request: refusals as the tools' JSON errors, else the upgrade.
pub async fn serve(
    service: Arc<Service>,
    p: Principal,
    vm_id: String,
    job_id: String,
    kind: Kind,
    query: JobQuery,
    ws: Option<WebSocketUpgrade>,
) -> Response {
    let job = match crate::service::parse_job(&job_id) {
        Ok(j) => j,
        Err(e) => return error_response(&e),
    };
    let complete = match (kind, query.until.as_deref()) {
        (_, None | Some("exit")) => false,
        (Kind::Output, Some("complete")) => true,
        (_, Some(other)) => {
            return error_response(&ApiError::invalid(format!(
                "until is exit or complete (output only), not {:?}",
                other.chars().take(32).collect::<String>()
            )))
        }
    };
    let Some(ws) = ws else {
        return error_response(&ApiError::invalid(
            "open job streams with a WebSocket upgrade (GET, Connection: Upgrade, Upgrade: websocket)",
        ));
    };
    let at = Cursor {
        stdout: query.stdout,
        stderr: query.stderr,
    };
    let opened = match service
        .open_job_stream(&p, &vm_id, job, at, kind == Kind::Terminal)
        .await
    {
        Ok(o) => o,
        Err(e) => {
            tracing::info!(workspace = %p.workspace, vm = %vm_id, job = %job, ?kind, code = e.code, message = %crate::ws::escape(&e.message), "job stream refused");
            return error_response(&e);
        }
    };
    let acked = kind == Kind::Terminal && query.ack;
    ws.max_message_size(MAX_MESSAGE)
        .max_frame_size(MAX_MESSAGE)
        .on_upgrade(move |socket| run(service, p, opened, kind, at, (complete, acked), socket))
}

/// What the reader task found.
enum Read {
    Data(u8, Vec<u8>),
    Exit(ExitEvent),
    Failed(String),
}

/// Why the upstream task ended.
enum Upstream {
    ClientGone,
    Violation(&'static str),
}

async fn run(
    service: Arc<Service>,
    p: Principal,
    opened: JobStream,
    kind: Kind,
    at: Cursor,
    (complete, acked): (bool, bool),
    socket: WebSocket,
) {
    let started = Instant::now();
    let progress = Arc::new(Progress {
        sent_stdout: AtomicU64::new(at.stdout),
        sent_stderr: AtomicU64::new(at.stderr),
        acked_stdout: AtomicU64::new(at.stdout),
        acked_stderr: AtomicU64::new(at.stderr),
    });
    let JobStream {
        vm_id,
        job,
        mut ticket,
    } = opened;
    tracing::info!(workspace = %p.workspace, vm = %vm_id, job = %job, ?kind, "job stream opened");
    let (mut sink, source) = socket.split();
    let mut life = Lifeline::new(started);
    let (tx, mut reads) = mpsc::channel(2);
    let reader = tokio::spawn(read_output(
        ReadSpec {
            service: service.clone(),
            vm: vm_id.clone(),
            job,
            complete,
            progress: acked.then(|| progress.clone()),
        },
        at,
        tx,
    ));
    let mut upstream = tokio::spawn(upstream(
        service.clone(),
        vm_id.clone(),
        job,
        kind,
        source,
        life.heard(),
        progress,
    ));
    let mut limit = RateLimit::new(service.streams().config().rate_bytes);
    let mut sent = 0u64;
    let (code, reason): (u16, String) = loop {
        tokio::select! {
            r = reads.recv() => match r {
                Some(Read::Data(tag, data)) => {
                    let at = limit.debit(data.len());
                    sent += data.len() as u64;
                    let mut msg = Vec::with_capacity(data.len() + 1);
                    msg.push(tag);
                    msg.extend_from_slice(&data);
                    let msg = Message::Binary(msg.into());
                    if let Some(end) = life.send(&service, &p, &mut sink, &mut ticket.closed, at, msg).await {
                        break end;
                    }
                }
                Some(Read::Exit(ev)) => {
                    let text = serde_json::to_string(&ev).unwrap_or_default();
                    let msg = Message::Text(text.into());
                    if let Some(end) = life.send(&service, &p, &mut sink, &mut ticket.closed, None, msg).await {
                        break end;
                    }
                    break (NORMAL, "job finished".into());
                }
                Some(Read::Failed(why)) => break (INTERNAL, why),
                None => break (INTERNAL, "internal error".into()),
            },
            up = &mut upstream => match up {
                Ok(Upstream::ClientGone) => break (NORMAL, "client closed".into()),
                Ok(Upstream::Violation(why)) => break (POLICY, why.into()),
                Err(_) => break (INTERNAL, "internal error".into()),
            },
            _ = ticket.closed.changed() => {
                let why = ticket.closed.borrow().map(|r| r.as_str()).unwrap_or("closed");
                break (GOING_AWAY, why.into());
            }
            duty = life.due() => {
                if let Some(end) = life.perform(duty, &service, &p, &vm_id, &mut sink, &mut ticket.closed).await {
                    break end;
                }
            }
        }
    };
    reader.abort();
    upstream.abort();
    crate::ws::close(&service, &vm_id, &mut sink, code, &reason).await;
    tracing::info!(
        workspace = %p.workspace,
        vm = %vm_id,
        job = %job,
        ?kind,
        duration_ms = started.elapsed().as_millis() as u64,
        bytes_out = sent,
        code,
        reason = %crate::ws::escape(&reason),
        "job stream closed"
    );
    drop(ticket);
}

/// What [`read_output`] reads.
struct ReadSpec {
    service: Arc<Service>,
    vm: String,
    job: JobId,
    /// Follow background output until the output is complete (`until=complete`).
    complete: bool,
    /// With acknowledgements: release only what the client acknowledged.
    progress: Option<Arc<Progress>>,
}

/// Reads the job's output from `at` and hands it on until the end the stream follows.
async fn read_output(spec: ReadSpec, mut at: Cursor, tx: mpsc::Sender<Read>) {
    let ReadSpec {
        service,
        vm,
        job,
        complete,
        progress,
    } = spec;
    // The retained sizes when the job was first seen finished: with `until=exit` the stream
    // ends there (background processes may write on; that stays readable by cursor).
    let mut end: Option<(u64, u64)> = None;
    loop {
        let read = match &progress {
            Some(p) => {
                let release = Cursor {
                    stdout: p.acked_stdout.load(Ordering::Relaxed),
                    stderr: p.acked_stderr.load(Ordering::Relaxed),
                };
                service
                    .job_read_acked(&vm, job, at, release, READ_WAIT)
                    .await
            }
            None => {
                service
                    .job_read(&vm, job, at, MAX_READ_PER_STREAM, READ_WAIT)
                    .await
            }
        };
        let o = match read {
            Ok(o) => o,
            Err(e) => {
                let _ = tx.send(Read::Failed(e.message)).await;
                return;
            }
        };
        let finished = matches!(o.state, JobState::Finished(_));
        if finished && end.is_none() && !complete {
            end = Some((o.stdout_retained, o.stderr_retained));
        }
        let (out, err) = match end {
            Some((so, se)) => (
                upto(&o.stdout, at.stdout, so),
                upto(&o.stderr, at.stderr, se),
            ),
            None => (&o.stdout[..], &o.stderr[..]),
        };
        for (tag, bytes) in [(STDOUT, out), (STDERR, err)] {
            if !bytes.is_empty() && tx.send(Read::Data(tag, bytes.to_vec())).await.is_err() {
                return;
            }
        }
        at.stdout = at.stdout.saturating_add(out.len() as u64);
        at.stderr = at.stderr.saturating_add(err.len() as u64);
        if let Some(p) = &progress {
            p.sent_stdout.store(at.stdout, Ordering::Relaxed);
            p.sent_stderr.store(at.stderr, Ordering::Relaxed);
        }
        let caught_up = at.stdout >= o.stdout_retained && at.stderr >= o.stderr_retained;
        let done = match (end, o.state) {
            (Some((so, se)), JobState::Finished(_)) => at.stdout >= so && at.stderr >= se,
            (None, JobState::Finished(_)) => complete && o.output_complete && caught_up,
            (_, JobState::Running) => false,
        };
        if let (true, JobState::Finished(x)) = (done, o.state) {
            let _ = tx.send(Read::Exit(exit_event(&x, &o, at))).await;
            return;
        }
        if finished && caught_up {
            // Nothing new now, and the guest does not wait for background output.
            tokio::time::sleep(BACKGROUND_POLL).await;
        } else if warren_core::interactive::stalled(
            end.is_some(),
            end.is_some_and(|(so, se)| at.stdout >= so && at.stderr >= se),
            out.len(),
            err.len(),
        ) {
            tokio::time::sleep(warren_core::interactive::STALLED_READ_PAUSE).await;
        }
    }
}

fn exit_event(x: &JobExit, o: &JobOutput, at: Cursor) -> ExitEvent {
    ExitEvent {
        event: "exit",
        exit_code: x.code,
        signal: x.signal,
        timed_out: x.timed_out,
        cancelled: x.cancelled,
        truncated: o.truncated,
        next_cursor: CursorJson {
            stdout: at.stdout,
            stderr: at.stderr,
        },
        output_complete: o.output_complete,
        background_processes: o.background_processes,
    }
}

/// The part of `bytes`, read at `cursor`, that lies before `end`.
fn upto(bytes: &[u8], cursor: u64, end: u64) -> &[u8] {
    let n = usize::try_from(end.saturating_sub(cursor)).unwrap_or(usize::MAX);
    &bytes[..bytes.len().min(n)]
}

/// The client's messages: terminal input and window sizes, in order (each answered by the
/// guest before the next is sent, so a slow job slows the client down).
async fn upstream(
    service: Arc<Service>,
    vm: String,
    job: JobId,
    kind: Kind,
    mut source: SplitStream<WebSocket>,
    heard: crate::ws::Heard,
    progress: Arc<Progress>,
) -> Upstream {
    let mut input_open = true;
    while let Some(msg) = source.next().await {
        let Ok(msg) = msg else {
            return Upstream::Violation("malformed or oversized message");
        };
        heard.now();
        match msg {
            Message::Ping(_) | Message::Pong(_) => continue,
            Message::Close(_) => return Upstream::ClientGone,
            Message::Binary(_) | Message::Text(_) if kind == Kind::Output => {
                return Upstream::Violation("the output stream takes no input")
            }
            Message::Binary(data) => {
                if !input_open {
                    continue;
                }
                let eof = data.is_empty();
                let mut chunks: Vec<&[u8]> = data.chunks(MAX_INPUT_CHUNK).collect();
                if eof {
                    chunks.push(&[]);
                }
                for chunk in chunks {
                    if let Err(e) = service.job_input(&vm, job, chunk.to_vec(), eof).await {
                        // The job ended or closed its input: later input has nowhere to go.
                        tracing::debug!(vm = %vm, job = %job, code = e.code, "terminal input");
                        input_open = false;
                        break;
                    }
                }
                if eof {
                    input_open = false;
                }
            }
            Message::Text(t) => {
                let Ok(c) = serde_json::from_str::<Control>(t.as_str()) else {
                    return Upstream::Violation(
                        "text messages are {\"resize\": {\"rows\", \"cols\"}} or {\"ack\": {\"stdout\", \"stderr\"}}",
                    );
                };
                match (c.resize, c.ack) {
                    (Some(r), None) => {
                        if r.rows == 0 || r.cols == 0 {
                            return Upstream::Violation(
                                "a window has at least one row and one column",
                            );
                        }
                        let size = WindowSize {
                            rows: r.rows,
                            cols: r.cols,
                        };
                        if let Err(e) = service.job_resize(&vm, job, size).await {
                            tracing::debug!(vm = %vm, job = %job, code = e.code, "terminal resize");
                        }
                    }
                    (None, Some(a)) => {
                        let sent = (
                            progress.sent_stdout.load(Ordering::Relaxed),
                            progress.sent_stderr.load(Ordering::Relaxed),
                        );
                        if a.stdout > sent.0 || a.stderr > sent.1 {
                            return Upstream::Violation("an acknowledgement past what was sent");
                        }
                        progress.acked_stdout.fetch_max(a.stdout, Ordering::Relaxed);
                        progress.acked_stderr.fetch_max(a.stderr, Ordering::Relaxed);
                    }
                    _ => return Upstream::Violation("a control message has exactly one field"),
                }
            }
        }
    }
    Upstream::ClientGone
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_upto_cuts_at_the_end_seen_first() {
        assert_eq!(upto(b"abcdef", 10, 13), b"abc");
        assert_eq!(upto(b"abc", 10, 10), b"");
        assert_eq!(upto(b"abc", 10, 100), b"abc");
        assert_eq!(upto(b"abc", 12, 10), b"");
    }

    #[test]
    fn test_control_messages_parsed_strictly() {
        let c: Control = serde_json::from_str(r#"{"resize":{"rows":40,"cols":120}}"#).expect("ok");
        let r = c.resize.expect("resize");
        assert_eq!((r.rows, r.cols), (40, 120));
        let c: Control = serde_json::from_str(r#"{"ack":{"stdout":4,"stderr":0}}"#).expect("ok");
        assert_eq!(c.ack.map(|a| a.stdout), Some(4));
        assert!(
            serde_json::from_str::<Control>(r#"{"resize":{"rows":1,"cols":1},"x":1}"#).is_err()
        );
        assert!(serde_json::from_str::<Control>(r#"{"resize":{"rows":70000,"cols":1}}"#).is_err());
    }

    #[test]
    fn test_exit_event_shape() {
        let x = JobExit {
            code: Some(3),
            signal: None,
            timed_out: false,
            cancelled: false,
        };
        let o = JobOutput {
            stdout: vec![],
            stderr: vec![],
            stdout_retained: 5,
            stderr_retained: 1,
            state: JobState::Finished(x),
            truncated: false,
            output_complete: true,
            background_processes: 0,
        };
        let v = serde_json::to_value(exit_event(
            &x,
            &o,
            Cursor {
                stdout: 5,
                stderr: 1,
            },
        ))
        .expect("json");
        assert_eq!(v["event"], "exit");
        assert_eq!(v["exit_code"], 3);
        assert_eq!(v["next_cursor"]["stdout"], 5);
        assert_eq!(v["output_complete"], true);
    }
}
