//! Per-VM copy-on-write disks: a qcow2 overlay over the image's read-only raw root
//! filesystem, with the base's fixed virtual size.

use std::path::Path;
use std::process::Command;

use crate::error::VmmError;

/// Creates `overlay` backed by `base` (absolute path, raw format).
pub fn create_overlay(base: &Path, overlay: &Path) -> Result<(), VmmError> {
    create_overlay_of(base, "raw", overlay)
}

/// Creates `overlay` backed by `base` of `format` (`raw`: an image's root filesystem;
/// `qcow2`: a template's frozen disk layer, itself backed by the image).
pub fn create_overlay_of(base: &Path, format: &str, overlay: &Path) -> Result<(), VmmError> {
    let out = Command::new("qemu-img")
        .arg("create")
        .arg("-q")
        .args(["-f", "qcow2", "-F", format, "-b"])
        .arg(base)
        .arg(overlay)
        .output()
        .map_err(|source| VmmError::Spawn {
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
