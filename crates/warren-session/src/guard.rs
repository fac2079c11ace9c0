//! The session directory's layout, and the check made before host git reads a session.
//!
//! The guest owns everything under `S/workspace`, including `.git`, so host git never uses
//! that directory as a repository: it reads the session through a host-owned scratch git
//! directory (`scratch`) built from copies of what it needs. `check` only verifies
//! what Warren itself made is in place (`S`, the host-owned objects link, the working tree, a
//! real `.git` directory); the guest's config, hooks, attributes, alternates, `commondir` and
//! submodules are never read by host git at all, whatever they say.

use std::path::{Path, PathBuf};

use crate::git::Repo;
use crate::{SessionError, SOURCE_OBJECTS_LINK, WORKSPACE_DIR};

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
        Repo::Explicit {
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

/// Verifies the session directory is what [`crate::prepare`] made, as far as host git is
/// concerned. Run before every host git operation on a session.
pub(crate) fn check(paths: &SessionPaths) -> Result<(), SessionError> {
    paths.check_session()?;
    match std::fs::symlink_metadata(&paths.git_dir) {
        Ok(m) if m.is_dir() => Ok(()),
        _ => Err(SessionError::UnsafeGitDir {
            path: paths.git_dir.clone(),
            reason: ".git is not a directory".into(),
        }),
    }
}
