//! Suspension: pause, hibernate, resume (with a fresh boot when a checkpoint cannot be
//! restored), and the idle policy.

use std::time::Duration;

use warren_supervisor::{SupervisorClient, SupervisorConfig};

use super::{kill_supervisor, now_unix, wait_supervisor_exit, write_private, SuspendMode, Warren};
use crate::error::CoreError;
use crate::store::{VmRecord, VmState};

impl Warren {
    /// Suspends a running VM: `Pause` keeps its RAM in the VMM; `Hibernate` writes memory and
    /// device state to its directory and ends the VMM. Running jobs and background processes
    /// left by finished jobs refuse it with `busy` unless `force` (they are frozen either way,
    /// jobs keep their timeout budgets, and everything continues on resume).
    pub async fn suspend_vm(
        &self,
        id: &str,
        mode: SuspendMode,
        force: bool,
    ) -> Result<VmRecord, CoreError> {
        let mut rec = self.get_vm(id)?;
        match (rec.state, mode) {
            (VmState::Running, _) | (VmState::Paused, SuspendMode::Hibernate) => {}
            (VmState::Paused, SuspendMode::Pause) | (VmState::Hibernated, _) => return Ok(rec),
            (s, _) => {
                return Err(CoreError::VmNotRunning {
                    id: rec.id,
                    state: s.as_str().to_string(),
                    reason: rec.reason,
                })
            }
        }
        let client = SupervisorClient::new(&self.vm_dir(id).socket());
        if rec.state == VmState::Running {
            let list = self.jobs_before_suspend(id, force).await?;
            let running = list
                .iter()
                .flatten()
                .filter(|j| j.state == warren_protocol::JobState::Running)
                .count();
            // Background processes a finished job left (a dev server) are work too.
            let background: u64 = list
                .iter()
                .flatten()
                .map(|j| u64::from(j.background_processes))
                .sum();
            if (running > 0 || background > 0) && !force {
                return Err(CoreError::Busy(format!(
                    "{running} job(s) running and {background} background process(es) in {id}; pass force to freeze them"
                )));
            }
            // What a status call answers while the VM is suspended (`jobs_seen`).
            self.record_jobs_seen(id, list.as_deref()).await;
        }
        match mode {
            SuspendMode::Pause => {
                if let Err(e) = client.pause().await {
                    // A pause that began runs to its end in the supervisor even when this
                    // call gave up on it: its phase says which way it went.
                    let paused = matches!(
                        client.status().await.map(|st| st.phase),
                        Ok(warren_supervisor::VmPhase::Paused(_))
                    );
                    if !paused {
                        return Err(e.into());
                    }
                }
                self.store.set_state(id, VmState::Paused, None, None)?;
                rec.state = VmState::Paused;
            }
            SuspendMode::Hibernate => {
                let dir = self.vm_dir(id);
                let need = u64::from(rec.memory_mib) << 20;
                let st = nix::sys::statvfs::statvfs(dir.path())
                    .map_err(|e| CoreError::io("statvfs", dir.path(), e.into()))?;
                let free = st.blocks_available() as u64 * st.fragment_size() as u64;
                if free < need + (need / 10) {
                    return Err(CoreError::QuotaExceeded(format!(
                        "hibernating {id} needs up to {} MiB of disk; {} MiB free",
                        need >> 20,
                        free >> 20
                    )));
                }
                let _ = std::fs::remove_file(dir.checkpoint_record());
                let before = rec.state;
                // Written before the action; reconciliation settles it after a crash.
                self.store.set_state(id, VmState::Hibernating, None, None)?;
                if let Err(e) = client.hibernate().await {
                    // Another process (the idle policy, a shutdown) may have hibernated it
                    // at the same time: then its supervisor is on its way out.
                    let ending = !matches!(
                        client.status().await.map(|st| st.phase),
                        Ok(warren_supervisor::VmPhase::Ready(_)
                            | warren_supervisor::VmPhase::Paused(_))
                    );
                    if ending {
                        wait_supervisor_exit(&dir, Duration::from_secs(5)).await;
                    }
                    if !dir.supervisor_alive() && dir.read_checkpoint().is_some() {
                        self.store.set_state(id, VmState::Hibernated, None, None)?;
                        rec.state = VmState::Hibernated;
                        return Ok(rec);
                    }
                    if dir.supervisor_alive() {
                        // The supervisor continued the VM where it was.
                        self.store.set_state(id, before, None, None)?;
                    }
                    // Otherwise the VM died: reconciliation records why.
                    return Err(e.into());
                }
                if !wait_supervisor_exit(&dir, Duration::from_secs(30)).await {
                    kill_supervisor(&dir);
                    wait_supervisor_exit(&dir, Duration::from_secs(5)).await;
                }
                self.store.set_state(id, VmState::Hibernated, None, None)?;
                rec.state = VmState::Hibernated;
            }
        }
        Ok(rec)
    }

    /// Resumes a paused or hibernated VM (the same VM: its processes and jobs continue).
    ///
    /// A call that waited for another caller's resume, which ended with the VM still paused
    /// or hibernated (refused by the host's limits, say), makes its own attempt once: its
    /// answer is then its own refusal, not "hibernated".
    pub async fn resume_vm(&self, id: &str) -> Result<VmRecord, CoreError> {
        self.resume_with(id, false).await
    }

    /// The operator's resume after a host update (`warren vm resume --accept-new-runtime`,
    /// `vm/artifacts.rs`): a hibernated VM is held to the host's QEMU, firmware and kernel
    /// from now on, and a checkpoint taken under another QEMU or firmware is dropped for a
    /// fresh boot on its disk (its memory lost; its generation moves on). Otherwise as
    /// [`Self::resume_vm`].
    pub async fn resume_vm_on_new_runtime(&self, id: &str) -> Result<VmRecord, CoreError> {
        self.resume_with(id, true).await
    }

    async fn resume_with(&self, id: &str, accept: bool) -> Result<VmRecord, CoreError> {
        match self.resume_once(id, accept).await {
            Err(CoreError::VmNotRunning { state, .. })
                if state == VmState::Hibernated.as_str() || state == VmState::Paused.as_str() =>
            {
                self.resume_once(id, accept).await
            }
            r => r,
        }
    }

    async fn resume_once(&self, id: &str, accept: bool) -> Result<VmRecord, CoreError> {
        let mut rec = self.get_vm(id)?;
        let dir = self.vm_dir(id);
        match rec.state {
            VmState::Running => {
                // A pause this engine gave up on may have finished after all: a stopped VM
                // recorded as running is resumed, not left stuck.
                let client = SupervisorClient::new(&dir.socket());
                if matches!(
                    client.status().await.map(|st| st.phase),
                    Ok(warren_supervisor::VmPhase::Paused(_))
                ) {
                    tracing::warn!(vm = %id, "the VM was paused behind a running record; resuming it");
                    client.resume().await?;
                }
                return Ok(rec);
            }
            VmState::Paused => {
                SupervisorClient::new(&dir.socket()).resume().await?;
            }
            VmState::Hibernated => {
                let Some(ck) = dir.read_checkpoint() else {
                    // Another caller's resume may have consumed it since the record was read
                    // (nothing is locked yet): then this call waits for that resume.
                    if self
                        .store
                        .get(id)?
                        .is_some_and(|r| r.state != VmState::Hibernated)
                    {
                        return self.await_resume(id).await;
                    }
                    return Err(CoreError::CheckpointIncompatible(format!(
                        "{id} has no completed checkpoint"
                    )));
                };
                // The disk overlay's backing file is the image's root filesystem: it must
                // still be the image the VM was created from.
                let image_id = warren_image::ImageId::parse(&rec.image_id)?;
                let image = self.verify_image(&image_id)?;
                // The QEMU, firmware and kernel it was created with, exactly (or the host's,
                // accepted by the operator).
                let (qemu, firmware) = warren_supervisor::vmm_digests();
                let mut other_vmm = ck.qemu_sha256 != qemu || ck.firmware_sha256 != firmware;
                if accept {
                    other_vmm |= self.accept_artifacts(id, &dir, &image)?;
                } else {
                    self.check_artifacts(id, &dir, &image)?;
                    if other_vmm {
                        return Err(CoreError::CheckpointIncompatible(format!(
                            "{id} was hibernated under another QEMU binary or firmware \
                             (microvm has no versioned machine types); reinstall that QEMU to \
                             resume it, or boot it fresh on this one, its memory lost \
                             (the operator's `warren vm resume {id} --accept-new-runtime`)"
                        )));
                    }
                }
                let mut cfg: SupervisorConfig = serde_json::from_slice(
                    &std::fs::read(dir.config())
                        .map_err(|e| CoreError::io("read", dir.config(), e))?,
                )
                .map_err(|e| CoreError::InvalidArgument(format!("supervisor config: {e}")))?;
                // A session copy's own filesystem that a host restart unmounted is mounted
                // again first: its shares are directories inside it.
                if let Some(s) = self
                    .store
                    .sessions(None)?
                    .into_iter()
                    .find(|s| s.vm_id.as_deref() == Some(id))
                {
                    self.volume_ready(&s).await?;
                    self.rebase_volume_shares(&s, &mut cfg.launch.shares)?;
                }
                // A share whose directory was replaced (or now leads elsewhere through a
                // symlink) while the VM slept refuses the resume; the VM stays hibernated.
                warren_vmm::qemu::virtiofs::validate(&cfg.launch.shares)
                    .map_err(|e| CoreError::Conflict(e.to_string()))?;
                cfg.restore = true;
                cfg.launch.incoming = true;
                // The restore runs to its end in a task of its own, on a handle of its own:
                // a caller that goes away (a client that hung up, a cancelled request) never
                // leaves the VM between supervisors or recorded `resuming` behind a running
                // supervisor.
                let engine = self.share();
                let id = id.to_string();
                let task = tokio::spawn(async move {
                    engine
                        .restore_hibernated(&id, rec, cfg, image, other_vmm)
                        .await
                });
                return match task.await {
                    Ok(r) => r,
                    Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
                    Err(_) => Err(CoreError::Busy(
                        "the resume was cut short: the engine is shutting down".into(),
                    )),
                };
            }
            // Another caller's resume, or one whose engine went away (settled there).
            VmState::Resuming => return self.await_resume(id).await,
            s => {
                return Err(CoreError::VmNotRunning {
                    id: rec.id,
                    state: s.as_str().to_string(),
                    reason: rec.reason,
                })
            }
        }
        self.store.set_state(id, VmState::Running, None, None)?;
        rec.state = VmState::Running;
        Ok(rec)
    }

    /// A hibernated VM's restore with its configuration `cfg`: writes it out, holds the
    /// VM's transition lock (listings leave the VM alone while no supervisor holds its own
    /// lock; held by another caller, that caller is resuming it), reserves its memory,
    /// launches the restoring supervisor, and boots the VM fresh on its disk when the
    /// checkpoint cannot be restored. `fresh`: the checkpoint is not tried (taken under
    /// another QEMU or firmware, which the operator accepted).
    async fn restore_hibernated(
        &self,
        id: &str,
        mut rec: VmRecord,
        cfg: SupervisorConfig,
        image: warren_image::VerifiedImage,
        fresh: bool,
    ) -> Result<VmRecord, CoreError> {
        let dir = self.vm_dir(id);
        let Some(transition) = begin_transition(&dir).await? else {
            return self.await_resume(id).await;
        };
        // Admission, as for a create: its memory is reserved (the VM is `resuming`) or the
        // resume is refused before anything in the VM directory changes.
        if self.reserve_resume(&rec)? == crate::admission::Reserved::Stale {
            // Another caller resumed it between our read and the reservation.
            drop(transition);
            return self.await_resume(id).await;
        }
        for p in [dir.exit_record(), dir.socket()] {
            let _ = std::fs::remove_file(p);
        }
        // A fresh lock file for the new supervisor: one opened before it was made private
        // (by anyone, under an older Warren) could otherwise still be held against it.
        if !dir.supervisor_alive() {
            let _ = std::fs::remove_file(dir.lock());
        }
        // Replaced whole (a temporary file and a rename): a failed write leaves the old
        // configuration, never none, and the VM can still be resumed.
        if let Err(e) = super::template::replace_config(&dir, &cfg) {
            self.store.set_state(id, VmState::Hibernated, None, None)?;
            return Err(e);
        }
        let launched = if fresh {
            Err(CoreError::CheckpointIncompatible(
                "it was taken under another QEMU binary or firmware".into(),
            ))
        } else {
            self.launch_and_wait(&dir).await.map(|_| ())
        };
        if let Err(e) = launched {
            // The checkpoint cannot be restored: its memory is lost. Never retried onto
            // another memory image; the VM boots fresh on its disk instead.
            tracing::warn!(vm = %id, error = %e, "restoring the checkpoint failed; booting the VM fresh");
            return match self.boot_fresh(&dir, cfg, &image).await {
                Ok((generation, boot_ms)) => {
                    self.store
                        .set_state(id, VmState::Running, None, Some(boot_ms))?;
                    rec.state = VmState::Running;
                    rec.generation = generation;
                    rec.boot_ms = Some(boot_ms);
                    Ok(rec)
                }
                Err(fresh) => {
                    let reason = format!(
                        "restoring the checkpoint failed ({e}), and so did a fresh boot: {fresh}"
                    );
                    self.store
                        .set_state(id, VmState::Failed, Some(&reason), None)?;
                    Err(fresh)
                }
            };
        }
        // The checkpoint is consumed: the VM runs on from it now.
        let _ = std::fs::remove_file(dir.checkpoint_record());
        let _ = std::fs::remove_file(dir.checkpoint_state());
        self.store.set_state(id, VmState::Running, None, None)?;
        rec.state = VmState::Running;
        Ok(rec)
    }

    /// A `resuming` record whose resume nobody holds any more (the engine that ran it died
    /// mid-way): `running` once its supervisor answers ready; otherwise whatever of it runs
    /// is stopped and the record is `failed`. Acts under the transition lock, on the record
    /// as it is then; `busy` while another caller settles it.
    pub(crate) async fn settle_orphaned_resume(&self, id: &str) -> Result<VmRecord, CoreError> {
        let dir = self.vm_dir(id);
        let Some(_transition) = try_transition(&dir)? else {
            return Err(CoreError::Busy(format!(
                "{id} is being resumed; try again once that ended"
            )));
        };
        let mut rec = self
            .store
            .get(id)?
            .ok_or_else(|| CoreError::VmNotFound(id.to_string()))?;
        match rec.state {
            VmState::Resuming => {}
            VmState::Running => return Ok(rec),
            s => {
                return Err(CoreError::VmNotRunning {
                    id: rec.id,
                    state: s.as_str().to_string(),
                    reason: rec.reason,
                })
            }
        }
        // A supervisor spawned just before its engine died may not hold its lock yet (it
        // retries a refused lock for a second), or not have its socket up yet.
        if !dir.supervisor_alive() {
            tokio::time::sleep(Duration::from_secs(2)).await;
        }
        let waited = std::time::Instant::now();
        while dir.supervisor_alive()
            && !dir.socket().exists()
            && waited.elapsed() < Duration::from_secs(10)
        {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let ready = dir.supervisor_alive()
            && SupervisorClient::new(&dir.socket())
                .wait_ready(self.cfg.boot_timeout + Duration::from_secs(5))
                .await
                .is_ok_and(|st| matches!(st.phase, warren_supervisor::VmPhase::Ready(_)));
        if ready {
            tracing::warn!(vm = %id, "an abandoned resume's VM came up; recording it running");
            // As a resume that ends well: the checkpoint is consumed.
            let _ = std::fs::remove_file(dir.checkpoint_record());
            let _ = std::fs::remove_file(dir.checkpoint_state());
            self.store.set_state(id, VmState::Running, None, None)?;
            rec.state = VmState::Running;
            return Ok(rec);
        }
        // Nothing of it runs on behind a failed record (its memory would go uncounted).
        if dir.supervisor_alive() {
            let _ = SupervisorClient::new(&dir.socket()).stop().await;
            if !wait_supervisor_exit(&dir, Duration::from_secs(10)).await {
                kill_supervisor(&dir);
                wait_supervisor_exit(&dir, Duration::from_secs(5)).await;
            }
        }
        if let Some(h) = warren_vmm::sys::cgroup::Hierarchy::detect() {
            let _ = warren_vmm::sys::cgroup::kill_and_remove(&h.vm_cgroup(id));
        }
        warren_supervisor::network::delete_netns(&warren_supervisor::network::netns_name(id));
        let reason = "its resume was abandoned and its supervisor never became ready";
        tracing::warn!(vm = %id, reason, "failing the VM");
        self.store
            .set_state(id, VmState::Failed, Some(reason), None)?;
        Err(CoreError::VmNotRunning {
            id: rec.id,
            state: VmState::Failed.as_str().to_string(),
            reason: Some(reason.to_string()),
        })
    }

    /// The running VMs that have been idle for their `idle_seconds` (status and list calls
    /// never count as work), each with the mode its idle policy suspends it in and its
    /// activity time ([`Warren::suspend_idle_vm`] wakes it again when that moves).
    pub fn idle_vms(&self) -> Vec<(String, SuspendMode, u64)> {
        let now = now_unix();
        let Ok(list) = self.list_vms() else {
            return Vec::new();
        };
        list.into_iter()
            .filter(|rec| {
                rec.idle_seconds > 0
                    && rec.state == VmState::Running
                    && now.saturating_sub(rec.last_active_unix) >= u64::from(rec.idle_seconds)
            })
            .map(|rec| {
                let mode = SuspendMode::parse(&rec.idle_mode).unwrap_or(SuspendMode::Hibernate);
                (rec.id, mode, rec.last_active_unix)
            })
            .collect()
    }

    /// Suspends one idle VM (from [`Warren::idle_vms`]) unless a job or a background process
    /// of a finished job runs in it. `None`: something runs, so the VM stays up and its idle
    /// clock starts again. Each VM's suspension is
    /// independent (its own supervisor, every call under its deadline), so the idle policy
    /// runs them concurrently and a silent guest holds only its own.
    ///
    /// Work that arrived since the VM was found idle (`seen`: its activity time then; a
    /// wake that found the VM still running leaves its request in flight to a guest now
    /// paused) wakes the VM again at once: its activity time moved past `seen` (an activity
    /// time only ever moves forward). Before, such a request waited out its whole deadline
    /// (50 s for an exec's output) and failed `unavailable` (seen when a create took longer
    /// than the VM's idle time, and possible whenever a call comes as the idle time runs
    /// out). Work arriving while a hibernation saves is refused `conflict` (the VM is
    /// hibernating), and the VM is then restored at once.
    pub async fn suspend_idle_vm(
        &self,
        id: &str,
        mode: SuspendMode,
        seen: u64,
    ) -> Option<Result<VmState, CoreError>> {
        match self.suspend_vm(id, mode, false).await {
            // Running jobs keep a VM awake: look again after another idle period.
            Err(CoreError::Busy(_)) => {
                let _ = self.store.touch(id, now_unix());
                None
            }
            Ok(r) if self.get_vm(id).is_ok_and(|rec| rec.last_active_unix > seen) => {
                tracing::info!(
                    vm = id,
                    state = r.state.as_str(),
                    "work arrived during an idle suspension: waking the VM again"
                );
                if let Err(e) = self.resume_vm(id).await {
                    tracing::warn!(vm = id, error = %e,
                        "waking the VM again after its idle suspension failed");
                }
                None
            }
            r => Some(r.map(|r| r.state)),
        }
    }

    /// Boots a VM whose checkpoint could not be restored from scratch on its own disk (the
    /// overlay is as the guest left it when it was hibernated): same id, secret, devices and
    /// shares, a new memory. The checkpoint, any RAM file and the jobs last seen go, and the
    /// VM (and its session) move to the next generation before the boot, so a caller holding
    /// the old one is refused even if this boot fails. Returns (generation, boot ms).
    async fn boot_fresh(
        &self,
        dir: &warren_supervisor::VmDir,
        mut cfg: SupervisorConfig,
        image: &warren_image::VerifiedImage,
    ) -> Result<(u64, u64), CoreError> {
        // The restoring supervisor was stopped (or killed) by the failed launch.
        if !wait_supervisor_exit(dir, Duration::from_secs(10)).await {
            kill_supervisor(dir);
            wait_supervisor_exit(dir, Duration::from_secs(5)).await;
        }
        let mut gone = vec![
            dir.checkpoint_record(),
            dir.checkpoint_state(),
            dir.config(),
            dir.exit_record(),
            dir.socket(),
            super::jobs_seen::path(dir),
        ];
        gone.extend(cfg.launch.ram_file.clone());
        for p in gone {
            match std::fs::remove_file(&p) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(CoreError::io("remove", p, e)),
            }
        }
        // Checked again: the failed restore may have taken long, and this is a new launch.
        self.check_artifacts(&cfg.vm_id, dir, image)?;
        let generation = self.store.bump_generation(&cfg.vm_id)?;
        tracing::warn!(vm = %cfg.vm_id, generation, "memory lost: fresh boot");
        cfg.restore = false;
        cfg.launch.incoming = false;
        let body = serde_json::to_vec_pretty(&cfg).expect("invariant: config serialises");
        write_private(&dir.config(), &body)?;
        let boot_ms = self.launch_and_wait(dir).await?;
        Ok((generation, boot_ms))
    }
}

/// Takes the VM's transition lock ([`VmDir::transition_lock`]) for a resume; `None` when
/// another caller holds it.
pub(super) async fn begin_transition(
    dir: &warren_supervisor::layout::VmDir,
) -> Result<Option<nix::fcntl::Flock<std::fs::File>>, CoreError> {
    // A listing's probe holds a shared lock for an instant: a refusal is retried for a moment
    // before another caller is taken to hold it.
    for _ in 0..TRANSITION_TRIES {
        if let Some(lock) = try_transition(dir)? {
            return Ok(Some(lock));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    try_transition(dir)
}

/// Attempts, 10 ms apart, at a VM's transition lock before another caller is taken to hold
/// it.
const TRANSITION_TRIES: u32 = 20;

/// One attempt at the VM's transition lock: `None` when it is held.
pub(crate) fn try_transition(
    dir: &warren_supervisor::layout::VmDir,
) -> Result<Option<nix::fcntl::Flock<std::fs::File>>, CoreError> {
    use std::os::unix::fs::OpenOptionsExt;
    let path = dir.transition_lock();
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .open(&path)
        .map_err(|e| match e.kind() {
            // Its directory is gone: the VM was destroyed.
            std::io::ErrorKind::NotFound => CoreError::VmNotFound(
                dir.path()
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default(),
            ),
            _ => CoreError::io("open", &path, e),
        })?;
    match nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock) {
        Ok(lock) => Ok(Some(lock)),
        Err((_, nix::errno::Errno::EWOULDBLOCK)) => Ok(None),
        Err((_, e)) => Err(CoreError::io("lock", &path, e.into())),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use warren_protocol::{GuestResponse, HostRequest};
    use warren_supervisor::proto::{read_frame, write_frame, Reply, SupervisorRequest};
    use warren_supervisor::SupervisorResponse;

    use super::*;

    /// A stand-in supervisor that lists no jobs, pauses and resumes, running `on_pause`
    /// before it answers a pause; returns the requests it answered, by kind.
    fn supervisor(
        w: &Warren,
        id: &str,
        on_pause: impl Fn() + Send + Sync + 'static,
    ) -> Arc<Mutex<Vec<&'static str>>> {
        let listener = tokio::net::UnixListener::bind(w.vm_dir(id).socket()).expect("bind");
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = seen.clone();
        let on_pause = Arc::new(on_pause);
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                let (log, on_pause) = (log.clone(), on_pause.clone());
                tokio::spawn(async move {
                    while let Ok(req) = read_frame::<_, SupervisorRequest>(&mut s).await {
                        let (kind, answer) = match req {
                            SupervisorRequest::Guest(HostRequest::JobList) => (
                                "jobs",
                                SupervisorResponse::Guest(GuestResponse::Jobs(vec![])),
                            ),
                            SupervisorRequest::Pause => {
                                on_pause();
                                ("pause", SupervisorResponse::Paused)
                            }
                            SupervisorRequest::Resume => ("resume", SupervisorResponse::Resumed),
                            _ => return,
                        };
                        log.lock().expect("log").push(kind);
                        let reply: Reply = Ok(answer);
                        if write_frame(&mut s, &reply).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        seen
    }

    /// Work that arrives while an idle suspension runs (its wake found the VM running, so
    /// its request may be in flight to the paused guest) wakes the VM again at once (found
    /// by CI: an exec waited out its 50 s deadline). Control: with no work, the VM stays
    /// paused.
    #[tokio::test]
    async fn test_work_arriving_during_an_idle_suspension_wakes_the_vm_again() {
        let id = "vm-0123456789ab";
        for work in [false, true] {
            let (_state, w, _held) = crate::vm::test_engine_with_running_vm(id);
            let w = Arc::new(w);
            let seen = w.get_vm(id).expect("vm").last_active_unix;
            let engine = w.clone();
            let requests = supervisor(&w, id, move || {
                if work {
                    engine.store.touch(id, now_unix()).expect("touch");
                }
            });
            let r = w.suspend_idle_vm(id, SuspendMode::Pause, seen).await;
            let state = w.get_vm(id).expect("vm").state;
            let asked = requests.lock().expect("log").clone();
            if work {
                assert!(r.is_none(), "{r:?}");
                assert_eq!(state, VmState::Running);
                assert_eq!(asked, ["jobs", "pause", "resume"]);
            } else {
                assert!(matches!(r, Some(Ok(VmState::Paused))), "{r:?}");
                assert_eq!(state, VmState::Paused);
                assert_eq!(asked, ["jobs", "pause"]);
            }
        }
    }
}
