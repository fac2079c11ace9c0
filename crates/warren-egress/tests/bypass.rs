//! Issue 13, items 5-7: a hostile guest tries to reach a disallowed name that shares an
//! allowed name's address (`shared.denied.test` and `api.allowed.test` are both on the
//! stand-in `API`), to get a secret sent under another `Host`, and to reach the host's own
//! addresses, through every trick the egress once let through: empty lines before the request
//! line, a second request on a keep-alive connection, an absolute-form target, two `Host`
//! headers, HTTP/2 (prior knowledge and `h2c` upgrade), an intercepted TLS connection whose
//! inner `Host` is not its SNI, fronting inside passed-through TLS, and `allow_cidrs` naming an
//! address of the namespace the egress connects out from. Each attack test asserts what the
//! stand-in received (nothing for the denied name) and has a positive control on the same
//! path. Needs root, `ip` and `nft`.

mod common;

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Result;
use common::*;
use hickory_proto::rr::RecordType;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use warren_egress::{
    DomainPattern, Egress, EgressConfig, EgressHandle, SecretSource, SecretSpec, UpstreamRoots,
};

const SECRET: &str = "real-secret-value-c0ffee42";
const PLACEHOLDER: &str = "WARREN_PLACEHOLDER_BYPASS_KEY";
const DENIED: &str = "shared.denied.test";

fn pat(s: &str) -> DomainPattern {
    s.parse().expect("pattern")
}

/// `*.allowed.test` allowed; no secrets, so plain HTTP is not inspected for placeholders
/// (the common case for a VM).
fn plain_config(topo: &Topology) -> EgressConfig {
    let mut cfg = EgressConfig::new("vm-bypass", SocketAddr::new(DNS.into(), 53));
    cfg.policy.allow_domains = vec![pat("*.allowed.test")];
    cfg.upstream_roots = UpstreamRoots::Pem(topo.pki.ca_pem.clone());
    cfg
}

/// The same with a secret for `secret.allowed.test` (also on `API`), so TLS to that name is
/// intercepted.
fn secret_config(topo: &Topology) -> EgressConfig {
    let mut cfg = plain_config(topo);
    cfg.secrets = vec![SecretSpec {
        name: "bypass-key".into(),
        placeholder: PLACEHOLDER.into(),
        hosts: vec![pat("secret.allowed.test")],
        source: SecretSource::Static(SECRET.into()),
        headers: vec![],
    }];
    cfg
}

async fn up(
    cfg: impl FnOnce(&Topology) -> EgressConfig,
) -> Result<(Topology, Egress, EgressHandle)> {
    let (topo, egress, handle) = up_with(SECRET, cfg).await?;
    // The guest resolved the allowed name: its address is allowed by address from now on,
    // which is what a co-hosted name tries to ride on.
    topo.guest_dns("api.allowed.test", RecordType::A).await?;
    Ok((topo, egress, handle))
}

/// Whether any stand-in received a request head mentioning `name`.
fn reached(topo: &Topology, name: &str) -> bool {
    topo.seen()
        .iter()
        .any(|h| h.to_ascii_lowercase().contains(name))
}

/// Refused: no response at all, or an error status from Warren.
fn refused(r: &Option<(u16, String)>) -> bool {
    r.as_ref().is_none_or(|(code, _)| *code >= 400)
}

async fn http(topo: &Topology, request: &[u8]) -> Result<Option<(u16, String)>> {
    let mut s = topo.guest_tcp(API, 80).await?;
    exchange(&mut s, request).await
}

#[tokio::test]
async fn test_disguised_request_line_still_decided_by_host() -> Result<()> {
    let (topo, _e, _h) = up(plain_config).await?;
    for disguise in ["\r\n\r\n", "\n", "\r\n\n"] {
        let req = format!("{disguise}GET /lead HTTP/1.1\r\nHost: {DENIED}\r\n\r\n");
        let r = http(&topo, req.as_bytes()).await?;
        assert!(refused(&r), "leading {disguise:?}: {r:?}");
    }
    let r = http(
        &topo,
        format!("get /lower HTTP/1.1\r\nHost: {DENIED}\r\n\r\n").as_bytes(),
    )
    .await?;
    assert!(refused(&r), "lowercase method: {r:?}");
    assert!(!reached(&topo, DENIED), "{:?}", topo.seen());

    // Positive control: the same disguise towards the allowed name is served.
    let r = http(
        &topo,
        b"\r\n\r\nGET /lead HTTP/1.1\r\nHost: api.allowed.test\r\n\r\n",
    )
    .await?;
    assert_eq!(r.map(|r| r.0), Some(200));
    assert!(reached(&topo, "host: api.allowed.test"));
    Ok(())
}

#[tokio::test]
async fn test_second_request_on_keep_alive_connection_decided() -> Result<()> {
    let (topo, _e, _h) = up(plain_config).await?;
    // Sequential: the first request is allowed and answered, the second names the co-hosted
    // name on the same connection.
    let mut s = topo.guest_tcp(API, 80).await?;
    let first = exchange(&mut s, &get("api.allowed.test", "/one", "")).await?;
    assert_eq!(first.map(|r| r.0), Some(200), "positive control");
    let second = exchange(&mut s, &get(DENIED, "/two", "")).await?;
    assert!(refused(&second), "second request: {second:?}");
    // Pipelined: both requests in one write.
    let mut s = topo.guest_tcp(API, 80).await?;
    let mut both = get("api.allowed.test", "/three", "");
    both.extend_from_slice(&get(DENIED, "/four", ""));
    let first = exchange(&mut s, &both).await?;
    assert_eq!(first.map(|r| r.0), Some(200));
    let mut rest = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut rest)).await;
    let rest = String::from_utf8_lossy(&rest);
    assert!(
        !rest.contains(" 200 "),
        "pipelined second request served: {rest}"
    );
    assert!(!reached(&topo, DENIED), "{:?}", topo.seen());

    // Positive control: keep-alive itself works for the name the connection is for.
    let mut s = topo.guest_tcp(API, 80).await?;
    for path in ["/a", "/b"] {
        let r = exchange(&mut s, &get("api.allowed.test", path, "")).await?;
        assert_eq!(r.map(|r| r.0), Some(200), "{path}");
    }
    Ok(())
}

#[tokio::test]
async fn test_request_naming_two_hosts_refused() -> Result<()> {
    let (topo, _e, _h) = up(plain_config).await?;
    let attacks = [
        // Absolute-form target: servers route by it and ignore Host.
        format!("GET http://{DENIED}/abs HTTP/1.1\r\nHost: api.allowed.test\r\n\r\n"),
        format!("GET http://{DENIED}/abs HTTP/1.1\r\n\r\n"),
        format!(
            "GET http://api.allowed.test@{DENIED}/abs HTTP/1.1\r\nHost: api.allowed.test\r\n\r\n"
        ),
        // Two Host headers: the proxy and the server may read different ones.
        format!("GET /dup HTTP/1.1\r\nHost: api.allowed.test\r\nHost: {DENIED}\r\n\r\n"),
    ];
    for a in &attacks {
        let r = http(&topo, a.as_bytes()).await?;
        assert!(refused(&r), "{a:?}: {r:?}");
    }
    assert!(!reached(&topo, DENIED), "{:?}", topo.seen());

    // Positive control: an absolute-form target naming the connection's own host is served.
    let r = http(
        &topo,
        b"GET http://api.allowed.test/abs HTTP/1.1\r\nHost: api.allowed.test\r\n\r\n",
    )
    .await?;
    assert_eq!(r.map(|r| r.0), Some(200));
    Ok(())
}

#[tokio::test]
async fn test_http2_prior_knowledge_and_h2c_upgrade_refused() -> Result<()> {
    let (topo, egress, _h) = up(secret_config).await?;
    const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
    // Prior knowledge on cleartext: refused before a byte reaches the address.
    let mut s = topo.guest_tcp(API, 80).await?;
    let _ = s.write_all(PREFACE).await;
    let mut buf = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut buf)).await;
    assert!(
        buf.is_empty(),
        "answered: {:?}",
        String::from_utf8_lossy(&buf)
    );
    // ... and inside an intercepted TLS connection (ALPN said http/1.1; the client ignores it).
    let mut tls = topo
        .guest_tls(API, "secret.allowed.test", egress.ca_cert_pem())
        .await?;
    let r = exchange(&mut tls, PREFACE).await?;
    assert!(refused(&r), "{r:?}");
    // ... and after an allowed request on a keep-alive connection.
    let mut s = topo.guest_tcp(API, 80).await?;
    let first = exchange(&mut s, &get("api.allowed.test", "/first", "")).await?;
    assert_eq!(first.map(|r| r.0), Some(200), "positive control");
    let r = exchange(&mut s, PREFACE).await?;
    assert!(refused(&r), "{r:?}");
    assert!(
        !topo.seen().iter().any(|h| h.contains("PRI *")),
        "{:?}",
        topo.seen()
    );

    // An h2c upgrade is never offered upstream (an upgraded connection would carry any
    // :authority); the request itself is served over HTTP/1.1.
    let r = http(
        &topo,
        &get(
            "api.allowed.test",
            "/h2c",
            "Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n",
        ),
    )
    .await?;
    let (code, body) = r.expect("response");
    assert_eq!(code, 200, "{body}");
    assert!(body.starts_with("GET /h2c HTTP/1.1"), "{body}");
    let lower = body.to_ascii_lowercase();
    assert!(
        !lower.contains("upgrade: h2c") && !lower.contains("http2-settings:"),
        "{body}"
    );
    Ok(())
}

/// Collects everything written by the tracing subscriber.
#[derive(Clone, Default)]
struct Capture(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Capture {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("capture lock").extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tokio::test]
async fn test_intercepted_connection_host_must_match_sni_and_secret() -> Result<()> {
    let capture = Capture::default();
    let writer = capture.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::INFO)
        .with_writer(move || writer.clone())
        .finish();
    // current_thread runtime: the proxy's tasks run on this thread, under this subscriber.
    let _guard = tracing::subscriber::set_default(subscriber);
    let (topo, egress, _h) = up(secret_config).await?;
    let ca = egress.ca_cert_pem().to_string();
    let auth = format!("Authorization: Bearer {PLACEHOLDER}\r\n");
    // SNI is the secret's host (so the connection is intercepted and the secret in scope);
    // Host is the co-hosted disallowed name, then an allowed name that is not the secret's.
    for host in [DENIED, "api.allowed.test"] {
        let mut tls = topo.guest_tls(API, "secret.allowed.test", &ca).await?;
        let r = exchange(&mut tls, &get(host, "/steal", &auth)).await?;
        assert!(refused(&r), "Host {host}: {r:?}");
    }
    // A second request with another Host on a connection whose first request matched.
    let mut tls = topo.guest_tls(API, "secret.allowed.test", &ca).await?;
    let r = exchange(&mut tls, &get("secret.allowed.test", "/ok", &auth)).await?;
    let (code, body) = r.expect("positive control");
    assert_eq!(code, 200);
    assert!(
        body.contains(&format!("Bearer {SECRET}")),
        "substituted: {body}"
    );
    let r = exchange(&mut tls, &get(DENIED, "/steal2", &auth)).await?;
    assert!(refused(&r), "{r:?}");

    let seen = topo.seen();
    assert!(!reached(&topo, DENIED), "{seen:?}");
    assert!(!reached(&topo, "/steal"), "{seen:?}");
    let with_secret: Vec<_> = seen.iter().filter(|h| h.contains(SECRET)).collect();
    assert_eq!(
        with_secret.len(),
        1,
        "the secret went out only once: {seen:?}"
    );
    assert!(with_secret[0].contains("Host: secret.allowed.test"));

    tokio::time::sleep(Duration::from_millis(100)).await;
    let logs = String::from_utf8(capture.0.lock().expect("lock").clone())?;
    assert!(
        logs.contains("secret_out_of_scope") && logs.contains("bypass-key"),
        "refusal logged by secret name: {logs}"
    );
    assert!(!logs.contains(SECRET), "secret value in logs");
    Ok(())
}

#[tokio::test]
async fn test_passthrough_tls_fronting_is_the_documented_limit() -> Result<()> {
    // Passed through (no secret or rule for the SNI): the inner Host is invisible to Warren,
    // so a server that also serves the co-hosted name answers for it. This is the known limit
    // docs/egress.md and docs/security.md state; this assertion keeps those docs honest.
    let (topo, _e, _h) = up(plain_config).await?;
    let mut tls = topo
        .guest_tls(API, "www.allowed.test", &topo.pki.ca_pem)
        .await?;
    let r = exchange(&mut tls, &get(DENIED, "/fronted", "")).await?;
    assert_eq!(r.map(|r| r.0), Some(200));
    assert!(reached(&topo, DENIED), "the limit as documented");
    drop(tls);

    // `intercept_all_tls` closes it: every allowed TLS connection is terminated and each
    // request's Host must be the SNI.
    let (topo, egress, _h) = up(|t| {
        let mut cfg = plain_config(t);
        cfg.intercept_all_tls = true;
        cfg
    })
    .await?;
    let mut tls = topo
        .guest_tls(API, "www.allowed.test", egress.ca_cert_pem())
        .await?;
    let r = exchange(&mut tls, &get(DENIED, "/fronted", "")).await?;
    assert!(refused(&r), "{r:?}");
    assert!(!reached(&topo, DENIED), "{:?}", topo.seen());
    // Positive control: the matching Host is served through interception (the guest trusts
    // the VM CA, Warren verifies the stand-in's certificate upstream).
    let mut tls = topo
        .guest_tls(API, "www.allowed.test", egress.ca_cert_pem())
        .await?;
    let r = exchange(&mut tls, &get("www.allowed.test", "/ok", "")).await?;
    assert_eq!(r.map(|r| r.0), Some(200));
    // The stand-in's own certificate is no longer what the guest sees.
    assert!(topo
        .guest_tls(API, "www.allowed.test", &topo.pki.ca_pem)
        .await
        .is_err());
    Ok(())
}

#[tokio::test]
async fn test_outbound_namespace_addresses_refused_even_when_allowed() -> Result<()> {
    // A public-looking address: not in any always-denied range.
    const MOVED: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 77);
    let (topo, _e, _h) = up(|t| {
        let mut cfg = plain_config(t);
        cfg.policy.allow_cidrs = vec![
            format!("{MOVED}/32").parse().expect("net"),
            format!("{UPLINK}/32").parse().expect("net"),
        ];
        cfg
    })
    .await?;
    // Positive control: MOVED on a stand-in host (not one of the outbound namespace's own
    // addresses), allowed by `allow_cidrs`, is reached.
    topo.remote
        .ip(&["addr", "add", &format!("{MOVED}/32"), "dev", "lo"])?;
    echo_at(&topo.remote, MOVED)?;
    assert!(guest_echo(&topo, MOVED).await?, "stand-in not reached");

    // The same address moved onto an interface of the namespace the egress connects out
    // from (a veth pair stands in for a dummy interface: this kernel has no dummy driver),
    // with the same listener: refused, though the allow list names it and it is reachable
    // from that namespace.
    topo.remote
        .ip(&["addr", "del", &format!("{MOVED}/32"), "dev", "lo"])?;
    topo.world
        .ip(&["link", "add", "hd0", "type", "veth", "peer", "name", "hd1"])?;
    topo.world
        .ip(&["addr", "add", &format!("{MOVED}/32"), "dev", "hd0"])?;
    topo.world.ip(&["link", "set", "hd0", "up"])?;
    topo.world.ip(&["link", "set", "hd1", "up"])?;
    echo_at(&topo.world, MOVED)?;
    assert!(world_reaches(&topo.world_out, MOVED, 7).await);
    assert!(!guest_echo(&topo, MOVED).await?, "reached a host address");
    // The outbound namespace's uplink address too.
    echo_at(&topo.world, UPLINK)?;
    assert!(world_reaches(&topo.world_out, UPLINK, 7).await);
    assert!(
        !guest_echo(&topo, UPLINK).await?,
        "reached the uplink address"
    );
    Ok(())
}

#[tokio::test]
async fn test_blocked_cidrs_win_over_allow_cidrs_and_dns() -> Result<()> {
    // ECHO is a stand-in (reachable) address; the operator blocks its range.
    let (topo, _e, _h) = up(|t| {
        let mut cfg = plain_config(t);
        cfg.policy.allow_cidrs = vec!["198.51.100.0/24".parse().expect("net")];
        cfg.policy.blocked_cidrs = vec!["198.51.100.16/28".parse().expect("net")];
        cfg
    })
    .await?;
    assert!(world_reaches(&topo.world_out, ECHO, 7).await);
    assert!(!guest_echo(&topo, ECHO).await?, "blocked address reached");
    let answer = topo.guest_dns("echo.allowed.test", RecordType::A).await?;
    assert!(answer.answers.is_empty(), "{answer:?}");
    // Positive control: the same address without the operator's block.
    let (topo, _e, _h) = up(|t| {
        let mut cfg = plain_config(t);
        cfg.policy.allow_cidrs = vec!["198.51.100.0/24".parse().expect("net")];
        cfg
    })
    .await?;
    assert!(guest_echo(&topo, ECHO).await?, "stand-in not reached");
    Ok(())
}
