//! Interface configuration through the classic `SIOC*` ioctls (the minimal image has no `ip`):
//! address, netmask, link up, default route.

use std::io;
use std::mem::zeroed;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

fn sockaddr_in(a: Ipv4Addr) -> libc::sockaddr {
    let sin = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: 0,
        sin_addr: libc::in_addr {
            s_addr: u32::from(a).to_be(),
        },
        sin_zero: [0; 8],
    };
    // SAFETY: `sockaddr_in` and `sockaddr` are both 16-byte plain C structs; the kernel reads
    // a `sockaddr` as a `sockaddr_in` when its family is AF_INET.
    unsafe { std::mem::transmute::<libc::sockaddr_in, libc::sockaddr>(sin) }
}

fn control_socket() -> io::Result<OwnedFd> {
    // SAFETY: plain socket(2) call; the returned descriptor is checked and owned.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn ifreq(name: &str) -> io::Result<libc::ifreq> {
    if name.is_empty() || name.len() >= libc::IFNAMSIZ {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "interface name",
        ));
    }
    // SAFETY: `ifreq` is a plain C struct (array + union of plain fields): all-zero is valid.
    let mut r: libc::ifreq = unsafe { zeroed() };
    for (d, s) in r.ifr_name.iter_mut().zip(name.bytes()) {
        *d = s as libc::c_char;
    }
    Ok(r)
}

fn ioctl<T>(fd: &OwnedFd, req: libc::c_ulong, arg: &mut T, what: &str) -> io::Result<()> {
    // SAFETY: `fd` is an open socket and `arg` a live, exclusively borrowed struct of the type
    // the request expects (`ifreq` for SIOCSIF*, `rtentry` for SIOCADDRT; callers pair them).
    let rc = unsafe { libc::ioctl(fd.as_raw_fd(), req as _, arg as *mut T) };
    if rc < 0 {
        let e = io::Error::last_os_error();
        return Err(io::Error::new(e.kind(), format!("{what}: {e}")));
    }
    Ok(())
}

/// Brings `name` up (IFF_UP | IFF_RUNNING).
pub fn link_up(name: &str) -> io::Result<()> {
    let s = control_socket()?;
    let mut r = ifreq(name)?;
    r.ifr_ifru.ifru_flags = (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short;
    ioctl(&s, libc::SIOCSIFFLAGS, &mut r, "SIOCSIFFLAGS")
}

/// Gives `name` the address `addr/prefix`, brings it up, and adds a default route via `gw`.
pub fn configure(name: &str, addr: Ipv4Addr, prefix: u8, gw: Ipv4Addr) -> io::Result<()> {
    let s = control_socket()?;
    let mut r = ifreq(name)?;
    r.ifr_ifru.ifru_addr = sockaddr_in(addr);
    ioctl(&s, libc::SIOCSIFADDR, &mut r, "SIOCSIFADDR")?;
    let mask = if prefix == 0 {
        0
    } else {
        u32::MAX << (32 - u32::from(prefix.min(32)))
    };
    let mut r = ifreq(name)?;
    r.ifr_ifru.ifru_netmask = sockaddr_in(Ipv4Addr::from(mask));
    ioctl(&s, libc::SIOCSIFNETMASK, &mut r, "SIOCSIFNETMASK")?;
    link_up(name)?;
    // SAFETY: `rtentry` is a plain C struct; all-zero (null `rt_dev`) is valid.
    let mut rt: libc::rtentry = unsafe { zeroed() };
    rt.rt_dst = sockaddr_in(Ipv4Addr::UNSPECIFIED);
    rt.rt_genmask = sockaddr_in(Ipv4Addr::UNSPECIFIED);
    rt.rt_gateway = sockaddr_in(gw);
    rt.rt_flags = libc::RTF_UP | libc::RTF_GATEWAY;
    ioctl(&s, libc::SIOCADDRT, &mut rt, "SIOCADDRT")
}
