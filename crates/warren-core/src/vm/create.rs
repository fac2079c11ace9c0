//! Creating and booting a VM: admission, its directory, disk overlay, secret and per-VM
//! initramfs, the supervisor's configuration, and the detached supervisor itself.

use std::os::unix::fs::{chown, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use rand::RngCore;
use warren_image::VerifiedImage;
use warren_supervisor::{SupervisorClient, SupervisorConfig, VmDir};
use warren_vmm::backend::MemMib;
use warren_vmm::sys::cgroup;
use warren_vmm::{Accel, LaunchSpec};

use super::mounts::{identify_mounts, net_spec, shares_of, validate_mounts};
use super::{
    kill_supervisor, local_workspace, now_unix, tail, wait_supervisor_exit, write_private,
    CreateVm, SuspendMode, Warren, DEFAULT_IDLE_SECONDS, DEFAULT_IMAGE, DEFAULT_MEMORY_MIB,
    DEFAULT_VCPUS, MEMORY_MIB_RANGE, VCPUS_RANGE,
};
use crate::error::CoreError;
use crate::store::{Usage, VmRecord, VmState};

impl Warren {
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
        let image = self.verify_image(&image_id)?;
        tracing::debug!(ms = t.elapsed().as_millis() as u64, "image verified");
        let (accel, warning) = self.resolve_accel(&image).await?;
        tracing::debug!(ms = t.elapsed().as_millis() as u64, %accel, "accelerator resolved");
        if let Some(w) = warning {
            warn(&w);
        }

        // A warm pool VM of this shape, when the pool has one ready (`pool.rs`).
        if req.template && req.workspace != super::pool::POOL_WORKSPACE {
            let ws = if req.workspace.is_empty() {
                local_workspace(nix::unistd::geteuid().as_raw())
            } else {
                req.workspace.clone()
            };
            if let Some(rec) = self.take_from_pool(req, &image_id.to_string(), &ws)? {
                return Ok(rec);
            }
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
            generation: req.generation.unwrap_or(1),
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
        let admit = |tx: &rusqlite::Transaction<'_>| {
            super::admit(tx, &ws, &req.workspace_limits, &req.host_limits, add)
        };
        // The caller's VM is admitted and its record inserted (`creating`) before any work,
        // so what it reserves counts against every later request at once; its directory's
        // transition lock is held from before the record exists until the create ends
        // (`begin_create`).
        let _creating = self.begin_create(&rec)?;
        if let Err(e) = self.store.insert(&mut rec, self.first_vm_uid(), admit) {
            self.abandon_create(&rec, false);
            return Err(e);
        }
        // A template of this shape (built now if there is none) instead of a cold boot.
        let template = match (req.template, self.template_key(req, &image, accel)) {
            (true, Some(key)) => {
                // A build boots a VM of the shape, counted in no workspace: only for a VM
                // admitted and reserved above. Before, a workspace at or past its limits still
                // had templates built (host memory and CPU for a boot, a RAM file and disk
                // layer kept, another shape's template retired) by requests refused
                // afterwards; and requests sent at once, each checked before any was
                // reserved, had as many builds run as they named shapes, past the workspace's
                // limits (a hostile review).
                match self.template_for(&key, req, &image).await {
                    Ok(t) => Some(t),
                    Err(e) => {
                        // Nothing of the VM runs yet: its record and directory go, so the
                        // request may be sent again (a build another request holds answers
                        // `busy`).
                        self.abandon_create(&rec, true);
                        return Err(e);
                    }
                }
            }
            _ => None,
        };
        let bench_port = req.raw_bench_port;
        let started = match &template {
            Some(tpl) => {
                self.start_clone(&rec, &image, accel, virtiofsd, network, tpl)
                    .await
            }
            None => {
                self.start(&rec, &image, accel, virtiofsd, network, bench_port)
                    .await
            }
        };
        let started = match started {
            Ok(boot_ms) => self
                .store
                .set_state(&id, VmState::Running, None, Some(boot_ms))
                // The idle time counts from here, not from the create's start: a boot longer
                // than the VM's idle time left it idle the moment it was handed over.
                .and_then(|()| self.store.touch(&id, now_unix()))
                .map(|()| boot_ms)
                .map_err(CoreError::from),
            Err(e) => Err(e),
        };
        match started {
            Ok(boot_ms) => {
                rec.state = VmState::Running;
                rec.boot_ms = Some(boot_ms);
                Ok(rec)
            }
            Err(e) => {
                // A start can fail after its VMM came up (settling a clone, the record's
                // update): nothing of a failed VM runs on.
                if let Err(halt) = self.halt(&id).await {
                    tracing::warn!(vm = %id, error = %halt, "stopping a VM whose start failed");
                }
                let reason = e.to_string();
                self.store
                    .set_state(&id, VmState::Failed, Some(&reason), None)?;
                Err(e)
            }
        }
    }

    /// Makes the new VM `rec`'s directory and takes its transition lock, before its record
    /// is inserted, held until the create ends: a destroy meanwhile answers `busy`. Before, a
    /// destroy during a create (a template build takes seconds) found no directory, removed
    /// the record alone, and the VM then started with no record: counted nowhere, reached by
    /// no call, its uid given to the next VM (hostile reviews; fork copies the same). The
    /// kernel drops the lock with a creator that died, so its record can then be destroyed.
    pub(super) fn begin_create(
        &self,
        rec: &VmRecord,
    ) -> Result<nix::fcntl::Flock<std::fs::File>, CoreError> {
        // A directory that exists already is no one's to remove here.
        let dir = self.make_vm_dir(rec)?;
        let locked = super::suspend::try_transition(&dir).and_then(|lock| {
            lock.ok_or_else(|| CoreError::Busy(format!("{} is being destroyed", rec.id)))
        });
        locked.inspect_err(|_| self.abandon_create(rec, false))
    }

    /// Removes what a create made before anything of its VM ran: the VM directory (made by
    /// [`Warren::begin_create`], only the engine's files in it) and, when `inserted`, the
    /// record (a refused insert leaves any record of that id alone).
    pub(super) fn abandon_create(&self, rec: &VmRecord, inserted: bool) {
        let dir = self.vm_dir(&rec.id);
        match std::fs::remove_dir_all(dir.path()) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => tracing::warn!(vm = %rec.id, error = %e, "removing a VM directory"),
        }
        if inserted {
            if let Err(e) = self.store.delete(&rec.id) {
                tracing::warn!(vm = %rec.id, error = %e, "removing a VM record");
            }
        }
    }

    /// The directory [`Warren::begin_create`] made for `rec`, and the uid and gid its VMM
    /// runs as (`None`: a non-root Warren).
    pub(super) fn made_vm_dir(&self, rec: &VmRecord) -> (VmDir, Option<(u32, u32)>) {
        let run_as = nix::unistd::geteuid()
            .is_root()
            .then_some((rec.uid, rec.uid));
        (self.vm_dir(&rec.id), run_as)
    }

    async fn start(
        &self,
        rec: &VmRecord,
        image: &VerifiedImage,
        accel: Accel,
        virtiofsd: Option<PathBuf>,
        network: Option<warren_vmm::NetSpec>,
        bench_port: bool,
    ) -> Result<u64, CoreError> {
        let (dir, run_as) = self.made_vm_dir(rec);
        let run = dir.run_dir();
        let root = run_as.is_some();
        let give = |path: &Path| give(path, run_as);
        self.record_artifacts(&dir, image)?;

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
        if bench_port {
            extra_cmdline.push(warren_protocol::BENCH_PORT_ARG.to_string());
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
                bench_port: bench_port.then(|| run.join("bench-port.sock")),
                view_readable: vec![],
                template_ram: None,
                clone_ram: None,
                fork_ram: None,
                named_ram: false,
                groups: vec![],
            },
            boot_timeout_ms: self.cfg.boot_timeout.as_millis() as u64,
            restore: false,
            clone: None,
            restore_from: None,
        };
        let body = serde_json::to_vec_pretty(&cfg).expect("invariant: config serialises");
        write_private(&dir.config(), &body)?;
        hand_over_run(&dir, run_as)?;
        self.launch_and_wait(&dir).await
    }

    /// Makes a new VM's directory: root's (0711: the VMM may only traverse it), with the
    /// VMM's `run/` (0700), still root's: the caller fills it and then hands it to the VM's
    /// uid ([`hand_over_run`]) just before the launch, so nothing running as that uid (a
    /// VMM of an earlier VM that had the same uid) can plant a link for root to follow while
    /// it is being filled ([`Warren::made_vm_dir`] then gives the uid and gid the VMM runs as).
    fn make_vm_dir(&self, rec: &VmRecord) -> Result<VmDir, CoreError> {
        let dir = self.vm_dir(&rec.id);
        let p = dir.path();
        std::fs::create_dir(p).map_err(|e| CoreError::io("create", p, e))?;
        let run = dir.run_dir();
        let shaped = std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o711))
            .map_err(|e| CoreError::io("chmod", p, e))
            .and_then(|()| std::fs::create_dir(&run).map_err(|e| CoreError::io("create", &run, e)))
            .and_then(|()| {
                std::fs::set_permissions(&run, std::fs::Permissions::from_mode(0o700))
                    .map_err(|e| CoreError::io("chmod", &run, e))
            });
        if let Err(e) = shaped {
            // Made here and nothing in it but `run/`: not left without a record.
            let _ = std::fs::remove_dir(&run);
            let _ = std::fs::remove_dir(p);
            return Err(e);
        }
        Ok(dir)
    }

    /// Starts the VM's supervisor and waits until its guest answers (or fails to). A cold
    /// boot whose kernel measured its timer wrongly (`ExitRecord::boot_again`: the host held
    /// the VM's CPU up while the kernel calibrated it) is booted again, up to
    /// [`BOOT_ATTEMPTS`] times in all, each time logged; the boot time returned counts them.
    pub(super) async fn launch_and_wait(&self, dir: &VmDir) -> Result<u64, CoreError> {
        let started = std::time::Instant::now();
        for attempt in 1..=BOOT_ATTEMPTS {
            let before = started.elapsed().as_millis() as u64;
            match self.launch_once(dir, attempt > 1).await? {
                Ok(ms) => return Ok(before + ms),
                Err(Failed { reason, boot_again }) if boot_again && attempt < BOOT_ATTEMPTS => {
                    tracing::warn!(
                        vm = %dir.path().display(),
                        attempt,
                        reason = %warren_supervisor::log::guest_text(&reason),
                        "the guest's kernel measured its timer wrongly (a busy host); booting the VM again"
                    );
                    // The last supervisor may still be on its way out (holding the lock).
                    if !wait_supervisor_exit(dir, Duration::from_secs(10)).await {
                        kill_supervisor(dir);
                        wait_supervisor_exit(dir, Duration::from_secs(5)).await;
                    }
                    for p in [dir.exit_record(), dir.socket()] {
                        match std::fs::remove_file(&p) {
                            Ok(()) => {}
                            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                            Err(e) => return Err(CoreError::io("remove", &p, e)),
                        }
                    }
                }
                Err(Failed { reason, boot_again }) => {
                    return Err(CoreError::BootFailed(if boot_again {
                        format!(
                            "{reason}\n(booted {BOOT_ATTEMPTS} times; each time the host held \
                             the VM's CPU up while its kernel calibrated the timer: the host is \
                             too busy to boot VMs under TCG)"
                        )
                    } else {
                        reason
                    }));
                }
            }
        }
        unreachable!("the last attempt returns")
    }

    /// One supervisor start and its wait: the boot time, or why the boot failed; an error
    /// when the supervisor could not be started. `again`: a boot after
    /// [`Failed::boot_again`] (the supervisor's log is appended to, not replaced).
    async fn launch_once(
        &self,
        dir: &VmDir,
        again: bool,
    ) -> Result<Result<u64, Failed>, CoreError> {
        let dir = dir.clone();
        let t = std::time::Instant::now();
        let supervisor = super::launch::spawn_supervisor(&self.cfg, &dir, again)?;
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
                return Ok(Err(dir
                    .read_exit()
                    .map(Failed::from)
                    .unwrap_or_else(|| Failed::from(tail(&dir.supervisor_log(), 10)))));
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        match client
            .wait_ready(self.cfg.boot_timeout + Duration::from_secs(5))
            .await
        {
            Ok(st) => Ok(Ok(st.boot_ms.unwrap_or(0))),
            Err(e) => {
                // The supervisor records the precise reason (console tail included).
                let _ = client.stop().await;
                if !wait_supervisor_exit(&dir, Duration::from_secs(10)).await {
                    // Never leave a VM running behind a failed create.
                    kill_supervisor(&dir);
                    wait_supervisor_exit(&dir, Duration::from_secs(5)).await;
                }
                Ok(Err(dir.read_exit().map(Failed::from).unwrap_or_else(
                    || {
                        Failed::from(format!(
                            "{e}; supervisor log:\n{}",
                            tail(&dir.supervisor_log(), 10)
                        ))
                    },
                )))
            }
        }
    }
}

/// Boots of one VM [`Warren::launch_and_wait`] makes at most: a kernel's timer calibration
/// fails only when the host stalls the VM in a window of a few milliseconds, so two in a row
/// are rare and three mean a host too loaded to boot.
const BOOT_ATTEMPTS: u32 = 3;

/// A boot that did not come up, and whether booting again may help.
struct Failed {
    reason: String,
    boot_again: bool,
}

impl From<String> for Failed {
    fn from(reason: String) -> Failed {
        Failed {
            reason,
            boot_again: false,
        }
    }
}

impl From<warren_supervisor::layout::ExitRecord> for Failed {
    fn from(r: warren_supervisor::layout::ExitRecord) -> Failed {
        Failed {
            reason: r.reason,
            boot_again: r.boot_again && !r.requested,
        }
    }
}

/// Hands a filled `run/` to the VM's uid, last thing before the launch (see
/// [`Warren::make_vm_dir`]).
pub(super) fn hand_over_run(dir: &VmDir, run_as: Option<(u32, u32)>) -> Result<(), CoreError> {
    give(&dir.run_dir(), run_as)
}

/// Hands `path` to the VM's uid (when running as root).
pub(super) fn give(path: &Path, run_as: Option<(u32, u32)>) -> Result<(), CoreError> {
    if let Some((u, g)) = run_as {
        chown(path, Some(u), Some(g)).map_err(|e| CoreError::io("chown", path, e))?;
    }
    Ok(())
}

/// Whether an environment variable's name says it holds a credential (`*_API_KEY`,
/// `*_TOKEN`, `*_SECRET`, `*_PASSWORD`, any case); such variables are not passed on to
/// the supervisor.
pub(crate) fn credential_variable(name: &str) -> bool {
    let n = name.to_ascii_uppercase();
    ["_API_KEY", "_TOKEN", "_SECRET", "_PASSWORD", "_CREDENTIALS"]
        .iter()
        .any(|s| n.ends_with(s))
        || matches!(n.as_str(), "API_KEY" | "TOKEN" | "PASSWORD")
}

#[cfg(test)]
mod tests {
    #[test]
    fn test_credential_variables_recognised() {
        for v in [
            "ANTHROPIC_API_KEY",
            "OPENAI_API_KEY",
            "GH_TOKEN",
            "github_token",
            "DB_PASSWORD",
        ] {
            assert!(super::credential_variable(v), "{v}");
        }
        for v in [
            "PATH",
            "RUST_LOG",
            "HOME",
            "WARREN_QEMU",
            "TOKENIZERS_PARALLELISM",
        ] {
            assert!(!super::credential_variable(v), "{v}");
        }
    }
}
