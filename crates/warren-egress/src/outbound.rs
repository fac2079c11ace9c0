//! How the egress reaches the outside: from the current network namespace, or from another
//! one (the host's, or a test namespace holding stand-in hosts) through a worker thread that
//! lives in it and creates sockets there.

use std::io;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpSocket, TcpStream, UdpSocket};

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

    /// Connects to `addr` over TCP, with [`CONNECT_TIMEOUT`]. Must be called inside a tokio
    /// runtime.
    pub async fn tcp_connect(&self, addr: SocketAddrV4) -> io::Result<TcpStream> {
        let socket = match self {
            Outbound::Current => TcpSocket::new_v4()?,
            Outbound::Netns(w) => {
                let fd = w.0.socket(SocketKind::Tcp).await?;
                TcpSocket::from_std_stream(std::net::TcpStream::from(fd))
            }
        };
        let stream = tokio::time::timeout(CONNECT_TIMEOUT, socket.connect(SocketAddr::V4(addr)))
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "connect timed out"))??;
        stream.set_nodelay(true)?;
        Ok(stream)
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
