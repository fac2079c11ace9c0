//! `vm_fork`: `count` independent copies of a running VM (processes, memory, files), each
//! with its own identity and secret.
//!
//! Steps, in order:
//! 1. **Admission**, one immediate transaction for all copies: the workspace and host limits
//!    must hold `count` more VMs of the parent's memory and disk, and all `count` records are
//!    inserted (`creating`) in that transaction, or none is.
//! 2. **Save** (the parent's supervisor, `warren-supervisor::fork`): jobs frozen, vCPUs
//!    stopped, memory and device state to one state file (`mapped-ram`), the disk overlay
//!    copied; then the parent runs on. The state file moves to `STATE/forks/<id>/` (root's,
//!    group of the state directory's templates (`Warren::template_gid`), 0440: the copies'
//!    VMMs read it, nothing else can).
//! 3. **Copies**, restored concurrently: each gets its own copy of the disk overlay (so the
//!    backing chain, image or template layer, is the parent's), anonymous RAM filled from the
//!    state file, the parent's current secret to authenticate with, and at once moves to a
//!    secret of its own with fresh entropy, the clock, its own hostname (its id) and machine
//!    id (`Rekey`), then thaws its jobs. A networked parent's copies get a fresh network
//!    namespace and egress with the parent's policy (its open TCP connections are dead in the
//!    copies: their peers are the parent's).
//! 4. The state file is deleted once every copy is up (or failed).
//!
//! What is duplicated: userspace RNG state of processes copied from the parent (a process
//! that seeded its own generator before the fork draws the same numbers in every copy until
//! it reseeds; the kernel's CRNG is reseeded), and whatever the parent's processes keep in
//! memory. VMs with shares (sessions) are refused for now: a share is a host directory that
//! the copies would write at the same time.

use std::os::unix::fs::{chown, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use rand::RngCore;
use warren_supervisor::{SupervisorClient, SupervisorConfig};

use super::fork_session::SessionFork;
use super::template::settle_copy;
use super::{now_unix, write_private, Limits, Warren};
use crate::error::CoreError;
use crate::store::{self as vmstore, Usage, VmRecord, VmState};

/// How long the parent's VMM may take to close the state file it wrote (it does once its
/// migration is cleaned up) before the fork is refused as having a writer left.
const WRITER_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// Most copies one fork makes.
pub const MAX_FORK_COUNT: u32 = 16;

/// A fork request.
#[derive(Debug, Clone, Default)]
pub struct ForkVm {
    pub vm_id: String,
    pub count: u32,
    /// The idempotency key of the request; copy `i` records [`copy_request_id`].
    pub request_id: Option<String>,
    pub host_limits: Limits,
    pub workspace_limits: Limits,
    /// The copies' egress policy as the caller's workspace has it now (the service builds it,
    /// refusing a fork its grants no longer allow); `None` keeps the parent's as launched
    /// (the CLI acting on its own state directory). The address, resolver and namespace
    /// hooks stay the parent's either way.
    pub network: Option<super::NetworkRequest>,
}

/// The request id copy `i` of the fork `request_id` records: `fork/<request_id>/<i>`. A
/// caller's request id has no `/`, so no `vm_create` (whose VM records the caller's id as
/// it is) and no other fork can name a fork's copy.
pub fn copy_request_id(request_id: &str, i: u32) -> String {
    format!("fork/{request_id}/{i}")
}

impl Warren {
    /// Forks running VM `req.vm_id` into `req.count` copies; returns their records.
    pub async fn fork_vm(&self, req: &ForkVm) -> Result<Vec<VmRecord>, CoreError> {
        if !(1..=MAX_FORK_COUNT).contains(&req.count) {
            return Err(CoreError::InvalidArgument(format!(
                "count must be within 1..={MAX_FORK_COUNT}, got {}",
                req.count
            )));
        }
        let parent = self.get_vm(&req.vm_id)?;
        if parent.state != VmState::Running {
            return Err(CoreError::VmNotRunning {
                id: parent.id,
                state: parent.state.as_str().to_string(),
                reason: Some("only a running VM can be forked (resume it first)".into()),
            });
        }
        // Every start from an image goes through the image policy (a fork's copies too: a
        // revoked key or an expired policy starts nothing), before anything else is read.
        let image_id = warren_image::ImageId::parse(&parent.image_id)?;
        self.check_image_policy(&image_id)?;
        let pdir = self.vm_dir(&parent.id);
        let mut pcfg: SupervisorConfig = serde_json::from_slice(
            &std::fs::read(pdir.config()).map_err(|e| CoreError::io("read", pdir.config(), e))?,
        )
        .map_err(|e| CoreError::InvalidArgument(format!("supervisor config: {e}")))?;
        // The copies are new VMs: their egress is the workspace's policy as it is now, not as
        // it was when the parent was made (`pcfg` is only the copies' from here on).
        if let (Some(net), Some(now)) = (&mut pcfg.launch.network, &req.network) {
            super::mounts::apply_policy(net, now)?;
        }
        let image = self.images.verify(&image_id)?;
        self.check_artifacts(&parent.id, &pdir, &image)?;

        // 1. Admission and the records, in one transaction.
        let mut recs: Vec<VmRecord> = (0..req.count)
            .map(|i| {
                let mut id_bytes = [0u8; 6];
                rand::rng().fill_bytes(&mut id_bytes);
                VmRecord {
                    id: format!("vm-{}", hex::encode(id_bytes)),
                    state: VmState::Creating,
                    reason: None,
                    uid: 0,
                    created_unix: now_unix(),
                    last_active_unix: now_unix(),
                    boot_ms: None,
                    generation: 1,
                    request_id: req.request_id.as_ref().map(|r| copy_request_id(r, i)),
                    ram_file: false,
                    mounts: vec![],
                    disk_mib: parent.disk_mib,
                    ..parent.clone()
                }
            })
            .collect();
        // A session's VM: a new session per copy, with a copy of the session's files.
        let sessions = self.plan_session_fork(&parent, &pcfg, &recs)?;
        if let Some(plan) = &sessions {
            for (i, r) in recs.iter_mut().enumerate() {
                r.mounts = plan.mounts_of_copy(i, &parent.mounts);
            }
        }
        let ws = parent.workspace.clone();
        let add = Usage {
            vms: u64::from(req.count),
            memory_mib: u64::from(parent.memory_mib) * u64::from(req.count),
            disk_mib: parent.disk_mib * u64::from(req.count),
        };
        // Each copy's directory is made and its transition lock held from before its record
        // exists until the fork ends, as a create's (`Warren::begin_create`): a destroy of a
        // copy meanwhile answers `busy` (before, it found no directory during the parent's
        // save, removed the record alone, and the copy then started with none).
        let mut creating = Vec::with_capacity(recs.len());
        for r in &recs {
            match self.begin_create(r) {
                Ok(lock) => creating.push(lock),
                Err(e) => {
                    recs.iter()
                        .take(creating.len())
                        .for_each(|r| self.abandon_create(r, false));
                    return Err(e);
                }
            }
        }
        let inserted = self.store.immediate(|tx| -> Result<(), CoreError> {
            super::admit(tx, &ws, &req.workspace_limits, &req.host_limits, add)?;
            for r in recs.iter_mut() {
                vmstore::insert_in(tx, r, self.first_vm_uid())?;
            }
            if let Some(plan) = &sessions {
                Self::admit_session_fork(tx, plan, (req.host_limits, req.workspace_limits))?;
            }
            Ok(())
        });
        if let Err(e) = inserted {
            recs.iter().for_each(|r| self.abandon_create(r, false));
            return Err(e);
        }

        let result = self
            .fork_into(&parent, &pcfg, &image, &recs, sessions.as_ref())
            .await;
        let mut out = Vec::new();
        let mut first_err = None;
        for (rec, r) in recs.iter_mut().zip(result) {
            let r = r.and_then(|ms| {
                self.store
                    .set_state(&rec.id, VmState::Running, None, Some(ms))?;
                Ok(ms)
            });
            match r {
                Ok(ms) => {
                    rec.state = VmState::Running;
                    rec.boot_ms = Some(ms);
                    out.push(rec.clone());
                }
                Err(e) => {
                    // A copy can fail after its VMM came up (its settling, its record's
                    // update): nothing of it runs on under a `failed` record. A failed
                    // update here fails this copy, never the clean-up of the others.
                    if let Err(halt) = self.halt(&rec.id).await {
                        tracing::warn!(vm = %rec.id, error = %halt, "stopping a fork copy whose start failed");
                    }
                    let reason = e.to_string();
                    if let Err(err) =
                        self.store
                            .set_state(&rec.id, VmState::Failed, Some(&reason), None)
                    {
                        tracing::warn!(vm = %rec.id, error = %err, "recording a failed fork copy");
                    }
                    first_err.get_or_insert(e);
                }
            }
        }
        // The copies are settled: a destroy (below, or the caller's) may act on them now.
        drop(creating);
        match first_err {
            // All or nothing: copies that came up are destroyed with the failed ones' records
            // left failed (with their reason) for the caller to see and destroy.
            Some(e) => {
                for r in &out {
                    let _ = self.destroy_vm(&r.id).await;
                }
                if let Some(plan) = &sessions {
                    self.discard_session_fork(plan);
                }
                Err(e)
            }
            None => Ok(out),
        }
    }

    /// Saves the parent and restores every copy; one result per record.
    async fn fork_into(
        &self,
        parent: &VmRecord,
        pcfg: &SupervisorConfig,
        image: &warren_image::VerifiedImage,
        recs: &[VmRecord],
        sessions: Option<&SessionFork>,
    ) -> Vec<Result<u64, CoreError>> {
        let all = |e: CoreError| -> Vec<Result<u64, CoreError>> {
            let msg = e.to_string();
            recs.iter()
                .map(|_| Err(CoreError::BootFailed(msg.clone())))
                .collect()
        };
        let forks = self.cfg.state_dir.join("forks");
        sweep_fork_leftovers(&forks, &self.vm_dir(&parent.id).run_dir());
        let mut tag = [0u8; 6];
        rand::rng().fill_bytes(&mut tag);
        let fdir = forks.join(hex::encode(tag));
        let tag = hex::encode(tag);
        // Removed however this ends, a cancelled call included: the parent's supervisor
        // finishes a save it began whoever waits for it, and its files are this fork's.
        let _leftovers = Leftovers {
            dir: fdir.clone(),
            written: self
                .vm_dir(&parent.id)
                .run_dir()
                .join(format!("fork-{tag}.state")),
        };
        let made = (|| -> Result<(), CoreError> {
            std::fs::create_dir_all(&forks).map_err(|e| CoreError::io("create", &forks, e))?;
            std::fs::set_permissions(&forks, std::fs::Permissions::from_mode(0o711))
                .map_err(|e| CoreError::io("chmod", &forks, e))?;
            std::fs::create_dir(&fdir).map_err(|e| CoreError::io("create", &fdir, e))?;
            if nix::unistd::geteuid().is_root() {
                chown(&fdir, Some(0), Some(self.template_gid()))
                    .map_err(|e| CoreError::io("chown", &fdir, e))?;
            }
            std::fs::set_permissions(&fdir, std::fs::Permissions::from_mode(0o750))
                .map_err(|e| CoreError::io("chmod", &fdir, e))
        })();
        if let Err(e) = made {
            return all(e);
        }
        if let Some(plan) = sessions {
            if let Err(e) = self.make_session_fork_volumes(plan).await {
                let _ = warren_session::remove_tree(&fdir);
                return all(e);
            }
        }
        self.fork_saved(parent, pcfg, image, recs, &fdir, sessions)
            .await
    }

    async fn fork_saved(
        &self,
        parent: &VmRecord,
        pcfg: &SupervisorConfig,
        image: &warren_image::VerifiedImage,
        recs: &[VmRecord],
        fdir: &std::path::Path,
        sessions: Option<&SessionFork>,
    ) -> Vec<Result<u64, CoreError>> {
        let pdir = self.vm_dir(&parent.id);
        // Written by the parent's VMM in its own run directory, then moved out of its reach;
        // named after this fork, so two forks of one parent never take each other's file.
        let tag = fdir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let written = pdir.run_dir().join(format!("fork-{tag}.state"));
        let state = fdir.join("state");
        let disk = fdir.join("disk.qcow2");
        let saved = async {
            // A qcow2 overlay is at most its virtual size (the image's root file system) plus
            // its metadata.
            let virtual_size = std::fs::metadata(&image.rootfs)
                .map_err(|e| CoreError::io("stat", &image.rootfs, e))?
                .len();
            let max_disk = virtual_size + virtual_size / 8 + (64 << 20);
            let client = SupervisorClient::new(&pdir.socket());
            let t = std::time::Instant::now();
            let saved = client
                .fork_save(&written, &disk, max_disk, sessions.is_some())
                .await;
            if let Ok((size, paused_ms)) = &saved {
                tracing::info!(
                    vm = %parent.id,
                    size,
                    paused_ms,
                    ms = t.elapsed().as_millis() as u64,
                    "parent saved for a fork"
                );
            }
            if let Err(e) = saved {
                // A reply lost after a held save must not leave the parent stopped. One the
                // supervisor answered with a refusal held nothing: a release then could only
                // end another fork's hold, while it copies that fork's files.
                let answered = matches!(
                    e,
                    warren_supervisor::client::ClientError::Supervisor(_)
                        | warren_supervisor::client::ClientError::Connect { .. }
                );
                if sessions.is_some() && !answered {
                    let _ = client.fork_release().await;
                }
                return Err(e.into());
            }
            if let Some(plan) = sessions {
                // The parent is held stopped: its files are copied as its memory was saved.
                let copied = self.copy_session_fork_files(plan).await;
                let released = client.fork_release().await;
                copied?;
                released?;
            }
            std::fs::rename(&written, &state).map_err(|e| CoreError::io("rename", &written, e))?;
            // Written by the VMM: owner and mode change through a checked descriptor only.
            let owner = nix::unistd::geteuid()
                .is_root()
                .then_some((0, self.template_gid()));
            warren_vmm::sys::vmm_file::claim_regular(&state, owner, 0o440)
                .map_err(|e| CoreError::io("claim", &state, e))?;
            // The copies read the state, and those that map it keep reading it as long as they
            // run: no process may be left able to write it (the parent's VMM could have kept
            // a descriptor of the file it wrote). Checked before anything in it is read.
            let checked = state.clone();
            let t = std::time::Instant::now();
            tokio::task::spawn_blocking(move || {
                warren_vmm::sys::vmm_file::refuse_writers(&checked, WRITER_WAIT)
                    .map_err(|e| CoreError::io("check for writers of", &checked, e))
            })
            .await
            .map_err(|e| CoreError::BootFailed(format!("writer check: {e}")))??;
            tracing::debug!(
                ms = t.elapsed().as_millis() as u64,
                "no writer of the fork's state"
            );
            // Copies without shares map the saved RAM copy-on-write instead of loading it (a
            // session's copies need shared RAM for their virtiofsd, so they load theirs).
            let fork_ram = if sessions.is_none() {
                let block = if parent_ram_named(&pcfg.launch) {
                    "mem"
                } else {
                    warren_vmm::qemu::mapped_ram::DEFAULT_RAM_ID
                };
                let len = u64::from(pcfg.launch.memory.0) << 20;
                let path = state.clone();
                let detached = tokio::task::spawn_blocking(move || {
                    warren_vmm::qemu::mapped_ram::detach_block(&path, block, len)
                })
                .await
                .map_err(|e| CoreError::BootFailed(format!("reading the fork's state: {e}")))?;
                match detached {
                    Ok(offset) => Some(warren_vmm::backend::ForkRam {
                        path: state.clone(),
                        offset,
                    }),
                    Err(e) => {
                        tracing::warn!(
                            vm = %parent.id,
                            error = %e,
                            "the fork's copies load its RAM in full: its RAM block cannot be mapped from the saved state"
                        );
                        None
                    }
                }
            } else {
                None
            };
            let secret = std::fs::read(pdir.secret())
                .map_err(|e| CoreError::io("read", pdir.secret(), e))?;
            Ok::<_, CoreError>((secret, fork_ram))
        }
        .await;
        let (secret, fork_ram) = match saved {
            Ok(s) => s,
            Err(e) => {
                let _ = std::fs::remove_file(&written);
                let msg = e.to_string();
                return recs
                    .iter()
                    .map(|_| Err(CoreError::BootFailed(format!("fork save: {msg}"))))
                    .collect();
            }
        };
        let marker = std::fs::read(pdir.path().join("template")).ok();
        let artifacts = super::artifacts::RuntimeArtifacts::load(&pdir)
            .ok()
            .flatten();
        let starts = recs.iter().enumerate().map(|(i, rec)| {
            let shares = sessions.map(|p| p.shares_of_copy(i, &pcfg.launch.shares));
            self.start_fork_copy(
                rec,
                pcfg,
                image,
                &state,
                &disk,
                &secret,
                marker.as_deref(),
                artifacts.as_ref(),
                shares,
                fork_ram.clone(),
            )
        });
        futures_util::future::join_all(starts).await
    }

    #[allow(clippy::too_many_arguments)]
    async fn start_fork_copy(
        &self,
        rec: &VmRecord,
        pcfg: &SupervisorConfig,
        image: &warren_image::VerifiedImage,
        state: &std::path::Path,
        disk: &std::path::Path,
        secret: &[u8],
        marker: Option<&[u8]>,
        artifacts: Option<&super::artifacts::RuntimeArtifacts>,
        shares: Option<Result<Vec<warren_vmm::backend::Share>, CoreError>>,
        fork_ram: Option<warren_vmm::backend::ForkRam>,
    ) -> Result<u64, CoreError> {
        let shares = shares.transpose()?;
        let (dir, run_as) = self.made_vm_dir(rec);
        match artifacts {
            Some(a) => a.store(&dir)?,
            None => self.record_artifacts(&dir, image)?,
        }
        if let Some(m) = marker {
            // The disk chain backs onto a template layer, which must outlive this copy.
            write_private(&dir.path().join("template"), m)?;
        }
        let own_disk = dir.run_dir().join("disk.qcow2");
        std::fs::copy(disk, &own_disk).map_err(|e| CoreError::io("copy", disk, e))?;
        super::create::give(&own_disk, run_as)?;
        write_private(&dir.secret(), secret)?;
        let root = nix::unistd::geteuid().is_root();
        let mut machine_id = [0u8; 16];
        rand::rng().fill_bytes(&mut machine_id);
        let mut launch = pcfg.launch.clone();
        launch.name = rec.id.clone();
        launch.run_dir = dir.run_dir();
        launch.stderr_log = dir.qemu_stderr();
        launch.disk = own_disk;
        launch.run_as = run_as;
        launch.cgroup = if root {
            warren_vmm::sys::cgroup::Hierarchy::detect().map(|h| h.vm_cgroup(&rec.id))
        } else {
            None
        };
        launch.incoming = true;
        launch.named_ram = parent_ram_named(&launch);
        launch.fork_ram = fork_ram;
        launch.template_ram = None;
        launch.clone_ram = None;
        launch.ram_file = None;
        launch.groups = if root {
            vec![self.template_gid()]
        } else {
            vec![]
        };
        if let Some(shares) = shares {
            launch.shares = shares;
        }
        // Only loaded, then overwritten by the restore.
        launch.initramfs = image.initramfs.clone();
        if let Some(net) = &mut launch.network {
            net.netns = warren_supervisor::network::netns_name(&rec.id);
        }
        let mut cfg = SupervisorConfig {
            vm_id: rec.id.clone(),
            launch,
            boot_timeout_ms: self.cfg.boot_timeout.as_millis() as u64,
            restore: true,
            clone: Some(warren_supervisor::CloneSpec {
                hostname: rec.id.clone(),
                machine_id: hex::encode(machine_id),
            }),
            restore_from: Some(PathBuf::from(state)),
        };
        let body = serde_json::to_vec_pretty(&cfg).expect("invariant: config serialises");
        write_private(&dir.config(), &body)?;
        super::create::hand_over_run(&dir, run_as)?;
        let ms = self.launch_and_wait(&dir).await?;
        settle_copy(&dir, &image.initramfs, &mut cfg, run_as)?;
        Ok(ms)
    }
}

/// Whether a VM's RAM block is `mem` (a RAM file, or started from a template) rather than
/// the machine's own; a VM with shares has `mem` whatever this says (its memfd).
fn parent_ram_named(l: &warren_vmm::LaunchSpec) -> bool {
    l.named_ram || l.template_ram.is_some() || l.clone_ram.is_some() || l.ram_file.is_some()
}

/// A fork's own files: its directory under `forks/` and the state the parent's VMM writes
/// in its run directory, removed when the fork ends however it ends.
struct Leftovers {
    dir: PathBuf,
    written: PathBuf,
}

impl Drop for Leftovers {
    fn drop(&mut self) {
        // A VMM still writing keeps its unlinked file until it closes it; the space goes then.
        // What the parent's VMM left at its state file's name (a directory tree of any depth)
        // may have been moved in: removed without recursion.
        let _ = warren_session::remove_tree(&self.dir);
        let _ = std::fs::remove_file(&self.written);
    }
}

/// How long a fork's files may sit unchanged before a later fork takes them for leftovers
/// (a save and a hold are bounded well below it).
const LEFTOVER_AGE: Duration = Duration::from_secs(2 * 3600);

/// Removes what forks left behind: a save that finished after its caller was gone writes its
/// files where [`Leftovers`] can no longer remove them. Only files unchanged for
/// [`LEFTOVER_AGE`], so no fork under way loses its own.
fn sweep_fork_leftovers(forks: &Path, parent_run: &Path) {
    let stale = |p: &Path| {
        std::fs::symlink_metadata(p)
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok())
            .is_some_and(|age| age > LEFTOVER_AGE)
    };
    if let Ok(dirs) = std::fs::read_dir(forks) {
        for e in dirs.flatten() {
            let p = e.path();
            let newest_inside = std::fs::read_dir(&p)
                .map(|d| d.flatten().all(|f| stale(&f.path())))
                .unwrap_or(true);
            if stale(&p) && newest_inside {
                tracing::info!(path = %p.display(), "removing a fork's leftover files");
                let _ = warren_session::remove_tree(&p);
            }
        }
    }
    if let Ok(files) = std::fs::read_dir(parent_run) {
        for e in files.flatten() {
            let name = e.file_name();
            let name = name.to_string_lossy();
            if name.starts_with("fork-") && name.ends_with(".state") && stale(&e.path()) {
                tracing::info!(path = %e.path().display(), "removing a fork's leftover state");
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_sweep_removes_only_fork_files_left_unchanged_for_long() {
        let t = tempfile::tempdir().expect("tempdir");
        let (forks, run) = (t.path().join("forks"), t.path().join("run"));
        for d in [&forks, &run] {
            std::fs::create_dir(d).expect("mkdir");
        }
        let old = std::time::SystemTime::now() - LEFTOVER_AGE - Duration::from_secs(60);
        let age = |p: &Path| {
            let f = std::fs::File::open(p).expect("open");
            f.set_modified(old).expect("set mtime");
        };
        let file = |p: PathBuf| {
            std::fs::write(&p, b"x").expect("write");
            p
        };
        // Left behind: an old fork directory with old files, an old state file.
        let gone = forks.join("aaaa");
        std::fs::create_dir(&gone).expect("mkdir");
        age(&file(gone.join("disk.qcow2")));
        age(&gone);
        let gone_state = file(run.join("fork-aaaa.state"));
        age(&gone_state);
        // Under way: a new directory, an old directory with a file still being written, a
        // new state file; and an old file of the parent's that is not a fork's.
        let live = forks.join("bbbb");
        std::fs::create_dir(&live).expect("mkdir");
        let busy = forks.join("cccc");
        std::fs::create_dir(&busy).expect("mkdir");
        file(busy.join("disk.qcow2"));
        age(&busy);
        let live_state = file(run.join("fork-bbbb.state"));
        let other = file(run.join("mem"));
        age(&other);
        sweep_fork_leftovers(&forks, &run);
        assert!(!gone.exists() && !gone_state.exists());
        for kept in [&live, &busy, &live_state, &other] {
            assert!(kept.exists(), "{}", kept.display());
        }
    }

    #[tokio::test]
    async fn test_fork_refused_under_an_expired_image_policy() {
        let (state, w, rec) = crate::vm::test_engine_with_vm("vm-0123456789ab");
        // A live supervisor, as far as the engine can tell: its lock is held.
        let dir = w.vm_dir(&rec.id);
        std::fs::create_dir_all(dir.path()).expect("vm dir");
        let lock = std::fs::File::create(dir.lock()).expect("lock");
        let _held = nix::fcntl::Flock::lock(lock, nix::fcntl::FlockArg::LockExclusiveNonblock)
            .map_err(|(_, e)| e)
            .expect("flock");
        let (_, public) = warren_image::trust::generate_key_pair().expect("key");
        std::fs::write(
            state.path().join(warren_image::policy::POLICY_FILE),
            format!(
                "version = 1\nexpires = 2001-01-01T00:00:00Z\n[[keys]]\nname = \"k\"\n\
                 public_key = \"\"\"\n{public}\"\"\"\n"
            ),
        )
        .expect("policy");
        let e = w
            .fork_vm(&ForkVm {
                vm_id: rec.id.clone(),
                count: 1,
                ..ForkVm::default()
            })
            .await
            .expect_err("refused");
        assert_eq!(e.code(), "untrusted_image", "{e}");
        assert!(e.to_string().contains("policy_expired"), "{e}");
    }
}
