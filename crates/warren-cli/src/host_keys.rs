//! Host credentials that are single values rather than an agent's login file: the provider
//! API keys (`ANTHROPIC_API_KEY`, `OPENAI_API_KEY`) and a GitHub token (`GH_TOKEN`,
//! `GITHUB_TOKEN`, or `gh`'s own login in its `hosts.yml`), for `warren run`.
//!
//! Each is read from a file named in the user's configuration ([`crate::user_config`]),
//! else the environment, else (GitHub) `gh`'s hosts file. A file named in the configuration
//! is the egress's secret file itself (re-read on every new connection, so rotating it needs
//! no restart). A value taken from the environment or from `gh`'s hosts file is copied into
//! `STATE/credentials/<workspace>/<name>` (directory 0700, file 0600, replaced by rename), the
//! egress's secret file for it; a later run without the variable keeps using that copy, so the
//! session's network settings stay the same. Delete the file to forget the value.
//!
//! The guest gets a placeholder of the real value's shape in the agent's environment (and,
//! for GitHub, a git credential helper handing the placeholder out for `https://github.com`),
//! never the value: the egress substitutes it in the provider's header, on the provider's
//! hosts only (for git, inside the `Authorization: Basic` credential).

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use warren_core::NetworkRequest;
use warren_vmm::NetSecret;

use crate::user_config::CredentialFiles;

/// Largest credential value or `gh` hosts file read.
const MAX_VALUE_FILE: u64 = 64 * 1024;

/// A single-value credential kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyKind {
    Anthropic,
    OpenAi,
    GitHub,
}

impl KeyKind {
    pub const ALL: [KeyKind; 3] = [KeyKind::Anthropic, KeyKind::OpenAi, KeyKind::GitHub];

    /// The name in `--credentials`, the secret's name and the stored copy's file name.
    pub fn name(self) -> &'static str {
        match self {
            KeyKind::Anthropic => "anthropic-api-key",
            KeyKind::OpenAi => "openai-api-key",
            KeyKind::GitHub => "github-token",
        }
    }

    pub fn parse(s: &str) -> Option<KeyKind> {
        KeyKind::ALL.into_iter().find(|k| k.name() == s)
    }

    /// The host environment variables read, in order.
    pub fn env_vars(self) -> &'static [&'static str] {
        match self {
            KeyKind::Anthropic => &["ANTHROPIC_API_KEY"],
            KeyKind::OpenAi => &["OPENAI_API_KEY"],
            KeyKind::GitHub => &["GH_TOKEN", "GITHUB_TOKEN"],
        }
    }

    /// The guest variable that carries the placeholder.
    pub fn guest_var(self) -> &'static str {
        match self {
            KeyKind::Anthropic => "ANTHROPIC_API_KEY",
            KeyKind::OpenAi => "OPENAI_API_KEY",
            KeyKind::GitHub => "GH_TOKEN",
        }
    }

    /// A placeholder of the real value's shape (prefix, alphabet, length), so clients that
    /// check a key's format accept it; fixed, so the session's network settings do not
    /// change when the key does.
    pub fn placeholder(self) -> String {
        let (prefix, marker, len, tail) = match self {
            // sk-ant-api03-<93 base64url>AA: 108 characters.
            KeyKind::Anthropic => (
                "sk-ant-api03-",
                "warren-placeholder-anthropic-key-v1-",
                108,
                "AA",
            ),
            // sk-proj-<156 base64url>: 164 characters.
            KeyKind::OpenAi => ("sk-proj-", "warren-placeholder-openai-key-v1-", 164, ""),
            // gho_<36 base62>: 40 characters.
            KeyKind::GitHub => ("gho_", "WarrenPlaceholderGitHubToken", 40, "01"),
        };
        let mut p = format!("{prefix}{marker}");
        while p.len() + tail.len() < len {
            p.push('x');
        }
        p.push_str(tail);
        p
    }

    /// Hosts the real value is sent to.
    fn token_hosts(self) -> &'static [&'static str] {
        match self {
            KeyKind::Anthropic => &["api.anthropic.com"],
            KeyKind::OpenAi => &["api.openai.com"],
            KeyKind::GitHub => &["github.com", "api.github.com", "uploads.github.com"],
        }
    }

    /// Allow-list entries the credential needs.
    fn allow(self) -> &'static [&'static str] {
        match self {
            KeyKind::Anthropic => &["api.anthropic.com"],
            KeyKind::OpenAi => &["api.openai.com"],
            KeyKind::GitHub => &["preset:github", "uploads.github.com"],
        }
    }

    /// The only request header the value is substituted into (the provider's).
    fn header(self) -> &'static str {
        match self {
            KeyKind::Anthropic => "x-api-key",
            // `Bearer KEY` for OpenAI; `token T` (gh) and `Basic base64(user:T)` (git).
            KeyKind::OpenAi | KeyKind::GitHub => "authorization",
        }
    }

    fn config_file(self, c: &CredentialFiles) -> Option<&PathBuf> {
        match self {
            KeyKind::Anthropic => c.anthropic_api_key_file.as_ref(),
            KeyKind::OpenAi => c.openai_api_key_file.as_ref(),
            KeyKind::GitHub => c.github_token_file.as_ref(),
        }
    }
}

/// Where one wired value comes from (for the run's messages; never the value).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    ConfigFile(PathBuf),
    Env(&'static str),
    GhHosts(PathBuf),
    Remembered,
}

/// What wiring one key adds.
pub struct WiredKey {
    pub kind: KeyKind,
    pub origin: Origin,
}

/// Everything the host environment and `gh`'s hosts file offer, read once (the value
/// itself stays in this struct only until it is stored).
pub struct HostSources<'a> {
    pub home: &'a Path,
    pub files: &'a CredentialFiles,
    /// `STATE/credentials/<workspace>`.
    pub store: PathBuf,
    pub owner: (u32, u32),
    pub mounted: &'a [PathBuf],
}

/// Wires `kinds` into `net` (secrets, allow list) and returns the guest environment and
/// what was wired. A kind with no source anywhere is skipped.
pub fn wire(
    kinds: &[KeyKind],
    src: &HostSources<'_>,
    net: &mut NetworkRequest,
    env: &mut Vec<(String, String)>,
) -> Result<Vec<WiredKey>> {
    let mut wired = Vec::new();
    for &kind in kinds {
        let Some((file, origin)) = source_file(kind, src)? else {
            continue;
        };
        let placeholder = kind.placeholder();
        net.secrets.push(NetSecret {
            name: kind.name().into(),
            placeholder: placeholder.clone(),
            hosts: kind.token_hosts().iter().map(|h| h.to_string()).collect(),
            file,
            json_pointer: None,
            headers: vec![kind.header().into()],
        });
        for h in kind.allow() {
            if !net.allow.iter().any(|a| a == h) {
                net.allow.push((*h).to_string());
            }
        }
        env.push((kind.guest_var().into(), placeholder));
        if kind == KeyKind::GitHub {
            env.extend(git_credential_env());
        }
        wired.push(WiredKey { kind, origin });
    }
    Ok(wired)
}

/// git's configuration from the environment (`GIT_CONFIG_COUNT`): for `https://github.com`
/// only, the helpers configured elsewhere are reset and one that hands out `$GH_TOKEN` (the
/// placeholder) as the password of `x-access-token` is added.
fn git_credential_env() -> Vec<(String, String)> {
    let key = "credential.https://github.com.helper";
    let helper = "!f() { test \"$1\" = get || exit 0; echo username=x-access-token; \
                  echo \"password=$GH_TOKEN\"; }; f";
    vec![
        ("GIT_CONFIG_COUNT".into(), "2".into()),
        ("GIT_CONFIG_KEY_0".into(), key.into()),
        ("GIT_CONFIG_VALUE_0".into(), String::new()),
        ("GIT_CONFIG_KEY_1".into(), key.into()),
        ("GIT_CONFIG_VALUE_1".into(), helper.into()),
    ]
}

/// The egress's secret file for `kind`, or `None` when the host has no such credential.
fn source_file(kind: KeyKind, src: &HostSources<'_>) -> Result<Option<(PathBuf, Origin)>> {
    if let Some(f) = kind.config_file(src.files) {
        let file = f.canonicalize().with_context(|| {
            format!("{} ({}): resolving {}", kind.name(), "config", f.display())
        })?;
        refuse_mounted(&file, src.mounted)?;
        // Checked now, so a bad file fails the run instead of every request.
        valid_value(&read_bounded(&file)?)
            .with_context(|| format!("{}: {}", kind.name(), file.display()))?;
        return Ok(Some((file.clone(), Origin::ConfigFile(file))));
    }
    let stored = src.store.join(kind.name());
    for var in kind.env_vars() {
        if let Some(v) = std::env::var_os(var).filter(|v| !v.is_empty()) {
            let v = v
                .into_string()
                .map_err(|_| anyhow::anyhow!("${var} is not text"))?;
            let v = valid_value(&v).with_context(|| format!("${var}"))?;
            store_value(&src.store, kind.name(), v, src.owner)?;
            return Ok(Some((stored, Origin::Env(var))));
        }
    }
    if kind == KeyKind::GitHub {
        let hosts = gh_hosts_file(src.home);
        if let Some(token) = gh_hosts_token(&hosts)? {
            store_value(&src.store, kind.name(), &token, src.owner)?;
            return Ok(Some((stored, Origin::GhHosts(hosts))));
        }
    }
    if stored.is_file() {
        return Ok(Some((stored, Origin::Remembered)));
    }
    Ok(None)
}

fn refuse_mounted(file: &Path, mounted: &[PathBuf]) -> Result<()> {
    if let Some(m) = mounted.iter().find(|m| file.starts_with(m)) {
        bail!(
            "{} is inside {}, which is mounted into the VM: the real value would be visible there",
            file.display(),
            m.display()
        );
    }
    Ok(())
}

fn read_bounded(file: &Path) -> Result<String> {
    let mut text = String::new();
    std::fs::File::open(file)
        .and_then(|f| f.take(MAX_VALUE_FILE + 1).read_to_string(&mut text))
        .with_context(|| format!("reading {}", file.display()))?;
    if text.len() as u64 > MAX_VALUE_FILE {
        bail!("{} is larger than {MAX_VALUE_FILE} bytes", file.display());
    }
    Ok(text)
}

/// The value without one trailing newline, if it is one the egress can send: printable
/// ASCII, no spaces, 8 to 4096 characters (the egress's own check, stricter).
fn valid_value(raw: &str) -> Result<&str> {
    let v = raw
        .strip_suffix("\r\n")
        .or_else(|| raw.strip_suffix('\n'))
        .unwrap_or(raw);
    if !(8..=4096).contains(&v.len()) || !v.bytes().all(|b| b.is_ascii_graphic()) {
        bail!("not a credential: expected 8 to 4096 printable characters without spaces");
    }
    Ok(v)
}

/// `gh`'s hosts file: `$GH_CONFIG_DIR/hosts.yml`, else `$XDG_CONFIG_HOME/gh/hosts.yml`, else
/// `~/.config/gh/hosts.yml`.
fn gh_hosts_file(home: &Path) -> PathBuf {
    if let Some(d) = std::env::var_os("GH_CONFIG_DIR").filter(|d| !d.is_empty()) {
        return PathBuf::from(d).join("hosts.yml");
    }
    std::env::var_os("XDG_CONFIG_HOME")
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| home.join(".config"))
        .join("gh/hosts.yml")
}

/// The `github.com` token of a `gh` hosts file (`github.com: {oauth_token: ...}`), `None`
/// when the file or the entry is absent (a `gh` that keeps its token in the system keyring
/// writes none: export `GH_TOKEN=$(gh auth token)` instead).
fn gh_hosts_token(file: &Path) -> Result<Option<String>> {
    if !file.exists() {
        return Ok(None);
    }
    let text = read_bounded(file)?;
    let docs = yaml_rust2::YamlLoader::load_from_str(&text)
        .map_err(|e| anyhow::anyhow!("{}: not YAML: {e}", file.display()))?;
    let Some(token) = docs
        .first()
        .and_then(|d| d["github.com"]["oauth_token"].as_str())
    else {
        return Ok(None);
    };
    Ok(Some(
        valid_value(token)
            .with_context(|| format!("{}: github.com oauth_token", file.display()))?
            .to_string(),
    ))
}

/// Writes `value` to `dir/name` (created 0700 and owned by `owner`; file 0600, through a
/// temporary file and a rename, so a reader sees the old or the new value).
fn store_value(dir: &Path, name: &str, value: &str, owner: (u32, u32)) -> Result<()> {
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
    if let Some(parent) = dir.parent() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(parent)
            .with_context(|| format!("creating {}", parent.display()))?;
    }
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => std::os::unix::fs::chown(dir, Some(owner.0), Some(owner.1))
            .with_context(|| format!("chown {}", dir.display()))?,
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e).with_context(|| format!("creating {}", dir.display())),
    }
    let meta = std::fs::symlink_metadata(dir)?;
    if !meta.is_dir() || meta.permissions().mode() & 0o077 != 0 {
        bail!(
            "{} must be a directory only its owner can open (mode 0700)",
            dir.display()
        );
    }
    let tmp = dir.join(format!(".{name}.{}", std::process::id()));
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .open(&tmp)
        .with_context(|| format!("creating {}", tmp.display()))?;
    let written = (|| -> std::io::Result<()> {
        f.write_all(value.as_bytes())?;
        f.write_all(b"\n")?;
        f.sync_all()?;
        std::os::unix::fs::fchown(&f, Some(owner.0), Some(owner.1))?;
        std::fs::rename(&tmp, dir.join(name))
    })();
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(e).with_context(|| format!("writing {}", dir.join(name).display()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_placeholders_have_the_real_shapes() {
        let a = KeyKind::Anthropic.placeholder();
        assert!(a.starts_with("sk-ant-api03-") && a.ends_with("AA") && a.len() == 108);
        let o = KeyKind::OpenAi.placeholder();
        assert!(o.starts_with("sk-proj-") && o.len() == 164);
        let g = KeyKind::GitHub.placeholder();
        assert!(g.starts_with("gho_") && g.len() == 40);
        assert!(g[4..].bytes().all(|b| b.is_ascii_alphanumeric()), "{g}");
        for k in KeyKind::ALL {
            assert_eq!(KeyKind::parse(k.name()), Some(k));
            assert!(valid_value(&k.placeholder()).is_ok());
        }
    }

    #[test]
    fn test_gh_hosts_token_read_or_absent() {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = dir.path().join("hosts.yml");
        assert_eq!(gh_hosts_token(&f).expect("absent"), None);
        std::fs::write(
            &f,
            "github.com:\n    users:\n        octo:\n            oauth_token: gho_a1\n    \
             git_protocol: https\n    oauth_token: gho_0123456789abcdef\n    user: octo\n",
        )
        .expect("write");
        assert_eq!(
            gh_hosts_token(&f).expect("token").as_deref(),
            Some("gho_0123456789abcdef")
        );
        // A keyring login: no token in the file.
        std::fs::write(&f, "github.com:\n    user: octo\n    git_protocol: https\n").expect("w");
        assert_eq!(gh_hosts_token(&f).expect("keyring"), None);
        std::fs::write(&f, "github.com:\n    oauth_token: \"has space\"\n").expect("w");
        assert!(gh_hosts_token(&f).is_err());
    }

    #[test]
    fn test_store_value_private_and_replaced() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("tempdir");
        let store = dir.path().join("credentials/local-0");
        let me = (
            nix::unistd::getuid().as_raw(),
            nix::unistd::getgid().as_raw(),
        );
        store_value(&store, "k", "value-one", me).expect("store");
        store_value(&store, "k", "value-two", me).expect("replace");
        let f = store.join("k");
        assert_eq!(std::fs::read_to_string(&f).expect("read"), "value-two\n");
        let mode = |p: &Path| std::fs::metadata(p).expect("meta").permissions().mode() & 0o777;
        assert_eq!((mode(&store), mode(&f)), (0o700, 0o600));
        assert_eq!(std::fs::read_dir(&store).expect("ls").count(), 1);
        // A store directory others can open is refused.
        std::fs::set_permissions(&store, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        assert!(store_value(&store, "k", "value-three", me).is_err());
        assert!(valid_value("short").is_err() && valid_value("has a space in it").is_err());
        assert_eq!(
            valid_value("abcdefgh\n").expect("trailing newline"),
            "abcdefgh"
        );
    }
}
