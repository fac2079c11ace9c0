//! What a VMM sees of the host's file system: a mount namespace of its own whose root is a
//! small read-only tmpfs holding only what QEMU needs, each at its host path.
//!
//! - read-only: `/usr` (QEMU, its modules, firmware and libraries), the merged-`/usr` links
//!   (`/bin`, `/lib`, ...) as links or read-only directories, `/etc/ld.so.cache`, `/sys`,
//!   and the directories the launch names ([`VmmView::for_launch`]: the image's, the VM's
//!   own template's, the fork state it restores from; their own modes still apply);
//! - read-only too: the QEMU program file itself when it lies outside `/usr` (a
//!   `$WARREN_QEMU` elsewhere; its directory stays out of the view, so an escape cannot
//!   plant programs next to it);
//! - read-write: the VM's `run/` directory (no devices, set-uid or executables there), and
//!   for the test suite's QEMU stand-ins only, the directory `$WARREN_TEST_VMM_DIR` names
//!   (its own modes apply; the variable is the environment's, like `$WARREN_QEMU`);
//! - `/proc` (QEMU maps RAM through `/proc/self/fd`): for a root Warren a procfs of its own
//!   that lists only the processes of the VMM's uid (`hidepid=invisible`), its host-wide
//!   files that name other processes or uids (`locks`, `key-users`, ...) covered by
//!   `/dev/null`, for a non-root Warren the host's; and the device nodes `null`, `zero`, `full`, `random`, `urandom`
//!   (and `kvm` under KVM). `/sys/fs/cgroup` is an empty directory in the view (its files
//!   list every host process and every VM's cgroup).
//!
//! Everything else (home directories, `/etc`, `/tmp`, `/run` and the sockets in it, other
//! VMs' state, the service's database) is not in the namespace at all: a VMM escape can
//! neither read it, nor write into a world-writable directory, nor connect to a socket
//! there. The namespace is built in the spawned child between `unshare` and the uid drop
//! ([`crate::sys::process::confine`]): a tmpfs on a staging directory that holds none of the
//! sources, mount points made in it, bind mounts, the tmpfs made read-only, then
//! `pivot_root` into it and the old root detached. Written by hand: the steps run in the
//! forked child, where nothing may allocate, so every path is prepared here first.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use nix::mount::MsFlags;

/// Directories on the host that are tried, in order, as the place the new root is built on
/// (in the child's namespace only): the first one that exists and holds no source is used.
const STAGING: &[&str] = &[
    "/mnt",
    "/media",
    "/srv",
    "/boot",
    "/opt",
    "/var/empty",
    "/tmp",
];

/// Device nodes every VMM gets.
const DEVICES: &[&str] = &["null", "zero", "full", "random", "urandom"];

/// Host-wide files of a procfs that a fresh, `hidepid` instance still shows every uid and
/// that QEMU never reads: who holds file locks (pids), which uids hold kernel keys, the
/// scheduler's and timers' per-task dumps, kernel symbols and modules, kernel memory
/// layouts. Each is covered by `/dev/null` in a root Warren's view (the set container
/// runtimes mask, and `locks`/`key-users`, which list other users' processes and uids).
const MASKED_PROC: &[&str] = &[
    "locks",
    "key-users",
    "keys",
    "sched_debug",
    "timer_list",
    "timer_stats",
    "latency_stats",
    "kcore",
    "kallsyms",
    "modules",
    "sysrq-trigger",
    "vmallocinfo",
    "slabinfo",
    "pagetypeinfo",
    "kpagecount",
    "kpageflags",
    "kpagecgroup",
    // Host-wide activity another tenant's work shows in (side channels across VMs): every
    // disk's and partition's I/O, load, interrupt and soft-interrupt counts, memory-zone and
    // paging counters, scheduler statistics, swap and RAID devices.
    "diskstats",
    "partitions",
    "loadavg",
    "interrupts",
    "softirqs",
    "vmstat",
    "zoneinfo",
    "buddyinfo",
    "schedstat",
    "swaps",
    "mdstat",
];

/// The top-level links of a merged-`/usr` system (or directories on an older one).
const USR_LINKS: &[&str] = &["bin", "sbin", "lib", "lib64", "lib32", "libx32"];

#[derive(Debug, Clone)]
enum Kind {
    /// A directory bind-mounted read-only (or read-write) with its source's mount flags.
    Dir { writable: bool, noexec: bool },
    /// A file (a cache) bind-mounted read-only onto an empty file.
    File,
    /// A device node bind-mounted onto an empty file, as it is (a read-only mount would
    /// not stop writes to a device anyway).
    Device,
    /// A symbolic link made in the new root, with this target.
    Link(CString),
    /// `/proc`: for a root Warren a fresh instance with `hidepid=invisible` (the VMM, once
    /// it drops to its VM's uid, sees only its own processes); for a non-root Warren, whose
    /// VMM's user namespace owns no pid namespace and so may mount no procfs, a recursive
    /// bind of the host's, flags as they are.
    Proc { fresh: bool },
    /// An empty read-only tmpfs over a directory of a bound tree (`/sys/fs/cgroup`, whose
    /// files list every host process and every VM's cgroup).
    Empty,
    /// A file of the fresh `/proc` covered by a bind of `/dev/null` ([`MASKED_PROC`]).
    Mask,
}

#[derive(Debug, Clone)]
struct Entry {
    /// Path in the view (as the launch names it).
    path: PathBuf,
    /// What is mounted there: the host path with every link resolved (a directory's), so
    /// that neither the choice of staging directory nor a bind is fooled by a link.
    source: PathBuf,
    kind: Kind,
    /// The source's mount flags that a bind must keep (`statvfs`).
    keep: MsFlags,
}

/// A VMM's file system view, built in a spawned child by
/// [`crate::sys::process::confine_viewed`].
#[derive(Debug, Clone, Default)]
pub struct VmmView {
    entries: Vec<Entry>,
}

/// Every buffer the child needs, made before the fork.
pub(crate) struct Prepared {
    staging: CString,
    /// Directories to create under the staging root, parents first.
    dirs: Vec<CString>,
    mounts: Vec<PreparedMount>,
}

struct PreparedMount {
    source: CString,
    /// The mount point under the staging root.
    target: CString,
    kind: Kind,
    keep: MsFlags,
}

impl VmmView {
    /// The view of a VMM that runs the program `qemu` (an absolute path) for a VM whose own
    /// directory is `run_dir`, that reads `readable` (the image's directory, template or
    /// fork files) and writes `writable` besides its run directory (test stand-ins only).
    /// Missing optional entries (a link this system lacks) are left out; a missing required
    /// one (the run directory, a readable directory) is an error.
    pub fn for_launch(
        qemu: &Path,
        run_dir: &Path,
        readable: &[PathBuf],
        writable: &[PathBuf],
        kvm: bool,
    ) -> std::io::Result<VmmView> {
        let mut v = VmmView::default();
        v.dir(Path::new("/usr"), false, false)?;
        for l in USR_LINKS {
            let p = Path::new("/").join(l);
            match std::fs::symlink_metadata(&p) {
                Ok(m) if m.file_type().is_symlink() => {
                    let target = std::fs::read_link(&p)?;
                    v.entries.push(Entry {
                        source: p.clone(),
                        path: p,
                        kind: Kind::Link(cstring(&target)?),
                        keep: MsFlags::empty(),
                    });
                }
                Ok(m) if m.is_dir() => v.dir(&p, false, false)?,
                _ => {}
            }
        }
        v.file_if_present(Path::new("/etc/ld.so.cache"))?;
        for d in DEVICES {
            v.device(&Path::new("/dev").join(d))?;
        }
        if kvm {
            v.device(Path::new("/dev/kvm"))?;
        }
        let fresh = nix::unistd::geteuid().is_root();
        v.entries.push(Entry {
            path: PathBuf::from("/proc"),
            source: PathBuf::from("/proc"),
            kind: Kind::Proc { fresh },
            keep: MsFlags::empty(),
        });
        // A non-root Warren's VMM runs as the user and sees the host's `/proc` anyway.
        if fresh {
            for f in MASKED_PROC {
                let path = Path::new("/proc").join(f);
                if std::fs::symlink_metadata(&path).is_ok_and(|m| m.is_file()) {
                    v.entries.push(Entry {
                        path,
                        source: PathBuf::from("/dev/null"),
                        kind: Kind::Mask,
                        keep: MsFlags::empty(),
                    });
                }
            }
        }
        v.dir(Path::new("/sys"), false, false)?;
        if Path::new("/sys/fs/cgroup").is_dir() {
            v.entries.push(Entry {
                path: PathBuf::from("/sys/fs/cgroup"),
                source: PathBuf::from("/sys/fs/cgroup"),
                kind: Kind::Empty,
                keep: MsFlags::empty(),
            });
        }
        if !qemu.starts_with("/usr") {
            v.file(qemu)?;
        }
        for w in writable {
            v.dir(w, true, false)?;
        }
        v.dir(run_dir, true, true)?;
        for r in readable {
            v.dir(r, false, false)?;
        }
        v.drop_nested();
        Ok(v)
    }

    fn dir(&mut self, path: &Path, writable: bool, noexec: bool) -> std::io::Result<()> {
        let path = absolute(path)?;
        let source = std::fs::canonicalize(&path)?;
        if !std::fs::metadata(&source)?.is_dir() {
            return Err(std::io::Error::other(format!(
                "{} is not a directory",
                path.display()
            )));
        }
        let keep = source_flags(&source)?;
        self.entries.push(Entry {
            path,
            source,
            kind: Kind::Dir { writable, noexec },
            keep,
        });
        Ok(())
    }

    fn device(&mut self, path: &Path) -> std::io::Result<()> {
        let keep = source_flags(path)?;
        self.entries.push(Entry {
            path: path.to_path_buf(),
            source: path.to_path_buf(),
            kind: Kind::Device,
            keep,
        });
        Ok(())
    }

    fn file(&mut self, path: &Path) -> std::io::Result<()> {
        let keep = source_flags(path)?;
        self.entries.push(Entry {
            path: path.to_path_buf(),
            source: path.to_path_buf(),
            kind: Kind::File,
            keep,
        });
        Ok(())
    }

    fn file_if_present(&mut self, path: &Path) -> std::io::Result<()> {
        match std::fs::metadata(path) {
            Ok(m) if m.is_file() => self.file(path),
            _ => Ok(()),
        }
    }

    /// Leaves out a directory inside another of the same access (its parent's bind shows
    /// it, at the same place: inside it on the host too); one of other access inside another
    /// stays, mounted after it, and a read-only parent's restrictions still cover it (they
    /// are set on the parent's whole tree), so nesting only ever makes the view stricter.
    fn drop_nested(&mut self) {
        let all = self.entries.clone();
        self.entries.retain(|e| {
            let shown_by = |o: &Entry| {
                o.path != e.path
                    && e.path.strip_prefix(&o.path).ok().is_some_and(|rel| {
                        e.source.strip_prefix(&o.source).ok() == Some(rel)
                    })
            };
            match e.kind {
                Kind::Dir { writable, noexec } => !all.iter().any(|o| {
                    matches!(o.kind, Kind::Dir { writable: w, noexec: x } if w == writable && x == noexec)
                        && shown_by(o)
                }),
                // A read-only file in a read-only directory of the view is there already
                // (and no mount point could be made for it there).
                Kind::File => !all.iter().any(|o| {
                    matches!(o.kind, Kind::Dir { writable: false, .. }) && shown_by(o)
                }),
                Kind::Device | Kind::Link(_) | Kind::Proc { .. } | Kind::Empty | Kind::Mask => {
                    true
                }
            }
        });
        // Parents before children: a bind inside another is mounted after it.
        self.entries.sort_by_key(|e| e.path.components().count());
    }

    /// The paths the view holds, for tests and logs.
    pub fn paths(&self) -> Vec<PathBuf> {
        self.entries.iter().map(|e| e.path.clone()).collect()
    }

    /// Makes every buffer the child needs.
    pub(crate) fn prepare(&self) -> std::io::Result<Prepared> {
        // Compared with links resolved, on both sides: a source reached through a link into
        // the staging directory would be looked up, in the child, inside the new root.
        let staging = STAGING
            .iter()
            .filter_map(|s| std::fs::canonicalize(s).ok())
            .find(|s| {
                s.is_dir()
                    && !self.entries.iter().any(|e| {
                        [&e.path, &e.source]
                            .iter()
                            .any(|p| p.starts_with(s) || s.starts_with(p))
                    })
            })
            .ok_or_else(|| {
                std::io::Error::other("no directory to build the VMM's root on (tried /mnt, /media, /srv, /boot, /opt, /var/empty, /tmp)")
            })?;
        let mut dirs: Vec<PathBuf> = Vec::new();
        let mut mounts = Vec::new();
        for e in &self.entries {
            let rel = e.path.strip_prefix("/").unwrap_or(&e.path);
            let target = staging.join(rel);
            let staging = staging.as_path();
            let parent_dirs = match &e.kind {
                Kind::Dir { .. } | Kind::Proc { .. } | Kind::Empty => {
                    target.ancestors().collect::<Vec<_>>()
                }
                Kind::File | Kind::Device | Kind::Link(_) | Kind::Mask => {
                    target.ancestors().skip(1).collect()
                }
            };
            for d in parent_dirs.into_iter().rev() {
                if d.starts_with(staging) && d != staging && !dirs.iter().any(|x| x == d) {
                    dirs.push(d.to_path_buf());
                }
            }
            mounts.push(PreparedMount {
                source: match &e.kind {
                    Kind::Link(t) => t.clone(),
                    _ => cstring(&e.source)?,
                },
                target: cstring(&target)?,
                kind: e.kind.clone(),
                keep: e.keep,
            });
        }
        Ok(Prepared {
            staging: cstring(&staging)?,
            dirs: dirs.iter().map(|d| cstring(d)).collect::<Result<_, _>>()?,
            mounts,
        })
    }
}

impl Prepared {
    /// Builds the view and enters it. Runs in the forked child, after `unshare` of a mount
    /// namespace (with the privileges over it) and before the uid drop: raw syscalls on
    /// buffers made before the fork, nothing allocated.
    pub(crate) fn enter(&self) -> std::io::Result<()> {
        use nix::mount::{mount, umount2, MntFlags};
        let none: Option<&str> = None;
        // Nothing done here reaches the host's namespace.
        mount(none, "/", none, MsFlags::MS_SLAVE | MsFlags::MS_REC, none)?;
        let root_flags = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
        mount(
            Some("tmpfs"),
            self.staging.as_c_str(),
            Some("tmpfs"),
            root_flags,
            Some("mode=0755,size=1m,nr_inodes=4096"),
        )?;
        for d in &self.dirs {
            match nix::unistd::mkdir(
                d.as_c_str(),
                nix::sys::stat::Mode::from_bits_truncate(0o755),
            ) {
                Ok(()) | Err(nix::errno::Errno::EEXIST) => {}
                Err(e) => return Err(e.into()),
            }
        }
        for m in &self.mounts {
            let target = m.target.as_c_str();
            match &m.kind {
                Kind::Link(_) => {
                    nix::unistd::symlinkat(m.source.as_c_str(), nix::fcntl::AT_FDCWD, target)?;
                    continue;
                }
                Kind::File | Kind::Device => {
                    // Read-only and not through a link: in a writable directory of the view
                    // the mount point is the host's file itself (a program another VMM may be
                    // running, which refuses writers), and a link planted there is not
                    // followed as root.
                    let fd = nix::fcntl::open(
                        target,
                        nix::fcntl::OFlag::O_CREAT
                            | nix::fcntl::OFlag::O_RDONLY
                            | nix::fcntl::OFlag::O_NOFOLLOW
                            | nix::fcntl::OFlag::O_CLOEXEC,
                        nix::sys::stat::Mode::from_bits_truncate(0o644),
                    )?;
                    drop(fd);
                }
                Kind::Proc { fresh: true } => {
                    // Other users' processes are not even listed; the VMM's own (same uid)
                    // and `/proc/self` are there as before.
                    mount(
                        Some(c"proc"),
                        target,
                        Some(c"proc"),
                        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
                        Some(c"hidepid=invisible"),
                    )?;
                    continue;
                }
                Kind::Empty => {
                    mount(
                        Some(c"tmpfs"),
                        target,
                        Some(c"tmpfs"),
                        MsFlags::MS_RDONLY
                            | MsFlags::MS_NOSUID
                            | MsFlags::MS_NODEV
                            | MsFlags::MS_NOEXEC,
                        Some(c"mode=0555,size=4k,nr_inodes=2"),
                    )?;
                    continue;
                }
                // The file is procfs's own (mounted just before): nothing to create.
                Kind::Dir { .. } | Kind::Proc { fresh: false } | Kind::Mask => {}
            }
            mount(
                Some(m.source.as_c_str()),
                target,
                none,
                MsFlags::MS_BIND | MsFlags::MS_REC,
                none,
            )?;
            let flags = match m.kind {
                Kind::Proc { .. } | Kind::Empty | Kind::Link(_) | Kind::Device | Kind::Mask => {
                    continue
                }
                Kind::File => MsFlags::MS_RDONLY | MsFlags::MS_NOSUID,
                Kind::Dir {
                    writable: false, ..
                } => MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
                Kind::Dir {
                    writable: true,
                    noexec,
                } => {
                    let mut f = MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
                    if noexec {
                        f |= MsFlags::MS_NOEXEC;
                    }
                    f
                }
            };
            mount(
                none,
                target,
                none,
                MsFlags::MS_BIND | MsFlags::MS_REMOUNT | flags | m.keep,
                none,
            )?;
        }
        // The view is complete: no mount the host makes from here on (under `/usr`, `/sys`,
        // a bound directory) propagates into it. Then each directory's restrictions apply to
        // everything mounted below it too (`/sys/fs/cgroup` below `/sys`, ...), not only to
        // its top: a remount changes one mount, `mount_setattr` the whole tree.
        mount(
            none,
            self.staging.as_c_str(),
            none,
            MsFlags::MS_REC | MsFlags::MS_PRIVATE,
            none,
        )?;
        for m in &self.mounts {
            let attr = match m.kind {
                Kind::Dir {
                    writable: false, ..
                } => libc::MOUNT_ATTR_RDONLY | libc::MOUNT_ATTR_NOSUID | libc::MOUNT_ATTR_NODEV,
                Kind::Dir {
                    writable: true,
                    noexec,
                } => {
                    let mut a = libc::MOUNT_ATTR_NOSUID | libc::MOUNT_ATTR_NODEV;
                    if noexec {
                        a |= libc::MOUNT_ATTR_NOEXEC;
                    }
                    a
                }
                Kind::File
                | Kind::Device
                | Kind::Link(_)
                | Kind::Proc { .. }
                | Kind::Empty
                | Kind::Mask => continue,
            };
            set_tree_attr(m.target.as_c_str(), attr)?;
        }
        mount(
            none,
            self.staging.as_c_str(),
            none,
            MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY | root_flags,
            none,
        )?;
        nix::unistd::chdir(self.staging.as_c_str())?;
        nix::unistd::pivot_root(c".", c".")?;
        umount2(c".", MntFlags::MNT_DETACH)?;
        nix::unistd::chdir(c"/")?;
        Ok(())
    }
}

/// Sets `attr` on the mount at `path` and every mount below it (`mount_setattr(2)`, Linux
/// 5.12). Async-signal-safe: one raw syscall on a buffer on the stack.
fn set_tree_attr(path: &std::ffi::CStr, attr: u64) -> std::io::Result<()> {
    let a = libc::mount_attr {
        attr_set: attr,
        attr_clr: 0,
        propagation: 0,
        userns_fd: 0,
    };
    // SAFETY: `path` is NUL-terminated and `a` a live `mount_attr` of the size passed.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            libc::AT_FDCWD,
            path.as_ptr(),
            libc::AT_RECURSIVE as libc::c_uint,
            &a as *const libc::mount_attr,
            std::mem::size_of::<libc::mount_attr>(),
        )
    };
    if rc < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

fn absolute(p: &Path) -> std::io::Result<PathBuf> {
    if p.is_absolute() {
        Ok(p.to_path_buf())
    } else {
        std::path::absolute(p)
    }
}

fn cstring(p: &Path) -> std::io::Result<CString> {
    CString::new(p.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::other(format!("NUL in path {}", p.display())))
}

/// The mount flags of `path`'s mount that a bind of it must keep (a user namespace may not
/// drop them, and nothing here should).
fn source_flags(path: &Path) -> std::io::Result<MsFlags> {
    use nix::sys::statvfs::FsFlags;
    let st = nix::sys::statvfs::statvfs(path)?;
    let f = st.flags();
    let mut out = MsFlags::empty();
    for (from, to) in [
        (FsFlags::ST_NOSUID, MsFlags::MS_NOSUID),
        (FsFlags::ST_NODEV, MsFlags::MS_NODEV),
        (FsFlags::ST_NOEXEC, MsFlags::MS_NOEXEC),
        (FsFlags::ST_RDONLY, MsFlags::MS_RDONLY),
        (FsFlags::ST_NOATIME, MsFlags::MS_NOATIME),
        (FsFlags::ST_NODIRATIME, MsFlags::MS_NODIRATIME),
        (FsFlags::ST_RELATIME, MsFlags::MS_RELATIME),
    ] {
        if f.contains(from) {
            out |= to;
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A program spawned with the view sees its run directory (writable), the readable
    /// directories (read-only), `/usr` (read-only) and `/proc`, and nothing else of the
    /// host: no `/home`, `/etc/passwd`, `/run`, nor a file the test left in `/tmp`. Control:
    /// the same script without the view sees the host.
    #[test]
    fn test_view_holds_only_what_the_vmm_needs() {
        let run = tempfile::tempdir().expect("run");
        let readable = tempfile::tempdir().expect("readable");
        std::fs::write(readable.path().join("r"), "image").expect("write");
        let marker =
            std::env::temp_dir().join(format!("warren-view-marker-{}", std::process::id()));
        std::fs::write(&marker, "host").expect("marker");
        let script = format!(
            "set -u\n\
             echo ok > {run}/w || echo FAIL write run\n\
             [ \"$(cat {read}/r)\" = image ] || echo FAIL read\n\
             touch {read}/y 2>/dev/null && echo FAIL write readable\n\
             touch /usr/warren-view-probe 2>/dev/null && echo FAIL write usr\n\
             [ -x /usr/bin/sh ] || echo FAIL usr\n\
             [ -e /proc/self/fd ] || echo FAIL proc\n\
             [ -c /dev/null ] && echo x > /dev/null || echo FAIL null\n\
             for p in /home /etc/passwd /run /root {marker}; do [ -e \"$p\" ] && echo \"SEEN $p\"; done\n\
             ls /\n",
            run = run.path().display(),
            read = readable.path().display(),
            marker = marker.display(),
        );
        let sh = std::fs::canonicalize("/bin/sh").expect("sh");
        let view = VmmView::for_launch(
            &sh,
            run.path(),
            &[readable.path().to_path_buf()],
            &[],
            false,
        )
        .expect("view");
        let run_it = |viewed: bool| {
            let mut cmd = std::process::Command::new(&sh);
            cmd.arg("-c").arg(&script);
            if viewed {
                crate::sys::process::confine_viewed(&mut cmd, None, &[], &view).expect("confine");
            }
            let out = cmd.output().expect("spawn");
            let text = String::from_utf8_lossy(&out.stdout).into_owned()
                + &String::from_utf8_lossy(&out.stderr);
            (out.status.success(), text)
        };
        let (ok, text) = run_it(true);
        let _ = std::fs::remove_file(&marker);
        assert!(ok, "{text}");
        assert!(!text.contains("FAIL") && !text.contains("SEEN"), "{text}");
        assert_eq!(
            std::fs::read_to_string(run.path().join("w")).expect("w"),
            "ok\n"
        );
        let top: Vec<&str> = text.lines().collect();
        for gone in ["home", "run", "root", "var", "mnt", "opt"] {
            assert!(!top.contains(&gone), "/{gone} in the view: {top:?}");
        }
        // Control: without the view the host is there.
        std::fs::write(&marker, "host").expect("marker");
        let (_, plain) = run_it(false);
        let _ = std::fs::remove_file(&marker);
        assert!(plain.contains("SEEN /etc/passwd"), "control: {plain}");
        assert!(
            plain.contains(&format!("SEEN {}", marker.display())),
            "control: {plain}"
        );
    }

    /// Runs `f` on a thread of its own in a mount namespace of its own (private, so nothing
    /// it mounts reaches the host), where a test may mount what a view's sources hold.
    fn in_own_mount_ns<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
        std::thread::spawn(move || {
            nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNS).expect("unshare");
            let none: Option<&str> = None;
            nix::mount::mount(none, "/", none, MsFlags::MS_REC | MsFlags::MS_PRIVATE, none)
                .expect("private");
            f()
        })
        .join()
        .expect("thread")
    }

    fn tmpfs(at: &Path) {
        nix::mount::mount(
            Some("tmpfs"),
            at,
            Some("tmpfs"),
            MsFlags::empty(),
            Some("mode=0777"),
        )
        .expect("tmpfs");
    }

    /// A read-only directory is read-only all the way down: a file system mounted below it
    /// on the host (as `/sys/fs/cgroup` is below `/sys`) is read-only in the view too, and
    /// one the host mounts there after the VMM started (a shared mount propagates) does not
    /// arrive writable. Every mount of the view but `/proc`, the devices and the run
    /// directory is read-only. Control: the host side of both mounts is writable.
    #[test]
    fn test_view_is_read_only_below_its_read_only_binds() {
        let (text, control) = in_own_mount_ns(|| {
            let run = tempfile::tempdir().expect("run");
            let readable = tempfile::tempdir().expect("readable");
            let r = readable.path().to_path_buf();
            // A shared mount, as `/` is on a systemd host.
            nix::mount::mount(Some(&r), &r, None::<&str>, MsFlags::MS_BIND, None::<&str>)
                .expect("bind");
            nix::mount::mount(
                None::<&str>,
                &r,
                None::<&str>,
                MsFlags::MS_SHARED,
                None::<&str>,
            )
            .expect("shared");
            std::fs::create_dir(r.join("sub")).expect("sub");
            std::fs::create_dir(r.join("later")).expect("later");
            tmpfs(&r.join("sub"));
            let script = format!(
                "touch {r}/sub/x 2>/dev/null && echo FAIL sub writable\n\
                 touch {run}/ready\n\
                 while [ ! -e {run}/go ]; do sleep 0.02; done\n\
                 touch {r}/later/x 2>/dev/null && echo FAIL later writable\n\
                 while read -r _ _ _ _ at opts _; do case $at in \
                 /proc|/proc/*|/dev/*|{run}) ;; *) case $opts in ro|ro,*) ;; \
                 *) echo \"FAIL $at $opts\";; esac;; esac; done < /proc/self/mountinfo\n\
                 echo done\n",
                r = r.display(),
                run = run.path().display(),
            );
            let sh = std::fs::canonicalize("/bin/sh").expect("sh");
            let view = VmmView::for_launch(&sh, run.path(), std::slice::from_ref(&r), &[], false)
                .expect("view");
            let mut cmd = std::process::Command::new(&sh);
            cmd.arg("-c")
                .arg(&script)
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped());
            crate::sys::process::confine_viewed(&mut cmd, None, &[], &view).expect("confine");
            let child = cmd.spawn().expect("spawn");
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
            while !run.path().join("ready").exists() && std::time::Instant::now() < deadline {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            tmpfs(&r.join("later"));
            std::fs::write(run.path().join("go"), "").expect("go");
            let out = child.wait_with_output().expect("wait");
            let text = String::from_utf8_lossy(&out.stdout).into_owned()
                + &String::from_utf8_lossy(&out.stderr);
            let control = std::fs::write(r.join("sub/y"), "").is_ok()
                && std::fs::write(r.join("later/y"), "").is_ok();
            for m in ["sub", "later", ""] {
                let _ = nix::mount::umount2(&r.join(m), nix::mount::MntFlags::MNT_DETACH);
            }
            (text, control)
        });
        assert!(control, "control: the host's mounts are writable");
        assert!(text.contains("done"), "{text}");
        assert!(!text.contains("FAIL"), "{text}");
    }

    /// A directory named through a link into the staging directory (a state directory
    /// under a link to `/mnt/...`) is the directory the link names in the view, not an empty
    /// one of the staging tmpfs.
    #[test]
    fn test_view_of_a_directory_behind_a_link_into_the_staging_directory() {
        let sh = std::fs::canonicalize("/bin/sh").expect("sh");
        let outer = tempfile::tempdir().expect("outer");
        let staging = {
            let v = VmmView::for_launch(&sh, outer.path(), &[], &[], false).expect("view");
            let p = v.prepare().expect("prepare");
            PathBuf::from(std::ffi::OsStr::from_bytes(p.staging.as_bytes()))
        };
        let real = tempfile::tempdir_in(&staging).expect("dir in the staging directory");
        let link = outer.path().join("state");
        std::os::unix::fs::symlink(real.path(), &link).expect("link");
        let view = VmmView::for_launch(&sh, &link, &[], &[], false).expect("view");
        let mut cmd = std::process::Command::new(&sh);
        cmd.arg("-c").arg(format!("echo ok > {}/w", link.display()));
        crate::sys::process::confine_viewed(&mut cmd, None, &[], &view).expect("confine");
        let out = cmd.output();
        let written = std::fs::read_to_string(real.path().join("w")).ok();
        assert_eq!(written.as_deref(), Some("ok\n"), "{out:?}");
    }
    /// For a root Warren the view's `/proc` lists only the VMM's own uid's processes: the
    /// program, dropped to an unprivileged uid, sees itself but neither init nor the test
    /// (root's); and `/sys/fs/cgroup` (every process's and VM's cgroup) is empty, the rest of
    /// `/sys` there. Control: the same program with the same uid but without the view sees
    /// all of it.
    #[test]
    fn test_view_proc_hides_other_users_processes() {
        assert!(
            nix::unistd::geteuid().is_root(),
            "the fresh /proc is a root Warren's (this suite runs as root)"
        );
        let sh = std::fs::canonicalize("/bin/sh").expect("sh");
        let run = tempfile::tempdir().expect("run");
        let view = VmmView::for_launch(&sh, run.path(), &[], &[], false).expect("view");
        let me = std::process::id();
        let script = format!(
            "cd /\n\
             [ -d /proc/$$ ] && echo SELF\n\
             [ -e /proc/self/fd/0 ] && echo FDS\n\
             [ -e /proc/1 ] && echo INIT\n\
             [ -e /proc/{me} ] && echo TEST\n\
             [ -n \"$(ls -A /sys/fs/cgroup)\" ] && echo CGROUPS\n\
             [ -n \"$(cat /proc/locks)\" ] && echo LOCKS\n\
             [ -n \"$(cat /proc/key-users)\" ] && echo KEYUSERS\n\
             [ -n \"$(cat /proc/diskstats)\" ] && echo DISKSTATS\n\
             [ -n \"$(cat /proc/interrupts)\" ] && echo INTERRUPTS\n\
             [ -n \"$(cat /proc/cpuinfo)\" ] && echo CPUINFO\n\
             [ -d /sys/devices/system/cpu ] && echo SYS\n"
        );
        // A lock the test holds: /proc/locks names its pid to anyone who may read it.
        let held = tempfile::tempfile().expect("lock file");
        held.lock().expect("flock");
        let run_it = |viewed: bool| {
            let mut cmd = std::process::Command::new(&sh);
            cmd.arg("-c").arg(&script);
            let uid = Some((2_999_999, 2_999_999));
            if viewed {
                crate::sys::process::confine_viewed(&mut cmd, uid, &[], &view).expect("confine");
            } else {
                crate::sys::process::confine(&mut cmd, uid, &[]);
            }
            let out = cmd.output().expect("spawn");
            String::from_utf8_lossy(&out.stdout).into_owned()
                + &String::from_utf8_lossy(&out.stderr)
        };
        let viewed = run_it(true);
        assert!(
            viewed.contains("SELF") && viewed.contains("FDS"),
            "{viewed}"
        );
        assert!(!viewed.contains("INIT"), "init listed: {viewed}");
        assert!(
            !viewed.contains("TEST"),
            "the test (root's) listed: {viewed}"
        );
        assert!(
            !viewed.contains("CGROUPS"),
            "the cgroup tree is there: {viewed}"
        );
        assert!(viewed.contains("SYS"), "the rest of /sys is: {viewed}");
        assert!(
            !viewed.contains("LOCKS")
                && !viewed.contains("KEYUSERS")
                && !viewed.contains("DISKSTATS")
                && !viewed.contains("INTERRUPTS"),
            "host-wide proc files are readable: {viewed}"
        );
        assert!(viewed.contains("CPUINFO"), "the rest of /proc is: {viewed}");
        let plain = run_it(false);
        assert!(
            plain.contains("INIT")
                && plain.contains("TEST")
                && plain.contains("CGROUPS")
                && plain.contains("LOCKS")
                && plain.contains("KEYUSERS")
                && plain.contains("DISKSTATS")
                && plain.contains("INTERRUPTS"),
            "control: {plain}"
        );
    }
}

#[cfg(test)]
mod program_tests {
    use super::*;

    /// A VMM program outside `/usr` is in the view as one read-only file: its directory's
    /// other files are not, and nothing can be planted next to it (found by a hostile
    /// review: with its directory bound read-write, an escape from a QEMU found in
    /// `~/.local/bin` could write programs the user later runs). Control: unconfined, the
    /// sibling is there.
    #[test]
    fn test_program_outside_usr_is_one_read_only_file() {
        let run = tempfile::tempdir().expect("run");
        let prog = tempfile::tempdir().expect("prog");
        let sh = prog.path().join("qemu");
        std::fs::copy(std::fs::canonicalize("/bin/sh").expect("sh"), &sh).expect("copy");
        std::fs::write(prog.path().join("sibling"), "x").expect("sibling");
        let script = format!(
            "[ -e {d}/sibling ] && echo SEEN; touch {d}/planted 2>/dev/null && echo PLANTED; \
             touch {p} 2>/dev/null && echo WROTE; echo done",
            d = prog.path().display(),
            p = sh.display()
        );
        let view = VmmView::for_launch(&sh, run.path(), &[], &[], false).expect("view");
        let run_it = |viewed: bool| {
            let mut cmd = std::process::Command::new(&sh);
            cmd.arg("-c").arg(&script);
            if viewed {
                crate::sys::process::confine_viewed(&mut cmd, None, &[], &view).expect("confine");
            }
            let out = cmd.output().expect("spawn");
            String::from_utf8_lossy(&out.stdout).into_owned()
                + &String::from_utf8_lossy(&out.stderr)
        };
        let text = run_it(true);
        assert!(text.contains("done"), "{text}");
        assert!(
            !text.contains("SEEN") && !text.contains("PLANTED") && !text.contains("WROTE"),
            "{text}"
        );
        assert!(!prog.path().join("planted").exists());
        assert!(run_it(false).contains("SEEN"), "control");
        let _ = std::fs::remove_file(prog.path().join("planted"));
    }
}

#[cfg(test)]
mod writable_program_tests {
    use super::*;

    /// A VMM program in a writable directory of the view (a test stand-in in
    /// `$WARREN_TEST_VMM_DIR`) is bound read-only while another VMM runs the same program:
    /// making its mount point never opens the program for writing (which a running program
    /// refuses, `ETXTBSY`), nor follows a link planted in its place. Control: the writable
    /// directory is writable.
    #[test]
    fn test_program_in_a_writable_dir_while_another_runs_it() {
        let run = tempfile::tempdir().expect("run");
        let w = tempfile::tempdir().expect("w");
        let w_path = std::fs::canonicalize(w.path()).expect("canonical");
        let prog = w_path.join("qemu");
        std::fs::copy(std::fs::canonicalize("/bin/sh").expect("sh"), &prog).expect("copy");
        let mut other = std::process::Command::new(&prog)
            .arg("-c")
            .arg("sleep 5")
            .spawn()
            .expect("other");
        let script = format!(
            "touch {w}/ok || echo FAIL writable; touch {p} 2>/dev/null && echo WROTE; echo done",
            w = w_path.display(),
            p = prog.display(),
        );
        let view =
            VmmView::for_launch(&prog, run.path(), &[], std::slice::from_ref(&w_path), false)
                .expect("view");
        let mut cmd = std::process::Command::new(&prog);
        cmd.arg("-c").arg(&script);
        crate::sys::process::confine_viewed(&mut cmd, None, &[], &view).expect("confine");
        let out = cmd.output();
        let _ = other.kill();
        let _ = other.wait();
        let out = out.expect("spawned while another runs the program");
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(text.contains("done") && !text.contains("FAIL"), "{text}");
        assert!(!text.contains("WROTE"), "{text}");
    }
}
