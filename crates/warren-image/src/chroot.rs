//! Running a recipe's commands (and pip) in the build root, confined: new mount, PID, IPC,
//! UTS and network namespaces (`unshare`), where only `/proc` (of the new PID namespace) and a
//! minimal `/dev` (a small tmpfs with `null`, `zero`, `full`, `random`, `urandom`, `tty` and
//! the `fd`/`stdin`/`stdout`/`stderr` links) are mounted into the root before `chroot`. The
//! mounts live and die with the namespace, so nothing is left mounted in the tree, and the
//! command has no network: what a build installs from outside is fetched and checked on the
//! host (Debian packages by apt's signatures, npm and Python packages by their pins).
//!
//! The environment is fixed (`PATH`, `HOME=/root`, `LC_ALL=C`, `DEBIAN_FRONTEND`); output is
//! appended to the build log.

use std::path::Path;
use std::process::Command;

use crate::command::{run_logged, Failure};
use crate::ImageError;

/// The script `unshare` runs (as PID 1 of the new namespace): `$1` is the root, the rest the
/// command's argv.
const SCRIPT: &str = r#"set -eu
root=$1; shift
mount -t proc -o nosuid,nodev,noexec proc "$root/proc"
mount -t tmpfs -o nosuid,noexec,mode=0755,size=1m warren-dev "$root/dev"
for d in null:1:3 zero:1:5 full:1:7 random:1:8 urandom:1:9 tty:5:0; do
  IFS=: read -r n ma mi <<<"$d"
  mknod -m 0666 "$root/dev/$n" c "$ma" "$mi"
done
ln -s /proc/self/fd "$root/dev/fd"
ln -s /proc/self/fd/0 "$root/dev/stdin"
ln -s /proc/self/fd/1 "$root/dev/stdout"
ln -s /proc/self/fd/2 "$root/dev/stderr"
exec chroot "$root" "$@"
"#;

/// Runs `argv` chrooted into `root` (see the module docs), logging to `log`; each output
/// line goes to `progress`. `Ok(Err(failure))` when the command ran and failed.
pub(crate) fn run(
    root: &Path,
    argv: &[String],
    log: &Path,
    progress: &mut dyn FnMut(&str),
) -> Result<Result<(), Failure>, ImageError> {
    for dir in ["proc", "dev"] {
        let p = root.join(dir);
        let meta = std::fs::symlink_metadata(&p).map_err(ImageError::io("stat", &p))?;
        if !meta.is_dir() {
            return Err(ImageError::RootfsSetup(format!(
                "{} is not a directory (a mount point for the build's commands)",
                p.display()
            )));
        }
    }
    let mut cmd = Command::new("unshare");
    cmd.args([
        "--mount",
        "--propagation",
        "private",
        "--pid",
        "--fork",
        "--kill-child",
        "--ipc",
        "--uts",
        "--net",
        "--",
        "/bin/bash",
        "-c",
        SCRIPT,
        "warren-build",
    ])
    .arg(root)
    .args(argv)
    .env_clear()
    .env(
        "PATH",
        "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    )
    .env("HOME", "/root")
    .env("LC_ALL", "C")
    .env("DEBIAN_FRONTEND", "noninteractive");
    run_logged(cmd, log, &mut |line| progress(line))
}
