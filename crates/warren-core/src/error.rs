//! The engine's error type and its stable machine codes.

use warren_image::ImageError;
use warren_protocol::{ErrorCode, GuestError};
use warren_supervisor::client::ClientError;
use warren_supervisor::SupervisorError;
use warren_vmm::VmmError;

#[derive(Debug, thiserror::Error)]
pub enum CoreError {
    #[error("no VM {0}")]
    VmNotFound(String),
    #[error("VM {id} is {state}{}", reason.as_ref().map(|r| format!(": {r}")).unwrap_or_default())]
    VmNotRunning {
        id: String,
        state: String,
        reason: Option<String>,
    },
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The caller may not use what it named (a repository outside its host root).
    #[error("forbidden: {0}")]
    Forbidden(String),
    #[error("image {0} is in use by VM {1}")]
    ImageInUse(String, String),
    #[error("quota exceeded: {0}")]
    QuotaExceeded(String),
    /// A precondition failed (the state changed under the caller).
    #[error("conflict: {0}")]
    Conflict(String),
    #[error("busy: {0}")]
    Busy(String),
    /// The guest answered outside the protocol's bounds (more bytes than asked for, a file
    /// that never ends): a hostile or broken agent. The call fails; the VM goes on.
    #[error("the guest broke the protocol: {0}")]
    GuestProtocol(String),
    #[error("cannot resume: {0}")]
    CheckpointIncompatible(String),
    /// The QEMU binary, firmware or kernel a VM was created with is not what the host has
    /// now (`vm/artifacts.rs`): the launch is refused and nothing changes.
    #[error(
        "VM {vm} was created with another {artifact}: recorded {recorded}, found {found}; \
         launch refused (the operator may accept this host's: `warren vm resume {vm} \
         --accept-new-runtime`)"
    )]
    ArtifactChanged {
        vm: String,
        artifact: &'static str,
        recorded: String,
        found: String,
    },
    #[error("no session {0}")]
    SessionNotFound(String),
    /// A job a suspended VM's record of its jobs does not hold.
    #[error("{0}")]
    JobNotFound(String),
    #[error("session: {0}")]
    Session(String),
    #[error("the VM failed to boot: {0}")]
    BootFailed(String),
    /// A session's own filesystem (its storage limit) could not be made or mounted: the
    /// host lacks loop devices, `mkfs.ext4` or mount permission (`warren preflight` says).
    #[error("session storage unavailable: {0}")]
    StorageUnavailable(String),
    /// A state or image directory another local user could control (`trusted_dir`).
    #[error("untrusted directory {0}")]
    UntrustedDirectory(String),
    #[error(transparent)]
    Image(#[from] ImageError),
    #[error(transparent)]
    Vmm(#[from] VmmError),
    #[error(transparent)]
    Supervisor(#[from] ClientError),
    /// The limits a resume is admitted under could not be read.
    #[error("admission limits: {0}")]
    Admission(String),
    #[error("store")]
    Store(#[from] rusqlite::Error),
    #[error("{op} {path}")]
    Io {
        op: &'static str,
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl CoreError {
    pub(crate) fn io(
        op: &'static str,
        path: impl Into<std::path::PathBuf>,
        e: std::io::Error,
    ) -> Self {
        CoreError::Io {
            op,
            path: path.into(),
            source: e,
        }
    }

    /// The stable machine code a client can act on.
    pub fn code(&self) -> &'static str {
        match self {
            CoreError::VmNotFound(_) => "not_found",
            CoreError::VmNotRunning { .. } => "conflict",
            CoreError::InvalidArgument(_) => "invalid_argument",
            CoreError::Forbidden(_) => "forbidden",
            CoreError::ImageInUse(..) => "conflict",
            CoreError::BootFailed(_) => "unavailable",
            CoreError::StorageUnavailable(_) => "unavailable",
            CoreError::UntrustedDirectory(_) => "forbidden",
            CoreError::QuotaExceeded(_) => "quota_exceeded",
            CoreError::Busy(_) => "busy",
            CoreError::GuestProtocol(_) => "unavailable",
            CoreError::Conflict(_) => "conflict",
            CoreError::CheckpointIncompatible(_) => "conflict",
            CoreError::ArtifactChanged { .. } => "integrity",
            CoreError::SessionNotFound(_) => "not_found",
            CoreError::JobNotFound(_) => "not_found",
            CoreError::Session(_) => "internal",
            CoreError::Image(ImageError::NotFound(_)) => "not_found",
            CoreError::Image(ImageError::Ambiguous(_)) => "invalid_argument",
            CoreError::Image(ImageError::DigestMismatch { .. }) => "integrity",
            CoreError::Image(ImageError::Untrusted { .. }) => "untrusted_image",
            CoreError::Image(
                ImageError::RecipeInvalid(_)
                | ImageError::UnknownRecipe(_)
                | ImageError::InvalidId(_)
                | ImageError::OciReference(_),
            ) => "invalid_argument",
            CoreError::Image(ImageError::Oci { .. }) => "unavailable",
            CoreError::Image(ImageError::OciRefused { .. }) => "integrity",
            CoreError::Image(_) => "internal",
            CoreError::Vmm(VmmError::AccelUnsupported(_) | VmmError::AccelParse(_)) => {
                "invalid_argument"
            }
            CoreError::Vmm(VmmError::VirtiofsdMissing) => "unavailable",
            CoreError::Vmm(VmmError::BadShare(_)) => "invalid_argument",
            CoreError::Vmm(_) => "internal",
            CoreError::Supervisor(ClientError::Supervisor(SupervisorError::Guest(g))) => {
                g.code.as_str()
            }
            CoreError::Supervisor(ClientError::Supervisor(
                SupervisorError::NotReady(_) | SupervisorError::Channel(_),
            )) => "unavailable",
            // The guest, its VMM or its supervisor did not answer within the call's
            // deadline: the call failed, the VM goes on; retrying later may succeed.
            CoreError::Supervisor(
                ClientError::Timeout(_) | ClientError::Supervisor(SupervisorError::Timeout(_)),
            ) => "unavailable",
            CoreError::Supervisor(ClientError::Supervisor(SupervisorError::Failed(_))) => {
                "conflict"
            }
            CoreError::Supervisor(_) => "unavailable",
            CoreError::Store(_) | CoreError::Io { .. } | CoreError::Admission(_) => "internal",
        }
    }

    /// The guest's typed error, when this is one.
    pub fn guest(&self) -> Option<&GuestError> {
        match self {
            CoreError::Supervisor(ClientError::Supervisor(SupervisorError::Guest(g))) => Some(g),
            _ => None,
        }
    }

    pub fn is_guest_code(&self, code: ErrorCode) -> bool {
        self.guest().map(|g| g.code == code).unwrap_or(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_code_guest_quota_maps_to_quota_exceeded() {
        let e = CoreError::Supervisor(ClientError::Supervisor(SupervisorError::Guest(
            GuestError::new(ErrorCode::QuotaExceeded, "4 jobs running"),
        )));
        assert_eq!(e.code(), "quota_exceeded");
    }

    #[test]
    fn test_code_deadline_of_guest_vmm_or_supervisor_is_unavailable() {
        let guest = CoreError::Supervisor(ClientError::Supervisor(SupervisorError::Timeout(
            "the guest did not answer within 20s".into(),
        )));
        let supervisor =
            CoreError::Supervisor(ClientError::Timeout(std::time::Duration::from_secs(40)));
        assert_eq!(guest.code(), "unavailable");
        assert_eq!(supervisor.code(), "unavailable");
    }

    #[test]
    fn test_code_guest_protocol_violation_is_unavailable() {
        let e = CoreError::GuestProtocol("a chunk longer than asked for".into());
        assert_eq!(e.code(), "unavailable");
    }

    #[test]
    fn test_code_missing_vm_not_found() {
        assert_eq!(CoreError::VmNotFound("x".into()).code(), "not_found");
    }
}
