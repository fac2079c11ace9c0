//! The image manifest (whose canonical JSON's SHA-256 is the image id) and the verification
//! record kept next to it.
//!
//! Invariant: `manifest.json` on disk holds exactly the canonical bytes that were hashed into
//! the id, so checking it is one hash of a small file.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::digest::{self, FileIdentity};
use crate::ImageError;

/// Version of the manifest schema.
pub const MANIFEST_FORMAT: u32 = 1;
/// File names inside an image directory.
pub const MANIFEST_FILE: &str = "manifest.json";
pub const VERIFIED_FILE: &str = "verified.json";
pub const VMLINUX_FILE: &str = "vmlinux";
pub const INITRAMFS_FILE: &str = "initramfs.cpio";
pub const ROOTFS_FILE: &str = "rootfs.ext4";
/// The content files listed in every manifest.
pub const CONTENT_FILES: [&str; 3] = [VMLINUX_FILE, INITRAMFS_FILE, ROOTFS_FILE];

/// Digest and size of one content file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileDigest {
    pub sha256: String,
    pub size: u64,
}

/// Everything that identifies an image.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    pub format: u32,
    pub recipe: String,
    /// Recipe description + agent digest (the build cache key).
    pub recipe_digest: String,
    /// Recipe description alone (the stage cache key).
    pub stage_digest: String,
    pub agent_sha256: String,
    pub kernel_release: String,
    pub kernel_package: String,
    /// Modules in load order, as stored in the initramfs.
    pub modules: Vec<String>,
    pub created_unix: u64,
    pub rootfs_virtual_size: u64,
    /// Keyed by file name (`vmlinux`, `initramfs.cpio`, `rootfs.ext4`).
    pub files: BTreeMap<String, FileDigest>,
    /// Where a pulled image came from (absent for recipe builds, whose ids stay as they
    /// were before the field existed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oci: Option<OciSource>,
}

/// A pulled image's origin and the parts of its OCI config that apply.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OciSource {
    /// `registry/repository` it was pulled from.
    pub repository: String,
    /// The digest it was pulled by (a manifest's or an index's): its trust subject.
    pub digest: String,
    /// The platform manifest's digest (the same unless `digest` is an index).
    pub manifest_digest: String,
    /// The layers' digests, in order.
    pub layers: Vec<String>,
    /// The config's `Env` (`NAME=value`), given to every job (a job's own env wins).
    pub env: Vec<String>,
    /// The config's `WorkingDir`, recorded only: jobs run in `/workspace`.
    pub working_dir: Option<String>,
}

/// Trust material file in an image directory (signatures and attestations; not part of the
/// manifest: signatures are added after the image exists).
pub const TRUST_FILE: &str = "trust.json";

impl Manifest {
    /// The canonical bytes stored as `manifest.json`.
    pub fn canonical_bytes(&self) -> Vec<u8> {
        digest::canonical_json(self)
    }

    /// The image id: SHA-256 of the canonical bytes.
    pub fn id(&self) -> String {
        digest::sha256_hex(&self.canonical_bytes())
    }

    /// Reads `manifest.json` from `dir` and checks that it hashes to `id`.
    pub fn load(dir: &Path, id: &str) -> Result<Manifest, ImageError> {
        let path = dir.join(MANIFEST_FILE);
        let bytes = std::fs::read(&path).map_err(ImageError::io("read", &path))?;
        let actual = digest::sha256_hex(&bytes);
        if actual != id {
            return Err(ImageError::DigestMismatch {
                file: path,
                expected: id.to_string(),
                actual,
            });
        }
        let m: Manifest = serde_json::from_slice(&bytes).map_err(|e| ImageError::Manifest {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        if m.format != MANIFEST_FORMAT || CONTENT_FILES.iter().any(|f| !m.files.contains_key(*f)) {
            return Err(ImageError::Manifest {
                path,
                reason: "unsupported format or missing file entry".into(),
            });
        }
        Ok(m)
    }
}

/// File identities recorded when the files were last hashed and found correct.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VerifiedRecord {
    pub files: BTreeMap<String, FileIdentity>,
}

impl VerifiedRecord {
    /// Reads `verified.json`; a missing or unreadable record is empty (forces rehashing).
    pub fn load(dir: &Path) -> VerifiedRecord {
        std::fs::read(dir.join(VERIFIED_FILE))
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_default()
    }

    /// Atomically replaces `verified.json` (write to a temp file, rename).
    pub fn store(&self, dir: &Path) -> Result<(), ImageError> {
        let path = dir.join(VERIFIED_FILE);
        let tmp = dir.join(format!(".{VERIFIED_FILE}.tmp-{}", std::process::id()));
        std::fs::write(&tmp, digest::canonical_json(self))
            .map_err(ImageError::io("write", &tmp))?;
        crate::store::set_mode(&tmp, 0o444)?;
        std::fs::rename(&tmp, &path).map_err(ImageError::io("rename", &tmp))
    }
}
