//! Per-VM copy-on-write disks: a qcow2 overlay over the image's read-only raw root
//! filesystem, with the base's fixed virtual size.

use std::path::Path;
use std::process::Command;

use crate::error::VmmError;

/// Creates `overlay` backed by `base` (absolute path, raw format: an image's verified root
/// filesystem), with the base's virtual size.
pub fn create_overlay(base: &Path, overlay: &Path) -> Result<(), VmmError> {
    qemu_img_create(base, "raw", overlay, None)
}

/// Creates `overlay` over a template's frozen disk layer `base` (qcow2, backed by the
/// image) with virtual size `size`, without opening `base`: a VMM wrote that layer, and its
/// header names a backing chain that root must never open (a FIFO, a device, a network
/// URL). The VMM that uses the overlay opens the chain with its own rights.
pub fn create_overlay_of_layer(base: &Path, size: u64, overlay: &Path) -> Result<(), VmmError> {
    qemu_img_create(base, "qcow2", overlay, Some(size))
}

/// `qemu-img create` of a qcow2 `overlay` over `base`; with `size`, `base` is not opened
/// (`-u`).
fn qemu_img_create(
    base: &Path,
    base_format: &str,
    overlay: &Path,
    size: Option<u64>,
) -> Result<(), VmmError> {
    let mut cmd = Command::new("qemu-img");
    cmd.args(["create", "-q", "-f", "qcow2", "-F", base_format]);
    if size.is_some() {
        cmd.arg("-u");
    }
    cmd.arg("-b").arg(base).arg(overlay);
    if let Some(size) = size {
        cmd.arg(size.to_string());
    }
    let out = cmd.output().map_err(|source| VmmError::Spawn {
        program: "qemu-img".into(),
        source,
    })?;
    if !out.status.success() {
        return Err(VmmError::DiskCreate(
            String::from_utf8_lossy(&out.stderr).trim().to_string(),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    #[test]
    fn test_overlay_of_layer_never_opens_the_layer() {
        let dir = tempfile::tempdir().expect("tempdir");
        // A layer a VMM replaced by a FIFO: opening it would block root forever.
        let fifo = dir.path().join("disk.qcow2");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600))
            .expect("mkfifo");
        let overlay = dir.path().join("overlay.qcow2");
        let t = Instant::now();
        create_overlay_of_layer(&fifo, 4 << 20, &overlay).expect("overlay");
        assert!(t.elapsed() < Duration::from_secs(10), "opened the layer");
        // Positive control: the header names the layer and the size given.
        let info = Command::new("qemu-img")
            .args(["info", "-U", "--output=json"])
            .arg(&overlay)
            .output()
            .expect("qemu-img info");
        let v: serde_json::Value = serde_json::from_slice(&info.stdout).expect("json");
        assert_eq!(v["virtual-size"], 4 << 20, "{v}");
        assert_eq!(v["backing-filename"], fifo.display().to_string(), "{v}");
    }
}
