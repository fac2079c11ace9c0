//! The network of a VM created through the service: the caller's allow/deny lists
//! (`vm_create.egress`), the operator's `[egress]` settings (blocked ranges, interception of
//! all TLS, per-workspace CIDR grants) and the workspace's secrets and interception rules
//! from the configuration.
//!
//! A caller (token holder or local user) may allow CIDRs only inside what the operator
//! granted its workspace (`egress.cidr_grants`); names are not restricted beyond the network
//! grant. Whatever the lists say, the egress refuses the always-denied ranges, the operator's
//! `blocked_cidrs` and every address of the host's own namespace.

use crate::auth::Principal;
use crate::config::{parse_cidr, ServiceConfig};
use crate::error::ApiError;
use crate::tools::EgressArgs;

/// Refuses (`forbidden`) an `allow` entry that is a CIDR or an address outside the ranges
/// granted to `workspace`; names pass. Entries are read the way the egress reads them, so an
/// entry is a CIDR here exactly when it is one there.
pub(crate) fn check_cidr_grant(
    cfg: &ServiceConfig,
    workspace: &str,
    allow: &[String],
) -> Result<(), ApiError> {
    let granted: Vec<ipnet::Ipv4Net> = cfg
        .egress
        .cidr_grants
        .get(workspace)
        .into_iter()
        .flatten()
        .filter_map(|c| parse_cidr(c))
        .collect();
    for entry in allow {
        let Some(net) = parse_cidr(entry) else {
            continue;
        };
        if !granted.iter().any(|g| g.contains(&net)) {
            return Err(ApiError::forbidden(format!(
                "egress.allow {entry:?}: workspace {workspace} has no grant for this range \
                 (the operator grants CIDRs in the service configuration's [egress.cidr_grants])"
            )));
        }
    }
    Ok(())
}

/// The network request of a `vm_create` by `p` with a network in `mode` (the caller has
/// checked the grant for the mode).
pub(crate) fn network_request(
    cfg: &ServiceConfig,
    p: &Principal,
    mode: warren_vmm::NetMode,
    egress: Option<EgressArgs>,
) -> Result<warren_core::NetworkRequest, ApiError> {
    let egress = egress.unwrap_or_default();
    check_cidr_grant(cfg, &p.workspace, &egress.allow)?;
    Ok(warren_core::NetworkRequest {
        allow: egress.allow,
        deny: egress.deny,
        mode,
        blocked_cidrs: cfg.egress.blocked_cidrs.clone(),
        intercept_all_tls: cfg.egress.intercept_all_tls,
        host_ca_store: cfg.egress.host_ca_store,
        secret_headers: cfg.egress.secret_headers.clone(),
        secrets: cfg
            .secrets
            .iter()
            .filter(|s| s.workspace == p.workspace)
            .map(|s| warren_vmm::NetSecret {
                name: s.name.clone(),
                placeholder: s.placeholder.clone(),
                hosts: s.hosts.clone(),
                file: s.file.clone(),
                json_pointer: s.json_pointer.clone(),
                headers: s.headers.clone(),
            })
            .collect(),
        intercepts: cfg
            .intercepts
            .iter()
            .filter(|r| r.workspace == p.workspace)
            .map(|r| warren_vmm::NetIntercept {
                host: r.host.clone(),
                method: r.method.clone(),
                path_prefix: r.path_prefix.clone(),
                command: r.command.clone(),
                uid: r.uid,
                gid: r.gid,
                timeout_ms: r.timeout_secs.saturating_mul(1000),
                env: vec![],
            })
            .collect(),
        ..Default::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    fn cfg(egress: &str) -> ServiceConfig {
        ServiceConfig::parse(
            std::path::Path::new("t.toml"),
            &format!("state_dir = \"/s\"\n[images.dev]\nid = \"{ID}\"\n{egress}"),
        )
        .expect("config")
    }

    fn allow(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn test_cidr_outside_grant_forbidden() {
        let c = cfg("[egress.cidr_grants]\nci = [\"203.0.113.0/24\"]\n");
        // Inside the grant, and names: allowed.
        let ok = allow(&[
            "203.0.113.0/25",
            "203.0.113.7",
            "api.example.com",
            "*.x.org",
        ]);
        assert!(check_cidr_grant(&c, "ci", &ok).is_ok());
        // Wider than, beside, or everything: refused, as for a workspace with no grant.
        for bad in [
            "203.0.112.0/23",
            "198.51.100.1",
            "0.0.0.0/0",
            "203.0.113.0/24",
        ] {
            let e = check_cidr_grant(&c, "other", &allow(&[bad])).expect_err(bad);
            assert_eq!(e.code, "forbidden");
            if bad != "203.0.113.0/24" {
                let e = check_cidr_grant(&c, "ci", &allow(&[bad])).expect_err(bad);
                assert_eq!(e.code, "forbidden", "{bad}");
            }
        }
    }

    #[test]
    fn test_network_request_carries_operator_settings() {
        let c = cfg(
            "[egress]\nblocked_cidrs = [\"198.51.100.0/24\"]\nintercept_all_tls = true\n\
             host_ca_store = true\nsecret_headers = [\"x-api-key\"]\n",
        );
        let p = Principal::local(1000);
        let args = EgressArgs {
            allow: allow(&["api.example.com"]),
            deny: vec![],
        };
        let net =
            network_request(&c, &p, warren_vmm::NetMode::Internet, Some(args)).expect("request");
        assert_eq!(net.blocked_cidrs, ["198.51.100.0/24"]);
        assert!(net.intercept_all_tls && net.host_ca_store);
        assert_eq!(net.secret_headers, ["x-api-key"]);
        assert_eq!(net.mode, warren_vmm::NetMode::Internet);
        assert_eq!(net.allow, ["api.example.com"]);
        let args = EgressArgs {
            allow: allow(&["198.51.100.7"]),
            deny: vec![],
        };
        assert!(network_request(&c, &p, warren_vmm::NetMode::Allowlist, Some(args)).is_err());
    }
}
