//! A stand-in git host for the credential tests: `git http-backend` (git's own smart-HTTP
//! CGI program) behind a small HTTPS server on [`GIT`] (`github.com` in the stand-in zone),
//! which answers only requests whose `Authorization: Basic` credential carries the real token
//! as its password; anything else gets `401` with a Basic challenge, as GitHub does. Pushes
//! are accepted (the CGI gets a `REMOTE_USER`).
//!
//! Each request runs one `git http-backend` with the CGI variables for it; the request body
//! (`Content-Length` or `chunked`, at most [`MAX_BODY`]) goes to its stdin and its output
//! (CGI headers, then the body) becomes the response.

use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;

use base64::Engine as _;
use rustls::pki_types::PrivateKeyDer;
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};

use super::{nb, StandinError, Topology, GIT};
use crate::bind_tcp_in;

/// Largest request body the stand-in accepts.
pub const MAX_BODY: usize = 16 * 1024 * 1024;

/// What the git stand-in saw: one entry per request, `(request line, authorized)`.
pub type GitSeen = Arc<std::sync::Mutex<Vec<(String, bool)>>>;

impl Topology {
    /// Serves the bare repositories under `root` over smart HTTP on `GIT:443`, to requests
    /// authorized with `token`.
    pub fn serve_git(&self, root: PathBuf, token: String) -> Result<GitSeen, StandinError> {
        let key = PrivateKeyDer::try_from(self.pki.server_key.clone())
            .map_err(|e| StandinError::Invalid(format!("server key: {e}")))?;
        let cfg = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(self.pki.server_chain.clone(), key)?;
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(cfg));
        let at = std::net::SocketAddr::from((GIT, 443));
        let l = tokio::net::TcpListener::from_std(nb(bind_tcp_in(&self.remote.path(), at)?)?)?;
        let seen = GitSeen::default();
        let (root, token, seen2) = (Arc::new(root), Arc::new(token), seen.clone());
        tokio::spawn(async move {
            while let Ok((s, _)) = l.accept().await {
                let (acceptor, root, token, seen) =
                    (acceptor.clone(), root.clone(), token.clone(), seen2.clone());
                tokio::spawn(async move {
                    if let Ok(tls) = acceptor.accept(s).await {
                        serve(tls, &root, &token, &seen).await;
                    }
                });
            }
        });
        Ok(seen)
    }
}

async fn serve<S: AsyncRead + AsyncWrite + Unpin>(
    s: S,
    root: &PathBuf,
    token: &str,
    seen: &GitSeen,
) {
    let mut s = BufReader::new(s);
    loop {
        let mut head = Vec::new();
        loop {
            let start = head.len();
            match s.read_until(b'\n', &mut head).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
            if &head[start..] == b"\r\n" || head.len() > 64 * 1024 {
                break;
            }
        }
        let mut hs = [httparse::EMPTY_HEADER; 64];
        let mut req = httparse::Request::new(&mut hs);
        if !matches!(req.parse(&head), Ok(httparse::Status::Complete(_))) {
            return;
        }
        let headers: Headers = req
            .headers
            .iter()
            .map(|h| {
                (
                    h.name.to_ascii_lowercase(),
                    String::from_utf8_lossy(h.value).into_owned(),
                )
            })
            .collect();
        let method = req.method.unwrap_or("").to_string();
        let target = req.path.unwrap_or("/").to_string();
        let Some(body) = read_body(&mut s, &headers).await else {
            return;
        };
        let authorized = header(&headers, "authorization")
            .and_then(|v| {
                let b64 = v.strip_prefix("Basic ")?;
                let raw = base64::engine::general_purpose::STANDARD.decode(b64).ok()?;
                let text = String::from_utf8(raw).ok()?;
                Some(text.split_once(':')?.1 == token)
            })
            .unwrap_or(false);
        seen.lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((format!("{method} {target}"), authorized));
        let response = if authorized {
            cgi(root, &method, &target, &headers, body).await
        } else {
            b"HTTP/1.1 401 Unauthorized\r\nwww-authenticate: Basic realm=\"stand-in git\"\r\n\
              content-length: 0\r\n\r\n"
                .to_vec()
        };
        if s.get_mut().write_all(&response).await.is_err() || s.get_mut().flush().await.is_err() {
            return;
        }
    }
}

/// A request's headers, names lowercase.
type Headers = Vec<(String, String)>;

fn header(headers: &Headers, name: &str) -> Option<String> {
    headers
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v.clone())
}

/// The request body by its framing (`None`: malformed or too large).
async fn read_body<R: AsyncBufReadExt + Unpin>(s: &mut R, headers: &Headers) -> Option<Vec<u8>> {
    let chunked =
        header(headers, "transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case("chunked"));
    if !chunked {
        let len: usize =
            header(headers, "content-length").map_or(Some(0), |v| v.trim().parse().ok())?;
        if len > MAX_BODY {
            return None;
        }
        let mut body = vec![0u8; len];
        s.read_exact(&mut body).await.ok()?;
        return Some(body);
    }
    let mut body = Vec::new();
    loop {
        let mut line = String::new();
        s.read_line(&mut line).await.ok()?;
        let size = usize::from_str_radix(line.trim().split(';').next()?, 16).ok()?;
        if size == 0 {
            // Trailers (none from the egress), then the final empty line.
            loop {
                line.clear();
                s.read_line(&mut line).await.ok()?;
                if line == "\r\n" || line.is_empty() {
                    return Some(body);
                }
            }
        }
        if body.len() + size > MAX_BODY {
            return None;
        }
        let start = body.len();
        body.resize(start + size, 0);
        s.read_exact(&mut body[start..]).await.ok()?;
        let mut crlf = [0u8; 2];
        s.read_exact(&mut crlf).await.ok()?;
    }
}

/// Runs `git http-backend` for one request and turns its CGI output into a response.
async fn cgi(
    root: &PathBuf,
    method: &str,
    target: &str,
    headers: &Headers,
    body: Vec<u8>,
) -> Vec<u8> {
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    let mut cmd = tokio::process::Command::new("git");
    cmd.arg("http-backend")
        .env_clear()
        .env("PATH", "/usr/local/bin:/usr/bin:/bin")
        .env("GIT_PROJECT_ROOT", root)
        .env("GIT_HTTP_EXPORT_ALL", "1")
        .env("REQUEST_METHOD", method)
        .env("PATH_INFO", path)
        .env("QUERY_STRING", query)
        .env("CONTENT_LENGTH", body.len().to_string())
        .env("REMOTE_USER", "stand-in")
        .env("REMOTE_ADDR", "203.0.113.1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true);
    for (var, name) in [
        ("CONTENT_TYPE", "content-type"),
        ("HTTP_CONTENT_ENCODING", "content-encoding"),
        ("GIT_PROTOCOL", "git-protocol"),
    ] {
        if let Some(v) = header(headers, name) {
            cmd.env(var, v);
        }
    }
    let Ok(mut child) = cmd.spawn() else {
        return b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 0\r\n\r\n".to_vec();
    };
    let mut stdin = child.stdin.take();
    let feed = async move {
        if let Some(i) = stdin.as_mut() {
            let _ = i.write_all(&body).await;
        }
        drop(stdin);
    };
    let (_, out) = tokio::join!(feed, child.wait_with_output());
    let Ok(out) = out else {
        return b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 0\r\n\r\n".to_vec();
    };
    let raw = out.stdout;
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|i| (i, 4))
        .or_else(|| raw.windows(2).position(|w| w == b"\n\n").map(|i| (i, 2)));
    let Some((at, sep)) = split else {
        return b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 0\r\n\r\n".to_vec();
    };
    let cgi_head = String::from_utf8_lossy(&raw[..at]).into_owned();
    let payload = &raw[at + sep..];
    let mut status = "200 OK".to_string();
    let mut resp_headers = String::new();
    for line in cgi_head.lines() {
        let Some((name, value)) = line.split_once(':') else {
            continue;
        };
        if name.eq_ignore_ascii_case("status") {
            status = value.trim().to_string();
        } else {
            resp_headers.push_str(&format!("{}: {}\r\n", name.trim(), value.trim()));
        }
    }
    let mut resp = format!(
        "HTTP/1.1 {status}\r\n{resp_headers}content-length: {}\r\n\r\n",
        payload.len()
    )
    .into_bytes();
    resp.extend_from_slice(payload);
    resp
}
