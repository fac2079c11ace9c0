//! Files of a VM directory and the records the supervisor leaves in it.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use warren_vmm::LaunchSpec;

/// Paths inside one VM's private directory.
#[derive(Debug, Clone)]
pub struct VmDir(pub PathBuf);

/// True while another open file description holds an exclusive `flock` on `path` (a
/// missing file is not held). Opened without following a link or blocking (a FIFO put
/// there would hang every listing); only a regular file can be held.
fn held(path: &Path) -> bool {
    use std::os::fd::AsFd;
    use std::os::unix::fs::OpenOptionsExt;
    let Ok(f) = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_NONBLOCK)
        .open(path)
    else {
        return false;
    };
    if !f.metadata().is_ok_and(|m| m.is_file()) {
        return false;
    }
    match nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockSharedNonblock) {
        Ok(l) => {
            let _ = l.as_fd();
            false
        }
        Err(_) => true,
    }
}

impl VmDir {
    pub fn path(&self) -> &Path {
        &self.0
    }
    /// The VMM's own directory (owned by the VM's uid): its disk, initramfs and sockets.
    /// Everything else in the VM directory is root's, so a compromised VMM cannot plant
    /// symlinks where the supervisor writes.
    pub fn run_dir(&self) -> PathBuf {
        self.0.join("run")
    }
    /// What the supervisor is to run (written by the creator before spawning it).
    pub fn config(&self) -> PathBuf {
        self.0.join("supervisor.json")
    }
    /// The per-VM channel secret (root-only; also inside the per-VM initramfs).
    pub fn secret(&self) -> PathBuf {
        self.0.join("secret")
    }
    /// A new secret being moved to by a rekey (`rekey.rs`): written before the guest is
    /// asked, renamed over [`VmDir::secret`] once the guest proved it holds it.
    pub fn secret_next(&self) -> PathBuf {
        self.0.join("secret.next")
    }
    /// Names the template directory (under `STATE/templates/`) the VM's disk chain backs
    /// onto, if any (written by the creator, root's).
    pub fn template_marker(&self) -> PathBuf {
        self.0.join("template")
    }
    /// The directories the VMM reads besides its image's and its run directory (its view,
    /// `warren_vmm::sys::view`): its template's (from [`VmDir::template_marker`], beside
    /// `vms/` in `STATE/templates/`), and the directory of the fork state it restores from.
    /// A marker that is not a plain name is an error.
    pub fn view_readable(&self, restore_from: Option<&Path>) -> std::io::Result<Vec<PathBuf>> {
        let mut out = Vec::new();
        match std::fs::read_to_string(self.template_marker()) {
            Ok(name) => {
                let name = name.trim();
                let plain = !name.is_empty()
                    && name
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
                if !plain {
                    return Err(std::io::Error::other(
                        "the VM's template marker is not a name",
                    ));
                }
                let state = self.0.parent().and_then(Path::parent).ok_or_else(|| {
                    std::io::Error::other("the VM directory has no state directory")
                })?;
                let dir = state.join("templates").join(name);
                if dir.is_dir() {
                    out.push(dir);
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        if let Some(dir) = restore_from.and_then(Path::parent) {
            out.push(dir.to_path_buf());
        }
        Ok(out)
    }
    /// Held locked by the live supervisor.
    pub fn lock(&self) -> PathBuf {
        self.0.join("supervisor.lock")
    }
    pub fn socket(&self) -> PathBuf {
        self.0.join("supervisor.sock")
    }
    /// The supervisor's own log (stderr).
    pub fn supervisor_log(&self) -> PathBuf {
        self.0.join("supervisor.log")
    }
    /// The previous half of the bounded supervisor log.
    pub fn supervisor_log_old(&self) -> PathBuf {
        self.0.join("supervisor.log.1")
    }
    /// Why the VM ended, written once by the supervisor.
    /// The VM's memory and device state while hibernated (written by the VMM, in `run/`).
    pub fn checkpoint_state(&self) -> PathBuf {
        self.run_dir().join("checkpoint.ram")
    }
    /// The record of a completed checkpoint, written (root's) only after the state was
    /// fsynced: without it a state file is never restored.
    pub fn checkpoint_record(&self) -> PathBuf {
        self.0.join("checkpoint.json")
    }
    pub fn read_checkpoint(&self) -> Option<crate::proto::CheckpointInfo> {
        let b = std::fs::read(self.checkpoint_record()).ok()?;
        serde_json::from_slice(&b).ok()
    }
    pub fn exit_record(&self) -> PathBuf {
        self.0.join("exit.json")
    }
    pub fn console_log(&self) -> PathBuf {
        self.0.join("console.log")
    }
    pub fn console_log_old(&self) -> PathBuf {
        self.0.join("console.log.1")
    }
    pub fn qemu_stderr(&self) -> PathBuf {
        self.0.join("qemu.stderr")
    }

    /// True while a supervisor holds the lock.
    pub fn supervisor_alive(&self) -> bool {
        held(&self.lock())
    }

    /// Held (an exclusive `flock`) by the engine while it resumes a hibernated VM, from
    /// before the record says `resuming` until it says `running` or `failed` (a fallback
    /// fresh boot and every boot again included), and while it destroys one: a listing in
    /// that window must not take the absent supervisor for a dead VM. The kernel drops the
    /// lock with its holder, so an engine that died mid-way leaves nothing held. A create
    /// (and a fork, each copy's) holds it too, from before its record's insert to its end.
    pub fn transition_lock(&self) -> PathBuf {
        self.0.join("transition.lock")
    }

    /// True while the engine holds [`VmDir::transition_lock`].
    pub fn in_transition(&self) -> bool {
        held(&self.transition_lock())
    }

    pub fn read_exit(&self) -> Option<ExitRecord> {
        let b = std::fs::read(self.exit_record()).ok()?;
        serde_json::from_slice(&b).ok()
    }

    /// The console log, older half first.
    pub fn console_text(&self) -> String {
        let mut s = std::fs::read(self.console_log_old()).unwrap_or_default();
        s.extend(std::fs::read(self.console_log()).unwrap_or_default());
        String::from_utf8_lossy(&s).into_owned()
    }
}

/// What the supervisor runs.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SupervisorConfig {
    pub vm_id: String,
    pub launch: LaunchSpec,
    /// How long the guest may take to answer on the channel after launch.
    pub boot_timeout_ms: u64,
    /// Restore from the checkpoint in `run/checkpoint.ram` instead of booting.
    #[serde(default)]
    pub restore: bool,
    /// The checkpoint is another VM's memory (a template's or a fork parent's): once the
    /// channel is up the guest takes this identity and moves to a secret of its own
    /// (`rekey.rs`) before anything else runs.
    #[serde(default)]
    pub clone: Option<CloneSpec>,
    /// The state to restore when it is not `run/checkpoint.ram` (a fork's, shared by all
    /// its copies).
    #[serde(default)]
    pub restore_from: Option<PathBuf>,
}

/// The identity a restored copy takes.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct CloneSpec {
    pub hostname: String,
    /// 32 lowercase hex digits.
    pub machine_id: String,
}

/// Why a VM ended.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ExitRecord {
    /// A client asked for it (destroy); otherwise the VM failed.
    pub requested: bool,
    pub reason: String,
    pub unix_time: u64,
    /// The guest stopped a cold boot (before it was ever ready) because the kernel's timer
    /// came out wrong ([`warren_protocol::CLOCK_FAILED_LINE`]): nothing ran and its disk is
    /// untouched, so the VM may be booted again as it is.
    #[serde(default)]
    pub boot_again: bool,
}

/// Opens (creating it 0600) a lock file only its owner may open: `flock` needs no write
/// access, so another local user able to open a lock file read-only could hold it and keep
/// a VM, the service or a template build from starting. A file an older Warren left with a
/// wider mode is narrowed; a symlink at the path is refused.
pub fn open_lock_file(path: &Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_CLOEXEC)
        .open(path)?;
    f.set_permissions(std::fs::Permissions::from_mode(0o600))?;
    Ok(f)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Lock files are their owner's alone (another user's read-only descriptor could hold
    /// them), an older wider one is narrowed, and a link at the path is refused.
    #[test]
    fn test_lock_files_are_private() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().expect("tmp");
        let mode = |p: &Path| std::fs::metadata(p).expect("stat").permissions().mode() & 0o777;
        let new = d.path().join("new.lock");
        drop(open_lock_file(&new).expect("create"));
        assert_eq!(mode(&new), 0o600);
        let old = d.path().join("old.lock");
        std::fs::write(&old, "").expect("write");
        std::fs::set_permissions(&old, std::fs::Permissions::from_mode(0o644)).expect("chmod");
        drop(open_lock_file(&old).expect("open"));
        assert_eq!(mode(&old), 0o600);
        let link = d.path().join("link.lock");
        std::os::unix::fs::symlink(&old, &link).expect("symlink");
        assert!(open_lock_file(&link).is_err(), "a link was followed");
    }

    /// Whether a lock is held is asked of a regular file only: a FIFO at the path answers
    /// at once instead of hanging the listing, and a link to a held lock is not followed.
    #[test]
    fn test_held_opens_neither_fifos_nor_links() {
        let d = tempfile::tempdir().expect("tmp");
        let real = d.path().join("real.lock");
        let holder = open_lock_file(&real).expect("create");
        let _held = nix::fcntl::Flock::lock(holder, nix::fcntl::FlockArg::LockExclusiveNonblock)
            .map_err(|(_, e)| e)
            .expect("lock");
        assert!(held(&real), "a held lock reads as free");
        let link = d.path().join("link.lock");
        std::os::unix::fs::symlink(&real, &link).expect("symlink");
        assert!(!held(&link), "a link was followed");
        let fifo = d.path().join("fifo.lock");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600))
            .expect("mkfifo");
        assert!(!held(&fifo), "a FIFO reads as held");
        assert!(!held(&d.path().join("missing.lock")));
    }
    /// A VMM reads its own template's directory and the fork state's, no other template
    /// (found by a hostile review: all of `templates/` and `forks/` were in every view); a
    /// marker that could name a path outside `templates/` fails the launch.
    #[test]
    fn test_view_readable_names_only_the_vms_own_template_and_fork_state() {
        let state = tempfile::tempdir().expect("state");
        let vm = state.path().join("vms").join("vm-1");
        std::fs::create_dir_all(&vm).expect("vm dir");
        for t in ["t-own", "t-other"] {
            std::fs::create_dir_all(state.path().join("templates").join(t)).expect("template");
        }
        let dir = VmDir(vm.clone());
        assert_eq!(
            dir.view_readable(None).expect("none"),
            Vec::<PathBuf>::new()
        );
        std::fs::write(dir.template_marker(), "t-own\n").expect("marker");
        let fork_state = state.path().join("forks").join("abc").join("state");
        assert_eq!(
            dir.view_readable(Some(&fork_state)).expect("own"),
            vec![
                state.path().join("templates").join("t-own"),
                state.path().join("forks").join("abc")
            ]
        );
        for bad in ["../../etc", "t-own/../t-other", "", "/etc"] {
            std::fs::write(dir.template_marker(), bad).expect("marker");
            assert!(dir.view_readable(None).is_err(), "{bad:?} accepted");
        }
    }
}
