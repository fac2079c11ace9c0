//! Test topology: three network namespaces created by the test (removed in `Drop`, even on
//! failure):
//! - `guest`: a client standing in for the VM, 192.0.2.2/24 on a veth, default route to `vm`;
//! - `vm`: the VM's namespace: the veth peer 192.0.2.1/24, nftables redirecting all guest TCP
//!   to the proxy and guest DNS to the resolver (both listening in this namespace, bound via
//!   `bind_tcp_in`/`bind_udp_in`), nothing routed;
//! - `world`: stand-in external hosts on TEST-NET addresses (plus
//!   169.254.169.254 and 10.1.2.3 to prove blocked ranges are refused by policy, not by
//!   reachability), all on its loopback device: HTTP echo on :80, HTTPS echo on :443 (test CA), TCP echo on :7, DNS on
//!   203.0.113.53:53. The egress's `Outbound` creates its sockets here.
//!
//! No packet leaves these namespaces.

#![allow(dead_code)]

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use hickory_proto::op::{Message, MessageType, OpCode, Query, ResponseCode};
use hickory_proto::rr::{Name, RData, Record, RecordType};
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use warren_egress::{bind_tcp_in, bind_udp_in, Outbound};

pub const PROXY_PORT: u16 = 15001;
pub const DNS_PORT: u16 = 15053;
pub const API: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 10);
pub const OTHER: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 11);
pub const OAUTH: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 12);
pub const DNS: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 53);
pub const ECHO: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 20);
pub const META: Ipv4Addr = Ipv4Addr::new(169, 254, 169, 254);
pub const PRIVATE: Ipv4Addr = Ipv4Addr::new(10, 1, 2, 3);
/// What the stand-in HTTPS server returns on `/leak` (to show responses are not rewritten).
pub const LEAK_MARK: &str = "upstream-says:";

pub fn zone() -> HashMap<&'static str, Ipv4Addr> {
    HashMap::from([
        ("api.allowed.test", API),
        ("www.allowed.test", API),
        ("secret.allowed.test", API),
        ("shared.denied.test", API),
        ("other.test", OTHER),
        ("oauth.allowed.test", OAUTH),
        ("echo.allowed.test", ECHO),
        ("meta.allowed.test", META),
        ("private.allowed.test", PRIVATE),
        // Stand-ins for the agents' providers (`warren run` credential wiring tests).
        ("api.anthropic.com", API),
        ("platform.claude.com", OAUTH),
        ("api.openai.com", API),
        ("auth.openai.com", OAUTH),
    ])
}

fn sh(args: &[&str]) -> Result<()> {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .with_context(|| format!("{args:?}"))?;
    if !out.status.success() {
        bail!("{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(())
}

/// A network namespace removed on drop.
pub struct NetNs {
    pub name: String,
}

impl NetNs {
    pub fn new(name: String) -> Result<Self> {
        let _ = Command::new("ip").args(["netns", "del", &name]).output();
        sh(&["ip", "netns", "add", &name])?;
        let ns = NetNs { name };
        ns.ip(&["link", "set", "lo", "up"])?;
        Ok(ns)
    }
    pub fn path(&self) -> PathBuf {
        PathBuf::from(format!("/run/netns/{}", self.name))
    }
    pub fn ip(&self, args: &[&str]) -> Result<()> {
        let mut v = vec!["ip", "-n", &self.name];
        v.extend_from_slice(args);
        sh(&v)
    }
    pub fn nft(&self, ruleset: &str) -> Result<()> {
        let mut child = Command::new("ip")
            .args(["netns", "exec", &self.name, "nft", "-f", "-"])
            .stdin(std::process::Stdio::piped())
            .spawn()?;
        use std::io::Write;
        child
            .stdin
            .take()
            .context("stdin")?
            .write_all(ruleset.as_bytes())?;
        if !child.wait()?.success() {
            bail!("nft failed");
        }
        Ok(())
    }
}

impl Drop for NetNs {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .output();
    }
}

/// The test CA and a server certificate for every stand-in name.
pub struct TestPki {
    pub ca_pem: String,
    pub server_chain: Vec<CertificateDer<'static>>,
    pub server_key: Vec<u8>,
}

pub fn test_pki() -> Result<TestPki> {
    let ca_key = KeyPair::generate()?;
    let mut ca = CertificateParams::new(Vec::<String>::new())?;
    ca.distinguished_name
        .push(DnType::CommonName, "stand-in test CA");
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_cert = ca.self_signed(&ca_key)?;
    let issuer = Issuer::new(ca, ca_key);
    let key = KeyPair::generate()?;
    let names: Vec<String> = zone().keys().map(|s| s.to_string()).collect();
    let leaf = CertificateParams::new(names)?.signed_by(&key, &issuer)?;
    Ok(TestPki {
        ca_pem: ca_cert.pem(),
        server_chain: vec![leaf.der().clone()],
        server_key: key.serialize_der(),
    })
}

/// One running topology.
pub struct Topology {
    pub guest: NetNs,
    pub vm: NetNs,
    pub world: NetNs,
    pub pki: TestPki,
    /// Outbound strategy for the egress (sockets in `world`).
    pub world_out: Outbound,
    /// Sockets created in `guest`: the guest's view.
    pub guest_out: Outbound,
}

static COUNTER: AtomicU32 = AtomicU32::new(0);

impl Topology {
    pub async fn new(leak_value: &str) -> Result<Self> {
        let id = format!(
            "{}x{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::SeqCst)
        );
        let guest = NetNs::new(format!("wegr-{id}-g"))?;
        let vm = NetNs::new(format!("wegr-{id}-v"))?;
        let world = NetNs::new(format!("wegr-{id}-w"))?;
        guest.ip(&[
            "link", "add", "vg0", "type", "veth", "peer", "name", "vv0", "netns", &vm.name,
        ])?;
        guest.ip(&["addr", "add", "192.0.2.2/24", "dev", "vg0"])?;
        guest.ip(&["link", "set", "vg0", "up"])?;
        guest.ip(&["route", "add", "default", "via", "192.0.2.1"])?;
        vm.ip(&["addr", "add", "192.0.2.1/24", "dev", "vv0"])?;
        vm.ip(&["link", "set", "vv0", "up"])?;
        vm.nft(&format!(
            "table ip warren {{
               chain pre {{ type nat hook prerouting priority dstnat; policy accept;
                 iifname \"vv0\" udp dport 53 redirect to :{DNS_PORT}
                 iifname \"vv0\" tcp dport 53 redirect to :{DNS_PORT}
                 iifname \"vv0\" meta l4proto tcp redirect to :{PROXY_PORT}
               }}
               chain input {{ type filter hook input priority filter; policy drop;
                 iifname \"lo\" accept
                 ct state established,related accept
                 iifname \"vv0\" tcp dport {{ {PROXY_PORT}, {DNS_PORT} }} accept
                 iifname \"vv0\" udp dport {DNS_PORT} accept
               }}
               chain forward {{ type filter hook forward priority filter; policy drop; }}
             }}"
        ))?;
        for a in [API, OTHER, OAUTH, DNS, ECHO, META, PRIVATE] {
            world.ip(&["addr", "add", &format!("{a}/32"), "dev", "lo"])?;
        }
        let pki = test_pki()?;
        let topo = Topology {
            world_out: Outbound::netns(&world.path())?,
            guest_out: Outbound::netns(&guest.path())?,
            guest,
            vm,
            world,
            pki,
        };
        topo.start_world(leak_value.to_string())?;
        Ok(topo)
    }

    /// The three listeners, bound in the VM namespace.
    pub fn listeners(&self) -> Result<warren_egress::Listeners> {
        let any = |p| SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, p));
        Ok(warren_egress::Listeners {
            proxy: Some(bind_tcp_in(&self.vm.path(), any(PROXY_PORT))?),
            dns_udp: Some(bind_udp_in(&self.vm.path(), any(DNS_PORT))?),
            dns_tcp: Some(bind_tcp_in(&self.vm.path(), any(DNS_PORT))?),
        })
    }

    fn start_world(&self, leak: String) -> Result<()> {
        let path = self.world.path();
        let key =
            PrivateKeyDer::try_from(self.pki.server_key.clone()).map_err(anyhow::Error::msg)?;
        let cfg = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(self.pki.server_chain.clone(), key)?;
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(cfg));
        // OAUTH deliberately has no servers: interception must answer without an upstream.
        for ip in [API, OTHER, ECHO, META, PRIVATE] {
            let at = |p| SocketAddr::V4(SocketAddrV4::new(ip, p));
            let http = tokio::net::TcpListener::from_std(nb(bind_tcp_in(&path, at(80))?)?)?;
            let https = tokio::net::TcpListener::from_std(nb(bind_tcp_in(&path, at(443))?)?)?;
            let echo = tokio::net::TcpListener::from_std(nb(bind_tcp_in(&path, at(7))?)?)?;
            let leak2 = leak.clone();
            tokio::spawn(async move {
                while let Ok((s, _)) = http.accept().await {
                    let _ = s.set_nodelay(true);
                    tokio::spawn(echo_http(s, leak2.clone()));
                }
            });
            let (acceptor, leak) = (acceptor.clone(), leak.clone());
            tokio::spawn(async move {
                while let Ok((s, _)) = https.accept().await {
                    let _ = s.set_nodelay(true);
                    let (acceptor, leak) = (acceptor.clone(), leak.clone());
                    tokio::spawn(async move {
                        if let Ok(tls) = acceptor.accept(s).await {
                            echo_http(tls, leak).await;
                        }
                    });
                }
            });
            tokio::spawn(async move {
                while let Ok((mut s, _)) = echo.accept().await {
                    tokio::spawn(async move {
                        let (mut r, mut w) = s.split();
                        let _ = tokio::io::copy(&mut r, &mut w).await;
                    });
                }
            });
        }
        let dns = bind_udp_in(&path, SocketAddr::V4(SocketAddrV4::new(DNS, 53)))?;
        dns.set_nonblocking(true)?;
        let dns = tokio::net::UdpSocket::from_std(dns)?;
        tokio::spawn(async move {
            let zone = zone();
            let mut buf = vec![0u8; 4096];
            while let Ok((n, peer)) = dns.recv_from(&mut buf).await {
                let Ok(req) = Message::from_vec(&buf[..n]) else {
                    continue;
                };
                let mut resp = Message::response(req.metadata.id, OpCode::Query);
                let Some(q) = req.queries.first() else {
                    continue;
                };
                resp.add_query(q.clone());
                let name = q
                    .name()
                    .to_ascii()
                    .trim_end_matches('.')
                    .to_ascii_lowercase();
                match zone.get(name.as_str()) {
                    Some(ip) if q.query_type() == RecordType::A => {
                        resp.add_answer(Record::from_rdata(
                            q.name().clone(),
                            30,
                            RData::A((*ip).into()),
                        ));
                    }
                    Some(_) if q.query_type() == RecordType::AAAA => {
                        let v6: std::net::Ipv6Addr = "2001:db8::1".parse().expect("v6");
                        resp.add_answer(Record::from_rdata(
                            q.name().clone(),
                            30,
                            RData::AAAA(v6.into()),
                        ));
                    }
                    Some(_) => {}
                    None => resp.metadata.response_code = ResponseCode::NXDomain,
                }
                if let Ok(wire) = resp.to_vec() {
                    let _ = dns.send_to(&wire, peer).await;
                }
            }
        });
        Ok(())
    }

    /// A TCP connection from the guest namespace (redirected to the proxy by nftables).
    pub async fn guest_tcp(&self, ip: Ipv4Addr, port: u16) -> Result<TcpStream> {
        Ok(self
            .guest_out
            .tcp_connect(SocketAddrV4::new(ip, port))
            .await?)
    }

    /// A DNS query from the guest to a "foreign" resolver address (redirected to Warren's).
    pub async fn guest_dns(&self, name: &str, qtype: RecordType) -> Result<Message> {
        let sock = self.guest_out.udp_socket().await?;
        sock.connect(SocketAddr::V4(SocketAddrV4::new(
            Ipv4Addr::new(203, 0, 113, 99),
            53,
        )))
        .await?;
        let mut q = Message::query();
        q.metadata.recursion_desired = true;
        q.add_query(Query::query(Name::from_ascii(format!("{name}."))?, qtype));
        sock.send(&q.to_vec()?).await?;
        let mut buf = vec![0u8; 4096];
        let n = tokio::time::timeout(Duration::from_secs(5), sock.recv(&mut buf)).await??;
        let m = Message::from_vec(&buf[..n])?;
        assert_eq!(m.metadata.message_type, MessageType::Response);
        Ok(m)
    }

    /// TLS from the guest with `sni`, trusting only `ca_pem`.
    pub async fn guest_tls(
        &self,
        ip: Ipv4Addr,
        sni: &str,
        ca_pem: &str,
    ) -> Result<tokio_rustls::client::TlsStream<TcpStream>> {
        let tcp = self.guest_tcp(ip, 443).await?;
        let mut roots = rustls::RootCertStore::empty();
        for c in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
            roots.add(c?)?;
        }
        let mut cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
        cfg.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        let conn = tokio_rustls::TlsConnector::from(Arc::new(cfg));
        let tls = tokio::time::timeout(
            Duration::from_secs(10),
            conn.connect(ServerName::try_from(sni.to_string())?, tcp),
        )
        .await??;
        Ok(tls)
    }
}

fn nb(l: std::net::TcpListener) -> Result<std::net::TcpListener> {
    l.set_nonblocking(true)?;
    Ok(l)
}

/// Stand-in HTTP/1.1 server: echoes the request head and body; `/leak` returns `leak`;
/// `/bytes/N` returns N bytes.
async fn echo_http<S: AsyncRead + AsyncWrite + Unpin>(s: S, leak: String) {
    let mut s = BufReader::new(s);
    loop {
        let mut head = Vec::new();
        loop {
            let start = head.len();
            match s.read_until(b'\n', &mut head).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
            if &head[start..] == b"\r\n" {
                break;
            }
        }
        let mut hs = [httparse::EMPTY_HEADER; 64];
        let mut req = httparse::Request::new(&mut hs);
        if req.parse(&head).is_err() {
            return;
        }
        let len: usize = req
            .headers
            .iter()
            .find(|h| h.name.eq_ignore_ascii_case("content-length"))
            .and_then(|h| std::str::from_utf8(h.value).ok()?.trim().parse().ok())
            .unwrap_or(0);
        let path = req.path.unwrap_or("").to_string();
        let mut body = vec![0u8; len];
        if s.read_exact(&mut body).await.is_err() {
            return;
        }
        let mut out = if let Some(n) = path.strip_prefix("/bytes/") {
            vec![b'x'; n.parse().unwrap_or(0)]
        } else if path == "/leak" {
            format!("{LEAK_MARK}{leak}").into_bytes()
        } else {
            let mut o = head.clone();
            o.extend_from_slice(b"--body--\n");
            o.extend_from_slice(&body);
            o
        };
        let mut resp =
            format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n", out.len()).into_bytes();
        resp.append(&mut out);
        if s.get_mut().write_all(&resp).await.is_err() || s.get_mut().flush().await.is_err() {
            return;
        }
    }
}

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
