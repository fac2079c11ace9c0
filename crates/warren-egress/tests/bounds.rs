//! What a guest can make its egress hold at once (`warren_egress::MAX_CONNECTIONS`,
//! `MAX_DNS_TCP_CONNECTIONS`), against the stand-in topology. Needs root, `ip` and `nft`.

mod common;

use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

use anyhow::Result;
use common::*;
use hickory_proto::rr::RecordType;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use warren_egress::{
    DomainPattern, EgressConfig, UpstreamRoots, MAX_CONNECTIONS, MAX_DNS_TCP_CONNECTIONS,
};

fn config(topo: &Topology) -> EgressConfig {
    let mut cfg = EgressConfig::new("vm-bounds", SocketAddr::new(DNS.into(), 53));
    cfg.policy.allow_domains = vec!["*.allowed.test".parse::<DomainPattern>().expect("pattern")];
    cfg.upstream_roots = UpstreamRoots::Pem(topo.pki.ca_pem.clone());
    cfg
}

/// Whether the egress closed `s` (end of file or reset) within `wait`.
async fn closed_within(s: &mut TcpStream, wait: Duration) -> bool {
    let mut buf = [0u8; 512];
    loop {
        match tokio::time::timeout(wait, s.read(&mut buf)).await {
            Err(_) => return false,
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            Ok(Ok(_)) => {}
        }
    }
}

/// Opens `n` connections from the guest to `ip:port`, each sending `first` (an unfinished
/// request head keeps the proxy waiting for the rest).
async fn open(
    topo: &Topology,
    ip: Ipv4Addr,
    port: u16,
    n: usize,
    first: &[u8],
) -> Result<Vec<TcpStream>> {
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        let mut s = topo.guest_tcp(ip, port).await?;
        s.write_all(first).await?;
        v.push(s);
    }
    Ok(v)
}

/// The proxy keeps at most `MAX_CONNECTIONS` guest connections: the ones past it are closed
/// at once, and a place freed is taken again. (Before, every connection was held: 2,000 in
/// the review's run, ~24 KiB of supervisor memory each.) DNS over TCP has a bound of its own.
#[tokio::test]
async fn test_a_guest_cannot_make_the_egress_hold_unbounded_connections() -> Result<()> {
    let (topo, _egress, _handle) = up_with("x", config).await?;
    topo.guest_dns("api.allowed.test", RecordType::A).await?;
    let head = b"GET / HTTP/1.1\r\nHost: api.allowed.test\r\nX-Pad: aaaa";
    let mut held = open(&topo, API, 80, MAX_CONNECTIONS, head).await?;
    let mut extra = open(&topo, API, 80, 8, head).await?;
    for s in &mut extra {
        assert!(
            closed_within(s, Duration::from_secs(5)).await,
            "a connection past {MAX_CONNECTIONS} was kept"
        );
    }
    // The held ones are still open (the sniff deadline is 10 s away).
    let mut first = held.swap_remove(0);
    assert!(!closed_within(&mut first, Duration::from_millis(300)).await);
    // Free some places: new connections are served again, to the end of a request.
    drop(first);
    held.truncate(held.len() - 8);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut s = topo.guest_tcp(API, 80).await?;
    let got = exchange(&mut s, &get("api.allowed.test", "/", "")).await?;
    assert!(got.is_some(), "no answer once places were free");
    drop(held);

    // DNS over TCP: a bound of its own, and a query goes through on a held connection.
    let mut dns = open(&topo, DNS, 53, MAX_DNS_TCP_CONNECTIONS, b"").await?;
    let mut past = topo.guest_tcp(DNS, 53).await?;
    assert!(
        closed_within(&mut past, Duration::from_secs(5)).await,
        "a DNS connection past {MAX_DNS_TCP_CONNECTIONS} was kept"
    );
    let q = a_query("api.allowed.test.")?;
    let s = &mut dns[0];
    s.write_all(&(q.len() as u16).to_be_bytes()).await?;
    s.write_all(&q).await?;
    let len = tokio::time::timeout(Duration::from_secs(5), s.read_u16()).await??;
    let mut reply = vec![0u8; usize::from(len)];
    s.read_exact(&mut reply).await?;
    let m = hickory_proto::op::Message::from_vec(&reply)?;
    assert_eq!(a_records(&m), vec![API]);
    Ok(())
}

/// A guest that pipelines DNS-over-TCP queries and never reads the answers cannot keep its
/// places: once an answer cannot be written for 10 s the connection is closed and its place
/// serves another. (Before, the answer's write waited for good: all 16 places stayed taken
/// and every later connection was closed at once.)
#[tokio::test]
async fn test_dns_tcp_connections_that_never_read_their_answers_are_closed() -> Result<()> {
    use std::os::fd::AsRawFd;
    let (topo, _egress, _handle) = up_with("x", config).await?;
    let q = a_query("api.allowed.test.")?;
    let mut framed = (q.len() as u16).to_be_bytes().to_vec();
    framed.extend_from_slice(&q);
    let burst: Vec<u8> = framed.repeat(3000);
    let mut stuck = Vec::new();
    for _ in 0..MAX_DNS_TCP_CONNECTIONS {
        let mut s = topo.guest_tcp(DNS, 53).await?;
        let small: libc::c_int = 4096;
        // SAFETY: a connected socket and an int-sized option.
        unsafe {
            libc::setsockopt(
                s.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVBUF,
                (&small as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            );
        }
        // Queries only, never a read: the resolver's answers pile up until it cannot write.
        let _ = tokio::time::timeout(Duration::from_secs(5), s.write_all(&burst)).await;
        stuck.push(s);
    }
    // Past the 10 s an answer may take to be written: the places are free again.
    tokio::time::sleep(Duration::from_secs(16)).await;
    let mut s = topo.guest_tcp(DNS, 53).await?;
    s.write_all(&framed).await?;
    let len = tokio::time::timeout(Duration::from_secs(5), s.read_u16())
        .await
        .map_err(|_| anyhow::anyhow!("no answer: the places are still held"))??;
    let mut reply = vec![0u8; usize::from(len)];
    s.read_exact(&mut reply).await?;
    assert_eq!(
        a_records(&hickory_proto::op::Message::from_vec(&reply)?),
        vec![API]
    );
    drop(stuck);
    Ok(())
}

/// A DNS query for `name`'s A records, as a guest's resolver sends it.
fn a_query(name: &str) -> Result<Vec<u8>> {
    let mut m = hickory_proto::op::Message::query();
    m.metadata.recursion_desired = true;
    m.add_query(hickory_proto::op::Query::query(
        hickory_proto::rr::Name::from_ascii(name)?,
        RecordType::A,
    ));
    Ok(m.to_vec()?)
}
