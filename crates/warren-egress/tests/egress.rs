//! End-to-end egress tests on real network namespaces: a guest namespace whose TCP and DNS
//! are redirected by nftables (so the proxy reads `SO_ORIGINAL_DST`) to Warren's listeners in
//! a VM namespace, and stand-in hosts in a world namespace. Needs root, `ip` and `nft`.

mod common;

use std::io::Write as _;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Result;
use common::*;
use hickory_proto::op::ResponseCode;
use hickory_proto::rr::RecordType;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use warren_egress::{
    DomainPattern, Egress, EgressConfig, EgressHandle, InterceptRule, SecretSource, SecretSpec,
    UpstreamRoots,
};

const SECRET: &str = "real-secret-value-7f3a9c";
const PLACEHOLDER: &str = "WARREN_PLACEHOLDER_API_KEY";
const OTHER_PLACEHOLDER: &str = "WARREN_PLACEHOLDER_OTHER_KEY";

fn pat(s: &str) -> DomainPattern {
    s.parse().expect("pattern")
}

fn base_config(topo: &Topology) -> EgressConfig {
    let mut cfg = EgressConfig::new("vm-test", std::net::SocketAddr::new(DNS.into(), 53));
    cfg.policy.allow_domains = vec![pat("*.allowed.test")];
    cfg.policy.deny_domains = vec![pat("denied.allowed.test")];
    cfg.upstream_roots = UpstreamRoots::Pem(topo.pki.ca_pem.clone());
    cfg.secrets = vec![
        SecretSpec {
            name: "api-key".into(),
            placeholder: PLACEHOLDER.into(),
            hosts: vec![pat("secret.allowed.test")],
            source: SecretSource::Static(SECRET.into()),
            headers: vec![],
        },
        SecretSpec {
            name: "other-key".into(),
            placeholder: OTHER_PLACEHOLDER.into(),
            hosts: vec![pat("elsewhere.allowed.test")],
            source: SecretSource::Static("other-real-value-55".into()),
            headers: vec![],
        },
    ];
    cfg.secret_headers = vec!["x-api-key".into()];
    cfg
}

async fn up(
    cfg: impl FnOnce(&Topology) -> EgressConfig,
) -> Result<(Topology, Egress, EgressHandle)> {
    up_with(SECRET, cfg).await
}

#[tokio::test]
async fn test_allowed_name_reachable_over_http_and_https_passthrough() -> Result<()> {
    let (topo, _e, _h) = up(base_config).await?;
    let answer = topo.guest_dns("api.allowed.test", RecordType::A).await?;
    assert_eq!(a_records(&answer), vec![API]);

    let mut s = topo.guest_tcp(API, 80).await?;
    let (code, body) = exchange(&mut s, &get("api.allowed.test", "/hello", ""))
        .await?
        .expect("response");
    assert_eq!(code, 200);
    assert!(body.starts_with("GET /hello HTTP/1.1"), "{body}");

    // Passthrough: the guest sees the upstream's own certificate (test CA), not Warren's.
    let mut tls = topo
        .guest_tls(API, "www.allowed.test", &topo.pki.ca_pem)
        .await?;
    let (code, body) = exchange(&mut tls, &get("www.allowed.test", "/tls", ""))
        .await?
        .expect("response");
    assert_eq!(code, 200);
    assert!(body.contains("GET /tls"));
    // ALPN is whatever upstream picked (the stand-in offers none): not altered by Warren.
    Ok(())
}

#[tokio::test]
async fn test_disallowed_name_refused_dns_http_tls() -> Result<()> {
    let (topo, _e, _h) = up(base_config).await?;
    let answer = topo.guest_dns("other.test", RecordType::A).await?;
    assert_eq!(answer.metadata.response_code, ResponseCode::Refused);
    assert!(answer.answers.is_empty());
    let answer = topo.guest_dns("denied.allowed.test", RecordType::A).await?;
    assert_eq!(answer.metadata.response_code, ResponseCode::Refused);

    let mut s = topo.guest_tcp(OTHER, 80).await?;
    assert!(exchange(&mut s, &get("other.test", "/", ""))
        .await?
        .is_none());
    assert!(topo
        .guest_tls(OTHER, "other.test", &topo.pki.ca_pem)
        .await
        .is_err());
    // Sanity: the stand-in is there; policy refused it.
    assert!(world_reaches(&topo.world_out, OTHER, 80).await);
    Ok(())
}

#[tokio::test]
async fn test_direct_ip_tcp_refused_until_allowed_name_resolves() -> Result<()> {
    let (topo, _e, _h) = up(base_config).await?;
    let mut s = topo.guest_tcp(ECHO, 7).await?;
    let _ = s.write_all(b"ping\r\n").await;
    let mut buf = [0u8; 6];
    let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
        .await?
        .unwrap_or(0);
    assert_eq!(n, 0, "direct IP must be refused");

    let answer = topo.guest_dns("echo.allowed.test", RecordType::A).await?;
    assert_eq!(a_records(&answer), vec![ECHO]);
    let mut s = topo.guest_tcp(ECHO, 7).await?;
    s.write_all(b"ping\r\n").await?;
    s.read_exact(&mut buf).await?;
    assert_eq!(&buf, b"ping\r\n");
    Ok(())
}

#[tokio::test]
async fn test_server_speaks_first_client_still_checked_by_name() -> Result<()> {
    let (topo, _e, _h) = up(base_config).await?;
    topo.guest_dns("api.allowed.test", RecordType::A).await?;
    // Silent past the first-bytes wait, then a request with a disallowed Host to an allowed
    // address: decided by name before anything is forwarded.
    let mut s = topo.guest_tcp(API, 80).await?;
    tokio::time::sleep(warren_egress::FIRST_BYTES_WAIT + Duration::from_millis(300)).await;
    assert!(exchange(&mut s, &get("shared.denied.test", "/", ""))
        .await?
        .is_none());
    let mut s = topo.guest_tcp(API, 80).await?;
    tokio::time::sleep(warren_egress::FIRST_BYTES_WAIT + Duration::from_millis(300)).await;
    let (code, _) = exchange(&mut s, &get("api.allowed.test", "/", ""))
        .await?
        .expect("response");
    assert_eq!(code, 200);
    Ok(())
}

#[tokio::test]
async fn test_sni_and_host_mismatch_refused() -> Result<()> {
    let (topo, _e, _h) = up(base_config).await?;
    topo.guest_dns("api.allowed.test", RecordType::A).await?;
    // Allowed name, but its address is API, not OTHER.
    assert!(topo
        .guest_tls(OTHER, "api.allowed.test", &topo.pki.ca_pem)
        .await
        .is_err());
    let mut s = topo.guest_tcp(OTHER, 80).await?;
    assert!(exchange(&mut s, &get("api.allowed.test", "/", ""))
        .await?
        .is_none());
    Ok(())
}

#[tokio::test]
async fn test_disallowed_name_sharing_allowed_address_refused() -> Result<()> {
    let (topo, _e, _h) = up(base_config).await?;
    topo.guest_dns("api.allowed.test", RecordType::A).await?;
    assert!(topo
        .guest_tls(API, "shared.denied.test", &topo.pki.ca_pem)
        .await
        .is_err());
    let mut s = topo.guest_tcp(API, 80).await?;
    assert!(exchange(&mut s, &get("shared.denied.test", "/", ""))
        .await?
        .is_none());
    Ok(())
}

#[tokio::test]
async fn test_metadata_and_private_ranges_blocked_even_if_dns_says_so() -> Result<()> {
    let (topo, _e, _h) = up(base_config).await?;
    for name in ["meta.allowed.test", "private.allowed.test"] {
        let answer = topo.guest_dns(name, RecordType::A).await?;
        assert!(a_records(&answer).is_empty(), "{name}: {answer:?}");
    }
    for (ip, host) in [
        (META, "meta.allowed.test"),
        (PRIVATE, "private.allowed.test"),
    ] {
        assert!(
            world_reaches(&topo.world_out, ip, 80).await,
            "stand-in at {ip}"
        );
        let mut s = topo.guest_tcp(ip, 80).await?;
        assert!(
            exchange(&mut s, &get(host, "/", "")).await?.is_none(),
            "{ip}"
        );
        let mut s = topo.guest_tcp(ip, 7).await?;
        let _ = s.write_all(b"ping\r\n").await;
        let mut buf = [0u8; 6];
        let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
            .await?
            .unwrap_or(0);
        assert_eq!(n, 0, "{ip}:7");
    }
    Ok(())
}

#[tokio::test]
async fn test_aaaa_and_other_types_empty() -> Result<()> {
    let (topo, _e, _h) = up(base_config).await?;
    let answer = topo.guest_dns("api.allowed.test", RecordType::AAAA).await?;
    assert_eq!(answer.metadata.response_code, ResponseCode::NoError);
    assert!(answer.answers.is_empty());
    let answer = topo.guest_dns("api.allowed.test", RecordType::TXT).await?;
    assert!(answer.answers.is_empty());
    Ok(())
}

#[tokio::test]
async fn test_placeholder_substituted_in_headers_only_for_its_host() -> Result<()> {
    let (topo, egress, _h) = up(base_config).await?;
    topo.guest_dns("secret.allowed.test", RecordType::A).await?;
    let mut tls = topo
        .guest_tls(API, "secret.allowed.test", egress.ca_cert_pem())
        .await?;
    assert_eq!(
        tls.get_ref().1.alpn_protocol(),
        Some(&b"http/1.1"[..]),
        "h2 must not be offered"
    );
    let req = post(
        "secret.allowed.test",
        "/echo",
        &format!("Authorization: Bearer {PLACEHOLDER}\r\nX-Api-Key: {PLACEHOLDER}\r\nX-Other: {PLACEHOLDER}\r\n"),
        &format!("body has {PLACEHOLDER}"),
    );
    let (code, body) = exchange(&mut tls, &req).await?.expect("response");
    assert_eq!(code, 200);
    assert!(
        body.contains(&format!("Authorization: Bearer {SECRET}")),
        "{body}"
    );
    assert!(body.contains(&format!("X-Api-Key: {SECRET}")), "{body}");
    assert!(
        body.contains(&format!("X-Other: {PLACEHOLDER}")),
        "unconfigured header untouched: {body}"
    );
    assert!(
        body.ends_with(&format!("body has {PLACEHOLDER}")),
        "body untouched: {body}"
    );
    // Second request on the same keep-alive connection is substituted too.
    let (code, body) = exchange(
        &mut tls,
        &get(
            "secret.allowed.test",
            "/again",
            &format!("Authorization: {PLACEHOLDER}\r\n"),
        ),
    )
    .await?
    .expect("response");
    assert_eq!(code, 200);
    assert!(body.contains(&format!("Authorization: {SECRET}")), "{body}");
    // No reverse substitution: what upstream sends reaches the guest unchanged.
    let (code, body) = exchange(&mut tls, &get("secret.allowed.test", "/leak", ""))
        .await?
        .expect("response");
    assert_eq!(code, 200);
    assert_eq!(body, format!("{LEAK_MARK}{SECRET}"));
    Ok(())
}

#[tokio::test]
async fn test_placeholder_for_other_host_blocked() -> Result<()> {
    let (topo, egress, _h) = up(base_config).await?;
    topo.guest_dns("secret.allowed.test", RecordType::A).await?;
    let mut tls = topo
        .guest_tls(API, "secret.allowed.test", egress.ca_cert_pem())
        .await?;
    let (code, _) = exchange(
        &mut tls,
        &get(
            "secret.allowed.test",
            "/",
            &format!("X-Custom: {OTHER_PLACEHOLDER}\r\n"),
        ),
    )
    .await?
    .expect("response");
    assert_eq!(code, 403);
    // Cleartext HTTP to an allowed host that is not the secret's: blocked too.
    topo.guest_dns("api.allowed.test", RecordType::A).await?;
    let mut s = topo.guest_tcp(API, 80).await?;
    let (code, _) = exchange(
        &mut s,
        &get(
            "api.allowed.test",
            "/",
            &format!("Authorization: {PLACEHOLDER}\r\n"),
        ),
    )
    .await?
    .expect("response");
    assert_eq!(code, 403);
    Ok(())
}

#[tokio::test]
async fn test_secret_file_rotation_takes_effect_on_next_connection() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("token");
    std::fs::write(&file, "first-value-111\n")?;
    let path = file.clone();
    let (topo, egress, _h) = up(move |t| {
        let mut cfg = base_config(t);
        cfg.secrets[0].source = SecretSource::File(path);
        cfg
    })
    .await?;
    topo.guest_dns("secret.allowed.test", RecordType::A).await?;
    let auth = format!("Authorization: Bearer {PLACEHOLDER}\r\n");
    let mut tls = topo
        .guest_tls(API, "secret.allowed.test", egress.ca_cert_pem())
        .await?;
    let (_, body) = exchange(&mut tls, &get("secret.allowed.test", "/1", &auth))
        .await?
        .expect("response");
    assert!(body.contains("Bearer first-value-111\r\n"), "{body}");
    std::fs::File::create(&file)?.write_all(b"second-value-222")?;
    let mut tls = topo
        .guest_tls(API, "secret.allowed.test", egress.ca_cert_pem())
        .await?;
    let (_, body) = exchange(&mut tls, &get("secret.allowed.test", "/2", &auth))
        .await?
        .expect("response");
    assert!(body.contains("Bearer second-value-222\r\n"), "{body}");
    Ok(())
}

fn rule(script: &str, timeout: Duration) -> InterceptRule {
    InterceptRule {
        host: pat("oauth.allowed.test"),
        method: "POST".into(),
        path_prefix: "/oauth/token".into(),
        command: vec!["/bin/sh".into(), "-c".into(), script.into()],
        uid: 65534,
        gid: 65534,
        timeout,
        env: vec![(
            "MARK_DIR".into(),
            std::env::temp_dir().display().to_string(),
        )],
    }
}

#[tokio::test]
async fn test_interception_rule_answered_by_command() -> Result<()> {
    let dir = tempfile::tempdir()?;
    std::fs::set_permissions(
        dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o777),
    )?;
    let lock = dir.path().join("lock");
    // Echo back the uid, whether another run overlaps (mkdir lock), and the request body.
    let script = format!(
        "mkdir {lock} || exit 3; req=$(cat); sleep 0.3; rmdir {lock}; \
         body=\"uid=$(id -u) $WARREN_INTERCEPT_METHOD $WARREN_INTERCEPT_PATH ${{req##*$(printf '\\r\\n\\r')}}\"; \
         printf 'HTTP/1.1 200 OK\\r\\ncontent-length: %d\\r\\n\\r\\n%s' \"${{#body}}\" \"$body\"",
        lock = lock.display()
    );
    let (topo, egress, _h) = up(move |t| {
        let mut cfg = base_config(t);
        cfg.intercepts = vec![rule(&script, Duration::from_secs(10))];
        cfg
    })
    .await?;
    topo.guest_dns("oauth.allowed.test", RecordType::A).await?;
    let ca = egress.ca_cert_pem().to_string();
    let one = async {
        let mut tls = topo.guest_tls(OAUTH, "oauth.allowed.test", &ca).await?;
        exchange(
            &mut tls,
            &post(
                "oauth.allowed.test",
                "/oauth/token?x=1",
                "",
                "grant=refresh",
            ),
        )
        .await
    };
    let two = async {
        let mut tls = topo.guest_tls(OAUTH, "oauth.allowed.test", &ca).await?;
        exchange(
            &mut tls,
            &post("oauth.allowed.test", "/oauth/token", "", "grant=second"),
        )
        .await
    };
    let (a, b) = tokio::join!(one, two);
    let (code, body) = a?.expect("response");
    assert_eq!(code, 200, "{body}");
    assert!(
        body.starts_with("uid=65534 POST /oauth/token?x=1"),
        "{body}"
    );
    assert!(body.ends_with("grant=refresh"), "{body}");
    let (code, body) = b?.expect("response");
    assert_eq!(code, 200, "single flight: {body}");
    // Nothing listens on OAUTH:443 in the world namespace: the upstream was never needed.
    assert!(!world_reaches(&topo.world_out, OAUTH, 443).await);

    // Over the 64 KiB cap: 413.
    let mut tls = topo.guest_tls(OAUTH, "oauth.allowed.test", &ca).await?;
    let big = "x".repeat(70 * 1024);
    let (code, _) = exchange(
        &mut tls,
        &post("oauth.allowed.test", "/oauth/token", "", &big),
    )
    .await?
    .expect("response");
    assert_eq!(code, 413);
    Ok(())
}

#[tokio::test]
async fn test_interception_rule_timeout_kills_process_group() -> Result<()> {
    let dir = tempfile::tempdir()?;
    std::fs::set_permissions(
        dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o777),
    )?;
    let pidfile = dir.path().join("pid");
    let script = format!("sleep 30 & echo $! > {}; wait", pidfile.display());
    let (topo, egress, _h) = up(move |t| {
        let mut cfg = base_config(t);
        cfg.intercepts = vec![rule(&script, Duration::from_secs(1))];
        cfg
    })
    .await?;
    topo.guest_dns("oauth.allowed.test", RecordType::A).await?;
    let mut tls = topo
        .guest_tls(OAUTH, "oauth.allowed.test", egress.ca_cert_pem())
        .await?;
    let started = Instant::now();
    let (code, _) = exchange(
        &mut tls,
        &post("oauth.allowed.test", "/oauth/token", "", "x"),
    )
    .await?
    .expect("response");
    assert_eq!(code, 504);
    assert!(started.elapsed() < Duration::from_secs(5));
    let pid: i32 = std::fs::read_to_string(&pidfile)?.trim().parse()?;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        !std::path::Path::new(&format!("/proc/{pid}")).exists()
            || std::fs::read_to_string(format!("/proc/{pid}/stat"))?.contains(") Z "),
        "grandchild {pid} survived"
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
async fn test_logs_never_carry_secret_values() -> Result<()> {
    let capture = Capture::default();
    let writer = capture.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_writer(move || writer.clone())
        .finish();
    // current_thread runtime: the proxy's tasks run on this thread, under this subscriber.
    let _guard = tracing::subscriber::set_default(subscriber);
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("token");
    std::fs::write(&file, "file-secret-9d8e7f\n")?;
    let path = file.clone();
    let (topo, egress, _h) = up(move |t| {
        let mut cfg = base_config(t);
        cfg.secrets[1].source = SecretSource::File(path);
        cfg.secrets[1].hosts = vec![pat("secret.allowed.test")];
        cfg
    })
    .await?;
    topo.guest_dns("secret.allowed.test", RecordType::A).await?;
    let mut tls = topo
        .guest_tls(API, "secret.allowed.test", egress.ca_cert_pem())
        .await?;
    let hdrs = format!("Authorization: {PLACEHOLDER}\r\nX-Api-Key: {OTHER_PLACEHOLDER}\r\n");
    let (code, body) = exchange(&mut tls, &get("secret.allowed.test", "/", &hdrs))
        .await?
        .expect("response");
    assert_eq!(code, 200);
    assert!(body.contains(SECRET) && body.contains("file-secret-9d8e7f"));
    // A blocked placeholder and an unreadable secret file are logged, without values.
    let mut s = topo.guest_tcp(API, 80).await?;
    topo.guest_dns("api.allowed.test", RecordType::A).await?;
    let _ = exchange(
        &mut s,
        &get(
            "api.allowed.test",
            "/",
            &format!("Authorization: {PLACEHOLDER}\r\n"),
        ),
    )
    .await?;
    std::fs::remove_file(&file)?;
    let mut tls = topo
        .guest_tls(API, "secret.allowed.test", egress.ca_cert_pem())
        .await?;
    let (code, _) = exchange(&mut tls, &get("secret.allowed.test", "/", &hdrs))
        .await?
        .expect("response");
    assert_eq!(code, 502);
    tokio::time::sleep(Duration::from_millis(100)).await;

    let logs = String::from_utf8(capture.0.lock().expect("lock").clone())?;
    assert!(logs.contains("egress allowed"), "{logs}");
    assert!(logs.contains("secret_out_of_scope"), "{logs}");
    assert!(logs.contains("secret unavailable"), "{logs}");
    for value in [SECRET, "file-secret-9d8e7f", "other-real-value-55"] {
        assert!(!logs.contains(value), "secret value in logs");
    }
    Ok(())
}
