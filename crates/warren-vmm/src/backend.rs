//! The backend trait the supervisor drives, and the launch description shared by backends.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;

use crate::accel::Accel;
use crate::error::VmmError;

/// Guest memory in MiB.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct MemMib(pub u32);

/// Everything a backend needs to start one VM. Paths are absolute.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct LaunchSpec {
    /// Used for the process name only.
    pub name: String,
    /// Private 0700 directory, owned by `run_as`, where the backend creates its sockets.
    pub run_dir: PathBuf,
    /// Where the VMM's stderr is logged (each virtiofsd's beside it, `virtiofsd-<tag>.log`).
    /// The VMM gets a pipe, never the file: the caller drains [`LaunchedVm::stderr`] into it,
    /// outside `run_dir`, so the VMM can neither redirect the caller's writes nor grow the
    /// file without bound.
    pub stderr_log: PathBuf,
    pub kernel: PathBuf,
    pub initramfs: PathBuf,
    /// The VM's own copy-on-write disk.
    pub disk: PathBuf,
    pub memory: MemMib,
    pub vcpus: u32,
    pub accel: Accel,
    /// QEMU CPU model, fixed when the VM is created so its checkpoints stay loadable across
    /// Warren upgrades ([`crate::qemu::default_cpu`]); `None` (VMs created before Warren
    /// chose one): QEMU's default under TCG, `host` under KVM.
    #[serde(default)]
    pub cpu: Option<String>,
    /// Extra kernel command line arguments appended after the backend's own.
    pub extra_cmdline: Vec<String>,
    /// uid/gid the VMM process runs as; `None` keeps the caller's (non-root developer runs).
    pub run_as: Option<(u32, u32)>,
    /// Host cgroup (v2) directory the VMM process is placed in, if any.
    pub cgroup: Option<PathBuf>,
    /// Start paused, waiting for an incoming migration (a restore from a checkpoint) instead
    /// of booting.
    #[serde(default)]
    pub incoming: bool,
    /// Host directories shared into the guest over virtio-fs, one virtiofsd each.
    #[serde(default)]
    pub shares: Vec<Share>,
    /// The virtiofsd binary; required when `shares` is not empty.
    #[serde(default)]
    pub virtiofsd: Option<PathBuf>,
    /// Guest RAM in this (shared) file instead of anonymous memory: fast standby, where a
    /// checkpoint leaves RAM in the file and saves only device state.
    #[serde(default)]
    pub ram_file: Option<PathBuf>,
    /// A virtio-net NIC on the TAP device `tap0` of this network namespace; `None`: no NIC
    /// at all.
    #[serde(default)]
    pub network: Option<NetSpec>,
    /// Bench and tests only, never set for normal VMs: a second virtio-serial port
    /// (`org.warren.bench.0`) on a UNIX socket chardev QEMU listens on at this path (in the
    /// run directory), the raw-port baseline of `warren bench --suite streams`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bench_port: Option<PathBuf>,
    /// Directories the VMM reads besides its image's and its run directory
    /// ([`crate::sys::view`]): the template its disk backs onto, the fork state it restores
    /// from. Set by the supervisor at each launch from the VM directory, never stored.
    #[serde(default, skip_serializing)]
    pub view_readable: Vec<PathBuf>,
    /// Guest RAM is a private (copy-on-write) mapping of this read-only file: a template's
    /// RAM, which the clone restored from the template's device state starts with. Writes
    /// stay in the clone's own memory; the file is never changed.
    #[serde(default)]
    pub template_ram: Option<PathBuf>,
    /// Guest RAM is a shared memfd of the VM's own that the backend fills with this template
    /// RAM file's data before QEMU starts (`sys::clone_ram`): a clone with shares, whose
    /// device backends (virtiofsd) must map guest RAM, which a private mapping of the
    /// template's file would not let them. The restore reads RAM from it as from a RAM file;
    /// later checkpoints save RAM in full, as for any shared memfd.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clone_ram: Option<PathBuf>,
    /// A fork's copy: guest RAM is a private (copy-on-write) mapping of the pages region of
    /// the parent's `mapped-ram` checkpoint, which the restore then reads no RAM page from
    /// (`qemu::mapped_ram`). The block is `mem` when `named_ram`, else the machine's own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fork_ram: Option<ForkRam>,
    /// Anonymous guest RAM under the backend id `mem` (instead of the machine's own RAM
    /// block), so checkpoints of a VM that started from a template (whose RAM block is
    /// `mem`) load into it.
    #[serde(default)]
    pub named_ram: bool,
    /// Supplementary groups of the VMM process (the templates' group for a clone).
    #[serde(default)]
    pub groups: Vec<u32>,
}

/// Where a fork's copy finds its guest RAM: `path` from byte `offset` on.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ForkRam {
    pub path: PathBuf,
    pub offset: u64,
}

/// A VM's network: its namespace (created by the supervisor, which also runs the egress
/// there) and the egress settings. Secret values never appear here, only host file paths.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct NetSpec {
    /// Namespace name (`/run/netns/NAME`), `warren-<vm id>`.
    pub netns: String,
    /// Guest MAC address.
    pub mac: String,
    /// Upstream recursive resolver the egress asks for allowed names.
    pub upstream_dns: std::net::SocketAddr,
    /// Namespace outbound connections are made from (`None`: the host's). For tests.
    #[serde(default)]
    pub outbound_netns: Option<PathBuf>,
    /// Allowed domains (`*.example.com` wildcards) and CIDRs.
    #[serde(default)]
    pub allow: Vec<String>,
    /// Denied domains and CIDRs (win over `allow`).
    #[serde(default)]
    pub deny: Vec<String>,
    /// File-backed secrets substituted into request headers.
    #[serde(default)]
    pub secrets: Vec<NetSecret>,
    /// PEM roots upstream TLS is verified against on intercepted connections (`None`:
    /// Mozilla's). For tests and private PKI.
    #[serde(default)]
    pub upstream_roots: Option<PathBuf>,
    /// Requests answered by a host command instead of the upstream (OAuth refresh).
    #[serde(default)]
    pub intercepts: Vec<NetIntercept>,
    /// The operator's blocked CIDRs (IPv4 CIDRs or addresses): never reachable, whatever
    /// `allow` says.
    #[serde(default)]
    pub blocked_cidrs: Vec<String>,
    /// Terminate every allowed TLS connection, so each request's `Host` is held to its SNI.
    #[serde(default)]
    pub intercept_all_tls: bool,
    /// What the VM may reach: its allow list only, or every public destination.
    #[serde(default)]
    pub mode: NetMode,
    /// Trust the host's own CA store too (hosts behind TLS inspection): upstream in the
    /// egress, and in the guest's trust bundle.
    #[serde(default)]
    pub host_ca_store: bool,
    /// Header names besides `Authorization` in which the placeholders of secrets that name
    /// no headers of their own are substituted (`x-api-key`).
    #[serde(default)]
    pub secret_headers: Vec<String>,
}

/// A networked VM's egress mode (a VM without network has no NIC: that is "off").
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum NetMode {
    /// Only what the allow list names.
    #[default]
    Allowlist,
    /// Every public destination over TCP, minus the deny list.
    Internet,
}

impl NetMode {
    /// `allowlist` or `internet`.
    pub fn as_str(self) -> &'static str {
        match self {
            NetMode::Allowlist => "allowlist",
            NetMode::Internet => "internet",
        }
    }
}

/// A request (host, method, path prefix) answered on the host by a command instead of the
/// upstream server. The command gets the raw request on stdin and prints a raw response.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct NetIntercept {
    /// Host (SNI or `Host` header) the rule applies to; wildcards as in the allow list.
    pub host: String,
    /// Exact request method.
    pub method: String,
    /// Request-target prefix, starting with `/`.
    pub path_prefix: String,
    /// Program and arguments (absolute program path).
    pub command: Vec<String>,
    /// Host user and group the command runs as (the session owner).
    pub uid: u32,
    pub gid: u32,
    /// Killed after this long; the guest then gets 504.
    pub timeout_ms: u64,
    /// Extra environment for the command.
    #[serde(default)]
    pub env: Vec<(String, String)>,
}

/// A host-held secret known to the guest only by its placeholder.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct NetSecret {
    pub name: String,
    pub placeholder: String,
    /// Hosts the real value may be sent to.
    pub hosts: Vec<String>,
    /// Host file holding the value, re-read on each new connection.
    pub file: PathBuf,
    /// When set, the file is JSON and the value is the string at this JSON pointer
    /// (`/claudeAiOauth/accessToken`), so an agent's own credential file is used in place.
    #[serde(default)]
    pub json_pointer: Option<String>,
    /// Request headers the value is substituted into (empty: `Authorization` and the VM's
    /// `secret_headers`). A `Basic` credential in `Authorization` is substituted inside.
    #[serde(default)]
    pub headers: Vec<String>,
}

/// One host directory shared into the guest (virtio-fs). The guest mounts it by `tag`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Share {
    /// virtio-fs tag: `[a-z0-9]{1,16}`, unique per VM.
    pub tag: String,
    /// Canonical host directory.
    pub host_dir: PathBuf,
    /// Enforced by virtiofsd on the host (`--readonly`), whatever the guest mounts.
    pub read_only: bool,
    /// Host uid/gid that the guest user (uid/gid 1000) maps to, both ways: files the guest
    /// creates belong to it, and its files appear as the guest user's.
    pub owner: Option<(u32, u32)>,
    /// The directory's device and inode when it was checked: every launch refuses a
    /// `host_dir` that no longer is that directory (`None`: records made before this check).
    #[serde(default)]
    pub identity: Option<(u64, u64)>,
}

/// Where a launched VM's endpoints are.
#[derive(Debug, Clone)]
pub struct VmEndpoints {
    /// Serial console (UNIX stream; the VMM waits for a client before starting the guest).
    pub console: PathBuf,
    /// The agent channel's virtio-serial port (UNIX stream).
    pub channel: PathBuf,
    /// The VMM control socket.
    pub control: PathBuf,
}

/// A started VM process.
pub struct LaunchedVm {
    pub child: tokio::process::Child,
    pub endpoints: VmEndpoints,
    /// Device backends started for this VM (virtiofsd, one per share). They exit when the
    /// VMM disconnects; the VM's cgroup reaps any leftover.
    pub helpers: Vec<tokio::process::Child>,
    /// The standard error of the VMM (first) and of each helper: for the caller to drain.
    pub stderr: Vec<StderrPipe>,
}

/// The read end of a child's standard error pipe, and the log it belongs in. A child never
/// gets a log file of its own: what it prints could then grow that file without bound (a
/// guest can make QEMU print an error line per virtqueue kick). The caller drains the pipe
/// into a bounded log, without ever making the child wait (`warren-supervisor::child_log`).
/// Dropped unread, it costs the child only its messages: its writes fail with `EPIPE`, and
/// neither QEMU (it ignores `SIGPIPE` from its start) nor virtiofsd (a Rust program, which
/// ignores it too) dies of that. Both get `SIGKILL` with their supervisor anyway
/// (`sys::process::confine`).
#[derive(Debug)]
pub struct StderrPipe {
    pub log: PathBuf,
    pub pipe: std::os::fd::OwnedFd,
}

impl StderrPipe {
    /// A pipe for a child's stderr: this (the read end) and the write end for the child.
    /// Both ends are close-on-exec; the spawn's `dup2` onto fd 2 makes the child's copy the
    /// only one that survives its `exec`.
    pub fn new(log: PathBuf) -> Result<(StderrPipe, std::os::fd::OwnedFd), VmmError> {
        let (read, write) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)
            .map_err(|e| VmmError::io("create the stderr pipe for", &log, e.into()))?;
        Ok((StderrPipe { log, pipe: read }, write))
    }
}

pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A VMM: creates disks and launches VMs. One instance serves any number of VMs.
pub trait VmBackend: Send + Sync {
    /// Short name for logs and `vm list`.
    fn name(&self) -> &'static str;
    /// Creates `overlay` as a copy-on-write disk over the read-only `base`.
    fn create_disk(&self, base: &Path, overlay: &Path) -> Result<(), VmmError>;
    /// Starts the VM process. The guest does not run until a client connects to the console.
    fn launch(&self, spec: &LaunchSpec) -> Result<LaunchedVm, VmmError>;
    /// Connects to the control endpoint of a launched VM.
    fn control<'a>(
        &'a self,
        endpoints: &'a VmEndpoints,
    ) -> BoxFuture<'a, Result<Box<dyn VmControl>, VmmError>>;
}

/// Run-state control of one VM.
pub trait VmControl: Send {
    fn pause(&mut self) -> BoxFuture<'_, Result<(), VmmError>>;
    fn resume(&mut self) -> BoxFuture<'_, Result<(), VmmError>>;
    /// Asks the VMM to exit now (no guest shutdown).
    fn quit(&mut self) -> BoxFuture<'_, Result<(), VmmError>>;
}
