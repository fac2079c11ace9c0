//! Background processes a job leaves behind: the job finishes at its main process's exit,
//! they run on, their output stays readable, cancel and timeouts kill them, and the limits
//! that bound them. Host-run like `tests.rs` (its fixtures), in a cgroup when one is writable.

use std::time::{Duration, Instant};

use warren_protocol::{ErrorCode, JobId, JobOutput, JobOutputRequest, JobState};

use super::tests::{fixture, fixture_cfg, sh, test_cgroup, Fixture};

fn at(job: JobId, out: u64, wait_ms: u32) -> JobOutputRequest {
    JobOutputRequest {
        job,
        stdout_cursor: out,
        stderr_cursor: 0,
        max_bytes: 16 * 1024,
        wait_ms,
    }
}

/// Reads `job` (at cursor 0) until `done` holds, for at most 20 s.
async fn read_until(f: &Fixture, job: JobId, done: impl Fn(&JobOutput) -> bool) -> JobOutput {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let o = f.jobs.output(&at(job, 0, 0)).await.expect("output");
        if done(&o) {
            return o;
        }
        assert!(
            Instant::now() < deadline,
            "job {job}: condition never held: {o:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn finished(o: &JobOutput) -> bool {
    matches!(o.state, JobState::Finished(_))
}

#[tokio::test]
async fn test_background_output_after_exit_readable_by_cursor_then_complete() {
    let f = fixture();
    let id = f
        .jobs
        .start(sh("(sleep 1; echo late) & echo early"))
        .await
        .expect("start");
    let o = read_until(&f, id, finished).await;
    let JobState::Finished(exit) = o.state else {
        unreachable!()
    };
    assert_eq!(exit.code, Some(0));
    assert!(!o.output_complete, "the subshell still holds stdout: {o:?}");
    // The subshell, and its sleep once forked.
    assert!((1..=2).contains(&o.background_processes), "{o:?}");
    // A caught-up read of the finished job answers at once, even with a wait: the wait is
    // for output or the main process's end, and that came.
    let started = Instant::now();
    let now = f.jobs.output(&at(id, 6, 15_000)).await.expect("read");
    assert!(started.elapsed() < Duration::from_secs(5), "{now:?}");
    // The background output arrives later, at the cursor past what the job printed.
    let deadline = Instant::now() + Duration::from_secs(20);
    let late = loop {
        let o = f.jobs.output(&at(id, 6, 0)).await.expect("poll");
        if !o.stdout.is_empty() {
            break o;
        }
        assert!(Instant::now() < deadline, "no late output: {o:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(late.stdout, b"late\n", "{late:?}");
    let done = read_until(&f, id, |o| o.output_complete).await;
    assert_eq!(done.background_processes, 0);
    assert_eq!(done.stdout, b"early\nlate\n");
    assert_eq!(
        done.state, o.state,
        "the exit status stays the main process's"
    );
}

#[tokio::test]
async fn test_cancel_finished_job_kills_background_exit_status_kept() {
    let f = fixture();
    let id = f.jobs.start(sh("sleep 60 & exit 3")).await.expect("start");
    let o = read_until(&f, id, |o| finished(o) && o.background_processes == 1).await;
    let listed = f.jobs.list();
    let summary = listed.iter().find(|j| j.id == id).expect("listed");
    assert_eq!(summary.command, "sh -c sleep 60 & exit 3");
    assert_eq!(summary.background_processes, 1);
    assert_eq!(summary.processes.len(), 1);
    assert_eq!(summary.processes[0].name, "sleep");
    f.jobs.cancel(id).expect("cancel");
    let done = read_until(&f, id, |o| o.output_complete).await;
    assert_eq!(done.background_processes, 0);
    assert_eq!(done.state, o.state);
    let JobState::Finished(exit) = done.state else {
        unreachable!()
    };
    assert_eq!((exit.code, exit.cancelled), (Some(3), false));
    let summary = f
        .jobs
        .list()
        .into_iter()
        .find(|j| j.id == id)
        .expect("kept");
    assert_eq!(summary.background_processes, 0);
    assert!(summary.processes.is_empty());
}

#[tokio::test]
async fn test_timeout_kills_background_after_main_exit() {
    let f = fixture();
    let mut e = sh("sleep 60 & echo started");
    e.timeout_ms = Some(1500);
    let id = f.jobs.start(e).await.expect("start");
    let o = read_until(&f, id, finished).await;
    assert!(
        o.background_processes == 1 && !o.output_complete,
        "runs on until the timeout: {o:?}"
    );
    let started = Instant::now();
    let done = read_until(&f, id, |o| o.output_complete).await;
    assert!(started.elapsed() < Duration::from_secs(10));
    assert_eq!(done.background_processes, 0);
}

#[tokio::test]
async fn test_live_jobs_bounded_finished_ones_free_running_slot() {
    let f = fixture_cfg(test_cgroup(), |cfg| {
        cfg.max_running = 1;
        cfg.max_live = 2;
    });
    let a = f.jobs.start(sh("sleep 60 & true")).await.expect("a");
    read_until(&f, a, |o| finished(o) && o.background_processes == 1).await;
    // a's main process exited: it no longer takes the one running slot.
    let b = f.jobs.start(sh("sleep 60 & true")).await.expect("b");
    read_until(&f, b, |o| finished(o) && o.background_processes == 1).await;
    let err = f.jobs.start(sh("true")).await.expect_err("two live jobs");
    assert_eq!(err.code, ErrorCode::QuotaExceeded);
    assert!(err.message.contains("background"), "{}", err.message);
    f.jobs.cancel(a).expect("cancel");
    read_until(&f, a, |o| o.output_complete).await;
    f.jobs
        .start(sh("true"))
        .await
        .expect("a live slot is free again");
    f.jobs.cancel(b).expect("cancel");
}

#[tokio::test]
async fn test_records_with_background_never_evicted() {
    let f = fixture_cfg(test_cgroup(), |cfg| cfg.max_records = 2);
    let a = f.jobs.start(sh("sleep 60 & true")).await.expect("a");
    let b = f.jobs.start(sh("sleep 60 & true")).await.expect("b");
    for j in [a, b] {
        read_until(&f, j, |o| finished(o) && o.background_processes == 1).await;
    }
    let err = f.jobs.start(sh("true")).await.expect_err("records full");
    assert_eq!(err.code, ErrorCode::QuotaExceeded);
    f.jobs.cancel(a).expect("cancel");
    read_until(&f, a, |o| o.output_complete).await;
    f.jobs
        .start(sh("true"))
        .await
        .expect("a's record can go now");
    let gone = f.jobs.output(&at(a, 0, 0)).await.expect_err("evicted");
    assert_eq!(gone.code, ErrorCode::NotFound);
    f.jobs.output(&at(b, 0, 0)).await.expect("b kept");
    f.jobs.cancel(b).expect("cancel");
}

#[tokio::test]
async fn test_finished_with_background_already_holds_all_main_output() {
    let f = fixture();
    // More than a pipe buffer: the last of it is still in the pipe when the shell exits.
    for _ in 0..5 {
        let id = f
            .jobs
            .start(sh("sleep 60 & head -c 100000 /dev/zero; echo end"))
            .await
            .expect("start");
        // Long-poll at the end of what is retained, so each change (the end among them)
        // is looked at as soon as it happens.
        let mut seen = 0;
        let o = loop {
            let o = f.jobs.output(&at(id, seen, 5_000)).await.expect("poll");
            if finished(&o) {
                break o;
            }
            seen = o.stdout_retained;
        };
        assert_eq!(o.stdout_retained, 100_004, "{:?}", o.state);
        assert!(o.background_processes >= 1);
        f.jobs.cancel(id).expect("cancel");
    }
}

/// A background process whose name is not UTF-8 (here a program named `\xff`; a
/// 15-byte cut of a multi-byte name does it too, as does `prctl(PR_SET_NAME)`) still counts:
/// hidden, its job would be marked complete and cancel and timeouts would no longer reach it.
#[tokio::test]
async fn test_background_with_non_utf8_name_counted_and_cancelled() {
    let f = fixture();
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path().display();
    let id = f
        .jobs
        .start(sh(&format!(
            "ln -s \"$(command -v sleep)\" {d}/\"$(printf '\\377')\" && \
             {d}/\"$(printf '\\377')\" 60 >/dev/null 2>&1 </dev/null & true"
        )))
        .await
        .expect("start");
    let o = read_until(&f, id, |o| finished(o) && o.background_processes == 1).await;
    assert!(!o.output_complete, "{o:?}");
    let summary = f
        .jobs
        .list()
        .into_iter()
        .find(|j| j.id == id)
        .expect("listed");
    assert_eq!(summary.processes.len(), 1, "{summary:?}");
    assert_eq!(summary.processes[0].name, "\u{fffd}");
    f.jobs.cancel(id).expect("cancel");
    let done = read_until(&f, id, |o| o.output_complete).await;
    assert_eq!(done.background_processes, 0);
}
