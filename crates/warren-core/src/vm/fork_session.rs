//! The fork of a session's VM: each copy gets a new session of its own, with a copy of the
//! session's files taken while the parent is stopped.
//!
//! 1. **Plan** ([`Warren::plan_session_fork`]): the parent must be a copy session's VM (a
//!    direct session's files are the user's directory itself, and a VM with `--mount`s
//!    outside a session has no files of its own to copy: both are refused). One new session
//!    record per copy: `<name>-fork-<hex>`, the parent session's source, owner, devices and
//!    storage size, and the copy's VM.
//! 2. **Admission**, in the fork's one transaction: the copies' session storage against the
//!    storage limits, and the session rows.
//! 3. **Directories** before the parent stops: each copy's own filesystem when the parent
//!    session has one.
//! 4. **Files**, with the parent held stopped and its jobs frozen after its save
//!    (`ForkSaveHeld`): each copy's workspace is a copy of the parent's
//!    (`warren_session::fork`), then the parent runs on (`ForkRelease`). The copies' memory
//!    and files are thus of the same instant.
//! 5. **Shares**: a copy's first share (the workspace) is its own session's; the others (the
//!    source objects, read-only; the project's agent state; `--mount`s) are the parent's
//!    directories, as every session of the project shares them. The copy's virtiofsd takes
//!    the parent's migrated state, which names files by their path in the share, so it finds
//!    them in the copy.
//!
//! If anything fails, every new session row and directory goes (the copies' VMs fail with
//! the reason).

use rand::RngCore;
use warren_session::volume::{Volume, VolumePaths};
use warren_supervisor::SupervisorConfig;

use super::{now_unix, Limits, Warren};
use crate::error::CoreError;
use crate::session::{blocking, check_storage, session_error};
use crate::store::{MountSpec, SessionRecord, VmRecord};

/// The longest the copies of a session's files may take together: the parent is held
/// stopped meanwhile (and runs on by itself after `warren_supervisor::fork::HOLD_LIMIT`,
/// which is longer).
pub const COPY_LIMIT: std::time::Duration = std::time::Duration::from_secs(300);

/// A session fork in progress.
#[derive(Debug)]
pub(super) struct SessionFork {
    parent: SessionRecord,
    /// One per copy, in the copies' order; rows inserted at admission.
    pub(super) copies: Vec<SessionRecord>,
}

impl Warren {
    /// The session whose VM is `parent` and a new session per copy in `copies` (see the
    /// module docs); `None` for a VM without shares.
    pub(super) fn plan_session_fork(
        &self,
        parent: &VmRecord,
        pcfg: &SupervisorConfig,
        copies: &[VmRecord],
    ) -> Result<Option<SessionFork>, CoreError> {
        if pcfg.launch.shares.is_empty() {
            return Ok(None);
        }
        let session = self
            .store()
            .sessions(None)?
            .into_iter()
            .find(|s| s.vm_id.as_deref() == Some(parent.id.as_str()))
            .ok_or_else(|| {
                CoreError::InvalidArgument(
                    "a VM with --mount shares cannot be forked (the copies would write the same host directories); a session's VM can".into(),
                )
            })?;
        if session.direct {
            return Err(CoreError::InvalidArgument(format!(
                "session {} is direct: its files are {} itself, which a fork cannot copy",
                session.name,
                session.source.display()
            )));
        }
        let workspace = warren_session::workspace_dir(&session.dir);
        if pcfg.launch.shares.first().map(|s| &s.host_dir) != Some(&workspace) {
            return Err(CoreError::InvalidArgument(format!(
                "VM {}'s first share is not session {}'s workspace",
                parent.id, session.name
            )));
        }
        let base: String = session.name.chars().take(48).collect();
        let copies = copies
            .iter()
            .map(|vm| {
                let mut idb = [0u8; 6];
                rand::rng().fill_bytes(&mut idb);
                let id = format!("ses-{}", hex::encode(idb));
                let dir = if session.storage_mib > 0 {
                    VolumePaths::new(&self.sessions_dir(), &id).session_dir()
                } else {
                    self.sessions_dir().join(&id)
                };
                SessionRecord {
                    name: format!("{base}-fork-{}", hex::encode(&idb[..3])),
                    id,
                    dir,
                    vm_id: Some(vm.id.clone()),
                    created_unix: now_unix(),
                    generation: 1,
                    ..session.clone()
                }
            })
            .collect();
        Ok(Some(SessionFork {
            parent: session,
            copies,
        }))
    }

    /// The new sessions' share of the fork's admission transaction: their storage against
    /// (host, workspace) limits, then their rows.
    pub(super) fn admit_session_fork(
        tx: &rusqlite::Transaction<'_>,
        plan: &SessionFork,
        limits: (Limits, Limits),
    ) -> Result<(), CoreError> {
        let add = plan.parent.storage_mib * plan.copies.len() as u64;
        check_storage(tx, &plan.parent.workspace, add, limits)?;
        for s in &plan.copies {
            crate::store::insert_session_in(tx, s).map_err(|e| match e {
                rusqlite::Error::SqliteFailure(f, _)
                    if f.code == rusqlite::ErrorCode::ConstraintViolation =>
                {
                    CoreError::Conflict(format!("a session named {:?} already exists", s.name))
                }
                e => CoreError::Store(e),
            })?;
        }
        Ok(())
    }

    /// Each copy's own filesystem, when the parent session has one (before the parent stops:
    /// making one takes a while).
    pub(super) async fn make_session_fork_volumes(
        &self,
        plan: &SessionFork,
    ) -> Result<(), CoreError> {
        if plan.parent.storage_mib == 0 {
            return Ok(());
        }
        for s in &plan.copies {
            let paths = VolumePaths::new(&self.sessions_dir(), &s.id);
            let mib = plan.parent.storage_mib;
            // The row stands for the volume from here on; the lock goes with the handle.
            let made: Volume =
                blocking(move || Volume::create(&paths, mib).map_err(session_error)).await?;
            drop(made);
        }
        Ok(())
    }

    /// Copies the parent session's files into every copy's directory (the parent is held
    /// stopped meanwhile), all within [`COPY_LIMIT`].
    pub(super) async fn copy_session_fork_files(
        &self,
        plan: &SessionFork,
    ) -> Result<(), CoreError> {
        let deadline = std::time::Instant::now() + COPY_LIMIT;
        let owner = (plan.parent.owner_uid != nix::unistd::geteuid().as_raw()).then_some(
            warren_session::Owner {
                uid: plan.parent.owner_uid,
                gid: plan.parent.owner_gid,
            },
        );
        for s in &plan.copies {
            let (from, to) = (plan.parent.dir.clone(), s.dir.clone());
            let t = std::time::Instant::now();
            let f = blocking(move || {
                warren_session::fork(&from, &to, owner, deadline).map_err(session_error)
            })
            .await?;
            tracing::info!(
                session = %s.id,
                files = f.files,
                bytes = f.bytes,
                ms = t.elapsed().as_millis() as u64,
                "session files copied for a fork"
            );
            if let Some(first) = f.skipped.first() {
                // Counted, not listed: the guest decides how many there are.
                tracing::warn!(
                    session = %s.id,
                    count = f.skipped_total,
                    first = %first.path.display(),
                    "special files not copied (FIFOs, sockets, device nodes)"
                );
            }
        }
        Ok(())
    }

    /// Removes every new session of a failed fork: directories (or filesystems), then rows.
    pub(super) fn discard_session_fork(&self, plan: &SessionFork) {
        for s in &plan.copies {
            self.discard_copy(&s.id, &s.dir, false, None);
            if let Err(e) = self.store().delete_session(&s.id) {
                tracing::warn!(session = %s.id, error = %e, "removing a failed fork's session");
            }
        }
    }
}

impl SessionFork {
    /// Copy `i`'s shares: the parent's, with the first (the workspace) its own session's.
    pub(super) fn shares_of_copy(
        &self,
        i: usize,
        parent: &[warren_vmm::backend::Share],
    ) -> Result<Vec<warren_vmm::backend::Share>, CoreError> {
        let mut shares = parent.to_vec();
        let ws = warren_session::workspace_dir(&self.copies[i].dir);
        let ws = ws
            .canonicalize()
            .map_err(|e| CoreError::io("resolve", &ws, e))?;
        let identity = warren_vmm::qemu::virtiofs::identity_of(&ws)
            .map_err(|e| CoreError::io("stat", &ws, e))?;
        if let Some(first) = shares.first_mut() {
            first.host_dir = ws;
            first.identity = Some(identity);
        }
        Ok(shares)
    }

    /// Copy `i`'s VM record mounts: the parent's, with the first its own workspace.
    pub(super) fn mounts_of_copy(&self, i: usize, parent: &[MountSpec]) -> Vec<MountSpec> {
        let mut mounts = parent.to_vec();
        if let Some(first) = mounts.first_mut() {
            first.host = warren_session::workspace_dir(&self.copies[i].dir);
            first.identity = None;
        }
        mounts
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vm::WarrenConfig;
    use std::path::PathBuf;
    use warren_vmm::backend::{MemMib, Share};
    use warren_vmm::{Accel, LaunchSpec};

    fn warren(state: &std::path::Path) -> Warren {
        Warren::open(WarrenConfig::new(
            state.to_path_buf(),
            "/usr/bin/warren".into(),
        ))
        .expect("open")
    }

    fn vm(id: &str) -> VmRecord {
        crate::vm::test_vm(id)
    }

    /// The parent's supervisor config with one share per host directory.
    fn config(vm_id: &str, shares: &[PathBuf]) -> SupervisorConfig {
        let p = PathBuf::from;
        SupervisorConfig {
            vm_id: vm_id.into(),
            launch: LaunchSpec {
                name: vm_id.into(),
                run_dir: p("/nonexistent/run"),
                stderr_log: p("/nonexistent/stderr"),
                kernel: p("/nonexistent/kernel"),
                initramfs: p("/nonexistent/initramfs"),
                disk: p("/nonexistent/disk"),
                memory: MemMib(256),
                vcpus: 1,
                accel: Accel::Tcg,
                cpu: None,
                extra_cmdline: vec![],
                run_as: None,
                cgroup: None,
                incoming: false,
                shares: shares
                    .iter()
                    .enumerate()
                    .map(|(i, d)| Share {
                        tag: format!("fs{i}"),
                        host_dir: d.clone(),
                        read_only: false,
                        owner: None,
                        identity: None,
                    })
                    .collect(),
                virtiofsd: None,
                ram_file: None,
                network: None,
                bench_port: None,
                view_readable: vec![],
                template_ram: None,
                clone_ram: None,
                fork_ram: None,
                named_ram: false,
                groups: vec![],
            },
            boot_timeout_ms: 1000,
            restore: false,
            clone: None,
            restore_from: None,
        }
    }

    fn session(w: &Warren, name: &str, vm_id: &str, direct: bool) -> SessionRecord {
        let id = format!("ses-{name}");
        let s = SessionRecord {
            id: id.clone(),
            name: name.into(),
            workspace: "local-0".into(),
            owner_uid: 0,
            owner_gid: 0,
            source: PathBuf::from("/nonexistent/project"),
            source_git: (!direct).then(|| PathBuf::from("/nonexistent/project/.git")),
            dir: w.sessions_dir().join(&id),
            direct,
            vm_id: Some(vm_id.into()),
            created_unix: 0,
            devices: serde_json::json!({}),
            storage_mib: 0,
            generation: 1,
        };
        w.store()
            .insert_session(&s, |_| Ok::<(), rusqlite::Error>(()))
            .expect("insert session");
        s
    }

    #[test]
    fn test_plain_vm_without_shares_is_no_session_fork() {
        let state = tempfile::tempdir().expect("state");
        let w = warren(state.path());
        let parent = vm("vm-000000000001");
        let plan = w
            .plan_session_fork(&parent, &config(&parent.id, &[]), &[vm("vm-00000000000c")])
            .expect("plan");
        assert!(plan.is_none());
    }

    #[test]
    fn test_vm_with_mounts_outside_a_session_refused() {
        let state = tempfile::tempdir().expect("state");
        let w = warren(state.path());
        let parent = vm("vm-000000000002");
        // A session of another VM does not make this one a session's.
        session(&w, "other", "vm-0000000000ff", false);
        let e = w
            .plan_session_fork(
                &parent,
                &config(&parent.id, &[PathBuf::from("/srv/data")]),
                &[vm("vm-00000000000c")],
            )
            .expect_err("refused");
        assert_eq!(e.code(), "invalid_argument", "{e}");
        assert!(e.to_string().contains("--mount"), "{e}");
    }

    #[test]
    fn test_direct_session_refused() {
        let state = tempfile::tempdir().expect("state");
        let w = warren(state.path());
        let parent = vm("vm-000000000003");
        let s = session(&w, "mine", &parent.id, true);
        let e = w
            .plan_session_fork(
                &parent,
                &config(&parent.id, std::slice::from_ref(&s.source)),
                &[vm("vm-00000000000c")],
            )
            .expect_err("refused");
        assert_eq!(e.code(), "invalid_argument", "{e}");
        assert!(e.to_string().contains("is direct"), "{e}");
    }

    #[test]
    fn test_session_whose_first_share_is_not_its_workspace_refused() {
        let state = tempfile::tempdir().expect("state");
        let w = warren(state.path());
        let parent = vm("vm-000000000004");
        session(&w, "mine", &parent.id, false);
        let e = w
            .plan_session_fork(
                &parent,
                &config(&parent.id, &[PathBuf::from("/srv/elsewhere")]),
                &[vm("vm-00000000000c")],
            )
            .expect_err("refused");
        assert_eq!(e.code(), "invalid_argument", "{e}");
        assert!(e.to_string().contains("workspace"), "{e}");
    }

    #[test]
    fn test_copy_session_plans_one_new_session_per_copy() {
        let state = tempfile::tempdir().expect("state");
        let w = warren(state.path());
        let parent = vm("vm-000000000005");
        let s = session(&w, "mine", &parent.id, false);
        let ws = warren_session::workspace_dir(&s.dir);
        let copies = [vm("vm-00000000000c"), vm("vm-00000000000d")];
        let plan = w
            .plan_session_fork(
                &parent,
                &config(&parent.id, &[ws, PathBuf::from("/srv/objects")]),
                &copies,
            )
            .expect("plan")
            .expect("a session fork");
        assert_eq!(plan.copies.len(), 2);
        for (c, v) in plan.copies.iter().zip(&copies) {
            assert!(c.name.starts_with("mine-fork-"), "{}", c.name);
            assert_eq!(c.vm_id.as_deref(), Some(v.id.as_str()));
            assert_ne!(c.id, s.id);
            assert_ne!(c.dir, s.dir);
            assert!(!c.direct);
        }
        assert_ne!(plan.copies[0].id, plan.copies[1].id);
        let mounts = plan.mounts_of_copy(
            1,
            &[crate::store::MountSpec {
                host: warren_session::workspace_dir(&s.dir),
                guest: "/workspace".into(),
                read_only: false,
                owner: None,
                identity: None,
            }],
        );
        assert_eq!(
            mounts[0].host,
            warren_session::workspace_dir(&plan.copies[1].dir)
        );
    }
}
