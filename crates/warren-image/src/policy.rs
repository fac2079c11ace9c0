//! The operator's image policy: one TOML file (`<state dir>/image-policy.toml`) read by both
//! the CLI and the service, saying which images may boot.
//!
//! ```toml
//! version = 3                          # raise it with every change
//! expires = 2027-06-30T00:00:00Z       # no boot at all after this instant
//!
//! [[keys]]
//! name = "release"
//! public_key = """
//! -----BEGIN PUBLIC KEY-----
//! ...                                  # ECDSA P-256, as `cosign generate-key-pair` writes
//! -----END PUBLIC KEY-----
//! """
//!
//! [[attestations]]                     # each rule must be met by a signed attestation
//! predicate_type = "https://slsa.dev/provenance/v1"
//! builder_ids = ["https://ci.example.com/builder@v1"]
//! keys = ["release"]                   # optional: which keys may sign it (default: any)
//! ```
//!
//! Invariants (fail closed):
//! - a file that does not parse, has unknown keys, no key or a malformed key refuses every
//!   boot and pull, as does one past its `expires`;
//! - the newest version seen is recorded next to it (`image-policy-seen.json`: version and
//!   SHA-256 of the file); an older version (rollback) is refused, and so is other content
//!   under the version already seen (a change must raise the version);
//! - once a policy has been seen, a missing file is refused too (delete the seen record to go
//!   back to no policy);
//! - with no policy file and no record, images boot as before (no signature check).

use std::path::{Path, PathBuf};

use ring::signature::UnparsedPublicKey;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::SubjectPublicKeyInfoDer;
use serde::{Deserialize, Serialize};

use crate::digest;
use crate::trust::TrustFailure;
use crate::ImageError;

/// File name of the policy in the state directory.
pub const POLICY_FILE: &str = "image-policy.toml";
/// File name of the newest-version record in the state directory.
pub const SEEN_FILE: &str = "image-policy-seen.json";
/// Largest policy file.
const MAX_POLICY: u64 = 1 << 20;
/// The DER prefix of a P-256 `SubjectPublicKeyInfo` (id-ecPublicKey, prime256v1, a 65-byte
/// uncompressed point in the BIT STRING): the only key kind accepted.
pub(crate) const P256_SPKI_PREFIX: [u8; 26] = [
    0x30, 0x59, 0x30, 0x13, 0x06, 0x07, 0x2a, 0x86, 0x48, 0xce, 0x3d, 0x02, 0x01, 0x06, 0x08, 0x2a,
    0x86, 0x48, 0xce, 0x3d, 0x03, 0x01, 0x07, 0x03, 0x42, 0x00,
];

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PolicyFile {
    version: u64,
    expires: toml::value::Datetime,
    keys: Vec<KeyEntry>,
    #[serde(default)]
    attestations: Vec<AttestationRule>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct KeyEntry {
    name: String,
    public_key: String,
}

/// A required attestation: an in-toto statement of `predicate_type`, in a DSSE envelope
/// signed by one of `keys` (any trusted key when empty), whose builder id is one of
/// `builder_ids`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AttestationRule {
    pub predicate_type: String,
    pub builder_ids: Vec<String>,
    #[serde(default)]
    pub keys: Vec<String>,
}

/// A trusted public key: ECDSA P-256 (the uncompressed point).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TrustedKey {
    pub name: String,
    pub point: Vec<u8>,
}

impl TrustedKey {
    /// Checks an ASN.1 DER ECDSA P-256 SHA-256 signature over `message`.
    pub fn verifies(&self, message: &[u8], signature: &[u8]) -> bool {
        UnparsedPublicKey::new(&ring::signature::ECDSA_P256_SHA256_ASN1, &self.point)
            .verify(message, signature)
            .is_ok()
    }
}

/// A loaded, valid, unexpired policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    pub version: u64,
    /// SHA-256 of the file.
    pub sha256: String,
    pub expires_unix: i64,
    pub keys: Vec<TrustedKey>,
    pub attestations: Vec<AttestationRule>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Seen {
    version: u64,
    sha256: String,
}

fn invalid(path: &Path, reason: impl std::fmt::Display) -> ImageError {
    ImageError::Untrusted {
        image: None,
        failure: TrustFailure::PolicyInvalid(format!("{}: {reason}", path.display())),
    }
}

/// Parses a P-256 public key in PEM (`-----BEGIN PUBLIC KEY-----`, SubjectPublicKeyInfo).
pub fn parse_public_key(pem: &str) -> Result<Vec<u8>, String> {
    let der = SubjectPublicKeyInfoDer::from_pem_slice(pem.as_bytes())
        .map_err(|e| format!("not a PEM public key ({e:?})"))?;
    let der = der.as_ref();
    match der.strip_prefix(&P256_SPKI_PREFIX[..]) {
        Some(point) if point.len() == 65 && point[0] == 4 => Ok(point.to_vec()),
        _ => Err("not an ECDSA P-256 public key (the only kind accepted)".into()),
    }
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's `days_from_civil`).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// Unix seconds of a TOML offset date-time (a date and time with `Z` or an offset).
fn unix_of(dt: &toml::value::Datetime) -> Option<i64> {
    let (date, time, offset) = (dt.date?, dt.time?, dt.offset?);
    let days = days_from_civil(
        i64::from(date.year),
        i64::from(date.month),
        i64::from(date.day),
    );
    let secs = days * 86_400
        + i64::from(time.hour) * 3600
        + i64::from(time.minute) * 60
        + i64::from(time.second.unwrap_or(0));
    let off = match offset {
        toml::value::Offset::Z => 0,
        toml::value::Offset::Custom { minutes } => i64::from(minutes) * 60,
    };
    Some(secs - off)
}

fn now_unix() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

impl Policy {
    /// Parses policy text (no version bookkeeping, no expiry check).
    pub fn parse(text: &str, path: &Path) -> Result<Policy, ImageError> {
        let f: PolicyFile = toml::from_str(text).map_err(|e| invalid(path, e.message()))?;
        if f.version == 0 {
            return Err(invalid(path, "version must be at least 1"));
        }
        let expires_unix = unix_of(&f.expires).ok_or_else(|| {
            invalid(
                path,
                "expires must be a date and time with an offset (…T00:00:00Z)",
            )
        })?;
        if f.keys.is_empty() {
            return Err(invalid(
                path,
                "no [[keys]]: a policy trusts at least one key",
            ));
        }
        let mut keys: Vec<TrustedKey> = Vec::new();
        for k in f.keys {
            if k.name.is_empty() || keys.iter().any(|o| o.name == k.name) {
                return Err(invalid(
                    path,
                    format!("key name {:?} empty or repeated", k.name),
                ));
            }
            let point = parse_public_key(&k.public_key)
                .map_err(|e| invalid(path, format!("key {}: {e}", k.name)))?;
            keys.push(TrustedKey {
                name: k.name,
                point,
            });
        }
        for a in &f.attestations {
            if a.predicate_type.is_empty() || a.builder_ids.is_empty() {
                return Err(invalid(
                    path,
                    "an attestation rule needs predicate_type and at least one builder id",
                ));
            }
            if let Some(k) = a.keys.iter().find(|k| !keys.iter().any(|t| &t.name == *k)) {
                return Err(invalid(
                    path,
                    format!("attestation rule names unknown key {k:?}"),
                ));
            }
        }
        Ok(Policy {
            version: f.version,
            sha256: digest::sha256_hex(text.as_bytes()),
            expires_unix,
            keys,
            attestations: f.attestations,
        })
    }

    /// Loads the policy of the state directory `state_dir` (see the module docs): `None` when
    /// there is none and never was; refused when invalid, expired, rolled back or removed.
    pub fn load(state_dir: &Path) -> Result<Option<Policy>, ImageError> {
        let path = state_dir.join(POLICY_FILE);
        let seen_path = state_dir.join(SEEN_FILE);
        let seen: Option<Seen> = match std::fs::read(&seen_path) {
            Ok(b) => Some(serde_json::from_slice(&b).map_err(|e| {
                invalid(
                    &seen_path,
                    format!("unreadable record of the newest policy seen: {e}"),
                )
            })?),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(ImageError::io("read", &seen_path)(e)),
        };
        let text = match std::fs::metadata(&path) {
            Ok(m) if !m.is_file() || m.len() > MAX_POLICY => {
                return Err(invalid(
                    &path,
                    format!("not a file of at most {MAX_POLICY} bytes"),
                ))
            }
            Ok(_) => std::fs::read_to_string(&path).map_err(|e| invalid(&path, e))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return match seen {
                    None => Ok(None),
                    Some(s) => Err(ImageError::Untrusted {
                        image: None,
                        failure: TrustFailure::PolicyMissing {
                            path: path.clone(),
                            seen: s.version,
                        },
                    }),
                };
            }
            Err(e) => return Err(ImageError::io("stat", &path)(e)),
        };
        let policy = Policy::parse(&text, &path)?;
        match &seen {
            Some(s) if policy.version < s.version => {
                return Err(ImageError::Untrusted {
                    image: None,
                    failure: TrustFailure::PolicyRollback {
                        version: policy.version,
                        seen: s.version,
                    },
                })
            }
            Some(s) if policy.version == s.version && policy.sha256 != s.sha256 => {
                return Err(invalid(
                    &path,
                    format!(
                        "the content changed but the version is still {} (raise it with every change)",
                        s.version
                    ),
                ))
            }
            Some(s) if policy.version == s.version => {}
            _ => record_seen(
                &seen_path,
                &Seen {
                    version: policy.version,
                    sha256: policy.sha256.clone(),
                },
            )?,
        }
        if now_unix() >= policy.expires_unix {
            return Err(ImageError::Untrusted {
                image: None,
                failure: TrustFailure::PolicyExpired {
                    version: policy.version,
                    expires_unix: policy.expires_unix,
                },
            });
        }
        Ok(Some(policy))
    }

    /// The key named `name`.
    pub fn key(&self, name: &str) -> Option<&TrustedKey> {
        self.keys.iter().find(|k| k.name == name)
    }
}

/// Writes the newest-version record atomically (temp file, fsync, rename).
fn record_seen(path: &Path, seen: &Seen) -> Result<(), ImageError> {
    use std::io::Write;
    let dir = path
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."));
    let mut tmp = tempfile::Builder::new()
        .prefix(".image-policy-seen-")
        .tempfile_in(&dir)
        .map_err(ImageError::io("create temp file in", &dir))?;
    tmp.write_all(&digest::canonical_json(seen))
        .and_then(|()| tmp.as_file().sync_all())
        .map_err(ImageError::io("write", tmp.path().to_path_buf()))?;
    tmp.persist(path)
        .map_err(|e| ImageError::io("rename", path)(e.error))?;
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A fresh P-256 key pair: (PKCS#8 PEM of the private key, SPKI PEM of the public key).
    pub(crate) fn key_pair() -> (String, String) {
        let (private, public) = crate::trust::generate_key_pair().expect("generate");
        (private, public)
    }

    pub(crate) fn policy_text(
        version: u64,
        expires: &str,
        public_pem: &str,
        extra: &str,
    ) -> String {
        format!(
            "version = {version}\nexpires = {expires}\n[[keys]]\nname = \"k1\"\npublic_key = \"\"\"\n{public_pem}\"\"\"\n{extra}"
        )
    }

    #[test]
    fn test_days_from_civil_known_dates() {
        assert_eq!(days_from_civil(1970, 1, 1), 0);
        assert_eq!(days_from_civil(2000, 3, 1), 11_017);
        let dt: toml::value::Datetime = "2027-06-30T12:00:00+02:00".parse().expect("dt");
        assert_eq!(unix_of(&dt), Some(1_814_349_600));
    }

    #[test]
    fn test_policy_load_version_expiry_rollback_missing() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (_, public) = key_pair();
        let write = |v: u64, exp: &str, extra: &str| {
            std::fs::write(
                dir.path().join(POLICY_FILE),
                policy_text(v, exp, &public, extra),
            )
            .expect("write")
        };
        assert_eq!(Policy::load(dir.path()).expect("none"), None);
        write(2, "2999-01-01T00:00:00Z", "");
        let p = Policy::load(dir.path()).expect("load").expect("some");
        assert_eq!((p.version, p.keys.len()), (2, 1));
        // Rollback.
        write(1, "2999-01-01T00:00:00Z", "");
        let e = Policy::load(dir.path()).expect_err("rollback").to_string();
        assert!(e.contains("rollback"), "{e}");
        // Same version, other content.
        write(2, "2998-01-01T00:00:00Z", "");
        let e = Policy::load(dir.path())
            .expect_err("same version")
            .to_string();
        assert!(e.contains("raise it"), "{e}");
        // Expired.
        write(3, "2001-01-01T00:00:00Z", "");
        let e = Policy::load(dir.path()).expect_err("expired").to_string();
        assert!(e.contains("expired"), "{e}");
        // Removed.
        std::fs::remove_file(dir.path().join(POLICY_FILE)).expect("rm");
        let e = Policy::load(dir.path()).expect_err("missing").to_string();
        assert!(e.contains("missing"), "{e}");
    }

    #[test]
    fn test_policy_parse_refuses_malformed() {
        let (_, public) = key_pair();
        let p = Path::new("p.toml");
        for (text, why) in [
            (policy_text(1, "2999-01-01T00:00:00Z", &public, "bogus = 1\n"), "unknown"),
            (policy_text(0, "2999-01-01T00:00:00Z", &public, ""), "version"),
            (policy_text(1, "2999-01-01", &public, ""), "offset"),
            (policy_text(1, "2999-01-01T00:00:00Z", "junk", ""), "PEM"),
            (
                policy_text(
                    1,
                    "2999-01-01T00:00:00Z",
                    &public,
                    "[[attestations]]\npredicate_type = \"x\"\nbuilder_ids = [\"b\"]\nkeys = [\"k9\"]\n",
                ),
                "unknown key",
            ),
            ("version = 1\nexpires = 2999-01-01T00:00:00Z\nkeys = []\n".to_string(), "no [[keys]]"),
        ] {
            let e = Policy::parse(&text, p).expect_err(why).to_string();
            assert!(e.contains(why), "{why}: {e}");
        }
    }
}
