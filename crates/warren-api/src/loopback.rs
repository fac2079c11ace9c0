//! TCP listeners holding both loopback addresses `localhost` names: the service's HTTP
//! API, and `warren port-forward` (a browser told `localhost:PORT` may bring a forwarded
//! web application's cookies to whoever holds ::1 there).
//!
//! A client told `http://localhost:8090` may connect to 127.0.0.1 or to ::1 (resolvers
//! commonly try ::1 first), and any local user may bind a port above 1023. A service that
//! listens on one of the two and leaves the other free hands the other to whoever binds it
//! first, and a client saying `localhost` sends its bearer token there. So when `listen`
//! covers one loopback address, the service binds the other on the same port too, and does
//! not start (`conflict`) when another process already holds it. Where ::1 is not
//! configured (IPv6 disabled on `lo`, as in many containers) the service holds it all the
//! same (`IPV6_FREEBIND`, which any user may set): once ::1 is brought up, connections to it
//! reach the service, not a user who bound it first. Only a host without IPv6 at all leaves
//! it out; IPv6 refused to this process alone (a seccomp filter) is not taken for that: the
//! service does not start.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use tokio::net::TcpListener;

use crate::serve::ServeError;

/// Ephemeral ports tried (`listen` with port 0) before giving up on finding one free on both
/// loopback addresses.
const EPHEMERAL_ATTEMPTS: usize = 16;

/// Binds `listen` and the loopback address it leaves free (see the module docs); the first
/// listener is `listen`'s. The service's HTTP listeners, and `warren port-forward`'s.
pub async fn bind(listen: SocketAddr) -> Result<Vec<TcpListener>, ServeError> {
    let io = |addr: SocketAddr| {
        move |source| ServeError::Io {
            op: "listen on",
            path: addr.to_string(),
            source,
        }
    };
    let mut attempts = 0;
    loop {
        attempts += 1;
        let primary = match TcpListener::bind(listen).await.and_then(deepen) {
            Ok(l) => l,
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => {
                return Err(ServeError::AddrTaken(listen));
            }
            Err(e) => return Err(io(listen)(e)),
        };
        let port = primary.local_addr().map_err(io(listen))?.port();
        // A `listen` of `::` takes IPv4 too unless the socket is IPv6-only (the host's
        // `net.ipv6.bindv6only`): asked of the socket itself.
        let dual_stack = socket2::SockRef::from(&primary)
            .only_v6()
            .map(|only| !only)
            .unwrap_or(true);
        let mut listeners = vec![primary];
        let mut taken = None;
        for addr in siblings(listen, port, dual_stack) {
            let bound = match TcpListener::bind(addr).await.and_then(deepen) {
                // Not configured now (IPv6 disabled on `lo`): held anyway, so that nobody
                // else holds it once it is.
                Err(e) if e.raw_os_error() == Some(nix::libc::EADDRNOTAVAIL) => {
                    bind_unconfigured(addr)
                }
                r => r,
            };
            match bound {
                Ok(l) => listeners.push(l),
                Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => {
                    taken = Some(addr);
                    break;
                }
                Err(e) if absent(&e) => {
                    tracing::debug!(%addr, error = %e, "no such loopback address here");
                }
                Err(e) => return Err(io(addr)(e)),
            }
        }
        match taken {
            None => return Ok(listeners),
            // An ephemeral port another process happens to hold on the other address.
            Some(_) if listen.port() == 0 && attempts < EPHEMERAL_ATTEMPTS => continue,
            Some(addr) => return Err(ServeError::LoopbackTaken(addr)),
        }
    }
}

/// The loopback addresses on `port` that `listen` leaves free: ::1 for 127.0.0.1 or
/// 0.0.0.0, 127.0.0.1 for ::1 (and for `::` when it is IPv6 only); none for an address
/// `localhost` does not name.
pub(crate) fn siblings(listen: SocketAddr, port: u16, dual_stack: bool) -> Vec<SocketAddr> {
    let v4 = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), port);
    let v6 = SocketAddr::new(IpAddr::V6(Ipv6Addr::LOCALHOST), port);
    // `::ffff:127.0.0.1` is 127.0.0.1.
    let ip = match listen.ip() {
        IpAddr::V6(ip) => ip.to_ipv4_mapped().map_or(IpAddr::V6(ip), IpAddr::V4),
        ip => ip,
    };
    match ip {
        IpAddr::V4(ip) if ip == Ipv4Addr::LOCALHOST || ip.is_unspecified() => vec![v6],
        IpAddr::V6(ip) if ip == Ipv6Addr::LOCALHOST => vec![v4],
        IpAddr::V6(ip) if ip.is_unspecified() && !dual_stack => vec![v4],
        _ => vec![],
    }
}

/// Connections the kernel completes for a listener before it accepts them. tokio binds with
/// 128 (the standard library's value): a burst of connections past it (a local user's
/// flood, while the accept loop also looks up each peer's uid) has further clients' SYNs
/// dropped and retried a second later.
const BACKLOG: i32 = 1024;

/// `l` with its backlog raised to [`BACKLOG`] (Linux takes a second `listen` on a listening
/// socket as a new backlog).
fn deepen(l: TcpListener) -> std::io::Result<TcpListener> {
    socket2::SockRef::from(&l).listen(BACKLOG)?;
    Ok(l)
}

/// Listens on `addr`, which this host does not have now, with `IP(V6)_FREEBIND` (as any
/// user may): a socket that holds the address for the day it is configured.
fn bind_unconfigured(addr: SocketAddr) -> std::io::Result<TcpListener> {
    use socket2::{Domain, Socket, Type};
    let s = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
    if addr.is_ipv6() {
        s.set_only_v6(true)?;
        s.set_freebind_v6(true)?;
    } else {
        s.set_freebind_v4(true)?;
    }
    // As the other listeners (tokio's bind sets it).
    s.set_reuse_address(true)?;
    s.set_nonblocking(true)?;
    s.bind(&addr.into())?;
    s.listen(BACKLOG)?;
    TcpListener::from_std(s.into())
}

/// No IPv6 at all: `EAFNOSUPPORT` with no `/proc/net/if_inet6` (the same error with IPv6
/// present is a filter refusing it to this process alone, not its absence).
fn absent(e: &std::io::Error) -> bool {
    e.raw_os_error() == Some(nix::libc::EAFNOSUPPORT) && no_ipv6()
}

/// The host has no IPv6 at all (no `/proc/net/if_inet6`: `ipv6.disable=1`).
pub(crate) fn no_ipv6() -> bool {
    !std::path::Path::new("/proc/net/if_inet6").exists()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a(s: &str) -> SocketAddr {
        s.parse().expect("address")
    }

    #[test]
    fn test_siblings_are_the_loopback_address_listen_leaves_free() {
        assert_eq!(siblings(a("127.0.0.1:8090"), 8090, true), [a("[::1]:8090")]);
        assert_eq!(siblings(a("0.0.0.0:8090"), 8090, true), [a("[::1]:8090")]);
        assert_eq!(siblings(a("[::1]:8090"), 8090, true), [a("127.0.0.1:8090")]);
        assert_eq!(siblings(a("[::]:8090"), 8090, false), [a("127.0.0.1:8090")]);
        assert!(siblings(a("[::]:8090"), 8090, true).is_empty());
        assert!(siblings(a("10.1.2.3:8090"), 8090, true).is_empty());
        assert!(siblings(a("127.0.0.2:8090"), 8090, true).is_empty());
        assert_eq!(
            siblings(a("[::ffff:127.0.0.1]:8090"), 8090, true),
            [a("[::1]:8090")]
        );
        // Port 0 takes the port actually bound.
        assert_eq!(siblings(a("127.0.0.1:0"), 41000, true), [a("[::1]:41000")]);
    }

    /// Another process on [::1] at the service's port: the service does not start. Positive
    /// control: with the squatter gone it binds both.
    #[tokio::test]
    async fn test_a_squatted_loopback_sibling_stops_the_service_from_starting() {
        // The test hosts have an IPv6 loopback (without one there is nothing to squat).
        let probe = std::net::TcpListener::bind("[::1]:0").expect("bind [::1]");
        let port = probe.local_addr().expect("addr").port();
        let listen = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), port);
        match bind(listen).await {
            Err(ServeError::LoopbackTaken(addr)) => {
                assert_eq!(addr, a(&format!("[::1]:{port}")));
            }
            Err(e) => panic!("wrong error: {e}"),
            Ok(_) => panic!("served beside a squatter on [::1]:{port}"),
        }
        // The address itself taken: `conflict` too.
        match bind(SocketAddr::new(IpAddr::V6(Ipv6Addr::LOCALHOST), port)).await {
            Err(ServeError::AddrTaken(addr)) => assert_eq!(addr, a(&format!("[::1]:{port}"))),
            Err(e) => panic!("wrong error: {e}"),
            Ok(_) => panic!("bound [::1]:{port} twice"),
        }
        drop(probe);
        let held = bind(listen).await.expect("bind both");
        let addrs: Vec<SocketAddr> = held.iter().map(|l| l.local_addr().expect("addr")).collect();
        assert_eq!(addrs, [listen, a(&format!("[::1]:{port}"))]);
        // While the service holds both, no other socket gets [::1] at that port.
        assert!(std::net::TcpListener::bind(format!("[::1]:{port}")).is_err());
    }

    #[tokio::test]
    async fn test_an_ephemeral_port_is_one_free_on_both_loopback_addresses() {
        let held = bind(a("127.0.0.1:0")).await.expect("bind");
        let port = held[0].local_addr().expect("addr").port();
        assert_ne!(port, 0);
        assert_eq!(held.len(), 2, "both loopback addresses held");
        assert_eq!(
            held[1].local_addr().expect("addr"),
            a(&format!("[::1]:{port}"))
        );
    }
}
