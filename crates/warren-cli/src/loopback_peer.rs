//! Who is on the other end of a TCP connection over loopback: the uid owning the peer's
//! socket, read from the kernel's socket table (`/proc/net/tcp`; `/proc/net/tcp6` for a
//! dual-stack socket and for ::1). `port-forward` uses it so another local user cannot reach the
//! forwarder's workspace through its listener. A TCP socket has no `SO_PEERCRED`, and no
//! kept crate answers this one question, so it is a bounded parse of two table files: the
//! peer's row is the one whose local address is the connection's remote address and whose
//! remote address is the listener's.

use std::io::{BufRead, BufReader};
use std::net::{IpAddr, SocketAddr};

/// Most rows read from one table (a busy host has many sockets; past this it is refused).
const MAX_ROWS: usize = 1 << 20;

/// The uid owning the socket at `peer` that is connected to `ours` (both on this host), or
/// `None` when no process holds such a socket (it closed meanwhile, or is not local).
pub fn peer_uid(ours: SocketAddr, peer: SocketAddr) -> std::io::Result<Option<u32>> {
    let v4 = |ip: std::net::Ipv4Addr, port: u16| {
        format!("{:08X}:{port:04X}", u32::from_ne_bytes(ip.octets()))
    };
    // The IPv6 table's addresses: four words, each as the host reads it.
    let v6 = |ip: std::net::Ipv6Addr, port: u16| {
        let mut s = String::with_capacity(40);
        for w in ip.octets().chunks_exact(4) {
            let word = [w[0], w[1], w[2], w[3]];
            s.push_str(&format!("{:08X}", u32::from_ne_bytes(word)));
        }
        format!("{s}:{port:04X}")
    };
    match (peer.ip(), ours.ip()) {
        (IpAddr::V4(p), IpAddr::V4(o)) => {
            if let Some(uid) = find("/proc/net/tcp", &v4(p, peer.port()), &v4(o, ours.port()))? {
                return Ok(Some(uid));
            }
            // An IPv6 socket connected to an IPv4 listener: the mapped address.
            find(
                "/proc/net/tcp6",
                &v6(p.to_ipv6_mapped(), peer.port()),
                &v6(o.to_ipv6_mapped(), ours.port()),
            )
        }
        (IpAddr::V6(p), IpAddr::V6(o)) => {
            find("/proc/net/tcp6", &v6(p, peer.port()), &v6(o, ours.port()))
        }
        _ => Ok(None),
    }
}

/// The uid of the row of `table` with local address `local` and remote address `remote`.
fn find(table: &str, local: &str, remote: &str) -> std::io::Result<Option<u32>> {
    let file = match std::fs::File::open(table) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    find_in(BufReader::new(file), table, local, remote)
}

/// [`find`] over the table's text. Only a socket still held by a process counts: a row
/// with inode 0 (a socket its owner closed: in `TIME_WAIT` the kernel lists it as uid 0)
/// is no one's, so a client that sends and closes at once is not taken for root.
fn find_in(
    table: impl BufRead,
    name: &str,
    local: &str,
    remote: &str,
) -> std::io::Result<Option<u32>> {
    for (n, line) in table.lines().enumerate() {
        if n > MAX_ROWS {
            return Err(std::io::Error::other(format!(
                "{name} has more than {MAX_ROWS} rows"
            )));
        }
        let line = line?;
        // sl local rem st queues timer retransmits uid timeout inode ...
        let cols: Vec<&str> = line.split_ascii_whitespace().take(10).collect();
        if cols.len() == 10
            && cols[1].eq_ignore_ascii_case(local)
            && cols[2].eq_ignore_ascii_case(remote)
        {
            if cols[9] == "0" {
                return Ok(None);
            }
            return Ok(cols[7].parse().ok());
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_a_loopback_peer_is_this_process_uid() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let ours = l.local_addr().expect("addr");
        let c = std::net::TcpStream::connect(ours).expect("connect");
        let (_s, peer) = l.accept().expect("accept");
        assert_eq!(c.local_addr().expect("local"), peer);
        let uid = rustix::process::geteuid().as_raw();
        assert_eq!(peer_uid(ours, peer).expect("table"), Some(uid));
        // Another port at the same address is nobody's.
        let other = SocketAddr::new(peer.ip(), peer.port().wrapping_add(1));
        assert_eq!(peer_uid(ours, other).expect("table"), None);
    }

    /// A client that sent and closed at once lingers in `TIME_WAIT`, listed as uid 0 with
    /// inode 0: it was taken for root and forwarded. Control: a live row gives its uid.
    #[test]
    fn test_a_closed_socket_is_no_ones() {
        let head = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n";
        let row = |st: &str, uid: u32, inode: u64| {
            format!("   0: 0100007F:A000 0100007F:1F90 {st} 00000000:00000000 00:00000000 00000000 {uid:>5}        0 {inode} 1 0000000000000000 20 4 0 10 -1\n")
        };
        let table = format!("{head}{}", row("06", 0, 0));
        let got = find_in(table.as_bytes(), "t", "0100007F:A000", "0100007F:1F90").expect("parse");
        assert_eq!(got, None);
        let table = format!("{head}{}", row("01", 65534, 123456));
        let got = find_in(table.as_bytes(), "t", "0100007F:A000", "0100007F:1F90").expect("parse");
        assert_eq!(got, Some(65534));
    }

    #[test]
    fn test_an_ipv6_loopback_peer_is_this_process_uid() {
        let l = std::net::TcpListener::bind("[::1]:0").expect("bind [::1]");
        let ours = l.local_addr().expect("addr");
        let _c = std::net::TcpStream::connect(ours).expect("connect");
        let (_s, peer) = l.accept().expect("accept");
        let uid = rustix::process::geteuid().as_raw();
        assert_eq!(peer_uid(ours, peer).expect("table"), Some(uid));
        let other = SocketAddr::new(peer.ip(), peer.port().wrapping_add(1));
        assert_eq!(peer_uid(ours, other).expect("table"), None);
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
