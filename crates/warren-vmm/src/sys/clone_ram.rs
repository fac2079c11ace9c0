//! A template clone's own shared RAM, for clones with shares.
//!
//! virtiofsd maps guest RAM through the descriptors QEMU hands it, so a VM with shares needs
//! guest RAM in shared memory, while a plain clone's RAM is a private copy-on-write mapping of
//! the template's file (which another process could not see the clone's writes through). A
//! clone with shares therefore starts on a shared memfd of its own that the backend fills with
//! the template's RAM before QEMU starts ([`memfd_from_template`]) and passes to QEMU, which
//! maps it as its RAM file (`/proc/self/fd/N`). Like any VM's memfd it lives exactly as long
//! as the processes holding it, is limited by nothing but host memory (not the size of a
//! shared tmpfs mount), and no other user can see or name it. Only the template's data
//! extents are copied (it is sparse: ~100 MiB of a 512 MiB guest), with plain reads and
//! writes (`copy_file_range` does not cross file system types); a template file longer than
//! the guest's memory is refused.

use std::fs::File;
use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::fs::FileExt;
use std::path::Path;

use nix::unistd::{lseek, Whence};

/// Bytes per read and write.
const CHUNK: usize = 1 << 20;

/// A new shared memfd of `size` bytes holding the data of the template RAM file `template`
/// (refused unless it is a regular file reached without a final symlink and at most `size`
/// bytes long).
pub fn memfd_from_template(template: &Path, size: u64) -> io::Result<OwnedFd> {
    let src = crate::sys::vmm_file::open_regular(template)?;
    let len = src.metadata()?.len();
    if len > size {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("the template RAM file is {len} bytes, more than the guest's {size}"),
        ));
    }
    let fd = rustix::fs::memfd_create("warren-guest-ram", rustix::fs::MemfdFlags::CLOEXEC)?;
    let dst = File::from(fd);
    dst.set_len(size)?;
    copy_extents(&src, &dst, len)?;
    Ok(OwnedFd::from(dst))
}

/// Copies each data extent of `src` below `len` to the same offset of `dst`.
fn copy_extents(src: &File, dst: &File, len: u64) -> io::Result<u64> {
    let mut buf = vec![0u8; CHUNK];
    let mut copied = 0u64;
    let mut pos: i64 = 0;
    let end = i64::try_from(len).map_err(|_| io::Error::other("file too large"))?;
    while pos < end {
        let data = match lseek(src, pos, Whence::SeekData) {
            Ok(off) => off,
            // No data after `pos`: the rest is a hole, already zero in `dst`.
            Err(nix::errno::Errno::ENXIO) => break,
            Err(e) => return Err(e.into()),
        };
        let hole = lseek(src, data, Whence::SeekHole)?.min(end);
        let mut off = data;
        while off < hole {
            let want = usize::try_from((hole - off).min(CHUNK as i64)).unwrap_or(CHUNK);
            let n = src.read_at(&mut buf[..want], off as u64)?;
            if n == 0 {
                // The file shrank under us: what is left reads as zero anyway.
                return Ok(copied);
            }
            dst.write_all_at(&buf[..n], off as u64)?;
            off += n as i64;
            copied += n as u64;
        }
        pos = hole;
    }
    Ok(copied)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_memfd_from_template_keeps_data_and_size() {
        let t = tempfile::tempdir().unwrap();
        let from = t.path().join("ram");
        let f = File::create(&from).unwrap();
        let len = 64u64 << 20;
        f.set_len(len).unwrap();
        f.write_all_at(b"first page", 0).unwrap();
        f.write_all_at(&[7u8; 5000], 20 << 20).unwrap();
        f.write_all_at(b"last", len - 4).unwrap();
        drop(f);
        let fd = memfd_from_template(&from, len).unwrap();
        let copy = File::from(fd);
        assert_eq!(copy.metadata().unwrap().len(), len);
        let mut got = vec![0u8; len as usize];
        copy.read_exact_at(&mut got, 0).unwrap();
        assert_eq!(std::fs::read(&from).unwrap(), got);
        // A larger guest: the rest is zero.
        let bigger = File::from(memfd_from_template(&from, len * 2).unwrap());
        assert_eq!(bigger.metadata().unwrap().len(), len * 2);
        let mut tail = [1u8; 8];
        bigger.read_exact_at(&mut tail, len + 4096).unwrap();
        assert_eq!(tail, [0u8; 8]);
    }

    #[test]
    fn test_memfd_from_template_refuses_links_and_oversize_files() {
        let t = tempfile::tempdir().unwrap();
        let real = t.path().join("real");
        std::fs::write(&real, vec![1u8; 8192]).unwrap();
        let link = t.path().join("ram");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        assert!(memfd_from_template(&link, 1 << 20).is_err());
        // Longer than the guest's memory: refused.
        assert!(memfd_from_template(&real, 4096).is_err());
        // Control: the file itself, within the size, is taken.
        memfd_from_template(&real, 1 << 20).unwrap();
    }
}
