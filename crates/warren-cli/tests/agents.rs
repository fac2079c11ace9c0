//! The `agents` image on a real VM: the Claude Code, Codex and opencode CLIs that the recipe
//! installs from the npm registry run in the guest as the guest user and report their pinned
//! versions, and `warren run claude|codex|opencode` in a fresh project starts them (a new
//! session defaults to the `agents` image). One VM for the whole file.

mod common;

use std::path::Path;
use std::process::{Command, Output, Stdio};

use common::{ok, TestEnv};

/// Deletes the project's session (and so its VM) even when an assertion fails.
struct SessionGuard<'a> {
    env: &'a TestEnv,
}

impl Drop for SessionGuard<'_> {
    fn drop(&mut self) {
        let Ok(out) = self.env.cmd().args(["session", "list", "--json"]).output() else {
            return;
        };
        let Ok(v) = serde_json::from_slice::<serde_json::Value>(&out.stdout) else {
            return;
        };
        for s in v.as_array().into_iter().flatten() {
            if let Some(name) = s["name"].as_str() {
                let _ = self
                    .env
                    .cmd()
                    .args(["session", "delete", name, "--force"])
                    .output();
            }
        }
    }
}

fn warren_run(env: &TestEnv, proj: &Path, args: &[&str]) -> Output {
    env.cmd()
        .arg("run")
        .args(args)
        .current_dir(proj)
        .stdin(Stdio::null())
        .output()
        .expect("warren run")
}

#[test]
fn test_agents_image_clis_report_pinned_versions() {
    common::ensure_image("agents");
    let env = TestEnv::new();
    let dir = tempfile::tempdir().expect("tempdir");
    let proj = dir.path().canonicalize().expect("canonical");
    let git = Command::new("git")
        .args(["init", "-q", "-b", "main"])
        .current_dir(&proj)
        .status()
        .expect("git init");
    assert!(git.success());
    let _guard = SessionGuard { env: &env };

    // No --image: the first run creates the session, whose VM gets the agents image; the
    // others start another process in the same VM.
    let agents = warren_image::Recipe::builtin("agents").expect("agents recipe");
    let clis = agents.agent_clis();
    for cli in clis {
        let started = std::time::Instant::now();
        let out = warren_run(&env, &proj, &[&cli.command, "--", "--version"]);
        let stdout = ok(out, &format!("warren run {} -- --version", cli.command));
        eprintln!(
            "warren run {} -- --version: {:.1?}: {}",
            cli.command,
            started.elapsed(),
            stdout.trim()
        );
        assert!(stdout.contains(cli.release()), "{}: {stdout}", cli.spec());
    }

    // Installed where the recipe says, run as the guest user, found on the default PATH.
    let commands: Vec<&str> = clis.iter().map(|c| c.command.as_str()).collect();
    let script = format!(
        "id -u; for c in {}; do readlink -f \"$(command -v $c)\"; done",
        commands.join(" ")
    );
    let out = warren_run(&env, &proj, &["shell", "--", "sh", "-c", &script]);
    let stdout = ok(out, "warren run shell");
    let mut lines = stdout.lines();
    assert_eq!(lines.next(), Some("1000"), "{stdout}");
    for (cli, line) in clis.iter().zip(lines) {
        assert_eq!(
            line,
            format!(
                "/usr/local/lib/warren-agents/{}-{}/{}",
                cli.command, cli.version, cli.binary
            ),
            "{stdout}"
        );
    }
    let list = ok(env.run(&["session", "list", "--json"]), "session list");
    let v: serde_json::Value = serde_json::from_str(&list).expect("json");
    assert_eq!(v.as_array().map(Vec::len), Some(1), "{v}");
}
