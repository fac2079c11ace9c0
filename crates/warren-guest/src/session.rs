//! One authenticated HTTP/2 session with the host, and the dispatch of its requests.
//!
//! A session is created by [`crate::channel`] for every `Sync` the host sends and lives until
//! the next one (its task is then aborted, which drops the h2 connection and every request
//! task of the session). Steps of a session, in order:
//! 1. h2 server handshake over the in-memory stream the channel feeds;
//! 2. `Hello`: version negotiation and the guest's proof (see `warren_protocol::auth`);
//! 3. `Auth`: the host's proof; on success the guest sets its clock, mixes in the host's
//!    entropy and answers `AgentInfo`;
//! 4. any other request, each on its own task; before step 3 they get `Unauthenticated`.
//!
//! A request is a POST to `RPC_PATH` whose body is one postcard `HostRequest`; the answer is
//! status 200 with one postcard `Response`. When the host resets a stream, the request's
//! future is dropped (this is how a long-poll is cancelled).

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use h2::server::SendResponse;
use h2::RecvStream;
use nix::sys::time::TimeSpec;
use nix::time::{clock_gettime, clock_settime, ClockId};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::task::JoinSet;
use warren_protocol::auth::{guest_proof, host_proof, verify, NONCE_LEN};
use warren_protocol::limits::MAX_MESSAGE_BYTES;
use warren_protocol::{
    AgentInfo, Auth, ErrorCode, GuestError, GuestResponse, Hello, HelloReply, HostRequest,
    Response, MIN_PROTOCOL_VERSION, PROTOCOL_VERSION, RPC_PATH,
};

use crate::files::{self, FilesConfig};
use crate::jobs::JobManager;
use crate::workspace_ops;

pub use crate::identity::Secret;

/// Which system-wide side effects requests may have.
#[derive(Debug)]
pub struct System {
    /// In the guest (PID 1): set the clock, feed entropy, power off for real. Off in tests.
    pub pid1: bool,
    /// A `PowerOff` was requested (what tests observe instead of a power-off).
    pub power_off_requested: AtomicBool,
    /// The virtio-fs shares, revalidated on every `Thaw` ([`crate::coherence`]).
    pub shares: crate::coherence::Shares,
}

/// Delay between answering `PowerOff` and powering off, so the reply reaches the host.
const POWER_OFF_DELAY: Duration = Duration::from_millis(300);

/// Everything requests act on; shared by all sessions.
pub struct Agent {
    pub jobs: Arc<JobManager>,
    pub files: FilesConfig,
    pub secret: Secret,
    pub system: System,
}

#[derive(Debug, Clone, Copy)]
enum AuthState {
    Fresh,
    Challenged {
        host_nonce: [u8; NONCE_LEN],
        guest_nonce: [u8; NONCE_LEN],
    },
    Authenticated,
}

/// Why a session ended abnormally.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error("http/2 handshake")]
    Handshake(#[source] h2::Error),
    #[error("http/2 connection")]
    Connection(#[source] h2::Error),
}

/// h2 settings: windows large enough for a file chunk in flight on a ~200 MB/s port; the
/// host's frames are at most 64 KiB, so a stream's target gets data while the next frame
/// arrives, and a short request is not queued behind much of a stream's data.
const STREAM_WINDOW: u32 = 2 * 1024 * 1024;
const CONNECTION_WINDOW: u32 = 8 * 1024 * 1024;
const MAX_FRAME: u32 = 64 * 1024;

/// Serves one session over `io` until the host goes away or the task is aborted.
pub async fn serve<IO>(agent: Arc<Agent>, io: IO) -> Result<(), SessionError>
where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let mut conn = h2::server::Builder::new()
        .initial_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .max_frame_size(MAX_FRAME)
        .max_send_buffer_size(MAX_MESSAGE_BYTES + 64 * 1024)
        .handshake::<_, Bytes>(io)
        .await
        .map_err(SessionError::Handshake)?;
    let auth = Arc::new(Mutex::new(AuthState::Fresh));
    // Dropping the set (session end) aborts every request of the session.
    let mut requests = JoinSet::new();
    loop {
        tokio::select! {
            next = conn.accept() => match next {
                Some(Ok((req, respond))) => {
                    requests.spawn(handle(agent.clone(), auth.clone(), req, respond));
                }
                Some(Err(e)) => return Err(SessionError::Connection(e)),
                None => return Ok(()),
            },
            Some(_) = requests.join_next(), if !requests.is_empty() => {}
        }
    }
}

enum Reply {
    Body(Vec<u8>),
    Status(http::StatusCode),
    /// The request stream failed; nothing can be sent.
    Abandon,
}

async fn handle(
    agent: Arc<Agent>,
    auth: Arc<Mutex<AuthState>>,
    req: http::Request<RecvStream>,
    mut respond: SendResponse<Bytes>,
) {
    if req.uri().path() == warren_protocol::stream::STREAM_PATH {
        let authenticated = matches!(*lock(&auth), AuthState::Authenticated);
        // A reset stream or a session end drops this task (and with it the target).
        return crate::streams::serve(agent, authenticated, req, respond).await;
    }
    let work = async {
        let request = match read_request(req).await {
            Ok(request) => request,
            Err(reply) => return reply,
        };
        if !runs_to_completion(&request) {
            return encode(dispatch(&agent, &auth, request).await);
        }
        // Its own task: a reset (or the session's end) leaves it running to its end.
        let (agent, auth) = (agent.clone(), auth.clone());
        tokio::spawn(async move { encode(dispatch(&agent, &auth, request).await) })
            .await
            .unwrap_or(Reply::Status(http::StatusCode::INTERNAL_SERVER_ERROR))
    };
    tokio::pin!(work);
    let reply = tokio::select! {
        reply = &mut work => reply,
        // The host reset the stream: a read or a long-poll is dropped unanswered; a change
        // goes on in its task (see [`runs_to_completion`]).
        _ = std::future::poll_fn(|cx| respond.poll_reset(cx)) => return,
    };
    let (status, body) = match reply {
        Reply::Body(body) => (http::StatusCode::OK, Some(body)),
        Reply::Status(status) => (status, None),
        Reply::Abandon => return,
    };
    let head = match http::Response::builder().status(status).body(()) {
        Ok(head) => head,
        Err(_) => return,
    };
    let Ok(mut stream) = respond.send_response(head, body.is_none()) else {
        return;
    };
    if let Some(body) = body {
        // Queued in the connection; it is flushed even after `stream` is dropped.
        let _ = stream.send_data(Bytes::from(body), true);
    }
}

/// Reads and decodes a request; `Err` holds the reply to a bad one.
async fn read_request(req: http::Request<RecvStream>) -> Result<HostRequest, Reply> {
    if req.uri().path() != RPC_PATH {
        return Err(Reply::Status(http::StatusCode::NOT_FOUND));
    }
    if req.method() != http::Method::POST {
        return Err(Reply::Status(http::StatusCode::METHOD_NOT_ALLOWED));
    }
    let mut body = req.into_body();
    let mut buf = Vec::new();
    while let Some(chunk) = body.data().await {
        let Ok(chunk) = chunk else {
            return Err(Reply::Abandon);
        };
        let _ = body.flow_control().release_capacity(chunk.len());
        if buf.len() + chunk.len() > MAX_MESSAGE_BYTES {
            return Err(encode(Err(GuestError::new(
                ErrorCode::InvalidArgument,
                "request exceeds the message size limit",
            ))));
        }
        buf.extend_from_slice(&chunk);
    }
    warren_protocol::decode::<HostRequest>(&buf).map_err(|e| {
        encode(Err(GuestError::new(
            ErrorCode::InvalidArgument,
            format!("undecodable request: {e}"),
        )))
    })
}

/// Requests that change something: once begun they run to their end even when the host
/// resets the stream or the session ends. Cut half-way, a thaw would set the clock and leave
/// the jobs frozen, a write would be torn. Reads and long-polls are dropped with their
/// stream, and so is a job's input: it waits on the job's pace (see `jobs::interactive`),
/// so kept past its stream it could pile up in the agent and arrive after the input that
/// replaced it. Every variant is named, so a new request is placed on purpose.
fn runs_to_completion(req: &HostRequest) -> bool {
    match req {
        HostRequest::Hello(_)
        | HostRequest::Auth(_)
        | HostRequest::Ping
        | HostRequest::JobList
        | HostRequest::JobOutput(_)
        | HostRequest::JobOutputAcked(_)
        | HostRequest::FileRead(_)
        | HostRequest::ReadVersioned(_)
        | HostRequest::Glob(_)
        | HostRequest::Grep(_)
        | HostRequest::Bench(_)
        | HostRequest::Discard(_)
        | HostRequest::Source(_)
        | HostRequest::JobInput(_) => false,
        HostRequest::ExecStart(_)
        | HostRequest::ExecBroker(_)
        | HostRequest::ExecInteractive(_)
        | HostRequest::JobResize(_)
        | HostRequest::JobCancel(_)
        | HostRequest::FileWrite(_)
        | HostRequest::WriteChecked(_)
        | HostRequest::Edit(_)
        | HostRequest::Freeze
        | HostRequest::Thaw(_)
        | HostRequest::InstallCa(_)
        | HostRequest::Rekey(_)
        | HostRequest::PowerOff => true,
    }
}

fn encode(response: Response) -> Reply {
    match warren_protocol::encode(&response) {
        Ok(body) => Reply::Body(body),
        Err(e) => match warren_protocol::encode::<Response>(&Err(GuestError::new(
            ErrorCode::Internal,
            format!("encode response: {e}"),
        ))) {
            Ok(body) => Reply::Body(body),
            Err(_) => Reply::Status(http::StatusCode::INTERNAL_SERVER_ERROR),
        },
    }
}

fn lock(auth: &Mutex<AuthState>) -> std::sync::MutexGuard<'_, AuthState> {
    auth.lock().unwrap_or_else(PoisonError::into_inner)
}

async fn dispatch(agent: &Arc<Agent>, auth: &Mutex<AuthState>, req: HostRequest) -> Response {
    match req {
        HostRequest::Hello(hello) => say_hello(agent, auth, &hello),
        HostRequest::Auth(proof) => authenticate(agent, auth, &proof),
        other => {
            if !matches!(*lock(auth), AuthState::Authenticated) {
                return Err(GuestError::new(
                    ErrorCode::Unauthenticated,
                    "authenticate with Hello and Auth first",
                ));
            }
            serve_request(agent, other).await
        }
    }
}

fn say_hello(agent: &Agent, auth: &Mutex<AuthState>, hello: &Hello) -> Response {
    let mut state = lock(auth);
    if matches!(*state, AuthState::Authenticated) {
        return Err(GuestError::new(
            ErrorCode::InvalidArgument,
            "session already authenticated",
        ));
    }
    let version = hello.max_version.min(PROTOCOL_VERSION);
    if version < hello.min_version.max(MIN_PROTOCOL_VERSION) {
        *state = AuthState::Fresh;
        return Err(GuestError::new(
            ErrorCode::VersionMismatch,
            format!(
                "guest speaks {MIN_PROTOCOL_VERSION}..={PROTOCOL_VERSION}, host {}..={}",
                hello.min_version, hello.max_version
            ),
        ));
    }
    // Hashed with the host's nonce: copies of one memory image differ from their first Hello.
    let guest_nonce = crate::identity::session_nonce(fresh_nonce(), &hello.host_nonce);
    *state = AuthState::Challenged {
        host_nonce: hello.host_nonce,
        guest_nonce,
    };
    Ok(GuestResponse::Hello(HelloReply {
        version,
        guest_nonce,
        proof: guest_proof(&agent.secret.get(), &hello.host_nonce, &guest_nonce),
    }))
}

/// A guest nonce that never blocks. At boot the kernel's CRNG may not be initialised yet (no
/// RDRAND under TCG) and a blocking `getrandom` would hang `Hello` until the host's entropy,
/// which only arrives with `Auth`. A nonce needs uniqueness, not secrecy: `GRND_INSECURE`
/// bytes mixed with the boot-time clock and a per-boot counter provide it.
fn fresh_nonce() -> [u8; NONCE_LEN] {
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let mut nonce = [0u8; NONCE_LEN];
    let mut filled = 0;
    while filled < NONCE_LEN {
        match rustix::rand::getrandom(&mut nonce[filled..], rustix::rand::GetRandomFlags::INSECURE)
        {
            Ok(n) => filled += n,
            Err(rustix::io::Errno::INTR) => {}
            Err(_) => break,
        }
    }
    let now = clock_gettime(ClockId::CLOCK_BOOTTIME)
        .map(|t| (t.tv_sec() as u64).wrapping_mul(1_000_000_000) ^ t.tv_nsec() as u64)
        .unwrap_or(0);
    let count = COUNTER.fetch_add(1, Ordering::Relaxed);
    for (byte, extra) in nonce
        .iter_mut()
        .zip(now.to_le_bytes().into_iter().chain(count.to_le_bytes()))
    {
        *byte ^= extra;
    }
    nonce
}

fn authenticate(agent: &Agent, auth: &Mutex<AuthState>, req: &Auth) -> Response {
    {
        let mut state = lock(auth);
        match *state {
            AuthState::Challenged {
                host_nonce,
                guest_nonce,
            } => {
                let expected = host_proof(&agent.secret.get(), &host_nonce, &guest_nonce);
                if !verify(&expected, &req.proof) {
                    // One attempt per challenge: a new Hello is needed.
                    *state = AuthState::Fresh;
                    return Err(GuestError::new(ErrorCode::Unauthenticated, "bad proof"));
                }
                *state = AuthState::Authenticated;
            }
            AuthState::Fresh => {
                return Err(GuestError::new(ErrorCode::Unauthenticated, "Hello first"))
            }
            AuthState::Authenticated => {
                return Err(GuestError::new(
                    ErrorCode::InvalidArgument,
                    "session already authenticated",
                ))
            }
        }
    }
    if agent.system.pid1 {
        set_clock(req.unix_time_ns);
        add_entropy(&req.entropy);
    }
    Ok(GuestResponse::Authenticated(agent_info()))
}

pub(crate) fn set_clock(unix_time_ns: u64) {
    let secs = i64::try_from(unix_time_ns / 1_000_000_000).unwrap_or(i64::MAX);
    let nanos = i64::try_from(unix_time_ns % 1_000_000_000).unwrap_or(0);
    if let Err(e) = clock_settime(ClockId::CLOCK_REALTIME, TimeSpec::new(secs, nanos)) {
        crate::console::log(format_args!("set clock: {e}"));
    }
}

pub(crate) fn add_entropy(entropy: &[u8; 32]) {
    let urandom = match OpenOptions::new().write(true).open("/dev/urandom") {
        Ok(f) => f,
        Err(e) => {
            crate::console::log(format_args!("open /dev/urandom: {e}"));
            return;
        }
    };
    if let Err(e) = crate::sys::add_entropy(&urandom, entropy) {
        crate::console::log(format_args!("RNDADDENTROPY: {e}; mixing without credit"));
        let mut f: &File = &urandom;
        let _ = f.write_all(entropy);
    }
    if let Err(e) = crate::sys::reseed_crng(&urandom) {
        crate::console::log(format_args!("RNDRESEEDCRNG: {e}"));
    }
}

fn agent_info() -> AgentInfo {
    let boot_id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_owned())
        .unwrap_or_default();
    let uptime_ms = clock_gettime(ClockId::CLOCK_BOOTTIME)
        .map(|t| {
            let ms = t.tv_sec() * 1000 + t.tv_nsec() / 1_000_000;
            u64::try_from(ms).unwrap_or(0)
        })
        .unwrap_or(0);
    AgentInfo {
        agent_version: env!("CARGO_PKG_VERSION").to_owned(),
        kernel_release: rustix::system::uname()
            .release()
            .to_string_lossy()
            .into_owned(),
        boot_id,
        uptime_ms,
    }
}

/// Largest `Source` payload that still fits one message (tags and length prefix included).
const SOURCE_MAX: usize = MAX_MESSAGE_BYTES - 16;

/// The `Freeze` half of [`crate::coherence`]. A failure is logged on the console; the `Thaw`
/// half then does the whole pass.
async fn prepare_shares(shares: &crate::coherence::Shares) {
    share_pass(shares, "preparation", |s| {
        s.before_suspend().map(|()| false)
    })
    .await;
}

/// The `Thaw` half: brings every share's cached view up to date before the jobs thaw. A
/// failure is logged on the console and the jobs thaw regardless: they ran against the same
/// share before the suspension.
async fn revalidate_shares(shares: &crate::coherence::Shares) {
    share_pass(shares, "revalidation", |s| {
        s.after_resume().map(|r| r.truncated)
    })
    .await;
}

/// Runs one half of [`crate::coherence`] off the runtime thread, under a deadline; `pass`
/// answers whether it stopped at a limit.
async fn share_pass(
    shares: &crate::coherence::Shares,
    what: &'static str,
    pass: fn(&crate::coherence::Shares) -> std::io::Result<bool>,
) {
    if shares.is_empty() {
        return;
    }
    let shares = shares.clone();
    let work = tokio::task::spawn_blocking(move || pass(&shares));
    match tokio::time::timeout(crate::coherence::DEADLINE * 2, work).await {
        Ok(Ok(Ok(false))) => {}
        Ok(Ok(Ok(true))) => crate::console::log(format_args!("share {what} stopped at a limit")),
        Ok(Ok(Err(e))) => crate::console::log(format_args!("share {what} failed: {e}")),
        Ok(Err(e)) => crate::console::log(format_args!("share {what} panicked: {e}")),
        Err(_) => crate::console::log(format_args!("share {what} timed out")),
    }
}

async fn serve_request(agent: &Arc<Agent>, req: HostRequest) -> Response {
    match req {
        HostRequest::Hello(_) | HostRequest::Auth(_) => Err(GuestError::new(
            ErrorCode::InvalidArgument,
            "session already authenticated",
        )),
        HostRequest::Ping => Ok(GuestResponse::Pong),
        HostRequest::JobList => Ok(GuestResponse::Jobs(agent.jobs.list())),
        HostRequest::Freeze => {
            let frozen = agent.jobs.freeze();
            if frozen.is_ok() && agent.system.pid1 {
                prepare_shares(&agent.system.shares).await;
                // A checkpoint or a fork copy carries the disk as it is now.
                crate::identity_files::flush();
            }
            frozen.map(GuestResponse::Frozen)
        }
        HostRequest::Thaw(t) => {
            if agent.system.pid1 {
                set_clock(t.unix_time_ns);
                add_entropy(&t.entropy);
                revalidate_shares(&agent.system.shares).await;
            }
            agent.jobs.thaw().map(|()| GuestResponse::Thawed)
        }
        HostRequest::ExecStart(exec) => {
            agent.jobs.start(exec).await.map(GuestResponse::ExecStarted)
        }
        HostRequest::ExecBroker(exec) => agent
            .jobs
            .start_broker(exec)
            .await
            .map(GuestResponse::ExecStarted),
        HostRequest::JobOutput(req) => agent.jobs.output(&req).await.map(GuestResponse::JobOutput),
        HostRequest::JobOutputAcked(req) => agent
            .jobs
            .output_acked(&req)
            .await
            .map(GuestResponse::JobOutput),
        HostRequest::ExecInteractive(req) => agent
            .jobs
            .start_interactive(req)
            .await
            .map(GuestResponse::ExecStarted),
        HostRequest::JobInput(req) => agent
            .jobs
            .input(req)
            .await
            .map(|()| GuestResponse::InputWritten),
        HostRequest::InstallCa(pem) => {
            let bundle = blocking(move || crate::trust::install(&pem)).await?;
            agent.jobs.set_extra_env(crate::trust::env_for(&bundle));
            Ok(GuestResponse::CaInstalled)
        }
        HostRequest::Rekey(req) => crate::identity::handle(&agent.secret, agent.system.pid1, &req),
        HostRequest::JobResize(req) => agent.jobs.resize(req).map(|()| GuestResponse::Resized),
        HostRequest::JobCancel(id) => agent.jobs.cancel(id).map(|()| GuestResponse::JobCancelled),
        HostRequest::FileRead(req) => {
            let cfg = agent.files.clone();
            blocking(move || files::read(&cfg, &req))
                .await
                .map(GuestResponse::FileData)
        }
        HostRequest::FileWrite(req) => {
            let cfg = agent.files.clone();
            blocking(move || files::write(&cfg, &req))
                .await
                .map(GuestResponse::FileWritten)
        }
        HostRequest::ReadVersioned(req) => {
            let cfg = agent.files.clone();
            blocking(move || workspace_ops::read_versioned(&cfg, &req))
                .await
                .map(GuestResponse::VersionedData)
        }
        HostRequest::WriteChecked(req) => {
            let cfg = agent.files.clone();
            blocking(move || workspace_ops::write_checked(&cfg, &req))
                .await
                .map(GuestResponse::FileVersioned)
        }
        HostRequest::Edit(req) => {
            let cfg = agent.files.clone();
            blocking(move || workspace_ops::edit(&cfg, &req))
                .await
                .map(GuestResponse::FileVersioned)
        }
        HostRequest::Glob(req) => {
            let cfg = agent.files.clone();
            blocking(move || workspace_ops::glob(&cfg, &req))
                .await
                .map(GuestResponse::Glob)
        }
        HostRequest::Grep(req) => {
            let cfg = agent.files.clone();
            blocking(move || workspace_ops::grep(&cfg, &req))
                .await
                .map(GuestResponse::Grep)
        }
        HostRequest::Bench(warren_protocol::BenchRequest::ForkExecWait { iterations }) => agent
            .jobs
            .bench_fork_exec_wait(iterations)
            .await
            .map(GuestResponse::Bench),
        HostRequest::Discard(_) => Ok(GuestResponse::Discarded),
        HostRequest::Source(n) => {
            let n = usize::try_from(n).unwrap_or(usize::MAX).min(SOURCE_MAX);
            Ok(GuestResponse::Source(vec![0; n]))
        }
        HostRequest::PowerOff => {
            power_off_soon(&agent.system);
            Ok(GuestResponse::PoweringOff)
        }
    }
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, GuestError> + Send + 'static,
) -> Result<T, GuestError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| GuestError::new(ErrorCode::Internal, format!("file task: {e}")))?
}

fn power_off_soon(system: &System) {
    system.power_off_requested.store(true, Ordering::SeqCst);
    if !system.pid1 {
        return;
    }
    crate::identity_files::flush();
    nix::unistd::sync();
    tokio::spawn(async {
        tokio::time::sleep(POWER_OFF_DELAY).await;
        crate::boot::power_off();
    });
}

#[cfg(test)]
#[path = "session_tests.rs"]
mod tests;
