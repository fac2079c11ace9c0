//! The supervisor's client protocol: one request per connection on `supervisor.sock`,
//! each message a big-endian u32 length followed by a postcard body.

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use warren_protocol::{AgentInfo, GuestError, GuestResponse, HostRequest};

/// Largest client message (a guest message plus headroom).
pub const MAX_FRAME: usize = warren_protocol::limits::MAX_MESSAGE_BYTES + 1024;
/// The longest `WaitReady` honours.
pub const MAX_WAIT_READY_MS: u64 = 600_000;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum SupervisorRequest {
    /// Forward to the guest agent. Session requests (Hello, Auth) are refused.
    Guest(HostRequest),
    /// Current phase, without waiting.
    Status,
    /// Waits until the guest answered (or failed to) for up to this long.
    WaitReady { timeout_ms: u64 },
    /// Stops the VM: the VMM is killed and the supervisor exits.
    Stop,
    /// Freezes the guest's jobs, then stops the vCPUs (RAM stays in the VMM).
    Pause,
    /// Runs the vCPUs again, then syncs the guest's clock and entropy and thaws its jobs.
    Resume,
    /// Writes the VM's memory and device state to `run/checkpoint.ram`, fsyncs it, records
    /// the checkpoint, and ends the VMM and the supervisor.
    Hibernate,
    /// Opens a guest stream; once answered `StreamOpened`, the connection carries stream
    /// frames ([`crate::stream_frame`]).
    OpenStream(warren_protocol::stream::StreamTarget),
    /// For a fork: freezes the jobs, stops the vCPUs, writes memory and device state to
    /// `state` (`mapped-ram`, in the VM's run directory), copies the disk overlay to `disk`,
    /// then runs the VM on and thaws it (`fork.rs`). A disk overlay larger than
    /// `max_disk_bytes` is refused (the VMM wrote it; it could be a huge sparse file).
    ForkSave {
        state: std::path::PathBuf,
        disk: std::path::PathBuf,
        max_disk_bytes: u64,
    },
    /// `ForkSave`, but the VM stays stopped and frozen afterwards (phase `Paused`, a plain
    /// `Resume` refused) until `ForkRelease` or the hold limit (10 minutes): the fork of a
    /// session's VM copies the session's files while the guest cannot change them.
    ForkSaveHeld {
        state: std::path::PathBuf,
        disk: std::path::PathBuf,
        max_disk_bytes: u64,
    },
    /// Ends a `ForkSaveHeld`: the VM runs on as after `Resume`.
    ForkRelease,
    /// The channel's round trip: one HTTP/2 PING to the guest's connection and its PONG
    /// (no request reaches the agent's handlers). Answered `ChannelPong`.
    ChannelPing,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum SupervisorResponse {
    Guest(GuestResponse),
    Status(StatusInfo),
    Stopping,
    Paused,
    Resumed,
    Hibernated(CheckpointInfo),
    StreamOpened,
    /// `ForkSave` done: the state's size and how long the VM was stopped.
    ForkSaved {
        size: u64,
        paused_ms: u64,
    },
    /// `ChannelPing` done: the round trip as the supervisor measured it on the channel.
    ChannelPong {
        rtt_ns: u64,
    },
}

/// A completed checkpoint, as recorded in `checkpoint.json` (after the state was fsynced).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct CheckpointInfo {
    /// Bytes of the state file.
    pub size: u64,
    /// Milliseconds from the request to the fsynced record.
    pub save_ms: u64,
    /// SHA-256 of the QEMU binary and firmware that wrote it: a restore needs the same.
    pub qemu_sha256: String,
    pub firmware_sha256: String,
    pub unix_time: u64,
    /// Fast standby: guest RAM stayed in the VM's RAM file (flushed to disk before this
    /// record); the state file holds device state only. Otherwise RAM is in the state file
    /// (`mapped-ram`).
    #[serde(default)]
    pub standby: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub enum VmPhase {
    Booting,
    Ready(AgentInfo),
    /// The channel dropped and is being re-established.
    Reconnecting,
    Failed(String),
    Stopping,
    /// vCPUs stopped, jobs frozen.
    Paused(AgentInfo),
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StatusInfo {
    pub phase: VmPhase,
    pub vmm_pid: Option<u32>,
    pub supervisor_pid: u32,
    /// The VM the supervisor serves.
    #[serde(default)]
    pub vm_id: String,
    /// Milliseconds from launch to the guest's authenticated answer.
    pub boot_ms: Option<u64>,
    /// Where this supervisor's start went: (step, milliseconds since the supervisor process
    /// started), in order (`warren bench --suite instant` prints them).
    #[serde(default)]
    pub timings: Vec<(String, u64)>,
}

#[derive(Debug, Clone, Serialize, Deserialize, thiserror::Error)]
pub enum SupervisorError {
    #[error("{0}")]
    Guest(GuestError),
    #[error("the guest is not ready: {0}")]
    NotReady(String),
    #[error("the VM failed: {0}")]
    Failed(String),
    #[error("request refused: {0}")]
    Refused(String),
    #[error("guest channel: {0}")]
    Channel(String),
    /// The guest or the VMM did not answer within the call's deadline
    /// ([`crate::deadline`]). The call failed; the VM and its jobs go on.
    #[error("{0}")]
    Timeout(String),
}

pub type Reply = Result<SupervisorResponse, SupervisorError>;

#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("I/O on the supervisor socket")]
    Io(#[from] std::io::Error),
    #[error("frame of {0} bytes is too large")]
    TooLarge(usize),
    #[error("malformed frame")]
    Codec(#[from] postcard::Error),
    #[error("unexpected stream frame")]
    BadStreamFrame,
}

pub async fn write_frame<W: AsyncWriteExt + Unpin, T: Serialize>(
    w: &mut W,
    msg: &T,
) -> Result<(), FrameError> {
    let body = postcard::to_stdvec(msg)?;
    if body.len() > MAX_FRAME {
        return Err(FrameError::TooLarge(body.len()));
    }
    let len = u32::try_from(body.len()).map_err(|_| FrameError::TooLarge(body.len()))?;
    // One write for the length and the body: one wakeup of the reader, not two.
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&len.to_be_bytes());
    frame.extend_from_slice(&body);
    w.write_all(&frame).await?;
    w.flush().await?;
    Ok(())
}

pub async fn read_frame<R: AsyncReadExt + Unpin, T: for<'de> Deserialize<'de>>(
    r: &mut R,
) -> Result<T, FrameError> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len).await?;
    let len = u32::from_be_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(FrameError::TooLarge(len));
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).await?;
    Ok(postcard::from_bytes(&body)?)
}
