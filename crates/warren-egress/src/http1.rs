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
//! bodies are framed by one `Content-Length` (digits only) or a `Transfer-Encoding` of
//! exactly `chunked` (re-encoded canonically, trailers dropped), and only the framing header
//! Warren computed is forwarded ([`framing`]), so the upstream frames them exactly as Warren
//! did; responses without
//! framing run to EOF and end the connection. An `h2c` upgrade is never offered upstream; a
//! `101 Switching Protocols` answer to a requested upgrade turns the connection into a plain
//! two-way relay. Placeholders are substituted in `Authorization` and the configured headers
//! only, never in request targets, bodies or responses.

use std::collections::HashMap;

use std::net::SocketAddrV4;
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

use crate::config::SecretValue;
use crate::decision_log::Kind;
use crate::egress::Inner;
use crate::error::ConnError;
use crate::intercept::{find_rule, Matched};
use crate::policy::DenyReason;

mod framing;
pub(crate) use framing::{chunk_size, request_framing};
use framing::{
    copy_body, copy_chunked_canonical, has_token, read_head, response_framing, Framing, Sink,
    UNSUPPORTED_CODING,
};

/// Largest request or response head accepted.
pub const MAX_HEAD: usize = 64 * 1024;
/// Largest request (head and body) passed to an interception command; larger gets 413.
pub const MAX_INTERCEPT_REQUEST: usize = 64 * 1024;
/// How long an idle keep-alive connection waits for the next request.
const IDLE_TIMEOUT: Duration = Duration::from_secs(300);

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
            None => inner.connect_remote(*addr).await?,
        })),
        Upstream::Tls(addr, pre, name) => {
            let tcp = match pre.take() {
                Some(s) => s,
                None => inner.connect_remote(*addr).await?,
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

/// Whether `req` asks the server to send the request back: `TRACE` (and IIS's `TRACK`), in
/// any case, also when claimed through a method-override header.
fn echoes_request(req: &Request) -> bool {
    let echo = |m: &[u8]| {
        let m = m.trim_ascii();
        m.eq_ignore_ascii_case(b"TRACE") || m.eq_ignore_ascii_case(b"TRACK")
    };
    echo(req.method.as_bytes())
        || req.headers.iter().any(|(n, v)| {
            crate::intercept::METHOD_OVERRIDES
                .iter()
                .any(|o| n.eq_ignore_ascii_case(o))
                && echo(v)
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

/// How many times `needle` occurs in `hay`, without overlaps, as [`replace`] finds them.
fn occurrences(hay: &[u8], needle: &[u8]) -> usize {
    if needle.is_empty() {
        return 0;
    }
    let (mut n, mut i) = (0, 0);
    while i < hay.len() {
        if hay[i..].starts_with(needle) {
            n += 1;
            i += needle.len();
        } else {
            i += 1;
        }
    }
    n
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

/// A request head: request line and headers, each as given.
fn serialize_head(method: &str, target: &str, minor: u8, headers: &[(&str, Vec<u8>)]) -> Vec<u8> {
    let mut out = format!("{method} {target} HTTP/1.{minor}\r\n").into_bytes();
    for (name, value) in headers {
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"\r\n");
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
        // A request echoed back would hand the guest the values substituted into it: never
        // on a connection Warren terminated (the only ones where anything is substituted).
        if self.substitute && echoes_request(&req) {
            return Self::refuse(guest, 405, "Method Not Allowed").await;
        }
        let req_framing = match request_framing(&req.headers, req.minor) {
            Ok(f) => f,
            Err(ConnError::Framing(UNSUPPORTED_CODING)) => {
                return Self::refuse(guest, 501, "Not Implemented").await
            }
            Err(_) => return Self::refuse(guest, 400, "Bad Request").await,
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

        // One form of the target for the rules and the upstream: origin-form, with an
        // absolute-form target's authority as `Host` (the name was held to this host above).
        let Ok(target) = crate::request::origin_form(&req.path) else {
            return Self::refuse(guest, 400, "Bad Request").await;
        };
        let forwarded_headers = || {
            let host_header = target
                .authority
                .as_deref()
                .map(|a| ("host", a.as_bytes().to_vec()));
            req.headers
                .iter()
                .filter(|(n, _)| host_header.is_none() || !n.eq_ignore_ascii_case("host"))
                .map(|(n, v)| (n.as_str(), v.clone()))
                .chain(host_header.clone())
                .collect::<Vec<_>>()
        };

        // Interception rules.
        let matched = if named {
            find_rule(&inner.rules, &host, &req.method, &target.path, &req.headers)
        } else {
            Matched::None
        };
        if let Matched::Ambiguous = matched {
            inner.log.record(
                Kind::Http,
                Some(&host),
                Some(self.dst),
                Err(DenyReason::AmbiguousTarget),
            );
            return Self::refuse(guest, 400, "Bad Request").await;
        }
        if let Matched::Rule(rule) = matched {
            let mut request =
                serialize_head(&req.method, &target.path, req.minor, &forwarded_headers());
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
                .answer(&inner.cfg.vm, &host, &req.method, &target.path, request)
                .await;
            guest.get_mut().write_all(&answer).await?;
            guest.get_mut().flush().await?;
            return Ok(Next::Close);
        }

        // Substitution in Authorization and the configured headers only.
        let mut out_headers = Vec::with_capacity(req.headers.len());
        // What substitutions add to the head, at most [`MAX_HEAD`] in all: a placeholder
        // repeated through a header would otherwise grow a 64 KiB head ~50 times, each copy
        // of it holding the real value (found by a hostile review).
        let mut grown = 0usize;
        let mut grown_sent = 0usize;
        let mut expect_continue = false;
        let mut upgrade = false;
        let forwarded = forwarded_headers();
        for &(name, ref value) in &forwarded {
            // The body's framing goes out as Warren framed it (below), never as written.
            if name.eq_ignore_ascii_case("transfer-encoding")
                || name.eq_ignore_ascii_case("content-length")
            {
                continue;
            }
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
                    out_headers.push((name, kept.join(", ").into_bytes()));
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
                        let n = occurrences(&text, p);
                        grown = grown
                            .saturating_add(n.saturating_mul(v.0.len().saturating_sub(p.len())));
                        if grown > MAX_HEAD {
                            tracing::info!(vm = %inner.cfg.vm, host = %host,
                                "egress refused a request whose substituted head grew too large");
                            return Self::refuse(guest, 431, "Request Header Fields Too Large")
                                .await;
                        }
                        text = replace(&text, p, v.0.as_bytes());
                    }
                }
                let sent = value.len();
                value = match basic {
                    Some(decoded) if decoded != text => encode_basic(&text),
                    Some(_) => value,
                    None => text,
                };
                // What the header grew as sent (a Basic credential's by a third more than
                // what was substituted into it, once re-encoded).
                grown_sent = grown_sent.saturating_add(value.len().saturating_sub(sent));
                if grown_sent > MAX_HEAD {
                    tracing::info!(vm = %inner.cfg.vm, host = %host,
                        "egress refused a request whose substituted head grew too large");
                    return Self::refuse(guest, 431, "Request Header Fields Too Large").await;
                }
            }
            out_headers.push((name, value));
        }
        match req_framing {
            Framing::Length(n) => out_headers.push(("content-length", n.to_string().into_bytes())),
            Framing::Chunked => out_headers.push(("transfer-encoding", b"chunked".to_vec())),
            Framing::None | Framing::UntilClose => {}
        }
        let out = serialize_head(&req.method, &target.path, req.minor, &out_headers);

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
                response_framing(&resp_headers)?
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

    #[test]
    fn test_trace_in_any_spelling_echoes() {
        let req = |method: &str, headers: &[(&str, &str)]| Request {
            method: method.into(),
            path: "/".into(),
            minor: 1,
            headers: headers
                .iter()
                .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
                .collect(),
        };
        for method in ["TRACE", "trace", "TRACK"] {
            assert!(echoes_request(&req(method, &[])), "{method}");
        }
        assert!(echoes_request(&req(
            "POST",
            &[("X-HTTP-Method-Override", " trace")]
        )));
        assert!(!echoes_request(&req("GET", &[])));
        assert!(!echoes_request(&req("POST", &[("X-Trace", "TRACE")])));
    }

    #[test]
    fn test_replace_all_occurrences() {
        assert_eq!(
            replace(b"Bearer PH PH", b"PH", b"real"),
            b"Bearer real real"
        );
    }
}
