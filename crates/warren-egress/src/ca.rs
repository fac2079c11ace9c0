//! TLS material of one VM: its interception CA (rcgen), per-SNI leaf certificates minted on
//! demand and cached, the guest-facing rustls server config (ALPN `http/1.1` only, so HTTP/2
//! is refused on intercepted connections) and the upstream client config (verified against
//! the configured roots, ALPN `http/1.1`).

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls::{ClientConfig, RootCertStore, ServerConfig};

use crate::config::{CaMaterial, UpstreamRoots};
use crate::error::ConfigError;

/// Leaf certificates kept per VM before the cache is cleared.
const MAX_LEAVES: usize = 1024;

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn ca_params() -> Result<CertificateParams, ConfigError> {
    let mut params =
        CertificateParams::new(Vec::<String>::new()).map_err(|e| ConfigError::Ca(e.to_string()))?;
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, "Warren egress CA");
    dn.push(DnType::OrganizationName, "Warren");
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    Ok(params)
}

/// Generates a fresh CA (certificate and key, PEM).
pub fn generate_ca() -> Result<CaMaterial, ConfigError> {
    let key = KeyPair::generate().map_err(|e| ConfigError::Ca(e.to_string()))?;
    let cert = ca_params()?
        .self_signed(&key)
        .map_err(|e| ConfigError::Ca(e.to_string()))?;
    Ok(CaMaterial {
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    })
}

/// Mints and caches leaf certificates signed by the VM CA.
pub(crate) struct LeafMinter {
    issuer: Issuer<'static, KeyPair>,
    ca_der: CertificateDer<'static>,
    /// Guards the per-name cache only.
    leaves: Mutex<HashMap<String, Arc<CertifiedKey>>>,
}

impl fmt::Debug for LeafMinter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("LeafMinter")
    }
}

impl LeafMinter {
    fn new(ca: &CaMaterial) -> Result<Self, ConfigError> {
        let key = KeyPair::from_pem(&ca.key_pem).map_err(|e| ConfigError::Ca(e.to_string()))?;
        let ca_der = CertificateDer::from_pem_slice(ca.cert_pem.as_bytes())
            .map_err(|e| ConfigError::Ca(e.to_string()))?;
        // The issuer is rebuilt from the fixed CA parameters and the stored key: same subject,
        // same key identifier, so leaves chain to the stored certificate.
        Ok(LeafMinter {
            issuer: Issuer::new(ca_params()?, key),
            ca_der,
            leaves: Mutex::new(HashMap::new()),
        })
    }

    fn mint(&self, name: &str) -> Option<Arc<CertifiedKey>> {
        if let Some(hit) = self
            .leaves
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(name)
        {
            return Some(hit.clone());
        }
        let key = KeyPair::generate().ok()?;
        let mut params = CertificateParams::new(vec![name.to_string()]).ok()?;
        params.distinguished_name.push(DnType::CommonName, name);
        params.use_authority_key_identifier_extension = true;
        let cert = params.signed_by(&key, &self.issuer).ok()?;
        let der = PrivateKeyDer::try_from(key.serialize_der()).ok()?;
        let signer = rustls::crypto::ring::sign::any_supported_type(&der).ok()?;
        let ck = Arc::new(CertifiedKey::new(
            vec![cert.der().clone(), self.ca_der.clone()],
            signer,
        ));
        let mut leaves = self.leaves.lock().unwrap_or_else(|p| p.into_inner());
        if leaves.len() >= MAX_LEAVES {
            leaves.clear();
        }
        leaves.insert(name.to_string(), ck.clone());
        Some(ck)
    }
}

impl ResolvesServerCert for LeafMinter {
    fn resolve(&self, hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        let name = crate::policy::normalize_name(hello.server_name()?)?;
        self.mint(&name)
    }
}

/// The TLS configs of one VM.
pub(crate) struct TlsState {
    pub(crate) ca: CaMaterial,
    pub(crate) server: Arc<ServerConfig>,
    pub(crate) client: Arc<ClientConfig>,
}

impl TlsState {
    pub(crate) fn new(
        ca: Option<CaMaterial>,
        roots: &UpstreamRoots,
        host_roots: Option<&str>,
    ) -> Result<Self, ConfigError> {
        let ca = match ca {
            Some(ca) => ca,
            None => generate_ca()?,
        };
        let minter = Arc::new(LeafMinter::new(&ca)?);
        let mut server = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| ConfigError::Ca(e.to_string()))?
            .with_no_client_auth()
            .with_cert_resolver(minter);
        server.alpn_protocols = vec![b"http/1.1".to_vec()];

        let mut store = RootCertStore::empty();
        match roots {
            UpstreamRoots::WebPki => store.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned()),
            UpstreamRoots::Pem(pem) => {
                for cert in CertificateDer::pem_slice_iter(pem.as_bytes()) {
                    let cert = cert.map_err(|e| ConfigError::Roots(e.to_string()))?;
                    store
                        .add(cert)
                        .map_err(|e| ConfigError::Roots(e.to_string()))?;
                }
                if store.is_empty() {
                    return Err(ConfigError::Roots("no certificate in PEM".into()));
                }
            }
        }
        for cert in CertificateDer::pem_slice_iter(host_roots.unwrap_or_default().as_bytes()) {
            let cert = cert.map_err(|e| ConfigError::HostCa(e.to_string()))?;
            store
                .add(cert)
                .map_err(|e| ConfigError::HostCa(e.to_string()))?;
        }
        let mut client = ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| ConfigError::Roots(e.to_string()))?
            .with_root_certificates(store)
            .with_no_client_auth();
        client.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(TlsState {
            ca,
            server: Arc::new(server),
            client: Arc::new(client),
        })
    }
}
