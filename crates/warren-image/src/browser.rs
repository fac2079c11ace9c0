//! The `agents` recipe's browser block, as the host sees it: where the image keeps the
//! Chrome DevTools MCP server's wrapper and the agents' MCP configuration naming it. The
//! block itself (Debian's `chromium-headless-shell`, the pinned `chrome-devtools-mcp` npm
//! package, the files below) is part of `recipes/agents.toml`, and the files live beside it
//! in `recipes/browser/`; `warren run` points Claude Code, Codex and opencode at them when a
//! session's guest has them.

/// The MCP server command (stdio): starts the headless browser and the DevTools MCP server
/// on it.
pub const MCP_WRAPPER: &str = "/usr/local/bin/warren-browser-mcp";

/// The MCP configuration in the `mcpServers` format Claude Code reads (`--mcp-config`).
pub const MCP_CONFIG: &str = "/etc/warren/mcp.json";

/// opencode's configuration naming the same server (`OPENCODE_CONFIG`).
pub const OPENCODE_CONFIG: &str = "/etc/warren/opencode.json";

/// The server's name in every agent's configuration.
pub const SERVER_NAME: &str = "chrome-devtools";

#[cfg(test)]
mod tests {
    use super::*;
    use crate::recipe::{Recipe, BUILTIN_FILES};

    /// The agents recipe installs the wrapper and both configurations where these constants
    /// say, and each configuration names the wrapper under [`SERVER_NAME`].
    #[test]
    fn test_agents_recipe_holds_the_browser_block_where_run_looks() {
        let agents = Recipe::builtin("agents").expect("agents");
        for path in [MCP_WRAPPER, MCP_CONFIG, OPENCODE_CONFIG] {
            assert!(
                agents.files().iter().any(|f| f.dest == path),
                "{path} not in the agents recipe"
            );
        }
        let wrapper = agents
            .files()
            .iter()
            .find(|f| f.dest == MCP_WRAPPER)
            .expect("wrapper");
        assert_eq!(wrapper.mode, 0o755);
        assert!(agents
            .packages()
            .iter()
            .any(|p| p == "chromium-headless-shell"));
        assert!(agents
            .agent_clis()
            .iter()
            .any(|c| c.package == "chrome-devtools-mcp"));
        let claude: serde_json::Value =
            serde_json::from_slice(BUILTIN_FILES[1].1).expect("mcp.json");
        assert_eq!(claude["mcpServers"][SERVER_NAME]["command"], MCP_WRAPPER);
        let opencode: serde_json::Value =
            serde_json::from_slice(BUILTIN_FILES[2].1).expect("opencode.json");
        assert_eq!(opencode["mcp"][SERVER_NAME]["command"][0], MCP_WRAPPER);
        // The dev recipe has none of it.
        let dev = Recipe::builtin("dev").expect("dev");
        assert!(dev.files().is_empty());
    }
}
