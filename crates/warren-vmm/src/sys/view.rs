//! What a VMM sees of the host's file system: a mount namespace of its own whose root is a
//! small read-only tmpfs holding only what QEMU needs, each at its host path.
//!
//! - read-only: `/usr` (QEMU, its modules, firmware and libraries), the merged-`/usr` links
//!   (`/bin`, `/lib`, ...) as links or read-only directories, `/etc/ld.so.cache`, `/sys`,
//!   and the directories the launch names ([`VmmView::for_launch`]: the image's, a
//!   template's, the state's `templates/` and `forks/`, whose own modes still apply);
//! - read-write: the VM's `run/` directory (no devices, set-uid or executables there), and
//!   the QEMU program's own directory when it lies outside `/usr` (a test's stand-in; its
//!   own modes apply);
//! - `/proc` (QEMU maps RAM through `/proc/self/fd`), and the device nodes `null`, `zero`,
//!   `full`, `random`, `urandom` (and `kvm` under KVM).
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
    /// A recursive bind of a pseudo file system (`/proc`), flags as they are.
    Tree,
}

#[derive(Debug, Clone)]
struct Entry {
    /// Path on the host and in the view.
    path: PathBuf,
    kind: Kind,
    /// The source's mount flags that a bind must keep (`statvfs`).
    keep: MsFlags,
}

/// A VMM's file system view, ready to be built in a spawned child ([`VmmView::prepare`]).
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
    /// The view of a VMM that runs the program `qemu` for a VM whose own directory is
    /// `run_dir` and that reads `readable` (the image's directory, template or fork files).
    /// Missing optional entries (a link this system lacks) are left out; a missing required
    /// one (the run directory, a readable directory) is an error.
    pub fn for_launch(
        qemu: &Path,
        run_dir: &Path,
        readable: &[PathBuf],
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
        v.entries.push(Entry {
            path: PathBuf::from("/proc"),
            kind: Kind::Tree,
            keep: MsFlags::empty(),
        });
        v.dir(Path::new("/sys"), false, false)?;
        let program_dir = qemu
            .parent()
            .ok_or_else(|| std::io::Error::other("the VMM program has no directory"))?;
        if !program_dir.starts_with("/usr") {
            v.dir(program_dir, true, false)?;
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
        if !std::fs::metadata(&path)?.is_dir() {
            return Err(std::io::Error::other(format!(
                "{} is not a directory",
                path.display()
            )));
        }
        let keep = source_flags(&path)?;
        self.entries.push(Entry {
            path,
            kind: Kind::Dir { writable, noexec },
            keep,
        });
        Ok(())
    }

    fn device(&mut self, path: &Path) -> std::io::Result<()> {
        let keep = source_flags(path)?;
        self.entries.push(Entry {
            path: path.to_path_buf(),
            kind: Kind::Device,
            keep,
        });
        Ok(())
    }

    fn file(&mut self, path: &Path) -> std::io::Result<()> {
        let keep = source_flags(path)?;
        self.entries.push(Entry {
            path: path.to_path_buf(),
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
    /// it); one of other access inside another stays, mounted after it.
    fn drop_nested(&mut self) {
        let all = self.entries.clone();
        self.entries.retain(|e| {
            let Kind::Dir { writable, noexec } = e.kind else {
                return true;
            };
            !all.iter().any(|o| {
                matches!(o.kind, Kind::Dir { writable: w, noexec: x } if w == writable && x == noexec)
                    && o.path != e.path
                    && e.path.starts_with(&o.path)
            })
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
        let staging = STAGING
            .iter()
            .map(Path::new)
            .find(|s| {
                s.is_dir()
                    && !self
                        .entries
                        .iter()
                        .any(|e| e.path.starts_with(s) || s.starts_with(&e.path))
            })
            .ok_or_else(|| {
                std::io::Error::other("no directory to build the VMM's root on (tried /mnt, /media, /srv, /boot, /opt, /var/empty, /tmp)")
            })?;
        let mut dirs: Vec<PathBuf> = Vec::new();
        let mut mounts = Vec::new();
        for e in &self.entries {
            let rel = e.path.strip_prefix("/").unwrap_or(&e.path);
            let target = staging.join(rel);
            let parent_dirs = match &e.kind {
                Kind::Dir { .. } | Kind::Tree => target.ancestors().collect::<Vec<_>>(),
                Kind::File | Kind::Device | Kind::Link(_) => target.ancestors().skip(1).collect(),
            };
            for d in parent_dirs.into_iter().rev() {
                if d.starts_with(staging) && d != staging && !dirs.iter().any(|x| x == d) {
                    dirs.push(d.to_path_buf());
                }
            }
            mounts.push(PreparedMount {
                source: match &e.kind {
                    Kind::Link(t) => t.clone(),
                    _ => cstring(&e.path)?,
                },
                target: cstring(&target)?,
                kind: e.kind.clone(),
                keep: e.keep,
            });
        }
        Ok(Prepared {
            staging: cstring(staging)?,
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
                    let fd = nix::fcntl::open(
                        target,
                        nix::fcntl::OFlag::O_CREAT
                            | nix::fcntl::OFlag::O_WRONLY
                            | nix::fcntl::OFlag::O_CLOEXEC,
                        nix::sys::stat::Mode::from_bits_truncate(0o644),
                    )?;
                    drop(fd);
                }
                Kind::Dir { .. } | Kind::Tree => {}
            }
            mount(
                Some(m.source.as_c_str()),
                target,
                none,
                MsFlags::MS_BIND | MsFlags::MS_REC,
                none,
            )?;
            let flags = match m.kind {
                Kind::Tree | Kind::Link(_) | Kind::Device => continue,
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
        let view = VmmView::for_launch(&sh, run.path(), &[readable.path().to_path_buf()], false)
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
}
