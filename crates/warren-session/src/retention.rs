//! What a session still holds ([`status`]) and destroying it ([`remove`]).

use std::path::{Path, PathBuf};

use crate::git::{nul_fields, Git, Repo};
use crate::guard::{self, SessionPaths};
use crate::scratch::Scratch;
use crate::{Owner, SessionError};

/// Work in a session that deleting it would lose.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Retention {
    /// Paths with staged, unstaged or untracked (non-ignored) changes, from
    /// `git status --porcelain` (the new path of a rename).
    pub uncommitted: Vec<String>,
    /// Commits reachable from the session's HEAD or branches but from no ref of the source
    /// repository, newest first.
    pub unexported: Vec<String>,
}

impl Retention {
    /// Nothing would be lost.
    pub fn is_clean(&self) -> bool {
        self.uncommitted.is_empty() && self.unexported.is_empty()
    }
}

/// Reports the session's uncommitted paths and unexported commits. Host git reads the
/// session through a host-owned scratch git directory (`scratch.rs`), never the
/// guest's, and ignores submodules entirely (`--ignore-submodules=all`: nothing under a
/// gitlink is opened; commits that change a gitlink still count as unexported).
pub fn status(session_dir: &Path, owner: Option<Owner>) -> Result<Retention, SessionError> {
    let git = Git::new(owner)?;
    let paths = SessionPaths::new(session_dir);
    guard::check(&paths)?;
    let scratch = Scratch::build(&paths, &git)?;
    let repo = scratch.repo();
    let porcelain = git.run(
        repo,
        &[
            "status",
            "--porcelain=v1",
            "-z",
            "--untracked-files=all",
            "--ignore-submodules=all",
        ],
    )?;
    let mut uncommitted = Vec::new();
    let mut fields = nul_fields(&porcelain);
    while let Some(rec) = fields.next() {
        // "XY path", and for a rename or copy the source path follows as its own field.
        if rec.len() < 4 {
            continue;
        }
        uncommitted.push(String::from_utf8_lossy(&rec[3..]).into_owned());
        if matches!(rec[0], b'R' | b'C') {
            fields.next();
        }
    }
    let unexported = unexported(&git, &paths, repo)?;
    Ok(Retention {
        uncommitted,
        unexported,
    })
}

/// The source's common git directory, derived from the session's objects link (the link
/// points at `<common dir>/objects`).
pub(crate) fn source_git_dir(paths: &SessionPaths) -> Result<PathBuf, SessionError> {
    let objects = paths.source_objects()?;
    objects
        .parent()
        .map(Path::to_path_buf)
        .ok_or_else(|| SessionError::NotASession {
            path: paths.root.clone(),
            reason: "the source objects link has no parent directory".into(),
        })
}

/// Object ids of every ref in the source repository (the commits it already has).
pub(crate) fn source_tips(git: &Git, source_git: &Path) -> Result<Vec<String>, SessionError> {
    let out = git.run(
        Repo::GitDir(source_git),
        &["for-each-ref", "--format=%(objectname)"],
    )?;
    Ok(String::from_utf8_lossy(&out)
        .lines()
        .map(str::to_string)
        .collect())
}

fn unexported(
    git: &Git,
    paths: &SessionPaths,
    repo: Repo<'_>,
) -> Result<Vec<String>, SessionError> {
    let head = git.output(
        repo,
        &["rev-parse", "--verify", "-q", "HEAD^{commit}"],
        None,
    )?;
    let mut args = vec!["rev-list", "--branches", "--stdin"];
    if head.status.success() {
        args.insert(1, "HEAD");
    }
    let tips = source_tips(git, &source_git_dir(paths)?)?;
    let mut input = String::new();
    for t in tips {
        input.push('^');
        input.push_str(&t);
        input.push('\n');
    }
    let out = git.run_with(repo, &args, Some(input.as_bytes()))?;
    Ok(String::from_utf8_lossy(&out)
        .lines()
        .map(str::to_string)
        .collect())
}

/// Deletes the session directory. Without `force`, refuses with [`SessionError::Unsaved`]
/// while the session has uncommitted paths or unexported commits (and with the check's own
/// error when the session repository cannot be inspected safely).
///
/// Deletion never follows symlinks: the objects link and any link the guest made are
/// removed, not their targets.
pub fn remove(session_dir: &Path, force: bool, owner: Option<Owner>) -> Result<(), SessionError> {
    if force {
        // A session whose directory was never made (a fork cut off between its admission
        // and its copy): nothing to remove, and its record must still go.
        if let Err(e) = std::fs::symlink_metadata(session_dir) {
            if e.kind() == std::io::ErrorKind::NotFound {
                return Ok(());
            }
        }
    }
    let paths = SessionPaths::new(session_dir);
    paths.check_session()?;
    if !force {
        let r = status(session_dir, owner)?;
        if !r.is_clean() {
            return Err(SessionError::Unsaved {
                uncommitted: r.uncommitted,
                unexported: r.unexported.len(),
            });
        }
    }
    // The guest shaped this tree: removed without recursion, symlinks unlinked, never
    // followed ([`crate::remove_tree`]).
    crate::remove_tree(session_dir).map_err(SessionError::io("remove", session_dir))?;
    tracing::info!(session = %session_dir.display(), force, "session removed");
    Ok(())
}
