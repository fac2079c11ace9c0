//! `supervisor.log`: the supervisor's own log, bounded like the console log, because much of
//! what it records is caused by the guest (its error messages, console lines at debug,
//! egress decisions on the names it asks for).
//!
//! Every record `tracing` formats goes through [`SupervisorLog`], one record per writer:
//! - a record is at most [`MAX_RECORD`] bytes; a longer one is cut at a character boundary
//!   and marked `…[truncated N bytes]`;
//! - records pass a token bucket ([`BURST`], then [`PER_SECOND`]); the rest are dropped and
//!   counted, and the next record written is preceded by one line saying how many were
//!   suppressed. Exempt (only size-bounded) are errors, which are rare and say why the VM
//!   failed (the outcome is also `exit.json`), and the supervisor's own info lines, its rare
//!   state changes (VMM launched, guest ready). Everything a guest can repeat is below error
//!   level (console lines and guest errors at debug, channel drops at warn) or comes from the
//!   egress (whose decision log has its own bucket besides);
//! - when the file reaches [`LOG_HALF`] bytes it becomes `supervisor.log.1` (replacing the
//!   previous one) and a new `supervisor.log` starts, so at most 2 × LOG_HALF (plus one
//!   record) is kept. Standard output and error are pointed at the current file, so a panic
//!   message lands there too.
//!
//! Guest-supplied text in a record goes through [`guest_text`] at the call site: control
//! characters escaped (no forged lines) and cut at [`MAX_GUEST_TEXT`] bytes.
//!
//! The mutex guards the open file, its size and the bucket; it is held only to write one
//! record.

use std::fmt;
use std::fs::File;
use std::io::{self, Write};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tracing::{Level, Metadata};

use crate::layout::VmDir;
use crate::rotate::RotatingFile;

/// Bytes per supervisor log file.
pub use crate::rotate::LOG_HALF;
/// Longest record written, in bytes (the truncation marker included).
pub const MAX_RECORD: usize = 4096;
/// Longest guest-supplied string a record carries, in bytes, before its marker.
pub const MAX_GUEST_TEXT: usize = 1024;
/// Records below error level written in a burst, then per second.
pub const BURST: u32 = 50;
pub const PER_SECOND: u32 = 10;

/// Guest text made safe for one log line: control characters escaped, at most
/// [`MAX_GUEST_TEXT`] bytes, the rest counted as `…[+N bytes]`.
pub struct GuestText<'a>(&'a str);

/// Wraps guest-supplied `s` for a log field (`%guest_text(&s)`).
pub fn guest_text(s: &str) -> GuestText<'_> {
    GuestText(s)
}

impl fmt::Display for GuestText<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut out = 0usize;
        for (i, c) in self.0.char_indices() {
            let piece: String = if c.is_control() {
                c.escape_default().collect()
            } else {
                c.to_string()
            };
            if out + piece.len() > MAX_GUEST_TEXT {
                return write!(f, "…[+{} bytes]", self.0.len() - i);
            }
            out += piece.len();
            f.write_str(&piece)?;
        }
        Ok(())
    }
}

struct Bucket {
    tokens: f64,
    last: Instant,
    suppressed: u64,
}

impl Bucket {
    fn new() -> Bucket {
        Bucket {
            tokens: f64::from(BURST),
            last: Instant::now(),
            suppressed: 0,
        }
    }

    /// Takes a token; `Some(suppressed_before)` when the record may be written.
    fn admit(&mut self) -> Option<u64> {
        let now = Instant::now();
        let refill = now.duration_since(self.last).as_secs_f64() * f64::from(PER_SECOND);
        self.tokens = (self.tokens + refill).min(f64::from(BURST));
        self.last = now;
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            Some(std::mem::take(&mut self.suppressed))
        } else {
            self.suppressed += 1;
            None
        }
    }
}

/// A bounded log of records: each cut at [`MAX_RECORD`], those subject to the rate limit
/// passed through a [`Bucket`] (the rest dropped and counted, and the count written before
/// the next record admitted), the file rotated at [`LOG_HALF`]. `supervisor.log` is one;
/// the stderr of the VM's QEMU and virtiofsd are others (`crate::child_log`).
pub(crate) struct BoundedLog {
    file: RotatingFile,
    bucket: Bucket,
    /// What a line about suppressed records starts with.
    marker: &'static str,
    /// Called with the new file after each rotation.
    on_rotate: Option<fn(&File)>,
}

impl BoundedLog {
    pub(crate) fn new(
        file: RotatingFile,
        marker: &'static str,
        on_rotate: Option<fn(&File)>,
    ) -> BoundedLog {
        BoundedLog {
            file,
            bucket: Bucket::new(),
            marker,
            on_rotate,
        }
    }

    /// Writes one record of which `cut` bytes were not kept (a marker says so), if the rate
    /// limit admits it (`limited`); returns whether it did.
    pub(crate) fn commit(&mut self, record: &[u8], cut: usize, limited: bool) -> bool {
        let suppressed = if limited {
            match self.bucket.admit() {
                None => return false,
                Some(n) => n,
            }
        } else {
            std::mem::take(&mut self.bucket.suppressed)
        };
        if suppressed > 0 {
            let line = format!(
                "{}: {suppressed} log records suppressed (more than {PER_SECOND} per second)\n",
                self.marker
            );
            self.append(line.as_bytes());
        }
        if cut == 0 {
            self.append(record);
        } else {
            let mut line = record.to_vec();
            if line.last() == Some(&b'\n') {
                line.pop();
            }
            line.extend_from_slice(format!("…[truncated {cut} bytes]\n").as_bytes());
            self.append(&line);
        }
        true
    }

    fn append(&mut self, data: &[u8]) {
        if self.file.append(data) {
            if let (Some(hook), Some(f)) = (self.on_rotate, self.file.file()) {
                hook(f);
            }
        }
    }
}

/// Points the process's stdout and stderr at `f` (the supervisor's current log file).
fn redirect_stdio(f: &File) {
    // Best effort: a failure leaves them on the previous file, which is bounded by what the
    // process prints outside `tracing` (a panic message).
    let _ = nix::unistd::dup2_stdout(f);
    let _ = nix::unistd::dup2_stderr(f);
}

/// The bounded log of one VM's supervisor; a `tracing_subscriber` writer.
#[derive(Clone)]
pub struct SupervisorLog(Arc<Mutex<BoundedLog>>);

impl SupervisorLog {
    /// Appends to `dir`'s `supervisor.log` (the creator made it the process's stdout and
    /// stderr) and points stdout and stderr at this writer's file.
    pub fn open(dir: VmDir) -> SupervisorLog {
        Self::open_with(dir, true)
    }

    fn open_with(dir: VmDir, redirect: bool) -> SupervisorLog {
        let file = RotatingFile::append_to(dir.supervisor_log());
        let on_rotate: Option<fn(&File)> = redirect.then_some(redirect_stdio);
        if let (Some(hook), Some(f)) = (on_rotate, file.file()) {
            hook(f);
        }
        SupervisorLog(Arc::new(Mutex::new(BoundedLog::new(
            file,
            "WARN warren_supervisor::log",
            on_rotate,
        ))))
    }

    fn record(&self, limited: bool) -> Record {
        Record {
            log: self.clone(),
            limited,
            buf: Vec::new(),
            cut: 0,
        }
    }
}

/// One record being formatted; written (or dropped by the rate limit) when it is dropped.
pub struct Record {
    log: SupervisorLog,
    /// Subject to the rate limit.
    limited: bool,
    buf: Vec<u8>,
    /// Bytes past [`MAX_RECORD`] that were not kept.
    cut: usize,
}

/// Room kept for the truncation marker.
const MARKER_ROOM: usize = 48;

impl Write for Record {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        let room = (MAX_RECORD - MARKER_ROOM).saturating_sub(self.buf.len());
        let keep = data.len().min(room);
        self.buf.extend_from_slice(&data[..keep]);
        self.cut += data.len() - keep;
        Ok(data.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Drop for Record {
    fn drop(&mut self) {
        if self.buf.is_empty() {
            return;
        }
        if self.cut > 0 {
            // Cut at a character boundary: the last partial UTF-8 sequence goes too.
            let valid = match std::str::from_utf8(&self.buf) {
                Ok(_) => self.buf.len(),
                Err(e) => e.valid_up_to(),
            };
            self.cut += self.buf.len() - valid;
            self.buf.truncate(valid);
        }
        let mut inner = self.log.0.lock().unwrap_or_else(|p| p.into_inner());
        inner.commit(&self.buf, self.cut, self.limited);
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for SupervisorLog {
    type Writer = Record;

    fn make_writer(&'a self) -> Record {
        self.record(true)
    }

    fn make_writer_for(&'a self, meta: &Metadata<'_>) -> Record {
        self.record(rate_limited(meta.level(), meta.target()))
    }
}

/// Whether a record at `level` from `target` passes the rate limit (see the module docs).
fn rate_limited(level: &Level, target: &str) -> bool {
    let own_info = *level == Level::INFO && target.starts_with("warren_supervisor");
    *level != Level::ERROR && !own_info
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(dir: &VmDir) -> (String, String) {
        (
            std::fs::read_to_string(dir.supervisor_log()).unwrap_or_default(),
            std::fs::read_to_string(dir.supervisor_log_old()).unwrap_or_default(),
        )
    }

    fn write(log: &SupervisorLog, level: Level, text: &str) {
        let mut r = log.record(rate_limited(&level, "warren_supervisor::server"));
        r.write_all(text.as_bytes()).expect("write");
    }

    #[test]
    fn test_rate_limit_spares_errors_and_own_state_changes_only() {
        assert!(!rate_limited(&Level::ERROR, "warren_egress::decision"));
        assert!(!rate_limited(&Level::INFO, "warren_supervisor::server"));
        assert!(rate_limited(&Level::INFO, "warren_egress::decision"));
        assert!(rate_limited(&Level::WARN, "warren_supervisor::server"));
        assert!(rate_limited(&Level::DEBUG, "warren_supervisor::console"));
    }

    #[test]
    fn test_guest_text_escapes_and_truncates() {
        assert_eq!(
            guest_text("a\nFORGED\x1b[2J").to_string(),
            "a\\nFORGED\\u{1b}[2J"
        );
        let long = "é".repeat(1000);
        let t = guest_text(&long).to_string();
        assert!(t.len() <= MAX_GUEST_TEXT + 32, "{}", t.len());
        assert!(t.ends_with("…[+976 bytes]"), "{}", &t[t.len() - 20..]);
        // Control: short text passes unchanged.
        assert_eq!(
            guest_text("command not found: x").to_string(),
            "command not found: x"
        );
    }

    #[test]
    fn test_supervisor_log_flood_stays_bounded_and_rotates() {
        let d = tempfile::tempdir().expect("tempdir");
        let dir = VmDir(d.path().to_path_buf());
        let log = SupervisorLog::open_with(dir.clone(), false);
        // Positive control: a first, normal record is written whole.
        write(&log, Level::INFO, "INFO guest ready\n");
        // A flood of megabyte records below error level: most are dropped and counted.
        let big = format!("DEBUG {}\n", "x".repeat(1 << 20));
        for _ in 0..500 {
            write(&log, Level::DEBUG, &big);
        }
        let (cur, _) = read(&dir);
        assert!(cur.starts_with("INFO guest ready\n"), "{}", &cur[..40]);
        assert!(
            cur.lines().all(|l| l.len() <= MAX_RECORD),
            "a line past the cap"
        );
        assert!(cur.contains("…[truncated "), "no truncation marker");
        // The next admitted record says how many were suppressed.
        std::thread::sleep(std::time::Duration::from_millis(250));
        write(&log, Level::WARN, "WARN after the flood\n");
        let (cur, _) = read(&dir);
        let written = cur.lines().filter(|l| l.starts_with("DEBUG x")).count();
        let suppressed: usize = cur
            .lines()
            .find_map(|l| l.strip_prefix("WARN warren_supervisor::log: "))
            .and_then(|l| l.split(' ').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no suppression line: {}", &cur[cur.len() - 300..]));
        assert_eq!(written + suppressed, 500);
        assert!(written < 100, "{written} flood records written");
        assert!(cur.ends_with("WARN after the flood\n"));
        // Errors are not rate-limited, but they are size-bounded and rotate: the two files
        // never hold more than 2 × LOG_HALF plus one record.
        for i in 0..2000 {
            write(
                &log,
                Level::ERROR,
                &format!("ERROR {i} {}\n", "y".repeat(8000)),
            );
        }
        let (cur, old) = read(&dir);
        assert!(
            cur.len() as u64 <= LOG_HALF + MAX_RECORD as u64,
            "{}",
            cur.len()
        );
        assert!(
            old.len() as u64 <= LOG_HALF + MAX_RECORD as u64,
            "{}",
            old.len()
        );
        assert!(!old.is_empty(), "never rotated");
        assert!(cur
            .lines()
            .chain(old.lines())
            .all(|l| l.len() <= MAX_RECORD));
        assert!(cur.contains("ERROR 1999 "), "the latest error is kept");
    }
}
