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

/// Reads the next frame; `Ok(None)` when the peer closed the connection between frames.
pub async fn read_stream_frame<R: AsyncRead + Unpin>(
    r: &mut R,
) -> Result<Option<StreamFrame>, FrameError> {
    let mut head = [0u8; 5];
    match r.read_exact(&mut head[..1]).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e.into()),
    }
    r.read_exact(&mut head[1..]).await?;
    let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize;
    match head[0] {
        KIND_DATA if (1..=MAX_STREAM_DATA).contains(&len) => {
            let mut data = vec![0u8; len];
            r.read_exact(&mut data).await?;
            Ok(Some(StreamFrame::Data(data)))
        }
        KIND_EOF if len == 0 => Ok(Some(StreamFrame::Eof)),
        KIND_END if len <= MAX_END => {
            let mut body = vec![0u8; len];
            r.read_exact(&mut body).await?;
            Ok(Some(StreamFrame::End(postcard::from_bytes(&body)?)))
        }
        _ => Err(FrameError::BadStreamFrame),
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
            reader: StreamReader(rd),
            writer: StreamWriter(wr),
        }
    }
}

/// Receives what the guest sends.
pub struct StreamReader(pub(crate) OwnedReadHalf);

/// Sends to the guest.
pub struct StreamWriter(pub(crate) OwnedWriteHalf);

impl StreamReader {
    /// The next data chunk, or how the stream ended. A connection that closes without an
    /// `end` frame (the supervisor died) ends with an error.
    pub async fn next(&mut self) -> Result<Result<Vec<u8>, StreamEnd>, FrameError> {
        match read_stream_frame(&mut self.0).await? {
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
        let mut r = &buf[..];
        assert_eq!(
            read_stream_frame(&mut r).await.expect("read"),
            Some(StreamFrame::Data(b"abc".to_vec()))
        );
        assert_eq!(
            read_stream_frame(&mut r).await.expect("read"),
            Some(StreamFrame::Eof)
        );
        match read_stream_frame(&mut r).await.expect("read") {
            Some(StreamFrame::End(e)) => {
                assert_eq!(e.code, 2);
                assert!(e.error.expect("error").len() <= MAX_END / 2);
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(read_stream_frame(&mut r).await.expect("read"), None);
        for bad in [
            vec![KIND_DATA, 0, 0, 0, 0],
            vec![KIND_DATA, 0, 0x20, 0, 0],
            vec![KIND_EOF, 0, 0, 0, 1],
            vec![9, 0, 0, 0, 0],
        ] {
            let mut r = &bad[..];
            assert!(read_stream_frame(&mut r).await.is_err(), "{bad:?}");
        }
        assert!(write_data(&mut Vec::new(), b"").await.is_err());
    }
}
