//! The virtio-serial port: resynchronisation and one session per host connection.
//!
//! Threads and tasks:
//! - the reader thread does blocking `read()`s on the port and feeds a
//!   [`framing::Decoder`]; `read() == 0` means no host is attached, so it sleeps briefly and
//!   retries (the port is never closed: data arriving while it is closed would be lost);
//! - the writer thread does blocking `write_all`s of queued chunks. Each chunk carries the
//!   session epoch it belongs to and chunks of an older epoch are dropped unwritten, which is
//!   how a resync clears the previous session's queued output. A blocked write (no host)
//!   only stalls this queue; jobs drain their output independently;
//! - the manager task owns the current session. On `Sync(nonce)` it aborts the current
//!   session, bumps the epoch, queues `SyncAck(nonce)` first and starts a new session: an h2
//!   server over an in-memory duplex stream, with a feeder task writing subsequent `Data` into
//!   it and a pump task escaping its output into the writer queue. Data before the first
//!   `Sync` is discarded.

use std::io::{ErrorKind, Read, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use warren_protocol::framing::{self, Decoder, Event};

use crate::session::{self, Agent};

/// Pause after `read() == 0` (no host attached) before reading again.
const DETACHED_PAUSE: Duration = Duration::from_millis(10);
/// Pause after an unexpected read error, to avoid a busy loop.
const ERROR_PAUSE: Duration = Duration::from_millis(100);
const READ_CHUNK: usize = 64 * 1024;
/// Decoded events in flight from the reader thread to the manager.
const EVENT_QUEUE: usize = 64;
/// Chunks (each at most ~64 KiB escaped) queued for the writer thread.
const WRITE_QUEUE: usize = 64;
/// Buffer of the in-memory stream between the channel and a session's h2 connection.
const SESSION_PIPE: usize = 256 * 1024;

type Outbound = mpsc::Sender<(u64, Vec<u8>)>;

/// Starts serving `reader`/`writer` (the two ends of the port) and returns the manager task,
/// which runs forever. Must be called within the agent's tokio runtime.
pub fn start<R, W>(reader: R, writer: W, agent: Arc<Agent>) -> std::io::Result<JoinHandle<()>>
where
    R: Read + Send + 'static,
    W: Write + Send + 'static,
{
    let (event_tx, event_rx) = mpsc::channel(EVENT_QUEUE);
    let (out_tx, out_rx) = mpsc::channel(WRITE_QUEUE);
    let epoch = Arc::new(AtomicU64::new(0));
    std::thread::Builder::new()
        .name("port-reader".into())
        .spawn(move || read_loop(reader, event_tx))?;
    let writer_epoch = epoch.clone();
    std::thread::Builder::new()
        .name("port-writer".into())
        .spawn(move || write_loop(writer, out_rx, writer_epoch))?;
    Ok(tokio::spawn(manage(event_rx, out_tx, epoch, agent)))
}

fn read_loop<R: Read>(mut port: R, events: mpsc::Sender<Event>) {
    let mut decoder = Decoder::new();
    let mut buf = vec![0u8; READ_CHUNK];
    let mut decoded = Vec::new();
    loop {
        match port.read(&mut buf) {
            Ok(0) => std::thread::sleep(DETACHED_PAUSE),
            Ok(n) => {
                decoder.feed(&buf[..n], &mut decoded);
                for event in decoded.drain(..) {
                    if events.blocking_send(event).is_err() {
                        return;
                    }
                }
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => {
                crate::console::log(format_args!("port read: {e}"));
                std::thread::sleep(ERROR_PAUSE);
            }
        }
    }
}

fn write_loop<W: Write>(
    mut port: W,
    mut queue: mpsc::Receiver<(u64, Vec<u8>)>,
    epoch: Arc<AtomicU64>,
) {
    while let Some((chunk_epoch, bytes)) = queue.blocking_recv() {
        if chunk_epoch != epoch.load(Ordering::Acquire) {
            continue;
        }
        if let Err(e) = port.write_all(&bytes).and_then(|()| port.flush()) {
            crate::console::log(format_args!("port write: {e}"));
        }
    }
}

/// The tasks of one session; aborting them ends it.
struct Session {
    inbound: mpsc::UnboundedSender<Vec<u8>>,
    tasks: [JoinHandle<()>; 3],
}

impl Session {
    fn end(self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

async fn manage(
    mut events: mpsc::Receiver<Event>,
    outbound: Outbound,
    epoch: Arc<AtomicU64>,
    agent: Arc<Agent>,
) {
    let mut current: Option<Session> = None;
    while let Some(event) = events.recv().await {
        match event {
            Event::Sync(nonce) => {
                if let Some(old) = current.take() {
                    old.end();
                }
                let new_epoch = epoch.fetch_add(1, Ordering::AcqRel) + 1;
                if outbound
                    .send((new_epoch, framing::encode_sync_ack(&nonce)))
                    .await
                    .is_err()
                {
                    return;
                }
                current = Some(start_session(agent.clone(), new_epoch, outbound.clone()));
            }
            Event::Data(data) => {
                if let Some(session) = &current {
                    // A closed feeder means the session already ended; drop the data.
                    let _ = session.inbound.send(data);
                }
            }
            Event::SyncAck(_) | Event::Garbage => {}
        }
    }
}

fn start_session(agent: Arc<Agent>, epoch: u64, outbound: Outbound) -> Session {
    let (agent_side, channel_side) = tokio::io::duplex(SESSION_PIPE);
    let (mut from_session, mut to_session) = tokio::io::split(channel_side);
    let (inbound, mut inbound_rx) = mpsc::unbounded_channel::<Vec<u8>>();
    let serve = tokio::spawn(async move {
        if let Err(e) = session::serve(agent, agent_side).await {
            crate::console::log(format_args!("session {epoch} ended: {e}"));
        }
    });
    let feed = tokio::spawn(async move {
        while let Some(data) = inbound_rx.recv().await {
            if to_session.write_all(&data).await.is_err() {
                return;
            }
        }
    });
    let pump = tokio::spawn(async move {
        let mut buf = vec![0u8; READ_CHUNK];
        loop {
            match from_session.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    let mut escaped = Vec::with_capacity(n + n / 64 + 2);
                    framing::encode_data(&buf[..n], &mut escaped);
                    if outbound.send((epoch, escaped)).await.is_err() {
                        return;
                    }
                }
            }
        }
    });
    Session {
        inbound,
        tasks: [serve, feed, pump],
    }
}
