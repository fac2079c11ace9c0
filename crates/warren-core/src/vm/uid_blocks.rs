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
//!   uids are `VM_UID_BASE + k * BLOCK ..`; `state-<sha256 of that path>` holds `k`;
//! - a block whose uids fall in any range of `/etc/subuid` or `/etc/subgid` is never given
//!   (a user's user namespaces own those ids);
//! - a block is taken back only when its state directory has no database any more and no
//!   process on the host runs as one of its uids;
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
/// Blocks there can be: every uid stays below 2^31 (ids past it trip old tools).
const MAX_BLOCKS: u32 = (i32::MAX as u32 - VM_UID_BASE) / BLOCK;
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
    reserved: &[(u32, u32)],
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
    let state_text = state.to_string_lossy().into_owned();
    let index = registry.join(format!(
        "state-{}",
        hex::encode(Sha256::digest(state_text.as_bytes()))
    ));
    if let Some(k) = read_small(&index)?.and_then(|t| t.trim().parse::<u32>().ok()) {
        if k < MAX_BLOCKS && read_small(&block_file(registry, k))?.as_deref() == Some(&state_text) {
            return Ok(base(k));
        }
    }
    for k in 0..MAX_BLOCKS {
        let (lo, hi) = (base(k), base(k) + BLOCK);
        let overlaps = |&(s, n): &(u32, u32)| {
            let (s, e) = (s as u64, s as u64 + n as u64);
            s < hi as u64 && (lo as u64) < e
        };
        if reserved.iter().any(overlaps) {
            continue;
        }
        let file = block_file(registry, k);
        match read_small(&file)? {
            None => {}
            Some(owner) if owner == state_text => {}
            Some(owner) => {
                let gone = !Path::new(&owner).join("warren.db").exists();
                if !gone || busy(lo, hi) {
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
        write_replace(&file, state_text.as_bytes())?;
        write_replace(&index, k.to_string().as_bytes())?;
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

/// Makes the registry directory (root's, 0700) or refuses one that is not that.
fn open_registry(registry: &Path) -> Result<(), CoreError> {
    match std::fs::DirBuilder::new().mode(0o700).create(registry) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(CoreError::io("create", registry, e)),
    }
    let m =
        std::fs::symlink_metadata(registry).map_err(|e| CoreError::io("inspect", registry, e))?;
    if !m.is_dir() || m.uid() != 0 || m.permissions().mode() & 0o077 != 0 {
        return Err(CoreError::UntrustedDirectory(format!(
            "{}: the VM uid registry must be a directory of root's that only root can use \
             (mode 0700)",
            registry.display()
        )));
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

/// Replaces `path` with `data` in one step (a new file, then a rename over it).
fn write_replace(path: &Path, data: &[u8]) -> Result<(), CoreError> {
    let tmp = path.with_extension("new");
    match std::fs::remove_file(&tmp) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(CoreError::io("remove", &tmp, e)),
    }
    super::write_private(&tmp, data)?;
    std::fs::rename(&tmp, path).map_err(|e| CoreError::io("rename", path, e))
}

/// The uid and gid ranges `(start, count)` of `/etc/subuid` and `/etc/subgid`.
fn subordinate_ranges() -> Vec<(u32, u32)> {
    let mut out = Vec::new();
    for f in ["/etc/subuid", "/etc/subgid"] {
        if let Ok(Some(text)) = read_small(Path::new(f)) {
            out.extend(parse_subordinate(&text));
        }
    }
    out
}

/// `name:start:count` lines; anything else is skipped.
fn parse_subordinate(text: &str) -> Vec<(u32, u32)> {
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
        let ranges = parse_subordinate(
            "alice:100000:65536\n# comment\nbob:2000100:10\nbad line\ncarol:2065536:1\n",
        );
        assert_eq!(ranges.len(), 3);
        let got = base_in(&r, &a, &ranges, &|_, _| false).expect("a");
        assert_eq!(
            got,
            VM_UID_BASE + 2 * BLOCK,
            "blocks 0 and 1 overlap bob's and carol's"
        );
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
