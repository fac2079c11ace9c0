//! Opening a guest stream for a caller: ownership, ports, quotas, then the guest. Every
//! refusal happens before the guest is asked to connect anything, except "nothing listens",
//! which only the guest can tell.

use warren_protocol::stream::StreamTarget;
use warren_protocol::ErrorCode;
use warren_supervisor::stream_frame::GuestStream;

use super::Service;
use crate::auth::Principal;
use crate::error::ApiError;
use crate::streams::{Streams, Ticket};

/// An open stream and its place under the quotas.
pub struct Opened {
    pub vm_id: String,
    pub stream: GuestStream,
    pub ticket: Ticket,
}

impl Service {
    /// The (device, inode) of every host directory a VM of this service can write (its
    /// read-write shares, sessions' directories and agent state included, whatever the
    /// workspace): the recorded identity, and what the path names now when it is a
    /// directory (`lstat`).
    pub fn writable_shares(&self) -> Result<Vec<(u64, u64)>, ApiError> {
        let mut out = Vec::new();
        for vm in self.engine().list_vms()? {
            for m in vm.mounts.iter().filter(|m| !m.read_only) {
                out.extend(m.identity);
                if let Ok(md) = std::fs::symlink_metadata(&m.host) {
                    if md.is_dir() {
                        use std::os::unix::fs::MetadataExt;
                        out.push((md.dev(), md.ino()));
                    }
                }
            }
        }
        out.sort_unstable();
        out.dedup();
        Ok(out)
    }

    /// The service's open streams.
    pub fn streams(&self) -> &Streams {
        &self.streams
    }

    /// The checks that need no guest: the VM is the caller's, the port may be streamed to.
    pub fn check_stream(
        &self,
        p: &Principal,
        vm_id: &str,
        target: &StreamTarget,
    ) -> Result<(), ApiError> {
        self.owned(p, vm_id, None)?;
        if let StreamTarget::Tcp { port } = target {
            self.streams.check_port(*port)?;
        }
        Ok(())
    }

    /// Opens `target` in the caller's VM `vm_id` (waking it when suspended).
    pub async fn open_stream(
        &self,
        p: &Principal,
        vm_id: &str,
        target: StreamTarget,
    ) -> Result<Opened, ApiError> {
        let rec = self.owned(p, vm_id, None)?;
        if let StreamTarget::Tcp { port } = target {
            self.streams.check_port(port)?;
        }
        let ticket = self.streams.admit(&p.workspace, &rec.id)?;
        let tcp = matches!(target, StreamTarget::Tcp { .. });
        let stream = self
            .warren
            .open_stream(&rec.id, target)
            .await
            .map_err(|e| {
                if tcp && e.guest().is_some_and(|g| g.code == ErrorCode::NotFound) {
                    // Nothing listens: the VM is there, the port is not (a conflict with
                    // the guest's state, which a retry after starting a listener fixes).
                    return ApiError::conflict(
                        e.guest().map(|g| g.message.clone()).unwrap_or_default(),
                    );
                }
                ApiError::from(e)
            })?;
        Ok(Opened {
            vm_id: rec.id,
            stream,
            ticket,
        })
    }

    /// Counts an open stream as work on its VM.
    pub fn stream_activity(&self, vm_id: &str) {
        self.warren.note_activity(vm_id);
    }
}
