//! Running `git` on the host without trusting anything but the caller.
//!
//! Every invocation gets a scrubbed environment (no system or global config, no user
//! attributes or excludes, `HOME` pointing nowhere, C locale, an empty transport allow-list
//! and no lazy fetch), command-line overrides that disable hooks, fsmonitor, pagers and every
//! transport, and runs as the session's [`Owner`]
//! when one is given and the process is root, in a process group of its own that is killed
//! when the command outlives its deadline ([`DEADLINE`]; [`PIPE_DEADLINE`] for a pack moved
//! between two gits). Repository-local config is still read by git, so git only ever runs on
//! a source repository `source` has checked (no includes, no `core.worktree`, no redirect)
//! and on host-owned directories: a session is read through `scratch`, never through the
//! guest's git directory.

use std::ffi::{OsStr, OsString};
use std::io::{Read, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

use crate::SessionError;

/// The Unix user and group that own a session's files and run its git commands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Owner {
    pub uid: u32,
    pub gid: u32,
}

/// Where a git command runs.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Repo<'a> {
    /// Discover the repository from this directory (`git -C dir`): only to compare git's
    /// view of the source with the one Warren checked (`source`).
    At(&'a Path),
    /// Explicit `--git-dir`/`--work-tree`, no discovery: a scratch git directory over the
    /// session's working tree, or the checked source repository (`source`).
    Explicit {
        git_dir: &'a Path,
        work_tree: &'a Path,
    },
    /// A scratch git directory over a session's working tree, which the guest writes: like
    /// `Explicit`, and when Warren runs as root git also runs in a mount namespace of its own
    /// where that tree is a read-only bind mount that follows no symbolic link and honours no
    /// device node or set-id bit (`sys::confine_tree`).
    Session {
        git_dir: &'a Path,
        work_tree: &'a Path,
    },
    /// A git directory without a working tree (`--git-dir`).
    GitDir(&'a Path),
    /// No repository (e.g. `check-ref-format`); runs in `/`.
    None,
}

/// Overrides that win over any config file git reads (command-line config has top priority).
const OVERRIDES: &[&str] = &[
    "core.hooksPath=/dev/null",
    "core.fsmonitor=false",
    "core.pager=cat",
    "core.attributesFile=/dev/null",
    "core.excludesFile=/dev/null",
    "protocol.allow=never",
    "gc.auto=0",
    "maintenance.auto=false",
    // Bounded memory over objects a guest wrote (huge blobs, deep delta windows).
    "core.bigFileThreshold=64m",
    "core.packedGitLimit=512m",
    "core.packedGitWindowSize=32m",
    "pack.windowMemory=256m",
    "pack.threads=1",
];

/// Address space a git command may map: packs are mapped through windows
/// (`core.packedGitLimit`), so this only stops a guest-written file (a huge `.gitignore`,
/// index or tree) from growing git without bound.
const ADDRESS_SPACE: u64 = 4 << 30;

/// Most bytes of a git command's output kept: past it the command fails (`TooLarge`) rather
/// than have a guest's tree (a status of millions of untracked paths) grow the service.
const MAX_OUTPUT: usize = 64 << 20;
/// Most bytes of a git command's error output kept (the rest is dropped).
const MAX_STDERR: usize = 64 << 10;

/// Longest a git command may run.
pub(crate) const DEADLINE: Duration = Duration::from_secs(120);
/// Longest a `pack-objects | index-pack` pipe may run.
pub(crate) const PIPE_DEADLINE: Duration = Duration::from_secs(600);

/// Runs git for one [`Owner`] (or the current user).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Git {
    run_as: Option<Owner>,
}

impl Git {
    /// `owner` applies only when the process is root and the owner is someone else; a
    /// non-root process can act only as itself.
    pub(crate) fn new(owner: Option<Owner>) -> Result<Self, SessionError> {
        Ok(Git {
            run_as: effective_owner(owner)?,
        })
    }

    /// The owner git and file creation switch to, if any (see [`effective_owner`]).
    pub(crate) fn run_as(&self) -> Option<Owner> {
        self.run_as
    }

    fn command<S: AsRef<OsStr>>(&self, repo: Repo<'_>, args: &[S]) -> Command {
        let mut cmd = Command::new("git");
        cmd.env_clear();
        cmd.env(
            "PATH",
            std::env::var_os("PATH").unwrap_or_else(|| "/usr/local/bin:/usr/bin:/bin".into()),
        );
        for (k, v) in [
            ("HOME", "/nonexistent"),
            ("LC_ALL", "C"),
            ("GIT_CONFIG_NOSYSTEM", "1"),
            ("GIT_CONFIG_GLOBAL", "/dev/null"),
            ("GIT_ATTR_NOSYSTEM", "1"),
            ("GIT_TERMINAL_PROMPT", "0"),
            ("GIT_NO_REPLACE_OBJECTS", "1"),
            ("GIT_PROTOCOL_FROM_USER", "0"),
            // An allow-list, even an empty one, wins over every `protocol.<name>.allow` a
            // repository's config may set (`protocol.allow=never` does not).
            ("GIT_ALLOW_PROTOCOL", ""),
            // No lazy fetch of a missing object from a promisor remote (git 2.44+).
            ("GIT_NO_LAZY_FETCH", "1"),
        ] {
            cmd.env(k, v);
        }
        cmd.current_dir("/");
        cmd.arg("--no-pager").arg("--no-optional-locks");
        for o in OVERRIDES {
            cmd.arg("-c").arg(o);
        }
        match repo {
            Repo::At(dir) => {
                cmd.arg("-C").arg(dir);
            }
            Repo::Explicit { git_dir, work_tree } | Repo::Session { git_dir, work_tree } => {
                cmd.arg(dashdash("--git-dir=", git_dir))
                    .arg(dashdash("--work-tree=", work_tree));
            }
            Repo::GitDir(git_dir) => {
                cmd.arg(dashdash("--git-dir=", git_dir));
            }
            Repo::None => {}
        }
        cmd.args(args);
        // Its own process group, so a deadline kills whatever it started too.
        cmd.process_group(0);
        crate::sys::limit_address_space(&mut cmd, ADDRESS_SPACE);
        match repo {
            Repo::Session { work_tree, .. } if nix::unistd::geteuid().is_root() => {
                // The namespace needs root, so the owner is taken on after it is made.
                crate::sys::confine_tree(&mut cmd, work_tree, self.run_as);
            }
            _ => {
                if let Some(o) = self.run_as {
                    // std drops supplementary groups itself when a root parent sets a uid.
                    cmd.uid(o.uid).gid(o.gid);
                }
            }
        }
        cmd
    }

    /// Runs git and returns its output whatever the exit status.
    pub(crate) fn output<S: AsRef<OsStr>>(
        &self,
        repo: Repo<'_>,
        args: &[S],
        stdin: Option<&[u8]>,
    ) -> Result<Output, SessionError> {
        let mut cmd = self.command(repo, args);
        tracing::trace!(?cmd, "git");
        cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
        cmd.stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        });
        let mut child = cmd.spawn().map_err(SessionError::GitSpawn)?;
        // Feed stdin from a thread: git may fill its stdout pipe before reading all input.
        let writer = match (stdin, child.stdin.take()) {
            (Some(input), Some(mut pipe)) => {
                let input = input.to_vec();
                Some(std::thread::spawn(move || pipe.write_all(&input)))
            }
            _ => None,
        };
        let stdout = drain(child.stdout.take(), MAX_OUTPUT);
        let stderr = drain(child.stderr.take(), MAX_STDERR);
        let status = wait_until(&mut child, DEADLINE, Instant::now() + DEADLINE, args)?;
        // A git that exits early closes the pipe; its exit status reports why.
        if let Some(w) = writer {
            let _ = w.join();
        }
        let (stdout, cut) = stdout.join().unwrap_or_default();
        if cut {
            return Err(SessionError::TooLarge {
                what: format!("the output of git {}", joined(args)),
                limit: format!("{} MiB", MAX_OUTPUT >> 20),
            });
        }
        Ok(Output {
            status,
            stdout,
            stderr: stderr.join().unwrap_or_default().0,
        })
    }

    /// Runs git, requires success, returns stdout.
    pub(crate) fn run<S: AsRef<OsStr>>(
        &self,
        repo: Repo<'_>,
        args: &[S],
    ) -> Result<Vec<u8>, SessionError> {
        self.run_with(repo, args, None)
    }

    /// Runs git with `stdin`, requires success, returns stdout.
    pub(crate) fn run_with<S: AsRef<OsStr>>(
        &self,
        repo: Repo<'_>,
        args: &[S],
        stdin: Option<&[u8]>,
    ) -> Result<Vec<u8>, SessionError> {
        let out = self.output(repo, args, stdin)?;
        if out.status.success() {
            Ok(out.stdout)
        } else {
            Err(failed(args, &out))
        }
    }

    /// Runs git and returns its trimmed stdout as text.
    pub(crate) fn line<S: AsRef<OsStr>>(
        &self,
        repo: Repo<'_>,
        args: &[S],
    ) -> Result<String, SessionError> {
        Ok(text(&self.run(repo, args)?))
    }

    /// Pipes `producer`'s stdout into `consumer`'s stdin (e.g. pack-objects into index-pack)
    /// without buffering the stream; `input` goes to the producer's stdin.
    pub(crate) fn pipe(
        &self,
        producer: (Repo<'_>, &[&str]),
        input: &[u8],
        consumer: (Repo<'_>, &[&str]),
    ) -> Result<Vec<u8>, SessionError> {
        let mut first = self.command(producer.0, producer.1);
        first
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut first = first.spawn().map_err(SessionError::GitSpawn)?;
        let stream = first.stdout.take().expect("invariant: stdout is piped");
        let mut second = self.command(consumer.0, consumer.1);
        second
            .stdin(Stdio::from(stream))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut second = match second.spawn() {
            Ok(c) => c,
            Err(e) => {
                kill_group(&mut first);
                return Err(SessionError::GitSpawn(e));
            }
        };
        let mut pipe = first.stdin.take().expect("invariant: stdin is piped");
        let input = input.to_vec();
        let writer = std::thread::spawn(move || pipe.write_all(&input));
        let first_err = drain(first.stderr.take(), MAX_STDERR);
        let second_out = drain(second.stdout.take(), MAX_OUTPUT);
        let second_err = drain(second.stderr.take(), MAX_STDERR);
        let deadline = Instant::now() + PIPE_DEADLINE;
        let second_status = match wait_until(&mut second, PIPE_DEADLINE, deadline, consumer.1) {
            Ok(s) => s,
            Err(e) => {
                kill_group(&mut first);
                return Err(e);
            }
        };
        let first_status = wait_until(&mut first, PIPE_DEADLINE, deadline, producer.1)?;
        let _ = writer.join();
        let first_out = Output {
            status: first_status,
            stdout: Vec::new(),
            stderr: first_err.join().unwrap_or_default().0,
        };
        let second_out = Output {
            status: second_status,
            stdout: second_out.join().unwrap_or_default().0,
            stderr: second_err.join().unwrap_or_default().0,
        };
        if !first_out.status.success() {
            return Err(failed(producer.1, &first_out));
        }
        if !second_out.status.success() {
            return Err(failed(consumer.1, &second_out));
        }
        Ok(second_out.stdout)
    }
}

/// Reads a child's pipe to the end on a thread of its own, keeping at most `cap` bytes (the
/// rest is read and dropped, so the child never blocks); `true` when bytes were dropped.
fn drain<R: Read + Send + 'static>(
    pipe: Option<R>,
    cap: usize,
) -> std::thread::JoinHandle<(Vec<u8>, bool)> {
    std::thread::spawn(move || {
        let mut buf = Vec::new();
        let mut cut = false;
        if let Some(p) = pipe {
            let mut p = p.take(cap as u64);
            let _ = p.read_to_end(&mut buf);
            let mut rest = p.into_inner();
            let mut sink = [0u8; 8192];
            while let Ok(n) = rest.read(&mut sink) {
                if n == 0 {
                    break;
                }
                cut = true;
            }
        }
        (buf, cut)
    })
}

/// Waits for `child` until `deadline`; past it, kills its process group and fails.
fn wait_until<S: AsRef<OsStr>>(
    child: &mut Child,
    limit: Duration,
    deadline: Instant,
    args: &[S],
) -> Result<ExitStatus, SessionError> {
    let mut pause = Duration::from_millis(1);
    loop {
        if let Some(status) = child.try_wait().map_err(SessionError::GitSpawn)? {
            return Ok(status);
        }
        if Instant::now() >= deadline {
            kill_group(child);
            return Err(SessionError::GitTimeout {
                args: joined(args),
                secs: limit.as_secs(),
            });
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(50));
    }
}

/// Kills `child`'s process group (it leads one, see `Git::command`) and reaps it.
fn kill_group(child: &mut Child) {
    if let Ok(pid) = i32::try_from(child.id()) {
        let _ = nix::sys::signal::killpg(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
    let _ = child.wait();
}

fn joined<S: AsRef<OsStr>>(args: &[S]) -> String {
    args.iter()
        .map(|a| a.as_ref().to_string_lossy())
        .collect::<Vec<_>>()
        .join(" ")
}

/// `owner` as it will be applied: `None` when no switch is needed (no owner, or the owner is
/// the current effective user). A non-root process cannot become someone else.
pub(crate) fn effective_owner(owner: Option<Owner>) -> Result<Option<Owner>, SessionError> {
    let Some(o) = owner else { return Ok(None) };
    let euid = nix::unistd::geteuid().as_raw();
    if euid == 0 {
        // Root acting as root needs no switch; anyone else gets the switch.
        Ok((o.uid != 0 || o.gid != 0).then_some(o))
    } else if o.uid == euid && o.gid == nix::unistd::getegid().as_raw() {
        Ok(None)
    } else {
        Err(SessionError::OwnerNotPermitted { uid: o.uid })
    }
}

fn dashdash(opt: &str, path: &Path) -> OsString {
    let mut s = OsString::from(opt);
    s.push(path.as_os_str());
    s
}

fn failed<S: AsRef<OsStr>>(args: &[S], out: &Output) -> SessionError {
    SessionError::Git {
        args: joined(args),
        status: out.status.to_string(),
        stderr: text(&out.stderr),
    }
}

/// Lossy, trimmed text of git output.
pub(crate) fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).trim().to_string()
}

/// Splits NUL-terminated git output (`-z`) into paths.
pub(crate) fn nul_fields(bytes: &[u8]) -> impl Iterator<Item = &[u8]> {
    bytes.split(|b| *b == 0).filter(|f| !f.is_empty())
}

/// A path from git output, relative to the working tree.
pub(crate) fn os_path(bytes: &[u8]) -> PathBuf {
    use std::os::unix::ffi::OsStrExt;
    PathBuf::from(OsStr::from_bytes(bytes))
}

#[cfg(test)]
mod output_tests {
    use super::*;

    /// A child's output past the cap is read and dropped (the child never blocks on a full
    /// pipe) and reported as cut; within the cap it is kept whole (the control).
    #[test]
    fn test_drain_keeps_at_most_the_cap_and_never_blocks_the_child() {
        let run = |cap: usize| {
            let mut child = Command::new("head")
                .args(["-c", "1000000", "/dev/zero"])
                .stdout(Stdio::piped())
                .spawn()
                .expect("head");
            let out = drain(child.stdout.take(), cap);
            let status = child.wait().expect("wait");
            assert!(status.success());
            out.join().expect("drain")
        };
        let (kept, cut) = run(1000);
        assert_eq!((kept.len(), cut), (1000, true));
        let (kept, cut) = run(2_000_000);
        assert_eq!((kept.len(), cut), (1_000_000, false));
    }
}
