//! Agents' own credentials for `warren run`: the host user's Claude Code, Codex and opencode
//! login files stay on the host. The VM gets
//! - file-backed secrets that point into those files (a JSON pointer, re-read on every new
//!   connection, so a refresh on the host takes effect at once),
//! - placeholder credential files in the project's agent state directory (same shape, tokens
//!   and keys replaced by placeholders; logins Warren cannot wire are left out),
//! - the provider hosts in its allow list, and
//! - interception rules for the OAuth refresh endpoints, answered on the host by
//!   `warren intercept-refresh` (running as the session owner, `crate::refresh`) with
//!   placeholders, so the agent's refresh never needs a real refresh token.

use std::collections::BTreeMap;
use std::io::Write;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use nix::fcntl::{openat, renameat, AtFlags, OFlag};
use nix::sys::stat::{mkdirat, Mode};
use warren_core::NetworkRequest;
use warren_vmm::{NetIntercept, NetSecret};

/// Intercept commands are killed after this long: a host CLI's refresh
/// ([`crate::refresh::HOST_CLI_TIMEOUT`]) after waiting for another one's lock
/// ([`crate::refresh::LOCK_WAIT`]) fits.
const REFRESH_TIMEOUT_MS: u64 = 90_000;

/// Variables of the caller's environment passed to the refresh command, so it finds the
/// same files and host CLI as the caller (never credentials: names only of directories and
/// the search path).
const REFRESH_ENV: &[&str] = &[
    "HOME",
    "PATH",
    "WARREN_CONFIG",
    "XDG_CONFIG_HOME",
    "XDG_DATA_HOME",
    "CLAUDE_CONFIG_DIR",
    "CODEX_HOME",
];

/// An agent whose login file Warren can wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Provider {
    Claude,
    Codex,
    Opencode,
}

/// One OAuth login inside a host file: its tokens, lifetime, hosts and refresh endpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Login {
    /// Claude Code's `claudeAiOauth`.
    Claude,
    /// Codex's ChatGPT login (`tokens`).
    Codex,
    /// opencode's Anthropic OAuth login (`anthropic`, `type = "oauth"`).
    OpencodeAnthropic,
    /// opencode's OpenAI (ChatGPT) OAuth login (`openai`, `type = "oauth"`).
    OpencodeOpenai,
}

impl Login {
    pub const ALL: [Login; 4] = [
        Login::Claude,
        Login::Codex,
        Login::OpencodeAnthropic,
        Login::OpencodeOpenai,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Login::Claude => "claude",
            Login::Codex => "codex",
            Login::OpencodeAnthropic => "opencode-anthropic",
            Login::OpencodeOpenai => "opencode-openai",
        }
    }

    pub fn parse(s: &str) -> Option<Login> {
        Login::ALL.into_iter().find(|l| l.name() == s)
    }

    /// The host CLI that owns (and refreshes) this login.
    pub fn agent(self) -> &'static str {
        match self {
            Login::Claude => "claude",
            Login::Codex => "codex",
            Login::OpencodeAnthropic | Login::OpencodeOpenai => "opencode",
        }
    }

    /// Placeholders the guest sees instead of the access and refresh tokens.
    pub fn placeholders(self) -> (&'static str, &'static str) {
        match self {
            Login::Claude => (
                "warren-placeholder-anthropic-access-v1",
                "warren-placeholder-anthropic-refresh-v1",
            ),
            Login::Codex => (
                "warren-placeholder-openai-access-v1",
                "warren-placeholder-openai-refresh-v1",
            ),
            Login::OpencodeAnthropic => (
                "warren-placeholder-opencode-anthropic-access-v1",
                "warren-placeholder-opencode-anthropic-refresh-v1",
            ),
            Login::OpencodeOpenai => (
                "warren-placeholder-opencode-openai-access-v1",
                "warren-placeholder-opencode-openai-refresh-v1",
            ),
        }
    }

    /// Hosts the access token may be sent to.
    fn token_hosts(self) -> &'static [&'static str] {
        match self {
            Login::Claude | Login::OpencodeAnthropic => &["api.anthropic.com"],
            Login::Codex | Login::OpencodeOpenai => &["api.openai.com", "chatgpt.com"],
        }
    }

    /// The OAuth refresh endpoints (host, path) answered on the host.
    fn refresh_endpoints(self) -> &'static [(&'static str, &'static str)] {
        match self {
            Login::Claude | Login::OpencodeAnthropic => &[
                ("platform.claude.com", "/v1/oauth/token"),
                ("console.anthropic.com", "/v1/oauth/token"),
            ],
            Login::Codex | Login::OpencodeOpenai => &[("auth.openai.com", "/oauth/token")],
        }
    }

    /// JSON pointers of the access and refresh tokens in the host file.
    pub fn pointers(self) -> (&'static str, &'static str) {
        match self {
            Login::Claude => ("/claudeAiOauth/accessToken", "/claudeAiOauth/refreshToken"),
            Login::Codex => ("/tokens/access_token", "/tokens/refresh_token"),
            Login::OpencodeAnthropic => ("/anthropic/access", "/anthropic/refresh"),
            Login::OpencodeOpenai => ("/openai/access", "/openai/refresh"),
        }
    }

    /// When the host's access token expires (seconds since the epoch), from the host file.
    pub fn expires_at(self, doc: &serde_json::Value) -> Option<i64> {
        let ms = |p: &str| doc.pointer(p).and_then(|v| v.as_i64()).map(|ms| ms / 1000);
        match self {
            // Milliseconds since the epoch.
            Login::Claude => ms("/claudeAiOauth/expiresAt"),
            Login::OpencodeAnthropic => ms("/anthropic/expires"),
            Login::OpencodeOpenai => ms("/openai/expires"),
            // The access token's own `exp` claim.
            Login::Codex => doc
                .pointer("/tokens/access_token")
                .and_then(|v| v.as_str())
                .and_then(jwt_exp),
        }
    }
}

/// An API key inside a login file (Codex's `OPENAI_API_KEY`, opencode's `type = "api"`):
/// (secret name, placeholder, JSON pointer, hosts, header).
type FileKey = (
    &'static str,
    &'static str,
    &'static str,
    &'static [&'static str],
    &'static str,
);

const CODEX_API_KEY: FileKey = (
    "codex-api-key",
    "warren-placeholder-codex-api-key-v1",
    "/OPENAI_API_KEY",
    &["api.openai.com"],
    "authorization",
);
const OPENCODE_ANTHROPIC_KEY: FileKey = (
    "opencode-anthropic-api-key",
    "warren-placeholder-opencode-anthropic-key-v1",
    "/anthropic/key",
    &["api.anthropic.com"],
    "x-api-key",
);
const OPENCODE_OPENAI_KEY: FileKey = (
    "opencode-openai-api-key",
    "warren-placeholder-opencode-openai-key-v1",
    "/openai/key",
    &["api.openai.com"],
    "authorization",
);

impl Provider {
    pub fn parse(s: &str) -> Option<Provider> {
        match s {
            "claude" => Some(Provider::Claude),
            "codex" => Some(Provider::Codex),
            "opencode" => Some(Provider::Opencode),
            _ => None,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Provider::Claude => "claude",
            Provider::Codex => "codex",
            Provider::Opencode => "opencode",
        }
    }

    /// Hosts the agent needs: its APIs and OAuth token endpoints.
    fn hosts(self) -> &'static [&'static str] {
        match self {
            Provider::Claude => &[
                "api.anthropic.com",
                "platform.claude.com",
                "console.anthropic.com",
                "claude.ai",
            ],
            Provider::Codex => &["api.openai.com", "chatgpt.com", "auth.openai.com"],
            Provider::Opencode => &[
                "api.anthropic.com",
                "platform.claude.com",
                "console.anthropic.com",
                "api.openai.com",
                "chatgpt.com",
                "auth.openai.com",
            ],
        }
    }

    /// The host credential file, relative to the owner's home (or the agent's own
    /// configuration variable).
    pub fn host_file(self, home: &Path) -> PathBuf {
        let var = |v: &str, default: &str| {
            std::env::var_os(v)
                .filter(|d| !d.is_empty())
                .map(PathBuf::from)
                .unwrap_or_else(|| home.join(default))
        };
        match self {
            Provider::Claude => var("CLAUDE_CONFIG_DIR", ".claude").join(".credentials.json"),
            Provider::Codex => var("CODEX_HOME", ".codex").join("auth.json"),
            Provider::Opencode => var("XDG_DATA_HOME", ".local/share").join("opencode/auth.json"),
        }
    }

    /// Where the agent looks for its credentials: directories under the agent state
    /// directory, and the file name (see `agent_env`: `CLAUDE_CONFIG_DIR`, `CODEX_HOME` and
    /// `XDG_DATA_HOME` point there).
    fn guest_file(self) -> (&'static [&'static str], &'static str) {
        match self {
            Provider::Claude => (&["claude"], ".credentials.json"),
            Provider::Codex => (&["codex"], "auth.json"),
            Provider::Opencode => (&["data", "opencode"], "auth.json"),
        }
    }

    /// The guest's copy of host document `doc`: every token and key replaced by its
    /// placeholder, everything else kept (so the agent sees a plausible file), logins Warren
    /// cannot wire left out. Also the logins and keys found.
    fn shape(
        self,
        doc: &serde_json::Value,
        warn: &mut dyn FnMut(&str),
    ) -> Result<(serde_json::Value, Vec<Login>, Vec<FileKey>)> {
        let mut doc = doc.clone();
        let mut logins = Vec::new();
        let mut keys = Vec::new();
        match self {
            Provider::Claude => {
                let o = doc
                    .pointer_mut("/claudeAiOauth")
                    .and_then(|v| v.as_object_mut())
                    .context("no claudeAiOauth object")?;
                if !o.get("accessToken").is_some_and(|v| v.is_string()) {
                    bail!("no claudeAiOauth.accessToken");
                }
                let (access, refresh) = Login::Claude.placeholders();
                o.insert("accessToken".into(), access.into());
                o.insert("refreshToken".into(), refresh.into());
                logins.push(Login::Claude);
            }
            Provider::Codex => {
                let has_key = doc.get("OPENAI_API_KEY").is_some_and(|v| v.is_string());
                if let Some(o) = doc.pointer_mut("/tokens").and_then(|v| v.as_object_mut()) {
                    if !o.get("access_token").is_some_and(|v| v.is_string()) {
                        bail!("no tokens.access_token");
                    }
                    let (access, refresh) = Login::Codex.placeholders();
                    o.insert("access_token".into(), access.into());
                    o.insert("refresh_token".into(), refresh.into());
                    // The id token is a JWT the agent decodes for account details: keep its
                    // claims, drop its signature (nothing it is sent to checks it).
                    if let Some(id) = o.get("id_token").and_then(|v| v.as_str()) {
                        o.insert("id_token".into(), unsigned_jwt(id).into());
                    }
                    logins.push(Login::Codex);
                } else if !has_key {
                    bail!("neither a tokens object nor OPENAI_API_KEY");
                }
                if has_key {
                    doc["OPENAI_API_KEY"] = CODEX_API_KEY.1.into();
                    keys.push(CODEX_API_KEY);
                }
            }
            Provider::Opencode => {
                let o = doc.as_object_mut().context("not a JSON object")?;
                let mut dropped = Vec::new();
                for (provider, entry) in o.iter_mut() {
                    let kind = entry
                        .get("type")
                        .and_then(|t| t.as_str())
                        .unwrap_or("")
                        .to_string();
                    let wired = match (provider.as_str(), kind.as_str()) {
                        ("anthropic", "oauth") => Some(Ok(Login::OpencodeAnthropic)),
                        ("openai", "oauth") => Some(Ok(Login::OpencodeOpenai)),
                        ("anthropic", "api") => Some(Err(OPENCODE_ANTHROPIC_KEY)),
                        ("openai", "api") => Some(Err(OPENCODE_OPENAI_KEY)),
                        _ => None,
                    };
                    let Some(wired) = wired else {
                        dropped.push(provider.clone());
                        continue;
                    };
                    let fields: Vec<(&str, &str)> = match &wired {
                        Ok(l) => {
                            let (a, r) = l.placeholders();
                            vec![("access", a), ("refresh", r)]
                        }
                        Err(k) => vec![("key", k.1)],
                    };
                    let e = entry
                        .as_object_mut()
                        .with_context(|| format!("{provider}: not an object"))?;
                    for (field, placeholder) in fields {
                        if !e.get(field).is_some_and(|v| v.is_string()) {
                            bail!("{provider}.{field} is not a string");
                        }
                        e.insert(field.into(), placeholder.into());
                    }
                    match wired {
                        Ok(l) => logins.push(l),
                        Err(k) => keys.push(k),
                    }
                }
                for provider in &dropped {
                    o.remove(provider);
                    warn(&format!(
                        "opencode's {provider} login is not wired (Warren wires anthropic and \
                         openai): log in to it inside the VM"
                    ));
                }
            }
        }
        Ok((doc, logins, keys))
    }
}

fn unsigned_jwt(jwt: &str) -> String {
    let mut parts = jwt.splitn(3, '.');
    match (parts.next(), parts.next()) {
        (Some(h), Some(c)) => format!("{h}.{c}.warren-placeholder-signature"),
        _ => "warren-placeholder-id-token".into(),
    }
}

/// The `exp` claim of a JWT (not verified: only used to report a lifetime).
pub fn jwt_exp(jwt: &str) -> Option<i64> {
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

/// What wiring `providers` adds to a session: network settings and placeholder files.
pub struct Wiring {
    pub network: NetworkRequest,
    /// (provider, placeholder document) to write into the agent state directory.
    pub files: Vec<(Provider, serde_json::Value)>,
    /// Placeholders (and git's credential helper) for the agent's environment.
    pub env: Vec<(String, String)>,
}

/// Wires the host user's login files of `providers`. A provider whose host file is missing
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
        env: Vec::new(),
    };
    // (host, path) -> the logins its refresh request may be for, with their files.
    let mut endpoints: BTreeMap<(&str, &str), Vec<(Login, PathBuf)>> = BTreeMap::new();
    for &p in providers {
        for h in p.hosts() {
            if !w.network.allow.iter().any(|a| a == h) {
                w.network.allow.push((*h).to_string());
            }
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
        let (shaped, logins, keys) = p
            .shape(&doc, warn)
            .with_context(|| format!("{}: unexpected shape", file.display()))?;
        for l in logins {
            w.network.secrets.push(NetSecret {
                name: format!("{}-access-token", l.name()),
                placeholder: l.placeholders().0.to_string(),
                hosts: l.token_hosts().iter().map(|h| h.to_string()).collect(),
                file: file.clone(),
                json_pointer: Some(l.pointers().0.to_string()),
                headers: vec!["authorization".into()],
            });
            for e in l.refresh_endpoints() {
                endpoints.entry(*e).or_default().push((l, file.clone()));
            }
        }
        for (name, placeholder, pointer, hosts, header) in keys {
            w.network.secrets.push(NetSecret {
                name: name.into(),
                placeholder: placeholder.into(),
                hosts: hosts.iter().map(|h| h.to_string()).collect(),
                file: file.clone(),
                json_pointer: Some(pointer.into()),
                headers: vec![header.into()],
            });
        }
        w.files.push((p, shaped));
    }
    let env: Vec<(String, String)> = REFRESH_ENV
        .iter()
        .filter_map(|v| {
            let value = std::env::var(v).ok().filter(|x| !x.is_empty())?;
            Some((v.to_string(), value))
        })
        .collect();
    for ((host, path), sources) in endpoints {
        let mut command = vec![
            exe.to_string_lossy().into_owned(),
            "intercept-refresh".into(),
        ];
        for (l, file) in sources {
            command.push("--source".into());
            command.push(format!("{}={}", l.name(), file.display()));
        }
        w.network.intercepts.push(NetIntercept {
            host: host.to_string(),
            method: "POST".into(),
            path_prefix: path.to_string(),
            command,
            uid: owner.0,
            gid: owner.1,
            timeout_ms: REFRESH_TIMEOUT_MS,
            env: env.clone(),
        });
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
        let (dirs, name) = p.guest_file();
        let mut d: OwnedFd = root.try_clone().context("dup")?;
        for dir in dirs {
            match mkdirat(d.as_fd(), *dir, Mode::from_bits_truncate(0o700)) {
                Ok(()) => nix::unistd::fchownat(
                    d.as_fd(),
                    *dir,
                    Some(owner.0.into()),
                    Some(owner.1.into()),
                    AtFlags::AT_SYMLINK_NOFOLLOW,
                )
                .with_context(|| format!("chown {dir}"))?,
                Err(nix::errno::Errno::EEXIST) => {}
                Err(e) => return Err(e).with_context(|| format!("mkdir {dir}")),
            }
            d = openat(
                d.as_fd(),
                *dir,
                OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
                Mode::empty(),
            )
            .with_context(|| format!("{dir} in the agent state directory is not a directory"))?;
        }
        let dir = dirs.join("/");
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

#[cfg(test)]
mod tests {
    use super::*;

    fn claude_doc(expires_ms: i64) -> serde_json::Value {
        serde_json::json!({"claudeAiOauth": {
            "accessToken": "sk-ant-oat-REAL", "refreshToken": "sk-ant-ort-REAL",
            "expiresAt": expires_ms, "scopes": ["user:inference", "user:profile"],
            "subscriptionType": "max"}})
    }

    fn shape(p: Provider, doc: &serde_json::Value) -> Result<(serde_json::Value, Vec<Login>)> {
        let (d, l, _) = p.shape(doc, &mut |_| {})?;
        Ok((d, l))
    }

    #[test]
    fn test_placeholder_documents_keep_shape_and_drop_tokens() {
        let (d, logins) = shape(Provider::Claude, &claude_doc(1)).expect("claude");
        let s = d.to_string();
        assert!(!s.contains("REAL"), "{s}");
        assert_eq!(logins, [Login::Claude]);
        assert_eq!(d["claudeAiOauth"]["subscriptionType"], "max");
        assert_eq!(d["claudeAiOauth"]["expiresAt"], 1);
        let codex = serde_json::json!({"OPENAI_API_KEY": null, "tokens": {
            "id_token": "aGVhZA.eyJlbWFpbCI6ImEifQ.SIGNATURE", "access_token": "REAL-A",
            "refresh_token": "REAL-R", "account_id": "acct"}, "last_refresh": "x"});
        let (d, _) = shape(Provider::Codex, &codex).expect("codex");
        let s = d.to_string();
        assert!(!s.contains("REAL") && !s.contains("SIGNATURE"), "{s}");
        assert_eq!(d["tokens"]["account_id"], "acct");
        assert!(d["tokens"]["id_token"]
            .as_str()
            .expect("id")
            .starts_with("aGVhZA.eyJlbWFpbCI6ImEifQ."));
        assert!(shape(Provider::Claude, &serde_json::json!({})).is_err());
        // Codex logged in with an API key only.
        let key_only = serde_json::json!({"OPENAI_API_KEY": "sk-REAL"});
        let (d, keys) = Provider::Codex
            .shape(&key_only, &mut |_| {})
            .map(|(d, _, k)| (d, k))
            .expect("key only");
        assert_eq!(d["OPENAI_API_KEY"], CODEX_API_KEY.1);
        assert_eq!(keys, [CODEX_API_KEY]);
    }

    #[test]
    fn test_opencode_auth_file_logins_keys_and_others_dropped() {
        let doc = serde_json::json!({
            "anthropic": {"type": "oauth", "access": "REAL-A", "refresh": "REAL-R",
                          "expires": 5_000_000},
            "openai": {"type": "api", "key": "sk-REAL"},
            "github-copilot": {"type": "oauth", "access": "REAL-C", "refresh": "REAL-D",
                               "expires": 1}});
        let mut warned = Vec::new();
        let (d, logins, keys) = Provider::Opencode
            .shape(&doc, &mut |m| warned.push(m.to_string()))
            .expect("opencode");
        assert!(!d.to_string().contains("REAL"), "{d}");
        assert_eq!(logins, [Login::OpencodeAnthropic]);
        assert_eq!(keys, [OPENCODE_OPENAI_KEY]);
        assert_eq!(d["anthropic"]["expires"], 5_000_000);
        assert_eq!(d["anthropic"]["type"], "oauth");
        assert_eq!(d["openai"]["key"], OPENCODE_OPENAI_KEY.1);
        assert!(d.get("github-copilot").is_none());
        assert!(
            warned.len() == 1 && warned[0].contains("github-copilot"),
            "{warned:?}"
        );
        assert_eq!(Login::OpencodeAnthropic.expires_at(&doc), Some(5000));
        let bad = serde_json::json!({"anthropic": {"type": "oauth", "access": 5}});
        assert!(Provider::Opencode.shape(&bad, &mut |_| {}).is_err());
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
        let (doc, _) = shape(Provider::Claude, &claude_doc(1)).expect("doc");
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

    #[test]
    fn test_write_files_nested_guest_directories() {
        let dir = tempfile::tempdir().expect("tempdir");
        let me = (
            nix::unistd::getuid().as_raw(),
            nix::unistd::getgid().as_raw(),
        );
        let doc = serde_json::json!({"anthropic": {"type": "api", "key": "PH"}});
        write_files(dir.path(), &[(Provider::Opencode, doc)], me).expect("write");
        let written =
            std::fs::read_to_string(dir.path().join("data/opencode/auth.json")).expect("read");
        assert!(written.contains("\"PH\""), "{written}");
    }
}
