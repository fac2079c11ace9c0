//! Listening sockets systemd passes the service (socket activation: `warren.socket`).
//!
//! A port above 1023 that no process holds is any local user's to bind, and clients that
//! connect there send that user their bearer tokens (`loopback.rs`). A service that binds
//! its own ports leaves them free before its first start at boot and between an old
//! process's exit and a new one's bind (restarts, upgrades). Under systemd the packaged
//! `warren.socket` binds them instead, from early boot (before any user's session or
//! service can run) until the socket unit is stopped, across every restart of the service:
//! connections made while no service runs wait in the backlog.
//!
//! The service serves the sockets it is passed only when they are exactly the ones it would
//! bind itself (`listen`, and the loopback address `listen` leaves free): a socket unit and
//! a configuration that disagree keep it from starting, both lists in the message, rather
//! than serving one address and leaving another to whoever binds it first. Reading
//! `LISTEN_PID`/`LISTEN_FDS` is sd-notify's (which checks the PID, marks the descriptors
//! close-on-exec and unsets the variables); checking what each descriptor is, is ours.
//!
//! `warren.service` is `Type=notify`: the service says `READY=1` once it serves, so a start
//! that fails (passed sockets refused, preflight) fails `systemctl start`/`restart` (and the
//! package upgrade says so) instead of counting as started. The datagram is sent by hand
//! ([`Notify`]): sd-notify reads `NOTIFY_SOCKET` from the environment at the time of the
//! call, and the environment must not change once threads run, so the address is taken
//! (and the variable unset) before they start, with the sockets.

use std::net::SocketAddr;
use std::os::fd::OwnedFd;

use tokio::net::TcpListener;

use crate::serve::ServeError;

/// Sockets passed in a larger number than this are refused (the unit names two).
const MAX_PASSED: usize = 16;

/// TCP listening sockets systemd passed this process.
#[derive(Debug)]
pub struct Inherited {
    listeners: Vec<std::net::TcpListener>,
}

/// The environment variable `warren.service` sets to `required`: without passed sockets
/// the service does not start, rather than bind the port itself (a socket unit whose
/// addresses were edited while it ran holds none of them until it is restarted, and a
/// service that quietly bound them would leave the port free at every later restart).
pub const REQUIRED_VAR: &str = "WARREN_SOCKET_ACTIVATION";

/// Takes the sockets systemd passed this process, if it passed any. Call it before any
/// thread starts: it unsets `LISTEN_PID`, `LISTEN_FDS` and `LISTEN_FDNAMES`, so that
/// nothing the service starts takes them for its own.
pub fn take() -> Result<Option<Inherited>, ServeError> {
    let owned = warren_vmm::sys::process::take_listen_fds()
        .map_err(|e| ServeError::Activation(format!("LISTEN_FDS: {e}")))?;
    if owned.is_empty() {
        return match std::env::var(REQUIRED_VAR).as_deref() {
            Ok("required") => Err(ServeError::Activation(format!(
                "{REQUIRED_VAR}=required and systemd passed no socket: start the service \
                 through warren.socket (`systemctl restart warren.socket warren.service` \
                 after editing the socket unit)"
            ))),
            Ok("") | Err(_) => Ok(None),
            Ok(other) => Err(ServeError::Activation(format!(
                "{REQUIRED_VAR}={other:?}: only `required` is understood"
            ))),
        };
    }
    if owned.len() > MAX_PASSED {
        return Err(ServeError::Activation(format!(
            "systemd passed {} descriptors; the service takes at most {MAX_PASSED}",
            owned.len()
        )));
    }
    let listeners = owned
        .into_iter()
        .enumerate()
        .map(|(i, fd)| {
            tcp_listener(fd)
                .map_err(|why| ServeError::Activation(format!("socket {}: {why}", i + 1)))
        })
        .collect::<Result<_, _>>()?;
    Ok(Some(Inherited { listeners }))
}

/// Where systemd waits for the service's readiness (`NOTIFY_SOCKET`).
#[derive(Debug, Clone)]
pub struct Notify(std::ffi::OsString);

/// Takes `NOTIFY_SOCKET` out of the environment (nothing the service starts sees it). Call it
/// before any thread starts.
pub fn take_notify() -> Option<Notify> {
    let addr = std::env::var_os("NOTIFY_SOCKET")?;
    std::env::remove_var("NOTIFY_SOCKET");
    Some(Notify(addr))
}

impl Notify {
    /// Tells systemd the service is ready (`READY=1`).
    pub fn ready(&self) -> std::io::Result<()> {
        use std::os::linux::net::SocketAddrExt;
        use std::os::unix::ffi::OsStrExt;
        use std::os::unix::net::{SocketAddr, UnixDatagram};
        let bytes = self.0.as_bytes();
        let addr = match bytes.first() {
            Some(b'@') => SocketAddr::from_abstract_name(&bytes[1..])?,
            Some(b'/') => SocketAddr::from_pathname(std::path::Path::new(&self.0))?,
            _ => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    "NOTIFY_SOCKET is neither a path nor an abstract name",
                ))
            }
        };
        UnixDatagram::unbound()?.send_to_addr(b"READY=1", &addr)?;
        Ok(())
    }
}

/// The descriptor as a TCP listener, if it is one (a stream socket of an IP family, listening).
fn tcp_listener(fd: OwnedFd) -> Result<std::net::TcpListener, String> {
    let s = socket2::Socket::from(fd);
    let addr = s
        .local_addr()
        .map_err(|e| format!("not a socket ({e})"))?
        .as_socket()
        .ok_or("not an IPv4 or IPv6 socket (ListenStream= takes an address and a port here)")?;
    if s.r#type().map_err(|e| e.to_string())? != socket2::Type::STREAM {
        return Err(format!("{addr} is not a stream socket"));
    }
    if !s.is_listener().map_err(|e| e.to_string())? {
        return Err(format!(
            "{addr} is not listening (Accept=no is the only mode served)"
        ));
    }
    // ReusePort= would let any other socket of root's join the port and take connections;
    // BindToDevice= lets another user bind the same address on another device.
    if s.reuse_port().map_err(|e| e.to_string())? {
        return Err(format!("{addr} has SO_REUSEPORT set"));
    }
    if s.device().map_err(|e| e.to_string())?.is_some() {
        return Err(format!("{addr} is bound to a device"));
    }
    s.set_nonblocking(true).map_err(|e| e.to_string())?;
    Ok(s.into())
}

impl Inherited {
    /// The addresses passed, in the order passed.
    pub fn addrs(&self) -> Vec<SocketAddr> {
        self.listeners
            .iter()
            .filter_map(|l| l.local_addr().ok())
            .collect()
    }

    /// The passed sockets when they are exactly what `listen` asks for (see the module
    /// docs), `listen`'s first.
    pub fn serve_for(self, listen: SocketAddr) -> Result<Vec<TcpListener>, ServeError> {
        let passed = self.addrs();
        if passed.len() != self.listeners.len() {
            return Err(ServeError::Activation(
                "a passed socket has no local address".into(),
            ));
        }
        if listen.port() == 0 {
            return Err(ServeError::Activation(format!(
                "systemd passed sockets on {} but `listen` names port 0: name the port \
                 warren.socket listens on",
                list(&passed)
            )));
        }
        // A `::` listener takes IPv4 too unless it is IPv6-only: asked of the socket.
        let first = unmapped(listen);
        let dual_stack = self
            .listeners
            .iter()
            .find(|l| l.local_addr().ok() == Some(first))
            .and_then(|l| socket2::SockRef::from(l).only_v6().ok())
            .map(|only| !only)
            .unwrap_or(true);
        let expected = expected(listen, dual_stack);
        let mut sorted_passed = passed.clone();
        sorted_passed.sort();
        let mut sorted_expected = expected.clone();
        sorted_expected.sort();
        if sorted_passed != sorted_expected {
            return Err(ServeError::Activation(format!(
                "systemd passed sockets on {} but `listen = \"{listen}\"` asks for {}: the \
                 socket unit (ListenStream= in warren.socket, `systemctl edit warren.socket`) \
                 and the configuration must name the same addresses",
                list(&passed),
                list(&expected)
            )));
        }
        let mut listeners = self.listeners;
        // `listen`'s first, then the others.
        listeners.sort_by_key(|l| l.local_addr().ok() != Some(first));
        listeners
            .into_iter()
            .map(|l| {
                TcpListener::from_std(l)
                    .map_err(|e| ServeError::Activation(format!("a passed socket: {e}")))
            })
            .collect()
    }
}

/// What the service serves for `listen`: `listen` and the loopback address it leaves free
/// (`loopback.rs`; ::1 only where this host has IPv6). `dual_stack`: a `::` listener also
/// takes IPv4.
fn expected(listen: SocketAddr, dual_stack: bool) -> Vec<SocketAddr> {
    let listen = unmapped(listen);
    let mut expected = vec![listen];
    expected.extend(
        crate::loopback::siblings(listen, listen.port(), dual_stack)
            .into_iter()
            .filter(|a| !(a.is_ipv6() && crate::loopback::no_ipv6())),
    );
    expected
}

/// `::ffff:a.b.c.d` as the IPv4 address it is (an IPv6-only socket cannot bind it; the unit's
/// are IPv6-only).
fn unmapped(addr: SocketAddr) -> SocketAddr {
    match addr {
        SocketAddr::V6(a) => a
            .ip()
            .to_ipv4_mapped()
            .map_or(addr, |v4| SocketAddr::new(v4.into(), a.port())),
        SocketAddr::V4(_) => addr,
    }
}

/// The addresses `warren.socket` must listen on for a service whose `listen` is this (the
/// unit's sockets are IPv6-only, `BindIPv6Only=ipv6-only`): what the systemd generator writes
/// into the unit, so that the socket follows the configuration.
pub fn unit_addresses(listen: SocketAddr) -> Result<Vec<SocketAddr>, ServeError> {
    if listen.port() == 0 {
        return Err(ServeError::Activation(
            "`listen` names port 0: warren.socket needs a fixed port".into(),
        ));
    }
    Ok(expected(listen, false))
}

fn list(addrs: &[SocketAddr]) -> String {
    addrs
        .iter()
        .map(|a| a.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a(s: &str) -> SocketAddr {
        s.parse().expect("address")
    }

    fn passed(addrs: &[&str]) -> Inherited {
        Inherited {
            listeners: addrs
                .iter()
                .map(|s| {
                    let l = std::net::TcpListener::bind(a(s)).expect("bind");
                    l.set_nonblocking(true).expect("nonblocking");
                    l
                })
                .collect(),
        }
    }

    /// Both loopback addresses at `listen`'s port, in either order: served, `listen`'s
    /// first. One of them missing, one too many, or another port: refused.
    #[tokio::test]
    async fn test_passed_sockets_are_served_only_when_they_are_what_listen_asks_for() {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = probe.local_addr().expect("addr").port();
        drop(probe);
        let v4 = format!("127.0.0.1:{port}");
        let v6 = format!("[::1]:{port}");
        let served = passed(&[&v6, &v4]).serve_for(a(&v4)).expect("served");
        let addrs: Vec<_> = served
            .iter()
            .map(|l| l.local_addr().expect("addr"))
            .collect();
        assert_eq!(addrs, [a(&v4), a(&v6)]);
        drop(served);

        for (given, listen) in [
            (vec![v4.as_str()], v4.as_str()),
            (vec![v6.as_str()], v4.as_str()),
            (vec![v4.as_str(), v6.as_str()], "127.0.0.1:1"),
            (vec![v4.as_str(), v6.as_str()], "127.0.0.1:0"),
        ] {
            match passed(&given).serve_for(a(listen)) {
                Err(e @ ServeError::Activation(_)) => {
                    assert_eq!(e.code(), "invalid_argument");
                    let msg = e.to_string();
                    assert!(msg.contains(&v4) || msg.contains(&v6), "{msg}");
                }
                Err(e) => panic!("wrong error for {given:?} / {listen}: {e}"),
                Ok(_) => panic!("served {given:?} for listen = {listen}"),
            }
        }
    }

    /// `READY=1` reaches the socket `NOTIFY_SOCKET` names, a path or an abstract name.
    #[test]
    fn test_ready_is_sent_where_notify_socket_says() {
        use std::os::linux::net::SocketAddrExt;
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("notify");
        let sink = std::os::unix::net::UnixDatagram::bind(&path).expect("bind");
        Notify(path.clone().into()).ready().expect("ready");
        let mut buf = [0u8; 64];
        let n = sink.recv(&mut buf).expect("recv");
        assert_eq!(&buf[..n], b"READY=1");
        let name = format!("warren-notify-test-{}", std::process::id());
        let abs =
            std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).expect("abstract");
        let sink = std::os::unix::net::UnixDatagram::bind_addr(&abs).expect("bind abstract");
        Notify(format!("@{name}").into()).ready().expect("ready");
        let n = sink.recv(&mut buf).expect("recv");
        assert_eq!(&buf[..n], b"READY=1");
        assert!(Notify("relative".into()).ready().is_err());
    }

    /// What the generator writes into warren.socket for a `listen` is what the service then
    /// serves: sockets bound there as the unit binds them (IPv6-only) pass `serve_for`.
    #[tokio::test]
    async fn test_the_socket_units_addresses_for_listen_are_served_for_it() {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = probe.local_addr().expect("addr").port();
        drop(probe);
        for ip in [
            "127.0.0.1",
            "[::1]",
            "0.0.0.0",
            "[::]",
            "[::ffff:127.0.0.1]",
        ] {
            let listen = a(&format!("{ip}:{port}"));
            let addrs = unit_addresses(listen).expect("addresses");
            assert_eq!(addrs[0], unmapped(listen));
            let listeners = addrs
                .iter()
                .map(|addr| {
                    let s = socket2::Socket::new(
                        socket2::Domain::for_address(*addr),
                        socket2::Type::STREAM,
                        None,
                    )
                    .expect("socket");
                    if addr.is_ipv6() {
                        s.set_only_v6(true).expect("IPV6_V6ONLY");
                    }
                    s.bind(&(*addr).into()).expect("bind");
                    s.listen(8).expect("listen");
                    s.set_nonblocking(true).expect("nonblocking");
                    std::net::TcpListener::from(s)
                })
                .collect();
            let served = Inherited { listeners }.serve_for(listen).expect("served");
            assert_eq!(served.len(), addrs.len(), "{listen}");
        }
        assert!(unit_addresses(a("127.0.0.1:0")).is_err());
    }

    /// What is not a TCP listener is refused with what it is.
    #[test]
    fn test_a_descriptor_that_is_no_tcp_listener_is_refused() {
        let file = std::fs::File::open("/dev/null").expect("open");
        let err = tcp_listener(OwnedFd::from(file)).expect_err("a file");
        assert!(err.contains("not a socket"), "{err}");
        let udp = std::net::UdpSocket::bind("127.0.0.1:0").expect("udp");
        let err = tcp_listener(OwnedFd::from(udp)).expect_err("udp");
        assert!(err.contains("not a stream socket"), "{err}");
        let sock = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)
            .expect("socket");
        sock.bind(&a("127.0.0.1:0").into()).expect("bind");
        let err = tcp_listener(OwnedFd::from(sock)).expect_err("not listening");
        assert!(err.contains("not listening"), "{err}");
        let shared = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)
            .expect("socket");
        shared.set_reuse_port(true).expect("SO_REUSEPORT");
        shared.bind(&a("127.0.0.1:0").into()).expect("bind");
        shared.listen(8).expect("listen");
        let err = tcp_listener(OwnedFd::from(shared)).expect_err("reuseport");
        assert!(err.contains("SO_REUSEPORT"), "{err}");
        let dir = tempfile::tempdir().expect("tempdir");
        let unix =
            std::os::unix::net::UnixListener::bind(dir.path().join("s")).expect("unix socket");
        let err = tcp_listener(OwnedFd::from(unix)).expect_err("unix");
        assert!(err.contains("not an IPv4 or IPv6 socket"), "{err}");
    }
}
