//! Running the service: one instance per state directory, preflight before listening, then
//! the TCP and UNIX-socket listeners until SIGINT or SIGTERM, each under the connection
//! limits of `crate::conn`.

use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use nix::fcntl::{Flock, FlockArg};
use tokio::net::UnixListener;

use crate::config::ServiceConfig;
use crate::conn::{self, ConnLimits};
use crate::http;
use crate::service::Service;

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("another warrend serves {0}")]
    AlreadyRunning(PathBuf),
    #[error(
        "another process listens on {0}, where clients saying `localhost` may connect and \
         send it what they send (tokens, cookies); stop it, or listen on an address \
         `localhost` does not name"
    )]
    LoopbackTaken(SocketAddr),
    #[error("another process listens on {0}")]
    AddrTaken(SocketAddr),
    #[error("socket activation: {0}")]
    Activation(String),
    #[error("preflight failed: {0}")]
    Preflight(String),
    #[error("{0}")]
    Service(#[from] crate::ApiError),
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: String,
        source: std::io::Error,
    },
}

fn io(op: &'static str, path: impl std::fmt::Display) -> impl FnOnce(std::io::Error) -> ServeError {
    let path = path.to_string();
    move |source| ServeError::Io { op, path, source }
}

impl ServeError {
    /// The stable code the CLI prints.
    pub fn code(&self) -> &'static str {
        match self {
            ServeError::AlreadyRunning(_)
            | ServeError::LoopbackTaken(_)
            | ServeError::AddrTaken(_) => "conflict",
            ServeError::Activation(_) => "invalid_argument",
            ServeError::Preflight(_) => "unavailable",
            ServeError::Service(e) => e.code,
            ServeError::Io { .. } => "internal",
        }
    }
}

/// How often the warm pools are topped up.
const POOL_CHECK: std::time::Duration = std::time::Duration::from_secs(2);
/// How long a stop waits for calls running to their end (`Service::call_to_end`); within
/// systemd's default stop timeout (90 s).
const DETACHED_WAIT: std::time::Duration = std::time::Duration::from_secs(60);
/// How often `vms/` is swept for what crashed creates and destroys left.
const LEFTOVER_SWEEP: std::time::Duration = std::time::Duration::from_secs(300);
/// How often idle VMs are looked for.
const IDLE_CHECK: std::time::Duration = std::time::Duration::from_secs(2);

/// Where the service listens, once it does.
#[derive(Debug, Clone)]
pub struct Bound {
    pub http: SocketAddr,
    pub socket: PathBuf,
}

/// Holds the state directory's service lock for the life of the process.
fn lock_state_dir(dir: &Path) -> Result<Flock<std::fs::File>, ServeError> {
    std::fs::create_dir_all(dir).map_err(io("create", dir.display()))?;
    let path = dir.join("warrend.lock");
    let f = warren_supervisor::layout::open_lock_file(&path).map_err(io("open", path.display()))?;
    Flock::lock(f, FlockArg::LockExclusiveNonblock)
        .map_err(|_| ServeError::AlreadyRunning(dir.to_path_buf()))
}

fn bind_socket(path: &Path, mode: u32) -> Result<UnixListener, ServeError> {
    // The directory is checked as the state directory is (`socket =` may name another),
    // before anything is made or removed in it: one another user could write would let them
    // redirect the removal below, and swap what is chmod'ed and moved.
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let trusted = |d: &Path| warren_core::trusted_dir::check(d).map_err(crate::ApiError::from);
    let mut existing = parent;
    while !existing.exists() {
        existing = match existing.parent() {
            Some(p) if p.as_os_str().is_empty() => Path::new("."),
            Some(p) => p,
            None => Path::new("/"),
        };
    }
    trusted(existing)?;
    std::fs::create_dir_all(parent).map_err(io("create", parent.display()))?;
    trusted(parent)?;
    // We hold the state lock, so a socket left at the path is a dead instance's.
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io("remove", path.display())(e)),
    }
    // Bound in a directory of its own (0700) and moved into place once it has its mode: a
    // socket listens from its bind, with the mode the process's umask gives it (a service
    // started by hand under umask 000 would take any user's connection until the chmod).
    // The staged path (`.wXXXXXX/s`) is no longer than the default `warrend.sock`'s.
    let private = tempfile::Builder::new()
        .prefix(".w")
        .rand_bytes(6)
        .tempdir_in(parent)
        .map_err(io("create a directory in", parent.display()))?;
    let staged = private.path().join("s");
    let l = UnixListener::bind(&staged).map_err(io("bind", staged.display()))?;
    std::fs::set_permissions(&staged, std::fs::Permissions::from_mode(mode))
        .map_err(io("chmod", staged.display()))?;
    std::fs::rename(&staged, path).map_err(io("move into place", path.display()))?;
    Ok(l)
}

/// Runs the service until a termination signal. `on_ready` runs once both listeners are up.
/// `inherited`: the sockets systemd passed (`crate::activation`), served instead of binding.
pub async fn serve(
    cfg: ServiceConfig,
    supervisor_exe: PathBuf,
    inherited: Option<crate::activation::Inherited>,
    on_ready: impl FnOnce(&Bound),
) -> Result<(), ServeError> {
    let _lock = lock_state_dir(&cfg.state_dir)?;
    // The connection caps, not the descriptor limit, must be what refuses a flood.
    match conn::raise_nofile_limit() {
        Ok(n) => tracing::debug!(open_files = n, "open-file limit raised to the hard limit"),
        Err(e) => tracing::warn!(error = %e, "cannot raise the open-file limit"),
    }
    // Bound before the slow preflight: the ports are ours from the start (`loopback.rs`),
    // or systemd's all along (`activation.rs`).
    let mut tcp = match inherited {
        Some(passed) => {
            let addrs = passed.addrs();
            let tcp = passed.serve_for(cfg.http.listen)?;
            tracing::info!(sockets = ?addrs, "serving the sockets systemd passed");
            tcp
        }
        None => crate::loopback::bind(cfg.http.listen).await?,
    };
    let siblings = tcp.split_off(1);
    let tcp = tcp
        .pop()
        .expect("invariant: loopback::bind returns listen's listener first");
    // Each local TCP client's uid is asked of the kernel's socket diagnostics (`conn`):
    // without them every such connection would be closed, so the service does not start.
    crate::loopback_peer::self_check().map_err(|e| {
        ServeError::Preflight(format!(
            "the kernel's socket diagnostics (NETLINK_SOCK_DIAG), which name each local TCP \
             client's uid: {e}"
        ))
    })?;
    let service = Arc::new(Service::open(cfg.clone(), supervisor_exe)?);
    for w in service.preflight().await.map_err(ServeError::Preflight)? {
        tracing::warn!("{w}");
    }
    let addr = tcp
        .local_addr()
        .map_err(io("address of", cfg.http.listen))?;
    let mut hosts = cfg.allowed_hosts();
    if cfg.http.allowed_hosts.is_empty() && cfg.http.listen.port() == 0 {
        // An ephemeral port: allow the loopback names with the port actually bound.
        let port = addr.port();
        hosts = vec![
            format!("127.0.0.1:{port}"),
            format!("localhost:{port}"),
            format!("[::1]:{port}"),
        ];
    }
    let socket_path = cfg.socket_path();
    let unix = bind_socket(&socket_path, cfg.socket_mode)?;
    let bound = Bound {
        http: addr,
        socket: socket_path.clone(),
    };
    tracing::info!(http = %addr, socket = %socket_path.display(), "serving");
    on_ready(&bound);

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let idle = {
        let service = service.clone();
        tokio::spawn(async move { service.idle_loop(IDLE_CHECK).await })
    };
    let pools = {
        let service = service.clone();
        tokio::spawn(async move { service.pool_loop(POOL_CHECK).await })
    };
    {
        let service = service.clone();
        tokio::spawn(async move { service.sweep_leftovers(LEFTOVER_SWEEP).await });
    }
    let tcp_app = http::tcp_router(service.clone(), hosts);
    let unix_app = http::unix_router(service.clone());
    let limits = ConnLimits::from_config(&cfg.http);
    let siblings: Vec<_> = siblings
        .into_iter()
        .map(|l| {
            tokio::spawn(conn::serve(
                l,
                tcp_app.clone(),
                limits,
                conn::tcp_peer,
                stop_rx.clone(),
                "tcp",
            ))
        })
        .collect();
    let t = tokio::spawn(conn::serve(
        tcp,
        tcp_app,
        limits,
        conn::tcp_peer,
        stop_rx.clone(),
        "tcp",
    ));
    let u = tokio::spawn(conn::serve(
        unix,
        unix_app,
        limits,
        |io: &tokio::net::UnixStream| Some(conn::Peer::Local(io.peer_cred().ok().map(|c| c.uid()))),
        stop_rx,
        "local socket",
    ));
    wait_for_signal().await;
    tracing::info!("stopping; VMs keep running under their supervisors");
    let _ = stop_tx.send(true);
    // Open MCP streams would hold a graceful shutdown forever: give them a moment only.
    let _ = tokio::time::timeout(std::time::Duration::from_secs(5), async {
        let _ = t.await;
        let _ = u.await;
        for s in siblings {
            let _ = s.await;
        }
    })
    .await;
    idle.abort();
    pools.abort();
    // Calls that change state run to their end whoever waits for them (a create, a fork):
    // given a bounded time to end, as a process that exits cuts them.
    let left = service.wait_for_detached(DETACHED_WAIT).await;
    if left > 0 {
        tracing::warn!(
            calls = left,
            "stopping with calls still running: they are cut"
        );
    }
    let _ = std::fs::remove_file(&socket_path);
    Ok(())
}

async fn wait_for_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = match signal(SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "cannot watch SIGTERM");
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    /// The socket is in place with its mode, over a stale one, and nothing else is left in
    /// the directory (the private directory it was bound in is gone).
    #[tokio::test]
    async fn test_the_local_socket_is_moved_into_place_with_its_mode() {
        let d = tempfile::tempdir().expect("tempdir");
        let path = d.path().join("warrend.sock");
        std::fs::write(&path, b"stale").expect("stale");
        let l = bind_socket(&path, 0o600).expect("bind");
        let meta = std::fs::symlink_metadata(&path).expect("stat");
        assert!(std::os::unix::fs::FileTypeExt::is_socket(&meta.file_type()));
        assert_eq!(meta.mode() & 0o7777, 0o600);
        let names: Vec<_> = std::fs::read_dir(d.path())
            .expect("list")
            .map(|e| e.expect("entry").file_name())
            .collect();
        assert_eq!(names, ["warrend.sock"]);
        // It is the listener's: a connection to the path is accepted there.
        let _c = tokio::net::UnixStream::connect(&path)
            .await
            .expect("connect");
        l.accept().await.expect("accept");
    }
}
