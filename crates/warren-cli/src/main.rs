//! `warren`: parse arguments, set up logging, run the command, map errors to exit codes.
//!
//! Exit codes: `vm exec` exits with the command's code (128+N for signal N, 124 on timeout);
//! every Warren error exits 125 and prints `error[<code>]: <message chain>`, its control
//! characters escaped unless `--raw` (`term`).

mod agents;
mod bench;
mod bench_floor;
mod bench_image;
mod bench_instant;
mod bench_instant_sessions;
mod bench_load;
mod bench_network;
mod bench_service;
mod bench_streams;
mod bench_suspend;
mod bench_workspace;
mod cli;
mod client;
mod commands;
mod copy;
mod cp_cmd;
mod docs_gen;
mod egress_file;
mod generator;
mod host_keys;
mod host_side;
mod image_cmd;
mod jobs_cmd;
mod logging;
mod preflight_cmd;
mod progress;
mod refresh;
mod remote_exec;
mod session_cmd;
mod stream_cmd;
mod stream_link;
mod term;
mod user_config;
mod ws_connect;

use clap::Parser;
use tracing_subscriber::filter::{self, FilterExt};
use tracing_subscriber::prelude::*;

/// Whether a span or event comes from rmcp, whose log lines are never shown: its spans, its
/// info lines and its error messages carry MCP session ids, which are bearer capabilities
/// for a session's stream. Warren logs MCP refusals itself, without them.
fn from_rmcp(target: &str) -> bool {
    target == "rmcp" || target.starts_with("rmcp::")
}

fn main() {
    quiet_on_closed_stdout();
    // Descriptors a parent left open never reach anything Warren starts (supervisors, VMMs,
    // virtiofsd, host git as a session owner).
    if let Err(e) = warren_vmm::sys::process::cloexec_from(3) {
        eprintln!("warren: marking inherited descriptors close-on-exec failed: {e}");
        std::process::exit(1);
    }
    // One TLS provider for the whole process: the HTTP clients (OCI pulls, the MCP bench
    // client) are built without one of their own, so none of them picks a different backend.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let args = cli::Cli::parse();
    let level = match args.verbose {
        0 if matches!(args.command, cli::Command::Serve { .. }) => "info",
        0 => "warn",
        1 => "info",
        _ => "debug",
    };
    let env = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(level));
    // RUST_LOG cannot lift this: the rmcp filter comes first and drops whatever it names.
    let not_rmcp = filter::filter_fn(|m| !from_rmcp(m.target()));
    // Every field escaped: they carry guest and caller text (`logging`).
    let fmt = tracing_subscriber::fmt::layer().fmt_fields(logging::EscapedFields);
    if let cli::Command::Supervise { vm_dir } = &args.command {
        // Much of a supervisor's log is caused by its guest: bounded, rate-limited records in
        // a rotated `supervisor.log` (`warren_supervisor::log`).
        let writer =
            warren_supervisor::log::SupervisorLog::open(warren_supervisor::VmDir(vm_dir.clone()));
        let log = fmt
            .with_writer(writer)
            .with_ansi(false)
            .with_filter(not_rmcp.and(env));
        tracing_subscriber::registry().with(log).init();
    } else {
        let log = fmt
            .with_writer(std::io::stderr)
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .with_filter(not_rmcp.and(env));
        tracing_subscriber::registry().with(log).init();
    }
    // Error messages can carry guest text (failure reasons, guest errors, file names).
    let term = term::Term::new(args.raw);
    let code = match commands::run(args) {
        Ok(code) => code,
        Err(e) => {
            let code = e
                .downcast_ref::<warren_core::CoreError>()
                .map(|c| c.code())
                .or_else(|| e.downcast_ref::<warren_api::ApiError>().map(|a| a.code))
                .or_else(|| {
                    e.downcast_ref::<warren_api::serve::ServeError>()
                        .map(|s| s.code())
                })
                .or_else(|| {
                    e.downcast_ref::<warren_api::config::ConfigError>()
                        .map(|_| "invalid_argument")
                })
                .unwrap_or("error");
            eprintln!("error[{code}]: {}", term.text(&format!("{e:#}")));
            commands::EXIT_WARREN_ERROR
        }
    };
    std::process::exit(code);
}

/// `println!` panics when standard output is a pipe its reader closed (`warren vm list |
/// head`): that one panic ends the process quietly instead, with the status a shell reports
/// for a process that SIGPIPE ended (128 + 13). SIGPIPE itself stays ignored (Rust's
/// default), so a write to a supervisor or service socket that closed is an error the code
/// handles, never a silent death. Matched on the OS error number, whatever the locale.
fn quiet_on_closed_stdout() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let payload = info.payload();
        let msg = payload
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| payload.downcast_ref::<&str>().copied())
            .unwrap_or("");
        if msg.starts_with("failed printing to stdout")
            && msg.ends_with(&format!("(os error {})", nix::libc::EPIPE))
        {
            std::process::exit(128 + nix::libc::SIGPIPE);
        }
        default(info);
    }));
}
