//! A VM's shares (host directories over virtio-fs) and its network description, checked
//! before anything is created.

use rand::RngCore;

use super::{error_text, NetworkRequest};
use crate::error::CoreError;
use crate::store::MountSpec;

/// The launch description of `net` for VM `id`, checked.
pub(super) fn net_spec(id: &str, net: &NetworkRequest) -> Result<warren_vmm::NetSpec, CoreError> {
    let upstream_dns = match net.upstream_dns {
        Some(a) => a,
        None => warren_supervisor::network::host_resolver().ok_or_else(|| {
            CoreError::InvalidArgument(
                "no upstream DNS given and no nameserver in /etc/resolv.conf".into(),
            )
        })?,
    };
    let mut mac = [0u8; 3];
    rand::rng().fill_bytes(&mut mac);
    let spec = warren_vmm::NetSpec {
        netns: warren_supervisor::network::netns_name(id),
        mac: format!("52:54:00:{:02x}:{:02x}:{:02x}", mac[0], mac[1], mac[2]),
        upstream_dns,
        outbound_netns: net.outbound_netns.clone(),
        allow: net.allow.clone(),
        deny: net.deny.clone(),
        secrets: net.secrets.clone(),
        upstream_roots: net.upstream_roots.clone(),
        intercepts: net.intercepts.clone(),
        blocked_cidrs: net.blocked_cidrs.clone(),
        intercept_all_tls: net.intercept_all_tls,
        mode: net.mode,
        host_ca_store: net.host_ca_store,
        secret_headers: net.secret_headers.clone(),
    };
    warren_supervisor::network::validate(&spec)
        .map_err(|e| CoreError::InvalidArgument(format!("network: {}", error_text(&e))))?;
    Ok(spec)
}

/// Replaces the policy of the launched network `spec` (allow and deny lists, secrets,
/// intercepts, blocked ranges, TLS and mode settings) with `now`'s, keeping its address,
/// namespace, resolver and test hooks; checked as a new one is.
pub(super) fn apply_policy(
    spec: &mut warren_vmm::NetSpec,
    now: &NetworkRequest,
) -> Result<(), CoreError> {
    spec.allow = now.allow.clone();
    spec.deny = now.deny.clone();
    spec.secrets = now.secrets.clone();
    spec.intercepts = now.intercepts.clone();
    spec.blocked_cidrs = now.blocked_cidrs.clone();
    spec.intercept_all_tls = now.intercept_all_tls;
    spec.mode = now.mode;
    spec.host_ca_store = now.host_ca_store;
    spec.secret_headers = now.secret_headers.clone();
    warren_supervisor::network::validate(spec)
        .map_err(|e| CoreError::InvalidArgument(format!("network: {}", error_text(&e))))
}

/// At most this many shared directories per VM.
pub const MAX_MOUNTS: usize = 8;

/// Guest paths a share may not cover: the system's own mounts.
const RESERVED_GUEST_PATHS: &[&str] = &["/proc", "/sys", "/dev", "/run", "/tmp", "/etc", "/usr"];

/// Checks shares before anything is created: absolute canonical host directories, plain
/// absolute guest paths (`[A-Za-z0-9._/-]`, no `..`), none reserved, none twice.
pub fn validate_mounts(mounts: &[MountSpec]) -> Result<(), CoreError> {
    if mounts.len() > MAX_MOUNTS {
        return Err(CoreError::InvalidArgument(format!(
            "at most {MAX_MOUNTS} mounts per VM, got {}",
            mounts.len()
        )));
    }
    let mut seen = std::collections::HashSet::new();
    for m in mounts {
        let g = &m.guest;
        let plain = g.starts_with('/')
            && g.len() > 1
            && g.len() <= 256
            && !g.ends_with('/')
            && g.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._/-".contains(&b))
            && g.split('/')
                .skip(1)
                .all(|c| !c.is_empty() && c != "." && c != "..");
        if !plain {
            return Err(CoreError::InvalidArgument(format!(
                "guest mount path {g:?} must be absolute, normalised and use only [A-Za-z0-9._/-]"
            )));
        }
        if let Some(r) = RESERVED_GUEST_PATHS
            .iter()
            .find(|r| g == *r || g.starts_with(&format!("{r}/")))
        {
            return Err(CoreError::InvalidArgument(format!(
                "guest mount path {g:?} is inside the reserved {r}"
            )));
        }
        if !seen.insert(g.clone()) {
            return Err(CoreError::InvalidArgument(format!(
                "guest mount path {g:?} given twice"
            )));
        }
        let canonical =
            std::fs::canonicalize(&m.host).map_err(|e| CoreError::io("resolve", &m.host, e))?;
        if canonical != m.host || !canonical.is_dir() {
            return Err(CoreError::InvalidArgument(format!(
                "host mount path {} must be a canonical directory",
                m.host.display()
            )));
        }
    }
    Ok(())
}

/// Parses `HOST:GUEST[:ro]` (the CLI's `--mount`); the host path is canonicalised and the
/// guest user maps to `owner`.
pub fn parse_mount(arg: &str, owner: (u32, u32)) -> Result<MountSpec, CoreError> {
    let bad = || CoreError::InvalidArgument(format!("--mount {arg:?}: expected HOST:GUEST[:ro]"));
    let mut parts: Vec<&str> = arg.split(':').collect();
    let read_only = match parts.last() {
        Some(&"ro") if parts.len() == 3 => {
            parts.pop();
            true
        }
        Some(&"rw") if parts.len() == 3 => {
            parts.pop();
            false
        }
        _ => false,
    };
    let [host, guest] = parts[..] else {
        return Err(bad());
    };
    if host.is_empty() || guest.is_empty() {
        return Err(bad());
    }
    let host = std::fs::canonicalize(host).map_err(|e| CoreError::io("resolve", host, e))?;
    let identity = warren_vmm::qemu::virtiofs::identity_of(&host)
        .map_err(|e| CoreError::io("stat", &host, e))?;
    Ok(MountSpec {
        host,
        guest: guest.to_owned(),
        read_only,
        owner: Some(owner),
        identity: Some(identity),
    })
}

/// Identifies every mount: one identified when it was made must still be that directory
/// (`conflict` otherwise); one that was not is identified now. Every later launch of the VM
/// checks the identity again (`warren_vmm::qemu::virtiofs::validate`).
pub(super) fn identify_mounts(mounts: &mut [MountSpec]) -> Result<(), CoreError> {
    for m in mounts.iter_mut() {
        match m.identity {
            Some(want) => warren_vmm::qemu::virtiofs::check_identity(&m.host, want)
                .map_err(|e| CoreError::Conflict(e.to_string()))?,
            None => {
                m.identity = Some(
                    warren_vmm::qemu::virtiofs::identity_of(&m.host)
                        .map_err(|e| CoreError::io("stat", &m.host, e))?,
                );
            }
        }
    }
    Ok(())
}

/// The shares and kernel arguments for `mounts`: share `fsN` is mounted at its guest path
/// (`warren.mount=TAG:PATH:rw|ro`, read by the guest agent at boot).
pub(super) fn shares_of(mounts: &[MountSpec]) -> (Vec<warren_vmm::backend::Share>, Vec<String>) {
    let mut shares = Vec::new();
    let mut args = Vec::new();
    for (i, m) in mounts.iter().enumerate() {
        let tag = format!("fs{i}");
        args.push(format!(
            "warren.mount={tag}:{}:{}",
            m.guest,
            if m.read_only { "ro" } else { "rw" }
        ));
        shares.push(warren_vmm::backend::Share {
            tag,
            host_dir: m.host.clone(),
            read_only: m.read_only,
            owner: m.owner,
            identity: m.identity,
        });
    }
    (shares, args)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fork's copy gets the policy it was admitted under and keeps its parent's address,
    /// namespace and resolver.
    #[test]
    fn test_apply_policy_replaces_the_policy_only() {
        let mut spec = net_spec(
            "vm-000000000001",
            &NetworkRequest {
                allow: vec!["old.example.com".into()],
                mode: warren_vmm::NetMode::Internet,
                upstream_dns: Some("127.0.0.53:53".parse().expect("addr")),
                ..Default::default()
            },
        )
        .expect("spec");
        let (mac, netns, dns) = (spec.mac.clone(), spec.netns.clone(), spec.upstream_dns);
        apply_policy(
            &mut spec,
            &NetworkRequest {
                allow: vec!["new.example.com".into()],
                deny: vec!["x.example.com".into()],
                blocked_cidrs: vec!["10.9.0.0/16".into()],
                intercept_all_tls: true,
                ..Default::default()
            },
        )
        .expect("apply");
        assert_eq!(spec.allow, vec!["new.example.com".to_string()]);
        assert_eq!(spec.deny, vec!["x.example.com".to_string()]);
        assert_eq!(spec.blocked_cidrs, vec!["10.9.0.0/16".to_string()]);
        assert!(spec.intercept_all_tls);
        assert_eq!(
            spec.mode,
            warren_vmm::NetMode::Allowlist,
            "no longer internet"
        );
        assert_eq!((spec.mac, spec.netns, spec.upstream_dns), (mac, netns, dns));
        // Checked as a new one: a bad entry refuses the copy.
        let mut bad = net_spec(
            "vm-000000000002",
            &NetworkRequest {
                upstream_dns: Some("127.0.0.53:53".parse().expect("addr")),
                ..Default::default()
            },
        )
        .expect("spec");
        let wrong = NetworkRequest {
            allow: vec!["not a name".into()],
            ..Default::default()
        };
        assert!(apply_policy(&mut bad, &wrong).is_err());
    }
}
