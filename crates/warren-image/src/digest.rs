//! SHA-256 helpers, canonical JSON and file identities.
//!
//! A file is hashed when an image is built or imported; afterwards its [`FileIdentity`]
//! (device, inode, size, mtime in ns) is recorded, and the file is only rehashed when that
//! identity changes. Canonical JSON is `serde_json`'s compact output of a `Value`, whose maps
//! are ordered by key, so equal content always yields equal bytes.

use std::fs::File;
use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::ImageError;

/// Hex SHA-256 of a byte slice.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// Hex SHA-256 of a file's content, streamed in 1 MiB chunks.
pub fn sha256_file(path: &Path) -> Result<String, ImageError> {
    let mut file = File::open(path).map_err(ImageError::io("open", path))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf).map_err(ImageError::io("read", path))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hex::encode(hasher.finalize()))
}

/// Canonical JSON bytes: compact, object keys sorted.
pub fn canonical_json<T: Serialize>(value: &T) -> Vec<u8> {
    // Serializing plain data structs into a `Value` cannot fail (no non-string map keys).
    let value = serde_json::to_value(value).expect("invariant: plain data serializes");
    serde_json::to_vec(&value).expect("invariant: a Value serializes")
}

/// What identifies one version of a file without reading it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileIdentity {
    pub dev: u64,
    pub ino: u64,
    pub size: u64,
    pub mtime_ns: i128,
}

impl FileIdentity {
    /// The identity of the file at `path` (follows symlinks).
    pub fn of(path: &Path) -> Result<Self, ImageError> {
        let md = std::fs::metadata(path).map_err(ImageError::io("stat", path))?;
        Ok(FileIdentity {
            dev: md.dev(),
            ino: md.ino(),
            size: md.size(),
            mtime_ns: i128::from(md.mtime()) * 1_000_000_000 + i128::from(md.mtime_nsec()),
        })
    }
}

/// Checks that `path` hashes to `expected`, returning a [`ImageError::DigestMismatch`] if not.
pub fn verify_file(path: &Path, expected: &str) -> Result<(), ImageError> {
    let actual = sha256_file(path)?;
    if actual != expected {
        return Err(ImageError::DigestMismatch {
            file: path.to_path_buf(),
            expected: expected.to_string(),
            actual,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    #[test]
    fn test_canonical_json_key_order_sorted() {
        #[derive(Serialize)]
        struct S {
            zeta: u32,
            alpha: &'static str,
        }
        let bytes = canonical_json(&S {
            zeta: 1,
            alpha: "x",
        });
        assert_eq!(bytes, br#"{"alpha":"x","zeta":1}"#);
        let mut m = BTreeMap::new();
        m.insert("b", 2);
        m.insert("a", 1);
        assert_eq!(canonical_json(&m), br#"{"a":1,"b":2}"#);
    }

    #[test]
    fn test_sha256_file_matches_bytes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("f");
        std::fs::write(&p, b"abc").expect("write");
        assert_eq!(sha256_file(&p).expect("hash"), sha256_hex(b"abc"));
        assert!(verify_file(&p, &sha256_hex(b"abd")).is_err());
    }
}
