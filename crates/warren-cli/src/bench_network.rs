//! `warren bench --suite network`: HTTP from a real guest to a stand-in host through the
//! VM's egress proxy, against the same client on the host with and without a proxy, in the
//! same run.
//!
//! Three cases, each measured as (n) new-connection request latency (connect, TLS if any,
//! one small request, whole response; median of `--iterations`) and (o) bulk download
//! throughput (`--mib` MiB, median of `--boots` downloads):
//! - `http`: plain HTTP, relayed by the proxy's inspecting HTTP/1.1 relay (the VM has a
//!   secret, so cleartext requests are checked for misplaced placeholders);
//! - `https_passthrough`: HTTPS to a host no secret names: the proxy checks the SNI and then
//!   copies bytes (the client verifies the stand-in's own certificate);
//! - `https_intercepted`: HTTPS to the host a secret is scoped to: the proxy terminates TLS
//!   with the VM CA (the guest trusts it through `SSL_CERT_FILE`), substitutes the secret in
//!   `Authorization` and re-originates TLS to the stand-in.
//!
//! Vantage points, all running `bench_network.py` (python urllib):
//! - guest: a VM of `--image` (needs python3: use `dev`) with a NIC behind its egress;
//! - host via proxy: the host, in the client namespace of an egress [`Topology`] with an
//!   egress of the same configuration running in this process: the proxy's cost without TCG;
//! - host direct: the host, in the namespace the egress connects out from (the topology's
//!   world), no proxy and no VM (the baseline).
//!
//! The stand-ins (HTTP/HTTPS/DNS) live in the topology's remote namespace, routed from its
//! world namespace; the VM's egress connects out from world, so no packet leaves this machine.

use std::collections::BTreeMap;
use std::net::{SocketAddr, SocketAddrV4};
use std::path::Path;

use anyhow::{bail, Context, Result};
use warren_core::{CreateVm, NetworkRequest, Warren};
use warren_egress::standin::{Topology, API, DNS};
use warren_egress::{DomainPattern, Egress, EgressConfig, SecretSource, SecretSpec, UpstreamRoots};

use crate::bench::{discard_private_warren, median, pct, private_warren, run_argv};
use crate::cli::{BenchArgs, Cli};

/// The client, run unchanged in the guest and on the host.
const CLIENT: &str = include_str!("bench_network.py");
/// A stand-in host no secret names: HTTP and passthrough HTTPS.
const PLAIN_HOST: &str = "api.allowed.test";
/// The stand-in host the secret is scoped to: intercepted HTTPS.
const SECRET_HOST: &str = "secret.allowed.test";
const PLACEHOLDER: &str = "WARREN_PLACEHOLDER_bench_network";
/// Unrecorded rounds before the latency samples.
const WARMUP: usize = 3;

/// One case from one vantage point.
#[derive(serde::Serialize, Clone, Copy)]
struct Figures {
    latency_ms_p50: f64,
    latency_ms_p95: f64,
    mib_s_median: f64,
}

/// The three cases from one vantage point (`https_intercepted`: none without a proxy).
#[derive(serde::Serialize)]
struct Vantage {
    http: Figures,
    https_passthrough: Figures,
    https_intercepted: Option<Figures>,
}

impl Vantage {
    /// Case `i` in the order http, passthrough, intercepted.
    fn case(&self, i: usize) -> Option<Figures> {
        match i {
            0 => Some(self.http),
            1 => Some(self.https_passthrough),
            _ => self.https_intercepted,
        }
    }
}

#[derive(serde::Serialize)]
struct Report {
    accel: String,
    iterations: usize,
    bulk_mib: usize,
    bulk_rounds: usize,
    host_direct: Vantage,
    host_via_proxy: Vantage,
    guest_via_proxy: Vantage,
    /// Intercepted / passthrough HTTPS, guest: latency and throughput.
    guest_intercepted_vs_passthrough_latency: f64,
    guest_intercepted_vs_passthrough_throughput: f64,
    /// The same on the host (the proxy's own share).
    host_intercepted_vs_passthrough_latency: f64,
    host_intercepted_vs_passthrough_throughput: f64,
    /// Guest name lookups through Warren's resolver (getaddrinfo), p50.
    guest_dns_ms_p50: f64,
}

pub async fn run(cli: &Cli, args: &BenchArgs) -> Result<i32> {
    if args.boots == 0 || args.iterations == 0 || args.mib == 0 {
        bail!("--boots, --iterations and --mib must be positive");
    }
    let (w, state) = private_warren(cli, args, "network")?;
    // The topology's namespaces are removed when it drops, after the VM (whose egress
    // connects out from its world namespace) is destroyed.
    let r = match Topology::new("unused").await {
        Ok(topo) => {
            let r = measure(&w, args, &state, &topo).await;
            discard_private_warren(&w, &state).await;
            drop(topo);
            r
        }
        Err(e) => {
            discard_private_warren(&w, &state).await;
            Err(e.into())
        }
    };
    let r = r?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        print_report(&r);
    }
    Ok(0)
}

/// The client's JSON input for `cases` from one vantage point.
fn client_input(args: &BenchArgs, cases: &[(&str, &str, &str)], cadata: &str, pin: bool) -> String {
    let cases: Vec<serde_json::Value> = cases
        .iter()
        .map(|(name, scheme, host)| {
            let headers = if *host == SECRET_HOST {
                serde_json::json!({ "Authorization": format!("Bearer {PLACEHOLDER}") })
            } else {
                serde_json::json!({})
            };
            serde_json::json!({
                "name": name, "url": format!("{scheme}://{host}"), "host": host,
                "headers": headers,
            })
        })
        .collect();
    let pin: BTreeMap<&str, String> = if pin {
        [
            (PLAIN_HOST, API.to_string()),
            (SECRET_HOST, API.to_string()),
        ]
        .into()
    } else {
        BTreeMap::new()
    };
    serde_json::json!({
        "cases": cases, "n": args.iterations, "warmup": WARMUP,
        "bulk_bytes": args.mib * 1024 * 1024, "bulk_rounds": args.boots,
        "cadata": cadata, "pin": pin,
    })
    .to_string()
}

const ALL_CASES: [(&str, &str, &str); 3] = [
    ("http", "http", PLAIN_HOST),
    ("https_passthrough", "https", PLAIN_HOST),
    ("https_intercepted", "https", SECRET_HOST),
];

/// The client's samples.
#[derive(serde::Deserialize)]
struct Samples {
    latency_ms: BTreeMap<String, Vec<f64>>,
    mib_s: BTreeMap<String, Vec<f64>>,
    dns_ms: Vec<f64>,
}

impl Samples {
    fn parse(out: &str) -> Result<Self> {
        let line = out.trim().lines().last().unwrap_or_default();
        serde_json::from_str(line).with_context(|| format!("client output {out:?}"))
    }

    fn figures(&mut self, case: &str) -> Option<Figures> {
        let lat = self.latency_ms.get_mut(case)?;
        let mib = self.mib_s.get_mut(case)?;
        Some(Figures {
            latency_ms_p50: median(lat),
            latency_ms_p95: pct(lat, 0.95),
            mib_s_median: median(mib),
        })
    }

    fn vantage(&mut self) -> Result<Vantage> {
        Ok(Vantage {
            http: self.figures("http").context("no http figures")?,
            https_passthrough: self
                .figures("https_passthrough")
                .context("no passthrough figures")?,
            https_intercepted: self.figures("https_intercepted"),
        })
    }
}

/// Runs the client on the host inside network namespace `ns`.
async fn host_client(ns: &str, input: &str) -> Result<Samples> {
    let out = tokio::process::Command::new("ip")
        .args(["netns", "exec", ns, "python3", "-c", CLIENT, input])
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .context("running python3 on the host")?;
    if !out.status.success() {
        bail!(
            "host client in {ns}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Samples::parse(&String::from_utf8_lossy(&out.stdout))
}

/// The egress configuration of both proxies: the two stand-in names allowed, a file-backed
/// secret scoped to `SECRET_HOST`, upstream TLS verified against the stand-in CA.
struct NetFiles {
    secret: std::path::PathBuf,
    roots: std::path::PathBuf,
}

fn host_egress(topo: &Topology, files: &NetFiles) -> Result<Egress> {
    let mut cfg = EgressConfig::new("bench-host", SocketAddr::V4(SocketAddrV4::new(DNS, 53)));
    cfg.policy.allow_domains = vec![
        PLAIN_HOST.parse::<DomainPattern>()?,
        SECRET_HOST.parse::<DomainPattern>()?,
    ];
    cfg.upstream_roots = UpstreamRoots::Pem(topo.pki.ca_pem.clone());
    cfg.secrets = vec![SecretSpec {
        name: "bench".into(),
        placeholder: PLACEHOLDER.into(),
        hosts: vec![SECRET_HOST.parse()?],
        source: SecretSource::File(files.secret.clone()),
        headers: vec![],
    }];
    // Every decision is logged at info (below this process's default level) instead of
    // being rate-limited, which would print a warning for each dry spell.
    cfg.log_burst = u32::MAX;
    cfg.log_per_second = u32::MAX;
    Ok(Egress::new(cfg, topo.world_out.clone())?)
}

fn vm_network(topo: &Topology, files: &NetFiles) -> NetworkRequest {
    NetworkRequest {
        allow: vec![PLAIN_HOST.into(), SECRET_HOST.into()],
        deny: vec![],
        secrets: vec![warren_vmm::NetSecret {
            name: "bench".into(),
            placeholder: PLACEHOLDER.into(),
            hosts: vec![SECRET_HOST.into()],
            file: files.secret.clone(),
            json_pointer: None,
            headers: vec![],
        }],
        upstream_dns: Some(SocketAddr::V4(SocketAddrV4::new(DNS, 53))),
        outbound_netns: Some(topo.world.path()),
        upstream_roots: Some(files.roots.clone()),
        ..Default::default()
    }
}

async fn measure(w: &Warren, args: &BenchArgs, state: &Path, topo: &Topology) -> Result<Report> {
    let files = NetFiles {
        secret: state.join("bench-secret"),
        roots: state.join("standin-ca.pem"),
    };
    std::fs::write(&files.secret, "bench-secret-value\n")?;
    std::fs::write(&files.roots, &topo.pki.ca_pem)?;

    // Host baselines first (the VM is not running yet, so they see an idle machine's share).
    eprintln!("host: direct");
    let direct_cases = &ALL_CASES[..2];
    let mut direct = host_client(
        &topo.world.name,
        &client_input(args, direct_cases, &topo.pki.ca_pem, true),
    )
    .await?;
    eprintln!("host: via proxy");
    let egress = host_egress(topo, &files)?;
    let handle = egress.spawn(topo.listeners()?)?;
    let cadata = format!("{}{}", topo.pki.ca_pem, egress.ca_cert_pem());
    let proxied = host_client(
        &topo.guest.name,
        &client_input(args, &ALL_CASES, &cadata, true),
    )
    .await;
    drop(handle);
    let mut proxied = proxied?;

    eprintln!("guest: booting a VM of {}", args.image);
    let create = CreateVm {
        image: Some(args.image.clone()),
        network: Some(vm_network(topo, &files)),
        ..Default::default()
    };
    let vm = w.create_vm(&create, &mut |_| {}).await?;
    if run_argv(
        w,
        &vm.id,
        vec!["python3".into(), "-c".into(), "pass".into()],
    )
    .await
    .is_err()
    {
        bail!("image {} has no python3 (use --image dev)", args.image);
    }
    eprintln!("guest: via proxy");
    // The guest trusts the VM CA through SSL_CERT_FILE; the stand-in CA is added for the
    // passthrough case, which sees the stand-in's own certificate.
    let input = client_input(args, &ALL_CASES, &topo.pki.ca_pem, false);
    let mut guest = Samples::parse(
        &run_argv(
            w,
            &vm.id,
            vec!["python3".into(), "-c".into(), CLIENT.into(), input],
        )
        .await?,
    )?;
    w.destroy_vm(&vm.id).await?;

    let host_direct = direct.vantage()?;
    let host_via_proxy = proxied.vantage()?;
    let guest_via_proxy = guest.vantage()?;
    let ratio = |v: &Vantage| -> (f64, f64) {
        match v.https_intercepted {
            Some(i) => (
                i.latency_ms_p50 / v.https_passthrough.latency_ms_p50,
                i.mib_s_median / v.https_passthrough.mib_s_median,
            ),
            None => (f64::NAN, f64::NAN),
        }
    };
    let (gl, gt) = ratio(&guest_via_proxy);
    let (hl, ht) = ratio(&host_via_proxy);
    Ok(Report {
        accel: vm.accel,
        iterations: args.iterations,
        bulk_mib: args.mib,
        bulk_rounds: args.boots,
        host_direct,
        host_via_proxy,
        guest_via_proxy,
        guest_intercepted_vs_passthrough_latency: gl,
        guest_intercepted_vs_passthrough_throughput: gt,
        host_intercepted_vs_passthrough_latency: hl,
        host_intercepted_vs_passthrough_throughput: ht,
        guest_dns_ms_p50: median(&mut guest.dns_ms),
    })
}

fn print_report(r: &Report) {
    println!(
        "accelerator: {}  (latency: p50 of {} new connections; throughput: median of {} downloads of {} MiB)",
        r.accel, r.iterations, r.bulk_rounds, r.bulk_mib
    );
    println!(
        "{:<34} {:>14} {:>16} {:>16}",
        "", "host direct", "host via proxy", "guest via proxy"
    );
    let vantages = [&r.host_direct, &r.host_via_proxy, &r.guest_via_proxy];
    for (case, name) in ["http", "https passthrough", "https intercepted"]
        .into_iter()
        .enumerate()
    {
        for (row, what) in ["latency p50", "latency p95", "throughput"]
            .into_iter()
            .enumerate()
        {
            let cells: Vec<String> = vantages
                .iter()
                .map(|v| match v.case(case) {
                    Some(f) if row == 0 => format!("{:.2} ms", f.latency_ms_p50),
                    Some(f) if row == 1 => format!("{:.2} ms", f.latency_ms_p95),
                    Some(f) => format!("{:.2} MiB/s", f.mib_s_median),
                    None => "-".into(),
                })
                .collect();
            println!(
                "{:<34} {:>14} {:>16} {:>16}",
                format!("{name} {what}"),
                cells[0],
                cells[1],
                cells[2]
            );
        }
    }
    println!(
        "{:<34} {:>14} {:>16.2} {:>16.2}",
        "intercepted/passthrough latency",
        "-",
        r.host_intercepted_vs_passthrough_latency,
        r.guest_intercepted_vs_passthrough_latency
    );
    println!(
        "{:<34} {:>14} {:>16.2} {:>16.2}",
        "intercepted/passthrough throughput",
        "-",
        r.host_intercepted_vs_passthrough_throughput,
        r.guest_intercepted_vs_passthrough_throughput
    );
    println!(
        "guest DNS lookup through Warren's resolver p50: {:.2} ms",
        r.guest_dns_ms_p50
    );
}
