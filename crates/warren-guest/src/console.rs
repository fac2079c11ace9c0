//! Console logging for the agent: one line per event on stderr (the guest console), rate
//! limited because many log sites are reachable from the host or from guest commands. Never
//! pass payloads or the secret here.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

/// Lines allowed per window; the rest are counted and summarised.
const LINES_PER_WINDOW: u32 = 20;
const WINDOW_SECS: u64 = 10;

struct Window {
    start: Option<Instant>,
    lines: u32,
}

static WINDOW: Mutex<Window> = Mutex::new(Window {
    start: None,
    lines: 0,
});
static SUPPRESSED: AtomicU64 = AtomicU64::new(0);

/// Prints `warren-guest: <msg>` unless the rate limit is exhausted.
pub fn log(msg: fmt::Arguments<'_>) {
    let Ok(mut w) = WINDOW.lock() else { return };
    let now = Instant::now();
    let expired = w
        .start
        .is_none_or(|s| now.duration_since(s).as_secs() >= WINDOW_SECS);
    if expired {
        w.start = Some(now);
        w.lines = 0;
        let dropped = SUPPRESSED.swap(0, Ordering::Relaxed);
        if dropped > 0 {
            eprintln!("warren-guest: {dropped} log lines suppressed");
        }
    }
    if w.lines >= LINES_PER_WINDOW {
        SUPPRESSED.fetch_add(1, Ordering::Relaxed);
        return;
    }
    w.lines += 1;
    eprintln!("warren-guest: {msg}");
}
