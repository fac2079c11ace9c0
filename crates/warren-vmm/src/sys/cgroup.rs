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

/// Per-VM limits on its host processes (the VMM, its virtiofsd daemons and its supervisor).
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
    /// plus 1 GiB (the RAM, again as much for the page cache that a RAM file and a
    /// checkpoint's save or restore go through, 512 MiB for QEMU's own use, its translation
    /// cache and virtiofsd, and 512 MiB for the supervisor, whose egress alone may hold that
    /// much in socket buffers (`warren-egress` `conns`); tighter, a restore stalls on writing
    /// back the RAM file); one CPU per vCPU plus one for QEMU's main loop and I/O and the
    /// supervisor; 512 tasks (QEMU, virtiofsd and the supervisor need a few dozen).
    pub fn for_vm(memory_mib: u64, vcpus: u32) -> Self {
        Limits {
            memory_bytes: (2 * memory_mib + 1024) << 20,
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

/// The child cgroup, of a VM's cgroup and of each v1 peer, that holds the VM's supervisor.
/// The VM's limits then count what the supervisor does for the guest (the channel, streams,
/// copies, the egress proxy and its TLS) with what its VMM does: before, a guest could make
/// its supervisor spend host CPU and memory outside every limit of its VM. A child, not the
/// VM's cgroup itself, so the VM's members (`cgroup.procs`, [`pids`]) stay its VMM and
/// helpers, and the VM's processes can be killed while its supervisor lives on
/// ([`leave_supervisor`]).
pub const SUPERVISOR_CHILD: &str = "supervisor";

/// Distinct directories of `dirs`, in order (two controllers may share a v1 hierarchy).
fn distinct(dirs: Vec<PathBuf>) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = Vec::new();
    for d in dirs {
        if !out.contains(&d) {
            out.push(d);
        }
    }
    out
}

/// Where the calling process was before [`enter_supervisor`]: for each directory it joined,
/// the cgroup of the same hierarchy it came from (read from `/proc/self/cgroup`), or `None`
/// when that could not be told.
#[derive(Debug, Default)]
pub struct Origin(Vec<(PathBuf, Option<PathBuf>)>);

/// Moves the calling process (every thread) into the supervisor child ([`SUPERVISOR_CHILD`])
/// of the VM cgroup `v2` and of each of its v1 peers, made here; call after
/// [`apply_limits`]. The processes it starts from then on start there too (the VMM and its
/// helpers then join the VM's cgroup itself, [`member_dirs`]). Returns where it came from,
/// for [`leave_supervisor`].
pub fn enter_supervisor(v2: &Path) -> Result<Origin, VmmError> {
    let own = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    let mut origin = Vec::new();
    for dir in distinct(member_dirs(v2)) {
        let from = hierarchy_root(&dir).and_then(|root| own_cgroup(&own, root, dir == v2));
        let child = dir.join(SUPERVISOR_CHILD);
        create(&child)?;
        std::fs::write(child.join("cgroup.procs"), "0").map_err(|source| VmmError::Cgroup {
            op: "move the supervisor into",
            path: child.clone(),
            source,
        })?;
        origin.push((dir, from));
    }
    Ok(Origin(origin))
}

/// The root of the hierarchy holding the VM cgroup (or v1 peer) `dir`, `<root>/warren/<vm>`.
fn hierarchy_root(dir: &Path) -> Option<&Path> {
    dir.parent().and_then(Path::parent)
}

/// This process's cgroup below `root`, from `/proc/self/cgroup` (`own`): the v2 line
/// (`0::/path`) when `v2`, else the v1 line naming `root`'s controller.
fn own_cgroup(own: &str, root: &Path, v2: bool) -> Option<PathBuf> {
    let controller = root.file_name()?.to_str()?;
    own.lines().find_map(|line| {
        let mut parts = line.splitn(3, ':');
        let (id, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        let ours = if v2 {
            id == "0" && controllers.is_empty()
        } else {
            controllers.split(',').any(|c| c == controller)
        };
        // A path outside this namespace's view (`/..`) is no place to go back to.
        (ours && path.starts_with('/') && !path.split('/').any(|c| c == ".."))
            .then(|| root.join(path.trim_start_matches('/')))
    })
}

/// Moves the calling process out of the VM cgroup `v2` and its v1 peers, back to the cgroups
/// it came from (`origin`), or to the root of a hierarchy where that is gone or refuses, so
/// that [`kill_and_remove`] of the VM's cgroup does not kill the caller. A supervisor calls
/// it last, before that.
pub fn leave_supervisor(v2: &Path, origin: &Origin) -> Result<(), VmmError> {
    let dirs: Vec<(PathBuf, Option<PathBuf>)> = if origin.0.is_empty() {
        distinct(member_dirs(v2))
            .into_iter()
            .map(|d| (d, None))
            .collect()
    } else {
        origin.0.clone()
    };
    for (dir, from) in dirs {
        if from.as_deref().is_some_and(|f| {
            !f.starts_with(&dir) && std::fs::write(f.join("cgroup.procs"), "0").is_ok()
        }) {
            continue;
        }
        let Some(root) = hierarchy_root(&dir) else {
            continue;
        };
        std::fs::write(root.join("cgroup.procs"), "0").map_err(|source| VmmError::Cgroup {
            op: "move the supervisor out to",
            path: root.to_path_buf(),
            source,
        })?;
    }
    Ok(())
}

/// Kills every process of the VM cgroup `v2` and of its v1 peers but the caller (in their
/// supervisor children too: the programs a supervisor runs): a supervisor's clean-up when
/// it could not leave ([`leave_supervisor`]); the cgroups stay for the engine to remove.
pub fn kill_members(v2: &Path) {
    let me = std::process::id();
    for dir in distinct(member_dirs(v2)) {
        let helpers = pids(&dir.join(SUPERVISOR_CHILD));
        for pid in pids(&dir).into_iter().chain(helpers).filter(|&p| p != me) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid as i32),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
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
    // The supervisor's child cgroup ([`SUPERVISOR_CHILD`]) goes with it: `cgroup.kill`
    // reaches it, signals must be sent to its members too.
    let child = path.join(SUPERVISOR_CHILD);
    let by_file = kill
        && match std::fs::write(path.join("cgroup.kill"), "1") {
            Ok(()) => true,
            // Kernels before 5.14 lack cgroup.kill: signal each member instead.
            Err(source) if source.kind() == std::io::ErrorKind::NotFound => false,
            Err(source) => {
                return Err(VmmError::Cgroup {
                    op: "kill",
                    path: path.to_path_buf(),
                    source,
                })
            }
        };
    if !by_file {
        for pid in pids(path).into_iter().chain(pids(&child)) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid as i32),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
    let mut last = None;
    for _ in 0..200 {
        match std::fs::remove_dir(&child) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                last = Some((child.clone(), e));
                std::thread::sleep(std::time::Duration::from_millis(10));
                continue;
            }
        }
        match std::fs::remove_dir(path) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => last = Some((path.to_path_buf(), e)),
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let (path, source) =
        last.unwrap_or_else(|| (path.to_path_buf(), std::io::Error::other("still populated")));
    Err(VmmError::Cgroup {
        op: "remove",
        path,
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A supervisor goes back to the cgroup of each hierarchy it came from: the v2 line for
    /// the v2 hierarchy, the line naming the controller for a v1 peer; never a path that
    /// climbs out of the namespace's view.
    #[test]
    fn test_own_cgroup_reads_each_hierarchy_s_line() {
        let own = "12:pids:/system.slice/warren.service\n\
                   4:cpu,cpuacct:/system.slice/warren.service\n\
                   7:memory:/../outside\n\
                   0::/system.slice/warren-vm-x.service\n";
        assert_eq!(
            own_cgroup(own, Path::new("/sys/fs/cgroup/unified"), true),
            Some(PathBuf::from(
                "/sys/fs/cgroup/unified/system.slice/warren-vm-x.service"
            ))
        );
        assert_eq!(
            own_cgroup(own, Path::new("/sys/fs/cgroup/cpu"), false),
            Some(PathBuf::from(
                "/sys/fs/cgroup/cpu/system.slice/warren.service"
            ))
        );
        assert_eq!(
            own_cgroup(own, Path::new("/sys/fs/cgroup/pids"), false),
            Some(PathBuf::from(
                "/sys/fs/cgroup/pids/system.slice/warren.service"
            ))
        );
        assert_eq!(
            own_cgroup(own, Path::new("/sys/fs/cgroup/memory"), false),
            None
        );
        assert_eq!(own_cgroup("", Path::new("/sys/fs/cgroup"), true), None);
        assert_eq!(
            hierarchy_root(Path::new("/sys/fs/cgroup/warren/vm-1")),
            Some(Path::new("/sys/fs/cgroup"))
        );
    }
}
