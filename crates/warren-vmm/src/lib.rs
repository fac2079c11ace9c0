//! Virtual machine monitors behind one trait.
//!
//! [`VmBackend`] is what the per-VM supervisor drives: create the copy-on-write disk, launch
//! the VM process with its console, agent channel and control sockets, and control it
//! (pause, resume, quit). [`qemu::QemuBackend`] is the first backend (microvm, PVH direct
//! kernel boot, virtio-mmio devices). Host specifics (cgroups, process confinement) live in
//! [`sys`]; that is the only module allowed `unsafe`.

pub mod accel;
pub mod backend;
pub mod disk;
pub mod error;
pub mod qemu;
pub mod sys;

pub use accel::{Accel, AccelChoice};
pub use backend::{
    LaunchSpec, LaunchedVm, NetIntercept, NetMode, NetSecret, NetSpec, StderrPipe, VmBackend,
    VmControl, VmEndpoints,
};
pub use error::VmmError;
