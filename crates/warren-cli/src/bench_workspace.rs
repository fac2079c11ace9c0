//! `warren bench --suite workspace`: a session's `/workspace` (virtio-fs) against the guest's
//! own disk, measured in the same VM and run.
//!
//! (k) `git status` in a repository of `--mib`×64 small committed files plus a few edits: the
//!     session copy at /workspace vs the same repository copied onto the guest's disk;
//! (l) many small files: create 10,000 files, stat them all, delete them (in-guest wall
//!     time, one python process, so exec overhead is excluded);
//! (m) host→guest visibility of an edit: the host rewrites a file; a guest poller (python,
//!     polling every 1 ms) notices the new content and answers by writing a file the host
//!     polls for: the round trip, halved, is the latency.

use std::path::Path;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use warren_core::{CreateSession, SessionDevices, Warren};

use crate::bench::{discard_private_warren, exec_true, median, private_warren, run_argv};
use crate::cli::{BenchArgs, Cli};

const SMALL_FILES: usize = 10_000;

#[derive(serde::Serialize)]
struct Report {
    accel: String,
    runs: usize,
    repo_files: usize,
    git_status_workspace_ms_median: f64,
    git_status_disk_ms_median: f64,
    git_status_ratio: f64,
    small_files_workspace_ms_median: f64,
    small_files_disk_ms_median: f64,
    small_files_ratio: f64,
    host_to_guest_visibility_ms_median: f64,
}

pub async fn run(cli: &Cli, args: &BenchArgs) -> Result<i32> {
    let (w, state) = private_warren(cli, args, "workspace")?;
    let repo = state.join("bench-repo");
    let r = measure(&w, args, &repo).await;
    discard_private_warren(&w, &state).await;
    let r = r?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        println!(
            "accelerator: {}  (medians over {} runs; repository of {} files)",
            r.accel, r.runs, r.repo_files
        );
        println!(
            "git status:        /workspace {:8.1} ms   guest disk {:8.1} ms   ratio {:.2}",
            r.git_status_workspace_ms_median, r.git_status_disk_ms_median, r.git_status_ratio
        );
        println!(
            "10k small files:   /workspace {:8.1} ms   guest disk {:8.1} ms   ratio {:.2}",
            r.small_files_workspace_ms_median, r.small_files_disk_ms_median, r.small_files_ratio
        );
        println!(
            "host edit visible in the guest after {:.1} ms (median)",
            r.host_to_guest_visibility_ms_median
        );
    }
    Ok(0)
}

fn git(dir: &Path, args: &[&str]) -> Result<()> {
    let st = std::process::Command::new("git")
        .args(["-c", "user.name=bench", "-c", "user.email=bench@localhost"])
        .args(args)
        .current_dir(dir)
        .stdout(std::process::Stdio::null())
        .status()
        .context("git")?;
    if !st.success() {
        bail!("git {args:?} failed");
    }
    Ok(())
}

/// A repository of `n` small committed files in 64 directories, with a few edits.
fn make_repo(dir: &Path, n: usize) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    git(dir, &["init", "-q", "-b", "main"])?;
    for i in 0..n {
        let d = dir.join(format!("d{:02}", i % 64));
        std::fs::create_dir_all(&d)?;
        std::fs::write(d.join(format!("f{i}.txt")), format!("line {i}\n"))?;
    }
    git(dir, &["add", "-A"])?;
    git(dir, &["commit", "-qm", "bench"])?;
    for i in 0..10 {
        std::fs::write(dir.join(format!("d00/f{}.txt", i * 64)), "edited\n")?;
    }
    Ok(())
}

async fn sh(w: &Warren, vm: &str, script: &str) -> Result<String> {
    run_argv(w, vm, vec!["sh".into(), "-c".into(), script.into()]).await
}

/// In-guest milliseconds of the python `body`, run in `dir`.
async fn timed(w: &Warren, vm: &str, dir: &str, body: &str) -> Result<f64> {
    let code = format!(
        "import time, os, subprocess\nos.chdir({dir:?})\nt = time.monotonic()\n{body}\nprint((time.monotonic() - t) * 1000)"
    );
    let out = run_argv(w, vm, vec!["python3".into(), "-c".into(), code]).await?;
    out.trim()
        .lines()
        .last()
        .and_then(|l| l.parse::<f64>().ok())
        .with_context(|| format!("no timing in {out:?}"))
}

async fn measure(w: &Warren, args: &BenchArgs, repo: &Path) -> Result<Report> {
    let runs = args.boots.max(1);
    let files = args.mib.max(1) * 64;
    make_repo(repo, files)?;
    let (uid, gid) = (
        nix::unistd::getuid().as_raw(),
        nix::unistd::getgid().as_raw(),
    );
    let req = CreateSession {
        repo: repo.to_path_buf(),
        name: Some("bench".into()),
        direct: false,
        devices: SessionDevices {
            image: Some(args.image.clone()),
            ..Default::default()
        },
        owner: (uid, gid),
        workspace: warren_core::local_workspace(nix::unistd::geteuid().as_raw()),
        limits: Default::default(),
        within: None,
    };
    let (session, vm) = w.create_session(&req, &mut |_| {}).await?;
    let id = vm.id.clone();
    // The same repository on the guest's disk; its alternates point at the absolute guest
    // path of the source objects.
    sh(
        w,
        &id,
        "cp -a /workspace /home/user/disk-repo && \
         echo /.warren-source-objects > /home/user/disk-repo/.git/objects/info/alternates && \
         mkdir -p /home/user/disk-small /workspace/.bench-small && \
         git -C /workspace status -s >/dev/null && git -C /home/user/disk-repo status -s >/dev/null",
    )
    .await?;
    let status =
        "subprocess.run(['git', 'status', '--porcelain'], check=True, stdout=subprocess.DEVNULL)";
    let small = format!(
        "n={SMALL_FILES}\nfor i in range(n):\n  open('f%d'%i,'w').write('x')\nfor i in range(n):\n  os.stat('f%d'%i)\nfor i in range(n):\n  os.unlink('f%d'%i)"
    );
    let (mut st_ws, mut st_disk, mut sm_ws, mut sm_disk) = (vec![], vec![], vec![], vec![]);
    for i in 0..runs {
        eprintln!("run {}/{runs}", i + 1);
        st_ws.push(timed(w, &id, "/workspace", status).await?);
        st_disk.push(timed(w, &id, "/home/user/disk-repo", status).await?);
        sm_ws.push(timed(w, &id, "/workspace/.bench-small", &small).await?);
        sm_disk.push(timed(w, &id, "/home/user/disk-small", &small).await?);
    }

    // Visibility: a guest poller answers each new value of `ping` with the same value in
    // `pong`; the host times the round trip.
    let ws = warren_session::workspace_dir(&session.dir);
    let (ping, pong) = (ws.join(".bench-ping"), ws.join(".bench-pong"));
    std::fs::write(&ping, "0")?;
    let mut poller = exec_true();
    poller.argv = vec![
        "python3".into(),
        "-c".into(),
        "import time\nlast='0'\nwhile True:\n  try: v=open('/workspace/.bench-ping').read()\n  except OSError: v=last\n  if v!=last:\n    open('/workspace/.bench-pong','w').write(v); last=v\n  time.sleep(0.001)".into(),
    ];
    let job = w.exec_start(&id, poller).await?;
    let mut vis = vec![];
    for i in 1..=(runs * 10) {
        let value = i.to_string();
        let t = Instant::now();
        std::fs::write(&ping, &value)?;
        loop {
            if std::fs::read_to_string(&pong).ok().as_deref() == Some(value.as_str()) {
                break;
            }
            if t.elapsed().as_secs() > 10 {
                bail!("the guest did not see edit {i} within 10 s");
            }
            tokio::time::sleep(std::time::Duration::from_micros(200)).await;
        }
        vis.push(t.elapsed().as_secs_f64() * 1000.0 / 2.0);
    }
    w.job_cancel(&id, job).await?;
    let (a, b) = (median(&mut st_ws), median(&mut st_disk));
    let (c, d) = (median(&mut sm_ws), median(&mut sm_disk));
    Ok(Report {
        accel: vm.accel,
        runs,
        repo_files: files,
        git_status_workspace_ms_median: a,
        git_status_disk_ms_median: b,
        git_status_ratio: a / b,
        small_files_workspace_ms_median: c,
        small_files_disk_ms_median: d,
        small_files_ratio: c / d,
        host_to_guest_visibility_ms_median: median(&mut vis),
    })
}
