//! Host cgroup v2 tracking of a VM's processes.
//!
//! Pure cgroup v2 hosts mount it at /sys/fs/cgroup; hybrid hosts (our build machines) at
//! /sys/fs/cgroup/unified with no controllers. Either way a child cgroup gives membership and
//! `cgroup.kill`, which is all we need to reap every process of a VM. Resource limits need
//! controllers, which [`Hierarchy::limits_supported`] reports for preflight.

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

/// Moves `pid` into the cgroup.
pub fn add_pid(path: &Path, pid: u32) -> Result<(), VmmError> {
    std::fs::write(path.join("cgroup.procs"), pid.to_string()).map_err(|source| VmmError::Cgroup {
        op: "add process to",
        path: path.to_path_buf(),
        source,
    })
}

/// Pids currently in the cgroup.
pub fn pids(path: &Path) -> Vec<u32> {
    std::fs::read_to_string(path.join("cgroup.procs"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect()
}

/// Kills every process in the cgroup and removes it, waiting briefly until it is empty.
/// A missing cgroup is fine.
pub fn kill_and_remove(path: &Path) -> Result<(), VmmError> {
    if !path.exists() {
        return Ok(());
    }
    if let Err(source) = std::fs::write(path.join("cgroup.kill"), "1") {
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
