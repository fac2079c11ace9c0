//! Agents' own credentials for `warren run`: the host user's Claude Code and Codex
//! credential files stay on the host. The VM gets
//! - file-backed secrets that point into those files (a JSON pointer, re-read on every new
//!   connection, so a refresh on the host takes effect at once),
//! - placeholder credential files in the project's agent state directory (same shape, tokens
//!   replaced by placeholders),
//! - the provider hosts in its allow list, and
//! - interception rules for the OAuth refresh endpoints, answered on the host by
//!   `warren intercept-refresh` (running as the session owner) with placeholders, so the
//!   agent's refresh never needs a real refresh token.

use std::io::{Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use nix::fcntl::{openat, renameat, AtFlags, OFlag};
use nix::sys::stat::{mkdirat, Mode};
use warren_core::NetworkRequest;
use warren_vmm::{NetIntercept, NetSecret};

/// Intercept commands are killed after this long.
const REFRESH_TIMEOUT_MS: u64 = 30_000;
/// An access token closer than this to its expiry is treated as expired.
const EXPIRY_SLACK_SECS: i64 = 60;

/// An agent whose credentials Warren can wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Provider {
    Claude,
    Codex,
}

impl Provider {
    pub fn parse(s: &str) -> Option<Provider> {
        match s {
            "claude" => Some(Provider::Claude),
            "codex" => Some(Provider::Codex),
            _ => None,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Provider::Claude => "claude",
            Provider::Codex => "codex",
        }
    }

    /// Placeholders the guest sees instead of the access and refresh tokens.
    fn placeholders(self) -> (&'static str, &'static str) {
        match self {
            Provider::Claude => (
                "warren-placeholder-anthropic-access-v1",
                "warren-placeholder-anthropic-refresh-v1",
            ),
            Provider::Codex => (
                "warren-placeholder-openai-access-v1",
                "warren-placeholder-openai-refresh-v1",
            ),
        }
    }

    /// Hosts the agent needs: its API and its OAuth token endpoint.
    fn hosts(self) -> &'static [&'static str] {
        match self {
            Provider::Claude => &[
                "api.anthropic.com",
                "platform.claude.com",
                "console.anthropic.com",
                "claude.ai",
            ],
            Provider::Codex => &["api.openai.com", "chatgpt.com", "auth.openai.com"],
        }
    }

    /// Hosts the access token may be sent to.
    fn token_hosts(self) -> &'static [&'static str] {
        match self {
            Provider::Claude => &["api.anthropic.com"],
            Provider::Codex => &["api.openai.com", "chatgpt.com"],
        }
    }

    /// The OAuth refresh endpoints (host, path) answered on the host.
    fn refresh_endpoints(self) -> &'static [(&'static str, &'static str)] {
        match self {
            Provider::Claude => &[
                ("platform.claude.com", "/v1/oauth/token"),
                ("console.anthropic.com", "/v1/oauth/token"),
            ],
            Provider::Codex => &[("auth.openai.com", "/oauth/token")],
        }
    }

    /// JSON pointer of the access token in the host file.
    fn access_pointer(self) -> &'static str {
        match self {
            Provider::Claude => "/claudeAiOauth/accessToken",
            Provider::Codex => "/tokens/access_token",
        }
    }

    /// The host credential file, relative to the owner's home (or the agent's own
    /// configuration variable).
    pub fn host_file(self, home: &Path) -> PathBuf {
        match self {
            Provider::Claude => std::env::var_os("CLAUDE_CONFIG_DIR")
                .map(PathBuf::from)
                .unwrap_or_else(|| home.join(".claude"))
                .join(".credentials.json"),
            Provider::Codex => std::env::var_os("CODEX_HOME")
                .map(PathBuf::from)
                .unwrap_or_else(|| home.join(".codex"))
                .join("auth.json"),
        }
    }

    /// Where the agent looks for its credentials, under the agent state directory (see
    /// `agent_env`: `CLAUDE_CONFIG_DIR` and `CODEX_HOME` point there).
    fn guest_file(self) -> (&'static str, &'static str) {
        match self {
            Provider::Claude => ("claude", ".credentials.json"),
            Provider::Codex => ("codex", "auth.json"),
        }
    }
}

/// Replaces the tokens of a host credential document with placeholders; everything else
/// (expiry, scopes, account) is kept so the agent sees a plausible file.
fn placeholder_document(p: Provider, doc: &serde_json::Value) -> Result<serde_json::Value> {
    let (access, refresh) = p.placeholders();
    let mut doc = doc.clone();
    match p {
        Provider::Claude => {
            let o = doc
                .pointer_mut("/claudeAiOauth")
                .and_then(|v| v.as_object_mut())
                .context("no claudeAiOauth object")?;
            if !o.get("accessToken").is_some_and(|v| v.is_string()) {
                bail!("no claudeAiOauth.accessToken");
            }
            o.insert("accessToken".into(), access.into());
            o.insert("refreshToken".into(), refresh.into());
        }
        Provider::Codex => {
            let o = doc
                .pointer_mut("/tokens")
                .and_then(|v| v.as_object_mut())
                .context("no tokens object")?;
            if !o.get("access_token").is_some_and(|v| v.is_string()) {
                bail!("no tokens.access_token");
            }
            o.insert("access_token".into(), access.into());
            o.insert("refresh_token".into(), refresh.into());
            // The id token is a JWT the agent decodes for account details: keep its claims,
            // drop its signature (it is never sent anywhere that checks it).
            if let Some(id) = o.get("id_token").and_then(|v| v.as_str()) {
                o.insert("id_token".into(), unsigned_jwt(id).into());
            }
            if let Some(root) = doc.as_object_mut() {
                if root.get("OPENAI_API_KEY").is_some_and(|v| v.is_string()) {
                    root.insert("OPENAI_API_KEY".into(), access.into());
                }
            }
        }
    }
    Ok(doc)
}

fn unsigned_jwt(jwt: &str) -> String {
    let mut parts = jwt.splitn(3, '.');
    match (parts.next(), parts.next()) {
        (Some(h), Some(c)) => format!("{h}.{c}.warren-placeholder-signature"),
        _ => "warren-placeholder-id-token".into(),
    }
}

/// What wiring `providers` adds to a session: network settings and placeholder files.
pub struct Wiring {
    pub network: NetworkRequest,
    /// (provider, placeholder document) to write into the agent state directory.
    pub files: Vec<(Provider, serde_json::Value)>,
}

/// Wires the host user's credentials of `providers`. A provider whose host file is missing
/// is skipped with a warning (the agent can still log in inside the VM).
pub fn wire(
    providers: &[Provider],
    home: &Path,
    owner: (u32, u32),
    mounted: &[PathBuf],
    warn: &mut dyn FnMut(&str),
) -> Result<Wiring> {
    let exe = std::env::current_exe().context("locating the warren binary")?;
    let mut w = Wiring {
        network: NetworkRequest::default(),
        files: Vec::new(),
    };
    for &p in providers {
        for h in p.hosts() {
            w.network.allow.push((*h).to_string());
        }
        let file = p.host_file(home);
        if !file.exists() {
            warn(&format!(
                "no {} credentials at {}: log in inside the VM, or on the host and run again",
                p.name(),
                file.display()
            ));
            continue;
        }
        let file = file
            .canonicalize()
            .with_context(|| format!("resolving {}", file.display()))?;
        if let Some(m) = mounted.iter().find(|m| file.starts_with(m)) {
            bail!(
                "{} is inside {}, which is mounted into the VM: the real tokens would be visible there",
                file.display(),
                m.display()
            );
        }
        let text = std::fs::read_to_string(&file)
            .with_context(|| format!("reading {}", file.display()))?;
        let doc: serde_json::Value = serde_json::from_str(&text)
            .with_context(|| format!("{} is not JSON", file.display()))?;
        let shaped = placeholder_document(p, &doc)
            .with_context(|| format!("{}: unexpected shape", file.display()))?;
        let (access, _) = p.placeholders();
        w.network.secrets.push(NetSecret {
            name: format!("{}-access-token", p.name()),
            placeholder: access.to_string(),
            hosts: p.token_hosts().iter().map(|h| h.to_string()).collect(),
            file: file.clone(),
            json_pointer: Some(p.access_pointer().to_string()),
        });
        if p == Provider::Codex && doc.get("OPENAI_API_KEY").is_some_and(|v| v.is_string()) {
            // The API key takes the access placeholder's place when the agent uses a key.
            w.network.secrets.push(NetSecret {
                name: "codex-api-key".into(),
                placeholder: "warren-placeholder-openai-api-key-v1".into(),
                hosts: vec!["api.openai.com".into()],
                file: file.clone(),
                json_pointer: Some("/OPENAI_API_KEY".into()),
            });
        }
        for (host, path) in p.refresh_endpoints() {
            w.network.intercepts.push(NetIntercept {
                host: (*host).to_string(),
                method: "POST".into(),
                path_prefix: (*path).to_string(),
                command: vec![
                    exe.to_string_lossy().into_owned(),
                    "intercept-refresh".into(),
                    "--agent".into(),
                    p.name().into(),
                    "--credentials".into(),
                    file.to_string_lossy().into_owned(),
                ],
                uid: owner.0,
                gid: owner.1,
                timeout_ms: REFRESH_TIMEOUT_MS,
                env: vec![],
            });
        }
        w.files.push((p, shaped));
    }
    Ok(w)
}

/// Writes the placeholder files into the host agent state directory `state` (mounted in the
/// guest, so the guest may have planted symlinks: every step is relative to directory file
/// descriptors, refuses symlinks, and replaces the file by rename).
pub fn write_files(
    state: &Path,
    files: &[(Provider, serde_json::Value)],
    owner: (u32, u32),
) -> Result<()> {
    let root: OwnedFd = nix::fcntl::open(
        state,
        OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .with_context(|| format!("opening {}", state.display()))?;
    for (p, doc) in files {
        let (dir, name) = p.guest_file();
        match mkdirat(root.as_fd(), dir, Mode::from_bits_truncate(0o700)) {
            Ok(()) => nix::unistd::fchownat(
                root.as_fd(),
                dir,
                Some(owner.0.into()),
                Some(owner.1.into()),
                AtFlags::AT_SYMLINK_NOFOLLOW,
            )
            .with_context(|| format!("chown {dir}"))?,
            Err(nix::errno::Errno::EEXIST) => {}
            Err(e) => return Err(e).with_context(|| format!("mkdir {dir}")),
        }
        let d: OwnedFd = openat(
            root.as_fd(),
            dir,
            OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .with_context(|| format!("{dir} in the agent state directory is not a directory"))?;
        let tmp = format!(".{name}.warren-{}", std::process::id());
        let f: OwnedFd = openat(
            d.as_fd(),
            tmp.as_str(),
            OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_WRONLY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::from_bits_truncate(0o600),
        )
        .with_context(|| format!("creating {dir}/{tmp}"))?;
        nix::unistd::fchown(f.as_fd(), Some(owner.0.into()), Some(owner.1.into()))
            .context("chown placeholder file")?;
        let mut file = std::fs::File::from(f);
        let mut body = serde_json::to_vec_pretty(doc)?;
        body.push(b'\n');
        file.write_all(&body)?;
        file.sync_all()?;
        renameat(d.as_fd(), tmp.as_str(), d.as_fd(), name)
            .with_context(|| format!("renaming into {dir}/{name}"))?;
    }
    Ok(())
}

/// `warren intercept-refresh`: answers an agent's OAuth refresh request (raw HTTP on stdin)
/// from the host credential file, with placeholders for both tokens and the host token's
/// remaining lifetime. A host token that has expired is refused (401 `invalid_grant`): the
/// host's own agent refreshes it, and the next request picks up the new token.
pub fn intercept_refresh(agent: &str, credentials: &Path) -> Result<i32> {
    let p = Provider::parse(agent).with_context(|| format!("unknown agent {agent:?}"))?;
    // The request itself carries nothing Warren needs (its refresh token is a placeholder);
    // read it so the proxy's write completes.
    let mut request = Vec::new();
    std::io::stdin().take(64 * 1024).read_to_end(&mut request)?;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    let response = match std::fs::read_to_string(credentials)
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
    {
        Some(doc) => refresh_response(p, &doc, now),
        None => (
            500,
            serde_json::json!({"error": "server_error",
                "error_description": "the host credential file cannot be read"}),
        ),
    };
    let body = response.1.to_string();
    let reason = match response.0 {
        200 => "OK",
        401 => "Unauthorized",
        _ => "Internal Server Error",
    };
    let mut out = std::io::stdout().lock();
    write!(
        out,
        "HTTP/1.1 {} {reason}\r\ncontent-type: application/json\r\ncontent-length: {}\r\ncache-control: no-store\r\nconnection: close\r\n\r\n{body}",
        response.0,
        body.len()
    )?;
    out.flush()?;
    Ok(0)
}

/// The token endpoint's answer for the host document `doc` at `now` (seconds).
fn refresh_response(p: Provider, doc: &serde_json::Value, now: i64) -> (u16, serde_json::Value) {
    let (access, refresh) = p.placeholders();
    let expires_at = match p {
        // Milliseconds since the epoch.
        Provider::Claude => doc
            .pointer("/claudeAiOauth/expiresAt")
            .and_then(|v| v.as_i64())
            .map(|ms| ms / 1000),
        // The access token's own `exp` claim.
        Provider::Codex => doc
            .pointer("/tokens/access_token")
            .and_then(|v| v.as_str())
            .and_then(jwt_exp),
    };
    let remaining = expires_at.map(|e| e - now);
    match remaining {
        Some(r) if r > EXPIRY_SLACK_SECS => {
            let mut v = serde_json::json!({
                "access_token": access,
                "refresh_token": refresh,
                "expires_in": r,
                "token_type": "Bearer",
            });
            if let Some(scopes) = doc
                .pointer("/claudeAiOauth/scopes")
                .and_then(|s| s.as_array())
            {
                let joined: Vec<&str> = scopes.iter().filter_map(|s| s.as_str()).collect();
                v["scope"] = joined.join(" ").into();
            }
            if p == Provider::Codex {
                if let Some(id) = doc.pointer("/tokens/id_token").and_then(|v| v.as_str()) {
                    v["id_token"] = unsigned_jwt(id).into();
                }
            }
            (200, v)
        }
        _ => (
            401,
            serde_json::json!({"error": "invalid_grant",
                "error_description": format!(
                    "the host's {} credentials have expired: run {} on the host to refresh them, then retry",
                    p.name(), p.name())}),
        ),
    }
}

/// The `exp` claim of a JWT (not verified: only used to report a lifetime).
fn jwt_exp(jwt: &str) -> Option<i64> {
    use base64::Engine;
    let claims = jwt.split('.').nth(1)?;
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(claims.trim_end_matches('='))
        .ok()?;
    serde_json::from_slice::<serde_json::Value>(&bytes)
        .ok()?
        .get("exp")?
        .as_i64()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claude_doc(expires_ms: i64) -> serde_json::Value {
        serde_json::json!({"claudeAiOauth": {
            "accessToken": "sk-ant-oat-REAL", "refreshToken": "sk-ant-ort-REAL",
            "expiresAt": expires_ms, "scopes": ["user:inference", "user:profile"],
            "subscriptionType": "max"}})
    }

    #[test]
    fn test_placeholder_documents_keep_shape_and_drop_tokens() {
        let d = placeholder_document(Provider::Claude, &claude_doc(1)).expect("claude");
        let s = d.to_string();
        assert!(!s.contains("REAL"), "{s}");
        assert_eq!(d["claudeAiOauth"]["subscriptionType"], "max");
        assert_eq!(d["claudeAiOauth"]["expiresAt"], 1);
        let codex = serde_json::json!({"OPENAI_API_KEY": null, "tokens": {
            "id_token": "aGVhZA.eyJlbWFpbCI6ImEifQ.SIGNATURE", "access_token": "REAL-A",
            "refresh_token": "REAL-R", "account_id": "acct"}, "last_refresh": "x"});
        let d = placeholder_document(Provider::Codex, &codex).expect("codex");
        let s = d.to_string();
        assert!(!s.contains("REAL") && !s.contains("SIGNATURE"), "{s}");
        assert_eq!(d["tokens"]["account_id"], "acct");
        assert!(d["tokens"]["id_token"]
            .as_str()
            .expect("id")
            .starts_with("aGVhZA.eyJlbWFpbCI6ImEifQ."));
        assert!(placeholder_document(Provider::Claude, &serde_json::json!({})).is_err());
    }

    #[test]
    fn test_refresh_response_placeholders_or_invalid_grant() {
        let (code, v) = refresh_response(Provider::Claude, &claude_doc(4_000_000), 1000);
        assert_eq!(code, 200);
        assert_eq!(v["access_token"], Provider::Claude.placeholders().0);
        assert_eq!(v["refresh_token"], Provider::Claude.placeholders().1);
        assert_eq!(v["expires_in"], 3000);
        assert_eq!(v["scope"], "user:inference user:profile");
        assert!(!v.to_string().contains("REAL"));
        let (code, v) = refresh_response(Provider::Claude, &claude_doc(1_030_000), 1000);
        assert_eq!(code, 401, "within the slack: {v}");
        assert_eq!(v["error"], "invalid_grant");
        // Codex: the lifetime comes from the access token's exp claim.
        use base64::Engine;
        let claims = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(br#"{"exp":5000}"#);
        let doc = serde_json::json!({"tokens": {"access_token": format!("h.{claims}.s"),
            "id_token": "a.b.c", "refresh_token": "REAL"}});
        let (code, v) = refresh_response(Provider::Codex, &doc, 1000);
        assert_eq!(code, 200);
        assert_eq!(v["expires_in"], 4000);
        assert_eq!(v["id_token"], "a.b.warren-placeholder-signature");
    }

    #[test]
    fn test_write_files_refuses_symlinked_directory() {
        let dir = tempfile::tempdir().expect("tempdir");
        let outside = tempfile::tempdir().expect("tempdir");
        std::os::unix::fs::symlink(outside.path(), dir.path().join("claude")).expect("symlink");
        let me = (
            nix::unistd::getuid().as_raw(),
            nix::unistd::getgid().as_raw(),
        );
        let doc = placeholder_document(Provider::Claude, &claude_doc(1)).expect("doc");
        assert!(write_files(dir.path(), &[(Provider::Claude, doc.clone())], me).is_err());
        assert!(std::fs::read_dir(outside.path())
            .expect("ls")
            .next()
            .is_none());
        // A planted symlink at the file name is replaced, not followed.
        std::fs::remove_file(dir.path().join("claude")).expect("rm");
        std::fs::create_dir(dir.path().join("claude")).expect("mkdir");
        let target = outside.path().join("victim");
        std::fs::write(&target, "keep").expect("victim");
        std::os::unix::fs::symlink(&target, dir.path().join("claude/.credentials.json"))
            .expect("symlink");
        write_files(dir.path(), &[(Provider::Claude, doc)], me).expect("write");
        assert_eq!(std::fs::read_to_string(&target).expect("victim"), "keep");
        let written =
            std::fs::read_to_string(dir.path().join("claude/.credentials.json")).expect("read");
        assert!(written.contains("warren-placeholder-anthropic-access-v1"));
    }
}
