//! Files only their owner may read: the state database and its WAL, and every per-VM log
//! (console, supervisor, QEMU and virtiofsd stderr). The VM directory is 0711 so that a VM's
//! QEMU can reach its `run/` directory; anyone who knows a VM id could otherwise read logs
//! that hold the guest's console.

use std::fs::{File, OpenOptions, Permissions};
use std::io;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::Path;

/// The mode of every private file.
pub const MODE: u32 = 0o600;

/// Opens `path` for writing, created 0600 (truncated, or appended to with `append`); an
/// existing file made before this rule is narrowed to 0600 too. A final symlink is refused.
pub fn create(path: &Path, append: bool) -> io::Result<File> {
    let mut o = OpenOptions::new();
    o.write(true)
        .create(true)
        .mode(MODE)
        .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_CLOEXEC);
    if append {
        o.append(true);
    } else {
        o.truncate(true);
    }
    let f = o.open(path)?;
    f.set_permissions(Permissions::from_mode(MODE))?;
    Ok(f)
}

/// Narrows an existing file to 0600; a missing one is fine.
pub fn restrict(path: &Path) -> io::Result<()> {
    match std::fs::set_permissions(path, Permissions::from_mode(MODE)) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        r => r,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn test_private_files_are_owner_only_new_or_old() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("log");
        std::fs::write(&p, "old\n").expect("write");
        std::fs::set_permissions(&p, Permissions::from_mode(0o644)).expect("chmod");
        let mut f = create(&p, true).expect("create");
        writeln!(f, "new").expect("write");
        let meta = std::fs::metadata(&p).expect("stat");
        assert_eq!(meta.permissions().mode() & 0o777, MODE);
        assert_eq!(std::fs::read_to_string(&p).expect("read"), "old\nnew\n");
        let fresh = dir.path().join("fresh");
        create(&fresh, false).expect("create");
        assert_eq!(
            std::fs::metadata(&fresh)
                .expect("stat")
                .permissions()
                .mode()
                & 0o777,
            MODE
        );
        std::os::unix::fs::symlink(&fresh, dir.path().join("link")).expect("symlink");
        assert!(
            create(&dir.path().join("link"), false).is_err(),
            "a final symlink"
        );
        restrict(&dir.path().join("missing")).expect("missing is fine");
    }
}
