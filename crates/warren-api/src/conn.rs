//! The listeners' accept loop and each connection's limits, for the TCP listener and the local
//! socket alike. One task accepts; each connection runs in a task of its own.
//!
//! - **Connection cap.** At most `max_connections` connections per listener. One more is
//!   accepted and closed at once (the client reads EOF), so the cap bites, never the
//!   descriptor limit: [`raise_nofile_limit`] lifts the service's soft limit to its hard one at
//!   start, and accept errors (`EMFILE` included) are retried after a pause by axum's
//!   [`Listener`]. Each connection holds a semaphore permit for its whole life.
//! - **Per local uid.** One local user may hold at most `max_connections_per_uid` of a
//!   listener's connections (more are closed at accept like the excess over the cap), and
//!   root, the operator, is never refused for the others' connections: at the cap it still
//!   gets up to that many of its own ([`PerUid`]). On the local socket the kernel names the
//!   uid (`SO_PEERCRED`). A TCP socket has none, so for every TCP connection, whatever its
//!   address (a local user may connect from any of the host's own addresses), the kernel's
//!   socket diagnostics name the uid holding the client's socket
//!   ([`crate::loopback_peer::SockDiag`]); a connection whose socket no process holds any
//!   more is closed, and so is one to a loopback listener whose socket this host does not
//!   have, and one from the host's own address that the lookup does not find (a socket tied
//!   to an interface); one from another host has no uid and no share (behind a reverse proxy every
//!   client has the proxy's address), the listener's cap alone bounds those. A subordinate
//!   uid counts as its range's owner ([`crate::subuid`]). The lookups happen before the
//!   connection counts, on a thread of the listener's own with a deadline, never on the
//!   runtime's blocking pool ([`crate::peer_owner`]). Before, one unprivileged user could hold every
//!   connection of the socket, or of a TCP listener without a token (re-opening idle ones
//!   as the timeouts closed them), and lock root and every other user out.
//! - **Header-read timeout.** hyper's `header_read_timeout` (HTTP/1): a request head not
//!   complete in time closes the connection. hyper also runs it while a kept-alive HTTP/1
//!   connection waits for its next request. Before the first request, hyper-util reads up to
//!   24 bytes to tell HTTP/1 from HTTP/2 with no deadline of its own, so this module gives a
//!   connection the same time to start its first request.
//! - **Idle timeout.** A connection with no request in flight for `idle_timeout` is closed
//!   (dropped: nothing is lost). A request is in flight from its head until its response
//!   body ends ([`Guarded`]), so a long-poll, a `vm_create` booting for minutes, or an MCP GET
//!   event stream (which rmcp keeps alive with an SSE ping every 15 s) is never cut by it.
//! - **HTTP/2** connections get keep-alive pings; an unanswered ping closes the connection.
//! - **Upgrades** (guest streams over WebSocket, `crate::ws`) are the only ones: once a
//!   connection is upgraded, hyper hands its socket over and the connection's task ends, so
//!   it no longer counts under `max_connections`. Streams have caps of their own (`[streams]`
//!   quotas, taken before the upgrade is accepted) and their own pings.
//!
//! Why by hand: `axum::serve` has none of these knobs. hyper provides the header timeout and
//! HTTP/2 pings, hyper-util the protocol choice and the tower adapter, tokio the semaphore;
//! no maintained crate caps a hyper server's connections or times its connections out by
//! requests in flight, which is the thin layer written here.
//!
//! On stop, the loop stops accepting, every connection shuts down gracefully, and the loop
//! returns when all have ended (the caller bounds the wait).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::connect_info::ConnectInfo;
use axum::serve::Listener;
use axum::Router;
use http_body::{Frame, SizeHint};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use nix::sys::resource::{getrlimit, setrlimit, Resource};
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};
use tower::ServiceExt;

use crate::config::HttpConfig;
use crate::http::PeerUid;
use crate::peer_owner::{Counted, PeerOwners};

/// Ping interval of HTTP/2 connections, and how long a ping may go unanswered.
const H2_KEEPALIVE_INTERVAL: Duration = Duration::from_secs(20);
const H2_KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(20);
/// At most one log line per this long about refused connections (a flood would otherwise
/// write a line per connection).
const REFUSAL_LOG_EVERY: Duration = Duration::from_secs(10);

/// The per-listener connection limits, from `[http]`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ConnLimits {
    pub max_connections: usize,
    /// Connections one local peer uid may hold on a listener ([`PerUid`]).
    pub max_connections_per_uid: usize,
    pub header_read_timeout: Duration,
    pub idle_timeout: Duration,
}

impl ConnLimits {
    pub(crate) fn from_config(h: &HttpConfig) -> ConnLimits {
        ConnLimits {
            max_connections: h.max_connections,
            max_connections_per_uid: h.max_connections_per_uid,
            header_read_timeout: Duration::from_secs(h.header_read_timeout_secs),
            idle_timeout: Duration::from_secs(h.idle_timeout_secs),
        }
    }
}

/// Raises the process's soft open-file limit to its hard limit; returns the new soft limit.
pub(crate) fn raise_nofile_limit() -> Result<u64, nix::Error> {
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE)?;
    if soft < hard {
        setrlimit(Resource::RLIMIT_NOFILE, hard, hard)?;
    }
    Ok(hard)
}

/// Who an accepted connection comes from, as its listener names it.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Peer {
    /// A local socket's peer: the uid its credentials name, if they name one. Its requests
    /// carry it ([`PeerUid`]).
    Local(Option<u32>),
    /// A TCP connection's two ends; over loopback its uid is looked up.
    Tcp { ours: SocketAddr, peer: SocketAddr },
}

/// The TCP listeners' [`Peer`].
pub(crate) fn tcp_peer(io: &tokio::net::TcpStream) -> Option<Peer> {
    Some(Peer::Tcp {
        ours: io.local_addr().ok()?,
        peer: io.peer_addr().ok()?,
    })
}

/// Serves `app` on `listener` under `limits` until `stop` turns true and every connection
/// has ended. `tag` names who a connection comes from ([`Peer`]); `None` (its addresses
/// unknown) closes it.
pub(crate) async fn serve<L, T>(
    mut listener: L,
    app: Router,
    limits: ConnLimits,
    tag: T,
    mut stop: watch::Receiver<bool>,
    door: &'static str,
) where
    L: Listener,
    T: Fn(&L::Io) -> Option<Peer>,
{
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    // Root's connections past the listener's cap (the local socket only).
    let reserve = Arc::new(Semaphore::new(limits.max_connections_per_uid));
    let per_uid = Arc::new(PerUid::default());
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout);
    builder
        .http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(H2_KEEPALIVE_INTERVAL)
        .keep_alive_timeout(H2_KEEPALIVE_TIMEOUT);
    let builder = Arc::new(builder);
    let mut refused = Refusals::default();
    let mut owners = PeerOwners::new(door).await;
    loop {
        let io = tokio::select! {
            (io, _addr) = listener.accept() => io,
            _ = stop.wait_for(|s| *s) => break,
        };
        let Some(peer) = tag(&io) else {
            drop(io);
            refused.unknown(door, "its addresses are unknown");
            continue;
        };
        let counted = owners.count(peer).await;
        let info = match peer {
            // Requests carry the kernel's own uid of the peer (what it may do), the share
            // counts its range's owner.
            Peer::Local(uid) => Some(ConnectInfo(PeerUid(uid))),
            Peer::Tcp { .. } => None,
        };
        let uid = match counted {
            Counted::Uid(uid) => Some(uid),
            Counted::Nobody => None,
            Counted::Refused(why) => {
                drop(io);
                refused.unknown(door, &why);
                continue;
            }
        };
        // A local uid's own share first: one user never holds the socket alone.
        let place = match uid {
            Some(u) => match per_uid.claim(u, limits.max_connections_per_uid) {
                Some(p) => Some(p),
                None => {
                    drop(io);
                    refused.note(door, limits.max_connections);
                    continue;
                }
            },
            None => None,
        };
        let permit = match slots.clone().try_acquire_owned() {
            Ok(p) => p,
            // At the cap, root (the operator) still gets in on a reserve of its own.
            Err(_) if uid == Some(0) => match reserve.clone().try_acquire_owned() {
                Ok(p) => p,
                Err(_) => {
                    drop(io);
                    refused.note(door, limits.max_connections);
                    continue;
                }
            },
            Err(_) => {
                // At the cap: closed at accept, before it costs anything but this descriptor.
                drop(io);
                refused.note(door, limits.max_connections);
                continue;
            }
        };
        tracing::trace!(door, "connection accepted");
        let conn = Connection {
            app: app.clone(),
            builder: builder.clone(),
            limits,
            stop: stop.clone(),
            _permit: permit,
            _place: place,
        };
        tokio::spawn(conn.run(io, info));
    }
    // Every permit back means every connection has ended.
    let all = u32::try_from(limits.max_connections).unwrap_or(u32::MAX);
    let _ = slots.acquire_many(all).await;
    let all = u32::try_from(limits.max_connections_per_uid).unwrap_or(u32::MAX);
    let _ = reserve.acquire_many(all).await;
}

/// Connections each local peer uid holds on a listener.
#[derive(Debug, Default)]
struct PerUid {
    /// Uid -> its open connections; entries at zero are removed.
    held: std::sync::Mutex<std::collections::HashMap<u32, usize>>,
}

impl PerUid {
    fn lock(&self) -> std::sync::MutexGuard<'_, std::collections::HashMap<u32, usize>> {
        // Every update is one statement: the map stays consistent even after a panic.
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A place for one more connection of `uid`, or `None` when it holds `max` already.
    fn claim(self: &Arc<Self>, uid: u32, max: usize) -> Option<UidPlace> {
        let mut held = self.lock();
        let n = held.entry(uid).or_insert(0);
        if *n >= max {
            return None;
        }
        *n += 1;
        Some(UidPlace {
            of: self.clone(),
            uid,
        })
    }
}

/// One local connection's place under its uid's share, released when the connection ends.
#[derive(Debug)]
struct UidPlace {
    of: Arc<PerUid>,
    uid: u32,
}

impl Drop for UidPlace {
    fn drop(&mut self) {
        let mut held = self.of.lock();
        if let Some(n) = held.get_mut(&self.uid) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                held.remove(&self.uid);
            }
        }
    }
}

/// Counts refused connections between log lines.
#[derive(Default)]
struct Refusals {
    cap: Throttled,
    unknown: Throttled,
}

/// Refusals of one kind counted between log lines, logged at most every
/// [`REFUSAL_LOG_EVERY`].
#[derive(Default)]
struct Throttled {
    count: u64,
    logged: Option<Instant>,
}

impl Throttled {
    /// Counts one; returns the count to log (and starts counting again) when one is due.
    fn due(&mut self) -> Option<u64> {
        self.count += 1;
        if self.logged.is_some_and(|t| t.elapsed() < REFUSAL_LOG_EVERY) {
            return None;
        }
        self.logged = Some(Instant::now());
        Some(std::mem::take(&mut self.count))
    }
}

impl Refusals {
    fn note(&mut self, door: &'static str, max: usize) {
        if let Some(refused) = self.cap.due() {
            tracing::warn!(
                door,
                max_connections = max,
                refused,
                "connection cap reached: connections closed at accept"
            );
        }
    }

    /// A connection whose peer's uid is not known (`why`), closed at accept.
    fn unknown(&mut self, door: &'static str, why: &str) {
        if let Some(refused) = self.unknown.due() {
            tracing::warn!(
                door,
                refused,
                reason = why,
                "connections whose peer's uid is not known closed at accept"
            );
        }
    }
}

/// One accepted connection.
struct Connection {
    app: Router,
    builder: Arc<auto::Builder<TokioExecutor>>,
    limits: ConnLimits,
    stop: watch::Receiver<bool>,
    /// This connection's place under the listener's cap.
    _permit: OwnedSemaphorePermit,
    /// A local connection's place under its uid's share.
    _place: Option<UidPlace>,
}

impl Connection {
    async fn run<I>(mut self, io: I, info: Option<ConnectInfo<PeerUid>>)
    where
        I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let (activity, mut idle) = Activity::new();
        let app = self.app.clone();
        let svc = tower::service_fn(move |mut req: http::Request<hyper::body::Incoming>| {
            let busy = activity.begin();
            if let Some(info) = info {
                req.extensions_mut().insert(info);
            }
            let app = app.clone();
            async move {
                let resp = app.oneshot(req).await?;
                Ok::<_, Infallible>(resp.map(|b| Body::new(Guarded::new(b, busy))))
            }
        });
        let conn = self
            .builder
            .serve_connection_with_upgrades(TokioIo::new(io), TowerToHyperService::new(svc));
        tokio::pin!(conn);
        tokio::select! {
            r = conn.as_mut() => {
                match r {
                    Ok(()) => tracing::trace!("connection ended"),
                    Err(e) => tracing::debug!(error = %e, "connection ended with an error"),
                }
                return;
            }
            () = idle.expired(self.limits) => {
                tracing::debug!("idle connection closed");
                return;
            }
            _ = self.stop.wait_for(|s| *s) => {}
        }
        tracing::trace!("shutting the connection down");
        conn.as_mut().graceful_shutdown();
        let _ = conn.await;
    }
}

/// What the idle timer looks at: requests in flight, and since when there were none.
#[derive(Debug, Clone, Copy)]
struct Load {
    in_flight: usize,
    since: tokio::time::Instant,
    /// Whether any request has started (until then, the header timeout applies).
    started: bool,
}

/// The sending side, shared by the connection's service and its in-flight guards.
#[derive(Clone)]
struct Activity(Arc<watch::Sender<Load>>);

/// The watching side, owned by the connection's task.
struct Idle(watch::Receiver<Load>);

impl Activity {
    fn new() -> (Activity, Idle) {
        let (tx, rx) = watch::channel(Load {
            in_flight: 0,
            since: tokio::time::Instant::now(),
            started: false,
        });
        (Activity(Arc::new(tx)), Idle(rx))
    }

    fn begin(&self) -> Busy {
        self.0.send_modify(|l| {
            l.in_flight += 1;
            l.started = true;
        });
        Busy(self.clone())
    }
}

/// One request in flight on a connection, until its response body ends.
struct Busy(Activity);

impl Drop for Busy {
    fn drop(&mut self) {
        self.0 .0.send_modify(|l| {
            l.in_flight = l.in_flight.saturating_sub(1);
            if l.in_flight == 0 {
                l.since = tokio::time::Instant::now();
            }
        });
    }
}

impl Idle {
    /// Resolves once the connection has had no request in flight for its limit: the idle
    /// timeout, or the header timeout before the first request.
    async fn expired(&mut self, limits: ConnLimits) {
        loop {
            let load = *self.0.borrow_and_update();
            if load.in_flight > 0 {
                if self.0.changed().await.is_err() {
                    return std::future::pending().await;
                }
                continue;
            }
            let limit = if load.started {
                limits.idle_timeout
            } else {
                limits.header_read_timeout
            };
            let deadline = load.since + limit;
            tokio::select! {
                () = tokio::time::sleep_until(deadline) => return,
                r = self.0.changed() => {
                    if r.is_err() {
                        return std::future::pending().await;
                    }
                }
            }
        }
    }
}

/// A response body carrying a guard that lives until the body ends or is dropped.
pub(crate) struct Guarded<G> {
    inner: Body,
    _guard: G,
}

impl<G> Guarded<G> {
    pub(crate) fn new(inner: Body, guard: G) -> Guarded<G> {
        Guarded {
            inner,
            _guard: guard,
        }
    }
}

impl<G: Send + Unpin + 'static> http_body::Body for Guarded<G> {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> ConnLimits {
        ConnLimits {
            max_connections: 4,
            max_connections_per_uid: 2,
            header_read_timeout: Duration::from_millis(200),
            idle_timeout: Duration::from_millis(2000),
        }
    }

    #[tokio::test]
    async fn test_idle_timer_waits_while_a_request_is_in_flight() {
        let (activity, mut idle) = Activity::new();
        let busy = activity.begin();
        // In flight: past both limits, still not idle.
        let r = tokio::time::timeout(Duration::from_millis(2500), idle.expired(limits())).await;
        assert!(r.is_err(), "a request in flight never counts as idle");
        let t = tokio::time::Instant::now();
        drop(busy);
        idle.expired(limits()).await;
        // Control: once it ended, the idle timeout (not the header timeout) applies.
        assert!(
            t.elapsed() >= Duration::from_millis(2000),
            "{:?}",
            t.elapsed()
        );
    }

    #[tokio::test]
    async fn test_idle_timer_before_the_first_request_is_the_header_timeout() {
        let (_activity, mut idle) = Activity::new();
        let t = tokio::time::Instant::now();
        idle.expired(limits()).await;
        let waited = t.elapsed();
        assert!(
            waited >= Duration::from_millis(200) && waited < Duration::from_millis(2000),
            "{waited:?}"
        );
    }

    /// Serves `GET /x` (answered `ok`) on `listener` under [`limits`] with 30 s timeouts,
    /// its peers named by `tag`, until the returned sender is dropped.
    fn serve_ok<L, T>(listener: L, tag: T, door: &'static str) -> watch::Sender<bool>
    where
        L: Listener,
        T: Fn(&L::Io) -> Option<Peer> + Send + 'static,
    {
        let app = Router::new().route("/x", axum::routing::get(|| async { "ok" }));
        let (stop_tx, stop) = watch::channel(false);
        let limits = ConnLimits {
            header_read_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(30),
            ..limits()
        };
        tokio::spawn(serve(listener, app, limits, tag, stop, door));
        stop_tx
    }

    /// Whether a new connection to `path` is served (an answer) or closed at accept (EOF).
    async fn served(path: &std::path::Path) -> (bool, tokio::net::UnixStream) {
        let mut c = tokio::net::UnixStream::connect(path)
            .await
            .expect("connect");
        (answered(&mut c).await, c)
    }

    /// Sends a request on `c`: whether it was answered (`200`), or closed at accept (EOF).
    async fn answered(c: &mut (impl tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin)) -> bool {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let _ = c.write_all(b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n").await;
        let mut buf = [0u8; 64];
        let n = tokio::time::timeout(Duration::from_secs(10), c.read(&mut buf))
            .await
            .expect("an answer or EOF")
            .unwrap_or(0);
        n > 0 && buf.starts_with(b"HTTP/1.1 200")
    }

    /// One local uid holds at most its share of the socket's connections, other uids still
    /// get in, and root gets in even at the listener's cap. (Before, a local user could take
    /// every connection of the socket and lock root and the other users out.)
    #[tokio::test]
    async fn test_one_local_uid_cannot_take_the_socket_from_the_others() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("s.sock");
        let listener = tokio::net::UnixListener::bind(&path).expect("bind");
        // The uid the next accepted connection is taken for (set before each connect).
        let uid = Arc::new(std::sync::Mutex::new(1000u32));
        let tag_uid = uid.clone();
        let _stop = serve_ok(
            listener,
            move |_: &tokio::net::UnixStream| {
                let u = *tag_uid.lock().expect("uid");
                Some(Peer::Local(Some(u)))
            },
            "local socket",
        );
        let mut held = Vec::new();
        let connect_as = |u: u32| {
            *uid.lock().expect("uid") = u;
            served(&path)
        };
        for _ in 0..2 {
            let (ok, c) = connect_as(1000).await;
            assert!(ok, "uid 1000's share");
            held.push(c);
        }
        let (ok, _c) = connect_as(1000).await;
        assert!(!ok, "a third connection of uid 1000 is past its share");
        // Control: another uid is served meanwhile.
        for _ in 0..2 {
            let (ok, c) = connect_as(1001).await;
            assert!(ok, "uid 1001 gets in");
            held.push(c);
        }
        // The listener's cap (4) is reached: another user waits, root does not.
        let (ok, _c) = connect_as(1002).await;
        assert!(!ok, "the listener's cap holds for other users");
        let (ok, _root) = connect_as(0).await;
        assert!(ok, "root gets in at the cap");
        // A connection that ends gives its place back.
        drop(held.remove(0));
        tokio::time::sleep(Duration::from_millis(200)).await;
        let (ok, _c) = connect_as(1000).await;
        assert!(ok, "uid 1000's place came back");
    }

    /// A connection to the TCP listener at `addr` made by a python3 child running as `uid`:
    /// whether it was served (an answer) or closed at accept (EOF), and the child, which holds
    /// the connection until it is killed.
    fn tcp_as(uid: u32, addr: SocketAddr) -> (bool, std::process::Child) {
        tcp_from(uid, None, None, addr)
    }

    /// [`tcp_as`] with the client's socket bound to `source` first.
    fn tcp_from(
        uid: u32,
        source: Option<std::net::IpAddr>,
        device: Option<&str>,
        addr: SocketAddr,
    ) -> (bool, std::process::Child) {
        use std::io::BufRead;
        use std::os::unix::process::CommandExt;
        assert!(
            rustix::process::geteuid().is_root(),
            "this test connects as other uids: run it as root"
        );
        let script = format!(
            "import socket,sys\n\
             s=socket.socket(socket.AF_INET6 if ':' in '{0}' else socket.AF_INET)\n\
             {3}\n\
             s.bind({2} or ('::' if ':' in '{0}' else '0.0.0.0',0))\n\
             s.connect(('{0}',{1}))\n\
             s.sendall(b'GET /x HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n')\n\
             s.settimeout(10)\n\
             try:\n d=s.recv(64)\n\
             except OSError:\n d=b''\n\
             print('served' if d.startswith(b'HTTP/1.1 200') else 'closed',flush=True)\n\
             sys.stdin.read()\n",
            addr.ip(),
            addr.port(),
            source.map_or("None".to_string(), |ip| format!("('{ip}',0)")),
            device.map_or("pass".to_string(), |d| format!(
                "s.setsockopt(socket.SOL_SOCKET,socket.SO_BINDTODEVICE,b'{d}')"
            )),
        );
        let mut child = std::process::Command::new("python3")
            .args(["-c", &script])
            .uid(uid)
            .gid(uid)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("python3");
        let mut line = String::new();
        let out = child.stdout.take().expect("stdout");
        std::io::BufReader::new(out)
            .read_line(&mut line)
            .expect("the child's verdict");
        (line.trim() == "served", child)
    }

    /// Over TCP too, one local uid holds at most its share of a listener's connections (its
    /// uid looked up in the kernel's socket table), other uids still get in, and root gets in
    /// at the listener's cap. (Before, any local user could hold every connection of the TCP
    /// listeners without a token, locking out every token holder.)
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn test_one_local_uid_cannot_take_a_tcp_listener_from_the_others() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let _stop = serve_ok(listener, tcp_peer, "tcp");
        let connect_as = |uid: u32| tokio::task::spawn_blocking(move || tcp_as(uid, addr));
        // One of this host's own non-loopback addresses: a local user may connect to the
        // loopback listener from it (before, such connections were counted nowhere).
        let own = own_address();
        assert!(!own.is_loopback(), "{own}");
        let mut held = Vec::new();
        let (ok, c) = connect_as(65534).await.expect("child");
        assert!(ok, "nobody's share");
        held.push(c);
        let from_own = move || tcp_from(65534, Some(own), None, addr);
        let (ok, c) = tokio::task::spawn_blocking(from_own).await.expect("child");
        assert!(ok, "nobody's share, from {own}");
        held.push(c);
        let (ok, mut third) = tokio::task::spawn_blocking(from_own).await.expect("child");
        assert!(
            !ok,
            "a third connection of nobody, from {own}, is past its share"
        );
        let _ = third.kill();
        // Control: another uid is served meanwhile, up to the listener's cap (4).
        for _ in 0..2 {
            let (ok, c) = connect_as(65533).await.expect("child");
            assert!(ok, "uid 65533 gets in");
            held.push(c);
        }
        let (ok, mut other) = connect_as(65532).await.expect("child");
        assert!(!ok, "the listener's cap holds for other users");
        let _ = other.kill();
        let (ok, _root) = served_tcp(addr).await;
        assert!(ok, "root gets in at the cap");
        // A connection that ends gives its place back.
        let mut first = held.remove(0);
        let _ = first.kill();
        let _ = first.wait();
        tokio::time::sleep(Duration::from_millis(300)).await;
        let (ok, c) = connect_as(65534).await.expect("child");
        assert!(ok, "nobody's place came back");
        held.push(c);
        for mut c in held {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// One of this host's own non-loopback addresses (the source of its route off the host).
    fn own_address() -> std::net::IpAddr {
        let u = std::net::UdpSocket::bind("0.0.0.0:0").expect("udp");
        u.connect("192.0.2.1:9")
            .expect("this test needs a route off the host, for a non-loopback address");
        u.local_addr().expect("source").ip()
    }

    /// On a listener of every address, a local client whose socket is tied to an interface
    /// (`SO_BINDTODEVICE`, which any user may set) is not found by the kernel's lookup, and
    /// was taken for a remote client: no share. Now a connection from one of the host's own
    /// addresses that the lookup does not find is closed. Control: the same user's plain
    /// connection to the same address is served.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn test_a_local_client_tied_to_an_interface_is_not_taken_for_a_remote_one() {
        let own = own_address();
        let device = nix::ifaddrs::getifaddrs()
            .expect("addresses")
            .find(|a| {
                a.address
                    .and_then(|x| x.as_sockaddr_in().map(|v4| std::net::IpAddr::V4(v4.ip())))
                    == Some(own)
            })
            .map(|a| a.interface_name)
            .expect("the interface of the host's own address");
        let listener = tokio::net::TcpListener::bind("0.0.0.0:0")
            .await
            .expect("bind");
        let addr = SocketAddr::new(own, listener.local_addr().expect("addr").port());
        let _stop = serve_ok(listener, tcp_peer, "tcp");
        let (ok, mut plain) =
            tokio::task::spawn_blocking(move || tcp_from(65534, None, None, addr))
                .await
                .expect("child");
        assert!(ok, "a plain connection to {addr}");
        let _ = plain.kill();
        let (ok, mut tied) =
            tokio::task::spawn_blocking(move || tcp_from(65534, None, Some(&device), addr))
                .await
                .expect("child");
        let _ = tied.kill();
        assert!(
            !ok,
            "a connection tied to an interface was let through uncounted"
        );
    }

    /// Whether a new TCP connection of this process to `addr` is served.
    async fn served_tcp(addr: SocketAddr) -> (bool, tokio::net::TcpStream) {
        let mut c = tokio::net::TcpStream::connect(addr).await.expect("connect");
        (answered(&mut c).await, c)
    }

    /// Accepts never wait on the runtime's blocking pool: with its one thread held by a job
    /// that does not end, TCP and local socket clients are still served. (Before, every
    /// accept's lookup ran there, so whatever filled the pool locked every client out.)
    #[test]
    fn test_accepts_never_wait_on_a_full_blocking_pool() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .max_blocking_threads(1)
            .enable_all()
            .build()
            .expect("runtime");
        let (release, held) = std::sync::mpsc::channel::<()>();
        let pool = rt.spawn_blocking(move || {
            let _ = held.recv();
        });
        rt.block_on(async {
            let tcp = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind");
            let addr = tcp.local_addr().expect("addr");
            let _tcp = serve_ok(tcp, tcp_peer, "tcp");
            let dir = tempfile::tempdir().expect("tmp");
            let path = dir.path().join("s.sock");
            let local = tokio::net::UnixListener::bind(&path).expect("bind");
            let _local = serve_ok(
                local,
                |_: &tokio::net::UnixStream| Some(Peer::Local(Some(1000))),
                "local socket",
            );
            for _ in 0..3 {
                assert!(served_tcp(addr).await.0, "a TCP client is served");
                assert!(served(&path).await.0, "a local socket client is served");
            }
            // Control: the pool is full (a second blocking job waits for the first).
            let second = tokio::task::spawn_blocking(|| ());
            let waited = tokio::time::timeout(Duration::from_millis(300), second).await;
            assert!(waited.is_err(), "the blocking pool was not full");
        });
        let _ = release.send(());
        rt.block_on(pool).expect("the pool's job");
    }

    #[test]
    fn test_nofile_soft_limit_raised_to_hard() {
        let soft = raise_nofile_limit().expect("raise");
        let (now, hard) = getrlimit(Resource::RLIMIT_NOFILE).expect("getrlimit");
        assert_eq!((soft, now), (hard, hard));
    }
}
