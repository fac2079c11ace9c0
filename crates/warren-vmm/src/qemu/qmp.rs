//! A minimal QMP client: greeting, `qmp_capabilities`, then one command at a time.
//! Asynchronous events are skipped while waiting for a command's reply.
//!
//! Every exchange has a deadline ([`REPLY_LIMIT`]): a VMM that stops answering (stopped,
//! wedged, or compromised and silent) fails the command with [`VmmError::QmpTimeout`]
//! instead of holding its caller forever. Long operations (migrations) are started by a
//! command that returns at once and then polled, so no single reply waits for them.

use std::path::Path;
use std::time::Duration;

use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::UnixStream;

use crate::backend::{BoxFuture, VmControl};
use crate::error::VmmError;

/// The longest QMP message accepted: the VMM may be compromised, so its output is bounded.
pub const MAX_LINE: u64 = 1 << 20;
/// The longest a QMP greeting or a command's reply may take. QEMU answers from its main
/// loop in milliseconds, even under TCG on a loaded host; this leaves two orders of
/// magnitude of margin while bounding what a silent VMM can hold.
pub const REPLY_LIMIT: Duration = Duration::from_secs(15);

pub struct Qmp {
    reader: BufReader<OwnedReadHalf>,
    writer: OwnedWriteHalf,
    /// The `id` of the next command. QEMU echoes it in the reply, so a reply that arrives
    /// after its command timed out is recognised and skipped, never taken for a later one's.
    next_id: u64,
    /// Bytes of a message whose end has not arrived yet.
    pending: Vec<u8>,
    /// Bytes of commands not yet written: a deadline that fires mid-write leaves the rest
    /// here, and the next exchange sends it first, so commands are never torn or merged.
    outbox: Vec<u8>,
    /// The deadline of each exchange: [`REPLY_LIMIT`] (shorter only in unit tests).
    limit: Duration,
}

impl Qmp {
    /// Connects, reads the greeting and negotiates capabilities, each under [`REPLY_LIMIT`].
    pub async fn connect(path: &Path) -> Result<Self, VmmError> {
        Self::connect_within(path, REPLY_LIMIT).await
    }

    async fn connect_within(path: &Path, limit: Duration) -> Result<Self, VmmError> {
        let stream = UnixStream::connect(path)
            .await
            .map_err(|source| VmmError::QmpConnect {
                path: path.to_path_buf(),
                source,
            })?;
        let (r, w) = stream.into_split();
        let mut q = Qmp {
            reader: BufReader::new(r),
            writer: w,
            next_id: 0,
            pending: Vec::new(),
            outbox: Vec::new(),
            limit,
        };
        let greeting = tokio::time::timeout(limit, q.read_msg())
            .await
            .map_err(|_| VmmError::QmpTimeout {
                what: "the QMP greeting".into(),
                limit,
            })??;
        if greeting.get("QMP").is_none() {
            return Err(VmmError::QmpProtocol(format!(
                "unexpected greeting {greeting}"
            )));
        }
        q.execute("qmp_capabilities", None).await?;
        Ok(q)
    }

    /// Reads one message. Cancel-safe: a deadline that fires mid-line leaves the bytes read
    /// so far in `pending`, and the next call continues that line.
    async fn read_msg(&mut self) -> Result<Value, VmmError> {
        let room = MAX_LINE.saturating_sub(self.pending.len() as u64);
        let n = (&mut self.reader)
            .take(room)
            .read_until(b'\n', &mut self.pending)
            .await
            .map_err(VmmError::QmpIo)?;
        if n == 0 && self.pending.is_empty() {
            return Err(VmmError::QmpIo(std::io::ErrorKind::UnexpectedEof.into()));
        }
        if !self.pending.ends_with(b"\n") {
            return Err(VmmError::QmpProtocol(format!(
                "a message longer than {MAX_LINE} bytes, or cut short"
            )));
        }
        let line = std::mem::take(&mut self.pending);
        serde_json::from_slice(&line).map_err(|e| VmmError::QmpProtocol(e.to_string()))
    }

    /// Runs one command and returns its `return` value, failing with
    /// [`VmmError::QmpTimeout`] when the reply does not arrive within [`REPLY_LIMIT`]
    /// (events arriving meanwhile do not extend it).
    pub async fn execute(&mut self, command: &str, args: Option<Value>) -> Result<Value, VmmError> {
        let limit = self.limit;
        tokio::time::timeout(limit, self.exchange(command, args))
            .await
            .map_err(|_| VmmError::QmpTimeout {
                what: format!("QMP {command}"),
                limit,
            })?
    }

    async fn exchange(&mut self, command: &str, args: Option<Value>) -> Result<Value, VmmError> {
        self.next_id += 1;
        let id = self.next_id;
        let mut msg = json!({ "execute": command, "id": id });
        if let Some(a) = args {
            msg["arguments"] = a;
        }
        let mut line = msg.to_string();
        line.push('\n');
        self.outbox.extend_from_slice(line.as_bytes());
        // Plain writes are cancel-safe: what is written leaves the outbox at once.
        while !self.outbox.is_empty() {
            let n = self
                .writer
                .write(&self.outbox)
                .await
                .map_err(VmmError::QmpIo)?;
            if n == 0 {
                return Err(VmmError::QmpIo(std::io::ErrorKind::WriteZero.into()));
            }
            self.outbox.drain(..n);
        }
        loop {
            let v = self.read_msg().await?;
            if v.get("event").is_some() || v.get("id").and_then(Value::as_u64) != Some(id) {
                // An event, or the late reply of a command that timed out: skip.
                continue;
            }
            if let Some(r) = v.get("return") {
                return Ok(r.clone());
            }
            if let Some(e) = v.get("error") {
                return Err(VmmError::QmpCommand {
                    command: command.to_string(),
                    desc: e
                        .get("desc")
                        .and_then(Value::as_str)
                        .unwrap_or("unknown error")
                        .to_string(),
                });
            }
            return Err(VmmError::QmpProtocol(format!("unexpected message {v}")));
        }
    }
}

impl VmControl for Qmp {
    fn pause(&mut self) -> BoxFuture<'_, Result<(), VmmError>> {
        Box::pin(async move { self.execute("stop", None).await.map(|_| ()) })
    }

    fn resume(&mut self) -> BoxFuture<'_, Result<(), VmmError>> {
        Box::pin(async move { self.execute("cont", None).await.map(|_| ()) })
    }

    fn quit(&mut self) -> BoxFuture<'_, Result<(), VmmError>> {
        Box::pin(async move {
            match self.execute("quit", None).await {
                Ok(_) => Ok(()),
                // QEMU may close the socket before its reply arrives.
                Err(VmmError::QmpIo(_)) => Ok(()),
                Err(e) => Err(e),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use std::io::{BufRead, BufReader as StdBufReader, Write};
    use std::os::unix::net::{UnixListener as StdListener, UnixStream as StdStream};

    use super::*;

    const GREETING: &str = "{\"QMP\": {\"version\": {}, \"capabilities\": []}}\n";

    /// A fake VMM on `path` that runs `serve` on its first connection, in a thread.
    fn vmm(
        path: &Path,
        serve: impl FnOnce(StdBufReader<StdStream>, StdStream) + Send + 'static,
    ) -> std::thread::JoinHandle<()> {
        let listener = StdListener::bind(path).expect("bind");
        std::thread::spawn(move || {
            let (s, _) = listener.accept().expect("accept");
            serve(StdBufReader::new(s.try_clone().expect("clone")), s)
        })
    }

    /// Reads one command; returns its `id`.
    fn command(r: &mut StdBufReader<StdStream>) -> u64 {
        let mut line = String::new();
        r.read_line(&mut line).expect("read command");
        let v: Value = serde_json::from_str(&line).expect("command json");
        v["id"].as_u64().expect("command id")
    }

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime")
    }

    #[test]
    fn test_qmp_silent_vmm_fails_at_the_deadline_greeting_vmm_connects() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (silent, greets) = (dir.path().join("silent"), dir.path().join("greets"));
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let held = vmm(&silent, move |_, _| {
            // Keeps the connection open, saying nothing, until the test is done.
            let _ = rx.recv();
        });
        let answers = vmm(&greets, |mut r, mut w| {
            w.write_all(GREETING.as_bytes()).expect("greet");
            let id = command(&mut r);
            writeln!(w, "{{\"return\": {{}}, \"id\": {id}}}").expect("reply");
        });
        rt().block_on(async {
            let t = std::time::Instant::now();
            let Err(e) = Qmp::connect_within(&silent, Duration::from_millis(300)).await else {
                panic!("a silent VMM connected");
            };
            assert!(matches!(e, VmmError::QmpTimeout { .. }), "{e}");
            assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
            // Control: the same client connects to a VMM that answers.
            Qmp::connect_within(&greets, Duration::from_secs(30))
                .await
                .expect("an answering VMM connects");
        });
        tx.send(()).expect("release");
        held.join().expect("silent vmm");
        answers.join().expect("answering vmm");
    }

    #[test]
    fn test_qmp_late_reply_of_a_timed_out_command_is_never_taken_for_the_next() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("qmp");
        let server = vmm(&path, |mut r, mut w| {
            w.write_all(GREETING.as_bytes()).expect("greet");
            let caps = command(&mut r);
            writeln!(w, "{{\"return\": {{}}, \"id\": {caps}}}").expect("reply");
            let slow = command(&mut r);
            // Half of the slow command's reply, then nothing until the next command.
            write!(w, "{{\"return\": {{\"which\": \"slow\"}},").expect("half");
            w.flush().expect("flush");
            let next = command(&mut r);
            writeln!(w, " \"id\": {slow}}}").expect("rest");
            writeln!(w, "{{\"event\": \"STOP\"}}").expect("event");
            writeln!(w, "{{\"return\": {{\"which\": \"next\"}}, \"id\": {next}}}").expect("reply");
        });
        rt().block_on(async {
            let mut q = Qmp::connect_within(&path, Duration::from_secs(30))
                .await
                .expect("connect");
            q.limit = Duration::from_millis(300);
            let e = q
                .execute("query-status", None)
                .await
                .expect_err("the slow reply is late");
            assert!(matches!(e, VmmError::QmpTimeout { .. }), "{e}");
            q.limit = Duration::from_secs(30);
            let v = q.execute("query-status", None).await.expect("next");
            assert_eq!(v["which"], "next", "{v}");
        });
        server.join().expect("server");
    }

    #[test]
    fn test_qmp_command_cut_mid_write_by_its_deadline_is_finished_before_the_next() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("qmp");
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let server = vmm(&path, move |mut r, mut w| {
            w.write_all(GREETING.as_bytes()).expect("greet");
            let caps = command(&mut r);
            writeln!(w, "{{\"return\": {{}}, \"id\": {caps}}}").expect("reply");
            // Reads nothing until the big command timed out with most of it unsent.
            let _ = rx.recv();
            let (big, next) = (command(&mut r), command(&mut r));
            writeln!(w, "{{\"return\": {{}}, \"id\": {big}}}").expect("reply");
            writeln!(w, "{{\"return\": {{\"which\": \"next\"}}, \"id\": {next}}}").expect("reply");
        });
        rt().block_on(async {
            let mut q = Qmp::connect_within(&path, Duration::from_secs(30))
                .await
                .expect("connect");
            q.limit = Duration::from_millis(300);
            // Far more than a socket buffer holds: the write blocks until the deadline.
            let big = json!({ "data": "x".repeat(8 << 20) });
            let e = q
                .execute("human-monitor-command", Some(big))
                .await
                .expect_err("the big command cannot be written in time");
            assert!(matches!(e, VmmError::QmpTimeout { .. }), "{e}");
            assert!(
                !q.outbox.is_empty(),
                "the command was written whole: nothing tested"
            );
            tx.send(()).expect("release");
            q.limit = Duration::from_secs(30);
            // The server parses both commands as whole JSON lines, or the test fails there.
            let v = q.execute("query-status", None).await.expect("next");
            assert_eq!(v["which"], "next", "{v}");
        });
        server.join().expect("server");
    }
}
