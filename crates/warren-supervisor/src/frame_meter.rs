//! A frame budget on what the guest sends over the channel.
//!
//! `h2` bounds the memory a peer can make it hold (one pending PONG, bounded SETTINGS, flow
//! control), but not the host CPU that parsing and answering costs: a guest that writes
//! PING or SETTINGS frames as fast as its port allows keeps the supervisor busy and slows
//! its neighbours. The channel's inbound bridge therefore counts the HTTP/2 frames in the
//! decoded stream and, past a budget, stops reading until the budget refills; the guest's
//! own writes then back up, which only it feels.
//!
//! Only the 9-byte frame headers are looked at (length and nothing else): the stream is
//! still parsed by `h2`. No crate exposes frame boundaries below `h2`'s codec, hence this
//! thin counter. The budget is far above what a legitimate guest sends: its bodies go out in
//! frames of up to 64 KiB, so [`FRAMES_PER_SECOND`] frames carry over 500 MiB/s.

use std::time::{Duration, Instant};

/// Frames the guest may send at once before the rate applies.
pub const FRAME_BURST: f64 = 4096.0;
/// Frames per second the guest may send after the burst.
pub const FRAMES_PER_SECOND: f64 = 8192.0;
/// Length of an HTTP/2 frame header.
const HEADER: usize = 9;

/// Tracks frame boundaries in the guest's HTTP/2 byte stream and the frame budget.
#[derive(Debug)]
pub struct FrameMeter {
    /// Payload bytes of the current frame still to come.
    payload_left: usize,
    /// A frame header split across reads.
    header: [u8; HEADER],
    header_len: usize,
    tokens: f64,
    refilled: Instant,
}

impl Default for FrameMeter {
    fn default() -> Self {
        FrameMeter::new()
    }
}

impl FrameMeter {
    pub fn new() -> FrameMeter {
        FrameMeter {
            payload_left: 0,
            header: [0; HEADER],
            header_len: 0,
            tokens: FRAME_BURST,
            refilled: Instant::now(),
        }
    }

    /// Counts the frames that start in `data` (the next bytes of the stream).
    pub fn count(&mut self, mut data: &[u8]) -> u64 {
        let mut frames = 0;
        while !data.is_empty() {
            if self.payload_left > 0 {
                let n = self.payload_left.min(data.len());
                self.payload_left -= n;
                data = &data[n..];
                continue;
            }
            let n = (HEADER - self.header_len).min(data.len());
            self.header[self.header_len..self.header_len + n].copy_from_slice(&data[..n]);
            self.header_len += n;
            data = &data[n..];
            if self.header_len == HEADER {
                self.header_len = 0;
                self.payload_left = (usize::from(self.header[0]) << 16)
                    | (usize::from(self.header[1]) << 8)
                    | usize::from(self.header[2]);
                frames += 1;
            }
        }
        frames
    }

    /// Takes `frames` from the budget; returns how long to wait before reading on (zero while
    /// the budget lasts).
    pub fn charge(&mut self, frames: u64, now: Instant) -> Duration {
        let elapsed = now.saturating_duration_since(self.refilled).as_secs_f64();
        self.refilled = now;
        self.tokens = (self.tokens + elapsed * FRAMES_PER_SECOND).min(FRAME_BURST);
        self.tokens -= frames as f64;
        if self.tokens >= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(-self.tokens / FRAMES_PER_SECOND)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(len: usize, kind: u8) -> Vec<u8> {
        let mut f = vec![
            (len >> 16) as u8,
            (len >> 8) as u8,
            len as u8,
            kind,
            0,
            0,
            0,
            0,
            1,
        ];
        f.extend(std::iter::repeat_n(0xAB, len));
        f
    }

    #[test]
    fn test_frame_meter_counts_frames_however_the_stream_is_split() {
        let mut stream = Vec::new();
        for len in [0, 8, 0, 131_072, 17, 0] {
            stream.extend(frame(len, 6));
        }
        for chunk in [1, 2, 5, 9, 10, 4096, stream.len()] {
            let mut m = FrameMeter::new();
            let n: u64 = stream.chunks(chunk).map(|c| m.count(c)).sum();
            assert_eq!(n, 6, "split into {chunk}-byte reads");
            assert_eq!((m.payload_left, m.header_len), (0, 0));
        }
    }

    #[test]
    fn test_frame_meter_budget_burst_then_rate() {
        let mut m = FrameMeter::new();
        let t = m.refilled;
        assert_eq!(m.charge(FRAME_BURST as u64, t), Duration::ZERO);
        // Past the burst: a wait proportional to the excess.
        let wait = m.charge(FRAMES_PER_SECOND as u64 / 2, t);
        assert!((wait.as_secs_f64() - 0.5).abs() < 1e-6, "{wait:?}");
        // After that wait the budget is even again; idle time refills at most the burst.
        let t = t + wait;
        assert_eq!(m.charge(0, t), Duration::ZERO);
        let t = t + Duration::from_secs(10);
        assert_eq!(m.charge(FRAME_BURST as u64, t), Duration::ZERO);
        assert!(m.charge(1, t) > Duration::ZERO);
    }
}
