//! Interactive jobs: `ExecInteractive`, `JobInput`, `JobResize`, flow-controlled output.

use super::*;

fn interactive(start: ExecStart, tty: Option<(u16, u16)>) -> ExecInteractive {
    ExecInteractive {
        start,
        tty: tty.map(|(rows, cols)| WindowSize { rows, cols }),
    }
}

async fn send(f: &Fixture, job: JobId, data: &[u8], eof: bool) -> Result<(), GuestError> {
    f.jobs
        .input(warren_protocol::JobInput {
            job,
            data: data.to_vec(),
            eof,
        })
        .await
}

/// Long-polls the job's stdout until it contains `needle`; returns everything read so far.
async fn read_until(f: &Fixture, job: JobId, needle: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut seen = Vec::new();
    while !String::from_utf8_lossy(&seen).contains(needle) {
        assert!(
            Instant::now() < deadline,
            "no {needle:?} in {:?}",
            String::from_utf8_lossy(&seen)
        );
        let o = f
            .jobs
            .output(&req(job, seen.len() as u64, 0, 1_000))
            .await
            .expect("output");
        seen.extend_from_slice(&o.stdout);
    }
    String::from_utf8_lossy(&seen).into_owned()
}

#[tokio::test]
async fn test_terminal_job_has_tty_size_term_and_merged_output() {
    let f = fixture();
    let id = f
        .jobs
        .start_interactive(interactive(
            sh("tty; stty size; echo $TERM; echo err >&2"),
            Some((33, 101)),
        ))
        .await
        .expect("start");
    let end = run_to_end(&f.jobs, id).await;
    let out = String::from_utf8_lossy(&end.stdout);
    assert!(out.starts_with("/dev/pts/"), "{out:?}");
    // The terminal's output processing turns \n into \r\n.
    assert!(
        out.contains("\r\n33 101\r\nxterm-256color\r\nerr\r\n"),
        "{out:?}"
    );
    assert!(
        end.stderr.is_empty(),
        "a terminal merges stderr into stdout"
    );
    assert_eq!(end.exit.code, Some(0));
}

#[tokio::test]
async fn test_terminal_input_line_read_and_resize_seen() {
    let f = fixture();
    let id = f
        .jobs
        .start_interactive(interactive(
            sh("echo ready; read x; echo got:$x; stty size"),
            Some((24, 80)),
        ))
        .await
        .expect("start");
    read_until(&f, id, "ready").await;
    f.jobs
        .resize(JobResize {
            job: id,
            size: WindowSize {
                rows: 40,
                cols: 120,
            },
        })
        .expect("resize");
    send(&f, id, b"hello\n", false).await.expect("input");
    let end = run_to_end(&f.jobs, id).await;
    let out = String::from_utf8_lossy(&end.stdout);
    assert!(out.contains("got:hello\r\n40 120\r\n"), "{out:?}");
    assert_eq!(end.exit.code, Some(0));
    // The job's end closed its input and its terminal.
    let job = f.jobs.get(id).expect("job");
    assert!(job.terminal().is_none(), "master kept after the job ended");
    assert!(job.input.try_lock().expect("input lock").is_none());
    assert!(send(&f, id, b"x", false).await.is_err());
    let gone = f.jobs.resize(JobResize {
        job: id,
        size: WindowSize { rows: 1, cols: 1 },
    });
    assert_eq!(gone.map_err(|e| e.code), Err(ErrorCode::InvalidArgument));
}

#[tokio::test]
async fn test_terminal_ctrl_c_interrupts_foreground_job() {
    let f = fixture();
    let id = f
        .jobs
        .start_interactive(interactive(exec(&["sleep", "100"]), Some((24, 80))))
        .await
        .expect("start");
    send(&f, id, &[0x03], false).await.expect("ctrl-c");
    let end = run_to_end(&f.jobs, id).await;
    assert_eq!(end.exit.signal, Some(libc::SIGINT));
    assert!(!end.exit.cancelled);
}

#[tokio::test]
async fn test_pipe_input_streamed_eof_closes_stdin() {
    let f = fixture();
    let id = f
        .jobs
        .start_interactive(interactive(sh("cat; echo err >&2"), None))
        .await
        .expect("start");
    send(&f, id, b"a\n", false).await.expect("input");
    send(&f, id, b"b\n", true).await.expect("input with eof");
    let after = send(&f, id, b"c\n", false).await;
    assert_eq!(after.map_err(|e| e.code), Err(ErrorCode::InvalidArgument));
    let end = run_to_end(&f.jobs, id).await;
    assert_eq!(
        (end.stdout.as_slice(), end.stderr.as_slice()),
        (&b"a\nb\n"[..], &b"err\n"[..])
    );
    assert_eq!(end.exit.code, Some(0));
}

#[tokio::test]
async fn test_input_and_resize_refused_where_they_do_not_apply() {
    let f = fixture();
    let batch = f.jobs.start(sh("sleep 5")).await.expect("start");
    let r = send(&f, batch, b"x", false).await;
    assert_eq!(r.map_err(|e| e.code), Err(ErrorCode::InvalidArgument));
    let pipe = f
        .jobs
        .start_interactive(interactive(exec(&["cat"]), None))
        .await
        .expect("start");
    let r = f.jobs.resize(JobResize {
        job: pipe,
        size: WindowSize { rows: 2, cols: 2 },
    });
    assert_eq!(r.map_err(|e| e.code), Err(ErrorCode::WrongType));
    let r = send(&f, pipe, &vec![b'x'; MAX_INPUT_CHUNK + 1], false).await;
    assert_eq!(r.map_err(|e| e.code), Err(ErrorCode::InvalidArgument));
    let mut with_stdin = exec(&["cat"]);
    with_stdin.stdin = Some(serde_bytes::ByteBuf::from(b"x".to_vec()));
    let r = f
        .jobs
        .start_interactive(interactive(with_stdin, None))
        .await;
    assert_eq!(r.map_err(|e| e.code), Err(ErrorCode::InvalidArgument));
    let r = f
        .jobs
        .start_interactive(interactive(exec(&["cat"]), Some((0, 80))))
        .await;
    assert_eq!(r.map_err(|e| e.code), Err(ErrorCode::InvalidArgument));
    f.jobs.cancel(batch).expect("cancel");
    send(&f, pipe, b"", true).await.expect("eof");
}

#[tokio::test]
async fn test_interactive_request_key_shared_with_exec_conflicts() {
    let f = fixture();
    f.jobs
        .start(keyed("k1", exec(&["true"])))
        .await
        .expect("start");
    let r = f
        .jobs
        .start_interactive(interactive(keyed("k1", exec(&["true"])), None))
        .await;
    assert_eq!(r.map_err(|e| e.code), Err(ErrorCode::Conflict));
    let a = f
        .jobs
        .start_interactive(interactive(keyed("k2", exec(&["true"])), None))
        .await
        .expect("start");
    let b = f
        .jobs
        .start_interactive(interactive(keyed("k2", exec(&["true"])), None))
        .await
        .expect("retry");
    assert_eq!(a, b, "a retried interactive start returns the first job");
}

#[tokio::test]
async fn test_interactive_output_flow_controlled_never_truncated() {
    let f = fixture_cfg(test_cgroup(), |cfg| cfg.max_retained = 1024);
    let id = f
        .jobs
        .start_interactive(interactive(
            sh("head -c 100000 /dev/zero; echo done >&2"),
            None,
        ))
        .await
        .expect("start");
    let (mut out, mut err) = (0u64, 0u64);
    let exit = loop {
        let o = f
            .jobs
            .output(&req(id, out, err, 5_000))
            .await
            .expect("output");
        assert!(o.stdout_retained - out <= 1024, "window exceeded");
        let progressed = !o.stdout.is_empty() || !o.stderr.is_empty();
        out += o.stdout.len() as u64;
        err += o.stderr.len() as u64;
        if let (JobState::Finished(x), false) = (o.state, progressed) {
            assert!(!o.truncated);
            break x;
        }
    };
    assert_eq!((out, err), (100_000, 5));
    assert_eq!(exit.code, Some(0));
    // What was read is released: reading before it again is refused.
    let r = f.jobs.output(&req(id, 0, 0, 0)).await;
    assert_eq!(r.map_err(|e| e.code), Err(ErrorCode::InvalidArgument));
}

#[tokio::test]
async fn test_acked_read_releases_only_before_the_acknowledged_point() {
    let f = fixture();
    let id = f
        .jobs
        .start_interactive(interactive(exec(&["cat"]), None))
        .await
        .expect("start");
    send(&f, id, b"abcdefgh", false).await.expect("input");
    let acked = |out: u64, release: u64| warren_protocol::JobOutputAcked {
        read: req(id, out, 0, 5_000),
        release_stdout: release,
        release_stderr: 0,
    };
    let o = f.jobs.output_acked(&acked(0, 0)).await.expect("read");
    assert_eq!(o.stdout, b"abcdefgh");
    // Read past everything, acknowledging only 3 bytes: the rest can be read again.
    send(&f, id, b"ij", false).await.expect("input");
    let o = f.jobs.output_acked(&acked(8, 3)).await.expect("read on");
    assert_eq!(o.stdout, b"ij");
    let again = f.jobs.output(&req(id, 3, 0, 0)).await.expect("reread");
    assert_eq!(again.stdout, b"defghij");
    // That plain read released before 3 and nothing more; before 3 is gone.
    let gone = f.jobs.output(&req(id, 2, 0, 0)).await;
    assert_eq!(gone.map_err(|e| e.code), Err(ErrorCode::InvalidArgument));
    // A status read still answers at a released cursor, and a release past the cursor is
    // refused.
    let mut status = req(id, 0, 0, 0);
    status.max_bytes = 0;
    let st = f.jobs.output(&status).await.expect("status");
    assert_eq!(st.stdout_retained, 10);
    let bad = f.jobs.output_acked(&acked(4, 5)).await;
    assert_eq!(bad.map_err(|e| e.code), Err(ErrorCode::InvalidArgument));
    send(&f, id, b"", true).await.expect("eof");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let o = f.jobs.output(&req(id, 10, 0, 5_000)).await.expect("end");
        if matches!(o.state, JobState::Finished(_)) {
            break;
        }
        assert!(Instant::now() < deadline, "cat did not end");
    }
}
