//! `warren bench --suite suspend`: suspension costs, against a cold boot measured in the
//! same run.
//!
//! (g) pause and resume latency (`vm suspend --mode pause` / `vm resume`, jobs frozen and
//!     thawed, clock synced);
//! (h) hibernate: save time and checkpoint size with the guest idle and with 128 MiB more
//!     guest RAM touched (random bytes in the guest's tmpfs), giving the cost per GiB touched;
//! (i) resume from hibernation to the first exec result vs a cold `vm create` to the first
//!     exec result (target ratio <= 0.1);
//! (j) host RSS of the VM's QEMU while paused; a hibernated VM has no process at all;
//! (standby) the same VM created with `--ram-file`: hibernate (device state plus flushing the
//!     RAM file) and resume to the first exec result;
//! (share) a VM with a share at `/workspace` and a job working in it: resume from pause, and
//!     resume from hibernation to the first exec result, which include the agent's share
//!     revalidation (`warren-guest::coherence`).

use std::time::Instant;

use anyhow::{bail, Context, Result};
use warren_core::{CreateVm, SuspendMode, Warren};

use crate::bench::{discard_private_warren, exec_true, median, private_warren, wait_job};
use crate::cli::{BenchArgs, Cli};

/// MiB of guest memory touched for the per-GiB figures.
const TOUCH_MIB: u64 = 128;

#[derive(serde::Serialize)]
struct Report {
    accel: String,
    cycles: usize,
    pause_ms_median: f64,
    resume_from_pause_ms_median: f64,
    hibernate_idle_ms_median: f64,
    checkpoint_idle_mib: f64,
    hibernate_touched_ms_median: f64,
    checkpoint_touched_mib: f64,
    hibernate_ms_per_gib_touched: f64,
    checkpoint_mib_per_gib_touched: f64,
    resume_to_first_exec_ms_median: f64,
    cold_create_to_first_exec_ms_median: f64,
    resume_vs_cold: f64,
    paused_qemu_rss_mib: f64,
    hibernated_host_rss_mib: f64,
    standby_hibernate_ms_median: f64,
    standby_state_kib: f64,
    standby_resume_to_first_exec_ms_median: f64,
    standby_resume_vs_cold: f64,
    share_resume_from_pause_ms_median: f64,
    share_resume_to_first_exec_ms_median: f64,
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1000.0
}

fn rss_mib(pid: u32) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<f64>().ok())
        })
        .map(|kb| kb / 1024.0)
        .unwrap_or(f64::NAN)
}

pub async fn run(cli: &Cli, args: &BenchArgs) -> Result<i32> {
    let (w, state) = private_warren(cli, args, "suspend")?;
    let r = measure(&w, args).await;
    discard_private_warren(&w, &state).await;
    let r = r?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        println!(
            "accelerator: {}  (medians over {} cycles)",
            r.accel, r.cycles
        );
        println!(
            "(g) pause {:.1} ms   resume from pause {:.1} ms",
            r.pause_ms_median, r.resume_from_pause_ms_median
        );
        println!(
            "(h) hibernate idle guest {:.0} ms, checkpoint {:.0} MiB; with {TOUCH_MIB} MiB more touched {:.0} ms, {:.0} MiB  => {:.0} ms and {:.0} MiB per GiB touched",
            r.hibernate_idle_ms_median,
            r.checkpoint_idle_mib,
            r.hibernate_touched_ms_median,
            r.checkpoint_touched_mib,
            r.hibernate_ms_per_gib_touched,
            r.checkpoint_mib_per_gib_touched
        );
        println!(
            "(i) resume from hibernation to first exec {:.0} ms   cold create to first exec {:.0} ms   ratio {:.3} (target <= 0.1)",
            r.resume_to_first_exec_ms_median, r.cold_create_to_first_exec_ms_median, r.resume_vs_cold
        );
        println!(
            "(j) host RSS: paused QEMU {:.0} MiB   hibernated {:.0} MiB (no process)",
            r.paused_qemu_rss_mib, r.hibernated_host_rss_mib
        );
        println!(
            "(standby) hibernate {:.0} ms, state {:.0} KiB; resume to first exec {:.0} ms   ratio vs cold {:.3}",
            r.standby_hibernate_ms_median,
            r.standby_state_kib,
            r.standby_resume_to_first_exec_ms_median,
            r.standby_resume_vs_cold
        );
        println!(
            "(share) resume from pause {:.1} ms   resume from hibernation to first exec {:.0} ms",
            r.share_resume_from_pause_ms_median, r.share_resume_to_first_exec_ms_median
        );
    }
    Ok(0)
}

async fn first_exec(w: &Warren, vm: &str) -> Result<()> {
    let job = w.exec_start(vm, exec_true()).await?;
    wait_job(w, vm, job).await
}

async fn hibernate(w: &Warren, vm: &str) -> Result<(f64, f64)> {
    let t = Instant::now();
    w.suspend_vm(vm, SuspendMode::Hibernate, true).await?;
    let took = ms(t);
    let size = std::fs::metadata(w.vm_dir_path(vm).join("run/checkpoint.ram"))
        .map(|m| {
            use std::os::unix::fs::MetadataExt;
            m.blocks() as f64 * 512.0 / (1024.0 * 1024.0)
        })
        .context("checkpoint file")?;
    Ok((took, size))
}

async fn measure(w: &Warren, args: &BenchArgs) -> Result<Report> {
    let cycles = args.boots;
    if cycles == 0 {
        bail!("--boots must be positive");
    }
    let create = CreateVm {
        image: Some(args.image.clone()),
        idle_seconds: Some(0),
        ..Default::default()
    };
    let (mut cold, mut pause, mut unpause, mut hib_idle, mut hib_touched, mut resume) =
        (vec![], vec![], vec![], vec![], vec![], vec![]);
    let (mut size_idle, mut size_touched, mut rss) = (vec![], vec![], vec![]);
    let (mut sb_hib, mut sb_size, mut sb_resume) = (vec![], vec![], vec![]);
    let (mut sh_unpause, mut sh_resume) = (vec![], vec![]);
    let share_dir = crate::bench::tempfile_dir()?.join("suspend-share");
    std::fs::create_dir_all(&share_dir)?;
    for i in 0..64 {
        std::fs::write(share_dir.join(format!("f{i}")), "x\n")?;
    }
    let mut accel = String::new();
    for i in 0..cycles {
        eprintln!("cycle {}/{cycles}", i + 1);
        let t = Instant::now();
        let rec = w.create_vm(&create, &mut |_| {}).await?;
        first_exec(w, &rec.id).await?;
        cold.push(ms(t));
        accel = rec.accel.clone();

        let t = Instant::now();
        w.suspend_vm(&rec.id, SuspendMode::Pause, true).await?;
        pause.push(ms(t));
        let sup = warren_supervisor::SupervisorClient::new(
            &w.vm_dir_path(&rec.id).join("supervisor.sock"),
        );
        if let Some(p) = sup.status().await.ok().and_then(|s| s.vmm_pid) {
            rss.push(rss_mib(p));
        }
        let t = Instant::now();
        w.resume_vm(&rec.id).await?;
        unpause.push(ms(t));

        let (took, size) = hibernate(w, &rec.id).await?;
        hib_idle.push(took);
        size_idle.push(size);
        let t = Instant::now();
        first_exec(w, &rec.id).await?;
        resume.push(ms(t));

        let fill = format!("head -c {TOUCH_MIB}M /dev/urandom > /tmp/bench-fill");
        let mut job = exec_true();
        job.argv = vec!["sh".into(), "-c".into(), fill];
        let id = w.exec_start(&rec.id, job).await?;
        wait_job(w, &rec.id, id).await?;
        let (took, size) = hibernate(w, &rec.id).await?;
        hib_touched.push(took);
        size_touched.push(size);
        w.destroy_vm(&rec.id).await?;

        // Fast standby: RAM in the VM's file, device state only in the checkpoint.
        let sb = w
            .create_vm(
                &CreateVm {
                    ram_file: true,
                    ..create.clone()
                },
                &mut |_| {},
            )
            .await?;
        first_exec(w, &sb.id).await?;
        let (took, size) = hibernate(w, &sb.id).await?;
        sb_hib.push(took);
        sb_size.push(size * 1024.0);
        let t = Instant::now();
        first_exec(w, &sb.id).await?;
        sb_resume.push(ms(t));
        w.destroy_vm(&sb.id).await?;

        // A share with a job that holds its directory and a file of it.
        let uid = nix::unistd::getuid().as_raw();
        let gid = nix::unistd::getgid().as_raw();
        let sh = w
            .create_vm(
                &CreateVm {
                    mounts: vec![warren_core::MountSpec {
                        host: share_dir.canonicalize()?,
                        guest: "/workspace".into(),
                        read_only: false,
                        owner: Some((uid, gid)),
                        identity: None,
                    }],
                    ..create.clone()
                },
                &mut |_| {},
            )
            .await?;
        let mut job = exec_true();
        job.argv = [
            "sh",
            "-c",
            "exec 3</workspace/f0; ls /workspace >/dev/null; sleep 3600",
        ]
        .map(String::from)
        .to_vec();
        w.exec_start(&sh.id, job).await?;
        first_exec(w, &sh.id).await?;
        w.suspend_vm(&sh.id, SuspendMode::Pause, true).await?;
        let t = Instant::now();
        w.resume_vm(&sh.id).await?;
        sh_unpause.push(ms(t));
        hibernate(w, &sh.id).await?;
        let t = Instant::now();
        first_exec(w, &sh.id).await?;
        sh_resume.push(ms(t));
        w.destroy_vm(&sh.id).await?;
    }
    let _ = std::fs::remove_dir_all(&share_dir);
    let (hi, ht) = (median(&mut hib_idle), median(&mut hib_touched));
    let (si, st) = (median(&mut size_idle), median(&mut size_touched));
    let gib = TOUCH_MIB as f64 / 1024.0;
    let (r, c) = (median(&mut resume), median(&mut cold));
    Ok(Report {
        accel,
        cycles,
        pause_ms_median: median(&mut pause),
        resume_from_pause_ms_median: median(&mut unpause),
        hibernate_idle_ms_median: hi,
        checkpoint_idle_mib: si,
        hibernate_touched_ms_median: ht,
        checkpoint_touched_mib: st,
        hibernate_ms_per_gib_touched: (ht - hi) / gib,
        checkpoint_mib_per_gib_touched: (st - si) / gib,
        resume_to_first_exec_ms_median: r,
        cold_create_to_first_exec_ms_median: c,
        resume_vs_cold: r / c,
        paused_qemu_rss_mib: median(&mut rss),
        hibernated_host_rss_mib: 0.0,
        standby_hibernate_ms_median: median(&mut sb_hib),
        standby_state_kib: median(&mut sb_size),
        standby_resume_to_first_exec_ms_median: median(&mut sb_resume),
        standby_resume_vs_cold: median(&mut sb_resume) / c,
        share_resume_from_pause_ms_median: median(&mut sh_unpause),
        share_resume_to_first_exec_ms_median: median(&mut sh_resume),
    })
}
