//! The parent's half of a fork (`SupervisorRequest::ForkSave`): a consistent copy of a
//! running VM's memory, device state and disk, after which the VM runs on.
//!
//! Steps, in order:
//! 1. `Freeze`: the guest freezes its jobs and stops their timeout clocks;
//! 2. QMP `stop`: the vCPUs stop;
//! 3. migrate to `state` with `mapped-ram` (RAM written into the file at fixed offsets;
//!    `x-ignore-shared` off, so a RAM file's pages are written too): the copies restore from
//!    it into anonymous RAM of their own;
//! 4. copy the disk overlay (quiescent: the vCPUs are stopped and the migration flushed the
//!    block layer) to `disk`; neither file is fsynced (they live only until the copies have
//!    started);
//! 5. QMP `cont` and `Thaw` (clock, entropy, jobs): the parent continues where it was.
//!
//! Any failure undoes 1 and 2 (the VM continues) and removes what was written.
//!
//! A held save (`ForkSaveHeld`, the fork of a session's VM) skips step 5: the VM stays
//! stopped with its jobs frozen (phase `Paused`) while the engine copies the session's files,
//! so the copies' files match their memory. A plain `Resume` is refused meanwhile;
//! `ForkRelease` runs the VM on, and so does the end of [`HOLD_LIMIT`] if the engine never
//! comes back.

use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use warren_vmm::VmControl;

use crate::proto::{Reply, SupervisorError, SupervisorResponse};
use crate::server::{error_chain, freeze, qmp, ready_info, refused, save_to_file, thaw, Shared};

/// The longest a held fork save keeps the VM stopped.
pub const HOLD_LIMIT: Duration = Duration::from_secs(600);

/// Whether a fork holds the VM stopped.
pub(crate) fn held(shared: &Shared) -> bool {
    !shared.fork_hold.load(Ordering::SeqCst).is_multiple_of(2)
}

/// Ends a hold (if there is one) and runs the VM on.
pub(crate) async fn release(shared: &Shared) -> Reply {
    let n = shared.fork_hold.load(Ordering::SeqCst);
    if n.is_multiple_of(2) {
        return Ok(SupervisorResponse::Resumed);
    }
    shared.fork_hold.store(n + 1, Ordering::SeqCst);
    crate::server::resume(shared).await
}

pub(crate) async fn save(
    shared: &Arc<Shared>,
    state: &Path,
    disk: &Path,
    max_disk: u64,
    hold: bool,
) -> Reply {
    if !matches!(*shared.phase.borrow(), crate::proto::VmPhase::Ready(_))
        || ready_info(shared).is_none()
    {
        return Err(SupervisorError::NotReady(
            "only a running VM can be forked".into(),
        ));
    }
    let ch = shared.channel(crate::deadline::RECONNECT_WAIT).await?;
    let t = Instant::now();
    freeze(shared, &ch).await?;
    let mut q = match qmp(&shared.control).await {
        Ok(q) => q,
        Err(e) => {
            let _ = thaw(&ch).await;
            return Err(e);
        }
    };
    let saved: Result<u64, String> = async {
        q.pause().await.map_err(|e| error_chain(&e))?;
        let _ = std::fs::remove_file(state);
        save_to_file(&mut q, state, false).await?;
        // Neither file is flushed: the copies read them at once from the page cache and
        // they are removed after that, and a crash abandons the fork anyway.
        let size = warren_vmm::sys::vmm_file::regular_size(state)
            .map_err(|e| format!("{}: {e}", state.display()))?;
        // The disk is in the VMM's directory: copied through a checked descriptor, so a
        // link the VMM planted there is refused instead of read with the supervisor's rights.
        let from = shared.dir.run_dir().join("disk.qcow2");
        warren_vmm::sys::vmm_file::copy_regular(&from, disk, max_disk)
            .map_err(|e| format!("copying {}: {e}", from.display()))?;
        Ok(size)
    }
    .await;
    if hold && saved.is_ok() {
        // Stays stopped and frozen for the engine's copy of its files (see the module docs).
        if let (Ok(size), Some(info)) = (&saved, ready_info(shared)) {
            let size = *size;
            let n = shared.fork_hold.fetch_add(1, Ordering::SeqCst) + 1;
            shared
                .phase
                .send_replace(crate::proto::VmPhase::Paused(info));
            let later = shared.clone();
            tokio::spawn(async move {
                tokio::time::sleep(HOLD_LIMIT).await;
                let _l = later.lifecycle.lock().await;
                if later.fork_hold.load(Ordering::SeqCst) == n {
                    tracing::warn!("a fork's hold ran out; the VM runs on");
                    let _ = release(&later).await;
                }
            });
            let paused_ms = t.elapsed().as_millis() as u64;
            return Ok(SupervisorResponse::ForkSaved { size, paused_ms });
        }
    }
    // The parent runs on whatever happened: the migration left it stopped.
    let resumed = q.resume().await;
    let thawed = thaw(&ch).await;
    let paused_ms = t.elapsed().as_millis() as u64;
    let size = match saved {
        Ok(size) => size,
        Err(e) => {
            let _ = q.execute("migrate_cancel", None).await;
            let _ = std::fs::remove_file(state);
            let _ = std::fs::remove_file(disk);
            return Err(refused("saving the VM for a fork failed; it continues", e));
        }
    };
    if let Err(e) = resumed {
        return Err(refused(
            "running the VM again after the fork save",
            error_chain(&e),
        ));
    }
    thawed?;
    Ok(SupervisorResponse::ForkSaved { size, paused_ms })
}
