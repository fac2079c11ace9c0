//! Actions on VMs: create, list (with reconciliation), exec, files, logs, destroy.

use std::os::unix::fs::{chown, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rand::RngCore;
use warren_image::{ImageStore, VerifiedImage};
use warren_protocol::{
    ExecStart, FileRead, FileWrite, GuestResponse, HostRequest, JobId, JobOutput, JobOutputRequest,
    WriteMode,
};
use warren_supervisor::{ExitRecord, SupervisorClient, SupervisorConfig, VmDir};
use warren_vmm::accel::{self, AccelChoice};
use warren_vmm::backend::MemMib;
use warren_vmm::sys::cgroup;
use warren_vmm::{Accel, LaunchSpec};

use crate::error::CoreError;
use crate::store::{self as vmstore, Store, Usage, VmRecord, VmState};

/// Default guest memory: enough for compilers in the `dev` image, cheap under TCG (only
/// touched pages cost host memory).
pub const DEFAULT_MEMORY_MIB: u32 = 512;
pub const DEFAULT_VCPUS: u32 = 1;
/// Bounds accepted for `--memory-mib` and `--vcpus`.
pub const MEMORY_MIB_RANGE: std::ops::RangeInclusive<u32> = 128..=65536;
pub const VCPUS_RANGE: std::ops::RangeInclusive<u32> = 1..=64;
/// How long a guest may take from launch to answering on its channel. TCG boots take ~2 s
/// alone, but 2-core CI machines booting several VMs at once are far slower.
pub const DEFAULT_BOOT_TIMEOUT: Duration = Duration::from_secs(120);
/// First uid handed to VMM processes; each VM gets its own.
pub const VM_UID_BASE: u32 = 2_000_000;
/// The recipe whose newest image is used when none is named.
pub const DEFAULT_IMAGE: &str = "dev";

#[derive(Debug, Clone)]
pub struct WarrenConfig {
    pub state_dir: PathBuf,
    pub image_dir: PathBuf,
    /// The executable that runs `supervise --vm-dir DIR` (the `warren` binary).
    pub supervisor_exe: PathBuf,
    pub accel: AccelChoice,
    pub boot_timeout: Duration,
}

impl WarrenConfig {
    /// Defaults for a state directory: images in `<state>/images`.
    pub fn new(state_dir: PathBuf, supervisor_exe: PathBuf) -> Self {
        WarrenConfig {
            image_dir: state_dir.join("images"),
            state_dir,
            supervisor_exe,
            accel: AccelChoice::Auto,
            boot_timeout: DEFAULT_BOOT_TIMEOUT,
        }
    }
}

#[derive(Debug, Clone, Default)]
pub struct CreateVm {
    pub image: Option<String>,
    pub memory_mib: Option<u32>,
    pub vcpus: Option<u32>,
    /// The owner; empty means the calling user's local workspace.
    pub workspace: String,
    /// The idempotency key of the creating request (unique per workspace).
    pub request_id: Option<String>,
    /// Host-wide limits, checked atomically with the VM's admission.
    pub host_limits: Limits,
    /// The owning workspace's limits.
    pub workspace_limits: Limits,
    /// Suspend after this many seconds without work (default 300; 0 disables).
    pub idle_seconds: Option<u32>,
    /// How an idle VM is suspended (default hibernate).
    pub idle_mode: Option<SuspendMode>,
}

/// How a VM is suspended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SuspendMode {
    /// vCPUs stopped, RAM kept in the VMM (fast, holds host memory).
    Pause,
    /// Memory and device state written to disk, VMM ended (holds no host memory).
    Hibernate,
}

impl SuspendMode {
    pub fn as_str(self) -> &'static str {
        match self {
            SuspendMode::Pause => "pause",
            SuspendMode::Hibernate => "hibernate",
        }
    }

    pub fn parse(s: &str) -> Option<SuspendMode> {
        match s {
            "pause" => Some(SuspendMode::Pause),
            "hibernate" => Some(SuspendMode::Hibernate),
            _ => None,
        }
    }
}

/// Seconds without work after which a VM is suspended, unless configured otherwise.
pub const DEFAULT_IDLE_SECONDS: u32 = 300;

/// Admission limits; `None` is unlimited.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Limits {
    pub max_vms: Option<u64>,
    pub max_memory_mib: Option<u64>,
    pub max_storage_mib: Option<u64>,
}

impl Limits {
    /// Refuses `add` on top of `used` when it would pass a limit; `scope` names whose limit.
    pub fn check(&self, scope: &str, used: Usage, add: Usage) -> Result<(), CoreError> {
        let checks = [
            ("VMs", self.max_vms, used.vms, add.vms),
            (
                "MiB of memory",
                self.max_memory_mib,
                used.memory_mib,
                add.memory_mib,
            ),
            (
                "MiB of storage",
                self.max_storage_mib,
                used.disk_mib,
                add.disk_mib,
            ),
        ];
        for (what, max, used, add) in checks {
            if let Some(max) = max {
                if used + add > max {
                    return Err(CoreError::QuotaExceeded(format!(
                        "{scope} limit of {max} {what} reached ({used} in use, {add} requested)"
                    )));
                }
            }
        }
        Ok(())
    }
}

/// The workspace a local user acts as.
pub fn local_workspace(uid: u32) -> String {
    format!("local-{uid}")
}

pub struct Warren {
    cfg: WarrenConfig,
    store: Store,
    images: ImageStore,
}

/// Resolves an accelerator warning to the user (printed by the CLI).
pub type Warning = String;

impl Warren {
    pub fn open(cfg: WarrenConfig) -> Result<Warren, CoreError> {
        for d in [&cfg.state_dir, &cfg.state_dir.join("vms")] {
            std::fs::create_dir_all(d).map_err(|e| CoreError::io("create", d, e))?;
        }
        // VMM processes run as per-VM uids and must traverse to their own directory.
        let vms = cfg.state_dir.join("vms");
        let _ = std::fs::set_permissions(&vms, std::fs::Permissions::from_mode(0o711));
        let _ = std::fs::set_permissions(&cfg.state_dir, std::fs::Permissions::from_mode(0o711));
        let store = Store::open(&cfg.state_dir.join("warren.db"))?;
        let images = ImageStore::open(&cfg.image_dir)?;
        Ok(Warren { cfg, store, images })
    }

    pub fn images(&self) -> &ImageStore {
        &self.images
    }

    pub fn config(&self) -> &WarrenConfig {
        &self.cfg
    }

    fn vm_dir(&self, id: &str) -> VmDir {
        VmDir(self.cfg.state_dir.join("vms").join(id))
    }

    /// Removes an image unless a VM uses it.
    pub fn remove_image(&self, spec: &str) -> Result<String, CoreError> {
        let id = self.images.resolve(spec)?;
        if let Some(vm) = self.store.vm_using_image(&id.to_string())? {
            return Err(CoreError::ImageInUse(id.to_string(), vm));
        }
        self.images.remove(&id)?;
        Ok(id.to_string())
    }

    /// Resolves the accelerator, probing KVM with `image` when asked for `auto`.
    pub async fn resolve_accel(
        &self,
        image: &VerifiedImage,
    ) -> Result<(Accel, Option<Warning>), CoreError> {
        let qemu = accel::find_qemu()?;
        let cache = probe_cache_dir(&self.cfg.state_dir);
        let choice = self.cfg.accel;
        // The probe boots the image's own kernel and base initramfs: with no per-VM secret the
        // agent prints its failing phase right away, which proves the guest reached user space.
        let probe = warren_vmm::qemu::probe_kvm(
            &qemu,
            &image.kernel,
            &image.initramfs,
            "guest",
            accel::KVM_PROBE_DEADLINE,
        );
        let r = accel::resolve(choice, &cache, &qemu, probe).await?;
        Ok((r.accel, r.warning))
    }

    /// Creates and boots a VM; returns its record once the guest answered.
    pub async fn create_vm(
        &self,
        req: &CreateVm,
        warn: &mut (dyn FnMut(&str) + Send),
    ) -> Result<VmRecord, CoreError> {
        let memory = req.memory_mib.unwrap_or(DEFAULT_MEMORY_MIB);
        if !MEMORY_MIB_RANGE.contains(&memory) {
            return Err(CoreError::InvalidArgument(format!(
                "memory_mib must be within {MEMORY_MIB_RANGE:?}, got {memory}"
            )));
        }
        let vcpus = req.vcpus.unwrap_or(DEFAULT_VCPUS);
        if !VCPUS_RANGE.contains(&vcpus) {
            return Err(CoreError::InvalidArgument(format!(
                "vcpus must be within {VCPUS_RANGE:?}, got {vcpus}"
            )));
        }
        let t = std::time::Instant::now();
        let spec = req.image.as_deref().unwrap_or(DEFAULT_IMAGE);
        let image_id = self.images.resolve(spec)?;
        let image = self.images.verify(&image_id)?;
        tracing::debug!(ms = t.elapsed().as_millis() as u64, "image verified");
        let (accel, warning) = self.resolve_accel(&image).await?;
        tracing::debug!(ms = t.elapsed().as_millis() as u64, %accel, "accelerator resolved");
        if let Some(w) = warning {
            warn(&w);
        }

        let mut id_bytes = [0u8; 6];
        rand::rng().fill_bytes(&mut id_bytes);
        let id = format!("vm-{}", hex::encode(id_bytes));
        let workspace = if req.workspace.is_empty() {
            local_workspace(nix::unistd::geteuid().as_raw())
        } else {
            req.workspace.clone()
        };
        let mut rec = VmRecord {
            workspace,
            disk_mib: image.rootfs_virtual_size.div_ceil(1 << 20),
            generation: 1,
            request_id: req.request_id.clone(),
            idle_seconds: req.idle_seconds.unwrap_or(DEFAULT_IDLE_SECONDS),
            idle_mode: req
                .idle_mode
                .unwrap_or(SuspendMode::Hibernate)
                .as_str()
                .to_string(),
            last_active_unix: now_unix(),
            id: id.clone(),
            image_id: image_id.to_string(),
            state: VmState::Creating,
            reason: None,
            memory_mib: memory,
            vcpus,
            accel: accel.to_string(),
            uid: 0,
            created_unix: now_unix(),
            boot_ms: None,
        };
        let add = Usage {
            vms: 1,
            memory_mib: u64::from(memory),
            disk_mib: rec.disk_mib,
        };
        let ws = rec.workspace.clone();
        self.store
            .insert(&mut rec, VM_UID_BASE, |tx| -> Result<(), CoreError> {
                req.workspace_limits.check(
                    &format!("workspace {ws}"),
                    vmstore::usage(tx, Some(&ws))?,
                    add,
                )?;
                req.host_limits
                    .check("host", vmstore::usage(tx, None)?, add)
            })?;
        match self.start(&rec, &image, accel).await {
            Ok(boot_ms) => {
                self.store
                    .set_state(&id, VmState::Running, None, Some(boot_ms))?;
                rec.state = VmState::Running;
                rec.boot_ms = Some(boot_ms);
                Ok(rec)
            }
            Err(e) => {
                let reason = e.to_string();
                self.store
                    .set_state(&id, VmState::Failed, Some(&reason), None)?;
                Err(e)
            }
        }
    }

    async fn start(
        &self,
        rec: &VmRecord,
        image: &VerifiedImage,
        accel: Accel,
    ) -> Result<u64, CoreError> {
        let dir = self.vm_dir(&rec.id);
        // The VM directory is root's (0711: the VMM may only traverse it); the VMM's own
        // files live in `run/`, owned by the VM's uid.
        let p = dir.path();
        std::fs::create_dir(p).map_err(|e| CoreError::io("create", p, e))?;
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o711))
            .map_err(|e| CoreError::io("chmod", p, e))?;
        let run = dir.run_dir();
        std::fs::create_dir(&run).map_err(|e| CoreError::io("create", &run, e))?;
        std::fs::set_permissions(&run, std::fs::Permissions::from_mode(0o700))
            .map_err(|e| CoreError::io("chmod", &run, e))?;
        let root = nix::unistd::geteuid().is_root();
        let run_as = root.then_some((rec.uid, rec.uid));
        let give = |path: &Path| -> Result<(), CoreError> {
            if let Some((u, g)) = run_as {
                chown(path, Some(u), Some(g)).map_err(|e| CoreError::io("chown", path, e))?;
            }
            Ok(())
        };
        give(&run)?;

        let disk = run.join("disk.qcow2");
        warren_vmm::disk::create_overlay(&image.rootfs, &disk)?;
        give(&disk)?;

        let mut secret = [0u8; warren_protocol::SECRET_LEN];
        rand::rng().fill_bytes(&mut secret);
        write_private(&dir.secret(), &secret)?;
        let initramfs = run.join("initramfs.cpio");
        warren_image::write_vm_initramfs(&image.initramfs, &secret, &initramfs)?;
        std::fs::set_permissions(&initramfs, std::fs::Permissions::from_mode(0o400))
            .map_err(|e| CoreError::io("chmod", &initramfs, e))?;
        give(&initramfs)?;

        let cgroup = if root {
            cgroup::Hierarchy::detect().map(|h| h.vm_cgroup(&rec.id))
        } else {
            None
        };
        let cfg = SupervisorConfig {
            vm_id: rec.id.clone(),
            launch: LaunchSpec {
                name: rec.id.clone(),
                run_dir: run.clone(),
                stderr_log: dir.qemu_stderr(),
                kernel: image.kernel.clone(),
                initramfs,
                disk,
                memory: MemMib(rec.memory_mib),
                vcpus: rec.vcpus,
                accel,
                extra_cmdline: vec![],
                run_as,
                cgroup,
                incoming: false,
            },
            boot_timeout_ms: self.cfg.boot_timeout.as_millis() as u64,
            restore: false,
        };
        let body = serde_json::to_vec_pretty(&cfg).expect("invariant: config serialises");
        write_private(&dir.config(), &body)?;
        self.launch_and_wait(&dir).await
    }

    /// Starts the VM's supervisor and waits until its guest answers (or fails to).
    async fn launch_and_wait(&self, dir: &VmDir) -> Result<u64, CoreError> {
        let dir = dir.clone();
        let t = std::time::Instant::now();
        self.spawn_supervisor(&dir)?;
        tracing::debug!(ms = t.elapsed().as_millis() as u64, "supervisor spawned");

        let client = SupervisorClient::new(&dir.socket());
        // The socket appears once the supervisor holds its lock.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !dir.socket().exists() {
            if std::time::Instant::now() > deadline || dir.exit_record().exists() {
                let reason = dir
                    .read_exit()
                    .map(|r| r.reason)
                    .unwrap_or_else(|| tail(&dir.supervisor_log(), 10));
                return Err(CoreError::BootFailed(reason));
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        match client
            .wait_ready(self.cfg.boot_timeout + Duration::from_secs(5))
            .await
        {
            Ok(st) => Ok(st.boot_ms.unwrap_or(0)),
            Err(e) => {
                // The supervisor records the precise reason (console tail included).
                let _ = client.stop().await;
                if !wait_supervisor_exit(&dir, Duration::from_secs(10)).await {
                    // Never leave a VM running behind a failed create.
                    kill_supervisor(&dir);
                    wait_supervisor_exit(&dir, Duration::from_secs(5)).await;
                }
                let reason = dir.read_exit().map(|r| r.reason).unwrap_or_else(|| {
                    format!("{e}; supervisor log:\n{}", tail(&dir.supervisor_log(), 10))
                });
                Err(CoreError::BootFailed(reason))
            }
        }
    }

    fn spawn_supervisor(&self, dir: &VmDir) -> Result<(), CoreError> {
        use std::os::unix::process::CommandExt;
        let log = std::fs::File::create(dir.supervisor_log())
            .map_err(|e| CoreError::io("create", dir.supervisor_log(), e))?;
        let log2 = log
            .try_clone()
            .map_err(|e| CoreError::io("dup", dir.supervisor_log(), e))?;
        let mut cmd = std::process::Command::new(&self.cfg.supervisor_exe);
        cmd.arg("supervise")
            .arg("--vm-dir")
            .arg(dir.path())
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log2)
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()),
            )
            // Its own session: terminal signals to the CLI never reach it.
            .process_group(0);
        let mut child = cmd
            .spawn()
            .map_err(|e| CoreError::io("spawn", &self.cfg.supervisor_exe, e))?;
        // Reap it if it ends while we still run; otherwise init inherits it.
        std::thread::spawn(move || {
            let _ = child.wait();
        });
        Ok(())
    }

    /// All VMs, with states reconciled against their supervisors.
    pub fn list_vms(&self) -> Result<Vec<VmRecord>, CoreError> {
        let mut out = Vec::new();
        for rec in self.store.list()? {
            out.push(self.reconcile(rec)?);
        }
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
        if dir.supervisor_alive() {
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
        self.store
            .set_state(&rec.id, VmState::Failed, Some(&reason), None)?;
        rec.state = VmState::Failed;
        rec.reason = Some(reason);
        Ok(rec)
    }

    /// Suspends a running VM: `Pause` keeps its RAM in the VMM; `Hibernate` writes memory and
    /// device state to its directory and ends the VMM. Active jobs refuse it with `busy`
    /// unless `force` (they are frozen either way and keep their timeout budgets).
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
        if rec.state == VmState::Running && !force {
            let running = self
                .job_list(id)
                .await?
                .iter()
                .filter(|j| j.state == warren_protocol::JobState::Running)
                .count();
            if running > 0 {
                return Err(CoreError::Busy(format!(
                    "{running} job(s) running in {id}; pass force to freeze them"
                )));
            }
        }
        match mode {
            SuspendMode::Pause => {
                client.pause().await?;
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
    pub async fn resume_vm(&self, id: &str) -> Result<VmRecord, CoreError> {
        let mut rec = self.get_vm(id)?;
        let dir = self.vm_dir(id);
        match rec.state {
            VmState::Running => return Ok(rec),
            VmState::Paused => {
                SupervisorClient::new(&dir.socket()).resume().await?;
            }
            VmState::Hibernated => {
                let ck = dir.read_checkpoint().ok_or_else(|| {
                    CoreError::CheckpointIncompatible(format!("{id} has no completed checkpoint"))
                })?;
                // The disk overlay's backing file is the image's root filesystem: it must
                // still be the image the VM was created from.
                let image_id = warren_image::ImageId::parse(&rec.image_id)?;
                self.images.verify(&image_id)?;
                let (qemu, firmware) = warren_supervisor::vmm_digests();
                if ck.qemu_sha256 != qemu || ck.firmware_sha256 != firmware {
                    return Err(CoreError::CheckpointIncompatible(format!(
                        "{id} was hibernated under another QEMU binary or firmware \
                         (microvm has no versioned machine types); reinstall that QEMU to resume it"
                    )));
                }
                let mut cfg: SupervisorConfig = serde_json::from_slice(
                    &std::fs::read(dir.config())
                        .map_err(|e| CoreError::io("read", dir.config(), e))?,
                )
                .map_err(|e| CoreError::InvalidArgument(format!("supervisor config: {e}")))?;
                cfg.restore = true;
                cfg.launch.incoming = true;
                let body = serde_json::to_vec_pretty(&cfg).expect("invariant: config serialises");
                for p in [dir.config(), dir.exit_record(), dir.socket()] {
                    let _ = std::fs::remove_file(p);
                }
                write_private(&dir.config(), &body)?;
                self.store.set_state(id, VmState::Resuming, None, None)?;
                if let Err(e) = self.launch_and_wait(&dir).await {
                    // Never retried onto another memory image: the VM is failed.
                    let reason = e.to_string();
                    self.store
                        .set_state(id, VmState::Failed, Some(&reason), None)?;
                    return Err(e);
                }
                // The checkpoint is consumed: the VM runs on from it now.
                let _ = std::fs::remove_file(dir.checkpoint_record());
                let _ = std::fs::remove_file(dir.checkpoint_state());
            }
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

    /// Suspends every running VM that has been idle for its `idle_seconds` and has no
    /// running job (status and list calls never count as work). Returns what it did.
    pub async fn suspend_idle(&self) -> Vec<(String, Result<VmState, CoreError>)> {
        let now = now_unix();
        let mut done = Vec::new();
        let Ok(list) = self.list_vms() else {
            return done;
        };
        for rec in list {
            let idle = rec.idle_seconds > 0
                && rec.state == VmState::Running
                && now.saturating_sub(rec.last_active_unix) >= u64::from(rec.idle_seconds);
            if !idle {
                continue;
            }
            let mode = SuspendMode::parse(&rec.idle_mode).unwrap_or(SuspendMode::Hibernate);
            match self.suspend_vm(&rec.id, mode, false).await {
                // Running jobs keep a VM awake: look again after another idle period.
                Err(CoreError::Busy(_)) => {
                    let _ = self.store.touch(&rec.id, now);
                }
                r => done.push((rec.id, r.map(|r| r.state))),
            }
        }
        done
    }

    /// A client for the VM, resuming it first if it is suspended (work wakes a VM).
    pub async fn awake_client(&self, id: &str) -> Result<SupervisorClient, CoreError> {
        self.store.touch(id, now_unix())?;
        let rec = self.get_vm(id)?;
        if matches!(rec.state, VmState::Paused | VmState::Hibernated) {
            self.resume_vm(id).await?;
        }
        self.client(id)
    }

    /// A client for a running VM.
    pub fn client(&self, id: &str) -> Result<SupervisorClient, CoreError> {
        let rec = self.get_vm(id)?;
        if rec.state != VmState::Running {
            return Err(CoreError::VmNotRunning {
                id: rec.id,
                state: rec.state.as_str().to_string(),
                reason: rec.reason,
            });
        }
        Ok(SupervisorClient::new(&self.vm_dir(id).socket()))
    }

    /// Stops the VM if it runs and removes every trace of it.
    pub async fn destroy_vm(&self, id: &str) -> Result<(), CoreError> {
        let rec = self
            .store
            .get(id)?
            .ok_or_else(|| CoreError::VmNotFound(id.to_string()))?;
        let dir = self.vm_dir(&rec.id);
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
            cgroup::kill_and_remove(&h.vm_cgroup(&rec.id))?;
        }
        match std::fs::remove_dir_all(dir.path()) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(CoreError::io("remove", dir.path(), e)),
        }
        self.store.delete(&rec.id)?;
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

    pub fn vm_dir_path(&self, id: &str) -> PathBuf {
        self.vm_dir(id).0
    }

    pub async fn exec_start(&self, id: &str, req: ExecStart) -> Result<JobId, CoreError> {
        match self
            .awake_client(id)
            .await?
            .guest(HostRequest::ExecStart(req))
            .await?
        {
            GuestResponse::ExecStarted(j) => Ok(j),
            _ => Err(unexpected()),
        }
    }

    pub async fn job_output(
        &self,
        id: &str,
        req: JobOutputRequest,
    ) -> Result<JobOutput, CoreError> {
        match self
            .awake_client(id)
            .await?
            .guest(HostRequest::JobOutput(req))
            .await?
        {
            GuestResponse::JobOutput(o) => Ok(o),
            _ => Err(unexpected()),
        }
    }

    /// The jobs the guest retains, oldest first.
    pub async fn job_list(&self, id: &str) -> Result<Vec<warren_protocol::JobSummary>, CoreError> {
        match self.client(id)?.guest(HostRequest::JobList).await? {
            GuestResponse::Jobs(j) => Ok(j),
            _ => Err(unexpected()),
        }
    }

    pub async fn job_cancel(&self, id: &str, job: JobId) -> Result<(), CoreError> {
        match self
            .awake_client(id)
            .await?
            .guest(HostRequest::JobCancel(job))
            .await?
        {
            GuestResponse::JobCancelled => Ok(()),
            _ => Err(unexpected()),
        }
    }

    /// Reads one chunk of a file (at most `MAX_FILE_CHUNK` bytes).
    pub async fn read_file_chunk(
        &self,
        id: &str,
        path: &str,
        offset: u64,
        len: u32,
    ) -> Result<warren_protocol::FileData, CoreError> {
        let req = HostRequest::FileRead(FileRead {
            path: path.to_string(),
            offset,
            len,
        });
        match self.awake_client(id).await?.guest(req).await? {
            GuestResponse::FileData(d) => Ok(d),
            _ => Err(unexpected()),
        }
    }

    /// Writes one chunk (at most `MAX_FILE_CHUNK` bytes), creating parent directories.
    pub async fn write_file_chunk(
        &self,
        id: &str,
        path: &str,
        mode: WriteMode,
        data: Vec<u8>,
    ) -> Result<u64, CoreError> {
        let n = data.len() as u64;
        let req = HostRequest::FileWrite(FileWrite {
            path: path.to_string(),
            mode,
            data,
            create_parents: true,
        });
        match self.awake_client(id).await?.guest(req).await? {
            GuestResponse::FileWritten(_) => Ok(n),
            _ => Err(unexpected()),
        }
    }

    /// Reads a whole file in bounded chunks.
    pub async fn read_file(
        &self,
        id: &str,
        path: &str,
        sink: &mut dyn FnMut(&[u8]),
    ) -> Result<u64, CoreError> {
        let mut offset = 0u64;
        loop {
            let d = self
                .read_file_chunk(id, path, offset, warren_protocol::limits::MAX_FILE_CHUNK)
                .await?;
            offset += d.data.len() as u64;
            sink(&d.data);
            if d.eof || d.data.is_empty() {
                return Ok(offset);
            }
        }
    }

    /// Writes a whole file from `source`, chunked to the protocol's bound.
    pub async fn write_file(
        &self,
        id: &str,
        path: &str,
        source: &mut dyn std::io::Read,
    ) -> Result<u64, CoreError> {
        let chunk = warren_protocol::limits::MAX_FILE_CHUNK as usize;
        let mut total = 0u64;
        loop {
            let mut buf = vec![0u8; chunk];
            let mut n = 0;
            while n < chunk {
                let r = source
                    .read(&mut buf[n..])
                    .map_err(|e| CoreError::io("read", "<input>", e))?;
                if r == 0 {
                    break;
                }
                n += r;
            }
            buf.truncate(n);
            if n == 0 && total > 0 {
                return Ok(total);
            }
            let mode = if total == 0 {
                WriteMode::Truncate
            } else {
                WriteMode::At(total)
            };
            total += self.write_file_chunk(id, path, mode, buf).await?;
            if n < chunk {
                return Ok(total);
            }
        }
    }
}

pub(crate) fn unexpected() -> CoreError {
    CoreError::Supervisor(warren_supervisor::client::ClientError::Unexpected)
}

/// Where accelerator verdicts are cached: they hold for one host boot, so a runtime directory
/// (cleared at reboot, shared by every state directory) when there is one.
fn probe_cache_dir(state_dir: &Path) -> PathBuf {
    if nix::unistd::geteuid().is_root() {
        return PathBuf::from("/run/warren");
    }
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(d) => PathBuf::from(d).join("warren"),
        None => state_dir.join("cache"),
    }
}

fn write_private(path: &Path, data: &[u8]) -> Result<(), CoreError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .create_new(true)
        .write(true)
        .mode(0o600)
        .open(path)
        .map_err(|e| CoreError::io("create", path, e))?;
    f.write_all(data)
        .map_err(|e| CoreError::io("write", path, e))
}

fn tail(path: &Path, n: usize) -> String {
    let s = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

async fn wait_supervisor_exit(dir: &VmDir, limit: Duration) -> bool {
    let deadline = std::time::Instant::now() + limit;
    while dir.supervisor_alive() {
        if std::time::Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    true
}

fn kill_supervisor(dir: &VmDir) {
    // The supervisor writes its pid into the lock file it holds.
    let pid = std::fs::read_to_string(dir.lock())
        .ok()
        .and_then(|s| s.trim().parse::<i32>().ok());
    if let (Some(pid), true) = (pid, dir.supervisor_alive()) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
}

fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs()
}
