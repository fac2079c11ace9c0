//! Guest bring-up, run once by PID 1 before the runtime starts. Phases, in order:
//! 1. `early-mounts`: proc, sysfs, devtmpfs; the console becomes stdin/stdout/stderr;
//!    then `clock`: is the kernel's timer sound ([`crate::clock`])?
//! 2. `modules`: `finit_module` the boot-critical modules listed in `/etc/warren/modules`
//!    (the rest are opened now and loaded in the background once the agent serves);
//! 3. `secret`: read the per-VM secret from the initramfs into memory;
//! 4. `root`: wait for `/dev/vda`, mount it (ext4) at `/newroot` and switch root into it the
//!    way busybox `switch_root` does (the agent stays PID 1 and keeps running);
//! 5. `system`: tmpfs, devpts, hostname, the identity files in memory
//!    ([`crate::identity_files`]);
//! 6. `cgroup`: cgroup2 (`favordynmods`) with `jobs/` holding one cgroup per job;
//! 7. `shares`: mount the host directories named by `warren.mount=TAG:PATH:rw|ro` kernel
//!    arguments (virtio-fs; read-only is also enforced by the host's virtiofsd);
//! 8. `port`: find and open the virtio-serial port, once, never to be closed;
//!
//! then [`serve`] starts the agent and prints `READY_LINE`. A failing phase prints
//! `guest: <phase> failed: <error chain>` on the console and powers the VM off.

use std::error::Error;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::kmod::{finit_module, ModuleInitFlags};
use nix::mount::{mount, MsFlags};
use nix::sys::reboot::{reboot, RebootMode};
use warren_protocol::limits::GUEST_USER_ID;
use warren_protocol::{
    BENCH_PORT_ARG, BENCH_PORT_NAME, PORT_NAME, READY_LINE, SECRET_LEN, SECRET_PATH,
};

use crate::files::FilesConfig;
use crate::jobs::{JobManager, JobsConfig};
use crate::reaper::{ReapMode, Reaper};
use crate::session::{Agent, Secret, System};

const MODULE_LIST: &str = "/etc/warren/modules";
const ROOT_DEVICE: &str = "/dev/vda";
const NEW_ROOT: &str = "/newroot";
const WORKSPACE: &str = "/workspace";
const CGROUP_ROOT: &str = "/sys/fs/cgroup";
const VIRTIO_PORTS: &str = "/sys/class/virtio-ports";
/// Bounded waits for devices that appear asynchronously after their driver probes.
const ROOT_DEVICE_WAIT: Duration = Duration::from_secs(5);
const PORT_WAIT: Duration = Duration::from_secs(10);
const POLL: Duration = Duration::from_millis(10);
/// `MODULE_INIT_COMPRESSED_FILE`: let the kernel decompress `.ko.xz`/`.ko.zst`.
const MODULE_INIT_COMPRESSED_FILE: u32 = 4;

/// What boot hands to the serving agent.
pub struct Booted {
    port: File,
    secret: Secret,
    /// Opened before switch-root, loaded once the agent serves.
    deferred_modules: Vec<(String, File)>,
    /// Where the shares are mounted (for [`crate::coherence`] after a resume).
    share_mounts: Vec<PathBuf>,
}

/// A failed boot step.
#[derive(Debug, thiserror::Error)]
pub enum BootError {
    #[error("mount {target}")]
    Mount {
        target: String,
        #[source]
        source: nix::Error,
    },
    #[error("{what} {path}")]
    Io {
        what: &'static str,
        path: String,
        #[source]
        source: io::Error,
    },
    #[error("load module {path}")]
    Module {
        path: String,
        #[source]
        source: nix::Error,
    },
    #[error("{what}")]
    Sys {
        what: &'static str,
        #[source]
        source: nix::Error,
    },
    #[error(transparent)]
    Clock(#[from] crate::clock::ClockError),
    #[error("{0}")]
    Other(String),
}

/// The phase whose failure the host answers by booting the VM again
/// ([`warren_protocol::CLOCK_FAILED_LINE`]).
const CLOCK_PHASE: &str = "clock";
/// The timer check could not be made (a malformed argument, an unreadable listing): another
/// boot would fail the same way, so it is not [`CLOCK_PHASE`].
const TIMER_CHECK_PHASE: &str = "timer-check";

type Phase<T> = Result<T, BootError>;

fn io_err(what: &'static str, path: impl AsRef<Path>) -> impl FnOnce(io::Error) -> BootError {
    let path = path.as_ref().display().to_string();
    move |source| BootError::Io { what, path, source }
}

fn do_mount(
    source: &str,
    target: &str,
    fstype: &str,
    flags: MsFlags,
    data: Option<&str>,
) -> Phase<()> {
    fs::create_dir_all(target).map_err(io_err("mkdir", target))?;
    match mount(Some(source), target, Some(fstype), flags, data) {
        // Already mounted (e.g. devtmpfs by the kernel): fine.
        Ok(()) | Err(nix::Error::EBUSY) => Ok(()),
        Err(source) => Err(BootError::Mount {
            target: target.to_owned(),
            source,
        }),
    }
}

/// Runs the boot phases; on failure returns the phase name and the error.
pub fn boot() -> Result<Booted, (&'static str, BootError)> {
    early_mounts().map_err(|e| ("early-mounts", e))?;
    let cmdline = fs::read_to_string("/proc/cmdline")
        .map_err(io_err("read", "/proc/cmdline"))
        .map_err(|e| ("early-mounts", e))?;
    // Before anything that sleeps: a kernel without a timer never wakes from a sleep.
    crate::clock::check(&cmdline).map_err(|e| {
        let phase = if e.transient() {
            CLOCK_PHASE
        } else {
            TIMER_CHECK_PHASE
        };
        (phase, e.into())
    })?;
    let shares = parse_shares(&cmdline).map_err(|e| ("shares", e))?;
    let net = parse_net(&cmdline).map_err(|e| ("network", e))?;
    let deferred = load_modules(!shares.is_empty(), net.is_some()).map_err(|e| ("modules", e))?;
    let secret = read_secret().map_err(|e| ("secret", e))?;
    switch_root().map_err(|e| ("root", e))?;
    system_setup().map_err(|e| ("system", e))?;
    cgroup_setup().map_err(|e| ("cgroup", e))?;
    mount_shares(&shares).map_err(|e| ("shares", e))?;
    loopback_up().map_err(|e| ("network", e))?;
    if let Some(net) = &net {
        network_setup(net).map_err(|e| ("network", e))?;
    }
    let port = open_port().map_err(|e| ("port", e))?;
    if cmdline.split_whitespace().any(|a| a == BENCH_PORT_ARG) {
        grant_bench_port().map_err(|e| ("port", e))?;
    }
    Ok(Booted {
        port,
        secret,
        deferred_modules: deferred,
        share_mounts: shares.iter().map(|s| PathBuf::from(&s.path)).collect(),
    })
}

fn early_mounts() -> Phase<()> {
    let common = MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC | MsFlags::MS_NODEV;
    do_mount("proc", "/proc", "proc", common, None)?;
    do_mount("sysfs", "/sys", "sysfs", common, None)?;
    do_mount(
        "devtmpfs",
        "/dev",
        "devtmpfs",
        MsFlags::MS_NOSUID,
        Some("mode=0755"),
    )?;
    // The kernel gives PID 1 the console only if the initramfs has /dev/console; make sure
    // our lines reach it either way.
    if let Ok(console) = OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/console")
    {
        let _ = rustix::stdio::dup2_stdin(&console);
        let _ = rustix::stdio::dup2_stdout(&console);
        let _ = rustix::stdio::dup2_stderr(&console);
    }
    Ok(())
}

/// Modules the boot path needs (the root disk and the agent's port sit on virtio-mmio).
/// Everything else in the list (network, vsock, overlay) is loaded after the agent is ready,
/// which takes ~0.3 s off every boot under TCG.
const BOOT_CRITICAL_MODULES: &[&str] = &["virtio", "virtio_ring", "virtio_mmio", "virtio_blk"];
/// Also boot-critical when the VM has shares.
const SHARE_MODULES: &[&str] = &["fuse", "virtiofs"];

/// A host directory to mount, from `warren.mount=TAG:PATH:rw|ro` on the kernel command line.
#[derive(Debug, Clone, PartialEq, Eq)]
struct ShareMount {
    tag: String,
    path: String,
    read_only: bool,
}

/// Parses the `warren.mount=` arguments of `cmdline`.
fn parse_shares(cmdline: &str) -> Phase<Vec<ShareMount>> {
    let mut out = Vec::new();
    for arg in cmdline.split_whitespace() {
        let Some(v) = arg.strip_prefix("warren.mount=") else {
            continue;
        };
        let parts: Vec<&str> = v.split(':').collect();
        let [tag, path, mode] = parts[..] else {
            return Err(BootError::Other(format!("malformed {arg}")));
        };
        let read_only = match mode {
            "ro" => true,
            "rw" => false,
            _ => return Err(BootError::Other(format!("malformed {arg}"))),
        };
        if tag.is_empty() || !path.starts_with('/') || path.split('/').any(|c| c == "..") {
            return Err(BootError::Other(format!("malformed {arg}")));
        }
        out.push(ShareMount {
            tag: tag.to_owned(),
            path: path.to_owned(),
            read_only,
        });
    }
    Ok(out)
}

/// Also boot-critical when the VM has a network (in load order).
const NET_MODULES: &[&str] = &["failover", "net_failover", "virtio_net"];
/// The guest's NIC.
const NET_DEVICE: &str = "eth0";
const NET_DEVICE_WAIT: Duration = Duration::from_secs(5);
/// How long the NIC may take to report its carrier once up: the kernel's link watch runs at
/// most once a second, later on a loaded host. Boot is not reported done before it, so a
/// job's first connection never meets a NIC still coming up.
const NET_CARRIER_WAIT: Duration = Duration::from_secs(15);

/// The VM's network, from `warren.net=ADDR/PREFIX,GW,DNS`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct NetConfig {
    addr: std::net::Ipv4Addr,
    prefix: u8,
    gateway: std::net::Ipv4Addr,
    dns: std::net::Ipv4Addr,
}

fn parse_net(cmdline: &str) -> Phase<Option<NetConfig>> {
    let Some(v) = cmdline
        .split_whitespace()
        .find_map(|a| a.strip_prefix("warren.net="))
    else {
        return Ok(None);
    };
    let bad = || BootError::Other(format!("malformed warren.net={v}"));
    let parts: Vec<&str> = v.split(',').collect();
    let [cidr, gw, dns] = parts[..] else {
        return Err(bad());
    };
    let (addr, prefix) = cidr.split_once('/').ok_or_else(bad)?;
    let prefix: u8 = prefix.parse().map_err(|_| bad())?;
    if prefix > 32 {
        return Err(bad());
    }
    Ok(Some(NetConfig {
        addr: addr.parse().map_err(|_| bad())?,
        prefix,
        gateway: gw.parse().map_err(|_| bad())?,
        dns: dns.parse().map_err(|_| bad())?,
    }))
}

/// `lo` up in every VM, networked or not, so guest services on 127.0.0.1 work with the
/// network off.
fn loopback_up() -> Phase<()> {
    crate::sys::net::link_up("lo").map_err(|e| BootError::Sys {
        what: "lo up",
        source: nix::Error::from_raw(e.raw_os_error().unwrap_or(libc::EIO)),
    })
}

/// IPv6 off, the NIC up with the address and default route, and the resolver.
fn network_setup(net: &NetConfig) -> Phase<()> {
    let sys = |what: &'static str| {
        move |e: io::Error| BootError::Sys {
            what,
            source: nix::Error::from_raw(e.raw_os_error().unwrap_or(libc::EIO)),
        }
    };
    let dev = Path::new("/sys/class/net").join(NET_DEVICE);
    if !wait_for(&dev, NET_DEVICE_WAIT) {
        return Err(BootError::Other(format!(
            "{} did not appear",
            dev.display()
        )));
    }
    for conf in ["all", "default", NET_DEVICE, "lo"] {
        let p = format!("/proc/sys/net/ipv6/conf/{conf}/disable_ipv6");
        match fs::write(&p, "1") {
            Ok(()) => {}
            // A kernel without IPv6 has nothing to disable.
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_err("write", p)(e)),
        }
    }
    crate::sys::net::configure(NET_DEVICE, net.addr, net.prefix, net.gateway)
        .map_err(sys("configure eth0"))?;
    let operstate = dev.join("operstate");
    let start = Instant::now();
    loop {
        let state = fs::read_to_string(&operstate).map_err(io_err("read", &operstate))?;
        if state.trim() == "up" {
            break;
        }
        if start.elapsed() >= NET_CARRIER_WAIT {
            return Err(BootError::Other(format!(
                "{NET_DEVICE} is still {} {}s after it was brought up",
                state.trim(),
                NET_CARRIER_WAIT.as_secs()
            )));
        }
        std::thread::sleep(POLL);
    }
    let resolv = "/etc/resolv.conf";
    let _ = fs::remove_file(resolv);
    fs::write(resolv, format!("nameserver {}\n", net.dns)).map_err(io_err("write", resolv))?;
    Ok(())
}

/// Mounts each share (after switch-root, so on the real root), creating mount points.
fn mount_shares(shares: &[ShareMount]) -> Phase<()> {
    for s in shares {
        fs::create_dir_all(&s.path).map_err(io_err("mkdir", &s.path))?;
        let mut flags = MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
        if s.read_only {
            flags |= MsFlags::MS_RDONLY;
        }
        mount(
            Some(s.tag.as_str()),
            s.path.as_str(),
            Some("virtiofs"),
            flags,
            None::<&str>,
        )
        .map_err(|source| BootError::Mount {
            target: s.path.clone(),
            source,
        })?;
    }
    Ok(())
}

/// Loads the boot-critical modules (plus fuse and virtiofs when `shares`); opens the others
/// (their files vanish at switch-root) and returns them for [`load_deferred_modules`].
fn load_modules(shares: bool, net: bool) -> Phase<Vec<(String, File)>> {
    let list = match fs::read_to_string(MODULE_LIST) {
        Ok(list) => list,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io_err("read", MODULE_LIST)(e)),
    };
    let mut deferred = Vec::new();
    for path in list.lines().map(str::trim) {
        if path.is_empty() || path.starts_with('#') {
            continue;
        }
        let file = File::open(path).map_err(io_err("open", path))?;
        let stem = Path::new(path)
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.split('.').next())
            .unwrap_or("");
        if BOOT_CRITICAL_MODULES.contains(&stem)
            || (shares && SHARE_MODULES.contains(&stem))
            || (net && NET_MODULES.contains(&stem))
        {
            load_module(path, &file)?;
        } else {
            deferred.push((path.to_owned(), file));
        }
    }
    Ok(deferred)
}

fn load_module(path: &str, file: &File) -> Phase<()> {
    let flags = if path.ends_with(".ko") {
        ModuleInitFlags::empty()
    } else {
        ModuleInitFlags::from_bits_retain(MODULE_INIT_COMPRESSED_FILE)
    };
    match finit_module(file, c"", flags) {
        Ok(()) | Err(nix::Error::EEXIST) => Ok(()),
        Err(source) => Err(BootError::Module {
            path: path.to_owned(),
            source,
        }),
    }
}

/// Loads the non-critical modules in list order on a thread of their own; failures are
/// logged, not fatal (nothing in the boot path needs them).
fn load_deferred_modules(modules: Vec<(String, File)>) {
    if modules.is_empty() {
        return;
    }
    std::thread::spawn(move || {
        // Lowest priority: the first requests after boot must not wait for these.
        let _ = rustix::process::setpriority_process(Some(rustix::thread::gettid()), 19);
        for (path, file) in modules {
            if let Err(e) = load_module(&path, &file) {
                crate::console::log(format_args!("deferred module: {e}"));
            }
        }
    });
}

fn read_secret() -> Phase<Secret> {
    let bytes = fs::read(SECRET_PATH).map_err(io_err("read", SECRET_PATH))?;
    let secret: [u8; SECRET_LEN] = bytes.as_slice().try_into().map_err(|_| {
        BootError::Other(format!(
            "{SECRET_PATH} has {} bytes, expected {SECRET_LEN}",
            bytes.len()
        ))
    })?;
    Ok(Secret::new(secret))
}

fn wait_for(path: &Path, limit: Duration) -> bool {
    let start = Instant::now();
    while !path.exists() {
        if start.elapsed() >= limit {
            return false;
        }
        std::thread::sleep(POLL);
    }
    true
}

/// Deletes the initramfs contents below `dir`, staying on the device `dev` (so mounts such as
/// `/newroot` are left alone). Best effort, like busybox `switch_root`.
fn delete_tree(dir: &Path, dev: u64) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let Ok(meta) = fs::symlink_metadata(&path) else {
            continue;
        };
        if meta.dev() != dev {
            continue;
        }
        if meta.is_dir() {
            delete_tree(&path, dev);
            let _ = fs::remove_dir(&path);
        } else {
            let _ = fs::remove_file(&path);
        }
    }
}

fn switch_root() -> Phase<()> {
    if !wait_for(Path::new(ROOT_DEVICE), ROOT_DEVICE_WAIT) {
        return Err(BootError::Other(format!(
            "{ROOT_DEVICE} did not appear within {ROOT_DEVICE_WAIT:?}"
        )));
    }
    fs::create_dir_all(NEW_ROOT).map_err(io_err("mkdir", NEW_ROOT))?;
    mount(
        Some(ROOT_DEVICE),
        NEW_ROOT,
        Some("ext4"),
        MsFlags::empty(),
        None::<&str>,
    )
    .map_err(|source| BootError::Mount {
        target: NEW_ROOT.into(),
        source,
    })?;
    for dir in ["/proc", "/sys", "/dev"] {
        let target = format!("{NEW_ROOT}{dir}");
        fs::create_dir_all(&target).map_err(io_err("mkdir", &target))?;
        mount(
            Some(dir),
            target.as_str(),
            None::<&str>,
            MsFlags::MS_MOVE,
            None::<&str>,
        )
        .map_err(|source| BootError::Mount { target, source })?;
    }
    std::env::set_current_dir(NEW_ROOT).map_err(io_err("chdir", NEW_ROOT))?;
    let root_dev = fs::symlink_metadata("/")
        .map_err(io_err("stat", "/"))?
        .dev();
    delete_tree(Path::new("/"), root_dev);
    mount(Some("."), "/", None::<&str>, MsFlags::MS_MOVE, None::<&str>).map_err(|source| {
        BootError::Mount {
            target: "/".into(),
            source,
        }
    })?;
    nix::unistd::chroot(".").map_err(|source| BootError::Sys {
        what: "chroot",
        source,
    })?;
    std::env::set_current_dir("/").map_err(io_err("chdir", "/"))?;
    Ok(())
}

fn system_setup() -> Phase<()> {
    let nosuid_nodev = MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
    do_mount("tmpfs", "/tmp", "tmpfs", nosuid_nodev, Some("mode=1777"))?;
    do_mount("tmpfs", "/run", "tmpfs", nosuid_nodev, Some("mode=0755"))?;
    do_mount(
        "devpts",
        "/dev/pts",
        "devpts",
        MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
        Some("newinstance,ptmxmode=0666,mode=0620,gid=5"),
    )?;
    do_mount(
        "tmpfs",
        "/dev/shm",
        "tmpfs",
        nosuid_nodev,
        Some("mode=1777"),
    )?;
    rustix::system::sethostname(b"warren").map_err(|e| BootError::Sys {
        what: "sethostname",
        source: nix::Error::from_raw(e.raw_os_error()),
    })?;
    crate::identity_files::bind();
    if !Path::new(WORKSPACE).exists() {
        fs::create_dir(WORKSPACE).map_err(io_err("mkdir", WORKSPACE))?;
        let id = Some(GUEST_USER_ID);
        std::os::unix::fs::chown(WORKSPACE, id, id).map_err(io_err("chown", WORKSPACE))?;
    }
    Ok(())
}

fn cgroup_setup() -> Phase<()> {
    let flags = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
    // Every job moves into a cgroup of its own: `favordynmods` makes such migrations cheap
    // (no RCU grace period per move), which dominates exec latency under TCG otherwise.
    if do_mount(
        "cgroup2",
        CGROUP_ROOT,
        "cgroup2",
        flags,
        Some("favordynmods"),
    )
    .is_err()
    {
        do_mount("cgroup2", CGROUP_ROOT, "cgroup2", flags, None)?;
    }
    // Job cgroups give membership and `cgroup.kill` without any controller. Controllers are
    // not enabled: no per-job limit is applied yet, and each enabled controller makes every
    // job's cgroup creation and migration markedly slower (measured under TCG: spawn ~27 ms
    // without controllers vs 28-69 ms with all of them). When job limits arrive, enable
    // exactly the controllers they need (the agent must then first leave the root cgroup:
    // "no internal processes").
    let jobs = jobs_cgroup();
    fs::create_dir_all(&jobs).map_err(io_err("mkdir", &jobs))?;
    Ok(())
}

fn jobs_cgroup() -> PathBuf {
    Path::new(CGROUP_ROOT).join("jobs")
}

fn find_port(wanted: &str) -> Option<PathBuf> {
    for entry in fs::read_dir(VIRTIO_PORTS).ok()?.flatten() {
        let name = fs::read_to_string(entry.path().join("name")).unwrap_or_default();
        if name.trim() == wanted {
            let dev = Path::new("/dev").join(entry.file_name());
            if dev.exists() {
                return Some(dev);
            }
        }
    }
    None
}

/// Waits (at most [`PORT_WAIT`]) for the virtio port named `name`; its device node.
fn wait_port(name: &str) -> Phase<PathBuf> {
    let start = Instant::now();
    loop {
        if let Some(dev) = find_port(name) {
            return Ok(dev);
        }
        if start.elapsed() >= PORT_WAIT {
            return Err(BootError::Other(format!(
                "virtio port {name} did not appear within {PORT_WAIT:?}"
            )));
        }
        std::thread::sleep(POLL);
    }
}

/// The bench VM's raw port (only with [`BENCH_PORT_ARG`]) goes to the guest user, who pumps
/// bytes through it with ordinary programs.
fn grant_bench_port() -> Phase<()> {
    let dev = wait_port(BENCH_PORT_NAME)?;
    let id = Some(nix::unistd::Uid::from_raw(GUEST_USER_ID));
    nix::unistd::chown(&dev, id, Some(nix::unistd::Gid::from_raw(GUEST_USER_ID)))
        .map_err(|e| BootError::Other(format!("chown {}: {e}", dev.display())))
}

fn open_port() -> Phase<File> {
    let dev = wait_port(PORT_NAME)?;
    // std opens with O_CLOEXEC: a job inheriting the port would make it busy.
    OpenOptions::new()
        .read(true)
        .write(true)
        .open(&dev)
        .map_err(io_err("open", &dev))
}

/// Starts the agent on the current runtime, prints the ready line and serves forever.
pub async fn serve(booted: Booted) -> Result<(), (&'static str, Box<dyn Error>)> {
    let files = FilesConfig {
        workspace: PathBuf::from(WORKSPACE),
        user: Some(GUEST_USER_ID),
    };
    let reaper = Reaper::start(ReapMode::AllChildren).map_err(|e| ("reaper", e.into()))?;
    let jobs = JobManager::new(JobsConfig::guest(files.clone(), jobs_cgroup()), reaper);
    let agent = Arc::new(Agent {
        jobs,
        files,
        secret: booted.secret,
        system: System {
            pid1: true,
            power_off_requested: AtomicBool::new(false),
            shares: crate::coherence::Shares::new(booted.share_mounts, jobs_cgroup()),
        },
    });
    let manager = crate::channel::start(booted.port, agent).map_err(|e| ("serve", e.into()))?;
    println!("{READY_LINE}");
    load_deferred_modules(booted.deferred_modules);
    match manager.await {
        Ok(()) => Err(("serve", "channel manager stopped".into())),
        Err(e) => Err(("serve", e.into())),
    }
}

/// Prints the failure with its cause chain and powers off; never returns.
pub fn fail(phase: &str, err: &dyn Error) -> ! {
    let mut line = format!("guest: {phase} failed: {err}");
    let mut source = err.source();
    while let Some(s) = source {
        line.push_str(&format!(": {s}"));
        source = s.source();
    }
    println!("{line}");
    power_off()
}

/// Syncs and powers the VM off. If that fails, parks forever: PID 1 must never exit.
pub fn power_off() -> ! {
    nix::unistd::sync();
    let Err(e) = reboot(RebootMode::RB_POWER_OFF);
    println!("guest: poweroff failed: {e}");
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_clock_phase_prints_the_line_the_host_looks_for() {
        assert_eq!(
            format!("guest: {CLOCK_PHASE} failed: "),
            warren_protocol::CLOCK_FAILED_LINE
        );
    }

    #[test]
    fn test_parse_net() {
        assert_eq!(parse_net("console=ttyS0 x=1").expect("ok"), None);
        let n = parse_net("a warren.net=10.255.0.2/30,10.255.0.1,10.255.0.1 b")
            .expect("ok")
            .expect("some");
        assert_eq!(n.addr, std::net::Ipv4Addr::new(10, 255, 0, 2));
        assert_eq!(n.prefix, 30);
        assert_eq!(n.gateway, std::net::Ipv4Addr::new(10, 255, 0, 1));
        for bad in [
            "warren.net=10.255.0.2,10.255.0.1,10.255.0.1",
            "warren.net=10.255.0.2/33,10.255.0.1,10.255.0.1",
            "warren.net=10.255.0.2/30,10.255.0.1",
            "warren.net=x/30,10.255.0.1,10.255.0.1",
        ] {
            assert!(parse_net(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn test_parse_shares_reads_mount_args_only() {
        let got = parse_shares(
            "console=ttyS0 quiet warren.mount=fs0:/workspace:rw warren.mount=fs1:/.src:ro x=1",
        )
        .unwrap();
        assert_eq!(
            got,
            vec![
                ShareMount {
                    tag: "fs0".into(),
                    path: "/workspace".into(),
                    read_only: false
                },
                ShareMount {
                    tag: "fs1".into(),
                    path: "/.src".into(),
                    read_only: true
                },
            ]
        );
        assert!(parse_shares("quiet").unwrap().is_empty());
    }

    #[test]
    fn test_parse_shares_rejects_malformed() {
        for bad in [
            "warren.mount=fs0:/w",
            "warren.mount=fs0:/w:rx",
            "warren.mount=:/w:rw",
            "warren.mount=fs0:w:rw",
            "warren.mount=fs0:/a/../b:rw",
        ] {
            assert!(parse_shares(bad).is_err(), "{bad}");
        }
    }
}
