//! Accelerator choice: `kvm | hvf | tcg | auto`.
//!
//! `auto` must never hang. On hosts where `/dev/kvm` exists but cannot boot a guest (nested
//! PVM on our build machines: a stock kernel hangs after real-mode setup), a short probe boot
//! under a deadline tells; its verdict is cached per host boot and QEMU binary digest, so the
//! probe costs once per host boot.

use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use crate::error::VmmError;

/// What the user asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AccelChoice {
    Kvm,
    Hvf,
    Tcg,
    Auto,
}

impl FromStr for AccelChoice {
    type Err = VmmError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "kvm" => Ok(AccelChoice::Kvm),
            "hvf" => Ok(AccelChoice::Hvf),
            "tcg" => Ok(AccelChoice::Tcg),
            "auto" => Ok(AccelChoice::Auto),
            other => Err(VmmError::AccelParse(other.to_string())),
        }
    }
}

/// A resolved accelerator a backend can use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Accel {
    Kvm,
    Tcg,
}

impl std::fmt::Display for Accel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Accel::Kvm => "kvm",
            Accel::Tcg => "tcg",
        })
    }
}

/// Deadline of the KVM probe boot. A usable KVM reaches the agent's first console line in
/// well under a second; a broken one never does.
pub const KVM_PROBE_DEADLINE: Duration = Duration::from_secs(8);

/// The cached verdict of a probe.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ProbeVerdict {
    pub usable: bool,
    pub detail: String,
}

/// The outcome of resolving a choice: the accelerator and, when it is not what was asked
/// for, a warning to show the user.
#[derive(Debug, Clone)]
pub struct Resolved {
    pub accel: Accel,
    pub warning: Option<String>,
}

/// Resolves `choice`. `probe` boots a guest under KVM with a deadline and reports whether the
/// guest reached user space; it is only awaited for `auto` on a cache miss.
pub async fn resolve(
    choice: AccelChoice,
    cache_dir: &Path,
    qemu: &Path,
    probe: impl std::future::Future<Output = ProbeVerdict>,
) -> Result<Resolved, VmmError> {
    match choice {
        AccelChoice::Tcg => Ok(Resolved {
            accel: Accel::Tcg,
            warning: None,
        }),
        AccelChoice::Hvf => Err(VmmError::AccelUnsupported(
            "hvf (needs the macOS backend, which does not exist yet)".into(),
        )),
        AccelChoice::Kvm => {
            kvm_device_usable().map_err(|e| VmmError::AccelUnsupported(format!("kvm: {e}")))?;
            Ok(Resolved {
                accel: Accel::Kvm,
                warning: None,
            })
        }
        AccelChoice::Auto => {
            if let Err(e) = kvm_device_usable() {
                return Ok(Resolved {
                    accel: Accel::Tcg,
                    warning: Some(format!("KVM unavailable ({e}); using TCG (slow)")),
                });
            }
            let key = cache_key(qemu, cache_dir)?;
            let path = cache_dir.join(format!("accel-probe-{key}.json"));
            let cache = private_dir(cache_dir);
            let verdict = match cache
                .then(|| std::fs::read(&path).ok())
                .flatten()
                .and_then(|b| serde_json::from_slice::<ProbeVerdict>(&b).ok())
            {
                Some(v) => v,
                None => {
                    let v = probe.await;
                    if cache {
                        let body = serde_json::to_vec(&v).expect("invariant: verdict serialises");
                        write_private(&path, &body).map_err(|e| VmmError::io("write", &path, e))?;
                    }
                    v
                }
            };
            if verdict.usable {
                Ok(Resolved {
                    accel: Accel::Kvm,
                    warning: None,
                })
            } else {
                Ok(Resolved {
                    accel: Accel::Tcg,
                    warning: Some(format!(
                        "/dev/kvm exists but cannot boot a guest ({}); using TCG (slow). \
                         Pass --accel tcg to skip the check",
                        verdict.detail
                    )),
                })
            }
        }
    }
}

fn kvm_device_usable() -> Result<(), String> {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .map(|_| ())
        .map_err(|e| format!("/dev/kvm: {e}"))
}

/// Host boot id + QEMU binary digest: a new boot or a new QEMU re-probes.
fn cache_key(qemu: &Path, cache_dir: &Path) -> Result<String, VmmError> {
    use sha2::{Digest, Sha256};
    let boot_id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map_err(|e| VmmError::io("read", "/proc/sys/kernel/random/boot_id", e))?;
    let mut h = Sha256::new();
    h.update(boot_id.trim().as_bytes());
    h.update(qemu_digest(qemu, cache_dir)?.as_bytes());
    Ok(hex::encode(&h.finalize()[..12]))
}

/// What a cached QEMU digest was computed for.
#[derive(Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
struct BinaryIdentity {
    path: PathBuf,
    dev: u64,
    ino: u64,
    size: u64,
    mtime_ns: i128,
    /// Set by the kernel on every change (unlike mtime, which a writer may set back): a
    /// binary rewritten in place with its old mtime is rehashed. Records written before it
    /// read as 0 and never match.
    #[serde(default)]
    ctime_ns: i128,
    sha256: String,
}

fn qemu_digest(qemu: &Path, cache_dir: &Path) -> Result<String, VmmError> {
    file_digest(qemu, cache_dir)
}

/// Where host facts that hold for one host boot are cached (binary digests, the TSC rate):
/// `/run/warren` for root (cleared at reboot), a per-user directory in the temporary
/// directory otherwise. That name is predictable, so nothing is read from or written to it
/// unless [`private_dir`] accepts it.
pub fn host_cache_dir() -> PathBuf {
    if nix::unistd::geteuid().is_root() {
        PathBuf::from("/run/warren")
    } else {
        std::env::temp_dir().join(format!("warren-{}", nix::unistd::geteuid()))
    }
}

/// Creates `dir` (0700) when missing and says whether cached facts may be kept in it: a
/// directory, not a link, of the effective user's, that no other user can write. Another
/// local user can make `/tmp/warren-<uid>` before its owner does: facts read from it would be
/// theirs (a wrong TSC rate for every guest, the digest a checkpoint is bound to), and files
/// written into it could be their links to the owner's files.
pub fn private_dir(dir: &Path) -> bool {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt};
    if std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .is_err()
    {
        return false;
    }
    let Ok(m) = std::fs::symlink_metadata(dir) else {
        return false;
    };
    let ok = m.is_dir() && m.uid() == nix::unistd::geteuid().as_raw() && m.mode() & 0o022 == 0;
    if !ok {
        tracing::warn!(
            dir = %dir.display(),
            "cache directory not used: it must be a directory of this user's that no one else can write"
        );
    }
    ok
}

/// Writes `body` to `path` through a new temporary file beside it and a rename (never through
/// an existing file or link at either name).
pub fn write_private(path: &Path, body: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".{}.tmp", std::process::id()));
    let tmp = PathBuf::from(tmp);
    let _ = std::fs::remove_file(&tmp);
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .and_then(|mut f| f.write_all(body))
        .and_then(|()| std::fs::rename(&tmp, path));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

/// SHA-256 of a host binary (QEMU, firmware), recomputed only when its identity (device,
/// inode, size, mtime, ctime) changes: hashing QEMU costs ~200 ms, too much for every create or
/// resume. The record lives in `cache_dir`, named after the file, when that directory is
/// [`private_dir`] (otherwise the binary is hashed every time).
pub fn file_digest(qemu: &Path, cache_dir: &Path) -> Result<String, VmmError> {
    use sha2::{Digest, Sha256};
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(qemu).map_err(|e| VmmError::io("stat", qemu, e))?;
    let mut id = BinaryIdentity {
        path: qemu.to_path_buf(),
        dev: meta.dev(),
        ino: meta.ino(),
        size: meta.size(),
        mtime_ns: i128::from(meta.mtime()) * 1_000_000_000 + i128::from(meta.mtime_nsec()),
        ctime_ns: i128::from(meta.ctime()) * 1_000_000_000 + i128::from(meta.ctime_nsec()),
        sha256: String::new(),
    };
    let name = qemu
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "binary".into());
    let record = cache_dir.join(format!("{name}.digest.json"));
    let cache = private_dir(cache_dir);
    if let Some(cached) = cache
        .then(|| std::fs::read(&record).ok())
        .flatten()
        .and_then(|b| serde_json::from_slice::<BinaryIdentity>(&b).ok())
    {
        id.sha256.clone_from(&cached.sha256);
        if cached == id {
            return Ok(cached.sha256);
        }
    }
    let bin = std::fs::read(qemu).map_err(|e| VmmError::io("read", qemu, e))?;
    id.sha256 = hex::encode(Sha256::digest(&bin));
    if cache {
        let body = serde_json::to_vec(&id).expect("invariant: identity serialises");
        write_private(&record, &body).map_err(|e| VmmError::io("write", &record, e))?;
    }
    Ok(id.sha256)
}

/// Finds the QEMU binary: `$WARREN_QEMU` or `qemu-system-x86_64` on `PATH`.
pub fn find_qemu() -> Result<PathBuf, VmmError> {
    if let Some(p) = std::env::var_os("WARREN_QEMU") {
        return Ok(PathBuf::from(p));
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|d| d.join("qemu-system-x86_64"))
        .find(|p| p.is_file())
        .ok_or(VmmError::QemuMissing)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_accel_parse_unknown_rejected() {
        assert!(matches!(
            "xen".parse::<AccelChoice>(),
            Err(VmmError::AccelParse(_))
        ));
        assert_eq!("auto".parse::<AccelChoice>().ok(), Some(AccelChoice::Auto));
    }

    fn block_on<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime")
            .block_on(f)
    }

    #[test]
    fn test_resolve_hvf_refused_as_unsupported() {
        let dir = tempfile::tempdir().expect("tempdir");
        let r = block_on(resolve(
            AccelChoice::Hvf,
            dir.path(),
            Path::new("/bin/sh"),
            async { unreachable!("no probe for hvf") },
        ));
        assert!(matches!(r, Err(VmmError::AccelUnsupported(_))));
    }

    /// A cache directory another user could have made (or can write) is neither read nor
    /// written: a link planted in it does not make the digest's owner overwrite the link's
    /// target, and a forged record is not believed. (Before, the record was written through
    /// the link.) Positive control: a private directory keeps the record. Needs root (the
    /// suite does) for the other user's directory.
    #[test]
    fn test_digest_cache_only_in_a_private_directory() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().expect("tempdir");
        let victim = d.path().join("victim");
        std::fs::write(&victim, "precious").expect("victim");
        let open = d.path().join("open");
        std::fs::create_dir(&open).expect("mkdir");
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).expect("chmod");
        std::os::unix::fs::symlink(&victim, open.join("sh.digest.json")).expect("link");
        let real = file_digest(Path::new("/bin/sh"), &open).expect("digest");
        assert_eq!(
            std::fs::read_to_string(&victim).expect("victim"),
            "precious",
            "written through a planted link"
        );
        // Another user's directory: a forged record is not believed.
        let theirs = d.path().join("theirs");
        std::fs::create_dir(&theirs).expect("mkdir");
        let meta = std::fs::metadata("/bin/sh").expect("stat");
        let forged = {
            use std::os::unix::fs::MetadataExt;
            BinaryIdentity {
                path: PathBuf::from("/bin/sh"),
                dev: meta.dev(),
                ino: meta.ino(),
                size: meta.size(),
                mtime_ns: i128::from(meta.mtime()) * 1_000_000_000 + i128::from(meta.mtime_nsec()),
                ctime_ns: i128::from(meta.ctime()) * 1_000_000_000 + i128::from(meta.ctime_nsec()),
                sha256: "f".repeat(64),
            }
        };
        std::fs::write(
            theirs.join("sh.digest.json"),
            serde_json::to_vec(&forged).expect("json"),
        )
        .expect("forged");
        std::os::unix::fs::chown(&theirs, Some(65534), Some(65534)).expect("chown");
        assert_eq!(
            file_digest(Path::new("/bin/sh"), &theirs).expect("digest"),
            real
        );
        // Positive control: the user's own private directory holds the record.
        let mine = d.path().join("mine");
        assert_eq!(
            file_digest(Path::new("/bin/sh"), &mine).expect("digest"),
            real
        );
        assert!(mine.join("sh.digest.json").is_file());
        assert_eq!(
            file_digest(Path::new("/bin/sh"), &mine).expect("digest"),
            real
        );
    }

    #[test]
    fn test_resolve_auto_probe_verdict_cached() {
        if kvm_device_usable().is_err() {
            return; // the cache is only consulted when /dev/kvm opens
        }
        let dir = tempfile::tempdir().expect("tempdir");
        let mut calls = 0;
        for _ in 0..2 {
            let r = block_on(resolve(
                AccelChoice::Auto,
                dir.path(),
                Path::new("/bin/sh"),
                async {
                    calls += 1;
                    ProbeVerdict {
                        usable: false,
                        detail: "probe timed out".into(),
                    }
                },
            ))
            .expect("resolve");
            assert_eq!(r.accel, Accel::Tcg);
            assert!(r.warning.expect("warning").contains("probe timed out"));
        }
        assert_eq!(calls, 1);
    }
}
