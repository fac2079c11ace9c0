//! The warm pool: VMs restored from a template ahead of demand, handed to `vm_create`.
//!
//! Pool VMs are ordinary VM records in the workspace [`POOL_WORKSPACE`], so the host limits
//! count them like any VM (a pool can never push the host past its limits, and a full host
//! refuses refills). Each was made by a template clone, so it already has its own disk
//! layer, channel secret, entropy, hostname (its id) and machine id; nothing of it is shared
//! with another VM. Its idle policy is off while it waits.
//!
//! **Hand-out** (`Warren::take_from_pool`, called by `create_vm`): one immediate SQLite
//! transaction picks the oldest running pool VM of the requested shape (image, memory, vCPUs; no shares, no NIC,
//! no RAM file), checks the caller's workspace limits and moves the record into the
//! caller's workspace with its request id and idle settings. Two callers can never get the
//! same VM: the second transaction no longer finds it in the pool. A pool VM whose
//! supervisor died meanwhile is marked failed and the next one is taken.
//!
//! **Refill** ([`Warren::fill_pool`]): creates template clones until the shape has the
//! configured number of pool VMs, and runs `true` once in each (its VMM translates the exec
//! path before a caller's first exec needs it); `warren serve` calls it in the background.

use rusqlite::OptionalExtension;
use serde::Serialize;

use super::{now_unix, CreateVm, Limits, Warren, DEFAULT_MEMORY_MIB, DEFAULT_VCPUS};
use crate::error::CoreError;
use crate::store::{self as vmstore, Usage, VmRecord, VmState};

/// The workspace pool VMs wait in.
pub const POOL_WORKSPACE: &str = "warren-pool";

/// One pool's state, as the service reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PoolStatus {
    pub image_id: String,
    pub memory_mib: u32,
    pub vcpus: u32,
    /// VMs ready to be handed out.
    pub ready: u32,
    /// VMs being restored.
    pub starting: u32,
}

/// The shape of a pool.
#[derive(Debug, Clone)]
pub struct PoolShape {
    pub image: String,
    pub memory_mib: Option<u32>,
    pub vcpus: Option<u32>,
}

impl Warren {
    /// Hands a ready pool VM of `req`'s shape to `req`'s workspace; `None` when the pool of
    /// that shape is empty (or the shape is not pooled).
    pub(super) fn take_from_pool(
        &self,
        req: &CreateVm,
        image_id: &str,
        workspace: &str,
    ) -> Result<Option<VmRecord>, CoreError> {
        if !req.mounts.is_empty() || req.ram_file || req.network.is_some() {
            return Ok(None);
        }
        let memory = req.memory_mib.unwrap_or(DEFAULT_MEMORY_MIB);
        let vcpus = req.vcpus.unwrap_or(DEFAULT_VCPUS);
        let idle_mode = req
            .idle_mode
            .unwrap_or(super::SuspendMode::Hibernate)
            .as_str();
        loop {
            let taken = self
                .store()
                .immediate(|tx| -> Result<Option<String>, CoreError> {
                    let Some(rec) = tx
                        .query_row(
                            "SELECT * FROM vms WHERE workspace = ?1 AND state = 'running'
                               AND image_id = ?2 AND memory_mib = ?3 AND vcpus = ?4
                               AND ram_file = 0 AND mounts = '[]'
                             ORDER BY created_unix, id LIMIT 1",
                            rusqlite::params![POOL_WORKSPACE, image_id, memory, vcpus],
                            vmstore::row,
                        )
                        .optional()?
                    else {
                        return Ok(None);
                    };
                    // Host usage does not change (the pool VM was counted already); the
                    // workspace takes on a whole VM.
                    req.workspace_limits.check(
                        &format!("workspace {workspace}"),
                        vmstore::usage(tx, Some(workspace))?,
                        Usage {
                            vms: 1,
                            memory_mib: u64::from(rec.memory_mib),
                            disk_mib: rec.disk_mib,
                        },
                    )?;
                    tx.execute(
                        "UPDATE vms SET workspace = ?2, request_id = ?3, idle_seconds = ?4,
                                        idle_mode = ?5, last_active_unix = ?6, generation = ?7
                         WHERE id = ?1 AND workspace = ?8",
                        rusqlite::params![
                            rec.id,
                            workspace,
                            req.request_id,
                            req.idle_seconds.unwrap_or(super::DEFAULT_IDLE_SECONDS),
                            idle_mode,
                            now_unix() as i64,
                            req.generation.unwrap_or(1) as i64,
                            POOL_WORKSPACE,
                        ],
                    )?;
                    Ok(Some(rec.id))
                })?;
            let Some(id) = taken else {
                return Ok(None);
            };
            if self.vm_dir(&id).supervisor_alive() {
                tracing::info!(vm = %id, %workspace, "handed out from the warm pool");
                return Ok(Some(self.get_vm(&id)?));
            }
            // Died while it waited: it is the caller's failed VM now only in name; record it
            // as failed (reconciliation adds the reason) and take the next one.
            tracing::warn!(vm = %id, "a pool VM's supervisor is gone; taking another");
            let _ = self.store().set_state(
                &id,
                VmState::Failed,
                Some("the warm pool VM died before it was handed out"),
                None,
            );
            let _ = self.store().immediate(|tx| -> Result<(), CoreError> {
                tx.execute(
                    "UPDATE vms SET workspace = ?2, request_id = NULL WHERE id = ?1",
                    rusqlite::params![id, POOL_WORKSPACE],
                )?;
                Ok(())
            });
        }
    }

    /// Tops up the pool of `shape` to `size` ready or starting VMs, one restore at a time;
    /// returns how many were started. Failed pool VMs are destroyed first.
    pub async fn fill_pool(
        &self,
        shape: &PoolShape,
        size: u32,
        host_limits: Limits,
    ) -> Result<u32, CoreError> {
        let image_id = self.images().resolve(&shape.image)?.to_string();
        let memory = shape.memory_mib.unwrap_or(DEFAULT_MEMORY_MIB);
        let vcpus = shape.vcpus.unwrap_or(DEFAULT_VCPUS);
        let mut started = 0;
        loop {
            let mine: Vec<VmRecord> = self
                .list_vms()?
                .into_iter()
                .filter(|r| {
                    r.workspace == POOL_WORKSPACE
                        && r.image_id == image_id
                        && r.memory_mib == memory
                        && r.vcpus == vcpus
                })
                .collect();
            for dead in mine.iter().filter(|r| r.state == VmState::Failed) {
                let _ = self.destroy_vm(&dead.id).await;
            }
            let live = mine
                .iter()
                .filter(|r| matches!(r.state, VmState::Running | VmState::Creating))
                .count() as u32;
            if live >= size {
                return Ok(started);
            }
            let req = CreateVm {
                image: Some(image_id.clone()),
                memory_mib: Some(memory),
                vcpus: Some(vcpus),
                workspace: POOL_WORKSPACE.to_string(),
                host_limits,
                idle_seconds: Some(0),
                template: true,
                ..CreateVm::default()
            };
            let mut ignore = |_: &str| {};
            let rec = self.create_vm(&req, &mut ignore).await?;
            // Its VMM translates the exec path now, so a caller's first exec finds it warm;
            // the warm-up job is the only record in its list (then evictable).
            if let Err(e) = self.warm(&rec.id, &["true"]).await {
                tracing::warn!(vm = %rec.id, error = %e, "warming a pool VM failed; destroying it");
                let _ = self.destroy_vm(&rec.id).await;
                return Err(e);
            }
            started += 1;
        }
    }

    /// Every pool's state, by shape.
    pub fn pool_status(&self) -> Result<Vec<PoolStatus>, CoreError> {
        let mut out: Vec<PoolStatus> = Vec::new();
        for r in self.list_vms()? {
            if r.workspace != POOL_WORKSPACE {
                continue;
            }
            let i = match out.iter().position(|p| {
                p.image_id == r.image_id && p.memory_mib == r.memory_mib && p.vcpus == r.vcpus
            }) {
                Some(i) => i,
                None => {
                    out.push(PoolStatus {
                        image_id: r.image_id.clone(),
                        memory_mib: r.memory_mib,
                        vcpus: r.vcpus,
                        ready: 0,
                        starting: 0,
                    });
                    out.len() - 1
                }
            };
            match r.state {
                VmState::Running => out[i].ready += 1,
                VmState::Creating => out[i].starting += 1,
                _ => {}
            }
        }
        Ok(out)
    }
}
