//! Host cgroups of a VM's processes: membership, reaping and limits.
//!
//! Pure cgroup v2 hosts mount it at /sys/fs/cgroup; hybrid hosts (our build machines) at
//! /sys/fs/cgroup/unified with no controllers. Either way a child cgroup gives membership and
//! `cgroup.kill`, which is all we need to reap every process of a VM.
//!
//! Limits ([`Limits`]: memory, CPU, pids) are written per controller where it lives: in the
//! VM's v2 cgroup when the v2 hierarchy has that controller, else in a v1 peer cgroup
//! `/sys/fs/cgroup/<controller>/warren/<vm>` on a hybrid host. A controller found in neither
//! place is an error ([`apply_limits`]), never a silent skip; [`controller_homes`] says which
//! applies, for preflight.

use std::path::{Path, PathBuf};

use crate::error::VmmError;

/// The host's cgroup v2 hierarchy.
#[derive(Debug, Clone)]
pub struct Hierarchy {
    pub root: PathBuf,
}

impl Hierarchy {
    /// Finds a writable cgroup v2 mount, or `None`.
    pub fn detect() -> Option<Self> {
        ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"]
            .into_iter()
            .map(PathBuf::from)
            .find(|p| {
                p.join("cgroup.procs").exists() && p.join("cgroup.kill").exists() || {
                    p.join("cgroup.procs").exists() && is_cgroup2(p)
                }
            })
            .map(|root| Hierarchy { root })
    }

    /// Controllers available for limits (`cpu`, `memory`, `pids`).
    pub fn limits_supported(&self) -> Vec<String> {
        std::fs::read_to_string(self.root.join("cgroup.controllers"))
            .unwrap_or_default()
            .split_whitespace()
            .map(str::to_string)
            .collect()
    }

    /// Path of the cgroup for one VM: `<root>/warren/<name>`.
    pub fn vm_cgroup(&self, name: &str) -> PathBuf {
        self.root.join("warren").join(name)
    }
}

fn is_cgroup2(p: &Path) -> bool {
    nix::sys::statfs::statfs(p)
        .map(|s| s.filesystem_type() == nix::sys::statfs::CGROUP2_SUPER_MAGIC)
        .unwrap_or(false)
}

/// Creates a cgroup directory (and its parents).
pub fn create(path: &Path) -> Result<(), VmmError> {
    std::fs::create_dir_all(path).map_err(|source| VmmError::Cgroup {
        op: "create",
        path: path.to_path_buf(),
        source,
    })
}

/// The controllers a VM is limited by.
pub const LIMIT_CONTROLLERS: [&str; 3] = ["memory", "cpu", "pids"];

/// Per-VM limits on its host processes (the VMM and its virtiofsd daemons).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Resident memory, page cache included.
    pub memory_bytes: u64,
    /// CPU time per [`CPU_PERIOD_US`].
    pub cpu_quota_us: u64,
    /// Processes and threads.
    pub pids: u64,
}

/// The CPU accounting period.
pub const CPU_PERIOD_US: u64 = 100_000;

impl Limits {
    /// The limits of a VM with `memory_mib` of guest RAM and `vcpus`: twice the guest's RAM
    /// plus 512 MiB (the RAM, again as much for the page cache that a RAM file and a
    /// checkpoint's save or restore go through, and QEMU's own use, its translation cache
    /// and virtiofsd; tighter, a restore stalls on writing back the RAM file); one CPU per
    /// vCPU plus one for QEMU's main loop and I/O; 512 tasks (QEMU and virtiofsd need a few
    /// dozen).
    pub fn for_vm(memory_mib: u64, vcpus: u32) -> Self {
        Limits {
            memory_bytes: (2 * memory_mib + 512) << 20,
            cpu_quota_us: (u64::from(vcpus) + 1) * CPU_PERIOD_US,
            pids: 512,
        }
    }
}

/// Where a controller is enforced for the VM whose v2 cgroup is `v2`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Home {
    /// In the VM's v2 cgroup.
    V2(PathBuf),
    /// In a v1 hierarchy: the VM's peer cgroup there.
    V1(PathBuf),
}

impl Home {
    pub fn dir(&self) -> &Path {
        match self {
            Home::V2(p) | Home::V1(p) => p,
        }
    }
}

/// For each of [`LIMIT_CONTROLLERS`], where it is enforced for the cgroup `v2`
/// (`<root>/warren/<vm>`), or `None` when this host has it nowhere.
pub fn controller_homes(v2: &Path) -> Vec<(&'static str, Option<Home>)> {
    let root = v2.parent().and_then(Path::parent);
    let v2_has: Vec<String> = root
        .map(|r| {
            std::fs::read_to_string(r.join("cgroup.controllers"))
                .unwrap_or_default()
                .split_whitespace()
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default();
    let name = v2.file_name().map(PathBuf::from).unwrap_or_default();
    LIMIT_CONTROLLERS
        .into_iter()
        .map(|c| {
            let home = if v2_has.iter().any(|x| x == c) {
                Some(Home::V2(v2.to_path_buf()))
            } else {
                let v1 = Path::new("/sys/fs/cgroup").join(c);
                is_v1_controller(&v1, c).then(|| Home::V1(v1.join("warren").join(&name)))
            };
            (c, home)
        })
        .collect()
}

/// Whether `mount` is a cgroup v1 hierarchy with `controller` (from `/proc/self/mountinfo`:
/// mount point, fstype `cgroup`, the controller among its super options).
fn is_v1_controller(mount: &Path, controller: &str) -> bool {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return false;
    };
    let want = mount.to_string_lossy();
    info.lines().any(|l| {
        let fields: Vec<&str> = l.split(' ').collect();
        let Some(sep) = fields.iter().position(|f| *f == "-") else {
            return false;
        };
        fields.get(4) == Some(&want.as_ref())
            && fields.get(sep + 1) == Some(&"cgroup")
            && fields
                .get(sep + 3)
                .is_some_and(|o| o.split(',').any(|x| x == controller))
    })
}

fn write_cg(dir: &Path, file: &str, value: &str) -> Result<(), VmmError> {
    std::fs::write(dir.join(file), value).map_err(|source| VmmError::Cgroup {
        op: "write a limit of",
        path: dir.join(file),
        source,
    })
}

/// Creates the cgroups that enforce `limits` for the VM cgroup `v2` (already created) and
/// writes them. Fails, creating nothing more, when a controller is available nowhere.
pub fn apply_limits(v2: &Path, limits: &Limits) -> Result<Vec<(&'static str, Home)>, VmmError> {
    let mut homes = Vec::new();
    for (c, home) in controller_homes(v2) {
        let home = home.ok_or_else(|| VmmError::Cgroup {
            op: "limit the VM: no host cgroup controller",
            path: PathBuf::from(c),
            source: std::io::Error::from(std::io::ErrorKind::Unsupported),
        })?;
        homes.push((c, home));
    }
    for (c, home) in &homes {
        if let Home::V2(_) = home {
            // Controllers reach a cgroup only through its parents' subtree_control.
            let warren = v2.parent().unwrap_or(v2);
            for dir in [warren.parent().unwrap_or(warren), warren] {
                write_cg(dir, "cgroup.subtree_control", &format!("+{c}"))?;
            }
        }
        let dir = home.dir();
        create(dir)?;
        match (c, home) {
            (&"memory", Home::V2(_)) => {
                write_cg(dir, "memory.max", &limits.memory_bytes.to_string())?;
                write_cg(dir, "memory.swap.max", "0").or_else(ignore_missing)?;
            }
            (&"memory", Home::V1(_)) => {
                write_cg(
                    dir,
                    "memory.limit_in_bytes",
                    &limits.memory_bytes.to_string(),
                )?;
            }
            (&"cpu", Home::V2(_)) => {
                write_cg(
                    dir,
                    "cpu.max",
                    &format!("{} {CPU_PERIOD_US}", limits.cpu_quota_us),
                )?;
            }
            (&"cpu", Home::V1(_)) => {
                write_cg(dir, "cpu.cfs_period_us", &CPU_PERIOD_US.to_string())?;
                write_cg(dir, "cpu.cfs_quota_us", &limits.cpu_quota_us.to_string())?;
            }
            _ => write_cg(dir, "pids.max", &limits.pids.to_string())?,
        }
    }
    Ok(homes)
}

fn ignore_missing(e: VmmError) -> Result<(), VmmError> {
    match &e {
        VmmError::Cgroup { source, .. } if source.kind() == std::io::ErrorKind::NotFound => Ok(()),
        _ => Err(e),
    }
}

/// The v1 peer cgroups of the VM cgroup `v2` that exist.
fn v1_peers(v2: &Path) -> Vec<PathBuf> {
    controller_homes(v2)
        .into_iter()
        .filter_map(|(_, h)| match h {
            Some(Home::V1(p)) if p.exists() => Some(p),
            _ => None,
        })
        .collect()
}

/// The cgroup `path` and its v1 peers: every directory a VM process joins.
pub fn member_dirs(path: &Path) -> Vec<PathBuf> {
    std::iter::once(path.to_path_buf())
        .chain(v1_peers(path))
        .collect()
}

/// Moves `pid` into the cgroup, and into its v1 peers where limits live there.
pub fn add_pid(path: &Path, pid: u32) -> Result<(), VmmError> {
    for dir in std::iter::once(path.to_path_buf()).chain(v1_peers(path)) {
        std::fs::write(dir.join("cgroup.procs"), pid.to_string()).map_err(|source| {
            VmmError::Cgroup {
                op: "add process to",
                path: dir.clone(),
                source,
            }
        })?;
    }
    Ok(())
}

/// Pids currently in the cgroup.
pub fn pids(path: &Path) -> Vec<u32> {
    std::fs::read_to_string(path.join("cgroup.procs"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect()
}

/// Kills every process in the cgroup and removes it and its v1 peers, waiting briefly until
/// each is empty. A missing cgroup is fine.
pub fn kill_and_remove(path: &Path) -> Result<(), VmmError> {
    let peers = v1_peers(path);
    kill_and_remove_one(path, true)?;
    // The same processes: once the v2 cgroup is empty, so are its v1 peers.
    for peer in peers {
        kill_and_remove_one(&peer, false)?;
    }
    Ok(())
}

fn kill_and_remove_one(path: &Path, kill: bool) -> Result<(), VmmError> {
    if !path.exists() {
        return Ok(());
    }
    if !kill {
        for pid in pids(path) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid as i32),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    } else if let Err(source) = std::fs::write(path.join("cgroup.kill"), "1") {
        // Kernels before 5.14 lack cgroup.kill: signal each member instead.
        if source.kind() != std::io::ErrorKind::NotFound {
            return Err(VmmError::Cgroup {
                op: "kill",
                path: path.to_path_buf(),
                source,
            });
        }
        for pid in pids(path) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid as i32),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
    let mut last = None;
    for _ in 0..200 {
        match std::fs::remove_dir(path) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => last = Some(e),
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    Err(VmmError::Cgroup {
        op: "remove",
        path: path.to_path_buf(),
        source: last.unwrap_or_else(|| std::io::Error::other("still populated")),
    })
}
