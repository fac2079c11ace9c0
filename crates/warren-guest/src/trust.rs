//! The egress CA: the host sends the VM's interception CA once the agent is up; the agent
//! writes a trust bundle (the system's roots plus that CA) and every later job is pointed at
//! it, because many runtimes (Node, Python requests, bundled root stores) ignore the system
//! store.

use std::path::{Path, PathBuf};

use warren_protocol::{ErrorCode, GuestError};

/// The system bundle (Debian's `ca-certificates`), if installed.
const SYSTEM_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";
/// Where the combined bundle is written.
pub const BUNDLE: &str = "/etc/warren/ca-bundle.pem";
/// Where the Warren CA alone is written.
pub const CA_ONLY: &str = "/etc/warren/egress-ca.pem";
/// At most this much PEM is accepted.
const MAX_CA: usize = 64 * 1024;

/// The variables that make common TLS clients trust `bundle`.
pub fn env_for(bundle: &Path) -> Vec<(String, String)> {
    let b = bundle.display().to_string();
    [
        "SSL_CERT_FILE",
        "NODE_EXTRA_CA_CERTS",
        "REQUESTS_CA_BUNDLE",
        "CURL_CA_BUNDLE",
        "GIT_SSL_CAINFO",
    ]
    .iter()
    .map(|k| (k.to_string(), b.clone()))
    .collect()
}

fn write_atomic(path: &Path, body: &[u8]) -> Result<(), GuestError> {
    let err = |e: std::io::Error| {
        GuestError::new(
            ErrorCode::Internal,
            format!("writing {}: {e}", path.display()),
        )
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(err)?;
    }
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, body).map_err(err)?;
    std::fs::rename(&tmp, path).map_err(err)
}

/// Writes [`CA_ONLY`] and [`BUNDLE`] (world-readable: certificates are public) and returns
/// the bundle's path.
pub fn install(pem: &str) -> Result<PathBuf, GuestError> {
    install_at(
        pem,
        Path::new(SYSTEM_BUNDLE),
        Path::new(CA_ONLY),
        Path::new(BUNDLE),
    )
}

fn install_at(
    pem: &str,
    system: &Path,
    ca_only: &Path,
    bundle: &Path,
) -> Result<PathBuf, GuestError> {
    if pem.len() > MAX_CA || !pem.contains("-----BEGIN CERTIFICATE-----") {
        return Err(GuestError::new(
            ErrorCode::InvalidArgument,
            "not a PEM certificate",
        ));
    }
    let mut body = std::fs::read(system).unwrap_or_default();
    if !body.is_empty() && !body.ends_with(b"\n") {
        body.push(b'\n');
    }
    body.extend_from_slice(pem.as_bytes());
    if !pem.ends_with('\n') {
        body.push(b'\n');
    }
    write_atomic(ca_only, pem.as_bytes())?;
    write_atomic(bundle, &body)?;
    Ok(bundle.to_path_buf())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_install_appends_ca_to_system_bundle() {
        let d = tempfile::tempdir().expect("tempdir");
        let sys = d.path().join("sys.crt");
        std::fs::write(&sys, "SYSTEM").expect("write");
        let pem = "-----BEGIN CERTIFICATE-----\nX\n-----END CERTIFICATE-----\n";
        let b = install_at(
            pem,
            &sys,
            &d.path().join("w/ca.pem"),
            &d.path().join("w/b.pem"),
        )
        .expect("install");
        assert_eq!(
            std::fs::read_to_string(&b).expect("read"),
            format!("SYSTEM\n{pem}")
        );
        let env = env_for(&b);
        assert!(env.iter().any(|(k, _)| k == "SSL_CERT_FILE"));
        assert!(install_at("junk", &sys, &d.path().join("c"), &d.path().join("b")).is_err());
    }
}
