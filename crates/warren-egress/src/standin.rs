//! Stand-in external hosts and a test topology, for the egress tests, the real-VM network
//! tests and `warren bench --suite network`. Nothing here is used by a running VM.
//!
//! [`Topology::new`] creates four network namespaces (removed in `Drop`, even on failure):
//! - `guest`: a client standing in for the VM, 192.0.2.2/24 on a veth, default route to `vm`;
//! - `vm`: the VM's namespace: the veth peer 192.0.2.1/24, nftables redirecting all guest TCP
//!   to the proxy and guest DNS to the resolver (both listening in this namespace, bound via
//!   `bind_tcp_in`/`bind_udp_in`), nothing routed;
//! - `world`: stands in for the host's namespace, the one the egress connects out from (an
//!   egress's `Outbound` creates its sockets here; a real VM's egress does too when given it
//!   as `outbound_netns`). Its only link is a veth to `remote`, [`UPLINK`]/30, with routes to
//!   the stand-ins' addresses through it. Its own addresses are not stand-ins: the egress
//!   refuses every address of the namespace it connects out from;
//! - `remote`: stand-in external hosts on TEST-NET addresses (plus 169.254.169.254 and
//!   10.1.2.3 to prove blocked ranges are refused by policy, not by reachability), all on its
//!   loopback device: HTTP echo on :80, HTTPS echo on :443 (certificates of a CA generated
//!   per topology), TCP echo on :7, DNS on 203.0.113.53:53. Every request head the HTTP and
//!   HTTPS stand-ins receive is recorded ([`Topology::seen`]), so a test can assert what
//!   reached a host, not only what came back.
//!
//! The servers are tasks on the caller's tokio runtime. No packet leaves these namespaces.
//! Needs root, `ip` and `nft`.

use std::collections::HashMap;
use std::io::Write;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use hickory_proto::op::{Message, MessageType, OpCode, Query, ResponseCode};
use hickory_proto::rr::{Name, RData, Record, RecordType};
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

use crate::{bind_tcp_in, bind_udp_in, EgressError, Listeners, Outbound};

mod git;
pub use git::{GitSeen, MAX_BODY as GIT_MAX_BODY};

/// The proxy's port in the `vm` namespace.
pub const PROXY_PORT: u16 = 15001;
/// The resolver's port in the `vm` namespace.
pub const DNS_PORT: u16 = 15053;
/// The main stand-in host (`api.`, `www.`, `secret.allowed.test`, `shared.denied.test`).
pub const API: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 10);
/// A host no allowed name resolves to (`other.test`).
pub const OTHER: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 11);
/// An address with no servers (`oauth.allowed.test`), for interception rules.
pub const OAUTH: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 12);
/// The stand-in DNS server (port 53, UDP).
pub const DNS: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 53);
/// A TCP echo host (`echo.allowed.test`).
pub const ECHO: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 20);
/// The stand-in git host (`github.com`): `git http-backend` behind HTTPS, started by
/// [`Topology::serve_git`].
pub const GIT: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 20);
/// The cloud metadata address (`meta.allowed.test`), always denied.
pub const META: Ipv4Addr = Ipv4Addr::new(169, 254, 169, 254);
/// A private address (`private.allowed.test`), always denied.
pub const PRIVATE: Ipv4Addr = Ipv4Addr::new(10, 1, 2, 3);
/// What the stand-in HTTPS server returns on `/leak` (to show responses are not rewritten).
pub const LEAK_MARK: &str = "upstream-says:";
/// The `world` namespace's own address on its link to `remote` (outside the always-denied
/// ranges, so only the host-address rule refuses it); `remote` is [`UPLINK_PEER`].
pub const UPLINK: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 1);
/// The `remote` end of the uplink.
pub const UPLINK_PEER: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 2);
/// The ranges `world` routes to `remote`: every stand-in address.
const REMOTE_ROUTES: &[&str] = &[
    "203.0.113.0/24",
    "198.51.100.0/24",
    "169.254.169.254/32",
    "10.1.2.3/32",
];

/// Setting up or using the topology failed.
#[derive(Debug, thiserror::Error)]
pub enum StandinError {
    /// A setup command (`ip`, `nft`) failed.
    #[error("{command}: {stderr}")]
    Command {
        /// The command line.
        command: String,
        /// Its standard error.
        stderr: String,
    },
    /// I/O on a socket or a setup command.
    #[error("i/o")]
    Io(#[from] std::io::Error),
    /// Binding in or connecting from a namespace.
    #[error(transparent)]
    Egress(#[from] EgressError),
    /// Generating the stand-in CA or its certificate.
    #[error("certificate generation")]
    Cert(#[from] rcgen::Error),
    /// TLS configuration or handshake.
    #[error("TLS")]
    Tls(#[from] rustls::Error),
    /// Unusable PEM, key or name.
    #[error("invalid {0}")]
    Invalid(String),
    /// DNS message encoding or decoding.
    #[error("DNS message")]
    Dns(#[from] hickory_proto::ProtoError),
    /// No answer in time.
    #[error("{0} timed out")]
    TimedOut(&'static str),
}

/// The stand-in zone: name -> address.
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
        // The agents' providers, for `warren run`'s credential wiring tests.
        ("api.anthropic.com", API),
        ("platform.claude.com", OAUTH),
        ("console.anthropic.com", OAUTH),
        ("api.openai.com", API),
        ("auth.openai.com", OAUTH),
        // GitHub: git over HTTPS on the git stand-in, the API on the echo stand-in.
        ("github.com", GIT),
        ("api.github.com", API),
        ("uploads.github.com", API),
        // Hosts of the allow-list presets, for the presets' tests.
        ("pypi.org", API),
        ("files.pythonhosted.org", API),
        ("registry.npmjs.org", API),
    ])
}

fn sh(args: &[&str]) -> Result<(), StandinError> {
    let out = Command::new(args[0]).args(&args[1..]).output()?;
    if !out.status.success() {
        return Err(StandinError::Command {
            command: args.join(" "),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        });
    }
    Ok(())
}

/// A network namespace removed on drop.
pub struct NetNs {
    /// Its name (`ip netns` list).
    pub name: String,
}

impl NetNs {
    /// Creates `name` (removing a stale one first) with `lo` up.
    pub fn new(name: String) -> Result<Self, StandinError> {
        let _ = Command::new("ip").args(["netns", "del", &name]).output();
        sh(&["ip", "netns", "add", &name])?;
        let ns = NetNs { name };
        ns.ip(&["link", "set", "lo", "up"])?;
        Ok(ns)
    }

    /// The namespace file.
    pub fn path(&self) -> PathBuf {
        PathBuf::from(format!("/run/netns/{}", self.name))
    }

    /// Runs `ip -n NAME args`.
    pub fn ip(&self, args: &[&str]) -> Result<(), StandinError> {
        let mut v = vec!["ip", "-n", &self.name];
        v.extend_from_slice(args);
        sh(&v)
    }

    /// Loads an nftables ruleset in the namespace.
    pub fn nft(&self, ruleset: &str) -> Result<(), StandinError> {
        let mut child = Command::new("ip")
            .args(["netns", "exec", &self.name, "nft", "-f", "-"])
            .stdin(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()?;
        if let Some(mut stdin) = child.stdin.take() {
            stdin.write_all(ruleset.as_bytes())?;
        }
        let out = child.wait_with_output()?;
        if !out.status.success() {
            return Err(StandinError::Command {
                command: format!("nft -f - in {}", self.name),
                stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
            });
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

/// The stand-in CA and a server certificate for every stand-in name.
pub struct StandinPki {
    /// The CA certificate, PEM: what a client must trust to reach the stand-ins directly.
    pub ca_pem: String,
    /// The server's certificate chain.
    pub server_chain: Vec<CertificateDer<'static>>,
    /// The server's private key, PKCS#8 DER.
    pub server_key: Vec<u8>,
}

/// Generates a fresh stand-in CA and one server certificate for every name of [`zone`].
pub fn standin_pki() -> Result<StandinPki, StandinError> {
    let ca_key = KeyPair::generate()?;
    let mut ca = CertificateParams::new(Vec::<String>::new())?;
    ca.distinguished_name
        .push(DnType::CommonName, "stand-in test CA");
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    // Python 3.13's default verification (VERIFY_X509_STRICT) requires key usages on the CA
    // and an authority key identifier on the leaf.
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca_cert = ca.self_signed(&ca_key)?;
    let issuer = Issuer::new(ca, ca_key);
    let key = KeyPair::generate()?;
    let names: Vec<String> = zone().keys().map(|s| s.to_string()).collect();
    let mut leaf = CertificateParams::new(names)?;
    leaf.use_authority_key_identifier_extension = true;
    let leaf = leaf.signed_by(&key, &issuer)?;
    Ok(StandinPki {
        ca_pem: ca_cert.pem(),
        server_chain: vec![leaf.der().clone()],
        server_key: key.serialize_der(),
    })
}

/// A TLS client configuration (ring) trusting only the certificates in `ca_pem`.
pub fn client_config(ca_pem: &str) -> Result<rustls::ClientConfig, StandinError> {
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(c.map_err(|e| StandinError::Invalid(format!("CA PEM: {e}")))?)?;
    }
    Ok(rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_root_certificates(roots)
    .with_no_client_auth())
}

/// Request heads received by the HTTP and HTTPS stand-ins, in arrival order. The mutex guards
/// the list only.
pub type Seen = Arc<std::sync::Mutex<Vec<String>>>;

/// One running topology.
pub struct Topology {
    /// The client namespace standing in for a VM.
    pub guest: NetNs,
    /// The VM's namespace (the proxy and resolver listen here).
    pub vm: NetNs,
    /// The namespace the egress connects out from (standing in for the host's).
    pub world: NetNs,
    /// The stand-in hosts' namespace, reached from `world` over the uplink.
    pub remote: NetNs,
    /// Every request head the HTTP(S) stand-ins received.
    pub seen: Seen,
    /// The stand-ins' certificates.
    pub pki: StandinPki,
    /// Outbound strategy for the egress (sockets in `world`).
    pub world_out: Outbound,
    /// Sockets created in `guest`: the guest's view.
    pub guest_out: Outbound,
}

static COUNTER: AtomicU32 = AtomicU32::new(0);

impl Topology {
    /// Creates the namespaces and starts the stand-ins; `/leak` answers `LEAK_MARK` followed
    /// by `leak_value`.
    pub async fn new(leak_value: &str) -> Result<Self, StandinError> {
        let id = format!(
            "{}x{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::SeqCst)
        );
        let guest = NetNs::new(format!("wegr-{id}-g"))?;
        let vm = NetNs::new(format!("wegr-{id}-v"))?;
        let world = NetNs::new(format!("wegr-{id}-w"))?;
        let remote = NetNs::new(format!("wegr-{id}-r"))?;
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
        world.ip(&[
            "link",
            "add",
            "wu0",
            "type",
            "veth",
            "peer",
            "name",
            "ru0",
            "netns",
            &remote.name,
        ])?;
        world.ip(&["addr", "add", &format!("{UPLINK}/30"), "dev", "wu0"])?;
        world.ip(&["link", "set", "wu0", "up"])?;
        remote.ip(&["addr", "add", &format!("{UPLINK_PEER}/30"), "dev", "ru0"])?;
        remote.ip(&["link", "set", "ru0", "up"])?;
        remote.ip(&["route", "add", "default", "via", &UPLINK.to_string()])?;
        for net in REMOTE_ROUTES {
            world.ip(&["route", "add", net, "via", &UPLINK_PEER.to_string()])?;
        }
        for a in [API, OTHER, OAUTH, DNS, ECHO, META, PRIVATE, GIT] {
            remote.ip(&["addr", "add", &format!("{a}/32"), "dev", "lo"])?;
        }
        let pki = standin_pki()?;
        let topo = Topology {
            world_out: Outbound::netns(&world.path())?,
            guest_out: Outbound::netns(&guest.path())?,
            guest,
            vm,
            world,
            remote,
            seen: Seen::default(),
            pki,
        };
        topo.start_world(leak_value.to_string())?;
        Ok(topo)
    }

    /// The three listeners, bound in the VM namespace.
    pub fn listeners(&self) -> Result<Listeners, StandinError> {
        let any = |p| SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, p));
        Ok(Listeners {
            proxy: Some(bind_tcp_in(&self.vm.path(), any(PROXY_PORT))?),
            dns_udp: Some(bind_udp_in(&self.vm.path(), any(DNS_PORT))?),
            dns_tcp: Some(bind_tcp_in(&self.vm.path(), any(DNS_PORT))?),
        })
    }

    /// The request heads the HTTP(S) stand-ins have received so far.
    pub fn seen(&self) -> Vec<String> {
        self.seen.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn start_world(&self, leak: String) -> Result<(), StandinError> {
        let path = self.remote.path();
        let key = PrivateKeyDer::try_from(self.pki.server_key.clone())
            .map_err(|e| StandinError::Invalid(format!("server key: {e}")))?;
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
            let (leak2, seen) = (leak.clone(), self.seen.clone());
            tokio::spawn(async move {
                while let Ok((s, _)) = http.accept().await {
                    let _ = s.set_nodelay(true);
                    tokio::spawn(echo_http(s, leak2.clone(), seen.clone()));
                }
            });
            let (acceptor, leak, seen) = (acceptor.clone(), leak.clone(), self.seen.clone());
            tokio::spawn(async move {
                while let Ok((s, _)) = https.accept().await {
                    let _ = s.set_nodelay(true);
                    let (acceptor, leak, seen) = (acceptor.clone(), leak.clone(), seen.clone());
                    tokio::spawn(async move {
                        if let Ok(tls) = acceptor.accept(s).await {
                            echo_http(tls, leak, seen).await;
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
        tokio::spawn(serve_dns(dns));
        Ok(())
    }

    /// A TCP connection from the guest namespace (redirected to the proxy by nftables).
    pub async fn guest_tcp(&self, ip: Ipv4Addr, port: u16) -> Result<TcpStream, StandinError> {
        Ok(self
            .guest_out
            .tcp_connect(SocketAddrV4::new(ip, port))
            .await?)
    }

    /// A DNS query from the guest to a "foreign" resolver address (redirected to Warren's).
    pub async fn guest_dns(&self, name: &str, qtype: RecordType) -> Result<Message, StandinError> {
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
        let n = tokio::time::timeout(Duration::from_secs(5), sock.recv(&mut buf))
            .await
            .map_err(|_| StandinError::TimedOut("DNS query"))??;
        let m = Message::from_vec(&buf[..n])
            .map_err(|e| StandinError::Invalid(format!("DNS answer: {e}")))?;
        if m.metadata.message_type != MessageType::Response {
            return Err(StandinError::Invalid("DNS answer: not a response".into()));
        }
        Ok(m)
    }

    /// TLS from the guest with `sni`, trusting only `ca_pem`.
    pub async fn guest_tls(
        &self,
        ip: Ipv4Addr,
        sni: &str,
        ca_pem: &str,
    ) -> Result<tokio_rustls::client::TlsStream<TcpStream>, StandinError> {
        let tcp = self.guest_tcp(ip, 443).await?;
        let mut cfg = client_config(ca_pem)?;
        cfg.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        let conn = tokio_rustls::TlsConnector::from(Arc::new(cfg));
        let name = ServerName::try_from(sni.to_string())
            .map_err(|_| StandinError::Invalid(format!("server name {sni:?}")))?;
        let tls = tokio::time::timeout(Duration::from_secs(10), conn.connect(name, tcp))
            .await
            .map_err(|_| StandinError::TimedOut("TLS handshake"))??;
        Ok(tls)
    }
}

fn nb(l: std::net::TcpListener) -> Result<std::net::TcpListener, StandinError> {
    l.set_nonblocking(true)?;
    Ok(l)
}

/// The stand-in DNS server: `A` (and a TEST-NET `AAAA`) for the names of [`zone`], NXDOMAIN
/// for others.
async fn serve_dns(dns: tokio::net::UdpSocket) {
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
                let v6 = std::net::Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 1);
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
}

/// Stand-in HTTP/1.1 server: echoes the request head and body; `/leak` returns `leak`;
/// `/bytes/N` returns N bytes. Like common servers, it skips empty lines before a request
/// line and serves every request of a keep-alive connection whatever its `Host`; each head
/// is recorded in `seen`.
async fn echo_http<S: AsyncRead + AsyncWrite + Unpin>(s: S, leak: String, seen: Seen) {
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
                if start == 0 {
                    head.clear();
                    continue;
                }
                break;
            }
        }
        seen.lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(String::from_utf8_lossy(&head).into_owned());
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
