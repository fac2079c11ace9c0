//! Signatures and attestations of images, checked offline against the [`Policy`].
//!
//! The formats are cosign's, so images signed with `cosign sign --key` and
//! `cosign attest --key` (or any implementation of the same formats) verify here, and what
//! `warren image sign` makes verifies with cosign's public-key tooling:
//! - a **signature** is a "simple signing" payload (JSON:
//!   `{"critical":{"identity":{"docker-reference":…},"image":{"docker-manifest-digest":"sha256:…"},"type":"cosign container image signature"},"optional":…}`)
//!   and an ASN.1 DER ECDSA P-256 SHA-256 signature over its exact bytes;
//! - an **attestation** is a DSSE envelope (`payloadType` `application/vnd.in-toto+json`,
//!   base64 `payload`, `signatures[].sig` over DSSE's pre-authentication encoding) holding an
//!   in-toto statement whose `subject` has the image's digest, with a `predicateType` and,
//!   for SLSA provenance, a builder id (`predicate.builder.id` in v0.2,
//!   `predicate.runDetails.builder.id` in v1).
//!
//! The *subject* of an image is the digest it is known by: the OCI manifest (or index) digest
//! it was pulled by, or `sha256:<image id>` for a local build. An image's signatures and
//! attestations are kept in `trust.json` in its directory (fetched from the registry's cosign
//! tags at pull, added by `warren image sign`); they are data to verify, never trusted as
//! such. Parsing is bounded: at most [`MAX_ENTRIES`] of each, [`MAX_PAYLOAD`] bytes each.
//!
//! Cryptography is `ring`'s (ECDSA P-256); PEM is `rustls-pki-types`'. The key format check
//! (a fixed SubjectPublicKeyInfo prefix) and DSSE's encoding are the thin layer written here.

use std::fmt;
use std::path::PathBuf;

use base64::Engine as _;
use ring::rand::SystemRandom;
use ring::signature::{EcdsaKeyPair, KeyPair, ECDSA_P256_SHA256_ASN1_SIGNING};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::PrivatePkcs8KeyDer;
use serde::{Deserialize, Serialize};

use crate::policy::{Policy, P256_SPKI_PREFIX};

/// Most signatures and most attestations kept or checked per image.
pub const MAX_ENTRIES: usize = 64;
/// Largest decoded payload or signature.
pub const MAX_PAYLOAD: usize = 1 << 20;
/// The in-toto payload type of DSSE envelopes.
pub const IN_TOTO_PAYLOAD_TYPE: &str = "application/vnd.in-toto+json";
/// cosign's simple-signing type string.
pub const COSIGN_TYPE: &str = "cosign container image signature";
/// The predicate type `warren image sign --builder-id` attests (SLSA provenance v1).
pub const SLSA_PROVENANCE_V1: &str = "https://slsa.dev/provenance/v1";

const B64: base64::engine::GeneralPurpose = base64::engine::general_purpose::STANDARD;

/// Why the policy refused an image (or refuses every image).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TrustFailure {
    /// The policy file does not parse or breaks a rule.
    PolicyInvalid(String),
    /// A policy was in force and its file is gone.
    PolicyMissing { path: PathBuf, seen: u64 },
    /// The policy's version is older than the newest one seen.
    PolicyRollback { version: u64, seen: u64 },
    /// The policy is past its expiry.
    PolicyExpired { version: u64, expires_unix: i64 },
    /// The image has no signature at all.
    SignatureMissing { subject: String },
    /// Signatures exist, but none verifies under a trusted key.
    UnknownSigner { subject: String },
    /// A trusted key signed, but another digest than the image's.
    WrongDigest { subject: String, signed: String },
    /// No signed attestation meets a rule.
    AttestationMissing {
        subject: String,
        predicate_type: String,
        builder_ids: Vec<String>,
    },
}

impl TrustFailure {
    /// A stable name of the failure, first in its message.
    pub fn kind(&self) -> &'static str {
        match self {
            TrustFailure::PolicyInvalid(_) => "policy_invalid",
            TrustFailure::PolicyMissing { .. } => "policy_missing",
            TrustFailure::PolicyRollback { .. } => "policy_rollback",
            TrustFailure::PolicyExpired { .. } => "policy_expired",
            TrustFailure::SignatureMissing { .. } => "signature_missing",
            TrustFailure::UnknownSigner { .. } => "unknown_signer",
            TrustFailure::WrongDigest { .. } => "wrong_digest",
            TrustFailure::AttestationMissing { .. } => "attestation_missing",
        }
    }
}

impl fmt::Display for TrustFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: ", self.kind())?;
        match self {
            TrustFailure::PolicyInvalid(r) => write!(f, "the image policy is invalid: {r}"),
            TrustFailure::PolicyMissing { path, seen } => write!(
                f,
                "the image policy {} is missing, and version {seen} was in force \
                 (to go back to no policy, remove its seen record too)",
                path.display()
            ),
            TrustFailure::PolicyRollback { version, seen } => write!(
                f,
                "the image policy's version {version} is older than version {seen} seen \
                 before (rollback refused)"
            ),
            TrustFailure::PolicyExpired {
                version,
                expires_unix,
            } => write!(
                f,
                "the image policy (version {version}) expired at unix time {expires_unix}: \
                 nothing boots until a new version is installed"
            ),
            TrustFailure::SignatureMissing { subject } => {
                write!(f, "{subject} has no signature")
            }
            TrustFailure::UnknownSigner { subject } => write!(
                f,
                "no signature of {subject} verifies under a key the policy trusts"
            ),
            TrustFailure::WrongDigest { subject, signed } => write!(
                f,
                "a trusted key signed {signed}, not this image's {subject}"
            ),
            TrustFailure::AttestationMissing {
                subject,
                predicate_type,
                builder_ids,
            } => write!(
                f,
                "{subject} has no attestation of {predicate_type} by builder {} signed by a \
                 key the rule allows",
                builder_ids.join(" or ")
            ),
        }
    }
}

/// A cosign signature: the simple-signing payload and the signature, both base64.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SignatureEntry {
    pub payload: String,
    pub signature: String,
}

/// One signature of a DSSE envelope.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DsseSignature {
    #[serde(default)]
    pub keyid: String,
    pub sig: String,
}

/// A DSSE envelope.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DsseEnvelope {
    #[serde(rename = "payloadType")]
    pub payload_type: String,
    pub payload: String,
    pub signatures: Vec<DsseSignature>,
}

/// An image's signatures and attestations (`trust.json`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrustMaterial {
    #[serde(default)]
    pub signatures: Vec<SignatureEntry>,
    #[serde(default)]
    pub attestations: Vec<DsseEnvelope>,
}

impl TrustMaterial {
    /// Adds entries not already present; past [`MAX_ENTRIES`] of a kind, the oldest go.
    pub fn merge(&mut self, other: TrustMaterial) {
        for s in other.signatures {
            if !self.signatures.contains(&s) {
                self.signatures.push(s);
            }
        }
        for a in other.attestations {
            if !self.attestations.contains(&a) {
                self.attestations.push(a);
            }
        }
        let extra = self.signatures.len().saturating_sub(MAX_ENTRIES);
        self.signatures.drain(..extra);
        let extra = self.attestations.len().saturating_sub(MAX_ENTRIES);
        self.attestations.drain(..extra);
    }
}

/// What a successful check found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verified {
    pub policy_version: u64,
    /// The trusted key that signed the image.
    pub signed_by: String,
    /// For each attestation rule, the key that signed the attestation meeting it.
    pub attested_by: Vec<String>,
}

fn decode(b64: &str) -> Option<Vec<u8>> {
    if b64.len() > MAX_PAYLOAD * 4 / 3 + 4 {
        return None;
    }
    B64.decode(b64.trim()).ok()
}

/// DSSE's pre-authentication encoding.
pub fn pae(payload_type: &str, payload: &[u8]) -> Vec<u8> {
    let mut out = format!(
        "DSSEv1 {} {} {} ",
        payload_type.len(),
        payload_type,
        payload.len()
    )
    .into_bytes();
    out.extend_from_slice(payload);
    out
}

#[derive(Deserialize)]
struct SimpleSigning {
    critical: Critical,
}

#[derive(Deserialize)]
struct Critical {
    image: CriticalImage,
    #[serde(rename = "type")]
    kind: String,
}

#[derive(Deserialize)]
struct CriticalImage {
    #[serde(rename = "docker-manifest-digest")]
    digest: String,
}

/// Checks `material` for the image known as `subject` (`sha256:<hex>`) against `policy`.
pub fn verify(
    policy: &Policy,
    subject: &str,
    material: &TrustMaterial,
) -> Result<Verified, TrustFailure> {
    let mut signed_by = None;
    let mut wrong = None;
    for s in material.signatures.iter().take(MAX_ENTRIES) {
        let (Some(payload), Some(sig)) = (decode(&s.payload), decode(&s.signature)) else {
            continue;
        };
        let Some(key) = policy.keys.iter().find(|k| k.verifies(&payload, &sig)) else {
            continue;
        };
        let Ok(doc) = serde_json::from_slice::<SimpleSigning>(&payload) else {
            continue;
        };
        if doc.critical.kind != COSIGN_TYPE {
            continue;
        }
        if doc.critical.image.digest == subject {
            signed_by = Some(key.name.clone());
            break;
        }
        wrong = Some(doc.critical.image.digest);
    }
    let signed_by = match (signed_by, wrong) {
        (Some(k), _) => k,
        (None, Some(signed)) => {
            return Err(TrustFailure::WrongDigest {
                subject: subject.to_string(),
                signed,
            })
        }
        (None, None) if material.signatures.is_empty() => {
            return Err(TrustFailure::SignatureMissing {
                subject: subject.to_string(),
            })
        }
        (None, None) => {
            return Err(TrustFailure::UnknownSigner {
                subject: subject.to_string(),
            })
        }
    };
    let hex = subject.strip_prefix("sha256:").unwrap_or(subject);
    let mut attested_by = Vec::new();
    for rule in &policy.attestations {
        let found = material
            .attestations
            .iter()
            .take(MAX_ENTRIES)
            .find_map(|env| attestation_meets(policy, rule, hex, env));
        match found {
            Some(k) => attested_by.push(k),
            None => {
                return Err(TrustFailure::AttestationMissing {
                    subject: subject.to_string(),
                    predicate_type: rule.predicate_type.clone(),
                    builder_ids: rule.builder_ids.clone(),
                })
            }
        }
    }
    Ok(Verified {
        policy_version: policy.version,
        signed_by,
        attested_by,
    })
}

/// The name of the allowed key that signed `env`, if `env` is an in-toto statement about
/// `hex` meeting `rule`.
fn attestation_meets(
    policy: &Policy,
    rule: &crate::policy::AttestationRule,
    hex: &str,
    env: &DsseEnvelope,
) -> Option<String> {
    if env.payload_type != IN_TOTO_PAYLOAD_TYPE {
        return None;
    }
    let payload = decode(&env.payload)?;
    let message = pae(&env.payload_type, &payload);
    let key = env.signatures.iter().take(MAX_ENTRIES).find_map(|s| {
        let sig = decode(&s.sig)?;
        policy
            .keys
            .iter()
            .filter(|k| rule.keys.is_empty() || rule.keys.contains(&k.name))
            .find(|k| k.verifies(&message, &sig))
    })?;
    let st: serde_json::Value = serde_json::from_slice(&payload).ok()?;
    let type_ok = matches!(
        st["_type"].as_str(),
        Some("https://in-toto.io/Statement/v0.1" | "https://in-toto.io/Statement/v1")
    );
    let subject_ok = st["subject"]
        .as_array()?
        .iter()
        .any(|s| s["digest"]["sha256"].as_str() == Some(hex));
    let builder = st["predicate"]["runDetails"]["builder"]["id"]
        .as_str()
        .or_else(|| st["predicate"]["builder"]["id"].as_str())?;
    (type_ok
        && subject_ok
        && st["predicateType"].as_str() == Some(rule.predicate_type.as_str())
        && rule.builder_ids.iter().any(|b| b == builder))
    .then(|| key.name.clone())
}

/// A P-256 signing key read from PKCS#8 PEM (`-----BEGIN PRIVATE KEY-----`, as
/// `openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256` or
/// `warren image keygen` write).
pub struct SigningKey {
    pair: EcdsaKeyPair,
    rng: SystemRandom,
}

impl SigningKey {
    /// Parses the PEM.
    pub fn from_pem(pem: &[u8]) -> Result<SigningKey, String> {
        let der = PrivatePkcs8KeyDer::from_pem_slice(pem)
            .map_err(|e| format!("not a PKCS#8 PEM private key ({e:?})"))?;
        let rng = SystemRandom::new();
        let pair = EcdsaKeyPair::from_pkcs8(
            &ECDSA_P256_SHA256_ASN1_SIGNING,
            der.secret_pkcs8_der(),
            &rng,
        )
        .map_err(|e| format!("not an ECDSA P-256 private key ({e})"))?;
        Ok(SigningKey { pair, rng })
    }

    fn sign(&self, message: &[u8]) -> Result<Vec<u8>, String> {
        self.pair
            .sign(&self.rng, message)
            .map(|s| s.as_ref().to_vec())
            .map_err(|e| format!("signing failed ({e})"))
    }

    /// The public key as PEM (SubjectPublicKeyInfo).
    pub fn public_pem(&self) -> String {
        let mut der = P256_SPKI_PREFIX.to_vec();
        der.extend_from_slice(self.pair.public_key().as_ref());
        pem("PUBLIC KEY", &der)
    }

    /// A cosign signature of the image known as `subject`, with `reference` as its
    /// `docker-reference`.
    pub fn sign_image(&self, subject: &str, reference: &str) -> Result<SignatureEntry, String> {
        let payload = serde_json::to_vec(&serde_json::json!({
            "critical": {
                "identity": {"docker-reference": reference},
                "image": {"docker-manifest-digest": subject},
                "type": COSIGN_TYPE,
            },
            "optional": null,
        }))
        .map_err(|e| e.to_string())?;
        Ok(SignatureEntry {
            signature: B64.encode(self.sign(&payload)?),
            payload: B64.encode(payload),
        })
    }

    /// A DSSE-enveloped in-toto statement about `subject` (named `name`) with
    /// `predicate_type` and `predicate`.
    pub fn attest(
        &self,
        subject: &str,
        name: &str,
        predicate_type: &str,
        predicate: serde_json::Value,
    ) -> Result<DsseEnvelope, String> {
        let hex = subject.strip_prefix("sha256:").unwrap_or(subject);
        let statement = serde_json::to_vec(&serde_json::json!({
            "_type": "https://in-toto.io/Statement/v1",
            "subject": [{"name": name, "digest": {"sha256": hex}}],
            "predicateType": predicate_type,
            "predicate": predicate,
        }))
        .map_err(|e| e.to_string())?;
        let sig = self.sign(&pae(IN_TOTO_PAYLOAD_TYPE, &statement))?;
        Ok(DsseEnvelope {
            payload_type: IN_TOTO_PAYLOAD_TYPE.to_string(),
            payload: B64.encode(statement),
            signatures: vec![DsseSignature {
                keyid: String::new(),
                sig: B64.encode(sig),
            }],
        })
    }
}

fn pem(label: &str, der: &[u8]) -> String {
    let b64 = B64.encode(der);
    let mut out = format!("-----BEGIN {label}-----\n");
    for chunk in b64.as_bytes().chunks(64) {
        out.push_str(&String::from_utf8_lossy(chunk));
        out.push('\n');
    }
    out.push_str(&format!("-----END {label}-----\n"));
    out
}

/// A new P-256 key pair: (PKCS#8 PEM private key, SPKI PEM public key).
pub fn generate_key_pair() -> Result<(String, String), String> {
    let rng = SystemRandom::new();
    let pkcs8 = EcdsaKeyPair::generate_pkcs8(&ECDSA_P256_SHA256_ASN1_SIGNING, &rng)
        .map_err(|e| format!("key generation failed ({e})"))?;
    let private = pem("PRIVATE KEY", pkcs8.as_ref());
    let key = SigningKey::from_pem(private.as_bytes())?;
    Ok((private, key.public_pem()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::tests::{key_pair, policy_text};
    use std::path::Path;

    const SUBJECT: &str = "sha256:1111111111111111111111111111111111111111111111111111111111111111";
    const OTHER: &str = "sha256:2222222222222222222222222222222222222222222222222222222222222222";

    fn policy(public: &str, extra: &str) -> Policy {
        Policy::parse(
            &policy_text(1, "2999-01-01T00:00:00Z", public, extra),
            Path::new("p"),
        )
        .expect("policy")
    }

    #[test]
    fn test_verify_signature_cases() {
        let (private, public) = key_pair();
        let (other_private, _) = key_pair();
        let key = SigningKey::from_pem(private.as_bytes()).expect("key");
        assert_eq!(key.public_pem(), public);
        let p = policy(&public, "");
        let good = TrustMaterial {
            signatures: vec![key.sign_image(SUBJECT, "warren/minimal").expect("sign")],
            ..Default::default()
        };
        assert_eq!(verify(&p, SUBJECT, &good).expect("ok").signed_by, "k1");
        let e = verify(&p, SUBJECT, &TrustMaterial::default()).expect_err("none");
        assert_eq!(e.kind(), "signature_missing");
        let wrong_key = TrustMaterial {
            signatures: vec![SigningKey::from_pem(other_private.as_bytes())
                .expect("key")
                .sign_image(SUBJECT, "x")
                .expect("sign")],
            ..Default::default()
        };
        assert_eq!(
            verify(&p, SUBJECT, &wrong_key).expect_err("x").kind(),
            "unknown_signer"
        );
        let other = TrustMaterial {
            signatures: vec![key.sign_image(OTHER, "x").expect("sign")],
            ..Default::default()
        };
        assert_eq!(
            verify(&p, SUBJECT, &other).expect_err("x").kind(),
            "wrong_digest"
        );
        // A payload changed after signing.
        let mut tampered = good.clone();
        let mut payload = B64.decode(&tampered.signatures[0].payload).expect("b64");
        payload[10] ^= 1;
        tampered.signatures[0].payload = B64.encode(payload);
        assert_eq!(
            verify(&p, SUBJECT, &tampered).expect_err("x").kind(),
            "unknown_signer"
        );
    }

    #[test]
    fn test_verify_attestation_rules() {
        let (private, public) = key_pair();
        let key = SigningKey::from_pem(private.as_bytes()).expect("key");
        let rule = "[[attestations]]\npredicate_type = \"https://slsa.dev/provenance/v1\"\nbuilder_ids = [\"https://b/1\"]\n";
        let p = policy(&public, rule);
        let mut m = TrustMaterial {
            signatures: vec![key.sign_image(SUBJECT, "x").expect("sign")],
            ..Default::default()
        };
        assert_eq!(
            verify(&p, SUBJECT, &m).expect_err("x").kind(),
            "attestation_missing"
        );
        let provenance =
            |builder: &str| serde_json::json!({"runDetails": {"builder": {"id": builder}}});
        m.attestations.push(
            key.attest(
                SUBJECT,
                "x",
                SLSA_PROVENANCE_V1,
                provenance("https://b/other"),
            )
            .expect("attest"),
        );
        m.attestations.push(
            key.attest(OTHER, "x", SLSA_PROVENANCE_V1, provenance("https://b/1"))
                .expect("attest"),
        );
        assert_eq!(
            verify(&p, SUBJECT, &m).expect_err("x").kind(),
            "attestation_missing"
        );
        m.attestations.push(
            key.attest(SUBJECT, "x", SLSA_PROVENANCE_V1, provenance("https://b/1"))
                .expect("attest"),
        );
        assert_eq!(verify(&p, SUBJECT, &m).expect("ok").attested_by, ["k1"]);
    }

    #[test]
    fn test_pae_matches_dsse_spec_example() {
        assert_eq!(
            pae("http://example.com/HelloWorld", b"hello world"),
            b"DSSEv1 29 http://example.com/HelloWorld 11 hello world".to_vec()
        );
    }
}
