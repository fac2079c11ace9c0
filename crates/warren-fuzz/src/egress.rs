//! Targets for `warren-egress`: the first-bytes classifier (HTTP/1 and TLS ClientHello), the
//! HTTP/1 relay's request parser and the resolver's query decoder, all fed by the guest.

use hickory_proto::op::{Message, MessageType};
use warren_egress::fuzzing::{self, Sniff, MAX_SNIFF};
use warren_egress::normalize_name;

/// Checks what holds for every classification of `buf`: a decided result does not change
/// when more bytes arrive, and names come out normalised and from the input.
fn check_sniff(buf: &[u8]) -> Sniff {
    let buf = &buf[..buf.len().min(MAX_SNIFF)];
    let got = fuzzing::sniff(buf);
    if got != Sniff::NeedMore {
        let mut more = buf.to_vec();
        more.extend_from_slice(b"\r\n\r\nGET / HTTP/1.1\r\nHost: x\r\n\r\n\x16\x03\x01");
        assert_eq!(
            fuzzing::sniff(&more),
            got,
            "decision changed with more bytes"
        );
    }
    match &got {
        Sniff::Http(Some(host)) => {
            assert_eq!(
                normalize_name(host).as_ref(),
                Some(host),
                "host not normalised"
            );
            assert!(host.len() <= buf.len());
        }
        Sniff::Tls(Some(sni)) => {
            assert!(
                buf.windows(sni.len()).any(|w| w == sni.as_bytes()),
                "SNI not taken from the input"
            );
        }
        _ => {}
    }
    got
}

/// The HTTP/1 sniffer and the relay's request parser on the same bytes. Invariants beyond
/// `check_sniff`: whatever host the sniffer decided a connection by, the relay reads the
/// same host from the same head (or refuses it); a parsed request's parts come from the
/// input; a body length is only ever given by exactly one digits-only `Content-Length`.
pub fn http1(data: &[u8]) {
    let sniffed = check_sniff(data);
    // The relay reads the head after the empty lines it skips (RFC 9112 section 2.2).
    let mut head = data;
    while let Some(rest) = head
        .strip_prefix(b"\r\n")
        .or_else(|| head.strip_prefix(b"\n"))
    {
        head = rest;
    }
    if let Some(req) = fuzzing::request_head(head) {
        assert!(req.method.len() + req.path.len() <= head.len());
        assert!(req.headers.len() <= 128);
        if let Sniff::Http(host) = &sniffed {
            assert_eq!(
                req.host.as_ref().ok(),
                Some(host),
                "sniffer and relay disagree"
            );
        }
        if let Ok(Some(n)) = req.body_length {
            let cl: Vec<_> = req
                .headers
                .iter()
                .filter(|(k, _)| k.eq_ignore_ascii_case("content-length"))
                .collect();
            assert_eq!(cl.len(), 1, "length from several Content-Length headers");
            let v = String::from_utf8_lossy(&cl[0].1);
            assert_eq!(v.trim_matches([' ', '\t']).parse::<u64>().ok(), Some(n));
        }
        if req.chunked {
            assert_eq!(req.body_length, Ok(None));
        }
    }
    // The first line as a chunk-size line: at most 16 hex digits, so the value fits.
    if let Some(end) = data.iter().position(|&b| b == b'\n') {
        if let Some(n) = fuzzing::chunk_size(&data[..=end]) {
            let digits = data.iter().take_while(|b| b.is_ascii_hexdigit()).count();
            assert!((1..=16).contains(&digits));
            assert_eq!(
                u64::from_str_radix(std::str::from_utf8(&data[..digits]).unwrap(), 16).ok(),
                Some(n)
            );
        }
    }
}

/// The TLS ClientHello sniffer: the input is taken as the bytes after a handshake record's
/// first byte (`0x16`), so every input reaches the ClientHello parser.
pub fn tls_client_hello(data: &[u8]) {
    let mut buf = Vec::with_capacity(data.len() + 1);
    buf.push(0x16);
    buf.extend_from_slice(data);
    buf.truncate(MAX_SNIFF);
    let got = check_sniff(&buf);
    assert!(
        matches!(got, Sniff::NeedMore | Sniff::Tls(_) | Sniff::Malformed),
        "a handshake record classified as {got:?}"
    );
    if buf.len() >= 5 {
        let record_len = usize::from(u16::from_be_bytes([buf[3], buf[4]]));
        if got == Sniff::NeedMore {
            assert!(
                buf.len() < 5 + record_len,
                "undecided with the whole record"
            );
        }
    }
}

/// The resolver's decoder of guest queries. Invariants: the reply is a response to the
/// query's id, parses back, fits a plain UDP DNS message, and a name comes out normalised.
pub fn dns_query(data: &[u8]) {
    let Some(q) = fuzzing::dns_query(data) else {
        return;
    };
    if let Some(name) = &q.name {
        assert_eq!(
            normalize_name(name).as_ref(),
            Some(name),
            "name not normalised"
        );
    }
    let reply = q.reply.expect("a decoded query has a reply");
    assert!(reply.len() <= 512, "reply of {} bytes", reply.len());
    let msg = Message::from_vec(&reply).expect("the reply parses");
    assert_eq!(msg.metadata.message_type, MessageType::Response);
    assert_eq!(msg.metadata.id.to_be_bytes(), [data[0], data[1]]);
    assert!(msg.queries.len() <= 1);
}
