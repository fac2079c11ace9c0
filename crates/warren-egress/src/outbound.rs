//! How the egress reaches the outside: from the current network namespace, or from another
//! one (the host's, or a test namespace standing in for it) through a worker thread that
//! lives in it and creates sockets there. Destinations a guest chose are never addresses of
//! that namespace itself ([`Outbound::is_own_address`], [`Outbound::tcp_connect_remote`]).

use std::io;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpSocket, TcpStream, UdpSocket};

use crate::conns::{fix_buffers, RELAY_SOCKET_BUFFER};
use crate::error::EgressError;
use crate::sys::netns::{NetnsWorker, SocketKind};

/// Connection timeout for outbound TCP.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Where outbound sockets are created. Cheap to clone.
#[derive(Debug, Clone)]
pub enum Outbound {
    /// The namespace of whichever runtime thread makes the call (normally the host's).
    Current,
    /// A given namespace, through a dedicated thread that entered it.
    Netns(Arc<NetnsWorkerHandle>),
}

/// Opaque handle on the namespace worker thread.
#[derive(Debug)]
pub struct NetnsWorkerHandle(NetnsWorker);

impl Outbound {
    /// Outbound sockets from the current namespace.
    pub fn current() -> Self {
        Outbound::Current
    }

    /// Outbound sockets from the namespace at `path` (e.g. `/run/netns/NAME`). Spawns the
    /// worker thread; it ends when the last clone is dropped.
    pub fn netns(path: &Path) -> Result<Self, EgressError> {
        Ok(Outbound::Netns(Arc::new(NetnsWorkerHandle(
            NetnsWorker::spawn(path)?,
        ))))
    }

    /// The namespace path, if any.
    pub fn netns_path(&self) -> Option<&Path> {
        match self {
            Outbound::Current => None,
            Outbound::Netns(w) => Some(w.0.path()),
        }
    }

    async fn tcp_socket(&self) -> io::Result<TcpSocket> {
        Ok(match self {
            Outbound::Current => TcpSocket::new_v4()?,
            Outbound::Netns(w) => {
                let fd = w.0.socket(SocketKind::Tcp).await?;
                TcpSocket::from_std_stream(std::net::TcpStream::from(fd))
            }
        })
    }

    /// Whether `ip` is an address of this namespace itself: on any of its interfaces, in any
    /// range, or in a `local` route. The kernel answers: a bind to it succeeds exactly then.
    /// (With `net.ipv4.ip_nonlocal_bind` set every bind succeeds, so every address counts as
    /// local and is refused: fail closed.)
    pub async fn is_own_address(&self, ip: Ipv4Addr) -> io::Result<bool> {
        own_address(&self.tcp_socket().await?, ip)
    }

    /// Connects to `addr` over TCP, with [`CONNECT_TIMEOUT`]. Must be called inside a tokio
    /// runtime.
    pub async fn tcp_connect(&self, addr: SocketAddrV4) -> io::Result<TcpStream> {
        connect(self.tcp_socket().await?, addr).await
    }

    /// [`Outbound::tcp_connect`] for a destination a guest chose: refused
    /// (`PermissionDenied`) when it is an address of this namespace
    /// ([`Outbound::is_own_address`]), checked on the connecting socket itself. The socket's
    /// kernel buffers are fixed at [`RELAY_SOCKET_BUFFER`] before it connects (so the
    /// window scale it offers fits them); if they cannot be, nothing is connected.
    pub async fn tcp_connect_remote(&self, addr: SocketAddrV4) -> io::Result<TcpStream> {
        let socket = self.tcp_socket().await?;
        if own_address(&socket, *addr.ip())? {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                "destination is an address of the outbound namespace",
            ));
        }
        if let Err(e) = fix_buffers(&socket, "upstream", RELAY_SOCKET_BUFFER) {
            tracing::warn!(destination = %addr, error = %e, source = %e.source,
                "egress refused an upstream connection");
            return Err(io::Error::other(e));
        }
        connect(socket, addr).await
    }

    /// A UDP socket bound to an ephemeral port on all addresses.
    pub async fn udp_socket(&self) -> io::Result<UdpSocket> {
        let any = SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 0));
        match self {
            Outbound::Current => UdpSocket::bind(any).await,
            Outbound::Netns(w) => {
                let fd = w.0.socket(SocketKind::Udp).await?;
                UdpSocket::from_std(std::net::UdpSocket::from(fd))
            }
        }
    }
}

/// See [`Outbound::is_own_address`]. Leaves `socket` unbound unless the address is local.
fn own_address(socket: &TcpSocket, ip: Ipv4Addr) -> io::Result<bool> {
    match socket.bind(SocketAddr::V4(SocketAddrV4::new(ip, 0))) {
        Ok(()) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::EADDRNOTAVAIL) => Ok(false),
        Err(e) => Err(e),
    }
}

async fn connect(socket: TcpSocket, addr: SocketAddrV4) -> io::Result<TcpStream> {
    let stream = tokio::time::timeout(CONNECT_TIMEOUT, socket.connect(SocketAddr::V4(addr)))
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "connect timed out"))??;
    stream.set_nodelay(true)?;
    Ok(stream)
}
