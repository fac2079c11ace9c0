//! Narrow entry points into the egress's parsers of guest bytes, for the fuzz targets in
//! `crates/warren-fuzz` and their corpus replay test. Not an API: hidden from the docs, and
//! each function only calls the parser the proxy or resolver calls, converting its result
//! into plain data.

use hickory_proto::op::ResponseCode;

use crate::resolver::{decode_query, refusal, Decoded};

/// Most bytes the proxy reads before deciding a connection.
pub const MAX_SNIFF: usize = crate::sniff::MAX_SNIFF;

/// What the first-bytes classifier made of a connection's first bytes (the proxy's own type).
pub use crate::sniff::Sniffed as Sniff;

/// The proxy's classifier (`sniff.rs`) on `buf`.
pub fn sniff(buf: &[u8]) -> Sniff {
    crate::sniff::sniff(buf)
}

/// A request head as the HTTP/1 relay reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestHead {
    pub method: String,
    pub path: String,
    pub minor: u8,
    pub headers: Vec<(String, Vec<u8>)>,
    /// The host the request names (`request::request_host`); `Err` refuses it.
    pub host: Result<Option<String>, &'static str>,
    /// The request body's length: `Some(n)` for `Content-Length`, `None` for `chunked` or
    /// no body; `Err` refuses the request (ambiguous framing).
    pub body_length: Result<Option<u64>, ()>,
    /// Whether the body is chunked.
    pub chunked: bool,
}

/// The relay's request-head parser and the checks it runs before relaying.
pub fn request_head(head: &[u8]) -> Option<RequestHead> {
    let req = crate::http1::parse_request(head)?;
    let host = crate::request::request_host(
        &req.path,
        req.headers.iter().map(|(n, v)| (n.as_str(), v.as_slice())),
    )
    .map_err(|e| e.0);
    let framing = crate::http1::request_framing(&req.headers, req.minor).ok();
    Some(RequestHead {
        host,
        body_length: framing.map(|f| f.length()).ok_or(()),
        chunked: framing.is_some_and(|f| f.is_chunked()),
        method: req.method,
        path: req.path,
        minor: req.minor,
        headers: req.headers,
    })
}

/// The relay's chunk-size line parser (`1a;ext\r\n`).
pub fn chunk_size(line: &[u8]) -> Option<u64> {
    crate::http1::chunk_size(line).ok()
}

/// What the resolver makes of one guest query before it consults the policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DnsQuery {
    /// The normalised name of the one `IN` question, when the query has one.
    pub name: Option<String>,
    /// The reply in wire format: the refusal, or the empty answer the resolver fills.
    pub reply: Option<Vec<u8>>,
}

/// The resolver's query decoder; `None` when the query is dropped without a reply.
pub fn dns_query(wire: &[u8]) -> Option<DnsQuery> {
    match decode_query(wire) {
        Decoded::Drop => None,
        Decoded::Refuse(resp, code) => Some(DnsQuery {
            name: None,
            reply: refusal(resp, code),
        }),
        Decoded::InvalidName(resp) => Some(DnsQuery {
            name: None,
            reply: refusal(resp, ResponseCode::Refused),
        }),
        Decoded::Question { resp, name, .. } => Some(DnsQuery {
            name: Some(name),
            reply: resp.to_vec().ok(),
        }),
    }
}
