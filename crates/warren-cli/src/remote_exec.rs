//! `warren vm exec` and `warren run` through the service, when one answers on its local
//! socket (`--socket`, `WARREN_SOCKET`, or the state directory's) or over HTTP (`--endpoint`
//! with `--token-file`). Without a service the engine runs in this process instead
//! (`commands.rs`, `warren_core::interactive`).
//!
//! Steps:
//! 1. the `vm_exec` tool starts the job (with `tty` for `-t`, `interactive` for `-i`);
//! 2. the job's WebSocket streams its output as it arrives: `/output`, or `/terminal` for
//!    `-t`/`-i`, which also takes this process's stdin, its end, and window sizes (SIGWINCH);
//! 3. a connection that breaks (the service restarted, the VM was suspended and woken) is
//!    reopened at the byte cursors reached, so output is neither lost nor repeated and the
//!    job runs on; a terminal that another client took over ends this one;
//! 4. the job's end (the last text message) gives the exit code, with the same conventions
//!    as in process: the job's code, 128+N for signal N, 124 for its timeout.
//!
//! SIGINT (without a raw terminal), SIGTERM and SIGHUP cancel the job, as in process.

use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio::signal::unix::{signal, SignalKind};
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::Message;
use warren_core::interactive::{
    grace_over, local_window_size, spawn_stdin_reader, stdin_is_terminal, RawMode, CANCEL_GRACE,
};
use warren_protocol::limits::MAX_STDIN_BYTES;

use crate::commands::{EXIT_TIMEOUT, EXIT_WARREN_ERROR};
use crate::stream_link::{Opener, Ws};

/// How the job takes input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// No input after the start (`stdin` given whole, or /dev/null).
    Batch,
    /// This process's stdin streamed to the job's stdin; stdout and stderr apart.
    Pipe,
    /// A guest pseudo-terminal: stdin streamed, window sizes followed, output merged.
    Tty,
}

/// What to run.
pub struct ExecRequest {
    pub vm: String,
    pub argv: Vec<String>,
    pub env: Vec<(String, String)>,
    pub cwd: Option<String>,
    pub timeout_ms: Option<u64>,
    /// Input read before the start (`--stdin`).
    pub stdin: Option<Vec<u8>>,
    pub mode: Mode,
    /// Print the job id as JSON and return at once.
    pub detach: bool,
}

/// Reconnection: how long a broken job stream is retried before giving up.
const RECONNECT_FOR: Duration = Duration::from_secs(60);
/// Longest pause between reconnection attempts.
const RECONNECT_MAX_PAUSE: Duration = Duration::from_secs(2);

/// The workspace root acts as on the local socket: the VM's own, so the operator reaches
/// every VM as in process. `None` for other callers (their own workspace applies).
pub fn operator_workspace(cli: &crate::cli::Cli, opener: &Opener, vm: &str) -> Option<String> {
    if !matches!(opener, Opener::Socket(_)) || !nix::unistd::geteuid().is_root() {
        return None;
    }
    let w = crate::commands::open(cli, None).ok()?;
    w.get_vm(vm).ok().map(|r| r.workspace)
}

/// Runs `req` through the service; returns the exit code.
pub async fn exec(opener: &Opener, workspace: Option<&str>, req: ExecRequest) -> Result<i32> {
    let mut mode = req.mode;
    let mut args = json!({
        "vm_id": req.vm,
        "request_id": request_id(),
        "argv": req.argv,
    });
    let mut env: serde_json::Map<String, Value> =
        req.env.iter().map(|(k, v)| (k.clone(), json!(v))).collect();
    if mode == Mode::Tty && !env.contains_key("TERM") {
        if let Ok(term) = std::env::var("TERM") {
            if !term.is_empty() {
                env.insert("TERM".into(), json!(term));
            }
        }
    }
    if !env.is_empty() {
        args["env"] = Value::Object(env);
    }
    if let Some(cwd) = &req.cwd {
        args["cwd"] = json!(cwd);
    }
    if let Some(t) = req.timeout_ms {
        args["timeout_ms"] = json!(t);
    }
    // Text that fits goes whole with the start; other input is streamed to a stdin pipe.
    let mut preload = None;
    if let Some(data) = req.stdin {
        match String::from_utf8(data) {
            Ok(text) if text.len() <= MAX_STDIN_BYTES => args["stdin"] = json!(text),
            Ok(text) => preload = Some(text.into_bytes()),
            Err(e) => preload = Some(e.into_bytes()),
        }
        if preload.is_some() {
            mode = Mode::Pipe;
        }
    }
    match mode {
        Mode::Batch => {}
        Mode::Pipe => args["interactive"] = json!(true),
        Mode::Tty => {
            let size = local_window_size();
            args["tty"] = json!({"rows": size.rows, "cols": size.cols});
        }
    }
    let mut tools = opener.tools(workspace).await?;
    let started = tools.post("vm_exec", &args).await?;
    let job = started["job_id"]
        .as_str()
        .ok_or_else(|| anyhow!("the service answered without a job id"))?
        .to_string();
    if req.detach {
        let shown = job.parse::<u64>().map(|n| json!(n)).unwrap_or(json!(job));
        println!("{}", json!({ "job_id": shown }));
        return Ok(0);
    }
    let link = Link {
        opener,
        workspace,
        vm: &req.vm,
        job: &job,
    };
    link.follow(mode, preload).await
}

fn request_id() -> String {
    let bytes: [u8; 16] = rand::random();
    format!("cli-{}", hex_of(&bytes))
}

fn hex_of(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// One job followed through the service.
struct Link<'a> {
    opener: &'a Opener,
    workspace: Option<&'a str>,
    vm: &'a str,
    job: &'a str,
}

/// Where the output stands.
#[derive(Default, Clone, Copy)]
struct Cursors {
    stdout: u64,
    stderr: u64,
}

/// How one connection ended.
enum Ended {
    /// The job ended: its exit code.
    Exit(i32),
    /// The connection broke; worth reconnecting.
    Broken(String),
    /// A second signal, or the cancelled job's end did not come within [`CANCEL_GRACE`]:
    /// leave without waiting for it (this exit code).
    Left(i32),
}

impl Link<'_> {
    async fn connect(&self, mode: Mode, at: Cursors) -> Result<Ws> {
        // A terminal acknowledges what it wrote, so a reconnection misses nothing.
        let what = if mode == Mode::Batch {
            "output?"
        } else {
            "terminal?ack=true&"
        };
        let path = format!(
            "/v1/vms/{}/jobs/{}/{what}stdout={}&stderr={}",
            self.vm, self.job, at.stdout, at.stderr
        );
        self.opener.websocket(&path, self.workspace).await
    }

    async fn cancel(&self) {
        let r = async {
            let mut t = self.opener.tools(self.workspace).await?;
            t.post(
                "vm_job_cancel",
                &json!({"vm_id": self.vm, "job_id": self.job}),
            )
            .await
        }
        .await;
        if let Err(e) = r {
            // The service's refusal may quote the guest: escaped (no `--raw` reaches here).
            eprintln!(
                "{}",
                crate::term::Term::new(false).failure("cancelling the job failed", &e)
            );
        }
    }

    /// Follows the job to its end, reconnecting as needed.
    async fn follow(&self, mode: Mode, preload: Option<Vec<u8>>) -> Result<i32> {
        let local_tty = mode == Mode::Tty && stdin_is_terminal();
        let raw = if local_tty {
            Some(RawMode::stdin().context("raw mode on stdin")?)
        } else {
            None
        };
        let stop = Arc::new(AtomicBool::new(false));
        // Input: what --stdin read (then its end), or this process's stdin as it comes.
        let mut input = match (&preload, mode) {
            (Some(_), _) | (None, Mode::Batch) => None,
            (None, Mode::Pipe | Mode::Tty) => Some(spawn_stdin_reader(stop.clone())),
        };
        let mut pending: Vec<Vec<u8>> = match preload {
            Some(data) => vec![data, Vec::new()],
            None => Vec::new(),
        };
        let sig = |k: SignalKind| signal(k).context("installing a signal handler");
        let mut term = sig(SignalKind::terminate())?;
        let mut hup = sig(SignalKind::hangup())?;
        let mut int = sig(SignalKind::interrupt())?;
        let mut winch = sig(SignalKind::window_change())?;
        let mut at = Cursors::default();
        let mut ended_by: Option<i32> = None;
        // Set by the first signal (which cancels the job): how long its end is waited for.
        let mut grace: Option<tokio::time::Instant> = None;
        let mut broken_since: Option<Instant> = None;
        let mut pause = Duration::from_millis(100);
        let result = loop {
            let mut ws = match self.connect(mode, at).await {
                Ok(ws) => ws,
                Err(e) if is_refusal(&e) => break Err(e),
                Err(e) => {
                    let since = *broken_since.get_or_insert_with(Instant::now);
                    if since.elapsed() > RECONNECT_FOR {
                        break Err(e.context("the job stream could not be reopened"));
                    }
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(RECONNECT_MAX_PAUSE);
                    continue;
                }
            };
            if mode == Mode::Tty {
                // A (re)attached terminal takes this one's size; full-screen programs redraw.
                let size = local_window_size();
                let msg = json!({"resize": {"rows": size.rows, "cols": size.cols}}).to_string();
                let _ = ws.send(Message::Text(msg.into())).await;
            }
            for data in pending.drain(..) {
                let _ = ws.send(Message::Binary(data.into())).await;
            }
            let ended = loop {
                tokio::select! {
                    msg = ws.next() => match msg {
                        Some(Ok(Message::Binary(b))) => {
                            broken_since = None;
                            pause = Duration::from_millis(100);
                            if let Err(e) = write_output(&b, mode, &mut at) {
                                break Err(e);
                            }
                            if mode != Mode::Batch {
                                let ack = json!({"ack": {"stdout": at.stdout, "stderr": at.stderr}});
                                let _ = ws.send(Message::Text(ack.to_string().into())).await;
                            }
                        }
                        Some(Ok(Message::Text(t))) => break Ok(Ended::Exit(exit_of(t.as_str())?)),
                        Some(Ok(Message::Close(frame))) => {
                            let (code, reason) = frame
                                .map(|f| (f.code, f.reason.to_string()))
                                .unwrap_or((CloseCode::Status, String::new()));
                            match code {
                                CloseCode::Policy => break Err(anyhow!("the service closed the job stream: {reason}")),
                                CloseCode::Away if reason.starts_with("replaced") => {
                                    break Err(anyhow!("another client attached to this job's terminal"))
                                }
                                CloseCode::Away if reason == "destroyed" => {
                                    break Err(anyhow!("the VM was destroyed"))
                                }
                                _ => break Ok(Ended::Broken(format!("{code} {reason}"))),
                            }
                        }
                        Some(Ok(_)) => {}
                        Some(Err(e)) => break Ok(Ended::Broken(e.to_string())),
                        None => break Ok(Ended::Broken("the service closed the connection".into())),
                    },
                    chunk = async {
                        match input.as_mut() {
                            Some(rx) => rx.recv().await,
                            None => std::future::pending().await,
                        }
                    } => {
                        let data = match chunk {
                            Some(Some(d)) => d,
                            // End of input: an empty message, once.
                            Some(None) | None => {
                                input = None;
                                Vec::new()
                            }
                        };
                        if ws.send(Message::Binary(data.clone().into())).await.is_err() {
                            pending.push(data);
                        }
                    }
                    Some(()) = winch.recv(), if mode == Mode::Tty => {
                        let size = local_window_size();
                        let msg = json!({"resize": {"rows": size.rows, "cols": size.cols}});
                        let _ = ws.send(Message::Text(msg.to_string().into())).await;
                    }
                    // The first signal cancels the job and waits for its end; a second
                    // leaves at once (a guest that never reports the end holds nobody).
                    Some(()) = term.recv() => {
                        if ended_by.is_some() {
                            break Ok(Ended::Left(128 + nix::libc::SIGTERM));
                        }
                        ended_by = Some(nix::libc::SIGTERM);
                        grace = Some(tokio::time::Instant::now() + CANCEL_GRACE);
                        self.cancel().await;
                    }
                    Some(()) = hup.recv() => {
                        if ended_by.is_some() {
                            break Ok(Ended::Left(128 + nix::libc::SIGHUP));
                        }
                        ended_by = Some(nix::libc::SIGHUP);
                        grace = Some(tokio::time::Instant::now() + CANCEL_GRACE);
                        self.cancel().await;
                    }
                    () = grace_over(grace) => {
                        break Ok(Ended::Left(128 + ended_by.unwrap_or(nix::libc::SIGTERM)));
                    }
                    Some(()) = int.recv(), if !local_tty => {
                        if ended_by.is_some() {
                            break Ok(Ended::Left(128 + nix::libc::SIGINT));
                        }
                        ended_by = Some(nix::libc::SIGINT);
                        grace = Some(tokio::time::Instant::now() + CANCEL_GRACE);
                        self.cancel().await;
                    }
                }
            };
            match ended {
                Ok(Ended::Exit(code)) => {
                    let _ = ws.close(None).await;
                    break Ok(match (ended_by, mode) {
                        (Some(s), Mode::Pipe | Mode::Tty) => 128 + s,
                        _ => code,
                    });
                }
                Ok(Ended::Left(code)) => {
                    let _ = ws.close(None).await;
                    eprintln!("warren: left without waiting for the cancelled job to end");
                    break Ok(code);
                }
                Ok(Ended::Broken(why)) => {
                    tracing::debug!(reason = %why, "job stream broke; reconnecting");
                    broken_since.get_or_insert_with(Instant::now);
                    tokio::time::sleep(pause).await;
                }
                Err(e) => break Err(e),
            }
        };
        stop.store(true, Ordering::Relaxed);
        drop(raw);
        result
    }
}

/// A refusal by the service (its JSON error) rather than a broken connection.
fn is_refusal(e: &anyhow::Error) -> bool {
    e.chain()
        .any(|c| c.downcast_ref::<warren_api::ApiError>().is_some())
}

/// Writes one output message (tag byte, then bytes) where it belongs.
fn write_output(msg: &[u8], mode: Mode, at: &mut Cursors) -> Result<()> {
    let Some((&tag, data)) = msg.split_first() else {
        bail!("the service sent an empty output message");
    };
    match tag {
        warren_api::job_ws::STDOUT => {
            let mut o = std::io::stdout().lock();
            o.write_all(data)?;
            o.flush()?;
            at.stdout += data.len() as u64;
        }
        warren_api::job_ws::STDERR => {
            if mode != Mode::Tty {
                let mut e = std::io::stderr().lock();
                e.write_all(data)?;
                e.flush()?;
            }
            at.stderr += data.len() as u64;
        }
        other => bail!("the service sent output of unknown stream {other}"),
    }
    Ok(())
}

/// The exit code of the job's end event.
fn exit_of(text: &str) -> Result<i32> {
    let v: Value = serde_json::from_str(text).context("the job's end")?;
    if v["event"] != "exit" {
        bail!("unexpected message from the service: {}", v["event"]);
    }
    if v["truncated"] == true {
        eprintln!("warren: output truncated (more than 256 KiB); the rest was discarded");
    }
    if v["timed_out"] == true {
        return Ok(EXIT_TIMEOUT);
    }
    if let Some(sig) = v["signal"].as_i64() {
        return Ok(warren_core::interactive::signal_exit(sig));
    }
    Ok(v["exit_code"]
        .as_i64()
        .map(|c| c as i32)
        .unwrap_or(EXIT_WARREN_ERROR))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_exit_of_follows_the_in_process_conventions() {
        let ev = |x: &str| format!(r#"{{"event":"exit",{x}}}"#);
        assert_eq!(exit_of(&ev(r#""exit_code":3"#)).expect("code"), 3);
        assert_eq!(
            exit_of(&ev(r#""exit_code":null,"signal":9"#)).expect("sig"),
            137
        );
        assert_eq!(
            exit_of(&ev(r#""timed_out":true,"signal":9"#)).expect("timeout"),
            EXIT_TIMEOUT
        );
        assert_eq!(
            exit_of(&ev(r#""exit_code":null"#)).expect("none"),
            EXIT_WARREN_ERROR
        );
        for hostile in ["2147483647", "1099511627776", "128", "-1"] {
            let e = ev(&format!(r#""exit_code":null,"signal":{hostile}"#));
            assert_eq!(exit_of(&e).expect("sig"), EXIT_WARREN_ERROR, "{hostile}");
        }
        assert!(exit_of(r#"{"event":"other"}"#).is_err());
        assert!(exit_of("not json").is_err());
    }

    #[test]
    fn test_write_output_advances_the_right_cursor() {
        let mut at = Cursors::default();
        write_output(
            &[warren_api::job_ws::STDERR, b'x', b'y'],
            Mode::Tty,
            &mut at,
        )
        .expect("ok");
        assert_eq!((at.stdout, at.stderr), (0, 2));
        assert!(write_output(&[9, b'x'], Mode::Batch, &mut at).is_err());
        assert!(write_output(&[], Mode::Batch, &mut at).is_err());
    }

    #[test]
    fn test_request_ids_are_fresh_and_valid() {
        let (a, b) = (request_id(), request_id());
        assert_ne!(a, b);
        assert!(a.len() <= 128 && a.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'-'));
    }
}
