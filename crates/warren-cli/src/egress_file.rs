//! The `--egress` TOML file of `warren vm create`, `warren run` and `warren session create`:
//! the VM's allow/deny lists, the operator settings (`blocked_cidrs`, `intercept_all_tls`),
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
    }
}
