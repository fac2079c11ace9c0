//! The host's own CA store, for hosts behind TLS inspection (a corporate proxy that
//! re-signs HTTPS with a CA only the host trusts).
//!
//! With the operator's `host_ca_store` setting:
//! - the egress trusts every certificate of the host's bundle for upstream TLS on intercepted
//!   connections, in addition to the public roots ([`crate::EgressConfig::host_roots`]);
//! - the guest gets the host's *locally added* CAs appended to its trust bundle, with the
//!   VM's CA: the certificates in the distribution's local anchor directories
//!   ([`LOCAL_ANCHOR_DIRS`], where operators and corporate tooling install an inspection CA),
//!   or, when there are none, the bundle's certificates that are not among the public roots
//!   Warren ships (`webpki-roots`). Not the whole bundle: the guest has its own public roots,
//!   and a host's older bundle still holds roots its distribution has since withdrawn.
//!
//! Everything is read with a bounded parser: files of at most [`MAX_HOST_BUNDLE`] bytes,
//! only `CERTIFICATE` sections (keys and anything else ignored; a malformed section refuses
//! the store), each one parsed as a trust anchor and re-encoded from its DER, so nothing but
//! certificates ever reaches the guest: at most [`MAX_EXTRA_CERTS`] of them in at most
//! [`MAX_EXTRA_PEM`] bytes.

use std::io::Read;
use std::path::{Path, PathBuf};

use base64::Engine;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;

use crate::error::ConfigError;

/// Where the host's CA bundle is looked for, first existing wins (Debian and Ubuntu, Fedora
/// and RHEL, openSUSE, Alpine and others).
pub const HOST_CA_BUNDLES: &[&str] = &[
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/pki/tls/certs/ca-bundle.crt",
    "/etc/ssl/ca-bundle.pem",
    "/etc/ssl/cert.pem",
];
/// Where distributions keep locally added CAs (Debian and Ubuntu, Fedora and RHEL,
/// openSUSE, Arch): `*.crt` and `*.pem` files directly inside.
pub const LOCAL_ANCHOR_DIRS: &[&str] = &[
    "/usr/local/share/ca-certificates",
    "/etc/pki/ca-trust/source/anchors",
    "/etc/pki/trust/anchors",
    "/etc/ca-certificates/trust-source/anchors",
];
/// A bundle (or anchor file) larger than this is refused (Debian's bundle is ~220 KiB).
pub const MAX_HOST_BUNDLE: u64 = 4 * 1024 * 1024;
/// At most this many certificates go to the guest.
pub const MAX_EXTRA_CERTS: usize = 32;
/// And at most this much PEM of them: with the VM's CA it must fit the guest agent's 64 KiB
/// limit on the trust material it installs.
pub const MAX_EXTRA_PEM: usize = 48 * 1024;
/// At most this many files are read from the anchor directories.
const MAX_ANCHOR_FILES: usize = 256;

/// The host's CAs, as the egress and the guest get them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostCas {
    /// The bundle they were read from.
    pub path: PathBuf,
    /// Every usable certificate of the bundle, PEM (the egress's extra upstream roots).
    pub upstream_pem: String,
    /// The certificates for the guest's trust bundle, PEM (see the module docs).
    pub guest_pem: String,
    /// How many certificates `guest_pem` holds.
    pub guest_count: usize,
}

/// Reads the first bundle of [`HOST_CA_BUNDLES`] that exists and the anchor directories of
/// [`LOCAL_ANCHOR_DIRS`].
pub fn load_host_cas() -> Result<HostCas, ConfigError> {
    let path = HOST_CA_BUNDLES
        .iter()
        .map(Path::new)
        .find(|p| p.is_file())
        .ok_or_else(|| {
            ConfigError::HostCa(format!(
                "no host CA bundle found (looked for {})",
                HOST_CA_BUNDLES.join(", ")
            ))
        })?;
    let dirs: Vec<&Path> = LOCAL_ANCHOR_DIRS.iter().map(Path::new).collect();
    load_host_cas_from(path, &dirs)
}

/// Reads `bundle` as the host's CA bundle and `anchor_dirs` as its local anchor directories
/// (missing ones are skipped).
pub fn load_host_cas_from(bundle: &Path, anchor_dirs: &[&Path]) -> Result<HostCas, ConfigError> {
    let bad =
        |path: &Path, what: String| ConfigError::HostCa(format!("{}: {what}", path.display()));
    let certs = read_certs(bundle).map_err(|e| bad(bundle, e))?;
    let mut upstream = Certs::default();
    for c in &certs {
        upstream
            .push(c, usize::MAX, usize::MAX)
            .map_err(|e| bad(bundle, e))?;
    }
    let mut local = Certs::default();
    for dir in anchor_dirs {
        let Ok(entries) = std::fs::read_dir(dir) else {
            continue;
        };
        let mut files: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "crt" || x == "pem") && p.is_file())
            .take(MAX_ANCHOR_FILES)
            .collect();
        files.sort();
        for f in files {
            for c in read_certs(&f).map_err(|e| bad(&f, e))? {
                local
                    .push(&c, MAX_EXTRA_CERTS, MAX_EXTRA_PEM)
                    .map_err(|e| bad(&f, e))?;
            }
        }
    }
    let guest = if local.count > 0 {
        local
    } else {
        // Nothing added locally: what the bundle has beyond the public roots.
        let mut extra = Certs::default();
        for c in certs.iter().filter(|c| !is_public_root(c)) {
            extra
                .push(c, MAX_EXTRA_CERTS, MAX_EXTRA_PEM)
                .map_err(|e| bad(bundle, e))?;
        }
        extra
    };
    Ok(HostCas {
        path: bundle.to_path_buf(),
        upstream_pem: upstream.pem,
        guest_pem: guest.pem,
        guest_count: guest.count,
    })
}

/// The usable trust anchors of one PEM file of at most [`MAX_HOST_BUNDLE`] bytes.
fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let file = std::fs::File::open(path).map_err(|e| e.to_string())?;
    let mut text = Vec::new();
    file.take(MAX_HOST_BUNDLE + 1)
        .read_to_end(&mut text)
        .map_err(|e| e.to_string())?;
    if text.len() as u64 > MAX_HOST_BUNDLE {
        return Err(format!("larger than {MAX_HOST_BUNDLE} bytes"));
    }
    parse_certs(&text)
}

/// The certificates of PEM `text` that parse as trust anchors. Non-certificate sections are
/// ignored; a malformed section refuses the text.
fn parse_certs(text: &[u8]) -> Result<Vec<CertificateDer<'static>>, String> {
    let mut out = Vec::new();
    for cert in CertificateDer::pem_slice_iter(text) {
        let cert = cert.map_err(|e| format!("malformed PEM: {e}"))?;
        // Not a certificate a TLS client could use as a root: nothing to add.
        if webpki::anchor_from_trusted_cert(&cert).is_ok() {
            out.push(cert);
        }
    }
    Ok(out)
}

/// Whether `cert` is one of the public roots Warren ships (same subject and key).
fn is_public_root(cert: &CertificateDer<'_>) -> bool {
    let Ok(anchor) = webpki::anchor_from_trusted_cert(cert) else {
        return false;
    };
    webpki_roots::TLS_SERVER_ROOTS.iter().any(|r| {
        r.subject.as_ref() == anchor.subject.as_ref()
            && r.subject_public_key_info.as_ref() == anchor.subject_public_key_info.as_ref()
    })
}

/// Re-encoded certificates, without duplicates.
#[derive(Default)]
struct Certs {
    pem: String,
    count: usize,
}

impl Certs {
    fn push(
        &mut self,
        cert: &CertificateDer<'_>,
        max: usize,
        max_pem: usize,
    ) -> Result<(), String> {
        let pem = to_pem(cert);
        if self.pem.contains(&pem) {
            return Ok(());
        }
        if self.count >= max {
            return Err(format!("more than {max} certificates for the guest"));
        }
        if self.pem.len() + pem.len() > max_pem {
            return Err(format!(
                "more than {max_pem} bytes of certificates for the guest"
            ));
        }
        self.pem.push_str(&pem);
        self.count += 1;
        Ok(())
    }
}

/// One certificate as PEM (64-character base64 lines).
fn to_pem(cert: &CertificateDer<'_>) -> String {
    let b64 = base64::engine::general_purpose::STANDARD.encode(cert.as_ref());
    let mut out = String::from("-----BEGIN CERTIFICATE-----\n");
    for chunk in b64.as_bytes().chunks(64) {
        // Base64 output is ASCII, so every chunk is valid UTF-8.
        out.push_str(std::str::from_utf8(chunk).unwrap_or_default());
        out.push('\n');
    }
    out.push_str("-----END CERTIFICATE-----\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn self_signed(cn: &str) -> String {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, cn);
        let key = rcgen::KeyPair::generate().expect("key");
        params.self_signed(&key).expect("cert").pem()
    }

    fn certs_of(pem: &str) -> Vec<CertificateDer<'static>> {
        CertificateDer::pem_slice_iter(pem.as_bytes())
            .collect::<Result<_, _>>()
            .expect("PEM parses")
    }

    #[test]
    fn test_guest_gets_local_anchors_upstream_gets_whole_bundle() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (public_ish, inspection) = (self_signed("bundle CA"), self_signed("inspection CA"));
        let bundle = dir.path().join("bundle.crt");
        let key = "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n";
        std::fs::write(&bundle, format!("# comment\n{public_ish}{inspection}{key}")).expect("w");
        let anchors = dir.path().join("anchors");
        std::fs::create_dir(&anchors).expect("mkdir");
        std::fs::write(anchors.join("corp.crt"), format!("{inspection}{key}")).expect("w");
        std::fs::write(anchors.join("notes.txt"), &public_ish).expect("w");
        let cas = load_host_cas_from(&bundle, &[&anchors]).expect("load");
        assert_eq!(cas.guest_count, 1);
        assert_eq!(
            certs_of(&cas.guest_pem),
            certs_of(&inspection),
            "re-encoded"
        );
        assert!(!cas.guest_pem.contains("PRIVATE KEY") && !cas.upstream_pem.contains("PRIVATE"));
        assert_eq!(certs_of(&cas.upstream_pem).len(), 2);
        // No local anchors: the bundle's certificates outside the public roots (both here).
        let cas = load_host_cas_from(&bundle, &[&dir.path().join("missing")]).expect("load");
        assert_eq!(cas.guest_count, 2);
    }

    #[test]
    fn test_host_cas_refuse_malformed_too_many_and_too_big() {
        let dir = tempfile::tempdir().expect("tempdir");
        let broken = "-----BEGIN CERTIFICATE-----\n!!!!\n-----END CERTIFICATE-----\n";
        assert!(parse_certs(broken.as_bytes()).is_err());
        assert!(parse_certs(b"").expect("empty").is_empty());
        let many: String = (0..=MAX_EXTRA_CERTS)
            .map(|i| self_signed(&format!("ca {i}")))
            .collect();
        let bundle = dir.path().join("many.crt");
        std::fs::write(&bundle, &many).expect("w");
        assert!(matches!(
            load_host_cas_from(&bundle, &[]),
            Err(ConfigError::HostCa(_))
        ));
        let big = dir.path().join("big.pem");
        let f = std::fs::File::create(&big).expect("create");
        f.set_len(MAX_HOST_BUNDLE + 1).expect("size");
        assert!(matches!(
            load_host_cas_from(&big, &[]),
            Err(ConfigError::HostCa(_))
        ));
        assert!(load_host_cas_from(&dir.path().join("missing"), &[]).is_err());
    }
}
