//! Admission of a VM whose memory comes back: a resume from hibernation (explicit, or a call
//! waking the VM) holds host memory again, so it passes the same memory limits as a create.
//!
//! The limits come from whoever opened the engine ([`Warren::set_admission`]): the service
//! gives its host limits and the owning workspace's policy; the CLI sets none, as its creates
//! do. The check and the reservation are one immediate transaction
//! ([`crate::store::Store::transition`]): the VM moves from `hibernated` to `resuming`, a
//! state whose memory counts, so a concurrent create or resume sees it. A refusal changes
//! nothing: the VM stays hibernated with its checkpoint untouched.

use std::sync::Arc;

use crate::error::CoreError;
use crate::store::{self as vmstore, Usage, VmRecord, VmState};
use crate::vm::{Limits, Warren};

/// The (host, workspace) limits that apply to a workspace's VMs, asked at each admission so
/// a changed policy applies to the next resume.
pub type LimitsFor = dyn Fn(&str) -> Result<(Limits, Limits), CoreError> + Send + Sync;

/// How a resume's reservation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reserved {
    /// The VM is now `resuming` and its memory is counted.
    Yes,
    /// The VM was no longer hibernated (another caller is resuming it).
    Stale,
}

impl Warren {
    /// Sets the limits resumes are admitted under (none until set).
    pub fn set_admission(&mut self, limits: Arc<LimitsFor>) {
        self.admission = Some(limits);
    }

    /// Reserves `rec`'s memory for a resume from hibernation: `hibernated` -> `resuming`
    /// when the host and workspace memory limits allow it, `quota_exceeded` otherwise.
    pub(crate) fn reserve_resume(&self, rec: &VmRecord) -> Result<Reserved, CoreError> {
        let (host, ws) = match &self.admission {
            Some(f) => f(&rec.workspace)?,
            None => (Limits::default(), Limits::default()),
        };
        // A resume adds memory only: its VM and its disk were admitted at create (and the
        // checkpoint it frees was counted as storage), so only memory limits apply.
        let memory_only = |l: Limits| Limits {
            max_memory_mib: l.max_memory_mib,
            ..Limits::default()
        };
        let add = Usage {
            memory_mib: u64::from(rec.memory_mib),
            ..Usage::default()
        };
        let scope = |whose: &str| format!("resuming {}: {whose}", rec.id);
        let moved = self.store().transition(
            &rec.id,
            VmState::Hibernated,
            VmState::Resuming,
            |tx| -> Result<(), CoreError> {
                memory_only(ws).check(
                    &scope(&format!("workspace {}", rec.workspace)),
                    vmstore::usage(tx, Some(&rec.workspace))?,
                    add,
                )?;
                memory_only(host).check(&scope("host"), vmstore::usage(tx, None)?, add)
            },
        )?;
        if moved {
            tracing::debug!(vm = %rec.id, mib = rec.memory_mib, "resume admitted");
            Ok(Reserved::Yes)
        } else {
            Ok(Reserved::Stale)
        }
    }

    /// Waits for another caller's resume of `id` to end (a call that wakes a VM while an
    /// explicit resume is under way), then answers with its outcome. A `resuming` record
    /// that nobody resumes any more is settled (`Warren::settle_orphaned_resume`).
    pub(crate) async fn await_resume(&self, id: &str) -> Result<VmRecord, CoreError> {
        // The holder's own deadlines (every boot attempt, a fresh boot) bound the wait; this
        // only guards against a holder that never lets go.
        let deadline = std::time::Instant::now() + self.config().boot_timeout * AWAIT_BOOTS;
        loop {
            // The record as stored: reconciling it could fail a VM whose supervisor the
            // other caller is only starting.
            let rec = self
                .store()
                .get(id)?
                .ok_or_else(|| CoreError::VmNotFound(id.to_string()))?;
            if rec.state == VmState::Running {
                return Ok(rec);
            }
            let held = self.vm_dir(id).in_transition();
            if held && std::time::Instant::now() < deadline {
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
            if rec.state == VmState::Resuming && !held {
                return self.settle_orphaned_resume(id).await;
            }
            return Err(CoreError::VmNotRunning {
                id: rec.id,
                state: rec.state.as_str().to_string(),
                reason: rec.reason,
            });
        }
    }
}

/// Boot timeouts [`Warren::await_resume`] waits at most for another caller's resume (a
/// restore, boots again, a fresh boot and its boots again).
const AWAIT_BOOTS: u32 = 8;

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::store::Store;
    use crate::vm::WarrenConfig;

    pub(crate) fn rec(id: &str, workspace: &str, memory_mib: u32) -> VmRecord {
        VmRecord {
            id: id.into(),
            image_id: "img".into(),
            state: VmState::Creating,
            reason: None,
            memory_mib,
            vcpus: 1,
            accel: "tcg".into(),
            uid: 0,
            created_unix: 1,
            boot_ms: None,
            workspace: workspace.into(),
            disk_mib: 100,
            generation: 1,
            request_id: None,
            idle_seconds: 0,
            idle_mode: "hibernate".into(),
            last_active_unix: 0,
            mounts: vec![],
            ram_file: false,
        }
    }

    fn ok(_: &rusqlite::Transaction<'_>) -> Result<(), rusqlite::Error> {
        Ok(())
    }

    fn engine(dir: &std::path::Path) -> Warren {
        Warren::open(WarrenConfig::new(dir.to_path_buf(), "/nonexistent".into())).expect("open")
    }

    fn add(s: &Store, r: VmRecord, state: VmState) {
        let mut r = r;
        s.insert(&mut r, 1, ok).expect("insert");
        s.set_state(&r.id, state, None, None).expect("state");
    }

    fn state(w: &Warren, id: &str) -> VmState {
        w.store().get(id).expect("get").expect("row").state
    }

    #[test]
    fn test_reserve_resume_over_workspace_memory_refused_then_admitted() {
        let d = tempfile::tempdir().expect("tempdir");
        let mut w = engine(d.path());
        let ws = Limits {
            max_memory_mib: Some(512),
            ..Limits::default()
        };
        w.set_admission(Arc::new(move |_: &str| Ok((Limits::default(), ws))));
        let a = rec("a", "w", 256);
        add(w.store(), a.clone(), VmState::Hibernated);
        add(w.store(), rec("b", "w", 512), VmState::Running);
        // Another workspace's VM does not count against this one's limit.
        add(w.store(), rec("c", "other", 512), VmState::Running);
        let e = w.reserve_resume(&a).expect_err("over the workspace limit");
        assert_eq!(e.code(), "quota_exceeded", "{e}");
        assert!(e.to_string().contains("workspace w"), "{e}");
        assert_eq!(state(&w, "a"), VmState::Hibernated);
        // Control: with b hibernated the same resume fits and reserves a's memory.
        w.store()
            .set_state("b", VmState::Hibernated, None, None)
            .expect("b");
        assert_eq!(w.reserve_resume(&a).expect("fits"), Reserved::Yes);
        assert_eq!(state(&w, "a"), VmState::Resuming);
        // b no longer fits beside a: a resuming VM's memory counts.
        let b = w.store().get("b").expect("get").expect("row");
        assert_eq!(
            w.reserve_resume(&b).expect_err("a holds it").code(),
            "quota_exceeded"
        );
        // A second reservation of a is stale, not a double count.
        assert_eq!(w.reserve_resume(&a).expect("stale"), Reserved::Stale);
    }

    #[test]
    fn test_reserve_resume_over_host_memory_refused_without_limits_admitted() {
        let d = tempfile::tempdir().expect("tempdir");
        let mut w = engine(d.path());
        let a = rec("a", "w", 256);
        add(w.store(), a.clone(), VmState::Hibernated);
        add(w.store(), rec("b", "other", 512), VmState::Paused);
        let host = Limits {
            max_memory_mib: Some(700),
            // Already at the VM limit: a resume adds no VM, so this does not refuse it.
            max_vms: Some(2),
            ..Limits::default()
        };
        w.set_admission(Arc::new(move |_: &str| Ok((host, Limits::default()))));
        let e = w.reserve_resume(&a).expect_err("over the host limit");
        assert!(e.to_string().contains("host"), "{e}");
        assert_eq!(state(&w, "a"), VmState::Hibernated);
        // Control: a larger host limit admits it.
        let host = Limits {
            max_memory_mib: Some(768),
            ..host
        };
        w.set_admission(Arc::new(move |_: &str| Ok((host, Limits::default()))));
        assert_eq!(w.reserve_resume(&a).expect("fits"), Reserved::Yes);
    }
}
