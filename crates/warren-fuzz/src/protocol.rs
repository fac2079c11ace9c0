//! Targets for `warren-protocol`: the resync framing decoder and the host-side decoding of
//! what a guest sends.

use warren_protocol::framing::{self, Decoder, Event, SYNC_NONCE_LEN};
use warren_protocol::limits::MAX_MESSAGE_BYTES;
use warren_protocol::{decode, encode, Response};

/// The resync framing decoder. Invariants: however the input is split into reads, the events
/// are the same (up to how data is merged); no event holds more data than the input; and
/// re-encoding the events gives back the input, except for invalid escapes (`Garbage`, two
/// bytes each) and an unfinished trailing escape or marker.
pub fn framing(data: &[u8]) {
    let whole = decode_in(std::iter::once(data));
    // The split points come from the input itself, so the fuzzer controls them.
    let step = usize::from(data.first().copied().unwrap_or(1)).max(1);
    let split = decode_in(data.chunks(step));
    assert_eq!(
        merged(&whole),
        merged(&split),
        "events depend on read boundaries"
    );

    let mut wire = Vec::new();
    let mut garbage = 0;
    for e in &whole {
        match e {
            Event::Data(d) => {
                assert!(!d.is_empty(), "empty Data event");
                framing::encode_data(d, &mut wire);
            }
            Event::Sync(n) => wire.extend(framing::encode_sync(n)),
            Event::SyncAck(n) => wire.extend(framing::encode_sync_ack(n)),
            Event::Garbage => garbage += 1,
        }
    }
    // Each `Garbage` consumed exactly two bytes; at most `2 + SYNC_NONCE_LEN - 1` bytes of an
    // unfinished marker are pending at the end.
    let consumed = wire.len() + 2 * garbage;
    assert!(
        consumed <= data.len(),
        "decoder produced more than its input"
    );
    assert!(
        data.len() - consumed < 2 + SYNC_NONCE_LEN,
        "decoder lost bytes"
    );
    if garbage == 0 {
        assert_eq!(
            wire,
            data[..wire.len()],
            "re-encoding differs from the input"
        );
    }
}

fn decode_in<'a>(reads: impl Iterator<Item = &'a [u8]>) -> Vec<Event> {
    let mut d = Decoder::new();
    let mut events = Vec::new();
    for r in reads {
        d.feed(r, &mut events);
    }
    events
}

/// Events with adjacent `Data` merged.
fn merged(events: &[Event]) -> Vec<Event> {
    let mut out: Vec<Event> = Vec::new();
    for e in events {
        match (out.last_mut(), e) {
            (Some(Event::Data(prev)), Event::Data(d)) => prev.extend_from_slice(d),
            _ => out.push(e.clone()),
        }
    }
    out
}

/// A response body as the supervisor decodes it (`Result<GuestResponse, GuestError>`).
/// Invariants: a decoded message re-encodes to at most its input's length (postcard has no
/// padding) and decodes back to the same value.
pub fn guest_messages(data: &[u8]) {
    let Ok(msg) = decode::<Response>(data) else {
        return;
    };
    assert!(data.len() <= MAX_MESSAGE_BYTES);
    let wire = encode(&msg).expect("a decoded message re-encodes");
    assert!(
        wire.len() <= data.len(),
        "re-encoding is longer than the input"
    );
    let again: Response = decode(&wire).expect("a re-encoded message decodes");
    assert_eq!(again, msg, "decode(encode(m)) != m");
}
