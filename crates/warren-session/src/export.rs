//! Bringing a session's commits into the source repository as a branch.
//!
//! Steps, in order:
//! 1. Check the session directory ([`crate::guard`]) and the branch name, and build the
//!    host-owned scratch git directory host git reads the session through
//!    (`scratch`).
//! 2. Resolve the session's HEAD commit, check the source repository at `source_git` as
//!    `prepare` does (`source`: a `gitdir:` file or `commondir` into another repository, a
//!    symlink in `objects`, the refs or the logs, an include... is refused before anything
//!    is written) and that it is the repository the session was made from (same object
//!    directory). Every later git command names its common git directory explicitly.
//! 3. Refuse a branch checked out in any working tree of the source, and an existing branch
//!    that is not an ancestor of the commit (fast-forward only).
//! 4. Pack the objects reachable from the commit and from no source ref
//!    (`pack-objects --revs` over the scratch directory, which also reads the source store)
//!    and index the pack into the source (`index-pack --stdin --strict`, which verifies every
//!    object).
//! 5. Move the branch with a compare-and-swap `update-ref` (old value: what step 3 saw).

use std::path::{Path, PathBuf};

use crate::git::{text, Git, Repo};
use crate::guard::{self, SessionPaths};
use crate::retention::source_tips;
use crate::scratch::Scratch;
use crate::{Owner, SessionError};

/// What [`export`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Exported {
    /// The full ref written, `refs/heads/<branch>`.
    pub refname: String,
    /// The session commit the branch now points at.
    pub commit: String,
    /// The branch's previous commit, if it existed.
    pub previous: Option<String>,
    /// Commits that were new to the source repository.
    pub new_commits: usize,
}

/// Makes the session's HEAD commit, and the objects it needs, available in the source
/// repository containing `source_git` as branch `branch`. Only creates the branch or
/// fast-forwards it.
#[tracing::instrument(skip_all, fields(session = %session_dir.display(), branch))]
pub fn export(
    session_dir: &Path,
    source_git: &Path,
    branch: &str,
    owner: Option<Owner>,
) -> Result<Exported, SessionError> {
    let git = Git::new(owner)?;
    let paths = SessionPaths::new(session_dir);
    guard::check(&paths)?;
    let refname = branch_ref(&git, branch)?;
    let scratch = Scratch::build(&paths, &git)?;
    let repo = scratch.repo();

    let head = git.output(
        repo,
        &["rev-parse", "--verify", "-q", "HEAD^{commit}"],
        None,
    )?;
    if !head.status.success() {
        return Err(SessionError::NothingToExport);
    }
    let commit = text(&head.stdout);

    let source = crate::source::open_any(&git, source_git)?;
    let expected = paths.source_objects()?;
    if source.objects_dir() != expected {
        return Err(SessionError::SourceMismatch {
            source_git: source_git.to_path_buf(),
            expected,
        });
    }
    let common = source.common_dir().to_path_buf();
    let src = Repo::GitDir(&common);

    if let Some(worktree) = checked_out_in(&git, src, &refname)? {
        return Err(SessionError::BranchCheckedOut {
            branch: branch.to_string(),
            worktree,
        });
    }
    let previous = {
        let out = git.output(src, &["rev-parse", "--verify", "-q", &refname], None)?;
        out.status.success().then(|| text(&out.stdout))
    };
    if let Some(old) = &previous {
        if *old == commit {
            return Ok(Exported {
                refname,
                commit,
                previous,
                new_commits: 0,
            });
        }
        // The old tip is in the source store, which the session reads through alternates.
        let out = git.output(repo, &["merge-base", "--is-ancestor", old, &commit], None)?;
        match out.status.code() {
            Some(0) => {}
            Some(1) => {
                return Err(SessionError::NotFastForward {
                    branch: branch.to_string(),
                    existing: old.clone(),
                    commit,
                })
            }
            _ => {
                return Err(SessionError::Git {
                    args: "merge-base --is-ancestor".into(),
                    status: out.status.to_string(),
                    stderr: text(&out.stderr),
                })
            }
        }
    }

    let mut revs = format!("{commit}\n");
    for t in source_tips(&git, &common)? {
        revs.push('^');
        revs.push_str(&t);
        revs.push('\n');
    }
    let new_commits = git
        .run_with(repo, &["rev-list", "--stdin"], Some(revs.as_bytes()))?
        .split(|b| *b == b'\n')
        .filter(|l| !l.is_empty())
        .count();
    let new_objects = git
        .run_with(
            repo,
            &["rev-list", "--objects", "--stdin"],
            Some(revs.as_bytes()),
        )?
        .split(|b| *b == b'\n')
        .filter(|l| !l.is_empty())
        .count();
    if new_objects > 0 {
        let pack_dir = common.join("objects").join("pack");
        let before = temporary_packs(&pack_dir);
        let indexed = git.pipe(
            (repo, &["pack-objects", "--revs", "--stdout", "-q"]),
            revs.as_bytes(),
            (src, &["index-pack", "--stdin", "--strict"]),
        );
        if indexed.is_err() {
            // index-pack leaves its temporary pack behind when it refuses the pack (the
            // guest can make `--strict` fail after a large blob) or is killed at the
            // deadline: guest-sized files in the user's own repository, each retry one more.
            for name in temporary_packs(&pack_dir).difference(&before) {
                let _ = std::fs::remove_file(pack_dir.join(name));
            }
        }
        indexed?;
    }
    let old = previous.clone().unwrap_or_default();
    git.run(
        src,
        &[
            "update-ref",
            "-m",
            "warren session export",
            &refname,
            &commit,
            &old,
        ],
    )?;
    tracing::info!(%refname, %commit, new_commits, "session exported");
    Ok(Exported {
        refname,
        commit,
        previous,
        new_commits,
    })
}

/// `refs/heads/<branch>` for a valid branch name.
fn branch_ref(git: &Git, branch: &str) -> Result<String, SessionError> {
    let invalid = || SessionError::InvalidBranch(branch.to_string());
    // `@{-1}` and friends expand only inside a repository; none is given here. A leading
    // dash would read as an option.
    // `HEAD` is refused explicitly: git before 2.43 accepts it as a branch name.
    if branch.starts_with('-') || branch == "HEAD" || (branch.contains('@') && branch.contains('{'))
    {
        return Err(invalid());
    }
    let out = git.output(Repo::None, &["check-ref-format", "--branch", branch], None)?;
    if !out.status.success() || text(&out.stdout) != branch {
        return Err(invalid());
    }
    Ok(format!("refs/heads/{branch}"))
}

/// The working tree of the source that has `refname` checked out (born or unborn), if any.
fn checked_out_in(
    git: &Git,
    source: Repo<'_>,
    refname: &str,
) -> Result<Option<PathBuf>, SessionError> {
    let list = git.run(source, &["worktree", "list", "--porcelain", "-z"])?;
    let mut current: Option<PathBuf> = None;
    for field in list.split(|b| *b == 0) {
        let line = String::from_utf8_lossy(field);
        if let Some(p) = line.strip_prefix("worktree ") {
            current = Some(PathBuf::from(p));
        } else if line.strip_prefix("branch ") == Some(refname) {
            return Ok(current);
        }
    }
    Ok(None)
}

/// The names of git's temporary files in a pack directory (`tmp_pack_*`, `tmp_idx_*`,
/// `tmp_rev_*`).
fn temporary_packs(pack_dir: &std::path::Path) -> std::collections::HashSet<std::ffi::OsString> {
    std::fs::read_dir(pack_dir)
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name())
                .filter(|n| {
                    let n = n.as_encoded_bytes();
                    n.starts_with(b"tmp_pack_")
                        || n.starts_with(b"tmp_idx_")
                        || n.starts_with(b"tmp_rev_")
                })
                .collect()
        })
        .unwrap_or_default()
}
