//! The transparent TCP proxy of one VM.
//!
//! Per accepted connection (one task each, at most [`MAX_CONNECTIONS`] at once, each closed
//! after [`IDLE_LIMIT`] without a byte to or from the guest, both its sockets' kernel buffers
//! fixed at [`RELAY_SOCKET_BUFFER`]: `crate::conns`):
//! 1. the original destination from `SO_ORIGINAL_DST` (nftables `redirect` rewrote it);
//! 2. the first client bytes are read (up to [`FIRST_BYTES_WAIT`]) and classified: a TLS
//!    ClientHello is decided by SNI, an HTTP request by the host it names, the HTTP/2 preface
//!    is refused, anything else is decided by address;
//! 3. a client that stays silent (server-speaks-first protocols) is decided by address, the
//!    upstream connected, and if the client then speaks TLS or HTTP first, its name is checked
//!    before a single byte is forwarded;
//! 4. every decision refuses always-denied and blocked ranges and every address of the
//!    namespace the egress connects out from (checked again on the connecting socket);
//! 5. cleartext HTTP always goes through [`crate::http1`], which holds every request of the
//!    connection to the host the connection was decided for; TLS to hosts with secrets or
//!    rules (every TLS connection with `intercept_all_tls`) is terminated with the VM CA and
//!    its requests go through [`crate::http1`] too, each held to the SNI; other allowed
//!    connections are relayed untouched (the read bytes first, then a two-way copy); denied
//!    connections are closed.

use std::io;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::sync::Semaphore;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};

use crate::conns::{
    accept_within, Activity, HANDSHAKE_TIMEOUT, IDLE_LIMIT, MAX_CONNECTIONS, RELAY_SOCKET_BUFFER,
};
use crate::decision_log::Kind;
use crate::egress::Inner;
use crate::error::ConnError;
use crate::http1::{Session, Upstream};
use crate::policy::{normalize_name, DenyReason, EgressMode};
use crate::resolver::name_resolves_to;
use crate::sniff::{sniff, Sniffed, MAX_SNIFF};

/// How long a new connection may stay silent before it is treated as server-speaks-first.
pub const FIRST_BYTES_WAIT: Duration = Duration::from_secs(1);
/// How long a started ClientHello or request head may take to complete.
pub const SNIFF_TIMEOUT: Duration = Duration::from_secs(10);

/// Serves the guest's connections, each within its place (`conns::accept_within`) and
/// under the idle limit, for as long as the egress runs.
pub(crate) async fn serve(inner: Arc<Inner>, listener: TcpListener) {
    let local = listener.local_addr().ok();
    let places = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let (conn, place) =
            accept_within(&inner, &listener, &places, Kind::Tcp, RELAY_SOCKET_BUFFER).await;
        let i = inner.clone();
        inner.tasks.spawn(async move {
            let activity = Arc::new(Activity::new());
            let r = tokio::select! {
                r = handle(&i, conn, local, &activity) => r,
                () = activity.idle_for(IDLE_LIMIT) => Err(ConnError::TimedOut("guest connection (idle)")),
            };
            if let Err(e) = r {
                tracing::debug!(vm = %i.cfg.vm, error = %e, "proxied connection ended with an error");
            }
            drop(place);
        });
    }
}

/// Reads client bytes until they can be classified. `first_wait` bounds the wait for the very
/// first byte (`Ok(None)`: the client is silent).
async fn read_first(
    conn: &mut TcpStream,
    first_wait: Duration,
) -> io::Result<Option<(Sniffed, Vec<u8>)>> {
    let mut buf = Vec::with_capacity(2048);
    let mut chunk = [0u8; 4096];
    match tokio::time::timeout(first_wait, conn.read(&mut chunk)).await {
        Err(_) => return Ok(None),
        Ok(n) => {
            let n = n?;
            if n == 0 {
                return Ok(Some((Sniffed::Other, buf)));
            }
            buf.extend_from_slice(&chunk[..n]);
        }
    }
    let deadline = tokio::time::Instant::now() + SNIFF_TIMEOUT;
    loop {
        let s = sniff(&buf);
        if s != Sniffed::NeedMore {
            return Ok(Some((s, buf)));
        }
        if buf.len() >= MAX_SNIFF {
            return Ok(Some((Sniffed::Malformed, buf)));
        }
        let want = chunk.len().min(MAX_SNIFF - buf.len());
        match tokio::time::timeout_at(deadline, conn.read(&mut chunk[..want])).await {
            Err(_) => return Ok(Some((Sniffed::Malformed, buf))),
            Ok(n) => {
                let n = n?;
                if n == 0 {
                    return Ok(Some((Sniffed::Malformed, buf)));
                }
                buf.extend_from_slice(&chunk[..n]);
            }
        }
    }
}

async fn handle(
    inner: &Arc<Inner>,
    mut conn: TcpStream,
    local: Option<std::net::SocketAddr>,
    activity: &Arc<Activity>,
) -> Result<(), ConnError> {
    let _ = conn.set_nodelay(true);
    let dst = match crate::sys::sockopt::original_dst(&conn) {
        Ok(d) if Some(std::net::SocketAddr::V4(d)) != local => d,
        _ => {
            inner
                .log
                .record(Kind::Tcp, None, None, Err(DenyReason::NoDestination));
            return Ok(());
        }
    };
    match read_first(&mut conn, FIRST_BYTES_WAIT).await? {
        Some((sniffed, prefix)) => {
            activity.touch();
            let guest = Prefixed::new(prefix, conn, activity);
            dispatch(inner, guest, dst, sniffed, None).await
        }
        None => {
            // Silent client: decide by address, connect, and see who speaks first.
            if let Err(reason) = decide_addr(inner, dst).await {
                inner.log.record(Kind::Tcp, None, Some(dst), Err(reason));
                return Ok(());
            }
            let upstream = inner.connect_remote(dst).await?;
            tokio::select! {
                r = conn.readable() => {
                    r?;
                    let Some((sniffed, prefix)) = read_first(&mut conn, SNIFF_TIMEOUT).await? else {
                        return Ok(());
                    };
                    activity.touch();
                    let guest = Prefixed::new(prefix, conn, activity);
                    dispatch(inner, guest, dst, sniffed, Some(upstream)).await
                }
                r = upstream.readable() => {
                    r?;
                    inner.log.record(Kind::Tcp, None, Some(dst), Ok(()));
                    relay(Prefixed::new(Vec::new(), conn, activity), upstream).await
                }
            }
        }
    }
}

/// The refusals that apply to an address whatever the name: always-denied and blocked ranges,
/// `deny_cidrs`, and the addresses of the outbound namespace itself (an error asking the
/// kernel refuses too).
async fn address_checks(inner: &Inner, ip: Ipv4Addr) -> Result<(), DenyReason> {
    if let Some(reason) = inner.cfg.policy.address_block(ip) {
        return Err(reason);
    }
    match inner.outbound.is_own_address(ip).await {
        Ok(false) => Ok(()),
        Ok(true) | Err(_) => Err(DenyReason::HostAddress),
    }
}

/// Address-only decision: blocked ranges and host addresses, allowed CIDRs, or an address
/// Warren's resolver returned for a name that is still allowed.
async fn decide_addr(inner: &Inner, dst: SocketAddrV4) -> Result<(), DenyReason> {
    let policy = &inner.cfg.policy;
    address_checks(inner, *dst.ip()).await?;
    if policy.cidr_allows(*dst.ip()) {
        return Ok(());
    }
    let names = inner.names.names_for(*dst.ip());
    if names.iter().any(|n| policy.name_verdict(n).is_ok()) {
        Ok(())
    } else {
        Err(DenyReason::AddressNotAllowed)
    }
}

/// Name decision for SNI/Host: the name must be allowed (deny list first) and resolve, through
/// Warren, to the destination; or the destination must be in `allow_cidrs` and the name not
/// denied. In internet mode every destination that passed the address checks is granted, so
/// only the deny list is left to decide.
async fn decide_name(inner: &Inner, raw: &str, dst: SocketAddrV4) -> Result<String, DenyReason> {
    let name = normalize_name(raw).ok_or(DenyReason::InvalidName)?;
    let policy = &inner.cfg.policy;
    address_checks(inner, *dst.ip()).await?;
    match policy.name_verdict(&name) {
        Err(DenyReason::NameNotAllowed) if policy.cidr_allows(*dst.ip()) => Ok(name),
        Ok(()) if policy.mode == EgressMode::Internet && policy.cidr_allows(*dst.ip()) => Ok(name),
        Err(reason) => Err(reason),
        Ok(()) => match name_resolves_to(inner, &name, *dst.ip()).await {
            Ok(true) => Ok(name),
            Ok(false) => Err(DenyReason::NameAddressMismatch),
            Err(_) => Err(DenyReason::ResolveFailed),
        },
    }
}

async fn dispatch(
    inner: &Arc<Inner>,
    guest: Prefixed,
    dst: SocketAddrV4,
    sniffed: Sniffed,
    pre: Option<TcpStream>,
) -> Result<(), ConnError> {
    let (kind, raw_name) = match &sniffed {
        Sniffed::Tls(sni) => (Kind::Tls, sni.clone()),
        // Already normalised; an IP literal or no Host carries no name: decided by address.
        Sniffed::Http(host) => (Kind::Http, host.clone()),
        Sniffed::Other | Sniffed::NeedMore => (Kind::Tcp, None),
        Sniffed::Http2 => {
            inner.log.record(
                Kind::Http,
                None,
                Some(dst),
                Err(DenyReason::UnsupportedProtocol),
            );
            return Ok(());
        }
        Sniffed::Malformed => {
            inner
                .log
                .record(Kind::Tcp, None, Some(dst), Err(DenyReason::Malformed));
            return Ok(());
        }
    };
    let Some(raw) = raw_name else {
        let mut verdict = decide_addr(inner, dst).await;
        // Interception of every TLS connection needs a name to mint and verify for; only an
        // address the policy grants outright may be reached by TLS without SNI.
        if verdict.is_ok()
            && matches!(sniffed, Sniffed::Tls(None))
            && inner.cfg.intercept_all_tls
            && !inner.cfg.policy.cidr_allows(*dst.ip())
        {
            verdict = Err(DenyReason::MissingSni);
        }
        inner.log.record(kind, None, Some(dst), verdict);
        if verdict.is_err() {
            return Ok(());
        }
        if let Sniffed::Http(None) = sniffed {
            let upstream = Upstream::Plain(dst, pre);
            return Session::new(inner.clone(), None, false, upstream, dst)
                .run(Box::new(guest))
                .await;
        }
        let upstream = match pre {
            Some(s) => s,
            None => inner.connect_remote(dst).await?,
        };
        return relay(guest, upstream).await;
    };
    let name = match decide_name(inner, &raw, dst).await {
        Ok(n) => n,
        Err(reason) => {
            let shown = normalize_name(&raw);
            inner
                .log
                .record(kind, shown.as_deref(), Some(dst), Err(reason));
            return Ok(());
        }
    };
    inner.log.record(kind, Some(&name), Some(dst), Ok(()));
    match sniffed {
        Sniffed::Tls(_) if inner.intercepts(&name) => {
            let acceptor = tokio_rustls::TlsAcceptor::from(inner.tls.server.clone());
            let tls = tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(guest))
                .await
                .map_err(|_| ConnError::TimedOut("the guest's TLS handshake"))??;
            let upstream = Upstream::Tls(dst, pre, name.clone());
            Session::new(inner.clone(), Some(name), true, upstream, dst)
                .run(Box::new(tls))
                .await
        }
        // Cleartext HTTP is always relayed request by request, each held to this name.
        Sniffed::Http(_) => {
            let upstream = Upstream::Plain(dst, pre);
            Session::new(inner.clone(), Some(name), false, upstream, dst)
                .run(Box::new(guest))
                .await
        }
        _ => {
            let upstream = match pre {
                Some(s) => s,
                None => inner.connect_remote(dst).await?,
            };
            relay(guest, upstream).await
        }
    }
}

/// Copies both ways (the bytes already read first) until both sides are done.
async fn relay(mut guest: Prefixed, mut upstream: TcpStream) -> Result<(), ConnError> {
    tokio::io::copy_bidirectional(&mut guest, &mut upstream).await?;
    Ok(())
}

/// The guest's side of a connection: first the bytes already read from it (so rustls and the
/// relays see the ClientHello or request head), then the socket. Every byte that moves
/// either way counts as the connection's activity.
struct Prefixed {
    prefix: Vec<u8>,
    pos: usize,
    inner: TcpStream,
    activity: Arc<Activity>,
}

impl Prefixed {
    fn new(prefix: Vec<u8>, inner: TcpStream, activity: &Arc<Activity>) -> Self {
        Prefixed {
            prefix,
            pos: 0,
            inner,
            activity: activity.clone(),
        }
    }
}

impl AsyncRead for Prefixed {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.pos < self.prefix.len() {
            let n = buf.remaining().min(self.prefix.len() - self.pos);
            let start = self.pos;
            buf.put_slice(&self.prefix[start..start + n]);
            self.pos += n;
            return Poll::Ready(Ok(()));
        }
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(r, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.activity.touch();
        }
        r
    }
}

impl AsyncWrite for Prefixed {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.touch();
        }
        r
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}
