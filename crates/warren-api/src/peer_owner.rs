//! Whom an accepted connection counts under in the connection shares (`crate::conn`),
//! found without the accept loop waiting on anything but memory and a thread of its own:
//!
//! - A TCP peer's uid comes from the kernel's socket diagnostics
//!   ([`crate::loopback_peer::SockDiag`]) on the listener's own lookup thread, not on
//!   tokio's blocking pool: other work can fill that pool (each blocked job holds a thread),
//!   and an accept waiting behind it would lock every client out. An answer not back within
//!   [`LOOKUP_DEADLINE`] closes the connection (on kernels before 6.9 the diagnostics take a
//!   global lock that another user's dump of a long socket table holds for milliseconds); a
//!   lookup asked while an earlier one is still with the kernel is refused at once rather
//!   than queued.
//! - A subordinate uid's owner comes from the last snapshot of `/etc/subuid`
//!   ([`crate::subuid::Subordinates`]), which a thread of its own reads again on a change, so
//!   a name service that hangs while a changed file's names resolve never stalls an accept.
//!
//! The local socket's accepts need neither thread's answer to wait on: its peer's uid comes
//! with the connection (`SO_PEERCRED`), and its owner from the snapshot.

use std::net::SocketAddr;
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::time::Duration;

use tokio::sync::oneshot;

use crate::conn::Peer;
use crate::loopback_peer::{is_loopback, is_own_address, Owner, SockDiag};
use crate::subuid::Subordinates;

/// How long an accept waits for a TCP peer's lookup before closing the connection.
const LOOKUP_DEADLINE: Duration = Duration::from_secs(2);
/// How long a listener waits for the first read of `/etc/subuid` before it accepts
/// (subordinate uids then count as themselves until the read ends).
const FIRST_READ_WAIT: Duration = Duration::from_secs(5);

/// What a connection counts as under the shares.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Counted {
    /// This uid's (a subordinate uid counted as its range's owner).
    Uid(u32),
    /// No uid's: a peer on another host, or a local socket peer without credentials.
    Nobody,
    /// Closed at accept, for this reason.
    Refused(String),
}

/// One TCP peer to look up, and where its answer goes.
struct Ask {
    ours: SocketAddr,
    peer: SocketAddr,
    answer: oneshot::Sender<Counted>,
}

/// One listener's lookups.
pub(crate) struct PeerOwners {
    subordinates: Subordinates,
    /// The lookup thread's queue (one place): started on the first TCP peer, and again if
    /// it ended.
    kernel: Option<SyncSender<Ask>>,
}

impl PeerOwners {
    /// A listener's lookups, once `/etc/subuid` has been read (or [`FIRST_READ_WAIT`] has
    /// passed).
    pub(crate) async fn new(door: &'static str) -> PeerOwners {
        let mut subordinates = Subordinates::shared();
        if !subordinates.first_read(FIRST_READ_WAIT).await {
            tracing::warn!(
                door,
                "/etc/subuid not read yet: subordinate uids count as themselves until it is"
            );
        }
        PeerOwners {
            subordinates,
            kernel: None,
        }
    }

    /// What `peer` counts as.
    pub(crate) async fn count(&mut self, peer: Peer) -> Counted {
        let uid = match peer {
            Peer::Local(Some(uid)) => uid,
            Peer::Local(None) => return Counted::Nobody,
            Peer::Tcp { ours, peer } => match self.tcp(ours, peer).await {
                Counted::Uid(uid) => uid,
                other => return other,
            },
        };
        Counted::Uid(self.subordinates.owner_of(uid))
    }

    /// A TCP peer's uid (not yet mapped to its range's owner), from the lookup thread.
    async fn tcp(&mut self, ours: SocketAddr, peer: SocketAddr) -> Counted {
        let (answer, answered) = oneshot::channel();
        let mut ask = Ask { ours, peer, answer };
        // At most: an ended thread found, a new one started, the ask sent.
        for _ in 0..3 {
            let Some(kernel) = &self.kernel else {
                match spawn_lookups() {
                    Ok(k) => self.kernel = Some(k),
                    Err(e) => return Counted::Refused(format!("the peer lookup thread: {e}")),
                }
                continue;
            };
            match kernel.try_send(ask) {
                Ok(()) => {
                    return match tokio::time::timeout(LOOKUP_DEADLINE, answered).await {
                        Ok(Ok(counted)) => counted,
                        Ok(Err(_)) => Counted::Refused("the peer lookup thread ended".into()),
                        Err(_) => Counted::Refused(format!(
                            "the kernel's socket diagnostics did not answer within {}s",
                            LOOKUP_DEADLINE.as_secs()
                        )),
                    }
                }
                Err(TrySendError::Full(_)) => {
                    return Counted::Refused(
                        "an earlier lookup is still with the kernel's socket diagnostics".into(),
                    )
                }
                // It ended: a new one.
                Err(TrySendError::Disconnected(back)) => {
                    ask = back;
                    self.kernel = None;
                }
            }
        }
        Counted::Refused("the peer lookup thread ends at once".into())
    }
}

/// Starts a lookup thread; it ends when its queue's sender is dropped.
fn spawn_lookups() -> std::io::Result<SyncSender<Ask>> {
    let (tx, rx) = sync_channel(1);
    std::thread::Builder::new()
        .name("warren-peer-lookup".into())
        .spawn(move || lookups(rx))?;
    Ok(tx)
}

/// The lookup thread: answers each ask in turn with one socket diagnostics socket (made on
/// first use, and again after a failure).
fn lookups(asks: Receiver<Ask>) {
    let mut diag = None;
    for ask in asks {
        // Its accept gave up (the deadline): the kernel is not asked for it.
        if ask.answer.is_closed() {
            continue;
        }
        let counted = tcp_owner(&mut diag, ask.ours, ask.peer);
        // The accept that asked may have given up.
        let _ = ask.answer.send(counted);
    }
}

/// Whose the TCP peer at `peer` connected to `ours` is: a uid (the kernel's), no one's (on
/// another host), or refused.
fn tcp_owner(diag: &mut Option<SockDiag>, ours: SocketAddr, peer: SocketAddr) -> Counted {
    let d = match diag {
        Some(d) => d,
        None => match SockDiag::new() {
            Ok(d) => diag.insert(d),
            Err(e) => return Counted::Refused(format!("the kernel's socket diagnostics: {e}")),
        },
    };
    match d.owner(ours, peer) {
        Ok(Owner::Uid(uid)) => Counted::Uid(uid),
        Ok(Owner::Closed) => Counted::Refused("no process holds the peer's socket".into()),
        // Whatever its address: a local user may connect from any of the host's own
        // addresses, so only a socket this host does not have is remote, and a loopback
        // listener has no remote peers.
        Ok(Owner::Absent) if is_loopback(ours.ip()) => {
            Counted::Refused("the peer's socket is not on this host's network stack".into())
        }
        // Not found, from one of this host's own addresses: a socket tied to an interface
        // (`SO_BINDTODEVICE`) is found only when the lookup names that interface, so it is
        // closed rather than let through uncounted.
        Ok(Owner::Absent) => match is_own_address(peer.ip()) {
            Ok(false) => Counted::Nobody,
            Ok(true) => Counted::Refused(
                "a socket of this host the kernel's diagnostics do not find \
                 (bound to an interface?)"
                    .into(),
            ),
            Err(e) => Counted::Refused(format!("this host's addresses: {e}")),
        },
        Err(e) => {
            // A fresh socket for the next lookup.
            *diag = None;
            Counted::Refused(format!("the kernel's socket diagnostics: {e}"))
        }
    }
}
