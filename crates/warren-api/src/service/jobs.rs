//! The job tools: `vm_exec` (with its receipt, broker pipe and first output page), a job's
//! status, output and cancel.

use super::*;

impl Service {
    pub(super) async fn vm_exec(&self, p: &Principal, a: VmExecArgs) -> Result<Value, ApiError> {
        validate_request_id(&a.request_id)?;
        let rec = self
            .owned_for_work(p, &a.vm_id, a.expected_generation)
            .await?;
        let argv = match (&a.command, &a.argv) {
            (Some(c), None) => vec!["bash".to_string(), "-c".to_string(), c.clone()],
            (None, Some(v)) if !v.is_empty() => v.clone(),
            (None, Some(_)) => return Err(ApiError::invalid("argv must not be empty")),
            _ => return Err(ApiError::invalid("give exactly one of command and argv")),
        };
        let wait_ms = a.wait_ms.unwrap_or(0);
        if wait_ms > MAX_OUTPUT_WAIT_MS {
            return Err(ApiError::invalid(format!(
                "wait_ms must be at most {MAX_OUTPUT_WAIT_MS}"
            )));
        }
        if a.stdin.as_ref().is_some_and(|s| s.len() > MAX_STDIN_BYTES) {
            return Err(ApiError::invalid(format!(
                "stdin must be at most {MAX_STDIN_BYTES} bytes"
            )));
        }
        if a.timeout_ms == Some(0) {
            return Err(ApiError::invalid("timeout_ms must be at least 1"));
        }
        let interactive = a.interactive || a.tty.is_some();
        if interactive && a.stdin.is_some() {
            return Err(ApiError::invalid(
                "stdin cannot be given to an interactive job: send it through its terminal",
            ));
        }
        if let Some(token) = &a.broker_pipe_token {
            crate::broker::validate_token(token)?;
            if interactive {
                return Err(ApiError::invalid(
                    "a job with a broker pipe is not interactive",
                ));
            }
        }
        if a.tty.is_some_and(|t| t.rows == 0 || t.cols == 0) {
            return Err(ApiError::invalid(
                "tty needs at least one row and one column",
            ));
        }
        // The retry of a request with the same id and arguments must not depend on wait_ms.
        // The broker token is never stored, not even in the arguments' hash; whether a pipe
        // was asked for is.
        let hash = args_hash(&VmExecArgs {
            wait_ms: None,
            broker_pipe_token: a.broker_pipe_token.as_ref().map(|_| String::new()),
            ..a.clone()
        });
        let rid = a.request_id.as_str();
        let _guard = self.enter(p, "vm_exec", rid)?;
        let claim = self.receipts.claim(&p.workspace, "vm_exec", rid, &hash)?;
        if let Claim::Done(v) = &claim {
            let v = replay(v.clone())?;
            let job = v
                .get("job_id")
                .and_then(Value::as_str)
                .ok_or_else(|| ApiError::internal("receipt without a job"))?;
            let job = parse_job(job)?;
            let started_in = v.get("broker_generation").and_then(Value::as_u64);
            let page = to_value(self.exec_page(&rec.id, job, wait_ms).await?)?;
            let asked = a.broker_pipe_token.is_some();
            return Ok(self.with_pipe(page, &rec.id, job, asked, started_in));
        }
        if rec.state != VmState::Running && claim == Claim::Pending {
            return Err(ApiError::new(
                "outcome_unknown",
                format!(
                    "VM {} is {}; whether request {rid} ran cannot be determined, so it is not run again",
                    rec.id,
                    rec.state.as_str()
                ),
            ));
        }
        // The guest deduplicates on this key within its boot, so re-sending a pending request
        // returns the job it already started instead of running the command twice.
        let key = hex::encode(Sha256::digest(format!("{}\0{rid}", p.workspace).as_bytes()));
        let start = ExecStart {
            argv,
            env: a.env.clone().unwrap_or_default().into_iter().collect(),
            cwd: a.cwd.clone(),
            stdin: a.stdin.clone().map(|s| s.into_bytes().into()),
            timeout_ms: a.timeout_ms,
            request_key: Some(key),
        };
        // A broker job's generation: `None` when the VM began a fresh boot meanwhile.
        let mut broker_generation = None;
        let started = if a.broker_pipe_token.is_some() {
            self.warren
                .exec_broker(&rec.id, start)
                .await
                .map(|(job, generation)| {
                    broker_generation = generation;
                    job
                })
        } else if interactive {
            let req = ExecInteractive {
                start,
                tty: a.tty.map(|t| WindowSize {
                    rows: t.rows,
                    cols: t.cols,
                }),
            };
            self.warren.exec_interactive(&rec.id, req).await
        } else {
            self.warren.exec_start(&rec.id, start).await
        };
        match started {
            Ok(job) => {
                // A broker job's generation, for a replay's `broker_pipe`.
                let mut stored =
                    serde_json::json!({ "ok": { "vm_id": rec.id, "job_id": job.to_string() } });
                if let Some(g) = broker_generation {
                    stored["ok"]["broker_generation"] = g.into();
                }
                self.receipts
                    .complete(&p.workspace, "vm_exec", rid, &stored)?;
                if let (Some(token), Some(generation)) = (&a.broker_pipe_token, broker_generation) {
                    self.register_pipe(&p.workspace, &rec.id, generation, job, token)
                        .await;
                }
                let page = to_value(self.exec_page(&rec.id, job, wait_ms).await?)?;
                let asked = a.broker_pipe_token.is_some();
                Ok(self.with_pipe(page, &rec.id, job, asked, broker_generation))
            }
            Err(e) => {
                if e.guest().is_some() || matches!(e, CoreError::VmNotRunning { .. }) {
                    // The guest refused it (or it never left the host): nothing ran.
                    self.receipts.release(&p.workspace, "vm_exec", rid)?;
                }
                // Otherwise the request may or may not have reached the guest: the receipt
                // stays pending and a retry asks the guest by key.
                Err(e.into())
            }
        }
    }

    /// Waits up to `wait_ms` for the job to end, then returns its first page. A job that ends
    /// quietly costs one long-poll; each burst of output costs one more.
    pub(super) async fn exec_page(
        &self,
        vm: &str,
        job: JobId,
        wait_ms: u32,
    ) -> Result<OutputPage, ApiError> {
        let deadline = Instant::now() + Duration::from_millis(u64::from(wait_ms));
        let left = || deadline.saturating_duration_since(Instant::now());
        // The wait past the output said the job ended: the next page is the answer, whatever
        // the guest says of the state then (a guest saying `Running` with full pages and
        // `Finished` in between made this loop spin unheld; found by a hostile review).
        let mut ended = false;
        loop {
            // From the start: answers at once when there is output, else waits for news.
            let o = self
                .job_read(vm, job, Cursor::default(), MAX_READ_PER_STREAM, left())
                .await?;
            if ended || matches!(o.state, JobState::Finished(_)) || left().is_zero() {
                return Ok(output::page(
                    &job.to_string(),
                    Cursor::default(),
                    &o,
                    Encoding::Utf8,
                ));
            }
            // Wait past what was seen for more output or the job's end, then reread.
            let at = Cursor {
                stdout: o.stdout_retained,
                stderr: o.stderr_retained,
            };
            let news = self.job_read(vm, job, at, 0, left()).await?;
            ended = matches!(news.state, JobState::Finished(_));
        }
    }

    /// Never wakes the VM nor counts as activity: a suspended VM answers from the host's
    /// record of its jobs (`warren_core::vm::jobs_seen`), marked stale.
    pub(super) async fn vm_job_status(&self, p: &Principal, a: JobRef) -> Result<Value, ApiError> {
        let rec = self.owned(p, &a.vm_id, a.expected_generation)?;
        let job = parse_job(&a.job_id)?;
        let v = self.warren.job_status(&rec.id, job).await?;
        let o = &v.job;
        let exit = match o.state {
            JobState::Running => None,
            JobState::Finished(x) => Some(x),
        };
        to_value(JobStatus {
            job_id: job.to_string(),
            state: if exit.is_some() {
                "completed"
            } else {
                "running"
            }
            .into(),
            exit_code: exit.and_then(|x| x.code),
            signal: exit.and_then(|x| x.signal),
            timed_out: exit.is_some_and(|x| x.timed_out),
            cancelled: exit.is_some_and(|x| x.cancelled),
            truncated: o.truncated,
            stdout_bytes: o.stdout_retained,
            stderr_bytes: o.stderr_retained,
            vm_state: v.vm_state.as_str().to_string(),
            stale: v.stale,
            seen_unix: v.seen_unix,
            background_processes: o.background_processes,
            output_complete: o.output_complete,
        })
    }

    pub(super) async fn vm_job_output(
        &self,
        p: &Principal,
        a: JobOutputArgs,
    ) -> Result<Value, ApiError> {
        let rec = self
            .owned_for_work(p, &a.vm_id, a.expected_generation)
            .await?;
        let job = parse_job(&a.job_id)?;
        let wait = a.wait_ms.unwrap_or(0);
        if wait > MAX_OUTPUT_WAIT_MS {
            return Err(ApiError::invalid(format!(
                "wait_ms must be at most {MAX_OUTPUT_WAIT_MS}"
            )));
        }
        let max = a.max_bytes.unwrap_or(MAX_READ_PER_STREAM);
        if max == 0 || max > MAX_READ_PER_STREAM {
            return Err(ApiError::invalid(format!(
                "max_bytes must be within 1..={MAX_READ_PER_STREAM}"
            )));
        }
        let c = a.cursor.unwrap_or_default();
        let cursor = Cursor {
            stdout: c.stdout,
            stderr: c.stderr,
        };
        let o = self
            .job_read(
                &rec.id,
                job,
                cursor,
                max,
                Duration::from_millis(u64::from(wait)),
            )
            .await?;
        to_value(output::page(
            &job.to_string(),
            cursor,
            &o,
            a.encoding.unwrap_or(Encoding::Utf8),
        ))
    }

    pub(super) async fn vm_job_cancel(&self, p: &Principal, a: JobRef) -> Result<Value, ApiError> {
        let rec = self
            .owned_for_work(p, &a.vm_id, a.expected_generation)
            .await?;
        let job = parse_job(&a.job_id)?;
        self.warren.job_cancel(&rec.id, job).await?;
        to_value(JobCancelled {
            job_id: job.to_string(),
            cancelled: true,
        })
    }
}
