//! Checks that make the session repository safe for host git.
//!
//! The guest owns everything under `S/workspace`, including `.git`. Before the host runs git
//! there, `check` verifies the layout [`crate::prepare`] made is still in place (real
//! directories, no `commondir` redirect, the alternates line unchanged) and that every key of
//! `.git/config` is on [`ALLOWED_KEYS`]. The config is read with
//! `git config --file F --list --no-includes`, which parses the file and runs nothing.
//!
//! The check and the git command that follows are not atomic: a guest that rewrites its
//! config in between could still get a key past it. Hooks, fsmonitor, pagers, attribute
//! files and transports are also overridden on git's command line (`crate::git`), so the
//! window matters only for drivers named by attributes (filters); callers that need a hard
//! guarantee run host-side git while the VM is paused or stopped.

use std::path::{Path, PathBuf};

use crate::git::{nul_fields, Git, Repo};
use crate::{SessionError, ALTERNATES_ENTRY, SOURCE_OBJECTS_LINK, WORKSPACE_DIR};

/// Config keys (as `git config --list` prints them: section and name lowercased) that host
/// git may read from a session repository: what `git init` writes, identity and line-ending
/// settings copied from the source, and settings that only describe, never run, anything.
pub const ALLOWED_KEYS: &[&str] = &[
    "core.repositoryformatversion",
    "core.filemode",
    "core.bare",
    "core.logallrefupdates",
    "core.symlinks",
    "core.ignorecase",
    "core.precomposeunicode",
    "core.autocrlf",
    "core.eol",
    "core.safecrlf",
    "extensions.objectformat",
    "init.defaultbranch",
    "user.name",
    "user.email",
];

/// Allowed `branch.<name>.<key>` keys: upstream bookkeeping the host never acts on.
const ALLOWED_BRANCH_KEYS: &[&str] = &["remote", "merge", "description"];

/// Whether host git may read `key` from a session's config.
pub fn key_allowed(key: &str) -> bool {
    let key_lc = key.to_ascii_lowercase();
    if ALLOWED_KEYS.contains(&key_lc.as_str()) || key_lc.starts_with("advice.") {
        return true;
    }
    // branch.<subsection>.<name>: the subsection keeps its case and may contain dots.
    if let (Some(rest), Some(dot)) = (key_lc.strip_prefix("branch."), key_lc.rfind('.')) {
        return dot > "branch".len()
            && !rest.is_empty()
            && ALLOWED_BRANCH_KEYS.contains(&&key_lc[dot + 1..]);
    }
    false
}

/// The paths of one session directory.
#[derive(Debug, Clone)]
pub(crate) struct SessionPaths {
    pub root: PathBuf,
    pub workspace: PathBuf,
    pub git_dir: PathBuf,
    pub link: PathBuf,
}

impl SessionPaths {
    pub(crate) fn new(session_dir: &Path) -> Self {
        let workspace = session_dir.join(WORKSPACE_DIR);
        SessionPaths {
            root: session_dir.to_path_buf(),
            git_dir: workspace.join(".git"),
            workspace,
            link: session_dir.join(SOURCE_OBJECTS_LINK),
        }
    }

    pub(crate) fn repo(&self) -> Repo<'_> {
        Repo::Session {
            git_dir: &self.git_dir,
            work_tree: &self.workspace,
        }
    }

    /// The source's object directory, as the session's link records it.
    pub(crate) fn source_objects(&self) -> Result<PathBuf, SessionError> {
        std::fs::read_link(&self.link).map_err(SessionError::io("read link", &self.link))
    }

    /// Checks that this is a session directory: the root, `workspace/` and the objects link
    /// (host-owned, outside the guest's reach) are in place.
    pub(crate) fn check_session(&self) -> Result<(), SessionError> {
        let not = |reason: &str| SessionError::NotASession {
            path: self.root.clone(),
            reason: reason.to_string(),
        };
        match std::fs::symlink_metadata(&self.root) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => return Err(not("not a directory")),
            Err(e) => return Err(SessionError::io("stat", &self.root)(e)),
        }
        match std::fs::symlink_metadata(&self.link) {
            Ok(m) if m.file_type().is_symlink() => {}
            _ => return Err(not("no source objects link")),
        }
        match std::fs::symlink_metadata(&self.workspace) {
            Ok(m) if m.is_dir() => Ok(()),
            _ => Err(not("no workspace directory")),
        }
    }
}

/// Verifies the session repository is what [`crate::prepare`] made, as far as host git is
/// concerned, and that its config holds only allowed keys. Run before every host git command
/// in the session repository.
pub(crate) fn check(paths: &SessionPaths, git: &Git) -> Result<(), SessionError> {
    paths.check_session()?;
    let unsafe_dir = |reason: &str| SessionError::UnsafeGitDir {
        path: paths.git_dir.clone(),
        reason: reason.to_string(),
    };
    for (path, what) in [
        (&paths.git_dir, ".git is not a directory"),
        (
            &paths.git_dir.join("objects"),
            ".git/objects is not a directory",
        ),
    ] {
        match std::fs::symlink_metadata(path) {
            Ok(m) if m.is_dir() => {}
            _ => return Err(unsafe_dir(what)),
        }
    }
    // `commondir` would make git take config, refs and objects from another directory.
    for redirect in ["commondir", "gitdir"] {
        if std::fs::symlink_metadata(paths.git_dir.join(redirect)).is_ok() {
            return Err(unsafe_dir(&format!(".git/{redirect} exists")));
        }
    }
    let alternates = paths.git_dir.join("objects/info/alternates");
    let entries = std::fs::read(&alternates).map_err(SessionError::io("read", &alternates))?;
    let entries: Vec<&[u8]> = entries
        .split(|b| *b == b'\n')
        .filter(|l| !l.is_empty())
        .collect();
    if entries != [ALTERNATES_ENTRY.as_bytes()] {
        return Err(unsafe_dir("objects/info/alternates was changed"));
    }
    check_config(&paths.git_dir.join("config"), git)
}

/// Refuses a config file with any key outside the allowlist (a missing file is empty).
pub(crate) fn check_config(config: &Path, git: &Git) -> Result<(), SessionError> {
    match std::fs::symlink_metadata(config) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(SessionError::io("stat", config)(e)),
        Ok(_) => {}
    }
    let mut file = std::ffi::OsString::from("--file=");
    file.push(config.as_os_str());
    let listing = git.run(
        Repo::None,
        &[
            std::ffi::OsStr::new("config"),
            std::ffi::OsStr::new("--no-includes"),
            &file,
            std::ffi::OsStr::new("--list"),
            std::ffi::OsStr::new("-z"),
        ],
    )?;
    for entry in nul_fields(&listing) {
        // `-z` prints "key\nvalue" (or just "key" for a valueless boolean).
        let key = entry.split(|b| *b == b'\n').next().unwrap_or_default();
        let key = String::from_utf8_lossy(key);
        if !key_allowed(&key) {
            return Err(SessionError::UnsafeConfig {
                key: key.into_owned(),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_key_allowed_init_keys_allowed() {
        for k in [
            "core.repositoryformatversion",
            "core.filemode",
            "core.bare",
            "core.logallrefupdates",
            "user.name",
            "extensions.objectformat",
            "branch.main.remote",
            "branch.feat/x.y.merge",
            "advice.detachedHead",
        ] {
            assert!(key_allowed(k), "{k}");
        }
    }

    #[test]
    fn test_key_allowed_executing_keys_refused() {
        for k in [
            "core.fsmonitor",
            "core.hookspath",
            "core.pager",
            "core.sshcommand",
            "core.editor",
            "core.worktree",
            "core.alternaterefscommand",
            "filter.lfs.clean",
            "filter.x.process",
            "diff.x.textconv",
            "diff.external",
            "include.path",
            "includeif.gitdir:/x.path",
            "alias.st",
            "gpg.program",
            "extensions.worktreeconfig",
            "branch.main.pushremote.x",
            "branch.remote",
            "remote.origin.url",
            "credential.helper",
        ] {
            assert!(!key_allowed(k), "{k}");
        }
    }
}
