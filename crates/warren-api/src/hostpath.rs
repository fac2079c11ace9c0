//! Which host paths a caller may hand to Warren (repositories, mounts).
//!
//! A local caller (uid U on the UNIX socket) may name any path uid U itself can reach; a
//! token holder may name only paths under an operator-configured `[[host_roots]]` entry,
//! and acts as that entry's uid. Either way the path is resolved and opened as that uid (its
//! primary group, no supplementary group: the identity every later use of the path has) and
//! the kernel is asked for the access ([`warren_session::access`]): ACLs and real search
//! permissions count, and a link cannot lead out of a root. The caller gets the identity
//! (device, inode) of the object checked, to hold its later use to.

use std::path::{Path, PathBuf};

use crate::auth::{Principal, Via};
use crate::config::HostRoot;
use crate::error::ApiError;

pub use warren_session::access::Access;

/// A host path the caller may use, the uid and primary gid Warren acts for on it, and the
/// identity (device, inode) of what was checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostPath {
    pub path: PathBuf,
    pub uid: u32,
    pub gid: u32,
    pub identity: (u64, u64),
    /// The canonical `[[host_roots]]` entry a token holder's path was admitted under (what
    /// everything later derived from the path must stay beneath); `None` for a local caller.
    pub root: Option<PathBuf>,
}

/// Decides whether `p` may use `path` with `access`. A uid the user database does not know
/// has no primary group to act with and is refused.
pub fn authorize(
    p: &Principal,
    roots: &[HostRoot],
    path: &str,
    access: Access,
) -> Result<HostPath, ApiError> {
    authorize_with(p, roots, path, access, primary_gid)
}

/// The primary group of `uid` in the user database.
fn primary_gid(uid: u32) -> Option<u32> {
    nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(uid))
        .ok()
        .flatten()
        .map(|u| u.gid.as_raw())
}

/// [`authorize`], with the primary group of a uid from `gid_of`.
fn authorize_with(
    p: &Principal,
    roots: &[HostRoot],
    path: &str,
    access: Access,
    gid_of: fn(u32) -> Option<u32>,
) -> Result<HostPath, ApiError> {
    let raw = Path::new(path);
    if !raw.is_absolute() {
        return Err(ApiError::invalid(format!(
            "host path {path:?} must be absolute"
        )));
    }
    let denied = || ApiError::forbidden(format!("host path {path:?} is not available to you"));
    // Resolution failures look the same as refusals: no probing of what exists.
    let (uid, root) = match &p.via {
        Via::Local { uid } => (*uid, None),
        Via::Token { .. } => {
            let real = std::fs::canonicalize(raw).map_err(|_| denied())?;
            // Only the roots the operator gave the caller's workspace: another workspace's
            // files are refused as any path outside every root is.
            let root = roots
                .iter()
                .filter(|r| r.admits(&p.workspace))
                .filter_map(|r| std::fs::canonicalize(&r.path).ok().map(|c| (c, r.uid)))
                .find(|(c, _)| real.starts_with(c))
                .ok_or_else(denied)?;
            (root.1, Some(root.0))
        }
    };
    // The account's primary group: what a session of it is owned by.
    let gid = gid_of(uid).ok_or_else(denied)?;
    let owner = warren_session::Owner { uid, gid };
    let checked = warren_session::access::check_access(owner, raw, access).map_err(|_| denied())?;
    // Resolved again as the uid: it must still be beneath the root it was admitted under.
    if let Some(root) = &root {
        if !checked.path.starts_with(root) {
            return Err(denied());
        }
    }
    Ok(HostPath {
        path: checked.path,
        uid,
        gid,
        identity: checked.identity,
        root,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    fn token_principal() -> Principal {
        Principal {
            workspace: "w".into(),
            policy: Default::default(),
            via: Via::Token {
                token_id: "t".into(),
            },
        }
    }

    fn chmod(p: &Path, m: u32) {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(m)).expect("chmod");
    }

    /// [`authorize`] for test uids the user database may not know: each its own group.
    fn authorize(
        p: &Principal,
        roots: &[HostRoot],
        path: &str,
        access: Access,
    ) -> Result<HostPath, ApiError> {
        authorize_with(p, roots, path, access, Some)
    }

    #[test]
    fn test_token_holder_only_under_roots() {
        let d = tempfile::tempdir().expect("tempdir");
        let root = d.path().join("root");
        let repo = root.join("repo");
        std::fs::create_dir_all(&repo).expect("mkdir");
        let roots = vec![HostRoot {
            path: root.clone(),
            uid: 0,
            workspaces: vec!["w".into()],
            allow_root: true,
        }];
        let p = token_principal();
        let ok = authorize(&p, &roots, repo.to_str().expect("utf8"), Access::Read).expect("ok");
        assert_eq!(ok.path, std::fs::canonicalize(&repo).expect("canon"));
        // Outside every root, or no roots configured: forbidden.
        assert_eq!(
            authorize(&p, &roots, "/etc", Access::Read)
                .expect_err("etc")
                .code,
            "forbidden"
        );
        assert!(authorize(&p, &[], repo.to_str().expect("utf8"), Access::Read).is_err());
        // A symlink inside the root pointing out of it is judged by its target.
        std::os::unix::fs::symlink("/etc", root.join("out")).expect("symlink");
        let out = root.join("out");
        assert!(authorize(&p, &roots, out.to_str().expect("utf8"), Access::Read).is_err());
        // `..` cannot climb out either.
        let climb = format!("{}/../../etc", repo.display());
        assert!(authorize(&p, &roots, &climb, Access::Read).is_err());
        assert_eq!(
            authorize(&p, &roots, "relative", Access::Read)
                .expect_err("relative")
                .code,
            "invalid_argument"
        );
    }

    /// A root belongs to the workspaces the operator names: a token holder of another
    /// workspace is refused beneath it as outside every root (before, every root was every
    /// token holder's: one workspace's token reached another's repositories, `direct`
    /// read-write sessions included). `"*"` gives it to every workspace.
    #[test]
    fn test_a_root_is_only_its_workspaces() {
        let d = tempfile::tempdir().expect("tempdir");
        let repo = d.path().join("repo");
        std::fs::create_dir_all(&repo).expect("mkdir");
        let repo = repo.to_str().expect("utf8").to_string();
        let root = |workspaces: &[&str]| {
            vec![HostRoot {
                path: d.path().to_path_buf(),
                uid: 0,
                workspaces: workspaces.iter().map(|w| w.to_string()).collect(),
                allow_root: true,
            }]
        };
        let p = token_principal(); // workspace "w"
        for (names, admitted) in [
            (&["w"][..], true),
            (&["other", "w"][..], true),
            (&["*"][..], true),
            (&["other"][..], false),
            (&[][..], false),
        ] {
            let r = authorize(&p, &root(names), &repo, Access::Read);
            assert_eq!(r.is_ok(), admitted, "{names:?}: {r:?}");
            if let Err(e) = r {
                assert_eq!(e.code, "forbidden", "{names:?}");
            }
        }
    }

    #[test]
    fn test_local_caller_checked_as_its_uid() {
        if !nix::unistd::geteuid().is_root() {
            return; // needs chown to set up other owners
        }
        let d = tempfile::tempdir().expect("tempdir");
        chmod(d.path(), 0o755);
        let mine = d.path().join("mine");
        let theirs = d.path().join("theirs");
        std::fs::create_dir(&mine).expect("mkdir");
        std::fs::create_dir(&theirs).expect("mkdir");
        std::os::unix::fs::chown(&mine, Some(4242), Some(4242)).expect("chown");
        chmod(&mine, 0o700);
        chmod(&theirs, 0o700);
        let p = Principal::local(4242);
        let s = |x: &Path| x.to_str().expect("utf8").to_string();
        assert!(authorize(&p, &[], &s(&mine), Access::ReadWrite).is_ok());
        assert!(authorize(&p, &[], &s(&theirs), Access::Read).is_err());
        // Readable but not writable for others.
        chmod(&theirs, 0o755);
        assert!(authorize(&p, &[], &s(&theirs), Access::Read).is_ok());
        assert!(authorize(&p, &[], &s(&theirs), Access::ReadWrite).is_err());
        // An unsearchable ancestor hides everything below it.
        let inner = theirs.join("inner");
        std::fs::create_dir(&inner).expect("mkdir");
        chmod(&inner, 0o777);
        chmod(&theirs, 0o700);
        assert!(authorize(&p, &[], &s(&inner), Access::Read).is_err());
        // Root may name anything.
        assert!(authorize(&Principal::local(0), &[], &s(&inner), Access::ReadWrite).is_ok());
    }

    /// `setfacl -m u:4242:--- dir` on a 0755 directory: the mode bits let others read it, the
    /// ACL denies uid 4242. The kernel's answer, not the mode bits', decides (before, the
    /// mode bits let 4242 name it).
    #[test]
    fn test_an_acl_denying_the_caller_is_honoured() {
        if !nix::unistd::geteuid().is_root() {
            panic!("this test needs root (other owners, ACLs)");
        }
        let d = tempfile::tempdir().expect("tempdir");
        chmod(d.path(), 0o755);
        let dir = d.path().join("acl");
        std::fs::create_dir(&dir).expect("mkdir");
        chmod(&dir, 0o755);
        let s = dir.to_str().expect("utf8").to_string();
        let p = Principal::local(4242);
        // Control: without the ACL, readable; the identity is the directory's.
        let ok = authorize(&p, &[], &s, Access::Read).expect("readable by others");
        let m = std::fs::metadata(&dir).expect("stat");
        assert_eq!(ok.identity, (m.dev(), m.ino()));
        assert_eq!((ok.uid, ok.gid), (4242, 4242));
        let mut acl = 2u32.to_le_bytes().to_vec();
        for (tag, perm, id) in [
            (0x01u16, 7u16, u32::MAX), // owner rwx
            (0x02, 0, 4242),           // user 4242 ---
            (0x04, 5, u32::MAX),       // group r-x
            (0x10, 5, u32::MAX),       // mask r-x
            (0x20, 5, u32::MAX),       // others r-x
        ] {
            acl.extend_from_slice(&tag.to_le_bytes());
            acl.extend_from_slice(&perm.to_le_bytes());
            acl.extend_from_slice(&id.to_le_bytes());
        }
        rustix::fs::setxattr(
            &dir,
            "system.posix_acl_access",
            &acl,
            rustix::fs::XattrFlags::empty(),
        )
        .expect("set the ACL");
        assert_eq!(m.mode() & 0o777, 0o755);
        assert_eq!(
            authorize(&p, &[], &s, Access::Read)
                .expect_err("the ACL denies 4242")
                .code,
            "forbidden"
        );
        // Nor anything beneath it.
        let inner = dir.join("inner");
        std::fs::create_dir(&inner).expect("mkdir");
        chmod(&inner, 0o777);
        let inner = inner.to_str().expect("utf8").to_string();
        assert!(authorize(&p, &[], &inner, Access::ReadWrite).is_err());
        // Another uid the ACL does not name still may.
        assert!(authorize(&Principal::local(4343), &[], &inner, Access::ReadWrite).is_ok());
    }
}
