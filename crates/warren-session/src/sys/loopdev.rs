//! Attaching an image file to a free loop device (`LOOP_CTL_GET_FREE`, then
//! `LOOP_CONFIGURE`), written here because neither `nix`, `rustix` nor `libc` wraps these
//! ioctls and the crates that do need bindgen at build time.
//!
//! The device is configured with `LO_FLAGS_AUTOCLEAR`: the kernel detaches it when its last
//! user goes, that is when the filesystem on it is unmounted, or at once when the process
//! that attached it dies before mounting. So no loop device outlives its mount, whatever
//! crashes.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::path::PathBuf;

/// `<linux/loop.h>`: `LOOP_CTL_GET_FREE`, `LOOP_CONFIGURE` (Linux 5.8), `LO_FLAGS_AUTOCLEAR`.
const LOOP_CTL_GET_FREE: u64 = 0x4C82;
const LOOP_CONFIGURE: u64 = 0x4C0A;
const LO_FLAGS_AUTOCLEAR: u32 = 4;
/// Another process may take the free device between the two ioctls; we then ask again.
const ATTEMPTS: usize = 32;

pub(crate) const LOOP_CONTROL: &str = "/dev/loop-control";

/// `struct loop_info64`.
#[repr(C)]
struct LoopInfo64 {
    lo_device: u64,
    lo_inode: u64,
    lo_rdevice: u64,
    lo_offset: u64,
    lo_sizelimit: u64,
    lo_number: u32,
    lo_encrypt_type: u32,
    lo_encrypt_key_size: u32,
    lo_flags: u32,
    lo_file_name: [u8; 64],
    lo_crypt_name: [u8; 64],
    lo_encrypt_key: [u8; 32],
    lo_init: [u64; 2],
}

/// `struct loop_config`.
#[repr(C)]
struct LoopConfig {
    fd: u32,
    block_size: u32,
    info: LoopInfo64,
    reserved: [u64; 8],
}

/// Attaches `image` (open read-write) to a free loop device with autoclear; returns the
/// device path and an open descriptor of it. The caller mounts the device, then drops the
/// descriptor: from then on the mount alone keeps the device attached.
pub(crate) fn attach(image: &File) -> std::io::Result<(PathBuf, File)> {
    let ctl = OpenOptions::new()
        .read(true)
        .write(true)
        .open(LOOP_CONTROL)?;
    let mut last = std::io::Error::other("no free loop device");
    for _ in 0..ATTEMPTS {
        // SAFETY: LOOP_CTL_GET_FREE takes no argument and only returns a device number.
        let n = unsafe { nix::libc::ioctl(ctl.as_raw_fd(), LOOP_CTL_GET_FREE as _) };
        if n < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let path = PathBuf::from(format!("/dev/loop{n}"));
        let dev = OpenOptions::new().read(true).write(true).open(&path)?;
        let cfg = LoopConfig {
            fd: u32::try_from(image.as_raw_fd()).map_err(|_| {
                std::io::Error::new(std::io::ErrorKind::InvalidInput, "negative descriptor")
            })?,
            block_size: 0,
            info: LoopInfo64 {
                lo_device: 0,
                lo_inode: 0,
                lo_rdevice: 0,
                lo_offset: 0,
                lo_sizelimit: 0,
                lo_number: 0,
                lo_encrypt_type: 0,
                lo_encrypt_key_size: 0,
                lo_flags: LO_FLAGS_AUTOCLEAR,
                lo_file_name: [0; 64],
                lo_crypt_name: [0; 64],
                lo_encrypt_key: [0; 32],
                lo_init: [0; 2],
            },
            reserved: [0; 8],
        };
        // SAFETY: `cfg` is a fully initialised `struct loop_config` that lives across the
        // call; the kernel only reads it. Both descriptors are open.
        let r = unsafe {
            nix::libc::ioctl(
                dev.as_raw_fd(),
                LOOP_CONFIGURE as _,
                &cfg as *const LoopConfig,
            )
        };
        if r == 0 {
            return Ok((path, dev));
        }
        last = std::io::Error::last_os_error();
        if last.raw_os_error() != Some(nix::libc::EBUSY) {
            return Err(last);
        }
    }
    Err(last)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_loop_structs_match_the_kernel_layout() {
        // <linux/loop.h>: loop_info64 is 232 bytes, loop_config 304.
        assert_eq!(std::mem::size_of::<LoopInfo64>(), 232);
        assert_eq!(std::mem::size_of::<LoopConfig>(), 304);
    }
}
