//! Starting a VM's supervisor, detached from whoever asked for the VM.
//!
//! Two ways, chosen by `WARREN_SUPERVISORS` when the engine's configuration is made
//! ([`SupervisorLaunch::from_env`]):
//!
//! - `child` (the default): a child process in its own process group. It outlives the CLI,
//!   but it stays in the caller's cgroup: under a service manager that kills a service's
//!   whole cgroup on stop, the VMs would die with the service.
//! - `systemd`: a transient service unit of its own (`systemd-run`), `warren-vm-*.service`
//!   in `warren-vms.slice`, started by PID 1 outside the caller's cgroup and mount
//!   namespace. `warren.service` sets it, so stopping, restarting or crashing the service
//!   leaves every VM running and the next service process re-adopts them (they are found
//!   through their directories and locks, never through the process tree). Each unit is
//!   ordered before `warren-hibernate.service`, whose stop at host shutdown hibernates every
//!   VM before systemd stops the units. The supervisor's output goes to the same log file
//!   as in `child` mode.
//!
//! Only an allow-list of the caller's environment reaches a supervisor started by systemd
//! (`PATH`, `RUST_LOG`, `WARREN_*`): everything else comes from the service manager. In
//! both ways no variable named like a credential (`*_TOKEN`, `*_API_KEY`, ...) reaches it.

use std::io::Read;
use std::os::fd::OwnedFd;
use std::process::Stdio;
use std::time::{Duration, Instant};

use rand::RngCore;
use warren_supervisor::VmDir;

use super::create::credential_variable;
use super::WarrenConfig;
use crate::error::CoreError;

/// How long `systemd-run` may take to have the unit started.
const SYSTEMD_RUN_DEADLINE: Duration = Duration::from_secs(30);

/// The slice holding every supervisor started as a unit (shipped as `warren-vms.slice`).
pub const VM_SLICE: &str = "warren-vms.slice";

/// How supervisors are started; see the module documentation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SupervisorLaunch {
    /// A detached child process (own process group).
    Child,
    /// A transient systemd service unit per supervisor.
    Systemd,
    /// `WARREN_SUPERVISORS` held something else: every launch is refused, naming it.
    Invalid(String),
}

impl SupervisorLaunch {
    /// From `WARREN_SUPERVISORS`: unset or `child`, or `systemd`.
    pub fn from_env() -> SupervisorLaunch {
        match std::env::var("WARREN_SUPERVISORS") {
            Err(std::env::VarError::NotPresent) => SupervisorLaunch::Child,
            Ok(v) => SupervisorLaunch::parse(&v),
            Err(std::env::VarError::NotUnicode(v)) => {
                SupervisorLaunch::Invalid(v.to_string_lossy().into_owned())
            }
        }
    }

    fn parse(v: &str) -> SupervisorLaunch {
        match v {
            "" | "child" => SupervisorLaunch::Child,
            "systemd" => SupervisorLaunch::Systemd,
            other => SupervisorLaunch::Invalid(other.to_string()),
        }
    }
}

/// Starts `warren supervise` for `dir`, detached; returns a pidfd on it when it is our
/// child (none under systemd, or on a kernel without pidfds: then only the supervisor's
/// own lock-file pid can reach it later). Its log replaces the last one, or with `append`
/// follows it (a VM booted again keeps the first boot's story).
pub(super) fn spawn_supervisor(
    cfg: &WarrenConfig,
    dir: &VmDir,
    append: bool,
) -> Result<Option<OwnedFd>, CoreError> {
    let log = warren_vmm::sys::private_file::create(&dir.supervisor_log(), append)
        .map_err(|e| CoreError::io("create", dir.supervisor_log(), e))?;
    match &cfg.supervisors {
        SupervisorLaunch::Child => spawn_child(cfg, dir, log),
        SupervisorLaunch::Systemd => {
            drop(log);
            spawn_unit(cfg, dir).map(|()| None)
        }
        SupervisorLaunch::Invalid(v) => Err(CoreError::InvalidArgument(format!(
            "WARREN_SUPERVISORS={v:?}: expected child or systemd"
        ))),
    }
}

fn spawn_child(
    cfg: &WarrenConfig,
    dir: &VmDir,
    log: std::fs::File,
) -> Result<Option<OwnedFd>, CoreError> {
    use std::os::unix::process::CommandExt;
    let log2 = log
        .try_clone()
        .map_err(|e| CoreError::io("dup", dir.supervisor_log(), e))?;
    let mut cmd = std::process::Command::new(&cfg.supervisor_exe);
    cmd.arg("supervise")
        .arg("--vm-dir")
        .arg(dir.path())
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(log2)
        .env("RUST_LOG", rust_log())
        // Its own session: terminal signals to the CLI never reach it.
        .process_group(0);
    // Credentials in the caller's environment (`ANTHROPIC_API_KEY`, `GH_TOKEN`, ...) stay
    // with the caller: the supervisor, QEMU and virtiofsd never hold them.
    for (name, _) in std::env::vars_os() {
        if name.to_str().is_none_or(credential_variable) {
            cmd.env_remove(&name);
        }
    }
    let mut child = cmd
        .spawn()
        .map_err(|e| CoreError::io("spawn", &cfg.supervisor_exe, e))?;
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

fn rust_log() -> String {
    std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into())
}

/// What a supervisor's unit forbids: the guest's bytes reach the supervisor (channel,
/// egress), which runs as root, so what it and its children (QEMU, virtiofsd, intercept
/// commands and credential refreshes) never need is taken from them, as `warren.service`
/// does for the service. Defence in depth, not containment: the supervisor keeps
/// `CAP_SYS_ADMIN` and the host's mount namespace. No privilege gained through
/// exec (set-user-ID programs, file capabilities), no capability a VM never uses (modules,
/// boot, clock, MAC, audit control, raw I/O, scheduling above others), no system call of
/// the groups none of them makes (a call refused returns `EPERM` rather than killing the
/// VM's processes), no socket family but UNIX, IP and netlink (the TAP device is a file).
/// Nothing that gives the unit a mount namespace of its own: the VM's shares and session
/// volumes are mounted in the host's.
const UNIT_HARDENING: &[&str] = &[
    "NoNewPrivileges=yes",
    "LockPersonality=yes",
    "RestrictRealtime=yes",
    "RestrictSUIDSGID=yes",
    "SystemCallArchitectures=native",
    "SystemCallFilter=~@clock @cpu-emulation @debug @module @obsolete @raw-io @reboot @swap",
    "SystemCallErrorNumber=EPERM",
    "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK",
    "CapabilityBoundingSet=~CAP_SYS_MODULE CAP_SYS_BOOT CAP_SYS_TIME CAP_WAKE_ALARM \
     CAP_MAC_ADMIN CAP_MAC_OVERRIDE CAP_AUDIT_CONTROL CAP_SYSLOG CAP_LINUX_IMMUTABLE \
     CAP_SYS_PACCT CAP_SYS_TTY_CONFIG CAP_BLOCK_SUSPEND CAP_SYS_RAWIO CAP_SYS_NICE",
];

/// The `systemd-run` arguments that start `dir`'s supervisor as unit `unit` (refused for
/// paths systemd would not pass on verbatim, see [`check_unit_path`]).
fn unit_args(
    cfg: &WarrenConfig,
    dir: &VmDir,
    unit: &str,
) -> Result<Vec<std::ffi::OsString>, CoreError> {
    for p in [dir.path(), cfg.supervisor_exe.as_path()] {
        check_unit_path(p)?;
    }
    let log = dir.supervisor_log();
    let mut args: Vec<std::ffi::OsString> = vec![
        "--quiet".into(),
        "--collect".into(),
        format!("--unit={unit}").into(),
        format!("--slice={VM_SLICE}").into(),
        format!(
            "--description=Warren VM supervisor ({})",
            dir.path().display()
        )
        .into(),
        // `exec`: systemd-run fails when the binary cannot be executed.
        "--property=Type=exec".into(),
        "--property=Before=warren-hibernate.service".into(),
        "--property=TimeoutStopSec=30".into(),
    ];
    args.extend(
        UNIT_HARDENING
            .iter()
            .map(|p| format!("--property={p}").into()),
    );
    for stream in ["StandardOutput", "StandardError"] {
        let mut a = std::ffi::OsString::from(format!("--property={stream}=append:"));
        a.push(&log);
        args.push(a);
    }
    let mut env = vec![("RUST_LOG".to_string(), rust_log().into())];
    for (k, v) in std::env::vars_os() {
        if let Some(k) = k.to_str() {
            if (k.starts_with("WARREN_") || k == "PATH")
                && k != "WARREN_SUPERVISORS"
                && k != "WARREN_SOCKET_ACTIVATION"
                && !credential_variable(k)
            {
                env.push((k.to_string(), v));
            }
        }
    }
    for (k, v) in env {
        let mut a = std::ffi::OsString::from(format!("--setenv={k}="));
        a.push(v);
        args.push(a);
    }
    args.push("--".into());
    args.push(cfg.supervisor_exe.clone().into());
    args.push("supervise".into());
    args.push("--vm-dir".into());
    args.push(dir.path().into());
    Ok(args)
}

/// Refuses a path systemd would not pass on verbatim: in a transient unit's command line
/// (`systemd-run` before systemd 254, as on Debian 12, has no `--expand-environment=no`)
/// `$NAME` and `${NAME}` are replaced by the unit's environment (and `$NAME` split at
/// whitespace), so a state directory with a `$` would start another program or directory;
/// control characters have no place in a unit's properties either.
fn check_unit_path(p: &std::path::Path) -> Result<(), CoreError> {
    use std::os::unix::ffi::OsStrExt;
    let bytes = p.as_os_str().as_bytes();
    if bytes.iter().any(|b| *b == b'$' || b.is_ascii_control()) || !p.is_absolute() {
        return Err(CoreError::InvalidArgument(format!(
            "{}: a path given to systemd-run must be absolute, without `$` or control \
             characters (systemd would expand or refuse it)",
            p.display()
        )));
    }
    Ok(())
}

fn spawn_unit(cfg: &WarrenConfig, dir: &VmDir) -> Result<(), CoreError> {
    let name = dir
        .path()
        .file_name()
        .and_then(|n| n.to_str())
        .filter(|n| n.chars().all(|c| c.is_ascii_alphanumeric() || c == '-'))
        .ok_or_else(|| {
            CoreError::InvalidArgument(format!(
                "{}: a VM directory name must be ASCII letters, digits and dashes",
                dir.path().display()
            ))
        })?;
    // A fresh name per launch: the previous supervisor's unit may not be collected yet
    // when a VM is resumed right after it hibernated.
    let mut nonce = [0u8; 4];
    rand::rng().fill_bytes(&mut nonce);
    let unit = format!("warren-vm-{name}-{}.service", hex::encode(nonce));
    let mut child = std::process::Command::new("systemd-run")
        .args(unit_args(cfg, dir, &unit)?)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| CoreError::io("spawn", "systemd-run", e))?;
    let started = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break s,
            Ok(None) if started.elapsed() < SYSTEMD_RUN_DEADLINE => {
                std::thread::sleep(Duration::from_millis(10));
            }
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(CoreError::BootFailed(format!(
                    "systemd-run did not start {unit} within {}s",
                    SYSTEMD_RUN_DEADLINE.as_secs()
                )));
            }
            Err(e) => return Err(CoreError::io("wait", "systemd-run", e)),
        }
    };
    if !status.success() {
        let mut err = String::new();
        if let Some(mut e) = child.stderr.take() {
            let _ = (&mut e).take(4096).read_to_string(&mut err);
        }
        return Err(CoreError::BootFailed(format!(
            "systemd-run could not start {unit} ({status}): {}",
            err.trim()
        )));
    }
    tracing::debug!(unit, "supervisor started as a systemd unit");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_supervisor_launch_parse_unknown_is_invalid() {
        assert_eq!(SupervisorLaunch::parse(""), SupervisorLaunch::Child);
        assert_eq!(SupervisorLaunch::parse("child"), SupervisorLaunch::Child);
        assert_eq!(
            SupervisorLaunch::parse("systemd"),
            SupervisorLaunch::Systemd
        );
        assert_eq!(
            SupervisorLaunch::parse("docker"),
            SupervisorLaunch::Invalid("docker".into())
        );
    }

    #[test]
    fn test_unit_paths_with_dollar_or_control_characters_refused() {
        use std::path::Path;
        check_unit_path(Path::new("/var/lib/warren/vms/abc")).expect("plain");
        check_unit_path(Path::new("/srv/my state/vms/abc")).expect("space");
        for bad in [
            "/var/lib/$HOME/vms/abc",
            "/var/lib/${X}/vms/abc",
            "/var/lib/warren\n/vms/abc",
            "relative/vms/abc",
        ] {
            let e = check_unit_path(Path::new(bad)).expect_err(bad).to_string();
            assert!(e.contains("systemd-run"), "{bad}: {e}");
        }
        // The arguments spawn_unit passes to systemd-run are refused before any exist.
        let cfg = WarrenConfig::new("/var/lib/$X".into(), "/usr/bin/warren".into());
        let dir = VmDir("/var/lib/$X/vms/abc".into());
        let e = unit_args(&cfg, &dir, "warren-vm-abc-1.service").expect_err("dollar");
        assert!(e.to_string().contains("without `$`"), "{e}");
    }

    #[test]
    fn test_unit_args_log_slice_and_command() {
        let cfg = WarrenConfig::new("/var/lib/warren".into(), "/usr/bin/warren".into());
        let dir = VmDir("/var/lib/warren/vms/abc".into());
        let args: Vec<String> = unit_args(&cfg, &dir, "warren-vm-abc-1.service")
            .expect("args")
            .into_iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        let log = dir.supervisor_log().display().to_string();
        for want in [
            "--unit=warren-vm-abc-1.service".to_string(),
            format!("--slice={VM_SLICE}"),
            "--property=Type=exec".into(),
            "--property=Before=warren-hibernate.service".into(),
            format!("--property=StandardOutput=append:{log}"),
            format!("--property=StandardError=append:{log}"),
            "--property=NoNewPrivileges=yes".into(),
            "--property=SystemCallErrorNumber=EPERM".into(),
        ] {
            assert!(args.contains(&want), "{want} in {args:?}");
        }
        let dash = args.iter().position(|a| a == "--").expect("--");
        assert_eq!(
            &args[dash + 1..],
            [
                "/usr/bin/warren",
                "supervise",
                "--vm-dir",
                "/var/lib/warren/vms/abc"
            ]
        );
        assert!(!args.iter().any(|a| a.contains("WARREN_SUPERVISORS")));
    }
}
