//! `warren vm jobs`: the guest's job list, with the background processes finished jobs left.

use anyhow::Result;
use warren_protocol::{JobState, JobSummary};

use crate::term::Term;

/// The list as JSON (`--json`) or as a table, oldest job first. Commands and process names
/// are the guest's: each is one escaped field (`--raw` prints them as they are).
pub(crate) fn print_jobs(t: Term, list: &[JobSummary], json: bool) -> Result<()> {
    if json {
        let v: Vec<serde_json::Value> = list.iter().map(job_json).collect();
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!(
        "{:<6} {:<9} {:>4} {:>10}  COMMAND",
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
        println!(
            "{:<6} {:<9} {:>4} {:>10}  {}",
            j.id,
            state_name(j.state),
            exit,
            j.background_processes,
            t.field(&j.command)
        );
        for p in &j.processes {
            println!(
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
    Ok(())
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
