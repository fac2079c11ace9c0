//! What an HTTP/1 request names: the host an upstream server would route it to. Shared by the
//! first-bytes classifier ([`crate::sniff`], which decides the connection by it) and the
//! HTTP/1 relay ([`crate::http1`], which holds every later request of the connection to the
//! same name).
//!
//! Servers differ in what they route by (the authority of an absolute-form target, the first
//! or the last `Host` header), so a request names at most one host or is refused: `Host` at
//! most once, an absolute-form target only with a scheme and an authority without userinfo,
//! and when both are present they must name the same host. Anything else a server could
//! read as a host (a `Host` that is neither a DNS name nor an IP literal) is refused too.

use std::net::{Ipv4Addr, Ipv6Addr};

use crate::policy::normalize_name;

/// Why a request's host could not be determined; the request is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Ambiguous(pub(crate) &'static str);

/// The host a request is for. `Ok(Some(name))`: a normalised DNS name; `Ok(None)`: no name
/// (no or empty `Host`, or an IP literal: decided by address); `Err`: ambiguous or malformed.
pub(crate) fn request_host<'a>(
    target: &str,
    headers: impl IntoIterator<Item = (&'a str, &'a [u8])>,
) -> Result<Option<String>, Ambiguous> {
    let mut hosts = headers
        .into_iter()
        .filter(|(n, _)| n.eq_ignore_ascii_case("host"))
        .map(|(_, v)| v);
    let header = hosts.next();
    if hosts.next().is_some() {
        return Err(Ambiguous("more than one Host header"));
    }
    let from_header = match header {
        None => None,
        Some(v) => {
            let v = std::str::from_utf8(v).map_err(|_| Ambiguous("Host is not text"))?;
            Some(host_of(v)?)
        }
    };
    match (target_host(target)?, from_header) {
        (Some(t), Some(h)) if t != h => Err(Ambiguous("target and Host name different hosts")),
        (Some(t), _) => Ok(t),
        (None, Some(h)) => Ok(h),
        (None, None) => Ok(None),
    }
}

/// The host of an absolute-form target (`Some`), or `None` for origin-form (`/path`) and
/// asterisk-form (`*`). Authority-form (`CONNECT host:port`) and anything else is refused.
fn target_host(target: &str) -> Result<Option<Option<String>>, Ambiguous> {
    if target.starts_with('/') || target == "*" {
        return Ok(None);
    }
    let bad = Ambiguous("request target is neither a path nor an absolute URI");
    let uri: http::Uri = target.parse().map_err(|_| bad)?;
    let scheme_ok = uri
        .scheme_str()
        .is_some_and(|s| s.eq_ignore_ascii_case("http") || s.eq_ignore_ascii_case("https"));
    let authority = uri.authority().ok_or(bad)?;
    if !scheme_ok {
        return Err(bad);
    }
    if authority.as_str().contains('@') {
        return Err(Ambiguous("userinfo in the request target"));
    }
    Ok(Some(host_of(authority.as_str())?))
}

/// A request target as the relay matches and forwards it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Target {
    /// Origin-form (`/path?query`, as written) or `*`.
    pub(crate) path: String,
    /// The authority of an absolute-form target, which replaces `Host` when forwarded
    /// (RFC 9112 section 3.2.2); `None` for origin-form and `*`.
    pub(crate) authority: Option<String>,
}

/// `target` in origin-form: an absolute-form target (`https://host/path?q`, whose host
/// [`request_host`] has already held to the connection's) becomes its path and query (`/`
/// when empty) and its authority; origin-form and `*` stay as written. So interception rules
/// match, and the upstream receives, one form whatever the guest wrote.
pub(crate) fn origin_form(target: &str) -> Result<Target, Ambiguous> {
    if target.starts_with('/') || target == "*" {
        return Ok(Target {
            path: target.to_string(),
            authority: None,
        });
    }
    let bad = Ambiguous("request target is neither a path nor an absolute URI");
    let uri: http::Uri = target.parse().map_err(|_| bad)?;
    let authority = uri.authority().ok_or(bad)?.as_str().to_string();
    if uri.scheme().is_none() {
        return Err(bad);
    }
    let rest = uri.path_and_query().map_or("", |pq| pq.as_str());
    let path = if rest.starts_with('/') {
        rest.to_string()
    } else {
        format!("/{rest}")
    };
    Ok(Target {
        path,
        authority: Some(authority),
    })
}

/// The path of an origin-form target as the most lenient server could route it, for
/// refusing requests that such a server would route to an interception rule's path while
/// the rule, matching the target as written, does not see them: the query (`?`) and anything
/// after `#` cut; percent-escapes decoded, repeatedly (double encoding, `%2F` included);
/// `\` read as `/`; path parameters (`;x` in a segment, as Java servers strip them), empty
/// segments and trailing dots and spaces of a segment (as Windows servers read them)
/// dropped; dot segments resolved; ASCII lowercased (case-insensitive routers).
pub(crate) fn lenient_path(target: &str) -> String {
    let end = target.find(['?', '#']).unwrap_or(target.len());
    let text = decode_repeatedly(&target[..end]).replace('\\', "/");
    let mut segments: Vec<&str> = Vec::new();
    let mut trailing_slash = false;
    for raw in text.split('/') {
        let segment = raw.split(';').next().unwrap_or("");
        trailing_slash = segment.is_empty() || segment == "." || segment == "..";
        match segment {
            "." => {}
            ".." => {
                segments.pop();
            }
            s => {
                let s = s.trim_end_matches(['.', ' ']);
                if !s.is_empty() {
                    segments.push(s);
                }
            }
        }
    }
    let mut out = format!("/{}", segments.join("/"));
    if trailing_slash && !segments.is_empty() {
        out.push('/');
    }
    // Case folded as the most lenient router compares: Java's `equalsIgnoreCase` takes the
    // Kelvin sign for `k`, the long s for `s` and the dotless i for `i` (upper, then lower).
    out.chars()
        .flat_map(char::to_uppercase)
        .flat_map(char::to_lowercase)
        .collect()
}

/// `text` percent-decoded as often as a server might (double encoding included, at most four
/// rounds), invalid escapes and invalid UTF-8 kept as well as they can be.
pub(crate) fn decode_repeatedly(text: &str) -> String {
    let mut bytes = text.as_bytes().to_vec();
    for _ in 0..4 {
        let decoded = percent_decode(&bytes);
        if decoded == bytes {
            break;
        }
        bytes = decoded;
    }
    String::from_utf8_lossy(&bytes).into_owned()
}

/// One round of percent-decoding (`%2f` -> `/`); invalid escapes stay as written.
fn percent_decode(bytes: &[u8]) -> Vec<u8> {
    let hex = |b: u8| {
        char::from(b)
            .to_digit(16)
            .and_then(|d| u8::try_from(d).ok())
    };
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            if let (Some(h), Some(l)) = (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                out.push(h * 16 + l);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    out
}

/// A `Host` value or URI authority (`host[:port]`) as a normalised name, `None` for an empty
/// value or an IP literal.
fn host_of(value: &str) -> Result<Option<String>, Ambiguous> {
    let bad = Ambiguous("Host is not a DNS name or an IP address");
    let v = value.trim_matches(|c| c == ' ' || c == '\t');
    if v.is_empty() {
        return Ok(None);
    }
    let port_ok = |p: &str| p.bytes().all(|b| b.is_ascii_digit());
    if let Some(rest) = v.strip_prefix('[') {
        let (inside, after) = rest.split_once(']').ok_or(bad)?;
        inside.parse::<Ipv6Addr>().map_err(|_| bad)?;
        let port = if after.is_empty() {
            ""
        } else {
            after.strip_prefix(':').ok_or(bad)?
        };
        return if port_ok(port) { Ok(None) } else { Err(bad) };
    }
    let host = match v.rsplit_once(':') {
        Some((h, p)) if port_ok(p) => h,
        Some(_) => return Err(bad),
        None => v,
    };
    if host.parse::<Ipv4Addr>().is_ok() {
        return Ok(None);
    }
    normalize_name(host).map(Some).ok_or(bad)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host(target: &str, hosts: &[&str]) -> Result<Option<String>, Ambiguous> {
        request_host(target, hosts.iter().map(|h| ("Host", h.as_bytes())))
    }

    #[test]
    fn test_request_host_from_header_normalised() {
        assert_eq!(
            host("/", &["Api.Example.com.:8080"]),
            Ok(Some("api.example.com".into()))
        );
        assert_eq!(host("*", &["a.example"]), Ok(Some("a.example".into())));
        assert_eq!(host("/", &[]), Ok(None));
        assert_eq!(host("/", &[""]), Ok(None));
        assert_eq!(host("/", &["203.0.113.7:80"]), Ok(None));
        assert_eq!(host("/", &["[2001:db8::1]:443"]), Ok(None));
    }

    #[test]
    fn test_request_host_absolute_form_must_agree_with_host() {
        let ok = Ok(Some("a.example".to_string()));
        assert_eq!(host("http://a.example/x", &["a.example"]), ok);
        assert_eq!(host("HTTPS://A.example:443/x?q", &[]), ok);
        assert!(host("http://b.example/x", &["a.example"]).is_err());
        assert!(host("http://a.example@b.example/", &["a.example"]).is_err());
        assert!(host("ftp://a.example/", &["a.example"]).is_err());
        assert!(
            host("a.example:443", &["a.example"]).is_err(),
            "authority-form"
        );
        assert!(host("a.example/x", &["a.example"]).is_err());
    }

    #[test]
    fn test_origin_form_of_absolute_targets() {
        let t = |path: &str, authority: Option<&str>| {
            Ok(Target {
                path: path.into(),
                authority: authority.map(Into::into),
            })
        };
        assert_eq!(origin_form("/a/b?q=1"), t("/a/b?q=1", None));
        assert_eq!(origin_form("*"), t("*", None));
        assert_eq!(
            origin_form("https://Oauth.example:443/oauth/token?x=1"),
            t("/oauth/token?x=1", Some("Oauth.example:443"))
        );
        assert_eq!(origin_form("http://a.example"), t("/", Some("a.example")));
        assert_eq!(
            origin_form("http://a.example?x"),
            t("/?x", Some("a.example"))
        );
        assert!(origin_form("a.example:443").is_err());
    }

    #[test]
    fn test_lenient_path_reads_what_lenient_servers_route() {
        for (raw, lenient) in [
            ("/oauth/token", "/oauth/token"),
            ("/oauth/token?grant=x", "/oauth/token"),
            ("/oauth/./token", "/oauth/token"),
            ("/x/../oauth/token", "/oauth/token"),
            ("//oauth//token", "/oauth/token"),
            ("/oauth%2Ftoken", "/oauth/token"),
            ("/oauth%252ftoken", "/oauth/token"),
            ("/%6Fauth/token", "/oauth/token"),
            ("/oauth\\token", "/oauth/token"),
            ("/oauth;jsessionid=1/token", "/oauth/token"),
            ("/oauth./token", "/oauth/token"),
            ("/OAuth/Token", "/oauth/token"),
            ("/oauth/to%E2%84%AAen", "/oauth/token"),
            ("/oauth/toKen%C5%BF", "/oauth/tokens"),
            ("/%C4%B1d", "/id"),
            ("/oauth/%2e%2e/oauth/token", "/oauth/token"),
            ("/../../oauth/token", "/oauth/token"),
            ("/oauth/token#frag", "/oauth/token"),
            ("/v1/", "/v1/"),
            ("/", "/"),
            ("*", "/*"),
            ("/bad%zz%", "/bad%zz%"),
        ] {
            assert_eq!(lenient_path(raw), lenient, "{raw}");
        }
    }

    #[test]
    fn test_request_host_ambiguous_or_malformed_refused() {
        assert!(host("/", &["a.example", "b.example"]).is_err());
        assert!(host("/", &["a.example", "a.example"]).is_err());
        for bad in [
            "a b",
            "a.example:x",
            "[::1",
            "[nope]",
            "a..example",
            "a.example/x",
            "x@a.example",
        ] {
            assert!(host("/", &[bad]).is_err(), "{bad}");
        }
    }
}
