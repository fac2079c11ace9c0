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
//!   the service's lifecycle closes with 1001 `suspended`/`destroyed` (so does a VM
//!   hibernated or destroyed by the CLI directly, seen when its channel goes down), a
//!   credential that no
//!   longer holds (rechecked every [`RECHECK`]) with 1008, and a client that answers no ping
//!   for [`PING_TIMEOUT`] with 1001. A send to the client never blocks these: it waits on
//!   them too (`Lifeline::send`), and a client that takes no message for [`SEND_STALL`] is
//!   dropped (1001 `the client stopped reading`).
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
use warren_supervisor::stream_frame::{StreamReader, StreamWriter, CHANNEL_CLOSED};

use crate::auth::Principal;
use crate::error::ApiError;
use crate::http::error_response;
use crate::service::Service;
use crate::streams::RateLimit;

/// Largest client message.
pub const MAX_MESSAGE: usize = 1 << 20;
/// How long one message to the client may take to go out: a client that takes nothing for
/// this long is dropped (its connection would otherwise hold the stream open for ever).
pub const SEND_STALL: Duration = PING_TIMEOUT;
/// How long the closing frame may take to go out.
const CLOSE_WAIT: Duration = Duration::from_secs(5);
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
    // Set once the guest stopped taking input: what it still sends is passed on, then its end.
    let mut guest_gone = false;
    // Set when the VM's channel went down under the stream (not the guest's own end).
    let mut channel_lost = false;
    let (code, reason): (u16, String) = loop {
        tokio::select! {
            next = next_down(&mut reader) => match next {
                Ok(data) => {
                    let at = limit.debit(data.len());
                    counters.down.fetch_add(data.len() as u64, Ordering::Relaxed);
                    let msg = Message::Binary(data.into());
                    if let Some(end) = life.send(&service, &p, &mut sink, &mut ticket.closed, at, msg).await {
                        break end;
                    }
                }
                Err(Down::End(code, reason)) => break (code, reason),
                Err(Down::Lost(why)) => {
                    channel_lost = true;
                    break (INTERNAL, why);
                }
            },
            up = &mut upstream, if !guest_gone => match up {
                Ok(Upstream::ClientGone) => break (NORMAL, "client closed".into()),
                Ok(Upstream::Violation(why)) => break (POLICY, why.into()),
                // The guest stopped reading; its end frame follows on the reader. The client's
                // messages (pongs included) are no longer read, so its silence proves nothing.
                Ok(Upstream::GuestGone) => {
                    guest_gone = true;
                    life.heard().unheard();
                }
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
    upstream.abort();
    let (code, reason) = if channel_lost {
        lifecycle_end(&service, &vm_id, (code, reason)).await
    } else {
        (code, reason)
    };
    close(&service, &vm_id, &mut sink, code, &reason).await;
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

/// How a stream's guest side ended.
enum Down {
    /// The guest's end: its close code and reason.
    End(u16, String),
    /// The VM's channel went down under the stream.
    Lost(String),
}

/// The next guest chunk, or how the guest side ended.
async fn next_down(reader: &mut StreamReader) -> Result<Vec<u8>, Down> {
    match reader.next().await {
        Ok(Ok(data)) => Ok(data),
        Ok(Err(end)) if end.ok() => Err(Down::End(NORMAL, "guest closed".into())),
        // The supervisor's own end for a channel that went down (the VMM exited).
        Ok(Err(end)) if end.code == -1 && end.error.as_deref() == Some(CHANNEL_CLOSED) => {
            Err(Down::Lost(CHANNEL_CLOSED.into()))
        }
        Ok(Err(end)) => Err(Down::End(
            INTERNAL,
            end.error
                .unwrap_or_else(|| format!("guest end failed ({})", end.code)),
        )),
        Err(e) => Err(Down::Lost(format!("stream: {e}"))),
    }
}

/// How long a stream whose channel went down looks for its VM's suspension or destruction.
const LIFECYCLE_LOOK: Duration = Duration::from_secs(3);

/// The end of a stream whose VM's channel went down under it (`end`, 1011): a VM suspended
/// (hibernated) or destroyed outside the service, by the CLI directly, ends it with 1001
/// `suspended` or `destroyed`, as the service's own lifecycle does. The record changes
/// just after the channel goes down (the VMM exits first), so it is looked at for up to
/// [`LIFECYCLE_LOOK`].
async fn lifecycle_end(service: &Service, vm_id: &str, end: (u16, String)) -> (u16, String) {
    use crate::streams::CloseReason;
    use warren_core::store::VmState;
    let deadline = Instant::now() + LIFECYCLE_LOOK;
    loop {
        let seen = match service.engine().get_vm(vm_id) {
            Err(warren_core::CoreError::VmNotFound(_)) => Some(CloseReason::Destroyed),
            Ok(r) if matches!(r.state, VmState::Hibernating | VmState::Hibernated) => {
                Some(CloseReason::Suspended)
            }
            Ok(_) => None,
            Err(_) => return end,
        };
        if let Some(why) = seen {
            return (GOING_AWAY, why.as_str().into());
        }
        if Instant::now() >= deadline {
            return end;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
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

    /// The client's messages are no longer read: never count it silent.
    fn unheard(&self) {
        self.at_ms.store(u64::MAX, Ordering::Relaxed);
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

    /// Waits for the next duty. Cancel-safe (it only waits on intervals), so it can race the
    /// data branches of a stream's loop; the duty is done by [`Lifeline::perform`] in the
    /// branch's body, where no other branch can cut it short (a ping dropped half-sent
    /// would let a download-only client look silent).
    pub(crate) async fn due(&mut self) -> Duty {
        tokio::select! {
            _ = self.recheck.tick() => Duty::Recheck,
            _ = self.ping.tick() => Duty::Ping,
        }
    }

    /// Does `duty`: `Some` close code and reason when the stream must end.
    pub(crate) async fn perform(
        &mut self,
        duty: Duty,
        service: &Service,
        p: &Principal,
        vm_id: &str,
        sink: &mut Sink,
        closed: &mut tokio::sync::watch::Receiver<Option<crate::streams::CloseReason>>,
    ) -> Option<(u16, String)> {
        match duty {
            Duty::Recheck => {
                if let Err(e) = service.credentials().recheck(p) {
                    return Some((POLICY, e.message));
                }
                service.stream_activity(vm_id);
                None
            }
            Duty::Ping => {
                if self.heard.silent_for() > PING_TIMEOUT {
                    return Some((GOING_AWAY, "the client answered no ping".into()));
                }
                // Sent as data is: still watching the stream's end and the credential.
                let ping = Message::Ping(Default::default());
                self.send(service, p, sink, closed, None, ping).await
            }
        }
    }

    /// Sends `msg` to the client, still rechecking the credential and watching `closed`
    /// (the stream's ticket) while it waits: a client that stopped reading never holds the
    /// stream open past its end (nor keeps its other task, e.g. terminal input, running).
    /// `Some` close code and reason when the stream must end, the message then possibly
    /// unsent; a client that takes nothing for [`SEND_STALL`] is dropped.
    pub(crate) async fn send(
        &mut self,
        service: &Service,
        p: &Principal,
        sink: &mut Sink,
        closed: &mut tokio::sync::watch::Receiver<Option<crate::streams::CloseReason>>,
        not_before: Option<tokio::time::Instant>,
        msg: Message,
    ) -> Option<(u16, String)> {
        // Paced by a rate limit: the wait is raced like the send, so a slow rate never
        // holds off the stream's end or the credential recheck.
        let start = not_before.unwrap_or_else(tokio::time::Instant::now);
        let send = async {
            tokio::time::sleep_until(start).await;
            sink.send(msg).await
        };
        tokio::pin!(send);
        let stall = tokio::time::sleep_until(start + SEND_STALL);
        tokio::pin!(stall);
        loop {
            tokio::select! {
                sent = &mut send => return sent.err().map(|_| (GOING_AWAY, "client gone".into())),
                () = &mut stall => return Some((GOING_AWAY, "the client stopped reading".into())),
                _ = closed.changed() => {
                    let why = closed.borrow().map(|r| r.as_str()).unwrap_or("closed");
                    return Some((GOING_AWAY, why.into()));
                }
                _ = self.recheck.tick() => {
                    if let Err(e) = service.credentials().recheck(p) {
                        return Some((POLICY, e.message));
                    }
                }
            }
        }
    }
}

/// What a stream's [`Lifeline`] has to do next.
pub(crate) enum Duty {
    /// Check the credential again and count the stream as activity.
    Recheck,
    /// Ping the client (ending the stream when it answered none for too long).
    Ping,
}

/// The client's half of a WebSocket, as the stream tasks send on it.
pub(crate) type Sink = futures_util::stream::SplitSink<WebSocket, Message>;

/// Ends a WebSocket: the close frame with `code` and `reason` (cut to fit; a client that
/// reads nothing gets [`CLOSE_WAIT`] for it), then the stream counts as activity on its VM
/// one last time.
pub(crate) async fn close(
    service: &Service,
    vm_id: &str,
    sink: &mut Sink,
    code: u16,
    reason: &str,
) {
    let frame = CloseFrame {
        code,
        reason: cut_reason(reason).into(),
    };
    let _ = tokio::time::timeout(CLOSE_WAIT, async {
        let _ = sink.send(Message::Close(Some(frame))).await;
        let _ = sink.close().await;
    })
    .await;
    service.stream_activity(vm_id);
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
pub(crate) mod tests {
    use super::*;

    /// A service on a fresh state directory (no VM is ever started).
    pub(crate) fn test_service(dir: &std::path::Path) -> Arc<Service> {
        test_service_with(dir, "")
    }

    /// [`test_service`] with `tables` (TOML) added to its configuration.
    pub(crate) fn test_service_with(dir: &std::path::Path, tables: &str) -> Arc<Service> {
        let text = format!(
            "state_dir = {:?}\naccel = \"tcg\"\n[images.dev]\nid = \"{}\"\n{tables}",
            dir.join("state"),
            "0".repeat(64)
        );
        let cfg = crate::config::ServiceConfig::parse(std::path::Path::new("t.toml"), &text)
            .expect("config");
        Arc::new(Service::open(cfg, dir.join("no-supervisor")).expect("open the service"))
    }

    /// A WebSocket client on loopback that completes the handshake and then never reads;
    /// `serve` runs on the server's socket. Returns the client's connection.
    pub(crate) async fn stalled_client<F, Fut>(serve: F) -> tokio::net::TcpStream
    where
        F: FnOnce(WebSocket) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        use tokio::io::AsyncWriteExt;
        let serve = Arc::new(std::sync::Mutex::new(Some(serve)));
        let app = axum::Router::new().route(
            "/s",
            axum::routing::get(move |ws: WebSocketUpgrade| {
                let serve = serve.lock().expect("lock").take();
                async move { ws.on_upgrade(serve.expect("one client")) }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(async move { axum::serve(listener, app).await });
        let mut c = tokio::net::TcpStream::connect(addr).await.expect("connect");
        c.write_all(
            b"GET /s HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
              Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n",
        )
        .await
        .expect("handshake");
        c
    }

    /// Waits until `written` stops growing for a second: the sender is stuck.
    pub(crate) async fn until_stuck(written: &AtomicU64) {
        let mut last = u64::MAX;
        let mut still = 0;
        for _ in 0..600 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let now = written.load(Ordering::Relaxed);
            if now == last && now > 0 {
                still += 1;
                if still >= 10 {
                    return;
                }
            } else {
                still = 0;
            }
            last = now;
        }
        panic!("the sender never stalled ({last} bytes)");
    }

    /// A guest stream of `p` to vm1 whose guest sends as fast as it is taken, to a client
    /// that reads nothing (or, `drain`, reads everything), once nothing moves any more.
    /// Returns when `run` ended, and the client's connection (to keep).
    async fn stuck_stream(
        service: &Arc<Service>,
        p: Principal,
        drain: bool,
    ) -> (
        tokio::sync::oneshot::Receiver<()>,
        tokio::net::tcp::OwnedWriteHalf,
    ) {
        let ticket = service.streams().admit(&p.workspace, "vm1").expect("admit");
        let (ours, guest) = tokio::net::UnixStream::pair().expect("pair");
        let opened = crate::service::streams::Opened {
            vm_id: "vm1".into(),
            stream: warren_supervisor::stream_frame::GuestStream::from_connected(ours),
            ticket,
        };
        let written = Arc::new(AtomicU64::new(0));
        let w = written.clone();
        tokio::spawn(async move {
            let mut guest = guest;
            let chunk = vec![7u8; 64 * 1024];
            while warren_supervisor::stream_frame::write_data(&mut guest, &chunk)
                .await
                .is_ok()
            {
                w.fetch_add(chunk.len() as u64, Ordering::Relaxed);
            }
        });
        let (done_tx, done) = tokio::sync::oneshot::channel();
        let s = service.clone();
        let client = stalled_client(move |socket| async move {
            run(s, p, opened, "port 5000".into(), socket).await;
            let _ = done_tx.send(());
        })
        .await;
        let (mut rd, wr) = client.into_split();
        tokio::spawn(async move {
            use tokio::io::AsyncReadExt;
            let mut buf = vec![0u8; 64 * 1024];
            while drain && matches!(rd.read(&mut buf).await, Ok(n) if n > 0) {}
            std::future::pending::<()>().await
        });
        until_stuck(&written).await;
        (done, wr)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn test_stream_to_a_client_that_stopped_reading_still_closes_on_suspend() {
        let dir = tempfile::tempdir().expect("tmp");
        let service = test_service(dir.path());
        let (done, _client) = stuck_stream(&service, Principal::local(0), false).await;
        assert_eq!(
            service
                .streams()
                .close_vm("vm1", crate::streams::CloseReason::Suspended),
            1
        );
        tokio::time::timeout(Duration::from_secs(20), done)
            .await
            .expect("the stream ends although its client reads nothing")
            .expect("ended");
        assert_eq!(service.streams().count("vm1"), 0);
    }

    /// A workspace token's id and its principal (to revoke while its stream is open).
    fn token(service: &Service) -> (String, Principal) {
        let (info, secret) = service
            .credentials()
            .issue("alice", None, &crate::auth::PolicyRequest::default())
            .expect("issue");
        let p = service.credentials().authenticate(&secret).expect("token");
        (info.id, p)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn test_stream_to_a_client_that_stopped_reading_still_closes_on_revocation() {
        let dir = tempfile::tempdir().expect("tmp");
        let service = test_service(dir.path());
        let (id, p) = token(&service);
        let (done, _client) = stuck_stream(&service, p, false).await;
        service.credentials().revoke(&id).expect("revoke");
        // Rechecked every RECHECK; the close frame then gets CLOSE_WAIT.
        tokio::time::timeout(RECHECK + CLOSE_WAIT + Duration::from_secs(5), done)
            .await
            .expect("revocation ends the stream although its client reads nothing")
            .expect("ended");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn test_slow_rate_limit_never_holds_off_revocation() {
        let dir = tempfile::tempdir().expect("tmp");
        // Past the 1 MiB burst each 64 KiB chunk waits 16 s for its turn: far beyond the
        // recheck, which must still close the stream on time.
        let service = test_service_with(dir.path(), "[streams]\nrate_bytes = 4096\n");
        let (id, p) = token(&service);
        let (done, _client) = stuck_stream(&service, p, true).await;
        service.credentials().revoke(&id).expect("revoke");
        // The client reads, so the close frame goes at once.
        tokio::time::timeout(RECHECK + Duration::from_secs(4), done)
            .await
            .expect("revocation ends a rate-limited stream on time")
            .expect("ended");
    }

    #[test]
    fn test_unheard_client_is_never_silent() {
        let heard = Heard {
            started: Instant::now() - PING_TIMEOUT * 2,
            at_ms: Arc::new(AtomicU64::new(0)),
        };
        assert!(heard.silent_for() > PING_TIMEOUT);
        heard.unheard();
        assert_eq!(heard.silent_for(), Duration::ZERO);
    }

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
