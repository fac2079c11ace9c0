//! Issue 20: the credential kinds `warren run` wires (provider API keys bound to one header,
//! tokens that git sends inside `Authorization: Basic`), attacked as a hostile guest would:
//! a placeholder in a header other than the provider's, in a query string, in
//! `Proxy-Authorization` or another header carrying a Basic credential, and Basic credentials
//! bound for a host the secret is not bound to. Every attack asserts what the stand-in
//! received (never the real value), with a positive control on the same connection or path.
//! Needs root, `ip` and `nft`.

mod common;

use std::net::SocketAddr;

use anyhow::Result;
use base64::Engine as _;
use common::*;
use hickory_proto::rr::RecordType;
use warren_egress::{DomainPattern, EgressConfig, SecretSource, SecretSpec, UpstreamRoots};

const KEY: &str = "sk-ant-api03-real-key-3b9d";
const KEY_PH: &str = "sk-ant-api03-warren-placeholder-key";
const TOKEN: &str = "gho_realtoken0123456789abcdef";
const TOKEN_PH: &str = "gho_warrenPlaceholderToken0000";
/// A placeholder much shorter than its value (a JWT's length).
const BIG_PH: &str = "warren-big-ph";

fn pat(s: &str) -> DomainPattern {
    s.parse().expect("pattern")
}

fn b64(s: &str) -> String {
    base64::engine::general_purpose::STANDARD.encode(s)
}

/// An API key bound to `x-api-key` on `secret.allowed.test`; a token bound (to the default
/// `Authorization`) on `www.allowed.test`, standing in for GitHub.
fn config(topo: &Topology) -> EgressConfig {
    let mut cfg = EgressConfig::new("vm-creds", SocketAddr::new(DNS.into(), 53));
    cfg.policy.allow_domains = vec![pat("*.allowed.test")];
    cfg.upstream_roots = UpstreamRoots::Pem(topo.pki.ca_pem.clone());
    cfg.secrets = vec![
        SecretSpec {
            name: "anthropic-api-key".into(),
            placeholder: KEY_PH.into(),
            hosts: vec![pat("secret.allowed.test")],
            source: SecretSource::Static(KEY.into()),
            headers: vec!["x-api-key".into()],
        },
        SecretSpec {
            name: "github-token".into(),
            placeholder: TOKEN_PH.into(),
            hosts: vec![pat("www.allowed.test")],
            source: SecretSource::Static(TOKEN.into()),
            headers: vec![],
        },
        SecretSpec {
            name: "big-token".into(),
            placeholder: BIG_PH.into(),
            hosts: vec![pat("secret.allowed.test")],
            source: SecretSource::Static(big_value()),
            headers: vec!["x-big".into(), "authorization".into()],
        },
    ];
    cfg
}

/// The value behind [`BIG_PH`]: 2,000 bytes.
fn big_value() -> String {
    "J".repeat(2000)
}

/// Whether any stand-in received `needle` in a request head.
fn seen(topo: &Topology, needle: &str) -> bool {
    topo.seen().iter().any(|h| h.contains(needle))
}

/// A placeholder repeated through a header cannot grow the head past 64 KiB with copies of
/// its value (found by a hostile review: ~1,850 copies of a 2 KB token grew a 64 KiB head to
/// 3.5 MiB): such a request is refused with 431 and nothing reaches the upstream. Control:
/// a few occurrences are substituted.
#[tokio::test]
async fn test_substitution_cannot_grow_the_head_past_its_limit() -> Result<()> {
    let (topo, egress, _h) = up_with("", config).await?;
    topo.guest_dns("secret.allowed.test", RecordType::A).await?;
    let mut tls = topo
        .guest_tls(API, "secret.allowed.test", egress.ca_cert_pem())
        .await?;
    let (code, body) = exchange(
        &mut tls,
        &get(
            "secret.allowed.test",
            "/few",
            &format!("x-big: {BIG_PH} {BIG_PH}\r\n"),
        ),
    )
    .await?
    .expect("response");
    assert_eq!(code, 200);
    let big = big_value();
    assert!(body.contains(&format!("x-big: {big} {big}")), "{body}");
    let many = vec![BIG_PH; 40].join(" ");
    let r = exchange(
        &mut tls,
        &get(
            "secret.allowed.test",
            "/many",
            &format!("x-big: {many}\r\n"),
        ),
    )
    .await?;
    assert_eq!(r.map(|(c, _)| c), Some(431));
    assert!(!seen(&topo, "/many"));
    // Inside a Basic credential the growth is counted as sent, re-encoded (found by a
    // hostile review of the first fix): 32 copies add ~62 KiB decoded, ~83 KiB encoded.
    let mut tls = topo
        .guest_tls(API, "secret.allowed.test", egress.ca_cert_pem())
        .await?;
    let basic = b64(&format!("u:{}", vec![BIG_PH; 32].join(" ")));
    let r = exchange(
        &mut tls,
        &get(
            "secret.allowed.test",
            "/basic-many",
            &format!("Authorization: Basic {basic}\r\n"),
        ),
    )
    .await?;
    assert_eq!(r.map(|(c, _)| c), Some(431));
    assert!(!seen(&topo, "/basic-many"));
    Ok(())
}

#[tokio::test]
async fn test_api_key_substituted_only_in_its_providers_header() -> Result<()> {
    let (topo, egress, _h) = up_with("", config).await?;
    topo.guest_dns("secret.allowed.test", RecordType::A).await?;
    let mut tls = topo
        .guest_tls(API, "secret.allowed.test", egress.ca_cert_pem())
        .await?;
    // Positive control: the provider's header gets the real key.
    let (code, body) = exchange(
        &mut tls,
        &get(
            "secret.allowed.test",
            "/v1/messages",
            &format!("x-api-key: {KEY_PH}\r\n"),
        ),
    )
    .await?
    .expect("response");
    assert_eq!(code, 200);
    assert!(body.contains(&format!("x-api-key: {KEY}")), "{body}");
    // Attacks on the same connection: the key's placeholder in Authorization, in another
    // header, in the query string, inside a Basic credential: all go out as the placeholder.
    let (code, body) = exchange(
        &mut tls,
        &get(
            "secret.allowed.test",
            &format!("/v1/echo?key={KEY_PH}"),
            &format!(
                "Authorization: Bearer {KEY_PH}\r\nX-Debug: {KEY_PH}\r\nCookie: k={KEY_PH}\r\n"
            ),
        ),
    )
    .await?
    .expect("response");
    assert_eq!(code, 200);
    assert!(!body.contains(KEY), "{body}");
    for line in [
        format!("GET /v1/echo?key={KEY_PH} "),
        format!("Authorization: Bearer {KEY_PH}"),
        format!("X-Debug: {KEY_PH}"),
        format!("Cookie: k={KEY_PH}"),
    ] {
        assert!(body.contains(&line), "{line} not as sent: {body}");
    }
    let basic = format!("Basic {}", b64(&format!("user:{KEY_PH}")));
    let (code, body) = exchange(
        &mut tls,
        &get(
            "secret.allowed.test",
            "/v1/basic",
            &format!("Authorization: {basic}\r\n"),
        ),
    )
    .await?
    .expect("response");
    assert_eq!(code, 200);
    assert!(body.contains(&format!("Authorization: {basic}")), "{body}");
    // The real key reached the stand-in exactly once: in the control's x-api-key.
    let with_key: Vec<String> = topo
        .seen()
        .into_iter()
        .filter(|h| h.contains(KEY))
        .collect();
    assert_eq!(with_key.len(), 1, "{with_key:?}");
    assert!(with_key[0].starts_with("GET /v1/messages "), "{with_key:?}");
    // Its placeholder to a host it is not bound to: refused before anything is sent.
    topo.guest_dns("www.allowed.test", RecordType::A).await?;
    let mut other = topo
        .guest_tls(API, "www.allowed.test", egress.ca_cert_pem())
        .await?;
    let r = exchange(
        &mut other,
        &get(
            "www.allowed.test",
            "/stolen",
            &format!("x-api-key: {KEY_PH}\r\n"),
        ),
    )
    .await?;
    assert_eq!(r.map(|(c, _)| c), Some(403));
    assert!(!seen(&topo, "/stolen"));
    Ok(())
}

#[tokio::test]
async fn test_token_substituted_inside_basic_authorization_only_for_its_host() -> Result<()> {
    let (topo, egress, _h) = up_with("", config).await?;
    topo.guest_dns("www.allowed.test", RecordType::A).await?;
    let mut tls = topo
        .guest_tls(API, "www.allowed.test", egress.ca_cert_pem())
        .await?;
    // git's form: Basic base64(user:token), decoded, substituted, re-encoded.
    let sent = format!("Basic {}", b64(&format!("x-access-token:{TOKEN_PH}")));
    let real = format!("Basic {}", b64(&format!("x-access-token:{TOKEN}")));
    let (code, body) = exchange(
        &mut tls,
        &get(
            "www.allowed.test",
            "/owner/repo.git/info/refs?service=git-upload-pack",
            &format!("Authorization: {sent}\r\n"),
        ),
    )
    .await?
    .expect("response");
    assert_eq!(code, 200);
    assert!(body.contains(&format!("Authorization: {real}")), "{body}");
    // gh's form: `token X`, substituted as text.
    let (code, body) = exchange(
        &mut tls,
        &get(
            "www.allowed.test",
            "/user",
            &format!("Authorization: token {TOKEN_PH}\r\n"),
        ),
    )
    .await?
    .expect("response");
    assert_eq!(code, 200);
    assert!(
        body.contains(&format!("Authorization: token {TOKEN}")),
        "{body}"
    );
    // Basic credentials anywhere but Authorization are not decoded, so not substituted.
    let (code, body) = exchange(
        &mut tls,
        &get(
            "www.allowed.test",
            "/elsewhere",
            &format!("Proxy-Authorization: {sent}\r\nX-Forwarded-Authorization: {sent}\r\n"),
        ),
    )
    .await?
    .expect("response");
    assert_eq!(code, 200);
    assert!(!body.contains(&real) && !body.contains(TOKEN), "{body}");
    assert!(
        body.contains(&format!("Proxy-Authorization: {sent}")),
        "{body}"
    );

    // The same Basic credential to hosts the token is not bound to: an intercepted one
    // (bound to another secret) and cleartext HTTP to an allowed host. Refused (403), logged,
    // nothing sent; positive control on the same paths without the placeholder.
    topo.guest_dns("secret.allowed.test", RecordType::A).await?;
    let mut other = topo
        .guest_tls(API, "secret.allowed.test", egress.ca_cert_pem())
        .await?;
    let r = exchange(
        &mut other,
        &get(
            "secret.allowed.test",
            "/exfil-tls",
            &format!("Authorization: {sent}\r\n"),
        ),
    )
    .await?;
    assert_eq!(r.map(|(c, _)| c), Some(403));
    topo.guest_dns("api.allowed.test", RecordType::A).await?;
    let mut plain = topo.guest_tcp(API, 80).await?;
    let r = exchange(
        &mut plain,
        &get(
            "api.allowed.test",
            "/exfil-http",
            &format!("Authorization: {sent}\r\n"),
        ),
    )
    .await?;
    assert_eq!(r.map(|(c, _)| c), Some(403));
    assert!(!seen(&topo, "/exfil-"));
    let mut plain = topo.guest_tcp(API, 80).await?;
    let innocent = format!("Basic {}", b64("user:not-a-placeholder"));
    let r = exchange(
        &mut plain,
        &get(
            "api.allowed.test",
            "/control",
            &format!("Authorization: {innocent}\r\n"),
        ),
    )
    .await?;
    assert_eq!(r.map(|(c, _)| c), Some(200));
    assert!(seen(&topo, "/control"));
    // The real token reached the stand-in only in the two substituted requests.
    let n = topo.seen().iter().filter(|h| h.contains(TOKEN)).count();
    let n_basic = topo.seen().iter().filter(|h| h.contains(&real)).count();
    assert_eq!((n, n_basic), (1, 1), "{:?}", topo.seen());
    Ok(())
}
