//! Guest streams on `supervisor.sock`: after `SupervisorRequest::OpenStream` is answered
//! `StreamOpened`, the same connection carries stream frames both ways until the stream
//! ends. A frame is `u8 kind, u32 length (big-endian), payload`:
//!
//! | kind | name | direction | payload |
//! | --- | --- | --- | --- |
//! | 1 | data | both | bytes, 1..=[`MAX_STREAM_DATA`] |
//! | 2 | eof | client -> supervisor | none: end of the guest's input (half-close) |
//! | 3 | end | supervisor -> client | postcard [`StreamEnd`]: the last frame |
//!
//! The client abandons a stream by closing the connection; the supervisor then resets the
//! guest's HTTP/2 stream, which closes the guest's end. Hand-written because it is five
//! lines of layout and the data path should not copy through a serde encoding.

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};

use crate::proto::FrameError;

/// Largest data payload of one frame.
pub const MAX_STREAM_DATA: usize = 1 << 20;
/// Largest `end` payload.
const MAX_END: usize = 4096;

const KIND_DATA: u8 = 1;
const KIND_EOF: u8 = 2;
const KIND_END: u8 = 3;

/// The end's text when the channel itself went down under a stream (the VMM exited, the
/// guest reset): the service then looks whether the VM was suspended or destroyed. A guest
/// can send the same text as its own error; it only delays its own stream's close.
pub const CHANNEL_CLOSED: &str = "the guest channel closed";

/// How a stream ended, from the guest's side.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamEnd {
    /// 0: the guest end closed normally (a TCP peer closed, `tar` succeeded).
    pub code: i32,
    /// Why it failed, when it did (the guest's text is cut and made printable).
    pub error: Option<String>,
}

impl StreamEnd {
    pub fn ok(&self) -> bool {
        self.code == 0 && self.error.is_none()
    }
}

/// One frame read from a stream connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamFrame {
    Data(Vec<u8>),
    Eof,
    End(StreamEnd),
}

/// Reads stream frames from `R`. [`FrameReader::next`] is cancel-safe: a frame read in part
/// when its future is dropped (a `select!` took another branch) stays here and the next call
/// goes on with it, so a reader raced against timers never loses its place in the stream.
pub struct FrameReader<R> {
    r: R,
    head: [u8; 5],
    /// Header bytes read so far (5: the header is complete and `body` is being filled).
    head_have: usize,
    body: Vec<u8>,
    body_have: usize,
    /// A bad frame or a torn connection ended the stream: every later call fails too.
    failed: bool,
}

impl<R: AsyncRead + Unpin> FrameReader<R> {
    pub fn new(r: R) -> Self {
        FrameReader {
            r,
            head: [0; 5],
            head_have: 0,
            body: Vec::new(),
            body_have: 0,
            failed: false,
        }
    }

    /// The next frame; `Ok(None)` when the peer closed the connection between frames. Each
    /// await reads into this reader's own buffers, so dropping the future loses nothing.
    pub async fn next(&mut self) -> Result<Option<StreamFrame>, FrameError> {
        if self.failed {
            return Err(FrameError::BadStreamFrame);
        }
        // An I/O error or a bad frame leaves the reader failed; a cut (the future dropped
        // while it waits) leaves it where it was.
        let frame = self.read_frame().await;
        self.failed = frame.is_err();
        frame
    }

    async fn read_frame(&mut self) -> Result<Option<StreamFrame>, FrameError> {
        while self.head_have < self.head.len() {
            let n = self.r.read(&mut self.head[self.head_have..]).await?;
            if n == 0 {
                if self.head_have == 0 {
                    return Ok(None);
                }
                return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof).into());
            }
            self.head_have += n;
            if self.head_have == self.head.len() {
                let len = self.body_len()?;
                self.body = vec![0u8; len];
                self.body_have = 0;
            }
        }
        while self.body_have < self.body.len() {
            let n = self.r.read(&mut self.body[self.body_have..]).await?;
            if n == 0 {
                return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof).into());
            }
            self.body_have += n;
        }
        self.head_have = 0;
        let body = std::mem::take(&mut self.body);
        Ok(Some(match self.head[0] {
            KIND_DATA => StreamFrame::Data(body),
            KIND_EOF => StreamFrame::Eof,
            KIND_END => StreamFrame::End(postcard::from_bytes(&body)?),
            _ => return Err(FrameError::BadStreamFrame),
        }))
    }

    /// The body length the complete header announces, refused before anything is allocated
    /// when the kind is unknown or the length out of its bounds.
    fn body_len(&self) -> Result<usize, FrameError> {
        let h = self.head;
        let len = u32::from_be_bytes([h[1], h[2], h[3], h[4]]) as usize;
        match h[0] {
            KIND_DATA if (1..=MAX_STREAM_DATA).contains(&len) => Ok(len),
            KIND_EOF if len == 0 => Ok(0),
            KIND_END if len <= MAX_END => Ok(len),
            _ => Err(FrameError::BadStreamFrame),
        }
    }

    /// The reader underneath (to wait for the peer to close, say).
    pub fn get_mut(&mut self) -> &mut R {
        &mut self.r
    }
}

/// Writes a data frame (`data` not empty, at most [`MAX_STREAM_DATA`]).
pub async fn write_data<W: AsyncWrite + Unpin>(w: &mut W, data: &[u8]) -> Result<(), FrameError> {
    if data.is_empty() || data.len() > MAX_STREAM_DATA {
        return Err(FrameError::TooLarge(data.len()));
    }
    let mut head = [KIND_DATA, 0, 0, 0, 0];
    head[1..].copy_from_slice(&(data.len() as u32).to_be_bytes());
    w.write_all(&head).await?;
    w.write_all(data).await?;
    Ok(())
}

pub async fn write_eof<W: AsyncWrite + Unpin>(w: &mut W) -> Result<(), FrameError> {
    w.write_all(&[KIND_EOF, 0, 0, 0, 0]).await?;
    w.flush().await?;
    Ok(())
}

pub async fn write_end<W: AsyncWrite + Unpin>(
    w: &mut W,
    end: &StreamEnd,
) -> Result<(), FrameError> {
    let mut end = end.clone();
    if let Some(e) = &mut end.error {
        let mut cut = e.len().min(MAX_END / 2);
        while !e.is_char_boundary(cut) {
            cut -= 1;
        }
        e.truncate(cut);
    }
    let body = postcard::to_stdvec(&end)?;
    let mut head = [KIND_END, 0, 0, 0, 0];
    head[1..].copy_from_slice(&(body.len() as u32).to_be_bytes());
    w.write_all(&head).await?;
    w.write_all(&body).await?;
    w.flush().await?;
    Ok(())
}

/// The client's end of an open guest stream (see the module docs).
pub struct GuestStream {
    pub reader: StreamReader,
    pub writer: StreamWriter,
}

impl GuestStream {
    /// A stream over a connection already past `StreamOpened` whose peer speaks the stream
    /// frames (a stand-in for the supervisor in the service's tests).
    pub fn from_connected(s: tokio::net::UnixStream) -> GuestStream {
        let (rd, wr) = s.into_split();
        GuestStream {
            reader: StreamReader(FrameReader::new(rd)),
            writer: StreamWriter(wr),
        }
    }
}

/// Receives what the guest sends.
pub struct StreamReader(pub(crate) FrameReader<OwnedReadHalf>);

/// Sends to the guest.
pub struct StreamWriter(pub(crate) OwnedWriteHalf);

impl StreamReader {
    /// The next data chunk, or how the stream ended. A connection that closes without an
    /// `end` frame (the supervisor died) ends with an error. Cancel-safe (see
    /// [`FrameReader`]).
    pub async fn next(&mut self) -> Result<Result<Vec<u8>, StreamEnd>, FrameError> {
        match self.0.next().await? {
            Some(StreamFrame::Data(d)) => Ok(Ok(d)),
            Some(StreamFrame::End(end)) => Ok(Err(end)),
            Some(StreamFrame::Eof) => Err(FrameError::BadStreamFrame),
            None => Ok(Err(StreamEnd {
                code: -1,
                error: Some("the VM's supervisor closed the stream".into()),
            })),
        }
    }
}

impl StreamWriter {
    /// Sends bytes (any length; split into frames).
    pub async fn send(&mut self, data: &[u8]) -> Result<(), FrameError> {
        for chunk in data.chunks(MAX_STREAM_DATA) {
            write_data(&mut self.0, chunk).await?;
        }
        Ok(())
    }

    /// Ends the guest's input; the guest may go on sending.
    pub async fn eof(&mut self) -> Result<(), FrameError> {
        write_eof(&mut self.0).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn test_frames_roundtrip_and_bad_frames_refused() {
        let mut buf = Vec::new();
        write_data(&mut buf, b"abc").await.expect("data");
        write_eof(&mut buf).await.expect("eof");
        let end = StreamEnd {
            code: 2,
            error: Some("x".repeat(10_000)),
        };
        write_end(&mut buf, &end).await.expect("end");
        let mut r = FrameReader::new(&buf[..]);
        assert_eq!(
            r.next().await.expect("read"),
            Some(StreamFrame::Data(b"abc".to_vec()))
        );
        assert_eq!(r.next().await.expect("read"), Some(StreamFrame::Eof));
        match r.next().await.expect("read") {
            Some(StreamFrame::End(e)) => {
                assert_eq!(e.code, 2);
                assert!(e.error.expect("error").len() <= MAX_END / 2);
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(r.next().await.expect("read"), None);
        for bad in [
            vec![KIND_DATA, 0, 0, 0, 0],
            vec![KIND_DATA, 0, 0x20, 0, 0],
            vec![KIND_EOF, 0, 0, 0, 1],
            vec![9, 0, 0, 0, 0],
        ] {
            // Followed by a good frame: a failed reader stays failed, never reads on.
            let mut bytes = bad.clone();
            write_eof(&mut bytes).await.expect("eof");
            let mut r = FrameReader::new(&bytes[..]);
            assert!(r.next().await.is_err(), "{bad:?}");
            assert!(r.next().await.is_err(), "{bad:?} then");
        }
        // A connection that ends inside a frame is an error, not a clean close.
        let mut r = FrameReader::new(&buf[..7]);
        assert!(r.next().await.is_err());
        assert!(write_data(&mut Vec::new(), b"").await.is_err());
    }

    #[tokio::test]
    async fn test_reader_raced_against_a_timer_keeps_its_place_in_the_stream() {
        // The bytes arrive a few at a time and every read is abandoned by a timer that
        // fires first, again and again: no frame may be lost or misread.
        let (mut tx, rx) = tokio::io::duplex(64);
        let sent: Vec<Vec<u8>> = (1..=40u32)
            .map(|i| (0..i * 37).map(|j| (i * 7 + j) as u8).collect())
            .collect();
        let mut wire = Vec::new();
        for d in &sent {
            write_data(&mut wire, d).await.expect("data");
        }
        write_eof(&mut wire).await.expect("eof");
        let feeder = tokio::spawn(async move {
            for piece in wire.chunks(3) {
                tx.write_all(piece).await.expect("feed");
                tokio::task::yield_now().await;
            }
        });
        let mut r = FrameReader::new(rx);
        let (mut got, mut abandoned) = (Vec::new(), 0);
        loop {
            tokio::select! {
                biased;
                () = tokio::task::yield_now() => abandoned += 1,
                f = r.next() => match f.expect("frame") {
                    Some(StreamFrame::Data(d)) => got.push(d),
                    Some(StreamFrame::Eof) => break,
                    other => panic!("{other:?}"),
                },
            }
        }
        feeder.await.expect("feeder");
        assert_eq!(got, sent);
        assert!(
            abandoned > 0,
            "no read was abandoned, so nothing was tested"
        );
    }
}
