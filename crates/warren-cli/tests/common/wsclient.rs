//! A WebSocket client for tests of the service's streams: blocking calls over a private
//! current-thread runtime, each with a deadline, so a test reads like a script.

use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::WebSocketStream;

/// What arrived next.
#[derive(Debug, PartialEq, Eq)]
pub enum Got {
    Binary(Vec<u8>),
    Text(String),
    /// The close frame's code and reason.
    Close(u16, String),
    /// The connection ended without a close frame.
    Gone,
    /// Nothing within the wait.
    Nothing,
}

pub struct WsClient {
    rt: tokio::runtime::Runtime,
    ws: WebSocketStream<tokio::net::TcpStream>,
}

impl WsClient {
    /// Opens `path` on the service at `addr` with `token`; the refusal's status otherwise.
    pub fn connect(addr: &str, token: &str, path: &str) -> Result<WsClient, u16> {
        Self::connect_with(addr, token, path, &[])
    }

    /// [`WsClient::connect`] with extra request headers.
    pub fn connect_with(
        addr: &str,
        token: &str,
        path: &str,
        headers: &[(&'static str, &str)],
    ) -> Result<WsClient, u16> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let ws = rt.block_on(async {
            let s = tokio::net::TcpStream::connect(addr).await.expect("connect");
            let mut req = format!("ws://{addr}{path}")
                .into_client_request()
                .expect("request");
            req.headers_mut().insert(
                "authorization",
                format!("Bearer {token}").parse().expect("header"),
            );
            for (k, v) in headers {
                req.headers_mut().insert(*k, v.parse().expect("header"));
            }
            match tokio_tungstenite::client_async(req, s).await {
                Ok((ws, _)) => Ok(ws),
                Err(tokio_tungstenite::tungstenite::Error::Http(r)) => Err(r.status().as_u16()),
                Err(e) => panic!("websocket {path}: {e}"),
            }
        })?;
        Ok(WsClient { rt, ws })
    }

    pub fn send_binary(&mut self, data: &[u8]) {
        let msg = Message::Binary(data.to_vec().into());
        self.rt.block_on(self.ws.send(msg)).expect("send");
    }

    pub fn send_text(&mut self, text: &str) {
        let msg = Message::Text(text.to_string().into());
        self.rt.block_on(self.ws.send(msg)).expect("send");
    }

    /// The next data message or the end, waiting at most `wait` (pings are skipped).
    pub fn next(&mut self, wait: Duration) -> Got {
        let ws = &mut self.ws;
        self.rt.block_on(async {
            let deadline = tokio::time::Instant::now() + wait;
            loop {
                let msg = match tokio::time::timeout_at(deadline, ws.next()).await {
                    Err(_) => return Got::Nothing,
                    Ok(None) | Ok(Some(Err(_))) => return Got::Gone,
                    Ok(Some(Ok(m))) => m,
                };
                return match msg {
                    Message::Binary(b) => Got::Binary(b.to_vec()),
                    Message::Text(t) => Got::Text(t.to_string()),
                    Message::Close(f) => f
                        .map(|f| Got::Close(u16::from(f.code), f.reason.to_string()))
                        .unwrap_or(Got::Close(1005, String::new())),
                    _ => continue,
                };
            }
        })
    }

    /// Collects data messages until `done` holds for what arrived (or the wait runs out);
    /// returns everything that arrived, in order.
    pub fn until(&mut self, wait: Duration, mut done: impl FnMut(&[Got]) -> bool) -> Vec<Got> {
        let deadline = std::time::Instant::now() + wait;
        let mut got = Vec::new();
        while !done(&got) {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                break;
            }
            match self.next(left) {
                Got::Nothing => break,
                g @ (Got::Close(..) | Got::Gone) => {
                    got.push(g);
                    break;
                }
                g => got.push(g),
            }
        }
        got
    }

    /// Drops the connection without a close frame (a client whose network went away).
    pub fn abandon(self) {
        drop(self.ws);
    }
}
