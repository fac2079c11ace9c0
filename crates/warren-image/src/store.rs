//! The on-disk image store.
//!
//! Layout:
//! ```text
//! <image_dir>/<image id>/{manifest.json, verified.json, vmlinux, initramfs.cpio, rootfs.ext4}
//! <image_dir>/cache/builds/<recipe digest>   text: the image id built from it
//! <image_dir>/cache/stages/<stage digest>/   debootstrap rootfs + kernel + modules
//! <image_dir>/cache/downloads/<package>-<version>.tgz   agent CLIs' npm tarballs (verified
//!                                                        against their pins on every use)
//! <image_dir>/<image id>/trust.json          signatures and attestations (not in the manifest)
//! <image_dir>/cache/lock                     held (flock) for the duration of a build or pull
//! ```
//! Invariants: an image directory appears only by an atomic rename of a complete temp dir
//! (`.build-*`, `.pull-*`); its files are 0444 and directories 0755 so the unprivileged QEMU uid can read
//! them. Content digests are checked at build time and again by [`ImageStore::verify`]
//! whenever a file's identity (dev, inode, size, mtime) differs from `verified.json`.

use std::fmt;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use crate::digest::{self, FileIdentity};
use crate::manifest::{
    Manifest, VerifiedRecord, CONTENT_FILES, INITRAMFS_FILE, ROOTFS_FILE, TRUST_FILE, VMLINUX_FILE,
};
use crate::trust::TrustMaterial;
use crate::{agent_cli, build};
use crate::{ImageError, Recipe};

/// Shortest accepted id prefix.
pub const MIN_PREFIX_LEN: usize = 8;

/// An image id: the 64-hex-digit SHA-256 of the image's canonical manifest.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ImageId(pub String);

impl ImageId {
    /// Validates a full id.
    pub fn parse(s: &str) -> Result<ImageId, ImageError> {
        if is_full_id(s) {
            Ok(ImageId(s.to_string()))
        } else {
            Err(ImageError::InvalidId(s.to_string()))
        }
    }

    /// The first 12 hex digits, for display.
    pub fn short(&self) -> &str {
        self.0.get(..12).unwrap_or(&self.0)
    }
}

impl fmt::Display for ImageId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

fn is_full_id(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// One build progress event, printed by the CLI as `step: detail`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BuildProgress {
    pub step: &'static str,
    pub detail: String,
}

impl BuildProgress {
    pub(crate) fn new(step: &'static str, detail: String) -> Self {
        BuildProgress { step, detail }
    }
}

/// Summary of a stored image, as listed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageInfo {
    pub id: ImageId,
    /// The recipe's name, or `oci` for a pulled image.
    pub recipe: String,
    pub kernel_release: String,
    pub created_unix: u64,
    /// Virtual size of `rootfs.ext4` in bytes.
    pub rootfs_size: u64,
    /// Bytes allocated on the host for the image's files (hard links to the stage cache
    /// are counted in full).
    pub disk_bytes: u64,
}

/// A verified image: the paths QEMU needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerifiedImage {
    pub id: ImageId,
    pub kernel: PathBuf,
    /// SHA-256 of `kernel`, as the manifest records it (and as verified just now).
    pub kernel_sha256: String,
    pub initramfs: PathBuf,
    pub rootfs: PathBuf,
    pub rootfs_virtual_size: u64,
    pub kernel_release: String,
}

/// The image store rooted at an image directory.
#[derive(Debug, Clone)]
pub struct ImageStore {
    root: PathBuf,
}

/// Largest `trust.json`.
const MAX_TRUST_FILE: u64 = 8 << 20;

/// Writes `data` to `path` through a temp file in the same directory (fsynced, `mode`), then
/// renames it into place.
pub(crate) fn write_atomic(path: &Path, data: &[u8], mode: u32) -> Result<(), ImageError> {
    use std::io::Write;
    let dir = path.parent().unwrap_or(Path::new("."));
    let mut tmp = tempfile::Builder::new()
        .prefix(".tmp-")
        .tempfile_in(dir)
        .map_err(ImageError::io("create temp file in", dir))?;
    tmp.write_all(data)
        .and_then(|()| tmp.as_file().sync_all())
        .map_err(ImageError::io("write", tmp.path().to_path_buf()))?;
    set_mode(tmp.path(), mode)?;
    tmp.persist(path)
        .map_err(|e| ImageError::io("rename", path)(e.error))?;
    Ok(())
}

/// Sets a path's permission bits.
pub(crate) fn set_mode(path: &Path, mode: u32) -> Result<(), ImageError> {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(ImageError::io("chmod", path))
}

impl ImageStore {
    /// Opens (creating if needed) the store at `image_dir`.
    pub fn open(image_dir: &Path) -> Result<Self, ImageError> {
        for d in [
            image_dir.to_path_buf(),
            image_dir.join("cache"),
            image_dir.join("cache/builds"),
            image_dir.join("cache/stages"),
            image_dir.join("cache/downloads"),
        ] {
            if !d.is_dir() {
                std::fs::create_dir_all(&d).map_err(ImageError::io("create", &d))?;
                set_mode(&d, 0o755)?;
            }
        }
        Ok(ImageStore {
            root: image_dir.to_path_buf(),
        })
    }

    /// The store's root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    fn image_dir(&self, id: &ImageId) -> PathBuf {
        self.root.join(&id.0)
    }

    /// Takes the store's build lock (held until the file is dropped): one build or pull at a
    /// time per store.
    pub(crate) fn lock(&self) -> Result<std::fs::File, ImageError> {
        let lock_path = self.root.join("cache/lock");
        let lock = std::fs::File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(ImageError::io("open", &lock_path))?;
        lock.lock().map_err(ImageError::io("lock", &lock_path))?;
        Ok(lock)
    }

    /// Builds `recipe` with `agent` as `/init`, or returns the cached image when neither the
    /// recipe nor the agent changed. Only one build runs at a time per store.
    pub fn build(
        &self,
        recipe: &Recipe,
        agent: &Path,
        progress: &mut dyn FnMut(BuildProgress),
    ) -> Result<ImageId, ImageError> {
        if !is_static_elf(agent)? {
            return Err(ImageError::AgentNotStatic(agent.to_path_buf()));
        }
        let agent_sha256 = digest::sha256_file(agent)?;
        let recipe_digest = recipe.recipe_digest(&agent_sha256);

        let _lock = self.lock()?;

        if let Some(id) = self.built(&recipe_digest)? {
            progress(BuildProgress::new(
                "cached",
                format!("image {id} is up to date"),
            ));
            return Ok(id);
        }

        build::cleanup_stale(&self.root, ".build-");
        build::cleanup_stale(&self.root, crate::pull::PULL_PREFIX);
        build::cleanup_stale(&self.root.join("cache/stages"), ".stage-");
        let downloads = self.root.join("cache/downloads");
        // A store created before the downloads cache existed.
        std::fs::create_dir_all(&downloads).map_err(ImageError::io("create", &downloads))?;
        agent_cli::remove_partial_downloads(&downloads);
        let (stage_dir, stage) = build::ensure_stage(
            &self.root.join("cache/stages"),
            &downloads,
            recipe,
            progress,
        )?;
        let tmp = tempfile::Builder::new()
            .prefix(".build-")
            .tempdir_in(&self.root)
            .map_err(ImageError::io("create temp dir in", &self.root))?;
        let manifest = build::assemble(
            &stage_dir,
            &stage,
            build::Assembly::Recipe(recipe),
            agent,
            &agent_sha256,
            tmp.path(),
            progress,
        )?;
        let id = ImageId(manifest.id());
        let dest = self.image_dir(&id);
        if dest.exists() {
            // Same manifest bytes (same second, same inputs): already installed.
            drop(tmp);
        } else {
            let kept = tmp.keep();
            if let Err(e) = std::fs::rename(&kept, &dest) {
                let _ = std::fs::remove_dir_all(&kept);
                return Err(ImageError::io("rename", &dest)(e));
            }
        }
        self.record_build(&recipe_digest, &id)?;
        progress(BuildProgress::new("install", format!("image {id}")));
        Ok(id)
    }

    /// The image a build (or pull) with `recipe_digest` made, if it is still there
    /// (verified).
    pub(crate) fn built(&self, recipe_digest: &str) -> Result<Option<ImageId>, ImageError> {
        let record = self.root.join("cache/builds").join(recipe_digest);
        if let Ok(text) = std::fs::read_to_string(&record) {
            if let Ok(id) = ImageId::parse(text.trim()) {
                if self.image_dir(&id).is_dir() {
                    self.verify(&id)?;
                    return Ok(Some(id));
                }
            }
        }
        Ok(None)
    }

    /// Records that `recipe_digest` made `id` (temp file and rename).
    pub(crate) fn record_build(&self, recipe_digest: &str, id: &ImageId) -> Result<(), ImageError> {
        let record = self.root.join("cache/builds").join(recipe_digest);
        let tmp = record.with_extension("tmp");
        std::fs::write(&tmp, format!("{id}\n")).map_err(ImageError::io("write", &tmp))?;
        std::fs::rename(&tmp, &record).map_err(ImageError::io("rename", &record))
    }

    fn image_ids(&self) -> Result<Vec<ImageId>, ImageError> {
        let entries =
            std::fs::read_dir(&self.root).map_err(ImageError::io("read dir", &self.root))?;
        let mut ids = Vec::new();
        for e in entries {
            let e = e.map_err(ImageError::io("read dir", &self.root))?;
            let name = e.file_name();
            let Some(name) = name.to_str() else { continue };
            if is_full_id(name) && e.path().is_dir() {
                ids.push(ImageId(name.to_string()));
            }
        }
        Ok(ids)
    }

    /// Every image in the store, newest first. Images whose manifest is unreadable or does not
    /// hash to its id are skipped (with a warning).
    pub fn list(&self) -> Result<Vec<ImageInfo>, ImageError> {
        let mut out = Vec::new();
        for id in self.image_ids()? {
            let dir = self.image_dir(&id);
            let manifest = match Manifest::load(&dir, &id.0) {
                Ok(m) => m,
                Err(e) => {
                    tracing::warn!(image = %id, error = %e, "skipping invalid image");
                    continue;
                }
            };
            let recipe = manifest.recipe.clone();
            let mut disk_bytes = 0;
            for name in CONTENT_FILES {
                if let Ok(md) = std::fs::metadata(dir.join(name)) {
                    disk_bytes += md.blocks() * 512;
                }
            }
            out.push(ImageInfo {
                id,
                recipe,
                kernel_release: manifest.kernel_release,
                created_unix: manifest.created_unix,
                rootfs_size: manifest.rootfs_virtual_size,
                disk_bytes,
            });
        }
        out.sort_by(|a, b| {
            b.created_unix
                .cmp(&a.created_unix)
                .then_with(|| a.id.cmp(&b.id))
        });
        Ok(out)
    }

    /// Resolves a full id, a unique id prefix of at least [`MIN_PREFIX_LEN`] hex digits, or a
    /// recipe name (the newest image of that recipe; `oci` for pulled images).
    pub fn resolve(&self, spec: &str) -> Result<ImageId, ImageError> {
        if crate::recipe::valid_name(spec) {
            let recipe = spec;
            return self
                .list()?
                .into_iter()
                .find(|i| i.recipe == recipe)
                .map(|i| i.id)
                .ok_or_else(|| ImageError::NotFound(spec.to_string()));
        }
        let spec_lc = spec.to_ascii_lowercase();
        if spec_lc.len() < MIN_PREFIX_LEN
            || spec_lc.len() > 64
            || !spec_lc.bytes().all(|b| b.is_ascii_hexdigit())
        {
            return Err(ImageError::NotFound(spec.to_string()));
        }
        let mut matches = self
            .image_ids()?
            .into_iter()
            .filter(|id| id.0.starts_with(&spec_lc));
        match (matches.next(), matches.next()) {
            (None, _) => Err(ImageError::NotFound(spec.to_string())),
            (Some(id), None) => Ok(id),
            (Some(_), Some(_)) => Err(ImageError::Ambiguous(spec.to_string())),
        }
    }

    /// Checks the image's manifest hash, then each file: files whose identity matches
    /// `verified.json` are trusted, the others are rehashed (and the record updated).
    pub fn verify(&self, id: &ImageId) -> Result<VerifiedImage, ImageError> {
        let dir = self.image_dir(id);
        if !dir.is_dir() {
            return Err(ImageError::NotFound(id.0.clone()));
        }
        let manifest = Manifest::load(&dir, &id.0)?;
        let mut record = VerifiedRecord::load(&dir);
        let mut changed = false;
        for name in CONTENT_FILES {
            let path = dir.join(name);
            let ident = FileIdentity::of(&path)?;
            if record.files.get(name) == Some(&ident) {
                continue;
            }
            let expected = &manifest.files[name];
            tracing::debug!(image = %id, file = name, "identity changed, rehashing");
            digest::verify_file(&path, &expected.sha256)?;
            record.files.insert(name.to_string(), ident);
            changed = true;
        }
        if changed {
            record.store(&dir)?;
        }
        Ok(VerifiedImage {
            id: id.clone(),
            kernel: dir.join(VMLINUX_FILE),
            kernel_sha256: manifest.files[VMLINUX_FILE].sha256.clone(),
            initramfs: dir.join(INITRAMFS_FILE),
            rootfs: dir.join(ROOTFS_FILE),
            rootfs_virtual_size: manifest.rootfs_virtual_size,
            kernel_release: manifest.kernel_release,
        })
    }

    /// The digest an image is known by for signatures: the digest it was pulled by, or
    /// `sha256:<id>` for a local build.
    pub fn subject(&self, id: &ImageId) -> Result<String, ImageError> {
        let manifest = Manifest::load(&self.image_dir(id), &id.0)?;
        Ok(match manifest.oci {
            Some(o) => o.digest,
            None => format!("sha256:{}", id.0),
        })
    }

    /// The image's manifest (checked against its id).
    pub fn manifest(&self, id: &ImageId) -> Result<Manifest, ImageError> {
        Manifest::load(&self.image_dir(id), &id.0)
    }

    /// The image's signatures and attestations (none when it has no `trust.json`).
    pub fn trust(&self, id: &ImageId) -> Result<TrustMaterial, ImageError> {
        let path = self.image_dir(id).join(TRUST_FILE);
        match std::fs::metadata(&path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Ok(TrustMaterial::default())
            }
            Err(e) => return Err(ImageError::io("stat", &path)(e)),
            Ok(m) if m.len() > MAX_TRUST_FILE => {
                return Err(ImageError::Manifest {
                    path,
                    reason: format!("larger than {MAX_TRUST_FILE} bytes"),
                })
            }
            Ok(_) => {}
        }
        let bytes = std::fs::read(&path).map_err(ImageError::io("read", &path))?;
        serde_json::from_slice(&bytes).map_err(|e| ImageError::Manifest {
            path,
            reason: e.to_string(),
        })
    }

    /// Adds signatures and attestations to the image's `trust.json` (under the store's
    /// lock; temp file and rename).
    pub fn add_trust(&self, id: &ImageId, add: TrustMaterial) -> Result<(), ImageError> {
        let _lock = self.lock()?;
        let dir = self.image_dir(id);
        if !dir.is_dir() {
            return Err(ImageError::NotFound(id.0.clone()));
        }
        let mut material = self.trust(id)?;
        material.merge(add);
        write_atomic(
            &dir.join(TRUST_FILE),
            &digest::canonical_json(&material),
            0o444,
        )
    }

    /// Removes an image (atomically renamed away, then deleted) and the build-cache entries
    /// that point at it. The stage cache is kept. The caller checks the image is not in use.
    pub fn remove(&self, id: &ImageId) -> Result<(), ImageError> {
        let dir = self.image_dir(id);
        if !dir.is_dir() {
            return Err(ImageError::NotFound(id.0.clone()));
        }
        let trash = self
            .root
            .join(format!(".remove-{}-{}", id.0, std::process::id()));
        std::fs::rename(&dir, &trash).map_err(ImageError::io("rename", &dir))?;
        std::fs::remove_dir_all(&trash).map_err(ImageError::io("remove", &trash))?;
        let builds = self.root.join("cache/builds");
        if let Ok(entries) = std::fs::read_dir(&builds) {
            for e in entries.flatten() {
                if std::fs::read_to_string(e.path()).is_ok_and(|t| t.trim() == id.0) {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::manifest::{FileDigest, MANIFEST_FILE, MANIFEST_FORMAT};

    /// Writes a tiny fake image (no real build) and returns its id.
    fn fake_image(store: &ImageStore, recipe: &str, created: u64, salt: &str) -> ImageId {
        let tmp = tempfile::tempdir_in(store.root()).expect("tempdir");
        let mut files = BTreeMap::new();
        let mut record = VerifiedRecord::default();
        for name in CONTENT_FILES {
            let content = format!("{name}-{salt}");
            let p = tmp.path().join(name);
            std::fs::write(&p, &content).expect("write");
            files.insert(
                name.to_string(),
                FileDigest {
                    sha256: digest::sha256_hex(content.as_bytes()),
                    size: content.len() as u64,
                },
            );
            record
                .files
                .insert(name.to_string(), FileIdentity::of(&p).expect("stat"));
        }
        let m = Manifest {
            format: MANIFEST_FORMAT,
            recipe: recipe.to_string(),
            recipe_digest: "0".repeat(64),
            stage_digest: "1".repeat(64),
            agent_sha256: "2".repeat(64),
            kernel_release: "6.12.0-test".into(),
            kernel_package: "linux-image-test".into(),
            modules: vec!["virtio_mmio.ko".into()],
            created_unix: created,
            rootfs_virtual_size: 1 << 30,
            files,
            oci: None,
        };
        std::fs::write(tmp.path().join(MANIFEST_FILE), m.canonical_bytes()).expect("manifest");
        record.store(tmp.path()).expect("record");
        let id = ImageId(m.id());
        std::fs::rename(tmp.keep(), store.root().join(&id.0)).expect("rename");
        id
    }

    fn store() -> (tempfile::TempDir, ImageStore) {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = ImageStore::open(&dir.path().join("images")).expect("open");
        (dir, store)
    }

    #[test]
    fn test_manifest_id_same_content_deterministic() {
        let (_d, s) = store();
        let id = fake_image(&s, "minimal", 100, "a");
        let m = Manifest::load(&s.root().join(&id.0), &id.0).expect("load");
        assert_eq!(m.id(), id.0);
        assert_eq!(m.clone().id(), m.id());
        let mut other = m.clone();
        other.created_unix += 1;
        assert_ne!(other.id(), m.id());
        assert_eq!(id.0.len(), 64);
    }

    #[test]
    fn test_list_multiple_images_newest_first() {
        let (_d, s) = store();
        let old = fake_image(&s, "minimal", 100, "a");
        let new = fake_image(&s, "dev", 200, "b");
        let ids: Vec<ImageId> = s.list().expect("list").into_iter().map(|i| i.id).collect();
        assert_eq!(ids, vec![new, old]);
    }

    #[test]
    fn test_resolve_full_prefix_recipe_found() {
        let (_d, s) = store();
        let old = fake_image(&s, "minimal", 100, "a");
        let new = fake_image(&s, "minimal", 200, "b");
        let dev = fake_image(&s, "dev", 150, "c");
        assert_eq!(s.resolve(&old.0).expect("full"), old);
        assert_eq!(s.resolve(&new.0[..10]).expect("prefix"), new);
        assert_eq!(s.resolve("minimal").expect("recipe"), new);
        assert_eq!(s.resolve("dev").expect("recipe"), dev);
    }

    #[test]
    fn test_resolve_short_or_unknown_not_found() {
        let (_d, s) = store();
        let id = fake_image(&s, "minimal", 100, "a");
        assert!(matches!(
            s.resolve(&id.0[..7]),
            Err(ImageError::NotFound(_))
        ));
        assert!(matches!(s.resolve("dev"), Err(ImageError::NotFound(_))));
        assert!(matches!(
            s.resolve(&"f".repeat(64)),
            Err(ImageError::NotFound(_))
        ));
    }

    #[test]
    fn test_resolve_shared_prefix_ambiguous() {
        let (_d, s) = store();
        // Find two fake images whose ids share the first 8 digits would take too long; rename
        // directories instead: resolve only looks at names for prefixes.
        let a = fake_image(&s, "minimal", 100, "a");
        let b = fake_image(&s, "minimal", 200, "b");
        let a2 = format!("deadbeef{}", &a.0[8..]);
        let b2 = format!("deadbeef{}", &b.0[8..]);
        std::fs::rename(s.root().join(&a.0), s.root().join(&a2)).expect("rename");
        std::fs::rename(s.root().join(&b.0), s.root().join(&b2)).expect("rename");
        assert!(matches!(
            s.resolve("deadbeef"),
            Err(ImageError::Ambiguous(_))
        ));
        assert_eq!(s.resolve(&a2[..20]).expect("unique"), ImageId(a2));
    }

    #[test]
    fn test_verify_modified_file_digest_mismatch() {
        let (_d, s) = store();
        let id = fake_image(&s, "minimal", 100, "a");
        s.verify(&id).expect("intact image verifies");
        let p = s.root().join(&id.0).join(ROOTFS_FILE);
        std::fs::write(&p, "tampered").expect("tamper");
        match s.verify(&id) {
            Err(ImageError::DigestMismatch {
                file,
                expected,
                actual,
            }) => {
                assert_eq!(file, p);
                assert_eq!(
                    expected,
                    digest::sha256_hex(format!("{ROOTFS_FILE}-a").as_bytes())
                );
                assert_eq!(actual, digest::sha256_hex(b"tampered"));
            }
            other => panic!("expected DigestMismatch, got {other:?}"),
        }
    }

    #[test]
    fn test_verify_identity_unchanged_skips_rehash() {
        let (_d, s) = store();
        let id = fake_image(&s, "minimal", 100, "a");
        let dir = s.root().join(&id.0);
        // Change the content, then record the new identity as if it had been verified: the
        // fast path must trust the record and not read the file.
        let p = dir.join(VMLINUX_FILE);
        std::fs::write(&p, "changed").expect("write");
        let mut record = VerifiedRecord::load(&dir);
        record.files.insert(
            VMLINUX_FILE.to_string(),
            FileIdentity::of(&p).expect("stat"),
        );
        record.store(&dir).expect("store");
        let before = FileIdentity::of(&dir.join(crate::manifest::VERIFIED_FILE)).expect("stat");
        s.verify(&id).expect("identity unchanged: no rehash");
        let after = FileIdentity::of(&dir.join(crate::manifest::VERIFIED_FILE)).expect("stat");
        assert_eq!(before, after, "record not rewritten");
    }

    #[test]
    fn test_verify_missing_record_rehashes_and_records() {
        let (_d, s) = store();
        let id = fake_image(&s, "minimal", 100, "a");
        let dir = s.root().join(&id.0);
        std::fs::remove_file(dir.join(crate::manifest::VERIFIED_FILE)).expect("rm");
        s.verify(&id).expect("verify");
        assert_eq!(VerifiedRecord::load(&dir).files.len(), 3);
    }

    #[test]
    fn test_verify_tampered_manifest_digest_mismatch() {
        let (_d, s) = store();
        let id = fake_image(&s, "minimal", 100, "a");
        let p = s.root().join(&id.0).join(MANIFEST_FILE);
        std::fs::write(&p, b"{}").expect("write");
        assert!(matches!(
            s.verify(&id),
            Err(ImageError::DigestMismatch { .. })
        ));
    }

    #[test]
    fn test_remove_image_gone_from_list() {
        let (_d, s) = store();
        let id = fake_image(&s, "minimal", 100, "a");
        s.remove(&id).expect("remove");
        assert!(s.list().expect("list").is_empty());
        assert!(matches!(s.remove(&id), Err(ImageError::NotFound(_))));
    }
}

/// Whether `path` is a 64-bit little-endian x86-64 ELF without a program interpreter
/// (`PT_INTERP`), i.e. one that runs with no dynamic loader.
pub fn is_static_elf(path: &Path) -> Result<bool, ImageError> {
    let data = std::fs::read(path).map_err(ImageError::io("read", path))?;
    Ok(static_elf(&data))
}

fn static_elf(d: &[u8]) -> bool {
    const PT_INTERP: u32 = 3;
    const EM_X86_64: u16 = 62;
    let u16_at = |o: usize| d.get(o..o + 2).map(|b| u16::from_le_bytes([b[0], b[1]]));
    let u32_at = |o: usize| {
        d.get(o..o + 4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    };
    let u64_at = |o: usize| {
        d.get(o..o + 8).map(|b| {
            let mut a = [0u8; 8];
            a.copy_from_slice(b);
            u64::from_le_bytes(a)
        })
    };
    if d.get(0..6) != Some(&[0x7f, b'E', b'L', b'F', 2, 1][..]) || u16_at(0x12) != Some(EM_X86_64) {
        return false;
    }
    let (Some(phoff), Some(phentsize), Some(phnum)) = (u64_at(0x20), u16_at(0x36), u16_at(0x38))
    else {
        return false;
    };
    (0..usize::from(phnum)).all(|i| {
        let o = phoff as usize + i * usize::from(phentsize);
        matches!(u32_at(o), Some(t) if t != PT_INTERP)
    })
}

#[cfg(test)]
mod static_elf_tests {
    use super::*;

    #[test]
    fn test_dynamic_executable_is_not_static() {
        // Any dynamically linked system binary has PT_INTERP.
        let ls = std::fs::read("/bin/ls").expect("read /bin/ls");
        assert!(!static_elf(&ls));
        assert!(!static_elf(b"#!/bin/sh\n"));
        assert!(!static_elf(&[]));
    }
}
