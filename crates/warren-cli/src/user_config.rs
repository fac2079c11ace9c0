//! The calling user's own Warren configuration for `warren run`: where host credentials live
//! when they are not in the environment, and which host CLI refreshes an agent's expired
//! login. `$WARREN_CONFIG`, else `$XDG_CONFIG_HOME/warren/config.toml`, else
//! `~/.config/warren/config.toml`; a missing file is an empty configuration.
//!
//! ```toml
//! [credentials]
//! anthropic_api_key_file = "/home/me/.secrets/anthropic"   # instead of $ANTHROPIC_API_KEY
//! openai_api_key_file = "/home/me/.secrets/openai"         # instead of $OPENAI_API_KEY
//! github_token_file = "/home/me/.secrets/github"           # instead of $GH_TOKEN / gh's login
//!
//! [refresh]                    # argv of the host CLI run to refresh an expired login
//! claude = ["claude", "-p", "ok", "--max-turns", "1"]
//! ```

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

/// Largest configuration file read.
const MAX_CONFIG: u64 = 64 * 1024;

/// `[credentials]`: files holding credentials (one value, one optional trailing newline).
#[derive(Debug, Default, Clone, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CredentialFiles {
    pub anthropic_api_key_file: Option<PathBuf>,
    pub openai_api_key_file: Option<PathBuf>,
    pub github_token_file: Option<PathBuf>,
}

/// The whole file.
#[derive(Debug, Default, Clone, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UserConfig {
    #[serde(default)]
    pub credentials: CredentialFiles,
    /// Agent (`claude`, `codex`, `opencode`) -> the host command that refreshes its login
    /// non-interactively (the program is looked up on the caller's `PATH`).
    #[serde(default)]
    pub refresh: BTreeMap<String, Vec<String>>,
}

/// Where the configuration is read from (the first of `$WARREN_CONFIG`,
/// `$XDG_CONFIG_HOME/warren/config.toml`, `HOME/.config/warren/config.toml`).
pub fn path(home: &Path) -> PathBuf {
    if let Some(p) = std::env::var_os("WARREN_CONFIG").filter(|p| !p.is_empty()) {
        return PathBuf::from(p);
    }
    std::env::var_os("XDG_CONFIG_HOME")
        .filter(|p| !p.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| home.join(".config"))
        .join("warren/config.toml")
}

/// Reads the configuration (an absent file is the default); relative paths in it are
/// relative to the file's directory.
pub fn load(home: &Path) -> Result<UserConfig> {
    load_file(&path(home))
}

/// Reads the configuration at `file` (absent: the default).
fn load_file(file: &Path) -> Result<UserConfig> {
    let f = match std::fs::File::open(file) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(UserConfig::default()),
        Err(e) => return Err(e).with_context(|| format!("reading {}", file.display())),
    };
    let mut text = String::new();
    f.take(MAX_CONFIG + 1)
        .read_to_string(&mut text)
        .with_context(|| format!("reading {}", file.display()))?;
    if text.len() as u64 > MAX_CONFIG {
        bail!("{} is larger than {MAX_CONFIG} bytes", file.display());
    }
    let mut cfg: UserConfig =
        toml::from_str(&text).with_context(|| format!("parsing {}", file.display()))?;
    let base = file.parent().unwrap_or(Path::new("/")).to_path_buf();
    let c = &mut cfg.credentials;
    for p in [
        &mut c.anthropic_api_key_file,
        &mut c.openai_api_key_file,
        &mut c.github_token_file,
    ]
    .into_iter()
    .flatten()
    {
        if p.is_relative() {
            *p = base.join(&*p);
        }
    }
    for (agent, argv) in &cfg.refresh {
        if !matches!(agent.as_str(), "claude" | "codex" | "opencode") {
            bail!(
                "{}: [refresh] {agent:?}: use claude, codex or opencode",
                file.display()
            );
        }
        if argv.is_empty() || argv[0].is_empty() {
            bail!("{}: [refresh] {agent} is an empty command", file.display());
        }
    }
    Ok(cfg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_user_config_parsed_relative_paths_and_checked() {
        let dir = tempfile::tempdir().expect("tempdir");
        let home = dir.path();
        std::fs::create_dir_all(home.join(".config/warren")).expect("mkdir");
        let file = home.join(".config/warren/config.toml");
        assert!(load_file(&file).expect("absent").refresh.is_empty());
        std::fs::write(
            &file,
            "[credentials]\nanthropic_api_key_file = \"keys/a\"\n\
             github_token_file = \"/abs/gh\"\n[refresh]\nclaude = [\"/bin/true\"]\n",
        )
        .expect("write");
        let c = load_file(&file).expect("parse");
        assert_eq!(
            c.credentials.anthropic_api_key_file,
            Some(home.join(".config/warren/keys/a"))
        );
        assert_eq!(c.credentials.github_token_file, Some("/abs/gh".into()));
        assert_eq!(c.refresh["claude"], ["/bin/true"]);
        for bad in [
            "[credentials]\nanthropic_key = \"x\"\n",
            "[refresh]\nvim = [\"x\"]\n",
            "[refresh]\nclaude = []\n",
        ] {
            std::fs::write(&file, bad).expect("write");
            assert!(load_file(&file).is_err(), "{bad}");
        }
    }
}
