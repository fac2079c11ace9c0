//! A minimal HTTP/1.1 client for Warren's own API: JSON POSTs to `/v1/tools/{tool}` over a
//! keep-alive connection, on TCP (bearer token) or on the service's local UNIX socket (the
//! caller's uid is the credential).

use std::path::Path;

use anyhow::{anyhow, Context, Result};
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};

/// Largest response body accepted.
const MAX_RESPONSE: usize = 64 << 20;

/// One keep-alive connection.
pub struct Conn<S> {
    r: BufReader<S>,
    host: String,
    auth: Option<String>,
    /// Extra request header lines (`Name: value\r\n`).
    extra: String,
}

impl Conn<tokio::net::TcpStream> {
    pub async fn tcp(addr: &str, token: &str) -> Result<Self> {
        let s = tokio::net::TcpStream::connect(addr).await?;
        s.set_nodelay(true)?;
        Ok(Conn {
            r: BufReader::new(s),
            host: addr.to_string(),
            auth: Some(format!("Bearer {token}")),
            extra: String::new(),
        })
    }
}

impl Conn<tokio::net::UnixStream> {
    pub async fn unix(path: &Path) -> Result<Self> {
        let s = tokio::net::UnixStream::connect(path)
            .await
            .with_context(|| format!("connecting to {}", path.display()))?;
        Ok(Conn {
            r: BufReader::new(s),
            host: "localhost".into(),
            auth: None,
            extra: String::new(),
        })
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> Conn<S> {
    /// Sends `name: value` with every request (a header value must be printable ASCII).
    pub fn with_header(mut self, name: &str, value: &str) -> Result<Self> {
        if !crate::ws_connect::printable(value) {
            return Err(anyhow!("header {name} must be printable ASCII"));
        }
        self.extra.push_str(&format!("{name}: {value}\r\n"));
        Ok(self)
    }

    /// Calls `tool`. A refusal comes back as the service's [`warren_api::ApiError`] (its
    /// code and message), so the CLI reports it like its own errors.
    pub async fn post(&mut self, tool: &str, body: &Value) -> Result<Value> {
        let body = body.to_string();
        let head = format!(
            "POST /v1/tools/{tool} HTTP/1.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n",
            body.len()
        );
        self.request(head, &body).await
    }

    /// `GET path` (an endpoint answering JSON, as `/v1/host/shares`).
    pub async fn get(&mut self, path: &str) -> Result<Value> {
        self.request(format!("GET {path} HTTP/1.1\r\n"), "").await
    }

    /// Sends `head` (request line and headers of its own) with the connection's headers
    /// and `body`; reads the JSON answer, a refusal as the service's error.
    async fn request(&mut self, head: String, body: &str) -> Result<Value> {
        let auth = self
            .auth
            .as_ref()
            .map(|a| format!("Authorization: {a}\r\n"))
            .unwrap_or_default();
        let req = format!(
            "{head}Host: {}\r\n{auth}{}\r\n{body}",
            self.host, self.extra
        );
        self.r.get_mut().write_all(req.as_bytes()).await?;
        let mut status = String::new();
        self.r.read_line(&mut status).await?;
        let code: u16 = status
            .split(' ')
            .nth(1)
            .and_then(|c| c.parse().ok())
            .ok_or_else(|| anyhow!("bad status line {status:?}"))?;
        let mut len = 0usize;
        loop {
            let mut line = String::new();
            if self.r.read_line(&mut line).await? == 0 {
                return Err(anyhow!("connection closed in the response head"));
            }
            let line = line.trim_end();
            if line.is_empty() {
                break;
            }
            if let Some((k, v)) = line.split_once(':') {
                if k.eq_ignore_ascii_case("content-length") {
                    len = v.trim().parse()?;
                }
            }
        }
        if len > MAX_RESPONSE {
            return Err(anyhow!("response of {len} bytes is too large"));
        }
        let mut buf = vec![0u8; len];
        self.r.read_exact(&mut buf).await?;
        let v: Value = serde_json::from_slice(&buf)?;
        if code != 200 {
            let code_str = v["error"]["code"].as_str().unwrap_or("internal");
            let message = v["error"]["message"].as_str().unwrap_or("").to_string();
            let known = warren_api::error::CODES
                .iter()
                .find(|c| **c == code_str)
                .copied()
                .unwrap_or("internal");
            return Err(warren_api::ApiError::new(known, message).into());
        }
        Ok(v)
    }
}
