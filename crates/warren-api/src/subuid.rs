//! The owners of subordinate uids (`/etc/subuid`): a user given a range there (Debian's
//! `useradd` gives every new user 65,536) can act as any uid of it through `newuidmap`
//! while staying in the host's network namespace, so a share of connections per uid would
//! give that user 65,536 shares. The service's connection shares (`crate::conn`) and its
//! per-credential and per-workspace caps (`crate::auth::counted_via`) count a subordinate
//! uid under the user owning its range.
//!
//! By hand because no kept crate reads the file: it is `name:start:count` lines, a name
//! being a user name or a uid. A thread of its own reads it ([`Subordinates::shared`]):
//! again whenever its modification time, size or inode changes (one `stat` a second), at
//! most [`MAX_BYTES`] of it, resolving its user names through the name service (a range
//! whose name does not resolve counts under its first uid, one share for the whole range,
//! and the file is read again [`RESOLVE_RETRY`] later). Readers
//! take the last snapshot and never wait on the file or the name service: an accept loop
//! looks an owner up for every connection, and a name service that hangs would otherwise
//! stall every accept. Ranges root owns (a container manager's) are left out: their uids
//! keep shares of their own and never get root's reserve. Not covered: subordinate ids a
//! name service hands out (`subid:` in `nsswitch.conf`) or systemd's transient ranges;
//! overlapping ranges count under the first line's owner.

use std::collections::HashMap;
use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant, SystemTime};

use tokio::sync::watch;

/// The file read.
const PATH: &str = "/etc/subuid";
/// The most of the file read (a host with thousands of users has a few hundred KiB).
const MAX_BYTES: u64 = 4 << 20;
/// How often the reader thread looks for a change.
const REREAD_EVERY: Duration = Duration::from_secs(1);
/// How soon a file with names that did not resolve is read again.
const RESOLVE_RETRY: Duration = Duration::from_secs(30);

/// `(start, count, owner)` of each range.
type Ranges = Arc<Vec<(u32, u32, u32)>>;

/// The subordinate uid ranges and their owners, as the reader thread last read them
/// (`None` until its first read ends).
#[derive(Debug, Clone)]
pub(crate) struct Subordinates(watch::Receiver<Option<Ranges>>);

impl Subordinates {
    /// The process's view of `/etc/subuid`; its reader thread starts on first use.
    pub(crate) fn shared() -> Subordinates {
        static SHARED: OnceLock<Subordinates> = OnceLock::new();
        SHARED
            .get_or_init(|| Subordinates::watch(PathBuf::from(PATH), user_uid, REREAD_EVERY))
            .clone()
    }

    /// Fixed ranges `(start, count, owner)`, read by no thread (for tests).
    #[cfg(test)]
    pub(crate) fn fixed(ranges: Vec<(u32, u32, u32)>) -> Subordinates {
        let (_tx, rx) = watch::channel(Some(Arc::new(ranges)));
        Subordinates(rx)
    }

    /// Starts a thread that reads `path` (names resolved by `resolve`), and again on every
    /// change seen at a look every `every`, until every reader is gone.
    fn watch(
        path: PathBuf,
        resolve: impl Fn(&str) -> Option<u32> + Send + 'static,
        every: Duration,
    ) -> Subordinates {
        let (tx, rx) = watch::channel(None);
        let spawned = std::thread::Builder::new()
            .name("warren-subuid".into())
            .spawn(move || {
                let mut seen = None;
                let mut first = true;
                let mut retry_at: Option<Instant> = None;
                let mut known = HashMap::new();
                while !tx.is_closed() {
                    let now = stamp(&path);
                    let retry = retry_at.is_some_and(|t| Instant::now() >= t);
                    if first || now != seen || retry {
                        first = false;
                        seen = now;
                        retry_at = refresh(&path, &resolve, &mut known, &tx)
                            .then(|| Instant::now() + RESOLVE_RETRY);
                    }
                    std::thread::sleep(every);
                }
            });
        if let Err(e) = spawned {
            // Readers then count every uid as itself.
            tracing::error!(error = %e, "cannot start the subordinate uids' reader");
        }
        Subordinates(rx)
    }

    /// The uid `uid` counts as: its range's owner, or itself. Never blocks.
    pub(crate) fn owner_of(&self, uid: u32) -> u32 {
        match &*self.0.borrow() {
            Some(ranges) => owner_in(ranges, uid),
            None => uid,
        }
    }

    /// Waits up to `within` for the first read; whether it ended.
    pub(crate) async fn first_read(&mut self, within: Duration) -> bool {
        matches!(
            tokio::time::timeout(within, self.0.wait_for(|r| r.is_some())).await,
            Ok(Ok(_))
        )
    }
}

/// What tells a changed file: its modification time, change time, size and inode (`None`:
/// absent).
fn stamp(path: &Path) -> Option<(SystemTime, (i64, i64), u64, u64)> {
    std::fs::metadata(path).ok().map(|m| {
        (
            m.modified().unwrap_or(SystemTime::UNIX_EPOCH),
            (m.ctime(), m.ctime_nsec()),
            m.len(),
            m.ino(),
        )
    })
}

/// Reads `path` and publishes its ranges on `tx`: first, at once, with the names the last
/// read resolved (`known`; each range of another name counted under its first uid), then
/// with every name resolved. Returns whether some name did not resolve (read again later).
/// A file that cannot be read (other than absent) keeps the last snapshot.
fn refresh(
    path: &Path,
    resolve: &impl Fn(&str) -> Option<u32>,
    known: &mut HashMap<String, u32>,
    tx: &watch::Sender<Option<Ranges>>,
) -> bool {
    let mut bytes = Vec::new();
    match std::fs::File::open(path).and_then(|f| f.take(MAX_BYTES).read_to_end(&mut bytes)) {
        Ok(_) => {
            let text = String::from_utf8_lossy(&bytes);
            // A name service that hangs never leaves a new range uncounted meanwhile.
            let (quick, _) = parse(&text, |name| match name {
                "root" => Some(0),
                _ => known.get(name).copied(),
            });
            tx.send_replace(Some(Arc::new(quick)));
            let mut resolved = HashMap::new();
            let (full, unresolved) = parse(&text, |name| {
                let uid = resolve(name);
                if let Some(u) = uid {
                    resolved.insert(name.to_string(), u);
                }
                uid
            });
            tx.send_replace(Some(Arc::new(full)));
            *known = resolved;
            unresolved
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            tx.send_replace(Some(Arc::new(Vec::new())));
            false
        }
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "cannot read the subordinate uids");
            if tx.borrow().is_none() {
                tx.send_replace(Some(Arc::new(Vec::new())));
            }
            true
        }
    }
}

/// A user name's uid, from the name service.
fn user_uid(name: &str) -> Option<u32> {
    nix::unistd::User::from_name(name)
        .ok()
        .flatten()
        .map(|u| u.uid.as_raw())
}

/// The owner of the range of `ranges` holding `uid`, or `uid`.
fn owner_in(ranges: &[(u32, u32, u32)], uid: u32) -> u32 {
    ranges
        .iter()
        .find(|(start, count, _)| uid >= *start && uid - start < *count)
        .map_or(uid, |(_, _, owner)| *owner)
}

/// The ranges of `text` with their owners (`resolve` names a user's uid), and whether some
/// name did not resolve: such a range counts under its own first uid (one share for all its
/// uids, never one per uid). Lines that do not parse are skipped, and so are ranges starting
/// at 0 (their first uid is root's).
fn parse(text: &str, mut resolve: impl FnMut(&str) -> Option<u32>) -> (Vec<(u32, u32, u32)>, bool) {
    let mut unresolved = false;
    let ranges = text
        .lines()
        .filter_map(|l| {
            let mut parts = l.trim().split(':');
            let (name, start, count) = (parts.next()?, parts.next()?, parts.next()?);
            let start: u32 = start.parse().ok()?;
            let count: u32 = count.parse().ok()?;
            if start == 0 {
                return None;
            }
            // A user name first, as shadow's tools match it; else a uid.
            let owner = match resolve(name).or_else(|| name.parse().ok()) {
                Some(owner) => owner,
                None => {
                    unresolved = true;
                    start
                }
            };
            // Root's ranges (containers' uids) are not root: they keep shares of their own,
            // and never root's reserve.
            (owner != 0).then_some((start, count, owner))
        })
        .collect();
    (ranges, unresolved)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_a_subordinate_uid_counts_as_its_ranges_owner() {
        let text = "alice:100000:65536\n1001:165536:65536\nghost:231072:10\nbad line\n\
                    root:1000000:65536\n";
        let (ranges, unresolved) = parse(text, |n| match n {
            "alice" => Some(1000),
            "root" => Some(0),
            _ => None,
        });
        assert!(unresolved, "ghost");
        assert_eq!(
            ranges,
            vec![
                (100000, 65536, 1000),
                (165536, 65536, 1001),
                (231072, 10, 231072)
            ]
        );
        let owner = |uid: u32| owner_in(&ranges, uid);
        assert_eq!(owner(100000), 1000);
        assert_eq!(owner(165535), 1000);
        assert_eq!(owner(165536), 1001);
        // An unresolved user's range: one share, its first uid's.
        assert_eq!(owner(231072), 231072);
        assert_eq!(owner(231081), 231072);
        assert_eq!(owner(231082), 231082);
        // Outside every range: itself.
        assert_eq!(owner(65534), 65534);
        // Root's range: each uid its own.
        assert_eq!(owner(1000005), 1000005);
    }

    /// Waits up to 10 s for `uid` to count as `owner`.
    async fn counts_as(s: &Subordinates, uid: u32, owner: u32) -> bool {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while std::time::Instant::now() < deadline {
            if s.owner_of(uid) == owner {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        false
    }

    /// The file is read again when it changes, and a name service that hangs while a changed
    /// file's names resolve stalls only that read: readers keep the last snapshot. (Before,
    /// the accept loop read the file and resolved its names itself, on every change.)
    #[tokio::test]
    async fn test_a_hung_name_service_never_stalls_an_owner_lookup() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("subuid");
        std::fs::write(&path, "alice:100000:65536\n").expect("write");
        // "bob" resolves only once the test lets it.
        let (release, hung) = std::sync::mpsc::channel::<()>();
        let hung = std::sync::Mutex::new(hung);
        let resolve = move |name: &str| match name {
            "alice" => Some(1000),
            "bob" => {
                let _ = hung.lock().expect("hung").recv();
                Some(1001)
            }
            _ => None,
        };
        let mut s = Subordinates::watch(path.clone(), resolve, Duration::from_millis(20));
        assert!(s.first_read(Duration::from_secs(10)).await, "first read");
        assert!(counts_as(&s, 100001, 1000).await, "alice's range");
        assert_eq!(s.owner_of(165536), 165536);
        // A changed file whose names hang: lookups answer at once, and the new range counts
        // as one share (its first uid's) until its name resolves, never one per uid.
        std::fs::write(&path, "alice:100000:65536\nbob:165536:65536\n").expect("write");
        assert!(
            counts_as(&s, 165537, 165536).await,
            "bob's range counted at once"
        );
        let t = std::time::Instant::now();
        for _ in 0..1000 {
            assert_eq!(s.owner_of(100001), 1000);
            assert_eq!(s.owner_of(170000), 165536);
        }
        assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
        // Control: once the name resolves, the new range counts.
        release.send(()).expect("release");
        assert!(counts_as(&s, 165537, 1001).await, "bob's range read");
        // Removed ranges stop counting.
        std::fs::remove_file(&path).expect("rm");
        assert!(
            counts_as(&s, 100001, 100001).await,
            "the file's removal read"
        );
    }
}
