//! `warren bench --suite instant`: how fast a workspace is ready, against a cold create and
//! the raw QEMU floors measured in the same run.
//!
//! (floor) raw QEMU: boot of the same kernel, initramfs and disk to the agent's ready line
//!     (the cold floor), and a restore of the template's device state and RAM file to a
//!     running VM (the restore floor: spawn, `migrate-incoming`, `cont`); and the guest's
//!     own fork+exec+wait of `/bin/true` as the first thing asked after a standby resume
//!     (cold: the fresh VMM translates every guest path anew under TCG) and right after
//!     (warm). Restore floor plus cold fork+exec is what no resume to a first exec can beat;
//! (cold) `vm create` to the first exec result, booting;
//! (template) the same from the shape's template (built once first, timed on its own);
//! (pool) a warm-pool hand-out to the first exec result (refilled between samples, untimed);
//! (concurrent) 8 creates from the template at once, to all 8 first exec results;
//! (fork) a fork of 4 of a running VM, to all 4 first exec results;
//! (standby) resume from fast standby to the first exec result;
//! (sessions) a session created to its first exec cold and from its template, and a fork
//!   of a session's VM into 2 new sessions (`bench_instant_sessions.rs`);
//! (breakdown) where a template restore and a standby resume spend their time: the
//!     supervisor's own steps (socket up, VMM spawned, state restored, channel
//!     authenticated, rekeyed, thawed, ready) and the engine's wait, medians; under TCG also
//!     how many translation blocks the fresh VMM translated until the resumed VM was ready
//!     and for its first exec (QEMU's `info jit`): translation starts empty in every new VMM,
//!     and those counts are what the restore's time scales with.
//!
//! p50 and p99 over `--boots` samples (use 20); ratios against the cold create.

use std::collections::BTreeMap;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use warren_core::{CreateVm, ForkVm, PoolShape, SuspendMode, Warren};

use crate::bench::{discard_private_warren, exec_true, median, pct, private_warren, wait_job};
use crate::cli::{BenchArgs, Cli};

#[derive(serde::Serialize, Default)]
struct Report {
    accel: String,
    samples: usize,
    raw_boot_ms_median: f64,
    raw_restore_ms_median: f64,
    guest_fork_exec_after_restore_cold_ms_median: f64,
    guest_fork_exec_after_restore_warm_ms_median: f64,
    cold_create_to_exec_ms_p50: f64,
    cold_create_to_exec_ms_p99: f64,
    template_build_ms: f64,
    template_create_to_exec_ms_p50: f64,
    template_create_to_exec_ms_p99: f64,
    template_vs_cold: f64,
    pool_handout_to_exec_ms_p50: f64,
    pool_handout_to_exec_ms_p99: f64,
    pool_vs_cold: f64,
    concurrent8_template_ms: f64,
    concurrent8_vs_cold: f64,
    fork4_ms: f64,
    fork4_vs_cold: f64,
    /// Until `fork_vm` returned: the parent saved and all 4 copies ready.
    fork4_ready_ms: f64,
    standby_resume_to_exec_ms_p50: f64,
    standby_resume_to_exec_ms_p99: f64,
    standby_vs_cold: f64,
    template_breakdown_ms: BTreeMap<String, f64>,
    standby_breakdown_ms: BTreeMap<String, f64>,
    /// Translation blocks in the resumed VMM once it is ready (TCG only; medians).
    standby_tbs_at_ready: Option<f64>,
    /// Translation blocks the first exec after a standby resume added (TCG only; medians).
    standby_tbs_first_exec: Option<f64>,
    /// The same for a second exec right after (TCG only; medians): what stays once the first
    /// exec's code is translated.
    standby_tbs_second_exec: Option<f64>,
    /// A fork's copies' start steps (medians over the 4), from each supervisor's start.
    fork_copy_breakdown_ms: BTreeMap<String, f64>,
    sessions: crate::bench_instant_sessions::SessionFigures,
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1000.0
}

async fn first_exec(w: &Warren, vm: &str) -> Result<()> {
    let job = w.exec_start(vm, exec_true()).await?;
    wait_job(w, vm, job).await
}

/// The guest's own fork+exec+wait of `/bin/true`, twice, in ms (outside job accounting).
async fn guest_fork_exec(w: &Warren, vm: &str) -> Result<Vec<f64>> {
    use warren_protocol::{BenchRequest, GuestResponse, HostRequest};
    let sup = warren_supervisor::SupervisorClient::new(&w.vm_dir_path(vm).join("supervisor.sock"));
    match sup
        .guest(HostRequest::Bench(BenchRequest::ForkExecWait {
            iterations: 2,
        }))
        .await?
    {
        GuestResponse::Bench(b) => Ok(b.samples_ns.iter().map(|n| *n as f64 / 1e6).collect()),
        _ => bail!("unexpected bench reply"),
    }
}

/// How many translation blocks `vm`'s VMM holds (QEMU's `info jit` over the VM's QMP
/// socket; `None` where it has none, as under KVM). The supervisor connects to QMP only for
/// a lifecycle step, none of which runs while the bench asks.
async fn tb_count(w: &Warren, vm: &str) -> Option<f64> {
    let path = w.vm_dir_path(vm).join("vmm-qmp.sock");
    let mut q = warren_vmm::qemu::qmp::Qmp::connect(&path).await.ok()?;
    let out = q
        .execute(
            "human-monitor-command",
            Some(serde_json::json!({ "command-line": "info jit" })),
        )
        .await
        .ok()?;
    parse_tb_count(out.as_str()?)
}

/// The `TB count` line of `info jit`.
fn parse_tb_count(info: &str) -> Option<f64> {
    info.lines()
        .find_map(|l| l.strip_prefix("TB count"))
        .and_then(|n| n.trim().parse().ok())
}

/// The median of `v`, or `None` when it is empty.
fn median_of(mut v: Vec<f64>) -> Option<f64> {
    (!v.is_empty()).then(|| median(&mut v))
}

/// The supervisor's start steps of `vm`, plus the engine's total (`engine`) and the first
/// exec (`first exec`), in ms.
async fn steps(w: &Warren, vm: &str) -> Vec<(String, f64)> {
    let sup = warren_supervisor::SupervisorClient::new(&w.vm_dir_path(vm).join("supervisor.sock"));
    sup.status()
        .await
        .map(|s| s.timings.into_iter().map(|(k, v)| (k, v as f64)).collect())
        .unwrap_or_default()
}

fn add_steps(acc: &mut BTreeMap<String, Vec<f64>>, steps: Vec<(String, f64)>) {
    for (i, (k, v)) in steps.into_iter().enumerate() {
        acc.entry(format!("{i:02} {k}")).or_default().push(v);
    }
}

fn medians(acc: BTreeMap<String, Vec<f64>>) -> BTreeMap<String, f64> {
    acc.into_iter()
        .map(|(k, mut v)| (k, median(&mut v)))
        .collect()
}

pub async fn run(cli: &Cli, args: &BenchArgs) -> Result<i32> {
    let (w, state) = private_warren(cli, args, "instant")?;
    let r = measure(&w, args).await;
    discard_private_warren(&w, &state).await;
    let r = r?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
        return Ok(0);
    }
    println!(
        "accelerator: {}  ({} samples per figure; p50 / p99)",
        r.accel, r.samples
    );
    println!(
        "(floor)      raw QEMU boot to ready line {:.0} ms   raw restore of the template {:.0} ms",
        r.raw_boot_ms_median, r.raw_restore_ms_median
    );
    println!(
        "(floor)      guest fork+exec+wait of /bin/true right after a standby resume {:.0} ms (cold), {:.1} ms (warm)",
        r.guest_fork_exec_after_restore_cold_ms_median, r.guest_fork_exec_after_restore_warm_ms_median
    );
    println!(
        "(cold)       create to first exec {:.0} / {:.0} ms",
        r.cold_create_to_exec_ms_p50, r.cold_create_to_exec_ms_p99
    );
    println!(
        "(template)   build {:.0} ms once; create to first exec {:.0} / {:.0} ms   ratio {:.3} (target <= 0.15)",
        r.template_build_ms,
        r.template_create_to_exec_ms_p50,
        r.template_create_to_exec_ms_p99,
        r.template_vs_cold
    );
    println!(
        "(pool)       hand-out to first exec {:.0} / {:.0} ms   ratio {:.3} (target p50 <= 150 ms)",
        r.pool_handout_to_exec_ms_p50, r.pool_handout_to_exec_ms_p99, r.pool_vs_cold
    );
    println!(
        "(concurrent) 8 template creates to 8 first execs {:.0} ms   ratio vs one cold {:.3}",
        r.concurrent8_template_ms, r.concurrent8_vs_cold
    );
    println!(
        "(fork)       fork of 4 to 4 first execs {:.0} ms   ratio vs one cold {:.3} (target <= 0.5); copies ready after {:.0} ms",
        r.fork4_ms, r.fork4_vs_cold, r.fork4_ready_ms
    );
    println!(
        "(standby)    resume to first exec {:.0} / {:.0} ms   ratio {:.3} (target <= 0.1)",
        r.standby_resume_to_exec_ms_p50, r.standby_resume_to_exec_ms_p99, r.standby_vs_cold
    );
    if let (Some(ready), Some(first), Some(second)) = (
        r.standby_tbs_at_ready,
        r.standby_tbs_first_exec,
        r.standby_tbs_second_exec,
    ) {
        println!(
            "(translation) standby resume: {ready:.0} blocks translated until ready, +{first:.0} for the first exec, +{second:.0} for the second"
        );
    }
    let s = &r.sessions;
    println!(
        "(sessions)   create to first exec: cold {:.0} ms, template {:.0} ms   ratio {:.3}; fork of 2 to 2 first execs {:.0} ms   ratio vs one cold session {:.3}  ({} samples)",
        s.cold_create_to_exec_ms_p50,
        s.template_create_to_exec_ms_p50,
        s.template_vs_cold,
        s.fork2_ms,
        s.fork2_vs_cold,
        s.samples
    );
    for (name, b) in [
        ("template restore", &r.template_breakdown_ms),
        ("standby resume", &r.standby_breakdown_ms),
        ("fork copy", &r.fork_copy_breakdown_ms),
    ] {
        let parts: Vec<String> = b.iter().map(|(k, v)| format!("{k} {v:.0}")).collect();
        println!("(breakdown)  {name}: {}", parts.join(" | "));
    }
    Ok(0)
}

async fn measure(w: &Warren, args: &BenchArgs) -> Result<Report> {
    let n = args.boots;
    if n == 0 {
        bail!("--boots must be positive");
    }
    let base = CreateVm {
        image: Some(args.image.clone()),
        idle_seconds: Some(0),
        ..Default::default()
    };
    let templ = CreateVm {
        template: true,
        ..base.clone()
    };
    let mut r = Report {
        samples: n,
        ..Report::default()
    };
    let image = w.images().verify(&w.images().resolve(&args.image)?)?;
    let (accel, _) = w.resolve_accel(&image).await?;

    // Cold creates, and the raw boot floor on the first VM's own files.
    let (mut cold, mut raw) = (vec![], vec![]);
    for i in 0..n {
        eprintln!("cold {}/{n}", i + 1);
        let t = Instant::now();
        let rec = w.create_vm(&base, &mut |_| {}).await?;
        first_exec(w, &rec.id).await?;
        cold.push(ms(t));
        r.accel = rec.accel.clone();
        if i < 5 {
            raw.push(crate::bench::raw_boot(&w.vm_dir_path(&rec.id), accel).await? * 1000.0);
        }
        w.destroy_vm(&rec.id).await?;
    }
    r.raw_boot_ms_median = median(&mut raw);
    r.cold_create_to_exec_ms_p50 = pct(&mut cold, 0.5);
    r.cold_create_to_exec_ms_p99 = pct(&mut cold, 0.99);
    let cold50 = r.cold_create_to_exec_ms_p50;

    // The template: built by the first create.
    eprintln!("template build");
    let t = Instant::now();
    let rec = w.create_vm(&templ, &mut |_| {}).await?;
    r.template_build_ms = ms(t);
    w.destroy_vm(&rec.id).await?;
    let (mut tpl, mut tsteps) = (vec![], BTreeMap::new());
    for i in 0..n {
        eprintln!("template {}/{n}", i + 1);
        let t = Instant::now();
        let rec = w.create_vm(&templ, &mut |_| {}).await?;
        let created = ms(t);
        first_exec(w, &rec.id).await?;
        tpl.push(ms(t));
        let mut s = steps(w, &rec.id).await;
        s.push(("engine create".into(), created));
        s.push(("first exec done".into(), ms(t)));
        add_steps(&mut tsteps, s);
        w.destroy_vm(&rec.id).await?;
    }
    r.template_create_to_exec_ms_p50 = pct(&mut tpl, 0.5);
    r.template_create_to_exec_ms_p99 = pct(&mut tpl, 0.99);
    r.template_vs_cold = r.template_create_to_exec_ms_p50 / cold50;
    r.template_breakdown_ms = medians(tsteps);
    let template_dir = w
        .list_templates()?
        .into_iter()
        .next()
        .map(|t| w.config().state_dir.join("templates").join(t.name))
        .context("no template after building one")?;
    let mut raw_restore = vec![];
    for _ in 0..n.min(5) {
        raw_restore.push(crate::bench_floor::raw_restore(w, &template_dir).await?);
    }
    r.raw_restore_ms_median = median(&mut raw_restore);

    // The warm pool: hand-outs, refilled between samples outside the timing.
    let shape = PoolShape {
        image: args.image.clone(),
        memory_mib: None,
        vcpus: None,
    };
    let mut pool = vec![];
    for i in 0..n {
        eprintln!("pool {}/{n}", i + 1);
        w.fill_pool(&shape, 1, Default::default()).await?;
        let t = Instant::now();
        let rec = w.create_vm(&templ, &mut |_| {}).await?;
        first_exec(w, &rec.id).await?;
        pool.push(ms(t));
        w.destroy_vm(&rec.id).await?;
    }
    r.pool_handout_to_exec_ms_p50 = pct(&mut pool, 0.5);
    r.pool_handout_to_exec_ms_p99 = pct(&mut pool, 0.99);
    r.pool_vs_cold = r.pool_handout_to_exec_ms_p50 / cold50;

    // 8 concurrent creates from the template.
    eprintln!("8 concurrent");
    let t = Instant::now();
    let made = futures_util::future::join_all((0..8).map(|_| async {
        let rec = w.create_vm(&templ, &mut |_| {}).await?;
        first_exec(w, &rec.id).await?;
        Ok::<_, anyhow::Error>(rec.id)
    }))
    .await;
    r.concurrent8_template_ms = ms(t);
    r.concurrent8_vs_cold = r.concurrent8_template_ms / cold50;
    let mut ids = vec![];
    for m in made {
        ids.push(m?);
    }
    for id in &ids {
        w.destroy_vm(id).await?;
    }

    // A fork of 4 of a running VM.
    eprintln!("fork of 4");
    let parent = w.create_vm(&templ, &mut |_| {}).await?;
    first_exec(w, &parent.id).await?;
    let t = Instant::now();
    let copies = w
        .fork_vm(&ForkVm {
            vm_id: parent.id.clone(),
            count: 4,
            ..Default::default()
        })
        .await?;
    r.fork4_ready_ms = ms(t);
    futures_util::future::try_join_all(copies.iter().map(|c| first_exec(w, &c.id))).await?;
    r.fork4_ms = ms(t);
    r.fork4_vs_cold = r.fork4_ms / cold50;
    let mut fsteps = BTreeMap::new();
    for c in &copies {
        add_steps(&mut fsteps, steps(w, &c.id).await);
    }
    r.fork_copy_breakdown_ms = medians(fsteps);
    for c in copies
        .iter()
        .map(|c| c.id.clone())
        .chain([parent.id.clone()])
    {
        w.destroy_vm(&c).await?;
    }

    // Resume from fast standby.
    let sb = w
        .create_vm(
            &CreateVm {
                ram_file: true,
                ..base.clone()
            },
            &mut |_| {},
        )
        .await?;
    first_exec(w, &sb.id).await?;
    let (mut standby, mut ssteps) = (vec![], BTreeMap::new());
    let (mut at_ready, mut first_tbs, mut second_tbs) = (vec![], vec![], vec![]);
    for i in 0..n {
        eprintln!("standby {}/{n}", i + 1);
        w.suspend_vm(&sb.id, SuspendMode::Hibernate, true).await?;
        let t = Instant::now();
        w.resume_vm(&sb.id).await?;
        let resumed = ms(t);
        first_exec(w, &sb.id).await?;
        standby.push(ms(t));
        let mut s = steps(w, &sb.id).await;
        s.push(("engine resume".into(), resumed));
        s.push(("first exec done".into(), ms(t)));
        add_steps(&mut ssteps, s);
    }
    // Translation counts, apart from the timed samples (asking QMP takes the VMM's time).
    for _ in 0..n.min(3) {
        w.suspend_vm(&sb.id, SuspendMode::Hibernate, true).await?;
        w.resume_vm(&sb.id).await?;
        let Some(ready) = tb_count(w, &sb.id).await else {
            break;
        };
        first_exec(w, &sb.id).await?;
        let first = tb_count(w, &sb.id).await;
        first_exec(w, &sb.id).await?;
        let second = tb_count(w, &sb.id).await;
        if let (Some(first), Some(second)) = (first, second) {
            at_ready.push(ready);
            first_tbs.push(first - ready);
            second_tbs.push(second - first);
        }
    }
    r.standby_tbs_at_ready = median_of(at_ready);
    r.standby_tbs_first_exec = median_of(first_tbs);
    r.standby_tbs_second_exec = median_of(second_tbs);
    // The floor: the guest's own fork+exec+wait as the first request after a resume.
    let (mut cold_fe, mut warm_fe) = (vec![], vec![]);
    for _ in 0..n.min(5) {
        w.suspend_vm(&sb.id, SuspendMode::Hibernate, true).await?;
        w.resume_vm(&sb.id).await?;
        let samples = guest_fork_exec(w, &sb.id).await?;
        let [cold, warm, ..] = samples[..] else {
            bail!(
                "the guest's bench answered {} samples, not 2",
                samples.len()
            );
        };
        cold_fe.push(cold);
        warm_fe.push(warm);
    }
    r.guest_fork_exec_after_restore_cold_ms_median = median(&mut cold_fe);
    r.guest_fork_exec_after_restore_warm_ms_median = median(&mut warm_fe);
    w.destroy_vm(&sb.id).await?;
    r.standby_resume_to_exec_ms_p50 = pct(&mut standby, 0.5);
    r.standby_resume_to_exec_ms_p99 = pct(&mut standby, 0.99);
    r.standby_vs_cold = r.standby_resume_to_exec_ms_p50 / cold50;
    r.standby_breakdown_ms = medians(ssteps);

    // Session VMs (three shares): cold against their template, and a fork of a session.
    r.sessions = crate::bench_instant_sessions::measure(w, &args.image, n.min(5)).await?;
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_tb_count_is_read_from_info_jit() {
        let info = "Translation buffer state:\ngen code size       7271267/67103744\nTB count            11619\nTB avg target size  20 max=514 bytes\n";
        assert_eq!(parse_tb_count(info), Some(11619.0));
        assert_eq!(parse_tb_count("kvm: no translation\n"), None);
        assert_eq!(parse_tb_count("TB count  many\n"), None);
    }
}
