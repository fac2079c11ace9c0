//! The per-project agent state directory's privacy (mounted at `/agent-state`).

use std::path::Path;

use crate::error::CoreError;

/// Makes (or keeps) the per-project agent state directory `state` for its owner only: the
/// agent's history there holds code, prompts and command output. Its parent (host-owned,
/// shared by every project) is 0711, so no one lists the projects; the directory itself is
/// 0700 and the owner's, made so or, left by an older Warren at 0755, made so now.
pub(crate) fn private_agent_state(state: &Path, uid: u32, gid: u32) -> Result<(), CoreError> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    let mode = |p: &Path, m: u32| {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(m))
            .map_err(|e| CoreError::io("chmod", p, e))
    };
    if let Some(parent) = state.parent() {
        std::fs::create_dir_all(parent).map_err(|e| CoreError::io("create", parent, e))?;
        mode(parent, 0o711)?;
    }
    match std::fs::DirBuilder::new().mode(0o700).create(state) {
        Ok(()) => std::os::unix::fs::chown(state, Some(uid), Some(gid))
            .map_err(|e| CoreError::io("chown", state, e))?,
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(CoreError::io("create", state, e)),
    }
    mode(state, 0o700)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The agent state directory (agent history: code, prompts, command output) is its
    /// owner's alone, and the directory of all projects lists nothing to others; one an older
    /// Warren made 0755 is made private on the next use. (Before: 0755 and 0755.)
    #[test]
    fn test_agent_state_is_private() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().expect("tmp");
        let mode = |p: &Path| std::fs::metadata(p).expect("stat").permissions().mode() & 0o777;
        let state = d.path().join("agent-state").join("0123456789abcdef");
        let (uid, gid) = (
            nix::unistd::getuid().as_raw(),
            nix::unistd::getgid().as_raw(),
        );
        private_agent_state(&state, uid, gid).expect("make");
        assert_eq!(
            (mode(state.parent().expect("parent")), mode(&state)),
            (0o711, 0o700)
        );
        let old = d.path().join("agent-state").join("fedcba9876543210");
        std::fs::create_dir(&old).expect("mkdir");
        std::fs::set_permissions(&old, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        std::fs::write(old.join("history.jsonl"), "{}").expect("write");
        private_agent_state(&old, uid, gid).expect("keep");
        assert_eq!(mode(&old), 0o700);
        assert!(old.join("history.jsonl").exists(), "its contents stay");
    }
}
