//! Talking to OCI registries: references, bounded and verified fetches of manifests and
//! blobs, cosign signature and attestation tags.
//!
//! The `oci-client` crate parses references, does the registry's token dance and streams
//! blobs. Manifests are fetched here with the same HTTP client stack and the crate's token,
//! because the crate reads a manifest body whole with no size limit; here every body is read
//! in chunks up to a fixed limit. Everything a registry sends is hostile input: every
//! manifest and blob is checked against the digest that names it (computed here, never taken
//! from a header), sizes against the descriptor and limits, and the caller's deadline bounds
//! the whole pull.
//!
//! Plain HTTP is used only for registries on loopback addresses (`127.0.0.0/8`, `[::1]`,
//! `localhost`); every other registry is HTTPS with the host's CA store.

use std::net::IpAddr;
use std::path::Path;
use std::str::FromStr;
use std::time::Duration;

use futures_util::StreamExt;
use oci_client::client::{ClientConfig, ClientProtocol};
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference, RegistryOperation};
use serde::Deserialize;
use sha2::{Digest as _, Sha256};
use tokio::io::AsyncWriteExt;

use crate::trust::{DsseEnvelope, SignatureEntry, TrustMaterial};
use crate::ImageError;

/// Largest manifest, index or config read.
pub const MAX_MANIFEST: usize = 4 << 20;
/// Largest signature payload or attestation envelope read.
pub const MAX_TRUST_BLOB: usize = 1 << 20;
/// Most layers an image may have.
pub const MAX_LAYERS: usize = 256;

/// Manifest media types accepted.
pub const ACCEPT: &[&str] = &[
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
];

/// How a layer is compressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    None,
    Gzip,
    Zstd,
}

/// The compression of a layer media type, or `None` for one that is not a layer we unpack.
pub fn layer_compression(media_type: &str) -> Option<Compression> {
    match media_type {
        "application/vnd.oci.image.layer.v1.tar"
        | "application/vnd.docker.image.rootfs.diff.tar" => Some(Compression::None),
        "application/vnd.oci.image.layer.v1.tar+gzip"
        | "application/vnd.docker.image.rootfs.diff.tar.gzip" => Some(Compression::Gzip),
        "application/vnd.oci.image.layer.v1.tar+zstd"
        | "application/vnd.docker.image.rootfs.diff.tar.zstd" => Some(Compression::Zstd),
        _ => None,
    }
}

/// A content descriptor.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Descriptor {
    #[serde(rename = "mediaType", default)]
    pub media_type: String,
    pub digest: String,
    pub size: u64,
    #[serde(default)]
    pub annotations: std::collections::BTreeMap<String, String>,
    #[serde(default)]
    pub platform: Option<Platform>,
}

/// An index entry's platform.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Platform {
    pub architecture: String,
    pub os: String,
}

/// An image manifest or an index (whichever fields the document has).
#[derive(Debug, Clone, Deserialize)]
pub struct ManifestDoc {
    #[serde(rename = "schemaVersion")]
    pub schema_version: u32,
    #[serde(default)]
    pub config: Option<Descriptor>,
    #[serde(default)]
    pub layers: Vec<Descriptor>,
    #[serde(default)]
    pub manifests: Option<Vec<Descriptor>>,
}

/// Checks `s` is `sha256:` and 64 lowercase hex digits.
pub fn valid_digest(s: &str) -> bool {
    s.strip_prefix("sha256:")
        .is_some_and(|h| h.len() == 64 && h.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')))
}

/// Whether `registry` (`host[:port]`) is on a loopback address.
pub fn is_loopback_registry(registry: &str) -> bool {
    let host = if let Some(rest) = registry.strip_prefix('[') {
        rest.split(']').next().unwrap_or("")
    } else {
        registry.rsplit_once(':').map_or(registry, |(h, _)| h)
    };
    host == "localhost" || IpAddr::from_str(host).is_ok_and(|ip| ip.is_loopback())
}

/// A parsed reference with the registry client for it.
pub struct Registry {
    pub reference: Reference,
    client: Client,
    http: reqwest::Client,
    scheme: &'static str,
    token: Option<String>,
}

fn net(reference: &Reference, e: impl std::fmt::Display) -> ImageError {
    ImageError::Oci {
        reference: reference.whole(),
        reason: e.to_string(),
    }
}

fn refused(reference: &Reference, reason: impl Into<String>) -> ImageError {
    ImageError::OciRefused {
        reference: reference.whole(),
        reason: reason.into(),
    }
}

/// Parses `s` (`[registry/]repository[:tag][@sha256:…]`).
pub fn parse_reference(s: &str) -> Result<Reference, ImageError> {
    if s.len() > 1024 || s.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(ImageError::OciReference(format!(
            "{s:?} is not an image reference"
        )));
    }
    Reference::from_str(s).map_err(|e| ImageError::OciReference(format!("{s:?}: {e}")))
}

impl Registry {
    /// A client for `reference`'s registry (plain HTTP only for a loopback one).
    pub fn new(reference: Reference) -> Result<Registry, ImageError> {
        // reqwest's TLS needs a process-wide rustls provider: ring, as the rest of Warren.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let registry = reference.resolve_registry().to_string();
        let loopback = is_loopback_registry(&registry);
        let protocol = if loopback {
            ClientProtocol::HttpsExcept(vec![registry.clone()])
        } else {
            ClientProtocol::Https
        };
        let client = Client::new(ClientConfig {
            protocol,
            read_timeout: Some(Duration::from_secs(60)),
            connect_timeout: Some(Duration::from_secs(30)),
            max_concurrent_download: 1,
            platform_resolver: None,
            ..Default::default()
        });
        let http = reqwest::Client::builder()
            .read_timeout(Duration::from_secs(60))
            .connect_timeout(Duration::from_secs(30))
            .https_only(!loopback)
            .build()
            .map_err(|e| net(&reference, e))?;
        Ok(Registry {
            reference,
            client,
            http,
            scheme: if loopback { "http" } else { "https" },
            token: None,
        })
    }

    /// Gets a pull token (anonymous access) if the registry asks for one.
    pub async fn authenticate(&mut self) -> Result<(), ImageError> {
        self.token = self
            .client
            .auth(
                &self.reference,
                &RegistryAuth::Anonymous,
                RegistryOperation::Pull,
            )
            .await
            .map_err(|e| net(&self.reference, e))?;
        Ok(())
    }

    fn manifest_url(&self, tag_or_digest: &str) -> String {
        format!(
            "{}://{}/v2/{}/manifests/{}",
            self.scheme,
            self.reference.resolve_registry(),
            self.reference.repository(),
            tag_or_digest
        )
    }

    /// GETs a manifest by tag or digest, at most [`MAX_MANIFEST`] bytes; `None` on 404.
    async fn get_manifest(&self, tag_or_digest: &str) -> Result<Option<Vec<u8>>, ImageError> {
        let url = self.manifest_url(tag_or_digest);
        let mut req = self.http.get(&url).header("Accept", ACCEPT.join(", "));
        if let Some(t) = &self.token {
            req = req.bearer_auth(t);
        }
        let mut res = req.send().await.map_err(|e| net(&self.reference, e))?;
        if res.status() == reqwest::StatusCode::NOT_FOUND {
            return Ok(None);
        }
        if !res.status().is_success() {
            return Err(net(
                &self.reference,
                format!("GET manifest {tag_or_digest}: HTTP {}", res.status()),
            ));
        }
        let mut body = Vec::new();
        while let Some(chunk) = res.chunk().await.map_err(|e| net(&self.reference, e))? {
            if body.len() + chunk.len() > MAX_MANIFEST {
                return Err(refused(
                    &self.reference,
                    format!("manifest {tag_or_digest} is larger than {MAX_MANIFEST} bytes"),
                ));
            }
            body.extend_from_slice(&chunk);
        }
        Ok(Some(body))
    }

    /// The manifest (or index) named by `digest`, checked against it.
    pub async fn manifest_by_digest(&self, digest: &str) -> Result<Vec<u8>, ImageError> {
        let body = self
            .get_manifest(digest)
            .await?
            .ok_or_else(|| net(&self.reference, format!("manifest {digest} not found")))?;
        let actual = format!("sha256:{}", hex::encode(Sha256::digest(&body)));
        if actual != digest {
            return Err(refused(
                &self.reference,
                format!("manifest digest mismatch: asked for {digest}, got content of {actual}"),
            ));
        }
        Ok(body)
    }

    /// The digest of the manifest the tag names now (computed from the content).
    pub async fn resolve_tag(&self, tag: &str) -> Result<String, ImageError> {
        let body = self
            .get_manifest(tag)
            .await?
            .ok_or_else(|| net(&self.reference, format!("tag {tag} not found")))?;
        parse_manifest(&self.reference, &body)?;
        Ok(format!("sha256:{}", hex::encode(Sha256::digest(&body))))
    }

    /// Streams the blob `desc` into `out`, checking its size against the descriptor and
    /// `limit`, and its SHA-256 against its digest. `progress` gets the bytes so far.
    pub async fn blob_to_file(
        &self,
        desc: &Descriptor,
        out: &Path,
        limit: u64,
        progress: &mut (dyn FnMut(u64) + Send),
    ) -> Result<(), ImageError> {
        if desc.size > limit {
            return Err(refused(
                &self.reference,
                format!(
                    "blob {} is {} bytes, over the {limit}-byte limit",
                    desc.digest, desc.size
                ),
            ));
        }
        let mut stream = self
            .client
            .pull_blob_stream(&self.reference, desc.digest.as_str())
            .await
            .map_err(|e| net(&self.reference, e))?;
        let mut file = tokio::fs::File::create(out)
            .await
            .map_err(ImageError::io("create", out))?;
        let mut hasher = Sha256::new();
        let mut got = 0u64;
        let mut last = 0u64;
        // The crate checks the digest too and fails the stream's end on a mismatch: then our
        // own check below names it as the refusal it is.
        let mut stream_err = None;
        while let Some(chunk) = stream.next().await {
            let chunk = match chunk {
                Ok(c) => c,
                Err(e) if got == desc.size => {
                    stream_err = Some(e);
                    break;
                }
                Err(e) => return Err(net(&self.reference, e)),
            };
            got += chunk.len() as u64;
            if got > desc.size {
                return Err(refused(
                    &self.reference,
                    format!(
                        "blob {} is longer than its descriptor's {} bytes",
                        desc.digest, desc.size
                    ),
                ));
            }
            hasher.update(&chunk);
            file.write_all(&chunk)
                .await
                .map_err(ImageError::io("write", out))?;
            if got - last >= 8 << 20 {
                progress(got);
                last = got;
            }
        }
        file.flush().await.map_err(ImageError::io("write", out))?;
        let actual = format!("sha256:{}", hex::encode(hasher.finalize()));
        if got != desc.size || actual != desc.digest {
            return Err(refused(
                &self.reference,
                format!(
                    "blob {} does not match its digest (got {got} bytes hashing to {actual})",
                    desc.digest
                ),
            ));
        }
        if let Some(e) = stream_err {
            return Err(net(&self.reference, e));
        }
        progress(got);
        Ok(())
    }

    /// A small blob in memory (at most `limit` bytes), verified.
    pub async fn blob_bytes(&self, desc: &Descriptor, limit: u64) -> Result<Vec<u8>, ImageError> {
        let tmp = tempfile::NamedTempFile::new().map_err(ImageError::io("create", "temp file"))?;
        self.blob_to_file(desc, tmp.path(), limit, &mut |_| {})
            .await?;
        std::fs::read(tmp.path()).map_err(ImageError::io("read", tmp.path()))
    }

    /// The cosign signatures (`sha256-<hex>.sig`) and attestations (`sha256-<hex>.att`) the
    /// registry holds for `digest`: none when the tags do not exist. Every blob is verified
    /// against its digest; what they say is checked later, against the policy.
    pub async fn trust_material(&self, digest: &str) -> Result<TrustMaterial, ImageError> {
        let tag = digest.replace(':', "-");
        let mut out = TrustMaterial::default();
        if let Some(body) = self.get_manifest(&format!("{tag}.sig")).await? {
            let m = parse_manifest(&self.reference, &body)?;
            for layer in m.layers.iter().take(crate::trust::MAX_ENTRIES) {
                let Some(sig) = layer.annotations.get("dev.cosignproject.cosign/signature") else {
                    continue;
                };
                let payload = self.blob_bytes(layer, MAX_TRUST_BLOB as u64).await?;
                out.signatures.push(SignatureEntry {
                    payload: base64::Engine::encode(
                        &base64::engine::general_purpose::STANDARD,
                        &payload,
                    ),
                    signature: sig.clone(),
                });
            }
        }
        if let Some(body) = self.get_manifest(&format!("{tag}.att")).await? {
            let m = parse_manifest(&self.reference, &body)?;
            for layer in m.layers.iter().take(crate::trust::MAX_ENTRIES) {
                let bytes = self.blob_bytes(layer, MAX_TRUST_BLOB as u64).await?;
                if let Ok(env) = serde_json::from_slice::<DsseEnvelope>(&bytes) {
                    out.attestations.push(env);
                }
            }
        }
        Ok(out)
    }
}

/// Parses a manifest or index, refusing what is not one.
pub fn parse_manifest(reference: &Reference, body: &[u8]) -> Result<ManifestDoc, ImageError> {
    let m: ManifestDoc = serde_json::from_slice(body)
        .map_err(|e| refused(reference, format!("not an OCI manifest or index: {e}")))?;
    if m.schema_version != 2 {
        return Err(refused(
            reference,
            "only schema version 2 manifests are pulled",
        ));
    }
    if m.layers.len() > MAX_LAYERS {
        return Err(refused(reference, format!("more than {MAX_LAYERS} layers")));
    }
    let all = m
        .layers
        .iter()
        .chain(m.config.iter())
        .chain(m.manifests.iter().flatten());
    for d in all {
        if !valid_digest(&d.digest) {
            return Err(refused(
                reference,
                format!("descriptor digest {:?} is not sha256", d.digest),
            ));
        }
    }
    Ok(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_loopback_registry_detection() {
        for yes in [
            "127.0.0.1:5000",
            "localhost:5000",
            "[::1]:5000",
            "127.1.2.3",
            "localhost",
        ] {
            assert!(is_loopback_registry(yes), "{yes}");
        }
        for no in [
            "docker.io",
            "10.0.0.1:5000",
            "ghcr.io",
            "localhost.evil.com:5000",
            "[::2]:1",
        ] {
            assert!(!is_loopback_registry(no), "{no}");
        }
    }

    #[test]
    fn test_parse_manifest_refuses_bad_digests_and_schema() {
        let r = parse_reference("127.0.0.1:5000/x@sha256:1111111111111111111111111111111111111111111111111111111111111111")
            .expect("ref");
        assert!(parse_manifest(&r, br#"{"schemaVersion":1}"#).is_err());
        let bad = br#"{"schemaVersion":2,"config":{"mediaType":"x","digest":"md5:00","size":1},"layers":[]}"#;
        assert!(parse_manifest(&r, bad).is_err());
        assert!(parse_reference("a b").is_err());
    }
}
