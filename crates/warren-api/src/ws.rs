//! Guest streams over WebSocket: `GET /v1/vms/{vm_id}/streams/{port}` (a TCP port on the
//! guest's loopback) and `GET /v1/vms/{vm_id}/copy/{in|out}?path=P` (a tar archive into or
//! out of the guest), behind the same guard and authentication layers as the tools.
//!
//! Order of a request: credentials (401, the auth layer), the VM is the caller's (404), the
//! port is allowed (403), a place under the quotas (409 `busy`), then the guest opens the
//! target (409 `conflict` when nothing listens). Only then is the upgrade accepted.
//!
//! An open stream runs two tasks:
//! - **upstream** (client -> guest): binary messages are bytes, text messages their UTF-8
//!   bytes, an empty binary message is end of input for the guest (a half-close: the guest
//!   may go on sending); data after it is a protocol error (1008);
//! - **downstream** (guest -> client, this task): guest bytes as binary messages; the
//!   guest's end closes with 1000 when it closed normally (1011 and its reason otherwise),
//!   the service's lifecycle closes with 1001 `suspended`/`destroyed`, a credential that no
//!   longer holds (rechecked every [`RECHECK`]) with 1008, and a client that answers no ping
//!   for [`PING_TIMEOUT`] with 1001.
//!
//! Each direction passes `[streams] rate_bytes` a second at most. Open and close are logged
//! with workspace, VM, target, duration, byte counts and reason, never payload.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::ws::{CloseFrame, Message, WebSocket, WebSocketUpgrade};
use axum::response::Response;
use futures_util::{SinkExt, StreamExt};
use warren_protocol::stream::StreamTarget;
use warren_supervisor::stream_frame::{StreamReader, StreamWriter};

use crate::auth::Principal;
use crate::error::ApiError;
use crate::http::error_response;
use crate::service::Service;
use crate::streams::RateLimit;

/// Largest client message.
pub const MAX_MESSAGE: usize = 1 << 20;
/// How often an open stream's credential is checked again.
pub const RECHECK: Duration = Duration::from_secs(5);
/// Ping interval, and how long a client may stay silent (pongs included) before it is
/// dropped.
pub const PING_EVERY: Duration = Duration::from_secs(15);
pub const PING_TIMEOUT: Duration = Duration::from_secs(45);

/// WebSocket close codes used here (RFC 6455).
pub(crate) const NORMAL: u16 = 1000;
pub(crate) const GOING_AWAY: u16 = 1001;
pub(crate) const POLICY: u16 = 1008;
pub(crate) const INTERNAL: u16 = 1011;

/// What a stream route asks for.
pub enum Request {
    Port(String),
    CopyIn(Option<String>),
    CopyOut(Option<String>),
}

/// Serves one stream request: refusals as the tools' JSON errors, else the upgrade.
pub async fn serve(
    service: Arc<Service>,
    p: Principal,
    vm_id: String,
    req: Request,
    ws: Option<WebSocketUpgrade>,
) -> Response {
    let target = match target(req) {
        Ok(t) => t,
        Err(e) => return error_response(&e),
    };
    if let Err(e) = service.check_stream(&p, &vm_id, &target) {
        return error_response(&e);
    }
    let Some(ws) = ws else {
        return error_response(&ApiError::invalid(
            "open streams with a WebSocket upgrade (GET, Connection: Upgrade, Upgrade: websocket)",
        ));
    };
    let label = describe(&target);
    let opened = match service.open_stream(&p, &vm_id, target).await {
        Ok(o) => o,
        Err(e) => {
            tracing::info!(workspace = %p.workspace, vm = %vm_id, target = %label, code = e.code, "stream refused");
            return error_response(&e);
        }
    };
    ws.max_message_size(MAX_MESSAGE)
        .max_frame_size(MAX_MESSAGE)
        .on_upgrade(move |socket| run(service, p, opened, label, socket))
}

fn target(req: Request) -> Result<StreamTarget, ApiError> {
    let path = |p: Option<String>| {
        p.filter(|p| p.starts_with('/'))
            .ok_or_else(|| ApiError::invalid("give the guest path as ?path=/absolute/path"))
    };
    Ok(match req {
        Request::Port(port) => StreamTarget::Tcp {
            port: port
                .parse::<u16>()
                .map_err(|_| ApiError::forbidden(format!("{port:?} is not a port (1-65535)")))?,
        },
        Request::CopyIn(p) => StreamTarget::TarExtract { dir: path(p)? },
        Request::CopyOut(p) => StreamTarget::TarCreate { path: path(p)? },
    })
}

fn describe(t: &StreamTarget) -> String {
    match t {
        StreamTarget::Tcp { port } => format!("port {port}"),
        StreamTarget::TarExtract { dir } => format!("copy into {}", escape(dir)),
        StreamTarget::TarCreate { path } => format!("copy out of {}", escape(path)),
        StreamTarget::BrokerAccept { job } => format!("broker pipe of job {job}"),
    }
}

pub(crate) fn escape(s: &str) -> String {
    s.chars().take(256).flat_map(char::escape_debug).collect()
}

/// Why the upstream task ended.
enum Upstream {
    /// The client closed the WebSocket or the connection.
    ClientGone,
    /// A message that breaks the stream's rules.
    Violation(&'static str),
    /// The guest side stopped taking input.
    GuestGone,
}

struct Counters {
    up: AtomicU64,
    down: AtomicU64,
}

async fn run(
    service: Arc<Service>,
    p: Principal,
    opened: crate::service::streams::Opened,
    label: String,
    socket: WebSocket,
) {
    let started = Instant::now();
    let crate::service::streams::Opened {
        vm_id,
        stream,
        mut ticket,
    } = opened;
    tracing::info!(workspace = %p.workspace, vm = %vm_id, target = %label, "stream opened");
    let rate = service.streams().config().rate_bytes;
    let counters = Arc::new(Counters {
        up: AtomicU64::new(0),
        down: AtomicU64::new(0),
    });
    let (mut sink, source) = socket.split();
    let mut life = Lifeline::new(started);
    let mut upstream = tokio::spawn(upstream(
        source,
        stream.writer,
        RateLimit::new(rate),
        counters.clone(),
        life.heard(),
    ));
    let mut reader = stream.reader;
    let mut limit = RateLimit::new(rate);
    let (code, reason): (u16, String) = loop {
        tokio::select! {
            next = next_down(&mut reader) => match next {
                Ok(data) => {
                    limit.take(data.len()).await;
                    counters.down.fetch_add(data.len() as u64, Ordering::Relaxed);
                    if sink.send(Message::Binary(data.into())).await.is_err() {
                        break (GOING_AWAY, "client gone".into());
                    }
                }
                Err(end) => break end,
            },
            up = &mut upstream => match up {
                Ok(Upstream::ClientGone) => break (NORMAL, "client closed".into()),
                Ok(Upstream::Violation(why)) => break (POLICY, why.into()),
                // The guest stopped reading; its end frame follows on the reader.
                Ok(Upstream::GuestGone) => break drain_end(&mut reader, &mut sink, &counters).await,
                Err(_) => break (INTERNAL, "internal error".into()),
            },
            _ = ticket.closed.changed() => {
                let why = ticket.closed.borrow().map(|r| r.as_str()).unwrap_or("closed");
                break (GOING_AWAY, why.into());
            }
            end = life.tick(&service, &p, &vm_id, &mut sink) => {
                if let Some(end) = end {
                    break end;
                }
            }
        }
    };
    upstream.abort();
    let frame = CloseFrame {
        code,
        reason: cut_reason(&reason).into(),
    };
    let _ = sink.send(Message::Close(Some(frame))).await;
    let _ = sink.close().await;
    service.stream_activity(&vm_id);
    tracing::info!(
        workspace = %p.workspace,
        vm = %vm_id,
        target = %label,
        duration_ms = started.elapsed().as_millis() as u64,
        bytes_in = counters.up.load(Ordering::Relaxed),
        bytes_out = counters.down.load(Ordering::Relaxed),
        code,
        reason = %escape(&reason),
        "stream closed"
    );
    // The guest connection closes with `reader` (and the writer in the aborted task).
    drop(reader);
    drop(ticket);
}

/// The next guest chunk, or the close code and reason of the guest's end.
async fn next_down(reader: &mut StreamReader) -> Result<Vec<u8>, (u16, String)> {
    match reader.next().await {
        Ok(Ok(data)) => Ok(data),
        Ok(Err(end)) if end.ok() => Err((NORMAL, "guest closed".into())),
        Ok(Err(end)) => Err((
            INTERNAL,
            end.error
                .unwrap_or_else(|| format!("guest end failed ({})", end.code)),
        )),
        Err(e) => Err((INTERNAL, format!("stream: {e}"))),
    }
}

/// After the guest stopped taking input: pass on what it still sends, then its end.
async fn drain_end(
    reader: &mut StreamReader,
    sink: &mut futures_util::stream::SplitSink<WebSocket, Message>,
    counters: &Counters,
) -> (u16, String) {
    loop {
        match next_down(reader).await {
            Ok(data) => {
                counters
                    .down
                    .fetch_add(data.len() as u64, Ordering::Relaxed);
                if sink.send(Message::Binary(data.into())).await.is_err() {
                    return (GOING_AWAY, "client gone".into());
                }
            }
            Err(end) => return end,
        }
    }
}

async fn upstream(
    mut source: futures_util::stream::SplitStream<WebSocket>,
    mut writer: StreamWriter,
    mut limit: RateLimit,
    counters: Arc<Counters>,
    heard: Heard,
) -> Upstream {
    let mut input_ended = false;
    while let Some(msg) = source.next().await {
        let Ok(msg) = msg else {
            return Upstream::Violation("malformed or oversized message");
        };
        heard.now();
        let data: &[u8] = match &msg {
            Message::Binary(b) => b,
            Message::Text(t) => t.as_str().as_bytes(),
            Message::Ping(_) | Message::Pong(_) => continue,
            Message::Close(_) => return Upstream::ClientGone,
        };
        if input_ended {
            return Upstream::Violation("data after the end of input");
        }
        if data.is_empty() {
            input_ended = true;
            if writer.eof().await.is_err() {
                return Upstream::GuestGone;
            }
            continue;
        }
        limit.take(data.len()).await;
        counters.up.fetch_add(data.len() as u64, Ordering::Relaxed);
        if writer.send(data).await.is_err() {
            return Upstream::GuestGone;
        }
    }
    Upstream::ClientGone
}

/// When the client was last heard from, shared between the task reading its messages and
/// the [`Lifeline`].
#[derive(Clone)]
pub(crate) struct Heard {
    started: Instant,
    /// Milliseconds since `started` of the client's last message.
    at_ms: Arc<AtomicU64>,
}

impl Heard {
    pub(crate) fn now(&self) {
        self.at_ms
            .store(self.started.elapsed().as_millis() as u64, Ordering::Relaxed);
    }

    fn silent_for(&self) -> Duration {
        let at = Duration::from_millis(self.at_ms.load(Ordering::Relaxed));
        self.started.elapsed().saturating_sub(at)
    }
}

/// The periodic duties of an open WebSocket: recheck the credential every [`RECHECK`]
/// (counting the stream as activity on its VM), ping every [`PING_EVERY`], and give up on a
/// client silent for [`PING_TIMEOUT`].
pub(crate) struct Lifeline {
    heard: Heard,
    recheck: tokio::time::Interval,
    ping: tokio::time::Interval,
}

impl Lifeline {
    pub(crate) fn new(started: Instant) -> Lifeline {
        let first = |every| {
            let mut i = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
            i.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            i
        };
        Lifeline {
            heard: Heard {
                started,
                at_ms: Arc::new(AtomicU64::new(0)),
            },
            recheck: first(RECHECK),
            ping: first(PING_EVERY),
        }
    }

    pub(crate) fn heard(&self) -> Heard {
        self.heard.clone()
    }

    /// Waits for the next duty and does it: `Some` close code and reason when the stream must
    /// end.
    pub(crate) async fn tick(
        &mut self,
        service: &Service,
        p: &Principal,
        vm_id: &str,
        sink: &mut futures_util::stream::SplitSink<WebSocket, Message>,
    ) -> Option<(u16, String)> {
        tokio::select! {
            _ = self.recheck.tick() => {
                if let Err(e) = service.credentials().recheck(p) {
                    return Some((POLICY, e.message));
                }
                service.stream_activity(vm_id);
                None
            }
            _ = self.ping.tick() => {
                if self.heard.silent_for() > PING_TIMEOUT {
                    return Some((GOING_AWAY, "the client answered no ping".into()));
                }
                if sink.send(Message::Ping(Default::default())).await.is_err() {
                    return Some((GOING_AWAY, "client gone".into()));
                }
                None
            }
        }
    }
}

/// A close reason fits in 123 bytes.
pub(crate) fn cut_reason(reason: &str) -> String {
    let mut end = reason.len().min(123);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    reason[..end].to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_cut_reason_fits_a_close_frame() {
        let r = cut_reason(&"é".repeat(100));
        assert!(r.len() <= 123 && r.chars().all(|c| c == 'é'));
        assert_eq!(cut_reason("destroyed"), "destroyed");
    }

    #[test]
    fn test_targets_parsed_and_refused() {
        assert!(matches!(
            target(Request::Port("5000".into())),
            Ok(StreamTarget::Tcp { port: 5000 })
        ));
        assert_eq!(
            target(Request::Port("x".into())).expect_err("bad").code,
            "forbidden"
        );
        assert_eq!(
            target(Request::CopyIn(Some("rel".into())))
                .expect_err("relative")
                .code,
            "invalid_argument"
        );
        assert!(target(Request::CopyOut(Some("/a".into()))).is_ok());
        assert!(target(Request::CopyOut(None)).is_err());
    }
}
