//! `warren bench`: Warren's costs against raw baselines measured in the same run.
//!
//! (a) raw `qemu-system` boot of the same kernel, initramfs and disk with Warren's exact
//!     command line, from spawn to the agent's ready line on the console, vs
//! (b) `vm create` to the first exec result (supervisor, channel, auth, exec included);
//! (c) exec round trip of `true` vs the guest's own fork+exec+wait and the channel ping;
//! (d) file write+read throughput through the agent vs raw channel throughput (bytes
//!     discarded/produced by the agent, no file system).
//! Every figure is a median over several iterations.

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use tokio::io::AsyncReadExt;
use warren_core::{CreateVm, Warren, WarrenConfig};
use warren_protocol::{
    BenchRequest, ExecStart, FileRead, FileWrite, GuestResponse, HostRequest, JobOutputRequest,
    JobState, WriteMode,
};
use warren_supervisor::SupervisorClient;
use warren_vmm::backend::MemMib;
use warren_vmm::qemu::QemuBackend;
use warren_vmm::{AccelChoice, LaunchSpec};

use crate::cli::{BenchArgs, Cli};

pub(crate) fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() {
        return f64::NAN;
    }
    v[v.len() / 2]
}

pub(crate) fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() {
        return f64::NAN;
    }
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

pub async fn run(cli: &Cli, args: &BenchArgs) -> Result<i32> {
    // A private state directory so the benchmark never touches the user's VMs.
    let main = crate::commands::open(cli, None)?;
    let state = tempfile_dir()?;
    let mut cfg = WarrenConfig::new(state.clone(), std::env::current_exe()?);
    cfg.image_dir = main.config().image_dir.clone();
    cfg.accel = args
        .accel
        .accel
        .parse::<AccelChoice>()
        .map_err(warren_core::CoreError::from)?;
    let w = Warren::open(cfg)?;
    let result = bench(&w, args).await;
    for vm in w.list_vms().unwrap_or_default() {
        let _ = w.destroy_vm(&vm.id).await;
    }
    let _ = std::fs::remove_dir_all(&state);
    let report = result?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_report(&report);
    }
    Ok(0)
}

/// A Warren on a private state directory `<tmp>/<name>` (removed first) that shares the
/// caller's image store and uses `--accel`, so a bench never touches the user's VMs.
pub(crate) fn private_warren(
    cli: &Cli,
    args: &BenchArgs,
    name: &str,
) -> Result<(Warren, std::path::PathBuf)> {
    let main = crate::commands::open(cli, None)?;
    let state = tempfile_dir()?.join(name);
    let _ = std::fs::remove_dir_all(&state);
    let mut cfg = WarrenConfig::new(state.clone(), std::env::current_exe()?);
    cfg.image_dir = main.config().image_dir.clone();
    cfg.accel = args.accel.accel.parse::<AccelChoice>()?;
    Ok((Warren::open(cfg)?, state))
}

/// Undoes [`private_warren`]: deletes its sessions and VMs, then its state directory (and
/// the per-process directory above it once empty).
pub(crate) async fn discard_private_warren(w: &Warren, state: &std::path::Path) {
    for s in w.list_sessions(None).unwrap_or_default() {
        let _ = w.delete_session(&s, true).await;
    }
    for vm in w.list_vms().unwrap_or_default() {
        let _ = w.destroy_vm(&vm.id).await;
    }
    let _ = std::fs::remove_dir_all(state);
    if let Some(parent) = state.parent() {
        let _ = std::fs::remove_dir(parent);
    }
}

pub(crate) fn tempfile_dir() -> Result<std::path::PathBuf> {
    let d = std::env::temp_dir().join(format!("warren-bench-{}", std::process::id()));
    std::fs::create_dir_all(&d)?;
    Ok(d)
}

#[derive(serde::Serialize)]
struct Report {
    accel: String,
    boots: usize,
    raw_boot_ms_median: f64,
    warren_create_to_exec_ms_median: f64,
    boot_ratio: f64,
    exec_rtt_us_p50: f64,
    exec_rtt_us_p99: f64,
    exec_start_us_p50: f64,
    guest_fork_exec_wait_us_p50: f64,
    ping_us_p50: f64,
    exec_target_us: f64,
    file_mib_s: f64,
    raw_channel_mib_s: f64,
    file_vs_raw: f64,
}

fn print_report(r: &Report) {
    println!("accelerator: {}  (medians over {} boots)", r.accel, r.boots);
    println!(
        "(a) raw qemu boot to agent ready      {:>9.1} ms",
        r.raw_boot_ms_median
    );
    println!(
        "(b) warren vm create to first exec    {:>9.1} ms   b/a = {:.3} (target <= 1.15)",
        r.warren_create_to_exec_ms_median, r.boot_ratio
    );
    println!(
        "(c) exec `true` round trip p50 / p99  {:>9.0} / {:.0} us   target p50 <= 2*fork+exec+wait + ping = {:.0} us",
        r.exec_rtt_us_p50, r.exec_rtt_us_p99, r.exec_target_us
    );
    println!(
        "    of which ExecStart p50            {:>9.0} us",
        r.exec_start_us_p50
    );
    println!(
        "    guest fork+exec+wait p50          {:>9.0} us",
        r.guest_fork_exec_wait_us_p50
    );
    println!(
        "    channel ping p50                  {:>9.0} us",
        r.ping_us_p50
    );
    println!(
        "(d) file write+read through agent     {:>9.1} MiB/s   raw channel {:.1} MiB/s   ratio {:.2} (target >= 0.5)",
        r.file_mib_s, r.raw_channel_mib_s, r.file_vs_raw
    );
}

async fn bench(w: &Warren, args: &BenchArgs) -> Result<Report> {
    if args.boots == 0 || args.iterations == 0 || args.mib == 0 {
        bail!("--boots, --iterations and --mib must be positive");
    }
    let image_id = w.images().resolve(&args.image)?;
    let image = w.images().verify(&image_id)?;
    let (accel, warning) = w.resolve_accel(&image).await?;
    if let Some(m) = warning {
        eprintln!("warning: {m}");
    }
    let create = CreateVm {
        image: Some(args.image.clone()),
        ..Default::default()
    };

    // (a) and (b), interleaved so both see the same machine load.
    let mut raw = Vec::new();
    let mut warren = Vec::new();
    for i in 0..args.boots {
        eprintln!("boot {}/{}", i + 1, args.boots);
        let t = Instant::now();
        let rec = w.create_vm(&create, &mut |_| {}).await?;
        let job = w
            .exec_start(&rec.id, exec_true())
            .await
            .context("first exec")?;
        wait_job(w, &rec.id, job).await?;
        warren.push(t.elapsed().as_secs_f64() * 1000.0);
        let dir = w.vm_dir_path(&rec.id);
        raw.push(raw_boot(&dir, accel).await? * 1000.0);
        w.destroy_vm(&rec.id).await?;
    }

    // (c) and (d) on one VM.
    let rec = w.create_vm(&create, &mut |_| {}).await?;
    let client = SupervisorClient::new(&w.vm_dir_path(&rec.id).join("supervisor.sock"));
    let mut rtt = Vec::new();
    let mut start = Vec::new();
    for _ in 0..args.iterations {
        let t = Instant::now();
        let job = w.exec_start(&rec.id, exec_true()).await?;
        start.push(t.elapsed().as_secs_f64() * 1e6);
        wait_job(w, &rec.id, job).await?;
        rtt.push(t.elapsed().as_secs_f64() * 1e6);
    }
    let mut ping = Vec::new();
    for _ in 0..args.iterations {
        let t = Instant::now();
        client.guest(HostRequest::Ping).await?;
        ping.push(t.elapsed().as_secs_f64() * 1e6);
    }
    let GuestResponse::Bench(b) = client
        .guest(HostRequest::Bench(BenchRequest::ForkExecWait {
            iterations: args.iterations as u32,
        }))
        .await?
    else {
        bail!("unexpected bench reply");
    };
    let mut few: Vec<f64> = b.samples_ns.iter().map(|n| *n as f64 / 1000.0).collect();

    let chunk = warren_protocol::limits::MAX_FILE_CHUNK as usize;
    let chunks = args.mib * 1024 * 1024 / chunk;
    let data = vec![0x5au8; chunk];
    let t = Instant::now();
    for i in 0..chunks {
        client
            .guest(HostRequest::FileWrite(FileWrite {
                path: "bench.bin".into(),
                mode: if i == 0 {
                    WriteMode::Truncate
                } else {
                    WriteMode::At((i * chunk) as u64)
                },
                data: data.clone(),
                create_parents: false,
            }))
            .await?;
    }
    for i in 0..chunks {
        client
            .guest(HostRequest::FileRead(FileRead {
                path: "bench.bin".into(),
                offset: (i * chunk) as u64,
                len: chunk as u32,
            }))
            .await?;
    }
    let file_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    for _ in 0..chunks {
        client.guest(HostRequest::Discard(data.clone())).await?;
    }
    for _ in 0..chunks {
        client.guest(HostRequest::Source(chunk as u32)).await?;
    }
    let raw_s = t.elapsed().as_secs_f64();
    w.destroy_vm(&rec.id).await?;

    let mib = (2 * chunks * chunk) as f64 / (1024.0 * 1024.0);
    let raw_boot_ms = median(&mut raw);
    let warren_ms = median(&mut warren);
    let few_p50 = median(&mut few);
    let ping_p50 = median(&mut ping);
    Ok(Report {
        accel: accel.to_string(),
        boots: args.boots,
        raw_boot_ms_median: raw_boot_ms,
        warren_create_to_exec_ms_median: warren_ms,
        boot_ratio: warren_ms / raw_boot_ms,
        exec_rtt_us_p50: pct(&mut rtt, 0.5),
        exec_rtt_us_p99: pct(&mut rtt, 0.99),
        exec_start_us_p50: median(&mut start),
        guest_fork_exec_wait_us_p50: few_p50,
        ping_us_p50: ping_p50,
        exec_target_us: 2.0 * few_p50 + ping_p50,
        file_mib_s: mib / file_s,
        raw_channel_mib_s: mib / raw_s,
        file_vs_raw: raw_s / file_s,
    })
}

pub(crate) fn exec_true() -> ExecStart {
    ExecStart {
        argv: vec!["true".into()],
        env: vec![],
        cwd: None,
        stdin: None,
        timeout_ms: None,
        request_key: None,
    }
}

/// Runs `argv` and returns its stdout (fails on a non-zero exit).
pub(crate) async fn run_argv(w: &Warren, vm: &str, argv: Vec<String>) -> Result<String> {
    let mut job = exec_true();
    job.argv = argv.clone();
    let id = w.exec_start(vm, job).await?;
    let (mut out, mut err) = (Vec::new(), Vec::new());
    loop {
        let o = w
            .job_output(
                vm,
                JobOutputRequest {
                    job: id,
                    stdout_cursor: out.len() as u64,
                    stderr_cursor: err.len() as u64,
                    max_bytes: warren_protocol::limits::MAX_READ_PER_STREAM,
                    wait_ms: 5_000,
                },
            )
            .await?;
        out.extend_from_slice(&o.stdout);
        err.extend_from_slice(&o.stderr);
        if let warren_protocol::JobState::Finished(exit) = o.state {
            if exit.code != Some(0) {
                bail!(
                    "{argv:?}: exit {:?}: {}",
                    exit.code,
                    String::from_utf8_lossy(&err)
                );
            }
            return Ok(String::from_utf8_lossy(&out).into_owned());
        }
    }
}

pub(crate) async fn wait_job(w: &Warren, vm: &str, job: warren_protocol::JobId) -> Result<()> {
    loop {
        let out = w
            .job_output(
                vm,
                JobOutputRequest {
                    job,
                    stdout_cursor: 0,
                    stderr_cursor: 0,
                    max_bytes: 0,
                    wait_ms: 10_000,
                },
            )
            .await?;
        if let JobState::Finished(_) = out.state {
            return Ok(());
        }
    }
}

/// Boots QEMU directly with Warren's own command line for a VM directory prepared by
/// `vm create` (same kernel, per-VM initramfs and a fresh overlay of the same base), and
/// returns seconds from spawn to the agent's ready line.
pub(crate) async fn raw_boot(vm_dir: &std::path::Path, accel: warren_vmm::Accel) -> Result<f64> {
    let cfg: warren_supervisor::SupervisorConfig =
        serde_json::from_slice(&std::fs::read(vm_dir.join("supervisor.json"))?)?;
    let run_dir = tempfile_dir()?.join("raw");
    let _ = std::fs::remove_dir_all(&run_dir);
    std::fs::create_dir_all(&run_dir)?;
    let disk = run_dir.join("disk.qcow2");
    let base = qemu_img_backing(&cfg.launch.disk)?;
    warren_vmm::disk::create_overlay(&base, &disk)?;
    let initramfs = run_dir.join("initramfs.cpio");
    std::fs::copy(&cfg.launch.initramfs, &initramfs)?;
    let spec = LaunchSpec {
        name: "bench-raw".into(),
        run_dir: run_dir.clone(),
        stderr_log: run_dir.join("qemu.stderr"),
        disk,
        initramfs,
        memory: MemMib(cfg.launch.memory.0),
        run_as: None,
        cgroup: None,
        incoming: false,
        accel,
        ..cfg.launch.clone()
    };
    let backend = QemuBackend::new(warren_vmm::accel::find_qemu()?)?;
    let ep = QemuBackend::endpoints(&run_dir);
    let args =
        warren_vmm::qemu::qemu_args(&spec, warren_vmm::qemu::Attach::Paths(&ep), backend.tsc_khz);
    let t = Instant::now();
    let mut child = tokio::process::Command::new(&backend.qemu)
        .args(&args)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()?;
    let mut con = warren_supervisor::console::connect(&ep.console, Duration::from_secs(10)).await?;
    let mut seen = Vec::new();
    let found = tokio::time::timeout(Duration::from_secs(120), async {
        let mut buf = [0u8; 4096];
        loop {
            let n = con.read(&mut buf).await?;
            if n == 0 {
                return Ok::<bool, std::io::Error>(false);
            }
            seen.extend_from_slice(&buf[..n]);
            if String::from_utf8_lossy(&seen).contains(warren_protocol::READY_LINE) {
                return Ok(true);
            }
        }
    })
    .await;
    let elapsed = t.elapsed().as_secs_f64();
    let _ = child.start_kill();
    let _ = child.wait().await;
    let _ = std::fs::remove_dir_all(&run_dir);
    match found {
        Ok(Ok(true)) => Ok(elapsed),
        _ => bail!(
            "raw boot did not reach the agent: {}",
            String::from_utf8_lossy(&seen)
        ),
    }
}

fn qemu_img_backing(overlay: &std::path::Path) -> Result<std::path::PathBuf> {
    let out = std::process::Command::new("qemu-img")
        .args(["info", "--output=json", "-U"])
        .arg(overlay)
        .output()?;
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    v["full-backing-filename"]
        .as_str()
        .or_else(|| v["backing-filename"].as_str())
        .map(std::path::PathBuf::from)
        .context("overlay has no backing file")
}
