//! Who is on the other end of a TCP connection: the uid owning the peer's socket, when it is
//! on this host. A TCP socket has no `SO_PEERCRED`; the kernel's socket diagnostics
//! (`NETLINK_SOCK_DIAG`, sock_diag(7)) find one socket by its addresses and ports in its hash
//! table and name its owner, so a lookup costs the same on a host with a million sockets as
//! on an idle one (reading `/proc/net/tcp` instead walked every socket per lookup: under a
//! flood of connections the service accepted one per ~10 ms). `port-forward` uses it so
//! another local user cannot reach the forwarder's workspace through its listener, and the
//! service's TCP listeners so that one local user cannot hold all their connections
//! (`crate::conn`). The messages are built and read by the `netlink-packet-sock-diag` crate.

use std::net::{IpAddr, SocketAddr};

use netlink_packet_core::{NetlinkHeader, NetlinkMessage, NetlinkPayload, NLM_F_REQUEST};
use netlink_packet_sock_diag::constants::{AF_INET, AF_INET6, IPPROTO_TCP};
use netlink_packet_sock_diag::inet::{ExtensionFlags, InetRequest, SocketId, StateFlags};
use netlink_packet_sock_diag::SockDiagMessage;
use netlink_sys::protocols::NETLINK_SOCK_DIAG;

/// The largest answer read: one socket's record (no attributes asked for) or an error.
const ANSWER_MAX: usize = 8192;
/// Answers read past stale ones (of an earlier request that gave up) before giving up.
const STALE_MAX: usize = 16;

/// The uid owning the socket at `peer` that is connected to `ours` (both on this host), or
/// `None` when no process holds such a socket (it closed meanwhile, or is not local).
pub fn peer_uid(ours: SocketAddr, peer: SocketAddr) -> std::io::Result<Option<u32>> {
    Ok(match SockDiag::new()?.owner(ours, peer)? {
        Owner::Uid(uid) => Some(uid),
        Owner::Closed | Owner::Absent => None,
    })
}

/// What the kernel says of the socket at a connection's other end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Owner {
    /// A process of this uid holds it.
    Uid(u32),
    /// It is on this host but no process holds it any more (closed: `FIN_WAIT`,
    /// `TIME_WAIT`, an orphan).
    Closed,
    /// This host's network stack has no such socket: the peer is on another host (or in
    /// another network namespace).
    Absent,
}

/// TCP states a connection's peer socket is never in: a listener (the kernel's exact lookup
/// falls back to one at the peer's address and port when no connected socket matches) and
/// a request socket of a half-open connection.
const TCP_LISTEN: u8 = 10;
const TCP_NEW_SYN_RECV: u8 = 12;

/// Whether `ip` is a loopback address, an IPv4 one mapped into IPv6 included.
pub fn is_loopback(ip: IpAddr) -> bool {
    ip.to_canonical().is_loopback()
}

/// Whether `ip` is one of this host's own addresses (any interface's, in this network
/// namespace). A peer at one is on this host: the kernel drops packets from elsewhere that
/// claim a local source address.
pub fn is_own_address(ip: IpAddr) -> std::io::Result<bool> {
    let ip = ip.to_canonical();
    let addrs = nix::ifaddrs::getifaddrs().map_err(std::io::Error::from)?;
    Ok(addrs.into_iter().any(|a| {
        let Some(addr) = a.address else { return false };
        if let Some(v4) = addr.as_sockaddr_in() {
            IpAddr::V4(v4.ip()) == ip
        } else if let Some(v6) = addr.as_sockaddr_in6() {
            IpAddr::V6(v6.ip()).to_canonical() == ip
        } else {
            false
        }
    }))
}

/// `addr` with an IPv4-mapped address as the IPv4 address it maps.
fn canonical(addr: SocketAddr) -> SocketAddr {
    SocketAddr::new(addr.ip().to_canonical(), addr.port())
}

/// Checks at start that lookups work here (the kernel's diagnostics present, allowed and in
/// this network namespace): a connection of this process's own to itself, over 127.0.0.1
/// and over ::1 where this host has it, must be found as this process's uid. Without it
/// the service would close every TCP connection of this host's users.
pub fn self_check() -> std::io::Result<()> {
    let me = nix::unistd::geteuid().as_raw();
    let mut diag = SockDiag::new()?;
    for addr in ["127.0.0.1:0", "[::1]:0"] {
        let c = match SelfConnection::new(addr) {
            Ok(c) => c,
            // No ::1 here: nothing to check over it.
            Err(_) if addr.starts_with('[') => continue,
            Err(e) => return Err(e),
        };
        let ours = c.ours;
        let found = diag.owner(ours, c.peer)?;
        if found != Owner::Uid(me) {
            return Err(std::io::Error::other(format!(
                "a connection of this process over {} was found as {found:?}, not as uid {me}",
                ours.ip()
            )));
        }
    }
    Ok(())
}

/// A TCP connection of this process to itself, on a listener of its own.
struct SelfConnection {
    /// The listener's end.
    ours: SocketAddr,
    /// The client's end, as the listener's accept names it.
    peer: SocketAddr,
    /// Held open for the connection's life (the tests close it).
    #[cfg_attr(not(test), allow(dead_code))]
    client: std::net::TcpStream,
    _server: std::net::TcpStream,
}

impl SelfConnection {
    /// A connection to a listener bound at `addr` (port 0: any).
    fn new(addr: &str) -> std::io::Result<SelfConnection> {
        let l = std::net::TcpListener::bind(addr)?;
        let ours = l.local_addr()?;
        let client = std::net::TcpStream::connect(ours)?;
        let (server, peer) = l.accept()?;
        Ok(SelfConnection {
            ours,
            peer,
            client,
            _server: server,
        })
    }
}

/// A socket diagnostics socket, kept for many lookups (an accept loop's). Non-blocking: the
/// kernel answers a lookup within the request's `send`, so the answer is there to read at
/// once, and a lookup never blocks its caller's thread.
pub struct SockDiag {
    socket: netlink_sys::Socket,
    sequence: u32,
}

impl SockDiag {
    pub fn new() -> std::io::Result<SockDiag> {
        let mut socket = netlink_sys::Socket::new(NETLINK_SOCK_DIAG)?;
        socket.bind_auto()?;
        socket.connect(&netlink_sys::SocketAddr::new(0, 0))?;
        socket.set_non_blocking(true)?;
        Ok(SockDiag {
            socket,
            sequence: 0,
        })
    }

    /// Who holds the socket at `peer` that is connected to `ours`.
    pub fn owner(&mut self, ours: SocketAddr, peer: SocketAddr) -> std::io::Result<Owner> {
        // A socket tied to an interface is found only when the lookup names it: a
        // link-local peer's scope is that interface.
        let ifindex = match peer {
            SocketAddr::V6(a) => a.scope_id(),
            SocketAddr::V4(_) => 0,
        };
        // A dual-stack listener names IPv4 peers by their mapped addresses.
        let (ours, peer) = (canonical(ours), canonical(peer));
        match (peer.ip(), ours.ip()) {
            (IpAddr::V4(p), IpAddr::V4(o)) => {
                let found = self.lookup(AF_INET, peer, ours, 0)?;
                if found != Owner::Absent {
                    return Ok(found);
                }
                // An IPv6 socket connected to an IPv4 listener: the mapped addresses.
                self.lookup(
                    AF_INET6,
                    SocketAddr::new(IpAddr::V6(p.to_ipv6_mapped()), peer.port()),
                    SocketAddr::new(IpAddr::V6(o.to_ipv6_mapped()), ours.port()),
                    0,
                )
            }
            (IpAddr::V6(_), IpAddr::V6(_)) => self.lookup(AF_INET6, peer, ours, ifindex),
            _ => Ok(Owner::Absent),
        }
    }

    /// The owner of the TCP socket of `family` whose local end is `local` and remote end
    /// `remote`. Only a connected socket with exactly these ends counts (the kernel may
    /// answer with a listener at `local` instead: a listener a user opened on a port a
    /// closed client freed is not that client), and only one still held by a process: one
    /// with inode 0 (closed by its owner: in `TIME_WAIT` the kernel names it uid 0, and an
    /// orphan keeps its old uid) is no one's, so a client that sends and closes at once is
    /// not taken for root.
    fn lookup(
        &mut self,
        family: u8,
        local: SocketAddr,
        remote: SocketAddr,
        ifindex: u32,
    ) -> std::io::Result<Owner> {
        self.sequence = self.sequence.wrapping_add(1);
        let mut header = NetlinkHeader::default();
        // No NLM_F_DUMP: the one socket these addresses name, found by the kernel's hash
        // lookup.
        header.flags = NLM_F_REQUEST;
        header.sequence_number = self.sequence;
        let mut request = NetlinkMessage::new(
            header,
            SockDiagMessage::InetRequest(InetRequest {
                family,
                protocol: IPPROTO_TCP,
                extensions: ExtensionFlags::empty(),
                states: StateFlags::all(),
                socket_id: SocketId {
                    source_port: local.port(),
                    destination_port: remote.port(),
                    source_address: local.ip(),
                    destination_address: remote.ip(),
                    interface_id: ifindex,
                    // No cookie: the socket is named by its addresses alone.
                    cookie: [0xff; 8],
                },
            })
            .into(),
        );
        request.finalize();
        let mut buf = vec![0u8; request.buffer_len()];
        request.serialize(&mut buf);
        self.socket.send(&buf, 0)?;
        // This request's answer: one an earlier lookup left unread (it failed before reading
        // it) carries another sequence number and is skipped.
        for _ in 0..STALE_MAX {
            let mut answer = Vec::with_capacity(ANSWER_MAX);
            let n = self.socket.recv(&mut answer, 0)?;
            let answer = answer.get(..n).unwrap_or_default();
            let message = NetlinkMessage::<SockDiagMessage>::deserialize(answer)
                .map_err(|e| std::io::Error::other(format!("a socket diagnostics answer: {e}")))?;
            if message.header.sequence_number != self.sequence {
                continue;
            }
            return match message.payload {
                NetlinkPayload::InnerMessage(SockDiagMessage::InetResponse(r)) => {
                    let h = &r.header;
                    let id = &h.socket_id;
                    let exact = id.source_port == local.port()
                        && id.destination_port == remote.port()
                        && id.source_address.to_canonical() == local.ip().to_canonical()
                        && id.destination_address.to_canonical() == remote.ip().to_canonical();
                    Ok(
                        if !exact || h.state == TCP_LISTEN || h.state == TCP_NEW_SYN_RECV {
                            Owner::Absent
                        } else if h.inode == 0 {
                            Owner::Closed
                        } else {
                            Owner::Uid(h.uid)
                        },
                    )
                }
                NetlinkPayload::Error(e) => match e.code.map(|c| -c.get()) {
                    Some(code) if code == nix::libc::ENOENT => Ok(Owner::Absent),
                    Some(code) => Err(std::io::Error::from_raw_os_error(code)),
                    None => Err(std::io::Error::other(
                        "an acknowledgement instead of a socket diagnostics answer",
                    )),
                },
                _ => Err(std::io::Error::other(
                    "an unexpected socket diagnostics answer",
                )),
            };
        }
        Err(std::io::Error::other(
            "no socket diagnostics answer to this lookup",
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_a_loopback_peer_is_this_process_uid() {
        let c = SelfConnection::new("127.0.0.1:0").expect("connection");
        let (ours, peer) = (c.ours, c.peer);
        assert_eq!(c.client.local_addr().expect("local"), peer);
        let uid = rustix::process::geteuid().as_raw();
        assert_eq!(peer_uid(ours, peer).expect("table"), Some(uid));
        // Another port at the same address is nobody's.
        let other = SocketAddr::new(peer.ip(), peer.port().wrapping_add(1));
        assert_eq!(peer_uid(ours, other).expect("table"), None);
    }

    /// A client that sent and closed at once lingers in `FIN_WAIT`/`TIME_WAIT` as no
    /// process's socket (inode 0; `TIME_WAIT` is listed as uid 0): it was taken for root and
    /// forwarded. Control: while it is open it gives its uid.
    #[test]
    fn test_a_closed_socket_is_no_ones() {
        let c = SelfConnection::new("127.0.0.1:0").expect("connection");
        let (ours, peer) = (c.ours, c.peer);
        let uid = rustix::process::geteuid().as_raw();
        assert_eq!(peer_uid(ours, peer).expect("lookup"), Some(uid));
        drop(c.client);
        assert_eq!(peer_uid(ours, peer).expect("lookup"), None);
    }

    /// Lookups stay cheap with many sockets open (the socket table was read whole per
    /// lookup before): 400 connections (800 descriptors, under the usual soft limit of
    /// 1,024), then 400 lookups well under a second.
    #[test]
    fn test_lookups_do_not_walk_the_socket_table() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let ours = l.local_addr().expect("addr");
        let mut held = Vec::new();
        for _ in 0..400 {
            let c = std::net::TcpStream::connect(ours).expect("connect");
            let (s, peer) = l.accept().expect("accept");
            held.push((c, s, peer));
        }
        let uid = rustix::process::geteuid().as_raw();
        let t = std::time::Instant::now();
        for (_, _, peer) in &held {
            assert_eq!(peer_uid(ours, *peer).expect("lookup"), Some(uid));
        }
        let took = t.elapsed();
        assert!(
            took < std::time::Duration::from_secs(2),
            "400 lookups took {took:?}"
        );
    }

    #[test]
    fn test_an_ipv6_loopback_peer_is_this_process_uid() {
        let c = SelfConnection::new("[::1]:0").expect("connection over [::1]");
        let (ours, peer) = (c.ours, c.peer);
        let uid = rustix::process::geteuid().as_raw();
        assert_eq!(peer_uid(ours, peer).expect("table"), Some(uid));
        let other = SocketAddr::new(peer.ip(), peer.port().wrapping_add(1));
        assert_eq!(peer_uid(ours, other).expect("table"), None);
    }

    /// The kernel answers a lookup of a connection it does not have with a listener at the
    /// peer's address and port: that listener's owner is not the peer (a user listening on
    /// a port a closed client freed would be taken for that client). Control: the listener's
    /// own connection is found.
    #[test]
    fn test_a_listener_at_the_peers_address_is_not_the_peer() {
        let ours = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let ours = ours.local_addr().expect("addr");
        let other = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let at = other.local_addr().expect("addr");
        let mut diag = SockDiag::new().expect("diag");
        assert_eq!(diag.owner(ours, at).expect("lookup"), Owner::Absent);
        let _c = std::net::TcpStream::connect(at).expect("connect");
        let (_s, peer) = other.accept().expect("accept");
        let uid = rustix::process::geteuid().as_raw();
        assert_eq!(diag.owner(at, peer).expect("lookup"), Owner::Uid(uid));
    }

    #[test]
    fn test_the_start_check_finds_this_process() {
        self_check().expect("socket diagnostics work here");
    }

    /// A dual-stack listener names an IPv4 peer by its mapped address; the peer's own
    /// (IPv4) socket is in the IPv4 table.
    #[test]
    fn test_an_ipv4_peer_of_a_dual_stack_listener_is_found_in_the_v4_table() {
        let l = std::net::TcpListener::bind("[::]:0").expect("bind [::]");
        let port = l.local_addr().expect("addr").port();
        let _c = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
        let (s, peer) = l.accept().expect("accept");
        let ours = s.local_addr().expect("local");
        assert!(matches!(peer.ip(), IpAddr::V6(v6) if v6.to_ipv4_mapped().is_some()));
        assert!(is_loopback(peer.ip()));
        let uid = rustix::process::geteuid().as_raw();
        assert_eq!(peer_uid(ours, peer).expect("table"), Some(uid));
    }

    #[test]
    fn test_a_dual_stack_peer_is_found_in_the_v6_table() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let ours = l.local_addr().expect("addr");
        let v6: SocketAddr = format!("[::ffff:127.0.0.1]:{}", ours.port())
            .parse()
            .expect("v6");
        // A v6 socket reaching the v4 listener.
        let _c = std::net::TcpStream::connect(v6).expect("a dual-stack connect");
        let (_s, peer) = l.accept().expect("accept");
        let uid = rustix::process::geteuid().as_raw();
        assert_eq!(peer_uid(ours, peer).expect("table"), Some(uid));
    }
}
