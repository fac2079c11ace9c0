//! Child reaping. As PID 1 the agent inherits every orphan in the guest, so a SIGCHLD-driven
//! task calls `waitpid(-1, WNOHANG)` until nothing is left and hands the statuses of children
//! the agent spawned itself (jobs, bench runs) to their waiters; orphans' statuses are dropped.
//!
//! Invariant that closes the spawn/exit race: [`Reaper::spawn`] holds the `waiters` lock from
//! before `fork` until the new pid is registered, and the reaper holds the same lock while it
//! collects and dispatches statuses. A child that exits before registration is therefore
//! collected only after it was registered.
//!
//! On a host (unit tests) the process is not PID 1 and other code may own children, so the
//! reaper runs in [`ReapMode::RegisteredOnly`] and waits only for pids it registered.

use std::collections::HashMap;
use std::io;
use std::process::{Child, Command};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use nix::errno::Errno;
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::oneshot;

/// How a child ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExitStatus {
    Code(i32),
    Signal(i32),
}

/// Which children the reaper waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReapMode {
    /// PID 1: every child, including adopted orphans.
    AllChildren,
    /// A normal process (tests): only children spawned through [`Reaper::spawn`].
    #[cfg_attr(not(test), allow(dead_code))]
    RegisteredOnly,
}

/// Safety net for a lost wake-up (the signal stream coalesces; this only bounds latency).
const REAP_FALLBACK_PERIOD: Duration = Duration::from_secs(1);

pub struct Reaper {
    mode: ReapMode,
    /// pid -> the waiter of a child spawned through `spawn`. Guards the spawn/exit race
    /// described in the module docs.
    waiters: Mutex<HashMap<i32, oneshot::Sender<ExitStatus>>>,
}

impl Reaper {
    /// Creates the reaper and starts its task on the current tokio runtime.
    pub fn start(mode: ReapMode) -> io::Result<Arc<Self>> {
        let reaper = Arc::new(Self {
            mode,
            waiters: Mutex::new(HashMap::new()),
        });
        let mut sigchld = signal(SignalKind::child())?;
        let task = Arc::downgrade(&reaper);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(REAP_FALLBACK_PERIOD);
            loop {
                tokio::select! {
                    _ = sigchld.recv() => {}
                    _ = tick.tick() => {}
                }
                match task.upgrade() {
                    Some(reaper) => reaper.reap(),
                    None => return,
                }
            }
        });
        Ok(reaper)
    }

    fn waiters(&self) -> MutexGuard<'_, HashMap<i32, oneshot::Sender<ExitStatus>>> {
        // The map stays consistent even if a holder panicked: recover it.
        self.waiters.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Spawns `cmd` and returns the child (never `wait` on it) and a receiver of its status.
    pub fn spawn(&self, cmd: &mut Command) -> io::Result<(Child, oneshot::Receiver<ExitStatus>)> {
        let mut waiters = self.waiters();
        let child = cmd.spawn()?;
        let (tx, rx) = oneshot::channel();
        // A pid always fits in i32 on Linux.
        waiters.insert(child.id() as i32, tx);
        Ok((child, rx))
    }

    /// Runs `spawn` (which starts a child and returns its pid) with reaping held off, and
    /// registers the pid before any status can be collected.
    pub fn spawn_with(
        &self,
        spawn: impl FnOnce() -> io::Result<i32>,
    ) -> io::Result<(i32, oneshot::Receiver<ExitStatus>)> {
        let mut waiters = self.waiters();
        let pid = spawn()?;
        let (tx, rx) = oneshot::channel();
        waiters.insert(pid, tx);
        Ok((pid, rx))
    }

    /// Collects every exited child that is ours to collect and dispatches the statuses.
    pub fn reap(&self) {
        match self.mode {
            ReapMode::AllChildren => {
                // Held across `waitpid(-1)`: `Command::spawn` itself waits for a child whose
                // exec failed (and panics if that child was already reaped), so the reaper
                // must never run while a spawn is in progress.
                let mut waiters = self.waiters();
                loop {
                    match waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG)) {
                        Ok(WaitStatus::StillAlive) | Err(Errno::ECHILD) => return,
                        Ok(status) => dispatch(&mut waiters, status),
                        Err(Errno::EINTR) => continue,
                        Err(_) => return,
                    }
                }
            }
            ReapMode::RegisteredOnly => {
                let mut waiters = self.waiters();
                let pids: Vec<i32> = waiters.keys().copied().collect();
                for pid in pids {
                    if let Ok(status) = waitpid(Pid::from_raw(pid), Some(WaitPidFlag::WNOHANG)) {
                        dispatch(&mut waiters, status);
                    }
                }
            }
        }
    }
}

fn dispatch(waiters: &mut HashMap<i32, oneshot::Sender<ExitStatus>>, status: WaitStatus) {
    let (pid, exit) = match status {
        WaitStatus::Exited(pid, code) => (pid, ExitStatus::Code(code)),
        WaitStatus::Signaled(pid, sig, _) => (pid, ExitStatus::Signal(sig as i32)),
        _ => return,
    };
    if let Some(tx) = waiters.remove(&pid.as_raw()) {
        // The waiter may have gone away (its job record was dropped): nothing to do.
        let _ = tx.send(exit);
    }
}
