//! Whether an owner may use a host path, decided by the kernel as that owner.
//!
//! The path is resolved and opened on a thread with the owner's filesystem identity (its uid,
//! its primary gid, no supplementary group: `crate::copy`'s `as_owner`, the identity every
//! later use of the path has), and the access is asked of the kernel on the opened
//! descriptor (`faccessat2` with `AT_EACCESS | AT_EMPTY_PATH`). So ACLs, the owner's real
//! search permission on every directory on the way and its groups are what the kernel says,
//! not what mode bits suggest; and the caller learns the identity (device, inode) of the
//! very object that was checked, to hold what it then uses to it.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use nix::fcntl::{OFlag, OpenHow, ResolveFlag};
use nix::unistd::AccessFlags;

use crate::copy::as_owner;
use crate::{Owner, SessionError};

/// The access an owner needs on a host path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Read (and, for a directory, search).
    Read,
    /// Read and write (and, for a directory, search).
    ReadWrite,
}

/// A host path the owner may use: its canonical form as the owner resolved it and the
/// identity (device, inode) of the object the kernel checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checked {
    pub path: PathBuf,
    pub identity: (u64, u64),
    pub is_dir: bool,
}

/// Resolves `path` as `owner` and asks the kernel whether `owner` has `access` to it. Any
/// failure (a missing component, a directory the owner cannot search, an ACL that denies
/// it) is `Err`; callers answer every one alike, so nothing about what exists is told.
pub fn check_access(owner: Owner, path: &Path, access: Access) -> Result<Checked, SessionError> {
    as_owner(Some(owner), || {
        let real = std::fs::canonicalize(path).map_err(SessionError::io("resolve", path))?;
        let fd = open_resolved(&real)?;
        let meta = std::fs::File::from(
            fd.try_clone()
                .map_err(SessionError::io("duplicate the descriptor of", &real))?,
        )
        .metadata()
        .map_err(SessionError::io("stat", &real))?;
        let mut want = AccessFlags::R_OK;
        if meta.is_dir() {
            want |= AccessFlags::X_OK;
        }
        if access == Access::ReadWrite {
            want |= AccessFlags::W_OK;
        }
        // AT_EACCESS: the thread's own (filesystem) identity, not the process's real ids.
        nix::unistd::faccessat(
            &fd,
            "",
            want,
            nix::fcntl::AtFlags::AT_EACCESS | nix::fcntl::AtFlags::AT_EMPTY_PATH,
        )
        .map_err(|e| SessionError::io("access", &real)(e.into()))?;
        Ok(Checked {
            path: real,
            identity: (meta.dev(), meta.ino()),
            is_dir: meta.is_dir(),
        })
    })
}

/// Opens the canonical path `real` (`O_PATH`) following no symlink at all: one swapped in
/// for any component since it was resolved, the last included, is refused (`ELOOP`), never
/// followed and never opened itself. With `O_NOFOLLOW` a trailing symlink would be opened as
/// the link, whose permission bits (`rwxrwxrwx`) pass every access check.
fn open_resolved(real: &Path) -> Result<std::os::fd::OwnedFd, SessionError> {
    let how = OpenHow::new()
        .flags(OFlag::O_PATH | OFlag::O_CLOEXEC)
        .resolve(ResolveFlag::RESOLVE_NO_SYMLINKS | ResolveFlag::RESOLVE_NO_MAGICLINKS);
    nix::fcntl::openat2(nix::fcntl::AT_FDCWD, real, how)
        .map_err(|e| SessionError::io("open", real)(e.into()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    const OWNER: Owner = Owner {
        uid: 4242,
        gid: 4242,
    };

    fn chmod(p: &Path, m: u32) {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(m)).expect("chmod");
    }

    /// `system.posix_acl_access` denying uid 4242 everything, with the mode bits `rwxr-xr-x`
    /// (what `setfacl -m u:4242:--- d` on a 0755 directory leaves).
    fn deny_4242(p: &Path) {
        let mut acl = 2u32.to_le_bytes().to_vec();
        let mut entry = |tag: u16, perm: u16, id: u32| {
            acl.extend_from_slice(&tag.to_le_bytes());
            acl.extend_from_slice(&perm.to_le_bytes());
            acl.extend_from_slice(&id.to_le_bytes());
        };
        entry(0x01, 7, u32::MAX); // ACL_USER_OBJ rwx
        entry(0x02, 0, 4242); // ACL_USER 4242 ---
        entry(0x04, 5, u32::MAX); // ACL_GROUP_OBJ r-x
        entry(0x10, 5, u32::MAX); // ACL_MASK r-x
        entry(0x20, 5, u32::MAX); // ACL_OTHER r-x
        rustix::fs::setxattr(
            p,
            "system.posix_acl_access",
            &acl,
            rustix::fs::XattrFlags::empty(),
        )
        .expect("set the ACL");
        let mode = std::fs::metadata(p).expect("stat").permissions().mode() & 0o7777;
        assert_eq!(mode, 0o755, "the ACL leaves the mode bits allowing others");
    }

    /// A symlink swapped in for the last component between the resolution and the open is
    /// refused, not opened as a link (whose `rwxrwxrwx` would pass the access check and whose
    /// identity would be handed on). Found by a hostile review. Control: the directory itself
    /// opens.
    #[test]
    fn test_a_trailing_symlink_swapped_in_after_resolution_is_refused() {
        let d = tempfile::tempdir().expect("tempdir");
        let dir = d.path().canonicalize().expect("canonical").join("dir");
        std::fs::create_dir(&dir).expect("mkdir");
        open_resolved(&dir).expect("control: the directory");
        let link = dir.with_file_name("link");
        std::os::unix::fs::symlink("/", &link).expect("symlink");
        assert!(open_resolved(&link).is_err(), "the link was opened");
    }

    #[test]
    fn test_the_kernel_decides_as_the_owner() {
        if !nix::unistd::geteuid().is_root() {
            panic!("this test needs root, as owners do");
        }
        let d = tempfile::tempdir().expect("tempdir");
        chmod(d.path(), 0o755);
        let open = d.path().join("open");
        let denied = d.path().join("denied");
        std::fs::create_dir(&open).expect("mkdir");
        std::fs::create_dir(&denied).expect("mkdir");
        chmod(&open, 0o755);
        chmod(&denied, 0o755);
        // Control: readable by mode bits alone, and its identity is the directory's.
        let ok = check_access(OWNER, &open, Access::Read).expect("readable");
        let m = std::fs::metadata(&open).expect("stat");
        assert_eq!(ok.identity, (m.dev(), m.ino()));
        assert_eq!(ok.path, open.canonicalize().expect("canonical"));
        assert!(
            check_access(OWNER, &open, Access::ReadWrite).is_err(),
            "0755 root's"
        );
        // An ACL that denies the owner, under mode bits that allow others.
        deny_4242(&denied);
        assert!(
            check_access(OWNER, &denied, Access::Read).is_err(),
            "the ACL denies"
        );
        assert!(
            check_access(
                Owner {
                    uid: 4343,
                    gid: 4343
                },
                &denied,
                Access::Read
            )
            .is_ok(),
            "control: another uid the ACL does not name"
        );
        // Beneath a directory the ACL closes to the owner: not even resolved.
        let inner = denied.join("inner");
        std::fs::create_dir(&inner).expect("mkdir");
        chmod(&inner, 0o777);
        assert!(check_access(OWNER, &inner, Access::ReadWrite).is_err());
        // The owner's own directory, read-write; a link to it is resolved as the owner.
        let mine = d.path().join("mine");
        std::fs::create_dir(&mine).expect("mkdir");
        std::os::unix::fs::chown(&mine, Some(4242), Some(4242)).expect("chown");
        chmod(&mine, 0o700);
        std::os::unix::fs::symlink(&mine, d.path().join("link")).expect("symlink");
        let rw = check_access(OWNER, &d.path().join("link"), Access::ReadWrite).expect("mine");
        assert_eq!(rw.path, mine.canonicalize().expect("canonical"));
        assert!(check_access(OWNER, Path::new("/root"), Access::Read).is_err());
    }
}
