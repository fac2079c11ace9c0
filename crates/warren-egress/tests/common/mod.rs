//! Test helpers on top of `warren_egress::standin` (the three-namespace topology and the
//! stand-in hosts, shared with `warren bench --suite network`): raw HTTP exchanges, a
//! reachability probe and a TCP echo stand-in.

#![allow(dead_code)]

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::time::Duration;

use anyhow::{bail, Result};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use warren_egress::{bind_tcp_in, Egress, EgressConfig, EgressHandle, Outbound};

pub use warren_egress::standin::*;

/// Sends a raw request and reads one response (`Content-Length` framed). `None`: the
/// connection was closed (or reset) without a response.
pub async fn exchange<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    request: &[u8],
) -> Result<Option<(u16, String)>> {
    if s.write_all(request).await.is_err() || s.flush().await.is_err() {
        return Ok(None);
    }
    let mut buf = Vec::new();
    let mut chunk = [0u8; 16384];
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    loop {
        let mut hs = [httparse::EMPTY_HEADER; 64];
        let mut resp = httparse::Response::new(&mut hs);
        if let Ok(httparse::Status::Complete(n)) = resp.parse(&buf) {
            let code = resp.code.unwrap_or(0);
            let len: usize = resp
                .headers
                .iter()
                .find(|h| h.name.eq_ignore_ascii_case("content-length"))
                .and_then(|h| std::str::from_utf8(h.value).ok()?.trim().parse().ok())
                .unwrap_or(0);
            if buf.len() >= n + len {
                return Ok(Some((
                    code,
                    String::from_utf8_lossy(&buf[n..n + len]).into_owned(),
                )));
            }
        }
        match tokio::time::timeout_at(deadline, s.read(&mut chunk)).await {
            Err(_) => bail!("response timed out"),
            Ok(Ok(0)) | Ok(Err(_)) => {
                return if buf.is_empty() {
                    Ok(None)
                } else {
                    bail!("truncated response")
                };
            }
            Ok(Ok(n)) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

pub fn get(host: &str, path: &str, extra: &str) -> Vec<u8> {
    format!("GET {path} HTTP/1.1\r\nHost: {host}\r\n{extra}\r\n").into_bytes()
}

pub fn post(host: &str, path: &str, extra: &str, body: &str) -> Vec<u8> {
    format!(
        "POST {path} HTTP/1.1\r\nHost: {host}\r\n{extra}content-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// Whether `ip:port` accepts connections from the world namespace (sanity checks that a
/// refused stand-in exists: the policy, not reachability, refuses it).
pub async fn world_reaches(out: &Outbound, ip: Ipv4Addr, port: u16) -> bool {
    out.tcp_connect(SocketAddrV4::new(ip, port)).await.is_ok()
}

/// A TCP echo server on `addr` in the namespace at `ns`.
pub fn echo_at(ns: &NetNs, addr: Ipv4Addr) -> Result<()> {
    let l = bind_tcp_in(&ns.path(), SocketAddr::V4(SocketAddrV4::new(addr, 7)))?;
    l.set_nonblocking(true)?;
    let l = tokio::net::TcpListener::from_std(l)?;
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            tokio::spawn(async move {
                let (mut r, mut w) = s.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
            });
        }
    });
    Ok(())
}

/// Whether the guest gets its bytes echoed from `addr:7` (decided by address: no name).
pub async fn guest_echo(topo: &Topology, addr: Ipv4Addr) -> Result<bool> {
    let mut s = topo.guest_tcp(addr, 7).await?;
    let _ = s.write_all(b"ping\r\n").await;
    let mut buf = [0u8; 6];
    let n = match tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut buf)).await {
        Ok(Ok(n)) => n,
        _ => 0,
    };
    Ok(n == 6 && &buf == b"ping\r\n")
}

/// Test logging (shown only for failing tests: the test writer is captured), once.
pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_test_writer()
        .with_max_level(tracing::Level::DEBUG)
        .try_init();
}

/// An egress configured by `cfg` serving a fresh topology whose stand-ins hold `secret`.
pub async fn up_with(
    secret: &str,
    cfg: impl FnOnce(&Topology) -> EgressConfig,
) -> Result<(Topology, Egress, EgressHandle)> {
    init_tracing();
    let topo = Topology::new(secret).await?;
    let egress = Egress::new(cfg(&topo), topo.world_out.clone())?;
    let handle = egress.spawn(topo.listeners()?)?;
    Ok((topo, egress, handle))
}

/// The IPv4 addresses of `m`'s A answers.
pub fn a_records(m: &hickory_proto::op::Message) -> Vec<Ipv4Addr> {
    m.answers
        .iter()
        .filter_map(|r| match &r.data {
            hickory_proto::rr::RData::A(a) => Some(a.0),
            _ => None,
        })
        .collect()
}
