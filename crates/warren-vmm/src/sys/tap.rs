//! TAP devices: a VM's NIC is the persistent `tap0` of its network namespace; the VMM gets an
//! open file descriptor on it (it never sees the namespace).

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use nix::sched::{setns, CloneFlags};

const IFF_TAP: i16 = 0x0002;
const IFF_NO_PI: i16 = 0x1000;
const IFF_VNET_HDR: i16 = 0x4000;
/// `_IOW('T', 202, int)`.
const TUNSETIFF: nix::libc::c_ulong = 0x4004_54ca;

/// `struct ifreq` as TUNSETIFF reads it: the name and the flags (the union's first member);
/// padded to the kernel's 40 bytes.
#[repr(C)]
struct IfReq {
    name: [u8; 16],
    flags: i16,
    _pad: [u8; 22],
}

/// Opens the TAP device `name` (`IFF_TAP | IFF_NO_PI | IFF_VNET_HDR`) inside the network
/// namespace at `netns` (e.g. `/run/netns/warren-ID`), from a short-lived thread that entered
/// it. The descriptor is close-on-exec; pass it to the VMM explicitly.
pub fn open_tap_in(netns: &Path, name: &str) -> io::Result<OwnedFd> {
    if name.is_empty() || name.len() > 15 || !name.bytes().all(|b| b.is_ascii_alphanumeric()) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "invalid TAP name",
        ));
    }
    let ns = File::open(netns)?;
    let name = name.to_string();
    std::thread::Builder::new()
        .name("warren-tap".into())
        .spawn(move || -> io::Result<OwnedFd> {
            setns(&ns, CloneFlags::CLONE_NEWNET).map_err(io::Error::from)?;
            let tun = OpenOptions::new()
                .read(true)
                .write(true)
                .custom_flags(nix::libc::O_CLOEXEC)
                .open("/dev/net/tun")?;
            let mut req = IfReq {
                name: [0; 16],
                flags: IFF_TAP | IFF_NO_PI | IFF_VNET_HDR,
                _pad: [0; 22],
            };
            req.name[..name.len()].copy_from_slice(name.as_bytes());
            // SAFETY: `tun` is an open /dev/net/tun descriptor and `req` is a live, properly
            // sized and aligned `struct ifreq` (name NUL-terminated: at most 15 bytes were
            // copied into 16 zeroed ones) that TUNSETIFF reads and may write back.
            let rc = unsafe { nix::libc::ioctl(tun.as_raw_fd(), TUNSETIFF as _, &mut req) };
            if rc < 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(OwnedFd::from(tun))
        })?
        .join()
        .map_err(|_| io::Error::other("TAP thread panicked"))?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_open_tap_rejects_bad_names() {
        let p = Path::new("/proc/self/ns/net");
        for n in ["", "tap0/x", "a-very-long-tap-name"] {
            let e = open_tap_in(p, n).expect_err(n);
            assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
        }
    }
}
