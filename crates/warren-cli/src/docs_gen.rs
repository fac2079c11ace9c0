//! Shell completions and man pages, generated from the clap definitions in `cli.rs` (so
//! they never drift from the parser); its tests hold every command to the CLI's
//! conventions (`--json` on every listing and status command).

use std::io::Write;
use std::path::Path;

use anyhow::{Context, Result};
use clap::CommandFactory;

use crate::cli::Cli;

/// `warren completions SHELL`: the completion script on stdout.
pub fn completions(shell: clap_complete::Shell) -> Result<i32> {
    let mut cmd = Cli::command();
    let mut script = Vec::new();
    clap_complete::generate(shell, &mut cmd, "warren", &mut script);
    let mut out = std::io::stdout().lock();
    match out.write_all(&script).and_then(|()| out.flush()) {
        // `warren completions bash | head`: the reader had enough.
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(0),
        r => r.map(|()| 0).context("writing the completion script"),
    }
}

/// `warren man-pages --out-dir DIR`: `warren.1` and `warren-<sub>[-<sub>].1` for every
/// visible subcommand.
pub fn man_pages(out_dir: &Path) -> Result<i32> {
    std::fs::create_dir_all(out_dir).with_context(|| out_dir.display().to_string())?;
    clap_mangen::generate_to(Cli::command(), out_dir)
        .with_context(|| format!("writing man pages into {}", out_dir.display()))?;
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Names of leaf subcommands that list or report state: each must take `--json`.
    const REPORTING: &[&str] = &[
        "list",
        "status",
        "jobs",
        "preflight",
        "show",
        "inspect",
        "info",
    ];

    /// Leaf subcommands (as `warren a b` paths) that report state without `--json`: a
    /// listing or status command is one named in [`REPORTING`] or whose help starts with
    /// "Lists" or "Shows".
    fn reporting_without_json() -> Vec<String> {
        let mut missing = Vec::new();
        walk(&Cli::command(), "warren", &mut missing);
        missing
    }

    fn walk(cmd: &clap::Command, path: &str, missing: &mut Vec<String>) {
        for sub in cmd.get_subcommands() {
            let p = format!("{path} {}", sub.get_name());
            if sub.has_subcommands() {
                walk(sub, &p, missing);
                continue;
            }
            let about = sub.get_about().map(|a| a.to_string()).unwrap_or_default();
            let reports = REPORTING.contains(&sub.get_name())
                || about.starts_with("Lists")
                || about.starts_with("Shows");
            let json = sub.get_arguments().any(|a| a.get_long() == Some("json"));
            if reports && !sub.is_hide_set() && !json {
                missing.push(p);
            }
        }
    }

    #[test]
    fn test_cli_definitions_are_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn test_every_listing_and_status_command_takes_json() {
        assert_eq!(reporting_without_json(), Vec::<String>::new());
    }

    #[test]
    fn test_man_pages_cover_every_visible_subcommand() {
        let dir = tempfile::tempdir().expect("tempdir");
        man_pages(dir.path()).expect("man pages");
        for page in [
            "warren.1",
            "warren-vm.1",
            "warren-vm-list.1",
            "warren-completions.1",
        ] {
            let text = std::fs::read_to_string(dir.path().join(page)).expect(page);
            assert!(
                text.starts_with(".ie"),
                "{page}: {}",
                &text[..40.min(text.len())]
            );
        }
        assert!(!dir.path().join("warren-supervise.1").exists(), "hidden");
    }

    #[test]
    fn test_version_names_the_commit() {
        let v = Cli::command().render_version();
        assert!(v.starts_with("warren "), "{v}");
        assert!(v.contains(" (commit "), "{v}");
    }
}
