//! The original destination of a connection redirected by netfilter NAT (`SO_ORIGINAL_DST`).

use std::io;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::os::fd::AsFd;

use nix::sys::socket::{getsockopt, sockopt::OriginalDst};

/// The destination the guest asked for before `redirect` rewrote it.
pub(crate) fn original_dst<F: AsFd>(sock: &F) -> io::Result<SocketAddrV4> {
    let sin = getsockopt(sock, OriginalDst).map_err(io::Error::from)?;
    let ip = Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr));
    Ok(SocketAddrV4::new(ip, u16::from_be(sin.sin_port)))
}
