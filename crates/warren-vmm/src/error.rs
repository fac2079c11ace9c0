//! Errors of the VMM layer.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum VmmError {
    #[error("qemu-system-x86_64 not found (install it with: apt-get install -t bookworm-backports qemu-system-x86)")]
    QemuMissing,
    #[error("qemu-img failed: {0}")]
    DiskCreate(String),
    #[error("starting {program} failed")]
    Spawn {
        program: String,
        #[source]
        source: std::io::Error,
    },
    #[error("this VM shares host directories but virtiofsd was not found (scripts/setup.sh installs it with `cargo install virtiofsd`; or set WARREN_VIRTIOFSD)")]
    VirtiofsdMissing,
    #[error("invalid share: {0}")]
    BadShare(String),
    #[error("building virtiofsd's seccomp filter failed: {0}")]
    Seccomp(String),
    #[error("share {} is not the directory that was checked when the VM was made: {why}; recreate the VM (or the session) to share what is there now", path.display())]
    ShareChanged {
        path: std::path::PathBuf,
        why: String,
    },
    #[error("accelerator {0} is not supported on this host")]
    AccelUnsupported(String),
    #[error("unknown accelerator {0:?} (expected kvm, hvf, tcg or auto)")]
    AccelParse(String),
    #[error("QMP connection to {path} failed")]
    QmpConnect {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("QMP I/O failed")]
    QmpIo(#[source] std::io::Error),
    #[error("QMP command {command} failed: {desc}")]
    QmpCommand { command: String, desc: String },
    #[error("QMP protocol error: {0}")]
    QmpProtocol(String),
    /// The VMM did not answer a QMP command (or greet) within its deadline.
    #[error("the VMM did not answer {what} within {limit:?}")]
    QmpTimeout {
        what: String,
        limit: std::time::Duration,
    },
    #[error("cgroup {op} at {path} failed")]
    Cgroup {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{op} {path} failed")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl VmmError {
    pub(crate) fn io(op: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        VmmError::Io {
            op,
            path: path.into(),
            source,
        }
    }
}
