//! Job broker pipes (`ExecBroker`, since protocol 5): a UNIX socket only one job can reach,
//! whose connections the host takes one at a time with `StreamTarget::BrokerAccept`.
//!
//! Layout and who can connect:
//! - the agent (root) binds `/run/warren/broker/<job>/broker.sock` before the job starts:
//!   `/run/warren/broker` is root's alone (0700), the job's directory 0750 and the socket
//!   0660, both group 1000;
//! - the job's process, still root in the spawn, enters a mount namespace of its own
//!   (`unshare(CLONE_NEWNS)`, propagation slave) and bind-mounts its directory at
//!   `/run/warren-broker`, then drops to the guest user; its processes see the socket at
//!   `/run/warren-broker/broker.sock`, other jobs see an empty directory there and cannot
//!   traverse `/run/warren/broker`;
//! - every accepted connection's peer (SO_PEERCRED, its pid at connect time) must be in the
//!   job's cgroup or below it (`/proc/<pid>/cgroup`), which also refuses another job of the
//!   same uid reaching the socket through `/proc/<pid>/root`; others are closed at once.
//!
//! Accepted connections wait in a queue of [`MAX_WAITING`]; when it is full the agent stops
//! accepting (the kernel's backlog holds the rest). The pipe ends when the job's cgroup is
//! empty (the supervisor task drops the [`Broker`]): the accept task stops, the directory is
//! removed, and waiting host accepts end. Nothing here is secret: the channel is
//! authenticated, and only the host can take connections.

use std::fs;
use std::io;
use std::os::unix::fs::{chown, PermissionsExt};
use std::path::{Path, PathBuf};

use tokio::net::{UnixListener, UnixStream};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use warren_protocol::JobId;

/// Root-only directory holding every job's broker directory.
pub const BROKER_ROOT: &str = "/run/warren/broker";
/// Where a broker job sees its own directory.
pub const BROKER_MOUNT: &str = "/run/warren-broker";
/// The socket's name in it.
pub const BROKER_SOCKET: &str = "broker.sock";
/// Connections accepted and waiting for the host.
pub const MAX_WAITING: usize = 32;

/// One job's pipe; dropping it closes the listener and removes its directory.
pub struct Broker {
    dir: PathBuf,
    queue: tokio::sync::Mutex<mpsc::Receiver<UnixStream>>,
    accept: JoinHandle<()>,
    /// Set by [`Broker::close`]; ends waiting [`Broker::next`] calls.
    ended: tokio::sync::watch::Sender<bool>,
}

impl Drop for Broker {
    fn drop(&mut self) {
        self.close();
    }
}

impl Broker {
    /// Binds the job's socket and starts accepting for processes of `cgroup` (the job's
    /// cgroup as `/proc/<pid>/cgroup` names it, e.g. `/jobs/7`). `root` is [`BROKER_ROOT`]
    /// (another directory in unit tests).
    pub fn open(root: &Path, job: JobId, user: u32, cgroup: String) -> io::Result<Broker> {
        fs::create_dir_all(root)?;
        fs::set_permissions(root, fs::Permissions::from_mode(0o700))?;
        let dir = root.join(job.to_string());
        match fs::remove_dir_all(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        fs::create_dir(&dir)?;
        let opened = (|| {
            fs::set_permissions(&dir, fs::Permissions::from_mode(0o750))?;
            chown(&dir, Some(0), Some(user))?;
            let path = dir.join(BROKER_SOCKET);
            let listener = UnixListener::bind(&path)?;
            fs::set_permissions(&path, fs::Permissions::from_mode(0o660))?;
            chown(&path, Some(0), Some(user))?;
            Ok::<_, io::Error>(listener)
        })();
        let listener = match opened {
            Ok(l) => l,
            Err(e) => {
                let _ = fs::remove_dir_all(&dir);
                return Err(e);
            }
        };
        let (tx, rx) = mpsc::channel(MAX_WAITING);
        let accept = tokio::spawn(accept_loop(listener, cgroup, tx));
        Ok(Broker {
            dir,
            queue: tokio::sync::Mutex::new(rx),
            accept,
            ended: tokio::sync::watch::Sender::new(false),
        })
    }

    /// Ends the pipe: no more connections are accepted, the socket's directory goes, and
    /// waiting host accepts end (connections already handed over run on). Idempotent.
    pub fn close(&self) {
        if self.ended.send_replace(true) {
            return;
        }
        self.accept.abort();
        if let Err(e) = fs::remove_dir_all(&self.dir) {
            if e.kind() != io::ErrorKind::NotFound {
                crate::console::log(format_args!("broker {}: {e}", self.dir.display()));
            }
        }
    }

    /// The directory to bind-mount at [`BROKER_MOUNT`].
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The next accepted connection; `None` once the pipe ended.
    pub async fn next(&self) -> Option<UnixStream> {
        let mut ended = self.ended.subscribe();
        if *ended.borrow_and_update() {
            return None;
        }
        tokio::select! {
            c = async { self.queue.lock().await.recv().await } => c,
            _ = ended.changed() => None,
        }
    }
}

async fn accept_loop(listener: UnixListener, cgroup: String, tx: mpsc::Sender<UnixStream>) {
    loop {
        let conn = match listener.accept().await {
            Ok((conn, _)) => conn,
            Err(e) => {
                crate::console::log(format_args!("broker accept: {e}"));
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                continue;
            }
        };
        let pid = conn.peer_cred().ok().and_then(|c| c.pid());
        let member = pid.is_some_and(|pid| {
            fs::read_to_string(format!("/proc/{pid}/cgroup"))
                .is_ok_and(|text| in_cgroup(&text, &cgroup))
        });
        if !member {
            // Not one of the job's processes: closed without a word.
            continue;
        }
        if tx.send(conn).await.is_err() {
            return;
        }
    }
}

/// Whether a `/proc/<pid>/cgroup` text puts the process in `cgroup` or below it (cgroup v2's
/// `0::<path>` line).
pub fn in_cgroup(text: &str, cgroup: &str) -> bool {
    text.lines().filter_map(|l| l.strip_prefix("0::")).any(|p| {
        p == cgroup
            || p.strip_prefix(cgroup)
                .is_some_and(|rest| rest.starts_with('/'))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_in_cgroup_exact_or_below_only() {
        assert!(in_cgroup("0::/jobs/7\n", "/jobs/7"));
        assert!(in_cgroup("0::/jobs/7/sub\n", "/jobs/7"));
        assert!(!in_cgroup("0::/jobs/70\n", "/jobs/7"));
        assert!(!in_cgroup("0::/jobs/8\n", "/jobs/7"));
        assert!(!in_cgroup("1:name=x:/jobs/7\n", "/jobs/7"));
        assert!(!in_cgroup("", "/jobs/7"));
    }

    #[tokio::test]
    async fn test_broker_refuses_other_cgroups_and_removes_its_directory() {
        let root = tempfile::tempdir().expect("tmp");
        let uid = nix::unistd::getgid().as_raw();
        // The test process is not in this cgroup: its connection is closed unaccepted.
        let b = Broker::open(root.path(), JobId(4), uid, "/jobs/none".into()).expect("open");
        let dir = b.dir().to_path_buf();
        let mode = fs::metadata(&dir).expect("dir").permissions().mode() & 0o777;
        assert_eq!(mode, 0o750);
        let mut c = UnixStream::connect(dir.join(BROKER_SOCKET))
            .await
            .expect("connect");
        let mut buf = [0u8; 1];
        let n = tokio::time::timeout(
            std::time::Duration::from_secs(5),
            tokio::io::AsyncReadExt::read(&mut c, &mut buf),
        )
        .await
        .expect("closed in time")
        .unwrap_or(0);
        assert_eq!(n, 0, "an outsider's connection is closed");
        drop(b);
        assert!(!dir.exists());
    }
}
