//! The QEMU backend: `-M microvm`, PVH direct boot of an ELF `vmlinux` through qboot,
//! virtio-mmio devices, no default devices (PLATFORM.md's fastest recipe).
//!
//! Endpoints are listening UNIX sockets the backend binds in the VM directory (the parent of
//! the run directory, which the VMM cannot write) and passes to QEMU as descriptors, so a
//! compromised VMM can neither replace them nor point the supervisor at another socket:
//! `vmm-console.sock` (serial; QEMU waits for the supervisor to connect before the guest runs,
//! so no console byte is lost), `vmm-channel.sock` (the agent's virtio-serial port) and
//! `vmm-qmp.sock`. Each is owner-only. QEMU and its virtiofsd run in network namespaces of
//! their own with no interface but a down `lo` (`sys::process::confine`).

mod cmdline;
pub mod mapped_ram;
pub mod qmp;
mod tsc;
pub mod virtiofs;

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

pub use cmdline::{default_cpu, kernel_cmdline, qemu_args, Attach, TCG_CPU};
use tokio::io::AsyncReadExt;
pub use tsc::host_tsc_khz;

use crate::accel::{Accel, ProbeVerdict};
use crate::backend::{
    BoxFuture, LaunchSpec, LaunchedVm, StderrPipe, VmBackend, VmControl, VmEndpoints,
};
use crate::error::VmmError;

/// QEMU's qboot firmware: SeaBIOS' microvm build hangs with a PVH vmlinux + initrd.
pub const QBOOT: &str = "/usr/share/qemu/qboot.rom";

#[derive(Debug, Clone)]
pub struct QemuBackend {
    pub qemu: PathBuf,
    /// Host TSC frequency in kHz, passed as `tsc_early_khz` (without it microvm under TCG
    /// sometimes hangs in PIT calibration).
    pub tsc_khz: u64,
}

impl QemuBackend {
    pub fn new(qemu: PathBuf) -> Result<Self, VmmError> {
        Ok(Self {
            qemu,
            tsc_khz: host_tsc_khz()?,
        })
    }

    /// Where the backend binds a VM's endpoints: beside `run_dir`, in its parent.
    pub fn endpoints(run_dir: &Path) -> VmEndpoints {
        let dir = run_dir.parent().unwrap_or(run_dir);
        VmEndpoints {
            console: dir.join("vmm-console.sock"),
            channel: dir.join("vmm-channel.sock"),
            control: dir.join("vmm-qmp.sock"),
        }
    }
}

impl VmBackend for QemuBackend {
    fn name(&self) -> &'static str {
        "qemu"
    }

    fn create_disk(&self, base: &Path, overlay: &Path) -> Result<(), VmmError> {
        crate::disk::create_overlay(base, overlay)
    }

    fn launch(&self, spec: &LaunchSpec) -> Result<LaunchedVm, VmmError> {
        let endpoints = Self::endpoints(&spec.run_dir);
        let listeners = [
            (bind_endpoint(&endpoints.console)?, cmdline::CONSOLE_FD),
            (bind_endpoint(&endpoints.channel)?, cmdline::CHANNEL_FD),
            (bind_endpoint(&endpoints.control)?, cmdline::QMP_FD),
        ];
        let virtiofs::Started {
            children: helpers,
            conns: share_conns,
            stderr: helper_stderr,
        } = virtiofs::spawn_all(spec)?;
        // The NIC: the namespace's TAP device, opened here and kept open until spawn returns.
        let tap = match &spec.network {
            Some(net) => {
                let ns = PathBuf::from("/run/netns").join(&net.netns);
                Some(
                    crate::sys::tap::open_tap_in(&ns, cmdline::TAP_NAME)
                        .map_err(|e| VmmError::io("open TAP in", &ns, e))?,
                )
            }
            None => None,
        };
        // A clone with shares: its own shared RAM, filled from the template's file.
        let ram = match &spec.clone_ram {
            Some(template) => Some(
                crate::sys::clone_ram::memfd_from_template(
                    template,
                    u64::from(spec.memory.0) << 20,
                )
                .map_err(|e| VmmError::io("copy the template RAM of", template, e))?,
            ),
            None => None,
        };
        // A fork's copy: the parent's saved state, opened here (read-only) and passed at
        // `RAM_FD`, so its path never appears on the VMM's command line, which every local
        // user can read.
        let ram = match (&spec.fork_ram, ram) {
            (Some(fr), None) => Some(OwnedFd::from(
                crate::sys::vmm_file::open_regular(&fr.path)
                    .map_err(|e| VmmError::io("open the fork's RAM", &fr.path, e))?,
            )),
            (_, ram) => ram,
        };
        let args = qemu_args(spec, Attach::Fds, self.tsc_khz);
        // Run by its absolute path: the view's root has no working directory of ours.
        let program =
            std::fs::canonicalize(&self.qemu).map_err(|e| VmmError::io("find", &self.qemu, e))?;
        let view = crate::sys::view::VmmView::for_launch(
            &program,
            &spec.run_dir,
            &view_dirs(spec),
            &test_vmm_dir(),
            spec.accel == crate::Accel::Kvm,
        )
        .map_err(|e| VmmError::io("prepare the VMM's view for", &spec.run_dir, e))?;
        let (qemu_stderr, stderr_write) = StderrPipe::new(spec.stderr_log.clone())?;
        let mut cmd = tokio::process::Command::new(&program);
        cmd.args(&args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(stderr_write))
            .kill_on_drop(false);
        if let Some(cg) = &spec.cgroup {
            // Joined in the child, before the uid drop: nothing QEMU starts runs outside.
            crate::sys::process::join_cgroups(
                cmd.as_std_mut(),
                &crate::sys::cgroup::member_dirs(cg),
            );
        }
        crate::sys::process::confine_viewed(cmd.as_std_mut(), spec.run_as, &spec.groups, &view)
            .map_err(|e| VmmError::io("prepare the VMM's view for", &spec.run_dir, e))?;
        let mut fds: Vec<(std::os::fd::RawFd, i32)> = Vec::new();
        {
            use std::os::fd::AsRawFd;
            if let Some(tap) = &tap {
                fds.push((tap.as_raw_fd(), cmdline::TAP_FD));
            }
            if let Some(ram) = &ram {
                fds.push((ram.as_raw_fd(), cmdline::RAM_FD));
            }
            fds.extend(listeners.iter().map(|(l, n)| (l.as_raw_fd(), *n)));
            fds.extend(
                share_conns
                    .iter()
                    .enumerate()
                    .map(|(i, c)| (c.as_raw_fd(), cmdline::SHARE_FD_BASE + i as i32)),
            );
        }
        crate::sys::process::pass_fds(cmd.as_std_mut(), &fds);
        let child = cmd.spawn().map_err(|source| VmmError::Spawn {
            program: self.qemu.display().to_string(),
            source,
        })?;
        // QEMU holds its own copies now; the supervisor keeps only the paths to connect to
        // (and the read end of QEMU's stderr: the command held the write end).
        drop((tap, listeners, share_conns, ram, cmd));
        if let (Some(cg), Some(pid)) = (&spec.cgroup, child.id()) {
            crate::sys::cgroup::add_pid(cg, pid)?;
        }
        let mut stderr = vec![qemu_stderr];
        stderr.extend(helper_stderr);
        Ok(LaunchedVm {
            child,
            endpoints,
            helpers,
            stderr,
        })
    }

    fn control<'a>(
        &'a self,
        endpoints: &'a VmEndpoints,
    ) -> BoxFuture<'a, Result<Box<dyn VmControl>, VmmError>> {
        Box::pin(async move {
            let q = qmp::Qmp::connect(&endpoints.control).await?;
            Ok(Box::new(q) as Box<dyn VmControl>)
        })
    }
}

/// The directories a VMM may read besides its run directory ([`crate::sys::view`]): the
/// image's (kernel, initramfs, the root file system its disk backs onto), a template's RAM
/// file's, and what the supervisor named ([`LaunchSpec::view_readable`]: its template, the
/// fork state it restores from). Their own modes still apply.
fn view_dirs(spec: &LaunchSpec) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = [
        Some(&spec.kernel),
        Some(&spec.initramfs),
        Some(&spec.disk),
        spec.template_ram.as_ref(),
        spec.ram_file.as_ref(),
    ]
    .into_iter()
    .flatten()
    .filter_map(|p| p.parent().map(Path::to_path_buf))
    .collect();
    dirs.extend(spec.view_readable.iter().cloned());
    dirs.retain(|d| !d.starts_with(&spec.run_dir));
    dirs.sort();
    dirs.dedup();
    dirs
}

/// `$WARREN_TEST_VMM_DIR`: a directory the test suite's QEMU stand-ins (a wrapper that counts
/// boots, the hostile-guest harness) read and write besides the run directory. The
/// environment is the operator's, as `$WARREN_QEMU` is (which picks the program itself).
fn test_vmm_dir() -> Vec<PathBuf> {
    let dir = std::env::var_os("WARREN_TEST_VMM_DIR").map(PathBuf::from);
    if let Some(d) = &dir {
        tracing::warn!(
            dir = %d.display(),
            "WARREN_TEST_VMM_DIR is set: the VMM may write this directory (for the test suite's QEMU stand-ins only)"
        );
    }
    dir.into_iter().collect()
}

/// Binds the listening socket of one endpoint at `path` (replacing a stale one), owner-only.
fn bind_endpoint(path: &Path) -> Result<std::os::unix::net::UnixListener, VmmError> {
    use std::os::unix::fs::PermissionsExt;
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(VmmError::io("remove", path, e)),
    }
    let l =
        std::os::unix::net::UnixListener::bind(path).map_err(|e| VmmError::io("bind", path, e))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .map_err(|e| VmmError::io("chmod", path, e))?;
    Ok(l)
}

/// Boots `kernel` + `initramfs` under KVM with a deadline and reports whether the guest
/// printed `marker` on its console (i.e. reached user space). Never waits past `deadline`.
pub async fn probe_kvm(
    qemu: &Path,
    kernel: &Path,
    initramfs: &Path,
    marker: &str,
    deadline: Duration,
) -> ProbeVerdict {
    let tsc = host_tsc_khz().unwrap_or(0);
    let mut args: Vec<String> = vec![
        "-M".into(),
        "microvm,acpi=on".into(),
        "-accel".into(),
        "kvm".into(),
        "-cpu".into(),
        "host".into(),
        "-bios".into(),
        QBOOT.into(),
        "-nodefaults".into(),
        "-no-user-config".into(),
        "-display".into(),
        "none".into(),
        "-no-reboot".into(),
        "-m".into(),
        "256".into(),
        "-serial".into(),
        "stdio".into(),
        "-kernel".into(),
        kernel.display().to_string(),
        "-initrd".into(),
        initramfs.display().to_string(),
        "-append".into(),
    ];
    args.push(kernel_cmdline(tsc, &["warren.probe=1".to_string()]));
    let started = Instant::now();
    let child = tokio::process::Command::new(qemu)
        .args(&args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) => {
            return ProbeVerdict {
                usable: false,
                detail: format!("starting QEMU for the KVM probe failed: {e}"),
            }
        }
    };
    let Some(mut out) = child.stdout.take() else {
        return ProbeVerdict {
            usable: false,
            detail: "no probe stdout".into(),
        };
    };
    let mut seen = Vec::new();
    let found = tokio::time::timeout(deadline, async {
        let mut buf = [0u8; 4096];
        loop {
            match out.read(&mut buf).await {
                Ok(0) | Err(_) => return false,
                Ok(n) => {
                    seen.extend_from_slice(&buf[..n]);
                    if String::from_utf8_lossy(&seen).contains(marker) {
                        return true;
                    }
                }
            }
        }
    })
    .await;
    // Never wait for the probe VM to die: a vCPU stuck in a broken KVM may take long to
    // honour SIGKILL. The runtime reaps it in the background (kill_on_drop).
    let _ = child.start_kill();
    let mut err_pipe = child.stderr.take();
    drop(child);
    match found {
        Ok(true) => ProbeVerdict {
            usable: true,
            detail: format!("guest reached user space in {:?}", started.elapsed()),
        },
        Ok(false) => {
            let mut err = String::new();
            if let Some(e) = err_pipe.as_mut() {
                let _ =
                    tokio::time::timeout(Duration::from_secs(1), e.read_to_string(&mut err)).await;
            }
            ProbeVerdict {
                usable: false,
                detail: format!(
                    "QEMU exited during the KVM probe: {}",
                    err.lines().last().unwrap_or("no message")
                ),
            }
        }
        Err(_) => ProbeVerdict {
            usable: false,
            detail: format!("a probe boot under KVM printed nothing within {deadline:?}"),
        },
    }
}

impl Accel {
    pub(crate) fn qemu_args(self) -> [&'static str; 2] {
        match self {
            Accel::Kvm => ["-accel", "kvm"],
            // A smaller translation cache trims ~10 MiB of RSS per VM at no measurable cost.
            Accel::Tcg => ["-accel", "tcg,tb-size=64"],
        }
    }
}
