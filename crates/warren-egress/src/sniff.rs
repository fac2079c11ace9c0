//! Classifying a connection from its first bytes: a TLS ClientHello (and its SNI), an HTTP/1
//! request (and the host it names), the HTTP/2 preface, or something else. Parsers are total over arbitrary input: they
//! return `NeedMore` until they can decide, and never panic.

/// Most bytes read before deciding; a ClientHello or a request head larger than this is
/// treated as malformed.
pub(crate) const MAX_SNIFF: usize = 16 * 1024;

/// What the first bytes are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Sniffed {
    /// Not enough bytes yet.
    NeedMore,
    /// A TLS ClientHello; the SNI host name if present (raw, not yet normalised). An
    /// SSLv2-format ClientHello is TLS without SNI.
    Tls(Option<String>),
    /// An HTTP/1 request head; the host it names (normalised, see
    /// `request::request_host`), `None` when it names none (no `Host`, an IP).
    Http(Option<String>),
    /// The HTTP/2 connection preface (prior knowledge): refused, its requests are not read.
    Http2,
    /// Starts like TLS or HTTP but does not parse (or is a TLS record no client starts with).
    Malformed,
    /// Any other protocol.
    Other,
}

/// Classifies `buf` (the bytes read so far).
///
/// Anything a TLS server could take as the start of a session is TLS, never `Other` (which
/// is relayed by address, and so would carry a whole TLS session past `intercept_all_tls`):
/// a TLS record of type handshake (`0x16`, parsed for its ClientHello below), an
/// SSLv2-format ClientHello (RFC 5246 appendix E.2: a 2-byte header with the high bit set,
/// then message type 1; it has no extensions and so no SNI), and the records some servers
/// skip before a ClientHello (a 2-byte alert, which OpenSSL and Go drop when it is a
/// warning, and a 1-byte ChangeCipherSpec), which are refused.
pub(crate) fn sniff(buf: &[u8]) -> Sniffed {
    match buf.first() {
        None => Sniffed::NeedMore,
        Some(0x16) => sniff_tls(buf),
        Some(0x80..=0xff) => sniff_sslv2(buf),
        Some(0x14 | 0x15) => sniff_tls_preamble(buf),
        Some(_) => sniff_text(buf),
    }
}

/// An SSLv2-format record header (`0x80 | length-high`, `length-low`) followed by message
/// type 1 (CLIENT-HELLO) is the shape OpenSSL, Java and NSS accept as a ClientHello: TLS
/// without SNI. Anything else with the high bit set is another protocol.
fn sniff_sslv2(buf: &[u8]) -> Sniffed {
    match buf.get(2) {
        None => Sniffed::NeedMore,
        Some(1) => Sniffed::Tls(None),
        Some(_) => Sniffed::Other,
    }
}

/// A TLS record header of type ChangeCipherSpec (`0x14`, 1 byte long) or alert (`0x15`, 2
/// bytes long) with a version a server accepts on its first record (major below 16, as Go
/// checks; OpenSSL wants 3): no client starts a session so, but a server that skips it reads
/// the ClientHello that follows, which Warren would not have decided. Refused. Other bytes
/// are another protocol.
fn sniff_tls_preamble(buf: &[u8]) -> Sniffed {
    let record_len = if buf[0] == 0x14 { 1 } else { 2 };
    let shape = [
        buf.get(1).map(|&major| major < 0x10),
        buf.get(3).map(|&len_high| len_high == 0),
        buf.get(4).map(|&len_low| len_low == record_len),
    ];
    if shape.contains(&Some(false)) {
        sniff_text(buf)
    } else if shape.contains(&None) {
        Sniffed::NeedMore
    } else {
        Sniffed::Malformed
    }
}

fn sniff_tls(buf: &[u8]) -> Sniffed {
    if buf.len() < 5 {
        return Sniffed::NeedMore;
    }
    let record_len = usize::from(u16::from_be_bytes([buf[3], buf[4]]));
    if buf[1] != 3 || record_len == 0 || record_len > 16384 + 256 {
        return Sniffed::Malformed;
    }
    if buf.len() < 5 + record_len {
        return Sniffed::NeedMore;
    }
    let record = &buf[5..5 + record_len];
    // Handshake header: type (1 = ClientHello) and a 24-bit length. A ClientHello spanning
    // several records is not supported (clients do not fragment it in practice).
    if record.len() < 4 || record[0] != 1 {
        return Sniffed::Malformed;
    }
    let hs_len =
        (usize::from(record[1]) << 16) | (usize::from(record[2]) << 8) | usize::from(record[3]);
    let Some(body) = record.get(4..4 + hs_len) else {
        return Sniffed::Malformed;
    };
    match client_hello_sni(body) {
        Some(sni) => Sniffed::Tls(sni),
        None => Sniffed::Malformed,
    }
}

/// A byte cursor that fails (returns `None`) instead of panicking.
struct Cursor<'a>(&'a [u8]);

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        Some(head)
    }
    fn u8(&mut self) -> Option<usize> {
        self.take(1).map(|b| usize::from(b[0]))
    }
    fn u16(&mut self) -> Option<usize> {
        self.take(2)
            .map(|b| usize::from(u16::from_be_bytes([b[0], b[1]])))
    }
}

/// `Some(None)`: a valid ClientHello without SNI; `None`: malformed.
fn client_hello_sni(body: &[u8]) -> Option<Option<String>> {
    let mut c = Cursor(body);
    c.take(2 + 32)?; // legacy_version, random
    let sid = c.u8()?;
    c.take(sid)?;
    let suites = c.u16()?;
    c.take(suites)?;
    let comp = c.u8()?;
    c.take(comp)?;
    if c.0.is_empty() {
        return Some(None);
    }
    let ext_len = c.u16()?;
    let mut exts = Cursor(c.take(ext_len)?);
    let mut sni = None;
    while !exts.0.is_empty() {
        let ty = exts.u16()?;
        let len = exts.u16()?;
        let data = exts.take(len)?;
        if ty != 0 {
            continue;
        }
        // Exactly one server_name extension holding exactly one host_name: a server that
        // read another entry (or the second extension) than Warren would be steered past
        // the decision.
        if sni.is_some() {
            return None;
        }
        let mut sn = Cursor(data);
        let list_len = sn.u16()?;
        let mut list = Cursor(sn.take(list_len)?);
        let name_type = list.u8()?;
        let name_len = list.u16()?;
        let name = list.take(name_len)?;
        if name_type != 0 || !list.0.is_empty() || !sn.0.is_empty() {
            return None;
        }
        sni = Some(std::str::from_utf8(name).ok()?.to_string());
    }
    Some(sni)
}

/// Whether `hay` contains `needle`, ASCII case-insensitively.
fn contains_ci(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len())
        .any(|w| w.eq_ignore_ascii_case(needle))
}

/// Anything that starts with text. An HTTP/1 request is recognised the way a lenient server
/// would recognise it, so that no request an upstream would serve is relayed undecided:
/// empty lines (and other whitespace) before the request line are looked past (RFC 9112
/// section 2.2 lets servers skip them), the method is any token (not only uppercase), and a
/// first line that mentions `HTTP` must parse as an HTTP/1 request or is refused.
fn sniff_text(buf: &[u8]) -> Sniffed {
    let Some(start) = buf.iter().position(|b| !b" \t\r\n".contains(b)) else {
        return Sniffed::NeedMore;
    };
    let text = &buf[start..];
    let method_len = text
        .iter()
        .position(|&b| !crate::config::is_token_byte(b))
        .unwrap_or(text.len());
    if method_len == 0 {
        return Sniffed::Other;
    }
    // Only a token so far: it may still become a request line with any method (an unknown
    // method is still HTTP), so it is held; a client that sends a bare word and waits is
    // refused after `SNIFF_TIMEOUT`, one that sends more than `MAX_SNIFF` of it at once too.
    if method_len == text.len() {
        return Sniffed::NeedMore;
    }
    match text[method_len] {
        b' ' | b'\t' => {}
        // Other bytes some servers split a request line on (Python's `str.split`: VT, FF,
        // FS..US, NEL, NBSP): a disguised request line is refused, not relayed undecided.
        0x0b | 0x0c | 0x1c..=0x1f | 0x85 | 0xa0 => return Sniffed::Malformed,
        _ => return Sniffed::Other,
    }
    // A token and a space: decided only once the whole first line is in (whatever bytes it
    // holds, since what a lenient server accepts in a request line is not ours to guess).
    let Some(line_end) = text.iter().position(|&b| b == b'\n') else {
        return Sniffed::NeedMore;
    };
    let line = &text[..line_end];
    // No version: another text protocol (decided by address), unless its first word is an
    // HTTP method: an HTTP/0.9-style request, which some servers still answer with the
    // headers that follow it, so it is refused rather than relayed undecided.
    if !contains_ci(line, b"http") {
        const METHODS: [&[u8]; 9] = [
            b"GET", b"HEAD", b"POST", b"PUT", b"DELETE", b"OPTIONS", b"PATCH", b"TRACE", b"CONNECT",
        ];
        // An uppercase method, or any case with an HTTP-shaped target; memcached's
        // lowercase `get key` stays another protocol.
        let method = &text[..method_len];
        let target = line[method_len..].trim_ascii_start();
        let http_target = target.starts_with(b"/") || contains_ci(target, b"://");
        if METHODS
            .iter()
            .any(|m| method == *m || (http_target && method.eq_ignore_ascii_case(m)))
        {
            return Sniffed::Malformed;
        }
        return Sniffed::Other;
    }
    if line.starts_with(b"PRI * HTTP/2") {
        return Sniffed::Http2;
    }
    // Spaces or tabs before the request line: not HTTP, but a lenient server might take it.
    if buf[..start].iter().any(|&b| b == b' ' || b == b'\t') {
        return Sniffed::Malformed;
    }
    let mut headers = [httparse::EMPTY_HEADER; 100];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(text) {
        Ok(httparse::Status::Partial) => Sniffed::NeedMore,
        Ok(httparse::Status::Complete(_)) => {
            let named = crate::request::request_host(
                req.path.unwrap_or(""),
                req.headers.iter().map(|h| (h.name, h.value)),
            );
            match named {
                Ok(host) => Sniffed::Http(host),
                Err(_) => Sniffed::Malformed,
            }
        }
        Err(_) => Sniffed::Malformed,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A minimal ClientHello record with one server_name extension per entry of `exts`, each
    /// listing those host names.
    fn client_hello_exts(exts_names: &[&[&str]]) -> Vec<u8> {
        let mut exts = Vec::new();
        for names in exts_names {
            let mut list = Vec::new();
            for name in *names {
                let n = name.as_bytes();
                list.push(0u8);
                list.extend_from_slice(&(n.len() as u16).to_be_bytes());
                list.extend_from_slice(n);
            }
            let mut data = (list.len() as u16).to_be_bytes().to_vec();
            data.extend_from_slice(&list);
            exts.extend_from_slice(&0u16.to_be_bytes());
            exts.extend_from_slice(&(data.len() as u16).to_be_bytes());
            exts.extend_from_slice(&data);
        }
        let mut body = vec![3, 3];
        body.extend_from_slice(&[0u8; 32]);
        body.push(0);
        body.extend_from_slice(&[0, 2, 0x13, 0x01]);
        body.extend_from_slice(&[1, 0]);
        body.extend_from_slice(&(exts.len() as u16).to_be_bytes());
        body.extend_from_slice(&exts);
        let mut hs = vec![1, 0];
        hs.extend_from_slice(&(body.len() as u16).to_be_bytes());
        hs.extend_from_slice(&body);
        let mut rec = vec![0x16, 3, 1];
        rec.extend_from_slice(&(hs.len() as u16).to_be_bytes());
        rec.extend_from_slice(&hs);
        rec
    }

    /// A minimal ClientHello record with the given SNI.
    fn client_hello(sni: Option<&str>) -> Vec<u8> {
        match sni {
            Some(name) => client_hello_exts(&[&[name]]),
            None => client_hello_exts(&[]),
        }
    }

    #[test]
    fn test_sniff_tls_sni_extracted() {
        let hello = client_hello(Some("api.example.com"));
        assert_eq!(sniff(&hello), Sniffed::Tls(Some("api.example.com".into())));
        assert_eq!(sniff(&hello[..hello.len() - 1]), Sniffed::NeedMore);
    }

    #[test]
    fn test_sniff_tls_two_names_malformed() {
        let two_in_one = client_hello_exts(&[&["a.example", "b.example"]]);
        assert_eq!(sniff(&two_in_one), Sniffed::Malformed);
        let two_exts = client_hello_exts(&[&["a.example"], &["b.example"]]);
        assert_eq!(sniff(&two_exts), Sniffed::Malformed);
        // Positive control: the same builder with one name parses.
        let one = client_hello_exts(&[&["a.example"]]);
        assert_eq!(sniff(&one), Sniffed::Tls(Some("a.example".into())));
    }

    #[test]
    fn test_sniff_tls_without_sni() {
        assert_eq!(sniff(&client_hello(None)), Sniffed::Tls(None));
    }

    #[test]
    fn test_sniff_truncated_fields_malformed_not_panic() {
        let hello = client_hello(Some("a.example.com"));
        for cut in 6..hello.len() {
            let mut broken = hello[..cut].to_vec();
            // Claim the truncated length so the parser sees a complete record.
            let len = (cut - 5) as u16;
            broken[3..5].copy_from_slice(&len.to_be_bytes());
            let _ = sniff(&broken);
        }
    }

    /// An SSLv2-format ClientHello (RFC 5246 appendix E.2) offering TLS 1.2.
    fn sslv2_client_hello() -> Vec<u8> {
        let mut body = vec![1u8, 3, 3];
        body.extend_from_slice(&[0, 3, 0, 0, 0, 32]); // cipher specs, session id, challenge
        body.extend_from_slice(&[0, 0, 0x2f]);
        body.extend_from_slice(&[9u8; 32]);
        let mut rec = (0x8000u16 | body.len() as u16).to_be_bytes().to_vec();
        rec.extend_from_slice(&body);
        rec
    }

    #[test]
    fn test_sniff_sslv2_format_hello_is_tls_without_sni() {
        // Before the fix this was `Other`: relayed by address, past `intercept_all_tls`.
        let hello = sslv2_client_hello();
        assert_eq!(sniff(&hello), Sniffed::Tls(None));
        assert_eq!(sniff(&hello[..3]), Sniffed::Tls(None));
        assert_eq!(sniff(&hello[..2]), Sniffed::NeedMore);
        // The long form of the length and any version: still the shape servers accept.
        assert_eq!(sniff(&[0xff, 0xff, 1, 0, 2]), Sniffed::Tls(None));
        // Control: other high-bit protocols (memcached's binary magic 0x80, then an opcode
        // and a key length below 256) stay another protocol.
        assert_eq!(sniff(&[0x80, 0x00, 0x00, 0x05, 0, 0]), Sniffed::Other);
        assert_eq!(sniff(b"\xff\xfb\x18"), Sniffed::Other);
    }

    #[test]
    fn test_sniff_tls_records_servers_skip_before_a_hello_refused() {
        // A warning alert (OpenSSL and Go drop it and read on), then a ClientHello.
        let mut alert_first = vec![0x15, 3, 1, 0, 2, 1, 0];
        alert_first.extend_from_slice(&client_hello(Some("denied.example")));
        assert_eq!(sniff(&alert_first), Sniffed::Malformed);
        assert_eq!(sniff(&[0x15, 0, 0, 0, 2]), Sniffed::Malformed);
        assert_eq!(sniff(&[0x14, 3, 3, 0, 1, 1]), Sniffed::Malformed);
        assert_eq!(sniff(&alert_first[..4]), Sniffed::NeedMore);
        // Controls: the same first bytes in other shapes are another protocol.
        assert_eq!(sniff(&[0x15, 0x20, 0, 0, 2]), Sniffed::Other);
        assert_eq!(sniff(&[0x15, 3, 1, 0, 7]), Sniffed::Other);
        assert_eq!(sniff(&[0x14, 3, 1, 1, 1]), Sniffed::Other);
    }

    #[test]
    fn test_sniff_http_host_without_port() {
        let req = b"GET / HTTP/1.1\r\nHost: Example.com:8080\r\n\r\n";
        assert_eq!(sniff(req), Sniffed::Http(Some("example.com".into())));
        assert_eq!(sniff(&req[..20]), Sniffed::NeedMore);
    }

    #[test]
    fn test_sniff_http_disguised_request_lines_found() {
        let named = Sniffed::Http(Some("b.example".into()));
        for req in [
            &b"\r\n\r\nGET / HTTP/1.1\r\nHost: b.example\r\n\r\n"[..],
            b"\nGET / HTTP/1.1\nHost: b.example\n\n",
            b"get / HTTP/1.1\r\nHost: b.example\r\n\r\n",
            b"GET http://b.example/ HTTP/1.1\r\n\r\n",
        ] {
            assert_eq!(sniff(req), named, "{:?}", String::from_utf8_lossy(req));
        }
        assert_eq!(sniff(b"\r\n\r\n"), Sniffed::NeedMore);
        assert_eq!(sniff(b" GET / HTTP/1.1\r\n\r\n"), Sniffed::Malformed);
        assert_eq!(sniff(b"GET / HTTP/3.0\r\n\r\n"), Sniffed::Malformed);
        assert_eq!(
            sniff(b"GET / HTTP/1.1\r\nHost: a.example\r\nHost: b.example\r\n\r\n"),
            Sniffed::Malformed
        );
        assert_eq!(
            sniff(b"GET http://b.example/ HTTP/1.1\r\nHost: a.example\r\n\r\n"),
            Sniffed::Malformed
        );
        assert_eq!(
            sniff(b"CONNECT b.example:443 HTTP/1.1\r\nHost: b.example\r\n\r\n"),
            Sniffed::Malformed
        );
        // Separators a lenient server splits on, and HTTP/0.9-shaped lines: refused, not
        // relayed undecided (the security review's attacks).
        for req in [
            &b"GET\x0c/one\x0cHTTP/1.1\r\nHost: b.example\r\n\r\n"[..],
            b"GET\x0b/ HTTP/1.1\r\n\r\n",
            b"GET\xa0/ HTTP/1.1\r\n\r\n",
            b"GET /nine\r\nHost: b.example\r\n\r\n",
            b"get /nine\r\n\r\n",
            b"POST http://b.example/\r\n\r\n",
        ] {
            assert_eq!(
                sniff(req),
                Sniffed::Malformed,
                "{:?}",
                String::from_utf8_lossy(req)
            );
        }
    }

    #[test]
    fn test_sniff_http2_preface_recognised() {
        assert_eq!(sniff(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"), Sniffed::Http2);
        assert_eq!(sniff(b"PRI * HTTP/2.0\r\n"), Sniffed::Http2);
        assert_eq!(sniff(b"PRI * HT"), Sniffed::NeedMore);
    }

    #[test]
    fn test_sniff_other_protocols() {
        assert_eq!(sniff(b"SSH-2.0-OpenSSH_9.2\r\n"), Sniffed::Other);
        assert_eq!(sniff(b"\x00\x01binary"), Sniffed::Other);
        assert_eq!(sniff(b"*1\r\n$4\r\nPING\r\n"), Sniffed::Other);
        assert_eq!(sniff(b"EHLO mail.example\r\n"), Sniffed::Other);
        assert_eq!(sniff(b"get key\r\n"), Sniffed::Other);
        assert_eq!(
            sniff(b"get key\x00\x01"),
            Sniffed::NeedMore,
            "a line may follow"
        );
        assert_eq!(sniff(b"GET /\x0b HTTP/1.1\r\n\r\n"), Sniffed::Malformed);
        assert_eq!(sniff(b"ping\n"), Sniffed::Other);
        assert_eq!(
            sniff(b"ping"),
            Sniffed::NeedMore,
            "may become `ping / HTTP/1.1`"
        );
    }
}
