//! The client side of the WebSocket upgrade to the service, written here so that a refusal
//! is read whole: tungstenite's client handshake hands back a non-101 response with only the
//! body bytes that arrived together with its head, so a refusal whose body came in a later
//! segment lost its code and message. This layer writes the upgrade request, reads the
//! response head with `httparse` (bounded), checks the accept key with tungstenite's own
//! derivation, and gives the stream — with any bytes read past the head — to
//! `tokio-tungstenite`, which does all the framing. A refusal's body is read to its
//! `Content-Length` (bounded) and returned as the service's error.

use anyhow::{anyhow, bail, Context, Result};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio_tungstenite::tungstenite::handshake::client::generate_key;
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;
use tokio_tungstenite::tungstenite::protocol::{Role, WebSocketConfig};
use tokio_tungstenite::WebSocketStream;

/// Largest response head accepted.
const MAX_HEAD: usize = 16 << 10;
/// Largest refusal body read.
const MAX_REFUSAL_BODY: usize = 64 << 10;
/// Most header lines in the response head.
const MAX_HEADERS: usize = 64;

/// How the upgrade ended.
pub enum Upgrade<S> {
    /// The service switched protocols.
    Open(Box<WebSocketStream<S>>),
    /// The service refused with `status` and its whole body.
    Refused { status: u16, body: Vec<u8> },
}

/// Asks the service at `host` to upgrade `path` to a WebSocket on `io`, with `headers`
/// (name, value) added to the request.
pub async fn upgrade<S: AsyncRead + AsyncWrite + Unpin>(
    mut io: S,
    host: &str,
    path: &str,
    headers: &[(&str, &str)],
    config: WebSocketConfig,
) -> Result<Upgrade<S>> {
    if !path.starts_with('/') || !printable(path) || !printable(host) {
        bail!("bad request target {path:?}");
    }
    let key = generate_key();
    let mut req = format!(
        "GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\
         Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: {key}\r\n"
    );
    for (name, value) in headers {
        if !printable(name) || !printable(value) || name.contains(':') {
            bail!("header {name} must be printable ASCII");
        }
        req.push_str(&format!("{name}: {value}\r\n"));
    }
    req.push_str("\r\n");
    io.write_all(req.as_bytes()).await?;
    io.flush().await?;

    let mut buf = Vec::with_capacity(1024);
    let (status, head_len, accept, body_len) = loop {
        let mut chunk = [0u8; 4096];
        let n = io
            .read(&mut chunk)
            .await
            .context("reading the service's answer")?;
        if n == 0 {
            bail!("the service closed the connection before answering the upgrade");
        }
        buf.extend_from_slice(&chunk[..n]);
        let mut hdrs = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut resp = httparse::Response::new(&mut hdrs);
        match resp.parse(&buf) {
            Ok(httparse::Status::Complete(len)) => {
                let status = resp.code.unwrap_or(0);
                let find = |want: &str| {
                    resp.headers
                        .iter()
                        .find(|h| h.name.eq_ignore_ascii_case(want))
                        .map(|h| h.value.to_vec())
                };
                let body_len = find("content-length")
                    .and_then(|v| std::str::from_utf8(&v).ok()?.trim().parse::<usize>().ok());
                break (status, len, find("sec-websocket-accept"), body_len);
            }
            Ok(httparse::Status::Partial) if buf.len() < MAX_HEAD => continue,
            Ok(httparse::Status::Partial) => bail!("the service's answer head is too long"),
            Err(e) => bail!("the service's answer is not HTTP: {e}"),
        }
    };
    let rest = buf.split_off(head_len);
    if status == 101 {
        if accept.as_deref() != Some(derive_accept_key(key.as_bytes()).as_bytes()) {
            bail!("the service answered the upgrade with a wrong accept key");
        }
        let ws = WebSocketStream::from_partially_read(io, rest, Role::Client, Some(config)).await;
        return Ok(Upgrade::Open(Box::new(ws)));
    }
    Ok(Upgrade::Refused {
        status,
        body: read_body(io, rest, body_len).await?,
    })
}

/// The refusal's body: `have` and then the rest up to `len` (at most [`MAX_REFUSAL_BODY`]),
/// or, without a length, what came with the head (a connection kept open would never end
/// a read to its close).
async fn read_body<S: AsyncRead + Unpin>(
    io: S,
    mut have: Vec<u8>,
    len: Option<usize>,
) -> Result<Vec<u8>> {
    let Some(len) = len else {
        have.truncate(MAX_REFUSAL_BODY);
        return Ok(have);
    };
    let want = len.min(MAX_REFUSAL_BODY);
    if have.len() >= want {
        have.truncate(want);
        return Ok(have);
    }
    let missing = u64::try_from(want - have.len()).map_err(|_| anyhow!("body too long"))?;
    io.take(missing)
        .read_to_end(&mut have)
        .await
        .context("reading the service's refusal")?;
    Ok(have)
}

/// Printable ASCII (what a request line or header may hold here).
pub(crate) fn printable(s: &str) -> bool {
    s.bytes().all(|b| (0x20..0x7f).contains(&b))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::duplex;

    async fn serve_answer(parts: Vec<Vec<u8>>) -> Result<Upgrade<tokio::io::DuplexStream>> {
        let (client, mut server) = duplex(1 << 16);
        let task = tokio::spawn(async move {
            let mut req = vec![0u8; 4096];
            let _ = server.read(&mut req).await;
            for p in parts {
                server.write_all(&p).await.ok();
                server.flush().await.ok();
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
            server
        });
        let out = upgrade(
            client,
            "localhost",
            "/v1/x",
            &[],
            WebSocketConfig::default(),
        )
        .await;
        drop(task.await);
        out
    }

    #[tokio::test]
    async fn test_a_refusal_body_sent_after_its_head_is_read_whole() {
        let body = br#"{"error":{"code":"not_found","message":"no such vm"}}"#.to_vec();
        let head = format!(
            "HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
            body.len()
        );
        let (a, b) = body.split_at(10);
        let out = serve_answer(vec![head.into_bytes(), a.to_vec(), b.to_vec()])
            .await
            .unwrap();
        match out {
            Upgrade::Refused { status, body: got } => {
                assert_eq!(status, 404);
                assert_eq!(got, body);
            }
            Upgrade::Open(_) => panic!("a refusal opened"),
        }
    }

    #[tokio::test]
    async fn test_an_upgrade_opens_and_keeps_a_message_sent_with_the_head() {
        use futures_util::StreamExt;
        let (client, server) = duplex(1 << 16);
        let task = tokio::spawn(async move {
            use futures_util::SinkExt;
            let mut ws = tokio_tungstenite::accept_async(server).await.unwrap();
            ws.send(tokio_tungstenite::tungstenite::Message::text("hello"))
                .await
                .unwrap();
            ws
        });
        let out = upgrade(
            client,
            "localhost",
            "/v1/x",
            &[("x-test", "1")],
            WebSocketConfig::default(),
        )
        .await
        .unwrap();
        let Upgrade::Open(mut ws) = out else {
            panic!("the upgrade was refused")
        };
        let msg = ws.next().await.unwrap().unwrap();
        assert_eq!(msg.into_text().unwrap().as_str(), "hello");
        drop(task.await);
    }

    #[tokio::test]
    async fn test_a_wrong_accept_key_is_refused() {
        let head = "HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: upgrade\r\nsec-websocket-accept: bm90IHRoZSBrZXk=\r\n\r\n";
        let err = serve_answer(vec![head.as_bytes().to_vec()])
            .await
            .err()
            .unwrap();
        assert!(err.to_string().contains("accept key"), "{err}");
    }

    #[tokio::test]
    async fn test_an_endless_head_is_refused() {
        let mut head = b"HTTP/1.1 400 Bad\r\n".to_vec();
        head.extend(std::iter::repeat_n(b"x-pad: 1\r\n".to_vec(), 3000).flatten());
        let err = serve_answer(vec![head]).await.err().unwrap();
        assert!(
            err.to_string().contains("too long") || err.to_string().contains("not HTTP"),
            "{err}"
        );
    }
}
