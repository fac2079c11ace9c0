//! Egress modes, presets and the host's extra roots on real network namespaces (the
//! stand-in world of `egress.rs`): internet mode reaches public stand-ins by name and by
//! address, and still refuses private, link-local (metadata), host and denied destinations;
//! an allow list made of a preset reaches that preset's hosts only; extra upstream roots
//! (the host's CA store behind TLS inspection) make intercepted TLS verify. Needs root, `ip`
//! and `nft`.

mod common;

use std::net::{Ipv4Addr, SocketAddr};

use anyhow::Result;
use common::*;
use hickory_proto::op::ResponseCode;
use hickory_proto::rr::RecordType;
use warren_egress::{
    ConfigError, DomainPattern, Egress, EgressConfig, EgressHandle, EgressMode, UpstreamRoots,
};

/// A private (RFC 1918) address given a stand-in listener for this test.
const PRIVATE_192: Ipv4Addr = Ipv4Addr::new(192, 168, 77, 7);

fn pat(s: &str) -> DomainPattern {
    s.parse().expect("pattern")
}

async fn up(
    cfg: impl FnOnce(&Topology) -> EgressConfig,
) -> Result<(Topology, Egress, EgressHandle)> {
    up_with("unused", cfg).await
}

/// An HTTP request from the guest to `ip:80` naming `host`: its status, `None` if refused.
async fn guest_http(topo: &Topology, ip: Ipv4Addr, host: &str) -> Result<Option<u16>> {
    let mut s = topo.guest_tcp(ip, 80).await?;
    Ok(exchange(&mut s, &get(host, "/modes", ""))
        .await?
        .map(|(code, _)| code))
}

fn internet_config(topo: &Topology) -> EgressConfig {
    let mut cfg = EgressConfig::new("vm-modes", SocketAddr::new(DNS.into(), 53));
    cfg.policy.mode = EgressMode::Internet;
    cfg.policy.deny_domains = vec![pat("shared.denied.test")];
    cfg.policy.deny_cidrs = vec![format!("{OTHER}/32").parse().expect("net")];
    cfg.upstream_roots = UpstreamRoots::Pem(topo.pki.ca_pem.clone());
    cfg
}

#[tokio::test]
async fn test_internet_mode_reaches_public_refuses_private_metadata_host_and_denied() -> Result<()>
{
    let (topo, _e, _h) = up(internet_config).await?;

    // Public stand-ins (TEST-NET addresses: the documentation ranges are public here), by
    // names no allow list names, and by address.
    let answer = topo.guest_dns("api.anthropic.com", RecordType::A).await?;
    assert_eq!(a_records(&answer), [API]);
    assert_eq!(
        guest_http(&topo, API, "api.anthropic.com").await?,
        Some(200)
    );
    assert_eq!(guest_http(&topo, API, "www.allowed.test").await?, Some(200));
    let mut tls = topo
        .guest_tls(API, "www.allowed.test", &topo.pki.ca_pem)
        .await?;
    let (code, _) = exchange(&mut tls, &get("www.allowed.test", "/tls", ""))
        .await?
        .expect("TLS response");
    assert_eq!(code, 200);
    // By address: never resolved by anyone, still reached.
    assert!(guest_echo(&topo, ECHO).await?, "public address not reached");
    assert_eq!(guest_http(&topo, API, "203.0.113.10").await?, Some(200));

    // Private, link-local (metadata) and host addresses: each stand-in is reachable from the
    // outbound namespace, so the policy refuses them, not the network.
    topo.remote
        .ip(&["addr", "add", &format!("{PRIVATE_192}/32"), "dev", "lo"])?;
    topo.world.ip(&[
        "route",
        "add",
        &format!("{PRIVATE_192}/32"),
        "via",
        &UPLINK_PEER.to_string(),
    ])?;
    echo_at(&topo.remote, PRIVATE_192)?;
    echo_at(&topo.world, UPLINK)?;
    for (what, ip) in [
        ("10/8", PRIVATE),
        ("192.168/16", PRIVATE_192),
        ("metadata", META),
        ("host address", UPLINK),
    ] {
        assert!(
            world_reaches(&topo.world_out, ip, 7).await,
            "{what}: stand-in missing"
        );
        assert!(!guest_echo(&topo, ip).await?, "{what} reached by address");
    }
    assert_eq!(
        guest_http(&topo, PRIVATE, "private.allowed.test").await?,
        None
    );
    assert_eq!(guest_http(&topo, META, "meta.allowed.test").await?, None);
    // Their names resolve to nothing usable: the resolver never hands those addresses out.
    for name in ["private.allowed.test", "meta.allowed.test"] {
        let answer = topo.guest_dns(name, RecordType::A).await?;
        assert!(a_records(&answer).is_empty(), "{name}: {answer:?}");
    }

    // The deny list wins: a denied name (DNS, Host, SNI) and a denied address.
    let answer = topo.guest_dns("shared.denied.test", RecordType::A).await?;
    assert_eq!(answer.metadata.response_code, ResponseCode::Refused);
    assert_eq!(guest_http(&topo, API, "shared.denied.test").await?, None);
    assert!(topo
        .guest_tls(API, "shared.denied.test", &topo.pki.ca_pem)
        .await
        .is_err());
    assert!(world_reaches(&topo.world_out, OTHER, 7).await);
    assert!(!guest_echo(&topo, OTHER).await?, "denied CIDR reached");
    assert_eq!(guest_http(&topo, OTHER, "other.test").await?, None);
    let answer = topo.guest_dns("other.test", RecordType::A).await?;
    assert!(a_records(&answer).is_empty(), "denied address handed out");
    Ok(())
}

#[tokio::test]
async fn test_allowlist_preset_reaches_its_hosts_only() -> Result<()> {
    let entries = warren_egress::presets::expand_all(&["preset:python".to_string()])?;
    let (topo, _e, _h) = up(|t| {
        let mut cfg = EgressConfig::new("vm-preset", SocketAddr::new(DNS.into(), 53));
        cfg.policy.allow_domains = entries.iter().map(|e| pat(e)).collect();
        cfg.upstream_roots = UpstreamRoots::Pem(t.pki.ca_pem.clone());
        cfg
    })
    .await?;
    // The preset's hosts: the package index and its file host.
    for host in ["pypi.org", "files.pythonhosted.org"] {
        let answer = topo.guest_dns(host, RecordType::A).await?;
        assert_eq!(a_records(&answer), [API], "{host}");
        assert_eq!(guest_http(&topo, API, host).await?, Some(200), "{host}");
    }
    // Another ecosystem's registry on the same address, and anything by address: refused.
    let answer = topo.guest_dns("registry.npmjs.org", RecordType::A).await?;
    assert_eq!(answer.metadata.response_code, ResponseCode::Refused);
    assert_eq!(guest_http(&topo, API, "registry.npmjs.org").await?, None);
    assert!(topo
        .guest_tls(API, "registry.npmjs.org", &topo.pki.ca_pem)
        .await
        .is_err());
    assert!(
        !guest_echo(&topo, ECHO).await?,
        "allow-list mode reached an address"
    );
    // An unknown preset is a configuration error.
    assert!(matches!(
        warren_egress::presets::expand_all(&["preset:pip".to_string()]),
        Err(ConfigError::Preset(_))
    ));
    Ok(())
}

#[tokio::test]
async fn test_host_roots_verify_intercepted_upstream_with_public_roots() -> Result<()> {
    // The stand-in's CA plays the TLS-inspection CA the host alone trusts. With public
    // roots only, an intercepted connection cannot verify its upstream; with the host's
    // roots added, it does.
    let config = |host_roots: Option<String>| {
        let mut cfg = EgressConfig::new("vm-roots", SocketAddr::new(DNS.into(), 53));
        cfg.policy.allow_domains = vec![pat("*.allowed.test")];
        cfg.intercept_all_tls = true;
        cfg.upstream_roots = UpstreamRoots::WebPki;
        cfg.host_roots = host_roots;
        cfg
    };
    for with_host_roots in [false, true] {
        let (topo, egress, _h) = up(|t| {
            let roots = with_host_roots.then(|| t.pki.ca_pem.clone());
            config(roots)
        })
        .await?;
        let mut tls = topo
            .guest_tls(API, "www.allowed.test", egress.ca_cert_pem())
            .await?;
        let got = exchange(&mut tls, &get("www.allowed.test", "/inspected", "")).await;
        let code = match got {
            Ok(Some((code, _))) => Some(code),
            _ => None,
        };
        if with_host_roots {
            assert_eq!(code, Some(200), "host roots not trusted upstream");
        } else {
            assert_ne!(code, Some(200), "verified against public roots alone");
        }
    }
    Ok(())
}
