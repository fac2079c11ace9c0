//! Job manager tests on the host: no PID 1, no uid switch; cgroup v2 when the host offers a
//! writable one (else the test-only process-group fallback; the cgroup-only test fails).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

use tempfile::TempDir;
use warren_protocol::limits::{
    MAX_INPUT_CHUNK, MAX_READ_PER_STREAM, MAX_REQUEST_KEY_BYTES, MAX_RETAINED_OUTPUT,
};
use warren_protocol::{ExecInteractive, JobResize};

use super::*;
use crate::reaper::ReapMode;
use warren_protocol::JobExit;

/// A cgroup v2 directory for one test, removed on drop.
pub(super) struct TestCgroup(PathBuf);

impl Drop for TestCgroup {
    fn drop(&mut self) {
        if let Ok(entries) = fs::read_dir(&self.0) {
            for e in entries.flatten() {
                if e.path().is_dir() {
                    let _ = fs::write(e.path().join("cgroup.kill"), b"1");
                    let _ = fs::remove_dir(e.path());
                }
            }
        }
        let _ = fs::remove_dir(&self.0);
    }
}

pub(super) fn test_cgroup() -> Option<TestCgroup> {
    static SEQ: AtomicU32 = AtomicU32::new(0);
    for base in ["/sys/fs/cgroup/unified", "/sys/fs/cgroup"] {
        let base = Path::new(base);
        if !base.join("cgroup.procs").exists() || !base.join("cgroup.subtree_control").exists() {
            continue;
        }
        let dir = base.join(format!(
            "warren-guest-test-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        if fs::create_dir(&dir).is_err() {
            continue;
        }
        let cg = TestCgroup(dir);
        if cg.0.join("cgroup.kill").exists() {
            return Some(cg);
        }
    }
    None
}

pub(super) struct Fixture {
    pub(super) jobs: Arc<JobManager>,
    ws: TempDir,
    _cgroup: Option<TestCgroup>,
}

fn fixture_with(cgroup: Option<TestCgroup>, max_running: usize, max_records: usize) -> Fixture {
    fixture_cfg(cgroup, |cfg| {
        cfg.max_running = max_running;
        cfg.max_records = max_records;
    })
}

/// A fixture with the protocol's limits, then `edit` applied to its configuration.
pub(super) fn fixture_cfg(
    cgroup: Option<TestCgroup>,
    edit: impl FnOnce(&mut JobsConfig),
) -> Fixture {
    let ws = tempfile::tempdir().expect("tempdir");
    let containment = match &cgroup {
        Some(cg) => Containment::Cgroup(cg.0.clone()),
        None => Containment::ProcessGroupForTestsOnly,
    };
    let mut cfg = JobsConfig {
        files: FilesConfig {
            workspace: ws.path().to_path_buf(),
            user: None,
        },
        containment,
        max_running: MAX_RUNNING_JOBS,
        max_records: MAX_JOB_RECORDS,
        max_live: MAX_LIVE_JOBS,
        max_retained: MAX_RETAINED_OUTPUT,
        max_request_keys: MAX_REQUEST_KEYS,
        cgroup_mount: "/sys/fs/cgroup".into(),
        broker_root: "/nonexistent".into(),
    };
    edit(&mut cfg);
    let reaper = Reaper::start(ReapMode::RegisteredOnly).expect("reaper");
    Fixture {
        jobs: JobManager::new(cfg, reaper),
        ws,
        _cgroup: cgroup,
    }
}

pub(super) fn fixture() -> Fixture {
    fixture_with(test_cgroup(), MAX_RUNNING_JOBS, MAX_JOB_RECORDS)
}

fn exec(argv: &[&str]) -> ExecStart {
    ExecStart {
        argv: argv.iter().map(|s| s.to_string()).collect(),
        env: Vec::new(),
        cwd: None,
        stdin: None,
        timeout_ms: None,
        request_key: None,
    }
}

fn keyed(key: &str, req: ExecStart) -> ExecStart {
    ExecStart {
        request_key: Some(key.into()),
        ..req
    }
}

/// A job appending one line to `runs` in the workspace: the file counts how often it ran.
fn count_run() -> ExecStart {
    sh("echo ran >> runs")
}

fn runs(f: &Fixture) -> usize {
    fs::read_to_string(f.ws.path().join("runs"))
        .unwrap_or_default()
        .lines()
        .count()
}

fn remembered_keys(f: &Fixture) -> usize {
    f.jobs.table().keys.len()
}

pub(super) fn sh(script: &str) -> ExecStart {
    exec(&["sh", "-c", script])
}

fn req(job: JobId, out: u64, err: u64, wait_ms: u32) -> JobOutputRequest {
    JobOutputRequest {
        job,
        stdout_cursor: out,
        stderr_cursor: err,
        max_bytes: MAX_READ_PER_STREAM,
        wait_ms,
    }
}

struct Ended {
    stdout: Vec<u8>,
    stderr: Vec<u8>,
    exit: JobExit,
    truncated: bool,
}

/// Reads a job to its end the way the host does: until finished and no cursor advances.
async fn run_to_end(jobs: &JobManager, id: JobId) -> Ended {
    let deadline = Instant::now() + Duration::from_secs(30);
    let (mut stdout, mut stderr) = (Vec::new(), Vec::new());
    loop {
        assert!(Instant::now() < deadline, "job {id} did not finish");
        let o = jobs
            .output(&req(id, stdout.len() as u64, stderr.len() as u64, 5_000))
            .await
            .expect("output");
        let progressed = !o.stdout.is_empty() || !o.stderr.is_empty();
        stdout.extend_from_slice(&o.stdout);
        stderr.extend_from_slice(&o.stderr);
        if let JobState::Finished(exit) = o.state {
            if !progressed {
                return Ended {
                    stdout,
                    stderr,
                    exit,
                    truncated: o.truncated,
                };
            }
        }
    }
}

#[tokio::test]
async fn test_exec_streams_separate_exit_code_reported() {
    let f = fixture();
    let id = f
        .jobs
        .start(sh("echo out; echo err >&2; exit 3"))
        .await
        .expect("start");
    let end = run_to_end(&f.jobs, id).await;
    assert_eq!(end.stdout, b"out\n");
    assert_eq!(end.stderr, b"err\n");
    assert_eq!(end.exit.code, Some(3));
    assert_eq!(end.exit.signal, None);
    assert!(!end.exit.timed_out && !end.exit.cancelled && !end.truncated);
}

#[tokio::test]
async fn test_exec_killed_by_signal_reports_signal() {
    let f = fixture();
    let id = f.jobs.start(sh("kill -TERM $$")).await.expect("start");
    let end = run_to_end(&f.jobs, id).await;
    assert_eq!(end.exit.code, None);
    assert_eq!(end.exit.signal, Some(libc::SIGTERM));
}

#[tokio::test]
async fn test_exec_env_base_overridden_cwd_and_stdin_applied() {
    let f = fixture();
    fs::create_dir(f.ws.path().join("sub")).expect("mkdir");
    let mut e = sh("echo $TERM $LANG $FOO; pwd; cat");
    e.env = vec![("FOO".into(), "bar".into()), ("LANG".into(), "C".into())];
    e.cwd = Some("sub".into());
    e.stdin = Some(serde_bytes::ByteBuf::from(b"from-stdin".to_vec()));
    let id = f.jobs.start(e).await.expect("start");
    let end = run_to_end(&f.jobs, id).await;
    let want = format!(
        "dumb C bar\n{}\nfrom-stdin",
        f.ws.path()
            .join("sub")
            .canonicalize()
            .expect("canon")
            .display()
    );
    assert_eq!(String::from_utf8_lossy(&end.stdout), want);
    assert_eq!(end.exit.code, Some(0));
}

#[tokio::test]
async fn test_exec_output_over_limit_truncated_command_finishes() {
    let f = fixture();
    let id = f
        .jobs
        .start(sh("yes | head -c 50000000; yes e | head -c 1000000 >&2"))
        .await
        .expect("start");
    let end = run_to_end(&f.jobs, id).await;
    assert_eq!(end.exit.code, Some(0));
    assert!(end.truncated);
    assert_eq!(
        (end.stdout.len() + end.stderr.len()) as u64,
        MAX_RETAINED_OUTPUT
    );
    assert!(end.stdout.chunks(2).all(|c| c[0] == b'y'));
}

#[tokio::test]
async fn test_output_cursors_reread_identical_and_capped() {
    let f = fixture();
    let id = f
        .jobs
        .start(sh("head -c 100000 /dev/zero"))
        .await
        .expect("start");
    let end = run_to_end(&f.jobs, id).await;
    assert_eq!(end.stdout.len(), 100_000);
    let a = f.jobs.output(&req(id, 1000, 0, 0)).await.expect("read");
    let b = f.jobs.output(&req(id, 1000, 0, 0)).await.expect("reread");
    assert_eq!(a, b);
    assert_eq!(a.stdout.len(), MAX_READ_PER_STREAM as usize);
    assert_eq!(a.stdout_retained, 100_000);
    let mut small = req(id, 0, 0, 0);
    small.max_bytes = 10;
    assert_eq!(f.jobs.output(&small).await.expect("small").stdout.len(), 10);
    let err = f
        .jobs
        .output(&req(id, 100_001, 0, 0))
        .await
        .expect_err("cursor past end");
    assert_eq!(err.code, ErrorCode::InvalidArgument);
}

#[tokio::test]
async fn test_output_long_poll_wakes_on_new_output() {
    let f = fixture();
    let id = f
        .jobs
        .start(sh("sleep 0.4; echo hi; sleep 5"))
        .await
        .expect("start");
    let started = Instant::now();
    let o = f.jobs.output(&req(id, 0, 0, 20_000)).await.expect("output");
    let waited = started.elapsed();
    assert_eq!(o.stdout, b"hi\n");
    assert!(waited >= Duration::from_millis(200), "{waited:?}");
    assert!(waited < Duration::from_secs(4), "{waited:?}");
    assert_eq!(o.state, JobState::Running);
    f.jobs.cancel(id).expect("cancel");
    let end = run_to_end(&f.jobs, id).await;
    assert!(end.exit.cancelled);
}

#[tokio::test]
async fn test_output_long_poll_times_out_empty() {
    let f = fixture();
    let id = f.jobs.start(exec(&["sleep", "5"])).await.expect("start");
    let started = Instant::now();
    let o = f.jobs.output(&req(id, 0, 0, 300)).await.expect("output");
    assert!(started.elapsed() >= Duration::from_millis(250));
    assert!(o.stdout.is_empty() && o.state == JobState::Running);
    f.jobs.cancel(id).expect("cancel");
}

#[tokio::test]
async fn test_running_limit_fifth_job_quota_exceeded() {
    let f = fixture();
    let mut ids = Vec::new();
    for _ in 0..MAX_RUNNING_JOBS {
        ids.push(f.jobs.start(exec(&["sleep", "30"])).await.expect("start"));
    }
    let err = f.jobs.start(exec(&["true"])).await.expect_err("fifth");
    assert_eq!(err.code, ErrorCode::QuotaExceeded);
    for id in &ids {
        f.jobs.cancel(*id).expect("cancel");
    }
    for id in ids {
        let end = run_to_end(&f.jobs, id).await;
        assert!(end.exit.cancelled);
        assert_eq!(end.exit.signal, Some(libc::SIGKILL));
    }
    f.jobs
        .start(exec(&["true"]))
        .await
        .expect("slot free again");
}

#[tokio::test]
async fn test_records_full_oldest_finished_evicted() {
    let f = fixture_with(test_cgroup(), 4, 3);
    let mut ids = Vec::new();
    for _ in 0..3 {
        let id = f.jobs.start(exec(&["true"])).await.expect("start");
        run_to_end(&f.jobs, id).await;
        ids.push(id);
    }
    let newest = f.jobs.start(exec(&["true"])).await.expect("start");
    let err = f
        .jobs
        .output(&req(ids[0], 0, 0, 0))
        .await
        .expect_err("evicted");
    assert_eq!(err.code, ErrorCode::NotFound);
    f.jobs.output(&req(ids[1], 0, 0, 0)).await.expect("kept");
    f.jobs.output(&req(newest, 0, 0, 0)).await.expect("new");
}

#[tokio::test]
async fn test_records_full_none_finished_quota_exceeded() {
    let f = fixture_with(test_cgroup(), 4, 2);
    let a = f.jobs.start(exec(&["sleep", "30"])).await.expect("start");
    let b = f.jobs.start(exec(&["sleep", "30"])).await.expect("start");
    let err = f.jobs.start(exec(&["true"])).await.expect_err("full");
    assert_eq!(err.code, ErrorCode::QuotaExceeded);
    f.jobs.cancel(a).expect("cancel");
    f.jobs.cancel(b).expect("cancel");
}

#[tokio::test]
async fn test_timeout_kills_setsid_grandchild_via_cgroup() {
    let cg = test_cgroup()
        .expect("a writable cgroup v2 (the suite runs as root on hosts that have one)");
    let f = fixture_with(Some(cg), 4, 16);
    let mut e = sh("setsid sh -c 'echo $$ > grandchild.pid; exec sleep 60' & sleep 60");
    e.timeout_ms = Some(500);
    let started = Instant::now();
    let id = f.jobs.start(e).await.expect("start");
    let end = run_to_end(&f.jobs, id).await;
    assert!(started.elapsed() < Duration::from_secs(10));
    assert!(end.exit.timed_out);
    assert_eq!(end.exit.signal, Some(libc::SIGKILL));
    let pid = fs::read_to_string(f.ws.path().join("grandchild.pid")).expect("pid file");
    let proc_dir = PathBuf::from(format!("/proc/{}", pid.trim()));
    // The kill is sent to the whole cgroup at once, but a SIGKILLed process takes a moment to
    // become a zombie, and reaping the orphan is not ours: accept a zombie or a process gone
    // within 2 s, not a live sleeper.
    let alive = || {
        fs::read_to_string(proc_dir.join("stat"))
            .map(|s| !s.contains(") Z "))
            .unwrap_or(false)
    };
    let deadline = Instant::now() + Duration::from_secs(2);
    while alive() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(!alive(), "setsid grandchild survived the timeout");
}

#[tokio::test]
async fn test_timeout_process_group_fallback_kills_job() {
    let f = fixture_with(None, 4, 16);
    let mut e = sh("sleep 60; echo never");
    e.timeout_ms = Some(300);
    let id = f.jobs.start(e).await.expect("start");
    let end = run_to_end(&f.jobs, id).await;
    assert!(end.exit.timed_out);
    assert!(end.stdout.is_empty());
}

#[tokio::test]
async fn test_main_exit_finishes_job_background_process_runs_on() {
    let f = fixture();
    let started = Instant::now();
    let id = f
        .jobs
        .start(sh("sleep 60 & echo done"))
        .await
        .expect("start");
    let end = run_to_end(&f.jobs, id).await;
    assert_eq!(end.stdout, b"done\n");
    assert_eq!(end.exit.code, Some(0));
    assert!(started.elapsed() < Duration::from_secs(10));
    let o = f.jobs.output(&req(id, 5, 0, 0)).await.expect("output");
    assert_eq!(o.background_processes, 1, "the sleep runs on");
    assert!(!o.output_complete, "the sleep holds the pipes");
    f.jobs.cancel(id).expect("cancel");
}

#[tokio::test]
async fn test_cancel_finished_noop_unknown_not_found() {
    let f = fixture();
    let id = f.jobs.start(exec(&["true"])).await.expect("start");
    let end = run_to_end(&f.jobs, id).await;
    f.jobs.cancel(id).expect("cancel finished");
    let again = f.jobs.output(&req(id, 0, 0, 0)).await.expect("output");
    assert_eq!(again.state, JobState::Finished(end.exit));
    assert!(!end.exit.cancelled);
    assert_eq!(
        f.jobs.cancel(JobId(9999)).expect_err("unknown").code,
        ErrorCode::NotFound
    );
}

#[tokio::test]
async fn test_exec_invalid_requests_refused_with_codes() {
    let f = fixture();
    fs::write(f.ws.path().join("file"), b"x").expect("write");
    let cases: Vec<(ExecStart, ErrorCode)> = vec![
        (exec(&[]), ErrorCode::InvalidArgument),
        (exec(&["a\0b"]), ErrorCode::InvalidArgument),
        (
            ExecStart {
                env: vec![("A=B".into(), "x".into())],
                ..exec(&["true"])
            },
            ErrorCode::InvalidArgument,
        ),
        (
            ExecStart {
                cwd: Some("../x".into()),
                ..exec(&["true"])
            },
            ErrorCode::InvalidArgument,
        ),
        (
            ExecStart {
                cwd: Some("missing".into()),
                ..exec(&["true"])
            },
            ErrorCode::NotFound,
        ),
        (
            ExecStart {
                cwd: Some("file".into()),
                ..exec(&["true"])
            },
            ErrorCode::WrongType,
        ),
        (exec(&["no-such-command-warren"]), ErrorCode::NotFound),
    ];
    for (e, code) in cases {
        let argv = e.argv.clone();
        let err = f.jobs.start(e).await.expect_err("refused");
        assert_eq!(err.code, code, "{argv:?}: {err}");
    }
    // Nothing leaked a record or a running slot.
    assert!(f.jobs.table().jobs.is_empty());
}

#[tokio::test]
async fn test_bench_fork_exec_wait_returns_samples() {
    let f = fixture();
    let reply = f.jobs.bench_fork_exec_wait(5).await.expect("bench");
    assert_eq!(reply.samples_ns.len(), 5);
    assert!(reply.samples_ns.iter().all(|&s| s > 0));
}

#[tokio::test]
async fn test_exec_request_key_same_request_same_job_runs_once() {
    let f = fixture();
    let first = f.jobs.start(keyed("k1", count_run())).await.expect("start");
    let retry = f.jobs.start(keyed("k1", count_run())).await.expect("retry");
    assert_eq!(retry, first);
    run_to_end(&f.jobs, first).await;
    let after_end = f
        .jobs
        .start(keyed("k1", count_run()))
        .await
        .expect("retry after end");
    assert_eq!(after_end, first);
    assert_eq!(runs(&f), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn test_exec_request_key_concurrent_duplicates_one_job() {
    let f = fixture();
    let tasks: Vec<_> = (0..8)
        .map(|_| {
            let jobs = f.jobs.clone();
            tokio::spawn(async move { jobs.start(keyed("k1", count_run())).await })
        })
        .collect();
    let mut ids = Vec::new();
    for t in tasks {
        ids.push(t.await.expect("join").expect("start"));
    }
    assert!(ids.iter().all(|&id| id == ids[0]), "{ids:?}");
    run_to_end(&f.jobs, ids[0]).await;
    assert_eq!(runs(&f), 1);
    assert_eq!(f.jobs.table().jobs.len(), 1);
}

#[tokio::test]
async fn test_exec_request_key_retry_after_cwd_removed_same_job() {
    let f = fixture();
    fs::create_dir(f.ws.path().join("sub")).expect("mkdir");
    let mut e = keyed("k1", sh("echo ran >> ../runs; rmdir ../sub"));
    e.cwd = Some("sub".into());
    let first = f.jobs.start(e.clone()).await.expect("start");
    assert_eq!(run_to_end(&f.jobs, first).await.exit.code, Some(0));
    assert!(!f.ws.path().join("sub").exists());
    let retry = f.jobs.start(e).await.expect("retry without its cwd");
    assert_eq!(retry, first);
    assert_eq!(runs(&f), 1);
}

#[tokio::test]
async fn test_exec_request_key_different_request_conflict() {
    let f = fixture();
    let first = f.jobs.start(keyed("k1", count_run())).await.expect("start");
    let err = f
        .jobs
        .start(keyed("k1", sh("echo other >> runs")))
        .await
        .expect_err("different argv, same key");
    assert_eq!(err.code, ErrorCode::Conflict);
    assert_eq!(err.code.as_str(), "conflict");
    let mut longer = keyed("k1", count_run());
    longer.timeout_ms = Some(60_000);
    let err = f
        .jobs
        .start(longer)
        .await
        .expect_err("different timeout, same key");
    assert_eq!(err.code, ErrorCode::Conflict);
    run_to_end(&f.jobs, first).await;
    assert_eq!(runs(&f), 1);
}

#[tokio::test]
async fn test_exec_no_request_key_two_jobs() {
    let f = fixture();
    let a = f.jobs.start(count_run()).await.expect("start");
    run_to_end(&f.jobs, a).await;
    let b = f.jobs.start(count_run()).await.expect("start again");
    run_to_end(&f.jobs, b).await;
    assert_ne!(a, b);
    assert_eq!(runs(&f), 2);
    assert_eq!(remembered_keys(&f), 0);
}

#[tokio::test]
async fn test_exec_request_key_over_limit_invalid_argument() {
    let f = fixture();
    let long = "k".repeat(MAX_REQUEST_KEY_BYTES + 1);
    let err = f
        .jobs
        .start(keyed(&long, count_run()))
        .await
        .expect_err("key too long");
    assert_eq!(err.code, ErrorCode::InvalidArgument);
    // The limit counts bytes, not characters.
    let wide = "é".repeat(MAX_REQUEST_KEY_BYTES / 2 + 1);
    let err = f
        .jobs
        .start(keyed(&wide, count_run()))
        .await
        .expect_err("key too long in bytes");
    assert_eq!(err.code, ErrorCode::InvalidArgument);
    let err = f
        .jobs
        .start(keyed("", count_run()))
        .await
        .expect_err("empty key");
    assert_eq!(err.code, ErrorCode::InvalidArgument);
    assert!(f.jobs.table().jobs.is_empty());
    assert_eq!(remembered_keys(&f), 0);
    let at_limit = "k".repeat(MAX_REQUEST_KEY_BYTES);
    let id = f
        .jobs
        .start(keyed(&at_limit, count_run()))
        .await
        .expect("key at the limit");
    run_to_end(&f.jobs, id).await;
}

#[tokio::test]
async fn test_exec_request_key_refused_by_running_limit_not_recorded() {
    let f = fixture_with(test_cgroup(), 1, MAX_JOB_RECORDS);
    let sleeper = f.jobs.start(exec(&["sleep", "30"])).await.expect("start");
    let err = f
        .jobs
        .start(keyed("k1", count_run()))
        .await
        .expect_err("no running slot");
    assert_eq!(err.code, ErrorCode::QuotaExceeded);
    assert_eq!(remembered_keys(&f), 0);
    f.jobs.cancel(sleeper).expect("cancel");
    run_to_end(&f.jobs, sleeper).await;
    let id = f
        .jobs
        .start(keyed("k1", count_run()))
        .await
        .expect("retry once a slot is free");
    assert_ne!(id, sleeper);
    assert_eq!(run_to_end(&f.jobs, id).await.exit.code, Some(0));
    assert_eq!(runs(&f), 1);
}

#[tokio::test]
async fn test_exec_request_key_failed_start_not_recorded() {
    let f = fixture();
    let err = f
        .jobs
        .start(keyed("k1", exec(&["no-such-command-warren"])))
        .await
        .expect_err("not found");
    assert_eq!(err.code, ErrorCode::NotFound);
    let mut missing_cwd = keyed("k2", count_run());
    missing_cwd.cwd = Some("missing".into());
    let err = f.jobs.start(missing_cwd).await.expect_err("missing cwd");
    assert_eq!(err.code, ErrorCode::NotFound);
    assert_eq!(remembered_keys(&f), 0);
    assert!(f.jobs.table().jobs.is_empty());
    // A different request may now use the key: nothing holds it.
    let id = f
        .jobs
        .start(keyed("k1", count_run()))
        .await
        .expect("key free");
    run_to_end(&f.jobs, id).await;
    assert_eq!(runs(&f), 1);
}

#[tokio::test]
async fn test_exec_request_key_outlives_evicted_record() {
    let f = fixture_with(test_cgroup(), 4, 1);
    let first = f.jobs.start(keyed("k1", count_run())).await.expect("start");
    run_to_end(&f.jobs, first).await;
    let other = f.jobs.start(exec(&["true"])).await.expect("evicts first");
    run_to_end(&f.jobs, other).await;
    assert_eq!(
        f.jobs
            .output(&req(first, 0, 0, 0))
            .await
            .expect_err("evicted")
            .code,
        ErrorCode::NotFound
    );
    let retry = f.jobs.start(keyed("k1", count_run())).await.expect("retry");
    assert_eq!(retry, first);
    assert_eq!(runs(&f), 1);
}

#[tokio::test]
async fn test_exec_request_keys_over_capacity_oldest_forgotten() {
    let f = fixture_cfg(test_cgroup(), |cfg| cfg.max_request_keys = 2);
    let mut ids = Vec::new();
    for key in ["k1", "k2", "k3"] {
        let id = f.jobs.start(keyed(key, count_run())).await.expect("start");
        run_to_end(&f.jobs, id).await;
        ids.push(id);
    }
    assert_eq!(remembered_keys(&f), 2);
    let k3 = f
        .jobs
        .start(keyed("k3", count_run()))
        .await
        .expect("k3 remembered");
    assert_eq!(k3, ids[2]);
    let k1 = f
        .jobs
        .start(keyed("k1", count_run()))
        .await
        .expect("k1 forgotten");
    assert!(!ids.contains(&k1));
    run_to_end(&f.jobs, k1).await;
    assert_eq!(runs(&f), 4);
}

#[tokio::test]
async fn test_frozen_time_does_not_count_against_timeout() {
    // Process-group containment: the process keeps running while "frozen", so only the
    // timeout clock is under test. Without the freeze the 300 ms budget would kill it.
    let f = fixture_with(None, 4, 16);
    let mut e = sh("sleep 0.8; echo done");
    e.timeout_ms = Some(300);
    let id = f.jobs.start(e).await.expect("start");
    assert_eq!(f.jobs.freeze().expect("freeze"), 1);
    tokio::time::sleep(Duration::from_millis(1200)).await;
    f.jobs.thaw().expect("thaw");
    let end = run_to_end(&f.jobs, id).await;
    assert!(
        !end.exit.timed_out,
        "frozen time counted against the budget"
    );
    assert_eq!(end.stdout, b"done\n");
}

#[tokio::test]
async fn test_budget_left_after_thaw_still_enforced() {
    let f = fixture_with(None, 4, 16);
    let mut e = sh("sleep 60");
    e.timeout_ms = Some(400);
    let id = f.jobs.start(e).await.expect("start");
    f.jobs.freeze().expect("freeze");
    tokio::time::sleep(Duration::from_millis(300)).await;
    f.jobs.thaw().expect("thaw");
    let started = Instant::now();
    let end = run_to_end(&f.jobs, id).await;
    assert!(end.exit.timed_out);
    // Roughly the whole budget remained after the thaw (less what ran before the freeze).
    assert!(
        started.elapsed() >= Duration::from_millis(250),
        "{:?}",
        started.elapsed()
    );
}

mod interactive;
