//! Share coherence across a suspension.
//!
//! The guest kernel trusts a virtio-fs share's cached names (dentries) and attributes for the
//! timeout virtiofsd gave with each answer, counted in guest time. A pause or a hibernation
//! stops guest time, so after a resume those entries can still be "fresh" while they describe
//! a host that changed in between (a deleted, renamed, replaced or new file). virtio-fs has no
//! notification queue, so the host cannot invalidate them; the agent does, in two halves:
//!
//! - **At `Freeze`** ([`Shares::before_suspend`]), once the jobs are frozen (so nothing in the
//!   guest looks up share names until they thaw), while the guest still runs warm: it drops
//!   every unused cached entry (`vm.drop_caches = 2`: reclaimable dentries and inodes), and it
//!   lists the share paths that cannot be dropped because a job process pins them (open files,
//!   working and root directories, executables, mapped files, and every ancestor of those),
//!   found in `/proc` for every process of the jobs' cgroup tree.
//! - **At `Thaw`** ([`Shares::after_resume`]), before the jobs run again: it forces a lookup of
//!   each listed path, parents first. `mkdirat` asks the file system for an exclusive-create
//!   lookup, which FUSE always sends to virtiofsd, and the kernel unhashes a dentry the server
//!   no longer confirms (descriptors open on it keep working on the old file). The `mkdirat`
//!   runs on a private read-only clone of the share's mount (`open_tree` + `mount_setattr`),
//!   so it can only fail (`EEXIST`/`EROFS`) and creates nothing; each parent is resolved
//!   beneath that clone without following symlinks. A `Thaw` without a listing (the jobs did
//!   not freeze in time, or no `Freeze` came first) does the whole pass then.
//!
//!   The root of every share has its attributes fetched again (`statx` with
//!   `AT_STATX_FORCE_SYNC`): a mount's root is never dropped from the cache.
//!
//! VMs without shares skip both halves. Every input (`cgroup.procs`, `/proc` links and maps)
//! is read with a size cap, and each pass is bounded in entries and time: what a guest process
//! controls here are names in its own share, never anything of the host.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsStr;
use std::fs;
use std::io::{self, Read};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rustix::fs::{Mode, OFlags, ResolveFlags};

/// Most pinned paths revalidated per resume (each costs one FUSE lookup per component).
const MAX_PINNED: usize = 16_384;
/// Largest `cgroup.procs` or `/proc/PID/maps` read.
const MAX_TABLE_BYTES: u64 = 4 << 20;
/// Most processes looked at.
const MAX_PROCS: usize = 4096;
/// Deepest cgroup looked into below the jobs' cgroup.
const MAX_CGROUP_DEPTH: usize = 8;
/// Most descriptors looked at per process.
const MAX_FDS_PER_PROC: usize = 4096;
/// Each half stops here; what is left keeps its timeout-bounded staleness.
pub const DEADLINE: Duration = Duration::from_secs(5);
/// How long `Freeze` waits for the jobs' cgroup to report itself frozen.
const FROZEN_WAIT: Duration = Duration::from_millis(500);

/// What one pass did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Report {
    /// virtio-fs mounts found.
    pub shares: usize,
    /// Paths whose lookup was forced.
    pub revalidated: usize,
    /// The pass stopped at a limit before it was complete.
    pub truncated: bool,
}

/// The VM's shares and where the processes that may pin their names live.
#[derive(Debug, Clone, Default)]
pub struct Shares {
    /// Mount points, deepest first, so a path is matched to its innermost share.
    mounts: Arc<[PathBuf]>,
    /// The jobs' cgroup tree (every guest process but the agent is a job's).
    jobs_cgroup: PathBuf,
    /// What the last `Freeze` prepared for the next `Thaw`.
    prepared: Arc<Mutex<Option<Prepared>>>,
}

/// The pinned paths to revalidate, by mount point, parents first.
#[derive(Debug)]
struct Prepared {
    plan: BTreeMap<PathBuf, Vec<PathBuf>>,
    truncated: bool,
}

impl Shares {
    pub fn new(mut mounts: Vec<PathBuf>, jobs_cgroup: PathBuf) -> Self {
        mounts.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
        mounts.dedup();
        Shares {
            mounts: mounts.into(),
            jobs_cgroup,
            prepared: Arc::default(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.mounts.is_empty()
    }

    /// The `Freeze` half: call right after freezing the jobs. Drops the unused cached
    /// entries and lists the pinned ones; returns without preparing anything if the jobs did
    /// not report frozen in time (the `Thaw` half then does everything).
    pub fn before_suspend(&self) -> io::Result<()> {
        self.take_prepared();
        if self.mounts.is_empty() || !wait_frozen(&self.jobs_cgroup) {
            return Ok(());
        }
        let prepared = self.prepare(Instant::now())?;
        *self.prepared.lock().unwrap_or_else(|p| p.into_inner()) = Some(prepared);
        Ok(())
    }

    /// The `Thaw` half: call with the jobs still frozen. Makes every share's cached view
    /// match the host again.
    pub fn after_resume(&self) -> io::Result<Report> {
        let started = Instant::now();
        if self.mounts.is_empty() {
            return Ok(Report::default());
        }
        let prepared = match self.take_prepared() {
            Some(p) => p,
            None => self.prepare(started)?,
        };
        let mut truncated = prepared.truncated;
        let mut revalidated = 0;
        // A share's root is never dropped from the cache, and its attributes may describe
        // another directory than the one served now (a template clone's shares were stand-ins
        // when the template was saved): fetched again from virtiofsd.
        for mount in self.mounts.iter() {
            let _ = rustix::fs::statx(
                rustix::fs::CWD,
                mount,
                rustix::fs::AtFlags::STATX_FORCE_SYNC,
                rustix::fs::StatxFlags::BASIC_STATS,
            );
        }
        for (mount, rels) in &prepared.plan {
            let Ok(tree) = crate::sys::readonly_clone(mount) else {
                // Unmounted by guest root since boot: nothing to revalidate there.
                continue;
            };
            for rel in rels {
                if started.elapsed() > DEADLINE {
                    truncated = true;
                    break;
                }
                force_lookup(&tree, rel);
                revalidated += 1;
            }
        }
        Ok(Report {
            shares: self.mounts.len(),
            revalidated,
            truncated,
        })
    }

    fn take_prepared(&self) -> Option<Prepared> {
        self.prepared
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
    }

    /// Drops the unused entries and lists the pinned ones.
    fn prepare(&self, started: Instant) -> io::Result<Prepared> {
        fs::write("/proc/sys/vm/drop_caches", "2")?;
        let (pids, mut truncated) = cgroup_pids(&self.jobs_cgroup);
        let (pinned, cut) = pinned_paths(&pids, started);
        truncated |= cut;
        Ok(Prepared {
            plan: plan(&self.mounts, &pinned),
            truncated,
        })
    }
}

/// Waits until the cgroup tree at `root` reports itself frozen (`frozen 1` in
/// `cgroup.events`); false after [`FROZEN_WAIT`].
fn wait_frozen(root: &Path) -> bool {
    let deadline = Instant::now() + FROZEN_WAIT;
    let events = root.join("cgroup.events");
    loop {
        match read_capped(&events) {
            Ok(text) if text.split(|&b| b == b'\n').any(|l| l == b"frozen 1") => return true,
            Ok(_) => {}
            // No cgroup (tests on hosts without one): nothing else can run anyway.
            Err(_) => return true,
        }
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Every pid in the cgroup tree under `root` (bounded in depth and count). The second value
/// says a limit cut the list short.
fn cgroup_pids(root: &Path) -> (Vec<u32>, bool) {
    let mut pids = Vec::new();
    let mut stack = vec![(root.to_path_buf(), 0usize)];
    let mut truncated = false;
    while let Some((dir, depth)) = stack.pop() {
        if let Ok(procs) = read_capped(&dir.join("cgroup.procs")) {
            for line in procs.split(|&b| b == b'\n') {
                if let Some(pid) = std::str::from_utf8(line).ok().and_then(|l| l.parse().ok()) {
                    pids.push(pid);
                }
            }
        }
        if pids.len() > MAX_PROCS {
            pids.truncate(MAX_PROCS);
            return (pids, true);
        }
        let Ok(children) = fs::read_dir(&dir) else {
            continue;
        };
        for c in children.flatten() {
            if c.file_type().is_ok_and(|t| t.is_dir()) {
                if depth >= MAX_CGROUP_DEPTH {
                    truncated = true;
                } else {
                    stack.push((c.path(), depth + 1));
                }
            }
        }
    }
    (pids, truncated)
}

/// Forces one exclusive-create lookup of `rel` beneath the read-only clone `tree`.
fn force_lookup(tree: &OwnedFd, rel: &Path) {
    let (parent, name) = match (rel.parent(), rel.file_name()) {
        (Some(p), Some(n)) => (p, n),
        _ => return,
    };
    let parent_fd;
    let dir = if parent.as_os_str().is_empty() {
        tree.as_fd()
    } else {
        let resolve = ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_XDEV;
        let flags = OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC;
        match rustix::fs::openat2(tree, parent, flags, Mode::empty(), resolve) {
            Ok(fd) => {
                parent_fd = fd;
                parent_fd.as_fd()
            }
            // The parent is gone or is no directory now: nothing below it is cached anymore.
            Err(_) => return,
        }
    };
    // EEXIST (the server confirmed it) and EROFS (it is gone, and nothing is made) are the
    // expected answers; either way the dentry now matches the host.
    let _ = rustix::fs::mkdirat(dir, name, Mode::empty());
}

/// Every path the processes `pids` pin: open descriptors, working and root directories,
/// executables and mapped files. The second value says a limit cut the list short.
fn pinned_paths(pids: &[u32], started: Instant) -> (BTreeSet<PathBuf>, bool) {
    let mut out = BTreeSet::new();
    for pid in pids {
        if out.len() >= MAX_PINNED || started.elapsed() > DEADLINE {
            return (out, true);
        }
        let dir = PathBuf::from(format!("/proc/{pid}"));
        for link in ["cwd", "root", "exe"] {
            add_link(&mut out, &dir.join(link));
        }
        if let Ok(fds) = fs::read_dir(dir.join("fd")) {
            for fd in fds.flatten().take(MAX_FDS_PER_PROC) {
                add_link(&mut out, &fd.path());
            }
        }
        if let Ok(maps) = read_capped(&dir.join("maps")) {
            for p in mapped_paths(&maps) {
                add_path(&mut out, p);
            }
        }
    }
    (out, false)
}

fn add_link(out: &mut BTreeSet<PathBuf>, link: &Path) {
    if let Ok(target) = fs::read_link(link) {
        add_path(out, target);
    }
}

/// Adds an absolute path; for a name the kernel marked ` (deleted)` the name without that
/// suffix too (a file may really be called that way: both are harmless to look up).
fn add_path(out: &mut BTreeSet<PathBuf>, p: PathBuf) {
    if !p.is_absolute() {
        return;
    }
    if let Some(stripped) = p.as_os_str().as_bytes().strip_suffix(b" (deleted)") {
        out.insert(PathBuf::from(OsStr::from_bytes(stripped)));
    }
    out.insert(p);
}

/// The file paths of a `/proc/PID/maps` text (the sixth column, which may hold spaces).
pub fn mapped_paths(maps: &[u8]) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for line in maps.split(|&b| b == b'\n') {
        let mut rest = line;
        let mut ok = true;
        for _ in 0..5 {
            rest = trim_start(rest);
            match rest.iter().position(|&b| b == b' ') {
                Some(i) => rest = &rest[i..],
                None => {
                    ok = false;
                    break;
                }
            }
        }
        let path = trim_start(rest);
        if ok && path.first() == Some(&b'/') {
            out.push(PathBuf::from(OsStr::from_bytes(path)));
        }
    }
    out
}

fn trim_start(b: &[u8]) -> &[u8] {
    let n = b.iter().take_while(|&&c| c == b' ').count();
    &b[n..]
}

/// Groups the pinned paths by the innermost share they lie in, as every prefix relative to
/// the mount point, parents before children.
pub fn plan(mounts: &[PathBuf], pinned: &BTreeSet<PathBuf>) -> BTreeMap<PathBuf, Vec<PathBuf>> {
    let mut by_mount: BTreeMap<PathBuf, BTreeSet<(usize, PathBuf)>> = BTreeMap::new();
    let mut total = 0;
    for p in pinned {
        let Some((mount, rel)) = mounts
            .iter()
            .find_map(|m| p.strip_prefix(m).ok().map(|r| (m, r)))
        else {
            continue;
        };
        let set = by_mount.entry(mount.clone()).or_default();
        let mut prefix = PathBuf::new();
        for (depth, c) in rel.components().enumerate() {
            let Component::Normal(name) = c else {
                break;
            };
            prefix.push(name);
            if total < MAX_PINNED && set.insert((depth, prefix.clone())) {
                total += 1;
            }
        }
    }
    by_mount
        .into_iter()
        .map(|(m, set)| (m, set.into_iter().map(|(_, p)| p).collect()))
        .filter(|(_, v): &(PathBuf, Vec<PathBuf>)| !v.is_empty())
        .collect()
}

fn read_capped(path: &Path) -> io::Result<Vec<u8>> {
    let mut buf = Vec::new();
    fs::File::open(path)?
        .take(MAX_TABLE_BYTES)
        .read_to_end(&mut buf)?;
    Ok(buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_cgroup_pids_walks_the_tree() {
        let root = tempfile::tempdir().expect("tempdir");
        std::fs::write(root.path().join("cgroup.procs"), "").expect("write");
        std::fs::create_dir_all(root.path().join("7/inner")).expect("mkdir");
        std::fs::write(root.path().join("7/cgroup.procs"), "12\n13\n").expect("write");
        std::fs::write(root.path().join("7/inner/cgroup.procs"), "14\nnot-a-pid\n").expect("write");
        let (mut pids, truncated) = cgroup_pids(root.path());
        pids.sort_unstable();
        assert_eq!(pids, vec![12, 13, 14]);
        assert!(!truncated);
        assert_eq!(
            cgroup_pids(&root.path().join("missing")),
            (Vec::new(), false)
        );
    }

    #[test]
    fn test_mapped_paths_keep_spaces_and_skip_anonymous_maps() {
        let maps = b"55d0-55d1 r--p 00000000 00:28 12  /workspace/my lib.so\n\
            7ff0-7ff1 rw-p 00000000 00:00 0 \n\
            7ff2-7ff3 rw-p 00000000 00:00 0  [heap]\n\
            7ff4-7ff5 r-xp 00000000 fe:00 99 /usr/lib/libc.so.6 (deleted)\n";
        assert_eq!(
            mapped_paths(maps),
            vec![
                PathBuf::from("/workspace/my lib.so"),
                PathBuf::from("/usr/lib/libc.so.6 (deleted)")
            ]
        );
    }

    #[test]
    fn test_plan_lists_every_prefix_parents_first_in_the_innermost_share() {
        let mounts = vec![PathBuf::from("/workspace/sub"), PathBuf::from("/workspace")];
        let mut pinned = BTreeSet::new();
        add_path(&mut pinned, PathBuf::from("/workspace/a/b/c.txt (deleted)"));
        add_path(&mut pinned, PathBuf::from("/workspace/sub/x"));
        add_path(&mut pinned, PathBuf::from("/etc/passwd"));
        add_path(&mut pinned, PathBuf::from("/workspace"));
        let p = plan(&mounts, &pinned);
        assert_eq!(
            p[&PathBuf::from("/workspace")],
            vec![
                PathBuf::from("a"),
                PathBuf::from("a/b"),
                PathBuf::from("a/b/c.txt"),
                PathBuf::from("a/b/c.txt (deleted)"),
            ]
        );
        assert_eq!(
            p[&PathBuf::from("/workspace/sub")],
            vec![PathBuf::from("x")]
        );
        assert_eq!(p.len(), 2);
    }
}
