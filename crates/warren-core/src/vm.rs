//! Actions on VMs: create, list (with reconciliation), exec, file chunks, logs, destroy.
//! Whole-file operations with versions, edits and searches are in `workspace_ops`.

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
use crate::store::{self as vmstore, MountSpec, Store, Usage, VmRecord, VmState};

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
    /// Host directories shared into the guest (checked by [`validate_mounts`]).
    pub mounts: Vec<MountSpec>,
    /// Guest RAM in a file in the VM's directory: hibernation becomes a fast standby that
    /// saves device state only and flushes the RAM file (which counts as storage).
    pub ram_file: bool,
    /// A NIC behind Warren's fail-closed egress; `None`: no NIC at all.
    pub network: Option<NetworkRequest>,
}

/// A VM's network and egress settings (see `docs/egress.md`). Secret values stay in host
/// files; only their paths are recorded.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct NetworkRequest {
    /// Allowed domains (wildcards `*.example.com`) and IPv4 CIDRs.
    pub allow: Vec<String>,
    /// Denied domains and CIDRs (win over `allow`).
    pub deny: Vec<String>,
    /// File-backed secrets substituted into request headers for their hosts.
    pub secrets: Vec<warren_vmm::NetSecret>,
    /// Upstream resolver (default: the first nameserver of the host's /etc/resolv.conf).
    pub upstream_dns: Option<std::net::SocketAddr>,
    /// Outbound connections from this network namespace instead of the host's (testing).
    pub outbound_netns: Option<PathBuf>,
    /// PEM roots for upstream TLS on intercepted connections (default: Mozilla's).
    pub upstream_roots: Option<PathBuf>,
    /// Requests answered by a host command instead of the upstream (OAuth refresh).
    #[serde(default)]
    pub intercepts: Vec<warren_vmm::NetIntercept>,
    /// The operator's blocked IPv4 CIDRs (or addresses): refused whatever `allow` says.
    #[serde(default)]
    pub blocked_cidrs: Vec<String>,
    /// Terminate every allowed TLS connection so each request's `Host` is held to its SNI
    /// (closes domain fronting; HTTP/1.1 only inside TLS).
    #[serde(default)]
    pub intercept_all_tls: bool,
}

/// The launch description of `net` for VM `id`, checked.
fn net_spec(id: &str, net: &NetworkRequest) -> Result<warren_vmm::NetSpec, CoreError> {
    let upstream_dns = match net.upstream_dns {
        Some(a) => a,
        None => warren_supervisor::network::host_resolver().ok_or_else(|| {
            CoreError::InvalidArgument(
                "no upstream DNS given and no nameserver in /etc/resolv.conf".into(),
            )
        })?,
    };
    let mut mac = [0u8; 3];
    rand::rng().fill_bytes(&mut mac);
    let spec = warren_vmm::NetSpec {
        netns: warren_supervisor::network::netns_name(id),
        mac: format!("52:54:00:{:02x}:{:02x}:{:02x}", mac[0], mac[1], mac[2]),
        upstream_dns,
        outbound_netns: net.outbound_netns.clone(),
        allow: net.allow.clone(),
        deny: net.deny.clone(),
        secrets: net.secrets.clone(),
        upstream_roots: net.upstream_roots.clone(),
        intercepts: net.intercepts.clone(),
        blocked_cidrs: net.blocked_cidrs.clone(),
        intercept_all_tls: net.intercept_all_tls,
    };
    warren_supervisor::network::validate(&spec)
        .map_err(|e| CoreError::InvalidArgument(format!("network: {}", error_text(&e))))?;
    Ok(spec)
}

fn error_text(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(x) = src {
        s.push_str(&format!(": {x}"));
        src = x.source();
    }
    s
}

/// At most this many shared directories per VM.
pub const MAX_MOUNTS: usize = 8;

/// Guest paths a share may not cover: the system's own mounts.
const RESERVED_GUEST_PATHS: &[&str] = &["/proc", "/sys", "/dev", "/run", "/tmp", "/etc", "/usr"];

/// Checks shares before anything is created: absolute canonical host directories, plain
/// absolute guest paths (`[A-Za-z0-9._/-]`, no `..`), none reserved, none twice.
pub fn validate_mounts(mounts: &[MountSpec]) -> Result<(), CoreError> {
    if mounts.len() > MAX_MOUNTS {
        return Err(CoreError::InvalidArgument(format!(
            "at most {MAX_MOUNTS} mounts per VM, got {}",
            mounts.len()
        )));
    }
    let mut seen = std::collections::HashSet::new();
    for m in mounts {
        let g = &m.guest;
        let plain = g.starts_with('/')
            && g.len() > 1
            && g.len() <= 256
            && !g.ends_with('/')
            && g.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._/-".contains(&b))
            && g.split('/')
                .skip(1)
                .all(|c| !c.is_empty() && c != "." && c != "..");
        if !plain {
            return Err(CoreError::InvalidArgument(format!(
                "guest mount path {g:?} must be absolute, normalised and use only [A-Za-z0-9._/-]"
            )));
        }
        if let Some(r) = RESERVED_GUEST_PATHS
            .iter()
            .find(|r| g == *r || g.starts_with(&format!("{r}/")))
        {
            return Err(CoreError::InvalidArgument(format!(
                "guest mount path {g:?} is inside the reserved {r}"
            )));
        }
        if !seen.insert(g.clone()) {
            return Err(CoreError::InvalidArgument(format!(
                "guest mount path {g:?} given twice"
            )));
        }
        let canonical =
            std::fs::canonicalize(&m.host).map_err(|e| CoreError::io("resolve", &m.host, e))?;
        if canonical != m.host || !canonical.is_dir() {
            return Err(CoreError::InvalidArgument(format!(
                "host mount path {} must be a canonical directory",
                m.host.display()
            )));
        }
    }
    Ok(())
}

/// Parses `HOST:GUEST[:ro]` (the CLI's `--mount`); the host path is canonicalised and the
/// guest user maps to `owner`.
pub fn parse_mount(arg: &str, owner: (u32, u32)) -> Result<MountSpec, CoreError> {
    let bad = || CoreError::InvalidArgument(format!("--mount {arg:?}: expected HOST:GUEST[:ro]"));
    let mut parts: Vec<&str> = arg.split(':').collect();
    let read_only = match parts.last() {
        Some(&"ro") if parts.len() == 3 => {
            parts.pop();
            true
        }
        Some(&"rw") if parts.len() == 3 => {
            parts.pop();
            false
        }
        _ => false,
    };
    let [host, guest] = parts[..] else {
        return Err(bad());
    };
    if host.is_empty() || guest.is_empty() {
        return Err(bad());
    }
    let host = std::fs::canonicalize(host).map_err(|e| CoreError::io("resolve", host, e))?;
    let identity = warren_vmm::qemu::virtiofs::identity_of(&host)
        .map_err(|e| CoreError::io("stat", &host, e))?;
    Ok(MountSpec {
        host,
        guest: guest.to_owned(),
        read_only,
        owner: Some(owner),
        identity: Some(identity),
    })
}

/// Identifies every mount: one identified when it was made must still be that directory
/// (`conflict` otherwise); one that was not is identified now. Every later launch of the VM
/// checks the identity again (`warren_vmm::qemu::virtiofs::validate`).
fn identify_mounts(mounts: &mut [MountSpec]) -> Result<(), CoreError> {
    for m in mounts.iter_mut() {
        match m.identity {
            Some(want) => warren_vmm::qemu::virtiofs::check_identity(&m.host, want)
                .map_err(|e| CoreError::Conflict(e.to_string()))?,
            None => {
                m.identity = Some(
                    warren_vmm::qemu::virtiofs::identity_of(&m.host)
                        .map_err(|e| CoreError::io("stat", &m.host, e))?,
                );
            }
        }
    }
    Ok(())
}

/// The shares and kernel arguments for `mounts`: share `fsN` is mounted at its guest path
/// (`warren.mount=TAG:PATH:rw|ro`, read by the guest agent at boot).
fn shares_of(mounts: &[MountSpec]) -> (Vec<warren_vmm::backend::Share>, Vec<String>) {
    let mut shares = Vec::new();
    let mut args = Vec::new();
    for (i, m) in mounts.iter().enumerate() {
        let tag = format!("fs{i}");
        args.push(format!(
            "warren.mount={tag}:{}:{}",
            m.guest,
            if m.read_only { "ro" } else { "rw" }
        ));
        shares.push(warren_vmm::backend::Share {
            tag,
            host_dir: m.host.clone(),
            read_only: m.read_only,
            owner: m.owner,
            identity: m.identity,
        });
    }
    (shares, args)
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
    /// The limits resumes are admitted under (`admission.rs`); `None`: unlimited.
    pub(crate) admission: Option<std::sync::Arc<crate::admission::LimitsFor>>,
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
        Ok(Warren {
            cfg,
            store,
            images,
            admission: None,
        })
    }

    pub fn images(&self) -> &ImageStore {
        &self.images
    }

    pub fn config(&self) -> &WarrenConfig {
        &self.cfg
    }

    pub(crate) fn store(&self) -> &Store {
        &self.store
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
        validate_mounts(&req.mounts)?;
        let virtiofsd = if req.mounts.is_empty() {
            None
        } else {
            Some(
                warren_vmm::qemu::virtiofs::find_virtiofsd()
                    .ok_or(warren_vmm::VmmError::VirtiofsdMissing)?,
            )
        };
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
        let network = req.network.as_ref().map(|n| net_spec(&id, n)).transpose()?;
        let workspace = if req.workspace.is_empty() {
            local_workspace(nix::unistd::geteuid().as_raw())
        } else {
            req.workspace.clone()
        };
        let mut rec = VmRecord {
            workspace,
            disk_mib: image.rootfs_virtual_size.div_ceil(1 << 20)
                + if req.ram_file { u64::from(memory) } else { 0 },
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
            mounts: {
                let mut m = req.mounts.clone();
                identify_mounts(&mut m)?;
                m
            },
            ram_file: req.ram_file,
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
        match self.start(&rec, &image, accel, virtiofsd, network).await {
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
        virtiofsd: Option<PathBuf>,
        network: Option<warren_vmm::NetSpec>,
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
        let (shares, mut extra_cmdline) = shares_of(&rec.mounts);
        if network.is_some() {
            extra_cmdline.push(warren_supervisor::network::guest_kernel_arg());
        }
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
                cpu: Some(warren_vmm::qemu::default_cpu(accel).to_string()),
                extra_cmdline,
                run_as,
                cgroup,
                incoming: false,
                shares,
                virtiofsd,
                ram_file: rec.ram_file.then(|| run.join("guest.ram")),
                network,
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
        let supervisor = self.spawn_supervisor(&dir)?;
        tracing::debug!(ms = t.elapsed().as_millis() as u64, "supervisor spawned");

        let client = SupervisorClient::new(&dir.socket());
        // The socket appears once the supervisor holds its lock.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !dir.socket().exists() {
            if std::time::Instant::now() > deadline || dir.exit_record().exists() {
                // A supervisor that never got its socket up is not left behind: signalled
                // through its pidfd, so a reused pid is never hit.
                if let Some(fd) = &supervisor {
                    let _ = rustix::process::pidfd_send_signal(fd, rustix::process::Signal::KILL);
                }
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

    /// Starts `warren supervise` for `dir`, detached; returns a pidfd on it (none on a kernel
    /// without pidfds, where only the supervisor's own lock-file pid can reach it later).
    fn spawn_supervisor(&self, dir: &VmDir) -> Result<Option<std::os::fd::OwnedFd>, CoreError> {
        use std::os::unix::process::CommandExt;
        let log = warren_vmm::sys::private_file::create(&dir.supervisor_log(), false)
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
        // Opened before the reaper can reap it, so the pidfd is this child's.
        let pid = rustix::process::Pid::from_child(&child);
        let pidfd = rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty())
            .map_err(|e| tracing::warn!(error = %e, "no pidfd on the supervisor"))
            .ok();
        // Reap it if it ends while we still run; otherwise init inherits it.
        std::thread::spawn(move || {
            let _ = child.wait();
        });
        Ok(pidfd)
    }

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
        for rec in self.list_vms()? {
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
            if !plain || !self.vm_dir(id).path().is_dir() || self.vm_dir(id).supervisor_alive() {
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
        warren_supervisor::network::delete_netns(&warren_supervisor::network::netns_name(&rec.id));
        self.store
            .set_state(&rec.id, VmState::Failed, Some(&reason), None)?;
        rec.state = VmState::Failed;
        rec.reason = Some(reason);
        Ok(rec)
    }

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
        if rec.state == VmState::Running && !force {
            // Background processes a finished job left (a dev server) are work too.
            let jobs = self.job_list(id).await?;
            let running = jobs
                .iter()
                .filter(|j| j.state == warren_protocol::JobState::Running)
                .count();
            let background: u64 = jobs.iter().map(|j| u64::from(j.background_processes)).sum();
            if running > 0 || background > 0 {
                return Err(CoreError::Busy(format!(
                    "{running} job(s) running and {background} background process(es) in {id}; pass force to freeze them"
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
                // A session copy's own filesystem that a host restart unmounted is mounted
                // again first: its shares are directories inside it.
                if let Some(s) = self
                    .store
                    .sessions(None)?
                    .into_iter()
                    .find(|s| s.vm_id.as_deref() == Some(id))
                {
                    self.volume_ready(&s).await?;
                }
                // A share whose directory was replaced (or now leads elsewhere through a
                // symlink) while the VM slept refuses the resume; the VM stays hibernated.
                warren_vmm::qemu::virtiofs::validate(&cfg.launch.shares)
                    .map_err(|e| CoreError::Conflict(e.to_string()))?;
                cfg.restore = true;
                cfg.launch.incoming = true;
                let body = serde_json::to_vec_pretty(&cfg).expect("invariant: config serialises");
                // Admission, as for a create: its memory is reserved (the VM is `resuming`)
                // or the resume is refused before anything in the VM directory changes.
                if self.reserve_resume(&rec)? == crate::admission::Reserved::Stale {
                    return self.await_resume(id).await;
                }
                for p in [dir.config(), dir.exit_record(), dir.socket()] {
                    let _ = std::fs::remove_file(p);
                }
                if let Err(e) = write_private(&dir.config(), &body) {
                    self.store.set_state(id, VmState::Hibernated, None, None)?;
                    return Err(e);
                }
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

    /// The running VMs that have been idle for their `idle_seconds` (status and list calls
    /// never count as work), each with the mode its idle policy suspends it in.
    pub fn idle_vms(&self) -> Vec<(String, SuspendMode)> {
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
                (rec.id, mode)
            })
            .collect()
    }

    /// Suspends one idle VM (from [`Warren::idle_vms`]) unless a job or a background process
    /// of a finished job runs in it. `None`: something runs, so the VM stays up and its idle
    /// clock starts again. Each VM's suspension is
    /// independent (its own supervisor, every call under its deadline), so the idle policy
    /// runs them concurrently and a silent guest holds only its own.
    pub async fn suspend_idle_vm(
        &self,
        id: &str,
        mode: SuspendMode,
    ) -> Option<Result<VmState, CoreError>> {
        match self.suspend_vm(id, mode, false).await {
            // Running jobs keep a VM awake: look again after another idle period.
            Err(CoreError::Busy(_)) => {
                let _ = self.store.touch(id, now_unix());
                None
            }
            r => Some(r.map(|r| r.state)),
        }
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

    /// The VM's network as launched (`None`: no NIC), from its supervisor configuration.
    pub fn vm_network(&self, id: &str) -> Option<warren_vmm::NetSpec> {
        let dir = warren_supervisor::layout::VmDir(self.vm_dir_path(id));
        let text = std::fs::read_to_string(dir.config()).ok()?;
        serde_json::from_str::<warren_supervisor::layout::SupervisorConfig>(&text)
            .ok()?
            .launch
            .network
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
            GuestResponse::FileData(d) if d.data.len() > len as usize => {
                Err(CoreError::GuestProtocol(format!(
                    "a read of at most {len} bytes was answered with {}",
                    d.data.len()
                )))
            }
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

pub(crate) fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs()
}
