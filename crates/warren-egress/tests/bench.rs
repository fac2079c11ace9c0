//! Egress benchmark on the test topology: request latency on new connections and download
//! throughput, direct (from the stand-ins' namespace) vs through the proxy (HTTP passthrough,
//! HTTPS passthrough, HTTPS intercepted with substitution). Prints a table (run with
//! `--nocapture`); asserts only that every path works. Bounded: 20 rounds and 32 MiB per case.

mod common;

use std::net::SocketAddrV4;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use common::*;
use hickory_proto::rr::RecordType;
use rustls::pki_types::ServerName;
use warren_egress::bench::{http_bench, HttpBenchParams, HttpBenchReport};
use warren_egress::{
    DomainPattern, Egress, EgressConfig, Outbound, SecretSource, SecretSpec, UpstreamRoots,
};

const DOWNLOAD: usize = 32 * 1024 * 1024;

fn params(host: &str) -> HttpBenchParams {
    HttpBenchParams {
        host: host.into(),
        small_path: "/small".into(),
        large_path: format!("/bytes/{DOWNLOAD}"),
        rounds: 20,
        timeout: Duration::from_secs(120),
    }
}

fn tls_connector(ca_pem: &str) -> Result<tokio_rustls::TlsConnector> {
    Ok(tokio_rustls::TlsConnector::from(Arc::new(client_config(
        ca_pem,
    )?)))
}

async fn plain(out: &Outbound, host: &str) -> Result<HttpBenchReport> {
    let connect = || out.tcp_connect(SocketAddrV4::new(API, 80));
    Ok(http_bench(connect, &params(host)).await?)
}

async fn tls(out: &Outbound, host: &str, ca_pem: &str) -> Result<HttpBenchReport> {
    let connector = tls_connector(ca_pem)?;
    let connect = || {
        let (connector, host) = (connector.clone(), host.to_string());
        async move {
            let tcp = out.tcp_connect(SocketAddrV4::new(API, 443)).await?;
            let name = ServerName::try_from(host).map_err(std::io::Error::other)?;
            connector.connect(name, tcp).await
        }
    };
    Ok(http_bench(connect, &params(host)).await?)
}

fn row(name: &str, r: &HttpBenchReport, base: &HttpBenchReport) {
    println!(
        "{name:<28} p50 {:>8.2?}  p95 {:>8.2?}  {:>8.1} MiB/s  (latency x{:.2}, throughput x{:.2})",
        r.request_p50,
        r.request_p95,
        r.download_mib_s,
        r.request_p50.as_secs_f64() / base.request_p50.as_secs_f64(),
        r.download_mib_s / base.download_mib_s
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_bench_proxy_vs_direct() -> Result<()> {
    let topo = Topology::new("unused").await?;
    let mut cfg = EgressConfig::new("vm-bench", std::net::SocketAddr::new(DNS.into(), 53));
    cfg.policy.allow_domains = vec!["*.allowed.test".parse::<DomainPattern>()?];
    cfg.upstream_roots = UpstreamRoots::Pem(topo.pki.ca_pem.clone());
    cfg.secrets = vec![SecretSpec {
        name: "k".into(),
        placeholder: "WARREN_PLACEHOLDER_BENCH".into(),
        hosts: vec!["secret.allowed.test".parse()?],
        source: SecretSource::Static("bench-secret".into()),
        headers: vec![],
    }];
    cfg.log_burst = 1;
    cfg.log_per_second = 1;
    // The VM has a secret, so plain HTTP goes through the inspecting HTTP/1.1 relay; the HTTPS
    // passthrough case measures the raw two-way copy.
    let egress = Egress::new(cfg, topo.world_out.clone())?;
    let _h = egress.spawn(topo.listeners()?)?;
    topo.guest_dns("api.allowed.test", RecordType::A).await?;
    topo.guest_dns("secret.allowed.test", RecordType::A).await?;

    let direct_http = plain(&topo.world_out, "api.allowed.test").await?;
    let proxy_http = plain(&topo.guest_out, "api.allowed.test").await?;
    let direct_tls = tls(&topo.world_out, "api.allowed.test", &topo.pki.ca_pem).await?;
    let pass_tls = tls(&topo.guest_out, "api.allowed.test", &topo.pki.ca_pem).await?;
    let mitm_tls = tls(&topo.guest_out, "secret.allowed.test", egress.ca_cert_pem()).await?;
    println!(
        "egress benchmark ({} rounds, {} MiB download)",
        20,
        DOWNLOAD >> 20
    );
    row("http direct", &direct_http, &direct_http);
    row("http via proxy (inspected)", &proxy_http, &direct_http);
    row("https direct", &direct_tls, &direct_tls);
    row("https via proxy (passthru)", &pass_tls, &direct_tls);
    row("https via proxy (intercept)", &mitm_tls, &direct_tls);
    for r in [&proxy_http, &pass_tls, &mitm_tls] {
        assert_eq!(r.download_bytes, DOWNLOAD as u64);
    }
    Ok(())
}
