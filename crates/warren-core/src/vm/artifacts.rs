//! The runtime artifacts a VM runs on: the QEMU binary, its firmware (qboot) and the guest
//! kernel, each with its path and SHA-256, recorded in `artifacts.json` in the VM directory
//! when the VM is created and checked before every launch (create, resume from hibernation,
//! the fresh boot after a failed restore).
//!
//! Invariant: a VM is only ever launched on the exact bytes it was created with. A changed
//! digest (an upgraded or replaced QEMU, another firmware, a kernel file that no longer
//! matches) refuses the launch with `integrity` before anything in the VM directory changes;
//! the VM stays as it was (hibernated VMs stay hibernated).
//!
//! Hashing is cheap on the hot path: QEMU and the firmware go through
//! [`warren_vmm::accel::file_digest`], which rehashes only when a file's identity (device,
//! inode, size, mtime) changed, and the kernel's digest comes from the image store's own
//! identity-cached verification ([`warren_image::VerifiedImage::kernel_sha256`]).
//!
//! A VM created before this record existed gets it written at its next launch (with a
//! warning): from then on it is held to those artifacts.
//!
//! The operator's way forward after a host update (a QEMU security release, say) is
//! `warren vm resume VM --accept-new-runtime`: the host's artifacts are recorded for the VM,
//! and a checkpoint taken under another QEMU or firmware (which microvm cannot restore) is
//! dropped for a fresh boot on the VM's disk: files kept, processes and memory lost. It is
//! the operator's (the CLI on the state directory), never a token holder's.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use warren_image::VerifiedImage;
use warren_supervisor::VmDir;

use crate::error::CoreError;

/// File name of the record in the VM directory.
pub const ARTIFACTS_FILE: &str = "artifacts.json";

/// Largest record accepted (it is a few hundred bytes; root writes it, but it is read with a
/// bound like every file in a VM directory).
const MAX_RECORD_BYTES: u64 = 16 * 1024;

/// One artifact: where it was and what its bytes hashed to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Artifact {
    pub path: PathBuf,
    pub sha256: String,
}

/// What a VM was created to run on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuntimeArtifacts {
    pub qemu: Artifact,
    pub firmware: Artifact,
    pub kernel: Artifact,
}

impl RuntimeArtifacts {
    /// The host's artifacts now, for a VM booting `image`'s kernel (the image was verified
    /// by the caller).
    pub fn current(image: &VerifiedImage, cache_dir: &Path) -> Result<Self, CoreError> {
        let qemu = warren_vmm::accel::find_qemu()?;
        let firmware = PathBuf::from(warren_vmm::qemu::QBOOT);
        Ok(RuntimeArtifacts {
            qemu: Artifact {
                sha256: warren_vmm::accel::file_digest(&qemu, cache_dir)?,
                path: qemu,
            },
            firmware: Artifact {
                sha256: warren_vmm::accel::file_digest(&firmware, cache_dir)?,
                path: firmware,
            },
            kernel: Artifact {
                path: image.kernel.clone(),
                sha256: image.kernel_sha256.clone(),
            },
        })
    }

    /// Refuses with [`CoreError::ArtifactChanged`] the first artifact of `now` whose path or
    /// digest differs from this record.
    pub fn check(&self, vm: &str, now: &RuntimeArtifacts) -> Result<(), CoreError> {
        for (what, recorded, found) in [
            ("QEMU binary", &self.qemu, &now.qemu),
            ("firmware", &self.firmware, &now.firmware),
            ("kernel", &self.kernel, &now.kernel),
        ] {
            if recorded != found {
                return Err(CoreError::ArtifactChanged {
                    vm: vm.to_string(),
                    artifact: what,
                    recorded: format!("{} sha256 {}", recorded.path.display(), recorded.sha256),
                    found: format!("{} sha256 {}", found.path.display(), found.sha256),
                });
            }
        }
        Ok(())
    }

    fn path(dir: &VmDir) -> PathBuf {
        dir.path().join(ARTIFACTS_FILE)
    }

    /// Reads the record; `None` when the VM has none (created before it existed).
    pub fn load(dir: &VmDir) -> Result<Option<Self>, CoreError> {
        use std::io::Read;
        let path = Self::path(dir);
        let file = match std::fs::File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(CoreError::io("open", path, e)),
        };
        let mut bytes = Vec::new();
        file.take(MAX_RECORD_BYTES + 1)
            .read_to_end(&mut bytes)
            .map_err(|e| CoreError::io("read", &path, e))?;
        if bytes.len() as u64 > MAX_RECORD_BYTES {
            return Err(CoreError::InvalidArgument(format!(
                "{} is larger than {MAX_RECORD_BYTES} bytes",
                path.display()
            )));
        }
        serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| CoreError::InvalidArgument(format!("{}: {e}", path.display())))
    }

    /// Writes the record (a new file, 0600; the VM directory is root's).
    pub fn store(&self, dir: &VmDir) -> Result<(), CoreError> {
        let body = serde_json::to_vec_pretty(self).expect("invariant: record serialises");
        super::write_private(&Self::path(dir), &body)
    }

    /// Replaces the record whole (a new file renamed over it).
    fn replace(&self, dir: &VmDir) -> Result<(), CoreError> {
        let body = serde_json::to_vec_pretty(self).expect("invariant: record serialises");
        super::replace_private(&Self::path(dir), &body)
    }
}

impl super::Warren {
    /// Records the artifacts a new VM runs on in its directory.
    pub(super) fn record_artifacts(
        &self,
        dir: &VmDir,
        image: &VerifiedImage,
    ) -> Result<(), CoreError> {
        let t = std::time::Instant::now();
        let now = RuntimeArtifacts::current(image, &super::probe_cache_dir(&self.cfg.state_dir))?;
        now.store(dir)?;
        tracing::debug!(
            us = t.elapsed().as_micros() as u64,
            "runtime artifacts recorded"
        );
        Ok(())
    }

    /// The operator's acceptance of the host's artifacts for VM `id` (`warren vm resume
    /// --accept-new-runtime`, after a QEMU, firmware or kernel update): they are recorded as
    /// the ones it runs on from now on, each change logged. Returns whether the QEMU or
    /// firmware bytes differ from those it last launched on (a record that cannot be read
    /// counts as differing): a checkpoint is then never restored, whatever digest it carries
    /// (a binary replaced in place while the VM ran is hashed anew at the hibernation, but
    /// the state was saved by the old process).
    pub(super) fn accept_artifacts(
        &self,
        id: &str,
        dir: &VmDir,
        image: &VerifiedImage,
    ) -> Result<bool, CoreError> {
        let now = RuntimeArtifacts::current(image, &super::probe_cache_dir(&self.cfg.state_dir))?;
        let recorded = match RuntimeArtifacts::load(dir) {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(vm = %id, error = %e, "the VM's record of its runtime artifacts is unreadable; replaced");
                None
            }
        };
        if recorded.as_ref() == Some(&now) {
            return Ok(false);
        }
        let other_bytes = recorded.as_ref().is_none_or(|r| {
            r.qemu.sha256 != now.qemu.sha256 || r.firmware.sha256 != now.firmware.sha256
        });
        if let Some(recorded) = &recorded {
            for (what, was, is) in [
                ("QEMU binary", &recorded.qemu, &now.qemu),
                ("firmware", &recorded.firmware, &now.firmware),
                ("kernel", &recorded.kernel, &now.kernel),
            ] {
                if was != is {
                    tracing::warn!(
                        vm = %id,
                        artifact = what,
                        recorded = %format!("{} sha256 {}", was.path.display(), was.sha256),
                        now = %format!("{} sha256 {}", is.path.display(), is.sha256),
                        "runtime artifact changed; accepted by the operator"
                    );
                }
            }
        }
        now.replace(dir)?;
        Ok(other_bytes)
    }

    /// Refuses to launch VM `id` unless the host's artifacts are the ones it was created
    /// with (a VM without a record gets one now).
    pub(super) fn check_artifacts(
        &self,
        id: &str,
        dir: &VmDir,
        image: &VerifiedImage,
    ) -> Result<(), CoreError> {
        let t = std::time::Instant::now();
        let now = RuntimeArtifacts::current(image, &super::probe_cache_dir(&self.cfg.state_dir))?;
        match RuntimeArtifacts::load(dir)? {
            Some(recorded) => recorded.check(id, &now)?,
            None => {
                tracing::warn!(vm = %id, "no record of the VM's runtime artifacts; recording the current ones");
                now.store(dir)?;
            }
        }
        tracing::debug!(
            us = t.elapsed().as_micros() as u64,
            "runtime artifacts checked"
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn artifacts() -> RuntimeArtifacts {
        let a = |p: &str, d: char| Artifact {
            path: PathBuf::from(p),
            sha256: d.to_string().repeat(64),
        };
        RuntimeArtifacts {
            qemu: a("/usr/bin/qemu-system-x86_64", 'a'),
            firmware: a("/usr/share/qemu/qboot.rom", 'b'),
            kernel: a("/images/x/vmlinux", 'c'),
        }
    }

    #[test]
    fn test_check_same_artifacts_ok() {
        artifacts().check("vm-1", &artifacts()).expect("same");
    }

    #[test]
    fn test_check_each_changed_digest_refused_with_integrity() {
        for (i, what) in ["QEMU binary", "firmware", "kernel"]
            .into_iter()
            .enumerate()
        {
            let mut now = artifacts();
            let changed = [&mut now.qemu, &mut now.firmware, &mut now.kernel];
            changed.into_iter().nth(i).expect("artifact").sha256 = "f".repeat(64);
            let e = artifacts().check("vm-1", &now).expect_err("refused");
            assert_eq!(e.code(), "integrity", "{what}");
            let msg = e.to_string();
            assert!(msg.contains(what) && msg.contains(&"f".repeat(64)), "{msg}");
        }
    }

    #[test]
    fn test_check_moved_artifact_refused() {
        let mut now = artifacts();
        now.qemu.path = PathBuf::from("/opt/qemu/bin/qemu-system-x86_64");
        let e = artifacts().check("vm-1", &now).expect_err("refused");
        assert!(e.to_string().contains("/opt/qemu"), "{e}");
    }

    #[test]
    fn test_record_roundtrip_and_unknown_field_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let vm = VmDir(dir.path().to_path_buf());
        assert!(RuntimeArtifacts::load(&vm).expect("load").is_none());
        artifacts().store(&vm).expect("store");
        assert_eq!(
            RuntimeArtifacts::load(&vm).expect("load"),
            Some(artifacts())
        );
        std::fs::remove_file(dir.path().join(ARTIFACTS_FILE)).expect("rm");
        let mut v = serde_json::to_value(artifacts()).expect("value");
        v["extra"] = serde_json::json!(1);
        std::fs::write(dir.path().join(ARTIFACTS_FILE), v.to_string()).expect("write");
        assert!(RuntimeArtifacts::load(&vm).is_err());
    }
}
