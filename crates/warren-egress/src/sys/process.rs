//! Credential drop for interception commands.

use tokio::process::Command;

/// Makes `cmd` run as `uid`/`gid` in its own process group (so a timeout can kill everything
/// it started). When Warren runs as root, the standard library also clears the supplementary
/// groups before `setuid` (it calls `setgroups(0, NULL)` when no groups were requested), so
/// root's groups do not leak into the command.
pub(crate) fn drop_privileges(cmd: &mut Command, uid: u32, gid: u32) {
    cmd.uid(uid).gid(gid).process_group(0);
}
