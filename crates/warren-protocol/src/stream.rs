//! Guest streams (since protocol version 4): a two-way byte stream between the host and
//! something in the guest, carried by one HTTP/2 stream of the channel.
//!
//! Steps, in order:
//! 1. The host sends a request to [`STREAM_PATH`] (method POST) whose
//!    [`STREAM_HEADER`] header is the hex of a postcard-encoded [`StreamTarget`], without
//!    ending the request body.
//! 2. The guest, in an authenticated session only, opens the target: a TCP connection to the
//!    guest's own `127.0.0.1:port`, or a `tar` process run as the guest user. It answers 200
//!    when it is open, or another status whose body is one postcard `GuestError` (401 before
//!    authentication, 400 for a bad target, 404 when nothing listens, 500 otherwise).
//! 3. Request body bytes go to the target; the end of the request body is end-of-file for
//!    the target (a TCP half-close, or the end of `tar`'s standard input). The target's bytes
//!    come back as the response body, and the target's own end ends it, followed by trailers:
//!    [`EXIT_TRAILER`] (a `tar` exit status, or `0` for a TCP peer that closed its end) and,
//!    for a failure, [`ERROR_TRAILER`] (printable ASCII, at most [`MAX_ERROR_TRAILER`] bytes).
//! 4. Either side resets the HTTP/2 stream to abandon it: the guest closes the connection or
//!    kills the process.
//!
//! HTTP/2 flow control paces both directions: the guest releases window only after it wrote
//! the bytes to the target, and reads the target only as fast as the host drains it.

use serde::{Deserialize, Serialize};

use crate::CodecError;

/// HTTP/2 path of a guest stream.
pub const STREAM_PATH: &str = "/warren/v1/stream";
/// Request header carrying the hex of the postcard-encoded [`StreamTarget`].
pub const STREAM_HEADER: &str = "warren-stream";
/// Trailer with the target's exit status (decimal).
pub const EXIT_TRAILER: &str = "warren-exit";
/// Trailer with a failure's message.
pub const ERROR_TRAILER: &str = "warren-error";
/// Longest [`ERROR_TRAILER`] value.
pub const MAX_ERROR_TRAILER: usize = 1024;
/// Longest path in a [`StreamTarget`].
pub const MAX_STREAM_PATH: usize = 4096;

/// What a guest stream connects to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum StreamTarget {
    /// A TCP connection to `127.0.0.1:port` in the guest.
    Tcp { port: u16 },
    /// Unpacks the tar archive the host sends into the directory `dir` (absolute, created
    /// with its parents when missing) as the guest user, keeping modes and symlinks.
    TarExtract { dir: String },
    /// Sends a tar archive of `path` (absolute; a file or a directory tree, named by its
    /// last component) made as the guest user.
    TarCreate { path: String },
    /// Since version 5: the next connection to the broker pipe of job `job` (started with
    /// `ExecBroker`). The guest answers 200 at once (404 when the job has no pipe or it is
    /// gone), then sends [`BROKER_ACCEPTED`] when a process of the job connects, followed by
    /// the connection's bytes; the request body carries the bytes back.
    BrokerAccept { job: crate::JobId },
}

/// The byte a broker accept stream sends first, when a connection arrived.
pub const BROKER_ACCEPTED: u8 = 0x01;

impl StreamTarget {
    /// The header value for this target.
    pub fn to_header(&self) -> Result<String, CodecError> {
        let bytes = crate::encode(self)?;
        let mut out = String::with_capacity(bytes.len() * 2);
        for b in bytes {
            out.push(char::from(HEX[usize::from(b >> 4)]));
            out.push(char::from(HEX[usize::from(b & 15)]));
        }
        Ok(out)
    }

    /// Parses a header value (at most twice [`MAX_STREAM_PATH`] plus a little).
    pub fn from_header(value: &[u8]) -> Result<Self, CodecError> {
        if value.len() > 2 * (MAX_STREAM_PATH + 16) {
            return Err(CodecError::TooLarge(value.len()));
        }
        if !value.len().is_multiple_of(2) {
            return Err(CodecError::BadHeader);
        }
        let mut bytes = Vec::with_capacity(value.len() / 2);
        for pair in value.chunks_exact(2) {
            let hi = nibble(pair[0]).ok_or(CodecError::BadHeader)?;
            let lo = nibble(pair[1]).ok_or(CodecError::BadHeader)?;
            bytes.push(hi << 4 | lo);
        }
        crate::decode(&bytes)
    }
}

const HEX: &[u8; 16] = b"0123456789abcdef";

fn nibble(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    }
}

/// Makes `text` safe for a trailer value: printable ASCII only (others become `?`), cut to
/// [`MAX_ERROR_TRAILER`] bytes.
pub fn trailer_text(text: &str) -> String {
    text.chars()
        .map(|c| if (' '..='~').contains(&c) { c } else { '?' })
        .take(MAX_ERROR_TRAILER)
        .collect()
}

/// Sends `data` on `send` as the peer's window allows (HTTP/2 flow control), never
/// buffering more than the window in the connection.
#[cfg(feature = "h2")]
pub async fn send_paced(
    send: &mut h2::SendStream<bytes::Bytes>,
    mut data: bytes::Bytes,
) -> Result<(), h2::Error> {
    while !data.is_empty() {
        send.reserve_capacity(data.len());
        match std::future::poll_fn(|cx| send.poll_capacity(cx)).await {
            Some(Ok(0)) => {}
            Some(Ok(n)) => send.send_data(data.split_to(n.min(data.len())), false)?,
            Some(Err(e)) => return Err(e),
            None => return Err(h2::Error::from(h2::Reason::CANCEL)),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_target_header_roundtrip() {
        for t in [
            StreamTarget::Tcp { port: 5000 },
            StreamTarget::TarExtract {
                dir: "/tmp/é x".into(),
            },
            StreamTarget::TarCreate { path: "/".into() },
        ] {
            let h = t.to_header().expect("encode");
            assert!(h.bytes().all(|b| b.is_ascii_hexdigit()), "{h}");
            assert_eq!(StreamTarget::from_header(h.as_bytes()).expect("decode"), t);
        }
    }

    #[test]
    fn test_target_header_garbage_refused() {
        assert!(StreamTarget::from_header(b"zz").is_err());
        assert!(StreamTarget::from_header(b"0").is_err());
        assert!(StreamTarget::from_header(b"ff").is_err());
        assert!(StreamTarget::from_header(&vec![b'0'; 20_000]).is_err());
    }

    #[test]
    fn test_trailer_text_printable_and_cut() {
        assert_eq!(trailer_text("a\nb\u{e9}"), "a?b?");
        assert_eq!(trailer_text(&"x".repeat(5000)).len(), MAX_ERROR_TRAILER);
    }
}
