//! The `--egress` TOML file of `warren vm create`, `warren run` and `warren session create`:
//! the VM's allow/deny lists, the operator settings (`blocked_cidrs`, `intercept_all_tls`,
//! `host_ca_store`),
//! secrets and interception rules, parsed strictly into a [`warren_core::NetworkRequest`].
//! Policy entries are checked when the VM's network is validated (`warren-supervisor`).

use anyhow::{bail, Context, Result};

/// The `--egress` file of `warren vm create`, `warren run` and `warren session create`.
/// Whoever runs the CLI directly is the operator of its state, so `blocked_cidrs` and
/// `intercept_all_tls` are set here too.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct EgressFile {
    #[serde(default)]
    allow: Vec<String>,
    #[serde(default)]
    deny: Vec<String>,
    /// IPv4 CIDRs or addresses never reachable, whatever `allow` says.
    #[serde(default)]
    blocked_cidrs: Vec<String>,
    /// Terminate every allowed TLS connection (each request's Host held to its SNI).
    #[serde(default)]
    intercept_all_tls: bool,
    /// Trust the host's CA store too (hosts behind TLS inspection).
    #[serde(default)]
    host_ca_store: bool,
    /// Header names besides `Authorization` where placeholders of secrets without `headers`
    /// of their own are substituted.
    #[serde(default)]
    secret_headers: Vec<String>,
    upstream_dns: Option<std::net::SocketAddr>,
    outbound_netns: Option<std::path::PathBuf>,
    upstream_roots: Option<std::path::PathBuf>,
    #[serde(default)]
    secrets: Vec<EgressSecret>,
    #[serde(default)]
    intercepts: Vec<EgressIntercept>,
}

/// An `[[intercepts]]` entry: the command runs as `uid`/`gid` (default: the caller, and
/// never root).
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct EgressIntercept {
    host: String,
    method: String,
    path_prefix: String,
    command: Vec<String>,
    uid: Option<u32>,
    gid: Option<u32>,
    #[serde(default = "default_intercept_timeout")]
    timeout_secs: u64,
}

fn default_intercept_timeout() -> u64 {
    60
}

#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct EgressSecret {
    name: String,
    placeholder: String,
    hosts: Vec<String>,
    file: std::path::PathBuf,
    json_pointer: Option<String>,
    /// The only headers this secret is substituted into.
    #[serde(default)]
    headers: Vec<String>,
}

/// The network of `--network [MODE]` and `--egress FILE`: `None` (no NIC) without either
/// or with `--network off`; the file's settings (or none) in the mode asked for, allow-list
/// by default.
pub(crate) fn network_request(
    mode: Option<&str>,
    egress: Option<&std::path::Path>,
) -> Result<Option<warren_core::NetworkRequest>> {
    let mut net = match (mode, egress) {
        (Some("off"), Some(_)) => bail!("--egress needs a network; drop --network off"),
        (Some("off"), None) | (None, None) => return Ok(None),
        (_, Some(path)) => load(path)?,
        (_, None) => warren_core::NetworkRequest::default(),
    };
    net.mode = parse_mode(mode)?;
    Ok(Some(net))
}

/// The egress mode of `--network MODE` (allow-list when absent or bare).
pub(crate) fn parse_mode(mode: Option<&str>) -> Result<warren_vmm::NetMode> {
    Ok(match mode {
        None | Some("allowlist") => warren_vmm::NetMode::Allowlist,
        Some("internet") => warren_vmm::NetMode::Internet,
        Some(other) => bail!("--network {other:?}: use off, allowlist or internet"),
    })
}

/// Reads and checks an egress file; paths of secret files and roots are canonicalised.
pub(crate) fn load(path: &std::path::Path) -> Result<warren_core::NetworkRequest> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let f: EgressFile =
        toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    let abs = |p: std::path::PathBuf| -> Result<std::path::PathBuf> {
        std::fs::canonicalize(&p).with_context(|| format!("resolving {}", p.display()))
    };
    Ok(warren_core::NetworkRequest {
        allow: f.allow,
        deny: f.deny,
        blocked_cidrs: f.blocked_cidrs,
        intercept_all_tls: f.intercept_all_tls,
        host_ca_store: f.host_ca_store,
        secret_headers: f.secret_headers,
        mode: warren_vmm::NetMode::Allowlist,
        upstream_dns: f.upstream_dns,
        outbound_netns: f.outbound_netns,
        upstream_roots: f.upstream_roots.map(abs).transpose()?,
        secrets: f
            .secrets
            .into_iter()
            .map(|s| {
                Ok(warren_vmm::NetSecret {
                    name: s.name,
                    placeholder: s.placeholder,
                    hosts: s.hosts,
                    file: abs(s.file)?,
                    json_pointer: s.json_pointer,
                    headers: s.headers,
                })
            })
            .collect::<Result<_>>()?,
        intercepts: f
            .intercepts
            .into_iter()
            .map(|r| {
                let uid = r.uid.unwrap_or_else(|| nix::unistd::getuid().as_raw());
                let gid = r.gid.unwrap_or_else(|| nix::unistd::getgid().as_raw());
                if uid == 0 || gid == 0 {
                    bail!(
                        "{}: intercept commands never run as root; set uid and gid",
                        path.display()
                    );
                }
                Ok(warren_vmm::NetIntercept {
                    host: r.host,
                    method: r.method,
                    path_prefix: r.path_prefix,
                    command: r.command,
                    uid,
                    gid,
                    timeout_ms: r.timeout_secs.saturating_mul(1000),
                    env: vec![],
                })
            })
            .collect::<Result<_>>()?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_egress_file_operator_settings_parsed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = dir.path().join("egress.toml");
        std::fs::write(
            &f,
            "allow = [\"203.0.113.0/24\"]\nblocked_cidrs = [\"203.0.113.64/26\", \"198.51.100.9\"]\n\
             intercept_all_tls = true\n",
        )
        .expect("write");
        let net = load(&f).expect("parse");
        assert_eq!(net.blocked_cidrs, ["203.0.113.64/26", "198.51.100.9"]);
        assert!(net.intercept_all_tls);
        std::fs::write(&f, "allow = []\n").expect("write");
        let net = load(&f).expect("parse");
        assert!(net.blocked_cidrs.is_empty() && !net.intercept_all_tls);
        std::fs::write(&f, "blocked = [\"203.0.113.0/24\"]\n").expect("write");
        assert!(load(&f).is_err(), "unknown key");
        std::fs::write(
            &f,
            "secret_headers = [\"x-api-key\"]\n[[secrets]]\nname = \"k\"\nplaceholder = \"PH-123456\"\n\
             hosts = [\"a.test\"]\nfile = \"/dev/null\"\nheaders = [\"x-goog-api-key\"]\n",
        )
        .expect("write");
        let net = load(&f).expect("parse");
        assert_eq!(net.secret_headers, ["x-api-key"]);
        assert_eq!(net.secrets[0].headers, ["x-goog-api-key"]);
        std::fs::write(&f, "deny = [\"x.test\"]\nhost_ca_store = true\n").expect("write");
        let net = network_request(Some("internet"), Some(&f))
            .expect("parse")
            .expect("networked");
        assert!(net.host_ca_store);
        assert_eq!(net.mode, warren_vmm::NetMode::Internet);
        assert_eq!(net.deny, ["x.test"]);
    }

    #[test]
    fn test_network_modes_of_the_flag() {
        use warren_vmm::NetMode;
        assert!(network_request(None, None).expect("none").is_none());
        assert!(network_request(Some("off"), None).expect("off").is_none());
        let bare = network_request(Some("allowlist"), None).expect("bare");
        assert_eq!(bare.expect("networked").mode, NetMode::Allowlist);
        let inet = network_request(Some("internet"), None).expect("internet");
        assert_eq!(inet.expect("networked").mode, NetMode::Internet);
        let f = std::path::Path::new("/nonexistent.toml");
        assert!(network_request(Some("off"), Some(f)).is_err());
    }
}
