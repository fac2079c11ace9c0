//! The controller's end of a job broker pipe: `GET /v1/vms/{vm_id}/jobs/{job_id}/broker`
//! (WebSocket) with the one-time token in `X-Broker-Pipe`, behind the same guard and
//! authentication layers as the tools. Framing and refusals: `crate::broker`.
//!
//! An attachment runs these tasks:
//! - **accept**: holds one `BrokerAccept` guest stream open at a time while fewer than
//!   [`MAX_CONNECTIONS`] connections are live; when a job process connects, it takes a place
//!   for the connection under the `[streams]` quotas (each live connection is a stream of its
//!   own against the host, workspace and VM quotas; the attachment's own place covers the
//!   one pending accept), waiting while they are full with no further accept (later job
//!   processes wait in the socket's backlog), then numbers the connection, sends `open`, and
//!   starts the connection's task. A pipe that ended (the
//!   job's processes are gone) ends the attachment with 1001 `job finished`.
//! - **one per connection**: guest bytes become `data` frames (read only as fast as the
//!   WebSocket drains); the controller's data for it waits in a queue of at most
//!   [`QUEUE_BYTES`] and is written as the guest reads; a `close` from the controller is
//!   delivered after the data queued before it (the guest reads its end of input), and the
//!   guest's end becomes a `close` frame. Frames for a connection already closed are ignored.
//! - **upstream**: the controller's messages, parsed into frames; a connection whose queue
//!   stays full for [`STALL`] is closed alone. Malformed framing, or a connection id never
//!   opened, closes the attachment with 1002.
//! - the task itself: frames to the controller under `[streams] rate_bytes`, the credential
//!   recheck and pings (`crate::ws::Lifeline`), suspend/destroy (1001), and a look every
//!   [`JOB_CHECK`] whether the job's processes are all gone.
//!
//! Open and close are logged with workspace, VM, job, duration, byte counts and reason; the
//! token and the payload never are.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::response::Response;
use futures_util::stream::SplitStream;
use futures_util::StreamExt;
use tokio::sync::{mpsc, Semaphore};
use tokio::task::AbortHandle;
use warren_protocol::stream::{StreamTarget, BROKER_ACCEPTED};
use warren_protocol::JobId;
use warren_supervisor::stream_frame::{StreamReader, StreamWriter};

use crate::auth::Principal;
use crate::broker::{close_frame, data_frames, open_frame, Frame, FrameReader};
use crate::error::ApiError;
use crate::http::error_response;
use crate::service::job_streams::BrokerOpen;
use crate::service::Service;
use crate::streams::RateLimit;
use crate::ws::{Lifeline, GOING_AWAY, INTERNAL, MAX_MESSAGE, NORMAL, POLICY};

/// Guest connections one attachment carries at once.
pub const MAX_CONNECTIONS: usize = 64;
/// Controller data queued per connection (in frames of at most 64 KiB: 16 of them).
pub const QUEUE_BYTES: usize = 1 << 20;
/// How long a connection's queue may stay full before that connection is closed.
pub const STALL: Duration = Duration::from_secs(10);
/// How often a full `[streams]` quota is looked at again while a guest connection waits.
pub const ADMIT_RETRY: Duration = Duration::from_millis(250);
/// How often the attachment looks whether its job's processes are all gone.
pub const JOB_CHECK: Duration = Duration::from_secs(5);
/// The longest one job check may wait for the guest's answer.
pub const JOB_CHECK_LIMIT: Duration = Duration::from_secs(2);
/// WebSocket close code for broken framing (RFC 6455 "protocol error").
const PROTOCOL: u16 = 1002;

/// The request header carrying the controller's token.
pub const TOKEN_HEADER: &str = "x-broker-pipe";

/// Serves one attach request: refusals as the tools' JSON errors, else the upgrade.
pub async fn serve(
    service: Arc<Service>,
    p: Principal,
    vm_id: String,
    job_id: String,
    token: Option<String>,
    ws: Option<WebSocketUpgrade>,
) -> Response {
    let job = match crate::service::parse_job(&job_id) {
        Ok(j) => j,
        Err(e) => return error_response(&e),
    };
    let Some(token) = token else {
        // No token is a wrong token: the same answer as any other.
        return error_response(&ApiError::new(
            "not_found",
            format!("no broker pipe for job {job}"),
        ));
    };
    let Some(ws) = ws else {
        return error_response(&ApiError::invalid(
            "attach with a WebSocket upgrade (GET, Connection: Upgrade, Upgrade: websocket)",
        ));
    };
    let opened = match service.open_broker(&p, &vm_id, job, &token).await {
        Ok(o) => o,
        Err(e) => {
            tracing::info!(workspace = %p.workspace, vm = %vm_id, job = %job, code = e.code, "broker attach refused");
            return error_response(&e);
        }
    };
    ws.max_message_size(MAX_MESSAGE)
        .max_frame_size(MAX_MESSAGE)
        .on_upgrade(move |socket| run(service, p, opened, socket))
}

/// What the controller sent for one connection.
enum ToGuest {
    Data(Vec<u8>),
    Close,
}

struct Conn {
    tx: mpsc::Sender<ToGuest>,
    task: AbortHandle,
}

#[derive(Default)]
struct Conns {
    /// The last id given out (ids start at 1 and are never reused).
    last_id: u32,
    live: HashMap<u32, Conn>,
}

type Shared = Arc<Mutex<Conns>>;

fn lock(c: &Mutex<Conns>) -> MutexGuard<'_, Conns> {
    c.lock().unwrap_or_else(PoisonError::into_inner)
}

#[derive(Default)]
struct Counters {
    up: AtomicU64,
    down: AtomicU64,
}

/// Why a helper task ended the attachment.
type End = (u16, String);

async fn run(service: Arc<Service>, p: Principal, opened: BrokerOpen, socket: WebSocket) {
    let started = Instant::now();
    let BrokerOpen {
        vm_id,
        job,
        mut ticket,
        attachment,
    } = opened;
    tracing::info!(workspace = %p.workspace, vm = %vm_id, job = %job, "broker pipe attached");
    let (mut sink, source) = socket.split();
    let mut life = Lifeline::new(started);
    let conns: Shared = Arc::default();
    let counters = Arc::new(Counters::default());
    let (out_tx, mut out_rx) = mpsc::channel::<Vec<u8>>(64);
    let rate = service.streams().config().rate_bytes;
    let mut accept = tokio::spawn(accept(
        service.clone(),
        p.workspace.clone(),
        vm_id.clone(),
        job,
        conns.clone(),
        out_tx.clone(),
    ));
    let mut upstream = tokio::spawn(upstream(
        source,
        conns.clone(),
        out_tx,
        RateLimit::new(rate),
        counters.clone(),
        life.heard(),
    ));
    let mut limit = RateLimit::new(rate);
    let mut job_check =
        tokio::time::interval_at(tokio::time::Instant::now() + JOB_CHECK, JOB_CHECK);
    let (code, reason): End = loop {
        tokio::select! {
            frame = out_rx.recv() => {
                let Some(frame) = frame else { break (INTERNAL, "internal error".into()) };
                let at = limit.debit(frame.len());
                counters.down.fetch_add(frame.len() as u64, Ordering::Relaxed);
                let msg = Message::Binary(frame.into());
                if let Some(end) = life.send(&service, &p, &mut sink, &mut ticket.closed, at, msg).await {
                    break end;
                }
            }
            end = &mut accept => break end.unwrap_or((INTERNAL, "internal error".into())),
            end = &mut upstream => break end.unwrap_or((INTERNAL, "internal error".into())),
            _ = ticket.closed.changed() => {
                let why = ticket.closed.borrow().map(|r| r.as_str()).unwrap_or("closed");
                break (GOING_AWAY, why.into());
            }
            _ = job_check.tick() => {
                // Bounded: a guest slow to answer must not hold off the loop's other
                // duties (the credential recheck); no answer counts as not finished.
                let done = tokio::time::timeout(JOB_CHECK_LIMIT, service.broker_job_done(&vm_id, job));
                if matches!(done.await, Ok(true)) {
                    break (GOING_AWAY, "job finished".into());
                }
            }
            duty = life.due() => {
                if let Some(end) = life.perform(duty, &service, &p, &vm_id, &mut sink, &mut ticket.closed).await {
                    break end;
                }
            }
        }
    };
    accept.abort();
    upstream.abort();
    for (_, c) in lock(&conns).live.drain() {
        c.task.abort();
    }
    if reason == "job finished" {
        service.broker_pipes().remove(&vm_id, job);
    }
    crate::ws::close(&service, &vm_id, &mut sink, code, &reason).await;
    tracing::info!(
        workspace = %p.workspace,
        vm = %vm_id,
        job = %job,
        duration_ms = started.elapsed().as_millis() as u64,
        bytes_in = counters.up.load(Ordering::Relaxed),
        bytes_out = counters.down.load(Ordering::Relaxed),
        code,
        reason = %crate::ws::escape(&reason),
        "broker pipe detached"
    );
    drop((attachment, ticket));
}

/// Takes the job's connections one at a time while there is room.
async fn accept(
    service: Arc<Service>,
    workspace: String,
    vm: String,
    job: JobId,
    conns: Shared,
    out: mpsc::Sender<Vec<u8>>,
) -> End {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let Ok(permit) = slots.clone().acquire_owned().await else {
            return (INTERNAL, "internal error".into());
        };
        let stream = match service
            .engine()
            .open_stream(&vm, StreamTarget::BrokerAccept { job })
            .await
        {
            Ok(s) => s,
            Err(e)
                if e.guest()
                    .is_some_and(|g| g.code == warren_protocol::ErrorCode::NotFound) =>
            {
                return (GOING_AWAY, "job finished".into())
            }
            Err(e) => return (INTERNAL, ApiError::from(e).message),
        };
        let (mut reader, writer) = (stream.reader, stream.writer);
        let first = match reader.next().await {
            Ok(Ok(first)) if first.first() == Some(&BROKER_ACCEPTED) => first,
            // The guest ended the pipe while we waited: the job's processes are gone.
            Ok(Err(_)) => return (GOING_AWAY, "job finished".into()),
            Ok(Ok(_)) => return (INTERNAL, "the guest sent no accept mark".into()),
            Err(e) => return (INTERNAL, format!("broker stream: {e}")),
        };
        // The connection's own place under the quotas. Until it has one it waits, and no
        // other connection is accepted: the attachment's own place covers it meanwhile.
        let mut logged = false;
        let ticket = loop {
            match service.streams().admit(&workspace, &vm) {
                Ok(t) => break t,
                Err(e) => {
                    if !logged {
                        tracing::info!(workspace = %workspace, vm = %vm, job = %job, code = e.code, "a broker connection waits for a stream place");
                        logged = true;
                    }
                    tokio::time::sleep(ADMIT_RETRY).await;
                }
            }
        };
        let (tx, rx) = mpsc::channel(QUEUE_BYTES / crate::broker::MAX_DATA);
        // Numbered, spawned and registered under one lock: the controller's frames for it
        // find it from the moment its id exists, and the task (which sends `open` before any
        // data) cannot unregister before it is registered.
        let mut c = lock(&conns);
        c.last_id += 1;
        let id = c.last_id;
        let task = tokio::spawn(connection(
            id,
            first[1..].to_vec(),
            reader,
            writer,
            rx,
            out.clone(),
            conns.clone(),
            (permit, ticket),
        ));
        c.live.insert(
            id,
            Conn {
                tx,
                task: task.abort_handle(),
            },
        );
    }
}

/// One guest connection: both directions until one side closed it (see the module docs).
#[allow(clippy::too_many_arguments)]
async fn connection(
    id: u32,
    first: Vec<u8>,
    mut reader: StreamReader,
    mut writer: StreamWriter,
    mut from_controller: mpsc::Receiver<ToGuest>,
    out: mpsc::Sender<Vec<u8>>,
    conns: Shared,
    _place: (tokio::sync::OwnedSemaphorePermit, crate::streams::Ticket),
) {
    let down = async {
        if out.send(open_frame(id)).await.is_err() {
            return;
        }
        if !first.is_empty() && out.send(data_frames(id, &first)).await.is_err() {
            return;
        }
        while let Ok(Ok(data)) = reader.next().await {
            if out.send(data_frames(id, &data)).await.is_err() {
                return;
            }
        }
    };
    let up = async {
        while let Some(m) = from_controller.recv().await {
            match m {
                ToGuest::Data(d) => {
                    if writer.send(&d).await.is_err() {
                        // The guest end is gone; its end arrives on the reader.
                        std::future::pending::<()>().await;
                    }
                }
                ToGuest::Close => {
                    let _ = writer.eof().await;
                    return;
                }
            }
        }
        std::future::pending::<()>().await;
    };
    let controller_closed = tokio::select! {
        () = down => false,
        () = up => true,
    };
    lock(&conns).live.remove(&id);
    if controller_closed {
        // The guest got its end of input; what it still sends is not wanted. Give it a moment
        // to close its end, then reset (dropping the halves).
        let _ = tokio::time::timeout(STALL, async {
            while let Ok(Ok(_)) = reader.next().await {}
        })
        .await;
    } else {
        let _ = out.send(close_frame(id)).await;
    }
}

/// The controller's messages: frames routed to their connections.
async fn upstream(
    mut source: SplitStream<WebSocket>,
    conns: Shared,
    out: mpsc::Sender<Vec<u8>>,
    mut limit: RateLimit,
    counters: Arc<Counters>,
    heard: crate::ws::Heard,
) -> End {
    let mut frames = FrameReader::default();
    while let Some(msg) = source.next().await {
        let Ok(msg) = msg else {
            return (POLICY, "malformed or oversized message".into());
        };
        heard.now();
        let data = match msg {
            Message::Binary(b) => b,
            Message::Ping(_) | Message::Pong(_) => continue,
            Message::Close(_) => return (NORMAL, "client closed".into()),
            Message::Text(_) => return (PROTOCOL, "broker messages are binary".into()),
        };
        limit.take(data.len()).await;
        counters.up.fetch_add(data.len() as u64, Ordering::Relaxed);
        let parsed = match frames.feed(&data) {
            Ok(f) => f,
            Err(e) => return (PROTOCOL, e.to_string()),
        };
        for frame in parsed {
            let (id, msg) = match frame {
                Frame::Data(id, d) => (id, ToGuest::Data(d)),
                Frame::Close(id) => (id, ToGuest::Close),
            };
            let target = {
                let c = lock(&conns);
                if id > c.last_id {
                    return (PROTOCOL, format!("connection {id} was never opened"));
                }
                c.live.get(&id).map(|c| c.tx.clone())
            };
            // A connection already closed: its frames are ignored.
            let Some(tx) = target else { continue };
            match tokio::time::timeout(STALL, tx.send(msg)).await {
                Ok(_) => {}
                Err(_) => {
                    // The guest stopped reading this connection: close it alone.
                    // (Only when it was still there: one that just ended sent its own close.)
                    let removed = lock(&conns).live.remove(&id);
                    if let Some(c) = removed {
                        c.task.abort();
                        if out.send(close_frame(id)).await.is_err() {
                            return (INTERNAL, "internal error".into());
                        }
                    }
                }
            }
        }
    }
    (NORMAL, "client closed".into())
}
