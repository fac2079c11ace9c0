//! Typed errors of the egress crate. No variant ever carries a secret value: secret-related
//! errors name the secret (its operator-chosen name) and, for files, the path.

use std::io;
use std::path::PathBuf;

/// A configuration that cannot be used; nothing was started.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A domain pattern is not `name` or `*.name` with valid DNS syntax.
    #[error("invalid domain pattern {0:?}")]
    DomainPattern(String),
    /// A secret's placeholder is empty, too short, not printable ASCII or duplicated.
    #[error("secret {0:?}: placeholder must be unique printable ASCII of at least 8 characters")]
    Placeholder(String),
    /// A secret has no host it may be sent to.
    #[error("secret {0:?} has no hosts")]
    SecretHosts(String),
    /// A header name configured for substitution is not a valid token.
    #[error("invalid header name {0:?}")]
    HeaderName(String),
    /// An interception rule is unusable (empty command, bad method or path prefix).
    #[error("interception rule {index}: {reason}")]
    Rule {
        /// Position in the configured list.
        index: usize,
        /// What is wrong.
        reason: &'static str,
    },
    /// The upstream root certificates could not be parsed.
    #[error("upstream root certificates: {0}")]
    Roots(String),
    /// An allow or deny entry names a preset that does not exist.
    #[error("unknown preset {0:?} (known: debian, python, npm, rust, go, github)")]
    Preset(String),
    /// The host's CA store could not be read or holds something unusable.
    #[error("host CA store: {0}")]
    HostCa(String),
    /// The VM CA could not be generated or loaded.
    #[error("VM CA: {0}")]
    Ca(String),
}

/// Resolving a secret's value failed. Never contains the value.
#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    /// The secret file could not be read.
    #[error("secret {name:?}: reading {path}")]
    Read {
        /// Secret name.
        name: String,
        /// File path.
        path: PathBuf,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// The value is empty or contains bytes not allowed in an HTTP header value.
    #[error("secret {name:?}: value is empty or not a valid header value")]
    Invalid {
        /// Secret name.
        name: String,
    },
}

/// Errors of the egress service itself (setup and serving).
#[derive(Debug, thiserror::Error)]
pub enum EgressError {
    /// Bad configuration.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// Opening or entering a network namespace failed.
    #[error("network namespace {path}")]
    Netns {
        /// The namespace file.
        path: PathBuf,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// The namespace worker thread is gone.
    #[error("network namespace worker stopped")]
    NetnsWorker,
    /// Registering a listener with the runtime failed.
    #[error("listener setup")]
    Listener(#[source] io::Error),
}

/// Fixing the kernel buffers of a connection's socket failed (`crate::conns`, "How much
/// kernel memory"): the connection is closed unserved rather than left with buffers the
/// kernel would grow.
#[derive(Debug, thiserror::Error)]
#[error("fixing the kernel buffers of the {side} socket at {bytes} bytes")]
pub(crate) struct BufferError {
    /// `guest-facing` or `upstream`.
    pub(crate) side: &'static str,
    /// The size asked for.
    pub(crate) bytes: usize,
    /// Cause.
    #[source]
    pub(crate) source: io::Error,
}

/// Why one proxied connection ended abnormally (logged at debug, never shown to the guest).
#[derive(Debug, thiserror::Error)]
pub(crate) enum ConnError {
    #[error("i/o")]
    Io(#[from] io::Error),
    #[error("upstream TLS name invalid")]
    ServerName,
    #[error("HTTP framing: {0}")]
    Framing(&'static str),
    #[error("{0} timed out")]
    TimedOut(&'static str),
}
