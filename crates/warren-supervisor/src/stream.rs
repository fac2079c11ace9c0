//! The supervisor's side of a guest stream: one client connection bridged to one HTTP/2
//! stream of the guest channel, on the task that serves the connection.
//!
//! Steps: open the guest stream (its refusal is the reply), answer `StreamOpened`, then run
//! both directions until the guest's side ended:
//! - client -> guest: data frames are sent as the guest's window allows (so a slow guest
//!   target stops the client's reads), `eof` ends the request body; the client closing the
//!   connection abandons the stream (reset, so the guest closes its end);
//! - guest -> client: data goes out as frames, and the window is released only after the
//!   client took it; the end of the body and its trailers become the `end` frame, a reset or
//!   a channel failure an `end` frame with the error.

use bytes::Bytes;
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use warren_protocol::stream::{self, StreamTarget, ERROR_TRAILER, EXIT_TRAILER};

use crate::channel::GuestChannel;
use crate::proto::{write_frame, Reply, SupervisorError, SupervisorResponse};
use crate::stream_frame::{write_data, write_end, FrameReader, StreamEnd, StreamFrame};

/// Opens `target` and bridges it to the client until the stream ends.
pub async fn serve(
    channel: Result<GuestChannel, SupervisorError>,
    target: StreamTarget,
    mut rd: OwnedReadHalf,
    mut wr: OwnedWriteHalf,
) {
    let opened = match channel {
        Ok(ch) => match ch.open_stream(&target).await {
            Ok(Ok(halves)) => Ok(halves),
            Ok(Err(e)) => Err(SupervisorError::Guest(e)),
            Err(e) => Err(SupervisorError::Channel(e.to_string())),
        },
        Err(e) => Err(e),
    };
    let (mut send, mut body) = match opened {
        Ok(halves) => halves,
        Err(e) => {
            let _ = write_frame(&mut wr, &Reply::Err(e)).await;
            return;
        }
    };
    if write_frame(&mut wr, &Reply::Ok(SupervisorResponse::StreamOpened))
        .await
        .is_err()
    {
        send.send_reset(h2::Reason::CANCEL);
        return;
    }
    let inbound = async {
        let mut rd = FrameReader::new(&mut rd);
        loop {
            match rd.next().await {
                Ok(Some(StreamFrame::Data(d))) => {
                    if stream::send_paced(&mut send, Bytes::from(d)).await.is_err() {
                        // The guest's side is gone; its end frame tells the client.
                        std::future::pending::<()>().await;
                    }
                }
                Ok(Some(StreamFrame::Eof)) => {
                    let _ = send.send_data(Bytes::new(), true);
                    // Wait for the client to go away; the guest decides the end.
                    let mut b = [0u8; 1];
                    let _ = tokio::io::AsyncReadExt::read(rd.get_mut(), &mut b).await;
                    return;
                }
                // Gone, or a frame a client must not send: abandon the stream.
                Ok(None) | Ok(Some(StreamFrame::End(_))) | Err(_) => return,
            }
        }
    };
    let outbound = async {
        let end = loop {
            match body.data().await {
                Some(Ok(chunk)) => {
                    let n = chunk.len();
                    if n == 0 {
                        continue;
                    }
                    if write_data(&mut wr, &chunk).await.is_err() {
                        return;
                    }
                    let _ = body.flow_control().release_capacity(n);
                }
                Some(Err(e)) => break reset_end(&e),
                None => break trailers_end(body.trailers().await),
            }
        };
        let _ = write_end(&mut wr, &end).await;
    };
    let client_gone = tokio::select! {
        () = inbound => true,
        () = outbound => false,
    };
    if client_gone {
        // The client went away first: reset, so the guest closes its end.
        send.send_reset(h2::Reason::CANCEL);
    }
}

fn reset_end(e: &h2::Error) -> StreamEnd {
    StreamEnd {
        code: -1,
        error: Some(if e.is_io() || e.is_go_away() {
            crate::stream_frame::CHANNEL_CLOSED.into()
        } else {
            format!("the guest reset the stream: {e}")
        }),
    }
}

fn trailers_end(trailers: Result<Option<http::HeaderMap>, h2::Error>) -> StreamEnd {
    match trailers {
        Ok(Some(t)) => {
            let code = t
                .get(EXIT_TRAILER)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse::<i32>().ok())
                .unwrap_or(-1);
            let error = t
                .get(ERROR_TRAILER)
                .map(|v| stream::trailer_text(&String::from_utf8_lossy(v.as_bytes())));
            let error = match (code, error) {
                (0, e) => e,
                (_, Some(e)) => Some(e),
                (c, None) => Some(format!("the guest end failed ({c})")),
            };
            StreamEnd { code, error }
        }
        Ok(None) => StreamEnd {
            code: -1,
            error: Some("the guest ended the stream without its status".into()),
        },
        Err(e) => reset_end(&e),
    }
}
