//! Sessions: a project's workspace copy (see `warren-session`) mounted at `/workspace` of a
//! VM of its own, or with `direct`, the project directory itself.
//!
//! Mounts of a session VM, in order: the workspace (read-write, the guest user acting as the
//! session's owner), the source repository's objects read-only at
//! [`warren_session::GUEST_SOURCE_OBJECTS`] (so the copy's relative `alternates` resolve),
//! the project's agent state directory at [`GUEST_AGENT_STATE`], then the caller's extra
//! `--mount`s.

use std::path::{Path, PathBuf};

use rand::RngCore;
use serde::{Deserialize, Serialize};
use warren_session::Owner;

use crate::error::CoreError;
use crate::store::{MountSpec, SessionRecord, VmRecord, VmState};
use crate::vm::{now_unix, CreateVm, Warren};

/// Where a session VM sees its project's agent state directory (Claude Code's, Codex's and
/// opencode's configuration and history), kept on the host per project, outside the copy.
pub const GUEST_AGENT_STATE: &str = "/agent-state";

/// What a session asks of its VM; `warren run` refuses different values for a running
/// session unless told to recreate.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionDevices {
    pub image: Option<String>,
    pub memory_mib: Option<u32>,
    pub vcpus: Option<u32>,
    /// Extra mounts (`HOST:GUEST[:ro]`, canonical host paths).
    pub mounts: Vec<MountSpec>,
    /// A NIC behind the egress with these settings (none: no NIC).
    #[serde(default)]
    pub network: Option<crate::vm::NetworkRequest>,
    /// A direct session's directory as it was when the session was made (device, inode):
    /// every VM the session boots later refuses a directory that is no longer that one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_identity: Option<(u64, u64)>,
    /// A copy's source object directory as it was when the session was made (device,
    /// inode), checked the same way: it is shared into every VM of the session.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub objects_identity: Option<(u64, u64)>,
}

impl SessionDevices {
    /// The requested values that differ from `self` (the session's), described.
    pub fn differences(&self, want: &SessionDevices) -> Vec<String> {
        let mut d = Vec::new();
        if want.image.is_some() && want.image != self.image {
            d.push(format!(
                "image {:?} (session: {:?})",
                want.image, self.image
            ));
        }
        if want.memory_mib.is_some() && want.memory_mib != self.memory_mib {
            d.push(format!(
                "memory_mib {:?} (session: {:?})",
                want.memory_mib, self.memory_mib
            ));
        }
        if want.vcpus.is_some() && want.vcpus != self.vcpus {
            d.push(format!(
                "vcpus {:?} (session: {:?})",
                want.vcpus, self.vcpus
            ));
        }
        if !want.mounts.is_empty() && want.mounts != self.mounts {
            d.push("mounts differ".to_string());
        }
        if want.network.is_some() && want.network != self.network {
            d.push(if self.network.is_none() {
                "network (the session VM has none)".to_string()
            } else {
                "network settings differ".to_string()
            });
        }
        d
    }
}

/// A request for a new session.
#[derive(Debug, Clone)]
pub struct CreateSession {
    /// The project: a directory inside a git checkout (its toplevel is used), or any
    /// directory with `direct`.
    pub repo: PathBuf,
    pub name: Option<String>,
    /// Mount `repo` itself instead of a copy (no git needed; edits go straight to it).
    pub direct: bool,
    pub devices: SessionDevices,
    /// The host user the session belongs to (files in the workspace are theirs).
    pub owner: (u32, u32),
    /// The owning workspace (`local-<uid>` for local callers).
    pub workspace: String,
    /// Admission limits for the session's VM: (host, workspace).
    pub limits: (crate::vm::Limits, crate::vm::Limits),
}

fn owner_of(uid: u32, gid: u32) -> Option<Owner> {
    // Acting as another uid needs root; a process acting for itself needs nothing.
    (uid != nix::unistd::geteuid().as_raw()).then_some(Owner { uid, gid })
}

fn session_error(e: warren_session::SessionError) -> CoreError {
    use warren_session::SessionError as S;
    match e {
        S::NotARepository(p) => CoreError::InvalidArgument(format!(
            "{} is not in a git repository (use --direct to mount the directory itself)",
            p.display()
        )),
        S::Unsaved { .. } | S::NotFastForward { .. } | S::BranchCheckedOut { .. } => {
            CoreError::Conflict(e.to_string())
        }
        S::UnsafeGitDir { .. } | S::TooLarge { .. } => CoreError::Conflict(e.to_string()),
        // The repository named leads outside itself: the request is refused as it stands.
        S::UnsafeSource { .. } => CoreError::InvalidArgument(e.to_string()),
        S::GitTimeout { .. } => CoreError::Session(e.to_string()),
        S::Io { .. } | S::GitSpawn(_) | S::Git { .. } => CoreError::Session(e.to_string()),
        other => CoreError::InvalidArgument(other.to_string()),
    }
}

/// Session names: what a user types; `[A-Za-z0-9._-]{1,64}`, not starting with `-` or `.`.
fn valid_name(n: &str) -> bool {
    !n.is_empty()
        && n.len() <= 64
        && !n.starts_with(['-', '.'])
        && n.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
}

impl Warren {
    fn sessions_dir(&self) -> PathBuf {
        self.config().state_dir.join("sessions")
    }

    /// The per-project agent state directory on the host (outside any session copy).
    pub fn agent_state_dir(&self, workspace: &str, project: &Path) -> PathBuf {
        use sha2::Digest;
        let h = sha2::Sha256::digest(format!("{workspace}\0{}", project.display()).as_bytes());
        self.config()
            .state_dir
            .join("agent-state")
            .join(hex::encode(&h[..8]))
    }

    /// Every session of `workspace` (all with `None`).
    pub fn list_sessions(&self, workspace: Option<&str>) -> Result<Vec<SessionRecord>, CoreError> {
        Ok(self.store().sessions(workspace)?)
    }

    /// A session of `workspace` by id or name; another workspace's is not found.
    pub fn session(&self, workspace: &str, id_or_name: &str) -> Result<SessionRecord, CoreError> {
        self.store()
            .sessions(Some(workspace))?
            .into_iter()
            .find(|s| s.id == id_or_name || s.name == id_or_name)
            .ok_or_else(|| CoreError::SessionNotFound(id_or_name.to_string()))
    }

    /// The newest session of `workspace` whose project is `project`.
    pub fn project_session(
        &self,
        workspace: &str,
        project: &Path,
    ) -> Result<Option<SessionRecord>, CoreError> {
        Ok(self
            .store()
            .sessions(Some(workspace))?
            .into_iter()
            .rev()
            .find(|s| s.source == project))
    }

    /// Prepares the workspace copy and boots the session's VM. Nothing is left behind on
    /// failure.
    pub async fn create_session(
        &self,
        req: &CreateSession,
        warn: &mut (dyn FnMut(&str) + Send),
    ) -> Result<(SessionRecord, VmRecord), CoreError> {
        let mut idb = [0u8; 6];
        rand::rng().fill_bytes(&mut idb);
        let id = format!("ses-{}", hex::encode(idb));
        let (uid, gid) = req.owner;
        let owner = owner_of(uid, gid);
        let mut devices = req.devices.clone();
        let (source, source_git, dir) = if req.direct {
            let d = warren_session::direct(&req.repo).map_err(session_error)?;
            devices.source_identity = Some(
                warren_vmm::qemu::virtiofs::identity_of(&d)
                    .map_err(|e| CoreError::io("stat", &d, e))?,
            );
            (d, None, PathBuf::new())
        } else {
            let parent = self.sessions_dir();
            std::fs::create_dir_all(&parent).map_err(|e| CoreError::io("create", &parent, e))?;
            // Owners reach their own copies; nobody lists the others'.
            use std::os::unix::fs::PermissionsExt;
            let _ = std::fs::set_permissions(&parent, std::fs::Permissions::from_mode(0o711));
            let dir = parent.join(&id);
            let (repo, into) = (req.repo.clone(), dir.clone());
            let p = blocking(move || {
                warren_session::prepare(&repo, &into, owner).map_err(session_error)
            })
            .await?;
            // The identity of the object directory prepare checked (opened beneath the source's
            // git directory, no symlink): every VM of the session must still mount that one.
            devices.objects_identity = Some(p.source_objects_identity);
            for s in &p.skipped {
                warn(&format!(
                    "not copied: {} ({:?})",
                    s.path.display(),
                    s.reason
                ));
            }
            (p.source_toplevel, Some(p.source_git_dir), dir)
        };
        let name = match &req.name {
            Some(n) if !valid_name(n) => {
                self.discard_copy(&dir, req.direct);
                return Err(CoreError::InvalidArgument(format!(
                    "session name {n:?} must be 1-64 characters [A-Za-z0-9._-]"
                )));
            }
            Some(n) => n.clone(),
            None => self.free_name(&req.workspace, &source)?,
        };
        let rec = SessionRecord {
            id: id.clone(),
            name,
            workspace: req.workspace.clone(),
            owner_uid: uid,
            owner_gid: gid,
            source,
            source_git,
            dir,
            direct: req.direct,
            vm_id: None,
            created_unix: now_unix(),
            devices: serde_json::to_value(&devices).expect("invariant: devices serialise"),
        };
        if let Err(e) = self.store().insert_session(&rec) {
            self.discard_copy(&rec.dir, rec.direct);
            if let rusqlite::Error::SqliteFailure(f, _) = &e {
                if f.code == rusqlite::ErrorCode::ConstraintViolation {
                    return Err(CoreError::Conflict(format!(
                        "a session named {:?} already exists",
                        rec.name
                    )));
                }
            }
            return Err(e.into());
        }
        match self
            .start_session_vm(&rec, &devices, req.limits, warn)
            .await
        {
            Ok((rec, vm)) => Ok((rec, vm)),
            Err(e) => {
                let _ = self.store().delete_session(&rec.id);
                self.discard_copy(&rec.dir, rec.direct);
                Err(e)
            }
        }
    }

    fn discard_copy(&self, dir: &Path, direct: bool) {
        if !direct && !dir.as_os_str().is_empty() {
            if let Err(e) = warren_session::remove(dir, true, None) {
                tracing::warn!(error = %e, dir = %dir.display(), "removing a session copy failed");
            }
        }
    }

    /// `<project basename>`, or with `-2`, `-3`... when taken.
    fn free_name(&self, workspace: &str, source: &Path) -> Result<String, CoreError> {
        let base: String = source
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default()
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || "._-".contains(c) {
                    c
                } else {
                    '-'
                }
            })
            .collect();
        let base = base.trim_start_matches(['-', '.']);
        let base = if base.is_empty() { "session" } else { base };
        let base: String = base.chars().take(56).collect();
        let taken: Vec<String> = self
            .store()
            .sessions(Some(workspace))?
            .into_iter()
            .map(|s| s.name)
            .collect();
        let mut name = base.clone();
        let mut n = 2;
        while taken.contains(&name) {
            name = format!("{base}-{n}");
            n += 1;
        }
        Ok(name)
    }

    /// The mounts of `s`'s VM (see the module docs).
    fn session_mounts(
        &self,
        s: &SessionRecord,
        devices: &SessionDevices,
    ) -> Result<Vec<MountSpec>, CoreError> {
        let owner = Some((s.owner_uid, s.owner_gid));
        let mut mounts = Vec::new();
        if s.direct {
            mounts.push(MountSpec {
                host: s.source.clone(),
                guest: warren_session::GUEST_WORKSPACE.to_string(),
                read_only: false,
                owner,
                identity: devices.source_identity,
            });
        } else {
            mounts.push(MountSpec {
                host: warren_session::workspace_dir(&s.dir),
                guest: warren_session::GUEST_WORKSPACE.to_string(),
                read_only: false,
                owner,
                identity: None,
            });
            let objects = warren_session::source_objects_dir(&s.dir).map_err(session_error)?;
            mounts.push(MountSpec {
                host: objects,
                guest: warren_session::GUEST_SOURCE_OBJECTS.to_string(),
                read_only: true,
                owner,
                identity: devices.objects_identity,
            });
        }
        let state = self.agent_state_dir(&s.workspace, &s.source);
        if !state.exists() {
            std::fs::create_dir_all(&state).map_err(|e| CoreError::io("create", &state, e))?;
            std::os::unix::fs::chown(&state, Some(s.owner_uid), Some(s.owner_gid))
                .map_err(|e| CoreError::io("chown", &state, e))?;
        }
        mounts.push(MountSpec {
            host: state
                .canonicalize()
                .map_err(|e| CoreError::io("resolve", &state, e))?,
            guest: GUEST_AGENT_STATE.to_string(),
            read_only: false,
            owner,
            identity: None,
        });
        mounts.extend(devices.mounts.iter().cloned());
        Ok(mounts)
    }

    /// Boots a VM for `s` with `devices` and records it as the session's VM.
    async fn start_session_vm(
        &self,
        s: &SessionRecord,
        devices: &SessionDevices,
        limits: (crate::vm::Limits, crate::vm::Limits),
        warn: &mut (dyn FnMut(&str) + Send),
    ) -> Result<(SessionRecord, VmRecord), CoreError> {
        let req = CreateVm {
            host_limits: limits.0,
            workspace_limits: limits.1,
            image: devices.image.clone(),
            memory_mib: devices.memory_mib,
            vcpus: devices.vcpus,
            workspace: s.workspace.clone(),
            mounts: self.session_mounts(s, devices)?,
            network: devices.network.clone(),
            ..Default::default()
        };
        let vm = self.create_vm(&req, warn).await?;
        let dev = serde_json::to_value(devices).expect("invariant: devices serialise");
        self.store().set_session_vm(&s.id, Some(&vm.id), &dev)?;
        let mut s = s.clone();
        s.vm_id = Some(vm.id.clone());
        s.devices = dev;
        Ok((s, vm))
    }

    /// The session's VM, ready for work: reattached when it exists (a suspended VM wakes on
    /// the first operation); with `recreate` (or when it is gone or failed and `recreate`),
    /// a new VM is booted with `devices`. A running VM with different devices is a conflict.
    pub async fn session_vm(
        &self,
        s: &SessionRecord,
        want: &SessionDevices,
        recreate: bool,
        warn: &mut (dyn FnMut(&str) + Send),
    ) -> Result<(SessionRecord, VmRecord), CoreError> {
        let have: SessionDevices = serde_json::from_value(s.devices.clone()).unwrap_or_default();
        let vm = match &s.vm_id {
            Some(id) => match self.get_vm(id) {
                Ok(vm) => Some(vm),
                Err(CoreError::VmNotFound(_)) => None,
                Err(e) => return Err(e),
            },
            None => None,
        };
        let diff = have.differences(want);
        match vm {
            Some(vm) if !recreate => {
                if vm.state == VmState::Failed {
                    return Err(CoreError::Conflict(format!(
                        "the session's VM {} failed ({}); pass --recreate to boot a new one",
                        vm.id,
                        vm.reason.as_deref().unwrap_or("no reason recorded")
                    )));
                }
                if !diff.is_empty() {
                    return Err(CoreError::Conflict(format!(
                        "session {} runs with different devices: {}; pass --recreate to replace its VM",
                        s.name,
                        diff.join(", ")
                    )));
                }
                Ok((s.clone(), vm))
            }
            Some(vm) => {
                self.destroy_vm(&vm.id).await?;
                let merged = merge_devices(&have, want);
                self.start_session_vm(s, &merged, Default::default(), warn)
                    .await
            }
            None => {
                if s.vm_id.is_some() && !recreate {
                    return Err(CoreError::Conflict(format!(
                        "the session's VM {} no longer exists; pass --recreate to boot a new one",
                        s.vm_id.as_deref().unwrap_or_default()
                    )));
                }
                let merged = merge_devices(&have, want);
                self.start_session_vm(s, &merged, Default::default(), warn)
                    .await
            }
        }
    }

    /// Runs host git work on the session copy with the session's VM paused, so the guest
    /// cannot rewrite the git directory between the safety checks and the git call (a
    /// running VM is resumed afterwards, whatever the outcome).
    async fn with_guest_stopped<T, F>(&self, s: &SessionRecord, f: F) -> Result<T, CoreError>
    where
        T: Send + 'static,
        F: FnOnce() -> Result<T, CoreError> + Send + 'static,
    {
        let running = match &s.vm_id {
            Some(id) => matches!(self.get_vm(id), Ok(vm) if vm.state == VmState::Running),
            None => false,
        };
        let vm = s.vm_id.as_deref().unwrap_or_default();
        // One host pass over a session at a time: concurrent calls on one session wait
        // instead of each holding a blocking thread and a git output of their own.
        let lock = session_lock(&s.id);
        let _one = lock.lock().await;
        if running {
            self.suspend_vm(vm, crate::vm::SuspendMode::Pause, true)
                .await?;
        }
        // Host git and the file reads of a guest-written copy run on a blocking thread with
        // their own deadlines, never on the runtime's workers.
        let r = blocking(f).await;
        if running {
            self.resume_vm(vm).await?;
        }
        r
    }

    /// What deleting `s` would lose (nothing for a direct session).
    pub async fn session_retention(
        &self,
        s: &SessionRecord,
    ) -> Result<warren_session::Retention, CoreError> {
        if s.direct {
            return Ok(warren_session::Retention::default());
        }
        let (dir, owner) = (s.dir.clone(), owner_of(s.owner_uid, s.owner_gid));
        self.with_guest_stopped(s, move || {
            warren_session::status(&dir, owner).map_err(session_error)
        })
        .await
    }

    /// Destroys the session's VM and its copy. Without `force`, refuses while the copy has
    /// uncommitted changes or unexported commits, saying which.
    pub async fn delete_session(&self, s: &SessionRecord, force: bool) -> Result<(), CoreError> {
        if !force {
            let r = self.session_retention(s).await?;
            if !r.is_clean() {
                return Err(session_error(warren_session::SessionError::Unsaved {
                    uncommitted: r.uncommitted,
                    unexported: r.unexported.len(),
                }));
            }
        }
        if let Some(vm) = &s.vm_id {
            match self.destroy_vm(vm).await {
                Ok(()) | Err(CoreError::VmNotFound(_)) => {}
                Err(e) => return Err(e),
            }
        }
        if !s.direct {
            let (dir, owner) = (s.dir.clone(), owner_of(s.owner_uid, s.owner_gid));
            blocking(move || warren_session::remove(&dir, true, owner).map_err(session_error))
                .await?;
        }
        self.store().delete_session(&s.id)?;
        Ok(())
    }

    /// Brings the session's HEAD commit into the source repository as `branch`
    /// (default `warren/<session name>`).
    pub async fn export_session(
        &self,
        s: &SessionRecord,
        branch: Option<&str>,
    ) -> Result<warren_session::Exported, CoreError> {
        let Some(git) = &s.source_git else {
            return Err(CoreError::InvalidArgument(format!(
                "session {} mounts {} directly: there is nothing to export",
                s.name,
                s.source.display()
            )));
        };
        let branch = branch
            .map(str::to_string)
            .unwrap_or_else(|| format!("warren/{}", s.name));
        let (dir, git, owner) = (
            s.dir.clone(),
            git.clone(),
            owner_of(s.owner_uid, s.owner_gid),
        );
        self.with_guest_stopped(s, move || {
            warren_session::export(&dir, &git, &branch, owner).map_err(session_error)
        })
        .await
    }
}

/// The lock that serialises host passes over session `id` (in this process).
fn session_lock(id: &str) -> std::sync::Arc<tokio::sync::Mutex<()>> {
    use std::collections::HashMap;
    use std::sync::{Arc, LazyLock, Mutex};
    static LOCKS: LazyLock<Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>> =
        LazyLock::new(Mutex::default);
    let mut locks = LOCKS.lock().unwrap_or_else(|p| p.into_inner());
    // Locks nobody holds or waits for are dropped as others are taken.
    locks.retain(|_, l| Arc::strong_count(l) > 1);
    locks.entry(id.to_string()).or_default().clone()
}

/// Runs `f` on the runtime's blocking pool: session copies, host git and reads of
/// guest-written files never occupy an async worker.
async fn blocking<T, F>(f: F) -> Result<T, CoreError>
where
    T: Send + 'static,
    F: FnOnce() -> Result<T, CoreError> + Send + 'static,
{
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| CoreError::Session(format!("a blocking session task failed: {e}")))?
}

fn merge_devices(have: &SessionDevices, want: &SessionDevices) -> SessionDevices {
    SessionDevices {
        image: want.image.clone().or_else(|| have.image.clone()),
        memory_mib: want.memory_mib.or(have.memory_mib),
        vcpus: want.vcpus.or(have.vcpus),
        mounts: if want.mounts.is_empty() {
            have.mounts.clone()
        } else {
            want.mounts.clone()
        },
        network: want.network.clone().or_else(|| have.network.clone()),
        source_identity: have.source_identity,
        objects_identity: have.objects_identity,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_session_names_validated() {
        assert!(valid_name("proj-2"));
        assert!(valid_name("a.b_c"));
        assert!(!valid_name(""));
        assert!(!valid_name("-x"));
        assert!(!valid_name(".x"));
        assert!(!valid_name("a/b"));
        assert!(!valid_name(&"x".repeat(65)));
    }

    #[test]
    fn test_device_differences_only_for_requested_values() {
        let have = SessionDevices {
            image: Some("dev".into()),
            memory_mib: Some(512),
            vcpus: None,
            mounts: vec![],
            network: None,
            source_identity: None,
            objects_identity: None,
        };
        assert!(have.differences(&SessionDevices::default()).is_empty());
        let networked = SessionDevices {
            network: Some(crate::vm::NetworkRequest::default()),
            ..Default::default()
        };
        assert_eq!(
            have.differences(&networked).len(),
            1,
            "network asked, none there"
        );
        assert!(merge_devices(&have, &networked).network.is_some());
        let want = SessionDevices {
            memory_mib: Some(1024),
            ..Default::default()
        };
        assert_eq!(have.differences(&want).len(), 1);
        let m = merge_devices(&have, &want);
        assert_eq!(m.memory_mib, Some(1024));
        assert_eq!(m.image.as_deref(), Some("dev"));
    }

    #[test]
    fn test_session_error_source_refusals_are_invalid_argument() {
        use warren_session::SessionError as S;
        let unsafe_source = session_error(S::UnsafeSource {
            path: "/r/.git/objects".into(),
            reason: "is a symlink".into(),
        });
        assert_eq!(unsafe_source.code(), "invalid_argument");
        assert!(
            unsafe_source
                .to_string()
                .contains("source repository refused: /r/.git/objects"),
            "{unsafe_source}"
        );
        let alternates = session_error(S::SourceHasAlternates("/r/.git/objects".into()));
        assert_eq!(alternates.code(), "invalid_argument");
    }
}
