//! The session part of `warren bench --suite instant`: a session (a copy of a small git
//! repository, three shares) created to its first exec, booted cold and restored from the
//! template of its shape, and a fork of a session's VM into two new sessions to both first
//! execs. The baseline is the cold session create of the same run.

use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result};
use warren_core::{CreateSession, ForkVm, SessionDevices, Warren};

use crate::bench::{exec_true, pct, wait_job};

/// What the session part measured, in ms.
#[derive(serde::Serialize, Default)]
pub struct SessionFigures {
    pub samples: usize,
    pub cold_create_to_exec_ms_p50: f64,
    pub template_create_to_exec_ms_p50: f64,
    pub template_vs_cold: f64,
    pub fork2_ms: f64,
    pub fork2_vs_cold: f64,
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1000.0
}

async fn first_exec(w: &Warren, vm: &str) -> Result<()> {
    let job = w.exec_start(vm, exec_true()).await?;
    wait_job(w, vm, job).await
}

/// A repository with one commit of a few files, at `dir`.
fn make_repo(dir: &Path) -> Result<()> {
    let git = |args: &[&str]| -> Result<()> {
        let out = std::process::Command::new("git")
            .args(["-c", "user.name=bench", "-c", "user.email=bench@localhost"])
            .args(args)
            .current_dir(dir)
            .output()
            .context("running git")?;
        anyhow::ensure!(out.status.success(), "git {args:?} failed");
        Ok(())
    };
    git(&["init", "-q"])?;
    for i in 0..16 {
        std::fs::write(dir.join(format!("f{i}.txt")), format!("file {i}\n"))?;
    }
    git(&["add", "-A"])?;
    git(&["commit", "-qm", "bench"])
}

/// `n` cold and `n` template session creates (the template built first, untimed), then a
/// fork of 2 of one session's VM.
pub async fn measure(w: &Warren, image: &str, n: usize) -> Result<SessionFigures> {
    let repo = tempfile::tempdir()?;
    let repo_path = repo.path().canonicalize()?;
    make_repo(&repo_path)?;
    let (uid, gid) = (
        nix::unistd::getuid().as_raw(),
        nix::unistd::getgid().as_raw(),
    );
    let req = |template: bool| CreateSession {
        repo: repo_path.clone(),
        name: None,
        direct: false,
        devices: SessionDevices {
            image: Some(image.to_string()),
            template,
            ..Default::default()
        },
        owner: (uid, gid),
        workspace: warren_core::local_workspace(nix::unistd::geteuid().as_raw()),
        limits: Default::default(),
        within: None,
    };
    let mut made = vec![];
    let result = async {
        let mut f = SessionFigures {
            samples: n,
            ..Default::default()
        };
        let (mut cold, mut tpl) = (vec![], vec![]);
        for (template, out) in [(false, &mut cold), (true, &mut tpl)] {
            if template {
                eprintln!("session template build");
                let (s, _) = w.create_session(&req(true), &mut |_| {}).await?;
                w.delete_session(&s, true).await?;
            }
            for i in 0..n {
                eprintln!(
                    "session {} {}/{n}",
                    if template { "template" } else { "cold" },
                    i + 1
                );
                let t = Instant::now();
                let (s, vm) = w.create_session(&req(template), &mut |_| {}).await?;
                first_exec(w, &vm.id).await?;
                out.push(ms(t));
                // One session VM at a time (the last one stays, to be forked).
                if i + 1 < n || !template {
                    w.delete_session(&s, true).await?;
                } else {
                    made.push(s);
                }
            }
        }
        f.cold_create_to_exec_ms_p50 = pct(&mut cold, 0.5);
        f.template_create_to_exec_ms_p50 = pct(&mut tpl, 0.5);
        f.template_vs_cold = f.template_create_to_exec_ms_p50 / f.cold_create_to_exec_ms_p50;

        eprintln!("session fork of 2");
        let parent = made
            .last()
            .and_then(|s| s.vm_id.clone())
            .context("no session VM to fork")?;
        let t = Instant::now();
        let copies = w
            .fork_vm(&ForkVm {
                vm_id: parent,
                count: 2,
                ..Default::default()
            })
            .await?;
        futures_util::future::try_join_all(copies.iter().map(|c| first_exec(w, &c.id))).await?;
        f.fork2_ms = ms(t);
        f.fork2_vs_cold = f.fork2_ms / f.cold_create_to_exec_ms_p50;
        let ws = warren_core::local_workspace(nix::unistd::geteuid().as_raw());
        for id in w.sessions_of_vms(&copies)? {
            made.push(w.session(&ws, &id)?);
        }
        Ok::<_, anyhow::Error>(f)
    }
    .await;
    for s in made {
        if let Err(e) = w.delete_session(&s, true).await {
            eprintln!("deleting bench session {}: {e}", s.name);
        }
    }
    result
}
