//! The HTTP/1.1 relay used on every cleartext HTTP connection and on TLS connections Warren
//! terminated.
//!
//! One request at a time: read the request head from the guest; refuse it (`421`, connection
//! closed) unless the host it names ([`crate::request::request_host`]) is the one the
//! connection was decided for (its first request's host, or its SNI), so no later request
//! and no absolute-form target reaches another name on the same address; check it for
//! placeholders; either answer it with an interception rule or forward the re-serialised
//! (possibly substituted) head and the body, then relay exactly one response (head and body
//! unchanged) back, and loop for the next request on the keep-alive connection. Request
//! bodies are framed by `Content-Length` (digits only) or `chunked` (re-encoded canonically,
//! trailers dropped), so the upstream frames them exactly as Warren did; responses without
//! framing run to EOF and end the connection. An `h2c` upgrade is never offered upstream; a
//! `101 Switching Protocols` answer to a requested upgrade turns the connection into a plain
//! two-way relay. Placeholders are substituted in `Authorization` and the configured headers
//! only, never in request targets, bodies or responses.

use std::collections::HashMap;

use std::net::SocketAddrV4;
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::ServerName;
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

use crate::config::SecretValue;
use crate::decision_log::Kind;
use crate::egress::Inner;
use crate::error::ConnError;
use crate::policy::DenyReason;

/// Largest request or response head accepted.
pub const MAX_HEAD: usize = 64 * 1024;
/// Largest request (head and body) passed to an interception command; larger gets 413.
pub const MAX_INTERCEPT_REQUEST: usize = 64 * 1024;
/// How long an idle keep-alive connection waits for the next request.
const IDLE_TIMEOUT: Duration = Duration::from_secs(300);
/// Longest chunk-size or trailer line.
const MAX_LINE: usize = 8 * 1024;

/// Anything the relay can talk over.
pub(crate) trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

/// A minimal complete response with `Connection: close`.
pub(crate) fn simple_response(code: u16, reason: &str) -> Vec<u8> {
    let body = format!("{code} {reason} (warren egress)\n");
    format!(
        "HTTP/1.1 {code} {reason}\r\ncontent-type: text/plain\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// How to reach the upstream, connected on first use.
pub(crate) enum Upstream {
    /// Plain TCP (cleartext HTTP).
    Plain(SocketAddrV4, Option<TcpStream>),
    /// TLS to `name`, verified against the VM's upstream roots.
    Tls(SocketAddrV4, Option<TcpStream>, String),
}

async fn connect(inner: &Inner, up: &mut Upstream) -> Result<Box<dyn Io>, ConnError> {
    match up {
        Upstream::Plain(addr, pre) => Ok(Box::new(match pre.take() {
            Some(s) => s,
            None => inner.outbound.tcp_connect_remote(*addr).await?,
        })),
        Upstream::Tls(addr, pre, name) => {
            let tcp = match pre.take() {
                Some(s) => s,
                None => inner.outbound.tcp_connect_remote(*addr).await?,
            };
            let tls = &inner.tls;
            let server_name =
                ServerName::try_from(name.clone()).map_err(|_| ConnError::ServerName)?;
            let connector = tokio_rustls::TlsConnector::from(tls.client.clone());
            let tls = tokio::time::timeout(
                crate::conns::HANDSHAKE_TIMEOUT,
                connector.connect(server_name, tcp),
            )
            .await
            .map_err(|_| ConnError::TimedOut("the upstream's TLS handshake"))??;
            Ok(Box::new(tls))
        }
    }
}

/// Body framing of one message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Framing {
    None,
    Length(u64),
    Chunked,
    UntilClose,
}

impl Framing {
    /// The body's length when `Content-Length` gives it.
    pub(crate) fn length(self) -> Option<u64> {
        match self {
            Framing::Length(n) => Some(n),
            _ => None,
        }
    }

    pub(crate) fn is_chunked(self) -> bool {
        self == Framing::Chunked
    }
}

fn header<'a>(headers: &'a [(String, Vec<u8>)], name: &str) -> impl Iterator<Item = &'a [u8]> + 'a {
    let name = name.to_string();
    headers
        .iter()
        .filter(move |(n, _)| n.eq_ignore_ascii_case(&name))
        .map(|(_, v)| v.as_slice())
}

fn has_token(headers: &[(String, Vec<u8>)], name: &str, token: &str) -> bool {
    header(headers, name).any(|v| {
        String::from_utf8_lossy(v)
            .split(',')
            .any(|t| t.trim().eq_ignore_ascii_case(token))
    })
}

/// Framing from `Transfer-Encoding`/`Content-Length`; `Err` for ambiguous or invalid framing
/// (both present, conflicting lengths, a transfer coding other than final `chunked`).
fn framing(headers: &[(String, Vec<u8>)], default: Framing) -> Result<Framing, ConnError> {
    let te: Vec<&[u8]> = header(headers, "transfer-encoding").collect();
    let cl: Vec<&[u8]> = header(headers, "content-length").collect();
    if !te.is_empty() {
        if !cl.is_empty() {
            return Err(ConnError::Framing(
                "both Transfer-Encoding and Content-Length",
            ));
        }
        let joined = te
            .iter()
            .map(|v| String::from_utf8_lossy(v).into_owned())
            .collect::<Vec<_>>()
            .join(",");
        let last = joined
            .rsplit(',')
            .next()
            .unwrap_or("")
            .trim()
            .to_ascii_lowercase();
        return if last == "chunked" {
            Ok(Framing::Chunked)
        } else if default == Framing::UntilClose {
            Ok(Framing::UntilClose)
        } else {
            Err(ConnError::Framing("request transfer coding not chunked"))
        };
    }
    // Exactly one Content-Length of digits only, because the head is forwarded as sent: a
    // repeated header or a list (`5, 5`, which RFC 9110 lets a recipient accept) is read as
    // something else by some upstreams, and the body would become a request there.
    match cl.as_slice() {
        [] => Ok(default),
        [v] => {
            let s = std::str::from_utf8(v).map_err(|_| ConnError::Framing("bad Content-Length"))?;
            let s = s.trim_matches(|c| c == ' ' || c == '\t');
            // Digits only: `+5` or `0x5` would parse here and mean something else upstream.
            if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
                return Err(ConnError::Framing("bad Content-Length"));
            }
            let n: u64 = s
                .parse()
                .map_err(|_| ConnError::Framing("bad Content-Length"))?;
            Ok(Framing::Length(n))
        }
        _ => Err(ConnError::Framing("repeated Content-Length")),
    }
}

/// A request's body framing (no body unless the headers frame one).
pub(crate) fn request_framing(headers: &[(String, Vec<u8>)]) -> Result<Framing, ConnError> {
    framing(headers, Framing::None)
}

/// Reads one head (up to and including the empty line). `Ok(None)` on a clean EOF before any
/// byte. Leading empty lines are skipped (RFC 9112 section 2.2).
async fn read_head<R: AsyncBufReadExt + Unpin>(r: &mut R) -> Result<Option<Vec<u8>>, ConnError> {
    let mut head = Vec::new();
    loop {
        let before = head.len();
        let room = (MAX_HEAD - before) as u64;
        let n = (&mut *r).take(room).read_until(b'\n', &mut head).await?;
        if n == 0 {
            return if head.is_empty() {
                Ok(None)
            } else {
                Err(ConnError::Framing("EOF inside a head"))
            };
        }
        if !head.ends_with(b"\n") {
            return Err(ConnError::Framing("head too large"));
        }
        let line = &head[before..];
        if line == b"\r\n" || line == b"\n" {
            if before == 0 {
                head.clear();
                continue;
            }
            return Ok(Some(head));
        }
    }
}

async fn read_line<R: AsyncBufReadExt + Unpin>(
    r: &mut R,
    out: &mut Vec<u8>,
) -> Result<(), ConnError> {
    let start = out.len();
    let n = (&mut *r)
        .take(MAX_LINE as u64)
        .read_until(b'\n', out)
        .await?;
    if n == 0 || !out[start..].ends_with(b"\n") {
        return Err(ConnError::Framing("bad chunk line"));
    }
    Ok(())
}

/// A body sink: either a writer (relay) or a capped buffer (interception).
enum Sink<'a> {
    Write(&'a mut dyn Io),
    Buffer(&'a mut Vec<u8>, usize),
}

impl Sink<'_> {
    async fn put(&mut self, data: &[u8]) -> Result<(), ConnError> {
        match self {
            Sink::Write(w) => Ok(w.write_all(data).await?),
            Sink::Buffer(buf, cap) => {
                if buf.len() + data.len() > *cap {
                    return Err(ConnError::Framing("too large"));
                }
                buf.extend_from_slice(data);
                Ok(())
            }
        }
    }
}

/// The size of a chunk-size line (`1a;ext=x\r\n`): 1-16 hex digits, optional whitespace and
/// extensions. Anything else (a sign, `0x`, junk) is refused.
pub(crate) fn chunk_size(line: &[u8]) -> Result<u64, ConnError> {
    let bad = ConnError::Framing("bad chunk size");
    let line = line
        .strip_suffix(b"\n")
        .ok_or(ConnError::Framing("bad chunk size"))?;
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let digits = line
        .iter()
        .position(|b| !b.is_ascii_hexdigit())
        .unwrap_or(line.len());
    let rest = &line[digits..];
    let rest_ok = rest
        .iter()
        .position(|b| !matches!(b, b' ' | b'\t'))
        .is_none_or(|i| rest[i] == b';');
    if digits == 0 || digits > 16 || !rest_ok {
        return Err(bad);
    }
    let text =
        std::str::from_utf8(&line[..digits]).map_err(|_| ConnError::Framing("bad chunk size"))?;
    u64::from_str_radix(text, 16).map_err(|_| bad)
}

async fn copy_exact<R: AsyncBufReadExt + Unpin>(
    r: &mut R,
    sink: &mut Sink<'_>,
    mut n: u64,
) -> Result<(), ConnError> {
    while n > 0 {
        let buf = r.fill_buf().await?;
        if buf.is_empty() {
            return Err(ConnError::Framing("EOF inside a body"));
        }
        let take = buf.len().min(usize::try_from(n).unwrap_or(usize::MAX));
        sink.put(&buf[..take]).await?;
        r.consume(take);
        n -= take as u64;
    }
    Ok(())
}

/// Copies a chunked request body re-encoded: canonical size lines without extensions, no
/// trailers (a trailer could carry a second `Host` to a server that merges them).
async fn copy_chunked_canonical<R: AsyncBufReadExt + Unpin>(
    r: &mut R,
    sink: &mut Sink<'_>,
) -> Result<(), ConnError> {
    loop {
        let mut line = Vec::new();
        read_line(r, &mut line).await?;
        let size = chunk_size(&line)?;
        sink.put(format!("{size:x}\r\n").as_bytes()).await?;
        if size == 0 {
            loop {
                let mut trailer = Vec::new();
                read_line(r, &mut trailer).await?;
                if trailer == b"\r\n" || trailer == b"\n" {
                    return sink.put(b"\r\n").await;
                }
            }
        }
        copy_exact(r, sink, size).await?;
        let mut crlf = Vec::new();
        read_line(r, &mut crlf).await?;
        if crlf != b"\r\n" && crlf != b"\n" {
            return Err(ConnError::Framing("missing CRLF after chunk"));
        }
        sink.put(b"\r\n").await?;
    }
}

async fn copy_body<R: AsyncBufReadExt + Unpin>(
    r: &mut R,
    sink: &mut Sink<'_>,
    framing: Framing,
) -> Result<(), ConnError> {
    match framing {
        Framing::None => Ok(()),
        Framing::Length(n) => copy_exact(r, sink, n).await,
        Framing::UntilClose => loop {
            let buf = r.fill_buf().await?;
            if buf.is_empty() {
                return Ok(());
            }
            let n = buf.len();
            sink.put(buf).await?;
            r.consume(n);
        },
        Framing::Chunked => loop {
            let mut line = Vec::new();
            read_line(r, &mut line).await?;
            sink.put(&line).await?;
            let size = chunk_size(&line)?;
            if size == 0 {
                loop {
                    let mut trailer = Vec::new();
                    read_line(r, &mut trailer).await?;
                    sink.put(&trailer).await?;
                    if trailer == b"\r\n" || trailer == b"\n" {
                        return Ok(());
                    }
                }
            }
            copy_exact(r, sink, size).await?;
            let mut crlf = Vec::new();
            read_line(r, &mut crlf).await?;
            if crlf != b"\r\n" && crlf != b"\n" {
                return Err(ConnError::Framing("missing CRLF after chunk"));
            }
            sink.put(&crlf).await?;
        },
    }
}

pub(crate) struct Request {
    pub(crate) method: String,
    pub(crate) path: String,
    pub(crate) minor: u8,
    pub(crate) headers: Vec<(String, Vec<u8>)>,
}

pub(crate) fn parse_request(head: &[u8]) -> Option<Request> {
    let mut headers = [httparse::EMPTY_HEADER; 128];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(head) {
        Ok(httparse::Status::Complete(_)) => {}
        _ => return None,
    }
    Some(Request {
        method: req.method?.to_string(),
        path: req.path?.to_string(),
        minor: req.version?,
        headers: req
            .headers
            .iter()
            .map(|h| (h.name.to_string(), h.value.to_vec()))
            .collect(),
    })
}

/// The decoded user-pass of a `Basic` credential (`Basic <base64>`, scheme in any case), or
/// `None` for any other value or invalid base64.
fn basic_credential(value: &[u8]) -> Option<Vec<u8>> {
    use base64::Engine as _;
    let v = value.trim_ascii();
    let (scheme, rest) = v.split_at(v.iter().position(|b| *b == b' ')?);
    if !scheme.eq_ignore_ascii_case(b"basic") {
        return None;
    }
    base64::engine::general_purpose::STANDARD
        .decode(rest.trim_ascii())
        .ok()
}

/// `Basic <base64 of user_pass>`.
fn encode_basic(user_pass: &[u8]) -> Vec<u8> {
    use base64::Engine as _;
    let mut out = b"Basic ".to_vec();
    out.extend_from_slice(
        base64::engine::general_purpose::STANDARD
            .encode(user_pass)
            .as_bytes(),
    );
    out
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    !needle.is_empty() && hay.windows(needle.len()).any(|w| w == needle)
}

fn replace(hay: &[u8], needle: &[u8], with: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(hay.len());
    let mut i = 0;
    while i < hay.len() {
        if hay[i..].starts_with(needle) {
            out.extend_from_slice(with);
            i += needle.len();
        } else {
            out.push(hay[i]);
            i += 1;
        }
    }
    out
}

/// Per-connection relay state.
pub(crate) struct Session {
    pub(crate) inner: Arc<Inner>,
    /// The normalised name the connection was allowed for (SNI, or the first request's host);
    /// `None` for a cleartext connection decided by address. Every request must name it.
    pub(crate) host: Option<String>,
    /// Whether placeholders are substituted (only on TLS connections Warren terminated).
    pub(crate) substitute: bool,
    pub(crate) upstream: Upstream,
    /// The connection's original destination, for the decision log.
    dst: SocketAddrV4,
    /// Values read for this connection (indexes into the VM's secrets). Files are read at
    /// most once per connection, so a rotated file takes effect on the next connection.
    values: HashMap<usize, SecretValue>,
}

enum Next {
    Continue,
    Close,
}

impl Session {
    pub(crate) fn new(
        inner: Arc<Inner>,
        host: Option<String>,
        substitute: bool,
        upstream: Upstream,
        dst: SocketAddrV4,
    ) -> Self {
        Session {
            inner,
            host,
            substitute,
            upstream,
            dst,
            values: HashMap::new(),
        }
    }

    /// Relays requests until either side closes.
    pub(crate) async fn run(mut self, guest: Box<dyn Io>) -> Result<(), ConnError> {
        let mut guest = BufReader::new(guest);
        let mut up: Option<BufReader<Box<dyn Io>>> = None;
        loop {
            let head = match tokio::time::timeout(IDLE_TIMEOUT, read_head(&mut guest)).await {
                Err(_) | Ok(Ok(None)) => return Ok(()),
                Ok(Ok(Some(h))) => h,
                Ok(Err(ConnError::Framing(what))) => {
                    let code = if what == "head too large" { 431 } else { 400 };
                    let reason = if code == 431 {
                        "Request Header Fields Too Large"
                    } else {
                        "Bad Request"
                    };
                    let _ = guest
                        .get_mut()
                        .write_all(&simple_response(code, reason))
                        .await;
                    return Err(ConnError::Framing(what));
                }
                Ok(Err(e)) => return Err(e),
            };
            match self.one(head, &mut guest, &mut up).await? {
                Next::Continue => {}
                Next::Close => {
                    let _ = guest.get_mut().shutdown().await;
                    return Ok(());
                }
            }
        }
    }

    async fn refuse(
        guest: &mut BufReader<Box<dyn Io>>,
        code: u16,
        reason: &str,
    ) -> Result<Next, ConnError> {
        guest
            .get_mut()
            .write_all(&simple_response(code, reason))
            .await?;
        guest.get_mut().flush().await?;
        Ok(Next::Close)
    }

    async fn one(
        &mut self,
        head: Vec<u8>,
        guest: &mut BufReader<Box<dyn Io>>,
        up: &mut Option<BufReader<Box<dyn Io>>>,
    ) -> Result<Next, ConnError> {
        let Some(req) = parse_request(&head) else {
            return Self::refuse(guest, 400, "Bad Request").await;
        };
        if req.method == "CONNECT" {
            return Self::refuse(guest, 405, "Method Not Allowed").await;
        }
        let Ok(req_framing) = request_framing(&req.headers) else {
            return Self::refuse(guest, 400, "Bad Request").await;
        };
        let inner = self.inner.clone();
        let secrets = &inner.cfg.secrets;
        // A placeholder anywhere in the head, including inside a `Basic` credential of
        // `Authorization` (the only encoded place it is ever substituted).
        let basics: Vec<Vec<u8>> = req
            .headers
            .iter()
            .filter(|(n, _)| n.eq_ignore_ascii_case("authorization"))
            .filter_map(|(_, v)| basic_credential(v))
            .collect();
        let present = |p: &[u8]| {
            contains(req.path.as_bytes(), p)
                || req
                    .headers
                    .iter()
                    .any(|(n, v)| contains(n.as_bytes(), p) || contains(v, p))
                || basics.iter().any(|b| contains(b, p))
        };

        // The request must name the host the connection was decided for: a second request,
        // an absolute-form target or an inner Host that differs is refused, and with it any
        // placeholder it carries (logged by secret name).
        let named = crate::request::request_host(
            &req.path,
            req.headers.iter().map(|(n, v)| (n.as_str(), v.as_slice())),
        );
        let named = match named {
            Ok(n) => n,
            Err(_) => {
                let shown = self.host.as_deref();
                inner.log.record(
                    Kind::Http,
                    shown,
                    Some(self.dst),
                    Err(DenyReason::Malformed),
                );
                return Self::refuse(guest, 400, "Bad Request").await;
            }
        };
        if named != self.host {
            let shown = named.as_deref().unwrap_or("-");
            for s in secrets.iter().filter(|s| present(s.placeholder.as_bytes())) {
                inner.log.secret_blocked(&s.name, shown);
            }
            inner.log.record(
                Kind::Http,
                Some(shown),
                Some(self.dst),
                Err(DenyReason::HostMismatch),
            );
            return Self::refuse(guest, 421, "Misdirected Request").await;
        }
        let host = self.host.clone().unwrap_or_default();
        let named = self.host.is_some();

        // Placeholders: any placeholder bound for another host, anywhere in the head, blocks.
        let mut used = Vec::new();
        for (i, s) in secrets.iter().enumerate() {
            if !present(s.placeholder.as_bytes()) {
                continue;
            }
            if !named || !crate::policy::any_matches(&s.hosts, &host) {
                inner
                    .log
                    .secret_blocked(&s.name, if named { &host } else { "-" });
                return Self::refuse(guest, 403, "Forbidden").await;
            }
            used.push(i);
        }

        // Interception rules.
        if let Some(rule) = inner
            .rules
            .iter()
            .find(|r| named && r.matches(&host, &req.method, &req.path))
        {
            let mut request = head.clone();
            let cap = MAX_INTERCEPT_REQUEST;
            if request.len() > cap {
                return Self::refuse(guest, 413, "Payload Too Large").await;
            }
            let mut sink = Sink::Buffer(&mut request, cap);
            match copy_body(guest, &mut sink, req_framing).await {
                Ok(()) => {}
                Err(ConnError::Framing("too large")) => {
                    return Self::refuse(guest, 413, "Payload Too Large").await
                }
                Err(e) => return Err(e),
            }
            let answer = rule
                .answer(&inner.cfg.vm, &host, &req.method, &req.path, request)
                .await;
            guest.get_mut().write_all(&answer).await?;
            guest.get_mut().flush().await?;
            return Ok(Next::Close);
        }

        // Substitution in Authorization and the configured headers only.
        let mut out_headers = Vec::with_capacity(req.headers.len());
        let mut expect_continue = false;
        let mut upgrade = false;
        for (name, value) in &req.headers {
            if name.eq_ignore_ascii_case("expect") && value.eq_ignore_ascii_case(b"100-continue") {
                expect_continue = true;
                continue;
            }
            // An h2c upgrade would turn the connection into HTTP/2, whose requests may carry
            // any :authority: never offered upstream (the client carries on in HTTP/1.1).
            if name.eq_ignore_ascii_case("http2-settings") {
                continue;
            }
            if name.eq_ignore_ascii_case("upgrade") {
                let text = String::from_utf8_lossy(value);
                let kept: Vec<&str> = text
                    .split(',')
                    .map(str::trim)
                    .filter(|t| !t.is_empty() && !t.eq_ignore_ascii_case("h2c"))
                    .collect();
                if !kept.is_empty() {
                    upgrade = true;
                    out_headers.push((name.as_str(), kept.join(", ").into_bytes()));
                }
                continue;
            }
            let mut value = value.clone();
            if self.substitute {
                // A `Basic` credential is substituted inside (decoded, re-encoded), and only
                // in `Authorization`; every other value as sent.
                let basic = name
                    .eq_ignore_ascii_case("authorization")
                    .then(|| basic_credential(&value))
                    .flatten();
                let mut text = basic.clone().unwrap_or_else(|| value.clone());
                for &i in &used {
                    let p = secrets[i].placeholder.as_bytes();
                    if !contains(&text, p)
                        || !secrets[i].substitutes_in(name, &inner.cfg.secret_headers)
                    {
                        continue;
                    }
                    if let std::collections::hash_map::Entry::Vacant(slot) = self.values.entry(i) {
                        match secrets[i].resolve() {
                            Ok(v) => {
                                slot.insert(v);
                            }
                            Err(e) => {
                                tracing::error!(vm = %inner.cfg.vm, host = %host, error = %e, "secret unavailable");
                                return Self::refuse(guest, 502, "Bad Gateway").await;
                            }
                        }
                    }
                    if let Some(v) = self.values.get(&i) {
                        text = replace(&text, p, v.0.as_bytes());
                    }
                }
                value = match basic {
                    Some(decoded) if decoded != text => encode_basic(&text),
                    Some(_) => value,
                    None => text,
                };
            }
            out_headers.push((name.as_str(), value));
        }
        let mut out = format!("{} {} HTTP/1.{}\r\n", req.method, req.path, req.minor).into_bytes();
        for (name, value) in &out_headers {
            out.extend_from_slice(name.as_bytes());
            out.extend_from_slice(b": ");
            out.extend_from_slice(value);
            out.extend_from_slice(b"\r\n");
        }
        out.extend_from_slice(b"\r\n");

        if up.is_none() {
            match connect(&inner, &mut self.upstream).await {
                Ok(s) => *up = Some(BufReader::new(s)),
                Err(e) => {
                    tracing::debug!(vm = %inner.cfg.vm, host = %host, error = %e, "upstream connect failed");
                    return Self::refuse(guest, 502, "Bad Gateway").await;
                }
            }
        }
        let Some(upstream) = up.as_mut() else {
            return Self::refuse(guest, 502, "Bad Gateway").await;
        };
        if expect_continue {
            guest
                .get_mut()
                .write_all(b"HTTP/1.1 100 Continue\r\n\r\n")
                .await?;
            guest.get_mut().flush().await?;
        }
        upstream.get_mut().write_all(&out).await?;
        let mut sink = Sink::Write(upstream.get_mut().as_mut());
        match req_framing {
            Framing::Chunked => copy_chunked_canonical(guest, &mut sink).await?,
            other => copy_body(guest, &mut sink, other).await?,
        }
        upstream.get_mut().flush().await?;

        let mut close = (req.minor == 0 && !has_token(&req.headers, "connection", "keep-alive"))
            || has_token(&req.headers, "connection", "close");
        loop {
            let Some(resp_head) = read_head(upstream).await? else {
                return Ok(Next::Close);
            };
            let mut headers = [httparse::EMPTY_HEADER; 128];
            let mut resp = httparse::Response::new(&mut headers);
            if !matches!(resp.parse(&resp_head), Ok(httparse::Status::Complete(_))) {
                return Self::refuse(guest, 502, "Bad Gateway").await;
            }
            let code = resp.code.unwrap_or(0);
            let resp_headers: Vec<(String, Vec<u8>)> = resp
                .headers
                .iter()
                .map(|h| (h.name.to_string(), h.value.to_vec()))
                .collect();
            let minor = resp.version.unwrap_or(1);
            // Switching protocols only to an upgrade the guest asked for (never h2c).
            if code == 101 && (!upgrade || has_token(&resp_headers, "upgrade", "h2c")) {
                return Self::refuse(guest, 502, "Bad Gateway").await;
            }
            guest.get_mut().write_all(&resp_head).await?;
            if code == 101 {
                guest.get_mut().flush().await?;
                tokio::io::copy_bidirectional(guest, upstream).await?;
                return Ok(Next::Close);
            }
            if (100..200).contains(&code) {
                continue;
            }
            let body = if req.method == "HEAD" || code == 204 || code == 304 {
                Framing::None
            } else {
                framing(&resp_headers, Framing::UntilClose)?
            };
            copy_body(upstream, &mut Sink::Write(guest.get_mut().as_mut()), body).await?;
            guest.get_mut().flush().await?;
            close |= body == Framing::UntilClose
                || has_token(&resp_headers, "connection", "close")
                || (minor == 0 && !has_token(&resp_headers, "connection", "keep-alive"));
            return Ok(if close { Next::Close } else { Next::Continue });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_basic_credential_decoded_only_for_basic() {
        assert_eq!(
            basic_credential(b"Basic eC1hY2Nlc3MtdG9rZW46UEg=").as_deref(),
            Some(&b"x-access-token:PH"[..])
        );
        assert_eq!(
            basic_credential(b"  bAsIc   eC1hY2Nlc3MtdG9rZW46UEg=  ").as_deref(),
            Some(&b"x-access-token:PH"[..])
        );
        assert!(basic_credential(b"Bearer eC1hY2Nlc3MtdG9rZW46UEg=").is_none());
        assert!(basic_credential(b"Basic not*base64").is_none());
        assert!(basic_credential(b"Basic").is_none());
        assert_eq!(
            basic_credential(&encode_basic(b"u:real")).as_deref(),
            Some(&b"u:real"[..])
        );
    }

    fn h(pairs: &[(&str, &str)]) -> Vec<(String, Vec<u8>)> {
        pairs
            .iter()
            .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
            .collect()
    }

    #[test]
    fn test_framing_rejects_smuggling_shapes() {
        assert!(framing(
            &h(&[("Content-Length", "5"), ("Transfer-Encoding", "chunked")]),
            Framing::None
        )
        .is_err());
        assert!(framing(
            &h(&[("Content-Length", "5"), ("Content-Length", "6")]),
            Framing::None
        )
        .is_err());
        assert!(framing(&h(&[("Transfer-Encoding", "chunked, gzip")]), Framing::None).is_err());
        assert!(
            framing(
                &h(&[("Content-Length", "5"), ("Content-Length", "5")]),
                Framing::None
            )
            .is_err(),
            "a repeated length, even equal, is refused"
        );
        assert_eq!(
            framing(&h(&[("Content-Length", " 5 ")]), Framing::None).ok(),
            Some(Framing::Length(5)),
            "control: one plain length"
        );
        for bad in ["+5", "0x5", "5 5", "", "-1", "5, 5", "5,5"] {
            assert!(
                framing(&h(&[("Content-Length", bad)]), Framing::None).is_err(),
                "{bad}"
            );
        }
        assert_eq!(
            framing(&h(&[]), Framing::UntilClose).ok(),
            Some(Framing::UntilClose)
        );
    }

    #[tokio::test]
    async fn test_chunked_body_copied_unchanged() {
        let body = b"4;ext=1\r\nWiki\r\n5\r\npedia\r\n0\r\nTrailer: x\r\n\r\nNEXT";
        let mut r = BufReader::new(&body[..]);
        let mut out = Vec::new();
        copy_body(&mut r, &mut Sink::Buffer(&mut out, 1024), Framing::Chunked)
            .await
            .expect("chunked");
        assert_eq!(out, &body[..body.len() - 4]);
    }

    #[test]
    fn test_chunk_size_strict() {
        assert_eq!(chunk_size(b"1a\r\n").ok(), Some(26));
        assert_eq!(chunk_size(b"1A ;ext=1\n").ok(), Some(26));
        for bad in [&b"+5\r\n"[..], b"0x5\r\n", b"\r\n", b"5 x\r\n", b"5"] {
            assert!(
                chunk_size(bad).is_err(),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[tokio::test]
    async fn test_chunked_request_reencoded_without_extensions_or_trailers() {
        let body = b"4;ext=1\r\nWiki\n5 \r\npedia\r\n0\r\nHost: other.example\r\n\r\nNEXT";
        let mut r = BufReader::new(&body[..]);
        let mut out = Vec::new();
        copy_chunked_canonical(&mut r, &mut Sink::Buffer(&mut out, 1024))
            .await
            .expect("chunked");
        assert_eq!(out, b"4\r\nWiki\r\n5\r\npedia\r\n0\r\n\r\n");
    }

    #[test]
    fn test_replace_all_occurrences() {
        assert_eq!(
            replace(b"Bearer PH PH", b"PH", b"real"),
            b"Bearer real real"
        );
    }
}
