//! What a guest can make its egress hold at once (`warren_egress::MAX_CONNECTIONS`,
//! `MAX_DNS_TCP_CONNECTIONS`, `RELAY_SOCKET_BUFFER`, `DNS_SOCKET_BUFFER`), against the
//! stand-in topology. Needs root, `ip` and `nft`.

mod common;

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use common::*;
use hickory_proto::rr::RecordType;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use warren_egress::{
    run_in_netns, DomainPattern, EgressConfig, UpstreamRoots, DNS_SOCKET_BUFFER, MAX_CONNECTIONS,
    MAX_DNS_TCP_CONNECTIONS, RELAY_SOCKET_BUFFER,
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
/// and every later connection was closed at once.) The burst is of `AAAA` queries, answered
/// (empty) without asking upstream, 216 KB of answers each: well past what the egress's
/// fixed send buffer (`DNS_SOCKET_BUFFER`, doubled) and the guest's small receive buffer hold.
#[tokio::test]
async fn test_dns_tcp_connections_that_never_read_their_answers_are_closed() -> Result<()> {
    use std::os::fd::AsRawFd;
    let (topo, _egress, _handle) = up_with("x", config).await?;
    let framing = |q: Vec<u8>| {
        let mut framed = (q.len() as u16).to_be_bytes().to_vec();
        framed.extend_from_slice(&q);
        framed
    };
    let framed = framing(a_query("api.allowed.test.")?);
    let burst: Vec<u8> = framing(query("api.allowed.test.", RecordType::AAAA)?).repeat(6000);
    // Answers are as long as their queries (an empty answer section): past the egress's
    // 128 KiB and the guest's 8 KiB with room to spare.
    assert!(burst.len() > 3 * DNS_SOCKET_BUFFER);
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

/// The byte at offset `i` of the bulk stand-in's stream.
fn pattern(i: u64) -> u8 {
    (i % 251) as u8
}

/// Where the bulk stand-in listens, and how much it sends each connection.
const BULK_PORT: u16 = 9000;
const BULK_BYTES: u64 = 64 << 20;

/// A stand-in at `API:9000` that sends [`BULK_BYTES`] of [`pattern`] on each connection as
/// fast as it is taken, counting in `written` every byte the kernel accepted from it. Its
/// send buffer is fixed small (8 KiB), so what it wrote has nearly all left it.
async fn bulk_standin(topo: &Topology, written: Arc<AtomicU64>) -> Result<()> {
    let sock = run_in_netns(&topo.remote.path(), TcpSocket::new_v4)??;
    sock.set_send_buffer_size(4096)?; // inherited by the accepted sockets
    sock.bind(SocketAddr::V4(SocketAddrV4::new(API, BULK_PORT)))?;
    let l = sock.listen(16)?;
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            let written = written.clone();
            tokio::spawn(async move {
                // The guest's first line, read so that closing at the end is an orderly end
                // rather than a reset.
                let mut line = [0u8; 6];
                if s.read_exact(&mut line).await.is_err() {
                    return;
                }
                let mut chunk = vec![0u8; 64 << 10];
                let mut at = 0u64;
                while at < BULK_BYTES {
                    let n = (BULK_BYTES - at).min(chunk.len() as u64) as usize;
                    for (k, b) in chunk[..n].iter_mut().enumerate() {
                        *b = pattern(at + k as u64);
                    }
                    let Ok(sent) = s.write(&chunk[..n]).await else {
                        return;
                    };
                    at += sent as u64;
                    written.fetch_add(sent as u64, Ordering::SeqCst);
                }
                let _ = s.shutdown().await;
            });
        }
    });
    Ok(())
}

/// Reads exactly `n` bytes of the bulk stream from `s`, checking them against [`pattern`]
/// from offset `*at` on.
async fn read_checked(s: &mut TcpStream, n: u64, at: &mut u64) -> Result<()> {
    let mut buf = vec![0u8; 64 << 10];
    let end = *at + n;
    while *at < end {
        let want = (end - *at).min(buf.len() as u64) as usize;
        let got = tokio::time::timeout(Duration::from_secs(30), s.read(&mut buf[..want])).await??;
        anyhow::ensure!(got > 0, "stream ended at {at} of {end}");
        for (k, b) in buf[..got].iter().enumerate() {
            anyhow::ensure!(
                *b == pattern(*at + k as u64),
                "wrong byte at {}",
                *at + k as u64
            );
        }
        *at += got as u64;
    }
    Ok(())
}

/// Bytes waiting in `s`'s kernel receive queue (`FIONREAD`).
fn unread(s: &TcpStream) -> Result<u64> {
    use std::os::fd::AsRawFd;
    let mut n: libc::c_int = 0;
    // SAFETY: a connected socket, and an int for the kernel to write the count into.
    let r = unsafe { libc::ioctl(s.as_raw_fd(), libc::FIONREAD, &mut n) };
    anyhow::ensure!(r == 0, "FIONREAD: {}", std::io::Error::last_os_error());
    Ok(u64::try_from(n)?)
}

/// A guest that takes part of a fast download and then stops reading cannot make a relay
/// hold more than its fixed kernel buffers. Held is what the upstream got rid of, minus what
/// reached the guest (read, or waiting in the guest's own receive queue, which its kernel
/// grows as it likes): the relay's guest-facing send queue and upstream receive queue, the
/// egress's 8 KiB copy buffer and the stand-in's small send queue. It stays under what the
/// kernel allows two buffers of `RELAY_SOCKET_BUFFER` (twice that each: 1 MiB), with 512 KiB
/// for the rest and a packet's overshoot per queue (0.9-1.1 MiB held in our runs). (Before,
/// the kernel grew the relay's buffers while the download ran fast: 3.4-21 MiB held by one
/// relay.) Positive control: the guest then reads the download to its end, every byte right.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_a_stalled_download_holds_only_the_relays_fixed_buffers() -> Result<()> {
    let (topo, _egress, _handle) = up_with("x", config).await?;
    let written = Arc::new(AtomicU64::new(0));
    bulk_standin(&topo, written.clone()).await?;
    // The address is allowed because an allowed name resolved to it; `PING` decides by address.
    topo.guest_dns("api.allowed.test", RecordType::A).await?;
    let mut s = topo.guest_tcp(API, BULK_PORT).await?;
    s.write_all(b"PING\r\n").await?;
    let mut read = 0u64;
    read_checked(&mut s, 8 << 20, &mut read).await?;
    // Stop reading; wait until the upstream can write no more (nothing moved for 2 s).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let mut last = written.load(Ordering::SeqCst);
    loop {
        tokio::time::sleep(Duration::from_secs(2)).await;
        let now = written.load(Ordering::SeqCst);
        if now == last {
            break;
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "the upstream never stalled"
        );
        last = now;
    }
    // The guest's queue first: everything in it was written before the count is read.
    let queued = unread(&s)?;
    let wrote = written.load(Ordering::SeqCst);
    let held = wrote - read - queued;
    let bound = (4 * RELAY_SOCKET_BUFFER + (512 << 10)) as u64;
    println!(
        "stalled relay: upstream wrote {wrote}, guest read {read} and has {queued} queued, \
         held between them {held} bytes ({:.2} MiB; bound {:.2} MiB)",
        held as f64 / f64::from(1 << 20),
        bound as f64 / f64::from(1 << 20)
    );
    assert!(
        held <= bound,
        "a stalled relay held {held} bytes, more than {bound}"
    );
    // Positive control: the rest of the download arrives intact.
    read_checked(&mut s, BULK_BYTES - read, &mut read).await?;
    assert_eq!(written.load(Ordering::SeqCst), BULK_BYTES);
    Ok(())
}

/// A DNS query for `name`'s A records, as a guest's resolver sends it.
fn a_query(name: &str) -> Result<Vec<u8>> {
    query(name, RecordType::A)
}

/// A DNS query for `name`'s `qtype` records.
fn query(name: &str, qtype: RecordType) -> Result<Vec<u8>> {
    let mut m = hickory_proto::op::Message::query();
    m.metadata.recursion_desired = true;
    m.add_query(hickory_proto::op::Query::query(
        hickory_proto::rr::Name::from_ascii(name)?,
        qtype,
    ));
    Ok(m.to_vec()?)
}
