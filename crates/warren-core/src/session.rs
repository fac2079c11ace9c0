//! Sessions: a project's workspace copy (see `warren-session`) mounted at `/workspace` of a
//! VM of its own, or with `direct`, the project directory itself.
//!
//! Mounts of a session VM, in order: the workspace (read-write, the guest user acting as the
//! session's owner), the source repository's objects read-only at
//! [`warren_session::GUEST_SOURCE_OBJECTS`] (so the copy's relative `alternates` resolve),
//! the project's agent state directory at [`GUEST_AGENT_STATE`], then the caller's extra
//! `--mount`s.
//!
//! Storage: a copy made under a storage limit (asked with `storage_mib`, or by default when
//! the host or the workspace has a storage limit) lives on a filesystem of its own of that
//! size ([`warren_session::volume`]), reserved as storage in the same immediate transaction
//! that inserts the session, beside the VMs' disk reservations. A direct session's directory
//! and `--mount`s are the user's own storage and are not counted. Such a session's agent
//! state is on its filesystem too ([`Warren::session_agent_state`]).

use std::path::{Path, PathBuf};

use rand::RngCore;
use serde::{Deserialize, Serialize};
use warren_session::Owner;

use warren_session::volume::{self, Volume, VolumePaths};

use crate::error::CoreError;
use crate::store::{self as vmstore, MountSpec, SessionRecord, Usage, VmRecord, VmState};
use crate::vm::{now_unix, CreateVm, Limits, Warren};

/// Where a session VM sees its project's agent state directory (Claude Code's, Codex's and
/// opencode's configuration and history), kept on the host per project, outside the copy.
pub const GUEST_AGENT_STATE: &str = "/agent-state";
/// The agent state directory on a limited session's own filesystem (beside `S`).
const AGENT_STATE_SUBDIR: &str = "agent-state";

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
    /// The size asked for the copy's own filesystem, MiB (fixed when the session is made).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub storage_mib: Option<u64>,
    /// Restore the session's VMs from the template of their shape (image, memory, vCPUs,
    /// the session's shares, NIC) instead of booting them (`vm::template`). Not a device: it
    /// never makes two sessions' devices differ.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub template: bool,
}

/// A session's own filesystem when a storage limit applies and none was asked: room for a
/// typical checkout with its build outputs.
pub const DEFAULT_SESSION_STORAGE_MIB: u64 = 4096;
/// The largest session filesystem one may ask for (1 TiB).
pub const MAX_SESSION_STORAGE_MIB: u64 = 1 << 20;

/// The size of a new session's own filesystem: the one asked, else the default when a
/// storage limit applies (host or workspace), else none (the copy is a plain directory).
pub fn session_storage(
    direct: bool,
    asked: Option<u64>,
    limits: (Limits, Limits),
) -> Result<Option<u64>, CoreError> {
    use warren_session::volume::MIN_STORAGE_MIB;
    match asked {
        Some(_) if direct => Err(CoreError::InvalidArgument(
            "storage_mib applies to session copies; a direct session's directory is the user's own storage".into(),
        )),
        Some(n) if !(MIN_STORAGE_MIB..=MAX_SESSION_STORAGE_MIB).contains(&n) => {
            Err(CoreError::InvalidArgument(format!(
                "storage_mib must be within {MIN_STORAGE_MIB}..={MAX_SESSION_STORAGE_MIB}, got {n}"
            )))
        }
        Some(n) => Ok(Some(n)),
        None if direct => Ok(None),
        None => Ok((limits.0.max_storage_mib.is_some() || limits.1.max_storage_mib.is_some())
            .then_some(DEFAULT_SESSION_STORAGE_MIB)),
    }
}

/// Checks `add_mib` of session storage for `workspace` against (host, workspace) storage
/// limits, inside the caller's immediate transaction; VM and memory limits do not apply.
pub(crate) fn check_storage(
    tx: &rusqlite::Transaction<'_>,
    workspace: &str,
    add_mib: u64,
    limits: (Limits, Limits),
) -> Result<(), CoreError> {
    let storage_only = |l: Limits| Limits {
        max_storage_mib: l.max_storage_mib,
        ..Limits::default()
    };
    let add = Usage {
        disk_mib: add_mib,
        ..Usage::default()
    };
    storage_only(limits.1).check(
        &format!("session storage: workspace {workspace}"),
        vmstore::usage(tx, Some(workspace))?,
        add,
    )?;
    storage_only(limits.0).check("session storage: host", vmstore::usage(tx, None)?, add)
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
    /// The canonical host root the caller named `repo` under (a token holder's
    /// `[[host_roots]]` entry), if any: a copy's repository (its working tree's top, its git
    /// and object directories, as the copy opened them) must lie beneath it. Git's search
    /// for a repository walks up from `repo`, and a path component swapped after the
    /// caller's check leads anywhere the owner can read: neither may take a copy out of it.
    pub within: Option<PathBuf>,
}

fn owner_of(uid: u32, gid: u32) -> Option<Owner> {
    // Acting as another uid needs root; a process acting for itself needs nothing.
    (uid != nix::unistd::geteuid().as_raw()).then_some(Owner { uid, gid })
}

pub(crate) fn session_error(e: warren_session::SessionError) -> CoreError {
    use warren_session::SessionError as S;
    match e {
        S::NotARepository(p) => CoreError::InvalidArgument(format!(
            "{} is not in a git repository (use --direct to mount the directory itself)",
            p.display()
        )),
        S::Unsaved { .. } | S::NotFastForward { .. } | S::BranchCheckedOut { .. } => {
            CoreError::Conflict(e.to_string())
        }
        S::UnsafeGitDir { .. } | S::TooLarge { .. } | S::DirectoryChanged(_) => {
            CoreError::Conflict(e.to_string())
        }
        // The repository named leads outside itself: the request is refused as it stands.
        S::UnsafeSource { .. } => CoreError::InvalidArgument(e.to_string()),
        S::GitTimeout { .. } => CoreError::Session(e.to_string()),
        // Host git's scratch directory found no room on the session's own file system.
        S::StorageFull => CoreError::QuotaExceeded(e.to_string()),
        S::Unreadable { .. } => CoreError::Forbidden(e.to_string()),
        S::Io { .. } | S::GitSpawn(_) | S::Git { .. } => CoreError::Session(e.to_string()),
        S::Volume { .. } => CoreError::StorageUnavailable(e.to_string()),
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
    pub(crate) fn sessions_dir(&self) -> PathBuf {
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

    /// Where `s`'s VM finds its agent state on the host: under a storage limit, a directory
    /// on the session's own filesystem (counted against its limit, deleted with it);
    /// otherwise the project's directory, shared by the project's sessions.
    pub fn session_agent_state(&self, s: &SessionRecord) -> PathBuf {
        if s.storage_mib > 0 && !s.direct {
            VolumePaths::new(&self.sessions_dir(), &s.id)
                .mountpoint
                .join(AGENT_STATE_SUBDIR)
        } else {
            self.agent_state_dir(&s.workspace, &s.source)
        }
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

    /// The ids of the sessions whose VMs are `vms`, in their order; empty when none of them
    /// is a session's.
    pub fn sessions_of_vms(&self, vms: &[VmRecord]) -> Result<Vec<String>, CoreError> {
        let all = self.store().sessions(None)?;
        let ids: Vec<String> = vms
            .iter()
            .filter_map(|v| {
                all.iter()
                    .find(|s| s.vm_id.as_deref() == Some(v.id.as_str()))
                    .map(|s| s.id.clone())
            })
            .collect();
        Ok(ids)
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
        let storage = session_storage(req.direct, req.devices.storage_mib, req.limits)?;
        let mut volume = None;
        let mut storage_turn = None;
        let (source, source_git, dir) = if req.direct {
            // A caller's check (the service's, as the caller) names the directory it allowed:
            // a path swapped since is refused, never served.
            let (d, found) = warren_session::direct_checked(&req.repo, req.devices.source_identity)
                .map_err(session_error)?;
            devices.source_identity = Some(found);
            (d, None, PathBuf::new())
        } else {
            let parent = self.sessions_dir();
            std::fs::create_dir_all(&parent).map_err(|e| CoreError::io("create", &parent, e))?;
            // Owners reach their own copies; nobody lists the others'.
            use std::os::unix::fs::PermissionsExt;
            let _ = std::fs::set_permissions(&parent, std::fs::Permissions::from_mode(0o711));
            let dir = match storage {
                Some(mib) => {
                    // Checked before any work, reserved with the session row below; one such
                    // create of a workspace at a time in this process (held until its row is
                    // in): requests sent at once would each pass the check before any was
                    // reserved, and each make a filesystem and copy the repository past the
                    // workspace's storage before being refused (a hostile review).
                    storage_turn = Some(
                        session_lock(&format!("storage-create\0{}", req.workspace))
                            .lock_owned()
                            .await,
                    );
                    self.store()
                        .admit(|tx| check_storage(tx, &req.workspace, mib, req.limits))?;
                    let paths = VolumePaths::new(&parent, &id);
                    let v = blocking(move || Volume::create(&paths, mib).map_err(session_error))
                        .await?;
                    let dir = v.paths.session_dir();
                    volume = Some(v);
                    dir
                }
                None => parent.join(&id),
            };
            let (repo, into) = (req.repo.clone(), dir.clone());
            let prepared = blocking(move || {
                warren_session::prepare(&repo, &into, owner).map_err(session_error)
            })
            .await;
            let p = match prepared {
                Ok(p) => p,
                Err(e) => {
                    // Torn down under the volume's lock, then the lock goes.
                    self.discard_copy(&id, &dir, false, volume.take());
                    return Err(e);
                }
            };
            // Every directory the copy read the repository from, as opened (canonical, no
            // symlink followed), must be beneath the caller's root.
            if let Some(root) = &req.within {
                let outside = [&p.source_toplevel, &p.source_git_dir, &p.source_objects]
                    .into_iter()
                    .any(|d| !d.starts_with(root));
                if outside {
                    self.discard_copy(&id, &dir, false, volume.take());
                    // Worded as the host path check words a refusal: nothing is told about
                    // what lies above the root.
                    return Err(CoreError::Forbidden(format!(
                        "host path {:?} is not available to you",
                        req.repo.display().to_string()
                    )));
                }
            }
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
                self.discard_copy(&id, &dir, req.direct, volume);
                return Err(CoreError::InvalidArgument(format!(
                    "session name {n:?} must be 1-64 characters [A-Za-z0-9._-]"
                )));
            }
            Some(n) => n.clone(),
            None => match self.free_name(&req.workspace, &source) {
                Ok(n) => n,
                Err(e) => {
                    self.discard_copy(&id, &dir, req.direct, volume);
                    return Err(e);
                }
            },
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
            storage_mib: storage.unwrap_or(0),
            generation: 1,
        };
        let inserted = self
            .store()
            .insert_session(&rec, |tx| -> Result<(), CoreError> {
                check_storage(tx, &rec.workspace, rec.storage_mib, req.limits)
            });
        if let Err(e) = inserted {
            self.discard_copy(&rec.id, &rec.dir, rec.direct, volume);
            if let CoreError::Store(rusqlite::Error::SqliteFailure(f, _)) = &e {
                if f.code == rusqlite::ErrorCode::ConstraintViolation {
                    return Err(CoreError::Conflict(format!(
                        "a session named {:?} already exists",
                        rec.name
                    )));
                }
            }
            return Err(e);
        }
        // The row (and its reservation) now stands for the volume: a sweep may see it.
        drop(volume);
        drop(storage_turn);
        match self
            .start_session_vm(&rec, &devices, req.limits, rec.generation, warn)
            .await
        {
            Ok((rec, vm)) => Ok((rec, vm)),
            Err(e) => {
                // The volume goes before the row, so its reservation outlives it.
                self.discard_copy(&rec.id, &rec.dir, rec.direct, None);
                let _ = self.store().delete_session(&rec.id);
                Err(e)
            }
        }
    }

    /// Removes session `id`'s copy: its own filesystem when it has one (unmounted, the
    /// image deleted: nothing the guest wrote is walked), else the directory. `held`: the
    /// volume still being made, torn down under the lock it holds (taking the lock again
    /// would wait for ourselves).
    pub(crate) fn discard_copy(&self, id: &str, dir: &Path, direct: bool, held: Option<Volume>) {
        if let Some(v) = held {
            if let Err(e) = v.teardown() {
                tracing::warn!(error = %e, session = id, "removing a session volume failed");
            }
            return;
        }
        if direct || dir.as_os_str().is_empty() {
            return;
        }
        let paths = VolumePaths::new(&self.sessions_dir(), id);
        if paths.image.exists() || paths.mountpoint.exists() {
            if let Err(e) = volume::teardown(&paths) {
                tracing::warn!(error = %e, session = id, "removing a session volume failed");
            }
        } else if let Err(e) = warren_session::remove(dir, true, None) {
            tracing::warn!(error = %e, dir = %dir.display(), "removing a session copy failed");
        }
    }

    /// Mounts `s`'s own filesystem again if a host restart unmounted it (no-op otherwise),
    /// on a blocking thread: it may wait for the image's lock. Before a session VM boots, a
    /// hibernated one resumes, and host git reads the copy.
    pub(crate) async fn volume_ready(&self, s: &SessionRecord) -> Result<(), CoreError> {
        if s.direct || s.storage_mib == 0 {
            return Ok(());
        }
        let paths = VolumePaths::new(&self.sessions_dir(), &s.id);
        blocking(move || volume::ensure_mounted(&paths).map_err(session_error)).await
    }

    /// Shares of `s`'s VM that live in its own filesystem, rebased onto the filesystem's
    /// current mount. A volume mounted again (after a host restart unmounted it) sits on a
    /// loop device of its own, so the same directories of the same image have another device
    /// number; each such share keeps its recorded inode and takes the device of the volume's
    /// mount now at the mount point (a root-only directory of Warren's state that only
    /// [`volume::ensure_mounted`] mounts). The identity check of every launch then still
    /// refuses any other directory at those paths.
    pub(crate) fn rebase_volume_shares(
        &self,
        s: &SessionRecord,
        shares: &mut [warren_vmm::backend::Share],
    ) -> Result<(), CoreError> {
        use std::os::unix::fs::MetadataExt;
        if s.direct || s.storage_mib == 0 {
            return Ok(());
        }
        let paths = VolumePaths::new(&self.sessions_dir(), &s.id);
        if !paths.is_mounted() {
            return Ok(());
        }
        let dev = std::fs::metadata(&paths.mountpoint)
            .map_err(|e| CoreError::io("stat", &paths.mountpoint, e))?
            .dev();
        for share in shares.iter_mut() {
            if share.host_dir.starts_with(&paths.mountpoint) {
                if let Some((_, ino)) = share.identity {
                    share.identity = Some((dev, ino));
                }
            }
        }
        Ok(())
    }

    /// Reconciliation of session volumes: one without a session record (a create or a
    /// delete that crashed half-way) is unmounted and deleted; one being made right now is
    /// left alone (its maker holds the image's lock until the record is written). Volumes
    /// of recorded sessions stay, mounted again when their session is next used.
    pub fn sweep_volumes(&self) {
        let dir = self.sessions_dir();
        if !dir.is_dir() {
            return;
        }
        // Asked under each volume's lock, so a session inserted meanwhile is seen; a store
        // that cannot be read keeps every volume.
        let known = |id: &str| match self.store().sessions(None) {
            Ok(list) => list.iter().any(|s| s.id == id),
            Err(e) => {
                tracing::warn!(error = %e, "listing sessions for the volume sweep");
                true
            }
        };
        for id in volume::sweep(&dir, known) {
            tracing::info!(session = %id, "removed an orphaned session volume");
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
        let state = self.session_agent_state(s);
        crate::agent_state::private_agent_state(&state, s.owner_uid, s.owner_gid)?;
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

    /// Boots a VM for `s` with `devices` at `generation` and records it as the session's VM
    /// (the session takes the same generation).
    async fn start_session_vm(
        &self,
        s: &SessionRecord,
        devices: &SessionDevices,
        limits: (crate::vm::Limits, crate::vm::Limits),
        generation: u64,
        warn: &mut (dyn FnMut(&str) + Send),
    ) -> Result<(SessionRecord, VmRecord), CoreError> {
        self.volume_ready(s).await?;
        // Names the VM this start makes, so a failed start finds it (no caller's request id
        // has a '/').
        let mut nonce = [0u8; 6];
        rand::rng().fill_bytes(&mut nonce);
        let rid = format!("session/{}/{}", s.id, hex::encode(nonce));
        let req = CreateVm {
            request_id: Some(rid.clone()),
            host_limits: limits.0,
            workspace_limits: limits.1,
            image: devices.image.clone(),
            memory_mib: devices.memory_mib,
            vcpus: devices.vcpus,
            workspace: s.workspace.clone(),
            mounts: self.session_mounts(s, devices)?,
            network: devices.network.clone(),
            generation: Some(generation),
            template: devices.template,
            ..Default::default()
        };
        let made = match self.create_vm(&req, warn).await {
            Ok(vm) => {
                let dev = serde_json::to_value(devices).expect("invariant: devices serialise");
                self.store()
                    .set_session_vm(&s.id, Some(&vm.id), &dev, generation)
                    .map(|()| (vm, dev))
                    .map_err(CoreError::from)
            }
            Err(e) => Err(e),
        };
        let (vm, dev) = match made {
            Ok(made) => made,
            Err(e) => {
                // A VM admitted for this start (failed, or running for no session) goes too:
                // nothing of a failed start is left counted against the limits.
                match self.store().by_request(&s.workspace, &rid) {
                    Ok(Some(vm)) => {
                        if let Err(d) = self.destroy_vm(&vm.id).await {
                            tracing::warn!(vm = %vm.id, error = %d, "removing a failed session start's VM");
                        }
                    }
                    Ok(None) => {}
                    Err(d) => {
                        tracing::warn!(error = %d, "finding a failed session start's VM")
                    }
                }
                return Err(e);
            }
        };
        let mut s = s.clone();
        s.vm_id = Some(vm.id.clone());
        s.devices = dev;
        s.generation = generation;
        Ok((s, vm))
    }

    /// The session's VM, ready for work: reattached when it exists (a suspended VM wakes on
    /// the first operation); with `recreate` (or when it is gone or failed and `recreate`),
    /// a new VM is booted with `devices`. A running VM with different devices is a conflict.
    /// A new VM replacing one the session had is the session's next generation; the
    /// session keeps its id and name.
    pub async fn session_vm(
        &self,
        s: &SessionRecord,
        want: &SessionDevices,
        recreate: bool,
        warn: &mut (dyn FnMut(&str) + Send),
    ) -> Result<(SessionRecord, VmRecord), CoreError> {
        // Its volume first (a host restart unmounts it): the agent state is written into it
        // and the VM's shares live on it.
        self.volume_ready(s).await?;
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
                self.start_session_vm(s, &merged, Default::default(), s.generation + 1, warn)
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
                // A session that had a VM lost its memory with it.
                let generation = s.generation + u64::from(s.vm_id.is_some());
                self.start_session_vm(s, &merged, Default::default(), generation, warn)
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
        self.volume_ready(s).await?;
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
        if s.storage_mib > 0 {
            // The whole filesystem goes: nothing the guest wrote is walked on the host.
            let paths = VolumePaths::new(&self.sessions_dir(), &s.id);
            blocking(move || volume::teardown(&paths).map_err(session_error)).await?;
        } else if !s.direct {
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
        self.volume_ready(s).await?;
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

/// The lock that serialises host passes over session `id` (in this process); also, under
/// `storage-create\0<workspace>`, a workspace's session creates on storage of their own.
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
pub(crate) async fn blocking<T, F>(f: F) -> Result<T, CoreError>
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
        storage_mib: have.storage_mib,
        template: want.template || have.template,
    }
}

#[cfg(test)]
mod tests;
