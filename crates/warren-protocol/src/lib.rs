//! Warren's host<->guest protocol: wire types, the resync framing that sits under HTTP/2 on the
//! virtio-serial port, the mutual authentication proofs and the limits both sides enforce.
//!
//! Layering on the port, bottom to top:
//! 1. [`framing`]: byte stuffing that can carry `Sync`/`SyncAck` markers which never occur in
//!    data. The host starts every (re)connection with a `Sync` carrying a fresh nonce and drops
//!    everything it reads until the matching `SyncAck`; the guest drops its previous session
//!    when it sees a `Sync`. This is what makes reconnection after a supervisor restart or a
//!    snapshot restore safe although stale bytes may sit in either direction.
//! 2. HTTP/2 (the `h2` crate) in the data stream: one stream per operation, so operations are
//!    multiplexed and cancelled by resetting their stream.
//! 3. [`messages`]: each HTTP/2 request body is one postcard-encoded [`messages::HostRequest`],
//!    each response body one postcard-encoded `Result<GuestResponse, GuestError>`.
//!
//! See `PROTOCOL.md` at the repository root for versioning and compatibility rules.
#![forbid(unsafe_code)]

pub mod auth;
pub mod framing;
pub mod limits;
pub mod messages;
pub mod stream;

pub use messages::*;

/// Protocol version spoken by this build. Bump on any incompatible change of [`messages`]
/// (see `PROTOCOL.md`); the schema snapshot test fails until the bump is deliberate.
pub const PROTOCOL_VERSION: u32 = 6;

/// Oldest protocol version this build still speaks. Version 3 added fields to `JobOutput`
/// and `JobSummary` (background processes) and neither side keeps the version-2 encoding.
/// Versions 4 (guest streams, [`stream`]), 5 (acknowledged output reads, the broker pipe)
/// and 6 (`Rekey` -> `Rekeyed`: restored copies take their own identity) only append, so a
/// version-3 peer is still spoken to (without them; a guest before 6 answers `Rekey` with
/// `InvalidArgument`, so its images cannot serve templates or forks).
pub const MIN_PROTOCOL_VERSION: u32 = 3;

/// Name of the virtio-serial port carrying the channel (`/sys/class/virtio-ports/*/name`).
pub const PORT_NAME: &str = "org.warren.agent.0";

/// Bench and tests only: a second virtio-serial port, byte for byte the same kind as
/// [`PORT_NAME`] but without Warren's protocol on it, the raw-port baseline of
/// `warren bench --suite streams`. Normal VMs never have it.
pub const BENCH_PORT_NAME: &str = "org.warren.bench.0";

/// Kernel argument telling the agent that the VM has the [`BENCH_PORT_NAME`] port: it waits
/// for it at boot and hands its device node to the guest user, so a job can pump bytes
/// through it.
pub const BENCH_PORT_ARG: &str = "warren.bench_port";

/// Kernel argument naming the frequency (kHz) at which the VMM runs the local APIC timer's
/// input clock (QEMU and KVM: 1 GHz). The agent checks the kernel's own measurement of it
/// at boot ([`CLOCK_FAILED_LINE`]); without the argument it checks only that a timer exists.
pub const APIC_BUS_ARG: &str = "warren.apic_bus_khz";

/// The console line (a prefix) of a boot the agent stopped because the kernel measured its
/// timer wrongly: the VMM's CPU was held up while the kernel calibrated the local APIC timer
/// (a loaded host under TCG), and the kernel either turned the timer off (the VM would hang
/// at its first sleep) or set it to fire late. Nothing ran yet; the host boots such a VM
/// again.
pub const CLOCK_FAILED_LINE: &str = "guest: clock failed: ";

/// HTTP/2 request path used for every operation; the operation is the body's enum variant.
pub const RPC_PATH: &str = "/warren/v1";

/// Path of the per-VM secret inside the initramfs (appended per VM by the host, read once by
/// the agent at boot and then removed with the rest of the initramfs).
pub const SECRET_PATH: &str = "/warren/secret";

/// Length in bytes of the per-VM secret.
pub const SECRET_LEN: usize = 32;

/// The agent's first console line once it serves the channel; the benchmark and boot-failure
/// diagnostics look for it.
pub const READY_LINE: &str = "warren-guest: ready";
