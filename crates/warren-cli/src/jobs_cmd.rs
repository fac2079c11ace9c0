//! `warren vm jobs`: the guest's job list, with the background processes finished jobs left.

use anyhow::Result;
use warren_protocol::{JobState, JobSummary};

use crate::term::Term;

/// The list as JSON (`--json`) or as a table, oldest job first.
pub(crate) fn print_jobs(t: Term, list: &[JobSummary], json: bool) -> Result<()> {
    if json {
        let v: Vec<serde_json::Value> = list.iter().map(job_json).collect();
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    print!("{}", table(t, list));
    Ok(())
}

/// The table `warren vm jobs` prints. Commands and process names are guest-controlled (any
/// process names itself, `prctl(PR_SET_NAME)`): every cell goes through `t`.
fn table(t: Term, list: &[JobSummary]) -> String {
    use std::fmt::Write;
    let mut out = format!(
        "{:<6} {:<9} {:>4} {:>10}  COMMAND\n",
        "JOB", "STATE", "EXIT", "BACKGROUND"
    );
    for j in list {
        let exit = match j.state {
            JobState::Running => String::new(),
            JobState::Finished(x) => match (x.code, x.signal) {
                (Some(c), _) => c.to_string(),
                (None, Some(s)) => format!("sig{s}"),
                (None, None) => "?".into(),
            },
        };
        let _ = writeln!(
            out,
            "{:<6} {:<9} {:>4} {:>10}  {}",
            j.id,
            state_name(j.state),
            exit,
            j.background_processes,
            t.field(&j.command)
        );
        for p in &j.processes {
            let _ = writeln!(
                out,
                "{:<6} {:<9} {:>4} {:>10}    pid {} {}",
                "",
                "",
                "",
                "",
                p.pid,
                t.field(&p.name)
            );
        }
    }
    out
}

fn state_name(s: JobState) -> &'static str {
    match s {
        JobState::Running => "running",
        JobState::Finished(_) => "completed",
    }
}

fn job_json(j: &JobSummary) -> serde_json::Value {
    let exit = match j.state {
        JobState::Running => None,
        JobState::Finished(x) => Some(x),
    };
    serde_json::json!({
        "job_id": j.id.to_string(),
        "state": state_name(j.state),
        "exit_code": exit.and_then(|x| x.code),
        "signal": exit.and_then(|x| x.signal),
        "timed_out": exit.is_some_and(|x| x.timed_out),
        "cancelled": exit.is_some_and(|x| x.cancelled),
        "command": j.command,
        "background_processes": j.background_processes,
        "processes": j.processes.iter().map(|p| serde_json::json!({"pid": p.pid, "name": p.name})).collect::<Vec<_>>(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use warren_protocol::{JobExit, JobId, ProcessInfo};

    #[test]
    fn test_table_escapes_guest_names_and_commands() {
        let list = [JobSummary {
            id: JobId(4),
            state: JobState::Finished(JobExit {
                code: Some(0),
                signal: None,
                timed_out: false,
                cancelled: false,
            }),
            command: "sh -c x\n\u{1b}[2J".into(),
            background_processes: 1,
            processes: vec![ProcessInfo {
                pid: 42,
                name: "\u{1b}]0;pwn\u{7}".into(),
            }],
        }];
        let out = table(Term::new(false), &list);
        assert!(!out.contains('\u{1b}') && !out.contains('\u{7}'), "{out:?}");
        assert_eq!(
            out.lines().count(),
            3,
            "one line per job and process: {out:?}"
        );
        assert!(out.contains("pid 42 \\u{1b}]0;pwn\\u{7}"), "{out:?}");
        assert!(table(Term::new(true), &list).contains('\u{1b}'), "--raw");
    }
}
