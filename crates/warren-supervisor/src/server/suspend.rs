//! Pause, hibernation and fast standby in the supervisor, and restoring a checkpoint.

use super::*;

pub(super) async fn pause(shared: &Shared) -> Reply {
    if matches!(*shared.phase.borrow(), VmPhase::Paused(_)) {
        return Ok(SupervisorResponse::Paused);
    }
    let ch = shared.channel(RECONNECT_WAIT).await?;
    let info = ready_info(shared).ok_or_else(|| SupervisorError::NotReady("not running".into()))?;
    freeze(shared, &ch).await?;
    let stopped = match qmp(&shared.control).await {
        Ok(mut q) => q
            .pause()
            .await
            .map_err(|e| vmm_failed("stopping the vCPUs", e)),
        Err(e) => Err(e),
    };
    if let Err(e) = stopped {
        let _ = thaw(&ch).await;
        return Err(e);
    }
    shared.phase.send_replace(VmPhase::Paused(info));
    Ok(SupervisorResponse::Paused)
}

pub(crate) async fn resume(shared: &Shared) -> Reply {
    let Some(info) = (match &*shared.phase.borrow() {
        VmPhase::Paused(i) => Some(i.clone()),
        _ => None,
    }) else {
        return match &*shared.phase.borrow() {
            VmPhase::Ready(_) => Ok(SupervisorResponse::Resumed),
            other => Err(SupervisorError::NotReady(format!(
                "cannot resume: {other:?}"
            ))),
        };
    };
    qmp(&shared.control)
        .await?
        .resume()
        .await
        .map_err(|e| vmm_failed("running the vCPUs", e))?;
    shared.phase.send_replace(VmPhase::Ready(info.clone()));
    let ch = shared.channel(RECONNECT_WAIT).await?;
    if let Err(e) = thaw(&ch).await {
        if matches!(e, SupervisorError::Timeout(_)) && repause(shared).await {
            // A guest that did not answer in time keeps its jobs: the vCPUs are stopped
            // again and the VM stays paused, so a later resume tries again.
            shared.phase.send_replace(VmPhase::Paused(info));
            return Err(e);
        }
        // A guest whose clock and jobs cannot be brought back is not trusted to go on.
        let reason = format!("syncing the resumed guest failed: {e}");
        shared.phase.send_replace(VmPhase::Failed(reason.clone()));
        *shared.stop_reason.lock().unwrap_or_else(|p| p.into_inner()) = Some(reason.clone());
        shared.stop.notify_one();
        return Err(SupervisorError::Failed(reason));
    }
    Ok(SupervisorResponse::Resumed)
}

/// Stops the vCPUs of a VM whose resume could not be completed; true if they stopped.
pub(super) async fn repause(shared: &Shared) -> bool {
    match qmp(&shared.control).await {
        Ok(mut q) => q.pause().await.is_ok(),
        Err(_) => false,
    }
}

/// Polls a migration until it completes.
/// Saves the paused VM's state into `state` (a migration to a file; `standby`: device state
/// only, the RAM staying in its shared file) and waits until it completes.
pub(crate) async fn save_to_file(
    q: &mut Qmp,
    state: &std::path::Path,
    standby: bool,
) -> Result<(), String> {
    q.execute("migrate-set-capabilities", Some(capabilities(standby)))
        .await
        .map_err(|e| error_chain(&e))?;
    // QEMU throttles migrations to 128 MiB/s by default, meant for live migration over a
    // network; a stopped VM going to a local file should go at disk speed.
    q.execute(
        "migrate-set-parameters",
        Some(serde_json::json!({"max-bandwidth": 1u64 << 40})),
    )
    .await
    .map_err(|e| error_chain(&e))?;
    q.execute(
        "migrate",
        Some(serde_json::json!({"uri": format!("file:{}", state.display())})),
    )
    .await
    .map_err(|e| error_chain(&e))?;
    migration_done(q).await
}

pub(crate) async fn migration_done(q: &mut Qmp) -> Result<(), String> {
    let deadline = Instant::now() + MIGRATION_LIMIT;
    loop {
        let v = q
            .execute("query-migrate", None)
            .await
            .map_err(|e| error_chain(&e))?;
        match v.get("status").and_then(|s| s.as_str()) {
            Some("completed") => return Ok(()),
            Some("failed") | Some("cancelled") => {
                let why = v
                    .get("error-desc")
                    .and_then(|d| d.as_str())
                    .unwrap_or("no reason given");
                return Err(format!("migration failed: {why}"));
            }
            _ => {}
        }
        if Instant::now() > deadline {
            return Err(format!(
                "migration did not finish within {MIGRATION_LIMIT:?}"
            ));
        }
        // A restore of device state only takes a few ms: poll finely.
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Migration capabilities of a checkpoint: `mapped-ram` (RAM written into the state file at
/// fixed offsets) or, for standby and template restores, `x-ignore-shared` (the shared RAM
/// file is left as it is). Both are always set, one on and one off: capabilities outlive a
/// migration in the VMM, and a restored template clone (which took `x-ignore-shared` to
/// load) must not carry it into its own checkpoints, whose reader would not expect it.
pub(crate) fn capabilities(standby: bool) -> serde_json::Value {
    serde_json::json!({"capabilities": [
        {"capability": "x-ignore-shared", "state": standby},
        {"capability": "mapped-ram", "state": !standby},
    ]})
}

pub(super) async fn hibernate(shared: &Shared) -> Reply {
    let t = Instant::now();
    let standby = shared.ram_file.is_some();
    let was_paused = matches!(*shared.phase.borrow(), VmPhase::Paused(_));
    if ready_info(shared).is_none() {
        return Err(SupervisorError::NotReady("the VM is not running".into()));
    }
    let ch = if was_paused {
        None
    } else {
        let ch = shared.channel(RECONNECT_WAIT).await?;
        freeze(shared, &ch).await?;
        Some(ch)
    };
    let mut q = match qmp(&shared.control).await {
        Ok(q) => q,
        Err(e) => {
            // The jobs were frozen for this: they run again, the VM continues.
            if let Some(ch) = &ch {
                let _ = thaw(ch).await;
            }
            return Err(e);
        }
    };
    let state = shared.dir.checkpoint_state();
    let saved: Result<u64, String> = async {
        if !was_paused {
            q.pause().await.map_err(|e| error_chain(&e))?;
        }
        let _ = std::fs::remove_file(&state);
        save_to_file(&mut q, &state, standby).await?;
        if standby {
            freeze_vmm(shared, true);
        }
        if injected("hibernate:fail-save") {
            return Err("injected save failure".to_string());
        }
        // Written by the VMM in its own directory: opened without following links or
        // blocking on FIFOs, and only as a regular file.
        let size = sync_regular(&state).map_err(|e| format!("fsync {}: {e}", state.display()))?;
        if let Some(ram) = &shared.ram_file {
            // Standby releases memory only once the RAM file is on disk.
            sync_regular(ram).map_err(|e| format!("fsync {}: {e}", ram.display()))?;
        }
        Ok(size)
    }
    .await;
    let size = match saved {
        Ok(size) => size,
        Err(e) => {
            // Nothing is lost: the VM continues where it was.
            freeze_vmm(shared, false);
            let _ = q.execute("migrate_cancel", None).await;
            let _ = std::fs::remove_file(&state);
            if let Some(ch) = &ch {
                let _ = q.resume().await;
                let _ = thaw(ch).await;
            }
            return Err(refused("hibernate failed; the VM continues", e));
        }
    };
    crash_point("hibernate:after-save");
    let (qemu_sha256, firmware_sha256) = vmm_digests();
    let info = CheckpointInfo {
        size,
        save_ms: t.elapsed().as_millis() as u64,
        qemu_sha256,
        firmware_sha256,
        unix_time: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs(),
        standby,
    };
    // The record is the completion marker: written, fsynced and renamed into place only now.
    let rec = shared.dir.checkpoint_record();
    let tmp = rec.with_extension("json.tmp");
    let body = serde_json::to_vec_pretty(&info).expect("invariant: record serialises");
    let written = warren_vmm::sys::private_file::create(&tmp, false)
        .and_then(|mut f| {
            use std::io::Write;
            f.write_all(&body)?;
            f.sync_all()
        })
        .and_then(|()| std::fs::rename(&tmp, &rec))
        .and_then(|()| std::fs::File::open(shared.dir.path())?.sync_all());
    if let Err(e) = written {
        freeze_vmm(shared, false);
        if let Some(ch) = &ch {
            let _ = q.resume().await;
            let _ = thaw(ch).await;
        }
        return Err(refused(
            "recording the checkpoint failed; the VM continues",
            e,
        ));
    }
    crash_point("hibernate:after-record");
    *shared.stop_reason.lock().unwrap_or_else(|p| p.into_inner()) = Some("hibernated".into());
    shared.phase.send_replace(VmPhase::Stopping);
    shared.stop.notify_one();
    Ok(SupervisorResponse::Hibernated(info))
}

/// Whether the VMM was frozen after a standby save ([`freeze_vmm`]).
pub(super) fn frozen(shared: &Shared) -> bool {
    shared.vmm_frozen.load(std::sync::atomic::Ordering::SeqCst)
}

/// Stops (`freeze`) or continues the VMM process with `SIGSTOP` / `SIGCONT`.
///
/// A fast standby's guest RAM is the file the VMM maps shared, and its device state was
/// just saved: whatever the VMM does from then on must not reach that RAM. But a VMM left
/// to quit still handles events, and a channel or console socket closing makes the
/// virtio-serial device write a control message into the guest's rings, behind the saved
/// device state; the restored guest (a standby resume, every clone of a template) then
/// loses the host's port-open messages and its writes block until the next reconnect. So
/// the VMM is stopped the moment the save completes and killed when the VM stops; it runs
/// again only when the save fails after all and the VM continues.
pub(super) fn freeze_vmm(shared: &Shared, freeze: bool) {
    use nix::sys::signal::{kill, Signal};
    let Some(pid) = shared.vmm_pid.and_then(|p| i32::try_from(p).ok()) else {
        return;
    };
    if !freeze && !frozen(shared) {
        return;
    }
    let signal = if freeze {
        Signal::SIGSTOP
    } else {
        Signal::SIGCONT
    };
    // The VMM is this process's child and is reaped only by the main loop, after the stop:
    // the pid cannot have been reused.
    if let Err(e) = kill(nix::unistd::Pid::from_raw(pid), signal) {
        tracing::warn!(error = %e, ?signal, "signalling the VMM failed");
        return;
    }
    shared
        .vmm_frozen
        .store(freeze, std::sync::atomic::Ordering::SeqCst);
}
