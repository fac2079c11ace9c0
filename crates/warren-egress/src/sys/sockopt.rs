//! Socket options: the original destination of a connection redirected by netfilter NAT
//! (`SO_ORIGINAL_DST`), and fixed kernel buffer sizes (`SO_SNDBUF`, `SO_RCVBUF`).

use std::io;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::os::fd::AsFd;

use nix::sys::socket::{
    getsockopt, setsockopt,
    sockopt::{OriginalDst, RcvBuf, SndBuf},
};

/// The destination the guest asked for before `redirect` rewrote it.
pub(crate) fn original_dst<F: AsFd>(sock: &F) -> io::Result<SocketAddrV4> {
    let sin = getsockopt(sock, OriginalDst).map_err(io::Error::from)?;
    let ip = Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr));
    Ok(SocketAddrV4::new(ip, u16::from_be(sin.sin_port)))
}

/// Fixes both kernel buffers of `sock` at `bytes` (the kernel caps the request at
/// `net.core.wmem_max`/`rmem_max` and doubles it for its bookkeeping). An explicit size also
/// turns the kernel's autotuning of that buffer off for the socket's lifetime.
pub(crate) fn fix_buffers<F: AsFd>(sock: &F, bytes: usize) -> io::Result<()> {
    setsockopt(sock, SndBuf, &bytes).map_err(io::Error::from)?;
    setsockopt(sock, RcvBuf, &bytes).map_err(io::Error::from)
}
