//! Warren's engine: the VM registry and its state machine, the SQLite store, and the actions
//! the CLI (and later the service) performs on VMs. It knows nothing of HTTP or MCP.
//!
//! A VM's life: `creating` (disk, secret, per-VM initramfs, supervisor spawned) -> `running`
//! (the guest answered) -> destroyed (row and directory gone), or `failed` at any point with
//! the reason the supervisor recorded. The supervisor, not this crate, owns the running VM;
//! this crate reconciles its records with the supervisors' on every listing.
#![forbid(unsafe_code)]

pub mod admission;
mod agent_state;
pub mod error;
pub mod interactive;
pub mod output;
pub mod session;
pub mod store;
pub mod trusted_dir;
pub mod vm;
pub mod workspace_ops;

pub use admission::LimitsFor;
pub use error::CoreError;
pub use interactive::InteractiveSpec;
pub use session::{CreateSession, SessionDevices};
pub use store::{MountSpec, SessionRecord};
pub use vm::fork::ForkVm;
pub use vm::pool::{PoolShape, PoolStatus};
pub use vm::template_gc::DEFAULT_MAX_TEMPLATES;
pub use vm::{
    local_workspace, validate_mounts, CreateVm, Limits, NetworkRequest, SuspendMode, Warren,
    WarrenConfig,
};
