//! The crate's error type: one variant per failed operation.

use std::path::PathBuf;

/// Everything that can go wrong while building, importing, resolving or verifying an image.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// A filesystem operation failed.
    #[error("{op} {path}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The agent is not a static x86-64 ELF executable: as PID 1 of the initramfs it has no
    /// dynamic loader or libraries to use.
    #[error("{0} is not a static x86-64 executable; build it with scripts/build-guest.sh")]
    AgentNotStatic(PathBuf),
    /// A helper program could not be started.
    #[error("cannot run {program}")]
    Spawn {
        program: String,
        #[source]
        source: std::io::Error,
    },
    /// `debootstrap` failed; `log_tail` holds the end of its output.
    #[error("debootstrap failed ({status}); log {log}:\n{log_tail}")]
    Debootstrap {
        status: String,
        log: PathBuf,
        log_tail: String,
    },
    /// Installing the recipe's extra packages in the chroot failed.
    #[error("package install failed ({status}); log {log}:\n{log_tail}")]
    Packages {
        status: String,
        log: PathBuf,
        log_tail: String,
    },
    /// Downloading an agent CLI's npm tarball failed.
    #[error("downloading npm package {package} from {url} failed ({status}): {output}")]
    NpmFetch {
        package: String,
        url: String,
        status: String,
        output: String,
    },
    /// An agent CLI's npm tarball does not match the integrity pinned in the recipe.
    #[error("npm package {package}: integrity mismatch: pinned {expected}, got {actual}")]
    NpmIntegrity {
        package: String,
        expected: String,
        actual: String,
    },
    /// An agent CLI's npm tarball could not be unpacked safely.
    #[error("unpacking npm package {package}: {reason}")]
    NpmUnpack { package: String, reason: String },
    /// Finding or downloading the kernel package failed.
    #[error("kernel fetch failed: {0}")]
    KernelFetch(String),
    /// Unpacking the kernel package or extracting `vmlinux` from the bzImage failed.
    #[error("kernel extract failed: {0}")]
    KernelExtract(String),
    /// Computing or decompressing the module set failed.
    #[error("kernel modules: {0}")]
    Modules(String),
    /// Preparing the root filesystem tree (links, user, /workspace, cleanup) failed.
    #[error("rootfs setup failed: {0}")]
    RootfsSetup(String),
    /// `mkfs.ext4` failed.
    #[error("mkfs.ext4 failed ({status}): {output}")]
    Mkfs { status: String, output: String },
    /// A file's content does not match the digest recorded in the manifest.
    #[error("digest mismatch for {file}: expected sha256 {expected}, found {actual}")]
    DigestMismatch {
        file: PathBuf,
        expected: String,
        actual: String,
    },
    /// A manifest or cache record could not be parsed or is inconsistent.
    #[error("invalid manifest {path}: {reason}")]
    Manifest { path: PathBuf, reason: String },
    /// No image matches the given spec.
    #[error("no image matches {0:?}")]
    NotFound(String),
    /// More than one image matches the given prefix.
    #[error("image spec {0:?} is ambiguous")]
    Ambiguous(String),
    /// A recipe name that is not `minimal`, `dev` or `agents`.
    #[error("unknown recipe {0:?} (expected minimal, dev or agents, or --recipe-file)")]
    UnknownRecipe(String),
    /// A recipe file that does not parse or breaks a rule.
    #[error("invalid recipe {0}")]
    RecipeInvalid(String),
    /// Finding or downloading a recipe's Python wheel failed.
    #[error("python package {package}: {reason}")]
    PythonFetch { package: String, reason: String },
    /// A Python wheel does not match the SHA-256 pinned in the recipe.
    #[error("python package {package}: sha256 mismatch: pinned {expected}, got {actual}")]
    PythonIntegrity {
        package: String,
        expected: String,
        actual: String,
    },
    /// The string is not a 64-hex-digit image id.
    #[error("invalid image id {0:?}")]
    InvalidId(String),
    /// The image policy refuses the image (`image` set) or every image (a policy problem).
    #[error("{}refused by the image policy: {failure}", image.as_deref().map(|i| format!("image {i}: ")).unwrap_or_default())]
    Untrusted {
        image: Option<String>,
        failure: crate::trust::TrustFailure,
    },
    /// An image reference that cannot be pulled as given (a tag without a digest, a
    /// malformed name, plain HTTP to a registry off this machine).
    #[error("image reference: {0}")]
    OciReference(String),
    /// Talking to the registry failed (network, status, deadline).
    #[error("pulling {reference}: {reason}")]
    Oci { reference: String, reason: String },
    /// The registry's content is refused: a digest mismatch, a size limit, a hostile layer.
    #[error("pulling {reference}: refused: {reason}")]
    OciRefused { reference: String, reason: String },
    /// Signing or key handling failed.
    #[error("signing: {0}")]
    Signing(String),
    /// The per-VM secret or another input is malformed.
    #[error("invalid input: {0}")]
    InvalidInput(String),
}

impl ImageError {
    /// Builds an [`ImageError::Io`] for `op` on `path`; use as `.map_err(io("read", &p))`.
    pub(crate) fn io(
        op: &'static str,
        path: impl Into<PathBuf>,
    ) -> impl FnOnce(std::io::Error) -> ImageError {
        let path = path.into();
        move |source| ImageError::Io { op, path, source }
    }
}
