//! Interception rules: a matching request is answered by a host command instead of the
//! upstream server. The command gets the raw request on stdin and prints a raw HTTP response.
//! One run at a time per rule (a second request waits for the first: single flight), a
//! timeout that kills the whole process group (504), and credentials dropped to the rule's
//! uid/gid. The request and the response are never logged.

use std::process::Stdio;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::process::Command;

use crate::config::InterceptRule;
use crate::http1::simple_response;

/// Most bytes of command output forwarded to the guest.
pub const MAX_RESPONSE: usize = 1024 * 1024;

/// A rule and its single-flight lock (guards: one command of this rule runs at a time).
pub(crate) struct RuleState {
    pub(crate) rule: InterceptRule,
    pub(crate) lock: tokio::sync::Mutex<()>,
}

impl RuleState {
    pub(crate) fn matches(&self, host: &str, method: &str, path: &str) -> bool {
        self.rule.host.matches(host)
            && self.rule.method == method
            && path.starts_with(&self.rule.path_prefix)
    }

    /// Runs the command for one request and returns the bytes to send to the guest.
    pub(crate) async fn answer(
        &self,
        vm: &str,
        host: &str,
        method: &str,
        path: &str,
        request: Vec<u8>,
    ) -> Vec<u8> {
        let _flight = self.lock.lock().await;
        let r = &self.rule;
        let mut cmd = Command::new(&r.command[0]);
        cmd.args(&r.command[1..])
            .env_clear()
            .env(
                "PATH",
                "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            )
            .env("WARREN_INTERCEPT_HOST", host)
            .env("WARREN_INTERCEPT_METHOD", method)
            .env("WARREN_INTERCEPT_PATH", path)
            .env("WARREN_INTERCEPT_RULE_HOST", r.host.to_string())
            .env("WARREN_INTERCEPT_RULE_PATH_PREFIX", &r.path_prefix)
            .envs(r.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .kill_on_drop(true);
        crate::sys::process::drop_privileges(&mut cmd, r.uid, r.gid);
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                tracing::error!(vm, host, path, error = %e, "interception command failed to start");
                return simple_response(502, "Bad Gateway");
            }
        };
        let pgid = child.id();
        let mut stdin = child.stdin.take();
        let mut stdout = child.stdout.take();
        let run = async {
            if let Some(mut s) = stdin.take() {
                // A command that does not read its input must not block us.
                let _ = s.write_all(&request).await;
            }
            let mut out = Vec::new();
            if let Some(s) = stdout.as_mut() {
                (&mut *s)
                    .take(MAX_RESPONSE as u64)
                    .read_to_end(&mut out)
                    .await?;
            }
            let status = child.wait().await?;
            Ok::<_, std::io::Error>((status, out))
        };
        match tokio::time::timeout(r.timeout, run).await {
            Ok(Ok((status, out))) if status.success() && !out.is_empty() => {
                tracing::info!(vm, host, path, "request answered by interception command");
                out
            }
            Ok(Ok((status, _))) => {
                tracing::warn!(vm, host, path, %status, "interception command failed");
                simple_response(502, "Bad Gateway")
            }
            Ok(Err(e)) => {
                tracing::warn!(vm, host, path, error = %e, "interception command i/o failed");
                simple_response(502, "Bad Gateway")
            }
            Err(_) => {
                if let Some(pid) = pgid.and_then(|p| i32::try_from(p).ok()) {
                    let _ = nix::sys::signal::killpg(
                        nix::unistd::Pid::from_raw(pid),
                        nix::sys::signal::Signal::SIGKILL,
                    );
                }
                let _ = child.start_kill();
                let _ = child.wait().await;
                tracing::warn!(vm, host, path, timeout = ?r.timeout, "interception command timed out; killed");
                simple_response(504, "Gateway Timeout")
            }
        }
    }
}
