//! The syscalls host git needs between fork and exec, and the loop-device ioctls of a
//! session's own filesystem (`loopdev`); the only modules of this crate with `unsafe`.
#![allow(unsafe_code)]

pub(crate) mod loopdev;

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Command;

use crate::git::Owner;

/// Sets the supplementary groups of the calling thread only. libc's `setgroups` changes every
/// thread of the process (it signals them all); the system call itself is per thread.
pub(crate) fn set_thread_groups(groups: &[u32]) -> std::io::Result<()> {
    // SAFETY: the pointer and length describe a live slice of gid_t (u32) for the call's
    // duration; the kernel only reads it.
    let r = unsafe {
        nix::libc::syscall(
            nix::libc::SYS_setgroups,
            groups.len() as nix::libc::size_t,
            groups.as_ptr(),
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Caps the address space of the program `cmd` runs at `bytes`.
pub(crate) fn limit_address_space(cmd: &mut Command, bytes: u64) {
    // SAFETY: setrlimit is async-signal-safe and touches only the child.
    unsafe {
        cmd.pre_exec(move || {
            nix::sys::resource::setrlimit(nix::sys::resource::Resource::RLIMIT_AS, bytes, bytes)
                .map_err(std::io::Error::from)
        });
    }
}

/// Runs `cmd` in a mount namespace of its own in which `work_tree` is bind-mounted onto itself
/// read-only, `nosymfollow`, `nodev` and `nosuid`, then takes on `owner`. Git then cannot
/// write into the guest's tree, and no path resolved through it follows a link the guest
/// planted or swapped in while git walks it. Its one supplementary group is a session
/// volume's reserve ([`crate::volume::RESERVE_ID`]). Needs root (the caller checks).
pub(crate) fn confine_tree(cmd: &mut Command, work_tree: &Path, owner: Option<Owner>) {
    use nix::mount::{mount, MsFlags};
    use std::os::unix::ffi::OsStrExt;
    let tree = std::ffi::CString::new(work_tree.as_os_str().as_bytes());
    let reserve = nix::unistd::Gid::from_raw(crate::volume::RESERVE_ID);
    // SAFETY: only async-signal-safe syscalls (unshare, mount, setgroups, setgid, setuid)
    // run between fork and exec, on a path prepared before the fork; nothing allocates.
    unsafe {
        cmd.pre_exec(move || {
            let tree = tree.as_deref().map_err(|_| {
                std::io::Error::new(std::io::ErrorKind::InvalidInput, "NUL in a path")
            })?;
            let none: Option<&str> = None;
            nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNS)?;
            mount(none, "/", none, MsFlags::MS_REC | MsFlags::MS_PRIVATE, none)?;
            mount(Some(tree), tree, none, MsFlags::MS_BIND, none)?;
            let guarded = MsFlags::MS_REMOUNT
                | MsFlags::MS_BIND
                | MsFlags::MS_RDONLY
                | MsFlags::MS_NOSUID
                | MsFlags::MS_NODEV
                | MsFlags::from_bits_retain(nix::libc::MS_NOSYMFOLLOW);
            mount(none, tree, none, guarded, none)?;
            // Its only supplementary group opens a session volume's reserve to it
            // (`volume::RESERVE_ID`), where host git may write the scratch index.
            nix::unistd::setgroups(&[reserve])?;
            if let Some(o) = owner {
                nix::unistd::setgid(nix::unistd::Gid::from_raw(o.gid))?;
                nix::unistd::setuid(nix::unistd::Uid::from_raw(o.uid))?;
            }
            Ok(())
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sh(script: &str, tree: &Path, confined: bool) -> std::process::Output {
        let mut cmd = Command::new("sh");
        cmd.arg("-c").arg(script).env("T", tree);
        limit_address_space(&mut cmd, 1 << 30);
        if confined {
            confine_tree(&mut cmd, tree, Some(Owner { uid: 0, gid: 0 }));
        }
        cmd.output().expect("sh")
    }

    /// The guarded view of a guest-written tree: no write, no link followed, the address space
    /// capped; the same commands outside it (the positive control) do all of that. Root only,
    /// like the confinement itself (CI runs as root).
    #[test]
    fn test_confined_git_sees_the_tree_read_only_without_links() {
        if !nix::unistd::geteuid().is_root() {
            panic!("this test needs root, as the confinement does");
        }
        let dir = tempfile::tempdir().expect("tempdir");
        let tree = dir.path().join("tree");
        std::fs::create_dir_all(tree.join("d")).expect("mkdir");
        std::fs::write(tree.join("d/f"), "inside\n").expect("write");
        let outside = dir.path().join("secret");
        std::fs::write(&outside, "host secret\n").expect("write");
        std::os::unix::fs::symlink(&outside, tree.join("link")).expect("symlink");
        std::os::unix::fs::symlink(dir.path(), tree.join("dirlink")).expect("symlink");

        let script = "cat \"$T/d/f\"; readlink \"$T/link\"; \
            cat \"$T/link\" 2>/dev/null && echo followed; \
            cat \"$T/dirlink/secret\" 2>/dev/null && echo followed-dir; \
            touch \"$T/new\" 2>/dev/null && echo wrote; ulimit -v";
        let open = sh(script, &tree, false);
        let open = String::from_utf8_lossy(&open.stdout).into_owned();
        assert!(open.contains("host secret\nfollowed\n"), "{open}");
        assert!(open.contains("followed-dir"), "{open}");
        assert!(open.contains("wrote"), "{open}");
        std::fs::remove_file(tree.join("new")).expect("rm");

        let out = sh(script, &tree, true);
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(out.status.success(), "{text}");
        assert!(text.starts_with("inside\n"), "{text}");
        assert!(
            text.contains(outside.to_str().expect("utf-8")),
            "readlink works: {text}"
        );
        assert!(!text.contains("host secret"), "a link was followed: {text}");
        assert!(!text.contains("followed"), "{text}");
        assert!(!text.contains("wrote"), "{text}");
        assert!(!tree.join("new").exists());
        assert!(
            text.trim_end().ends_with("1048576"),
            "address space: {text}"
        );
        // The namespace is the child's own: the host's view is unchanged.
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
        assert!(!mounts.contains(tree.to_str().expect("utf-8")), "{mounts}");
    }
}
