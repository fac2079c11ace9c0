//! A template clone's own shared RAM file, for clones with shares.
//!
//! virtiofsd maps guest RAM through the descriptors QEMU hands it, so a VM with shares needs
//! guest RAM in shared memory, while a plain clone's RAM is a private copy-on-write mapping of
//! the template's file (which another process could not see the clone's writes through). A
//! clone with shares therefore starts on a shared copy of the template's RAM file of its own.
//!
//! The copy lives on tmpfs (`/dev/shm/warren-<euid>/<vm id>.ram`), so guest RAM is never
//! written back to a disk, and is unlinked as soon as the clone's VMM has it mapped
//! ([`remove`]): the memory then lives exactly as long as that VMM. Only the template's data
//! extents are copied (it is sparse: ~100 MiB of a 512 MiB guest), with plain reads and
//! writes (`copy_file_range` does not cross file system types).

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use nix::unistd::{lseek, Whence};

/// Where clone RAM files live: a tmpfs.
const SHM: &str = "/dev/shm";
/// Bytes per read and write.
const CHUNK: usize = 1 << 20;

/// This process's clone RAM directory, `/dev/shm/warren-<euid>`: made 0711 if missing,
/// and refused unless it is a real directory this user owns that nobody else may write (a
/// name in a world-writable directory anyone could have taken first).
pub fn dir() -> io::Result<PathBuf> {
    let euid = nix::unistd::geteuid().as_raw();
    let dir = Path::new(SHM).join(format!("warren-{euid}"));
    match std::fs::create_dir(&dir) {
        Ok(()) => std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o711))?,
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    let meta = std::fs::symlink_metadata(&dir)?;
    if !meta.is_dir() || meta.uid() != euid || meta.mode() & 0o022 != 0 {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "{} is not a directory of this user's that only it may write",
                dir.display()
            ),
        ));
    }
    Ok(dir)
}

/// The RAM file of VM `vm_id`.
pub fn path(vm_id: &str) -> io::Result<PathBuf> {
    Ok(dir()?.join(format!("{vm_id}.ram")))
}

/// Copies the data extents of the template RAM file `from` into a new file `to` of the same
/// size (never an existing path, mode 0600), owned by `owner` (set through the descriptor);
/// returns the bytes copied.
pub fn copy_from_template(from: &Path, to: &Path, owner: Option<(u32, u32)>) -> io::Result<u64> {
    let src = crate::sys::vmm_file::open_regular(from)?;
    let len = src.metadata()?.len();
    let dst = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_CLOEXEC)
        .open(to)?;
    let copied = (|| {
        dst.set_len(len)?;
        let copied = copy_extents(&src, &dst, len)?;
        if let Some((uid, gid)) = owner {
            std::os::unix::fs::fchown(&dst, Some(uid), Some(gid))?;
        }
        Ok(copied)
    })();
    if copied.is_err() {
        let _ = std::fs::remove_file(to);
    }
    copied
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

/// Unlinks VM `vm_id`'s RAM file if there is one (its VMM keeps its mapping).
pub fn remove(vm_id: &str) -> io::Result<()> {
    match std::fs::remove_file(path(vm_id)?) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_copy_from_template_keeps_data_holes_and_size() {
        let t = tempfile::tempdir().unwrap();
        let from = t.path().join("ram");
        let f = File::create(&from).unwrap();
        let len = 64u64 << 20;
        f.set_len(len).unwrap();
        f.write_all_at(b"first page", 0).unwrap();
        f.write_all_at(&[7u8; 5000], 20 << 20).unwrap();
        f.write_all_at(b"last", len - 4).unwrap();
        drop(f);
        let to = t.path().join("copy");
        let copied = copy_from_template(&from, &to, None).unwrap();
        // Only the data extents moved (a few pages each), not 64 MiB.
        assert!(copied < 1 << 20, "copied {copied}");
        assert_eq!(std::fs::read(&from).unwrap(), std::fs::read(&to).unwrap());
        let meta = std::fs::metadata(&to).unwrap();
        assert_eq!(meta.len(), len);
        assert_eq!(meta.mode() & 0o777, 0o600);
        // Never over an existing file.
        assert!(copy_from_template(&from, &to, None).is_err());
        assert_eq!(std::fs::read(&from).unwrap(), std::fs::read(&to).unwrap());
    }

    #[test]
    fn test_copy_from_template_refuses_a_symlinked_source() {
        let t = tempfile::tempdir().unwrap();
        let real = t.path().join("real");
        std::fs::write(&real, b"x").unwrap();
        let link = t.path().join("ram");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        assert!(copy_from_template(&link, &t.path().join("copy"), None).is_err());
        assert!(!t.path().join("copy").exists());
        // Control: the file itself copies.
        copy_from_template(&real, &t.path().join("copy"), None).unwrap();
    }

    #[test]
    fn test_dir_is_private_and_reused() {
        let d = dir().unwrap();
        let meta = std::fs::symlink_metadata(&d).unwrap();
        assert!(meta.is_dir());
        assert_eq!(meta.mode() & 0o022, 0);
        assert_eq!(dir().unwrap(), d);
        assert!(path("vm-1").unwrap().starts_with(&d));
        remove("vm-does-not-exist").unwrap();
    }
}
