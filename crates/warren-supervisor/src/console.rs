//! The serial console: read from the VMM's console socket into a bounded log.
//!
//! The log is `console.log`; when it would pass [`LOG_HALF`] bytes it becomes
//! `console.log.1` (replacing the previous one) and a new `console.log` starts, so at most
//! 2 × LOG_HALF bytes are kept ([`crate::rotate`]). A guest flooding its console cannot fill
//! the host disk.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::AsyncReadExt;
use tokio::net::UnixStream;

use crate::layout::VmDir;
use crate::rotate::RotatingFile;

/// Bytes per console log file.
pub use crate::rotate::LOG_HALF;
/// Bytes of console output kept in memory for error messages.
const TAIL: usize = 4096;

/// The last bytes the console printed, shared with the supervisor for error reports.
#[derive(Clone, Default)]
pub struct ConsoleTail(Arc<Mutex<Tail>>);

#[derive(Default)]
struct Tail {
    bytes: Vec<u8>,
    /// How the console connection went: `None` until it was made or failed.
    link: Option<Result<(), String>>,
}

impl ConsoleTail {
    pub fn text(&self) -> String {
        let t = self.0.lock().unwrap_or_else(|p| p.into_inner());
        String::from_utf8_lossy(&t.bytes).into_owned()
    }

    fn push(&self, data: &[u8]) {
        let mut t = self.0.lock().unwrap_or_else(|p| p.into_inner());
        t.bytes.extend_from_slice(data);
        if t.bytes.len() > TAIL {
            let cut = t.bytes.len() - TAIL;
            t.bytes.drain(..cut);
        }
    }

    /// Records how connecting the console went (for [`ConsoleTail::report`]).
    pub fn linked(&self, link: Result<(), String>) {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).link = Some(link);
    }

    /// The console part of a failure reason: its last `n` lines, or why there are none (a
    /// console never connected holds the VMM before it starts the guest).
    pub fn report(&self, n: usize) -> String {
        let lines = self.last_lines(n);
        if !lines.is_empty() {
            return format!("\nconsole:\n{lines}");
        }
        let t = self.0.lock().unwrap_or_else(|p| p.into_inner());
        match &t.link {
            Some(Ok(())) => "\nconsole: the guest printed nothing".into(),
            Some(Err(e)) => format!("\nconsole: not connected ({e})"),
            None => "\nconsole: not connected yet".into(),
        }
    }

    /// The last `n` lines.
    pub fn last_lines(&self, n: usize) -> String {
        let text = self.text();
        let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }
}

/// Connects to the console socket (retrying until it exists, up to `wait`).
pub async fn connect(path: &std::path::Path, wait: Duration) -> std::io::Result<UnixStream> {
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        match UnixStream::connect(path).await {
            Ok(s) => return Ok(s),
            Err(e) if tokio::time::Instant::now() >= deadline => return Err(e),
            Err(_) => tokio::time::sleep(Duration::from_millis(2)).await,
        }
    }
}

/// Copies the console into the bounded log until the VMM closes it.
pub async fn pump(mut stream: UnixStream, dir: VmDir, tail: ConsoleTail) {
    let mut buf = vec![0u8; 16 * 1024];
    let mut file = RotatingFile::append_to(dir.console_log());
    loop {
        let n = match stream.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        tail.push(&buf[..n]);
        if tracing::enabled!(tracing::Level::DEBUG) {
            for line in String::from_utf8_lossy(&buf[..n]).lines() {
                tracing::debug!(line = %crate::log::guest_text(line), "console");
            }
        }
        file.append(&buf[..n]);
    }
}
