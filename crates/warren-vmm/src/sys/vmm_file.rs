//! Opening files the VMM could have written (its `run/` directory: checkpoint state, guest
//! RAM). The VMM runs as another uid and may be compromised, so each open refuses a final
//! symlink (`O_NOFOLLOW`), never blocks on a FIFO or a device (`O_NONBLOCK`), and accepts
//! only a regular file.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// Opens `path` read-only if it is a regular file reached without a final symlink.
pub fn open_regular(path: &Path) -> io::Result<File> {
    let f = OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_NONBLOCK | nix::libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| match e.raw_os_error() {
            Some(nix::libc::ELOOP) => io::Error::new(
                io::ErrorKind::InvalidInput,
                "it is a symlink, refused in the VMM's directory",
            ),
            _ => e,
        })?;
    let kind = f.metadata()?.file_type();
    if !kind.is_file() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "it is not a regular file, refused in the VMM's directory",
        ));
    }
    Ok(f)
}

/// Flushes the regular file at `path` to disk and returns its size.
pub fn sync_regular(path: &Path) -> io::Result<u64> {
    let f = open_regular(path)?;
    f.sync_all()?;
    Ok(f.metadata()?.len())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    #[test]
    fn test_vmm_files_refuse_symlinks_fifos_and_devices_without_blocking() {
        let dir = tempfile::tempdir().expect("tempdir");
        let secret = dir.path().join("secret");
        std::fs::write(&secret, b"host secret").expect("write");
        // Positive control: a regular file is opened and synced.
        assert_eq!(sync_regular(&secret).expect("regular file"), 11);
        let link = dir.path().join("checkpoint.ram");
        std::os::unix::fs::symlink(&secret, &link).expect("symlink");
        assert!(open_regular(&link).is_err(), "symlink followed");
        let fifo = dir.path().join("guest.ram");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600))
            .expect("mkfifo");
        let t = Instant::now();
        let e = open_regular(&fifo).expect_err("a FIFO is refused");
        assert!(t.elapsed() < Duration::from_secs(5), "blocked on the FIFO");
        assert!(e.to_string().contains("not a regular file"), "{e}");
        assert!(open_regular(Path::new("/dev/null")).is_err(), "device");
    }
}
