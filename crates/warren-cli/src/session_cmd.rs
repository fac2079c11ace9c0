//! `warren session ...` and `warren run`: sessions of the calling user (workspace
//! `local-<uid>`), acting on the state directory directly like the other user commands.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use warren_core::session::GUEST_AGENT_STATE;
use warren_core::{local_workspace, CreateSession, SessionDevices, SessionRecord, Warren};

use crate::cli::{Cli, DeviceArgs, RunArgs, SessionCmd};
use crate::commands::open;

fn caller() -> (u32, u32) {
    (
        nix::unistd::getuid().as_raw(),
        nix::unistd::getgid().as_raw(),
    )
}

fn my_workspace() -> String {
    local_workspace(nix::unistd::geteuid().as_raw())
}

fn devices(d: &DeviceArgs) -> Result<SessionDevices> {
    let owner = caller();
    Ok(SessionDevices {
        image: d.image.clone(),
        memory_mib: d.memory_mib,
        vcpus: d.vcpus,
        mounts: d
            .mounts
            .iter()
            .map(|m| warren_core::vm::parse_mount(m, owner))
            .collect::<Result<Vec<_>, _>>()?,
    })
}

fn session_json(s: &SessionRecord) -> serde_json::Value {
    serde_json::json!({
        "session_id": s.id,
        "name": s.name,
        "source": s.source,
        "direct": s.direct,
        "workspace_dir": if s.direct { s.source.clone() } else { warren_session::workspace_dir(&s.dir) },
        "vm_id": s.vm_id,
        "created_unix": s.created_unix,
    })
}

fn warn(m: &str) {
    eprintln!("warning: {m}");
}

pub async fn session(cli: &Cli, cmd: &SessionCmd) -> Result<i32> {
    let w = open(cli, None)?;
    let ws = my_workspace();
    match cmd {
        SessionCmd::Create {
            repo,
            name,
            direct,
            devices: d,
            json,
        } => {
            let req = CreateSession {
                repo: repo.clone(),
                name: name.clone(),
                direct: *direct,
                devices: devices(d)?,
                owner: caller(),
                workspace: ws,
            };
            let (s, vm) = w.create_session(&req, &mut |m| warn(m)).await?;
            if *json {
                let mut v = session_json(&s);
                v["boot_ms"] = serde_json::json!(vm.boot_ms);
                println!("{v}");
            } else {
                println!("{} {} {}", s.id, s.name, vm.id);
            }
            Ok(0)
        }
        SessionCmd::List { json } => {
            let list = w.list_sessions(Some(&ws))?;
            if *json {
                let v: Vec<_> = list.iter().map(session_json).collect();
                println!("{}", serde_json::Value::Array(v));
            } else {
                println!("{:<18} {:<20} {:<17} SOURCE", "SESSION", "NAME", "VM");
                for s in &list {
                    println!(
                        "{:<18} {:<20} {:<17} {}{}",
                        s.id,
                        s.name,
                        s.vm_id.as_deref().unwrap_or("-"),
                        s.source.display(),
                        if s.direct { " (direct)" } else { "" }
                    );
                }
            }
            Ok(0)
        }
        SessionCmd::Status { session, json } => {
            let s = w.session(&ws, session)?;
            let r = w.session_retention(&s).await?;
            if *json {
                println!(
                    "{}",
                    serde_json::json!({"uncommitted": r.uncommitted, "unexported": r.unexported})
                );
            } else {
                println!("uncommitted paths: {}", r.uncommitted.len());
                for p in &r.uncommitted {
                    println!("  {p}");
                }
                println!("unexported commits: {}", r.unexported.len());
                for c in &r.unexported {
                    println!("  {c}");
                }
            }
            Ok(0)
        }
        SessionCmd::Export { session, branch } => {
            let s = w.session(&ws, session)?;
            let e = w.export_session(&s, branch.as_deref()).await?;
            println!(
                "{} -> {} ({} new commit(s))",
                e.refname, e.commit, e.new_commits
            );
            Ok(0)
        }
        SessionCmd::Delete { session, force } => {
            let s = w.session(&ws, session)?;
            w.delete_session(&s, *force).await?;
            println!("deleted {} ({})", s.id, s.name);
            Ok(0)
        }
    }
}

/// The project of the current directory: its canonical git toplevel, else the directory.
fn project_of(cwd: &Path) -> Result<PathBuf> {
    let out = std::process::Command::new("git")
        .args(["-c", "core.fsmonitor=false", "rev-parse", "--show-toplevel"])
        .current_dir(cwd)
        .stderr(std::process::Stdio::null())
        .output();
    let dir = match out {
        Ok(o) if o.status.success() => {
            PathBuf::from(String::from_utf8_lossy(&o.stdout).trim_end_matches('\n'))
        }
        _ => cwd.to_path_buf(),
    };
    dir.canonicalize()
        .with_context(|| format!("resolving {}", dir.display()))
}

/// The agent's program (CMD replaces a shell; for an agent, CMD are its arguments).
fn argv_for(agent: &str, command: &[String], tty: bool) -> Vec<String> {
    let program = match agent {
        "claude" => "claude",
        "codex" => "codex",
        "opencode" => "opencode",
        _ => {
            return if command.is_empty() {
                let mut v = vec!["bash".to_string()];
                if tty {
                    v.push("-il".into());
                }
                v
            } else {
                command.to_vec()
            };
        }
    };
    let mut v = vec![program.to_string()];
    v.extend(command.iter().cloned());
    v
}

/// The image a new session gets when `--image` is not given: the `agents` recipe (which
/// installs the agent CLIs) for an agent, else the engine's default (`dev`).
fn default_image_for(agent: Option<&str>) -> Option<&'static str> {
    match agent {
        Some("claude" | "codex" | "opencode") => Some("agents"),
        _ => None,
    }
}

/// Every agent keeps its state under the per-project directory mounted at
/// [`GUEST_AGENT_STATE`], never in the workspace.
fn agent_env() -> Vec<(String, String)> {
    let s = GUEST_AGENT_STATE;
    vec![
        ("CLAUDE_CONFIG_DIR".into(), format!("{s}/claude")),
        ("CODEX_HOME".into(), format!("{s}/codex")),
        ("XDG_CONFIG_HOME".into(), format!("{s}/config")),
        ("XDG_DATA_HOME".into(), format!("{s}/data")),
        ("XDG_STATE_HOME".into(), format!("{s}/state")),
        ("XDG_CACHE_HOME".into(), format!("{s}/cache")),
    ]
}

pub async fn run(cli: &Cli, args: &RunArgs) -> Result<i32> {
    let w = open(cli, None)?;
    let ws = my_workspace();
    let cwd = std::env::current_dir().context("current directory")?;
    let cwd = cwd.canonicalize().unwrap_or(cwd);
    let project = project_of(&cwd)?;
    let want = devices(&args.devices)?;
    let (s, vm) = match w.project_session(&ws, &project)? {
        Some(s) => {
            w.session_vm(&s, &want, args.recreate, &mut |m| warn(m))
                .await?
        }
        None => {
            let mut want = want;
            if want.image.is_none() {
                want.image = default_image_for(args.agent.as_deref()).map(str::to_string);
            }
            let req = CreateSession {
                repo: project.clone(),
                name: None,
                direct: args.direct,
                devices: want,
                owner: caller(),
                workspace: ws,
            };
            let (s, vm) = w.create_session(&req, &mut |m| warn(m)).await?;
            eprintln!("warren: session {} ({}) in VM {}", s.name, s.id, vm.id);
            (s, vm)
        }
    };
    let rel = cwd
        .strip_prefix(&project)
        .ok()
        .filter(|r| !r.as_os_str().is_empty())
        .map(|r| r.to_string_lossy().into_owned());
    let tty = std::io::stdin().is_terminal() && std::io::stdout().is_terminal();
    let agent = args.agent.as_deref().unwrap_or("shell");
    let argv = argv_for(agent, &args.command, tty);
    tracing::info!(session = %s.id, vm = %vm.id, ?argv, tty, "run");
    run_in(&w, &vm.id, argv, rel, tty).await
}

/// Runs `argv` in the VM attached to this terminal: on a guest pseudo-terminal when stdin
/// and stdout are terminals, otherwise with stdin streamed and stdout/stderr kept apart.
async fn run_in(
    w: &Warren,
    vm: &str,
    argv: Vec<String>,
    cwd: Option<String>,
    tty: bool,
) -> Result<i32> {
    let spec = warren_core::InteractiveSpec {
        argv,
        env: agent_env(),
        cwd,
        timeout_ms: None,
        tty,
    };
    Ok(w.interactive(vm, spec).await?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_default_image_for_agent_is_agents_recipe() {
        assert_eq!(default_image_for(Some("claude")), Some("agents"));
        assert_eq!(default_image_for(Some("opencode")), Some("agents"));
        assert_eq!(default_image_for(Some("shell")), None);
        assert_eq!(default_image_for(None), None);
    }

    #[test]
    fn test_argv_for_agents_and_shell() {
        assert_eq!(argv_for("shell", &[], true), vec!["bash", "-il"]);
        assert_eq!(argv_for("shell", &[], false), vec!["bash"]);
        let cmd = vec!["git".to_string(), "status".to_string()];
        assert_eq!(argv_for("shell", &cmd, false), cmd);
        assert_eq!(
            argv_for("claude", &["--version".to_string()], false),
            vec!["claude", "--version"]
        );
    }
}
