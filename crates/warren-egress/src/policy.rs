//! The per-VM egress policy: domain patterns, CIDR lists and the always-denied address ranges.
//!
//! Pure data and pure decisions; the proxy and the resolver ask it questions and add what only
//! they know (the original destination, what Warren's resolver returned for a name).
//! Invariants: names are compared in normalised form (ASCII lowercase, no trailing dot); deny
//! wins over allow; an always-denied address is denied whatever the lists say.

use std::fmt;
use std::net::Ipv4Addr;
use std::str::FromStr;

use ipnet::Ipv4Net;

use crate::error::ConfigError;

/// Ranges no guest may reach, whatever the policy says: unspecified/"this network", RFC 1918,
/// CGNAT, loopback, link-local (which holds the cloud metadata address 169.254.169.254),
/// multicast, and the reserved block that ends in the limited broadcast address.
pub const ALWAYS_DENIED: &[(Ipv4Addr, u8)] = &[
    (Ipv4Addr::new(0, 0, 0, 0), 8),
    (Ipv4Addr::new(10, 0, 0, 0), 8),
    (Ipv4Addr::new(100, 64, 0, 0), 10),
    (Ipv4Addr::new(127, 0, 0, 0), 8),
    (Ipv4Addr::new(169, 254, 0, 0), 16),
    (Ipv4Addr::new(172, 16, 0, 0), 12),
    (Ipv4Addr::new(192, 168, 0, 0), 16),
    // IETF protocol assignments (DS-Lite, NAT64 discovery and the like).
    (Ipv4Addr::new(192, 0, 0, 0), 24),
    // Azure's WireServer: a cloud host's metadata and agent channel outside 169.254/16.
    (Ipv4Addr::new(168, 63, 129, 16), 32),
    (Ipv4Addr::new(224, 0, 0, 0), 4),
    (Ipv4Addr::new(240, 0, 0, 0), 4),
];

/// True when `ip` lies in one of [`ALWAYS_DENIED`].
pub fn is_always_denied(ip: Ipv4Addr) -> bool {
    ALWAYS_DENIED.iter().any(|(net, len)| {
        Ipv4Net::new(*net, *len)
            .map(|n| n.contains(&ip))
            .unwrap_or(true)
    })
}

/// Normalises a DNS name for comparison: ASCII lowercase, one trailing dot removed, and
/// checked for DNS syntax (labels of 1-63 letters, digits, `-` or `_`; at most 253 bytes).
/// IP literals are not names and are rejected.
pub fn normalize_name(raw: &str) -> Option<String> {
    let name = raw.strip_suffix('.').unwrap_or(raw).to_ascii_lowercase();
    if name.is_empty() || name.len() > 253 || name.parse::<Ipv4Addr>().is_ok() {
        return None;
    }
    let ok = name.split('.').all(|label| {
        !label.is_empty()
            && label.len() <= 63
            && label
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    });
    ok.then_some(name)
}

/// A domain pattern: `example.com` matches that name only; `*.example.com` matches every name
/// below `example.com` (any depth) but not `example.com` itself.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum DomainPattern {
    /// One exact name (normalised).
    Exact(String),
    /// Every name strictly below this suffix (normalised, without the `*.`).
    Wildcard(String),
}

impl DomainPattern {
    /// Whether the normalised `name` matches.
    pub fn matches(&self, name: &str) -> bool {
        match self {
            DomainPattern::Exact(n) => n == name,
            DomainPattern::Wildcard(suffix) => name
                .strip_suffix(suffix.as_str())
                .is_some_and(|head| head.len() > 1 && head.ends_with('.')),
        }
    }
}

impl FromStr for DomainPattern {
    type Err = ConfigError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || ConfigError::DomainPattern(s.to_string());
        match s.strip_prefix("*.") {
            Some(rest) => Ok(DomainPattern::Wildcard(
                normalize_name(rest).ok_or_else(bad)?,
            )),
            None => Ok(DomainPattern::Exact(normalize_name(s).ok_or_else(bad)?)),
        }
    }
}

impl fmt::Display for DomainPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DomainPattern::Exact(n) => f.write_str(n),
            DomainPattern::Wildcard(s) => write!(f, "*.{s}"),
        }
    }
}

/// Whether any pattern in `patterns` matches the normalised `name`.
pub fn any_matches(patterns: &[DomainPattern], name: &str) -> bool {
    patterns.iter().any(|p| p.matches(name))
}

/// What a networked VM may reach before its lists are read. (A VM without network has no
/// NIC and no egress at all: "off" is not a mode of the egress.)
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum EgressMode {
    /// Only what `allow_domains` and `allow_cidrs` name (the default).
    #[default]
    Allowlist,
    /// Every public destination over TCP, by name or address: anything not always denied,
    /// not in `blocked_cidrs`, not an address of the outbound namespace, and not on the deny
    /// lists. The resolver answers every name that is not denied.
    Internet,
}

impl EgressMode {
    /// Stable name: `allowlist` or `internet`.
    pub fn as_str(self) -> &'static str {
        match self {
            EgressMode::Allowlist => "allowlist",
            EgressMode::Internet => "internet",
        }
    }
}

/// A VM's egress policy. Empty lists deny everything (fail closed) in
/// [`EgressMode::Allowlist`].
#[derive(Debug, Clone, Default)]
pub struct EgressPolicy {
    /// Allow-list or internet.
    pub mode: EgressMode,
    /// Names the guest may reach (TLS by SNI, HTTP by Host, other TCP by resolved address).
    pub allow_domains: Vec<DomainPattern>,
    /// Names never reachable; wins over `allow_domains`.
    pub deny_domains: Vec<DomainPattern>,
    /// Destination ranges the guest may reach by address (any name not denied).
    pub allow_cidrs: Vec<Ipv4Net>,
    /// Destination ranges never reachable; wins over everything.
    pub deny_cidrs: Vec<Ipv4Net>,
    /// Operator ranges (for example public management networks) added to [`ALWAYS_DENIED`].
    /// The addresses of the namespace the egress connects out from are refused too, by the
    /// proxy (they can only be known there).
    pub blocked_cidrs: Vec<Ipv4Net>,
}

/// Why a connection or query was refused. Stable snake_case names via [`DenyReason::as_str`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DenyReason {
    /// Always-denied range or operator `blocked_cidrs`.
    BlockedAddress,
    /// In the policy's `deny_cidrs`.
    DeniedCidr,
    /// Matches `deny_domains`.
    DeniedName,
    /// Matches no `allow_domains` entry.
    NameNotAllowed,
    /// The name does not resolve (through Warren) to the connection's destination.
    NameAddressMismatch,
    /// Address neither in `allow_cidrs` nor returned by Warren's resolver for an allowed name.
    AddressNotAllowed,
    /// Not a valid DNS name.
    InvalidName,
    /// The original destination could not be determined, or is the proxy itself.
    NoDestination,
    /// The first bytes looked like TLS or HTTP but could not be parsed.
    Malformed,
    /// A placeholder was sent towards a host outside its scope.
    SecretOutOfScope,
    /// Warren's own resolution of the name failed.
    ResolveFailed,
    /// An address of the namespace the egress connects out from (the host itself).
    HostAddress,
    /// A request on a connection names another host than the one the connection was
    /// decided for (its first request's host, or its SNI).
    HostMismatch,
    /// A protocol Warren refuses rather than relay undecided (HTTP/2 with prior knowledge).
    UnsupportedProtocol,
    /// TLS without SNI while every TLS connection must be intercepted (`intercept_all_tls`).
    MissingSni,
    /// The VM already has as many connections open through the egress as it may
    /// (`MAX_CONNECTIONS`, `MAX_DNS_TCP_CONNECTIONS`).
    TooManyConnections,
    /// A request target that does not match an interception rule as written but that a
    /// lenient server could route to the rule's path (`/oauth/./token`, `%2F`, `post`).
    AmbiguousTarget,
}

impl DenyReason {
    /// Stable machine name, used in logs.
    pub fn as_str(self) -> &'static str {
        match self {
            DenyReason::BlockedAddress => "blocked_address",
            DenyReason::DeniedCidr => "denied_cidr",
            DenyReason::DeniedName => "denied_name",
            DenyReason::NameNotAllowed => "name_not_allowed",
            DenyReason::NameAddressMismatch => "name_address_mismatch",
            DenyReason::AddressNotAllowed => "address_not_allowed",
            DenyReason::InvalidName => "invalid_name",
            DenyReason::NoDestination => "no_destination",
            DenyReason::Malformed => "malformed",
            DenyReason::SecretOutOfScope => "secret_out_of_scope",
            DenyReason::ResolveFailed => "resolve_failed",
            DenyReason::HostAddress => "host_address",
            DenyReason::HostMismatch => "host_mismatch",
            DenyReason::UnsupportedProtocol => "unsupported_protocol",
            DenyReason::MissingSni => "missing_sni",
            DenyReason::TooManyConnections => "too_many_connections",
            DenyReason::AmbiguousTarget => "ambiguous_target",
        }
    }
}

impl fmt::Display for DenyReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl EgressPolicy {
    /// The address-level refusal that applies to `ip` whatever the name: always-denied ranges,
    /// `blocked_cidrs`, then `deny_cidrs`.
    pub fn address_block(&self, ip: Ipv4Addr) -> Option<DenyReason> {
        if is_always_denied(ip) || self.blocked_cidrs.iter().any(|n| n.contains(&ip)) {
            Some(DenyReason::BlockedAddress)
        } else if self.deny_cidrs.iter().any(|n| n.contains(&ip)) {
            Some(DenyReason::DeniedCidr)
        } else {
            None
        }
    }

    /// Whether the policy grants `ip` by address (never a blocked one): it is in
    /// `allow_cidrs`, or the mode is [`EgressMode::Internet`]. The outbound namespace's own
    /// addresses are refused by the proxy before it asks.
    pub fn cidr_allows(&self, ip: Ipv4Addr) -> bool {
        self.address_block(ip).is_none()
            && (self.mode == EgressMode::Internet
                || self.allow_cidrs.iter().any(|n| n.contains(&ip)))
    }

    /// The name-level verdict for a normalised name: deny list first, then the allow list
    /// (every name in [`EgressMode::Internet`]).
    pub fn name_verdict(&self, name: &str) -> Result<(), DenyReason> {
        if any_matches(&self.deny_domains, name) {
            Err(DenyReason::DeniedName)
        } else if self.mode == EgressMode::Internet || any_matches(&self.allow_domains, name) {
            Ok(())
        } else {
            Err(DenyReason::NameNotAllowed)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pat(s: &str) -> DomainPattern {
        s.parse().expect("valid pattern")
    }

    #[test]
    fn test_wildcard_matches_subdomains_not_apex() {
        let p = pat("*.Example.com.");
        assert!(p.matches("a.example.com"));
        assert!(p.matches("a.b.example.com"));
        assert!(!p.matches("example.com"));
        assert!(!p.matches("badexample.com"));
    }

    #[test]
    fn test_exact_pattern_matches_only_itself() {
        let p = pat("api.example.com");
        assert!(p.matches("api.example.com"));
        assert!(!p.matches("x.api.example.com"));
    }

    #[test]
    fn test_invalid_patterns_rejected() {
        for bad in [
            "",
            "*.",
            "a..b",
            "1.2.3.4",
            "exa mple.com",
            "*.*.x.com",
            "é.com",
        ] {
            assert!(bad.parse::<DomainPattern>().is_err(), "{bad}");
        }
    }

    #[test]
    fn test_deny_wins_over_allow() {
        let policy = EgressPolicy {
            allow_domains: vec![pat("*.example.com")],
            deny_domains: vec![pat("evil.example.com")],
            ..Default::default()
        };
        assert_eq!(policy.name_verdict("ok.example.com"), Ok(()));
        assert_eq!(
            policy.name_verdict("evil.example.com"),
            Err(DenyReason::DeniedName)
        );
        assert_eq!(
            policy.name_verdict("other.org"),
            Err(DenyReason::NameNotAllowed)
        );
    }

    #[test]
    fn test_always_denied_ranges() {
        for ip in [
            "169.254.169.254",
            "168.63.129.16",
            "192.0.0.170",
            "10.1.2.3",
            "172.31.0.1",
            "192.168.1.1",
            "127.0.0.1",
            "100.64.0.1",
            "0.0.0.0",
            "255.255.255.255",
            "224.0.0.1",
        ] {
            assert!(is_always_denied(ip.parse().expect("ip")), "{ip}");
        }
        for ip in ["203.0.113.10", "198.51.100.1", "8.8.8.8", "172.32.0.1"] {
            assert!(!is_always_denied(ip.parse().expect("ip")), "{ip}");
        }
    }

    #[test]
    fn test_internet_mode_allows_public_not_blocked_or_denied() {
        let policy = EgressPolicy {
            mode: EgressMode::Internet,
            deny_domains: vec![pat("*.denied.test")],
            deny_cidrs: vec!["198.51.100.0/24".parse().expect("net")],
            blocked_cidrs: vec!["203.0.113.128/25".parse().expect("net")],
            ..Default::default()
        };
        assert_eq!(policy.name_verdict("any.example.org"), Ok(()));
        assert_eq!(
            policy.name_verdict("x.denied.test"),
            Err(DenyReason::DeniedName)
        );
        let ip = |s: &str| s.parse::<Ipv4Addr>().expect("ip");
        // TEST-NET ranges are public here: the documentation ranges are not always denied.
        assert!(policy.cidr_allows(ip("203.0.113.10")));
        assert!(policy.cidr_allows(ip("192.0.2.7")));
        assert!(policy.cidr_allows(ip("8.8.8.8")));
        for refused in ["10.1.2.3", "192.168.1.1", "169.254.169.254", "127.0.0.1"] {
            assert!(!policy.cidr_allows(ip(refused)), "{refused}");
        }
        assert!(!policy.cidr_allows(ip("198.51.100.1")), "deny_cidrs win");
        assert!(
            !policy.cidr_allows(ip("203.0.113.200")),
            "blocked_cidrs win"
        );
        // The same policy in allow-list mode grants nothing.
        let allowlist = EgressPolicy {
            mode: EgressMode::Allowlist,
            ..policy
        };
        assert!(!allowlist.cidr_allows(ip("203.0.113.10")));
        assert_eq!(
            allowlist.name_verdict("any.example.org"),
            Err(DenyReason::NameNotAllowed)
        );
    }

    #[test]
    fn test_allow_cidr_cannot_open_blocked_range() {
        let policy = EgressPolicy {
            allow_cidrs: vec!["10.0.0.0/8".parse().expect("net")],
            ..Default::default()
        };
        assert!(!policy.cidr_allows("10.1.1.1".parse().expect("ip")));
        assert_eq!(
            policy.address_block("10.1.1.1".parse().expect("ip")),
            Some(DenyReason::BlockedAddress)
        );
    }
}
