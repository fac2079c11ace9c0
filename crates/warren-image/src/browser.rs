//! The `agents` recipe's browser block (issue 20): Debian's headless Chromium (the
//! `chromium-headless-shell` build, without the desktop browser's UI), the GitHub CLI, and the
//! Chrome DevTools MCP server from the npm registry, pinned by version and integrity like the
//! agent CLIs ([`crate::agent_cli`]), with a wrapper that runs it headless on the image's
//! Chromium and the MCP configuration the agents are started with (`warren run` points
//! Claude Code, Codex and opencode at [`MCP_CONFIG`] when the guest has it).
//!
//! Kept apart from the rest of the recipe so it can move as one piece: its packages, its npm
//! package and its files are all part of the recipe description (and so of its digest).

use std::path::Path;

use serde::Serialize;

use crate::agent_cli::NpmAgentCli;
use crate::ImageError;

/// Debian packages: the headless browser, and `gh` for agents that use GitHub (its token is
/// wired as a placeholder by `warren run`).
pub const PACKAGES: &[&str] = &["chromium-headless-shell", "gh"];

/// The browser the MCP server launches.
pub const CHROMIUM: &str = "/usr/bin/chromium-headless-shell";

/// The Chrome DevTools MCP server. Its npm package bundles its dependencies and runs on
/// Debian's Node.js (it needs 20.19 or later). To bump: `npm view chrome-devtools-mcp
/// version`, then `npm view chrome-devtools-mcp@<version> dist.integrity`.
pub const DEVTOOLS_MCP: NpmAgentCli = NpmAgentCli {
    command: "chrome-devtools-mcp",
    package: "chrome-devtools-mcp",
    version: "1.11.0",
    integrity: "sha512-CytJ/5tnzrS+J/74be2P5aCOsS/mmGRHys/Si+IYC4ucrbnWAmES/dYdxGJjeUCECRcoFUilZAysdjlwqUjXIA==",
    binary: "build/src/bin/chrome-devtools-mcp.js",
};

/// The npm packages of the block.
pub const NPM: &[NpmAgentCli] = &[DEVTOOLS_MCP];

/// The MCP server command the agents are configured with.
pub const MCP_WRAPPER: &str = "/usr/local/bin/warren-browser-mcp";

/// The agents' MCP configuration in the guest (the `mcpServers` format Claude Code reads
/// with `--mcp-config`).
pub const MCP_CONFIG: &str = "/etc/warren/mcp.json";

/// opencode's configuration naming the same server (`OPENCODE_CONFIG`).
pub const OPENCODE_CONFIG: &str = "/etc/warren/opencode.json";

/// A file the block writes into the root tree: (absolute path, mode, content).
#[derive(Debug, Clone, Copy, Serialize)]
pub struct RootFile {
    pub path: &'static str,
    pub mode: u32,
    pub content: &'static str,
}

/// The block's files.
pub const FILES: &[RootFile] = &[
    RootFile {
        path: MCP_WRAPPER,
        mode: 0o755,
        // A fresh headless profile per run, no Chromium sandbox of its own (the VM is the
        // sandbox), one process fewer (GPU work in the browser process, no zygote: cheaper to
        // start on a slow or emulated CPU), no usage statistics or field data sent anywhere.
        // With WARREN_BROWSER_URL, it drives that running browser instead of starting one.
        content: "#!/bin/sh\n\
                  # The Chrome DevTools MCP server on the image's Chromium (Warren's agents recipe).\n\
                  set -- --usageStatistics=false --performanceCrux=false \"$@\"\n\
                  if [ -n \"$WARREN_BROWSER_URL\" ]; then\n  \
                  exec /usr/local/bin/chrome-devtools-mcp --browserUrl \"$WARREN_BROWSER_URL\" \"$@\"\n\
                  fi\n\
                  exec /usr/local/bin/chrome-devtools-mcp --executablePath /usr/bin/chromium-headless-shell \\\n  \
                  --headless --isolated --chromeArg=--no-sandbox --chromeArg=--disable-gpu \\\n  \
                  --chromeArg=--in-process-gpu --chromeArg=--no-zygote \"$@\"\n",
    },
    RootFile {
        path: MCP_CONFIG,
        mode: 0o644,
        content: "{\"mcpServers\": {\"chrome-devtools\": {\"command\": \"/usr/local/bin/warren-browser-mcp\", \"args\": []}}}\n",
    },
    RootFile {
        path: OPENCODE_CONFIG,
        mode: 0o644,
        content: "{\"$schema\": \"https://opencode.ai/config.json\", \"mcp\": {\"chrome-devtools\": {\"type\": \"local\", \"command\": [\"/usr/local/bin/warren-browser-mcp\"], \"enabled\": true}}}\n",
    },
];

/// Writes `files` (a recipe's, [`FILES`] for `agents`) into the root tree `root`, after the
/// packages and npm packages.
pub fn write_files(root: &Path, files: &[RootFile]) -> Result<(), ImageError> {
    use std::os::unix::fs::PermissionsExt;
    for f in files {
        let path = root.join(f.path.trim_start_matches('/'));
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(ImageError::io("create", parent))?;
        }
        std::fs::write(&path, f.content).map_err(ImageError::io("write", &path))?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(f.mode))
            .map_err(ImageError::io("chmod", &path))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_browser_files_name_the_wrapper_and_parse() {
        for f in FILES.iter().filter(|f| f.path.ends_with(".json")) {
            let v: serde_json::Value = serde_json::from_str(f.content).expect(f.path);
            assert!(v.to_string().contains(MCP_WRAPPER), "{}", f.path);
        }
        assert!(FILES[0]
            .content
            .contains("/usr/local/bin/chrome-devtools-mcp"));
        assert_eq!(DEVTOOLS_MCP.release(), "1.11.0");
    }
}
