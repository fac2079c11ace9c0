//! Actions on VMs, split by concern: creation and boot (`create`), records and their
//! reconciliation with the supervisors, re-adoption and destroy (`reconcile`), suspension,
//! resume and the idle policy (`suspend`), guest work (`guest`), shares and the network
//! description (`mounts`), the host's record of the jobs it last saw (`jobs_seen`), and the
//! QEMU, firmware and kernel each VM is held to at every launch (`artifacts`).
//! Whole-file operations with versions, edits and searches are in `workspace_ops`.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use warren_image::{ImageId, ImageStore, VerifiedImage};
use warren_supervisor::VmDir;
use warren_vmm::accel::{self, AccelChoice};
use warren_vmm::Accel;

use crate::error::CoreError;
use crate::store::{MountSpec, Store, Usage};

pub mod artifacts;
mod create;
pub mod fork;
mod fork_session;
mod guest;
pub mod jobs_seen;
pub mod launch;
mod mounts;
mod orphans;
pub mod pool;
mod reconcile;
mod suspend;
pub mod template;
pub mod template_gc;
pub mod uid_blocks;

pub use guest::expecting_generation;
pub use mounts::{parse_mount, validate_mounts, MAX_MOUNTS};

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
/// Where the host-wide blocks of VM uids begin ([`uid_blocks`]): above systemd's container
/// range (0x00080000-0x6FFFFFFF, which `systemd-nspawn --private-users=pick` and userns
/// managers hand out) and `useradd`'s subordinate ranges (up to 600100000 by default), below
/// 2^31 (ids past it trip old tools).
pub const VM_UID_BASE: u32 = 0x7000_0000;
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
    /// How supervisors are started (`WARREN_SUPERVISORS`, see [`launch`]).
    pub supervisors: launch::SupervisorLaunch,
    /// Shapes with a current template at most; past it the least recently used are
    /// retired (`template_gc`).
    pub max_templates: usize,
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
            supervisors: launch::SupervisorLaunch::from_env(),
            max_templates: template_gc::DEFAULT_MAX_TEMPLATES,
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
    /// The generation the VM starts at (default 1): a session's next VM continues the
    /// session's lineage.
    pub generation: Option<u64>,
    /// Bench and tests only (`warren bench --suite streams`), never offered by the CLI or the
    /// service: a second, raw virtio-serial port the guest user can pump bytes through
    /// (`LaunchSpec::bench_port`).
    pub raw_bench_port: bool,
    /// Restore from the template of this shape (built first if there is none) instead of
    /// booting, when templates serve the shape (`template.rs`); other shapes boot cold.
    pub template: bool,
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
    /// Allow-list (the default) or every public destination (`internet`).
    #[serde(default)]
    pub mode: warren_vmm::NetMode,
    /// Trust the host's CA store too, for hosts behind TLS inspection: the egress verifies
    /// upstream TLS against it and the guest's trust bundle gets its extra CAs.
    #[serde(default)]
    pub host_ca_store: bool,
    /// Header names besides `Authorization` where placeholders are substituted, for secrets
    /// that name no headers of their own.
    #[serde(default)]
    pub secret_headers: Vec<String>,
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
                    // What the host has in use is every workspace's: not told to one of them.
                    let msg = if scope == "host" || scope.ends_with(": host") {
                        format!("{scope} limit of {max} {what} reached ({add} requested)")
                    } else {
                        format!("{scope} limit of {max} {what} reached ({used} in use, {add} requested)")
                    };
                    return Err(CoreError::QuotaExceeded(msg));
                }
            }
        }
        Ok(())
    }
}

/// Admits `add` more of workspace `ws` under its limits and the host's, as they stand in
/// `tx` (`quota_exceeded` otherwise).
pub(crate) fn admit(
    tx: &rusqlite::Transaction<'_>,
    ws: &str,
    workspace_limits: &Limits,
    host_limits: &Limits,
    add: crate::store::Usage,
) -> Result<(), CoreError> {
    workspace_limits.check(
        &format!("workspace {ws}"),
        crate::store::usage(tx, Some(ws))?,
        add,
    )?;
    host_limits.check("host", crate::store::usage(tx, None)?, add)
}

/// Refuses with `conflict`, naming the current generation, unless `expected` is absent or
/// is `current`: an older (or any other) generation means the caller's view of `what`'s
/// memory is not this one's.
pub fn check_generation(what: &str, current: u64, expected: Option<u64>) -> Result<(), CoreError> {
    match expected {
        Some(g) if g != current => Err(CoreError::Conflict(format!(
            "{what} is at generation {current}, not {g}: its memory was lost and rebuilt since"
        ))),
        _ => Ok(()),
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
    /// The first VM uid of this state directory's host-wide block ([`uid_blocks`]); a
    /// non-root Warren runs no VMM as a uid of its own and uses [`VM_UID_BASE`].
    pub(crate) uid_base: u32,
}

/// Resolves an accelerator warning to the user (printed by the CLI).
pub type Warning = String;

impl Warren {
    pub fn open(cfg: WarrenConfig) -> Result<Warren, CoreError> {
        for d in [&cfg.state_dir, &cfg.state_dir.join("vms")] {
            std::fs::create_dir_all(d).map_err(|e| CoreError::io("create", d, e))?;
        }
        // Nothing in them is used before both are known to be the user's (or root's).
        crate::trusted_dir::check(&cfg.state_dir)?;
        std::fs::create_dir_all(&cfg.image_dir)
            .map_err(|e| CoreError::io("create", &cfg.image_dir, e))?;
        crate::trusted_dir::check(&cfg.image_dir)?;
        // VMM processes run as per-VM uids and must traverse to their own directory.
        let vms = cfg.state_dir.join("vms");
        let _ = std::fs::set_permissions(&vms, std::fs::Permissions::from_mode(0o711));
        let _ = std::fs::set_permissions(&cfg.state_dir, std::fs::Permissions::from_mode(0o711));
        let store = Store::open(&cfg.state_dir.join("warren.db"))?;
        let images = ImageStore::open(&cfg.image_dir)?;
        // After the database exists: a block is taken back only from a state without one.
        let uid_base = if nix::unistd::geteuid().is_root() {
            let base = uid_blocks::base_for(&cfg.state_dir)?;
            // VMs made before state directories had blocks of their own may share uids
            // with another state directory's.
            for rec in store.list()? {
                if !(base..base.saturating_add(uid_blocks::BLOCK)).contains(&rec.uid) {
                    tracing::warn!(vm = %rec.id, uid = rec.uid, "this VM's uid lies outside its state directory's uid block, so another state directory's VM may share it: destroy and recreate it");
                }
            }
            base
        } else {
            VM_UID_BASE
        };
        Ok(Warren {
            cfg,
            store,
            images,
            admission: None,
            uid_base,
        })
    }

    /// Another handle on this engine (same configuration, database connection, image store
    /// and admission limits), for work that must outlive its caller.
    pub fn share(&self) -> Warren {
        Warren {
            cfg: self.cfg.clone(),
            store: self.store.clone(),
            images: self.images.clone(),
            admission: self.admission.clone(),
            uid_base: self.uid_base,
        }
    }

    /// The group of this state directory's templates and fork files, which only its own
    /// VMMs are given: its uid block's first id ([`uid_blocks`]; VMs get the ids after it).
    pub fn template_gid(&self) -> u32 {
        self.uid_base
    }

    /// The first uid a VM of this state directory may get.
    pub(crate) fn first_vm_uid(&self) -> u32 {
        self.uid_base + 1
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

    pub(crate) fn vm_dir(&self, id: &str) -> VmDir {
        VmDir(self.cfg.state_dir.join("vms").join(id))
    }

    /// Checks an image's files against its manifest and, when an image policy is in force,
    /// its signatures and attestations under that policy (`warren_image::policy`). Every
    /// boot and launch goes through here.
    pub fn verify_image(&self, id: &ImageId) -> Result<VerifiedImage, CoreError> {
        let image = self.images.verify(id)?;
        self.check_image_policy(id)?;
        Ok(image)
    }

    /// The image policy's verdict on `id`: `None` when no policy is in force, the verified
    /// signer otherwise; a refusal is [`ImageError::Untrusted`](warren_image::ImageError).
    pub fn check_image_policy(
        &self,
        id: &ImageId,
    ) -> Result<Option<warren_image::trust::Verified>, CoreError> {
        let Some(policy) = warren_image::policy::Policy::load(&self.cfg.state_dir)? else {
            return Ok(None);
        };
        let subject = self.images.subject(id)?;
        let material = self.images.trust(id)?;
        warren_image::trust::verify(&policy, &subject, &material)
            .map(Some)
            .map_err(|failure| {
                warren_image::ImageError::Untrusted {
                    image: Some(id.to_string()),
                    failure,
                }
                .into()
            })
    }

    /// Pulls an OCI image by digest into the image store, checked against the image policy
    /// (if any) before its layers are fetched and once more, as every boot checks it, before
    /// it is returned.
    pub async fn pull_image(
        &self,
        reference: &str,
        agent: &Path,
        opts: warren_image::pull::PullOptions,
        progress: &mut (dyn FnMut(warren_image::BuildProgress) + Send),
    ) -> Result<ImageId, CoreError> {
        let policy = warren_image::policy::Policy::load(&self.cfg.state_dir)?;
        let id = warren_image::pull::pull(
            &self.images,
            reference,
            agent,
            policy.as_ref(),
            opts,
            progress,
        )
        .await?;
        self.check_image_policy(&id)?;
        Ok(id)
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

/// Replaces `path` with `data` in one step: a new private file beside it (`.new`), synced,
/// then renamed over it.
fn replace_private(path: &Path, data: &[u8]) -> Result<(), CoreError> {
    let tmp = path.with_extension("new");
    match std::fs::remove_file(&tmp) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(CoreError::io("remove", &tmp, e)),
    }
    write_private(&tmp, data)?;
    std::fs::File::open(&tmp)
        .and_then(|f| f.sync_all())
        .map_err(|e| CoreError::io("sync", &tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| CoreError::io("rename", path, e))
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
    // The supervisor writes its pid into the lock file it holds; killed only when that pid
    // is a supervisor of this very directory (a pid file can outlive its process).
    let pid = std::fs::read_to_string(dir.lock())
        .ok()
        .and_then(|s| s.lines().next().and_then(|l| l.trim().parse::<i32>().ok()));
    let ours = |pid: i32| {
        std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| {
            let args: Vec<&[u8]> = c.split(|b| *b == 0).collect();
            args.contains(&&b"supervise"[..])
                && args.contains(&dir.path().as_os_str().as_encoded_bytes())
        })
    };
    if let (Some(pid), true) = (pid, dir.supervisor_alive()) {
        if !ours(pid) {
            tracing::warn!(pid, dir = %dir.path().display(), "the lock's pid is no supervisor of this VM; not killed");
            return;
        }
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

/// A running VM's record, 256 MiB, for the engine's unit tests.
#[cfg(test)]
pub(crate) fn test_vm(id: &str) -> crate::store::VmRecord {
    crate::store::VmRecord {
        id: id.into(),
        image_id: "a".repeat(64),
        state: crate::store::VmState::Running,
        reason: None,
        memory_mib: 256,
        vcpus: 1,
        accel: "tcg".into(),
        uid: 0,
        created_unix: 0,
        boot_ms: None,
        workspace: "local-0".into(),
        disk_mib: 0,
        generation: 1,
        request_id: None,
        idle_seconds: 0,
        idle_mode: "hibernate".into(),
        last_active_unix: 0,
        mounts: vec![],
        ram_file: false,
    }
}

/// An engine on a fresh state directory (kept alive by the returned guard) holding the
/// running VM record [`test_vm`] `id` (no VM directory, no supervisor), for the engine's
/// unit tests.
#[cfg(test)]
pub(crate) fn test_engine_with_vm(id: &str) -> (tempfile::TempDir, Warren, crate::store::VmRecord) {
    let state = tempfile::tempdir().expect("state");
    let w = Warren::open(WarrenConfig::new(
        state.path().to_path_buf(),
        "/usr/bin/warren".into(),
    ))
    .expect("open");
    let mut rec = test_vm(id);
    w.store
        .insert(&mut rec, w.first_vm_uid(), |_| Ok::<(), CoreError>(()))
        .expect("insert");
    (state, w, rec)
}

/// [`test_engine_with_vm`] with the VM's directory and its supervisor's lock, which the
/// returned guard holds (what the engine checks before it trusts a running record).
#[cfg(test)]
pub(crate) fn test_engine_with_running_vm(
    id: &str,
) -> (tempfile::TempDir, Warren, nix::fcntl::Flock<std::fs::File>) {
    let (state, w, _) = test_engine_with_vm(id);
    let dir = w.vm_dir(id);
    std::fs::create_dir_all(dir.path()).expect("vm dir");
    let lock = std::fs::File::create(dir.lock()).expect("lock file");
    let lock =
        nix::fcntl::Flock::lock(lock, nix::fcntl::FlockArg::LockExclusiveNonblock).expect("lock");
    (state, w, lock)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_check_generation_other_than_current_is_conflict() {
        assert!(check_generation("VM v", 2, None).is_ok());
        assert!(check_generation("VM v", 2, Some(2)).is_ok());
        for stale in [0, 1, 3, u64::MAX] {
            let e = check_generation("VM v", 2, Some(stale)).expect_err("refused");
            assert_eq!(e.code(), "conflict", "{stale}");
            assert!(e.to_string().contains("at generation 2"), "{e}");
        }
    }
}
