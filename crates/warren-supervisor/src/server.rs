//! The supervisor process: launch, watch, serve, clean up (see the crate docs for the order).
//!
//! Runs on a current-thread runtime: the VMM's parent-death signal is tied to the thread that
//! spawned it, so that thread must be the process's only one.

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tokio::io::AsyncReadExt;
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{watch, Notify};
use warren_protocol::HostRequest;
use warren_vmm::qemu::QemuBackend;
use warren_vmm::sys::vmm_file::sync_regular;
use warren_vmm::{sys::cgroup, VmBackend};

mod exit;
mod suspend;

use exit::{clock_failed, record_exit, vmm_cpu_note, vmm_exit_reason, Ended};
pub(crate) use suspend::{capabilities, migration_done, resume, save_to_file};
use suspend::{frozen, hibernate, pause};

use crate::channel::GuestChannel;
use crate::console::{self, ConsoleTail};
use crate::layout::{ExitRecord, SupervisorConfig, VmDir};
use crate::proto::{
    read_frame, write_frame, CheckpointInfo, Reply, StatusInfo, SupervisorError, SupervisorRequest,
    SupervisorResponse, VmPhase,
};
use crate::timings::Timings;
use warren_vmm::qemu::qmp::Qmp;
use warren_vmm::VmControl;

#[derive(Debug, thiserror::Error)]
pub enum SuperviseError {
    #[error("reading {path}")]
    Config {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("parsing the supervisor config")]
    ConfigParse(#[from] serde_json::Error),
    #[error("another supervisor holds {0}")]
    Locked(PathBuf),
    #[error("I/O on {what}")]
    Io {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Vmm(#[from] warren_vmm::VmmError),
    #[error("setting up the VM network")]
    Network(#[from] crate::network::NetError),
}

/// How long a stopping VMM gets to exit after `quit` before it is killed.
const QUIT_GRACE: Duration = Duration::from_secs(3);
/// A guest session that ends sooner than this counts as short: the next resync waits
/// [`BACKOFF_MIN`], doubling per short session up to [`BACKOFF_MAX`]; a longer session
/// resets the wait to none.
const SHORT_SESSION: Duration = Duration::from_secs(2);
const BACKOFF_MIN: Duration = Duration::from_millis(50);
const BACKOFF_MAX: Duration = Duration::from_secs(1);
use crate::deadline::{MIGRATION_LIMIT, RECONNECT_WAIT};

pub(crate) struct Shared {
    pub(crate) phase: watch::Sender<VmPhase>,
    pub(crate) channel: Mutex<Option<GuestChannel>>,
    pub(crate) stop: Notify,
    /// Why a requested stop happens, when it is not a destroy (hibernation).
    pub(crate) stop_reason: Mutex<Option<String>>,
    pub(crate) vmm_pid: Option<u32>,
    /// The VMM is stopped (`SIGSTOP`) after a fast standby's save: it must not run again,
    /// so the VM's stop kills it instead of asking it to quit ([`freeze_vmm`]).
    pub(crate) vmm_frozen: std::sync::atomic::AtomicBool,
    /// A `Freeze` failed in a way that may have frozen the jobs after all and its undoing
    /// `Thaw` could not be sent: the next connection thaws them first ([`freeze`]).
    pub(crate) thaw_owed: std::sync::atomic::AtomicBool,
    /// A fork holds the VM stopped (`ForkSaveHeld`) until it releases it: a plain resume is
    /// refused meanwhile. Counts holds, so a hold's time limit never ends a later one.
    pub(crate) fork_hold: std::sync::atomic::AtomicU64,
    /// The VM this supervisor serves (its identity, checked on re-adoption).
    pub(crate) vm_id: String,
    /// Guest RAM file (fast standby), if the VM has one.
    pub(crate) ram_file: Option<PathBuf>,
    pub(crate) boot_ms: Mutex<Option<u64>>,
    /// The VMM's QMP socket.
    pub(crate) control: PathBuf,
    pub(crate) dir: VmDir,
    /// Lifecycle steps (suspend, resume, fork) run one at a time (see [`process`]).
    pub(crate) lifecycle: Arc<tokio::sync::Mutex<()>>,
    /// Where the start went (reported in `Status`).
    pub(crate) timings: Timings,
}

impl Shared {
    fn current_channel(&self) -> Option<GuestChannel> {
        self.channel
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    pub(crate) async fn channel(&self, wait: Duration) -> Result<GuestChannel, SupervisorError> {
        let mut rx = self.phase.subscribe();
        let waited = tokio::time::timeout(wait, async {
            loop {
                match &*rx.borrow_and_update() {
                    VmPhase::Ready(_) => {
                        if let Some(ch) = self.current_channel() {
                            return Ok(ch);
                        }
                    }
                    VmPhase::Failed(r) => return Err(SupervisorError::Failed(r.clone())),
                    VmPhase::Paused(_) => {
                        return Err(SupervisorError::NotReady("the VM is paused".into()))
                    }
                    VmPhase::Stopping => {
                        return Err(SupervisorError::NotReady("the VM is stopping".into()))
                    }
                    VmPhase::Booting | VmPhase::Reconnecting => {}
                }
                if rx.changed().await.is_err() {
                    return Err(SupervisorError::NotReady("supervisor exiting".into()));
                }
            }
        })
        .await;
        waited.unwrap_or_else(|_| {
            Err(SupervisorError::NotReady(format!(
                "no guest channel within {wait:?}"
            )))
        })
    }
}

/// Attempts, 10 ms apart, at the VM's lock before another supervisor is taken to hold it.
const LOCK_TRIES: u32 = 100;

/// Runs the supervisor for the VM in `dir` until the VM ends.
pub fn run(dir: PathBuf) -> Result<(), SuperviseError> {
    // Nothing the supervisor (or its VMM) creates is writable by group or others from its
    // first instant, whatever umask the caller had: a socket is never connectable by another
    // local user between its bind and its chmod to 0600 (connecting needs write permission).
    let old = nix::sys::stat::umask(nix::sys::stat::Mode::empty());
    nix::sys::stat::umask(old | nix::sys::stat::Mode::from_bits_truncate(0o022));
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|source| SuperviseError::Io {
            what: "runtime",
            source,
        })?;
    rt.block_on(run_async(VmDir(dir)))
}

/// A resume from hibernation names guest RAM as its checkpoint does: fork copies settled
/// before their block kept its name (a cold-booted parent's `microvm.ram`) have `mem` in
/// their config, and their checkpoints would not load. Only plain anonymous RAM is renamed.
fn name_ram_as_checkpoint(dir: &VmDir, cfg: &mut SupervisorConfig) {
    let l = &cfg.launch;
    let plain = l.shares.is_empty()
        && l.ram_file.is_none()
        && l.template_ram.is_none()
        && l.clone_ram.is_none()
        && l.fork_ram.is_none();
    if !cfg.restore || cfg.restore_from.is_some() || !plain {
        return;
    }
    let len = u64::from(l.memory.0) << 20;
    let named = match warren_vmm::qemu::mapped_ram::guest_ram_block(&dir.checkpoint_state(), len) {
        Some("mem") => true,
        Some(_) => false,
        None => return,
    };
    if named != cfg.launch.named_ram {
        tracing::warn!(named, "guest RAM named as the checkpoint names it");
        cfg.launch.named_ram = named;
    }
}

async fn run_async(dir: VmDir) -> Result<(), SuperviseError> {
    let timings = Timings::new();
    let cfg_bytes = std::fs::read(dir.config()).map_err(|source| SuperviseError::Config {
        path: dir.config(),
        source,
    })?;
    let mut cfg: SupervisorConfig = serde_json::from_slice(&cfg_bytes)?;
    name_ram_as_checkpoint(&dir, &mut cfg);
    // Replaced by a rekey (`rekey.rs`): every later session uses the current one.
    let secret = Arc::new(Mutex::new(std::fs::read(dir.secret()).map_err(
        |source| SuperviseError::Config {
            path: dir.secret(),
            source,
        },
    )?));

    // 1. The lock: held until this process exits. Private (0600, an existing file made so):
    // anyone able to open it could hold a shared lock and keep every later supervisor of the
    // VM from starting. A listing's probe holds a shared lock for an instant, so a refusal is
    // retried for a moment before another supervisor is taken to hold it.
    let lock_file =
        crate::layout::open_lock_file(&dir.lock()).map_err(|source| SuperviseError::Io {
            what: "lock file",
            source,
        })?;
    let mut lock_file = lock_file;
    let mut tries = 0;
    let _lock = loop {
        match nix::fcntl::Flock::lock(lock_file, nix::fcntl::FlockArg::LockExclusiveNonblock) {
            Ok(lock) => break lock,
            Err((f, nix::errno::Errno::EWOULDBLOCK)) if tries < LOCK_TRIES => {
                lock_file = f;
                tries += 1;
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            Err(_) => return Err(SuperviseError::Locked(dir.lock())),
        }
    };
    {
        use std::io::Write;
        // Replaces what an earlier supervisor wrote: a shorter pid written over a longer one
        // would leave its digits behind, naming another process.
        let mut f: &std::fs::File = &_lock;
        let _ = f.set_len(0);
        let _ = f.write_all(format!("{}\n", std::process::id()).as_bytes());
    }
    // Bound and listening under a temporary name, then renamed: clients that see the socket
    // can always connect (between bind and listen a connect would be refused).
    let _ = std::fs::remove_file(dir.socket());
    let staging = dir.path().join("supervisor.sock.new");
    let _ = std::fs::remove_file(&staging);
    let listener = UnixListener::bind(&staging).map_err(|source| SuperviseError::Io {
        what: "supervisor socket",
        source,
    })?;
    {
        use std::os::unix::fs::PermissionsExt;
        // Root's only: not even the VM's own uid (its VMM) may drive the supervisor.
        std::fs::set_permissions(&staging, std::fs::Permissions::from_mode(0o600))
            .and_then(|_| std::fs::rename(&staging, dir.socket()))
            .map_err(|source| SuperviseError::Io {
                what: "supervisor socket",
                source,
            })?;
    }

    timings.mark("socket");
    // 2. Launch.
    let backend = QemuBackend::new(warren_vmm::accel::find_qemu()?)?;
    let mut cgroup_origin = cgroup::Origin::default();
    if let Some(cg) = &cfg.launch.cgroup {
        cgroup::create(cg)?;
        let limits = cgroup::Limits::for_vm(u64::from(cfg.launch.memory.0), cfg.launch.vcpus);
        let homes = cgroup::apply_limits(cg, &limits)?;
        // This process's work for the guest counts against the same limits.
        cgroup_origin = cgroup::enter_supervisor(cg)?;
        tracing::info!(?limits, ?homes, "VM host limits");
    }
    // The network namespace, TAP device, rules and egress; removed when this process exits
    // (dropped after the VMM, which holds the TAP device).
    let network = match &cfg.launch.network {
        Some(spec) => match crate::network::setup(&cfg.vm_id, dir.path(), spec) {
            Ok(n) => Some(n),
            Err(e) => {
                record_exit(
                    &dir,
                    false,
                    format!("setting up the network failed: {}", error_chain(&e)),
                    false,
                );
                return Err(e.into());
            }
        },
        None => None,
    };
    let ca_cert = network.as_ref().map(|n| n.ca_cert_pem.clone());
    let launched_at = Instant::now();
    let mut launch = cfg.launch.clone();
    launch.view_readable = match dir.view_readable(cfg.restore_from.as_deref()) {
        Ok(v) => v,
        Err(source) => {
            record_exit(
                &dir,
                false,
                format!("launching the VMM failed: {source}"),
                false,
            );
            return Err(SuperviseError::Io {
                what: "the VMM's view",
                source,
            });
        }
    };
    let launched = match backend.launch(&launch) {
        Ok(l) => l,
        Err(e) => {
            record_exit(&dir, false, format!("launching the VMM failed: {e}"), false);
            return Err(e.into());
        }
    };
    timings.mark("vmm spawned");
    let mut child = launched.child;
    let endpoints = launched.endpoints;
    // virtiofsd processes: they exit when QEMU disconnects; held here so they are reaped.
    let _device_helpers = launched.helpers;
    // Their stderr and QEMU's (first), drained into bounded logs; QEMU's last line is read
    // once its drain reached the end of the pipe.
    let mut drains = launched
        .stderr
        .into_iter()
        .map(|p| crate::child_log::drain(p.pipe, &p.log));
    let vmm_stderr_drained = drains.next();
    drains.for_each(drop);
    tracing::info!(vm = %cfg.vm_id, pid = ?child.id(), "VMM launched");

    let (phase, _) = watch::channel(VmPhase::Booting);
    let shared = Arc::new(Shared {
        phase,
        channel: Mutex::new(None),
        stop: Notify::new(),
        stop_reason: Mutex::new(None),
        vmm_pid: child.id(),
        vmm_frozen: std::sync::atomic::AtomicBool::new(false),
        thaw_owed: std::sync::atomic::AtomicBool::new(false),
        fork_hold: std::sync::atomic::AtomicU64::new(0),
        vm_id: cfg.vm_id.clone(),
        ram_file: cfg.launch.ram_file.clone(),
        boot_ms: Mutex::new(None),
        control: endpoints.control.clone(),
        dir: dir.clone(),
        lifecycle: Arc::new(tokio::sync::Mutex::new(())),
        timings: timings.clone(),
    });

    // 3. Console.
    let tail = ConsoleTail::default();
    let console_task = {
        let dir = dir.clone();
        let tail = tail.clone();
        let path = endpoints.console.clone();
        tokio::spawn(async move {
            match console::connect(&path, Duration::from_secs(10)).await {
                Ok(s) => {
                    tail.linked(Ok(()));
                    console::pump(s, dir, tail).await
                }
                Err(e) => {
                    tracing::warn!(error = %e, "console unavailable");
                    tail.linked(Err(e.to_string()));
                }
            }
        })
    };

    // 4. Channel, re-established whenever it drops. A restored VM first takes in its
    //    checkpoint, and its guest is told the time and thawed once the channel is up.
    let failure = Arc::new(Mutex::new(None::<String>));
    let restore = cfg.restore;
    let clone = cfg.clone.clone();
    // A template's checkpoint leaves RAM in its file (mapped privately by the clone, or
    // copied into a shared file of its own for a clone with shares).
    let standby = cfg.launch.ram_file.is_some()
        || cfg.launch.template_ram.is_some()
        || cfg.launch.clone_ram.is_some();
    {
        let shared = shared.clone();
        let path = endpoints.channel.clone();
        let tail = tail.clone();
        let failure = failure.clone();
        let boot_deadline = launched_at + Duration::from_millis(cfg.boot_timeout_ms);
        let restore_state = cfg
            .restore_from
            .clone()
            .unwrap_or_else(|| dir.checkpoint_state());
        let control = endpoints.control.clone();
        let ca_cert = ca_cert.clone();
        tokio::spawn(async move {
            let mut first = true;
            // A restored guest's port was open when it was saved: the channel is connected
            // before the restore, so the device finds it as the guest last saw it and sends
            // no port-closed / port-opened messages behind the guest's back (a guest handling
            // those while its first session starts can be left believing no host is there,
            // its answers unwritten).
            let mut preconnected = None;
            if restore {
                let connected = match GuestChannel::connect_socket(&path, boot_deadline).await {
                    Ok(stream) => {
                        preconnected = Some(stream);
                        Ok(())
                    }
                    Err(e) => Err(format!("connecting the guest channel: {e}")),
                };
                let restored = match connected {
                    Ok(()) => {
                        restore_checkpoint(&control, &restore_state, standby, boot_deadline).await
                    }
                    Err(e) => Err(e),
                };
                if let Err(e) = restored {
                    let reason = format!("restoring the checkpoint failed: {e}");
                    tracing::error!(%reason);
                    *failure.lock().unwrap_or_else(|p| p.into_inner()) = Some(reason.clone());
                    shared.phase.send_replace(VmPhase::Failed(reason));
                    shared.stop.notify_one();
                    return;
                }
                shared.timings.mark("restored");
            }
            // A guest that drops its sessions right after making them (a reconnect storm)
            // costs a handshake each: short sessions back off, doubling up to a limit.
            let mut backoff = Duration::ZERO;
            loop {
                let deadline = if first {
                    boot_deadline
                } else {
                    Instant::now() + RECONNECT_WAIT
                };
                let current = secret.lock().unwrap_or_else(|p| p.into_inner()).clone();
                let connected = match preconnected.take() {
                    Some(stream) => GuestChannel::connect_over(stream, &current, deadline).await,
                    None => GuestChannel::connect(&path, &current, deadline).await,
                };
                match connected {
                    Ok(ch) => {
                        if first {
                            let ms = launched_at.elapsed().as_millis() as u64;
                            *shared.boot_ms.lock().unwrap_or_else(|p| p.into_inner()) = Some(ms);
                            tracing::info!(boot_ms = ms, "guest ready");
                            shared.timings.mark("channel");
                        }
                        if let (true, Some(spec)) = (first, &clone) {
                            // A copy of another VM's memory: its own secret and identity
                            // before anything else (`rekey.rs`).
                            match crate::rekey::run(&ch, &shared.dir, &current, spec).await {
                                Ok(new) => {
                                    *secret.lock().unwrap_or_else(|p| p.into_inner()) = new;
                                    shared.timings.mark("rekeyed");
                                }
                                Err(e) => {
                                    let reason = format!("rekeying the restored guest failed: {e}");
                                    tracing::error!(%reason);
                                    *failure.lock().unwrap_or_else(|p| p.into_inner()) =
                                        Some(reason.clone());
                                    shared.phase.send_replace(VmPhase::Failed(reason));
                                    shared.stop.notify_one();
                                    return;
                                }
                            }
                        }
                        if !first && shared.thaw_owed.swap(false, Ordering::SeqCst) {
                            // Before any step can use the channel again (see [`freeze`]).
                            if let Err(e) = thaw(&ch).await {
                                tracing::warn!(error = %e, "thawing jobs left frozen failed");
                                shared.thaw_owed.store(true, Ordering::SeqCst);
                            }
                        }
                        if first && restore {
                            if let Err(e) = thaw(&ch).await {
                                let reason = format!("syncing the restored guest failed: {e}");
                                tracing::error!(%reason);
                                *failure.lock().unwrap_or_else(|p| p.into_inner()) =
                                    Some(reason.clone());
                                shared.phase.send_replace(VmPhase::Failed(reason));
                                shared.stop.notify_one();
                                return;
                            }
                            shared.timings.mark("thawed");
                        }
                        if let Some(ca) = &ca_cert {
                            // Idempotent: sent on every (re)connection, so a fresh agent
                            // always has it before any job runs.
                            if let Err(e) =
                                guest_call(&ch, HostRequest::InstallCa(ca.clone())).await
                            {
                                tracing::warn!(
                                    error = %crate::log::guest_text(&e.to_string()),
                                    "installing the egress CA failed"
                                );
                            }
                        }
                        if first {
                            shared.timings.mark("ready");
                        }
                        first = false;
                        let info = ch.info.clone();
                        *shared.channel.lock().unwrap_or_else(|p| p.into_inner()) =
                            Some(ch.clone());
                        shared.phase.send_replace(VmPhase::Ready(info));
                        let session_started = Instant::now();
                        ch.closed().await;
                        *shared.channel.lock().unwrap_or_else(|p| p.into_inner()) = None;
                        if matches!(*shared.phase.borrow(), VmPhase::Stopping) {
                            return;
                        }
                        tracing::warn!("guest channel dropped; resynchronising");
                        shared.phase.send_replace(VmPhase::Reconnecting);
                        backoff = if session_started.elapsed() < SHORT_SESSION {
                            (backoff * 2).clamp(BACKOFF_MIN, BACKOFF_MAX)
                        } else {
                            Duration::ZERO
                        };
                        tokio::time::sleep(backoff).await;
                    }
                    Err(e) if !first => {
                        // The VM came up before: keep trying (a VMM exit ends everything
                        // through the main loop, with its own reason).
                        tracing::warn!(error = %e, "guest channel reconnect failed; retrying");
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                    Err(e) => {
                        let mut reason =
                            format!("the guest agent did not come up: {}", error_chain(&e));
                        reason.push_str(&vmm_cpu_note(shared.vmm_pid));
                        reason.push_str(&tail.report(20));
                        // The console tail is the guest's text: escaped and cut in the log.
                        tracing::error!(reason = %crate::log::guest_text(&reason), "guest channel failed");
                        *failure.lock().unwrap_or_else(|p| p.into_inner()) = Some(reason.clone());
                        shared.phase.send_replace(VmPhase::Failed(reason));
                        shared.stop.notify_one();
                        return;
                    }
                }
            }
        });
    }

    // 5. Serve until the VMM exits or someone asks to stop.
    let serve = {
        let shared = shared.clone();
        async move {
            loop {
                match listener.accept().await {
                    Ok((conn, _)) => {
                        tokio::spawn(handle(conn, shared.clone()));
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
            }
        }
    };
    let mut sigterm = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|source| SuperviseError::Io {
            what: "signal handler",
            source,
        })?;
    let (requested, ended) = tokio::select! {
        status = child.wait() => {
            let status = status.map_err(|source| SuperviseError::Io { what: "wait for VMM", source })?;
            (false, Ended::Vmm(status))
        }
        _ = shared.stop.notified() => {
            let fail = failure.lock().unwrap_or_else(|p| p.into_inner()).clone();
            // A VMM that already died explains a failed channel better than the channel does.
            let died = child.try_wait().ok().flatten();
            shared.phase.send_replace(VmPhase::Stopping);
            stop_vmm(&backend, &endpoints, &mut child, frozen(&shared)).await;
            match (died, fail) {
                (Some(status), Some(_)) => (false, Ended::Vmm(status)),
                (_, Some(r)) => (false, Ended::Said(r)),
                (_, None) => {
                    let why = shared.stop_reason.lock().unwrap_or_else(|p| p.into_inner()).clone();
                    (true, Ended::Said(why.unwrap_or_else(|| "destroyed".to_string())))
                }
            }
        }
        _ = sigterm.recv() => {
            shared.phase.send_replace(VmPhase::Stopping);
            stop_vmm(&backend, &endpoints, &mut child, frozen(&shared)).await;
            (true, Ended::Said("supervisor terminated (SIGTERM)".to_string()))
        }
        _ = serve => unreachable!("the accept loop never ends"),
    };
    // The console and QEMU's stderr are drained before the reason is written: the guest's
    // last line and QEMU's come just before it ends.
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        let _ = console_task.await;
        if let Some(d) = vmm_stderr_drained {
            let _ = d.await;
        }
    })
    .await;
    let reason = match ended {
        Ended::Vmm(status) => vmm_exit_reason(&dir, status, &tail),
        Ended::Said(r) => r,
    };
    if !matches!(*shared.phase.borrow(), VmPhase::Stopping) {
        shared.phase.send_replace(VmPhase::Failed(reason.clone()));
    }

    // 6. Clean up.
    if let Some(cg) = &cfg.launch.cgroup {
        match cgroup::leave_supervisor(cg, &cgroup_origin) {
            Ok(()) => {
                if let Err(e) = cgroup::kill_and_remove(cg) {
                    tracing::warn!(error = %e, "cgroup cleanup failed");
                }
            }
            Err(e) => {
                // Killing the VM's cgroup would kill this process before it records the
                // exit: its VMM's processes are killed by pid, the cgroup left to the engine.
                tracing::warn!(error = %e, "leaving the VM's cgroup failed");
                cgroup::kill_members(cg);
            }
        }
    }
    let never_ready = shared
        .boot_ms
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .is_none();
    let boot_again = !requested && never_ready && !restore && clock_failed(&tail.text());
    if boot_again {
        tracing::warn!("the guest's kernel measured its timer wrongly; the VM can boot again");
    }
    // Namespace, TAP device, rules and egress go before the exit is recorded.
    drop(network);
    record_exit(&dir, requested, reason, boot_again);
    for p in [
        dir.socket(),
        endpoints.console,
        endpoints.channel,
        endpoints.control,
    ] {
        let _ = std::fs::remove_file(p);
    }
    Ok(())
}

async fn stop_vmm(
    backend: &QemuBackend,
    endpoints: &warren_vmm::VmEndpoints,
    child: &mut tokio::process::Child,
    frozen: bool,
) {
    if frozen {
        // Saved to a standby RAM file: the VMM never runs again (see `freeze_vmm`).
        let _ = child.start_kill();
        let _ = child.wait().await;
        return;
    }
    let quit = async {
        if let Ok(mut ctl) = backend.control(endpoints).await {
            let _ = ctl.quit().await;
        }
        child.wait().await
    };
    if tokio::time::timeout(QUIT_GRACE, quit).await.is_err() {
        let _ = child.start_kill();
        let _ = child.wait().await;
    }
}

async fn handle(conn: UnixStream, shared: Arc<Shared>) {
    let (mut rd, mut wr) = conn.into_split();
    let req: SupervisorRequest = match read_frame(&mut rd).await {
        Ok(r) => r,
        Err(e) => {
            tracing::debug!(error = %e, "bad client request");
            return;
        }
    };
    if let SupervisorRequest::OpenStream(target) = req {
        let channel = shared.channel(RECONNECT_WAIT).await;
        return crate::stream::serve(channel, target, rd, wr).await;
    }
    // A client that goes away cancels its request: a guest call (and with it the guest's
    // HTTP/2 stream), a wait, or a lifecycle step still waiting for its turn. A step that
    // began runs to its end (see [`process`]); the client then only misses the answer.
    let gone = async {
        let mut b = [0u8; 1];
        let _ = rd.read(&mut b).await;
    };
    tokio::select! {
        reply = process(req, &shared) => {
            let _ = write_frame(&mut wr, &reply).await;
        }
        _ = gone => {}
    }
}

/// Answers one request. A lifecycle step waits for the lifecycle lock as part of the
/// request, so a client that gives up while another step runs leaves nothing queued behind
/// it (a pause run minutes later would stop a VM its engine believes running). Once the
/// lock is held the step runs in a task of its own to its end whatever the client does: cut
/// half-way it would leave the VM stopped, or its jobs frozen, behind a phase that says
/// otherwise.
async fn process(req: SupervisorRequest, shared: &Arc<Shared>) -> Reply {
    match req {
        SupervisorRequest::Status => Ok(SupervisorResponse::Status(status(shared))),
        SupervisorRequest::WaitReady { timeout_ms } => {
            shared
                .channel(Duration::from_millis(
                    timeout_ms.min(crate::proto::MAX_WAIT_READY_MS),
                ))
                .await?;
            Ok(SupervisorResponse::Status(status(shared)))
        }
        SupervisorRequest::Stop => {
            shared.stop.notify_one();
            Ok(SupervisorResponse::Stopping)
        }
        step @ (SupervisorRequest::Pause
        | SupervisorRequest::Resume
        | SupervisorRequest::Hibernate
        | SupervisorRequest::ForkSave { .. }
        | SupervisorRequest::ForkSaveHeld { .. }
        | SupervisorRequest::ForkRelease) => {
            let held = shared.lifecycle.clone().lock_owned().await;
            let shared = shared.clone();
            tokio::spawn(async move {
                let _held = held;
                lifecycle_step(step, &shared).await
            })
            .await
            .unwrap_or_else(|e| Err(SupervisorError::Failed(format!("internal error: {e}"))))
        }
        SupervisorRequest::OpenStream(_) => Err(SupervisorError::Refused(
            "a stream is opened on a connection of its own".into(),
        )),
        SupervisorRequest::Guest(HostRequest::Hello(_) | HostRequest::Auth(_)) => Err(
            SupervisorError::Refused("session requests belong to the supervisor".into()),
        ),
        SupervisorRequest::Guest(r) => {
            let ch = shared.channel(RECONNECT_WAIT).await?;
            guest_call(&ch, r).await.map(SupervisorResponse::Guest)
        }
        SupervisorRequest::ChannelPing => {
            let ch = shared.channel(RECONNECT_WAIT).await?;
            let rtt = ch
                .ping()
                .await
                .map_err(|e| SupervisorError::Channel(error_chain(&e)))?;
            Ok(SupervisorResponse::ChannelPong {
                rtt_ns: u64::try_from(rtt.as_nanos()).unwrap_or(u64::MAX),
            })
        }
    }
}

/// One lifecycle step, with the lifecycle lock held by the caller.
async fn lifecycle_step(req: SupervisorRequest, shared: &Arc<Shared>) -> Reply {
    match req {
        SupervisorRequest::Pause => pause(shared).await,
        SupervisorRequest::Resume => {
            if crate::fork::held(shared) {
                return Err(SupervisorError::Refused(
                    "a fork is copying this VM's session files; it runs on when they are copied"
                        .into(),
                ));
            }
            resume(shared).await
        }
        SupervisorRequest::Hibernate => hibernate(shared).await,
        SupervisorRequest::ForkSave {
            state,
            disk,
            max_disk_bytes,
        } => crate::fork::save(shared, &state, &disk, max_disk_bytes, false).await,
        SupervisorRequest::ForkSaveHeld {
            state,
            disk,
            max_disk_bytes,
        } => crate::fork::save(shared, &state, &disk, max_disk_bytes, true).await,
        SupervisorRequest::ForkRelease => crate::fork::release(shared).await,
        _ => Err(SupervisorError::Refused("not a lifecycle step".into())),
    }
}

pub(crate) fn refused(what: &str, e: impl std::fmt::Display) -> SupervisorError {
    SupervisorError::Refused(format!("{what}: {e}"))
}

pub(crate) async fn qmp(path: &std::path::Path) -> Result<Qmp, SupervisorError> {
    Qmp::connect(path)
        .await
        .map_err(|e| vmm_failed("VMM control", e))
}

/// A failed VMM control command: a timeout keeps its own variant (one stable code for
/// "did not answer in time"); anything else refuses the request.
pub(crate) fn vmm_failed(what: &str, e: warren_vmm::VmmError) -> SupervisorError {
    match e {
        warren_vmm::VmmError::QmpTimeout { .. } => {
            SupervisorError::Timeout(format!("{what}: {}", error_chain(&e)))
        }
        e => refused(what, error_chain(&e)),
    }
}

pub(crate) async fn guest_call(
    ch: &GuestChannel,
    req: HostRequest,
) -> Result<warren_protocol::GuestResponse, SupervisorError> {
    match ch.call(&req).await {
        Ok(Ok(r)) => Ok(r),
        Ok(Err(e)) => {
            // The message is the guest's: escaped and cut, and the log is rate-limited.
            tracing::debug!(
                code = e.code.as_str(),
                message = %crate::log::guest_text(&e.message),
                "guest refused a request"
            );
            Err(SupervisorError::Guest(e))
        }
        Err(e @ crate::channel::ChannelError::Timeout(_)) => {
            tracing::warn!(error = %e, "guest call timed out");
            Err(SupervisorError::Timeout(error_chain(&e)))
        }
        Err(e) => Err(SupervisorError::Channel(error_chain(&e))),
    }
}

/// Freezes the guest's jobs for a lifecycle step. Only the guest's own refusal means they
/// were not frozen: a Freeze whose answer was lost (a timeout, a dropped channel) may have
/// happened, since the guest runs it to its end. It is undone at once, or, when the
/// channel cannot carry the `Thaw`, on the next connection, so the jobs of a VM that keeps
/// running are never left frozen.
pub(crate) async fn freeze(shared: &Shared, ch: &GuestChannel) -> Result<(), SupervisorError> {
    match guest_call(ch, HostRequest::Freeze).await {
        Ok(_) => Ok(()),
        Err(e @ SupervisorError::Guest(_)) => Err(e),
        Err(e) => {
            if thaw(ch).await.is_err() {
                shared.thaw_owed.store(true, Ordering::SeqCst);
            }
            Err(e)
        }
    }
}

/// The host's clock and fresh entropy for a guest that runs again.
pub(crate) async fn thaw(ch: &GuestChannel) -> Result<(), SupervisorError> {
    use rand::RngCore;
    let mut entropy = [0u8; 32];
    rand::rng().fill_bytes(&mut entropy);
    let unix_time_ns = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos() as u64;
    guest_call(
        ch,
        HostRequest::Thaw(warren_protocol::Thaw {
            unix_time_ns,
            entropy,
        }),
    )
    .await
    .map(|_| ())
}

pub(crate) fn ready_info(shared: &Shared) -> Option<warren_protocol::AgentInfo> {
    match &*shared.phase.borrow() {
        VmPhase::Ready(i) | VmPhase::Paused(i) => Some(i.clone()),
        _ => None,
    }
}

fn sha256_file(path: &std::path::Path) -> String {
    use sha2::Digest;
    let mut h = sha2::Sha256::new();
    match std::fs::File::open(path) {
        Ok(mut f) => {
            if std::io::copy(&mut f, &mut h).is_err() {
                return String::new();
            }
        }
        Err(_) => return String::new(),
    }
    hex::encode(h.finalize())
}

/// The QEMU binary and firmware digests a checkpoint is bound to (cached by file identity in
/// the host's runtime directory).
pub fn vmm_digests() -> (String, String) {
    let cache = warren_vmm::accel::host_cache_dir();
    let digest = |p: &std::path::Path| {
        warren_vmm::accel::file_digest(p, &cache).unwrap_or_else(|_| sha256_file(p))
    };
    let qemu = warren_vmm::accel::find_qemu()
        .map(|q| digest(&q))
        .unwrap_or_default();
    (qemu, digest(std::path::Path::new(warren_vmm::qemu::QBOOT)))
}

fn injected(name: &str) -> bool {
    std::env::var("WARREN_TEST_CRASH").is_ok_and(|v| v == name)
}

/// Crash-injection points for the end-to-end tests: when `WARREN_TEST_CRASH` names this
/// point, the supervisor dies on the spot (SIGABRT, no cleanup), as a host crash would leave
/// it; its VMM follows through the parent-death signal.
fn crash_point(name: &str) {
    if injected(name) {
        tracing::error!(point = name, "injected crash");
        std::process::abort();
    }
}

/// Loads the checkpoint into a VMM started with `-incoming defer`, then runs it.
async fn restore_checkpoint(
    control: &std::path::Path,
    state: &std::path::Path,
    standby: bool,
    deadline: Instant,
) -> Result<(), String> {
    // QMP appears once QEMU is past its console (which waits for our client).
    let mut q = loop {
        match Qmp::connect(control).await {
            Ok(q) => break q,
            Err(e) if Instant::now() > deadline => return Err(error_chain(&e)),
            Err(_) => tokio::time::sleep(Duration::from_millis(2)).await,
        }
    };
    q.execute("migrate-set-capabilities", Some(capabilities(standby)))
        .await
        .map_err(|e| error_chain(&e))?;
    q.execute(
        "migrate-incoming",
        Some(serde_json::json!({"uri": format!("file:{}", state.display())})),
    )
    .await
    .map_err(|e| error_chain(&e))?;
    migration_done(&mut q).await?;
    q.resume().await.map_err(|e| error_chain(&e))
}

fn status(shared: &Shared) -> StatusInfo {
    StatusInfo {
        phase: shared.phase.borrow().clone(),
        vmm_pid: shared.vmm_pid,
        supervisor_pid: std::process::id(),
        vm_id: shared.vm_id.clone(),
        boot_ms: *shared.boot_ms.lock().unwrap_or_else(|p| p.into_inner()),
        timings: shared.timings.get(),
    }
}

pub(crate) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(x) = src {
        s.push_str(&format!(": {x}"));
        src = x.source();
    }
    s
}
