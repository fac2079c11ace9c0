//! HTTP/1 message framing for the relay: reading heads and chunk lines with caps, the body
//! framing `Transfer-Encoding`/`Content-Length` give, and copying a body as framed (a request's
//! chunked body re-encoded canonically).

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};

use super::{Io, MAX_HEAD};
use crate::error::ConnError;

/// Longest chunk-size or trailer line.
const MAX_LINE: usize = 8 * 1024;

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

pub(super) fn has_token(headers: &[(String, Vec<u8>)], name: &str, token: &str) -> bool {
    header(headers, name).any(|v| {
        String::from_utf8_lossy(v)
            .split(',')
            .any(|t| t.trim().eq_ignore_ascii_case(token))
    })
}

/// The framing error of a request whose transfer codings are well formed but include one
/// Warren does not frame (`gzip, chunked`): answered `501 Not Implemented` (RFC 9112 section
/// 6.1), every other framing error `400`.
pub(crate) const UNSUPPORTED_CODING: &str = "request transfer coding not implemented";

/// A response's body framing: `Transfer-Encoding` ending in `chunked`, any other coding
/// (read until close), `Content-Length`, or until close. `Err` for ambiguous framing (both,
/// conflicting lengths). Responses are relayed as received, so their framing is the
/// upstream's, read the way the guest's client reads it.
pub(super) fn response_framing(headers: &[(String, Vec<u8>)]) -> Result<Framing, ConnError> {
    let te: Vec<&[u8]> = header(headers, "transfer-encoding").collect();
    if te.is_empty() {
        return content_length(headers, Framing::UntilClose);
    }
    if header(headers, "content-length").next().is_some() {
        return Err(ConnError::Framing(
            "both Transfer-Encoding and Content-Length",
        ));
    }
    let joined = te
        .iter()
        .map(|v| String::from_utf8_lossy(v).into_owned())
        .collect::<Vec<_>>()
        .join(",");
    let last = joined.rsplit(',').next().unwrap_or("").trim();
    Ok(if last.eq_ignore_ascii_case("chunked") {
        Framing::Chunked
    } else {
        Framing::UntilClose
    })
}

/// A request's body framing (no body unless the headers frame one), strictly: the relay
/// forwards only the framing header it computed (`transfer-encoding: chunked` or one
/// `content-length`), so anything an upstream could frame differently is refused rather than
/// rewritten. `Transfer-Encoding` must be exactly one header whose value is exactly
/// `chunked` (any case), on HTTP/1.1, without `Content-Length`: a list (`x, chunked`,
/// `chunked, chunked`), a repeated header, a coding other than `chunked` or one in HTTP/1.0
/// (whose framing RFC 9112 section 6.1 calls faulty) is refused. `Content-Length`: exactly
/// one, digits only.
pub(crate) fn request_framing(
    headers: &[(String, Vec<u8>)],
    minor: u8,
) -> Result<Framing, ConnError> {
    let te: Vec<&[u8]> = header(headers, "transfer-encoding").collect();
    let value = match te.as_slice() {
        [] => return content_length(headers, Framing::None),
        [v] => *v,
        _ => return Err(ConnError::Framing("repeated Transfer-Encoding")),
    };
    if header(headers, "content-length").next().is_some() {
        return Err(ConnError::Framing(
            "both Transfer-Encoding and Content-Length",
        ));
    }
    if minor == 0 {
        return Err(ConnError::Framing("Transfer-Encoding in HTTP/1.0"));
    }
    let bad = ConnError::Framing("request transfer coding not chunked");
    let text = std::str::from_utf8(value).map_err(|_| ConnError::Framing("bad coding"))?;
    let codings: Vec<&str> = text
        .split(',')
        .map(|c| c.trim_matches([' ', '\t']))
        .collect();
    let chunked = |c: &str| c.eq_ignore_ascii_case("chunked");
    match codings.as_slice() {
        [only] if chunked(only) => Ok(Framing::Chunked),
        // Well-formed codings before a final `chunked`: not implemented (`501`).
        [.., last]
            if chunked(last)
                && codings.iter().filter(|c| chunked(c)).count() == 1
                && codings.iter().all(|c| !c.is_empty()) =>
        {
            Err(ConnError::Framing(UNSUPPORTED_CODING))
        }
        _ => Err(bad),
    }
}

/// Framing from `Content-Length` alone (`default` without one). Exactly one header of digits
/// only: a repeated header or a list (`5, 5`, which RFC 9110 lets a recipient accept) is
/// read as something else by some upstreams, and the body would become a request there.
fn content_length(headers: &[(String, Vec<u8>)], default: Framing) -> Result<Framing, ConnError> {
    let cl: Vec<&[u8]> = header(headers, "content-length").collect();
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

/// Reads one head (up to and including the empty line). `Ok(None)` on a clean EOF before any
/// byte. Leading empty lines are skipped (RFC 9112 section 2.2).
pub(super) async fn read_head<R: AsyncBufReadExt + Unpin>(
    r: &mut R,
) -> Result<Option<Vec<u8>>, ConnError> {
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
pub(super) enum Sink<'a> {
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
pub(super) async fn copy_chunked_canonical<R: AsyncBufReadExt + Unpin>(
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

pub(super) async fn copy_body<R: AsyncBufReadExt + Unpin>(
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

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::BufReader;

    fn h(pairs: &[(&str, &str)]) -> Vec<(String, Vec<u8>)> {
        pairs
            .iter()
            .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
            .collect()
    }

    #[test]
    fn test_framing_rejects_smuggling_shapes() {
        let req = |pairs: &[(&str, &str)]| request_framing(&h(pairs), 1);
        assert!(req(&[("Content-Length", "5"), ("Transfer-Encoding", "chunked")]).is_err());
        assert!(req(&[("Transfer-Encoding", "chunked"), ("Content-Length", "5")]).is_err());
        assert!(req(&[("Content-Length", "5"), ("Content-Length", "6")]).is_err());
        assert!(req(&[("Transfer-Encoding", "chunked, gzip")]).is_err());
        assert!(
            req(&[("Content-Length", "5"), ("Content-Length", "5")]).is_err(),
            "a repeated length, even equal, is refused"
        );
        assert_eq!(
            req(&[("Content-Length", " 5 ")]).ok(),
            Some(Framing::Length(5)),
            "control: one plain length"
        );
        for bad in ["+5", "0x5", "5 5", "", "-1", "5, 5", "5,5"] {
            assert!(req(&[("Content-Length", bad)]).is_err(), "{bad}");
        }
        assert_eq!(req(&[]).ok(), Some(Framing::None));
        let resp = |pairs: &[(&str, &str)]| response_framing(&h(pairs));
        assert_eq!(resp(&[]).ok(), Some(Framing::UntilClose));
        assert_eq!(
            resp(&[("Transfer-Encoding", "gzip, chunked")]).ok(),
            Some(Framing::Chunked)
        );
        assert_eq!(
            resp(&[("Transfer-Encoding", "gzip")]).ok(),
            Some(Framing::UntilClose)
        );
        assert!(resp(&[("Content-Length", "5"), ("Transfer-Encoding", "chunked")]).is_err());
    }

    #[test]
    fn test_request_transfer_encoding_exactly_one_chunked() {
        let req = |pairs: &[(&str, &str)], minor| request_framing(&h(pairs), minor);
        for ok in ["chunked", "Chunked", " CHUNKED\t"] {
            assert_eq!(
                req(&[("Transfer-Encoding", ok)], 1).ok(),
                Some(Framing::Chunked),
                "{ok:?}"
            );
        }
        // Codings Warren does not frame before a final `chunked`: 501. Before the fix these
        // were accepted and the list forwarded as written.
        for unsupported in ["x, chunked", "gzip,chunked", "gzip, deflate, chunked"] {
            assert!(
                matches!(
                    req(&[("Transfer-Encoding", unsupported)], 1),
                    Err(ConnError::Framing(UNSUPPORTED_CODING))
                ),
                "{unsupported:?}"
            );
        }
        // Anything else is malformed: 400.
        for bad in [
            "chunked, chunked",
            "chunked, gzip",
            "gzip",
            "",
            ",chunked",
            "chunked,",
            "x,,chunked",
        ] {
            let got = req(&[("Transfer-Encoding", bad)], 1);
            assert!(
                matches!(got, Err(ConnError::Framing(m)) if m != UNSUPPORTED_CODING),
                "{bad:?}: {got:?}"
            );
        }
        // The classic split over two headers, and `chunked` twice.
        assert!(req(
            &[("Transfer-Encoding", "x"), ("Transfer-Encoding", "chunked")],
            1
        )
        .is_err());
        assert!(req(
            &[
                ("Transfer-Encoding", "chunked"),
                ("Transfer-Encoding", "chunked")
            ],
            1
        )
        .is_err());
        // HTTP/1.0 has no transfer codings: its framing is faulty.
        assert!(req(&[("Transfer-Encoding", "chunked")], 0).is_err());
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
}
