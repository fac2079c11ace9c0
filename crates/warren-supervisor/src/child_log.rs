//! The standard error of the VM's QEMU and of each virtiofsd (`qemu.stderr`,
//! `virtiofsd-<tag>.log`), bounded like the supervisor's own log.
//!
//! What these processes print is partly the guest's doing: a root guest can make QEMU print
//! an error line per virtqueue kick (`virtio-serial-bus: Unexpected port id`, "Looped
//! descriptor" after a device reset, ...), with no rate limit in QEMU. A plain file handed
//! to the child would grow until the state directory's disk is full. So the child gets a
//! pipe ([`warren_vmm::StderrPipe`]), and a thread of the supervisor drains it:
//! - lines are cut at [`MAX_RECORD`] bytes, pass the same token bucket as the supervisor's
//!   records ([`crate::log::BURST`], then [`crate::log::PER_SECOND`]; the rest dropped and
//!   counted in a `warren:` line), and the file rotates at
//!   [`LOG_HALF`](crate::rotate::LOG_HALF) (two files, the older `<name>.1`;
//!   [`crate::rotate`]). The child's last line is written whatever the bucket says (it says
//!   why the child ended). Each launch starts the files afresh, as the file QEMU was given
//!   before did: they describe this run only.
//! - The drain never makes the child wait. It is a thread of its own (a blocking read on
//!   the pipe), not a task of the supervisor's single-threaded runtime, so a busy or stalled
//!   runtime does not stop it; it reads whatever arrives at once and writes only what the
//!   bucket admits (a few small writes a second), dropping the rest unwritten. A child
//!   blocks on its stderr only for as long as the 64 KiB pipe is full while this thread is
//!   not scheduled.
//! - When the supervisor is gone the pipe has no reader: a write fails with `EPIPE`. QEMU
//!   ignores `SIGPIPE` from its start and virtiofsd (Rust) does too, so neither dies of it;
//!   both get `SIGKILL` with the supervisor anyway (the parent-death signal), so no VM runs
//!   on without its supervisor and nothing is lost that a reader would have kept. A new
//!   supervisor (a restore) launches a new QEMU with a new pipe.
//!
//! Readers read the tail only ([`last_line`], [`TAIL`] bytes): the exit reason takes QEMU's
//! last line from it once the drain has reached the end of the pipe.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::os::fd::OwnedFd;
use std::path::Path;

use crate::log::{BoundedLog, MAX_RECORD};
#[cfg(test)]
use crate::rotate::LOG_HALF;
use crate::rotate::{old_half, RotatingFile};

/// Bytes read from the end of a log for its last line.
pub const TAIL: u64 = 4096;
/// Room kept in a line for the truncation marker.
const MARKER_ROOM: usize = 48;

/// Resolves when a drain has written everything its child printed (the pipe's end).
pub type Drained = tokio::sync::oneshot::Receiver<()>;

/// Drains `pipe` into the bounded log at `log` on a thread of its own, until every writer
/// closed it. Without a thread, the pipe is dropped (the child's writes then fail with
/// `EPIPE`; it never waits for a reader).
pub fn drain(pipe: OwnedFd, log: &Path) -> Drained {
    let (done, drained) = tokio::sync::oneshot::channel();
    let path = log.to_path_buf();
    let name = format!(
        "drain {}",
        log.file_name().unwrap_or_default().to_string_lossy()
    );
    let spawned = std::thread::Builder::new()
        .name(name)
        .stack_size(256 * 1024)
        .spawn(move || {
            let mut out = BoundedLog::new(RotatingFile::fresh(path), "warren", None);
            copy_lines(File::from(pipe), &mut out);
            let _ = done.send(());
        });
    if let Err(e) = spawned {
        tracing::warn!(log = %log.display(), error = %e, "no thread to drain a child's stderr");
    }
    drained
}

/// Copies `input` to `out` a line at a time (each cut at [`MAX_RECORD`] bytes, the rate
/// limit applied) until it ends. The last line is always written, outside the rate limit
/// (one record per pipe): it says why the child ended, even after a flood.
fn copy_lines(mut input: impl Read, out: &mut BoundedLog) {
    let keep = MAX_RECORD - MARKER_ROOM;
    let mut buf = vec![0u8; 16 * 1024];
    let mut line: Vec<u8> = Vec::with_capacity(keep + 1);
    let mut cut = 0usize;
    // The latest line the rate limit dropped, while no line came after it.
    let mut dropped: Vec<u8> = Vec::with_capacity(keep + 1);
    let mut dropped_cut = None;
    loop {
        let n = match input.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => break,
        };
        for piece in buf[..n].split_inclusive(|&b| b == b'\n') {
            let (text, ends) = match piece.split_last() {
                Some((b'\n', text)) => (text, true),
                _ => (piece, false),
            };
            let room = keep.saturating_sub(line.len());
            let take = text.len().min(room);
            line.extend_from_slice(&text[..take]);
            cut += text.len() - take;
            if ends {
                line.push(b'\n');
                if out.commit(&line, cut, true) {
                    dropped_cut = None;
                } else {
                    std::mem::swap(&mut line, &mut dropped);
                    dropped_cut = Some(cut);
                }
                line.clear();
                cut = 0;
            }
        }
    }
    if !line.is_empty() || cut > 0 {
        line.push(b'\n');
        out.commit(&line, cut, false);
    } else if let Some(cut) = dropped_cut {
        out.commit(&dropped, cut, false);
    }
}

/// The last non-empty line of the log at `path` (its older half if the current one has
/// none), read from at most [`TAIL`] bytes of each file, control characters escaped and
/// cut like any guest-caused text ([`crate::log::guest_text`]).
pub fn last_line(path: &Path) -> Option<String> {
    [path.to_path_buf(), old_half(path)]
        .iter()
        .find_map(|p| last_line_of(p))
}

fn last_line_of(path: &Path) -> Option<String> {
    let mut f = File::open(path).ok()?;
    let len = f.metadata().ok()?.len();
    let start = len.saturating_sub(TAIL);
    f.seek(SeekFrom::Start(start)).ok()?;
    let mut tail = Vec::with_capacity(TAIL as usize);
    f.take(TAIL).read_to_end(&mut tail).ok()?;
    let text = String::from_utf8_lossy(&tail);
    let line = text.lines().rev().find(|l| !l.trim().is_empty())?;
    Some(crate::log::guest_text(line).to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// Bytes the two halves of a log may hold at most.
    const MAX_KEPT: u64 = 2 * LOG_HALF;

    fn kib_hwm() -> u64 {
        let s = std::fs::read_to_string("/proc/self/status").expect("status");
        s.lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("VmHWM")
    }

    fn on_disk(path: &Path) -> u64 {
        [path.to_path_buf(), old_half(path)]
            .iter()
            .filter_map(|p| std::fs::metadata(p).ok())
            .map(|m| m.len())
            .sum()
    }

    /// A hostile QEMU stand-in writes 100 MiB of error lines (and one endless line) to its
    /// stderr: the writer is never held up for long, at most two halves stay on disk, the
    /// lines kept are whole and cut, and the suppression is counted.
    #[test]
    fn test_stderr_flood_is_drained_into_a_bounded_log() {
        let d = tempfile::tempdir().expect("tempdir");
        let log = d.path().join("qemu.stderr");
        std::fs::write(old_half(&log), "a previous run\n").expect("stale");
        let (read, write) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).expect("pipe");
        let drained = drain(read, &log);
        let writer = std::thread::spawn(move || {
            let mut w = File::from(write);
            let line = b"qemu-system-x86_64: virtio-serial-bus: Unexpected port id 4660 for device virtio-serial-bus.0\n";
            let mut chunk = Vec::new();
            while chunk.len() + line.len() <= 64 * 1024 {
                chunk.extend_from_slice(line);
            }
            let started = std::time::Instant::now();
            let mut written = 0usize;
            while written < 100 << 20 {
                w.write_all(&chunk).expect("the drain reads on");
                written += chunk.len();
            }
            w.write_all(&vec![b'x'; 1 << 20]).expect("endless line");
            w.write_all(b"\nqemu-system-x86_64: terminating on signal 15\n")
                .expect("last");
            started.elapsed()
        });
        let took = writer.join().expect("writer");
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("runtime");
        rt.block_on(async {
            tokio::time::timeout(std::time::Duration::from_secs(30), drained)
                .await
                .expect("drained in time")
                .expect("drain finished");
        });
        assert!(took.as_secs() < 20, "the writer waited {took:?}");
        let kept = on_disk(&log);
        assert!(kept <= MAX_KEPT, "{kept} bytes kept");
        let cur = std::fs::read_to_string(&log).expect("read");
        let old = std::fs::read_to_string(old_half(&log)).unwrap_or_default();
        assert!(
            !old.contains("a previous run"),
            "the old half is this run's"
        );
        assert!(
            cur.lines()
                .chain(old.lines())
                .all(|l| l.len() <= MAX_RECORD),
            "a line past the cap"
        );
        assert!(cur.contains("warren: "), "no suppression count: {cur}");
        // Positive control: the first lines (the burst) are kept whole.
        let first = old.lines().chain(cur.lines()).next().expect("a line");
        assert!(first.ends_with("virtio-serial-bus.0"), "{first}");
        // The last line is kept, after the flood and its count.
        assert!(
            cur.ends_with("\nqemu-system-x86_64: terminating on signal 15\n"),
            "{}",
            &cur[cur.len().saturating_sub(300)..]
        );
        assert_eq!(
            last_line(&log).as_deref(),
            Some("qemu-system-x86_64: terminating on signal 15")
        );
    }

    /// The last line comes from the log's tail, never from reading it whole: a 1 GiB
    /// (sparse) log costs no memory. Positive control: the line is found.
    #[test]
    fn test_last_line_reads_the_tail_only() {
        let d = tempfile::tempdir().expect("tempdir");
        let log = d.path().join("qemu.stderr");
        let f = File::create(&log).expect("create");
        f.set_len(1 << 30).expect("len");
        drop(f);
        std::fs::OpenOptions::new()
            .append(true)
            .open(&log)
            .expect("open")
            .write_all(b"\nqemu-system-x86_64: bad \x1b[2J thing\n\n")
            .expect("write");
        let before = kib_hwm();
        let line = last_line(&log).expect("a line");
        let grew = kib_hwm().saturating_sub(before);
        assert_eq!(line, "qemu-system-x86_64: bad \\u{1b}[2J thing");
        assert!(grew < 16 * 1024, "VmHWM grew by {grew} KiB");
        // Only the older half has lines: it is used.
        std::fs::rename(&log, old_half(&log)).expect("rotate");
        File::create(&log).expect("empty current half");
        assert!(last_line(&log).is_some_and(|l| l.contains("bad")));
        assert_eq!(last_line(&d.path().join("missing")), None);
    }
}
