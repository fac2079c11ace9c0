//! Interception rules: a matching request is answered by a host command instead of the
//! upstream server. The command gets the request (its head re-serialised with the target in
//! origin-form, the body as received) on stdin and prints a raw HTTP response. Rules match
//! the target as forwarded; other spellings of a rule's path are refused ([`find_rule`]).
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

/// Headers through which some frameworks let a request claim another method.
pub(crate) const METHOD_OVERRIDES: [&str; 3] = [
    "x-http-method-override",
    "x-http-method",
    "x-method-override",
];

/// What the rules make of a request.
pub(crate) enum Matched<'a> {
    /// Answered by this rule.
    Rule(&'a RuleState),
    /// No rule matches the request as written, but a lenient server could route it to a
    /// rule's path (another spelling of the path, of the method, or a method override):
    /// refused, so no request a rule exists for reaches the upstream in disguise.
    Ambiguous,
    /// Not a rule's request: forwarded.
    None,
}

/// Matches a request against the rules. `target` is in origin-form
/// ([`crate::request::origin_form`]), so an absolute-form target matches like its path.
/// A rule matches its host, its method exactly, and a target starting with its
/// `path_prefix` as written; the request is forwarded in that same form. A request that does
/// not match, but whose [`crate::request::lenient_path`] starts with a rule's (lenient)
/// prefix on that rule's host, with the rule's method in any case or a method-override
/// header, is [`Matched::Ambiguous`].
pub(crate) fn find_rule<'a>(
    rules: &'a [RuleState],
    host: &str,
    method: &str,
    target: &str,
    headers: &[(String, Vec<u8>)],
) -> Matched<'a> {
    if let Some(rule) = rules.iter().find(|r| r.matches(host, method, target)) {
        return Matched::Rule(rule);
    }
    let overridden = headers
        .iter()
        .any(|(n, _)| METHOD_OVERRIDES.iter().any(|o| n.eq_ignore_ascii_case(o)))
        || form_override(method, target, headers);
    let lenient = crate::request::lenient_path(target);
    let near = |r: &&RuleState| {
        r.rule.host.matches(host)
            && (overridden || same_route_method(&r.rule.method, method))
            && lenient.starts_with(&crate::request::lenient_path(&r.rule.path_prefix))
    };
    if rules.iter().any(|r| near(&r)) {
        Matched::Ambiguous
    } else {
        Matched::None
    }
}

/// Whether a server could run `rule_method`'s handler for a request with `method`: the same
/// method in any case, or `HEAD` for a `GET` rule (most frameworks answer `HEAD` with the
/// `GET` handler).
fn same_route_method(rule_method: &str, method: &str) -> bool {
    rule_method.eq_ignore_ascii_case(method)
        || (rule_method.eq_ignore_ascii_case("GET") && method.eq_ignore_ascii_case("HEAD"))
}

/// Whether a POST may claim another method the way Rack, Laravel and Symfony read it: a
/// `_method` query parameter, or a form body (which may hold a `_method` field; the body is
/// not read before the rules are matched).
fn form_override(method: &str, target: &str, headers: &[(String, Vec<u8>)]) -> bool {
    if !method.eq_ignore_ascii_case("POST") {
        return false;
    }
    let query = target.split_once('?').map_or("", |(_, q)| q);
    let query = crate::request::decode_repeatedly(query).to_ascii_lowercase();
    let form = headers.iter().any(|(n, v)| {
        let v = String::from_utf8_lossy(v).trim().to_ascii_lowercase();
        n.eq_ignore_ascii_case("content-type")
            && (v.starts_with("application/x-www-form-urlencoded")
                || v.starts_with("multipart/form-data"))
    });
    form || query.contains("_method")
}

impl RuleState {
    fn matches(&self, host: &str, method: &str, target: &str) -> bool {
        self.rule.host.matches(host)
            && self.rule.method == method
            && target.starts_with(&self.rule.path_prefix)
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

#[cfg(test)]
mod tests {
    use super::*;

    fn rules() -> Vec<RuleState> {
        vec![RuleState {
            rule: InterceptRule {
                host: "oauth.example".parse().expect("pattern"),
                method: "POST".into(),
                path_prefix: "/v1/oauth/token".into(),
                command: vec!["/bin/true".into()],
                uid: 65534,
                gid: 65534,
                timeout: std::time::Duration::from_secs(1),
                env: vec![],
            },
            lock: tokio::sync::Mutex::new(()),
        }]
    }

    fn find(method: &str, target: &str, headers: &[(&str, &str)]) -> &'static str {
        let headers: Vec<(String, Vec<u8>)> = headers
            .iter()
            .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
            .collect();
        match find_rule(&rules(), "oauth.example", method, target, &headers) {
            Matched::Rule(_) => "rule",
            Matched::Ambiguous => "ambiguous",
            Matched::None => "none",
        }
    }

    /// Methods a server routes to a rule's handler without naming it: `HEAD` for a `GET`
    /// rule, a `POST` with a `_method` parameter or a form body for any rule. (Before, both
    /// were forwarded.)
    #[test]
    fn test_methods_routed_to_a_rule_elsewhere_are_ambiguous() {
        let rule = |method: &str, path: &str| RuleState {
            rule: InterceptRule {
                method: method.into(),
                path_prefix: path.into(),
                ..rules().remove(0).rule
            },
            lock: tokio::sync::Mutex::new(()),
        };
        let rules = vec![rule("GET", "/v1/token"), rule("PUT", "/v1/secret")];
        let find = |method: &str, target: &str, content_type: &str| {
            let headers = vec![("Content-Type".to_string(), content_type.as_bytes().to_vec())];
            match find_rule(&rules, "oauth.example", method, target, &headers) {
                Matched::Rule(_) => "rule",
                Matched::Ambiguous => "ambiguous",
                Matched::None => "none",
            }
        };
        let json = "application/json";
        assert_eq!(find("GET", "/v1/token", json), "rule");
        assert_eq!(find("HEAD", "/v1/token", json), "ambiguous");
        assert_eq!(find("POST", "/v1/secret?_method=PUT", json), "ambiguous");
        assert_eq!(find("POST", "/v1/secret?%5Fmethod=put", json), "ambiguous");
        assert_eq!(
            find("POST", "/v1/secret", "application/x-www-form-urlencoded"),
            "ambiguous"
        );
        assert_eq!(find("PUT", "/v1/secret", json), "rule");
        // Controls.
        assert_eq!(find("POST", "/v1/secret", json), "none");
        assert_eq!(find("HEAD", "/v1/other", json), "none");
        assert_eq!(find("DELETE", "/v1/token", json), "none");
        assert_eq!(find("GET", "/v1/secret", json), "none");
    }

    #[test]
    fn test_rule_matching_refuses_other_spellings_of_a_rule_path() {
        assert_eq!(find("POST", "/v1/oauth/token", &[]), "rule");
        assert_eq!(find("POST", "/v1/oauth/token?grant=x", &[]), "rule");
        for target in [
            "/v1/oauth/./token",
            "//v1/oauth/token",
            "/v1//oauth/token",
            "/v1/oauth%2Ftoken",
            "/v1/%6fauth/token",
            "/v1/x/../oauth/token",
            "/V1/OAuth/Token",
            "/v1;x/oauth/token",
            "/v1\\oauth\\token",
        ] {
            assert_eq!(find("POST", target, &[]), "ambiguous", "{target}");
        }
        assert_eq!(find("post", "/v1/oauth/token", &[]), "ambiguous");
        assert_eq!(
            find(
                "GET",
                "/v1/oauth/token",
                &[("X-HTTP-Method-Override", "POST")]
            ),
            "ambiguous"
        );
        // A non-ASCII letter that Unicode case-insensitive routers (Java's
        // equalsIgnoreCase) take for an ASCII one: the Kelvin sign for `k`.
        assert_eq!(find("POST", "/v1/oauth/to%E2%84%AAen", &[]), "ambiguous");
        assert_eq!(find("POST", "/V1/OAUTH/TO%E2%84%AAEN", &[]), "ambiguous");
        // Controls: other paths, another method, another host are not the rule's.
        assert_eq!(find("POST", "/v1/messages", &[]), "none");
        assert_eq!(find("POST", "/v1/oauth/other", &[]), "none");
        assert_eq!(find("GET", "/v1/oauth/token", &[]), "none");
        let headers: Vec<(String, Vec<u8>)> = vec![];
        assert!(matches!(
            find_rule(
                &rules(),
                "api.example",
                "POST",
                "/v1/oauth/./token",
                &headers
            ),
            Matched::None
        ));
    }
}
