//! Command implementations: thin adapters from arguments to `warren_core` actions.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use warren_core::output::{self, Cursor, Encoding};
use warren_core::store::VmRecord;
use warren_core::workspace_ops::{parse_version, version_hex};
use warren_core::{CreateVm, Warren, WarrenConfig};
use warren_protocol::{
    EditFile, ExecStart, GlobRequest, GrepRequest, JobId, JobOutputRequest, JobState, Precondition,
};
use warren_vmm::AccelChoice;

use crate::cli::{Cli, Command, TokenCmd, VmCmd};
use crate::progress::Progress;
use crate::term::Term;

/// Exit code for any Warren error (as opposed to the command's own code).
pub const EXIT_WARREN_ERROR: i32 = 125;
/// Exit code when `--timeout` killed the command (as coreutils' `timeout`).
pub const EXIT_TIMEOUT: i32 = 124;
/// How long a service given systemd's sockets waits before it exits on a start-up error.
const ACTIVATED_FAILURE_HOLD: std::time::Duration = std::time::Duration::from_secs(5);

pub fn run(cli: Cli) -> Result<i32> {
    if let Command::Supervise { vm_dir } = &cli.command {
        // The VM's egress holds up to two descriptors per guest connection (256 at once,
        // `warren_egress::MAX_CONNECTIONS`) beside QEMU's and the channel's: a supervisor
        // started by systemd would otherwise keep its default soft limit of 1024.
        raise_nofile_limit();
        warren_supervisor::run(vm_dir.clone()).context("supervisor")?;
        return Ok(0);
    }
    if let Command::InterceptRefresh { sources } = &cli.command {
        return crate::refresh::intercept_refresh(sources);
    }
    match &cli.command {
        Command::Completions { shell } => return crate::docs_gen::completions(*shell),
        Command::ManPages { out_dir } => return crate::docs_gen::man_pages(out_dir),
        Command::SystemdGenerator {
            normal_dir, config, ..
        } => return crate::generator::run(config, normal_dir),
        _ => {}
    }
    let rt = || {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
    };
    if let Command::Serve { config } = &cli.command {
        // Before the runtime's threads: taking them unsets LISTEN_* and NOTIFY_SOCKET in the
        // environment.
        let passed = warren_api::activation::take();
        let notify = warren_api::activation::take_notify();
        let activated = !matches!(passed, Ok(None));
        let served = match passed {
            Ok(inherited) => {
                let runtime = rt()?;
                let served = runtime.block_on(serve(config, inherited, notify));
                // The stop has waited for the calls it waits for: blocking work still running
                // (a session's git, a tree's removal) is not waited for without end.
                runtime.shutdown_timeout(std::time::Duration::from_secs(5));
                served
            }
            Err(e) => Err(e.into()),
        };
        if served.is_err() && activated {
            // systemd holds the port meanwhile (its own copies of the sockets). A service
            // that fails to start (some causes are other users': the disk's free space) is
            // started again at the next connection: this keeps that loop slow.
            std::thread::sleep(ACTIVATED_FAILURE_HOLD);
        }
        return served;
    }
    rt()?.block_on(run_async(cli))
}

/// Raises the soft open-file limit to the hard one (a failure keeps the soft limit: logged).
fn raise_nofile_limit() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let raised = getrlimit(Resource::RLIMIT_NOFILE).and_then(|(soft, hard)| {
        if soft < hard {
            setrlimit(Resource::RLIMIT_NOFILE, hard, hard)?;
        }
        Ok(hard)
    });
    if let Err(e) = raised {
        tracing::warn!(error = %e, "could not raise the open-file limit");
    }
}

pub(crate) fn default_state_dir() -> PathBuf {
    if let Some(x) = std::env::var_os("XDG_STATE_HOME") {
        return PathBuf::from(x).join("warren");
    }
    if nix::unistd::geteuid().is_root() {
        return PathBuf::from("/var/lib/warren");
    }
    let home = std::env::var_os("HOME").unwrap_or_else(|| "/tmp".into());
    PathBuf::from(home).join(".local/state/warren")
}

/// The service socket of state directory `state` (`warrend.sock`), `None` when the directory
/// does not exist. Refused, like `Warren::open` refuses the directory, unless the directory and
/// its parents are the user's or root's (`warren_core::trusted_dir`): whatever listens in a
/// directory another user controls (`/tmp/.local/state/warren` without `$HOME`, an inherited
/// `$XDG_STATE_HOME`) could be theirs, and would get the requests and uploads meant for the
/// service.
pub(crate) fn state_socket(state: &std::path::Path) -> Result<Option<PathBuf>> {
    if !state.exists() {
        return Ok(None);
    }
    warren_core::trusted_dir::check(state)?;
    Ok(Some(state.join("warrend.sock")))
}

pub(crate) fn open(cli: &Cli, accel: Option<&str>) -> Result<Warren> {
    let state = cli.state_dir.clone().unwrap_or_else(default_state_dir);
    let exe = std::env::current_exe().context("locating the warren binary")?;
    let mut cfg = WarrenConfig::new(state, exe);
    if let Some(d) = &cli.image_dir {
        cfg.image_dir = d.clone();
    }
    if let Some(a) = accel {
        cfg.accel = a
            .parse::<AccelChoice>()
            .map_err(warren_core::CoreError::from)?;
    }
    Ok(Warren::open(cfg)?)
}

async fn run_async(cli: Cli) -> Result<i32> {
    match &cli.command {
        Command::Image(cmd) => crate::image_cmd::image(&cli, cmd).await,
        Command::Vm(cmd) => vm(&cli, cmd).await,
        Command::Preflight { json } => crate::preflight_cmd::preflight(&cli, *json),
        Command::Bench(args) if args.suite == "suspend" => {
            crate::bench_suspend::run(&cli, args).await
        }
        Command::Bench(args) if args.suite == "workspace" => {
            crate::bench_workspace::run(&cli, args).await
        }
        Command::Bench(args) if args.suite == "network" => {
            crate::bench_network::run(&cli, args).await
        }
        Command::Bench(args) if args.suite == "load" => crate::bench_load::run(&cli, args).await,
        Command::Bench(args) if args.suite == "streams" => {
            crate::bench_streams::run(&cli, args).await
        }
        Command::Bench(args) if args.suite == "instant" => {
            crate::bench_instant::run(&cli, args).await
        }
        Command::Bench(args) if args.suite == "image" => {
            crate::bench_image::run_bench(&cli, args).await
        }
        Command::Bench(args) if args.suite == "service" => {
            crate::bench_service::run(&cli, args).await
        }
        Command::Bench(args) => crate::bench::run(&cli, args).await,
        Command::Token(cmd) => token(&cli, cmd),
        Command::Session(cmd) => crate::session_cmd::session(&cli, cmd).await,
        Command::Run(args) => crate::session_cmd::run(&cli, args).await,
        Command::Shutdown { config, .. } => shutdown(&cli, config.as_deref()).await,
        Command::Attach {
            vm,
            port,
            ignore_stdin_eof,
            service,
        } => crate::stream_cmd::attach(&cli, service, vm, *port, *ignore_stdin_eof).await,
        Command::PortForward {
            vm,
            ports,
            allow_other_users,
            service,
        } => crate::stream_cmd::port_forward(&cli, service, vm, ports, *allow_other_users).await,
        Command::Supervise { .. }
        | Command::InterceptRefresh { .. }
        | Command::Completions { .. }
        | Command::Serve { .. }
        | Command::SystemdGenerator { .. }
        | Command::ManPages { .. } => {
            unreachable!("handled before the runtime starts")
        }
    }
}

async fn serve(
    config: &std::path::Path,
    inherited: Option<warren_api::activation::Inherited>,
    notify: Option<warren_api::activation::Notify>,
) -> Result<i32> {
    let cfg = warren_api::config::ServiceConfig::load(config)?;
    let exe = std::env::current_exe().context("locating the warren binary")?;
    warren_api::serve::serve(cfg, exe, inherited, |b| {
        println!(
            "warrend: serving http://{}/mcp and /v1/tools, local socket {}",
            b.http,
            b.socket.display()
        );
        let _ = std::io::stdout().flush();
        if let Some(Err(e)) = notify.map(|n| n.ready()) {
            tracing::warn!(error = %e, "cannot tell systemd the service is ready");
        }
    })
    .await?;
    Ok(0)
}

async fn shutdown(cli: &Cli, config: Option<&std::path::Path>) -> Result<i32> {
    // The service's state and image directories, as `warren serve --config` uses them. At
    // host shutdown a configuration the service would refuse (say, no image configured yet)
    // must not keep VMs the CLI started from being hibernated: it is reported, and the
    // global options (default: the default state directory) are used instead.
    let svc = config.and_then(|path| match warren_api::config::ServiceConfig::load(path) {
        Ok(svc) => Some(svc),
        Err(e) => {
            eprintln!(
                "warning: {e:#}; hibernating the VMs of {} instead",
                cli.state_dir
                    .clone()
                    .unwrap_or_else(default_state_dir)
                    .display()
            );
            None
        }
    });
    let w = match svc {
        Some(svc) => {
            let exe = std::env::current_exe().context("locating the warren binary")?;
            let mut cfg = WarrenConfig::new(svc.state_dir.clone(), exe);
            cfg.image_dir = svc.image_dir();
            Warren::open(cfg)?
        }
        None => open(cli, None)?,
    };
    let t = Term::new(cli.raw);
    let mut failed = 0;
    for vm in w.list_vms()? {
        if !matches!(
            vm.state,
            warren_core::store::VmState::Running | warren_core::store::VmState::Paused
        ) {
            continue;
        }
        let progress = Progress::steps(format!("vm {}", vm.id));
        progress.step("hibernating");
        match w
            .suspend_vm(&vm.id, warren_core::SuspendMode::Hibernate, true)
            .await
        {
            Ok(r) => progress.finish(Some(r.state.as_str())),
            Err(e) => {
                failed += 1;
                eprintln!(
                    "{}: error[{}]: {}",
                    vm.id,
                    e.code(),
                    t.text(&format!("{e:#}"))
                );
            }
        }
    }
    Ok(if failed == 0 { 0 } else { EXIT_WARREN_ERROR })
}

fn token(cli: &Cli, cmd: &TokenCmd) -> Result<i32> {
    let state = cli.state_dir.clone().unwrap_or_else(default_state_dir);
    std::fs::create_dir_all(&state).with_context(|| format!("creating {}", state.display()))?;
    // As `Warren::open`: a state directory another user controls (an inherited
    // XDG_STATE_HOME) is refused before a credential is written into it.
    warren_core::trusted_dir::check(&state)?;
    let creds = warren_api::auth::Credentials::open(&state.join("warren.db"))?;
    match cmd {
        TokenCmd::Issue {
            workspace,
            output,
            ttl,
            allow_network,
            allow_internet,
            images,
            max_vms,
            max_memory_mib,
            max_storage_mib,
        } => {
            if let Some(bad) = images
                .iter()
                .find(|i| !warren_api::config::valid_image_name(i))
            {
                bail!("--image {bad:?} is not an image name");
            }
            let req = warren_api::auth::PolicyRequest {
                allow_network: (*allow_network || *allow_internet).then_some(true),
                allow_internet: allow_internet.then_some(true),
                images: (!images.is_empty()).then(|| images.clone()),
                max_vms: *max_vms,
                max_memory_mib: *max_memory_mib,
                max_storage_mib: *max_storage_mib,
            };
            let (info, secret) = creds.issue(workspace, *ttl, &req)?;
            if let Err(e) = warren_api::auth::write_token_file(output, &secret) {
                // Never leave a valid token nobody holds.
                let _ = creds.revoke(&info.id);
                return Err(e).with_context(|| format!("writing {}", output.display()));
            }
            eprintln!(
                "issued {} for workspace {} into {}",
                info.id,
                info.workspace,
                output.display()
            );
            Ok(0)
        }
        TokenCmd::List { json } => {
            let list = creds.list()?;
            if *json {
                println!("{}", serde_json::to_string_pretty(&list)?);
            } else {
                println!("{:<18} {:<24} {:<12} STATUS", "ID", "WORKSPACE", "EXPIRES");
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_secs())
                    .unwrap_or(0);
                for t in list {
                    let status = if t.revoked {
                        "revoked"
                    } else if t.expires_unix.is_some_and(|e| e <= now) {
                        "expired"
                    } else {
                        "active"
                    };
                    let exp = t
                        .expires_unix
                        .map(|e| format!("in {}s", e.saturating_sub(now)))
                        .unwrap_or_else(|| "never".into());
                    println!("{:<18} {:<24} {:<12} {status}", t.id, t.workspace, exp);
                }
            }
            Ok(0)
        }
        TokenCmd::Revoke { id } => {
            creds.revoke(id)?;
            eprintln!("revoked {id}");
            Ok(0)
        }
        TokenCmd::RevokeWorkspace { workspace } => {
            let n = creds.revoke_workspace(workspace)?;
            eprintln!("revoked {n} active token(s) of workspace {workspace}");
            Ok(0)
        }
        TokenCmd::AllowInternet { workspace, off } => {
            creds.set_internet(workspace, !*off)?;
            if *off {
                eprintln!("workspace {workspace} no longer has the internet grant");
            } else {
                eprintln!("workspace {workspace} has the internet grant (and networking)");
            }
            Ok(0)
        }
    }
}

/// `off`, or the mode (`allowlist`/`internet`) with the allow list's length and the
/// secrets' and rules' counts.
fn network_summary(net: Option<&warren_vmm::NetSpec>) -> String {
    match net {
        None => "off".into(),
        Some(n) => format!(
            "{}:{}a/{}s/{}r",
            n.mode.as_str(),
            n.allow.len(),
            n.secrets.len(),
            n.intercepts.len()
        ),
    }
}

fn print_vms(w: &Warren, t: Term, list: &[VmRecord], json: bool) -> Result<()> {
    if json {
        let mut v = serde_json::to_value(list)?;
        for (item, r) in v.as_array_mut().into_iter().flatten().zip(list) {
            let net = w.vm_network(&r.id);
            item["network"] = match &net {
                None => serde_json::json!("off"),
                Some(n) => serde_json::json!({
                    "mode": n.mode.as_str(),
                    "host_ca_store": n.host_ca_store,
                    "allow": n.allow,
                    "deny": n.deny,
                    "blocked_cidrs": n.blocked_cidrs,
                    "intercept_all_tls": n.intercept_all_tls,
                    "secrets": n.secrets.iter().map(|s| &s.name).collect::<Vec<_>>(),
                    "intercepts": n.intercepts.iter().map(|i| format!("{} {} {}", i.method, i.host, i.path_prefix)).collect::<Vec<_>>(),
                }),
            };
        }
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!(
        "{:<16} {:<9} {:<5} {:>6} {:>5} {:<14} {:<16} REASON",
        "VM", "STATE", "ACCEL", "MiB", "VCPU", "IMAGE", "NET"
    );
    for r in list {
        println!(
            "{:<16} {:<9} {:<5} {:>6} {:>5} {:<14} {:<16} {}",
            r.id,
            r.state.as_str(),
            r.accel,
            r.memory_mib,
            r.vcpus,
            &r.image_id[..r.image_id.len().min(12)],
            network_summary(w.vm_network(&r.id).as_ref()),
            // The failure reason can quote the guest's console.
            t.field(
                r.reason
                    .as_deref()
                    .unwrap_or("")
                    .lines()
                    .next()
                    .unwrap_or("")
            )
        );
    }
    Ok(())
}

async fn vm(cli: &Cli, cmd: &VmCmd) -> Result<i32> {
    let t = Term::new(cli.raw);
    match cmd {
        VmCmd::Create {
            image,
            memory_mib,
            vcpus,
            idle_seconds,
            idle_mode,
            mounts,
            ram_file,
            template,
            network,
            egress,
            accel,
            json,
        } => {
            let network =
                crate::egress_file::network_request(network.as_deref(), egress.as_deref())?;
            let owner = (
                nix::unistd::getuid().as_raw(),
                nix::unistd::getgid().as_raw(),
            );
            let mounts = mounts
                .iter()
                .map(|m| warren_core::vm::parse_mount(m, owner))
                .collect::<Result<Vec<_>, _>>()?;
            let w = open(cli, Some(&accel.accel))?;
            let req = CreateVm {
                mounts,
                ram_file: *ram_file,
                template: *template,
                network,
                image: image.clone(),
                memory_mib: *memory_mib,
                vcpus: *vcpus,
                idle_seconds: *idle_seconds,
                idle_mode: idle_mode
                    .as_deref()
                    .and_then(warren_core::SuspendMode::parse),
                ..Default::default()
            };
            let rec = w.create_vm(&req, &mut |m| t.warn(m)).await?;
            if *json {
                println!(
                    "{}",
                    serde_json::json!({ "vm_id": rec.id, "boot_ms": rec.boot_ms, "accel": rec.accel })
                );
            } else {
                println!("{}", rec.id);
            }
            Ok(0)
        }
        VmCmd::Cp {
            src,
            dst,
            max_mib,
            idle_timeout,
            service,
        } => crate::cp_cmd::cp(cli, service, src, dst, *max_mib, *idle_timeout).await,
        VmCmd::List { json } => {
            let w = open(cli, None)?;
            print_vms(&w, t, &w.list_vms()?, *json)?;
            Ok(0)
        }
        VmCmd::Exec {
            vm,
            timeout,
            cwd,
            env,
            stdin,
            tty,
            interactive,
            detach,
            service,
            command,
        } => {
            let opener = crate::stream_link::Opener::new(cli, service).await?;
            let env = env
                .iter()
                .map(|kv| {
                    kv.split_once('=')
                        .map(|(k, v)| (k.to_string(), v.to_string()))
                        .ok_or_else(|| {
                            warren_core::CoreError::InvalidArgument(format!(
                                "--env takes NAME=VALUE, got {kv:?}"
                            ))
                        })
                })
                .collect::<Result<Vec<_>, _>>()?;
            let timeout_ms = match timeout {
                Some(t) if !(t.is_finite() && *t > 0.0) => {
                    return Err(warren_core::CoreError::InvalidArgument(format!(
                        "--timeout must be a positive number of seconds, got {t}"
                    ))
                    .into())
                }
                Some(t) => Some((t * 1000.0) as u64),
                None => None,
            };
            let w = match opener {
                crate::stream_link::Opener::Local(w) => w,
                remote => {
                    // Through the service: live output over its WebSocket, no polling.
                    let stdin_data = if *stdin {
                        let mut buf = Vec::new();
                        std::io::Read::read_to_end(&mut std::io::stdin(), &mut buf)?;
                        Some(buf)
                    } else {
                        None
                    };
                    let mode = match (*tty, *interactive) {
                        (true, _) => crate::remote_exec::Mode::Tty,
                        (false, true) => crate::remote_exec::Mode::Pipe,
                        _ => crate::remote_exec::Mode::Batch,
                    };
                    let ws = crate::remote_exec::operator_workspace(cli, &remote, vm);
                    let req = crate::remote_exec::ExecRequest {
                        vm: vm.clone(),
                        argv: command.clone(),
                        env,
                        cwd: cwd.clone(),
                        timeout_ms,
                        stdin: stdin_data,
                        mode,
                        detach: *detach,
                    };
                    return crate::remote_exec::exec(&remote, ws.as_deref(), req).await;
                }
            };
            if *tty || *interactive {
                let spec = warren_core::InteractiveSpec {
                    argv: command.clone(),
                    env,
                    cwd: cwd.clone(),
                    timeout_ms,
                    tty: *tty,
                };
                return Ok(w.interactive(vm, spec).await?);
            }
            let stdin_data = if *stdin {
                let mut buf = Vec::new();
                std::io::Read::read_to_end(&mut std::io::stdin(), &mut buf)?;
                Some(buf.into())
            } else {
                None
            };
            let job = w
                .exec_start(
                    vm,
                    ExecStart {
                        argv: command.clone(),
                        env,
                        cwd: cwd.clone(),
                        stdin: stdin_data,
                        timeout_ms,
                        request_key: None,
                    },
                )
                .await?;
            if *detach {
                println!("{}", serde_json::json!({ "job_id": job.0 }));
                return Ok(0);
            }
            stream_job(&w, vm, job).await
        }
        VmCmd::Output {
            vm,
            job,
            stdout_cursor,
            stderr_cursor,
            encoding,
            wait_ms,
            max_bytes,
        } => {
            let w = open(cli, None)?;
            let enc = match encoding.as_str() {
                "utf-8" | "utf8" => Encoding::Utf8,
                "base64" => Encoding::Base64,
                other => {
                    return Err(warren_core::CoreError::InvalidArgument(format!(
                        "--encoding must be utf-8 or base64, got {other:?}"
                    ))
                    .into())
                }
            };
            let cursor = Cursor {
                stdout: *stdout_cursor,
                stderr: *stderr_cursor,
            };
            let out = w
                .job_output(
                    vm,
                    JobOutputRequest {
                        job: JobId(*job),
                        stdout_cursor: cursor.stdout,
                        stderr_cursor: cursor.stderr,
                        max_bytes: *max_bytes,
                        wait_ms: *wait_ms,
                    },
                )
                .await?;
            let page = output::page(&job.to_string(), cursor, &out, enc);
            println!("{}", serde_json::to_string_pretty(&page)?);
            Ok(0)
        }
        VmCmd::Cancel { vm, job } => {
            let w = open(cli, None)?;
            w.job_cancel(vm, JobId(*job)).await?;
            Ok(0)
        }
        VmCmd::Jobs { vm, json } => {
            let w = open(cli, None)?;
            crate::jobs_cmd::print_jobs(t, &w.job_list(vm).await?, *json)?;
            Ok(0)
        }
        VmCmd::Write {
            vm,
            path,
            create_only,
            expected_version,
        } => {
            let w = open(cli, None)?;
            let precondition = match (create_only, expected_version) {
                (true, _) => Precondition::CreateOnly,
                (false, Some(v)) => Precondition::IfVersion(parse_version(v)?),
                (false, None) => Precondition::None,
            };
            let (n, version) = w
                .write_file(vm, path, &mut std::io::stdin().lock(), precondition)
                .await?;
            eprintln!("wrote {n} bytes");
            if let Some(v) = version {
                println!("{}", version_hex(&v));
            }
            Ok(0)
        }
        VmCmd::Read {
            vm,
            path,
            print_version,
        } => {
            let w = open(cli, None)?;
            let mut out = std::io::stdout().lock();
            // The first failed write ends the read (nothing more is asked of the guest); a
            // reader that went away (`| head`) ends it quietly with the status of a process
            // SIGPIPE ended, as `println!` does here (`main::quiet_on_closed_stdout`).
            let mut failed = None;
            let read = w
                .read_file(vm, path, &mut |d| {
                    out.write_all(d).map_err(|e| {
                        let kind = e.kind();
                        failed = Some(e);
                        kind.into()
                    })
                })
                .await;
            let written = match failed {
                None => out.flush(),
                Some(e) => Err(e),
            };
            match written {
                Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {
                    return Ok(128 + nix::libc::SIGPIPE)
                }
                Err(e) => bail!("writing to stdout: {e}"),
                Ok(()) => {}
            }
            let (_, version) = read?;
            if *print_version {
                match version {
                    Some(v) => eprintln!("version: {}", version_hex(&v)),
                    None => eprintln!("version: none (file larger than 16 MiB)"),
                }
            }
            Ok(0)
        }
        VmCmd::Edit {
            vm,
            path,
            old,
            new,
            expected_version,
        } => {
            let w = open(cli, None)?;
            let expected_version = expected_version.as_deref().map(parse_version).transpose()?;
            let v = w
                .edit_file(
                    vm,
                    EditFile {
                        path: path.clone(),
                        old: old.clone(),
                        new: new.clone(),
                        expected_version,
                    },
                )
                .await?;
            println!("{}", version_hex(&v.version));
            Ok(0)
        }
        VmCmd::Glob {
            vm,
            pattern,
            path,
            limit,
            json,
        } => {
            let w = open(cli, None)?;
            let r = w
                .glob(
                    vm,
                    GlobRequest {
                        pattern: pattern.clone(),
                        path: path.clone(),
                        limit: *limit,
                    },
                )
                .await?;
            if *json {
                let v = serde_json::json!({"paths": r.paths, "truncated": r.truncated});
                println!("{}", serde_json::to_string_pretty(&v)?);
                return Ok(0);
            }
            let mut out = std::io::stdout().lock();
            for p in &r.paths {
                writeln!(out, "{}", t.field(p))?;
            }
            out.flush()?;
            if r.truncated {
                eprintln!("warning: results truncated (raise --limit or narrow the search)");
            }
            Ok(0)
        }
        VmCmd::Grep {
            vm,
            pattern,
            glob,
            path,
            ignore_case,
            limit,
        } => {
            let w = open(cli, None)?;
            let r = w
                .grep(
                    vm,
                    GrepRequest {
                        pattern: pattern.clone(),
                        glob: glob.clone(),
                        path: path.clone(),
                        case_insensitive: *ignore_case,
                        limit: *limit,
                    },
                )
                .await?;
            let mut out = std::io::stdout().lock();
            for m in &r.matches {
                writeln!(out, "{}:{}:{}", t.field(&m.path), m.line, t.line(&m.text))?;
            }
            out.flush()?;
            if r.truncated {
                eprintln!("warning: results truncated (raise --limit or narrow the search)");
            }
            Ok(if r.matches.is_empty() { 1 } else { 0 })
        }
        VmCmd::Logs { vm } => {
            let w = open(cli, None)?;
            print!("{}", t.text(&w.logs(vm)?));
            Ok(0)
        }
        VmCmd::Suspend { vm, mode, force } => {
            let w = open(cli, None)?;
            let mode = if mode == "pause" {
                warren_core::SuspendMode::Pause
            } else {
                warren_core::SuspendMode::Hibernate
            };
            let progress = Progress::steps(format!("vm {vm}"));
            progress.step(match mode {
                warren_core::SuspendMode::Pause => "pausing",
                warren_core::SuspendMode::Hibernate => "hibernating",
            });
            let rec = w.suspend_vm(vm, mode, *force).await?;
            progress.finish(Some(rec.state.as_str()));
            Ok(0)
        }
        VmCmd::Resume {
            vm,
            accept_new_runtime,
        } => {
            let w = open(cli, None)?;
            let progress = Progress::steps(format!("vm {vm}"));
            progress.step("resuming");
            let rec = if *accept_new_runtime {
                w.resume_vm_on_new_runtime(vm).await?
            } else {
                w.resume_vm(vm).await?
            };
            progress.finish(Some(rec.state.as_str()));
            Ok(0)
        }
        VmCmd::Destroy { vm } => {
            let w = open(cli, None)?;
            w.destroy_vm(vm).await?;
            Ok(0)
        }
        VmCmd::Fork { vm, count, json } => {
            let w = open(cli, None)?;
            let copies = w
                .fork_vm(&warren_core::ForkVm {
                    vm_id: vm.clone(),
                    count: *count,
                    ..Default::default()
                })
                .await?;
            let ids: Vec<&str> = copies.iter().map(|c| c.id.as_str()).collect();
            // A session's VM: each copy is a new session's.
            let sessions = w.sessions_of_vms(&copies)?;
            if *json {
                let mut out = serde_json::json!({ "vm_ids": ids });
                if !sessions.is_empty() {
                    out["session_ids"] = serde_json::json!(sessions);
                }
                println!("{out}");
            } else {
                for (i, id) in ids.iter().enumerate() {
                    match sessions.get(i) {
                        Some(s) => println!("{id}  session {s}"),
                        None => println!("{id}"),
                    }
                }
            }
            Ok(0)
        }
        VmCmd::Templates { json } => {
            let w = open(cli, None)?;
            let list = w.list_templates()?;
            if *json {
                println!("{}", serde_json::to_string_pretty(&list)?);
            } else {
                for t in list {
                    println!(
                        "{}  image {}  {} MiB  {} vCPU  {} {}  nic {}  shares [{}]  {}",
                        t.name,
                        &t.key.image_id[..12.min(t.key.image_id.len())],
                        t.key.memory_mib,
                        t.key.vcpus,
                        t.key.accel,
                        t.key.cpu,
                        t.key.network,
                        t.key
                            .shares
                            .iter()
                            .map(|s| format!(
                                "{}:{}",
                                s.guest,
                                if s.read_only { "ro" } else { "rw" }
                            ))
                            .collect::<Vec<_>>()
                            .join(" "),
                        if t.valid { "valid" } else { "stale" }
                    );
                }
            }
            Ok(0)
        }
        VmCmd::Pool { image, size } => {
            let w = open(cli, None)?;
            if let Some(size) = size {
                let shape = warren_core::PoolShape {
                    image: image
                        .clone()
                        .unwrap_or_else(|| warren_core::vm::DEFAULT_IMAGE.into()),
                    memory_mib: None,
                    vcpus: None,
                };
                w.fill_pool(&shape, *size, Default::default()).await?;
            }
            println!("{}", serde_json::to_string_pretty(&w.pool_status()?)?);
            Ok(0)
        }
    }
}

/// Streams a job's output to our stdout/stderr as it arrives; returns its exit code once
/// the main process exited and the output retained then was written (background processes
/// it left may run on: their later output stays readable with `vm output`).
/// Ctrl-C cancels the job (its whole process tree) and still drains what it printed.
pub(crate) async fn stream_job(w: &Warren, vm: &str, job: JobId) -> Result<i32> {
    let mut cursor = Cursor::default();
    // The retained sizes when the job was first seen finished: where the stream ends.
    let mut end: Option<Cursor> = None;
    // Set by the first Ctrl-C (which cancels the job): how long its end is waited for.
    let mut grace: Option<tokio::time::Instant> = None;
    let mut ctrl_c = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())?;
    loop {
        let req = JobOutputRequest {
            job,
            stdout_cursor: cursor.stdout,
            stderr_cursor: cursor.stderr,
            max_bytes: warren_protocol::limits::MAX_READ_PER_STREAM,
            wait_ms: 5_000,
        };
        let out = tokio::select! {
            r = w.job_output(vm, req) => r?,
            // The first Ctrl-C cancels the job and waits for its end; a second leaves at
            // once (a guest that never reports the end holds nobody).
            Some(()) = ctrl_c.recv() => {
                if grace.is_some() {
                    eprintln!("warren: left without waiting for the cancelled job to end");
                    return Ok(128 + nix::libc::SIGINT);
                }
                grace = Some(tokio::time::Instant::now() + warren_core::interactive::CANCEL_GRACE);
                w.job_cancel(vm, job).await?;
                continue;
            }
            () = warren_core::interactive::grace_over(grace) => {
                eprintln!("warren: the cancelled job did not end in time; left it");
                return Ok(128 + nix::libc::SIGINT);
            }
        };
        if matches!(out.state, JobState::Finished(_)) && end.is_none() {
            end = Some(Cursor {
                stdout: out.stdout_retained,
                stderr: out.stderr_retained,
            });
        }
        let (stdout, stderr) = match end {
            Some(e) => (
                upto(&out.stdout, cursor.stdout, e.stdout),
                upto(&out.stderr, cursor.stderr, e.stderr),
            ),
            None => (&out.stdout[..], &out.stderr[..]),
        };
        {
            let mut so = std::io::stdout().lock();
            so.write_all(stdout)?;
            so.flush()?;
            let mut se = std::io::stderr().lock();
            se.write_all(stderr)?;
            se.flush()?;
        }
        cursor.stdout += stdout.len() as u64;
        cursor.stderr += stderr.len() as u64;
        let caught_up = end.is_some_and(|e| cursor.stdout >= e.stdout && cursor.stderr >= e.stderr);
        if let (JobState::Finished(x), true) = (out.state, caught_up) {
            if out.truncated {
                eprintln!("warren: output truncated (more than 256 KiB); the rest was discarded");
            }
            if x.timed_out {
                return Ok(EXIT_TIMEOUT);
            }
            if let Some(sig) = x.signal {
                return Ok(warren_core::interactive::signal_exit(i64::from(sig)));
            }
            return Ok(x.code.unwrap_or(EXIT_WARREN_ERROR));
        }
        if warren_core::interactive::stalled(end.is_some(), caught_up, stdout.len(), stderr.len()) {
            tokio::time::sleep(warren_core::interactive::STALLED_READ_PAUSE).await;
        }
    }
}

/// The part of `bytes`, read at `cursor`, that lies before `end`.
fn upto(bytes: &[u8], cursor: u64, end: u64) -> &[u8] {
    let n = usize::try_from(end.saturating_sub(cursor)).unwrap_or(usize::MAX);
    &bytes[..bytes.len().min(n)]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The service socket of a state directory another user made is refused before anything
    /// connects to it (it could be theirs); the user's own directory gives its socket, a
    /// missing one none. (Before, `<state>/warrend.sock` was connected to whoever owned it.)
    /// Needs root (the suite does) to make another user's directory.
    #[test]
    fn test_state_socket_only_in_a_trusted_directory() {
        let tmp = tempfile::tempdir().expect("tmp");
        let mine = tmp.path().join("mine");
        std::fs::create_dir(&mine).expect("mkdir");
        assert_eq!(
            state_socket(&mine).expect("trusted"),
            Some(mine.join("warrend.sock"))
        );
        assert_eq!(
            state_socket(&tmp.path().join("missing")).expect("none"),
            None
        );
        let theirs = tmp.path().join("theirs");
        std::fs::create_dir(&theirs).expect("mkdir");
        std::os::unix::fs::chown(&theirs, Some(65534), Some(65534)).expect("chown");
        let e = state_socket(&theirs).expect_err("another user's directory");
        assert_eq!(
            e.downcast_ref::<warren_core::CoreError>().map(|c| c.code()),
            Some("forbidden"),
            "{e:#}"
        );
    }
}
