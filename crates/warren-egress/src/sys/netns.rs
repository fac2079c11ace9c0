//! Network namespace helpers. A socket belongs to the namespace of the thread that created it,
//! so creating a socket "in" a namespace means: a thread enters it (`setns`, which only affects
//! that thread), creates the socket, and hands the file descriptor back.

use std::fs::File;
use std::io;
use std::net::{SocketAddr, TcpListener, UdpSocket};
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::mpsc;

use nix::sched::{setns, CloneFlags};
use std::os::fd::AsRawFd;

use nix::sys::socket::{bind, socket, AddressFamily, SockFlag, SockType, SockaddrIn};

use crate::error::EgressError;

fn netns_err(path: &Path, source: io::Error) -> EgressError {
    EgressError::Netns {
        path: path.to_path_buf(),
        source,
    }
}

/// Runs `f` on a fresh thread that has entered the network namespace at `path` (for example
/// `/run/netns/NAME` or `/proc/PID/ns/net`) and returns its result. Use it to bind listeners
/// inside a VM's namespace: the sockets stay there after the thread ends.
pub fn run_in_netns<T, F>(path: &Path, f: F) -> Result<T, EgressError>
where
    T: Send + 'static,
    F: FnOnce() -> T + Send + 'static,
{
    let ns = File::open(path).map_err(|e| netns_err(path, e))?;
    let owned = path.to_path_buf();
    std::thread::Builder::new()
        .name("warren-netns".into())
        .spawn(move || {
            setns(&ns, CloneFlags::CLONE_NEWNET).map_err(|e| netns_err(&owned, e.into()))?;
            Ok(f())
        })
        .map_err(|e| netns_err(path, e))?
        .join()
        .map_err(|_| EgressError::NetnsWorker)?
}

/// Binds a TCP listener on `addr` inside the namespace at `path`.
pub fn bind_tcp_in(path: &Path, addr: SocketAddr) -> Result<TcpListener, EgressError> {
    run_in_netns(path, move || TcpListener::bind(addr))?.map_err(EgressError::Listener)
}

/// Binds a UDP socket on `addr` inside the namespace at `path`.
pub fn bind_udp_in(path: &Path, addr: SocketAddr) -> Result<UdpSocket, EgressError> {
    run_in_netns(path, move || UdpSocket::bind(addr))?.map_err(EgressError::Listener)
}

/// What the namespace worker creates.
#[derive(Debug, Clone, Copy)]
pub(crate) enum SocketKind {
    Tcp,
    Udp,
}

type Reply = tokio::sync::oneshot::Sender<io::Result<OwnedFd>>;

/// A long-lived thread inside a namespace that creates unconnected, non-blocking IPv4 sockets
/// on request. It exits when the last sender (held by [`crate::Outbound`] clones) is dropped.
#[derive(Debug)]
pub(crate) struct NetnsWorker {
    path: PathBuf,
    tx: std::sync::Mutex<mpsc::Sender<(SocketKind, Reply)>>,
}

impl NetnsWorker {
    pub(crate) fn spawn(path: &Path) -> Result<Self, EgressError> {
        let ns = File::open(path).map_err(|e| netns_err(path, e))?;
        let (tx, rx) = mpsc::channel::<(SocketKind, Reply)>();
        let (ready_tx, ready_rx) = mpsc::channel();
        std::thread::Builder::new()
            .name("warren-egress-ns".into())
            .spawn(move || {
                if let Err(e) = setns(&ns, CloneFlags::CLONE_NEWNET) {
                    let _ = ready_tx.send(Err(io::Error::from(e)));
                    return;
                }
                let _ = ready_tx.send(Ok(()));
                while let Ok((kind, reply)) = rx.recv() {
                    let ty = match kind {
                        SocketKind::Tcp => SockType::Stream,
                        SocketKind::Udp => SockType::Datagram,
                    };
                    let flags = SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK;
                    let fd = socket(AddressFamily::Inet, ty, flags, None)
                        .and_then(|fd| {
                            if let SocketKind::Udp = kind {
                                bind(fd.as_raw_fd(), &SockaddrIn::new(0, 0, 0, 0, 0))?;
                            }
                            Ok(fd)
                        })
                        .map_err(io::Error::from);
                    let _ = reply.send(fd);
                }
            })
            .map_err(|e| netns_err(path, e))?;
        match ready_rx.recv() {
            Ok(Ok(())) => Ok(NetnsWorker {
                path: path.to_path_buf(),
                tx: std::sync::Mutex::new(tx),
            }),
            Ok(Err(e)) => Err(netns_err(path, e)),
            Err(_) => Err(EgressError::NetnsWorker),
        }
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    pub(crate) async fn socket(&self, kind: SocketKind) -> io::Result<OwnedFd> {
        let (reply, rx) = tokio::sync::oneshot::channel();
        let gone = || io::Error::other("network namespace worker stopped");
        self.tx
            .lock()
            .map_err(|_| gone())?
            .send((kind, reply))
            .map_err(|_| gone())?;
        rx.await.map_err(|_| gone())?
    }
}
