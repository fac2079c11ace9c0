//! Byte stuffing under the HTTP/2 stream so that resynchronisation markers can never be
//! confused with data.
//!
//! Encoding: every data byte except [`ESC`] is sent as is; `ESC` is sent as `ESC 0x01`.
//! A marker is `ESC <kind> <16-byte nonce>` with kind `0x02` (`Sync`, host -> guest) or
//! `0x03` (`SyncAck`, guest -> host). Any other byte after `ESC` is a framing error: the
//! decoder reports [`Event::Garbage`] and keeps scanning, which is what a reader that starts
//! in the middle of stale bytes wants.
//!
//! The [`Decoder`] keeps its state across `feed` calls, so markers split across reads are
//! recognised.

/// The escape byte. Chosen as a byte that is rare in text and not special in HTTP/2 headers.
pub const ESC: u8 = 0xF5;
const KIND_DATA_ESC: u8 = 0x01;
const KIND_SYNC: u8 = 0x02;
const KIND_SYNC_ACK: u8 = 0x03;

/// Length of a resync nonce.
pub const SYNC_NONCE_LEN: usize = 16;

/// A resync nonce.
pub type SyncNonce = [u8; SYNC_NONCE_LEN];

/// Something the decoder found in the byte stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// Payload bytes, unescaped.
    Data(Vec<u8>),
    /// Host asks the guest to start a new session.
    Sync(SyncNonce),
    /// Guest confirms it started a new session for this nonce.
    SyncAck(SyncNonce),
    /// An invalid escape sequence was skipped.
    Garbage,
}

/// Appends the escaped form of `data` to `out`.
pub fn encode_data(data: &[u8], out: &mut Vec<u8>) {
    out.reserve(data.len() + data.len() / 64 + 2);
    let mut rest = data;
    while let Some(pos) = memchr::memchr(ESC, rest) {
        out.extend_from_slice(&rest[..pos]);
        out.extend_from_slice(&[ESC, KIND_DATA_ESC]);
        rest = &rest[pos + 1..];
    }
    out.extend_from_slice(rest);
}

/// Encodes a `Sync` marker.
pub fn encode_sync(nonce: &SyncNonce) -> Vec<u8> {
    marker(KIND_SYNC, nonce)
}

/// Encodes a `SyncAck` marker.
pub fn encode_sync_ack(nonce: &SyncNonce) -> Vec<u8> {
    marker(KIND_SYNC_ACK, nonce)
}

fn marker(kind: u8, nonce: &SyncNonce) -> Vec<u8> {
    let mut v = Vec::with_capacity(2 + SYNC_NONCE_LEN);
    v.push(ESC);
    v.push(kind);
    v.extend_from_slice(nonce);
    v
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum State {
    #[default]
    Plain,
    Escaped,
    Nonce {
        kind: u8,
        have: usize,
    },
}

/// Incremental decoder; see the module docs for the format.
#[derive(Debug, Default, Clone)]
pub struct Decoder {
    state: State,
    nonce: SyncNonce,
}

impl Decoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Decodes `input`, appending what it found to `events`. Consecutive data is merged into
    /// one `Data` event per call.
    pub fn feed(&mut self, input: &[u8], events: &mut Vec<Event>) {
        let mut data = Vec::new();
        let mut i = 0;
        while i < input.len() {
            match self.state {
                State::Plain => {
                    let rest = &input[i..];
                    match memchr::memchr(ESC, rest) {
                        Some(pos) => {
                            data.extend_from_slice(&rest[..pos]);
                            self.state = State::Escaped;
                            i += pos + 1;
                        }
                        None => {
                            data.extend_from_slice(rest);
                            i = input.len();
                        }
                    }
                }
                State::Escaped => {
                    let kind = input[i];
                    i += 1;
                    match kind {
                        KIND_DATA_ESC => {
                            data.push(ESC);
                            self.state = State::Plain;
                        }
                        KIND_SYNC | KIND_SYNC_ACK => {
                            self.state = State::Nonce { kind, have: 0 };
                        }
                        _ => {
                            flush(&mut data, events);
                            events.push(Event::Garbage);
                            self.state = State::Plain;
                        }
                    }
                }
                State::Nonce { kind, have } => {
                    let take = (SYNC_NONCE_LEN - have).min(input.len() - i);
                    self.nonce[have..have + take].copy_from_slice(&input[i..i + take]);
                    i += take;
                    let have = have + take;
                    if have == SYNC_NONCE_LEN {
                        flush(&mut data, events);
                        events.push(if kind == KIND_SYNC {
                            Event::Sync(self.nonce)
                        } else {
                            Event::SyncAck(self.nonce)
                        });
                        self.state = State::Plain;
                    } else {
                        self.state = State::Nonce { kind, have };
                    }
                }
            }
        }
        flush(&mut data, events);
    }
}

/// What [`Decoder::decode_in_place`] did with a buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InPlace {
    /// Unescaped data bytes, now at the start of the buffer.
    pub data: usize,
    /// Input bytes consumed. Less than the buffer's length only when `marker` is set: the
    /// bytes after the marker are not decoded yet (they belong to what follows it).
    pub consumed: usize,
    /// The marker (`Sync`, `SyncAck`) or invalid escape (`Garbage`) that ended this call;
    /// never `Data`.
    pub marker: Option<Event>,
}

impl Decoder {
    /// Decodes `buf` in place, without allocating: its data bytes are moved to its start
    /// and decoding stops after the first marker or invalid escape (see [`InPlace`]). The
    /// state carries over to the next call exactly as with [`Decoder::feed`].
    pub fn decode_in_place(&mut self, buf: &mut [u8]) -> InPlace {
        let (mut w, mut r) = (0, 0);
        while r < buf.len() {
            match self.state {
                State::Plain => {
                    let (len, next) = match memchr::memchr(ESC, &buf[r..]) {
                        Some(pos) => (pos, Some(State::Escaped)),
                        None => (buf.len() - r, None),
                    };
                    if w != r {
                        buf.copy_within(r..r + len, w);
                    }
                    w += len;
                    r += len;
                    if let Some(state) = next {
                        r += 1;
                        self.state = state;
                    }
                }
                State::Escaped => {
                    let kind = buf[r];
                    r += 1;
                    match kind {
                        KIND_DATA_ESC => {
                            // `w < r` here: the escape took two input bytes for one.
                            buf[w] = ESC;
                            w += 1;
                            self.state = State::Plain;
                        }
                        KIND_SYNC | KIND_SYNC_ACK => self.state = State::Nonce { kind, have: 0 },
                        _ => {
                            self.state = State::Plain;
                            return InPlace {
                                data: w,
                                consumed: r,
                                marker: Some(Event::Garbage),
                            };
                        }
                    }
                }
                State::Nonce { kind, have } => {
                    let take = (SYNC_NONCE_LEN - have).min(buf.len() - r);
                    self.nonce[have..have + take].copy_from_slice(&buf[r..r + take]);
                    r += take;
                    let have = have + take;
                    if have < SYNC_NONCE_LEN {
                        self.state = State::Nonce { kind, have };
                        continue;
                    }
                    self.state = State::Plain;
                    return InPlace {
                        data: w,
                        consumed: r,
                        marker: Some(if kind == KIND_SYNC {
                            Event::Sync(self.nonce)
                        } else {
                            Event::SyncAck(self.nonce)
                        }),
                    };
                }
            }
        }
        InPlace {
            data: w,
            consumed: r,
            marker: None,
        }
    }
}

fn flush(data: &mut Vec<u8>, events: &mut Vec<Event>) {
    if !data.is_empty() {
        events.push(Event::Data(std::mem::take(data)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode_bytewise(wire: &[u8]) -> Vec<Event> {
        let mut d = Decoder::new();
        let mut ev = Vec::new();
        for b in wire {
            d.feed(std::slice::from_ref(b), &mut ev);
        }
        ev
    }

    fn data_of(ev: &[Event]) -> Vec<u8> {
        ev.iter()
            .filter_map(|e| match e {
                Event::Data(d) => Some(d.clone()),
                _ => None,
            })
            .flatten()
            .collect()
    }

    #[test]
    fn test_roundtrip_all_bytes_split_anywhere_preserved() {
        let payload: Vec<u8> = (0..=255u8).cycle().take(3000).collect();
        let mut wire = Vec::new();
        encode_data(&payload, &mut wire);
        assert_eq!(data_of(&decode_bytewise(&wire)), payload);
        let mut d = Decoder::new();
        let mut ev = Vec::new();
        d.feed(&wire, &mut ev);
        assert_eq!(data_of(&ev), payload);
    }

    #[test]
    fn test_marker_in_data_never_decodes_as_sync() {
        let nonce = [9u8; SYNC_NONCE_LEN];
        let fake = encode_sync(&nonce);
        let mut wire = Vec::new();
        encode_data(&fake, &mut wire);
        let ev = decode_bytewise(&wire);
        assert!(ev.iter().all(|e| matches!(e, Event::Data(_))));
        assert_eq!(data_of(&ev), fake);
    }

    #[test]
    fn test_sync_split_across_feeds_recognised_in_order() {
        let nonce = [3u8; SYNC_NONCE_LEN];
        let mut wire = Vec::new();
        encode_data(b"old", &mut wire);
        wire.extend(encode_sync(&nonce));
        encode_data(b"new", &mut wire);
        wire.extend(encode_sync_ack(&nonce));
        let ev = decode_bytewise(&wire);
        let kinds: Vec<_> = ev
            .iter()
            .filter(|e| !matches!(e, Event::Data(_)))
            .cloned()
            .collect();
        assert_eq!(kinds, vec![Event::Sync(nonce), Event::SyncAck(nonce)]);
        let mut d = Decoder::new();
        let mut ev2 = Vec::new();
        d.feed(&wire, &mut ev2);
        assert_eq!(
            ev2,
            vec![
                Event::Data(b"old".to_vec()),
                Event::Sync(nonce),
                Event::Data(b"new".to_vec()),
                Event::SyncAck(nonce)
            ]
        );
    }

    /// Decodes `wire` split into `chunk`-byte reads with `decode_in_place`, as events.
    fn decode_in_place_split(wire: &[u8], chunk: usize) -> Vec<Event> {
        let mut d = Decoder::new();
        let mut ev = Vec::new();
        for piece in wire.chunks(chunk) {
            let mut buf = piece.to_vec();
            let mut start = 0;
            loop {
                let r = d.decode_in_place(&mut buf[start..]);
                if r.data > 0 {
                    ev.push(Event::Data(buf[start..start + r.data].to_vec()));
                }
                start += r.consumed;
                match r.marker {
                    Some(m) => ev.push(m),
                    None => break,
                }
                if start == buf.len() {
                    break;
                }
            }
        }
        ev
    }

    /// Merges consecutive data events, so differently split decodings compare equal.
    fn merged(ev: Vec<Event>) -> Vec<Event> {
        let mut out: Vec<Event> = Vec::new();
        for e in ev {
            match (out.last_mut(), e) {
                (Some(Event::Data(prev)), Event::Data(d)) => prev.extend_from_slice(&d),
                (_, e) => out.push(e),
            }
        }
        out
    }

    #[test]
    fn test_decode_in_place_matches_feed_however_split() {
        let nonce = [ESC; SYNC_NONCE_LEN];
        let payload: Vec<u8> = (0..=255u8).cycle().take(5000).collect();
        let mut wire = Vec::new();
        encode_data(&payload, &mut wire);
        wire.extend(encode_sync(&nonce));
        encode_data(&[ESC, ESC, 1, 2], &mut wire);
        wire.extend([ESC, 0x77]);
        encode_data(b"tail", &mut wire);
        wire.extend(encode_sync_ack(&[7; SYNC_NONCE_LEN]));
        wire.push(ESC);
        let expected = merged(decode_bytewise(&wire));
        for chunk in [1, 2, 3, 17, 18, 19, 4096, wire.len()] {
            assert_eq!(
                merged(decode_in_place_split(&wire, chunk)),
                expected,
                "split into {chunk}-byte reads"
            );
        }
    }

    #[test]
    fn test_invalid_escape_reports_garbage_and_continues() {
        let mut d = Decoder::new();
        let mut ev = Vec::new();
        d.feed(&[b'a', ESC, 0x77, b'b'], &mut ev);
        assert_eq!(
            ev,
            vec![
                Event::Data(b"a".to_vec()),
                Event::Garbage,
                Event::Data(b"b".to_vec())
            ]
        );
    }
}
