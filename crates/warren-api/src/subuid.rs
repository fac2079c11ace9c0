//! The owners of subordinate uids (`/etc/subuid`): a user given a range there (Debian's
//! `useradd` gives every new user 65,536) can act as any uid of it through `newuidmap`
//! while staying in the host's network namespace, so a share of connections per uid would
//! give that user 65,536 shares. The service's connection shares (`crate::conn`) count a
//! subordinate uid under the user owning its range.
//!
//! By hand because no kept crate reads the file: it is `name:start:count` lines, a name
//! being a user name or a uid. The file is read again when its modification time or size
//! changes (one `stat` per lookup), at most [`MAX_BYTES`] of it. Ranges root owns (a
//! container manager's) are left out: their uids keep shares of their own and never get
//! root's reserve. Not covered: subordinate ids a name service hands out (`subid:` in
//! `nsswitch.conf`) or systemd's transient ranges; overlapping ranges count under the
//! first line's owner.

use std::io::Read;
use std::time::SystemTime;

/// The file read.
const PATH: &str = "/etc/subuid";
/// The most of the file read (a host with thousands of users has a few hundred KiB).
const MAX_BYTES: u64 = 4 << 20;

/// The subordinate uid ranges and their owners, as last read.
#[derive(Debug, Default)]
pub(crate) struct Subordinates {
    /// The file's modification time and size when last read (`None`: never read, or absent).
    seen: Option<(SystemTime, u64)>,
    /// `(start, count, owner)`.
    ranges: Vec<(u32, u32, u32)>,
}

impl Subordinates {
    /// The uid `uid` counts as: its range's owner, or itself. Blocking (a `stat`, and on a
    /// change the file's read and its user names' resolution).
    pub(crate) fn owner_of(&mut self, uid: u32) -> u32 {
        self.refresh();
        owner_in(&self.ranges, uid)
    }

    fn refresh(&mut self) {
        let stamp = std::fs::metadata(PATH)
            .ok()
            .map(|m| (m.modified().unwrap_or(SystemTime::UNIX_EPOCH), m.len()));
        if stamp == self.seen && (stamp.is_some() || self.ranges.is_empty()) {
            return;
        }
        self.seen = stamp;
        let mut bytes = Vec::new();
        let read =
            std::fs::File::open(PATH).and_then(|f| f.take(MAX_BYTES).read_to_end(&mut bytes));
        let text = String::from_utf8_lossy(&bytes);
        self.ranges = match read {
            Ok(_) => parse(&text, |name| {
                nix::unistd::User::from_name(name)
                    .ok()
                    .flatten()
                    .map(|u| u.uid.as_raw())
            }),
            Err(e) => {
                if e.kind() != std::io::ErrorKind::NotFound {
                    tracing::warn!(path = PATH, error = %e, "cannot read the subordinate uids");
                }
                Vec::new()
            }
        };
    }
}

/// The owner of the range of `ranges` holding `uid`, or `uid`.
fn owner_in(ranges: &[(u32, u32, u32)], uid: u32) -> u32 {
    ranges
        .iter()
        .find(|(start, count, _)| uid >= *start && uid - start < *count)
        .map_or(uid, |(_, _, owner)| *owner)
}

/// The ranges of `text` with their owners (`resolve` names a user's uid); lines that do not
/// parse, and users that do not resolve, are skipped.
fn parse(text: &str, resolve: impl Fn(&str) -> Option<u32>) -> Vec<(u32, u32, u32)> {
    text.lines()
        .filter_map(|l| {
            let mut parts = l.trim().split(':');
            let (name, start, count) = (parts.next()?, parts.next()?, parts.next()?);
            let start: u32 = start.parse().ok()?;
            let count: u32 = count.parse().ok()?;
            // A user name first, as shadow's tools match it; else a uid.
            let owner = resolve(name).or_else(|| name.parse().ok())?;
            // Root's ranges (containers' uids) are not root: they keep shares of their own,
            // and never root's reserve.
            (owner != 0).then_some((start, count, owner))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_a_subordinate_uid_counts_as_its_ranges_owner() {
        let text = "alice:100000:65536\n1001:165536:65536\nghost:231072:10\nbad line\n\
                    root:1000000:65536\n";
        let ranges = parse(text, |n| match n {
            "alice" => Some(1000),
            "root" => Some(0),
            _ => None,
        });
        assert_eq!(ranges, vec![(100000, 65536, 1000), (165536, 65536, 1001)]);
        let owner = |uid: u32| owner_in(&ranges, uid);
        assert_eq!(owner(100000), 1000);
        assert_eq!(owner(165535), 1000);
        assert_eq!(owner(165536), 1001);
        // Outside every range, or in an unresolved user's: itself.
        assert_eq!(owner(231072), 231072);
        assert_eq!(owner(65534), 65534);
        // Root's range: each uid its own.
        assert_eq!(owner(1000005), 1000005);
    }
}
