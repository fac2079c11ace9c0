//! Progress of long operations (image builds, copies, suspensions, pulls): one module, so
//! every command reports the same way.
//!
//! On a terminal (stderr is a TTY) it draws with `indicatif`: a bar for byte counts with a
//! known total, a byte counter otherwise, and a spinner with the current step; finished
//! steps stay above it as lines. Anywhere else (a pipe, a log, CI) it never draws: steps are
//! plain lines, byte counts a line every [`PLAIN_EVERY`] and one when the operation
//! finishes. Nothing goes to stdout, which stays the command's result.
//!
//! The API is deliberately small and stable (other commands build on it):
//!
//! - [`Progress::bytes`] `(label, total)` then [`Progress::inc`] per chunk;
//! - [`Progress::steps`] `(label)` then [`Progress::step`] per step;
//! - [`Progress::finish`] when it succeeded (a summary line); dropping it without
//!   finishing (an error) clears the drawing and prints nothing more.
//!
//! A `Progress` is cheap to clone and `Send + Sync`: clones report to the same display.

use std::io::IsTerminal;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// How often a byte count prints a plain line when stderr is not a terminal.
pub const PLAIN_EVERY: Duration = Duration::from_secs(10);

/// Progress of one operation; see the module documentation.
#[derive(Clone)]
pub struct Progress {
    inner: Arc<Inner>,
}

struct Inner {
    label: String,
    /// Total bytes, 0 when unknown (or when counting steps).
    total: u64,
    kind: Kind,
    started: Instant,
    done: AtomicU64,
    /// Drawn on a terminal; `None` prints plain lines.
    bar: Option<ProgressBar>,
    /// When the last plain line was printed.
    last_line: Mutex<Instant>,
    finished: std::sync::atomic::AtomicBool,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Bytes,
    Steps,
}

impl Progress {
    /// A byte count for `label` (e.g. `src -> vm:/dir`), of `total` bytes when known.
    pub fn bytes(label: impl Into<String>, total: Option<u64>) -> Progress {
        Progress::new(label.into(), Kind::Bytes, total.unwrap_or(0), terminal())
    }

    /// A sequence of named steps for `label` (e.g. `image dev`), with the elapsed time.
    pub fn steps(label: impl Into<String>) -> Progress {
        Progress::new(label.into(), Kind::Steps, 0, terminal())
    }

    fn new(label: String, kind: Kind, total: u64, draw: bool) -> Progress {
        let bar = draw.then(|| {
            let bar = match (kind, total) {
                (Kind::Bytes, t) if t > 0 => {
                    ProgressBar::with_draw_target(Some(t), ProgressDrawTarget::stderr()).with_style(
                        style(
                            "{prefix}: [{bar:30}] {binary_bytes}/{binary_total_bytes} \
                     ({binary_bytes_per_sec}, {eta})",
                        ),
                    )
                }
                (Kind::Bytes, _) => {
                    ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr()).with_style(
                        style("{spinner} {prefix}: {binary_bytes} ({binary_bytes_per_sec})"),
                    )
                }
                (Kind::Steps, _) => {
                    ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr())
                        .with_style(style("{spinner} [{elapsed:>4}] {prefix}: {wide_msg}"))
                }
            };
            bar.set_prefix(label.clone());
            bar.enable_steady_tick(Duration::from_millis(120));
            bar
        });
        let now = Instant::now();
        Progress {
            inner: Arc::new(Inner {
                label,
                total,
                kind,
                started: now,
                done: AtomicU64::new(0),
                bar,
                last_line: Mutex::new(now),
                finished: std::sync::atomic::AtomicBool::new(false),
            }),
        }
    }

    /// Adds `n` bytes done.
    pub fn inc(&self, n: u64) {
        let i = &self.inner;
        let done = i.done.fetch_add(n, Ordering::Relaxed) + n;
        match &i.bar {
            Some(bar) => bar.inc(n),
            None => {
                let Ok(mut last) = i.last_line.lock() else {
                    return;
                };
                if last.elapsed() >= PLAIN_EVERY {
                    *last = Instant::now();
                    eprintln!("{}", i.bytes_line(done));
                }
            }
        }
    }

    /// Starts step `msg`: the previous step stays as a line above the spinner on a
    /// terminal; elsewhere each step is a line with the elapsed time.
    pub fn step(&self, msg: &str) {
        let i = &self.inner;
        let line = format!("[{:>6.1}s] {}: {msg}", i.elapsed_secs(), i.label);
        match &i.bar {
            Some(bar) => {
                bar.println(&line);
                bar.set_message(msg.to_string());
            }
            None => eprintln!("{line}"),
        }
    }

    /// The operation succeeded: clears the drawing and prints a summary line (`summary`
    /// after the label, or the byte count and rate).
    pub fn finish(&self, summary: Option<&str>) {
        let i = &self.inner;
        if i.finished.swap(true, Ordering::Relaxed) {
            return;
        }
        if let Some(bar) = &i.bar {
            bar.finish_and_clear();
        }
        let line = match (summary, i.kind) {
            (Some(s), _) => format!("[{:>6.1}s] {}: {s}", i.elapsed_secs(), i.label),
            (None, Kind::Bytes) => i.bytes_line(i.done.load(Ordering::Relaxed)),
            (None, Kind::Steps) => format!("[{:>6.1}s] {}: done", i.elapsed_secs(), i.label),
        };
        eprintln!("{line}");
    }
}

impl Inner {
    fn elapsed_secs(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }

    fn bytes_line(&self, done: u64) -> String {
        let secs = self.elapsed_secs();
        let of = if self.total > 0 {
            format!(" of {}", mib(self.total))
        } else {
            String::new()
        };
        format!(
            "{}: {}{of} in {secs:.1}s ({:.1} MiB/s)",
            self.label,
            mib(done),
            done as f64 / (1u64 << 20) as f64 / secs.max(1e-3)
        )
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // An operation that failed leaves no half-drawn bar behind its error message.
        if let Some(bar) = &self.bar {
            if !bar.is_finished() {
                bar.finish_and_clear();
            }
        }
    }
}

fn terminal() -> bool {
    std::io::stderr().is_terminal()
}

fn style(template: &str) -> ProgressStyle {
    // The templates are constants of this module; a bad one is a programming error that
    // the unit tests below catch, and falls back to the default style rather than panicking.
    ProgressStyle::with_template(template)
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> ")
}

fn mib(n: u64) -> String {
    format!("{:.1} MiB", n as f64 / (1u64 << 20) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_progress_templates_parse_ok() {
        for t in [
            "{prefix}: [{bar:30}] {binary_bytes}/{binary_total_bytes} \
             ({binary_bytes_per_sec}, {eta})",
            "{spinner} {prefix}: {binary_bytes} ({binary_bytes_per_sec})",
            "{spinner} [{elapsed:>4}] {prefix}: {wide_msg}",
        ] {
            assert!(ProgressStyle::with_template(t).is_ok(), "{t}");
        }
    }

    #[test]
    fn test_progress_plain_bytes_counted_and_finished_once() {
        let p = Progress::new("copy".into(), Kind::Bytes, 3 << 20, false);
        p.inc(1 << 20);
        p.clone().inc(1 << 20);
        assert_eq!(p.inner.done.load(Ordering::Relaxed), 2 << 20);
        let line = p.inner.bytes_line(2 << 20);
        assert!(line.starts_with("copy: 2.0 MiB of 3.0 MiB in "), "{line}");
        p.finish(None);
        assert!(p.inner.finished.load(Ordering::Relaxed));
        p.finish(None);
    }

    #[test]
    fn test_progress_dropped_unfinished_clears_the_bar() {
        let p = Progress::new("steps".into(), Kind::Steps, 0, true);
        p.step("one");
        let bar = p.inner.bar.clone().expect("drawn");
        drop(p);
        assert!(bar.is_finished());
    }
}
