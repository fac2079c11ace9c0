//! The engine's own directories (state, images) must be trusted before anything in them is:
//! the database says which images boot, the image store holds the kernels and root
//! filesystems VMs boot. A directory another local user owns, or can write to, or can
//! replace (through a parent it can write to), would let that user choose what the running
//! user's VMs boot: a state directory pre-created under a predictable path (`/tmp` when no
//! home is known), or one named by an inherited `XDG_STATE_HOME`.
//!
//! [`check`] walks the directory and every parent, as OpenSSH's strict modes do: each must be
//! owned by the running user or root; none may be writable by other users, except a sticky
//! parent (like `/tmp`, where only a child's owner can rename it); a group-writable one only
//! when the running user is in the group and nobody else is (`trusted_group`: the user's
//! private group, as a umask of 002 leaves directories on Debian-style systems; root's group
//! for root where no other account has it). A primary group users share (`users`) is not
//! trusted, even when it is the running user's. A directory with an access ACL is refused when a named entry lets
//! another user, or a group not trusted so, write (its mode's group bits are the ACL's
//! mask, which such an entry writes through). Both the path as named and the path it
//! resolves to are walked: a symbolic link on the way must be owned by the user or root too,
//! and the path it names is walked the same way (links within links included), so no link
//! another user planted, and no parent of one, decides where the directory is.

use std::os::unix::fs::MetadataExt;
use std::path::Path;

use crate::error::CoreError;

const STICKY: u32 = 0o1000;

/// Refuses `dir` (which must exist) unless it and its parents are trusted (module docs).
pub fn check(dir: &Path) -> Result<(), CoreError> {
    let real = dir
        .canonicalize()
        .map_err(|e| CoreError::io("resolve", dir, e))?;
    let named = std::path::absolute(dir).map_err(|e| CoreError::io("resolve", dir, e))?;
    walk(&real, dir, true, 0)?;
    if named != real {
        walk(&named, dir, true, 0)?;
    }
    Ok(())
}

/// Links followed within links before a path is refused (the kernel's own limit).
const MAX_LINKS: usize = 40;

/// Checks `path` and its parents as they are named (a link is judged by its owner, as its
/// mode means nothing), and the path each link on the way names, the same way: a link's
/// target may itself go through a link (`/home/u/state -> /tmp/shared/state`), which is on
/// neither the named nor the resolved path, and whose owner could re-point it later. `own`:
/// `path` is the directory itself (not one of its parents).
fn walk(path: &Path, dir: &Path, own: bool, links: usize) -> Result<(), CoreError> {
    let uid = rustix::process::geteuid().as_raw();
    let mut at = Some(path);
    let mut own = own;
    while let Some(d) = at {
        let m = std::fs::symlink_metadata(d).map_err(|e| CoreError::io("inspect", d, e))?;
        let link = m.file_type().is_symlink();
        let mode = if link { 0 } else { m.mode() };
        let trusted = |g| trusted_group(g, uid);
        let why = refusal(m.uid(), m.gid(), mode, uid, own, &trusted).or_else(|| {
            // The group bits of a directory with an access ACL are its mask: a named entry
            // (another user, a shared group) can write through them whatever the owning
            // group is.
            let sticky = mode & STICKY != 0 && !own;
            if link || sticky || mode & 0o020 == 0 {
                return None;
            }
            acl_writers(d, uid, &trusted)
        });
        if let Some(why) = why {
            return Err(CoreError::UntrustedDirectory(format!(
                "{} (for {}): {why}",
                d.display(),
                dir.display()
            )));
        }
        if link {
            if links >= MAX_LINKS {
                return Err(CoreError::UntrustedDirectory(format!(
                    "{} (for {}): too many levels of links",
                    d.display(),
                    dir.display()
                )));
            }
            let target = std::fs::read_link(d).map_err(|e| CoreError::io("inspect", d, e))?;
            let target = match d.parent() {
                Some(p) if target.is_relative() => p.join(target),
                _ => target,
            };
            walk(&target, dir, own, links + 1)?;
        }
        own = false;
        at = d.parent();
    }
    Ok(())
}

/// Why a directory with `owner`, `group` and `mode` cannot be trusted by `uid`, whose
/// trusted groups `trusted` names; `own`: it is the directory itself rather than a parent.
fn refusal(
    owner: u32,
    group: u32,
    mode: u32,
    uid: u32,
    own: bool,
    trusted: &dyn Fn(u32) -> bool,
) -> Option<String> {
    if owner != uid && owner != 0 {
        return Some(format!("owned by uid {owner}, not by uid {uid} or root"));
    }
    let sticky = mode & STICKY != 0 && !own;
    if mode & 0o002 != 0 && !sticky {
        return Some(format!("writable by every user (mode {:o})", mode & 0o7777));
    }
    if mode & 0o020 != 0 && !sticky && !trusted(group) {
        return Some(format!(
            "writable by group {group}, which other users may be in (mode {:o}; `chmod g-w` \
             it, or make its group the running user's private one)",
            mode & 0o7777
        ));
    }
    None
}

/// Why the access ACL of `dir`, whose mode grants its group class write, lets someone other
/// than `uid` (or a group `trusted` does not name) write to it; `None` when it has no ACL or
/// none such. An ACL that cannot be read (other than none there) refuses.
fn acl_writers(dir: &Path, uid: u32, trusted: &dyn Fn(u32) -> bool) -> Option<String> {
    const USER: u16 = 0x02;
    const GROUP: u16 = 0x08;
    const WRITE: u16 = 0x02;
    let mut buf = vec![0u8; 4096];
    let n = match rustix::fs::lgetxattr(dir, "system.posix_acl_access", &mut buf[..]) {
        Ok(n) => n,
        Err(e) if e == rustix::io::Errno::NODATA || e == rustix::io::Errno::NOTSUP => return None,
        Err(e) => return Some(format!("its ACL cannot be read ({e})")),
    };
    // A version word, then (tag u16, perm u16, id u32) entries, little-endian.
    let entries = buf[..n].get(4..).unwrap_or_default();
    for e in entries.chunks_exact(8) {
        let tag = u16::from_le_bytes([e[0], e[1]]);
        let perm = u16::from_le_bytes([e[2], e[3]]);
        let id = u32::from_le_bytes([e[4], e[5], e[6], e[7]]);
        if perm & WRITE == 0 {
            continue;
        }
        if tag == USER && id != uid {
            return Some(format!("writable by uid {id} through its ACL"));
        }
        if tag == GROUP && !trusted(id) {
            return Some(format!(
                "writable by group {id} through its ACL, which other users may be in"
            ));
        }
    }
    None
}

/// Whether only the running user (`uid`) can be in group `group`: the user is in it (their
/// primary group, or listed), nobody else is listed, and no other account has it as primary
/// group (every account the system's user database enumerates is looked at). An empty group
/// is not trusted: setgid programs run as such groups. Looked up through the system's user
/// database (`getpwuid_r`, `getgrgid_r`, `getpwent`); a lookup that fails trusts nothing.
/// Accounts of a source that does not enumerate (a directory service set not to) are not
/// seen.
fn trusted_group(group: u32, uid: u32) -> bool {
    use nix::unistd::{Gid, Group, Uid, User};
    let Ok(Some(g)) = Group::from_gid(Gid::from_raw(group)) else {
        return false;
    };
    let Ok(Some(u)) = User::from_uid(Uid::from_raw(uid)) else {
        return false;
    };
    let Some(primary) = warren_vmm::sys::accounts::primary_members(group) else {
        return false;
    };
    only_user_in(&g.mem, &primary, u.gid.as_raw() == group, &u.name, uid)
}

/// Whether the user (`user`, `uid`) is in a group (`primary`: it is their primary group)
/// whose listed members are `listed` and whose primary members are the uids `primaries`,
/// and nobody else is.
fn only_user_in(listed: &[String], primaries: &[u32], primary: bool, user: &str, uid: u32) -> bool {
    (primary || listed.iter().any(|m| m == user))
        && listed.iter().all(|m| m == user)
        && primaries.iter().all(|&p| p == uid)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_refusals() {
        let own = |g: u32| g == 1000;
        let refusal =
            |owner, group, mode, uid, is_own| refusal(owner, group, mode, uid, is_own, &own);
        // The running user's or root's, not writable by others: trusted.
        assert!(refusal(1000, 1000, 0o40755, 1000, true).is_none());
        assert!(refusal(0, 0, 0o40755, 1000, false).is_none());
        // Another user's: refused wherever it is.
        assert!(refusal(1001, 1001, 0o40700, 1000, true).is_some());
        assert!(refusal(1001, 1001, 0o40755, 0, false).is_some());
        // World-writable: only a sticky parent (like /tmp).
        assert!(refusal(0, 0, 0o41777, 1000, false).is_none());
        assert!(refusal(0, 0, 0o41777, 1000, true).is_some());
        assert!(refusal(0, 0, 0o40777, 1000, false).is_some());
        // Group-writable: only a trusted group.
        assert!(refusal(1000, 1000, 0o40775, 1000, true).is_none());
        assert!(refusal(1000, 50, 0o40775, 1000, true).is_some());
        assert!(refusal(0, 0, 0o40775, 1000, false).is_some());
    }

    /// A group is trusted only when the user is in it and nobody else is: a primary group
    /// users share (`users`, gid 100, the documented gap: before, any primary group was
    /// trusted), one that lists someone else, one that is another account's primary group
    /// too (before: not seen), and an empty one (setgid programs run as such) are not.
    #[test]
    fn test_groups_only_the_user_is_in() {
        let none: [String; 0] = [];
        let alice = || vec!["alice".to_string()];
        assert!(only_user_in(&none, &[1000], true, "alice", 1000));
        assert!(
            only_user_in(&alice(), &[], false, "alice", 1000),
            "listed only"
        );
        assert!(
            !only_user_in(&none, &[1000, 1001], true, "alice", 1000),
            "bob's primary too"
        );
        assert!(
            !only_user_in(&["bob".into()], &[1000], true, "alice", 1000),
            "bob listed"
        );
        assert!(
            !only_user_in(&none, &[], false, "alice", 1000),
            "empty: setgid programs'"
        );
        assert!(
            !only_user_in(&["bob".into()], &[], false, "alice", 1000),
            "bob's only"
        );
    }

    /// On this system: root's group is trusted for root when root is the only account
    /// with it as primary group (true of the machines this suite runs on), not for another
    /// user (root is in it); a group no user database knows is not, even as the running
    /// user's primary group (before, the running user's primary group always was). The
    /// enumeration sees root.
    #[test]
    fn test_trusted_group_from_the_user_database() {
        assert_eq!(
            warren_vmm::sys::accounts::primary_members(0).map(|m| m.contains(&0)),
            Some(true)
        );
        assert_eq!(
            trusted_group(0, 0),
            warren_vmm::sys::accounts::primary_members(0) == Some(vec![0]),
            "root's group"
        );
        assert!(!trusted_group(0, 65534), "root's group for nobody");
        assert!(!trusted_group(4_000_000, 0), "a group no database knows");
    }

    /// A state directory another user made (the review's attack: pre-created where the
    /// victim's Warren will look) is refused, and so is one under a parent that user owns;
    /// the victim's own directory under /tmp is trusted. Needs root (to make another user's
    /// directory), as the suite does.
    #[test]
    fn test_a_directory_another_user_made_is_refused() {
        let tmp = tempfile::tempdir().expect("tmp");
        let mine = tmp.path().join("mine");
        std::fs::create_dir(&mine).expect("mkdir");
        assert!(check(&mine).is_ok());
        let theirs = tmp.path().join("theirs");
        std::fs::create_dir(&theirs).expect("mkdir");
        std::os::unix::fs::chown(&theirs, Some(65534), Some(65534)).expect("chown");
        let e = check(&theirs).expect_err("another user's");
        assert_eq!(e.code(), "forbidden", "{e}");
        let under = theirs.join("warren");
        std::fs::create_dir(&under).expect("mkdir");
        assert!(check(&under).is_err(), "a parent another user owns");
        let open = tmp.path().join("open");
        std::fs::create_dir(&open).expect("mkdir");
        std::fs::set_permissions(&open, std::os::unix::fs::PermissionsExt::from_mode(0o777))
            .expect("chmod");
        assert!(check(&open).is_err(), "world-writable");
        // A link another user planted, even to the user's own directory, is refused; the
        // user's own link to it is not.
        let planted = tmp.path().join("planted");
        std::os::unix::fs::symlink(&mine, &planted).expect("symlink");
        assert!(check(&planted).is_ok(), "the user's own link");
        std::os::unix::fs::lchown(&planted, Some(65534), Some(65534)).expect("lchown");
        assert!(check(&planted).is_err(), "another user's link");
    }

    /// Sets `dir`'s access ACL: its owner, group and others as `mode` says, plus `extra`
    /// named (tag, id) entries with rwx and a mask of rwx.
    fn set_acl(dir: &Path, mode: u16, extra: &[(u16, u32)]) {
        let any = u32::MAX;
        let mut entries = vec![(0x01, (mode >> 6) & 7, any)];
        entries.extend(extra.iter().map(|&(t, id)| (t, 7, id)));
        entries.extend([
            (0x04, (mode >> 3) & 7, any),
            (0x10, 7, any),
            (0x20, mode & 7, any),
        ]);
        // The kernel takes entries in tag order.
        entries.sort_by_key(|&(tag, _, id)| (tag, id));
        let mut acl = 2u32.to_le_bytes().to_vec();
        for (tag, perm, id) in entries {
            acl.extend(u16::to_le_bytes(tag));
            acl.extend(u16::to_le_bytes(perm));
            acl.extend(u32::to_le_bytes(id));
        }
        rustix::fs::setxattr(
            dir,
            "system.posix_acl_access",
            &acl,
            rustix::fs::XattrFlags::empty(),
        )
        .expect("set an ACL (the test's file system must have them)");
    }

    /// A directory whose mode looks group-writable by a trusted group (root's, for the
    /// root-run suite) but whose ACL lets another user or a shared group write is refused:
    /// with an ACL the mode's group bits are its mask, not the group's. (Before, both were
    /// trusted, and Warren went on to create `images/` there, which the ACL's user could
    /// write for good.) Positive control: the same mode without a named entry, and a named
    /// entry for the running user itself, pass.
    #[test]
    fn test_an_acl_granting_another_user_write_is_refused() {
        assert_eq!(
            rustix::process::geteuid().as_raw(),
            0,
            "the suite runs as root"
        );
        let tmp = tempfile::tempdir().expect("tmp");
        let dir = tmp.path().join("state");
        std::fs::create_dir(&dir).expect("mkdir");
        std::os::unix::fs::chown(&dir, Some(0), Some(0)).expect("chown");
        set_acl(&dir, 0o775, &[]);
        assert!(check(&dir).is_ok(), "control: {:?}", check(&dir));
        set_acl(&dir, 0o775, &[(0x02, 0)]);
        assert!(
            check(&dir).is_ok(),
            "control, the user's own entry: {:?}",
            check(&dir)
        );
        set_acl(&dir, 0o775, &[(0x02, 1234)]);
        let e = check(&dir).expect_err("another user's ACL entry");
        assert_eq!(e.code(), "forbidden", "{e}");
        assert!(e.to_string().contains("uid 1234"), "{e}");
        set_acl(&dir, 0o775, &[(0x08, 50)]);
        assert!(check(&dir).is_err(), "a shared group's ACL entry");
        // A parent with such an ACL is refused too.
        set_acl(&dir, 0o775, &[(0x02, 1234)]);
        let under = dir.join("warren");
        std::fs::create_dir(&under).expect("mkdir");
        assert!(
            check(&under).is_err(),
            "a parent with another user's ACL entry"
        );
    }

    /// A link of the user's whose target goes through another user's link (in a sticky
    /// directory, where that user may re-point it at any time) is refused, though neither
    /// the path as named nor the path it resolves to has anything of that user's. (Before,
    /// both walks passed.) Positive control: the same chain with the user's own link passes.
    #[test]
    fn test_a_link_through_another_users_link_is_refused() {
        let tmp = tempfile::tempdir().expect("tmp");
        let sticky = tmp.path().join("sticky");
        std::fs::create_dir(&sticky).expect("mkdir");
        std::fs::set_permissions(
            &sticky,
            std::os::unix::fs::PermissionsExt::from_mode(0o1777),
        )
        .expect("chmod");
        let real = tmp.path().join("real");
        std::fs::create_dir_all(real.join("state")).expect("mkdir");
        let shared = sticky.join("shared");
        std::os::unix::fs::symlink(&real, &shared).expect("symlink");
        let state = tmp.path().join("state");
        std::os::unix::fs::symlink(shared.join("state"), &state).expect("symlink");
        assert!(check(&state).is_ok(), "every link the user's own");
        std::os::unix::fs::lchown(&shared, Some(65534), Some(65534)).expect("lchown");
        let e = check(&state).expect_err("a link another user can re-point");
        assert_eq!(e.code(), "forbidden", "{e}");
        // A relative link within the user's own directory is followed the same way, and a
        // link to a sticky directory as a parent is one as before.
        let rel = tmp.path().join("rel");
        std::os::unix::fs::symlink("real/state", &rel).expect("symlink");
        assert!(check(&rel).is_ok(), "{:?}", check(&rel));
        std::fs::create_dir(sticky.join("mine")).expect("mkdir");
        let to_sticky = tmp.path().join("to-sticky");
        std::os::unix::fs::symlink(&sticky, &to_sticky).expect("symlink");
        assert!(
            check(&to_sticky.join("mine")).is_ok(),
            "{:?}",
            check(&to_sticky.join("mine"))
        );
    }
}
