//! A VM's network: its own network namespace holding the TAP device `tap0` (the VM's only
//! link), nftables rules that send all guest TCP to the egress proxy and guest DNS to the
//! egress resolver (everything else dropped, nothing forwarded), and the egress itself
//! (`warren-egress`) listening inside that namespace. Created before the VMM starts and
//! removed when the supervisor exits ([`Network`]'s `Drop`).

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use warren_egress::{
    bind_tcp_in, bind_udp_in, CaMaterial, DomainPattern, Egress, EgressConfig, EgressHandle,
    EgressMode, HostCas, InterceptRule, Listeners, Outbound, SecretSource, SecretSpec,
    UpstreamRoots,
};
use warren_vmm::{NetMode, NetSpec};

/// The host side of the VM's link (the guest's gateway and resolver).
pub const HOST_ADDR: Ipv4Addr = Ipv4Addr::new(10, 255, 0, 1);
/// The guest's address.
pub const GUEST_ADDR: Ipv4Addr = Ipv4Addr::new(10, 255, 0, 2);
/// The host side's MAC address (locally administered; every VM namespace is separate).
pub const HOST_MAC: &str = "02:57:52:00:00:01";
/// Prefix length of the link.
pub const PREFIX: u8 = 30;
/// Where guest TCP is redirected, inside the namespace.
pub const PROXY_PORT: u16 = 15001;
/// Where guest DNS is redirected, inside the namespace.
pub const DNS_PORT: u16 = 15053;
/// Prefix of every namespace Warren creates (`warren-<vm id>`).
pub const NETNS_PREFIX: &str = "warren-";

#[derive(Debug, thiserror::Error)]
pub enum NetError {
    #[error("{what} failed: {detail}")]
    Command { what: String, detail: String },
    #[error("invalid egress setting {0:?}")]
    Setting(String),
    #[error("I/O on {path}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Egress(#[from] warren_egress::EgressError),
    #[error(transparent)]
    Config(#[from] warren_egress::ConfigError),
}

fn run(what: &str, cmd: &mut Command, stdin: Option<&str>) -> Result<(), NetError> {
    use std::io::Write;
    let err = |detail: String| NetError::Command {
        what: what.to_string(),
        detail,
    };
    let mut child = cmd
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| err(e.to_string()))?;
    if let (Some(text), Some(mut pipe)) = (stdin, child.stdin.take()) {
        pipe.write_all(text.as_bytes())
            .map_err(|e| err(e.to_string()))?;
    }
    let out = child.wait_with_output().map_err(|e| err(e.to_string()))?;
    if !out.status.success() {
        return Err(err(String::from_utf8_lossy(&out.stderr).trim().to_string()));
    }
    Ok(())
}

fn ip(args: &[&str]) -> Result<(), NetError> {
    run(
        &format!("ip {}", args.join(" ")),
        Command::new("ip").args(args),
        None,
    )
}

/// Removes the namespace `name` (its TAP device and rules go with it). Missing is fine.
pub fn delete_netns(name: &str) {
    let _ = Command::new("ip")
        .args(["netns", "del", name])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

/// The nftables table of a VM namespace.
fn ruleset() -> String {
    format!(
        "table ip warren {{
           chain pre {{ type nat hook prerouting priority dstnat; policy accept;
             iifname \"tap0\" udp dport 53 redirect to :{DNS_PORT}
             iifname \"tap0\" tcp dport 53 redirect to :{DNS_PORT}
             iifname \"tap0\" meta l4proto tcp redirect to :{PROXY_PORT}
           }}
           chain input {{ type filter hook input priority filter; policy drop;
             iifname \"lo\" accept
             ct state established,related accept
             iifname \"tap0\" tcp dport {{ {PROXY_PORT}, {DNS_PORT} }} accept
             iifname \"tap0\" udp dport {DNS_PORT} accept
           }}
           chain forward {{ type filter hook forward priority filter; policy drop; }}
           chain out {{ type filter hook output priority filter; policy accept; }}
         }}
         table ip6 warren6 {{
           chain input {{ type filter hook input priority filter; policy drop; }}
           chain forward {{ type filter hook forward priority filter; policy drop; }}
         }}"
    )
}

/// A VM's running network; dropping it stops the egress and deletes the namespace.
pub struct Network {
    name: String,
    egress: Option<EgressHandle>,
    /// The VM CA certificate (PEM) the guest must trust.
    pub ca_cert_pem: String,
}

impl Drop for Network {
    fn drop(&mut self) {
        if let Some(e) = self.egress.take() {
            e.shutdown();
        }
        delete_netns(&self.name);
        tracing::info!(netns = %self.name, "network namespace removed");
    }
}

/// Splits policy entries into CIDRs (an IPv4 address is a /32) and domain patterns, with
/// every `preset:NAME` entry replaced by its hosts first (an unknown preset is refused).
fn split_entries(
    entries: &[String],
) -> Result<(Vec<ipnet::Ipv4Net>, Vec<DomainPattern>), NetError> {
    let mut cidrs = Vec::new();
    let mut names = Vec::new();
    for e in &warren_egress::presets::expand_all(entries)? {
        if let Ok(n) = e.parse::<ipnet::Ipv4Net>() {
            cidrs.push(n);
        } else if let Ok(a) = e.parse::<Ipv4Addr>() {
            cidrs.push(ipnet::Ipv4Net::from(a));
        } else {
            names.push(
                e.parse::<DomainPattern>()
                    .map_err(|_| NetError::Setting(e.clone()))?,
            );
        }
    }
    Ok((cidrs, names))
}

/// Loads the VM's CA from its directory, or generates and persists it (root-only) so that
/// restarts (hibernate/resume) keep the certificate the guest trusts.
fn load_or_create_ca(dir: &Path) -> Result<CaMaterial, NetError> {
    let cert = dir.join("egress-ca.pem");
    let key = dir.join("egress-ca.key");
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| NetError::Io { path, source }
    };
    if let (Ok(c), Ok(k)) = (
        std::fs::read_to_string(&cert),
        std::fs::read_to_string(&key),
    ) {
        return Ok(CaMaterial {
            cert_pem: c,
            key_pem: k,
        });
    }
    let ca = warren_egress::generate_ca()?;
    for (path, body) in [(&key, &ca.key_pem), (&cert, &ca.cert_pem)] {
        use std::io::Write;
        let tmp = path.with_extension("tmp");
        let _ = std::fs::remove_file(&tmp);
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)
            .map_err(io(&tmp))?;
        f.write_all(body.as_bytes())
            .and_then(|()| f.sync_all())
            .map_err(io(&tmp))?;
        std::fs::rename(&tmp, path).map_err(io(path))?;
    }
    Ok(ca)
}

/// Checks `spec` before any VM is created: policy entries, secret hosts and placeholders,
/// readable secret files and upstream roots.
pub fn validate(spec: &NetSpec) -> Result<(), NetError> {
    if !spec.netns.starts_with(NETNS_PREFIX) {
        return Err(NetError::Setting(spec.netns.clone()));
    }
    let cfg = egress_config("validate", spec, None, host_cas(spec)?.as_ref())?;
    cfg.validate()?;
    for s in &spec.secrets {
        std::fs::metadata(&s.file).map_err(|source| NetError::Io {
            path: s.file.clone(),
            source,
        })?;
    }
    if let Some(p) = &spec.outbound_netns {
        std::fs::metadata(p).map_err(|source| NetError::Io {
            path: p.clone(),
            source,
        })?;
    }
    Ok(())
}

/// The host's CA store when `spec` asks for it (`host_ca_store`).
fn host_cas(spec: &NetSpec) -> Result<Option<HostCas>, NetError> {
    Ok(spec
        .host_ca_store
        .then(warren_egress::load_host_cas)
        .transpose()?)
}

fn egress_config(
    vm: &str,
    spec: &NetSpec,
    ca: Option<CaMaterial>,
    host_cas: Option<&HostCas>,
) -> Result<EgressConfig, NetError> {
    let mut cfg = EgressConfig::new(vm, spec.upstream_dns);
    let (allow_cidrs, allow_domains) = split_entries(&spec.allow)?;
    let (deny_cidrs, deny_domains) = split_entries(&spec.deny)?;
    cfg.policy.allow_cidrs = allow_cidrs;
    cfg.policy.allow_domains = allow_domains;
    cfg.policy.deny_cidrs = deny_cidrs;
    cfg.policy.deny_domains = deny_domains;
    let (blocked, names) = split_entries(&spec.blocked_cidrs)?;
    if let Some(name) = names.first() {
        return Err(NetError::Setting(format!(
            "blocked_cidrs takes IPv4 CIDRs or addresses, not {name}"
        )));
    }
    cfg.policy.blocked_cidrs = blocked;
    cfg.policy.mode = match spec.mode {
        NetMode::Allowlist => EgressMode::Allowlist,
        NetMode::Internet => EgressMode::Internet,
    };
    cfg.intercept_all_tls = spec.intercept_all_tls;
    cfg.secret_headers = spec.secret_headers.clone();
    cfg.host_roots = host_cas.map(|c| c.upstream_pem.clone());
    for s in &spec.secrets {
        let hosts = s
            .hosts
            .iter()
            .map(|h| {
                h.parse::<DomainPattern>()
                    .map_err(|_| NetError::Setting(h.clone()))
            })
            .collect::<Result<_, _>>()?;
        cfg.secrets.push(SecretSpec {
            name: s.name.clone(),
            placeholder: s.placeholder.clone(),
            hosts,
            source: match &s.json_pointer {
                Some(pointer) => SecretSource::JsonField {
                    path: s.file.clone(),
                    pointer: pointer.clone(),
                },
                None => SecretSource::File(s.file.clone()),
            },
            headers: s.headers.clone(),
        });
    }
    for r in &spec.intercepts {
        cfg.intercepts.push(InterceptRule {
            host: r
                .host
                .parse::<DomainPattern>()
                .map_err(|_| NetError::Setting(r.host.clone()))?,
            method: r.method.clone(),
            path_prefix: r.path_prefix.clone(),
            command: r.command.clone(),
            uid: r.uid,
            gid: r.gid,
            timeout: std::time::Duration::from_millis(r.timeout_ms),
            env: r.env.clone(),
        });
    }
    if let Some(roots) = &spec.upstream_roots {
        let pem = std::fs::read_to_string(roots).map_err(|source| NetError::Io {
            path: roots.clone(),
            source,
        })?;
        cfg.upstream_roots = UpstreamRoots::Pem(pem);
    }
    cfg.ca = ca;
    Ok(cfg)
}

/// Fuzzing entry (`crates/warren-fuzz`), not an API: the egress configuration built from
/// `spec` as [`setup`] builds it, and checked as [`validate`] checks it, without reading
/// any file (`upstream_roots` is ignored).
#[doc(hidden)]
pub fn fuzz_egress_config(spec: &NetSpec) -> Result<EgressConfig, NetError> {
    let spec = NetSpec {
        upstream_roots: None,
        ..spec.clone()
    };
    let cfg = egress_config("fuzz", &spec, None, None)?;
    cfg.validate()?;
    Ok(cfg)
}

/// Creates the namespace, its TAP device, address and rules, and starts the egress in it
/// (on the caller's tokio runtime). On error everything created is removed again.
pub fn setup(vm: &str, vm_dir: &Path, spec: &NetSpec) -> Result<Network, NetError> {
    if !spec.netns.starts_with(NETNS_PREFIX) {
        return Err(NetError::Setting(spec.netns.clone()));
    }
    let name = spec.netns.clone();
    // A crash may have left one behind.
    delete_netns(&name);
    ip(&["netns", "add", &name])?;
    // From here on the guard removes the namespace whatever fails.
    let mut net = Network {
        name: name.clone(),
        egress: None,
        ca_cert_pem: String::new(),
    };
    let path = PathBuf::from("/run/netns").join(&name);
    // No IPv6 at all in the namespace (before any device exists, so none gets an address).
    let no_v6 = warren_egress::run_in_netns(&path, || {
        for f in ["all", "default"] {
            std::fs::write(format!("/proc/sys/net/ipv6/conf/{f}/disable_ipv6"), "1")?;
        }
        Ok::<(), std::io::Error>(())
    })?;
    no_v6.map_err(|source| NetError::Io {
        path: PathBuf::from("/proc/sys/net/ipv6/conf/all/disable_ipv6"),
        source,
    })?;
    ip(&["-n", &name, "link", "set", "lo", "up"])?;
    ip(&[
        "-n", &name, "tuntap", "add", "dev", "tap0", "mode", "tap", "vnet_hdr",
    ])?;
    ip(&[
        "-n",
        &name,
        "addr",
        "add",
        &format!("{HOST_ADDR}/{PREFIX}"),
        "dev",
        "tap0",
    ])?;
    // A fixed MAC: a guest restored from a checkpoint keeps its neighbour entry for the
    // gateway, so the rebuilt device must answer to the same address.
    ip(&["-n", &name, "link", "set", "tap0", "address", HOST_MAC])?;
    ip(&["-n", &name, "link", "set", "tap0", "up"])?;
    run(
        "nft -f -",
        Command::new("ip").args(["netns", "exec", &name, "nft", "-f", "-"]),
        Some(&ruleset()),
    )?;

    let ca = load_or_create_ca(vm_dir)?;
    net.ca_cert_pem = ca.cert_pem.clone();
    let host = host_cas(spec)?;
    let cfg = egress_config(vm, spec, Some(ca), host.as_ref())?;
    // Behind TLS inspection the guest must trust the host's locally added CAs too, for the
    // TLS it speaks through the egress untouched.
    if let Some(host) = &host {
        if !net.ca_cert_pem.ends_with('\n') {
            net.ca_cert_pem.push('\n');
        }
        net.ca_cert_pem.push_str(&host.guest_pem);
        tracing::info!(netns = %name, bundle = %host.path.display(), cas = host.guest_count, "guest trusts the host's CAs");
    }
    let outbound = match &spec.outbound_netns {
        Some(p) => Outbound::netns(p)?,
        None => Outbound::current(),
    };
    let egress = Egress::new(cfg, outbound)?;
    let at = |port| SocketAddr::V4(SocketAddrV4::new(HOST_ADDR, port));
    let listeners = Listeners {
        proxy: Some(bind_tcp_in(&path, at(PROXY_PORT))?),
        dns_udp: Some(bind_udp_in(&path, at(DNS_PORT))?),
        dns_tcp: Some(bind_tcp_in(&path, at(DNS_PORT))?),
    };
    net.egress = Some(egress.spawn(listeners)?);
    tracing::info!(netns = %name, "network ready");
    Ok(net)
}

/// The first `nameserver` of the host's `/etc/resolv.conf` (port 53), the default upstream.
pub fn host_resolver() -> Option<SocketAddr> {
    let text = std::fs::read_to_string("/etc/resolv.conf").ok()?;
    text.lines().find_map(|l| {
        let mut w = l.split_whitespace();
        (w.next() == Some("nameserver"))
            .then(|| w.next()?.parse::<Ipv4Addr>().ok())
            .flatten()
            .map(|a| SocketAddr::V4(SocketAddrV4::new(a, 53)))
    })
}

/// Namespace name of VM `id`.
pub fn netns_name(id: &str) -> String {
    format!("{NETNS_PREFIX}{id}")
}

/// Names of the Warren namespaces that exist now (`/run/netns/warren-*`).
pub fn list_netns() -> Vec<String> {
    let Ok(rd) = std::fs::read_dir("/run/netns") else {
        return Vec::new();
    };
    rd.filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with(NETNS_PREFIX))
        .collect()
}

/// The guest's kernel argument for this network: `warren.net=ADDR/PREFIX,GW,DNS`.
pub fn guest_kernel_arg() -> String {
    format!("warren.net={GUEST_ADDR}/{PREFIX},{HOST_ADDR},{HOST_ADDR}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_split_entries_cidrs_addresses_and_names() {
        let (c, n) = split_entries(&[
            "203.0.113.0/24".into(),
            "198.51.100.7".into(),
            "*.example.com".into(),
        ])
        .expect("valid");
        assert_eq!(c.len(), 2);
        assert_eq!(n.len(), 1);
        assert!(split_entries(&["bad name!".into()]).is_err());
    }

    fn spec() -> NetSpec {
        NetSpec {
            netns: "warren-x".into(),
            mac: "52:54:00:00:00:01".into(),
            upstream_dns: "203.0.113.53:53".parse().expect("addr"),
            outbound_netns: None,
            allow: vec!["198.51.100.0/24".into()],
            deny: vec![],
            secrets: vec![],
            upstream_roots: None,
            intercepts: vec![],
            blocked_cidrs: vec![],
            intercept_all_tls: false,
            mode: Default::default(),
            host_ca_store: false,
            secret_headers: vec![],
        }
    }

    #[test]
    fn test_egress_config_carries_blocked_cidrs_and_intercept_all_tls() {
        let mut s = spec();
        s.blocked_cidrs = vec!["198.51.100.16/28".into(), "192.0.2.7".into()];
        s.intercept_all_tls = true;
        let cfg = egress_config("x", &s, None, None).expect("config");
        assert_eq!(
            cfg.policy.blocked_cidrs,
            vec![
                "198.51.100.16/28".parse::<ipnet::Ipv4Net>().expect("net"),
                "192.0.2.7/32".parse().expect("net"),
            ]
        );
        assert!(cfg.intercept_all_tls);
        // Blocked wins over the allowed range that contains it.
        let ip = "198.51.100.20".parse().expect("ip");
        assert!(!cfg.policy.cidr_allows(ip));
        assert!(cfg.policy.cidr_allows("198.51.100.1".parse().expect("ip")));
        s.blocked_cidrs = vec!["example.com".into()];
        assert!(matches!(
            egress_config("x", &s, None, None),
            Err(NetError::Setting(_))
        ));
    }

    #[test]
    fn test_egress_config_expands_presets_and_carries_mode() {
        let mut s = spec();
        s.allow = vec!["preset:python".into(), "api.example.com".into()];
        s.mode = NetMode::Internet;
        let cfg = egress_config("x", &s, None, None).expect("config");
        assert_eq!(cfg.policy.mode, EgressMode::Internet);
        let names: Vec<String> = cfg
            .policy
            .allow_domains
            .iter()
            .map(|d| d.to_string())
            .collect();
        assert_eq!(
            names,
            ["pypi.org", "files.pythonhosted.org", "api.example.com"]
        );
        s.allow = vec!["preset:nope".into()];
        assert!(matches!(
            egress_config("x", &s, None, None),
            Err(NetError::Config(warren_egress::ConfigError::Preset(_)))
        ));
        s.allow = vec![];
        s.deny = vec!["preset:npm".into()];
        let cfg = egress_config("x", &s, None, None).expect("config");
        assert_eq!(cfg.policy.deny_domains.len(), 1);
    }

    #[test]
    fn test_setup_refuses_foreign_namespace_names() {
        let spec = NetSpec {
            netns: "other".into(),
            mac: "52:54:00:00:00:01".into(),
            upstream_dns: "203.0.113.53:53".parse().expect("addr"),
            outbound_netns: None,
            allow: vec![],
            deny: vec![],
            secrets: vec![],
            upstream_roots: None,
            intercepts: vec![],
            blocked_cidrs: vec![],
            intercept_all_tls: false,
            mode: Default::default(),
            host_ca_store: false,
            secret_headers: vec![],
        };
        assert!(matches!(
            setup("x", Path::new("/nonexistent"), &spec),
            Err(NetError::Setting(_))
        ));
    }
}
