//! The controller's end of a job broker pipe: `GET /v1/vms/{vm_id}/jobs/{job_id}/broker`
//! (WebSocket) with the one-time token in `X-Broker-Pipe`, behind the same guard and
//! authentication layers as the tools. Framing and refusals: `crate::broker`.
//!
//! An attachment runs these tasks:
//! - **accept**: holds one `BrokerAccept` guest stream open at a time while fewer than
//!   [`MAX_CONNECTIONS`] connections are live; when a job process connects, it takes a place
//!   for the connection under the `[streams]` quotas (each live connection is a stream of its
//!   own against the host, workspace and VM quotas; the attachment's own place covers the
//!   one pending accept), waiting while they are full with no further accept (later job
//!   processes wait in the socket's backlog), then numbers the connection, sends `open`, and
//!   starts the connection's task. A pipe that ended (the
//!   job's processes are gone) ends the attachment with 1001 `job finished`. Before each
//!   accept, and again once the guest answered it, the VM's generation is read (one database
//!   read each): an attachment is for its job's boot only, so once the VM is in another (it
//!   booted fresh: job ids started again, and the same number may name another job) it ends
//!   with 1001 and takes nothing from the new boot (`boot_check`). The read after the
//!   answer is the one that counts: an accept that woke the VM may itself have booted it
//!   fresh, and a fresh boot moves the generation before its supervisor starts.
//! - **one per connection**: guest bytes become `data` frames (read only as fast as the
//!   WebSocket drains); the controller's data for it waits in a queue of at most
//!   [`QUEUE_BYTES`] and is written as the guest reads; a `close` from the controller is
//!   delivered after the data queued before it (the guest reads its end of input), and the
//!   guest's end becomes a `close` frame. Frames for a connection already closed are ignored.
//! - **upstream**: the controller's messages, parsed into frames; a connection whose queue
//!   stays full for [`STALL`] is closed alone. Malformed framing, or a connection id never
//!   opened, closes the attachment with 1002.
//! - the task itself: frames to the controller under `[streams] rate_bytes`, the credential
//!   recheck and pings (`crate::ws::Lifeline`), suspend/destroy (1001), and a look every
//!   [`JOB_CHECK`] whether the job's processes are all gone, its answer taken only when the
//!   VM is in the attachment's generation before and after it (`check_job`).
//!
//! Open and close are logged with workspace, VM, job, duration, byte counts and reason; the
//! token and the payload never are.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::response::Response;
use futures_util::stream::SplitStream;
use futures_util::StreamExt;
use tokio::sync::{mpsc, Semaphore};
use tokio::task::AbortHandle;
use warren_protocol::stream::{StreamTarget, BROKER_ACCEPTED};
use warren_protocol::JobId;
use warren_supervisor::stream_frame::{StreamReader, StreamWriter};

use crate::auth::Principal;
use crate::broker::{close_frame, data_frames, open_frame, Frame, FrameReader};
use crate::error::ApiError;
use crate::http::error_response;
use crate::service::job_streams::BrokerOpen;
use crate::service::Service;
use crate::streams::{CloseReason, RateLimit};
use crate::ws::{Lifeline, GOING_AWAY, INTERNAL, MAX_MESSAGE, NORMAL, POLICY};

/// Guest connections one attachment carries at once.
pub const MAX_CONNECTIONS: usize = 64;
/// Controller data queued per connection (in frames of at most 64 KiB: 16 of them).
pub const QUEUE_BYTES: usize = 1 << 20;
/// How long a connection's queue may stay full before that connection is closed.
pub const STALL: Duration = Duration::from_secs(10);
/// How often a full `[streams]` quota is looked at again while a guest connection waits.
pub const ADMIT_RETRY: Duration = Duration::from_millis(250);
/// How often the attachment looks whether its job's processes are all gone.
pub const JOB_CHECK: Duration = Duration::from_secs(5);
/// The longest one job check may wait for the guest's answer.
pub const JOB_CHECK_LIMIT: Duration = Duration::from_secs(2);
/// WebSocket close code for broken framing (RFC 6455 "protocol error").
const PROTOCOL: u16 = 1002;
/// The close reason when the job's processes are all gone (its pipe is then forgotten).
const JOB_FINISHED: &str = "job finished";

/// The request header carrying the controller's token.
pub const TOKEN_HEADER: &str = "x-broker-pipe";

/// Serves one attach request: refusals as the tools' JSON errors, else the upgrade.
pub async fn serve(
    service: Arc<Service>,
    p: Principal,
    vm_id: String,
    job_id: String,
    token: Option<String>,
    ws: Option<WebSocketUpgrade>,
) -> Response {
    let job = match crate::service::parse_job(&job_id) {
        Ok(j) => j,
        Err(e) => return error_response(&e),
    };
    let Some(token) = token else {
        // No token is a wrong token: the same answer as any other.
        return error_response(&ApiError::new(
            "not_found",
            format!("no broker pipe for job {job}"),
        ));
    };
    let Some(ws) = ws else {
        return error_response(&ApiError::invalid(
            "attach with a WebSocket upgrade (GET, Connection: Upgrade, Upgrade: websocket)",
        ));
    };
    let opened = match service.open_broker(&p, &vm_id, job, &token).await {
        Ok(o) => o,
        Err(e) => {
            tracing::info!(workspace = %p.workspace, vm = %vm_id, job = %job, code = e.code, "broker attach refused");
            return error_response(&e);
        }
    };
    ws.max_message_size(MAX_MESSAGE)
        .max_frame_size(MAX_MESSAGE)
        .on_upgrade(move |socket| run(service, p, opened, socket))
}

/// What the controller sent for one connection.
enum ToGuest {
    Data(Vec<u8>),
    Close,
}

struct Conn {
    tx: mpsc::Sender<ToGuest>,
    task: AbortHandle,
}

#[derive(Default)]
struct Conns {
    /// The last id given out (ids start at 1 and are never reused).
    last_id: u32,
    live: HashMap<u32, Conn>,
}

type Shared = Arc<Mutex<Conns>>;

fn lock(c: &Mutex<Conns>) -> MutexGuard<'_, Conns> {
    c.lock().unwrap_or_else(PoisonError::into_inner)
}

#[derive(Default)]
struct Counters {
    up: AtomicU64,
    down: AtomicU64,
}

/// Why a helper task ended the attachment.
type End = (u16, String);

async fn run(service: Arc<Service>, p: Principal, opened: BrokerOpen, socket: WebSocket) {
    let started = Instant::now();
    let BrokerOpen {
        vm_id,
        job,
        mut ticket,
        attachment,
    } = opened;
    let generation = attachment.generation();
    tracing::info!(workspace = %p.workspace, vm = %vm_id, job = %job, generation, "broker pipe attached");
    let (mut sink, source) = socket.split();
    let mut life = Lifeline::new(started);
    let conns: Shared = Arc::default();
    let counters = Arc::new(Counters::default());
    let (out_tx, mut out_rx) = mpsc::channel::<Vec<u8>>(64);
    let rate = service.streams().config().rate_bytes;
    let mut accept = tokio::spawn(accept(
        service.clone(),
        p.workspace.clone(),
        vm_id.clone(),
        generation,
        job,
        conns.clone(),
        out_tx.clone(),
    ));
    let mut upstream = tokio::spawn(upstream(
        source,
        conns.clone(),
        out_tx,
        RateLimit::new(rate),
        counters.clone(),
        life.heard(),
    ));
    let mut limit = RateLimit::new(rate);
    let mut job_check =
        tokio::time::interval_at(tokio::time::Instant::now() + JOB_CHECK, JOB_CHECK);
    let (code, reason): End = loop {
        tokio::select! {
            frame = out_rx.recv() => {
                let Some(frame) = frame else { break (INTERNAL, "internal error".into()) };
                let at = limit.debit(frame.len());
                counters.down.fetch_add(frame.len() as u64, Ordering::Relaxed);
                let msg = Message::Binary(frame.into());
                if let Some(end) = life.send(&service, &p, &mut sink, &mut ticket.closed, at, msg).await {
                    break end;
                }
            }
            end = &mut accept => break end.unwrap_or((INTERNAL, "internal error".into())),
            end = &mut upstream => break end.unwrap_or((INTERNAL, "internal error".into())),
            _ = ticket.closed.changed() => {
                let why = ticket.closed.borrow().map(|r| r.as_str()).unwrap_or("closed");
                break (GOING_AWAY, why.into());
            }
            _ = job_check.tick() => {
                if let Some(end) = check_job(&service, &vm_id, generation, job).await {
                    break end;
                }
            }
            duty = life.due() => {
                if let Some(end) = life.perform(duty, &service, &p, &vm_id, &mut sink, &mut ticket.closed).await {
                    break end;
                }
            }
        }
    };
    accept.abort();
    upstream.abort();
    for (_, c) in lock(&conns).live.drain() {
        c.task.abort();
    }
    if reason == JOB_FINISHED {
        service.broker_pipes().end(&vm_id, generation, job);
    }
    crate::ws::close(&service, &vm_id, &mut sink, code, &reason).await;
    tracing::info!(
        workspace = %p.workspace,
        vm = %vm_id,
        job = %job,
        duration_ms = started.elapsed().as_millis() as u64,
        bytes_in = counters.up.load(Ordering::Relaxed),
        bytes_out = counters.down.load(Ordering::Relaxed),
        code,
        reason = %crate::ws::escape(&reason),
        "broker pipe detached"
    );
    drop((attachment, ticket));
}

/// `Some` close when the VM is no longer in `generation`, the boot the attachment was made
/// for (it booted fresh, or it is gone): one database read. A record that cannot be read
/// ends the attachment too: nothing is taken from a boot that may not be its job's.
fn boot_check(service: &Service, vm: &str, generation: u64) -> Option<End> {
    match service.engine().get_vm(vm) {
        Ok(r) if r.generation == generation => None,
        Ok(r) => Some((
            GOING_AWAY,
            format!(
                "the VM booted fresh (generation {}): the job's boot is gone",
                r.generation
            ),
        )),
        Err(warren_core::CoreError::VmNotFound(_)) => {
            Some((GOING_AWAY, CloseReason::Destroyed.as_str().into()))
        }
        Err(e) => Some((INTERNAL, ApiError::from(e).message)),
    }
}

/// The periodic look at the job: `Some` close when the VM left `generation` (looked at before
/// and after the guest's answer, which is about whichever boot gave it: the look wakes a
/// suspended VM, and that wake may boot it fresh) or the job's processes are all gone.
/// Bounded: a guest slow to answer must not hold off the loop's other duties (the credential
/// recheck); no answer counts as not finished.
async fn check_job(service: &Service, vm: &str, generation: u64, job: JobId) -> Option<End> {
    if let Some(end) = boot_check(service, vm, generation) {
        return Some(end);
    }
    let done = tokio::time::timeout(JOB_CHECK_LIMIT, service.broker_job_done(vm, job)).await;
    if let Some(end) = boot_check(service, vm, generation) {
        return Some(end);
    }
    matches!(done, Ok(true)).then(|| (GOING_AWAY, JOB_FINISHED.into()))
}

/// Takes the job's connections one at a time while there is room, from the job's boot
/// (`generation`) only.
async fn accept(
    service: Arc<Service>,
    workspace: String,
    vm: String,
    generation: u64,
    job: JobId,
    conns: Shared,
    out: mpsc::Sender<Vec<u8>>,
) -> End {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let Ok(permit) = slots.clone().acquire_owned().await else {
            return (INTERNAL, "internal error".into());
        };
        // Not even asked of another boot's guest (its job of this number is not ours).
        if let Some(end) = boot_check(&service, &vm, generation) {
            return end;
        }
        let opened = service
            .engine()
            .open_stream(&vm, StreamTarget::BrokerAccept { job })
            .await;
        // The open wakes a suspended VM, which may boot it fresh: whatever the answer, it is
        // the new boot's then (the generation moved before that boot's supervisor started),
        // and the stream is dropped unread.
        if let Some(end) = boot_check(&service, &vm, generation) {
            return end;
        }
        let stream = match opened {
            Ok(s) => s,
            Err(e)
                if e.guest()
                    .is_some_and(|g| g.code == warren_protocol::ErrorCode::NotFound) =>
            {
                return (GOING_AWAY, JOB_FINISHED.into())
            }
            Err(e) => return (INTERNAL, ApiError::from(e).message),
        };
        let (mut reader, writer) = (stream.reader, stream.writer);
        let first = match reader.next().await {
            Ok(Ok(first)) if first.first() == Some(&BROKER_ACCEPTED) => first,
            // The guest ended the pipe while we waited: the job's processes are gone.
            Ok(Err(_)) => return (GOING_AWAY, JOB_FINISHED.into()),
            Ok(Ok(_)) => return (INTERNAL, "the guest sent no accept mark".into()),
            Err(e) => return (INTERNAL, format!("broker stream: {e}")),
        };
        // The connection's own place under the quotas. Until it has one it waits, and no
        // other connection is accepted: the attachment's own place covers it meanwhile.
        let mut logged = false;
        let ticket = loop {
            match service.streams().admit(&workspace, &vm) {
                Ok(t) => break t,
                Err(e) => {
                    if !logged {
                        tracing::info!(workspace = %workspace, vm = %vm, job = %job, code = e.code, "a broker connection waits for a stream place");
                        logged = true;
                    }
                    tokio::time::sleep(ADMIT_RETRY).await;
                }
            }
        };
        let (tx, rx) = mpsc::channel(QUEUE_BYTES / crate::broker::MAX_DATA);
        // Numbered, spawned and registered under one lock: the controller's frames for it
        // find it from the moment its id exists, and the task (which sends `open` before any
        // data) cannot unregister before it is registered.
        let mut c = lock(&conns);
        c.last_id += 1;
        let id = c.last_id;
        let task = tokio::spawn(connection(
            id,
            first[1..].to_vec(),
            reader,
            writer,
            rx,
            out.clone(),
            conns.clone(),
            (permit, ticket),
        ));
        c.live.insert(
            id,
            Conn {
                tx,
                task: task.abort_handle(),
            },
        );
    }
}

/// One guest connection: both directions until one side closed it (see the module docs).
#[allow(clippy::too_many_arguments)]
async fn connection(
    id: u32,
    first: Vec<u8>,
    mut reader: StreamReader,
    mut writer: StreamWriter,
    mut from_controller: mpsc::Receiver<ToGuest>,
    out: mpsc::Sender<Vec<u8>>,
    conns: Shared,
    _place: (tokio::sync::OwnedSemaphorePermit, crate::streams::Ticket),
) {
    let down = async {
        if out.send(open_frame(id)).await.is_err() {
            return;
        }
        if !first.is_empty() && out.send(data_frames(id, &first)).await.is_err() {
            return;
        }
        while let Ok(Ok(data)) = reader.next().await {
            if out.send(data_frames(id, &data)).await.is_err() {
                return;
            }
        }
    };
    let up = async {
        while let Some(m) = from_controller.recv().await {
            match m {
                ToGuest::Data(d) => {
                    if writer.send(&d).await.is_err() {
                        // The guest end is gone; its end arrives on the reader.
                        std::future::pending::<()>().await;
                    }
                }
                ToGuest::Close => {
                    let _ = writer.eof().await;
                    return;
                }
            }
        }
        std::future::pending::<()>().await;
    };
    let controller_closed = tokio::select! {
        () = down => false,
        () = up => true,
    };
    lock(&conns).live.remove(&id);
    if controller_closed {
        // The guest got its end of input; what it still sends is not wanted. Give it a moment
        // to close its end, then reset (dropping the halves).
        let _ = tokio::time::timeout(STALL, async {
            while let Ok(Ok(_)) = reader.next().await {}
        })
        .await;
    } else {
        let _ = out.send(close_frame(id)).await;
    }
}

/// The controller's messages: frames routed to their connections.
async fn upstream(
    mut source: SplitStream<WebSocket>,
    conns: Shared,
    out: mpsc::Sender<Vec<u8>>,
    mut limit: RateLimit,
    counters: Arc<Counters>,
    heard: crate::ws::Heard,
) -> End {
    let mut frames = FrameReader::default();
    while let Some(msg) = source.next().await {
        let Ok(msg) = msg else {
            return (POLICY, "malformed or oversized message".into());
        };
        heard.now();
        let data = match msg {
            Message::Binary(b) => b,
            Message::Ping(_) | Message::Pong(_) => continue,
            Message::Close(_) => return (NORMAL, "client closed".into()),
            Message::Text(_) => return (PROTOCOL, "broker messages are binary".into()),
        };
        limit.take(data.len()).await;
        counters.up.fetch_add(data.len() as u64, Ordering::Relaxed);
        let parsed = match frames.feed(&data) {
            Ok(f) => f,
            Err(e) => return (PROTOCOL, e.to_string()),
        };
        for frame in parsed {
            let (id, msg) = match frame {
                Frame::Data(id, d) => (id, ToGuest::Data(d)),
                Frame::Close(id) => (id, ToGuest::Close),
            };
            let target = {
                let c = lock(&conns);
                if id > c.last_id {
                    return (PROTOCOL, format!("connection {id} was never opened"));
                }
                c.live.get(&id).map(|c| c.tx.clone())
            };
            // A connection already closed: its frames are ignored.
            let Some(tx) = target else { continue };
            match tokio::time::timeout(STALL, tx.send(msg)).await {
                Ok(_) => {}
                Err(_) => {
                    // The guest stopped reading this connection: close it alone.
                    // (Only when it was still there: one that just ended sent its own close.)
                    let removed = lock(&conns).live.remove(&id);
                    if let Some(c) = removed {
                        c.task.abort();
                        if out.send(close_frame(id)).await.is_err() {
                            return (INTERNAL, "internal error".into());
                        }
                    }
                }
            }
        }
    }
    (NORMAL, "client closed".into())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;
    use tokio::net::UnixListener;
    use warren_core::store::{Store, VmRecord, VmState};
    use warren_protocol::{GuestResponse, HostRequest, JobOutput, JobState};
    use warren_supervisor::proto::{read_frame, write_frame, Reply, SupervisorRequest};
    use warren_supervisor::SupervisorResponse;

    pub(crate) const VM: &str = "vm-0123456789ab";

    /// A running VM `VM` of `workspace` in generation 1, in the database of
    /// `crate::ws::tests::test_service(dir)`, with the supervisor's lock held (what the engine
    /// checks before it trusts a running record) and its socket path free for a stand-in.
    /// Returns another handle on the database (to move the generation, as a fresh boot does),
    /// the lock and the VM's directory.
    pub(crate) fn running_vm(
        dir: &std::path::Path,
        workspace: &str,
    ) -> (
        Store,
        nix::fcntl::Flock<std::fs::File>,
        warren_supervisor::VmDir,
    ) {
        let state = dir.join("state");
        let store = Store::open(&state.join("warren.db")).expect("store");
        let mut rec = VmRecord {
            id: VM.into(),
            image_id: "0".repeat(64),
            state: VmState::Running,
            reason: None,
            memory_mib: 256,
            vcpus: 1,
            accel: "tcg".into(),
            uid: 0,
            created_unix: 0,
            boot_ms: None,
            workspace: workspace.into(),
            disk_mib: 0,
            generation: 1,
            request_id: None,
            idle_seconds: 0,
            idle_mode: "hibernate".into(),
            last_active_unix: 0,
            mounts: vec![],
            ram_file: false,
        };
        store
            .insert(&mut rec, 2_000_000, |_| Ok::<(), rusqlite::Error>(()))
            .expect("insert");
        let vm_dir = warren_supervisor::VmDir(state.join("vms").join(VM));
        std::fs::create_dir_all(&vm_dir.0).expect("vm dir");
        let lock = std::fs::File::create(vm_dir.lock()).expect("lock file");
        let lock = nix::fcntl::Flock::lock(lock, nix::fcntl::FlockArg::LockExclusiveNonblock)
            .expect("lock");
        (store, lock, vm_dir)
    }

    /// A stand-in supervisor answering one request on `listener`: a broker accept of job 1,
    /// answered with a connection whose first bytes are `b"hello"`, or a job output read,
    /// answered with `complete`. Before it answers, `fresh_boot` moves the VM to generation 2
    /// (the request woke the VM and its restore failed: the answer is the new boot's).
    pub(crate) fn supervisor(
        listener: UnixListener,
        fresh_boot: Option<Store>,
        complete: bool,
    ) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.expect("accept");
            let req: SupervisorRequest = read_frame(&mut s).await.expect("request");
            if let Some(store) = fresh_boot {
                assert_eq!(store.bump_generation(VM), Ok(2));
            }
            match req {
                SupervisorRequest::OpenStream(StreamTarget::BrokerAccept { job: JobId(1) }) => {
                    let reply: Reply = Ok(SupervisorResponse::StreamOpened);
                    write_frame(&mut s, &reply).await.expect("reply");
                    let first = [&[BROKER_ACCEPTED][..], b"hello"].concat();
                    warren_supervisor::stream_frame::write_data(&mut s, &first)
                        .await
                        .expect("accepted");
                    // Held until the service drops it.
                    let mut buf = [0u8; 64];
                    while matches!(s.read(&mut buf).await, Ok(n) if n > 0) {}
                }
                SupervisorRequest::Guest(HostRequest::JobOutput(r)) if r.job == JobId(1) => {
                    let reply: Reply = Ok(SupervisorResponse::Guest(GuestResponse::JobOutput(
                        JobOutput {
                            stdout: vec![],
                            stderr: vec![],
                            stdout_retained: 0,
                            stderr_retained: 0,
                            state: JobState::Running,
                            truncated: false,
                            output_complete: complete,
                            background_processes: 0,
                        },
                    )));
                    write_frame(&mut s, &reply).await.expect("reply");
                }
                other => panic!("unexpected request {other:?}"),
            }
        })
    }

    fn accept_job_1(
        service: &Arc<Service>,
        out: mpsc::Sender<Vec<u8>>,
    ) -> tokio::task::JoinHandle<End> {
        tokio::spawn(accept(
            service.clone(),
            "w".into(),
            VM.into(),
            1,
            JobId(1),
            Arc::default(),
            out,
        ))
    }

    fn is_fresh_boot(end: &End) -> bool {
        end.0 == GOING_AWAY && end.1.contains("booted fresh (generation 2)")
    }

    /// Control: an accept in the attachment's boot hands the connection to the controller.
    #[tokio::test]
    async fn test_accept_in_the_attachments_boot_opens_the_connection() {
        let dir = tempfile::tempdir().expect("tmp");
        let service = crate::ws::tests::test_service(dir.path());
        let (_store, _lock, vm_dir) = running_vm(dir.path(), "w");
        let guest = supervisor(
            UnixListener::bind(vm_dir.socket()).expect("bind"),
            None,
            false,
        );
        let (out, mut from_accept) = mpsc::channel(64);
        let task = accept_job_1(&service, out);
        let got = tokio::time::timeout(Duration::from_secs(10), from_accept.recv()).await;
        assert_eq!(got.expect("in time"), Some(open_frame(1)));
        let got = tokio::time::timeout(Duration::from_secs(10), from_accept.recv()).await;
        assert_eq!(got.expect("in time"), Some(data_frames(1, b"hello")));
        task.abort();
        drop(guest);
    }

    /// The accept's open wakes the VM, whose restore fails: it boots fresh (generation 2) and
    /// the new boot's job 1 (same number, another job) connects. Nothing of it reaches the
    /// controller, and the attachment ends with 1001. (Before, the generation was looked at
    /// only when the attachment opened: the new boot's connection was opened to the old
    /// job's controller, its bytes sent.)
    #[tokio::test]
    async fn test_accept_takes_nothing_from_a_boot_its_own_wake_began() {
        let dir = tempfile::tempdir().expect("tmp");
        let service = crate::ws::tests::test_service(dir.path());
        let (store, _lock, vm_dir) = running_vm(dir.path(), "w");
        let listener = UnixListener::bind(vm_dir.socket()).expect("bind");
        let guest = supervisor(listener, Some(store), false);
        let (out, mut from_accept) = mpsc::channel(64);
        let end = tokio::time::timeout(Duration::from_secs(10), accept_job_1(&service, out))
            .await
            .expect("the attachment ends")
            .expect("accept");
        assert!(is_fresh_boot(&end), "{end:?}");
        assert_eq!(
            from_accept.recv().await,
            None,
            "nothing sent to the controller"
        );
        // The stream was dropped unread: the stand-in saw its end.
        tokio::time::timeout(Duration::from_secs(10), guest)
            .await
            .expect("the stream was dropped")
            .expect("stand-in");
    }

    /// The VM booted fresh while the attachment held no accept (suspended from the CLI, its
    /// restore failed): the next accept is not even asked of the new boot's guest.
    #[tokio::test]
    async fn test_accept_after_a_fresh_boot_asks_nothing_of_the_new_boot() {
        let dir = tempfile::tempdir().expect("tmp");
        let service = crate::ws::tests::test_service(dir.path());
        let (store, _lock, vm_dir) = running_vm(dir.path(), "w");
        let listener = UnixListener::bind(vm_dir.socket()).expect("bind");
        assert_eq!(store.bump_generation(VM), Ok(2));
        let (out, mut from_accept) = mpsc::channel(64);
        let end = tokio::time::timeout(Duration::from_secs(10), accept_job_1(&service, out))
            .await
            .expect("the attachment ends")
            .expect("accept");
        assert!(is_fresh_boot(&end), "{end:?}");
        assert_eq!(from_accept.recv().await, None);
        assert!(
            tokio::time::timeout(Duration::from_millis(200), listener.accept())
                .await
                .is_err(),
            "the new boot's supervisor was asked"
        );
    }

    /// The periodic job look: its answer counts only from the attachment's boot. A look whose
    /// wake booted the VM fresh ends the attachment for the boot, not as `job finished`
    /// (which would forget the pipe by number); control: from the same boot, a job whose
    /// processes are gone is `job finished`. (Before, the new boot's answer was taken.)
    #[tokio::test]
    async fn test_job_check_takes_no_answer_of_another_boot() {
        let dir = tempfile::tempdir().expect("tmp");
        let service = crate::ws::tests::test_service(dir.path());
        let (store, _lock, vm_dir) = running_vm(dir.path(), "w");
        let guest = supervisor(
            UnixListener::bind(vm_dir.socket()).expect("bind"),
            None,
            true,
        );
        let end = check_job(&service, VM, 1, JobId(1)).await;
        assert_eq!(end, Some((GOING_AWAY, JOB_FINISHED.into())), "control");
        guest.await.expect("stand-in");
        std::fs::remove_file(vm_dir.socket()).expect("socket");

        let listener = UnixListener::bind(vm_dir.socket()).expect("bind");
        let guest = supervisor(listener, Some(store), true);
        let end = check_job(&service, VM, 1, JobId(1)).await;
        assert!(end.as_ref().is_some_and(is_fresh_boot), "{end:?}");
        guest.await.expect("stand-in");
        // Already moved: the guest is not asked.
        let end = check_job(&service, VM, 1, JobId(1)).await;
        assert!(end.as_ref().is_some_and(is_fresh_boot), "{end:?}");
    }

    #[test]
    fn test_boot_check_of_a_destroyed_vm_ends_the_attachment() {
        let dir = tempfile::tempdir().expect("tmp");
        let service = crate::ws::tests::test_service(dir.path());
        assert_eq!(
            boot_check(&service, VM, 1),
            Some((GOING_AWAY, "destroyed".into()))
        );
    }
}
