//! The crate's error type: one variant per failed operation or refused request.

use std::path::PathBuf;

use nix::errno::Errno;

/// Everything that can go wrong while preparing, inspecting, exporting or removing a session.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    /// A filesystem operation failed.
    #[error("{op} {path}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// `git` could not be started.
    #[error("cannot run git")]
    GitSpawn(#[source] std::io::Error),
    /// A git command failed; `stderr` is its (trimmed) error output.
    #[error("git {args} failed ({status}): {stderr}")]
    Git {
        args: String,
        status: String,
        stderr: String,
    },
    /// The source is not inside a git repository (the CLI can suggest `--direct`).
    #[error("{0} is not in a git repository")]
    NotARepository(PathBuf),
    /// The source is a bare repository or a git directory: there is no working tree to copy.
    #[error("{0} is a bare repository or a git directory, not a working tree")]
    BareRepository(PathBuf),
    /// The source's object store borrows objects through `objects/info/alternates`; the
    /// session could not reach those objects in the guest.
    #[error("source object store {0} uses alternates, which sessions do not support")]
    SourceHasAlternates(PathBuf),
    /// The source repository leads outside itself, or could make Warren read or write outside
    /// it: a `.git` that is a symlink, or a `gitdir:` file that is not a linked worktree its
    /// repository registered (a separate git directory, a submodule checkout, another
    /// repository); a `commondir` into another repository; a symlink (or a mount) in
    /// `objects`, `info/exclude`, `index`, `HEAD`, `config`, the refs or any other path
    /// Warren reads, copies, mounts or exports through; config that includes other files or
    /// sets `core.worktree`. Refused before anything is copied, mounted or written.
    #[error("source repository refused: {path} {reason}")]
    UnsafeSource { path: PathBuf, reason: String },
    /// The session directory already exists.
    #[error("session directory {0} already exists")]
    SessionExists(PathBuf),
    /// The path is not a session directory made by [`crate::prepare`].
    #[error("{path} is not a session directory: {reason}")]
    NotASession { path: PathBuf, reason: String },
    /// The session's git directory has a shape host git must not use (a `.git` file or
    /// symlink, a `commondir`, changed alternates, ...). The guest controls it.
    #[error("session git directory {path} is unsafe for host git: {reason}")]
    UnsafeGitDir { path: PathBuf, reason: String },
    /// What host git would have to copy out of a session exceeds a limit.
    #[error("{what} exceeds the limit of {limit} for host-side inspection")]
    TooLarge { what: String, limit: String },
    /// A session's own filesystem (its storage limit) could not be made, mounted or removed.
    /// Never answered by falling back to an unlimited directory.
    #[error("session storage: {op} {path}: {reason}")]
    Volume {
        op: &'static str,
        path: PathBuf,
        reason: String,
    },
    /// A git command ran past its deadline and was killed.
    #[error("git {args} did not finish within {secs} s and was stopped")]
    GitTimeout { args: String, secs: u64 },
    /// The branch name is not a valid git branch name.
    #[error("invalid branch name {0:?}")]
    InvalidBranch(String),
    /// The session has no commit to export (its HEAD is unborn).
    #[error("the session has no commits to export")]
    NothingToExport,
    /// The source branch exists and is not an ancestor of the session's HEAD.
    #[error(
        "branch {branch} exists in the source at {existing} and is not an ancestor of the \
         session's {commit}; export to another branch"
    )]
    NotFastForward {
        branch: String,
        existing: String,
        commit: String,
    },
    /// The branch is checked out in a working tree of the source repository; moving it would
    /// change what that checkout shows as staged.
    #[error("branch {branch} is checked out in {worktree}; export to another branch")]
    BranchCheckedOut { branch: String, worktree: PathBuf },
    /// The repository given to export is not the one the session was made from.
    #[error("{source_git} is not the session's source repository (its objects are {expected})")]
    SourceMismatch {
        source_git: PathBuf,
        expected: PathBuf,
    },
    /// Removing a session that still holds work, without `force`.
    #[error("{}", unsaved_message(uncommitted, *unexported))]
    Unsaved {
        uncommitted: Vec<String>,
        unexported: usize,
    },
    /// The owner cannot be applied: only root can act as another user.
    #[error("cannot act as uid {uid}: the process is not root")]
    OwnerNotPermitted { uid: u32 },
    /// Direct mode was given something that is not a directory.
    #[error("{0} is not a directory")]
    NotADirectory(PathBuf),
    /// Direct mode's directory is no longer the one that was checked (a component swapped
    /// for a symlink, another directory renamed into its place).
    #[error("{0} is no longer the directory that was checked")]
    DirectoryChanged(PathBuf),
    /// The session's owner may not read a path of the source that the copy needs (a
    /// tracked file or a directory leading to one): the kernel refused the owner.
    #[error("{op} {path}: the session's owner may not read it")]
    Unreadable { op: &'static str, path: PathBuf },
    #[error(
        "no room is left in the session's storage (its limit, or the host's disk) for host \
         git's scratch directory: free space in its workspace and retry (a forced delete needs \
         no room)"
    )]
    StorageFull,
}

/// How many uncommitted paths an [`SessionError::Unsaved`] message names before "...".
const LISTED_PATHS: usize = 10;

fn unsaved_message(uncommitted: &[String], unexported: usize) -> String {
    let mut parts = Vec::new();
    if !uncommitted.is_empty() {
        let mut listed = uncommitted
            .iter()
            .take(LISTED_PATHS)
            .map(String::as_str)
            .collect::<Vec<_>>()
            .join(", ");
        if uncommitted.len() > LISTED_PATHS {
            listed.push_str(", ...");
        }
        parts.push(format!(
            "{} uncommitted path(s) ({listed})",
            uncommitted.len()
        ));
    }
    if unexported > 0 {
        parts.push(format!("{unexported} commit(s) not exported"));
    }
    format!(
        "the session has {}; commit and export them, or force",
        parts.join(" and ")
    )
}

impl SessionError {
    /// [`SessionError::io`] for reading the source as its owner: a refusal of the owner
    /// (`EACCES`, `EPERM`) is [`SessionError::Unreadable`].
    pub(crate) fn source(op: &'static str, path: impl Into<PathBuf>) -> impl FnOnce(Errno) -> Self {
        let path = path.into();
        move |e| match e {
            Errno::EACCES | Errno::EPERM => SessionError::Unreadable { op, path },
            e => SessionError::Io {
                op,
                path,
                source: e.into(),
            },
        }
    }

    pub(crate) fn io(
        op: &'static str,
        path: impl Into<PathBuf>,
    ) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |source| SessionError::Io { op, path, source }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_unsaved_message_many_paths_truncated() {
        let paths: Vec<String> = (0..12).map(|i| format!("f{i}")).collect();
        let msg = SessionError::Unsaved {
            uncommitted: paths,
            unexported: 2,
        }
        .to_string();
        assert!(msg.contains("12 uncommitted path(s) (f0, f1"), "{msg}");
        assert!(msg.contains("f9, ...)"), "{msg}");
        assert!(!msg.contains("f10"), "{msg}");
        assert!(msg.contains("2 commit(s) not exported"), "{msg}");
    }

    #[test]
    fn test_unsaved_message_only_commits() {
        let msg = SessionError::Unsaved {
            uncommitted: vec![],
            unexported: 1,
        }
        .to_string();
        assert_eq!(
            msg,
            "the session has 1 commit(s) not exported; commit and export them, or force"
        );
    }
}
