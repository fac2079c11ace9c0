//! The session tools (`session_create`, `session_list`, `session_status`,
//! `session_export`, `session_delete`): host paths checked as the caller, generations
//! compared, the work done by the engine.

use super::*;

/// A session record as the `session_*` tools return it.
pub fn session_info(s: &warren_core::SessionRecord) -> SessionInfo {
    let workspace_dir = if s.direct {
        s.source.clone()
    } else {
        warren_session::workspace_dir(&s.dir)
    };
    SessionInfo {
        session_id: s.id.clone(),
        name: s.name.clone(),
        source: s.source.to_string_lossy().into_owned(),
        direct: s.direct,
        workspace_dir: workspace_dir.to_string_lossy().into_owned(),
        vm_id: s.vm_id.clone(),
        created_unix: s.created_unix,
        storage_mib: (s.storage_mib > 0).then_some(s.storage_mib),
        generation: s.generation,
    }
}

impl Service {
    /// The caller's session, refused with `conflict` (changing nothing) unless it is at
    /// `expected_generation` when one is given.
    pub(super) fn session(
        &self,
        p: &Principal,
        session: &str,
        expected_generation: Option<u64>,
    ) -> Result<warren_core::SessionRecord, ApiError> {
        let s = self.warren.session(&p.workspace, session)?;
        warren_core::vm::check_generation(
            &format!("session {}", s.name),
            s.generation,
            expected_generation,
        )?;
        Ok(s)
    }

    /// `session_create`: the repository is checked as the caller (host path rules), the
    /// session belongs to the uid it was checked as, and its VM is admitted under the same
    /// limits as `vm_create`. With a `request_id`, a retry with the same arguments gets the
    /// recorded outcome (a create that failed made nothing, and its key stays free for a
    /// corrected retry), a concurrent one `busy`; one cut off by the service's stop gets
    /// `outcome_unknown` (its session, if it was made, is in `session_list`).
    pub(super) async fn session_create(
        &self,
        p: &Principal,
        a: SessionCreateArgs,
    ) -> Result<Value, ApiError> {
        let Some(rid) = a.request_id.clone() else {
            return self.make_session(p, a).await;
        };
        validate_request_id(&rid)?;
        let hash = args_hash(&a);
        let _guard = self.enter(p, "session_create", &rid)?;
        match self
            .receipts
            .claim(&p.workspace, "session_create", &rid, &hash)?
        {
            Claim::Done(v) => return replay(v),
            Claim::Pending => {
                return Err(ApiError::new(
                    "outcome_unknown",
                    format!(
                        "session_create request {rid} was cut off by the service's stop; \
                         its session, if it was made, is in session_list (delete it if it \
                         is not wanted); use a new request_id"
                    ),
                ))
            }
            Claim::New => {}
        }
        match self.make_session(p, a).await {
            Ok(v) => {
                let stored = serde_json::json!({ "ok": v });
                self.receipts
                    .complete(&p.workspace, "session_create", &rid, &stored)?;
                replay(stored)
            }
            Err(e) => {
                // Refused or failed: nothing was made (the engine removes a half-made
                // session), so the key stays free.
                self.receipts
                    .release(&p.workspace, "session_create", &rid)?;
                Err(e)
            }
        }
    }

    /// The work of `session_create`.
    async fn make_session(&self, p: &Principal, a: SessionCreateArgs) -> Result<Value, ApiError> {
        let access = if a.direct {
            crate::hostpath::Access::ReadWrite
        } else {
            crate::hostpath::Access::Read
        };
        let host = crate::hostpath::authorize(p, &self.cfg.host_roots, &a.repo, access)?;
        let (name, img) = self.configured_image(p, a.image.as_deref())?;
        let memory = checked_size(&name, &img, a.memory_mib, a.vcpus)?;
        let network = self.network_for(p, a.network, a.egress)?;
        let req = warren_core::CreateSession {
            repo: host.path,
            name: a.name,
            direct: a.direct,
            devices: warren_core::SessionDevices {
                image: Some(img.id.clone()),
                memory_mib: Some(memory),
                vcpus: a.vcpus,
                mounts: vec![],
                network,
                // A direct session serves the directory checked as the caller, or nothing.
                source_identity: a.direct.then_some(host.identity),
                objects_identity: None,
                storage_mib: a.storage_mib,
                template: img.template || img.pool > 0,
            },
            owner: (host.uid, host.gid),
            workspace: p.workspace.clone(),
            limits: (self.cfg.host_limits(), workspace_limits(p)),
            within: host.root,
        };
        let (s, _vm) = self
            .warren
            .create_session(&req, &mut |w| tracing::warn!("{w}"))
            .await?;
        to_value(session_info(&s))
    }

    /// `session_list`, `session_status`, `session_export` and `session_delete`.
    pub(super) async fn session_tool(
        &self,
        p: &Principal,
        tool: &str,
        args: Value,
    ) -> Result<Value, ApiError> {
        match tool {
            "session_list" => {
                let _: NoArgs = parse(args)?;
                let sessions = self
                    .warren
                    .list_sessions(Some(&p.workspace))?
                    .iter()
                    .map(session_info)
                    .collect();
                to_value(SessionList { sessions })
            }
            "session_status" => {
                let a: SessionRef = parse(args)?;
                let s = self.session(p, &a.session, a.expected_generation)?;
                let r = self.warren.session_retention(&s).await?;
                to_value(SessionStatus {
                    session_id: s.id,
                    generation: s.generation,
                    uncommitted: r.uncommitted,
                    unexported: r.unexported,
                })
            }
            "session_export" => {
                let a: SessionExportArgs = parse(args)?;
                let s = self.session(p, &a.session, a.expected_generation)?;
                // Writing into the source repository needs the caller's write access now.
                crate::hostpath::authorize(
                    p,
                    &self.cfg.host_roots,
                    &s.source.to_string_lossy(),
                    crate::hostpath::Access::ReadWrite,
                )?;
                let e = self.warren.export_session(&s, a.branch.as_deref()).await?;
                to_value(SessionExported {
                    refname: e.refname,
                    commit: e.commit,
                    new_commits: e.new_commits as u64,
                })
            }
            "session_delete" => {
                let a: SessionDeleteArgs = parse(args)?;
                let s = self.session(p, &a.session, a.expected_generation)?;
                if let Some(vm) = &s.vm_id {
                    self.forget_vm(vm);
                }
                self.warren.delete_session(&s, a.force).await?;
                to_value(SessionDeleted {
                    session_id: s.id,
                    deleted: true,
                })
            }
            other => Err(ApiError::internal(format!("{other} is not a session tool"))),
        }
    }
}
