//! Named presets for allow lists: `preset:NAME` stands for the hosts a package ecosystem's
//! ordinary installs reach. This table is the only place they are spelled out; callers
//! expand entries with [`expand`] before they parse the rest as names or CIDRs.
//!
//! A preset entry cannot collide with a host name: `:` is not legal in a DNS name (nor in
//! an IPv4 CIDR), so `preset:python` can only mean the preset.

use crate::error::ConfigError;

/// What starts a preset entry in an allow or deny list.
pub const PRESET_PREFIX: &str = "preset:";

/// Every preset and its hosts (exact names, or `*.name` wildcards as in allow lists).
///
/// - `debian`: the Debian archive (`deb.debian.org`, `ftp.debian.org`) and its security
///   archive (`security.debian.org`);
/// - `python`: the Python package index (`pypi.org`) and its file host
///   (`files.pythonhosted.org`);
/// - `npm`: the npm registry (`registry.npmjs.org`);
/// - `rust`: the Rust crate registry's sparse index (`index.crates.io`) and its download
///   host (`static.crates.io`);
/// - `go`: the Go module proxy (`proxy.golang.org`) and checksum database
///   (`sum.golang.org`);
/// - `github`: GitHub (`github.com`), its API (`api.github.com`), raw content
///   (`raw.githubusercontent.com`), archives (`codeload.github.com`) and release and LFS
///   objects (`objects.githubusercontent.com`).
pub const PRESETS: &[(&str, &[&str])] = &[
    (
        "debian",
        &["deb.debian.org", "ftp.debian.org", "security.debian.org"],
    ),
    ("python", &["pypi.org", "files.pythonhosted.org"]),
    ("npm", &["registry.npmjs.org"]),
    ("rust", &["index.crates.io", "static.crates.io"]),
    ("go", &["proxy.golang.org", "sum.golang.org"]),
    (
        "github",
        &[
            "github.com",
            "api.github.com",
            "raw.githubusercontent.com",
            "codeload.github.com",
            "objects.githubusercontent.com",
        ],
    ),
];

/// The names of every preset, for error messages and documentation.
pub fn preset_names() -> Vec<&'static str> {
    PRESETS.iter().map(|(n, _)| *n).collect()
}

/// The hosts of `entry` when it is a preset entry (`Ok(Some(..))`), `Ok(None)` when it is
/// not one (a name or CIDR, parsed by the caller), and [`ConfigError::Preset`] for an unknown
/// preset.
pub fn expand(entry: &str) -> Result<Option<&'static [&'static str]>, ConfigError> {
    let Some(name) = entry.strip_prefix(PRESET_PREFIX) else {
        return Ok(None);
    };
    PRESETS
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, hosts)| Some(*hosts))
        .ok_or_else(|| ConfigError::Preset(entry.to_string()))
}

/// `entries` with every preset entry replaced by its hosts (in place, order kept), or the
/// first unknown preset's error.
pub fn expand_all(entries: &[String]) -> Result<Vec<String>, ConfigError> {
    let mut out = Vec::with_capacity(entries.len());
    for e in entries {
        match expand(e)? {
            Some(hosts) => out.extend(hosts.iter().map(|h| h.to_string())),
            None => out.push(e.clone()),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::DomainPattern;

    #[test]
    fn test_presets_expand_to_valid_patterns() {
        for (name, hosts) in PRESETS {
            assert!(!hosts.is_empty(), "{name}");
            for h in *hosts {
                assert!(h.parse::<DomainPattern>().is_ok(), "{name}: {h}");
            }
            let got = expand(&format!("preset:{name}")).expect("known");
            assert_eq!(got, Some(*hosts));
        }
    }

    #[test]
    fn test_unknown_preset_refused_and_names_untouched() {
        for bad in ["preset:", "preset:pypi", "preset:Python", "preset:python "] {
            assert!(
                matches!(expand(bad), Err(ConfigError::Preset(_))),
                "{bad:?}"
            );
        }
        assert_eq!(expand("pypi.org").expect("name"), None);
        assert_eq!(expand("203.0.113.0/24").expect("cidr"), None);
        // A preset is not a name: nothing with a colon parses as one.
        assert!("preset:python".parse::<DomainPattern>().is_err());
        let all = expand_all(&["a.test".into(), "preset:npm".into()]).expect("expand");
        assert_eq!(all, ["a.test", "registry.npmjs.org"]);
        assert!(expand_all(&["preset:nope".into()]).is_err());
    }
}
