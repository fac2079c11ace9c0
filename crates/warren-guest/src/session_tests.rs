//! Session and channel tests: a host written like the supervisor (Sync until SyncAck, h2
//! client over the escaped stream, Hello, Auth, requests) against `channel::start` on one end
//! of a socket pair.

use std::collections::HashMap;
use std::os::unix::net::UnixStream as StdUnixStream;
use std::sync::atomic::AtomicBool;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::unix::OwnedWriteHalf;
use tokio::net::UnixStream;
use tokio::sync::{mpsc, oneshot};
use warren_protocol::framing::{self, Decoder, Event, SyncNonce};
use warren_protocol::{ExecStart, JobOutputRequest, JobState};

use super::*;
use crate::jobs::{Containment, JobsConfig};
use crate::reaper::{ReapMode, Reaper};

const SECRET: [u8; 32] = [7; 32];

type Sink = mpsc::UnboundedSender<Vec<u8>>;

#[derive(Default)]
struct Route {
    /// Waiting for this SyncAck; data goes to the sink after it.
    expect: Option<(SyncNonce, oneshot::Sender<()>, Sink)>,
    active: Option<Sink>,
}

/// The host end of the wire: routes decoded data to the latest acknowledged session.
struct Wire {
    writer: Arc<tokio::sync::Mutex<OwnedWriteHalf>>,
    route: Arc<Mutex<Route>>,
    agent: Option<Arc<Agent>>,
    _ws: Option<tempfile::TempDir>,
}

struct Client {
    send: h2::client::SendRequest<Bytes>,
}

fn new_agent() -> (Arc<Agent>, tempfile::TempDir) {
    let ws = tempfile::tempdir().expect("tempdir");
    let files = FilesConfig {
        workspace: ws.path().to_path_buf(),
        user: None,
    };
    let reaper = Reaper::start(ReapMode::RegisteredOnly).expect("reaper");
    let jobs = JobManager::new(
        JobsConfig {
            files: files.clone(),
            containment: Containment::ProcessGroupForTestsOnly,
            ..JobsConfig::guest(files.clone(), "/nonexistent".into())
        },
        reaper,
    );
    let agent = Arc::new(Agent {
        jobs,
        files,
        secret: Secret::new(SECRET),
        system: System {
            pid1: false,
            power_off_requested: AtomicBool::new(false),
            shares: crate::coherence::Shares::default(),
        },
    });
    (agent, ws)
}

/// The agent on one end of a socket pair; the other end, non-blocking, for tokio.
fn serve_pair(agent: &Arc<Agent>) -> UnixStream {
    let (guest, host) = StdUnixStream::pair().expect("socketpair");
    crate::channel::start(guest, agent.clone()).expect("start");
    host.set_nonblocking(true).expect("nonblocking");
    UnixStream::from_std(host).expect("tokio")
}

async fn start_agent() -> Wire {
    let (agent, ws) = new_agent();
    let stream = serve_pair(&agent);
    Wire::over(stream, Some(agent), Some(ws))
}

impl Wire {
    fn over(stream: UnixStream, agent: Option<Arc<Agent>>, ws: Option<tempfile::TempDir>) -> Wire {
        let (mut rd, wr) = stream.into_split();
        let route = Arc::new(Mutex::new(Route::default()));
        let router = route.clone();
        tokio::spawn(async move {
            let mut decoder = Decoder::new();
            let mut buf = vec![0u8; 64 * 1024];
            let mut events = Vec::new();
            loop {
                let n = match rd.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => n,
                };
                decoder.feed(&buf[..n], &mut events);
                for ev in events.drain(..) {
                    let mut r = router.lock().expect("route");
                    match ev {
                        Event::SyncAck(nonce)
                            if r.expect.as_ref().is_some_and(|(n, _, _)| *n == nonce) =>
                        {
                            let (_, ack, sink) = r.expect.take().expect("checked");
                            r.active = Some(sink);
                            let _ = ack.send(());
                        }
                        Event::Data(d) => {
                            if let Some(sink) = &r.active {
                                let _ = sink.send(d);
                            }
                        }
                        _ => {}
                    }
                }
            }
        });
        Wire {
            writer: Arc::new(tokio::sync::Mutex::new(wr)),
            route,
            agent,
            _ws: ws,
        }
    }

    async fn raw(&self, bytes: &[u8]) {
        self.writer
            .lock()
            .await
            .write_all(bytes)
            .await
            .expect("write");
    }

    /// Resyncs and opens a new h2 session, like the supervisor does on (re)connect.
    async fn connect(&self) -> Client {
        let nonce: SyncNonce = rand::random();
        let (client_io, bridge) = tokio::io::duplex(256 * 1024);
        let (mut from_client, mut to_client) = tokio::io::split(bridge);
        let (sink, mut inbound) = mpsc::unbounded_channel::<Vec<u8>>();
        let (ack_tx, ack_rx) = oneshot::channel();
        {
            let mut r = self.route.lock().expect("route");
            r.active = None;
            r.expect = Some((nonce, ack_tx, sink));
        }
        self.raw(&framing::encode_sync(&nonce)).await;
        tokio::time::timeout(Duration::from_secs(5), ack_rx)
            .await
            .expect("SyncAck in time")
            .expect("ack");
        tokio::spawn(async move {
            while let Some(d) = inbound.recv().await {
                if to_client.write_all(&d).await.is_err() {
                    return;
                }
            }
        });
        let writer = self.writer.clone();
        tokio::spawn(async move {
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                let n = match from_client.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => n,
                };
                let mut out = Vec::new();
                framing::encode_data(&buf[..n], &mut out);
                if writer.lock().await.write_all(&out).await.is_err() {
                    return;
                }
            }
        });
        let (send, conn) = h2::client::handshake(client_io)
            .await
            .expect("h2 handshake");
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Client { send }
    }
}

impl Client {
    async fn call(&mut self, req: &HostRequest) -> Response {
        tokio::time::timeout(Duration::from_secs(10), self.try_call(req))
            .await
            .expect("answer in time")
            .expect("a response")
    }

    /// One request; `None` when the stream or connection failed.
    async fn try_call(&mut self, req: &HostRequest) -> Option<Response> {
        let body = warren_protocol::encode(req).expect("encode");
        let mut send = self.send.clone().ready().await.ok()?;
        let head = http::Request::builder()
            .method("POST")
            .uri(format!("http://guest{RPC_PATH}"))
            .body(())
            .expect("request");
        let (resp, mut stream) = send.send_request(head, false).ok()?;
        stream.send_data(Bytes::from(body), true).ok()?;
        let resp = resp.await.ok()?;
        assert_eq!(resp.status(), http::StatusCode::OK);
        let mut body = resp.into_body();
        let mut buf = Vec::new();
        while let Some(chunk) = body.data().await {
            let chunk = chunk.ok()?;
            let _ = body.flow_control().release_capacity(chunk.len());
            buf.extend_from_slice(&chunk);
        }
        Some(warren_protocol::decode(&buf).expect("decode response"))
    }

    async fn hello(&mut self) -> ([u8; 32], HelloReply) {
        let host_nonce: [u8; 32] = rand::random();
        let reply = self
            .call(&HostRequest::Hello(Hello {
                max_version: PROTOCOL_VERSION,
                min_version: MIN_PROTOCOL_VERSION,
                host_nonce,
            }))
            .await;
        match reply {
            Ok(GuestResponse::Hello(h)) => (host_nonce, h),
            other => panic!("unexpected hello reply {other:?}"),
        }
    }

    async fn authenticate(&mut self) -> AgentInfo {
        self.authenticate_with(&SECRET).await
    }

    async fn authenticate_with(&mut self, secret: &[u8; 32]) -> AgentInfo {
        let (host_nonce, h) = self.hello().await;
        assert_eq!(h.version, PROTOCOL_VERSION);
        assert!(verify(
            &guest_proof(secret, &host_nonce, &h.guest_nonce),
            &h.proof
        ));
        let reply = self
            .call(&HostRequest::Auth(Auth {
                proof: host_proof(secret, &host_nonce, &h.guest_nonce),
                unix_time_ns: 1,
                entropy: [0; 32],
            }))
            .await;
        match reply {
            Ok(GuestResponse::Authenticated(info)) => info,
            other => panic!("unexpected auth reply {other:?}"),
        }
    }
}

fn code(r: Response) -> ErrorCode {
    r.expect_err("error expected").code
}

/// A restored copy's rekey: only in an authenticated session; afterwards a session made with
/// the old secret fails (the guest's proof is wrong and the host's is refused) and one made
/// with the new secret works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_session_rekey_old_secret_unusable_new_one_works() {
    let wire = start_agent().await;
    let contribution = [3u8; 32];
    let rekey_req = HostRequest::Rekey(warren_protocol::Rekey {
        contribution,
        proof: warren_protocol::auth::rekey_host_proof(&SECRET, &contribution),
        unix_time_ns: 1,
        entropy: [1; 32],
        hostname: "vm-a".into(),
        machine_id: "0123456789abcdef0123456789abcdef".into(),
    });
    let mut c = wire.connect().await;
    assert_eq!(
        code(c.call(&rekey_req).await),
        ErrorCode::Unauthenticated,
        "no rekey before Auth"
    );
    c.authenticate().await;
    let new = warren_protocol::auth::rekey(&SECRET, &contribution);
    match c.call(&rekey_req).await {
        Ok(GuestResponse::Rekeyed(p)) => assert!(verify(
            &warren_protocol::auth::rekey_guest_proof(&new, &contribution),
            &p.proof
        )),
        other => panic!("unexpected rekey reply {other:?}"),
    }
    // The old secret: the guest's Hello proof no longer matches it, and Auth with it fails.
    let mut old = wire.connect().await;
    let (host_nonce, h) = old.hello().await;
    assert!(!verify(
        &guest_proof(&SECRET, &host_nonce, &h.guest_nonce),
        &h.proof
    ));
    assert!(verify(
        &guest_proof(&new, &host_nonce, &h.guest_nonce),
        &h.proof
    ));
    let refused = old
        .call(&HostRequest::Auth(Auth {
            proof: host_proof(&SECRET, &host_nonce, &h.guest_nonce),
            unix_time_ns: 1,
            entropy: [0; 32],
        }))
        .await;
    assert_eq!(code(refused), ErrorCode::Unauthenticated);
    let mut fresh = wire.connect().await;
    fresh.authenticate_with(&new).await;
    assert_eq!(
        fresh.call(&HostRequest::Ping).await,
        Ok(GuestResponse::Pong)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_session_sync_hello_auth_ping_pong() {
    let wire = start_agent().await;
    // Stale bytes before the first Sync are discarded.
    wire.raw(b"stale bytes from a previous life").await;
    let mut c = wire.connect().await;
    let info = c.authenticate().await;
    assert_eq!(info.agent_version, env!("CARGO_PKG_VERSION"));
    assert!(!info.kernel_release.is_empty());
    assert_eq!(c.call(&HostRequest::Ping).await, Ok(GuestResponse::Pong));
}

#[tokio::test]
async fn test_session_requests_before_auth_unauthenticated() {
    let wire = start_agent().await;
    let mut c = wire.connect().await;
    assert_eq!(
        code(c.call(&HostRequest::Ping).await),
        ErrorCode::Unauthenticated
    );
    c.hello().await;
    assert_eq!(
        code(
            c.call(&HostRequest::JobCancel(warren_protocol::JobId(1)))
                .await
        ),
        ErrorCode::Unauthenticated
    );
}

#[tokio::test]
async fn test_session_wrong_proof_unauthenticated() {
    let wire = start_agent().await;
    let mut c = wire.connect().await;
    c.hello().await;
    let bad = HostRequest::Auth(Auth {
        proof: [0; 32],
        unix_time_ns: 1,
        entropy: [0; 32],
    });
    assert_eq!(code(c.call(&bad).await), ErrorCode::Unauthenticated);
    assert_eq!(
        code(c.call(&HostRequest::Ping).await),
        ErrorCode::Unauthenticated
    );
}

/// Starts `argv` as a job; panics unless the guest accepts it.
async fn start_job(client: &mut Client, argv: &[&str]) -> warren_protocol::JobId {
    match client
        .call(&HostRequest::ExecStart(ExecStart {
            argv: argv.iter().map(|a| a.to_string()).collect(),
            env: Vec::new(),
            cwd: None,
            stdin: None,
            timeout_ms: None,
            request_key: None,
        }))
        .await
    {
        Ok(GuestResponse::ExecStarted(id)) => id,
        other => panic!("exec: {other:?}"),
    }
}

#[tokio::test]
async fn test_session_version_outside_range_mismatch() {
    let wire = start_agent().await;
    let mut c = wire.connect().await;
    let hello = HostRequest::Hello(Hello {
        max_version: PROTOCOL_VERSION + 5,
        min_version: PROTOCOL_VERSION + 1,
        host_nonce: [1; 32],
    });
    assert_eq!(code(c.call(&hello).await), ErrorCode::VersionMismatch);
}

#[tokio::test]
async fn test_session_resync_mid_session_fresh_session_works() {
    let wire = start_agent().await;
    let mut first = wire.connect().await;
    first.authenticate().await;
    let job = start_job(&mut first, &["sh", "-c", "echo survived"]).await;
    // A long-poll in flight when the host resyncs must not hold up the new session.
    let sleeper = start_job(&mut first, &["sleep", "3"]).await;
    let mut poller = Client {
        send: first.send.clone(),
    };
    tokio::spawn(async move {
        let _ = poller
            .try_call(&HostRequest::JobOutput(JobOutputRequest {
                job: sleeper,
                stdout_cursor: 0,
                stderr_cursor: 0,
                max_bytes: 1024,
                wait_ms: 20_000,
            }))
            .await;
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let mut second = wire.connect().await;
    assert_eq!(
        code(second.call(&HostRequest::Ping).await),
        ErrorCode::Unauthenticated,
        "a new session starts unauthenticated"
    );
    second.authenticate().await;
    assert_eq!(
        second.call(&HostRequest::Ping).await,
        Ok(GuestResponse::Pong)
    );
    // Jobs belong to the agent, not to the session.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let out = second
            .call(&HostRequest::JobOutput(JobOutputRequest {
                job,
                stdout_cursor: 0,
                stderr_cursor: 0,
                max_bytes: 1024,
                wait_ms: 1000,
            }))
            .await;
        let Ok(GuestResponse::JobOutput(out)) = out else {
            panic!("output: {out:?}");
        };
        if matches!(out.state, JobState::Finished(_)) {
            assert_eq!(out.stdout, b"survived\n");
            break;
        }
        assert!(std::time::Instant::now() < deadline);
    }
}

#[tokio::test]
async fn test_channel_queued_syncs_get_one_ack_for_the_newest() {
    let (agent, _ws) = new_agent();
    let mut host = serve_pair(&agent);
    // Five resends queued before the agent reads any of them (a slow guest): one write.
    let mut burst = Vec::new();
    for n in 1..=5u8 {
        burst.extend_from_slice(&framing::encode_sync(&[n; framing::SYNC_NONCE_LEN]));
    }
    host.write_all(&burst).await.expect("write");
    let mut decoder = Decoder::new();
    let mut acks = Vec::new();
    let mut buf = vec![0u8; 4096];
    let until = tokio::time::Instant::now() + Duration::from_millis(500);
    while let Ok(Ok(n)) = tokio::time::timeout_at(until, host.read(&mut buf)).await {
        if n == 0 {
            break;
        }
        let mut events = Vec::new();
        decoder.feed(&buf[..n], &mut events);
        for ev in events {
            if let Event::SyncAck(nonce) = ev {
                acks.push(nonce[0]);
            }
        }
    }
    assert_eq!(acks, vec![5], "only the newest Sync is acknowledged");
}

#[tokio::test]
async fn test_session_probes_and_files_over_channel() {
    let wire = start_agent().await;
    let mut c = wire.connect().await;
    c.authenticate().await;
    let Ok(GuestResponse::Source(zeros)) = c.call(&HostRequest::Source(u32::MAX)).await else {
        panic!("source");
    };
    assert!(zeros.len() > MAX_MESSAGE_BYTES / 2 && zeros.iter().all(|&b| b == 0));
    assert_eq!(
        c.call(&HostRequest::Discard(vec![0xF5; 200_000])).await,
        Ok(GuestResponse::Discarded)
    );
    let data: Vec<u8> = (0..=255u8).cycle().take(100_000).collect();
    let w = c
        .call(&HostRequest::FileWrite(warren_protocol::FileWrite {
            path: "d/f".into(),
            mode: warren_protocol::WriteMode::Truncate,
            data: data.clone(),
            create_parents: true,
        }))
        .await;
    assert_eq!(
        w,
        Ok(GuestResponse::FileWritten(warren_protocol::FileWritten {
            size: 100_000
        }))
    );
    let Ok(GuestResponse::FileData(back)) = c
        .call(&HostRequest::FileRead(warren_protocol::FileRead {
            path: "d/f".into(),
            offset: 0,
            len: 128 * 1024,
        }))
        .await
    else {
        panic!("read");
    };
    assert_eq!(back.data, data);
    assert!(back.eof);
    // Concurrent requests on one session.
    let mut handles = HashMap::new();
    for i in 0..8 {
        let mut cc = Client {
            send: c.send.clone(),
        };
        handles.insert(
            i,
            tokio::spawn(async move { cc.call(&HostRequest::Ping).await }),
        );
    }
    for (_, h) in handles {
        assert_eq!(h.await.expect("join"), Ok(GuestResponse::Pong));
    }
    assert_eq!(
        c.call(&HostRequest::PowerOff).await,
        Ok(GuestResponse::PoweringOff)
    );
    assert!(wire
        .agent
        .as_ref()
        .expect("local agent")
        .system
        .power_off_requested
        .load(Ordering::SeqCst));
}
