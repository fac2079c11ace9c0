//! `warren bench --suite service`: the service's costs, measured against the CLI's path in
//! the same run.
//!
//! A real `warren serve` runs on a private state directory with one VM. Measured:
//! (e) `vm_status` requests per second with 8 concurrent keep-alive HTTP clients, and its
//!     latency against the engine call it wraps (reconcile + the guest's job list);
//! (f) exec round trip of `true` through `POST /v1/tools/vm_exec` (with `wait_ms`, so one
//!     request covers start to exit) against the CLI's path (the engine's exec start plus
//!     output long-poll, in process) and against a whole `warren vm exec` process.

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::json;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::net::TcpStream;
use warren_core::{Warren, WarrenConfig};
use warren_vmm::AccelChoice;

use crate::bench::{exec_true, median, pct, tempfile_dir, wait_job};
use crate::cli::{BenchArgs, Cli};

/// Concurrent clients for the throughput figure.
const CLIENTS: usize = 8;
/// How long the throughput figure runs.
const RPS_WINDOW: Duration = Duration::from_secs(5);

#[derive(serde::Serialize)]
struct Report {
    accel: String,
    status_rps_8_clients: f64,
    status_http_us_p50: f64,
    status_engine_us_p50: f64,
    exec_http_us_p50: f64,
    exec_http_us_p99: f64,
    exec_engine_us_p50: f64,
    exec_cli_process_us_p50: f64,
    exec_http_vs_engine: f64,
    exec_http_vs_cli_process: f64,
}

type Conn = crate::client::Conn<TcpStream>;

/// A real `warren serve` on a private state directory `<tmp>/<name>` that shares the
/// caller's image store (its `--image` configured as the default image `bench`), and an
/// engine on the same state directory for setup and cleanup. [`PrivateService::stop`]
/// ends the process and destroys every VM and the state directory; dropping it kills the
/// process (`kill_on_drop`) but leaves VMs, so callers always `stop` it, also on error.
pub(crate) struct PrivateService {
    /// `host:port` of the HTTP listener.
    pub addr: String,
    pub state: std::path::PathBuf,
    pub engine: Warren,
    daemon: tokio::process::Child,
    creds: warren_api::auth::Credentials,
}

impl PrivateService {
    pub async fn start(cli: &Cli, args: &BenchArgs, name: &str) -> Result<PrivateService> {
        let main = crate::commands::open(cli, None)?;
        let image_id = main.images().resolve(&args.image)?.to_string();
        let state = tempfile_dir()?.join(name);
        let _ = std::fs::remove_dir_all(&state);
        std::fs::create_dir_all(&state)?;
        let config = state.join("warren.toml");
        std::fs::write(
            &config,
            format!(
                "state_dir = {state:?}\nimage_dir = {:?}\naccel = {:?}\n[http]\nlisten = \"127.0.0.1:0\"\n[images.bench]\nid = \"{image_id}\"\ndefault = true\n",
                main.config().image_dir,
                args.accel.accel,
            ),
        )?;
        let creds = warren_api::auth::Credentials::open(&state.join("warren.db"))?;
        let exe = std::env::current_exe()?;
        let mut wc = WarrenConfig::new(state.clone(), exe.clone());
        wc.image_dir = main.config().image_dir.clone();
        wc.accel = args.accel.accel.parse::<AccelChoice>()?;
        let engine = Warren::open(wc)?;
        let mut daemon = tokio::process::Command::new(&exe)
            .args(["serve", "--config"])
            .arg(&config)
            .env("RUST_LOG", "warn")
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .context("starting warren serve")?;
        let mut ready = String::new();
        BufReader::new(daemon.stdout.take().context("daemon stdout")?)
            .read_line(&mut ready)
            .await?;
        let addr = ready
            .split("http://")
            .nth(1)
            .and_then(|s| s.split('/').next())
            .map(str::to_string);
        let service = PrivateService {
            addr: addr.clone().unwrap_or_default(),
            state,
            engine,
            daemon,
            creds,
        };
        if addr.is_none() {
            service.stop().await;
            bail!("warren serve did not start: {ready:?}");
        }
        Ok(service)
    }

    /// A token for `workspace` with the default policy.
    pub fn token(&self, workspace: &str) -> Result<String> {
        let (_, token) =
            self.creds
                .issue(workspace, None, &warren_api::auth::PolicyRequest::default())?;
        Ok(token)
    }

    /// Ends the service, destroys every VM of the state directory, removes it.
    pub async fn stop(mut self) {
        let _ = self.daemon.start_kill();
        let _ = self.daemon.wait().await;
        for vm in self.engine.list_vms().unwrap_or_default() {
            let _ = self.engine.destroy_vm(&vm.id).await;
        }
        let _ = std::fs::remove_dir_all(&self.state);
        if let Some(parent) = self.state.parent() {
            let _ = std::fs::remove_dir(parent);
        }
    }
}

pub async fn run(cli: &Cli, args: &BenchArgs) -> Result<i32> {
    let service = PrivateService::start(cli, args, "service").await?;
    let result = match service.token("bench") {
        Ok(token) => measure(&service.engine, &service.addr, &token, &service.state, args).await,
        Err(e) => Err(e),
    };
    service.stop().await;
    let r = result?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        println!("accelerator: {}", r.accel);
        println!(
            "(e) vm_status, {CLIENTS} concurrent HTTP clients  {:>9.0} req/s   p50 {:.0} us (engine call it wraps: {:.0} us)",
            r.status_rps_8_clients, r.status_http_us_p50, r.status_engine_us_p50
        );
        println!(
            "(f) exec `true` round trip p50 / p99: HTTP {:.0} / {:.0} us   CLI path (in process) {:.0} us   `warren vm exec` process {:.0} us",
            r.exec_http_us_p50, r.exec_http_us_p99, r.exec_engine_us_p50, r.exec_cli_process_us_p50
        );
        println!(
            "    ratios: HTTP / CLI path = {:.2}   HTTP / CLI process = {:.2}",
            r.exec_http_vs_engine, r.exec_http_vs_cli_process
        );
    }
    Ok(0)
}

async fn measure(
    engine: &Warren,
    addr: &str,
    token: &str,
    state: &std::path::Path,
    args: &BenchArgs,
) -> Result<Report> {
    if args.iterations == 0 {
        bail!("--iterations must be positive");
    }
    let mut c = Conn::tcp(addr, token).await?;
    let vm = c
        .post("vm_create", &json!({"request_id": "bench-vm"}))
        .await?;
    let vm_id = vm["vm_id"].as_str().context("vm_id")?.to_string();
    let accel = vm["accel"].as_str().unwrap_or("?").to_string();
    let status = json!({ "vm_id": vm_id });

    // (e) Throughput with 8 clients, then single-client latency against the engine call.
    let stop = Instant::now() + RPS_WINDOW;
    let mut tasks = Vec::new();
    for _ in 0..CLIENTS {
        let (addr, token, body) = (addr.to_string(), token.to_string(), status.clone());
        tasks.push(tokio::spawn(async move {
            let mut c = Conn::tcp(&addr, &token).await?;
            let mut n = 0u64;
            while Instant::now() < stop {
                c.post("vm_status", &body).await?;
                n += 1;
            }
            anyhow::Ok(n)
        }));
    }
    let t = Instant::now();
    let mut total = 0;
    for task in tasks {
        total += task.await??;
    }
    let rps = total as f64 / t.elapsed().as_secs_f64();
    let (mut http, mut eng) = (Vec::new(), Vec::new());
    for _ in 0..args.iterations {
        let t = Instant::now();
        c.post("vm_status", &status).await?;
        http.push(t.elapsed().as_secs_f64() * 1e6);
        let t = Instant::now();
        engine.get_vm(&vm_id)?;
        engine.job_list(&vm_id).await?;
        eng.push(t.elapsed().as_secs_f64() * 1e6);
    }

    // (f) Exec round trips, interleaved so all three paths see the same load.
    let (mut ex_http, mut ex_eng, mut ex_cli) = (Vec::new(), Vec::new(), Vec::new());
    let cli_runs = args.iterations.min(50);
    for i in 0..args.iterations {
        let body = json!({"vm_id": vm_id, "request_id": format!("b-{i}"), "argv": ["true"], "wait_ms": 30000});
        let t = Instant::now();
        let page = c.post("vm_exec", &body).await?;
        ex_http.push(t.elapsed().as_secs_f64() * 1e6);
        if page["state"] != "completed" {
            bail!("exec did not complete within wait_ms: {page}");
        }
        let t = Instant::now();
        let job = engine.exec_start(&vm_id, exec_true()).await?;
        wait_job(engine, &vm_id, job).await?;
        ex_eng.push(t.elapsed().as_secs_f64() * 1e6);
        if i < cli_runs {
            let t = Instant::now();
            let out = tokio::process::Command::new(std::env::current_exe()?)
                .arg("--state-dir")
                .arg(state)
                .args(["vm", "exec", &vm_id, "--", "true"])
                .output()
                .await?;
            if !out.status.success() {
                bail!("warren vm exec: {}", String::from_utf8_lossy(&out.stderr));
            }
            ex_cli.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    let h = median(&mut ex_http);
    let e = median(&mut ex_eng);
    let p = median(&mut ex_cli);
    Ok(Report {
        accel,
        status_rps_8_clients: rps,
        status_http_us_p50: median(&mut http),
        status_engine_us_p50: median(&mut eng),
        exec_http_us_p50: h,
        exec_http_us_p99: pct(&mut ex_http, 0.99),
        exec_engine_us_p50: e,
        exec_cli_process_us_p50: p,
        exec_http_vs_engine: h / e,
        exec_http_vs_cli_process: h / p,
    })
}
