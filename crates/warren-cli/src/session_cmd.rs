//! `warren session ...` and `warren run`: sessions of the calling user (workspace
//! `local-<uid>`), acting on the state directory directly like the other user commands.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use warren_core::session::GUEST_AGENT_STATE;
use warren_core::{local_workspace, CreateSession, SessionDevices, SessionRecord, Warren};

use crate::cli::{Cli, DeviceArgs, RunArgs, SessionCmd};
use crate::client::Conn;
use crate::commands::open;
use crate::term::Term;

/// Said when `--template` (or `WARREN_TEMPLATES`) meets a session made by the service.
const TEMPLATE_VIA_SERVICE: &str = "through the service, the image's `template` setting decides whether the session's VM restores from a template; --template (WARREN_TEMPLATES) is not used";

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
        network: None,
        source_identity: None,
        objects_identity: None,
        storage_mib: d.storage_mib,
        template: d.template,
    })
}

/// A session as JSON: the same shape as the service's `session_*` tools return.
fn session_json(s: &SessionRecord) -> serde_json::Value {
    serde_json::to_value(warren_api::service::session_info(s)).unwrap_or_default()
}

/// The service to send session commands to: `--socket`, else the state directory's
/// socket when a service answers there.
async fn service_conn(cli: &Cli) -> Result<Option<Conn<tokio::net::UnixStream>>> {
    if let Some(path) = &cli.socket {
        return Ok(Some(Conn::unix(path).await?));
    }
    let state = cli
        .state_dir
        .clone()
        .unwrap_or_else(crate::commands::default_state_dir);
    let Some(sock) = crate::commands::state_socket(&state)? else {
        return Ok(None);
    };
    Ok(Conn::unix(&sock).await.ok())
}

/// `warren session ...` through the service (the same output as the direct path).
async fn session_via_service(
    mut c: Conn<tokio::net::UnixStream>,
    t: Term,
    cmd: &SessionCmd,
) -> Result<i32> {
    use serde_json::json;
    match cmd {
        SessionCmd::Create {
            repo,
            name,
            direct,
            devices: d,
            json,
        } => {
            if !d.mounts.is_empty() {
                anyhow::bail!("--mount is not available through the service");
            }
            if d.template {
                t.warn(TEMPLATE_VIA_SERVICE);
            }
            let repo = std::path::absolute(repo)
                .with_context(|| format!("resolving {}", repo.display()))?;
            let mut args = json!({"repo": repo, "direct": direct});
            for (k, v) in [
                ("name", name.as_ref().map(|n| json!(n))),
                ("image", d.image.as_ref().map(|n| json!(n))),
                ("memory_mib", d.memory_mib.map(|n| json!(n))),
                ("vcpus", d.vcpus.map(|n| json!(n))),
                ("storage_mib", d.storage_mib.map(|n| json!(n))),
            ] {
                if let Some(v) = v {
                    args[k] = v;
                }
            }
            let s = c.post("session_create", &args).await?;
            if *json {
                println!("{s}");
            } else {
                println!(
                    "{} {} {}",
                    s["session_id"].as_str().unwrap_or_default(),
                    t.field(s["name"].as_str().unwrap_or_default()),
                    s["vm_id"].as_str().unwrap_or("-")
                );
            }
        }
        SessionCmd::List { json } => {
            let v = c.post("session_list", &json!({})).await?;
            if *json {
                println!("{}", v["sessions"]);
            } else {
                let list = v["sessions"].as_array().map(Vec::as_slice).unwrap_or(&[]);
                print_session_table(t, list);
            }
        }
        SessionCmd::Status { session, json } => {
            let v = c
                .post("session_status", &json!({"session": session}))
                .await?;
            let list = |k: &str| -> Vec<String> {
                v[k].as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|x| x.as_str().map(str::to_string))
                    .collect()
            };
            let generation = v["generation"].as_u64().unwrap_or_default();
            print_retention(
                t,
                generation,
                &list("uncommitted"),
                &list("unexported"),
                *json,
            );
        }
        SessionCmd::Export { session, branch } => {
            let mut args = json!({"session": session});
            if let Some(b) = branch {
                args["branch"] = json!(b);
            }
            let v = c.post("session_export", &args).await?;
            println!(
                "{} -> {} ({} new commit(s))",
                t.field(v["refname"].as_str().unwrap_or_default()),
                v["commit"].as_str().unwrap_or_default(),
                v["new_commits"]
            );
        }
        SessionCmd::Delete { session, force } => {
            let v = c
                .post(
                    "session_delete",
                    &json!({"session": session, "force": force}),
                )
                .await?;
            println!("deleted {}", v["session_id"].as_str().unwrap_or_default());
        }
    }
    Ok(0)
}

fn print_session_table(t: Term, sessions: &[serde_json::Value]) {
    println!("{:<18} {:<20} {:<17} SOURCE", "SESSION", "NAME", "VM");
    for s in sessions {
        println!(
            "{:<18} {:<20} {:<17} {}{}",
            s["session_id"].as_str().unwrap_or_default(),
            t.field(s["name"].as_str().unwrap_or_default()),
            s["vm_id"].as_str().unwrap_or("-"),
            t.field(s["source"].as_str().unwrap_or_default()),
            if s["direct"].as_bool() == Some(true) {
                " (direct)"
            } else {
                ""
            }
        );
    }
}

/// The session's generation, then what deleting it would lose. The paths are the guest's
/// file names and the commits carry the guest's subjects: each is printed as one escaped
/// line.
fn print_retention(
    t: Term,
    generation: u64,
    uncommitted: &[String],
    unexported: &[String],
    json: bool,
) {
    if json {
        println!(
            "{}",
            serde_json::json!({"generation": generation, "uncommitted": uncommitted, "unexported": unexported})
        );
        return;
    }
    println!("generation: {generation}");
    println!("uncommitted paths: {}", uncommitted.len());
    for p in uncommitted {
        println!("  {}", t.field(p));
    }
    println!("unexported commits: {}", unexported.len());
    for c in unexported {
        println!("  {}", t.field(c));
    }
}

pub async fn session(cli: &Cli, cmd: &SessionCmd) -> Result<i32> {
    let t = Term::new(cli.raw);
    if let Some(conn) = service_conn(cli).await? {
        return session_via_service(conn, t, cmd).await;
    }
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
                limits: Default::default(),
                within: None,
            };
            let (s, vm) = w.create_session(&req, &mut |m| t.warn(m)).await?;
            if *json {
                let mut v = session_json(&s);
                v["boot_ms"] = serde_json::json!(vm.boot_ms);
                println!("{v}");
            } else {
                println!("{} {} {}", s.id, t.field(&s.name), vm.id);
            }
            Ok(0)
        }
        SessionCmd::List { json } => {
            let list = w.list_sessions(Some(&ws))?;
            let v: Vec<_> = list.iter().map(session_json).collect();
            if *json {
                println!("{}", serde_json::Value::Array(v));
            } else {
                print_session_table(t, &v);
            }
            Ok(0)
        }
        SessionCmd::Status { session, json } => {
            let s = w.session(&ws, session)?;
            let r = w.session_retention(&s).await?;
            print_retention(t, s.generation, &r.uncommitted, &r.unexported, *json);
            Ok(0)
        }
        SessionCmd::Export { session, branch } => {
            let s = w.session(&ws, session)?;
            let e = w.export_session(&s, branch.as_deref()).await?;
            println!(
                "{} -> {} ({} new commit(s))",
                t.field(&e.refname),
                e.commit,
                e.new_commits
            );
            Ok(0)
        }
        SessionCmd::Delete { session, force } => {
            let s = w.session(&ws, session)?;
            w.delete_session(&s, *force).await?;
            println!("deleted {} ({})", s.id, t.field(&s.name));
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

/// The agent's program (CMD replaces a shell; for an agent, CMD are its arguments). An agent
/// starts through [`agent_launch`]: with `browser`, it names the image's browser MCP server
/// in the agent's configuration when the guest has it.
fn argv_for(agent: &str, command: &[String], tty: bool, browser: bool) -> Vec<String> {
    let Some(script) = agent_launch(agent, browser) else {
        return if command.is_empty() {
            let mut v = vec!["bash".to_string()];
            if tty {
                v.push("-il".into());
            }
            v
        } else {
            command.to_vec()
        };
    };
    let mut v = vec![
        "sh".to_string(),
        "-c".to_string(),
        script,
        agent.to_string(),
    ];
    v.extend(command.iter().cloned());
    v
}

/// The script that starts `agent` (`sh -c SCRIPT AGENT ARGS...`): Codex's home directory is
/// made first (Codex refuses to start when `CODEX_HOME` does not exist, and a fresh
/// project's `/agent-state` is empty), then [`browser_launch`]'s script, or the agent alone
/// without `browser`. `None` for anything but the three agents.
fn agent_launch(agent: &str, browser: bool) -> Option<String> {
    let script = match browser {
        true => browser_launch(agent)?,
        false => {
            if !matches!(agent, "claude" | "codex" | "opencode") {
                return None;
            }
            format!("exec {agent} \"$@\"")
        }
    };
    Some(match agent {
        "codex" => format!("[ -z \"$CODEX_HOME\" ] || mkdir -p \"$CODEX_HOME\"; {script}"),
        _ => script,
    })
}

/// A shell script (run as `sh -c SCRIPT AGENT ARGS...`) that starts `agent` with ARGS and,
/// when the guest has the `agents` image's browser block (`warren_image::browser`), the
/// Chrome DevTools MCP server in its configuration, with startup and call limits that leave
/// room for a browser on a slow or emulated CPU: Claude Code by `--mcp-config=` (the `=`
/// form, so the option takes one value and a prompt after it stays a prompt) and
/// `MCP_TIMEOUT` 60 s unless set, Codex by `-c` overrides (the command, a 120 s startup and a
/// 300 s call limit), opencode by `OPENCODE_CONFIG` (merged with the user's own
/// configuration; the file sets its limit). Decided in the guest, so it is the same in
/// process and through the service. `None` for anything but the three agents.
fn browser_launch(agent: &str) -> Option<String> {
    use warren_image::browser::{MCP_CONFIG, MCP_WRAPPER, OPENCODE_CONFIG, SERVER_NAME};
    let with = match agent {
        "claude" => format!(
            "MCP_TIMEOUT=\"${{MCP_TIMEOUT:-60000}}\" exec claude --mcp-config={MCP_CONFIG} \"$@\""
        ),
        "codex" => format!(
            "exec codex -c 'mcp_servers.{SERVER_NAME}.command=\"{MCP_WRAPPER}\"' \
             -c mcp_servers.{SERVER_NAME}.startup_timeout_sec=120 \
             -c mcp_servers.{SERVER_NAME}.tool_timeout_sec=300 \"$@\""
        ),
        "opencode" => format!("OPENCODE_CONFIG={OPENCODE_CONFIG} exec opencode \"$@\""),
        _ => return None,
    };
    let probe = match agent {
        "codex" => format!("[ -x {MCP_WRAPPER} ]"),
        "claude" => format!("[ -f {MCP_CONFIG} ]"),
        _ => format!("[ -f {OPENCODE_CONFIG} ]"),
    };
    Some(format!("if {probe}; then {with}; fi; exec {agent} \"$@\""))
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
    let t = Term::new(cli.raw);
    let cwd = std::env::current_dir().context("current directory")?;
    let cwd = cwd.canonicalize().unwrap_or(cwd);
    let project = project_of(&cwd)?;
    let mut want = devices(&args.devices)?;
    let agent = args.agent.as_deref().unwrap_or("shell");
    let state = cli
        .state_dir
        .clone()
        .unwrap_or_else(crate::commands::default_state_dir);
    let wiring = wire_credentials(t, &state, args, agent, &project, &want)?;
    // Through the service when one listens, unless host credentials are to be wired (the
    // service takes no credential files from a caller), the VM is to be recreated or host
    // directories mounted: those stay in this process, which has the engine's full reach.
    let in_process = wiring.is_some() || args.recreate || !args.devices.mounts.is_empty();
    let opener = match in_process {
        false => {
            crate::stream_link::Opener::new(cli, &crate::stream_link::ServiceArgs::default())
                .await?
        }
        true => crate::stream_link::Opener::Local(Box::new(open(cli, None)?)),
    };
    let w = match opener {
        crate::stream_link::Opener::Local(w) => w,
        remote => return run_via_service(t, &remote, args, agent, &project, &cwd).await,
    };
    let ws = my_workspace();
    if let Some(wired) = &wiring {
        want.network = Some(wired.network.clone());
    }
    let (s, vm) = match w.project_session(&ws, &project)? {
        Some(s) => {
            w.session_vm(&s, &want, args.recreate, &mut |m| t.warn(m))
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
                limits: Default::default(),
                within: None,
            };
            let (s, vm) = w.create_session(&req, &mut |m| t.warn(m)).await?;
            eprintln!(
                "warren: session {} ({}) in VM {}",
                t.field(&s.name),
                s.id,
                vm.id
            );
            (s, vm)
        }
    };
    let rel = cwd
        .strip_prefix(&project)
        .ok()
        .filter(|r| !r.as_os_str().is_empty())
        .map(|r| r.to_string_lossy().into_owned());
    if let Some(wiring) = &wiring {
        let state = w.session_agent_state(&s);
        crate::agents::write_files(&state, &wiring.files, (s.owner_uid, s.owner_gid))?;
    }
    let tty = std::io::stdin().is_terminal() && std::io::stdout().is_terminal();
    let argv = argv_for(agent, &args.command, tty, !args.no_browser);
    let mut env = agent_env();
    if let Some(wiring) = wiring {
        env.extend(wiring.env);
    }
    tracing::info!(session = %s.id, vm = %vm.id, ?argv, tty, "run");
    run_in(&w, &vm.id, argv, env, rel, tty).await
}

/// `warren run` through the service: the project's session of the caller's workspace (made
/// with `session_create` the first time), then the agent on a terminal over the service's
/// WebSocket, as `warren vm exec -t` (`crate::remote_exec`).
async fn run_via_service(
    t: Term,
    opener: &crate::stream_link::Opener,
    args: &RunArgs,
    agent: &str,
    project: &Path,
    cwd: &Path,
) -> Result<i32> {
    use serde_json::json;
    let d = &args.devices;
    let mut tools = opener.tools(None).await?;
    let list = tools.post("session_list", &json!({})).await?;
    let source = project.to_string_lossy();
    let existing = list["sessions"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|s| s["source"].as_str() == Some(&*source))
        .cloned();
    let session = match existing {
        Some(s) => {
            let devices_given = d.image.is_some()
                || d.memory_mib.is_some()
                || d.vcpus.is_some()
                || d.storage_mib.is_some();
            if devices_given {
                anyhow::bail!(
                    "through the service a session's VM keeps its devices: device options apply \
                     when the session is created (or with --recreate, run in process)"
                );
            }
            s
        }
        None => {
            if d.template {
                t.warn(TEMPLATE_VIA_SERVICE);
            }
            let mut req = json!({"repo": project, "direct": args.direct});
            let image = d
                .image
                .clone()
                .or_else(|| default_image_for(args.agent.as_deref()).map(str::to_string));
            for (k, v) in [
                ("image", image.map(|n| json!(n))),
                ("memory_mib", d.memory_mib.map(|n| json!(n))),
                ("vcpus", d.vcpus.map(|n| json!(n))),
                ("storage_mib", d.storage_mib.map(|n| json!(n))),
            ] {
                if let Some(v) = v {
                    req[k] = v;
                }
            }
            let s = tools.post("session_create", &req).await?;
            eprintln!(
                "warren: session {} ({}) in VM {}",
                t.field(s["name"].as_str().unwrap_or_default()),
                s["session_id"].as_str().unwrap_or_default(),
                s["vm_id"].as_str().unwrap_or_default()
            );
            s
        }
    };
    let vm = session["vm_id"].as_str().with_context(|| {
        format!(
            "session {} has no VM",
            session["name"].as_str().unwrap_or_default()
        )
    })?;
    let rel = cwd
        .strip_prefix(project)
        .ok()
        .filter(|r| !r.as_os_str().is_empty())
        .map(|r| r.to_string_lossy().into_owned());
    let tty = std::io::stdin().is_terminal() && std::io::stdout().is_terminal();
    let req = crate::remote_exec::ExecRequest {
        vm: vm.to_string(),
        argv: argv_for(agent, &args.command, tty, !args.no_browser),
        env: agent_env(),
        cwd: rel,
        timeout_ms: None,
        stdin: None,
        mode: if tty {
            crate::remote_exec::Mode::Tty
        } else {
            crate::remote_exec::Mode::Pipe
        },
        detach: false,
    };
    crate::remote_exec::exec(opener, None, req).await
}

/// The network the run asks for: the `--egress` file's settings plus, for each agent whose
/// credentials are wired, its provider hosts, file-backed secrets and refresh rules. `None`
/// when the run asks for no network.
fn wire_credentials(
    t: Term,
    state: &Path,
    args: &RunArgs,
    agent: &str,
    project: &Path,
    devices: &SessionDevices,
) -> Result<Option<crate::agents::Wiring>> {
    use crate::agents::Provider;
    use crate::host_keys::KeyKind;
    // An agent gets every credential the host has, the same set whichever agent runs, so all
    // agents of a project share its VM (opencode talks to either provider).
    let (providers, keys): (Vec<Provider>, Vec<KeyKind>) = if args.no_credentials {
        (Vec::new(), Vec::new())
    } else if !args.credentials.is_empty() {
        let (mut v, mut k) = (Vec::new(), Vec::new());
        for c in &args.credentials {
            match (Provider::parse(c), KeyKind::parse(c)) {
                (Some(p), _) if !v.contains(&p) => v.push(p),
                (_, Some(kind)) if !k.contains(&kind) => k.push(kind),
                _ => {}
            }
        }
        (v, k)
    } else if matches!(agent, "claude" | "codex" | "opencode") {
        (
            vec![Provider::Claude, Provider::Codex, Provider::Opencode],
            KeyKind::ALL.to_vec(),
        )
    } else {
        (Vec::new(), Vec::new())
    };
    let mode = crate::egress_file::parse_mode(args.network.as_deref().filter(|m| *m != "off"))?;
    if args.network.as_deref() == Some("off") {
        if !providers.is_empty() || !keys.is_empty() || args.egress.is_some() {
            anyhow::bail!(
                "--network off: wired credentials and --egress need a network \
                 (add --no-credentials, drop --egress)"
            );
        }
        return Ok(None);
    }
    if providers.is_empty() && keys.is_empty() && args.network.is_none() && args.egress.is_none() {
        return Ok(None);
    }
    let mut mounted: Vec<PathBuf> = devices.mounts.iter().map(|m| m.host.clone()).collect();
    if args.direct {
        mounted.push(project.to_path_buf());
    }
    let home = caller_home()?;
    let mut wiring =
        crate::agents::wire(&providers, &home, caller(), &mounted, &mut |m| t.warn(m))?;
    let user = crate::user_config::load(&home)?;
    let sources = crate::host_keys::HostSources {
        home: &home,
        files: &user.credentials,
        store: state.join("credentials").join(my_workspace()),
        owner: caller(),
        mounted: &mounted,
    };
    for k in crate::host_keys::wire(&keys, &sources, &mut wiring.network, &mut wiring.env)? {
        tracing::info!(credential = k.kind.name(), origin = ?k.origin, "wired");
    }
    if let Some(file) = &args.egress {
        let mut net = crate::egress_file::load(file)?;
        net.allow.append(&mut wiring.network.allow);
        net.secrets.append(&mut wiring.network.secrets);
        net.intercepts.append(&mut wiring.network.intercepts);
        wiring.network = net;
    }
    wiring.network.mode = mode;
    Ok(Some(wiring))
}

/// The calling user's home: `$HOME`, else the password database's entry.
fn caller_home() -> Result<PathBuf> {
    if let Some(h) = std::env::var_os("HOME").filter(|h| !h.is_empty()) {
        return Ok(PathBuf::from(h));
    }
    let uid = nix::unistd::getuid();
    nix::unistd::User::from_uid(uid)
        .ok()
        .flatten()
        .map(|u| u.dir)
        .with_context(|| format!("no home directory for uid {uid}"))
}

/// Runs `argv` in the VM attached to this terminal: on a guest pseudo-terminal when stdin
/// and stdout are terminals, otherwise with stdin streamed and stdout/stderr kept apart.
async fn run_in(
    w: &Warren,
    vm: &str,
    argv: Vec<String>,
    env: Vec<(String, String)>,
    cwd: Option<String>,
    tty: bool,
) -> Result<i32> {
    let spec = warren_core::InteractiveSpec {
        argv,
        env,
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
        assert_eq!(argv_for("shell", &[], true, true), vec!["bash", "-il"]);
        assert_eq!(argv_for("shell", &[], false, true), vec!["bash"]);
        let cmd = vec!["git".to_string(), "status".to_string()];
        assert_eq!(argv_for("shell", &cmd, false, true), cmd);
        let claude = argv_for("claude", &["--version".to_string()], false, true);
        assert_eq!(claude[..2], ["sh", "-c"]);
        assert_eq!(claude[3..], ["claude", "--version"]);
        // --no-browser: the agent itself (Codex after making its home).
        let claude = argv_for("claude", &["--version".to_string()], false, false);
        assert_eq!(claude[2], "exec claude \"$@\"");
        let codex = argv_for("codex", &["--version".to_string()], false, false);
        assert_eq!(
            codex[2],
            "[ -z \"$CODEX_HOME\" ] || mkdir -p \"$CODEX_HOME\"; exec codex \"$@\""
        );
    }

    /// The launch scripts, run by a real `sh` with stand-in agents and browser files: each
    /// agent gets the browser's MCP server only when the files are there, and its own
    /// arguments unchanged either way.
    #[test]
    fn test_browser_launch_scripts_under_sh() {
        let dir = tempfile::tempdir().expect("tempdir");
        let bin = dir.path().join("bin");
        std::fs::create_dir(&bin).expect("bin");
        for agent in ["claude", "codex", "opencode"] {
            let p = bin.join(agent);
            std::fs::write(
                &p,
                "#!/bin/sh\nprintf '%s|' \"$OPENCODE_CONFIG\" \"$MCP_TIMEOUT\" \"$@\"\n",
            )
            .expect("write");
            std::fs::set_permissions(&p, std::os::unix::fs::PermissionsExt::from_mode(0o755))
                .expect("chmod");
        }
        let root = dir.path().join("root");
        let run = |agent: &str, with_files: bool| -> String {
            let script = agent_launch(agent, true).expect("script");
            // The guest paths, moved under a scratch root for the test.
            let script = script.replace("/etc/warren/", &format!("{}/etc/", root.display()));
            let script = script.replace(
                "[ -x /usr/local/bin/",
                &format!("[ -x {}/bin/", root.display()),
            );
            let _ = std::fs::remove_dir_all(&root);
            if with_files {
                std::fs::create_dir_all(root.join("etc")).expect("etc");
                std::fs::create_dir_all(root.join("bin")).expect("bin");
                for f in [
                    "etc/mcp.json",
                    "etc/opencode.json",
                    "bin/warren-browser-mcp",
                ] {
                    std::fs::write(root.join(f), "x").expect("write");
                }
                std::fs::set_permissions(
                    root.join("bin/warren-browser-mcp"),
                    std::os::unix::fs::PermissionsExt::from_mode(0o755),
                )
                .expect("chmod");
            }
            let out = std::process::Command::new("sh")
                .args([
                    "-c",
                    &script,
                    agent,
                    "a prompt",
                    "--flag",
                    "",
                    "a'b \"c\"",
                    "$(id)",
                    "--",
                ])
                .env("PATH", format!("{}:/usr/bin:/bin", bin.display()))
                .env_remove("OPENCODE_CONFIG")
                .env_remove("MCP_TIMEOUT")
                .env_remove("CODEX_HOME")
                .output()
                .expect("sh");
            assert!(out.status.success(), "{out:?}");
            String::from_utf8(out.stdout).expect("utf-8")
        };
        let args = "a prompt|--flag||a'b \"c\"|$(id)|--|";
        assert_eq!(run("claude", false), format!("||{args}"));
        assert_eq!(
            run("claude", true),
            format!("|60000|--mcp-config={}/etc/mcp.json|{args}", root.display())
        );
        assert_eq!(run("codex", false), format!("||{args}"));
        assert_eq!(
            run("codex", true),
            format!(
                "||-c|mcp_servers.chrome-devtools.command=\"/usr/local/bin/warren-browser-mcp\"|\
                 -c|mcp_servers.chrome-devtools.startup_timeout_sec=120|\
                 -c|mcp_servers.chrome-devtools.tool_timeout_sec=300|{args}"
            )
        );
        assert_eq!(run("opencode", false), format!("||{args}"));
        assert_eq!(
            run("opencode", true),
            format!("{}/etc/opencode.json||{args}", root.display())
        );
        assert_eq!(browser_launch("shell"), None);
        assert_eq!(agent_launch("shell", false), None);
    }
}
