//! Host-wide blocks of VM uids, one per state directory.
//!
//! A root Warren runs each VM's VMM as a uid of its own, the lowest free one in its state
//! directory's database. Two state directories on one host (a service and a CLI with
//! `--state-dir`, two services, a test suite) used to hand out the same uids, so an escaped
//! VMM of one VM could read and write the other's `run/` files and trace its QEMU. Here each
//! state directory gets a block of [`BLOCK`] uids no other state directory uses, recorded in
//! a root-only registry ([`REGISTRY`]) that outlives reboots (a hibernated VM's files keep
//! its uid):
//! - `block-<k>` holds the canonical path of the state directory that has block `k`, whose
//!   ids are `VM_UID_BASE + k * BLOCK ..` (the first the state directory's templates group,
//!   the others its VMs' uids); `state-<sha256 of that path>` holds `k`;
//! - a block whose uids fall in any range of `/etc/subuid` or `/etc/subgid` is never given
//!   (a user's user namespaces own those ids);
//! - `dev-<k>` holds the device of the filesystem the state directory was on when it got
//!   block `k`;
//! - a block whose uids fall in any range of `/etc/subuid` or `/etc/subgid` *now* is not
//!   used any more: its state directory gets another (its VMs made in the old one are named
//!   in [`super::Warren::open`]'s warning);
//! - a block is taken back only when its state directory is known to be gone: no database,
//!   no VM directory left (a hibernated VM's `run/` files belong to the block's uids), the
//!   filesystem it was on still there (a state directory on an unmounted filesystem is only
//!   out of sight), and no process on the host runs as one of its uids;
//! - a state directory's path must be UTF-8 (the registry names it as text);
//! - every change happens under an exclusive `flock` of the registry's `.lock`.
//!
//! Written by hand: no crate keeps a host-wide id registry; the file formats are ours and
//! read with size limits.

use std::io::Read;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use super::VM_UID_BASE;
use crate::error::CoreError;

/// Where the registry lives (root's, 0700).
pub const REGISTRY: &str = "/var/lib/warren-uids";
/// Uids per state directory.
pub const BLOCK: u32 = 65_536;
/// Blocks there can be: every id stays below systemd's "foreign" range (0x7FFE0000) and so
/// below 2^31.
const MAX_BLOCKS: u32 = (0x7FFE_0000 - VM_UID_BASE) / BLOCK;
/// The longest registry, subuid or status file read.
const MAX_FILE: u64 = 1 << 20;

/// The first uid of `state_dir`'s block, claiming a block for it when it has none.
pub fn base_for(state_dir: &Path) -> Result<u32, CoreError> {
    let ranges = subordinate_ranges();
    base_in(Path::new(REGISTRY), state_dir, &ranges, &|lo, hi| {
        processes_with_uid_in(lo, hi)
    })
}

/// [`base_for`] on the registry `registry`, avoiding `reserved` uid ranges `(start, count)`;
/// `busy(lo, hi)`: whether a process runs as a uid in `lo..hi`.
fn base_in(
    registry: &Path,
    state_dir: &Path,
    reserved: &[(u64, u64)],
    busy: &dyn Fn(u32, u32) -> bool,
) -> Result<u32, CoreError> {
    let io = |what: &'static str, p: &Path| {
        let p = p.to_path_buf();
        move |e| CoreError::io(what, p, e)
    };
    open_registry(registry)?;
    let lock_path = registry.join(".lock");
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .open(&lock_path)
        .map_err(io("open", &lock_path))?;
    let _lock = nix::fcntl::Flock::lock(lock, nix::fcntl::FlockArg::LockExclusive)
        .map_err(|(_, e)| CoreError::io("lock", &lock_path, e.into()))?;

    let state = state_dir.canonicalize().map_err(io("resolve", state_dir))?;
    // Two paths that are not UTF-8 could read alike as text (and share a block), and the
    // take-back could not find the directory again by its text.
    let Some(state_text) = state.to_str().map(str::to_owned) else {
        return Err(CoreError::InvalidArgument(format!(
            "{}: a root Warren's state directory must have a UTF-8 path (the VM uid \
             registry names it)",
            state.display()
        )));
    };
    let state_dev = std::fs::metadata(&state)
        .map_err(io("inspect", &state))?
        .dev();
    let reserved_block = |k: u32| {
        let (lo, hi) = (base(k) as u64, base(k) as u64 + BLOCK as u64);
        reserved
            .iter()
            .any(|&(s, n)| s < hi && lo < s.saturating_add(n))
    };
    let index = registry.join(format!(
        "state-{}",
        hex::encode(Sha256::digest(state_text.as_bytes()))
    ));
    if let Some(k) = read_small(&index)?.and_then(|t| t.trim().parse::<u32>().ok()) {
        if k < MAX_BLOCKS && read_small(&block_file(registry, k))?.as_deref() == Some(&state_text) {
            if !reserved_block(k) {
                if read_small(&dev_file(registry, k))?.is_none() {
                    super::replace_private(
                        &dev_file(registry, k),
                        state_dev.to_string().as_bytes(),
                    )?;
                }
                return Ok(base(k));
            }
            // A user's user namespaces were given ids of this block since it was claimed
            // (`useradd` picks subordinate ranges without knowing of Warren): new VMs get
            // uids of a block of their own again. The old block stays this directory's.
            tracing::warn!(
                block = k,
                state = %state_text,
                "this state directory's uid block now overlaps a range of /etc/subuid or \
                 /etc/subgid: a user's user namespaces can run as its VMs' uids; new VMs get \
                 another block"
            );
        }
    }
    for k in 0..MAX_BLOCKS {
        let (lo, hi) = (base(k), base(k) + BLOCK);
        if reserved_block(k) {
            continue;
        }
        let file = block_file(registry, k);
        match read_small(&file)? {
            None => {}
            Some(owner) if owner == state_text => {}
            Some(owner) => {
                if !owner_gone(registry, k, &owner)? || busy(lo, hi) {
                    continue;
                }
                tracing::info!(block = k, previous = %owner, "taking back the uid block of a state directory that is gone");
                let old = registry.join(format!(
                    "state-{}",
                    hex::encode(Sha256::digest(owner.as_bytes()))
                ));
                match std::fs::remove_file(&old) {
                    Ok(()) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => return Err(CoreError::io("remove", &old, e)),
                }
            }
        }
        super::replace_private(&dev_file(registry, k), state_dev.to_string().as_bytes())?;
        super::replace_private(&file, state_text.as_bytes())?;
        super::replace_private(&index, k.to_string().as_bytes())?;
        tracing::info!(block = k, state = %state_text, first_uid = base(k), "uid block claimed");
        return Ok(base(k));
    }
    Err(CoreError::Busy(
        "no free block of VM uids on this host (every block belongs to a state directory)".into(),
    ))
}

fn base(k: u32) -> u32 {
    VM_UID_BASE + k * BLOCK
}

fn block_file(registry: &Path, k: u32) -> PathBuf {
    registry.join(format!("block-{k}"))
}

fn dev_file(registry: &Path, k: u32) -> PathBuf {
    registry.join(format!("dev-{k}"))
}

/// Whether block `k`'s state directory `owner` is known to be gone (module docs): anything
/// that cannot be read counts as still there.
fn owner_gone(registry: &Path, k: u32, owner: &str) -> Result<bool, CoreError> {
    let owner = Path::new(owner);
    if !matches!(owner.join("warren.db").try_exists(), Ok(false)) {
        return Ok(false);
    }
    match std::fs::read_dir(owner.join("vms")) {
        Ok(mut vms) => {
            if vms.next().is_some() {
                return Ok(false);
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(_) => return Ok(false),
    }
    let Some(dev) = read_small(&dev_file(registry, k))?.and_then(|t| t.trim().parse::<u64>().ok())
    else {
        // A block claimed before devices were recorded.
        return Ok(true);
    };
    // The nearest part of its path that exists, links not followed, must lie on the
    // filesystem the directory was on: a filesystem not mounted shows its mount point
    // (another filesystem's directory) or nothing there.
    for part in owner.ancestors() {
        match std::fs::symlink_metadata(part) {
            Ok(m) => return Ok(!m.file_type().is_symlink() && m.dev() == dev),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(_) => return Ok(false),
        }
    }
    Ok(false)
}

/// Makes the registry directory (root's, 0700) or refuses one that is not that.
fn open_registry(registry: &Path) -> Result<(), CoreError> {
    match std::fs::DirBuilder::new().mode(0o700).create(registry) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(CoreError::io("create", registry, e)),
    }
    let m =
        std::fs::symlink_metadata(registry).map_err(|e| CoreError::io("inspect", registry, e))?;
    let mode = m.permissions().mode();
    if !m.is_dir() || m.uid() != 0 || mode & 0o022 != 0 {
        return Err(CoreError::UntrustedDirectory(format!(
            "{}: the VM uid registry must be a directory of root's that only root can write \
             to (mode 0700)",
            registry.display()
        )));
    }
    if mode & 0o077 != 0 {
        // Root's and written by nobody else (a host path a container runtime made, 0755):
        // made root's alone before anything in it is used.
        std::fs::set_permissions(registry, std::fs::Permissions::from_mode(0o700))
            .map_err(|e| CoreError::io("chmod", registry, e))?;
    }
    Ok(())
}

/// A registry file's text, `None` when it does not exist; never through a link.
fn read_small(path: &Path) -> Result<Option<String>, CoreError> {
    let f = match std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(CoreError::io("open", path, e)),
    };
    let mut text = String::new();
    f.take(MAX_FILE)
        .read_to_string(&mut text)
        .map_err(|e| CoreError::io("read", path, e))?;
    Ok(Some(text))
}

/// The uid and gid ranges `(start, count)` of `/etc/subuid` and `/etc/subgid`.
fn subordinate_ranges() -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    for f in ["/etc/subuid", "/etc/subgid"] {
        if let Ok(Some(text)) = read_small(Path::new(f)) {
            out.extend(parse_subordinate(&text));
        }
    }
    out
}

/// `name:start:count` lines (numbers as wide as shadow's, `unsigned long`); anything else
/// is skipped.
fn parse_subordinate(text: &str) -> Vec<(u64, u64)> {
    text.lines()
        .filter_map(|l| {
            let mut parts = l.trim().split(':');
            let (_, start, count) = (parts.next()?, parts.next()?, parts.next()?);
            Some((start.parse().ok()?, count.parse().ok()?))
        })
        .collect()
}

/// Whether any process on the host runs with a real, effective, saved or file-system uid in
/// `lo..hi`.
fn processes_with_uid_in(lo: u32, hi: u32) -> bool {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return true;
    };
    for e in dir.flatten() {
        let name = e.file_name();
        if !name.to_string_lossy().bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let Ok(Some(status)) = read_small(&e.path().join("status")) else {
            continue;
        };
        let uids = status
            .lines()
            .find_map(|l| l.strip_prefix("Uid:"))
            .unwrap_or_default();
        if uids
            .split_whitespace()
            .filter_map(|u| u.parse::<u32>().ok())
            .any(|u| (lo..hi).contains(&u))
        {
            return true;
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    fn registry() -> (tempfile::TempDir, PathBuf) {
        let t = tempfile::tempdir().expect("tmp");
        let r = t.path().join("uids");
        (t, r)
    }

    fn state(t: &tempfile::TempDir, name: &str) -> PathBuf {
        let s = t.path().join(name);
        std::fs::create_dir_all(&s).expect("mkdir");
        std::fs::write(s.join("warren.db"), "").expect("db");
        s
    }

    /// Two state directories get disjoint blocks (before, both allocated from 2000000); the
    /// same one, asked again (by its path or through a link), keeps its block.
    #[test]
    fn test_state_directories_get_disjoint_blocks() {
        let (t, r) = registry();
        let idle = |_: u32, _: u32| false;
        let (a, b) = (state(&t, "a"), state(&t, "b"));
        let ba = base_in(&r, &a, &[], &idle).expect("a");
        let bb = base_in(&r, &b, &[], &idle).expect("b");
        assert_eq!(ba, VM_UID_BASE);
        assert_eq!(bb, VM_UID_BASE + BLOCK);
        assert_eq!(base_in(&r, &a, &[], &idle).expect("again"), ba);
        let link = t.path().join("link-to-b");
        std::os::unix::fs::symlink(&b, &link).expect("link");
        assert_eq!(base_in(&r, &link, &[], &idle).expect("link"), bb);
        let m = std::fs::metadata(&r).expect("registry");
        assert_eq!(m.permissions().mode() & 0o777, 0o700);
    }

    /// A block is taken back only when its state directory lost its database and no process
    /// runs as one of its uids.
    #[test]
    fn test_a_block_is_taken_back_only_when_its_state_and_processes_are_gone() {
        let (t, r) = registry();
        let idle = |_: u32, _: u32| false;
        let busy = |_: u32, _: u32| true;
        let a = state(&t, "a");
        assert_eq!(base_in(&r, &a, &[], &idle).expect("a"), VM_UID_BASE);
        std::fs::remove_file(a.join("warren.db")).expect("rm db");
        let b = state(&t, "b");
        assert_eq!(
            base_in(&r, &b, &[], &busy).expect("b"),
            VM_UID_BASE + BLOCK,
            "a process still runs as a uid of a's block"
        );
        let c = state(&t, "c");
        assert_eq!(
            base_in(&r, &c, &[], &idle).expect("c"),
            VM_UID_BASE,
            "a's block, nothing of it left"
        );
        // a comes back (a new database at the same path): it gets a block of its own anew.
        std::fs::write(a.join("warren.db"), "").expect("db");
        let again = base_in(&r, &a, &[], &idle).expect("a again");
        assert!(
            again != VM_UID_BASE && again != VM_UID_BASE + BLOCK,
            "{again}"
        );
    }

    /// A block overlapping a subordinate id range (a user's user namespaces) is skipped.
    #[test]
    fn test_blocks_in_subordinate_ranges_are_skipped() {
        let (t, r) = registry();
        let a = state(&t, "a");
        // bob's range ends inside block 0, carol's one id is block 1's first.
        let text = format!(
            "alice:100000:65536\n# comment\nbob:{}:10\nbad line\ncarol:{}:1\n",
            VM_UID_BASE - 5,
            VM_UID_BASE + BLOCK
        );
        let ranges = parse_subordinate(&text);
        assert_eq!(ranges.len(), 3);
        let got = base_in(&r, &a, &ranges, &|_, _| false).expect("a");
        assert_eq!(
            got,
            VM_UID_BASE + 2 * BLOCK,
            "blocks 0 and 1 overlap bob's and carol's"
        );
    }

    /// Two state directories whose paths are not UTF-8 used to be named alike in the
    /// registry (both as `\u{FFFD}`) and got the same block; such a path is refused now.
    #[test]
    fn test_state_paths_that_are_not_utf8_are_refused() {
        use std::os::unix::ffi::OsStrExt;
        let (t, r) = registry();
        let idle = |_: u32, _: u32| false;
        let mut got = Vec::new();
        for name in [&b"s\xff"[..], &b"s\xfe"[..]] {
            let s = t.path().join(std::ffi::OsStr::from_bytes(name));
            std::fs::create_dir_all(&s).expect("mkdir");
            std::fs::write(s.join("warren.db"), "").expect("db");
            got.push(base_in(&r, &s, &[], &idle));
        }
        for g in got {
            let e = g.expect_err("refused");
            assert_eq!(e.code(), "invalid_argument", "{e}");
        }
    }

    /// A subordinate range given since a block was claimed (`useradd` picks ranges up to
    /// 600100000 without knowing of Warren) moves new VMs to another block; the old one
    /// stays the directory's.
    #[test]
    fn test_a_block_overlapping_a_later_subordinate_range_is_left() {
        let (t, r) = registry();
        let idle = |_: u32, _: u32| false;
        let a = state(&t, "a");
        assert_eq!(base_in(&r, &a, &[], &idle).expect("a"), VM_UID_BASE);
        let later = parse_subordinate(&format!("user29:{}:65536\n", VM_UID_BASE - 65_000));
        let moved = base_in(&r, &a, &later, &idle).expect("a again");
        assert_eq!(
            moved,
            VM_UID_BASE + BLOCK,
            "block 0 now overlaps user29's range"
        );
        let b = state(&t, "b");
        let bb = base_in(&r, &b, &[], &idle).expect("b");
        assert!(
            bb != VM_UID_BASE && bb != moved,
            "block 0 is still a's: {bb}"
        );
    }

    /// A state directory whose database went but whose VM directories stay (a hibernated
    /// VM's `run/` files belong to the block's uids) keeps its block.
    #[test]
    fn test_a_block_with_vm_directories_left_is_kept() {
        let (t, r) = registry();
        let idle = |_: u32, _: u32| false;
        let a = state(&t, "a");
        assert_eq!(base_in(&r, &a, &[], &idle).expect("a"), VM_UID_BASE);
        std::fs::create_dir_all(a.join("vms/vm-000000000001/run")).expect("vm dir");
        std::fs::remove_file(a.join("warren.db")).expect("rm db");
        let c = state(&t, "c");
        assert_eq!(base_in(&r, &c, &[], &idle).expect("c"), VM_UID_BASE + BLOCK);
    }

    /// A state directory out of sight because its filesystem is not mounted (its path now
    /// leads to another filesystem, or nowhere) keeps its block; one deleted with the
    /// directory around it is taken back.
    #[test]
    fn test_a_block_whose_filesystem_is_not_mounted_is_kept() {
        let (t, r) = registry();
        let idle = |_: u32, _: u32| false;
        let mnt = t.path().join("mnt");
        let a = state(&t, "mnt/a");
        assert_eq!(base_in(&r, &a, &[], &idle).expect("a"), VM_UID_BASE);
        // The filesystem a was on, as if mounted at `mnt` and now not mounted: `mnt` is an
        // empty directory of the filesystem below.
        let here = std::fs::metadata(t.path()).expect("stat").dev();
        std::fs::write(r.join("dev-0"), (here + 1).to_string()).expect("dev");
        std::fs::remove_dir_all(&a).expect("rm a");
        let c = state(&t, "c");
        assert_eq!(
            base_in(&r, &c, &[], &idle).expect("c"),
            VM_UID_BASE + BLOCK,
            "a may come back when its filesystem is mounted"
        );
        // Control: the same, its filesystem still there (a temporary directory deleted).
        std::fs::write(r.join("dev-0"), here.to_string()).expect("dev");
        std::fs::remove_dir_all(&mnt).expect("rm mnt");
        let d = state(&t, "d");
        assert_eq!(base_in(&r, &d, &[], &idle).expect("d"), VM_UID_BASE);
    }

    /// A subordinate range too wide for 32 bits (shadow reads `unsigned long`) still counts:
    /// before, it was skipped and its blocks given.
    #[test]
    fn test_a_wide_subordinate_range_counts() {
        let (t, r) = registry();
        let a = state(&t, "a");
        let ranges = parse_subordinate("big:100000:4294967296\n");
        assert_eq!(ranges.len(), 1);
        let e = base_in(&r, &a, &ranges, &|_, _| false).expect_err("every block is the user's");
        assert_eq!(e.code(), "busy", "{e}");
    }

    /// A registry of root's that others may read (a host path a container runtime made,
    /// 0755) is made root's alone and used.
    #[test]
    fn test_a_readable_registry_is_made_private() {
        let (t, r) = registry();
        std::fs::create_dir(&r).expect("mkdir");
        std::fs::set_permissions(&r, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        let a = state(&t, "a");
        assert_eq!(base_in(&r, &a, &[], &|_, _| false).expect("a"), VM_UID_BASE);
        let m = std::fs::metadata(&r).expect("registry");
        assert_eq!(m.permissions().mode() & 0o777, 0o700);
    }

    /// A registry another user could write to is refused.
    #[test]
    fn test_a_registry_others_can_use_is_refused() {
        let (t, r) = registry();
        std::fs::create_dir(&r).expect("mkdir");
        std::fs::set_permissions(&r, std::fs::Permissions::from_mode(0o777)).expect("chmod");
        let a = state(&t, "a");
        let e = base_in(&r, &a, &[], &|_, _| false).expect_err("refused");
        assert_eq!(e.code(), "forbidden", "{e}");
    }

    /// This process's own uid counts as a process in its range.
    #[test]
    fn test_processes_with_uid_in_sees_this_process() {
        let me = nix::unistd::getuid().as_raw();
        assert!(processes_with_uid_in(me, me + 1));
        assert!(!processes_with_uid_in(4_000_000_000, 4_000_000_001));
    }
}
