//! Targets for the service: the tools' JSON bodies, the service configuration file and the
//! egress configuration a VM's network is built from.

use serde_json::Value;
use warren_api::config::ServiceConfig;
use warren_api::fuzzing::{tool_args, TOOLS};
use warren_egress::DomainPattern;
use warren_vmm::NetSpec;

/// A `POST /v1/tools/{tool}` body: the first byte picks the tool, the rest is the body,
/// parsed as the HTTP layer parses it and then as the tool's arguments. Invariants: every
/// refusal is `invalid_argument`; accepted arguments, re-serialised, are accepted again with
/// the same receipt hash (so a retry is recognised as the same request).
pub fn api_json(data: &[u8]) {
    let Some((&pick, body)) = data.split_first() else {
        return;
    };
    let tool = TOOLS[usize::from(pick) % TOOLS.len()];
    let Ok(args) = serde_json::from_slice::<Value>(body) else {
        return;
    };
    match tool_args(tool, args) {
        Ok((hash, again)) => {
            let (hash2, again2) = tool_args(tool, again.clone())
                .unwrap_or_else(|e| panic!("{tool}: re-serialised arguments refused: {e:?}"));
            assert_eq!(hash, hash2, "{tool}: receipt hash changed");
            assert_eq!(again, again2, "{tool}: re-serialisation not stable");
        }
        Err(e) => assert_eq!(e.code, "invalid_argument", "{tool}: {e:?}"),
    }
}

/// The operator's files: the first byte picks the parser, the rest is the file. Even: the
/// service configuration (TOML), which must either parse or fail with an error, and once
/// parsed answers its derived settings. Odd: the egress settings of one VM (`NetSpec`, the
/// JSON the engine gives the supervisor), turned into the egress's configuration and
/// validated; every domain pattern it holds prints back to itself.
pub fn configs(data: &[u8]) {
    let Some((&pick, body)) = data.split_first() else {
        return;
    };
    if pick % 2 == 0 {
        let Ok(text) = std::str::from_utf8(body) else {
            return;
        };
        if let Ok(cfg) = ServiceConfig::parse(std::path::Path::new("fuzz.toml"), text) {
            let _ = cfg.host_limits();
            let _ = cfg.allowed_hosts();
            let _ = cfg.socket_path();
            assert!(
                cfg.images.contains_key(cfg.default_image()),
                "no default image"
            );
            assert!(
                cfg.images
                    .keys()
                    .all(|n| warren_api::config::valid_image_name(n)),
                "an invalid image name was accepted"
            );
        }
    } else {
        let Ok(spec) = serde_json::from_slice::<NetSpec>(body) else {
            return;
        };
        let Ok(cfg) = warren_supervisor::network::fuzz_egress_config(&spec) else {
            return;
        };
        let p = &cfg.policy;
        assert_eq!(
            p.allow_cidrs.len() + p.allow_domains.len(),
            spec.allow.len()
        );
        assert_eq!(p.deny_cidrs.len() + p.deny_domains.len(), spec.deny.len());
        let patterns = p
            .allow_domains
            .iter()
            .chain(&p.deny_domains)
            .chain(cfg.secrets.iter().flat_map(|s| &s.hosts))
            .chain(cfg.intercepts.iter().map(|r| &r.host));
        for d in patterns {
            let back: DomainPattern = d.to_string().parse().expect("a pattern prints parseably");
            assert_eq!(&back, d, "pattern does not print back to itself");
        }
    }
}
