//! Which host paths a caller may hand to Warren (repositories, mounts).
//!
//! A local caller (uid U on the UNIX socket) may name any path uid U itself can reach, checked
//! as U with U's groups. A token holder may name only paths under an operator-configured
//! `[[host_roots]]` entry, checked as that entry's uid. Paths are resolved (symlinks
//! included) before any check, so a link cannot lead out of a root.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use crate::auth::{Principal, Via};
use crate::config::HostRoot;
use crate::error::ApiError;

/// The access a caller needs on the named path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    Read,
    ReadWrite,
}

/// A host path the caller may use, and the uid Warren acts for on it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostPath {
    pub path: PathBuf,
    pub uid: u32,
}

/// Decides whether `p` may use `path` with `access`.
pub fn authorize(
    p: &Principal,
    roots: &[HostRoot],
    path: &str,
    access: Access,
) -> Result<HostPath, ApiError> {
    let raw = Path::new(path);
    if !raw.is_absolute() {
        return Err(ApiError::invalid(format!(
            "host path {path:?} must be absolute"
        )));
    }
    let denied = || ApiError::forbidden(format!("host path {path:?} is not available to you"));
    // Resolution failures look the same as refusals: no probing of what exists.
    let real = std::fs::canonicalize(raw).map_err(|_| denied())?;
    let uid = match &p.via {
        Via::Local { uid } => *uid,
        Via::Token { .. } => {
            let root = roots
                .iter()
                .filter_map(|r| std::fs::canonicalize(&r.path).ok().map(|c| (c, r.uid)))
                .find(|(c, _)| real.starts_with(c))
                .ok_or_else(denied)?;
            root.1
        }
    };
    if !may_access(uid, &real, access) {
        return Err(denied());
    }
    Ok(HostPath { path: real, uid })
}

/// The groups of `uid` (primary and supplementary), from the user database.
fn groups_of(uid: u32) -> Vec<u32> {
    let Ok(Some(user)) = nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(uid)) else {
        return vec![];
    };
    let mut g = vec![user.gid.as_raw()];
    if let Ok(name) = std::ffi::CString::new(user.name) {
        if let Ok(list) = nix::unistd::getgrouplist(&name, user.gid) {
            g.extend(list.iter().map(|x| x.as_raw()));
        }
    }
    g
}

/// Whether `uid` can search every ancestor of `path` and read (or read and write) `path`
/// itself, from mode bits. Root may do anything; ACLs are not consulted.
fn may_access(uid: u32, path: &Path, access: Access) -> bool {
    if uid == 0 {
        return true;
    }
    let groups = groups_of(uid);
    let allowed = |m: &std::fs::Metadata, bit: u32| -> bool {
        let mode = m.mode();
        if m.uid() == uid {
            mode & (bit << 6) != 0
        } else if groups.contains(&m.gid()) {
            mode & (bit << 3) != 0
        } else {
            mode & bit != 0
        }
    };
    for anc in path.ancestors().skip(1) {
        match std::fs::metadata(anc) {
            Ok(m) if allowed(&m, 0o1) => {}
            _ => return false,
        }
    }
    let Ok(m) = std::fs::metadata(path) else {
        return false;
    };
    let mut need = vec![0o4];
    if m.is_dir() {
        need.push(0o1);
    }
    if access == Access::ReadWrite {
        need.push(0o2);
    }
    need.into_iter().all(|b| allowed(&m, b))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

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

    #[test]
    fn test_token_holder_only_under_roots() {
        let d = tempfile::tempdir().expect("tempdir");
        let root = d.path().join("root");
        let repo = root.join("repo");
        std::fs::create_dir_all(&repo).expect("mkdir");
        let roots = vec![HostRoot {
            path: root.clone(),
            uid: 0,
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
}
