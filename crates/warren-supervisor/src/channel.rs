//! Host side of the agent channel.
//!
//! Steps on every (re)connection, in order:
//! 1. connect to the VMM's UNIX socket for the virtio-serial port;
//! 2. send `Sync(nonce)` with a fresh nonce every [`SYNC_RETRY`] until a `SyncAck` for the
//!    latest nonce arrives; everything read before it is stale and dropped (the guest may not
//!    have opened its port yet, and the kernel drops bytes sent to a closed port);
//! 3. an HTTP/2 client connection runs over the escaped data stream (a bridge task converts
//!    between the socket and an in-memory pipe);
//! 4. `Hello` then `Auth` (mutual proof of the per-VM secret, see `warren_protocol::auth`).
//!
//! A [`GuestChannel`] is cheap to clone; each [`GuestChannel::call`] is one HTTP/2 stream, and
//! dropping the call's future resets the stream, which cancels the request in the guest.
//! Every call has a deadline of its kind ([`crate::deadline::guest_limit`]): a guest that
//! stops answering fails the call with [`ChannelError::Timeout`], and the session stays up
//! for the calls after it (a stopped guest that runs again answers them).

use std::path::Path;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use rand::RngCore;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use warren_protocol::framing::{self, Decoder, Event, SyncNonce};

use crate::frame_meter::FrameMeter;
use warren_protocol::{
    auth, decode, encode, AgentInfo, Auth, GuestError, GuestResponse, Hello, HostRequest, Response,
    MIN_PROTOCOL_VERSION, PROTOCOL_VERSION, RPC_PATH,
};

/// How often an unanswered `Sync` is repeated.
pub const SYNC_RETRY: Duration = Duration::from_millis(20);
/// HTTP/2 windows: large enough that a 128 KiB file chunk flows without waiting for updates.
const STREAM_WINDOW: u32 = 1 << 20;
const CONN_WINDOW: u32 = 8 << 20;
const MAX_FRAME_SIZE: u32 = 1 << 17;
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
    H2(#[from] h2::Error),
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

/// An authenticated session with the guest agent.
#[derive(Clone)]
pub struct GuestChannel {
    sender: h2::client::SendRequest<Bytes>,
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

    async fn connect_inner(path: &Path, secret: &[u8]) -> Result<GuestChannel, ChannelError> {
        let stream = loop {
            match UnixStream::connect(path).await {
                Ok(s) => break s,
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
        };
        let (mut rd, mut wr) = stream.into_split();
        let mut decoder = Decoder::new();
        let leftover = resync(&mut rd, &mut wr, &mut decoder).await?;
        tracing::debug!("channel resynchronised");

        let (h2_io, bridge_io) = tokio::io::duplex(1 << 20);
        tokio::spawn(bridge(rd, wr, decoder, leftover, bridge_io));

        let (sender, conn) = h2::client::Builder::new()
            .initial_window_size(STREAM_WINDOW)
            .initial_connection_window_size(CONN_WINDOW)
            .max_frame_size(MAX_FRAME_SIZE)
            .enable_push(false)
            .handshake::<_, Bytes>(h2_io)
            .await?;
        let (closed_tx, closed) = tokio::sync::watch::channel(false);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "guest channel connection ended");
            }
            let _ = closed_tx.send(true);
        });
        let mut ch = GuestChannel {
            sender,
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

/// Sends `Sync`s until the guest acknowledges the latest; returns data read after the ack.
async fn resync(
    rd: &mut tokio::net::unix::OwnedReadHalf,
    wr: &mut tokio::net::unix::OwnedWriteHalf,
    decoder: &mut Decoder,
) -> Result<Vec<u8>, ChannelError> {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let mut nonce: SyncNonce = [0; framing::SYNC_NONCE_LEN];
        rand::rng().fill_bytes(&mut nonce);
        wr.write_all(&framing::encode_sync(&nonce)).await?;
        let until = tokio::time::Instant::now() + SYNC_RETRY;
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
                return Ok(after);
            }
        }
    }
}

/// Moves bytes between the socket (escaped) and the HTTP/2 pipe (plain) until either ends.
async fn bridge(
    mut rd: tokio::net::unix::OwnedReadHalf,
    mut wr: tokio::net::unix::OwnedWriteHalf,
    mut decoder: Decoder,
    leftover: Vec<u8>,
    pipe: tokio::io::DuplexStream,
) {
    let (mut prd, mut pwr) = tokio::io::split(pipe);
    let inbound = async move {
        if !leftover.is_empty() {
            pwr.write_all(&leftover).await?;
        }
        let mut buf = vec![0u8; 128 * 1024];
        // The guest's frames are budgeted (`frame_meter`): a flood waits here, unread.
        let mut meter = FrameMeter::new();
        let frames = meter.count(&leftover);
        meter.charge(frames, Instant::now());
        loop {
            let n = rd.read(&mut buf).await?;
            if n == 0 {
                return Ok::<_, std::io::Error>(());
            }
            let mut events = Vec::new();
            decoder.feed(&buf[..n], &mut events);
            for ev in events {
                match ev {
                    Event::Data(d) => {
                        let frames = meter.count(&d);
                        let wait = meter.charge(frames, Instant::now());
                        if !wait.is_zero() {
                            tokio::time::sleep(wait).await;
                        }
                        pwr.write_all(&d).await?
                    }
                    // The guest never sends markers mid-session; a stray one means the stream
                    // is corrupt, so end the session and let the supervisor resync.
                    other => {
                        return Err(std::io::Error::other(format!(
                            "unexpected {other:?} on the channel"
                        )))
                    }
                }
            }
        }
    };
    let outbound = async move {
        let mut buf = vec![0u8; 128 * 1024];
        let mut out = Vec::with_capacity(256 * 1024);
        loop {
            let n = prd.read(&mut buf).await?;
            if n == 0 {
                return Ok::<_, std::io::Error>(());
            }
            out.clear();
            framing::encode_data(&buf[..n], &mut out);
            wr.write_all(&out).await?;
        }
    };
    tokio::select! {
        r = inbound => if let Err(e) = r { tracing::debug!(error = %e, "channel inbound ended") },
        r = outbound => if let Err(e) = r { tracing::debug!(error = %e, "channel outbound ended") },
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
