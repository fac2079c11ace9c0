//! Host-side session copies of git repositories.
//!
//! A session is a private, writable copy of a source checkout that a guest VM works in. The
//! copy has its own git directory (HEAD, index, refs, config, new objects) and borrows every
//! existing object from the source's object store through a relative `alternates` entry, so
//! nothing large is copied and the source store is only ever read.
//!
//! Layout of a session directory `S` (see `docs/sessions.md`):
//!
//! ```text
//! S/                          0711, the caller's
//! S/workspace/                the working tree, shared into the guest at /workspace
//! S/workspace/.git/           its own git directory (the guest's; host git never opens it)
//! S/workspace/.git/objects/info/alternates  = "../../../.warren-source-objects"
//! S/.warren-source-objects -> <source common git dir>/objects   (mounted read-only in the
//!                                                                guest at /.warren-source-objects)
//! ```
//!
//! The alternates entry is relative to the objects directory, so it resolves to
//! `S/.warren-source-objects` on the host and to `/.warren-source-objects` in the guest.
//!
//! - [`prepare`]: make a session from a source checkout; [`direct`] validates a directory
//!   mounted as is.
//! - [`fork`]: a new session whose workspace is a copy of another's (`vm_fork`).
//! - [`status`]: what the session still holds (uncommitted paths, unexported commits).
//! - [`export`]: the session's HEAD as a branch of the source repository.
//! - [`remove`]: delete a session, refusing while it holds work unless forced.
//! - [`volume`]: a session's own filesystem, which bounds its host storage.
//!
//! Every host git command runs with a scrubbed environment, as the owner, under a deadline;
//! a session is read only through a host-owned scratch git directory (`scratch`), never
//! through the guest's git directory, and the source repository is checked (`source`) before
//! anything of it is read, copied, mounted or written: nothing in it may lead outside it.
#![deny(unsafe_code)]

pub mod access;
mod beneath;
mod copy;
mod error;
mod export;
mod fork;
mod git;
pub mod guard;
mod prepare;
mod remove;
mod retention;
mod scratch;
mod source;
mod sys;
pub mod volume;

use std::path::{Path, PathBuf};

pub use copy::{SkipReason, Skipped};
pub use error::SessionError;
pub use export::{export, Exported};
pub use fork::{fork, Forked, MAX_FORK_ENTRIES};
pub use git::Owner;
pub use prepare::{direct, direct_checked, prepare, Head, Prepared};
pub use remove::{remove_tree, remove_tree_at};
pub use retention::{remove, status, Retention};

/// The working tree inside a session directory, shared into the guest at [`GUEST_WORKSPACE`].
pub const WORKSPACE_DIR: &str = "workspace";
/// The symlink inside a session directory to the source's object directory.
pub const SOURCE_OBJECTS_LINK: &str = ".warren-source-objects";
/// Where the guest sees the workspace.
pub const GUEST_WORKSPACE: &str = "/workspace";
/// Where the guest must see the source objects (read-only) for the alternates entry to
/// resolve.
pub const GUEST_SOURCE_OBJECTS: &str = "/.warren-source-objects";
/// The line in `workspace/.git/objects/info/alternates`, relative to the objects directory.
pub const ALTERNATES_ENTRY: &str = "../../../.warren-source-objects";

/// The working tree of the session in `session_dir`.
pub fn workspace_dir(session_dir: &Path) -> PathBuf {
    session_dir.join(WORKSPACE_DIR)
}

/// The host directory to mount read-only at [`GUEST_SOURCE_OBJECTS`]: the target of the
/// session's objects link (canonical when [`prepare`] made it).
pub fn source_objects_dir(session_dir: &Path) -> Result<PathBuf, SessionError> {
    let paths = guard::SessionPaths::new(session_dir);
    paths.check_session()?;
    let target = paths.source_objects()?;
    // The link's target was canonical when prepare made it: a symlink anywhere in it now
    // (or a missing directory) means the path leads somewhere else.
    let canonical = target.canonicalize().ok();
    if canonical.as_deref() != Some(target.as_path()) || !target.is_dir() {
        return Err(SessionError::NotASession {
            path: session_dir.to_path_buf(),
            reason: format!(
                "source objects {} are gone or now lead elsewhere",
                target.display()
            ),
        });
    }
    Ok(target)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_alternates_entry_matches_layout() {
        // objects -> .git -> workspace -> S, then the link.
        assert_eq!(ALTERNATES_ENTRY, format!("../../../{SOURCE_OBJECTS_LINK}"));
        assert_eq!(GUEST_SOURCE_OBJECTS, format!("/{SOURCE_OBJECTS_LINK}"));
        assert_eq!(GUEST_WORKSPACE, format!("/{WORKSPACE_DIR}"));
    }
}
