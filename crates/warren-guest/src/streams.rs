//! Guest streams: the guest end of `warren_protocol::stream` (see its module docs for the
//! wire steps).
//!
//! One task per stream, run by the session that accepted it (a resync or a host reset drops
//! it). The task opens the target, answers 200, then moves bytes both ways until the target
//! ends its output:
//! - host -> target: request body chunks are written to the target and only then released
//!   to the HTTP/2 window, so a slow target slows the host down; the end of the body shuts
//!   the target's input (TCP half-close, or `tar`'s standard input closed);
//! - target -> host: the target is read in chunks no larger than the window the host grants
//!   ([`warren_protocol::stream::send_paced`]); its end of output ends the body, followed by
//!   the exit trailers.
//!
//! A `tar` helper runs as the guest user outside job accounting and is killed when the
//! stream is abandoned (the [`Helper`] guard).

use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use h2::server::SendResponse;
use h2::{RecvStream, SendStream};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::watch;
use warren_protocol::stream::{
    self, StreamTarget, BROKER_ACCEPTED, ERROR_TRAILER, EXIT_TRAILER, MAX_STREAM_PATH,
    STREAM_HEADER,
};
use warren_protocol::{ErrorCode, GuestError};

use crate::bulk::BulkGate;
use crate::jobs::JobManager;
use crate::reaper::ExitStatus;
use crate::session::Agent;
use crate::unpack::Staging;

/// How long connecting to a guest port may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// Largest chunk read from a target at once (one HTTP/2 frame to the host).
const READ_CHUNK: usize = 64 * 1024;
/// `tar`'s blocking factor for the helpers, in 512-byte blocks: 64 KiB records, one HTTP/2
/// frame. GNU tar's default (10 KiB) makes a pipe read or write per 10 KiB, and each is a
/// wake-up of the agent or the helper on the guest's one vCPU: twice as slow under TCG.
/// Reading its standard input, tar takes short reads as they come (`--read-full-records` is
/// implied), so the host's archive may end anywhere. Only for GNU tar ([`tar_blocking`]).
const TAR_BLOCKING: &str = "128";
/// How long asking `tar --version` may take.
const PROBE_LIMIT: Duration = Duration::from_secs(10);

/// The size of a `tar` helper's standard input and output pipes.
const HELPER_PIPE: usize = 1 << 20;
/// Most of a `tar` helper's standard error kept for the error trailer.
const MAX_STDERR: usize = 4096;

/// Serves one stream request. `authenticated` is the session's state when it arrived.
pub async fn serve(
    agent: Arc<Agent>,
    authenticated: bool,
    req: http::Request<RecvStream>,
    mut respond: SendResponse<Bytes>,
) {
    let target = if authenticated {
        parse_target(&req)
    } else {
        Err(GuestError::new(
            ErrorCode::Unauthenticated,
            "authenticate with Hello and Auth first",
        ))
    };
    let opened = match target {
        Ok(StreamTarget::BrokerAccept { job }) => {
            return serve_broker(&agent, job, req, respond).await
        }
        Ok(t) => open(&agent, t).await,
        Err(e) => Err(e),
    };
    let target = match opened {
        Ok(t) => t,
        Err(e) => return refuse(&mut respond, e),
    };
    let head = http::Response::builder()
        .status(http::StatusCode::OK)
        .body(())
        .expect("invariant: static response parts are valid");
    let Ok(send) = respond.send_response(head, false) else {
        return;
    };
    let body = req.into_body();
    match target {
        Opened::Tcp(tcp) => {
            let (rd, wr) = tcp.into_split();
            let outcome = pump(&agent.jobs.bulk, body, wr, rd, send, |_| async {
                (0, None)
            })
            .await;
            if let Err(e) = outcome {
                crate::console::log(format_args!("stream ended: {e}"));
            }
        }
        Opened::Tar(mut helper) => {
            let (Some(stdin), Some(stdout)) = (helper.stdin.take(), helper.stdout.take()) else {
                return;
            };
            let stdin = tokio::process::ChildStdin::from_std(stdin);
            let stdout = tokio::process::ChildStdout::from_std(stdout);
            let (Ok(stdin), Ok(stdout)) = (stdin, stdout) else {
                return;
            };
            let outcome = pump(&agent.jobs.bulk, body, stdin, stdout, send, |ended| {
                helper.finish(ended)
            })
            .await;
            if let Err(e) = outcome {
                crate::console::log(format_args!("tar stream ended: {e}"));
            }
        }
    }
}

enum Opened {
    Tcp(TcpStream),
    Tar(Helper),
}

fn parse_target(req: &http::Request<RecvStream>) -> Result<StreamTarget, GuestError> {
    let header = req
        .headers()
        .get(STREAM_HEADER)
        .ok_or_else(|| invalid("no stream target"))?;
    StreamTarget::from_header(header.as_bytes()).map_err(|e| invalid(format!("stream target: {e}")))
}

/// A broker accept: 200 at once, then [`BROKER_ACCEPTED`] and the connection's bytes once a
/// process of the job connects (or an error end when the pipe ends first). A host that
/// resets the stream while it waits gives its turn up.
async fn serve_broker(
    agent: &Agent,
    job: warren_protocol::JobId,
    req: http::Request<RecvStream>,
    mut respond: SendResponse<Bytes>,
) {
    let broker = match agent.jobs.broker(job) {
        Ok(b) => b,
        Err(e) => return refuse(&mut respond, e),
    };
    let head = http::Response::builder()
        .status(http::StatusCode::OK)
        .body(())
        .expect("invariant: static response parts are valid");
    let Ok(mut send) = respond.send_response(head, false) else {
        return;
    };
    let conn = tokio::select! {
        c = broker.next() => c,
        _ = std::future::poll_fn(|cx| send.poll_reset(cx)) => return,
    };
    drop(broker);
    let Some(conn) = conn else {
        let mut trailers = http::HeaderMap::new();
        trailers.insert(EXIT_TRAILER, http::HeaderValue::from_static("-1"));
        trailers.insert(
            ERROR_TRAILER,
            http::HeaderValue::from_static("the job's broker pipe ended"),
        );
        let _ = send.send_trailers(trailers);
        return;
    };
    if stream::send_paced(&mut send, Bytes::from_static(&[BROKER_ACCEPTED]))
        .await
        .is_err()
    {
        return;
    }
    if let Err(e) = pump_broker(req.into_body(), conn, send).await {
        crate::console::log(format_args!("broker stream ended: {e}"));
    }
}

/// How often a broker connection whose job shut its writing side is checked for a full
/// close.
const HANGUP_POLL: Duration = Duration::from_millis(200);

/// [`pump`] for a broker connection, where the job's half-close is not the end: a client
/// that shut its writing side still reads the reply. The stream ends when the job closed
/// the connection altogether (a hangup) or the host ended its input and the job then
/// closed.
async fn pump_broker(
    mut body: RecvStream,
    conn: tokio::net::UnixStream,
    mut send: SendStream<Bytes>,
) -> Result<(), h2::Error> {
    use std::os::fd::AsFd;
    let (mut rd, mut wr) = conn.into_split();
    let inbound = async {
        while let Some(chunk) = body.data().await {
            let chunk = chunk?;
            let n = chunk.len();
            let _ = wr.write_all(&chunk).await;
            let _ = body.flow_control().release_capacity(n);
        }
        let _ = wr.shutdown().await;
        std::future::pending::<()>().await;
        Ok::<(), h2::Error>(())
    };
    let outbound = async {
        let mut buf = vec![0u8; READ_CHUNK];
        while let Ok(n) = rd.read(&mut buf).await {
            if n == 0 {
                break;
            }
            stream::send_paced(&mut send, Bytes::copy_from_slice(&buf[..n])).await?;
        }
        loop {
            let mut fds = [nix::poll::PollFd::new(
                rd.as_ref().as_fd(),
                nix::poll::PollFlags::empty(),
            )];
            let hung_up = match nix::poll::poll(&mut fds, nix::poll::PollTimeout::ZERO) {
                Ok(_) => fds[0].revents().is_some_and(|r| {
                    r.intersects(nix::poll::PollFlags::POLLHUP | nix::poll::PollFlags::POLLERR)
                }),
                Err(_) => true,
            };
            if hung_up {
                break;
            }
            tokio::time::sleep(HANGUP_POLL).await;
        }
        let mut trailers = http::HeaderMap::new();
        trailers.insert(EXIT_TRAILER, http::HeaderValue::from_static("0"));
        send.send_trailers(trailers)?;
        Ok::<(), h2::Error>(())
    };
    tokio::select! {
        r = inbound => r,
        r = outbound => r,
    }
}

async fn open(agent: &Agent, target: StreamTarget) -> Result<Opened, GuestError> {
    match target {
        StreamTarget::Tcp { port } => {
            let connect = TcpStream::connect((std::net::Ipv4Addr::LOCALHOST, port));
            match tokio::time::timeout(CONNECT_TIMEOUT, connect).await {
                Ok(Ok(tcp)) => {
                    let _ = tcp.set_nodelay(true);
                    Ok(Opened::Tcp(tcp))
                }
                Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                    Err(GuestError::new(
                        ErrorCode::NotFound,
                        format!("nothing listens on 127.0.0.1:{port} in the guest"),
                    ))
                }
                Ok(Err(e)) => Err(GuestError::new(
                    ErrorCode::Io,
                    format!("connecting to 127.0.0.1:{port}: {e}"),
                )),
                Err(_) => Err(GuestError::new(
                    ErrorCode::Io,
                    format!("connecting to 127.0.0.1:{port} timed out"),
                )),
            }
        }
        StreamTarget::TarExtract { dir } => {
            check_path(&dir)?;
            // As the guest user: the directory is made (as `mkdir -p`), tar unpacks into a
            // staging directory in it keeping modes (`-p`) but not owners, and only a whole
            // archive is moved into place, never over an existing name ([`Staging`]).
            let user = agent.files.user;
            let staging = tokio::task::spawn_blocking(move || {
                Staging::prepare(std::path::Path::new(&dir), user)
            })
            .await
            .map_err(|e| GuestError::new(ErrorCode::Internal, format!("staging: {e}")))??;
            let mut cmd = std::process::Command::new("tar");
            cmd.arg("-x");
            if let Some(blocking) = tar_blocking(agent).await {
                cmd.args(["-b", blocking]);
            }
            cmd.args(["-p", "-f", "-", "-C"]).arg(staging.path());
            match Helper::spawn(agent, cmd) {
                Ok(mut helper) => {
                    helper.staging = Some(staging);
                    Ok(Opened::Tar(helper))
                }
                Err(e) => {
                    // Still empty: one `rmdir`.
                    let _ = tokio::task::spawn_blocking(move || staging.remove_if_empty()).await;
                    Err(e)
                }
            }
        }
        StreamTarget::TarCreate { path } => {
            check_path(&path)?;
            let p = std::path::Path::new(&path);
            let (parent, name) = match (p.parent(), p.file_name()) {
                (Some(parent), Some(name)) => (
                    parent.to_string_lossy().into_owned(),
                    name.to_string_lossy().into_owned(),
                ),
                _ => ("/".to_string(), ".".to_string()),
            };
            std::fs::symlink_metadata(&path).map_err(|e| {
                GuestError::new(
                    if e.kind() == std::io::ErrorKind::NotFound {
                        ErrorCode::NotFound
                    } else {
                        ErrorCode::Io
                    },
                    format!("{path}: {e}"),
                )
            })?;
            let mut cmd = std::process::Command::new("tar");
            cmd.arg("-c");
            if let Some(blocking) = tar_blocking(agent).await {
                cmd.args(["-b", blocking]);
            }
            cmd.args(["-f", "-", "-C", &parent, "--", &name]);
            Helper::spawn(agent, cmd).map(Opened::Tar)
        }
        StreamTarget::BrokerAccept { .. } => Err(invalid("not a stream to open here")),
    }
}

/// [`TAR_BLOCKING`] when the guest's `tar` is GNU tar; `None` for one that takes no
/// blocking factor (BusyBox's, in images built on it). Asked once for the agent's life
/// (`tar --version`, as the guest user, at most [`PROBE_LIMIT`]).
async fn tar_blocking(agent: &Agent) -> Option<&'static str> {
    static GNU: tokio::sync::OnceCell<bool> = tokio::sync::OnceCell::const_new();
    // Only an answer is kept: a probe that could not start or finish is asked again next
    // time (this copy goes without the blocking factor).
    let gnu = GNU
        .get_or_try_init(|| async {
            tokio::time::timeout(PROBE_LIMIT, probe_gnu_tar(agent))
                .await
                .ok()
                .flatten()
                .ok_or(())
        })
        .await
        .copied()
        .unwrap_or(false);
    gnu.then_some(TAR_BLOCKING)
}

/// Whether `tar --version` names GNU tar; `None` when it could not be asked.
async fn probe_gnu_tar(agent: &Agent) -> Option<bool> {
    let mut cmd = std::process::Command::new("tar");
    cmd.arg("--version");
    let mut helper = Helper::spawn(agent, cmd).ok()?;
    drop(helper.stdin.take());
    let stdout = tokio::process::ChildStdout::from_std(helper.stdout.take()?).ok()?;
    let mut out = Vec::new();
    stdout.take(4096).read_to_end(&mut out).await.ok()?;
    // No upload: nothing waits on the input's end.
    let (code, _) = helper.finish(watch::channel(true).1).await;
    Some(code == 0 && out.windows(7).any(|w| w == b"GNU tar"))
}

fn check_path(path: &str) -> Result<(), GuestError> {
    if !path.starts_with('/') {
        return Err(invalid("the guest path must be absolute"));
    }
    if path.len() > MAX_STREAM_PATH || path.contains('\0') {
        return Err(invalid("the guest path is too long or contains NUL"));
    }
    Ok(())
}

fn invalid(msg: impl Into<String>) -> GuestError {
    GuestError::new(ErrorCode::InvalidArgument, msg)
}

/// Answers a refused stream: a status for the code and one postcard `GuestError` body.
fn refuse(respond: &mut SendResponse<Bytes>, err: GuestError) {
    let status = match err.code {
        ErrorCode::Unauthenticated => http::StatusCode::UNAUTHORIZED,
        ErrorCode::InvalidArgument => http::StatusCode::BAD_REQUEST,
        ErrorCode::NotFound => http::StatusCode::NOT_FOUND,
        _ => http::StatusCode::INTERNAL_SERVER_ERROR,
    };
    let Ok(head) = http::Response::builder().status(status).body(()) else {
        return;
    };
    let Ok(mut send) = respond.send_response(head, false) else {
        return;
    };
    if let Ok(body) = warren_protocol::encode(&err) {
        let _ = send.send_data(Bytes::from(body), true);
    }
}

/// Moves bytes both ways (see the module docs) and sends the trailers once `from_target`
/// ended; `finish` gives the exit status and error text after the target's output ended.
async fn pump<W, R, F, Fut>(
    bulk: &BulkGate,
    mut body: RecvStream,
    mut to_target: W,
    mut from_target: R,
    mut send: SendStream<Bytes>,
    finish: F,
) -> Result<(), h2::Error>
where
    W: AsyncWrite + Unpin,
    R: AsyncRead + Unpin,
    F: FnOnce(watch::Receiver<bool>) -> Fut,
    Fut: std::future::Future<Output = (i32, Option<String>)>,
{
    // Set once the host ended its input cleanly (not by a reset).
    let (input_ended, ended) = watch::channel(false);
    let inbound = async {
        while let Some(chunk) = body.data().await {
            let chunk = chunk?;
            let n = chunk.len();
            bulk.pass().await;
            if to_target.write_all(&chunk).await.is_err() {
                // The target stopped reading: drop the rest, keep the window open.
                let _ = body.flow_control().release_capacity(n);
                continue;
            }
            let _ = body.flow_control().release_capacity(n);
        }
        input_ended.send_replace(true);
        let _ = to_target.shutdown().await;
        drop(to_target);
        // The host ended its input; the output side decides when the stream ends.
        std::future::pending::<()>().await;
        Ok::<(), h2::Error>(())
    };
    let outbound = async {
        let mut read_error = None;
        loop {
            // Read straight into the buffer HTTP/2 sends from: no copy (under TCG every
            // copy costs the guest's vCPU).
            let mut buf = BytesMut::with_capacity(READ_CHUNK);
            bulk.pass().await;
            match from_target.read_buf(&mut buf).await {
                Ok(0) => break,
                Ok(_) => {}
                Err(e) => {
                    read_error = Some(format!("reading the guest end: {e}"));
                    break;
                }
            }
            stream::send_paced(&mut send, buf.freeze()).await?;
        }
        let (mut code, mut error) = finish(ended).await;
        if let Some(e) = read_error {
            code = if code == 0 { -1 } else { code };
            error = Some(error.map_or(e.clone(), |x| format!("{x}; {e}")));
        }
        let mut trailers = http::HeaderMap::new();
        if let Ok(v) = http::HeaderValue::from_str(&code.to_string()) {
            trailers.insert(EXIT_TRAILER, v);
        }
        if let Some(e) = error {
            if let Ok(v) = http::HeaderValue::from_str(&stream::trailer_text(&e)) {
                trailers.insert(ERROR_TRAILER, v);
            }
        }
        send.send_trailers(trailers)?;
        Ok::<(), h2::Error>(())
    };
    tokio::select! {
        r = inbound => r,
        r = outbound => r,
    }
}

/// A `tar` helper process, killed on drop unless it exited.
struct Helper {
    child: std::process::Child,
    exit: Option<tokio::sync::oneshot::Receiver<ExitStatus>>,
    stdin: Option<std::process::ChildStdin>,
    stdout: Option<std::process::ChildStdout>,
    stderr: Option<std::process::ChildStderr>,
    exited: bool,
    jobs: Arc<JobManager>,
    /// An upload's staging directory: placed after a clean exit and a clean end of the
    /// host's input, removed otherwise (on drop too, once the killed `tar` exited).
    staging: Option<Staging>,
}

impl Helper {
    fn spawn(agent: &Agent, mut cmd: std::process::Command) -> Result<Self, GuestError> {
        cmd.stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let (mut child, exit) = agent
            .jobs
            .spawn_helper(&mut cmd)
            .map_err(|e| GuestError::new(ErrorCode::Internal, format!("starting tar: {e}")))?;
        // Larger pipes: the agent and tar each move several records per wake-up. A pipe
        // that keeps its default size only costs speed.
        for fd in [
            child.stdin.as_ref().map(std::os::fd::AsFd::as_fd),
            child.stdout.as_ref().map(std::os::fd::AsFd::as_fd),
        ]
        .into_iter()
        .flatten()
        {
            let _ = rustix::pipe::fcntl_setpipe_size(fd, HELPER_PIPE);
        }
        Ok(Self {
            stdin: child.stdin.take(),
            stdout: child.stdout.take(),
            stderr: child.stderr.take(),
            child,
            exit: Some(exit),
            exited: false,
            jobs: agent.jobs.clone(),
            staging: None,
        })
    }

    /// Waits for the exit after the output ended: its code (128+N for a signal) and, on a
    /// failure, the start of standard error. An upload is placed only when `tar` succeeded
    /// and `input_ended` says the host ended its archive cleanly (`tar` stops at the
    /// archive's end marker, which a host that failed half-way may still have sent).
    async fn finish(&mut self, mut input_ended: watch::Receiver<bool>) -> (i32, Option<String>) {
        let mut text = Vec::new();
        if let Some(stderr) = self.stderr.take() {
            if let Ok(mut stderr) = tokio::process::ChildStderr::from_std(stderr) {
                let mut buf = [0u8; 1024];
                while let Ok(n) = stderr.read(&mut buf).await {
                    if n == 0 {
                        break;
                    }
                    let room = MAX_STDERR.saturating_sub(text.len());
                    text.extend_from_slice(&buf[..n.min(room)]);
                }
            }
        }
        let status = match self.exit.take() {
            Some(rx) => rx.await.ok(),
            None => None,
        };
        self.exited = status.is_some();
        let message = String::from_utf8_lossy(&text).trim().to_string();
        let (code, error) = match status {
            Some(ExitStatus::Code(0)) => (0, None),
            Some(ExitStatus::Code(c)) => (c, Some(format!("tar exited with {c}: {message}"))),
            Some(ExitStatus::Signal(s)) => (
                128 + s,
                Some(format!("tar was killed by signal {s}: {message}")),
            ),
            None => (-1, Some("tar's exit status was lost".into())),
        };
        let Some(staging) = self.staging.take() else {
            return (code, error);
        };
        let path = staging.path().to_path_buf();
        let (code, error) = if code != 0 {
            (code, error)
        } else if input_ended.wait_for(|ended| *ended).await.is_err() {
            (
                -1,
                Some("the archive's input did not end cleanly; nothing was placed".into()),
            )
        } else {
            match tokio::task::spawn_blocking(move || staging.place()).await {
                Ok(Ok(true)) => return (0, None),
                Ok(Ok(false)) => (0, None),
                Ok(Err((code, text))) => (code, Some(text)),
                Err(e) => (-1, Some(format!("placing the upload: {e}"))),
            }
        };
        // Whatever is left (a failed upload's tree) goes before the host hears the end.
        remove_staging(&self.jobs, &path).await;
        (code, error)
    }
}

impl Drop for Helper {
    fn drop(&mut self) {
        if !self.exited {
            let _ = self.child.kill();
        }
        // An abandoned upload: its staging directory goes once the killed `tar` exited.
        if let (Some(staging), Ok(rt)) =
            (self.staging.take(), tokio::runtime::Handle::try_current())
        {
            let exit = self.exit.take();
            let jobs = self.jobs.clone();
            rt.spawn(async move {
                if let Some(exit) = exit {
                    let _ = tokio::time::timeout(REMOVE_LIMIT, exit).await;
                }
                remove_staging(&jobs, staging.path()).await;
            });
        }
    }
}

/// How long removing a staging directory may take.
const REMOVE_LIMIT: Duration = Duration::from_secs(120);

/// Removes a staging directory and what it holds with `rm -rf`, as the guest user (never by
/// the agent itself: see [`crate::unpack`]).
async fn remove_staging(jobs: &JobManager, path: &std::path::Path) {
    let mut cmd = std::process::Command::new("rm");
    cmd.args(["-rf", "--"])
        .arg(path)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let removed = match jobs.spawn_helper(&mut cmd) {
        Ok((mut child, exit)) => match tokio::time::timeout(REMOVE_LIMIT, exit).await {
            Ok(Ok(ExitStatus::Code(0))) => true,
            Ok(_) => false,
            Err(_) => {
                let _ = child.kill();
                false
            }
        },
        Err(_) => false,
    };
    if !removed {
        crate::console::log(format_args!(
            "could not remove the staging directory {}",
            path.display()
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An upload's own steps with the blocking factor (GNU tar) and without it (a tar that
    /// takes none gets no `-b`): `tar -x` unpacks an archive fed through a pipe in short
    /// pieces, its last record short, into the staging directory, which is then placed.
    #[test]
    fn test_an_upload_unpacks_with_and_without_a_blocking_factor() {
        let src = tempfile::tempdir().expect("src");
        std::fs::create_dir(src.path().join("tree")).expect("tree");
        let big: Vec<u8> = (0..200_000u32).map(|i| (i * 7 % 251) as u8).collect();
        std::fs::write(src.path().join("tree/big"), &big).expect("big");
        let archive = std::process::Command::new("tar")
            .args(["-c", "-b", "1", "-f", "-", "-C"])
            .arg(src.path())
            .arg("tree")
            .output()
            .expect("tar -c");
        assert!(archive.status.success());
        for blocking in [Some(TAR_BLOCKING), None] {
            let dest = tempfile::tempdir().expect("dest");
            let dir = dest.path().join("in");
            let staging = Staging::prepare(&dir, None).expect("staging");
            let mut tar = std::process::Command::new("tar");
            tar.arg("-x");
            if let Some(b) = blocking {
                tar.args(["-b", b]);
            }
            let mut child = tar
                .args(["-p", "-f", "-", "-C"])
                .arg(staging.path())
                .stdin(Stdio::piped())
                .spawn()
                .expect("tar -x");
            let mut stdin = child.stdin.take().expect("stdin");
            for piece in archive.stdout.chunks(3000) {
                std::io::Write::write_all(&mut stdin, piece).expect("feed");
            }
            drop(stdin);
            assert!(
                child.wait().expect("wait").success(),
                "blocking {blocking:?}"
            );
            staging.place().expect("placed");
            assert_eq!(
                std::fs::read(dir.join("tree/big")).expect("unpacked"),
                big,
                "blocking {blocking:?}"
            );
            let names: Vec<_> = std::fs::read_dir(&dir).expect("ls").collect();
            assert_eq!(names.len(), 1, "only the tree, no staging left");
        }
    }
}
