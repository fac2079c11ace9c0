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

/// The size of the regular file at `path` (checked as [`open_regular`] does).
pub fn regular_size(path: &Path) -> io::Result<u64> {
    Ok(open_regular(path)?.metadata()?.len())
}

/// Copies the regular file at `from` (checked as [`open_regular`] does, with one link and
/// at most `max_len` bytes: a VMM could leave a huge sparse file) to a new file `to` (mode
/// 0600, never an existing path); returns the bytes copied. Not flushed: the caller syncs
/// what must survive a crash.
pub fn copy_regular(from: &Path, to: &Path, max_len: u64) -> io::Result<u64> {
    let src = open_regular(from)?;
    let meta = src.metadata()?;
    one_link(&meta)?;
    if meta.len() > max_len {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "it is {} bytes, more than the {max_len} allowed",
                meta.len()
            ),
        ));
    }
    let mut src = io::Read::take(src, max_len);
    let mut dst = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_CLOEXEC)
        .open(to)?;
    io::copy(&mut src, &mut dst)
}

fn one_link(meta: &std::fs::Metadata) -> io::Result<()> {
    use std::os::unix::fs::MetadataExt;
    if meta.nlink() != 1 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "it has other hard links, refused from the VMM's directory",
        ));
    }
    Ok(())
}

/// Takes over a file the VMM wrote, moved to `path` in a directory it cannot write: refuses
/// anything but a regular file with one link reached without a final symlink (a link the VMM
/// planted would hand the change to whatever it names), then sets owner and mode through the
/// open descriptor, never through the path. A VMM that still runs may hold a descriptor of
/// the file and go on writing it: the caller treats its content as untrusted.
pub fn claim_regular(path: &Path, owner: Option<(u32, u32)>, mode: u32) -> io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let f = open_regular(path)?;
    one_link(&f.metadata()?)?;
    if let Some((uid, gid)) = owner {
        std::os::unix::fs::fchown(&f, Some(uid), Some(gid))?;
    }
    f.set_permissions(std::fs::Permissions::from_mode(mode))?;
    // Checked again: the VMM, the owner until the chown, could have linked a second name
    // to the file meanwhile (through its own descriptor).
    one_link(&f.metadata()?)
}

/// Refuses the regular file at `path` while any process holds it open for writing (a
/// descriptor, or a writable shared mapping): a read lease is granted only when none does.
/// The VMM that wrote a file may keep a descriptor after [`claim_regular`]; a file other VMs
/// go on reading (a fork's saved RAM, which its copies map) must have no writer left. An
/// honest VMM closes its file just after its migration completes, so a writer is waited for
/// up to `wait` before the refusal.
pub fn refuse_writers(path: &Path, wait: std::time::Duration) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let f = open_regular(path)?;
    let deadline = std::time::Instant::now() + wait;
    loop {
        // SAFETY: fcntl on a descriptor this function owns, with integer arguments only.
        let r =
            unsafe { nix::libc::fcntl(f.as_raw_fd(), nix::libc::F_SETLEASE, nix::libc::F_RDLCK) };
        if r != -1 {
            // The lease goes with the descriptor; dropped at once, nothing waits on it.
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(nix::libc::EAGAIN) {
            return Err(e);
        }
        if std::time::Instant::now() >= deadline {
            return Err(io::Error::new(
                io::ErrorKind::ResourceBusy,
                "another process still holds it open for writing",
            ));
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
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
    fn test_refuse_writers_while_a_descriptor_or_shared_mapping_can_write() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("state");
        std::fs::write(&p, vec![7u8; 8192]).expect("write");
        let short = Duration::from_millis(20);
        refuse_writers(&p, short).expect("no writer: accepted");
        let w = OpenOptions::new().write(true).open(&p).expect("writer");
        let t = Instant::now();
        let e = refuse_writers(&p, short).expect_err("a writer: refused");
        assert_eq!(e.kind(), io::ErrorKind::ResourceBusy, "{e}");
        assert!(t.elapsed() < Duration::from_secs(2));
        // A writable shared mapping outlives its descriptor and is a writer too.
        let rw = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&p)
            .expect("rw");
        drop(w);
        use std::os::fd::AsRawFd;
        // SAFETY: a fresh 4 KiB shared mapping of a file this test owns, unmapped below and
        // never read or written through.
        let addr = unsafe {
            nix::libc::mmap(
                std::ptr::null_mut(),
                4096,
                nix::libc::PROT_READ | nix::libc::PROT_WRITE,
                nix::libc::MAP_SHARED,
                rw.as_raw_fd(),
                0,
            )
        };
        assert_ne!(addr, nix::libc::MAP_FAILED, "mmap");
        drop(rw);
        assert!(
            refuse_writers(&p, short).is_err(),
            "a writable mapping: refused"
        );
        // SAFETY: the mapping made above, 4096 bytes long.
        assert_eq!(unsafe { nix::libc::munmap(addr, 4096) }, 0, "munmap");
        refuse_writers(&p, short).expect("writers gone: accepted");
    }

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

    #[test]
    fn test_claim_and_copy_refuse_planted_links_and_act_on_the_file_itself() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("tempdir");
        let host = dir.path().join("host-secret");
        std::fs::write(&host, b"host secret").expect("write");
        std::fs::set_permissions(&host, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        let mode = |p: &Path| std::fs::metadata(p).expect("stat").permissions().mode() & 0o777;
        // A link planted where the VMM's state was: neither claimed nor copied.
        let state = dir.path().join("state");
        std::os::unix::fs::symlink(&host, &state).expect("symlink");
        assert!(
            claim_regular(&state, None, 0o440).is_err(),
            "symlink claimed"
        );
        assert!(
            copy_regular(&state, &dir.path().join("copy"), 1 << 20).is_err(),
            "symlink copied"
        );
        assert_eq!(mode(&host), 0o600, "the link's target changed");
        // A hard link to another file.
        let hard = dir.path().join("hard");
        std::fs::hard_link(&host, &hard).expect("hard link");
        assert!(
            claim_regular(&hard, None, 0o440).is_err(),
            "hard link claimed"
        );
        assert_eq!(mode(&host), 0o600);
        // Positive controls: a plain file is claimed and copied.
        let plain = dir.path().join("plain");
        std::fs::write(&plain, b"state bytes").expect("write");
        claim_regular(&plain, None, 0o440).expect("claim");
        assert_eq!(mode(&plain), 0o440);
        let copy = dir.path().join("copy");
        assert_eq!(copy_regular(&plain, &copy, 11).expect("copy"), 11);
        assert_eq!(std::fs::read(&copy).expect("read"), b"state bytes");
        assert!(
            copy_regular(&plain, &copy, 11).is_err(),
            "an existing destination is replaced"
        );
        assert_eq!(regular_size(&plain).expect("size"), 11);
        // Too large, or hard-linked: not copied.
        assert!(
            copy_regular(&plain, &dir.path().join("c2"), 10).is_err(),
            "over the cap"
        );
        assert!(
            copy_regular(&hard, &dir.path().join("c3"), 1 << 20).is_err(),
            "hard link"
        );
    }
}
