//! Per-VM egress configuration: policy, upstream DNS, secrets, interception rules, TLS roots.
//!
//! Built by the caller (the lead's service), checked once by [`EgressConfig::validate`] (called
//! by [`crate::Egress::new`]); after that the running egress only reads it.

use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use crate::error::{ConfigError, SecretError};
use crate::policy::{DomainPattern, EgressPolicy};

/// Default timeout of an interception command: long enough for a host CLI to refresh a token.
pub const DEFAULT_RULE_TIMEOUT: Duration = Duration::from_secs(60);

/// The whole egress configuration of one VM.
#[derive(Debug, Clone)]
pub struct EgressConfig {
    /// VM identifier, used in every log line.
    pub vm: String,
    /// Allow/deny lists.
    pub policy: EgressPolicy,
    /// Upstream recursive resolver Warren asks for allowed names (reached through the
    /// [`crate::Outbound`] strategy).
    pub upstream_dns: SocketAddr,
    /// Host-held secrets substituted into request headers.
    pub secrets: Vec<SecretSpec>,
    /// Extra header names (besides `Authorization`) in which placeholders are substituted,
    /// for secrets that name no headers of their own ([`SecretSpec::headers`]).
    pub secret_headers: Vec<String>,
    /// Requests answered by a host command instead of the upstream.
    pub intercepts: Vec<InterceptRule>,
    /// Terminate every allowed TLS connection that has an SNI (not only those of hosts with
    /// secrets or rules), so that each request's `Host` is checked against the SNI: closes
    /// domain fronting to a co-hosted name inside passed-through TLS, at the cost of HTTP/1.1
    /// only (no HTTP/2) and no non-HTTP protocols over TLS; TLS without SNI is then refused
    /// unless its destination is in `allow_cidrs`.
    pub intercept_all_tls: bool,
    /// Roots that upstream TLS certificates are verified against on intercepted connections.
    pub upstream_roots: UpstreamRoots,
    /// More roots trusted upstream in addition to `upstream_roots`, PEM: the host's own CAs
    /// for hosts behind TLS inspection ([`crate::load_host_cas`]).
    pub host_roots: Option<String>,
    /// The VM's interception CA; `None` generates a new one (persist [`crate::Egress::ca`] to
    /// keep the guest's trust across restarts).
    pub ca: Option<CaMaterial>,
    /// Decision log budget: burst size and refill per second (per VM).
    pub log_burst: u32,
    /// Decision log refill rate per second.
    pub log_per_second: u32,
}

impl EgressConfig {
    /// A fail-closed configuration: nothing allowed, no secrets, web PKI roots.
    pub fn new(vm: impl Into<String>, upstream_dns: SocketAddr) -> Self {
        EgressConfig {
            vm: vm.into(),
            policy: EgressPolicy::default(),
            upstream_dns,
            secrets: Vec::new(),
            secret_headers: Vec::new(),
            intercepts: Vec::new(),
            intercept_all_tls: false,
            upstream_roots: UpstreamRoots::WebPki,
            host_roots: None,
            ca: None,
            log_burst: 50,
            log_per_second: 10,
        }
    }

    /// Checks placeholders, hosts, header names and rules.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let mut seen = std::collections::HashSet::new();
        for s in &self.secrets {
            let printable = s.placeholder.bytes().all(|b| b.is_ascii_graphic());
            if s.placeholder.len() < 8 || !printable || !seen.insert(s.placeholder.as_str()) {
                return Err(ConfigError::Placeholder(s.name.clone()));
            }
            if s.hosts.is_empty() {
                return Err(ConfigError::SecretHosts(s.name.clone()));
            }
        }
        let named = self.secrets.iter().flat_map(|s| s.headers.iter());
        for h in self.secret_headers.iter().chain(named) {
            if h.is_empty() || !h.bytes().all(is_token_byte) {
                return Err(ConfigError::HeaderName(h.clone()));
            }
        }
        for (index, r) in self.intercepts.iter().enumerate() {
            let reason = if r.command.is_empty() {
                Some("empty command")
            } else if !std::path::Path::new(&r.command[0]).is_absolute() {
                Some("the program must be an absolute path")
            } else if r.method.is_empty() || !r.method.bytes().all(is_token_byte) {
                Some("invalid method")
            } else if !r.path_prefix.starts_with('/') {
                Some("path prefix must start with '/'")
            } else if r.timeout.is_zero() {
                Some("zero timeout")
            } else {
                None
            };
            if let Some(reason) = reason {
                return Err(ConfigError::Rule { index, reason });
            }
        }
        Ok(())
    }
}

pub(crate) fn is_token_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// A secret the guest only knows by its placeholder.
#[derive(Debug, Clone)]
pub struct SecretSpec {
    /// Operator name, used in logs and errors.
    pub name: String,
    /// The string the guest uses in place of the real value.
    pub placeholder: String,
    /// Hosts the real value may be sent to (matched against SNI).
    pub hosts: Vec<DomainPattern>,
    /// Where the real value lives.
    pub source: SecretSource,
    /// The request headers the value is substituted into (case-insensitive names). Empty:
    /// `Authorization` and the configuration's `secret_headers`. An API key that its provider
    /// takes in one header (`x-api-key`) names only that one, so a placeholder the guest puts
    /// in any other header goes out unsubstituted. In `Authorization`, a `Basic` credential is
    /// decoded, substituted and re-encoded (git over HTTPS sends tokens that way).
    pub headers: Vec<String>,
}

/// Where a secret's real value comes from.
#[derive(Clone)]
pub enum SecretSource {
    /// A host file, re-read on every new intercepted connection; one trailing newline is
    /// stripped. Keep it outside anything shared with the guest.
    File(PathBuf),
    /// A string field of a host JSON file, addressed by a JSON pointer (RFC 6901, e.g.
    /// `/claudeAiOauth/accessToken`), re-read on every new intercepted connection. This is how
    /// an agent's own credential file is used without copying its token anywhere.
    JsonField {
        /// The JSON file.
        path: PathBuf,
        /// JSON pointer to a string value.
        pointer: String,
    },
    /// A fixed value.
    Static(String),
}

impl fmt::Debug for SecretSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SecretSource::File(p) => f.debug_tuple("File").field(p).finish(),
            SecretSource::JsonField { path, pointer } => f
                .debug_struct("JsonField")
                .field("path", path)
                .field("pointer", pointer)
                .finish(),
            SecretSource::Static(_) => f.write_str("Static(<redacted>)"),
        }
    }
}

/// A resolved secret value; its `Debug` is redacted so it cannot leak through `{:?}`.
#[derive(Clone)]
pub(crate) struct SecretValue(pub(crate) String);

impl fmt::Debug for SecretValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

impl SecretSpec {
    /// Whether the value may be substituted into header `name` (given the configuration's
    /// `secret_headers`).
    pub(crate) fn substitutes_in(&self, name: &str, secret_headers: &[String]) -> bool {
        if self.headers.is_empty() {
            name.eq_ignore_ascii_case("authorization")
                || secret_headers.iter().any(|h| h.eq_ignore_ascii_case(name))
        } else {
            self.headers.iter().any(|h| h.eq_ignore_ascii_case(name))
        }
    }

    /// Reads the current value (the file for [`SecretSource::File`]).
    pub(crate) fn resolve(&self) -> Result<SecretValue, SecretError> {
        let raw = match &self.source {
            SecretSource::Static(v) => v.clone(),
            SecretSource::File(path) => {
                std::fs::read_to_string(path).map_err(|source| SecretError::Read {
                    name: self.name.clone(),
                    path: path.clone(),
                    source,
                })?
            }
            SecretSource::JsonField { path, pointer } => {
                let text = std::fs::read_to_string(path).map_err(|source| SecretError::Read {
                    name: self.name.clone(),
                    path: path.clone(),
                    source,
                })?;
                let doc: serde_json::Value =
                    serde_json::from_str(&text).map_err(|_| SecretError::Invalid {
                        name: self.name.clone(),
                    })?;
                match doc.pointer(pointer).and_then(|v| v.as_str()) {
                    Some(v) => v.to_string(),
                    None => {
                        return Err(SecretError::Invalid {
                            name: self.name.clone(),
                        })
                    }
                }
            }
        };
        let value = raw
            .strip_suffix("\r\n")
            .or_else(|| raw.strip_suffix('\n'))
            .unwrap_or(&raw);
        let valid = !value.is_empty()
            && value
                .bytes()
                .all(|b| b == b'\t' || (b' '..=b'~').contains(&b));
        if !valid {
            return Err(SecretError::Invalid {
                name: self.name.clone(),
            });
        }
        Ok(SecretValue(value.to_string()))
    }
}

/// A request answered on the host by a command instead of the upstream server (for example
/// an OAuth token refresh).
#[derive(Debug, Clone)]
pub struct InterceptRule {
    /// Host (SNI or Host header) the rule applies to.
    pub host: DomainPattern,
    /// Exact request method, for example `POST`.
    pub method: String,
    /// Request-target prefix, for example `/v1/oauth/token`, matched against the target in
    /// origin-form as written (an absolute-form target by its path); a request a lenient
    /// server could route under it in another spelling is refused (see `docs/egress.md`).
    pub path_prefix: String,
    /// Program and arguments. It gets the request (its head re-serialised with the target in
    /// origin-form, the body as received) on stdin and must print a complete raw HTTP
    /// response on stdout.
    pub command: Vec<String>,
    /// User the command runs as.
    pub uid: u32,
    /// Group the command runs as (no supplementary groups).
    pub gid: u32,
    /// Killed (whole process group) after this long; the guest then gets 504.
    pub timeout: Duration,
    /// Extra environment (the command starts with an empty environment plus `PATH` and the
    /// `WARREN_INTERCEPT_*` variables).
    pub env: Vec<(String, String)>,
}

/// Trust anchors for upstream TLS on intercepted connections.
#[derive(Debug, Clone)]
pub enum UpstreamRoots {
    /// Mozilla's roots as shipped by `webpki-roots`.
    WebPki,
    /// Certificates from PEM text (one or more `CERTIFICATE` blocks), for tests or private PKI.
    Pem(String),
}

/// A VM's interception CA, to persist across restarts of the egress (the guest keeps trusting
/// the certificate). The key must stay on the host.
#[derive(Clone)]
pub struct CaMaterial {
    /// Self-signed CA certificate, PEM: send this to the guest.
    pub cert_pem: String,
    /// PKCS#8 private key, PEM: host only.
    pub key_pem: String,
}

impl fmt::Debug for CaMaterial {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CaMaterial")
            .field("cert_pem", &self.cert_pem)
            .field("key_pem", &"<redacted>")
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(source: SecretSource) -> SecretSpec {
        SecretSpec {
            name: "t".into(),
            placeholder: "PLACEHOLDER-1".into(),
            hosts: vec!["api.test".parse().expect("pattern")],
            source,
            headers: vec![],
        }
    }

    #[test]
    fn rules_need_an_absolute_program() {
        let mut cfg = EgressConfig::new("vm", "192.0.2.53:53".parse().expect("addr"));
        let rule = |program: &str| InterceptRule {
            host: "auth.test".parse().expect("pattern"),
            method: "POST".into(),
            path_prefix: "/token".into(),
            command: vec![program.into()],
            uid: 65534,
            gid: 65534,
            timeout: DEFAULT_RULE_TIMEOUT,
            env: vec![],
        };
        cfg.intercepts = vec![rule("/bin/hook")];
        assert!(cfg.validate().is_ok());
        cfg.intercepts = vec![rule("hook")];
        assert!(matches!(
            cfg.validate(),
            Err(ConfigError::Rule { index: 0, .. })
        ));
    }

    #[test]
    fn json_field_secret_is_reread_and_checked() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("creds.json");
        let pointer = "/oauth/accessToken".to_string();
        let s = spec(SecretSource::JsonField {
            path: path.clone(),
            pointer,
        });
        std::fs::write(&path, r#"{"oauth":{"accessToken":"tok-1","expiresAt":1}}"#).expect("w");
        assert_eq!(s.resolve().expect("value").0, "tok-1");
        std::fs::write(&path, r#"{"oauth":{"accessToken":"tok-2"}}"#).expect("w");
        assert_eq!(s.resolve().expect("rotated").0, "tok-2");
        // Missing field, non-string field, malformed JSON, missing file: all refused.
        for bad in [r#"{"oauth":{}}"#, r#"{"oauth":{"accessToken":5}}"#, "{"] {
            std::fs::write(&path, bad).expect("w");
            assert!(
                matches!(s.resolve(), Err(SecretError::Invalid { .. })),
                "{bad}"
            );
        }
        std::fs::remove_file(&path).expect("rm");
        assert!(matches!(s.resolve(), Err(SecretError::Read { .. })));
        // The path and pointer may be logged; nothing else is.
        assert!(format!("{:?}", s.source).contains("accessToken"));
    }
}
