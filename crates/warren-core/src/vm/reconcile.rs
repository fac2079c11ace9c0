//! VM records against their supervisors: listing with reconciliation, re-adoption after a
//! service restart, stale network namespaces, destroy, logs.

use std::path::{Path, PathBuf};
use std::time::Duration;

use warren_supervisor::{ExitRecord, SupervisorClient};
use warren_vmm::sys::cgroup;

use super::{kill_supervisor, wait_supervisor_exit, Warren};
use crate::error::CoreError;
use crate::store::{VmRecord, VmState};

/// Attempts, 1 ms apart, at a dead-looking VM's transition lock (another listing holds it
/// for the instant of its own probe or failing).
const RECONCILE_LOCK_TRIES: u32 = 20;

impl Warren {
    /// All VMs, with states reconciled against their supervisors.
    pub fn list_vms(&self) -> Result<Vec<VmRecord>, CoreError> {
        let mut out = Vec::new();
        for rec in self.store.list()? {
            out.push(self.reconcile(rec)?);
        }
        self.sweep_netns();
        self.sweep_volumes();
        Ok(out)
    }

    /// The VM `workspace` created with request `request_id`, reconciled.
    pub fn vm_by_request(
        &self,
        workspace: &str,
        request_id: &str,
    ) -> Result<Option<VmRecord>, CoreError> {
        match self.store.by_request(workspace, request_id)? {
            Some(rec) => Ok(Some(self.reconcile(rec)?)),
            None => Ok(None),
        }
    }

    pub fn get_vm(&self, id: &str) -> Result<VmRecord, CoreError> {
        let rec = self
            .store
            .get(id)?
            .ok_or_else(|| CoreError::VmNotFound(id.to_string()))?;
        self.reconcile(rec)
    }

    /// On service start: asks every live supervisor who it is, all at once (each answer is
    /// bounded by the `Status` deadline, so a stuck supervisor delays nobody else's). One
    /// serving the recorded VM (and, while the VM runs, with its VMM alive) is re-adopted;
    /// any other answer marks the VM failed with the reason. Returns (adopted, failed) VM ids.
    pub async fn adopt_supervisors(&self) -> Result<(Vec<String>, Vec<String>), CoreError> {
        let (mut adopted, mut failed) = (Vec::new(), Vec::new());
        let mut asked = tokio::task::JoinSet::new();
        let listed = self.list_vms()?;
        // Records written readable by all before they were made owner-only (an upgrade):
        // narrowed now, not at the VM's next write of them.
        for rec in &listed {
            let dir = self.vm_dir(&rec.id);
            for f in [
                dir.exit_record(),
                dir.checkpoint_record(),
                super::jobs_seen::path(&dir),
            ] {
                if let Err(e) = warren_vmm::sys::private_file::restrict(&f) {
                    tracing::warn!(vm = %rec.id, file = %f.display(), error = %e, "narrowing to 0600");
                }
            }
        }
        // Resumes an earlier engine left half-way (it died or was stopped mid-way): settled
        // now rather than at the next call that wakes them.
        for rec in &listed {
            if rec.state == VmState::Resuming && !self.vm_dir(&rec.id).in_transition() {
                match self.settle_orphaned_resume(&rec.id).await {
                    Ok(_) => adopted.push(rec.id.clone()),
                    Err(CoreError::VmNotRunning { state, .. }) if state == "failed" => {
                        failed.push(rec.id.clone())
                    }
                    Err(e) => {
                        tracing::warn!(vm = %rec.id, error = %e, "settling an abandoned resume")
                    }
                }
            }
        }
        for rec in listed {
            if !matches!(rec.state, VmState::Running | VmState::Paused) {
                continue;
            }
            let client = SupervisorClient::new(&self.vm_dir(&rec.id).socket());
            asked.spawn(async move { (rec, client.status().await) });
        }
        while let Some(joined) = asked.join_next().await {
            let Ok((rec, answer)) = joined else {
                continue;
            };
            let problem = match answer {
                Ok(st) if st.vm_id != rec.id => Some(format!(
                    "supervisor identity mismatch: it serves {:?}, not {}",
                    st.vm_id, rec.id
                )),
                Ok(st) => match st.vmm_pid {
                    Some(pid) if Path::new(&format!("/proc/{pid}")).exists() => None,
                    _ => Some("the supervisor has no live VMM".to_string()),
                },
                Err(e) => Some(format!("the supervisor does not answer: {e}")),
            };
            match problem {
                None => adopted.push(rec.id),
                Some(reason) => {
                    tracing::warn!(vm = %rec.id, %reason, "not re-adopted");
                    self.store
                        .set_state(&rec.id, VmState::Failed, Some(&reason), None)?;
                    failed.push(rec.id);
                }
            }
        }
        Ok((adopted, failed))
    }

    /// Removes the network namespaces of this state directory's VMs that have no live
    /// supervisor (a crashed supervisor cannot remove its own). A live supervisor holds its
    /// lock before it creates the namespace, so a VM being created is never swept; namespaces
    /// of VMs this state directory does not know (another Warren's) are left alone.
    pub fn sweep_netns(&self) {
        for name in warren_supervisor::network::list_netns() {
            let id = &name[warren_supervisor::network::NETNS_PREFIX.len()..];
            let plain =
                !id.is_empty() && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-');
            if !plain
                || !self.vm_dir(id).path().is_dir()
                || self.vm_dir(id).in_transition()
                || self.vm_dir(id).supervisor_alive()
            {
                continue;
            }
            tracing::info!(netns = %name, "removing a stale network namespace");
            warren_supervisor::network::delete_netns(&name);
        }
    }

    /// A running VM whose supervisor is gone becomes failed with the recorded reason, and
    /// anything left in its cgroup is killed.
    fn reconcile(&self, mut rec: VmRecord) -> Result<VmRecord, CoreError> {
        let held = matches!(
            rec.state,
            VmState::Running | VmState::Paused | VmState::Hibernating | VmState::Resuming
        );
        if !held {
            return Ok(rec);
        }
        let dir = self.vm_dir(&rec.id);
        // A resume between supervisors (starting one, or booting again) is no dead VM. The
        // transition lock is asked first: probing the supervisor's lock while a supervisor
        // starts is what that supervisor has to retry past.
        if dir.in_transition() || dir.supervisor_alive() {
            return Ok(rec);
        }
        // The VM looks dead: it is failed (its cgroup killed) under its transition lock, and
        // only if it still looks dead once that is held. Without the lock, a resume that began
        // after the check above would have its new VMM killed and its record failed.
        let Some(_transition) = self.transition_for_reconcile(&dir) else {
            return Ok(rec);
        };
        let Some(fresh) = self.store.get(&rec.id)? else {
            return Ok(rec);
        };
        rec = fresh;
        let held = matches!(
            rec.state,
            VmState::Running | VmState::Paused | VmState::Hibernating | VmState::Resuming
        );
        if !held || dir.supervisor_alive() {
            return Ok(rec);
        }
        if rec.state == VmState::Hibernating && dir.read_checkpoint().is_some() {
            // The checkpoint was completed (and fsynced) before the supervisor went away.
            self.store
                .set_state(&rec.id, VmState::Hibernated, None, None)?;
            rec.state = VmState::Hibernated;
            return Ok(rec);
        }
        let reason = match dir.read_exit() {
            Some(ExitRecord { reason, .. }) => reason,
            None => "the supervisor exited unexpectedly (its VMM was killed with it)".to_string(),
        };
        if let Some(h) = cgroup::Hierarchy::detect() {
            let _ = cgroup::kill_and_remove(&h.vm_cgroup(&rec.id));
        }
        warren_supervisor::network::delete_netns(&warren_supervisor::network::netns_name(&rec.id));
        self.store
            .set_state(&rec.id, VmState::Failed, Some(&reason), None)?;
        rec.state = VmState::Failed;
        rec.reason = Some(reason);
        Ok(rec)
    }

    /// The transition lock of a VM that looked dead, for [`Warren::reconcile`]; `None` when
    /// another holds it past a few tries (a resume or destroy under way, or another listing
    /// failing the same VM: the record is then left as it is for this answer) or when it
    /// cannot be taken (a VM directory gone or not this caller's to lock).
    fn transition_for_reconcile(
        &self,
        dir: &warren_supervisor::layout::VmDir,
    ) -> Option<nix::fcntl::Flock<std::fs::File>> {
        for _ in 0..RECONCILE_LOCK_TRIES {
            match super::suspend::try_transition(dir) {
                Ok(Some(lock)) => return Some(lock),
                Ok(None) => std::thread::sleep(Duration::from_millis(1)),
                Err(e) => {
                    tracing::debug!(error = %e, "not reconciled: no transition lock");
                    return None;
                }
            }
        }
        None
    }

    /// Stops the VM if it runs and removes every trace of it.
    pub async fn destroy_vm(&self, id: &str) -> Result<(), CoreError> {
        let rec = self
            .store
            .get(id)?
            .ok_or_else(|| CoreError::VmNotFound(id.to_string()))?;
        let dir = self.vm_dir(&rec.id);
        // Never while a resume is between supervisors: it would launch into a removed
        // directory, or leave its supervisor running with no record.
        let _transition = match dir.path().is_dir() {
            true => match super::suspend::begin_transition(&dir).await? {
                Some(lock) => Some(lock),
                None => {
                    return Err(CoreError::Busy(format!(
                        "{id} is being created or resumed; destroy it once that ended"
                    )))
                }
            },
            false => None,
        };
        self.halt(&rec.id).await?;
        // Out of its name first, in one step, while the transition lock is held: a resume
        // waiting for the lock then finds no VM directory (and creates no file in the one
        // being removed).
        let gone = self.cfg.state_dir.join("vms").join(format!(
            ".destroyed-{}-{}",
            rec.id,
            std::process::id()
        ));
        // The directory's own lock, held until it is gone: a sweep or another destroy never
        // removes it beside this one (`orphans::lock_dir`).
        let mut held = Vec::new();
        match super::orphans::lock_dir(dir.path()) {
            Ok(Some(l)) => held.push(l),
            Ok(None) => {
                return Err(CoreError::Busy(format!(
                    "{id} is being destroyed; retry once that ended"
                )))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(CoreError::io("lock", dir.path(), e)),
        }
        let doomed = match std::fs::rename(dir.path(), &gone) {
            Ok(()) => vec![gone],
            // Already out of its name: what an earlier destroy that died half-way moved
            // aside goes before the record, whose uid the next VM may get (a `run/` owned by
            // that uid must not outlive it: a hostile review).
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let prefix = format!(".destroyed-{}-", rec.id);
                let vms = self.cfg.state_dir.join("vms");
                let mut found = Vec::new();
                for e in std::fs::read_dir(&vms).map_err(|e| CoreError::io("list", &vms, e))? {
                    let e = e.map_err(|e| CoreError::io("list", &vms, e))?;
                    if !e.file_name().to_string_lossy().starts_with(&prefix) {
                        continue;
                    }
                    match super::orphans::lock_dir(&e.path()) {
                        Ok(Some(l)) => held.push(l),
                        // Another destroy is removing it.
                        Ok(None) => {
                            return Err(CoreError::Busy(format!(
                                "{id} is being destroyed; retry once that ended"
                            )))
                        }
                        Err(err) if err.kind() == std::io::ErrorKind::NotFound => continue,
                        Err(err) => return Err(CoreError::io("lock", e.path(), err)),
                    }
                    found.push(e.path());
                }
                found
            }
            Err(e) => return Err(CoreError::io("rename", dir.path(), e)),
        };
        // Its `run/` is the VMM's to shape: removed without recursion (std's recursive
        // removal overflowed the service's 2 MiB worker stack on 16,000 nested directories a
        // compromised VMM made there, and the whole service aborted), on the blocking pool
        // (such a tree takes seconds to remove).
        for doomed in doomed {
            let removing = doomed.clone();
            let removed =
                tokio::task::spawn_blocking(move || warren_session::remove_tree(&removing))
                    .await
                    .unwrap_or_else(|e| Err(std::io::Error::other(e.to_string())));
            match removed {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(CoreError::io("remove", &doomed, e)),
            }
        }
        self.store.delete(&rec.id)?;
        Ok(())
    }

    /// Stops whatever of VM `id` runs: its supervisor (asked, then killed) and every process
    /// in its cgroup. Also for a start that failed after its VMM came up (a clone's or a fork
    /// copy's settling, a state update), which must not leave a VM running under a `failed`
    /// record, counted nowhere.
    pub(super) async fn halt(&self, id: &str) -> Result<(), CoreError> {
        let dir = self.vm_dir(id);
        if dir.supervisor_alive() {
            let client = SupervisorClient::new(&dir.socket());
            if let Err(e) = client.stop().await {
                tracing::warn!(error = %e, "stop request failed; killing the supervisor");
            }
            if !wait_supervisor_exit(&dir, Duration::from_secs(10)).await {
                kill_supervisor(&dir);
                wait_supervisor_exit(&dir, Duration::from_secs(5)).await;
            }
        }
        if let Some(h) = cgroup::Hierarchy::detect() {
            cgroup::kill_and_remove(&h.vm_cgroup(id))?;
        }
        Ok(())
    }

    /// The VM's console log (bounded by the supervisor).
    pub fn logs(&self, id: &str) -> Result<String, CoreError> {
        let rec = self
            .store
            .get(id)?
            .ok_or_else(|| CoreError::VmNotFound(id.to_string()))?;
        Ok(self.vm_dir(&rec.id).console_text())
    }

    /// The VM's network as launched (`None`: no NIC, or no readable configuration), from its
    /// supervisor configuration.
    pub fn vm_network(&self, id: &str) -> Option<warren_vmm::NetSpec> {
        self.vm_network_checked(id).ok().flatten()
    }

    /// [`Warren::vm_network`], failing when the configuration cannot be read (what admits a
    /// fork's copies must not take an unreadable configuration for "no network").
    pub fn vm_network_checked(&self, id: &str) -> Result<Option<warren_vmm::NetSpec>, CoreError> {
        let dir = warren_supervisor::layout::VmDir(self.vm_dir_path(id));
        let text = std::fs::read_to_string(dir.config())
            .map_err(|e| CoreError::io("read", dir.config(), e))?;
        let cfg: warren_supervisor::layout::SupervisorConfig = serde_json::from_str(&text)
            .map_err(|e| CoreError::InvalidArgument(format!("supervisor config: {e}")))?;
        Ok(cfg.launch.network)
    }

    pub fn vm_dir_path(&self, id: &str) -> PathBuf {
        self.vm_dir(id).0
    }
}

#[cfg(test)]
mod tests {
    use crate::store::{VmRecord, VmState};

    /// An engine on a fresh state directory (kept alive by the returned guard) holding one
    /// `resuming` VM record `id` with its (empty) VM directory, and no supervisor.
    fn resuming_vm(id: &str) -> (tempfile::TempDir, crate::Warren, VmRecord) {
        let (state, w, rec) = crate::vm::test_engine_with_vm(id);
        w.store
            .set_state(&rec.id, VmState::Resuming, None, None)
            .expect("resuming");
        std::fs::create_dir_all(w.vm_dir(&rec.id).path()).expect("vm dir");
        (state, w, rec)
    }

    /// A VM whose resume is between supervisors (the engine holds its transition lock) is
    /// left `resuming` by a listing and cannot be destroyed; once the lock is gone with no
    /// supervisor, it is failed.
    #[tokio::test]
    async fn test_list_leaves_a_resume_between_supervisors_alone() {
        let (_state, w, rec) = resuming_vm("vm-0123456789ab");
        let dir = w.vm_dir(&rec.id);
        let held = super::super::suspend::try_transition(&dir)
            .expect("lock")
            .expect("free");
        assert!(dir.in_transition());
        assert!(
            super::super::suspend::try_transition(&dir)
                .expect("second")
                .is_none(),
            "a second resume finds it held"
        );
        let listed = w.list_vms().expect("list");
        assert_eq!(listed[0].state, VmState::Resuming, "left alone while held");
        assert_eq!(w.get_vm(&rec.id).expect("get").state, VmState::Resuming);
        let e = w.destroy_vm(&rec.id).await.expect_err("busy");
        assert_eq!(e.code(), "busy", "{e}");
        assert!(dir.path().is_dir(), "nothing removed");
        drop(held);
        assert!(!dir.in_transition());
        let listed = w.list_vms().expect("list");
        assert_eq!(listed[0].state, VmState::Failed, "nobody is resuming it");
    }

    /// A record read before a transition ended (here `resuming`, since put back to
    /// `hibernated` by its resume) is read again under the transition lock before anything is
    /// failed: the VM is left as the store now says, never failed on the stale copy (before,
    /// a listing that read the record as a resume began could kill the VMM that resume had
    /// just started and fail the VM).
    #[test]
    fn test_reconcile_reads_the_record_again_under_the_transition_lock() {
        let (_state, w, stale) = resuming_vm("vm-5ca1eca11ed0");
        w.store
            .set_state(&stale.id, VmState::Hibernated, None, None)
            .expect("hibernated");
        let rec = w.reconcile(stale.clone()).expect("reconcile");
        assert_eq!(
            rec.state,
            VmState::Hibernated,
            "the store's state, not the copy's"
        );
        let stored = w.store.get(&stale.id).expect("get").expect("record");
        assert_eq!(stored.state, VmState::Hibernated, "not failed");
        // Positive control: the same stale copy while the store still says resuming (and
        // nothing runs) is failed.
        w.store
            .set_state(&stale.id, VmState::Resuming, None, None)
            .expect("resuming");
        assert_eq!(
            w.reconcile(stale).expect("reconcile").state,
            VmState::Failed
        );
    }

    /// A caller that waited for another caller's resume, which ended with the VM still
    /// hibernated (refused), makes its own attempt and answers with its own refusal (here:
    /// no checkpoint), not with "hibernated" (which it did before).
    #[tokio::test]
    async fn test_a_waiter_makes_its_own_attempt_when_the_other_resume_ended_without_one() {
        let (_state, w, rec) = resuming_vm("vm-0badc0ffee00");
        let dir = w.vm_dir(&rec.id);
        let held = super::super::suspend::try_transition(&dir)
            .expect("lock")
            .expect("free");
        let (engine, id) = (w.share(), rec.id.clone());
        let waiter = tokio::spawn(async move { engine.resume_vm(&id).await });
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        assert!(!waiter.is_finished(), "the waiter must wait for the holder");
        // The holder's resume is refused: the record goes back to hibernated.
        w.store
            .set_state(&rec.id, VmState::Hibernated, None, None)
            .expect("hibernated");
        drop(held);
        let e = waiter.await.expect("join").expect_err("no checkpoint");
        assert!(e.to_string().contains("no completed checkpoint"), "{e}");
    }

    /// A destroy that finds its VM's directory already moved aside (an earlier destroy died
    /// half-way) removes what was moved before the record, whose uid the next VM may get;
    /// another VM's is left alone. (Before, the record went and the directory, its `run/`
    /// owned by that uid, stayed.)
    #[tokio::test]
    async fn test_destroy_again_removes_what_a_dead_destroy_moved_aside() {
        let (_state, w, rec) = crate::vm::test_engine_with_vm("vm-0123456789ab");
        let vms = w.cfg.state_dir.join("vms");
        let moved = vms.join(format!(".destroyed-{}-4294967294", rec.id));
        let others = vms.join(".destroyed-vm-0123456789ac-4294967294");
        for d in [&moved, &others] {
            std::fs::create_dir_all(d.join("run/x")).expect("mkdir");
            std::fs::write(d.join("disk.qcow2"), b"disk").expect("write");
        }
        assert!(!w.vm_dir(&rec.id).path().exists());
        // While a destroy still removes it (holding the directory's lock): busy, nothing
        // changed.
        let live = crate::vm::orphans::lock_dir(&moved)
            .expect("lock")
            .expect("free");
        let r = w.destroy_vm(&rec.id).await;
        assert!(matches!(r, Err(crate::CoreError::Busy(_))), "{r:?}");
        assert!(moved.join("disk.qcow2").exists());
        assert!(
            w.store.get(&rec.id).expect("store").is_some(),
            "the record stays"
        );
        drop(live);
        w.destroy_vm(&rec.id).await.expect("destroyed");
        assert!(!moved.exists(), "what the dead destroy moved aside is gone");
        assert!(others.join("disk.qcow2").exists(), "another VM's is kept");
        assert!(
            w.store.get(&rec.id).expect("store").is_none(),
            "the record is gone"
        );
    }

    /// A VM's `run/` belongs to its VMM, which can fill it with a tree of any shape: a
    /// destroy removes one deeper than std's recursive removal could on the stack it runs on
    /// (the service's 2 MiB worker overflowed and the whole service aborted at 16,000 levels a
    /// VMM made, found by a hostile review; here stacks of 512 KiB and 6,000 levels, to keep
    /// the test short), and leaves what a link in it names alone.
    #[test]
    fn test_destroy_removes_a_deep_tree_the_vmm_made_on_a_small_stack() {
        use rustix::fs::{mkdirat, openat, symlinkat, Mode, OFlags, CWD};
        let (state, w, rec) = crate::vm::test_engine_with_vm("vm-dee9dee9dee9");
        let dir = w.vm_dir(&rec.id);
        let run = dir.run_dir();
        std::fs::create_dir_all(&run).expect("run dir");
        let outside = state.path().join("outside");
        std::fs::write(&outside, "keep").expect("outside");
        let open = |at: &dyn std::os::fd::AsFd, name: &str| {
            openat(
                at,
                name,
                OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
                Mode::empty(),
            )
            .expect("open")
        };
        // Built with descriptors: a path this deep is longer than PATH_MAX.
        let mut cur = open(&CWD, run.to_str().expect("utf-8"));
        symlinkat(&outside, &cur, "link").expect("symlink");
        for _ in 0..6_000 {
            mkdirat(&cur, "d", Mode::RWXU).expect("mkdir");
            cur = open(&cur, "d");
        }
        drop(cur);
        let id = rec.id.clone();
        const STACK: usize = 512 << 10;
        let destroyed = std::thread::Builder::new()
            .stack_size(STACK)
            .spawn(move || {
                tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .thread_stack_size(STACK)
                    .build()
                    .expect("runtime")
                    .block_on(w.destroy_vm(&id))
            })
            .expect("thread")
            .join()
            .expect("no panic");
        destroyed.expect("destroyed");
        assert!(!dir.path().exists(), "the VM directory is gone");
        let left: Vec<_> = std::fs::read_dir(dir.path().parent().expect("vms"))
            .expect("vms")
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert!(left.is_empty(), "nothing left under vms/: {left:?}");
        assert_eq!(std::fs::read(&outside).expect("kept"), b"keep");
    }

    /// A `resuming` record whose engine went away (no transition lock, no supervisor) is
    /// settled as failed by the next caller waiting for it, with the reason.
    #[tokio::test]
    async fn test_an_abandoned_resume_is_settled() {
        let (_state, w, rec) = resuming_vm("vm-ba5eba11feed");
        let e = w.await_resume(&rec.id).await.expect_err("failed");
        assert!(e.to_string().contains("abandoned"), "{e}");
        let now = w.store.get(&rec.id).expect("get").expect("record");
        assert_eq!(now.state, VmState::Failed);
        assert!(now.reason.unwrap_or_default().contains("abandoned"));
    }
}
