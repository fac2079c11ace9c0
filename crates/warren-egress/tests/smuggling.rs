//! Security review 38a: a hostile guest smuggles something past a decision the egress made
//! on another form of the same bytes: a TLS session in an SSLv2-format ClientHello (or behind
//! a record servers skip) past `intercept_all_tls`, a request target an interception rule
//! does not match but the server routes to the rule's path, a `Transfer-Encoding` the
//! upstream frames differently from Warren, and a `TRACE` that echoes a substituted secret.
//! Each attack asserts what the stand-in received (or what came back), with a positive
//! control on the same path. Needs root, `ip` and `nft`.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Result;
use common::*;
use hickory_proto::rr::RecordType;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use warren_egress::{DomainPattern, EgressConfig, UpstreamRoots};

fn pat(s: &str) -> DomainPattern {
    s.parse().expect("pattern")
}

fn plain_config(topo: &Topology) -> EgressConfig {
    let mut cfg = EgressConfig::new("vm-smuggling", SocketAddr::new(DNS.into(), 53));
    cfg.policy.allow_domains = vec![pat("*.allowed.test")];
    cfg.upstream_roots = UpstreamRoots::Pem(topo.pki.ca_pem.clone());
    cfg
}

/// Sends `bytes` and reads whatever comes back within `wait` (until EOF).
async fn send_and_read(topo: &Topology, port: u16, bytes: &[u8], wait: Duration) -> Vec<u8> {
    let mut s = topo.guest_tcp(ECHO, port).await.expect("connect");
    let _ = s.write_all(bytes).await;
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        match tokio::time::timeout_at(deadline, s.read(&mut buf)).await {
            Err(_) | Ok(Ok(0)) | Ok(Err(_)) => return out,
            Ok(Ok(n)) => out.extend_from_slice(&buf[..n]),
        }
    }
}

/// An SSLv2-format ClientHello (RFC 5246 appendix E.2) offering TLS 1.2: no extensions, so
/// no SNI. OpenSSL 3 servers still parse it.
fn sslv2_client_hello() -> Vec<u8> {
    let mut body = vec![1u8, 3, 3];
    body.extend_from_slice(&[0, 6, 0, 0, 0, 32]); // cipher specs, session id, challenge
    body.extend_from_slice(&[0, 0, 0x2f, 0, 0, 0x35]);
    body.extend_from_slice(&[9u8; 32]);
    let mut rec = (0x8000u16 | body.len() as u16).to_be_bytes().to_vec();
    rec.extend_from_slice(&body);
    rec
}

#[tokio::test]
async fn test_sslv2_format_hello_and_skipped_records_refused_with_intercept_all_tls() -> Result<()>
{
    let v2 = sslv2_client_hello();
    // A warning alert record (OpenSSL and Go drop it before the ClientHello), then junk.
    let alert_first = b"\x15\x03\x01\x00\x02\x01\x00rest".to_vec();

    // Control: without `intercept_all_tls`, TLS without SNI is decided by address and the
    // echo stand-in (an allowed name's address) answers.
    let (topo, _e, _h) = up_with("", plain_config).await?;
    topo.guest_dns("echo.allowed.test", RecordType::A).await?;
    let got = send_and_read(&topo, 7, &v2, Duration::from_secs(2)).await;
    assert_eq!(got, v2, "control: relayed by address");
    drop(topo);

    let (topo, _e, _h) = up_with("", |t| {
        let mut c = plain_config(t);
        c.intercept_all_tls = true;
        c
    })
    .await?;
    topo.guest_dns("echo.allowed.test", RecordType::A).await?;
    // Attack: before the fix the SSLv2-format hello was "another protocol", relayed to the
    // address untouched, the whole TLS session past `intercept_all_tls`.
    let got = send_and_read(&topo, 7, &v2, Duration::from_secs(2)).await;
    assert!(got.is_empty(), "SSLv2-format hello relayed: {got:?}");
    let got = send_and_read(&topo, 7, &alert_first, Duration::from_secs(2)).await;
    assert!(got.is_empty(), "alert-first TLS relayed: {got:?}");
    // Control: another protocol to the same address is still decided by address.
    assert!(guest_echo(&topo, ECHO).await?, "control: echo reachable");
    Ok(())
}

/// Whether a stand-in received a request head containing `needle`.
fn seen(topo: &Topology, needle: &str) -> bool {
    topo.seen().iter().any(|h| h.contains(needle))
}

#[tokio::test]
async fn test_transfer_encoding_only_exactly_chunked_and_sent_as_framed() -> Result<()> {
    let (topo, _e, _h) = up_with("", plain_config).await?;
    topo.guest_dns("api.allowed.test", RecordType::A).await?;
    let body = "5\r\nhello\r\n0\r\n\r\n";
    let request = |path: &str, framing: &str| {
        format!("POST {path} HTTP/1.1\r\nHost: api.allowed.test\r\n{framing}\r\n{body}")
            .into_bytes()
    };
    // Attacks: a coding list an upstream may read as not chunked (before the fix forwarded
    // as written, with Warren's own chunked body behind it), the list split over two
    // headers, and both framings at once.
    for (path, framing, code) in [
        ("/te-list", "Transfer-Encoding: x, chunked\r\n", 501),
        (
            "/te-split",
            "Transfer-Encoding: x\r\nTransfer-Encoding: chunked\r\n",
            400,
        ),
        (
            "/te-cl",
            "Content-Length: 3\r\nTransfer-Encoding: chunked\r\n",
            400,
        ),
        ("/te-twice", "Transfer-Encoding: chunked, chunked\r\n", 400),
    ] {
        let mut s = topo.guest_tcp(API, 80).await?;
        let r = exchange(&mut s, &request(path, framing)).await?;
        assert_eq!(r.map(|r| r.0), Some(code), "{path}");
        assert!(!seen(&topo, path), "{path} reached the upstream");
    }
    // Control: exactly `chunked`, in any case, goes out as Warren framed it: one
    // `transfer-encoding: chunked`, never the guest's spelling.
    let mut s = topo.guest_tcp(API, 80).await?;
    let r = exchange(
        &mut s,
        &request("/te-ok", "Transfer-Encoding: CHUNKED \r\n"),
    )
    .await?;
    assert_eq!(r.map(|r| r.0), Some(200));
    let head = topo
        .seen()
        .into_iter()
        .find(|h| h.contains("/te-ok"))
        .expect("control reached the upstream");
    assert!(
        head.contains("\r\ntransfer-encoding: chunked\r\n"),
        "{head}"
    );
    assert!(!head.contains("CHUNKED"), "{head}");
    // A length goes out as digits only, once.
    let mut s = topo.guest_tcp(API, 80).await?;
    let r = exchange(
        &mut s,
        b"POST /cl-ok HTTP/1.1\r\nHost: api.allowed.test\r\nContent-Length:  5 \r\n\r\nhello",
    )
    .await?;
    assert_eq!(r.map(|r| r.0), Some(200));
    assert!(
        seen(&topo, "\r\ncontent-length: 5\r\n"),
        "{:?}",
        topo.seen()
    );
    Ok(())
}

/// A rule on `oauth.allowed.test` (whose address has no server: a request that is not
/// answered by the rule gets Warren's `502`).
fn rule_config(topo: &Topology) -> EgressConfig {
    let mut c = plain_config(topo);
    c.intercepts = vec![warren_egress::InterceptRule {
        host: pat("oauth.allowed.test"),
        method: "POST".into(),
        path_prefix: "/oauth/token".into(),
        command: vec![
            "/bin/sh".into(),
            "-c".into(),
            "req=$(head -n 1); cat >/dev/null; body=\"rule:$req\"; \
             printf 'HTTP/1.1 200 OK\\r\\ncontent-length: %d\\r\\n\\r\\n%s' \"${#body}\" \"$body\""
                .into(),
        ],
        uid: 65534,
        gid: 65534,
        timeout: Duration::from_secs(10),
        env: vec![],
    }];
    c
}

#[tokio::test]
async fn test_rules_match_the_target_as_forwarded_and_refuse_other_spellings() -> Result<()> {
    let (topo, egress, _h) = up_with("", rule_config).await?;
    topo.guest_dns("oauth.allowed.test", RecordType::A).await?;
    topo.guest_dns("api.allowed.test", RecordType::A).await?;
    let ca = egress.ca_cert_pem().to_string();
    let send = |target: &'static str, method: &'static str| {
        let topo = &topo;
        let ca = ca.clone();
        async move {
            let mut tls = topo.guest_tls(OAUTH, "oauth.allowed.test", &ca).await?;
            let request = format!(
                "{method} {target} HTTP/1.1\r\nHost: oauth.allowed.test\r\ncontent-length: 3\r\n\r\nx=1"
            );
            anyhow::Ok(exchange(&mut tls, request.as_bytes()).await?)
        }
    };
    // Control: the rule answers the origin-form request.
    let r = send("/oauth/token", "POST").await?;
    assert_eq!(
        r.map(|r| r.1),
        Some("rule:POST /oauth/token HTTP/1.1\r".into())
    );
    // Attack from the review: an absolute-form target skipped the rule and went upstream
    // (502 here, no server). Now it is the rule's request, in origin-form for the command.
    let r = send("https://oauth.allowed.test/oauth/token", "POST").await?;
    assert_eq!(
        r.map(|r| r.1),
        Some("rule:POST /oauth/token HTTP/1.1\r".into())
    );
    // Other spellings a lenient server routes to the rule's path: refused, not forwarded.
    for (target, method) in [
        ("/oauth/./token", "POST"),
        ("//oauth/token", "POST"),
        ("/oauth%2Ftoken", "POST"),
        ("/x/../oauth/token", "POST"),
        ("/OAuth/Token", "POST"),
        ("/oauth/token", "post"),
    ] {
        let r = send(target, method).await?;
        assert_eq!(r.map(|r| r.0), Some(400), "{method} {target}");
    }
    // Control: a path that is not the rule's goes upstream (502: no server there).
    let r = send("/other", "POST").await?;
    assert_eq!(r.map(|r| r.0), Some(502));

    // What the upstream receives is the same origin-form: an absolute-form target on plain
    // HTTP goes out as its path, with `Host` from its authority.
    let mut s = topo.guest_tcp(API, 80).await?;
    let r = exchange(
        &mut s,
        b"GET http://api.allowed.test:80/abs?q=1 HTTP/1.1\r\nHost: API.allowed.test\r\n\r\n",
    )
    .await?;
    assert_eq!(r.map(|r| r.0), Some(200));
    let head = topo
        .seen()
        .into_iter()
        .find(|h| h.contains("/abs?q=1"))
        .expect("reached the upstream");
    assert!(head.starts_with("GET /abs?q=1 HTTP/1.1\r\n"), "{head}");
    assert!(head.contains("\r\nhost: api.allowed.test:80\r\n"), "{head}");
    assert!(!head.contains("API.allowed.test"), "{head}");
    Ok(())
}

const SECRET: &str = "real-secret-value-trace-5e1f";
const PLACEHOLDER: &str = "WARREN_PLACEHOLDER_TRACE_KEY";

#[tokio::test]
async fn test_trace_refused_where_secrets_are_substituted() -> Result<()> {
    let (topo, egress, _h) = up_with("", |t| {
        let mut c = plain_config(t);
        c.secrets = vec![warren_egress::SecretSpec {
            name: "trace-key".into(),
            placeholder: PLACEHOLDER.into(),
            hosts: vec![pat("secret.allowed.test")],
            source: warren_egress::SecretSource::Static(SECRET.into()),
            headers: vec![],
        }];
        c
    })
    .await?;
    topo.guest_dns("secret.allowed.test", RecordType::A).await?;
    let ca = egress.ca_cert_pem().to_string();
    let auth = format!("Authorization: Bearer {PLACEHOLDER}\r\n");
    // Attack: a server that implements TRACE sends the request back, substituted value
    // included (the stand-in echoes every request). Refused before anything is sent.
    for (method, extra) in [
        ("TRACE", String::new()),
        ("trace", String::new()),
        ("TRACK", String::new()),
        ("POST", "X-HTTP-Method-Override: TRACE\r\n".to_string()),
    ] {
        let mut tls = topo.guest_tls(API, "secret.allowed.test", &ca).await?;
        let request = format!(
            "{method} /trace-{method} HTTP/1.1\r\nHost: secret.allowed.test\r\n{auth}{extra}\r\n"
        );
        let r = exchange(&mut tls, request.as_bytes()).await?;
        assert_eq!(r.as_ref().map(|r| r.0), Some(405), "{method} {extra}");
        assert!(
            !r.is_some_and(|r| r.1.contains(SECRET)),
            "{method}: value echoed"
        );
        assert!(!seen(&topo, &format!("/trace-{method}")), "{method} sent");
    }
    // Control: the same connection kind substitutes and relays other methods.
    let mut tls = topo.guest_tls(API, "secret.allowed.test", &ca).await?;
    let r = exchange(&mut tls, &get("secret.allowed.test", "/ok", &auth)).await?;
    assert_eq!(r.map(|r| r.0), Some(200));
    assert!(seen(&topo, SECRET), "control: substituted");
    Ok(())
}
