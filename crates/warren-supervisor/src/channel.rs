//! Host side of the agent channel.
//!
//! Steps on every (re)connection, in order:
//! 1. connect to the VMM's UNIX socket for the virtio-serial port;
//! 2. send `Sync(nonce)` with a fresh nonce every [`SYNC_RETRY`] until a `SyncAck` for the
//!    latest nonce arrives; everything read before it is stale and dropped (the guest may not
//!    have opened its port yet, and the kernel drops bytes sent to a closed port);
//! 3. an HTTP/2 client connection runs over the escaped data stream (`ChannelIo` escapes
//!    and unescapes in place, on the connection's own task);
//! 4. `Hello` then `Auth` (mutual proof of the per-VM secret, see `warren_protocol::auth`).
//!
//! A [`GuestChannel`] is cheap to clone; each [`GuestChannel::call`] is one HTTP/2 stream, and
//! dropping the call's future resets the stream, which cancels the request in the guest.
//! Every call has a deadline of its kind ([`crate::deadline::guest_limit`]): a guest that
//! stops answering fails the call with [`ChannelError::Timeout`], and the session stays up
//! for the calls after it (a stopped guest that runs again answers them).

use std::future::Future;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use rand::RngCore;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::UnixStream;
use warren_protocol::framing::{self, Decoder, Event, SyncNonce};

use crate::frame_meter::FrameMeter;
use warren_protocol::{
    auth, decode, encode, AgentInfo, Auth, GuestError, GuestResponse, Hello, HostRequest, Response,
    MIN_PROTOCOL_VERSION, PROTOCOL_VERSION, RPC_PATH,
};

/// How often an unanswered `Sync` is repeated.
pub const SYNC_RETRY: Duration = Duration::from_millis(20);
/// How long the first `Sync` to a restored guest is waited for before it is repeated. Its
/// port was open when it was saved and the socket is connected before the restore
/// ([`GuestChannel::connect_over`]), so that `Sync` is not lost, only answered slowly (the
/// guest's code runs cold after a restore: 20-40 ms under TCG); repeating it after
/// [`SYNC_RETRY`] made the guest answer twice and the host wait for the second answer.
pub const RESTORED_SYNC_WAIT: Duration = Duration::from_millis(250);
/// HTTP/2 windows: large enough that a 128 KiB file chunk flows without waiting for updates.
const STREAM_WINDOW: u32 = 1 << 20;
const CONN_WINDOW: u32 = 8 << 20;
/// The guest's frames: small enough that a short answer is not queued behind much of a
/// stream's data, and that a stream's receiver gets data while the next frame arrives.
const MAX_FRAME_SIZE: u32 = 1 << 16;
/// The largest header block (decoded, as HTTP/2 counts it) the guest may send: an answer
/// needs `:status`, a stream's end two short trailers (`warren-exit`, and `warren-error` of
/// at most 1 KiB). Without it h2 accepts 16 MiB per block, decoded and held before anything
/// looks at it. A larger block resets its stream (far larger: a GOAWAY). The HPACK table the
/// guest may make the host keep stays at HTTP/2's default 4 KiB (never raised here).
const MAX_HEADER_LIST_SIZE: u32 = 16 * 1024;
/// The longest guest error message passed on: the agent's own are a line, a hostile guest's
/// may fill a whole message (1 MiB), which would reach every log and client it crosses.
pub const MAX_GUEST_ERROR_MESSAGE: usize = 4096;

/// Cuts `message` to [`MAX_GUEST_ERROR_MESSAGE`] bytes (at a character boundary), saying so.
fn cut_message(message: &mut String) {
    if message.len() <= MAX_GUEST_ERROR_MESSAGE {
        return;
    }
    let mut end = MAX_GUEST_ERROR_MESSAGE;
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    let cut = message.len() - end;
    message.truncate(end);
    message.push_str(&format!("…[+{cut} bytes]"));
}

#[derive(Debug, thiserror::Error)]
pub enum ChannelError {
    #[error("connecting to the channel socket failed")]
    Connect(#[source] std::io::Error),
    #[error("the guest did not answer within {0:?}")]
    Timeout(Duration),
    #[error("channel I/O failed")]
    Io(#[from] std::io::Error),
    #[error("HTTP/2 failed")]
    H2(#[source] H2Failure),
    #[error("message codec: {0}")]
    Codec(#[from] warren_protocol::CodecError),
    #[error("the guest's proof of the VM secret is wrong")]
    BadGuestProof,
    #[error("protocol version mismatch: guest chose {0}")]
    Version(u32),
    #[error("unexpected reply to {0}")]
    Unexpected(&'static str),
    #[error("guest refused the session: {0}")]
    Refused(GuestError),
    #[error("the channel closed")]
    Closed,
}

/// Every HTTP/2 failure becomes a [`H2Failure`]: the one place guest bytes inside an
/// `h2::Error` are dropped before the error reaches a log, a reply or `exit.json`.
impl From<h2::Error> for ChannelError {
    fn from(e: h2::Error) -> ChannelError {
        ChannelError::H2(H2Failure(e))
    }
}

/// An HTTP/2 failure, described without the peer's GOAWAY debug data. h2's own text appends
/// that data escaped (up to a whole 64 KiB frame of the guest's bytes, four times that once
/// escaped) to every error of the calls in flight; here a GOAWAY says only who sent it and
/// its reason code. Every other kind of h2 error has a fixed text (a reason code, an I/O
/// error, a misuse of the API), so it is passed on as h2 words it.
#[derive(Debug)]
pub struct H2Failure(h2::Error);

impl H2Failure {
    /// The h2 error (its `Display` is not bounded: use this type's).
    pub fn inner(&self) -> &h2::Error {
        &self.0
    }
}

impl std::fmt::Display for H2Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let e = &self.0;
        if !e.is_go_away() {
            return e.fmt(f);
        }
        let by = if e.is_remote() {
            "received from the guest"
        } else if e.is_library() {
            "detected"
        } else {
            "sent"
        };
        match e.reason() {
            Some(r) => write!(f, "connection error {by}: {r}"),
            None => write!(f, "connection error {by}"),
        }
    }
}

impl std::error::Error for H2Failure {}

/// The HTTP/2 connection's PING handle and whether a PING of a caller that gave up is
/// still unanswered.
struct Pinger {
    ping_pong: Option<h2::PingPong>,
    in_flight: bool,
}

/// An authenticated session with the guest agent.
#[derive(Clone)]
pub struct GuestChannel {
    sender: h2::client::SendRequest<Bytes>,
    /// The connection's HTTP/2 PING: one in flight at a time, so callers take turns.
    pinger: Arc<tokio::sync::Mutex<Pinger>>,
    /// Becomes true when the HTTP/2 connection task ends.
    closed: tokio::sync::watch::Receiver<bool>,
    pub info: AgentInfo,
    /// The protocol version the guest chose in `Hello`.
    pub version: u32,
}

impl GuestChannel {
    /// Connects, resynchronises and authenticates, giving up at `deadline`.
    pub async fn connect(
        path: &Path,
        secret: &[u8],
        deadline: Instant,
    ) -> Result<GuestChannel, ChannelError> {
        let budget = deadline.saturating_duration_since(Instant::now());
        tokio::time::timeout(budget, Self::connect_inner(path, secret))
            .await
            .map_err(|_| ChannelError::Timeout(budget))?
    }

    /// Connects the VMM's end of the channel (waiting for it to appear), giving up at
    /// `deadline`; [`GuestChannel::connect_over`] then makes the session on it.
    pub async fn connect_socket(
        path: &Path,
        deadline: Instant,
    ) -> Result<UnixStream, ChannelError> {
        let budget = deadline.saturating_duration_since(Instant::now());
        tokio::time::timeout(budget, Self::socket(path))
            .await
            .map_err(|_| ChannelError::Timeout(budget))?
    }

    /// Resynchronises and authenticates over an already connected `stream`, giving up at
    /// `deadline`.
    pub async fn connect_over(
        stream: UnixStream,
        secret: &[u8],
        deadline: Instant,
    ) -> Result<GuestChannel, ChannelError> {
        let budget = deadline.saturating_duration_since(Instant::now());
        tokio::time::timeout(budget, Self::session(stream, secret, RESTORED_SYNC_WAIT))
            .await
            .map_err(|_| ChannelError::Timeout(budget))?
    }

    async fn socket(path: &Path) -> Result<UnixStream, ChannelError> {
        loop {
            match UnixStream::connect(path).await {
                Ok(s) => return Ok(s),
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
                    ) =>
                {
                    tokio::time::sleep(Duration::from_millis(5)).await
                }
                Err(e) => return Err(ChannelError::Connect(e)),
            }
        }
    }

    async fn connect_inner(path: &Path, secret: &[u8]) -> Result<GuestChannel, ChannelError> {
        let stream = Self::socket(path).await?;
        Self::session(stream, secret, SYNC_RETRY).await
    }

    /// A session over `stream`, its first `Sync` repeated after `first_wait`.
    async fn session(
        stream: UnixStream,
        secret: &[u8],
        first_wait: Duration,
    ) -> Result<GuestChannel, ChannelError> {
        let mut stream = stream;
        let mut decoder = Decoder::new();
        let leftover = resync(&mut stream, &mut decoder, first_wait).await?;
        tracing::debug!("channel resynchronised");
        let h2_io = ChannelIo::new(stream, decoder, leftover);

        let (sender, conn) = h2::client::Builder::new()
            .initial_window_size(STREAM_WINDOW)
            .initial_connection_window_size(CONN_WINDOW)
            .max_frame_size(MAX_FRAME_SIZE)
            .max_header_list_size(MAX_HEADER_LIST_SIZE)
            .enable_push(false)
            .handshake::<_, Bytes>(h2_io)
            .await?;
        let mut conn = conn;
        let pinger = Arc::new(tokio::sync::Mutex::new(Pinger {
            ping_pong: conn.ping_pong(),
            in_flight: false,
        }));
        let (closed_tx, closed) = tokio::sync::watch::channel(false);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                let e = H2Failure(e);
                tracing::debug!(error = %e, "guest channel connection ended");
            }
            let _ = closed_tx.send(true);
        });
        let mut ch = GuestChannel {
            sender,
            pinger,
            closed,
            info: AgentInfo {
                agent_version: String::new(),
                kernel_release: String::new(),
                boot_id: String::new(),
                uptime_ms: 0,
            },
            version: 0,
        };
        tracing::debug!("HTTP/2 session up");
        (ch.info, ch.version) = ch.authenticate(secret).await?;
        tracing::debug!("guest authenticated");
        Ok(ch)
    }

    async fn authenticate(&self, secret: &[u8]) -> Result<(AgentInfo, u32), ChannelError> {
        let mut host_nonce = [0u8; auth::NONCE_LEN];
        rand::rng().fill_bytes(&mut host_nonce);
        let reply = self
            .call(&HostRequest::Hello(Hello {
                max_version: PROTOCOL_VERSION,
                min_version: MIN_PROTOCOL_VERSION,
                host_nonce,
            }))
            .await?
            .map_err(ChannelError::Refused)?;
        let GuestResponse::Hello(hello) = reply else {
            return Err(ChannelError::Unexpected("Hello"));
        };
        if !(MIN_PROTOCOL_VERSION..=PROTOCOL_VERSION).contains(&hello.version) {
            return Err(ChannelError::Version(hello.version));
        }
        let expected = auth::guest_proof(secret, &host_nonce, &hello.guest_nonce);
        if !auth::verify(&expected, &hello.proof) {
            return Err(ChannelError::BadGuestProof);
        }
        let mut entropy = [0u8; 32];
        rand::rng().fill_bytes(&mut entropy);
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos() as u64;
        let reply = self
            .call(&HostRequest::Auth(Auth {
                proof: auth::host_proof(secret, &host_nonce, &hello.guest_nonce),
                unix_time_ns: now,
                entropy,
            }))
            .await?
            .map_err(ChannelError::Refused)?;
        match reply {
            GuestResponse::Authenticated(info) => Ok((info, hello.version)),
            _ => Err(ChannelError::Unexpected("Auth")),
        }
    }

    /// The channel's own round trip: an HTTP/2 PING, answered by the guest's HTTP/2
    /// connection without a request (no stream, headers or message), within
    /// [`crate::deadline::CONTROL_LIMIT`]. Returns the time from sending it to its PONG.
    pub async fn ping(&self) -> Result<Duration, ChannelError> {
        let limit = crate::deadline::CONTROL_LIMIT;
        let round = async {
            let mut guard = self.pinger.lock().await;
            let Pinger {
                ping_pong,
                in_flight,
            } = &mut *guard;
            let ping_pong = ping_pong.as_mut().ok_or(ChannelError::Unexpected("PING"))?;
            // A caller that gave up left its PING unanswered: HTTP/2 allows one at a time,
            // so its PONG is waited for first.
            if *in_flight {
                std::future::poll_fn(|cx| ping_pong.poll_pong(cx)).await?;
                *in_flight = false;
            }
            let t = Instant::now();
            ping_pong.send_ping(h2::Ping::opaque())?;
            *in_flight = true;
            std::future::poll_fn(|cx| ping_pong.poll_pong(cx)).await?;
            *in_flight = false;
            Ok(t.elapsed())
        };
        tokio::time::timeout(limit, round)
            .await
            .map_err(|_| ChannelError::Timeout(limit))?
    }

    /// Sends one request and waits for its response, at most for the deadline of its kind
    /// ([`crate::deadline::guest_limit`]); dropping the future cancels it.
    pub async fn call(&self, req: &HostRequest) -> Result<Response, ChannelError> {
        // What a guest older than protocol 5 does instead (it cannot decode the new ones).
        let older;
        let req = match req {
            HostRequest::JobOutputAcked(a) if self.version < 5 => {
                // Its read releases at the cursors: a reconnecting reader may find less.
                older = HostRequest::JobOutput(a.read.clone());
                &older
            }
            HostRequest::ExecBroker(_) if self.version < 5 => {
                return Ok(Err(GuestError::new(
                    warren_protocol::ErrorCode::InvalidArgument,
                    format!(
                        "the VM's agent speaks protocol {}, without broker pipes (5): recreate the VM on a rebuilt image",
                        self.version
                    ),
                )));
            }
            req => req,
        };
        let limit = crate::deadline::guest_limit(req);
        tokio::time::timeout(limit, self.exchange(req))
            .await
            .map_err(|_| ChannelError::Timeout(limit))?
    }

    async fn exchange(&self, req: &HostRequest) -> Result<Response, ChannelError> {
        let body = Bytes::from(encode(req)?);
        let mut sender = self.sender.clone().ready().await?;
        let request = http::Request::post(RPC_PATH)
            .body(())
            .expect("invariant: static request parts are valid");
        let (response, mut send) = sender.send_request(request, false)?;
        send.send_data(body, true)?;
        let response = response.await?;
        let mut body = response.into_body();
        let mut buf = Vec::new();
        while let Some(chunk) = body.data().await {
            let chunk = chunk?;
            let _ = body.flow_control().release_capacity(chunk.len());
            if buf.len() + chunk.len() > warren_protocol::limits::MAX_MESSAGE_BYTES {
                return Err(warren_protocol::CodecError::TooLarge(buf.len() + chunk.len()).into());
            }
            buf.extend_from_slice(&chunk);
            // An error whose message is past the limit is cut as soon as the part kept is
            // here; returning drops `body`, which resets the stream: the rest is never
            // asked for, held or decoded.
            if let Some(head) = warren_protocol::long_error_head(&buf, MAX_GUEST_ERROR_MESSAGE) {
                let (code, text, len) = head?;
                let mut message = text.to_string();
                message.push_str(&format!("…[+{} bytes]", len - text.len()));
                return Ok(Err(GuestError { code, message }));
            }
        }
        let mut response = decode::<Response>(&buf)?;
        if let Err(e) = &mut response {
            cut_message(&mut e.message);
        }
        Ok(response)
    }

    /// Opens a guest stream (`warren_protocol::stream`): the send half carries the guest's
    /// input, the receive half its output and then the exit trailers. A refusal is the
    /// guest's error.
    pub async fn open_stream(
        &self,
        target: &warren_protocol::stream::StreamTarget,
    ) -> Result<Result<(h2::SendStream<Bytes>, h2::RecvStream), GuestError>, ChannelError> {
        use warren_protocol::stream::{STREAM_HEADER, STREAM_PATH};
        let limit = crate::deadline::CONTROL_LIMIT;
        let open = async {
            let header = target.to_header()?;
            let mut sender = self.sender.clone().ready().await?;
            let request = http::Request::post(STREAM_PATH)
                .header(STREAM_HEADER, header)
                .body(())
                .map_err(|_| ChannelError::Unexpected("stream target header"))?;
            let (response, send) = sender.send_request(request, false)?;
            let response = response.await?;
            let status = response.status();
            let mut body = response.into_body();
            if status == http::StatusCode::OK {
                return Ok(Ok((send, body)));
            }
            let mut buf = Vec::new();
            while let Some(chunk) = body.data().await {
                let chunk = chunk?;
                let _ = body.flow_control().release_capacity(chunk.len());
                if buf.len() + chunk.len() > 64 * 1024 {
                    return Err(
                        warren_protocol::CodecError::TooLarge(buf.len() + chunk.len()).into(),
                    );
                }
                buf.extend_from_slice(&chunk);
            }
            let mut err = match decode::<GuestError>(&buf) {
                Ok(e) => e,
                // An agent of protocol version 3 has no stream path.
                Err(_) if status == http::StatusCode::NOT_FOUND => GuestError::new(
                    warren_protocol::ErrorCode::WrongType,
                    "the guest agent has no streams (an image built before protocol \
                     version 4): rebuild the image",
                ),
                Err(e) => return Err(e.into()),
            };
            cut_message(&mut err.message);
            Ok(Err(err))
        };
        tokio::time::timeout(limit, open)
            .await
            .map_err(|_| ChannelError::Timeout(limit))?
    }

    /// Resolves once the session is gone (guest reset, corrupt stream, VMM exit).
    pub async fn closed(&self) {
        let mut rx = self.closed.clone();
        let _ = rx.wait_for(|c| *c).await;
    }
}

/// Sends `Sync`s until the guest acknowledges the latest (the first repeated after
/// `first_wait`, the others after [`SYNC_RETRY`]); returns data read after the ack.
async fn resync(
    stream: &mut UnixStream,
    decoder: &mut Decoder,
    first_wait: Duration,
) -> Result<Vec<u8>, ChannelError> {
    let (mut rd, mut wr) = stream.split();
    let mut buf = vec![0u8; 64 * 1024];
    let started = Instant::now();
    let mut sent = 0u32;
    loop {
        sent += 1;
        let mut nonce: SyncNonce = [0; framing::SYNC_NONCE_LEN];
        rand::rng().fill_bytes(&mut nonce);
        wr.write_all(&framing::encode_sync(&nonce)).await?;
        let wait = if sent == 1 { first_wait } else { SYNC_RETRY };
        let until = tokio::time::Instant::now() + wait;
        loop {
            let n = match tokio::time::timeout_at(until, rd.read(&mut buf)).await {
                Err(_) => break, // resend
                Ok(Ok(0)) => return Err(ChannelError::Closed),
                Ok(Ok(n)) => n,
                Ok(Err(e)) => return Err(e.into()),
            };
            let mut events = Vec::new();
            decoder.feed(&buf[..n], &mut events);
            let mut acked = false;
            let mut after = Vec::new();
            for ev in events {
                match ev {
                    Event::SyncAck(n) if n == nonce => {
                        acked = true;
                        after.clear();
                    }
                    Event::Data(d) if acked => after.extend_from_slice(&d),
                    _ => {}
                }
            }
            if acked {
                tracing::debug!(
                    syncs = sent,
                    us = started.elapsed().as_micros() as u64,
                    "sync acknowledged"
                );
                return Ok(after);
            }
        }
    }
}

/// Unwritten escaped bytes past which a write waits for the socket (small: a request queued
/// behind a stream's data waits for all of it).
const MAX_PENDING: usize = 64 * 1024;
/// Escaped bytes written at once before a flush asks for the rest: HTTP/2's small frames
/// written together (headers and body of a request) reach the guest in one write.
const WRITE_BATCH: usize = 32 * 1024;

/// The HTTP/2 connection's view of the channel socket, with no task or pipe in between:
/// reads are unescaped in place in HTTP/2's own buffer and budgeted ([`FrameMeter`]: past
/// the budget the next read waits, so the guest's writes back up), writes are escaped into
/// one pending buffer. A marker mid-session means the stream is corrupt: the read fails,
/// which ends the session, and the supervisor resyncs.
struct ChannelIo {
    stream: UnixStream,
    decoder: Decoder,
    meter: FrameMeter,
    /// Read on only once this fires.
    wait: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
    /// Data read together with the acknowledgement, delivered first.
    leftover: Vec<u8>,
    /// A marker arrived mid-session: reads fail from now on (after the data before it).
    corrupt: Option<String>,
    /// Escaped bytes; `out[pos..]` is not written yet.
    out: Vec<u8>,
    pos: usize,
}

impl ChannelIo {
    fn new(stream: UnixStream, decoder: Decoder, leftover: Vec<u8>) -> ChannelIo {
        let mut meter = FrameMeter::new();
        let frames = meter.count(&leftover);
        meter.charge(frames, Instant::now());
        ChannelIo {
            stream,
            decoder,
            meter,
            wait: None,
            leftover,
            corrupt: None,
            out: Vec::new(),
            pos: 0,
        }
    }

    fn poll_drain(&mut self, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        while self.pos < self.out.len() {
            let n = ready!(Pin::new(&mut self.stream).poll_write(cx, &self.out[self.pos..]))?;
            if n == 0 {
                return Poll::Ready(Err(std::io::ErrorKind::WriteZero.into()));
            }
            self.pos += n;
        }
        self.out.clear();
        self.pos = 0;
        Poll::Ready(Ok(()))
    }

    fn poll_write_data(
        &mut self,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        if self.out.len() - self.pos >= MAX_PENDING {
            match self.poll_drain(cx) {
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending if self.out.len() - self.pos >= MAX_PENDING => return Poll::Pending,
                _ => {}
            }
        }
        if self.pos > 0 && self.pos >= self.out.len() / 2 {
            self.out.drain(..self.pos);
            self.pos = 0;
        }
        let mut n = 0;
        for b in bufs {
            framing::encode_data(b, &mut self.out);
            n += b.len();
        }
        // Small writes wait for the flush; what the socket does not take now goes with the
        // next write or flush.
        if self.out.len() - self.pos >= WRITE_BATCH {
            if let Poll::Ready(Err(e)) = self.poll_drain(cx) {
                return Poll::Ready(Err(e));
            }
        }
        Poll::Ready(Ok(n))
    }
}

impl AsyncRead for ChannelIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        if !this.leftover.is_empty() {
            let n = this.leftover.len().min(buf.remaining());
            buf.put_slice(&this.leftover[..n]);
            this.leftover.drain(..n);
            return Poll::Ready(Ok(()));
        }
        if let Some(why) = &this.corrupt {
            return Poll::Ready(Err(std::io::Error::other(why.clone())));
        }
        if let Some(wait) = this.wait.as_mut() {
            ready!(wait.as_mut().poll(cx));
            this.wait = None;
        }
        loop {
            let start = buf.filled().len();
            ready!(Pin::new(&mut this.stream).poll_read(cx, buf))?;
            let end = buf.filled().len();
            if end == start {
                return Poll::Ready(Ok(()));
            }
            let got = this
                .decoder
                .decode_in_place(&mut buf.filled_mut()[start..end]);
            if let Some(marker) = got.marker {
                // The guest never sends markers mid-session: the session ends, after the data
                // before the marker (an answer already sent stays answered).
                this.corrupt = Some(format!("unexpected {marker:?} on the channel"));
            }
            buf.set_filled(start + got.data);
            let frames = this.meter.count(&buf.filled()[start..]);
            let wait = this.meter.charge(frames, Instant::now());
            if !wait.is_zero() {
                this.wait = Some(Box::pin(tokio::time::sleep(wait)));
            }
            if got.data > 0 {
                return Poll::Ready(Ok(()));
            }
            if let Some(why) = &this.corrupt {
                return Poll::Ready(Err(std::io::Error::other(why.clone())));
            }
        }
    }
}

impl AsyncWrite for ChannelIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        self.get_mut()
            .poll_write_data(cx, &[std::io::IoSlice::new(buf)])
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        self.get_mut().poll_write_data(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        self.get_mut().poll_drain(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_drain(cx))?;
        Pin::new(&mut this.stream).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_cut_message_megabyte_guest_error_is_cut_at_a_char_boundary() {
        let mut m = format!("é{}", "E".repeat(1 << 20));
        cut_message(&mut m);
        assert!(m.len() < MAX_GUEST_ERROR_MESSAGE + 32, "{}", m.len());
        assert!(m.ends_with(" bytes]"), "{m}");
        let mut short = "not found".to_string();
        cut_message(&mut short);
        assert_eq!(short, "not found");
    }
}
