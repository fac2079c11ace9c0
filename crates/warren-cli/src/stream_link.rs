//! Where a guest stream comes from for `attach`, `port-forward` and `vm cp`: the service
//! over HTTP (`--endpoint` with `--token-file`), the service's local socket (`--socket`, or
//! the state directory's when a service answers there), or, without a service, the engine
//! in this process. All three give the same two halves: [`Tx`] towards the guest, [`Rx`]
//! from it.

use std::path::PathBuf;

use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use futures_util::stream::{SplitSink, SplitStream};
use futures_util::{SinkExt, StreamExt};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::WebSocketStream;
use warren_protocol::stream::StreamTarget;
use warren_supervisor::stream_frame::{StreamReader, StreamWriter};

use crate::cli::Cli;
use crate::client::Conn;
use crate::ws_connect;

/// How to reach the service (flattened into the stream commands).
#[derive(Args, Debug, Clone, Default)]
pub struct ServiceArgs {
    /// The service's HTTP address (`http://127.0.0.1:8090`); needs --token-file.
    #[arg(long, requires = "token_file")]
    pub endpoint: Option<String>,
    /// File holding the workspace's bearer token (never on the command line).
    #[arg(long, requires = "endpoint")]
    pub token_file: Option<PathBuf>,
}

/// `HOST:PORT` as the loopback socket address it names (`localhost`, 127.0.0.0/8, `[::1]`):
/// the only places a bearer token is sent over plain HTTP. What is connected to is this
/// address, not the text again (`localhost` is 127.0.0.1, never a name lookup).
fn loopback_endpoint(addr: &str) -> Option<std::net::SocketAddr> {
    use std::net::{IpAddr, Ipv4Addr, SocketAddr};
    let (host, port) = addr.rsplit_once(':')?;
    let port: u16 = port.parse().ok()?;
    let ip = if host.eq_ignore_ascii_case("localhost") {
        IpAddr::V4(Ipv4Addr::LOCALHOST)
    } else {
        let host = host.strip_prefix('[').and_then(|h| h.strip_suffix(']'));
        match host {
            Some(v6) => IpAddr::V6(v6.parse().ok()?),
            None => IpAddr::V4(addr.rsplit_once(':')?.0.parse().ok()?),
        }
    };
    let loopback = match ip {
        IpAddr::V6(v6) => {
            v6.is_loopback() || v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback())
        }
        IpAddr::V4(v4) => v4.is_loopback(),
    };
    loopback.then_some(SocketAddr::new(ip, port))
}

/// Any byte stream a WebSocket can run on.
pub trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

/// A WebSocket to the service.
pub type Ws = WebSocketStream<Box<dyn Io>>;

/// Largest message sent to the service (its limit is 1 MiB).
pub const MAX_SEND: usize = 1 << 20;

/// Towards the guest.
pub enum Tx {
    Ws(SplitSink<Ws, Message>),
    Local(StreamWriter),
}

/// From the guest.
pub enum Rx {
    Ws(SplitStream<Ws>),
    Local(StreamReader),
}

/// What arrived from the guest.
pub enum Chunk {
    Data(Vec<u8>),
    /// The stream ended: normally (the guest closed its end) or not, with the reason.
    End {
        ok: bool,
        reason: String,
    },
}

impl Tx {
    pub async fn send(&mut self, data: &[u8]) -> Result<()> {
        match self {
            Tx::Ws(s) => {
                for c in data.chunks(MAX_SEND) {
                    s.send(Message::Binary(c.to_vec().into())).await?;
                }
            }
            Tx::Local(w) => w.send(data).await?,
        }
        Ok(())
    }

    /// End of the guest's input (the guest may go on sending).
    pub async fn eof(&mut self) -> Result<()> {
        match self {
            Tx::Ws(s) => s.send(Message::Binary(Vec::new().into())).await?,
            Tx::Local(w) => w.eof().await?,
        }
        Ok(())
    }
}

impl Rx {
    pub async fn next(&mut self) -> Result<Chunk> {
        match self {
            Rx::Local(r) => Ok(match r.next().await? {
                Ok(d) => Chunk::Data(d),
                Err(end) => Chunk::End {
                    ok: end.ok(),
                    reason: end.error.unwrap_or_else(|| "guest closed".into()),
                },
            }),
            Rx::Ws(s) => loop {
                match s.next().await {
                    Some(Ok(Message::Binary(b))) => return Ok(Chunk::Data(b.to_vec())),
                    Some(Ok(Message::Close(frame))) => {
                        let (code, reason) = frame
                            .map(|f| (u16::from(f.code), f.reason.to_string()))
                            .unwrap_or((1005, String::new()));
                        return Ok(Chunk::End {
                            ok: code == 1000 && reason != "client closed",
                            reason: format!("{code} {reason}"),
                        });
                    }
                    Some(Ok(_)) => {}
                    Some(Err(e)) => {
                        return Ok(Chunk::End {
                            ok: false,
                            reason: format!("connection: {e}"),
                        })
                    }
                    None => {
                        return Ok(Chunk::End {
                            ok: false,
                            reason: "the service closed the connection".into(),
                        })
                    }
                }
            },
        }
    }
}

/// Where streams are opened.
pub enum Opener {
    Http { addr: String, token: String },
    Socket(PathBuf),
    Local(Box<warren_core::Warren>),
}

impl Opener {
    pub async fn new(cli: &Cli, s: &ServiceArgs) -> Result<Opener> {
        if let (Some(endpoint), Some(file)) = (&s.endpoint, &s.token_file) {
            let addr = endpoint
                .strip_prefix("http://")
                .ok_or_else(|| anyhow!("--endpoint takes http://HOST:PORT"))?
                .trim_end_matches('/')
                .to_string();
            let Some(checked) = loopback_endpoint(&addr) else {
                bail!(
                    "--endpoint http://{addr}: a token sent over plain HTTP to another host \
                     can be read on the way; reach a remote service through an encrypted \
                     tunnel that ends on this host (`ssh -L 8090:127.0.0.1:8090 HOST`, then \
                     --endpoint http://127.0.0.1:8090)"
                );
            };
            let addr = checked.to_string();
            let token = std::fs::read_to_string(file)
                .with_context(|| format!("reading {}", file.display()))?
                .trim()
                .to_string();
            if token.is_empty() {
                bail!("{} holds no token", file.display());
            }
            return Ok(Opener::Http { addr, token });
        }
        if let Some(path) = &cli.socket {
            return Ok(Opener::Socket(path.clone()));
        }
        let state = cli
            .state_dir
            .clone()
            .unwrap_or_else(crate::commands::default_state_dir);
        if let Some(sock) = crate::commands::state_socket(&state)? {
            if tokio::net::UnixStream::connect(&sock).await.is_ok() {
                return Ok(Opener::Socket(sock));
            }
        }
        Ok(Opener::Local(Box::new(crate::commands::open(cli, None)?)))
    }

    /// Opens `target` in `vm`.
    pub async fn open(&self, vm: &str, target: &StreamTarget) -> Result<(Tx, Rx)> {
        let path = match target {
            StreamTarget::Tcp { port } => format!("/v1/vms/{vm}/streams/{port}"),
            StreamTarget::TarExtract { dir } => format!("/v1/vms/{vm}/copy/in?path={}", query(dir)),
            StreamTarget::TarCreate { path } => {
                format!("/v1/vms/{vm}/copy/out?path={}", query(path))
            }
            StreamTarget::BrokerAccept { .. } => bail!("broker pipes are not opened here"),
        };
        if let Opener::Local(w) = self {
            let s = w.open_stream(vm, target.clone()).await?;
            return Ok((Tx::Local(s.writer), Rx::Local(s.reader)));
        }
        let (tx, rx) = self.websocket(&path, None).await?.split();
        Ok((Tx::Ws(tx), Rx::Ws(rx)))
    }

    /// Opens the service's WebSocket at `path` (not for [`Opener::Local`]); `workspace` is
    /// the workspace root acts as on the local socket.
    pub async fn websocket(&self, path: &str, workspace: Option<&str>) -> Result<Ws> {
        let (io, host, auth): (Box<dyn Io>, String, Option<String>) = match self {
            Opener::Local(_) => bail!("no service to open {path} on"),
            Opener::Http { addr, token } => {
                let s = tokio::net::TcpStream::connect(addr)
                    .await
                    .with_context(|| format!("connecting to {addr}"))?;
                s.set_nodelay(true)?;
                (Box::new(s), addr.clone(), Some(format!("Bearer {token}")))
            }
            Opener::Socket(p) => {
                let s = tokio::net::UnixStream::connect(p)
                    .await
                    .with_context(|| format!("connecting to {}", p.display()))?;
                (Box::new(s), "localhost".into(), None)
            }
        };
        let mut headers: Vec<(&str, &str)> = Vec::new();
        if let Some(a) = &auth {
            headers.push(("Authorization", a));
        }
        if let Some(w) = workspace {
            headers.push((warren_api::http::WORKSPACE_HEADER, w));
        }
        let mut config = WebSocketConfig::default();
        config.max_message_size = Some(16 << 20);
        config.max_frame_size = Some(16 << 20);
        match ws_connect::upgrade(io, &host, path, &headers, config).await? {
            ws_connect::Upgrade::Open(ws) => Ok(*ws),
            ws_connect::Upgrade::Refused { status, body } => Err(refusal(status, &body)),
        }
    }

    /// A connection for the service's tools (not for [`Opener::Local`]); `workspace` as for
    /// [`Opener::websocket`].
    pub async fn tools(&self, workspace: Option<&str>) -> Result<Tools> {
        let with = |c: Tools| -> Result<Tools> {
            Ok(match (c, workspace) {
                (Tools::Tcp(c), Some(w)) => {
                    Tools::Tcp(c.with_header(warren_api::http::WORKSPACE_HEADER, w)?)
                }
                (Tools::Unix(c), Some(w)) => {
                    Tools::Unix(c.with_header(warren_api::http::WORKSPACE_HEADER, w)?)
                }
                (c, None) => c,
            })
        };
        match self {
            Opener::Local(_) => bail!("no service to call"),
            Opener::Http { addr, token } => with(Tools::Tcp(Conn::tcp(addr, token).await?)),
            Opener::Socket(p) => with(Tools::Unix(Conn::unix(p).await?)),
        }
    }
}

/// A keep-alive connection for the service's tools.
pub enum Tools {
    Tcp(Conn<tokio::net::TcpStream>),
    Unix(Conn<tokio::net::UnixStream>),
}

impl Tools {
    /// `GET path` (see [`Conn::get`]).
    pub async fn get(&mut self, path: &str) -> Result<serde_json::Value> {
        match self {
            Tools::Tcp(c) => c.get(path).await,
            Tools::Unix(c) => c.get(path).await,
        }
    }

    /// Calls `tool` (see [`Conn::post`]).
    pub async fn post(
        &mut self,
        tool: &str,
        body: &serde_json::Value,
    ) -> Result<serde_json::Value> {
        match self {
            Tools::Tcp(c) => c.post(tool, body).await,
            Tools::Unix(c) => c.post(tool, body).await,
        }
    }
}

/// The service's refusal as the CLI's error (its code and message).
fn refusal(status: u16, body: &[u8]) -> anyhow::Error {
    let parsed = serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| {
            let code = v.pointer("/error/code")?.as_str()?.to_string();
            let message = v.pointer("/error/message")?.as_str()?.to_string();
            Some((code, message))
        });
    match parsed {
        Some((code, message)) => {
            let known = warren_api::error::CODES
                .iter()
                .find(|c| **c == code)
                .copied()
                .unwrap_or("internal");
            warren_api::ApiError::new(known, message).into()
        }
        None => anyhow!("the service refused the stream (HTTP {status})"),
    }
}

/// Percent-encodes a query value.
fn query(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"/-_.~".contains(&b) {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_only_loopback_endpoints_take_a_token_over_plain_http() {
        for ok in [
            "127.0.0.1:8090",
            "127.0.0.2:1",
            "localhost:8090",
            "LOCALHOST:1",
            "[::1]:8090",
            "[::ffff:127.0.0.1]:8090",
        ] {
            assert!(loopback_endpoint(ok).is_some(), "{ok}");
        }
        assert_eq!(
            loopback_endpoint("localhost:8090"),
            Some("127.0.0.1:8090".parse().expect("addr"))
        );
        for bad in [
            "10.0.0.1:8090",
            "warren.internal:8090",
            "[2001:db8::1]:8090",
            "localhost.evil.example:8090",
            "127.0.0.1.nip.example:80",
            "0.0.0.0:8090",
            "[::1]@evil.example:80",
            "localhost:8090@evil",
            "127.0.0.1",
        ] {
            assert!(loopback_endpoint(bad).is_none(), "{bad}");
        }
    }

    #[test]
    fn test_query_escapes_everything_but_safe_bytes() {
        assert_eq!(query("/a b/é&x"), "/a%20b/%C3%A9%26x");
    }
}
