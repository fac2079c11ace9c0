//! Warren's DNS resolver for one VM.
//!
//! Serves the guest over UDP and TCP (sockets bound by the caller inside the VM's namespace).
//! In allow-list mode only `A` queries for allowed names are forwarded, one name at a time, to
//! the configured upstream resolver (reached through the [`Outbound`] strategy); the answer
//! is rewritten to plain `A` records for the queried name, minus always-denied, blocked and
//! denied addresses and the outbound namespace's own addresses. `AAAA` and every other type
//! of an allowed name get an empty answer (no IPv6, nothing else to carry data); denied names get REFUSED. Returned addresses are recorded in
//! [`ResolvedNames`] so the proxy can accept TCP to them (by address) and check that a
//! SNI/Host name really resolves to the connection's destination.

use std::collections::HashMap;
use std::io;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hickory_proto::op::{Message, MessageType, OpCode, Query, ResponseCode};
use hickory_proto::rr::{DNSClass, Name, RData, Record, RecordType};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, UdpSocket};
use tokio::sync::Semaphore;

use crate::conns::{accept_within, DNS_SOCKET_BUFFER, MAX_DNS_TCP_CONNECTIONS};
use crate::decision_log::Kind;
use crate::egress::Inner;
use crate::outbound::Outbound;
use crate::policy::{normalize_name, DenyReason, EgressPolicy};

/// A recorded address stays valid for at least this long, whatever TTL upstream gave: guests
/// cache answers for a moment, and a connection made a few seconds after the lookup must work.
pub const MIN_RECORD_TTL: Duration = Duration::from_secs(60);
/// TTLs handed to the guest are capped to this (and recorded for at least as long).
pub const MAX_TTL: u32 = 3600;
/// Upstream query timeout per attempt (two attempts over UDP).
pub const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(2);
/// Most names remembered per VM; expired entries go first, then the cache is cleared.
const MAX_NAMES: usize = 4096;
/// Most addresses used from one answer, and remembered per name (the ones expiring first make
/// room): an upstream answer may carry ~4,000 `A` records (64 KiB over TCP), and a guest may
/// ask for [`MAX_NAMES`] names of a zone whose server returns that many.
pub(crate) const MAX_ADDRS_PER_NAME: usize = 32;
/// Concurrent guest queries being answered per VM (UDP).
const MAX_INFLIGHT: usize = 64;
/// How long a guest's DNS-over-TCP connection may take to send one query, and to take its
/// answer.
const TCP_TURN: Duration = Duration::from_secs(10);

/// Addresses Warren's resolver returned, per normalised name, each with its expiry.
/// The mutex guards the map only; it is never held across an await.
#[derive(Default)]
pub(crate) struct ResolvedNames {
    map: Mutex<HashMap<String, Vec<(Ipv4Addr, Instant)>>>,
}

impl ResolvedNames {
    pub(crate) fn insert(&self, name: &str, ips: &[Ipv4Addr], ttl: Duration) {
        let expiry = Instant::now() + ttl.max(MIN_RECORD_TTL);
        let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        if map.len() >= MAX_NAMES {
            let now = Instant::now();
            map.retain(|_, v| {
                v.retain(|(_, e)| *e > now);
                !v.is_empty()
            });
            if map.len() >= MAX_NAMES {
                map.clear();
            }
        }
        let entry = map.entry(name.to_string()).or_default();
        for ip in ips.iter().take(MAX_ADDRS_PER_NAME) {
            match entry.iter_mut().find(|(a, _)| a == ip) {
                Some(slot) => slot.1 = slot.1.max(expiry),
                None => entry.push((*ip, expiry)),
            }
        }
        if entry.len() > MAX_ADDRS_PER_NAME {
            // Keep the addresses that stay valid longest (the latest answers').
            entry.sort_by_key(|(_, e)| std::cmp::Reverse(*e));
            entry.truncate(MAX_ADDRS_PER_NAME);
        }
    }

    /// Whether `name` resolved (unexpired) to `ip`.
    pub(crate) fn has(&self, name: &str, ip: Ipv4Addr) -> bool {
        let now = Instant::now();
        let map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        map.get(name)
            .is_some_and(|v| v.iter().any(|(a, e)| *a == ip && *e > now))
    }

    /// Names that resolved (unexpired) to `ip`.
    pub(crate) fn names_for(&self, ip: Ipv4Addr) -> Vec<String> {
        let now = Instant::now();
        let map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        map.iter()
            .filter(|(_, v)| v.iter().any(|(a, e)| *a == ip && *e > now))
            .map(|(n, _)| n.clone())
            .collect()
    }
}

/// Result of asking upstream for a name's `A` records.
#[derive(Debug, Clone)]
pub(crate) struct Lookup {
    pub(crate) rcode: ResponseCode,
    /// Usable addresses (blocked ones removed).
    pub(crate) ips: Vec<Ipv4Addr>,
    pub(crate) ttl: u32,
}

#[derive(Debug, thiserror::Error)]
pub(crate) enum ResolveError {
    #[error("upstream DNS i/o")]
    Io(#[from] io::Error),
    #[error("upstream DNS timed out")]
    Timeout,
    #[error("upstream DNS answer unusable")]
    BadAnswer,
}

fn fqdn(name: &str) -> Option<Name> {
    Name::from_ascii(format!("{name}.")).ok()
}

async fn query_udp(
    outbound: &Outbound,
    upstream: SocketAddr,
    wire: &[u8],
) -> Result<Vec<u8>, ResolveError> {
    let sock = outbound.udp_socket().await?;
    sock.connect(upstream).await?;
    let mut buf = vec![0u8; 4096];
    for _ in 0..2 {
        sock.send(wire).await?;
        if let Ok(n) = tokio::time::timeout(UPSTREAM_TIMEOUT, sock.recv(&mut buf)).await {
            let n = n?;
            return Ok(buf[..n].to_vec());
        }
    }
    Err(ResolveError::Timeout)
}

async fn query_tcp(
    outbound: &Outbound,
    upstream: SocketAddr,
    wire: &[u8],
) -> Result<Vec<u8>, ResolveError> {
    let SocketAddr::V4(v4) = upstream else {
        return Err(ResolveError::BadAnswer);
    };
    let work = async {
        let mut s = outbound.tcp_connect(v4).await?;
        let len = u16::try_from(wire.len()).map_err(|_| io::Error::other("query too long"))?;
        s.write_all(&len.to_be_bytes()).await?;
        s.write_all(wire).await?;
        let n = s.read_u16().await?;
        let mut buf = vec![0u8; usize::from(n)];
        s.read_exact(&mut buf).await?;
        Ok::<_, io::Error>(buf)
    };
    tokio::time::timeout(UPSTREAM_TIMEOUT * 2, work)
        .await
        .map_err(|_| ResolveError::Timeout)?
        .map_err(ResolveError::from)
}

/// Asks the upstream resolver for `name`'s `A` records and records the usable ones.
pub(crate) async fn lookup(inner: &Inner, name: &str) -> Result<Lookup, ResolveError> {
    let qname = fqdn(name).ok_or(ResolveError::BadAnswer)?;
    let mut msg = Message::query();
    msg.metadata.recursion_desired = true;
    msg.add_query(Query::query(qname, RecordType::A));
    let id = msg.metadata.id;
    let wire = msg.to_vec().map_err(|_| ResolveError::BadAnswer)?;
    let upstream = inner.cfg.upstream_dns;
    // In its turn under the VM's lookup rate (`crate::pace`).
    inner.lookups.take().await;
    let mut answer = query_udp(&inner.outbound, upstream, &wire).await?;
    let mut resp = Message::from_vec(&answer).map_err(|_| ResolveError::BadAnswer)?;
    if resp.metadata.truncation {
        // A TCP connection to the host's resolver: in its turn under the connection rate.
        inner.connects.take().await;
        answer = query_tcp(&inner.outbound, upstream, &wire).await?;
        resp = Message::from_vec(&answer).map_err(|_| ResolveError::BadAnswer)?;
    }
    if resp.metadata.id != id || resp.metadata.message_type != MessageType::Response {
        return Err(ResolveError::BadAnswer);
    }
    let policy: &EgressPolicy = &inner.cfg.policy;
    let mut ips = Vec::new();
    let mut ttl = MAX_TTL;
    // At most MAX_ADDRS_PER_NAME records looked at: each costs a socket in the outbound
    // namespace (`is_own_address`), and the rest would not be kept.
    let records = resp
        .answers
        .iter()
        .filter(|r| matches!(r.data, RData::A(_)))
        .take(MAX_ADDRS_PER_NAME);
    for r in records {
        if let RData::A(a) = &r.data {
            // Never hand out (or accept by) an address the proxy would refuse: blocked ranges
            // and the outbound namespace's own addresses (an error asking counts as own).
            let own = || async { inner.outbound.is_own_address(a.0).await.unwrap_or(true) };
            if policy.address_block(a.0).is_none() && !own().await {
                ips.push(a.0);
                ttl = ttl.min(r.ttl);
            }
        }
    }
    if !ips.is_empty() {
        inner
            .names
            .insert(name, &ips, Duration::from_secs(u64::from(ttl)));
    }
    Ok(Lookup {
        rcode: resp.metadata.response_code,
        ips,
        ttl,
    })
}

/// Whether `name` resolves (per Warren's records, or a fresh lookup) to `ip`.
pub(crate) async fn name_resolves_to(
    inner: &Inner,
    name: &str,
    ip: Ipv4Addr,
) -> Result<bool, ResolveError> {
    if inner.names.has(name, ip) {
        return Ok(true);
    }
    let found = lookup(inner, name).await?;
    Ok(found.ips.contains(&ip))
}

/// A guest query as [`decode_query`] reads it, before the policy is consulted.
pub(crate) enum Decoded {
    /// Not a query: dropped without a reply.
    Drop,
    /// Refused with this code (the reply, with the question if there was exactly one).
    Refuse(Message, ResponseCode),
    /// The question's name is not a DNS name: refused, and logged as such.
    InvalidName(Message),
    /// One `IN` question for a valid name: the reply to fill, the question and its
    /// normalised name.
    Question {
        resp: Message,
        query: Query,
        name: String,
    },
}

/// Decodes one guest query (wire format) into what [`answer`] decides on. Pure: no policy,
/// no log, no upstream.
pub(crate) fn decode_query(wire: &[u8]) -> Decoded {
    let Ok(req) = Message::from_vec(wire) else {
        return Decoded::Drop;
    };
    if req.metadata.message_type != MessageType::Query {
        return Decoded::Drop;
    }
    let mut resp = Message::response(req.metadata.id, req.metadata.op_code);
    resp.metadata.recursion_desired = req.metadata.recursion_desired;
    resp.metadata.recursion_available = true;
    if req.metadata.op_code != OpCode::Query {
        return Decoded::Refuse(resp, ResponseCode::NotImp);
    }
    let [q] = req.queries.as_slice() else {
        return Decoded::Refuse(resp, ResponseCode::FormErr);
    };
    resp.add_query(q.clone());
    let raw = q.name().to_ascii();
    let Some(name) = normalize_name(&raw) else {
        return Decoded::InvalidName(resp);
    };
    if q.query_class() != DNSClass::IN {
        return Decoded::Refuse(resp, ResponseCode::Refused);
    }
    Decoded::Question {
        resp,
        query: q.clone(),
        name,
    }
}

/// `resp` with `code`, in wire format.
pub(crate) fn refusal(mut resp: Message, code: ResponseCode) -> Option<Vec<u8>> {
    resp.metadata.response_code = code;
    resp.to_vec().ok()
}

/// Builds the reply to one guest query (wire format in, wire format out). `None` drops it.
pub(crate) async fn answer(inner: &Inner, wire: &[u8]) -> Option<Vec<u8>> {
    let (mut resp, q, name) = match decode_query(wire) {
        Decoded::Drop => return None,
        Decoded::Refuse(resp, code) => return refusal(resp, code),
        Decoded::InvalidName(resp) => {
            inner
                .log
                .record(Kind::Dns, None, None, Err(DenyReason::InvalidName));
            return refusal(resp, ResponseCode::Refused);
        }
        Decoded::Question { resp, query, name } => (resp, query, name),
    };
    if let Err(reason) = inner.cfg.policy.name_verdict(&name) {
        inner.log.record(Kind::Dns, Some(&name), None, Err(reason));
        return refusal(resp, ResponseCode::Refused);
    }
    if q.query_type() != RecordType::A {
        // Allowed name, but no IPv6 and no other record types: an empty answer.
        inner.log.record(Kind::Dns, Some(&name), None, Ok(()));
        return resp.to_vec().ok();
    }
    match lookup(inner, &name).await {
        Ok(found) => {
            inner.log.record(Kind::Dns, Some(&name), None, Ok(()));
            resp.metadata.response_code = match found.rcode {
                ResponseCode::NXDomain => ResponseCode::NXDomain,
                _ => ResponseCode::NoError,
            };
            for ip in found.ips {
                resp.add_answer(Record::from_rdata(
                    q.name().clone(),
                    found.ttl,
                    RData::A(ip.into()),
                ));
            }
            resp.to_vec().ok()
        }
        Err(e) => {
            tracing::debug!(vm = %inner.cfg.vm, name = %name, error = %e, "upstream DNS failed");
            inner
                .log
                .record(Kind::Dns, Some(&name), None, Err(DenyReason::ResolveFailed));
            refusal(resp, ResponseCode::ServFail)
        }
    }
}

/// Serves guest DNS over UDP until the socket fails.
pub(crate) async fn serve_udp(inner: Arc<Inner>, sock: UdpSocket) -> io::Result<()> {
    let sock = Arc::new(sock);
    let limit = Arc::new(Semaphore::new(MAX_INFLIGHT));
    let mut buf = vec![0u8; 4096];
    loop {
        let (n, peer) = sock.recv_from(&mut buf).await?;
        let Ok(permit) = limit.clone().try_acquire_owned() else {
            continue; // Overloaded: drop, the guest retries.
        };
        let query = buf[..n].to_vec();
        let (inner2, sock) = (inner.clone(), sock.clone());
        inner.tasks.spawn(async move {
            let inner = inner2;
            if let Some(reply) = answer(&inner, &query).await {
                let _ = sock.send_to(&reply, peer).await;
            }
            drop(permit);
        });
    }
}

/// Serves guest DNS over TCP (length-prefixed messages): at most
/// [`MAX_DNS_TCP_CONNECTIONS`] connections at once (more are closed when accepted), each a
/// task of the VM's task set, so shutdown ends them too.
pub(crate) async fn serve_tcp(inner: Arc<Inner>, listener: TcpListener) -> io::Result<()> {
    let places = Arc::new(Semaphore::new(MAX_DNS_TCP_CONNECTIONS));
    loop {
        let (mut conn, place) =
            accept_within(&inner, &listener, &places, Kind::Dns, DNS_SOCKET_BUFFER).await;
        let inner2 = inner.clone();
        inner.tasks.spawn(async move {
            let _place = place;
            let inner = inner2;
            loop {
                let read = async {
                    let n = conn.read_u16().await?;
                    let mut buf = vec![0u8; usize::from(n)];
                    conn.read_exact(&mut buf).await?;
                    Ok::<_, io::Error>(buf)
                };
                let Ok(Ok(query)) = tokio::time::timeout(TCP_TURN, read).await else {
                    return;
                };
                let Some(reply) = answer(&inner, &query).await else {
                    return;
                };
                let Ok(len) = u16::try_from(reply.len()) else {
                    return;
                };
                // Under a deadline too: a guest that never reads its answers must not hold
                // its place (and the socket's buffers) for good.
                let write = async {
                    conn.write_all(&len.to_be_bytes()).await?;
                    conn.write_all(&reply).await
                };
                if !matches!(tokio::time::timeout(TCP_TURN, write).await, Ok(Ok(()))) {
                    return;
                }
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_resolved_names_records_and_finds() {
        let names = ResolvedNames::default();
        let ip: Ipv4Addr = "203.0.113.10".parse().expect("ip");
        names.insert("a.example.com", &[ip], Duration::from_secs(1));
        assert!(names.has("a.example.com", ip));
        assert!(!names.has("b.example.com", ip));
        assert_eq!(names.names_for(ip), vec!["a.example.com".to_string()]);
    }

    /// An answer with thousands of addresses (an attacker's zone, 64 KiB over TCP) is not kept
    /// whole: a name holds at most MAX_ADDRS_PER_NAME addresses, the latest answer's first.
    /// (Before, every address was kept: 4,096 names x ~4,000 addresses per VM.)
    #[test]
    fn test_addresses_per_name_bounded() {
        let names = ResolvedNames::default();
        let ips: Vec<Ipv4Addr> = (0..4000u32)
            .map(|i| Ipv4Addr::from(0xcb00_7100 + i))
            .collect();
        names.insert("many.example", &ips, Duration::from_secs(60));
        let later: Vec<Ipv4Addr> = (0..8u32).map(|i| Ipv4Addr::from(0xc633_6400 + i)).collect();
        names.insert("many.example", &later, Duration::from_secs(600));
        let map = names.map.lock().expect("map");
        let kept = &map["many.example"];
        assert!(
            kept.len() <= MAX_ADDRS_PER_NAME,
            "{} addresses kept for one name",
            kept.len()
        );
        drop(map);
        // Positive control: the latest answer's addresses are usable.
        assert!(later.iter().all(|ip| names.has("many.example", *ip)));
        assert!(names.has("many.example", ips[0]));
    }
}
