//! `warren intercept-refresh`: answers an agent's OAuth refresh request (raw HTTP on stdin,
//! from the egress's interception rule, running as the session owner) from the host's own
//! login file, with placeholders for both tokens and the host token's remaining lifetime.
//! Warren never uses a refresh token itself.
//!
//! When the host token has expired (or expires within [`EXPIRY_SLACK_SECS`]), the host's own
//! CLI is asked to refresh it, the way the user would: non-interactively (the configured
//! `[refresh]` command of [`crate::user_config`], else [`default_refresh`]), as the owner, with
//! a timeout ([`HOST_CLI_TIMEOUT`]), single-flight under an exclusive `flock` on the login
//! file's directory (a second refresh waits, then finds the file rotated and runs nothing);
//! then the rotated file is read again. `401 invalid_grant` remains only when the host CLI
//! could not refresh either, with the fix in its description. That failure is remembered
//! beside the login file for [`FAILURE_BACKOFF`]: requests meanwhile get it without the CLI
//! being run again (a guest may send refresh requests in a loop).
//!
//! Which login a request is for comes from the request itself: the refresh placeholder it
//! carries (each login has its own), so one endpoint serves every login that uses it.

use std::io::{Read, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::agents::Login;

/// An access token closer than this to its expiry is treated as expired.
pub const EXPIRY_SLACK_SECS: i64 = 60;
/// The host CLI is killed (its whole process group) after this long.
pub const HOST_CLI_TIMEOUT: Duration = Duration::from_secs(45);
/// Longest wait for another refresh of the same login to finish.
pub const LOCK_WAIT: Duration = Duration::from_secs(30);
/// After the host CLI was started for a login and did not refresh it, requests for it are
/// answered with that failure for this long without running the CLI again: a guest can send
/// refresh requests as often as it likes, and each would otherwise start the host's CLI as
/// the user.
pub const FAILURE_BACKOFF: Duration = Duration::from_secs(120);
/// The same after the CLI ran to success and the login is still expired (it renews another
/// login, or none: running it again will not renew this one, and each run may be a paid
/// model call).
pub const STILL_EXPIRED_BACKOFF: Duration = Duration::from_secs(3600);
/// Largest request read from the egress.
const MAX_REQUEST: u64 = 64 * 1024;

/// The host command that refreshes `agent`'s login without a prompt, when the user's
/// configuration names none: one short non-interactive run, which refreshes an expired
/// token before its first request and rotates the login file.
pub fn default_refresh(agent: &str) -> Vec<String> {
    let v: &[&str] = match agent {
        "claude" => &["claude", "-p", "Reply with OK", "--max-turns", "1"],
        "codex" => &["codex", "exec", "--skip-git-repo-check", "Reply with OK"],
        _ => &["opencode", "run", "Reply with OK"],
    };
    v.iter().map(|s| s.to_string()).collect()
}

/// `warren intercept-refresh --source LOGIN=FILE ...`.
pub fn intercept_refresh(sources: &[String]) -> Result<i32> {
    let mut logins = Vec::new();
    for s in sources {
        let (name, file) = s
            .split_once('=')
            .with_context(|| format!("--source {s:?}: expected LOGIN=FILE"))?;
        let login = Login::parse(name).with_context(|| format!("unknown login {name:?}"))?;
        logins.push((login, PathBuf::from(file)));
    }
    let mut request = Vec::new();
    std::io::stdin()
        .take(MAX_REQUEST)
        .read_to_end(&mut request)?;
    let (code, body) = match logins
        .iter()
        .find(|(l, _)| contains(&request, l.placeholders().1.as_bytes()))
    {
        Some((login, file)) => refresh(*login, file, &mut HostCli),
        None => (
            400,
            serde_json::json!({"error": "invalid_grant",
                "error_description": "the refresh token was not issued by Warren for this session"}),
        ),
    };
    let body = body.to_string();
    let reason = match code {
        200 => "OK",
        400 => "Bad Request",
        401 => "Unauthorized",
        503 => "Service Unavailable",
        _ => "Internal Server Error",
    };
    let mut out = std::io::stdout().lock();
    write!(
        out,
        "HTTP/1.1 {code} {reason}\r\ncontent-type: application/json\r\ncontent-length: {}\r\ncache-control: no-store\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )?;
    out.flush()?;
    Ok(0)
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    !needle.is_empty() && hay.windows(needle.len()).any(|w| w == needle)
}

fn now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

/// Runs the host CLI that refreshes a login (a trait so tests count the runs).
pub trait Refresher {
    /// Refreshes `login` (whose file is `file`); `Err` says why it could not, in words for
    /// the guest's error description (never output of the CLI, which may hold tokens).
    fn refresh(&mut self, login: Login, file: &Path) -> Result<(), String>;
}

/// The real one: the configured or default command, as this (the owner's) process.
struct HostCli;

impl Refresher for HostCli {
    fn refresh(&mut self, login: Login, file: &Path) -> Result<(), String> {
        let home = std::env::var_os("HOME")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("/"));
        // The guest reads this reason: the configuration's own error (which may quote it)
        // stays on the host.
        let cfg = crate::user_config::load(&home)
            .map_err(|_| "the host's Warren configuration could not be read".to_string())?;
        let argv = cfg
            .refresh
            .get(login.agent())
            .cloned()
            .unwrap_or_else(|| default_refresh(login.agent()));
        run_host_cli(&argv, &home, file)
    }
}

/// Runs `argv` (the program looked up on `PATH` unless it names a path) in `home` with no
/// input and its output discarded, in a process group of its own that is killed after
/// [`HOST_CLI_TIMEOUT`].
fn run_host_cli(argv: &[String], home: &Path, file: &Path) -> Result<(), String> {
    let mut cmd = Command::new(&argv[0]);
    // The guest reads the reasons below: the program's name, not where the host keeps it.
    let program = Path::new(&argv[0])
        .file_name()
        .map_or_else(|| "CLI".into(), |n| n.to_string_lossy().into_owned());
    cmd.args(&argv[1..])
        .current_dir(if home.is_dir() {
            home
        } else {
            file.parent().unwrap_or(Path::new("/"))
        })
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0);
    // The CLI dies with this process (the egress kills that when the VM stops or its rule's
    // timeout passes); what the CLI started in its group is killed when it ends here.
    warren_vmm::sys::process::die_with_parent(&mut cmd);
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("the host's {program} could not be started ({e})"))?;
    let deadline = Instant::now() + HOST_CLI_TIMEOUT;
    let pid = i32::try_from(child.id())
        .map(nix::unistd::Pid::from_raw)
        .map_err(|_| format!("the host's {program} has no process id"))?;
    // What the CLI left in its group goes with it. Sent while the CLI is a zombie not yet
    // reaped, so its id (the group's) cannot be another process's.
    let end_group = || {
        let _ = nix::sys::signal::killpg(pid, nix::sys::signal::Signal::SIGKILL);
    };
    use nix::sys::wait::{waitid, Id, WaitPidFlag};
    loop {
        let exited = waitid(
            Id::Pid(pid),
            WaitPidFlag::WEXITED | WaitPidFlag::WNOHANG | WaitPidFlag::WNOWAIT,
        );
        match exited {
            Ok(nix::sys::wait::WaitStatus::StillAlive) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(50));
            }
            Ok(nix::sys::wait::WaitStatus::StillAlive) | Err(_) => {
                end_group();
                let _ = child.wait();
                return Err(format!(
                    "the host's {program} did not finish within {}s",
                    HOST_CLI_TIMEOUT.as_secs()
                ));
            }
            Ok(_) => {
                end_group();
                return match child.wait() {
                    Ok(status) if status.success() => Ok(()),
                    Ok(status) => Err(format!("the host's {program} failed ({status})")),
                    Err(e) => Err(format!(
                        "the host's {program} could not be waited for ({e})"
                    )),
                };
            }
        }
    }
}

/// The token endpoint's answer for `login` from its host file: placeholders when the host
/// token is valid (after a host refresh if needed), else `401 invalid_grant` saying why.
pub fn refresh(login: Login, file: &Path, cli: &mut dyn Refresher) -> (u16, serde_json::Value) {
    if let Some(ok) = read(file).and_then(|d| answer(login, &d, now())) {
        return (200, ok);
    }
    let _lock = match lock_dir(file) {
        Ok(l) => l,
        Err(e) => {
            return (
                503,
                serde_json::json!({"error": "temporarily_unavailable",
                "error_description": format!(
                    "the host's {} login could not be locked for a refresh ({}); retry",
                    login.agent(),
                    e.root_cause()
                        .downcast_ref::<std::io::Error>()
                        .map_or("another refresh holds it".to_string(), |e| e
                            .kind()
                            .to_string())
                )}),
            )
        }
    };
    // Another refresh may have finished while this one waited.
    if let Some(ok) = read(file).and_then(|d| answer(login, &d, now())) {
        return (200, ok);
    }
    let record = failure_record(login, file);
    let why = match recent_failure(&record) {
        Some((why, age, backoff)) => {
            format!("{why} ({age}s ago; it is not run again until {backoff}s have passed)")
        }
        None => {
            // Recorded before the run: a run cut short (its VM stopped) counts too, and a
            // login whose record cannot be written is not refreshed at all.
            if let Err(e) = record_failure(
                &record,
                FAILURE_BACKOFF,
                "a refresh by the host's CLI was started and did not finish",
            ) {
                return (
                    503,
                    serde_json::json!({"error": "temporarily_unavailable",
                    "error_description": format!(
                        "the host's {} login has expired, and the refresh attempt could \
                         not be recorded beside it ({}), so it is not made",
                        login.agent(),
                        e.kind()
                    )}),
                );
            }
            let (why, backoff) = match cli.refresh(login, file) {
                Ok(()) => match read(file).and_then(|d| answer(login, &d, now())) {
                    Some(ok) => {
                        let _ = std::fs::remove_file(&record);
                        return (200, ok);
                    }
                    None => (
                        format!(
                            "the host's {} ran but its login is still expired",
                            login.agent()
                        ),
                        STILL_EXPIRED_BACKOFF,
                    ),
                },
                Err(why) => (why, FAILURE_BACKOFF),
            };
            let _ = record_failure(&record, backoff, &why);
            why
        }
    };
    (
        401,
        serde_json::json!({"error": "invalid_grant",
            "error_description": format!(
                "the host's {} login has expired and could not be refreshed: {why}; \
                 log in again on the host (run `{}` there), then retry",
                login.agent(), login.agent())}),
    )
}

/// Where a failed host refresh of `login` is remembered: beside its login file (the
/// owner's directory, whose lock serialises refreshes).
fn failure_record(login: Login, file: &Path) -> PathBuf {
    file.parent()
        .unwrap_or(Path::new("/"))
        .join(format!(".warren-refresh-failed.{}", login.name()))
}

/// The reason, age and backoff in seconds of a failure recorded less than its backoff ago
/// (`TIME BACKOFF` on the first line, the reason after it).
fn recent_failure(record: &Path) -> Option<(String, i64, i64)> {
    let mut bytes = Vec::new();
    std::fs::File::open(record)
        .ok()?
        .take(4096)
        .read_to_end(&mut bytes)
        .ok()?;
    let text = String::from_utf8_lossy(&bytes);
    let (head, why) = text.split_once('\n')?;
    let (at, backoff) = head.split_once(' ')?;
    let age = now() - at.parse::<i64>().ok()?;
    let backoff = backoff.parse::<i64>().ok()?;
    (0..backoff)
        .contains(&age)
        .then(|| (why.to_string(), age, backoff))
}

/// Remembers a refresh that did not renew the login for `backoff` (whole or not at all).
fn record_failure(record: &Path, backoff: Duration, why: &str) -> std::io::Result<()> {
    let dir = record.parent().unwrap_or(Path::new("/"));
    let mut tmp = tempfile::Builder::new()
        .prefix(".warren-refresh-failed.")
        .tempfile_in(dir)?;
    writeln!(tmp, "{} {}", now(), backoff.as_secs())?;
    tmp.write_all(why.as_bytes())?;
    tmp.persist(record).map_err(|e| e.error)?;
    Ok(())
}

fn read(file: &Path) -> Option<serde_json::Value> {
    let mut text = String::new();
    std::fs::File::open(file)
        .ok()?
        .take(MAX_REQUEST * 16)
        .read_to_string(&mut text)
        .ok()?;
    serde_json::from_str(&text).ok()
}

/// The token response for a host document whose access token is still valid at `now`.
fn answer(login: Login, doc: &serde_json::Value, now: i64) -> Option<serde_json::Value> {
    let (access, refresh) = login.placeholders();
    let remaining = login.expires_at(doc)? - now;
    if remaining <= EXPIRY_SLACK_SECS {
        return None;
    }
    let mut v = serde_json::json!({
        "access_token": access,
        "refresh_token": refresh,
        "expires_in": remaining,
        "token_type": "Bearer",
    });
    if let Some(scopes) = doc
        .pointer("/claudeAiOauth/scopes")
        .and_then(|s| s.as_array())
        .filter(|_| login == Login::Claude)
    {
        let joined: Vec<&str> = scopes.iter().filter_map(|s| s.as_str()).collect();
        v["scope"] = joined.join(" ").into();
    }
    if login == Login::Codex {
        if let Some(id) = doc.pointer("/tokens/id_token").and_then(|v| v.as_str()) {
            let mut parts = id.splitn(3, '.');
            if let (Some(h), Some(c)) = (parts.next(), parts.next()) {
                v["id_token"] = format!("{h}.{c}.warren-placeholder-signature").into();
            }
        }
    }
    Some(v)
}

/// An exclusive `flock` on the directory holding `file` (the login's host CLIs replace the
/// file by rename, so the directory is the stable object), waited for up to [`LOCK_WAIT`].
fn lock_dir(file: &Path) -> Result<nix::fcntl::Flock<std::fs::File>> {
    let dir = file.parent().unwrap_or(Path::new("/"));
    let deadline = Instant::now() + LOCK_WAIT;
    let mut f = std::fs::File::open(dir).with_context(|| format!("opening {}", dir.display()))?;
    loop {
        match nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockExclusiveNonblock) {
            Ok(l) => return Ok(l),
            Err((back, nix::errno::Errno::EWOULDBLOCK)) if Instant::now() < deadline => {
                f = back;
                std::thread::sleep(Duration::from_millis(50));
            }
            Err((_, e)) => bail!(
                "another refresh of the login in {} holds its lock ({e})",
                dir.display()
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agents::jwt_exp;

    fn claude_doc(expires_ms: i64) -> serde_json::Value {
        serde_json::json!({"claudeAiOauth": {
            "accessToken": "sk-ant-oat-REAL", "refreshToken": "sk-ant-ort-REAL",
            "expiresAt": expires_ms, "scopes": ["user:inference", "user:profile"]}})
    }

    /// Rotates the file to a token valid for an hour, or fails; counts its runs.
    struct Fake {
        runs: u32,
        works: bool,
    }

    impl Refresher for Fake {
        fn refresh(&mut self, _: Login, file: &Path) -> Result<(), String> {
            self.runs += 1;
            if !self.works {
                return Err("the host's claude failed (exit status: 1)".into());
            }
            std::fs::write(file, claude_doc((now() + 3600) * 1000).to_string())
                .map_err(|e| e.to_string())
        }
    }

    #[test]
    fn test_answer_placeholders_and_lifetime_or_none() {
        let v = answer(Login::Claude, &claude_doc(4_000_000), 1000).expect("valid");
        assert_eq!(v["access_token"], Login::Claude.placeholders().0);
        assert_eq!(v["refresh_token"], Login::Claude.placeholders().1);
        assert_eq!(v["expires_in"], 3000);
        assert_eq!(v["scope"], "user:inference user:profile");
        assert!(!v.to_string().contains("REAL"));
        assert!(answer(Login::Claude, &claude_doc(1_030_000), 1000).is_none());
        use base64::Engine;
        let claims = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(br#"{"exp":5000}"#);
        let doc = serde_json::json!({"tokens": {"access_token": format!("h.{claims}.s"),
            "id_token": "a.b.c", "refresh_token": "REAL"}});
        let v = answer(Login::Codex, &doc, 1000).expect("codex");
        assert_eq!(v["expires_in"], 4000);
        assert_eq!(v["id_token"], "a.b.warren-placeholder-signature");
        assert_eq!(jwt_exp(&format!("h.{claims}.s")), Some(5000));
    }

    #[test]
    fn test_refresh_runs_host_cli_only_when_expired_and_reports_failure() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join(".credentials.json");
        // Valid: answered from the file, the CLI not run.
        std::fs::write(&file, claude_doc((now() + 600) * 1000).to_string()).expect("w");
        let mut cli = Fake {
            runs: 0,
            works: true,
        };
        let (code, v) = refresh(Login::Claude, &file, &mut cli);
        assert_eq!((code, cli.runs), (200, 0), "{v}");
        // Expired: the CLI rotates it once; the answer carries the new lifetime.
        std::fs::write(&file, claude_doc(1000).to_string()).expect("w");
        let (code, v) = refresh(Login::Claude, &file, &mut cli);
        assert_eq!((code, cli.runs), (200, 1), "{v}");
        assert!(v["expires_in"].as_i64().expect("lifetime") > 3500, "{v}");
        // Expired and the CLI cannot refresh: invalid_grant naming the fix.
        std::fs::write(&file, claude_doc(1000).to_string()).expect("w");
        let mut broken = Fake {
            runs: 0,
            works: false,
        };
        let (code, v) = refresh(Login::Claude, &file, &mut broken);
        assert_eq!((code, broken.runs), (401, 1));
        assert_eq!(v["error"], "invalid_grant");
        let text = v["error_description"].as_str().expect("description");
        assert!(
            text.contains("exit status: 1") && text.contains("run `claude`"),
            "{text}"
        );
        // Asked again at once: the same failure, the CLI not run again (a guest's requests
        // do not start the host's CLI over and over).
        let (code, v) = refresh(Login::Claude, &file, &mut broken);
        assert_eq!((code, broken.runs), (401, 1));
        let text = v["error_description"].as_str().expect("description");
        assert!(
            text.contains("exit status: 1") && text.contains("not run again"),
            "{text}"
        );
        // A login made valid on the host meanwhile is answered at once, and once the
        // backoff has passed the CLI runs again (and its success clears the record).
        std::fs::write(&file, claude_doc((now() + 600) * 1000).to_string()).expect("w");
        assert_eq!(refresh(Login::Claude, &file, &mut broken).0, 200);
        std::fs::write(&file, claude_doc(1000).to_string()).expect("w");
        let record = failure_record(Login::Claude, &file);
        let old = now() - i64::try_from(FAILURE_BACKOFF.as_secs()).expect("secs") - 1;
        std::fs::write(&record, format!("{old} 120\nearlier")).expect("w");
        let (code, _) = refresh(Login::Claude, &file, &mut cli);
        assert_eq!((code, cli.runs), (200, 2));
        assert!(!record.exists());
    }

    /// A CLI that succeeds without renewing the login is not run again for an hour; a
    /// login whose attempt cannot be recorded is not refreshed at all (503, no run).
    #[test]
    fn test_refresh_backs_off_a_cli_that_renews_nothing_and_needs_its_record() {
        struct Stale(u32);
        impl Refresher for Stale {
            fn refresh(&mut self, _: Login, _: &Path) -> Result<(), String> {
                self.0 += 1;
                Ok(())
            }
        }
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join(".credentials.json");
        std::fs::write(&file, claude_doc(1000).to_string()).expect("w");
        let mut cli = Stale(0);
        assert_eq!(refresh(Login::Claude, &file, &mut cli).0, 401);
        let (code, v) = refresh(Login::Claude, &file, &mut cli);
        assert_eq!((code, cli.0), (401, 1), "{v}");
        let text = v["error_description"].as_str().expect("description");
        assert!(
            text.contains("still expired") && text.contains("3600s"),
            "{text}"
        );

        let record = failure_record(Login::Claude, &file);
        std::fs::remove_file(&record).expect("rm");
        std::fs::create_dir(&record).expect("a directory where the record goes");
        let (code, v) = refresh(Login::Claude, &file, &mut cli);
        assert_eq!((code, cli.0), (503, 1), "{v}");
    }

    #[test]
    fn test_host_cli_timeout_and_missing_program() {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = dir.path().join("x.json");
        let e = run_host_cli(&["/nonexistent/cli".into()], dir.path(), &f).expect_err("missing");
        assert!(e.contains("could not be started"), "{e}");
        let e = run_host_cli(&["/bin/false".into()], dir.path(), &f).expect_err("fails");
        assert!(e.contains("failed"), "{e}");
        run_host_cli(&["/bin/true".into()], dir.path(), &f).expect("succeeds");
        // What the CLI left running in its group ends with it.
        let pidfile = dir.path().join("bg.pid");
        let script = format!("sleep 1000 & echo $! > {}; exit 0", pidfile.display());
        run_host_cli(&["/bin/sh".into(), "-c".into(), script], dir.path(), &f).expect("ok");
        let bg = std::fs::read_to_string(&pidfile).expect("pid");
        let stat = format!("/proc/{}/stat", bg.trim());
        let gone = (0..100).any(|_| {
            let alive = std::fs::read_to_string(&stat)
                .is_ok_and(|st| st.rsplit(')').next().is_some_and(|r| !r.starts_with(" Z")));
            if alive {
                std::thread::sleep(Duration::from_millis(20));
            }
            !alive
        });
        assert!(gone, "the CLI's background process outlived it");
    }
}
