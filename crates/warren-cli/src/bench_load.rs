//! `warren bench --suite load`: many clients of several workspaces at once through a real
//! `warren serve`, over HTTP and MCP, under the service's default caps.
//!
//! Setup: a private service ([`PrivateService`]), one token per workspace `load-<w>` and
//! one VM per workspace (created concurrently, each by its workspace's token). Client `c`
//! belongs to workspace `c % workspaces` and speaks one of three transports: keep-alive
//! HTTP/1.1 to `/v1/tools`, MCP with a session (protocol 2025-06-18, rmcp's client: one
//! POST per call plus the session's GET stream), or stateless MCP (protocol 2026-07-28).
//! All clients start together (a barrier) and each makes `--requests` requests, drawn from a
//! fixed mix by a per-client generator:
//!
//! - `exec`: `vm_exec` of a command that prints a nonce unique to the run, client and job on
//!   stdout and stderr, either waited for in the call (`wait_ms`) or started and then
//!   followed with `output` (`vm_job_output` long-polls along the cursors until the job
//!   completed); a waited exec is read back once with `output` too. Every collected stream
//!   must be exactly the nonce and a newline: anything else (another job's nonce, its own
//!   missing) counts as crossed.
//! - `write_file` / `read_file`: each client writes its own file with unique content and
//!   reads it back; other bytes count as crossed.
//! - `status`, `list`, `job_status`: `vm_status` must describe the client's own VM,
//!   `vm_list` must list exactly that VM (another workspace's VM counts as crossed),
//!   `vm_job_status` must describe the client's last job.
//!
//! Limits respected by construction: each client has at most one job running, and a
//! workspace has at most `MAX_RUNNING_JOBS` clients, so no VM is asked for more jobs than it
//! runs at once; a workspace's clients share its token, so in flight per token are at most
//! one request per client plus the session clients' GET streams, below the default
//! `max_requests_per_token` (32) and `max_long_polls_per_token` (8).
//!
//! Reported: p50/p99 latency per operation and transport, errors by code, crossed outputs,
//! wall time. The exit status is 1 when there was any error or crossed output.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use base64::Engine as _;
use rmcp::model::{
    CallToolRequestParams, ClientCapabilities, ClientConfig, Implementation, ProtocolVersion,
};
use rmcp::service::RunningService;
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::{ClientLifecycleMode, ClientServiceExt, RoleClient, ServiceExt};
use serde_json::{json, Value};
use tokio::sync::Barrier;
use warren_protocol::{BenchRequest, GuestResponse, HostRequest};

use crate::bench::pct;
use crate::bench_service::PrivateService;
use crate::cli::{BenchArgs, Cli};

/// A client gives up on one request after this long (the service's own deadlines end every
/// call well before: at most a 30 s wait plus 20 s).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(120);
/// A started job must complete within this long of guest time under load.
const JOB_TIMEOUT: Duration = Duration::from_secs(300);
/// Examples of errors and crossed outputs kept for the report.
const EXAMPLES: usize = 10;

/// How a client reaches the service.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Transport {
    Http,
    McpSession,
    McpStateless,
}

impl Transport {
    /// The cycle clients are assigned from.
    const CYCLE: [Transport; 4] = [
        Transport::Http,
        Transport::McpSession,
        Transport::Http,
        Transport::McpStateless,
    ];

    fn name(self) -> &'static str {
        match self {
            Transport::Http => "http",
            Transport::McpSession => "mcp-session",
            Transport::McpStateless => "mcp-stateless",
        }
    }
}

/// Client `c` of `workspaces`: its workspace and transport. Shifting the transport cycle by
/// one per round of workspaces gives every workspace every transport once it has 4 clients.
fn assignment(c: usize, workspaces: usize) -> (usize, Transport) {
    let t = Transport::CYCLE[(c + c / workspaces) % Transport::CYCLE.len()];
    (c % workspaces, t)
}

/// One failed request: the service's error code, or the client's own (`transport`,
/// `client_timeout`, `bad_response`, `exit_status`, `job_timeout`).
#[derive(Debug)]
struct Failure {
    code: String,
    message: String,
}

impl Failure {
    fn new(code: &str, message: impl Into<String>) -> Failure {
        Failure {
            code: code.to_string(),
            message: message.into(),
        }
    }
}

type Conn = crate::client::Conn<tokio::net::TcpStream>;

/// A connected client.
enum Link {
    /// `None` after a transport failure: reconnected before the next request.
    Http(Option<Conn>),
    Mcp(RunningService<RoleClient, ClientConfig>),
}

impl Link {
    async fn open(addr: &str, token: &str, transport: Transport) -> Result<Link> {
        if transport == Transport::Http {
            return Ok(Link::Http(Some(Conn::tcp(addr, token).await?)));
        }
        // No silent re-initialization: an expired session must show up as an error.
        let config = StreamableHttpClientTransportConfig::with_uri(format!("http://{addr}/mcp"))
            .auth_header(token)
            .reinit_on_expired_session(false);
        let http = StreamableHttpClientTransport::from_config(config);
        let info = ClientConfig::new(
            ClientCapabilities::default(),
            Implementation::new("warren-bench-load", env!("CARGO_PKG_VERSION")),
        )
        .with_protocol_version(ProtocolVersion::V_2025_06_18);
        let running = if transport == Transport::McpSession {
            info.serve(http).await?
        } else {
            let lifecycle = ClientLifecycleMode::Discover {
                preferred_versions: vec![ProtocolVersion::V_2026_07_28],
            };
            info.serve_with_lifecycle(http, lifecycle).await?
        };
        Ok(Link::Mcp(running))
    }

    /// Calls `tool`; the service's refusal comes back with its code.
    async fn call(
        &mut self,
        addr: &str,
        token: &str,
        tool: &str,
        args: Value,
    ) -> Result<Value, Failure> {
        match tokio::time::timeout(REQUEST_TIMEOUT, self.call_inner(addr, token, tool, args)).await
        {
            Ok(r) => r,
            Err(_) => {
                // The connection may still carry the late response: start afresh.
                if let Link::Http(conn) = self {
                    *conn = None;
                }
                Err(Failure::new(
                    "client_timeout",
                    format!("{tool}: no answer within {REQUEST_TIMEOUT:?}"),
                ))
            }
        }
    }

    async fn call_inner(
        &mut self,
        addr: &str,
        token: &str,
        tool: &str,
        args: Value,
    ) -> Result<Value, Failure> {
        match self {
            Link::Http(slot) => {
                if slot.is_none() {
                    let c = Conn::tcp(addr, token)
                        .await
                        .map_err(|e| Failure::new("transport", format!("reconnecting: {e:#}")))?;
                    *slot = Some(c);
                }
                let conn = slot
                    .as_mut()
                    .ok_or_else(|| Failure::new("transport", "no connection"))?;
                match conn.post(tool, &args).await {
                    Ok(v) => Ok(v),
                    Err(e) => match e.downcast_ref::<warren_api::ApiError>() {
                        Some(api) => Err(Failure::new(api.code, api.message.clone())),
                        None => {
                            *slot = None;
                            Err(Failure::new("transport", format!("{tool}: {e:#}")))
                        }
                    },
                }
            }
            Link::Mcp(client) => {
                let Value::Object(map) = args else {
                    return Err(Failure::new("bad_response", "arguments must be an object"));
                };
                let params = CallToolRequestParams::new(tool.to_string()).with_arguments(map);
                let result = client
                    .call_tool(params)
                    .await
                    .map_err(|e| Failure::new("transport", format!("{tool}: {e}")))?;
                let content = result.structured_content.unwrap_or(Value::Null);
                if result.is_error == Some(true) {
                    let code = content["error"]["code"].as_str().unwrap_or("internal");
                    let message = content["error"]["message"].as_str().unwrap_or("");
                    return Err(Failure::new(code, message));
                }
                Ok(content)
            }
        }
    }

    async fn close(self) {
        if let Link::Mcp(client) = self {
            let _ = client.cancel().await;
        }
    }
}

/// A deterministic generator (xorshift64*), so a run's mix is reproducible per client.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) % n
    }
}

/// What one client saw.
#[derive(Default)]
struct Tally {
    /// (operation, transport) -> latencies in ms.
    samples: BTreeMap<(&'static str, &'static str), Vec<f64>>,
    errors: BTreeMap<String, u64>,
    error_examples: Vec<String>,
    crossed: u64,
    crossed_examples: Vec<String>,
    requests: u64,
}

impl Tally {
    fn error(&mut self, client: usize, op: &str, f: &Failure) {
        *self.errors.entry(f.code.clone()).or_default() += 1;
        if self.error_examples.len() < EXAMPLES {
            self.error_examples
                .push(format!("client {client} {op}: {}: {}", f.code, f.message));
        }
    }
    fn cross(&mut self, client: usize, what: String) {
        self.crossed += 1;
        if self.crossed_examples.len() < EXAMPLES {
            self.crossed_examples
                .push(format!("client {client}: {what}"));
        }
    }
    fn merge(&mut self, other: Tally) {
        for (k, mut v) in other.samples {
            self.samples.entry(k).or_default().append(&mut v);
        }
        for (k, n) in other.errors {
            *self.errors.entry(k).or_default() += n;
        }
        self.error_examples.extend(other.error_examples);
        self.error_examples.truncate(EXAMPLES);
        self.crossed += other.crossed;
        self.crossed_examples.extend(other.crossed_examples);
        self.crossed_examples.truncate(EXAMPLES);
        self.requests += other.requests;
    }
}

/// One client: its identity, its link and what it saw.
struct Client {
    id: usize,
    transport: Transport,
    addr: String,
    token: String,
    vm_id: String,
    run: String,
    link: Link,
    tally: Tally,
    rng: Rng,
    jobs: u64,
    last_job: Option<String>,
    /// The content of this client's file, once written.
    file: Option<Vec<u8>>,
}

impl Client {
    /// One timed request, counted in the tally.
    async fn req(&mut self, op: &'static str, tool: &str, args: Value) -> Result<Value, Failure> {
        let t = Instant::now();
        let r = self.link.call(&self.addr, &self.token, tool, args).await;
        let ms = t.elapsed().as_secs_f64() * 1e3;
        self.tally.requests += 1;
        match &r {
            Ok(_) => self
                .tally
                .samples
                .entry((op, self.transport.name()))
                .or_default()
                .push(ms),
            Err(f) => self.tally.error(self.id, op, f),
        }
        r
    }

    async fn run(mut self, requests: u64, barrier: Arc<Barrier>) -> (Tally, Link) {
        barrier.wait().await;
        while self.tally.requests < requests {
            match self.rng.below(100) {
                0..=39 => self.exec().await,
                40..=54 => self.write_then_read().await,
                55..=64 => self.read_file().await,
                65..=79 => self.status().await,
                80..=89 => self.list().await,
                _ => self.job_status().await,
            }
        }
        (self.tally, self.link)
    }

    /// Starts a job printing a fresh nonce and reads its output to the end.
    async fn exec(&mut self) {
        self.jobs += 1;
        let nonce = format!("{}-c{}-j{}", self.run, self.id, self.jobs);
        let variant = self.rng.below(3);
        let mut args = json!({
            "vm_id": self.vm_id,
            "request_id": format!("{nonce}-x"),
            "wait_ms": if variant == 1 { 0 } else { 30_000 },
        });
        match variant {
            // A direct exec, no shell.
            0 => args["argv"] = json!(["echo", nonce]),
            // A job still running when the call returns, followed with long-polls.
            1 => args["command"] = json!(format!("sleep 0.2; echo {nonce}; echo {nonce} >&2")),
            _ => args["command"] = json!(format!("echo {nonce}; echo {nonce} >&2")),
        }
        let Ok(page) = self.req("exec", "vm_exec", args).await else {
            return;
        };
        let Some(job) = page["job_id"].as_str().map(str::to_string) else {
            let f = Failure::new("bad_response", format!("vm_exec without job_id: {page}"));
            self.tally.error(self.id, "exec", &f);
            return;
        };
        let expect_err = variant != 0;
        let (mut out, mut err) = (String::new(), String::new());
        let mut last = page;
        let mut followed = false;
        let started = Instant::now();
        // The waited page, then the job's output read from the start (or along the cursors
        // until the job completed and both cursors stopped).
        if last["state"] == "completed" {
            let first = (text(&last["stdout"]), text(&last["stderr"]));
            self.check(&nonce, "exec page stdout", first.0, true);
            self.check(&nonce, "exec page stderr", first.1, expect_err);
            let a = json!({"vm_id": self.vm_id, "job_id": job});
            match self.req("output", "vm_job_output", a).await {
                Ok(p) => {
                    out.push_str(text(&p["stdout"]));
                    err.push_str(text(&p["stderr"]));
                    last = p;
                    followed = true;
                }
                Err(_) => return,
            }
        } else {
            out.push_str(text(&last["stdout"]));
            err.push_str(text(&last["stderr"]));
        }
        while !followed {
            if started.elapsed() > JOB_TIMEOUT {
                let f = Failure::new("job_timeout", format!("job {job} did not complete"));
                self.tally.error(self.id, "output", &f);
                return;
            }
            let cursor = last["next_cursor"].clone();
            let a =
                json!({"vm_id": self.vm_id, "job_id": job, "cursor": cursor, "wait_ms": 30_000});
            let Ok(p) = self.req("output", "vm_job_output", a).await else {
                return;
            };
            out.push_str(text(&p["stdout"]));
            err.push_str(text(&p["stderr"]));
            followed = p["state"] == "completed" && p["next_cursor"] == cursor;
            last = p;
        }
        if last["exit_code"] != 0 {
            let f = Failure::new("exit_status", format!("job {job}: {last}"));
            self.tally.error(self.id, "output", &f);
        }
        self.check(&nonce, "output stdout", &out, true);
        self.check(&nonce, "output stderr", &err, expect_err);
        self.last_job = Some(job);
    }

    fn check(&mut self, nonce: &str, what: &str, got: &str, printed: bool) {
        if !stream_ok(nonce, got, printed) {
            self.tally.cross(
                self.id,
                format!("{what}: want {nonce:?} (printed: {printed}), got {got:?}"),
            );
        }
    }

    async fn write_then_read(&mut self) {
        self.jobs += 1;
        // Unique content of varying length (up to ~4 KiB) naming its writer and write.
        let line = format!("{}-c{}-w{}\n", self.run, self.id, self.jobs);
        let content = line.repeat(1 + self.rng.below(128) as usize).into_bytes();
        let args = json!({
            "vm_id": self.vm_id,
            "path": self.path(),
            "content_base64": base64::engine::general_purpose::STANDARD.encode(&content),
        });
        if self.req("write_file", "vm_write_file", args).await.is_ok() {
            self.file = Some(content);
            self.read_file().await;
        }
    }

    async fn read_file(&mut self) {
        let args = json!({"vm_id": self.vm_id, "path": self.path()});
        let Some(want) = self.file.clone() else {
            // Nothing written yet: write first.
            return Box::pin(self.write_then_read()).await;
        };
        if let Ok(v) = self.req("read_file", "vm_read_file", args).await {
            let got = base64::engine::general_purpose::STANDARD
                .decode(v["content_base64"].as_str().unwrap_or(""))
                .unwrap_or_default();
            if got != want || v["eof"] != true {
                let shown = String::from_utf8_lossy(&got[..got.len().min(80)]).into_owned();
                self.tally.cross(
                    self.id,
                    format!("file read back {} bytes: {shown:?}...", got.len()),
                );
            }
        }
    }

    fn path(&self) -> String {
        format!("load/{}-c{}.txt", self.run, self.id)
    }

    async fn status(&mut self) {
        let args = json!({"vm_id": self.vm_id});
        if let Ok(v) = self.req("status", "vm_status", args).await {
            if v["vm_id"] != self.vm_id.as_str() || v["state"] != "running" {
                self.tally
                    .cross(self.id, format!("vm_status of another VM or state: {v}"));
            }
        }
    }

    async fn list(&mut self) {
        if let Ok(v) = self.req("list", "vm_list", json!({})).await {
            let ids: Vec<&str> = v["vms"]
                .as_array()
                .map(|a| a.iter().filter_map(|vm| vm["vm_id"].as_str()).collect())
                .unwrap_or_default();
            if ids != [self.vm_id.as_str()] {
                self.tally.cross(self.id, format!("vm_list shows {ids:?}"));
            }
        }
    }

    async fn job_status(&mut self) {
        let Some(job) = self.last_job.clone() else {
            return self.status().await;
        };
        let args = json!({"vm_id": self.vm_id, "job_id": job});
        if let Ok(v) = self.req("job_status", "vm_job_status", args).await {
            if v["job_id"] != job.as_str() || v["state"] != "completed" {
                self.tally
                    .cross(self.id, format!("vm_job_status of {job}: {v}"));
            }
        }
    }
}

/// A job's stream is exactly its nonce and a newline, or empty where nothing was printed:
/// another job's nonce, a missing or repeated nonce or stray bytes are all crossed output.
fn stream_ok(nonce: &str, got: &str, printed: bool) -> bool {
    if printed {
        got.strip_prefix(nonce) == Some("\n")
    } else {
        got.is_empty()
    }
}

fn text(v: &Value) -> &str {
    v.as_str().unwrap_or("")
}

#[derive(serde::Serialize)]
struct OpFigures {
    op: &'static str,
    transport: &'static str,
    n: usize,
    p50_ms: f64,
    p99_ms: f64,
}

#[derive(serde::Serialize)]
struct Report {
    accel: String,
    clients: usize,
    workspaces: usize,
    requests_per_client: u64,
    requests: u64,
    wall_s: f64,
    requests_per_s: f64,
    vm_create_ms_max: f64,
    /// The physical floor, measured in the same run before the clients start: the guest's own
    /// fork+exec+wait of `/bin/true` (median over the first VM's samples), in ms.
    guest_fork_exec_ms: f64,
    /// The exec p50 over all transports against that floor.
    exec_p50_over_floor: f64,
    errors_total: u64,
    errors: BTreeMap<String, u64>,
    error_examples: Vec<String>,
    crossed: u64,
    crossed_examples: Vec<String>,
    ops: Vec<OpFigures>,
}

pub async fn run(cli: &Cli, args: &BenchArgs) -> Result<i32> {
    check_args(args)?;
    let service = PrivateService::start(cli, args, "load").await?;
    // Ends the run on Ctrl-C too, so its VMs and state are always cleaned up.
    let result = tokio::select! {
        r = measure(&service, args) => r,
        _ = tokio::signal::ctrl_c() => Err(anyhow::anyhow!("interrupted")),
    };
    service.stop().await;
    let r = result?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        print_report(&r);
    }
    Ok(if r.errors_total == 0 && r.crossed == 0 {
        0
    } else {
        1
    })
}

fn check_args(args: &BenchArgs) -> Result<()> {
    if args.clients == 0 || args.workspaces == 0 || args.requests == 0 {
        bail!("--clients, --workspaces and --requests must be positive");
    }
    if args.workspaces > args.clients {
        bail!("--workspaces must not exceed --clients (each workspace needs a client)");
    }
    let per = args.clients.div_ceil(args.workspaces);
    let max = warren_protocol::limits::MAX_RUNNING_JOBS;
    if per > max {
        bail!("{per} clients per workspace would exceed the {max} jobs a VM runs at once: raise --workspaces");
    }
    Ok(())
}

async fn measure(service: &PrivateService, args: &BenchArgs) -> Result<Report> {
    let addr = service.addr.clone();
    let mut tokens = Vec::new();
    for w in 0..args.workspaces {
        tokens.push(service.token(&format!("load-{w}"))?);
    }
    // One VM per workspace, booted concurrently.
    let t = Instant::now();
    let mut creates = Vec::new();
    for token in &tokens {
        let (addr, token) = (addr.clone(), token.clone());
        creates.push(tokio::spawn(async move {
            let mut c = Conn::tcp(&addr, &token).await?;
            let vm = c
                .post("vm_create", &json!({"request_id": "load-vm"}))
                .await?;
            anyhow::Ok((vm, t.elapsed().as_secs_f64() * 1e3))
        }));
    }
    let (mut vms, mut create_ms, mut accel) = (Vec::new(), 0f64, String::new());
    for c in creates {
        let (vm, ms) = c.await?.context("vm_create")?;
        vms.push(vm["vm_id"].as_str().context("vm_id")?.to_string());
        accel = vm["accel"].as_str().unwrap_or("?").to_string();
        create_ms = create_ms.max(ms);
    }
    eprintln!(
        "{} VMs running after {create_ms:.0} ms; connecting {} clients",
        vms.len(),
        args.clients
    );
    let floor_ms = fork_exec_floor(service, &vms[0]).await?;

    let run = format!(
        "n{}x{}",
        std::process::id(),
        std::time::UNIX_EPOCH.elapsed()?.as_millis() % 1_000_000
    );
    let barrier = Arc::new(Barrier::new(args.clients + 1));
    let mut tasks = Vec::new();
    for c in 0..args.clients {
        let (w, transport) = assignment(c, args.workspaces);
        let link = Link::open(&addr, &tokens[w], transport)
            .await
            .with_context(|| format!("connecting client {c} ({})", transport.name()))?;
        let client = Client {
            id: c,
            transport,
            addr: addr.clone(),
            token: tokens[w].clone(),
            vm_id: vms[w].clone(),
            run: run.clone(),
            link,
            tally: Tally::default(),
            rng: Rng::new(c as u64 + 1),
            jobs: 0,
            last_job: None,
            file: None,
        };
        tasks.push(tokio::spawn(
            client.run(args.requests as u64, barrier.clone()),
        ));
    }
    barrier.wait().await;
    let t = Instant::now();
    let mut total = Tally::default();
    let mut links = Vec::new();
    for task in tasks {
        let (tally, link) = task.await?;
        total.merge(tally);
        links.push(link);
    }
    let wall_s = t.elapsed().as_secs_f64();
    for link in links {
        link.close().await;
    }
    let mut r = report(total, args, accel, wall_s, create_ms);
    r.guest_fork_exec_ms = floor_ms;
    r.exec_p50_over_floor = r
        .ops
        .iter()
        .find(|o| o.op == "exec" && o.transport == "all")
        .map_or(f64::NAN, |o| o.p50_ms / floor_ms);
    Ok(r)
}

/// The guest's own fork+exec+wait of `/bin/true`, median of 20, asked of `vm`'s supervisor
/// directly (no service, no channel round trip per sample), in ms.
async fn fork_exec_floor(service: &PrivateService, vm: &str) -> Result<f64> {
    let sup = warren_supervisor::SupervisorClient::new(
        &service.engine.vm_dir_path(vm).join("supervisor.sock"),
    );
    let reply = sup
        .guest(HostRequest::Bench(BenchRequest::ForkExecWait {
            iterations: 20,
        }))
        .await?;
    let GuestResponse::Bench(b) = reply else {
        bail!("unexpected reply to the fork+exec benchmark");
    };
    let mut ms: Vec<f64> = b.samples_ns.iter().map(|n| *n as f64 / 1e6).collect();
    Ok(crate::bench::median(&mut ms))
}

fn report(mut t: Tally, args: &BenchArgs, accel: String, wall_s: f64, create_ms: f64) -> Report {
    let mut ops = Vec::new();
    let mut all: BTreeMap<&'static str, Vec<f64>> = BTreeMap::new();
    for ((op, transport), v) in &mut t.samples {
        all.entry(op).or_default().extend_from_slice(v);
        ops.push(OpFigures {
            op,
            transport,
            n: v.len(),
            p50_ms: pct(v, 0.5),
            p99_ms: pct(v, 0.99),
        });
    }
    for (op, mut v) in all {
        ops.push(OpFigures {
            op,
            transport: "all",
            n: v.len(),
            p50_ms: pct(&mut v, 0.5),
            p99_ms: pct(&mut v, 0.99),
        });
    }
    ops.sort_by_key(|o| (o.op, o.transport));
    Report {
        accel,
        clients: args.clients,
        workspaces: args.workspaces,
        requests_per_client: args.requests as u64,
        requests: t.requests,
        wall_s,
        requests_per_s: t.requests as f64 / wall_s,
        vm_create_ms_max: create_ms,
        guest_fork_exec_ms: f64::NAN,
        exec_p50_over_floor: f64::NAN,
        errors_total: t.errors.values().sum(),
        errors: t.errors,
        error_examples: t.error_examples,
        crossed: t.crossed,
        crossed_examples: t.crossed_examples,
        ops,
    }
}

fn print_report(r: &Report) {
    println!(
        "accelerator: {}  {} clients in {} workspaces (one VM each), {} requests each",
        r.accel, r.clients, r.workspaces, r.requests_per_client
    );
    println!(
        "{} requests in {:.1} s ({:.1} req/s); VMs created in {:.0} ms",
        r.requests, r.wall_s, r.requests_per_s, r.vm_create_ms_max
    );
    println!(
        "floor: the guest's own fork+exec+wait {:.2} ms (median); exec p50 is {:.1}x that",
        r.guest_fork_exec_ms, r.exec_p50_over_floor
    );
    println!(
        "{:<12} {:<14} {:>6} {:>10} {:>10}",
        "operation", "transport", "n", "p50 ms", "p99 ms"
    );
    for o in &r.ops {
        println!(
            "{:<12} {:<14} {:>6} {:>10.1} {:>10.1}",
            o.op, o.transport, o.n, o.p50_ms, o.p99_ms
        );
    }
    println!("errors: {} {:?}", r.errors_total, r.errors);
    for e in &r.error_examples {
        println!("  {e}");
    }
    println!("crossed outputs: {}", r.crossed);
    for e in &r.crossed_examples {
        println!("  {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_assignment_every_workspace_gets_every_transport() {
        for c in 0..16 {
            let (w, _) = assignment(c, 4);
            assert_eq!(w, c % 4);
        }
        for w in 0..4 {
            let mut kinds: Vec<Transport> = (0..16)
                .map(|c| assignment(c, 4))
                .filter(|(ws, _)| *ws == w)
                .map(|(_, t)| t)
                .collect();
            kinds.sort();
            assert_eq!(
                kinds,
                [
                    Transport::Http,
                    Transport::Http,
                    Transport::McpSession,
                    Transport::McpStateless
                ]
            );
        }
    }

    #[test]
    fn test_assignment_small_config_covers_all_transports() {
        let mut kinds: Vec<Transport> = (0..4).map(|c| assignment(c, 2).1).collect();
        kinds.sort();
        kinds.dedup();
        assert_eq!(kinds.len(), 3);
    }

    #[test]
    fn test_stream_ok_own_nonce_only() {
        assert!(stream_ok("r-c1-j2", "r-c1-j2\n", true));
        assert!(stream_ok("r-c1-j2", "", false));
        // Another job's nonce (a prefix of it too), its own missing, repeated, or extra bytes.
        assert!(!stream_ok("r-c1-j2", "r-c1-j3\n", true));
        assert!(!stream_ok("r-c1-j2", "r-c1-j21\n", true));
        assert!(!stream_ok("r-c1-j2", "", true));
        assert!(!stream_ok("r-c1-j2", "r-c1-j2\nr-c1-j2\n", true));
        assert!(!stream_ok("r-c1-j2", "r-c1-j2\n", false));
    }

    #[test]
    fn test_rng_same_seed_same_sequence_in_range() {
        let (mut a, mut b) = (Rng::new(7), Rng::new(7));
        for _ in 0..1000 {
            let x = a.below(100);
            assert_eq!(x, b.below(100));
            assert!(x < 100);
        }
    }
}
