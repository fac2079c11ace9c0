//! A raw-frame hostile guest against the real `GuestChannel` client (over a socketpair): it
//! resyncs, speaks HTTP/2 and authenticates with the VM secret like the agent, then answers
//! requests with what an attacker would. What the host must bound: the text of the errors it
//! makes from the guest's frames, and the header blocks it decodes.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream as StdStream;
use std::time::{Duration, Instant};

use warren_protocol::framing::{self, Decoder, Event};
use warren_protocol::{
    auth, decode, encode, AgentInfo, GuestResponse, HelloReply, HostRequest, Response,
    PROTOCOL_VERSION,
};
use warren_supervisor::channel::GuestChannel;

const SECRET: &[u8] = b"0123456789abcdef0123456789abcdef";

const DATA: u8 = 0;
const HEADERS: u8 = 1;
const SETTINGS: u8 = 4;
const PING: u8 = 6;
const GOAWAY: u8 = 7;
const CONTINUATION: u8 = 9;
const END_STREAM: u8 = 1;
const END_HEADERS: u8 = 4;
const ACK: u8 = 1;

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len();
    let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
    f.extend_from_slice(&stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// HPACK integer with an `n`-bit prefix, first byte's high bits `hi`.
fn hpack_int(out: &mut Vec<u8>, hi: u8, n: u32, mut v: usize) {
    let max = (1usize << n) - 1;
    if v < max {
        out.push(hi | v as u8);
        return;
    }
    out.push(hi | max as u8);
    v -= max;
    while v >= 128 {
        out.push((v % 128) as u8 | 0x80);
        v /= 128;
    }
    out.push(v as u8);
}

struct Guest {
    s: StdStream,
    dec: Decoder,
    buf: Vec<u8>,
}

impl Guest {
    fn raw(&mut self, b: &[u8]) {
        let mut e = Vec::new();
        framing::encode_data(b, &mut e);
        // The host may close the channel mid-attack (that is a refusal): stop quietly.
        let _ = self.s.write_all(&e);
    }

    /// Reads more; returns false at EOF.
    fn fill(&mut self) -> bool {
        let mut b = vec![0u8; 65536];
        let n = match self.s.read(&mut b) {
            Ok(0) | Err(_) => return false,
            Ok(n) => n,
        };
        let mut ev = Vec::new();
        self.dec.feed(&b[..n], &mut ev);
        for e in ev {
            match e {
                Event::Sync(nonce) => {
                    self.buf.clear();
                    self.s
                        .write_all(&framing::encode_sync_ack(&nonce))
                        .expect("ack");
                }
                Event::Data(d) => self.buf.extend_from_slice(&d),
                _ => {}
            }
        }
        true
    }

    fn take(&mut self, n: usize) -> Option<Vec<u8>> {
        while self.buf.len() < n {
            if !self.fill() {
                return None;
            }
        }
        Some(self.buf.drain(..n).collect())
    }

    /// Next frame: (kind, flags, stream, payload).
    fn next_frame(&mut self) -> Option<(u8, u8, u32, Vec<u8>)> {
        let h = self.take(9)?;
        let len = (usize::from(h[0]) << 16) | (usize::from(h[1]) << 8) | usize::from(h[2]);
        let stream = u32::from_be_bytes([h[5], h[6], h[7], h[8]]) & 0x7fff_ffff;
        let p = self.take(len)?;
        Some((h[3], h[4], stream, p))
    }

    fn respond(&mut self, stream: u32, r: &Response) {
        self.raw(&frame(HEADERS, END_HEADERS, stream, &[0x88]));
        self.raw(&frame(
            DATA,
            END_STREAM,
            stream,
            &encode(r).expect("encode"),
        ));
    }
}

/// How late the guest answers its first HTTP/2 PING.
const FIRST_PONG_DELAY: Duration = Duration::from_millis(300);

/// Runs a guest that authenticates and then hands every later request to `attack`.
fn spawn_guest(
    s: StdStream,
    attack: impl Fn(&mut Guest, u32, HostRequest) + Send + 'static,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut g = Guest {
            s,
            dec: Decoder::new(),
            buf: Vec::new(),
        };
        // The client preface.
        if g.take(24).is_none() {
            return;
        }
        g.raw(&frame(SETTINGS, 0, 0, &[]));
        let mut bodies: std::collections::HashMap<u32, Vec<u8>> = Default::default();
        let guest_nonce = [7u8; 32];
        let mut pings = 0;
        while let Some((kind, flags, stream, p)) = g.next_frame() {
            match kind {
                SETTINGS if flags & ACK == 0 => g.raw(&frame(SETTINGS, ACK, 0, &[])),
                // The first PING is answered late (a caller may give up on it), later ones
                // at once.
                PING if flags & ACK == 0 => {
                    if pings == 0 {
                        std::thread::sleep(FIRST_PONG_DELAY);
                    }
                    pings += 1;
                    g.raw(&frame(PING, ACK, 0, &p));
                }
                DATA => {
                    bodies.entry(stream).or_default().extend_from_slice(&p);
                    if flags & END_STREAM != 0 {
                        let body = bodies.remove(&stream).unwrap_or_default();
                        let req: HostRequest = decode(&body).expect("request");
                        match req {
                            HostRequest::Hello(h) => {
                                let proof = auth::guest_proof(SECRET, &h.host_nonce, &guest_nonce);
                                g.respond(
                                    stream,
                                    &Ok(GuestResponse::Hello(HelloReply {
                                        version: PROTOCOL_VERSION,
                                        guest_nonce,
                                        proof,
                                    })),
                                );
                            }
                            HostRequest::Auth(_) => g.respond(
                                stream,
                                &Ok(GuestResponse::Authenticated(AgentInfo {
                                    agent_version: "x".into(),
                                    kernel_release: "x".into(),
                                    boot_id: "x".into(),
                                    uptime_ms: 0,
                                })),
                            ),
                            other => attack(&mut g, stream, other),
                        }
                    }
                }
                _ => {}
            }
        }
    })
}

async fn connected(
    attack: impl Fn(&mut Guest, u32, HostRequest) + Send + 'static,
) -> (GuestChannel, std::thread::JoinHandle<()>) {
    let (host, guest) = StdStream::pair().expect("pair");
    host.set_nonblocking(true).expect("nonblocking");
    let t = spawn_guest(guest, attack);
    let host = tokio::net::UnixStream::from_std(host).expect("tokio");
    let ch = GuestChannel::connect_over(host, SECRET, Instant::now() + Duration::from_secs(20))
        .await
        .expect("session");
    (ch, t)
}

/// The whole text an error carries, its sources included (what `error_chain` makes of it).
fn chain(err: &dyn std::error::Error) -> String {
    let mut s = err.to_string();
    let mut src = err.source();
    while let Some(x) = src {
        s.push_str(&format!(": {x}"));
        src = x.source();
    }
    s
}

/// A GOAWAY whose debug data fills a whole frame: h2's text would carry all of it, escaped
/// (256 KiB), into the error of every call in flight. The guest's bytes are dropped; the
/// reason code stays.
#[tokio::test(flavor = "current_thread")]
async fn test_goaway_debug_data_never_reaches_the_error() {
    let (ch, _t) = connected(|g, _stream, _req| {
        let mut p = vec![0, 0, 0, 0, 0, 0, 0, 0xb]; // last stream 0, ENHANCE_YOUR_CALM
        p.extend(std::iter::repeat_n(0x1b_u8, 65536 - 8));
        g.raw(&frame(GOAWAY, 0, 0, &p));
    })
    .await;
    let err = ch
        .call(&HostRequest::Ping)
        .await
        .expect_err("the call must fail");
    let text = chain(&err);
    assert!(
        text.len() <= 256,
        "{} bytes: {:?}",
        text.len(),
        &text[..200]
    );
    assert!(!text.contains("x1b") && !text.contains('\x1b'), "{text}");
    assert!(
        text.contains("excessive load"),
        "the reason code stays: {text}"
    );
}

/// Control: a well-behaved answer goes through, with an extra 8 KiB header (what a block
/// under the limit may hold).
#[tokio::test(flavor = "current_thread")]
async fn test_control_answer_with_headers_under_the_limit() {
    let (ch, _t) = connected(|g, stream, _req| {
        let mut block = vec![0x88];
        literal_header(&mut block, b"x-pad", 8 * 1024);
        g.raw(&frame(HEADERS, END_HEADERS, stream, &block));
        g.raw(&pong(stream));
    })
    .await;
    let r = ch.call(&HostRequest::Ping).await.expect("call");
    assert!(matches!(r, Ok(GuestResponse::Pong)));
}

/// The channel's PING: a caller that gave up on one (its PONG still due) does not leave the
/// connection's one PING slot taken; the next caller waits for that PONG, then sends its own.
#[tokio::test(flavor = "current_thread")]
async fn test_channel_ping_after_an_abandoned_ping() {
    let (ch, _t) = connected(|g, stream, _req| g.respond(stream, &Ok(GuestResponse::Pong))).await;
    let first = tokio::time::timeout(Duration::from_millis(50), ch.ping()).await;
    assert!(first.is_err(), "the late PONG came early: {first:?}");
    for _ in 0..3 {
        let rtt = ch.ping().await.expect("a later ping");
        assert!(rtt < Duration::from_secs(10), "{rtt:?}");
    }
    // Requests still go through beside it.
    let r = ch.call(&HostRequest::Ping).await.expect("call");
    assert!(matches!(r, Ok(GuestResponse::Pong)));
}

/// The DATA frame that ends `stream` with a `Pong` answer.
fn pong(stream: u32) -> Vec<u8> {
    let body = encode(&Ok::<_, warren_protocol::GuestError>(GuestResponse::Pong)).expect("enc");
    frame(DATA, END_STREAM, stream, &body)
}

/// An HPACK literal without indexing, new name `name`, a value of `len` bytes.
fn literal_header(block: &mut Vec<u8>, name: &[u8], len: usize) {
    block.push(0x00);
    hpack_int(block, 0, 7, name.len());
    block.extend_from_slice(name);
    hpack_int(block, 0, 7, len);
    block.extend(std::iter::repeat_n(b'a', len));
}

/// An answer whose header block decodes to 15 MiB, over CONTINUATION frames: h2's default
/// (16 MiB) took it whole, decoded; the host's limit refuses it.
#[tokio::test(flavor = "current_thread")]
async fn test_fifteen_mib_response_headers_refused() {
    let (ch, _t) = connected(|g, stream, _req| {
        let mut block = vec![0x88];
        literal_header(&mut block, b"x-big", 15 << 20);
        let chunks: Vec<&[u8]> = block.chunks(1 << 16).collect();
        let last = chunks.len() - 1;
        for (i, c) in chunks.iter().enumerate() {
            let kind = if i == 0 { HEADERS } else { CONTINUATION };
            let flags = if i == last { END_HEADERS } else { 0 };
            g.raw(&frame(kind, flags, stream, c));
        }
        g.raw(&pong(stream));
    })
    .await;
    let r = ch.call(&HostRequest::Ping).await;
    assert!(r.is_err(), "a 15 MiB header block was accepted: {r:?}");
}

/// An error answer announcing a 1 MiB message: the host keeps its first
/// `MAX_GUEST_ERROR_MESSAGE` bytes and resets the stream there, without waiting for (or
/// holding, or decoding) the rest. The guest sends only the first 64 KiB and waits: the
/// old host read on until the call's deadline.
#[tokio::test(flavor = "current_thread")]
async fn test_long_error_message_is_cut_before_the_rest_is_read() {
    use warren_supervisor::channel::MAX_GUEST_ERROR_MESSAGE;
    const RST_STREAM: u8 = 3;
    let (reset_tx, reset_rx) = std::sync::mpsc::channel();
    let (ch, _t) = connected(move |g, stream, _req| {
        let wire = encode(&Err::<GuestResponse, _>(warren_protocol::GuestError::new(
            warren_protocol::ErrorCode::Io,
            "\u{1b}".repeat(512 << 10),
        )))
        .expect("encode");
        g.raw(&frame(HEADERS, END_HEADERS, stream, &[0x88]));
        g.raw(&frame(DATA, 0, stream, &wire[..64 << 10]));
        // What the host sends next for this stream.
        while let Some((kind, _, s, _)) = g.next_frame() {
            if s == stream && kind != DATA {
                let _ = reset_tx.send(kind);
                return;
            }
        }
    })
    .await;
    let answer = tokio::time::timeout(Duration::from_secs(5), ch.call(&HostRequest::Ping))
        .await
        .expect("answered without the rest of the message")
        .expect("the channel stays up");
    let e = answer.expect_err("the guest's error");
    assert_eq!(e.code, warren_protocol::ErrorCode::Io);
    assert!(
        e.message.len() < MAX_GUEST_ERROR_MESSAGE + 32,
        "{}",
        e.message.len()
    );
    assert!(
        e.message.ends_with(&format!(
            "[+{} bytes]",
            (512 << 10) - MAX_GUEST_ERROR_MESSAGE
        )),
        "{}",
        &e.message[e.message.len() - 40..]
    );
    let kind = tokio::task::spawn_blocking(move || reset_rx.recv_timeout(Duration::from_secs(5)))
        .await
        .expect("join")
        .expect("the host reset the stream");
    assert_eq!(kind, RST_STREAM);
    // The connection still answers.
    assert!(ch.ping().await.is_ok());
}
