//! `warren-hostile-qemu`: a test-only stand-in for QEMU that plays a hostile guest (issue 14,
//! item 7). Never installed; `tests/hostile_guest.rs` selects it with `$WARREN_QEMU`.
//!
//! Why hand-written: the attacks are about bytes the `h2` crate's server never sends (frames
//! over the size limit, endless CONTINUATION, answers on streams the host never opened,
//! stray resync markers), so the guest side of HTTP/2 is written here at the frame level.
//!
//! Steps, in order:
//! 1. claim the behaviour: rename `$WARREN_HARNESS_DIR/next` to `claimed-<pid>`. Without one,
//!    exec the real QEMU (`$WARREN_HARNESS_REAL_QEMU`) with the same arguments and
//!    descriptors, so the test's well-behaved VM boots for real under the same service;
//! 2. take the listening sockets the supervisor passed (`-chardev socket,id=...,fd=N`) and
//!    the VM secret from the per-VM initramfs (`-initrd`), as a root guest knows it;
//! 3. answer QMP minimally (greeting, `return {}` to everything, `quit` exits), hold the
//!    console, and on every channel connection answer `Sync` with `SyncAck`, authenticate
//!    like the agent does, then misbehave as the behaviour says.
//!
//! Progress (sessions, flooded bytes) goes to `$WARREN_HARNESS_DIR/stats-<pid>`, so the test
//! can check that the attack really happened.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::fd::FromRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use warren_protocol::framing::{self, Decoder, Event};
use warren_protocol::{
    auth, decode, encode, AgentInfo, ErrorCode, FileData, GuestError, GuestResponse, HelloReply,
    HostRequest, Response, VersionedData, PROTOCOL_VERSION,
};

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const DATA: u8 = 0;
const HEADERS: u8 = 1;
const RST_STREAM: u8 = 3;
const SETTINGS: u8 = 4;
const PUSH_PROMISE: u8 = 5;
const PING: u8 = 6;
const WINDOW_UPDATE: u8 = 8;
const CONTINUATION: u8 = 9;
const END_STREAM: u8 = 0x1;
const ACK: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
/// HPACK: indexed field 8 of the static table, `:status: 200`.
const STATUS_200: &[u8] = &[0x88];
/// The largest DATA payload sent (HTTP/2's default `SETTINGS_MAX_FRAME_SIZE`).
const CHUNK: usize = 16 * 1024;

/// What the hostile guest does; the test writes its name into the claim file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Behaviour {
    Flood,
    Oversized,
    Malformed,
    Forged,
    OtherStreams,
    EndlessRead,
    MegaError,
    ReconnectStorm,
    NeverDrains,
}

impl Behaviour {
    fn parse(s: &str) -> Option<Behaviour> {
        Some(match s.trim() {
            "flood" => Behaviour::Flood,
            "oversized" => Behaviour::Oversized,
            "malformed" => Behaviour::Malformed,
            "forged" => Behaviour::Forged,
            "other-streams" => Behaviour::OtherStreams,
            "endless-read" => Behaviour::EndlessRead,
            "mega-error" => Behaviour::MegaError,
            "reconnect-storm" => Behaviour::ReconnectStorm,
            "never-drains" => Behaviour::NeverDrains,
            _ => return None,
        })
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let dir = std::env::var_os("WARREN_HARNESS_DIR").map(PathBuf::from);
    let behaviour = dir.as_deref().and_then(claim);
    let Some(behaviour) = behaviour else {
        passthrough(&args);
    };
    let dir = dir.expect("invariant: a claimed behaviour came from the harness directory");
    if let Err(e) = run(behaviour, &args, &dir) {
        eprintln!("hostile-qemu: {e}");
        std::process::exit(1);
    }
}

/// Takes the pending behaviour, if any, so that only one VM plays it.
fn claim(dir: &Path) -> Option<Behaviour> {
    let claimed = dir.join(format!("claimed-{}", std::process::id()));
    std::fs::rename(dir.join("next"), &claimed).ok()?;
    Behaviour::parse(&std::fs::read_to_string(&claimed).ok()?)
}

fn passthrough(args: &[String]) -> ! {
    use std::os::unix::process::CommandExt;
    let real =
        std::env::var_os("WARREN_HARNESS_REAL_QEMU").unwrap_or_else(|| "qemu-system-x86_64".into());
    let e = std::process::Command::new(&real).args(args).exec();
    eprintln!("hostile-qemu: exec {real:?}: {e}");
    std::process::exit(127);
}

fn run(behaviour: Behaviour, args: &[String], dir: &Path) -> std::io::Result<()> {
    let mut fds = HashMap::new();
    let mut initrd = None;
    for w in args.windows(2) {
        match w[0].as_str() {
            "-chardev" => {
                let id = opt(&w[1], "id");
                let fd = opt(&w[1], "fd").and_then(|f| f.parse::<i32>().ok());
                if let (Some(id), Some(fd)) = (id, fd) {
                    fds.insert(id.to_string(), fd);
                }
            }
            "-initrd" => initrd = Some(PathBuf::from(&w[1])),
            _ => {}
        }
    }
    let listener = |id: &str| -> std::io::Result<UnixListener> {
        let fd = *fds
            .get(id)
            .ok_or_else(|| std::io::Error::other(format!("no -chardev id={id} with fd=")))?;
        // SAFETY: the supervisor passed this listening socket at exactly this descriptor
        // number (`-chardev ...,fd=N`); nothing else in this process owns or closes it.
        Ok(unsafe { UnixListener::from_raw_fd(fd) })
    };
    let initrd = initrd.ok_or_else(|| std::io::Error::other("no -initrd"))?;
    let secret = read_secret(&std::fs::read(&initrd)?)
        .ok_or_else(|| std::io::Error::other("no warren/secret in the initramfs"))?;
    let (console, channel, qmp) = (listener("con")?, listener("agent")?, listener("qmp")?);
    std::thread::spawn(move || {
        for conn in console.incoming().flatten() {
            let mut c = conn;
            let _ = c.write_all(b"warren-guest: hostile harness guest\r\n");
            // Held open: the console stays quiet, as a guest that says nothing does.
            std::thread::spawn(move || {
                let mut sink = [0u8; 256];
                while matches!(c.read(&mut sink), Ok(n) if n > 0) {}
            });
        }
    });
    std::thread::spawn(move || {
        for conn in qmp.incoming().flatten() {
            std::thread::spawn(move || serve_qmp(conn));
        }
    });
    let stats = Arc::new(Stats {
        path: dir.join(format!("stats-{}", std::process::id())),
        sessions: AtomicU64::new(0),
        flooded: AtomicU64::new(0),
    });
    // One connection at a time, as QEMU's socket chardev serves one client.
    for conn in channel.incoming() {
        let conn = conn?;
        let mut s = Session::new(behaviour, secret.clone(), conn, stats.clone())?;
        if let Err(e) = s.run() {
            eprintln!("hostile-qemu: session ended: {e}");
        }
        s.generation.fetch_add(1, Ordering::SeqCst);
    }
    Ok(())
}

/// The value of `key=` in a comma-separated QEMU option string.
fn opt<'a>(s: &'a str, key: &str) -> Option<&'a str> {
    s.split(',')
        .find_map(|kv| kv.strip_prefix(key).and_then(|r| r.strip_prefix('=')))
}

/// The content of `warren/secret` in the last cpio "newc" entry of that name.
fn read_secret(initrd: &[u8]) -> Option<Vec<u8>> {
    let name = b"warren/secret\0";
    let at = initrd.windows(name.len()).rposition(|w| w == name)?;
    let header = at.checked_sub(110)?;
    let field = |i: usize| -> Option<usize> {
        let s = std::str::from_utf8(initrd.get(header + 6 + 8 * i..header + 14 + 8 * i)?).ok()?;
        usize::from_str_radix(s, 16).ok()
    };
    let (size, namesize) = (field(6)?, field(11)?);
    let data = (header + 110 + namesize + 3) & !3;
    initrd.get(data..data + size).map(<[u8]>::to_vec)
}

fn serve_qmp(mut conn: UnixStream) {
    let greeting = "{\"QMP\": {\"version\": {}, \"capabilities\": []}}\n";
    if conn.write_all(greeting.as_bytes()).is_err() {
        return;
    }
    let Ok(reader) = conn.try_clone() else { return };
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(reader));
    while let Some(Ok(line)) = lines.next() {
        let v: serde_json::Value = serde_json::from_str(&line).unwrap_or_default();
        let ret = match v["execute"].as_str() {
            Some("query-status") => serde_json::json!({"status": "running", "running": true}),
            _ => serde_json::json!({}),
        };
        let reply = serde_json::json!({"return": ret, "id": v["id"]});
        let _ = conn.write_all(format!("{reply}\n").as_bytes());
        if v["execute"] == "quit" {
            std::process::exit(0);
        }
    }
}

struct Stats {
    path: PathBuf,
    sessions: AtomicU64,
    flooded: AtomicU64,
}

impl Stats {
    fn save(&self) {
        let text = format!(
            "sessions {}\nflooded {}\n",
            self.sessions.load(Ordering::Relaxed),
            self.flooded.load(Ordering::Relaxed)
        );
        let tmp = self.path.with_extension("new");
        if std::fs::write(&tmp, text).is_ok() {
            let _ = std::fs::rename(&tmp, &self.path);
        }
    }
}

/// Writes whole escaped frames, shared with the flood thread (frames never interleave).
#[derive(Clone)]
struct Wire(Arc<Mutex<UnixStream>>);

impl Wire {
    fn raw(&self, bytes: &[u8]) -> std::io::Result<()> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .write_all(bytes)
    }

    fn data(&self, plain: &[u8]) -> std::io::Result<()> {
        let mut out = Vec::with_capacity(plain.len() + 16);
        framing::encode_data(plain, &mut out);
        self.raw(&out)
    }

    fn frame(&self, kind: u8, flags: u8, stream: u32, payload: &[u8]) -> std::io::Result<()> {
        self.data(&frame_bytes(kind, flags, stream, payload))
    }
}

fn frame_bytes(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len() as u32;
    let mut f = Vec::with_capacity(9 + payload.len());
    f.extend_from_slice(&len.to_be_bytes()[1..]);
    f.push(kind);
    f.push(flags);
    f.extend_from_slice(&(stream & 0x7fff_ffff).to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// One channel connection: resync, HTTP/2 (server side, by frame), the behaviour.
struct Session {
    behaviour: Behaviour,
    secret: Vec<u8>,
    conn: UnixStream,
    wire: Wire,
    stats: Arc<Stats>,
    /// Bumped when the session (or the HTTP/2 connection inside it) ends: stops the flood.
    generation: Arc<AtomicU64>,
    decoder: Decoder,
    /// Plain HTTP/2 bytes not yet parsed; `None` before the first `Sync`.
    h2: Option<Vec<u8>>,
    preface_seen: bool,
    bodies: HashMap<u32, Vec<u8>>,
    /// Send windows: the connection's and each stream's (the host's receive windows).
    conn_window: i64,
    initial_window: i64,
    windows: HashMap<u32, i64>,
    /// DATA not yet sent for lack of window: (stream, bytes, end of stream).
    pending: Vec<(u32, Vec<u8>, bool)>,
    last_stream: u32,
}

impl Session {
    fn new(
        behaviour: Behaviour,
        secret: Vec<u8>,
        conn: UnixStream,
        stats: Arc<Stats>,
    ) -> std::io::Result<Session> {
        let wire = Wire(Arc::new(Mutex::new(conn.try_clone()?)));
        Ok(Session {
            behaviour,
            secret,
            conn,
            wire,
            stats,
            generation: Arc::new(AtomicU64::new(0)),
            decoder: Decoder::new(),
            h2: None,
            preface_seen: false,
            bodies: HashMap::new(),
            conn_window: 65_535,
            initial_window: 65_535,
            windows: HashMap::new(),
            pending: Vec::new(),
            last_stream: 0,
        })
    }

    fn run(&mut self) -> std::io::Result<()> {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = self.conn.read(&mut buf)?;
            if n == 0 {
                return Ok(());
            }
            let mut events = Vec::new();
            self.decoder.feed(&buf[..n], &mut events);
            for ev in events {
                match ev {
                    Event::Sync(nonce) => {
                        self.generation.fetch_add(1, Ordering::SeqCst);
                        self.h2 = Some(Vec::new());
                        self.preface_seen = false;
                        self.bodies.clear();
                        self.windows.clear();
                        self.pending.clear();
                        self.conn_window = 65_535;
                        self.initial_window = 65_535;
                        self.wire.raw(&framing::encode_sync_ack(&nonce))?;
                    }
                    Event::Data(d) => {
                        if let Some(h2) = self.h2.as_mut() {
                            h2.extend_from_slice(&d);
                            self.frames()?;
                        }
                    }
                    Event::SyncAck(_) | Event::Garbage => {}
                }
            }
        }
    }

    /// Parses and handles every complete frame received.
    fn frames(&mut self) -> std::io::Result<()> {
        if !self.preface_seen {
            let have = self.h2.as_ref().map_or(0, Vec::len);
            if have < PREFACE.len() {
                return Ok(());
            }
            if let Some(h2) = self.h2.as_mut() {
                h2.drain(..PREFACE.len());
            }
            self.preface_seen = true;
            self.wire.frame(SETTINGS, 0, 0, &[])?;
        }
        loop {
            let Some(h2) = self.h2.as_mut() else {
                return Ok(());
            };
            if h2.len() < 9 {
                return Ok(());
            }
            let len = u32::from_be_bytes([0, h2[0], h2[1], h2[2]]) as usize;
            if h2.len() < 9 + len {
                return Ok(());
            }
            let (kind, flags) = (h2[3], h2[4]);
            let stream = u32::from_be_bytes([h2[5], h2[6], h2[7], h2[8]]) & 0x7fff_ffff;
            let payload: Vec<u8> = h2[9..9 + len].to_vec();
            h2.drain(..9 + len);
            self.frame(kind, flags, stream, payload)?;
        }
    }

    fn frame(&mut self, kind: u8, flags: u8, stream: u32, payload: Vec<u8>) -> std::io::Result<()> {
        match kind {
            SETTINGS if flags & ACK == 0 => {
                for s in payload.chunks_exact(6) {
                    if u16::from_be_bytes([s[0], s[1]]) == 4 {
                        let v = i64::from(u32::from_be_bytes([s[2], s[3], s[4], s[5]]));
                        for w in self.windows.values_mut() {
                            *w += v - self.initial_window;
                        }
                        self.initial_window = v;
                    }
                }
                self.wire.frame(SETTINGS, ACK, 0, &[])?;
            }
            PING if flags & ACK == 0 => self.wire.frame(PING, ACK, 0, &payload)?,
            WINDOW_UPDATE if payload.len() == 4 => {
                let inc = i64::from(
                    u32::from_be_bytes([payload[0], payload[1], payload[2], payload[3]])
                        & 0x7fff_ffff,
                );
                if stream == 0 {
                    self.conn_window += inc;
                } else if let Some(w) = self.windows.get_mut(&stream) {
                    *w += inc;
                }
                self.flush()?;
            }
            HEADERS => {
                self.bodies.insert(stream, Vec::new());
                self.windows.insert(stream, self.initial_window);
                self.last_stream = self.last_stream.max(stream);
            }
            DATA => {
                if !payload.is_empty() {
                    // Give the host its window back at once: this guest always reads.
                    let inc = (payload.len() as u32).to_be_bytes();
                    self.wire.frame(WINDOW_UPDATE, 0, 0, &inc)?;
                    self.wire.frame(WINDOW_UPDATE, 0, stream, &inc)?;
                }
                if let Some(b) = self.bodies.get_mut(&stream) {
                    b.extend_from_slice(&payload);
                }
                if flags & END_STREAM != 0 {
                    let body = self.bodies.remove(&stream).unwrap_or_default();
                    self.request(stream, &body)?;
                }
            }
            RST_STREAM => {
                self.bodies.remove(&stream);
                self.windows.remove(&stream);
                self.pending.retain(|(s, _, _)| *s != stream);
            }
            _ => {}
        }
        Ok(())
    }

    /// Queues a well-formed response on `stream` (flow-controlled).
    fn respond(&mut self, stream: u32, resp: &Response) -> std::io::Result<()> {
        let body = encode(resp).map_err(std::io::Error::other)?;
        self.respond_raw(stream, body)
    }

    fn respond_raw(&mut self, stream: u32, body: Vec<u8>) -> std::io::Result<()> {
        self.wire.frame(HEADERS, END_HEADERS, stream, STATUS_200)?;
        self.windows.entry(stream).or_insert(self.initial_window);
        self.pending.push((stream, body, true));
        self.flush()
    }

    /// Sends queued DATA as far as the host's windows allow.
    fn flush(&mut self) -> std::io::Result<()> {
        let mut i = 0;
        while i < self.pending.len() {
            let stream = self.pending[i].0;
            loop {
                let win = self.windows.get(&stream).copied().unwrap_or(0);
                let left = self.pending[i].1.len();
                let n = left
                    .min(CHUNK)
                    .min(win.min(self.conn_window).max(0) as usize);
                if n == 0 && left > 0 {
                    break;
                }
                let chunk: Vec<u8> = self.pending[i].1.drain(..n).collect();
                let done = self.pending[i].1.is_empty();
                let flags = if done && self.pending[i].2 {
                    END_STREAM
                } else {
                    0
                };
                self.wire.frame(DATA, flags, stream, &chunk)?;
                self.conn_window -= n as i64;
                if let Some(w) = self.windows.get_mut(&stream) {
                    *w -= n as i64;
                }
                if done {
                    break;
                }
            }
            if self.pending[i].1.is_empty() {
                self.pending.remove(i);
            } else {
                i += 1;
            }
        }
        Ok(())
    }

    fn request(&mut self, stream: u32, body: &[u8]) -> std::io::Result<()> {
        let req = match decode::<HostRequest>(body) {
            Ok(r) => r,
            Err(_) => {
                let e = GuestError::new(ErrorCode::InvalidArgument, "undecodable request");
                return self.respond(stream, &Err(e));
            }
        };
        let reply: Response = match req {
            HostRequest::Hello(h) => {
                let mut guest_nonce = [0u8; auth::NONCE_LEN];
                std::fs::File::open("/dev/urandom")?.read_exact(&mut guest_nonce)?;
                Ok(GuestResponse::Hello(HelloReply {
                    version: PROTOCOL_VERSION,
                    guest_nonce,
                    proof: auth::guest_proof(&self.secret, &h.host_nonce, &guest_nonce),
                }))
            }
            HostRequest::Auth(_) => {
                let info = AgentInfo {
                    agent_version: "hostile-harness".into(),
                    kernel_release: "none".into(),
                    boot_id: "hostile".into(),
                    uptime_ms: 0,
                };
                self.respond(stream, &Ok(GuestResponse::Authenticated(info)))?;
                self.stats.sessions.fetch_add(1, Ordering::Relaxed);
                self.stats.save();
                return self.authenticated();
            }
            HostRequest::Ping => Ok(GuestResponse::Pong),
            HostRequest::JobList => Ok(GuestResponse::Jobs(Vec::new())),
            HostRequest::InstallCa(_) => Ok(GuestResponse::CaInstalled),
            HostRequest::Freeze => Ok(GuestResponse::Frozen(0)),
            HostRequest::Thaw(_) => Ok(GuestResponse::Thawed),
            HostRequest::PowerOff => Ok(GuestResponse::PoweringOff),
            other => return self.attack(stream, other),
        };
        self.respond(stream, &reply)
    }

    /// What the guest does right after it authenticated.
    fn authenticated(&mut self) -> std::io::Result<()> {
        match self.behaviour {
            Behaviour::Flood => {
                let (wire, stats) = (self.wire.clone(), self.stats.clone());
                let (gen, mine) = (
                    self.generation.clone(),
                    self.generation.load(Ordering::SeqCst),
                );
                std::thread::spawn(move || flood(wire, stats, gen, mine));
                Ok(())
            }
            // A stray marker mid-session: the host drops the session and resyncs, again and
            // again, as fast as it reconnects.
            Behaviour::ReconnectStorm => self.wire.raw(&framing::encode_sync_ack(&[7; 16])),
            // Stops reading for good (the host's writes back up), while the process lives.
            Behaviour::NeverDrains => loop {
                std::thread::sleep(Duration::from_secs(3600));
            },
            _ => Ok(()),
        }
    }

    /// The answer to a request the behaviour attacks. For most behaviours the variant is
    /// named by the request itself (an exec's `argv[0]`), so a host retry gets the same one.
    fn attack(&mut self, stream: u32, req: HostRequest) -> std::io::Result<()> {
        let variant = match &req {
            HostRequest::ExecStart(e) => e.argv.first().cloned().unwrap_or_default(),
            _ => String::new(),
        };
        let control =
            || -> Response { Err(GuestError::new(ErrorCode::NotFound, "harness-control")) };
        match (self.behaviour, variant.as_str()) {
            (Behaviour::Oversized, "frame-too-large") => {
                // A DATA header announcing 16 MiB - 1 (the host allows 128 KiB), then bytes.
                self.wire.frame(HEADERS, END_HEADERS, stream, STATUS_200)?;
                let mut f = frame_bytes(DATA, 0, stream, &[]);
                f[..3].copy_from_slice(&[0xff, 0xff, 0xff]);
                self.wire.data(&f)?;
                self.wire.data(&vec![0u8; 1 << 20])
            }
            (Behaviour::Oversized, "endless-headers") => {
                // A header block that never ends: CONTINUATION after CONTINUATION.
                let mut block = vec![0x00, 0x7f, 0x81, 0x7f];
                block.resize(CHUNK, b'a');
                self.wire.frame(HEADERS, 0, stream, &block)?;
                let start = self.generation.load(Ordering::SeqCst);
                for _ in 0..(64 << 20) / CHUNK {
                    if self.wire.frame(CONTINUATION, 0, stream, &block).is_err()
                        || self.generation.load(Ordering::SeqCst) != start
                    {
                        break;
                    }
                }
                Ok(())
            }
            (Behaviour::Oversized, "body-too-large") => {
                // Within HTTP/2's rules, beyond the 1 MiB message limit.
                self.respond_raw(stream, vec![0u8; 3 << 20])
            }
            (Behaviour::Malformed, "garbage-body") => {
                self.respond_raw(stream, b"\xff\xfe not postcard at all".repeat(64))
            }
            (Behaviour::Malformed, "bad-hpack") => self.wire.frame(
                HEADERS,
                END_HEADERS,
                stream,
                &[0xff, 0xff, 0xff, 0xff, 0x7f],
            ),
            (Behaviour::Malformed, "bad-escape") => self.wire.raw(&[framing::ESC, 0x07, 0x00]),
            (Behaviour::Malformed, "data-on-stream-0") => self.wire.frame(DATA, 0, 0, b"x"),
            (Behaviour::Forged, "wrong-type") => self.respond(
                stream,
                &Ok(GuestResponse::Authenticated(AgentInfo {
                    agent_version: "forged".into(),
                    kernel_release: String::new(),
                    boot_id: String::new(),
                    uptime_ms: 0,
                })),
            ),
            (Behaviour::Forged, "unsolicited") => {
                // A response on a stream the host never opened, then a wrong type.
                let forged = encode(&Ok::<_, GuestError>(GuestResponse::ExecStarted(
                    warren_protocol::JobId(7),
                )))
                .map_err(std::io::Error::other)?;
                self.wire
                    .frame(HEADERS, END_HEADERS, self.last_stream + 200, STATUS_200)?;
                self.wire
                    .frame(DATA, END_STREAM, self.last_stream + 200, &forged)?;
                self.respond(stream, &Ok(GuestResponse::Pong))
            }
            (Behaviour::Forged, "push-promise") => {
                let mut p = 2u32.to_be_bytes().to_vec();
                p.push(0x82);
                self.wire.frame(PUSH_PROMISE, END_HEADERS, stream, &p)
            }
            (Behaviour::OtherStreams, "closed-stream") => {
                // A forged answer on an earlier, finished stream, then the real one.
                let forged = encode(&Ok::<_, GuestError>(GuestResponse::Pong))
                    .map_err(std::io::Error::other)?;
                for old in [1, stream.saturating_sub(2).max(1)] {
                    self.wire.frame(HEADERS, END_HEADERS, old, STATUS_200)?;
                    self.wire.frame(DATA, END_STREAM, old, &forged)?;
                }
                self.respond(stream, &control())
            }
            (Behaviour::OtherStreams, "idle-stream") => {
                // The answer on a stream the host has not opened yet.
                self.respond(stream + 2, &control())
            }
            (Behaviour::OtherStreams, "even-stream") => self.respond(stream + 1, &control()),
            (Behaviour::EndlessRead, _) => {
                let reply = match req {
                    HostRequest::ReadVersioned(_) => GuestResponse::VersionedData(VersionedData {
                        data: vec![b'r'; warren_protocol::limits::MAX_WHOLE_FILE as usize],
                        size: 1 << 20,
                        eof: false,
                        version: Some([1; 32]),
                    }),
                    _ => GuestResponse::FileData(FileData {
                        data: vec![b'r'; warren_protocol::limits::MAX_FILE_CHUNK as usize],
                        size: 1 << 20,
                        eof: false,
                    }),
                };
                self.respond(stream, &Ok(reply))
            }
            (Behaviour::MegaError, v) => {
                // As long as a message may be, with terminal escapes and newlines in it.
                let mut m = String::from("\x1b[2J\x1b]0;pwned\x07line\nforged: log line\n");
                let room = warren_protocol::limits::MAX_MESSAGE_BYTES - 64 - m.len();
                m.push_str(&"E".repeat(room));
                // `visible`: a code whose message the service passes on to the client.
                let code = if v == "visible" {
                    ErrorCode::InvalidArgument
                } else {
                    ErrorCode::Internal
                };
                self.respond(stream, &Err(GuestError::new(code, m)))
            }
            _ => self.respond(stream, &control()),
        }
    }
}

/// Legal frames as fast as the host takes them: PINGs (each wants a PONG) and empty
/// SETTINGS (each wants an ACK).
fn flood(wire: Wire, stats: Arc<Stats>, generation: Arc<AtomicU64>, mine: u64) {
    let mut batch = Vec::new();
    for i in 0..256u64 {
        batch.extend_from_slice(&frame_bytes(PING, 0, 0, &i.to_be_bytes()));
        batch.extend_from_slice(&frame_bytes(SETTINGS, 0, 0, &[]));
    }
    let mut escaped = Vec::new();
    framing::encode_data(&batch, &mut escaped);
    let mut n = 0u64;
    while generation.load(Ordering::SeqCst) == mine {
        if wire.raw(&escaped).is_err() {
            return;
        }
        stats
            .flooded
            .fetch_add(escaped.len() as u64, Ordering::Relaxed);
        n += 1;
        if n.is_multiple_of(64) {
            stats.save();
        }
    }
}
