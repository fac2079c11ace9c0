//! The seccomp filters Warren puts on every virtiofsd before it starts (virtiofsd stacks its
//! own on top): whatever the share's owner (root included), nothing a guest does through a
//! share leaves a file on the host that grants privilege.
//!
//! - **EPERM** for every call that would give a file a set-user-ID or set-group-ID bit
//!   (`chmod`, `fchmod`, `fchmodat`, `fchmodat2`; the mode of `open`, `openat`, `creat`,
//!   `mkdir`, `mkdirat`, `mknod`, `mknodat`), for a character or block device node
//!   (`mknod`, `mknodat`), and for every extended attribute write (`setxattr`, `lsetxattr`,
//!   `fsetxattr`: file capabilities live in `security.capability`; Warren never turns on
//!   virtiofsd's `--xattr` anyway).
//! - **EPERM** for `open_by_handle_at`. A file handle names an inode of the whole file system,
//!   not of the share: a virtiofsd with `CAP_DAC_READ_SEARCH` (a root share's) opens it past
//!   its sandbox's root. Warren never turns on `--inode-file-handles` or
//!   `--migration-mode=file-handles`, yet a restoring virtiofsd takes whatever inode
//!   locations the incoming state names, file handles included, whatever its own mode: a
//!   checkpoint (written by the VMM, in its `run/` directory) that named the handle of `/`
//!   for a directory the guest held gave the guest the host's whole root file system on
//!   resume. Refused, the inode becomes an error in the guest (`--migration-on-error`).
//! - **ENOSYS** for `openat2` (its mode sits in a struct seccomp cannot read; virtiofsd probes
//!   for it and falls back to `openat`, whose mode argument the first filter checks) and for
//!   `io_uring_setup` (operations submitted through a ring never pass the filter).
//!
//! virtiofsd also gives up `CAP_MKNOD`, `CAP_FSETID` and `CAP_SETFCAP` (`--modcaps`), so the
//! kernel itself clears set-ID bits on writes and refuses device nodes. Seccomp's argument
//! checks are what seccompiler (Firecracker's) compiles; the filters are built before the
//! fork and only installed in the child.

use std::collections::BTreeMap;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};

use crate::error::VmmError;

/// `fchmodat2`, too new for every libc crate release.
const SYS_FCHMODAT2: i64 = 452;
const S_ISUID: u64 = 0o4000;
const S_ISGID: u64 = 0o2000;
const S_IFMT: u64 = 0o170000;
const S_IFCHR: u64 = 0o020000;
const S_IFBLK: u64 = 0o060000;

/// Both filters, compiled.
#[derive(Debug, Clone)]
pub struct ShareFilters {
    deny: BpfProgram,
    nosys: BpfProgram,
}

fn masked(arg: u8, mask: u64, value: u64) -> Result<SeccompRule, VmmError> {
    let cond = SeccompCondition::new(
        arg,
        SeccompCmpArgLen::Dword,
        SeccompCmpOp::MaskedEq(mask),
        value,
    )
    .map_err(|e| VmmError::Seccomp(e.to_string()))?;
    SeccompRule::new(vec![cond]).map_err(|e| VmmError::Seccomp(e.to_string()))
}

fn arch() -> Result<TargetArch, VmmError> {
    TargetArch::try_from(std::env::consts::ARCH).map_err(|e| VmmError::Seccomp(e.to_string()))
}

/// Builds the filters (see the module docs).
pub fn share_filters() -> Result<ShareFilters, VmmError> {
    let mut deny: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
    let mode_arg: &[(i64, u8)] = &[
        (libc::SYS_chmod, 1),
        (libc::SYS_fchmod, 1),
        (libc::SYS_fchmodat, 2),
        (SYS_FCHMODAT2, 2),
        (libc::SYS_open, 2),
        (libc::SYS_openat, 3),
        (libc::SYS_creat, 1),
        (libc::SYS_mkdir, 1),
        (libc::SYS_mkdirat, 2),
        (libc::SYS_mknod, 1),
        (libc::SYS_mknodat, 2),
    ];
    for &(sys, arg) in mode_arg {
        let rules = deny.entry(sys).or_default();
        rules.push(masked(arg, S_ISUID, S_ISUID)?);
        rules.push(masked(arg, S_ISGID, S_ISGID)?);
        if sys == libc::SYS_mknod || sys == libc::SYS_mknodat {
            rules.push(masked(arg, S_IFMT, S_IFCHR)?);
            rules.push(masked(arg, S_IFMT, S_IFBLK)?);
        }
    }
    for sys in [
        libc::SYS_setxattr,
        libc::SYS_lsetxattr,
        libc::SYS_fsetxattr,
        libc::SYS_open_by_handle_at,
    ] {
        // No rule: the action applies whatever the arguments.
        deny.insert(sys, Vec::new());
    }
    let nosys: BTreeMap<i64, Vec<SeccompRule>> = [libc::SYS_openat2, libc::SYS_io_uring_setup]
        .into_iter()
        .map(|s| (s, Vec::new()))
        .collect();
    let compile = |rules, action| -> Result<BpfProgram, VmmError> {
        SeccompFilter::new(rules, SeccompAction::Allow, action, arch()?)
            .and_then(BpfProgram::try_from)
            .map_err(|e| VmmError::Seccomp(e.to_string()))
    };
    Ok(ShareFilters {
        deny: compile(deny, SeccompAction::Errno(libc::EPERM as u32))?,
        nosys: compile(nosys, SeccompAction::Errno(libc::ENOSYS as u32))?,
    })
}

/// Installs `filters` in the child of `cmd` just before it execs.
pub fn install_in_child(cmd: &mut std::process::Command, filters: ShareFilters) {
    use std::os::unix::process::CommandExt;
    // SAFETY: the closure runs in the forked child before exec; the programs were built (and
    // allocated) before the fork, and installing them is two prctl/seccomp syscalls.
    unsafe {
        cmd.pre_exec(move || {
            for p in [&filters.deny, &filters.nosys] {
                seccompiler::apply_filter(p).map_err(|e| std::io::Error::other(e.to_string()))?;
            }
            Ok(())
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// Runs `script` under `sh` with (or without) the filters; returns its exit status.
    fn sh(script: &str, filtered: bool) -> std::process::ExitStatus {
        let mut cmd = std::process::Command::new("sh");
        cmd.arg("-c").arg(script);
        if filtered {
            install_in_child(&mut cmd, share_filters().expect("filters"));
        }
        cmd.status().expect("sh")
    }

    #[test]
    fn test_filters_refuse_set_id_bits_devices_and_xattrs() {
        let dir = tempfile::tempdir().expect("tempdir");
        let d = dir.path().display();
        let root = nix::unistd::geteuid().is_root();
        // Positive control: without the filters the same commands do it.
        let mut cases = vec![
            format!("touch {d}/a && chmod u+s {d}/a"),
            format!("touch {d}/b && chmod g+s {d}/b"),
            format!("mkdir -m 2755 {d}/c"),
            format!("install -m 4755 /bin/true {d}/e"),
        ];
        if root {
            cases.push(format!("mknod {d}/dev c 1 3"));
            cases.push(format!("mknod {d}/blk b 7 0"));
        }
        for (i, case) in cases.iter().enumerate() {
            assert!(sh(case, false).success(), "control {case}");
            let _ = sh(
                &format!("rm -rf {d}/a {d}/b {d}/c {d}/e {d}/dev {d}/blk"),
                false,
            );
            assert!(!sh(case, true).success(), "filtered {i}: {case} succeeded");
        }
        // Nothing set-ID or device-like was left by the filtered runs.
        for e in std::fs::read_dir(dir.path()).expect("ls").flatten() {
            let m = e.metadata().expect("stat");
            assert_eq!(m.permissions().mode() & 0o6000, 0, "{:?}", e.path());
            assert!(m.is_file() || m.is_dir(), "{:?}", e.path());
        }
        // Ordinary work still succeeds under the filters.
        assert!(sh(
            &format!("mkdir {d}/ok && echo x > {d}/ok/f && chmod 755 {d}/ok/f && mkfifo {d}/ok/p"),
            true
        )
        .success());
    }

    /// A file handle opens its inode wherever it lies on the file system, past any mount
    /// namespace root: a root virtiofsd restoring a state that names one (a checkpoint its
    /// VMM wrote) served a file outside its share, the host's `/` included, to the guest.
    /// Found by a hostile review. Control: unfiltered, root opens the same handle.
    #[test]
    fn test_filters_refuse_opening_file_handles() {
        assert!(nix::unistd::geteuid().is_root(), "this test needs root");
        let dir = tempfile::tempdir().expect("tempdir");
        let outside = dir.path().join("outside");
        std::fs::write(&outside, "secret").expect("write");
        // struct file_handle: handle_bytes, handle_type, then the handle itself.
        let mut fh = [0u8; 8 + 128];
        fh[..4].copy_from_slice(&128u32.to_ne_bytes());
        let name = std::ffi::CString::new(outside.as_os_str().as_encoded_bytes()).expect("name");
        let mut mount_id: libc::c_int = 0;
        // SAFETY: `name` is NUL-terminated and `fh` is a file_handle with room for 128 bytes.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_name_to_handle_at,
                libc::AT_FDCWD,
                name.as_ptr(),
                fh.as_mut_ptr(),
                &mut mount_id as *mut libc::c_int,
                0,
            )
        };
        assert_eq!(
            rc,
            0,
            "name_to_handle_at: {}",
            std::io::Error::last_os_error()
        );
        let mount = std::fs::File::open(dir.path()).expect("mount fd");
        let mount_fd = std::os::fd::AsRawFd::as_raw_fd(&mount);
        let open_handle = |filtered: bool| -> std::io::Result<()> {
            use std::os::unix::process::CommandExt;
            let mut cmd = std::process::Command::new("true");
            if filtered {
                install_in_child(&mut cmd, share_filters().expect("filters"));
            }
            // SAFETY: runs in the child before exec (after the filters): one syscall on a
            // descriptor and a buffer made before the fork; its error fails the spawn.
            unsafe {
                cmd.pre_exec(move || {
                    let fd = libc::syscall(
                        libc::SYS_open_by_handle_at,
                        mount_fd,
                        fh.as_ptr(),
                        libc::O_RDONLY | libc::O_CLOEXEC,
                    );
                    if fd < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
            cmd.status().map(drop)
        };
        open_handle(false).expect("control: root opens the handle unfiltered");
        let refused = open_handle(true).expect_err("the filtered child opened a file handle");
        assert_eq!(refused.raw_os_error(), Some(libc::EPERM), "{refused}");
    }
}
