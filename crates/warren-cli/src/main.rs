//! `warren`: parse arguments, set up logging, run the command, map errors to exit codes.
//!
//! Exit codes: `vm exec` exits with the command's code (128+N for signal N, 124 on timeout);
//! every Warren error exits 125 and prints `error[<code>]: <message chain>`.

mod agents;
mod bench;
mod bench_network;
mod bench_service;
mod bench_suspend;
mod bench_workspace;
mod cli;
mod client;
mod commands;
mod egress_file;
mod session_cmd;

use clap::Parser;

fn main() {
    let args = cli::Cli::parse();
    let filter = match args.verbose {
        // rmcp logs every MCP session (and the client's details) at info.
        0 if matches!(args.command, cli::Command::Serve { .. }) => "info,rmcp=warn",
        0 => "warn",
        1 => "info",
        _ => "debug",
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(filter)),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
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
            eprintln!("error[{code}]: {e:#}");
            commands::EXIT_WARREN_ERROR
        }
    };
    std::process::exit(code);
}
