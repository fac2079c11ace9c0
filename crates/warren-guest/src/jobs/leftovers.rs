//! Background processes: what a job leaves running in its cgroup after its main process
//! exited (`cmd &`, `nohup`, `setsid`, daemons). They keep running until they exit, the job
//! is cancelled, its timeout fires or the VM goes away; this module finds and names them.
//!
//! A job's processes are the pids in its cgroup's `cgroup.procs` (the test-only process-group
//! containment scans `/proc` for its process group instead), minus zombies: a process that
//! exited but was not reaped yet runs nothing.

use std::fs;
use std::path::Path;

use warren_protocol::limits::MAX_JOB_COMMAND_BYTES;
use warren_protocol::ProcessInfo;

use super::Job;

/// The argv joined with spaces, cut at a character boundary to `MAX_JOB_COMMAND_BYTES`.
pub(super) fn command_line(argv: &[String]) -> String {
    let mut s = argv.join(" ");
    if s.len() > MAX_JOB_COMMAND_BYTES {
        let mut end = MAX_JOB_COMMAND_BYTES;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
    }
    s
}

/// How many live processes the job holds.
pub(super) fn count(job: &Job) -> u32 {
    processes(job, 0).0
}

/// How many live processes the job holds, and the first `limit` of them by pid.
pub(super) fn processes(job: &Job, limit: usize) -> (u32, Vec<ProcessInfo>) {
    let mut live: Vec<ProcessInfo> = match &job.cgroup {
        Some(dir) => cgroup_pids(dir)
            .into_iter()
            .filter_map(|pid| stat(pid).filter(|s| s.state != 'Z').map(|s| s.info))
            .collect(),
        None => match job.data().pid {
            Some(leader) => group_members(leader),
            None => Vec::new(),
        },
    };
    live.sort_by_key(|p| p.pid);
    let n = u32::try_from(live.len()).unwrap_or(u32::MAX);
    live.truncate(limit);
    (n, live)
}

/// The pids listed in a cgroup's `cgroup.procs` (none when it is gone).
fn cgroup_pids(dir: &Path) -> Vec<u32> {
    fs::read_to_string(dir.join("cgroup.procs"))
        .map(|s| s.lines().filter_map(|l| l.trim().parse().ok()).collect())
        .unwrap_or_default()
}

/// Live members of the process group `leader` leads (the test-only containment).
fn group_members(leader: i32) -> Vec<ProcessInfo> {
    let Ok(entries) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(stat)
        .filter(|s| s.state != 'Z' && i64::from(s.pgrp) == i64::from(leader))
        .map(|s| s.info)
        .collect()
}

struct Stat {
    info: ProcessInfo,
    state: char,
    pgrp: i32,
}

/// `/proc/<pid>/stat`: name, state and process group; `None` once the process is gone.
/// Read as bytes: a name need not be UTF-8 (any program name, `prctl(PR_SET_NAME)`, or a
/// 15-byte cut of a multi-byte name), and a process must never hide from the count by its
/// name. Invalid bytes become U+FFFD.
fn stat(pid: u32) -> Option<Stat> {
    let raw = fs::read(format!("/proc/{pid}/stat")).ok()?;
    parse_stat(pid, &String::from_utf8_lossy(&raw))
}

/// Parses `pid (comm) state ppid pgrp ...`; `comm` may itself contain spaces and `)`.
fn parse_stat(pid: u32, line: &str) -> Option<Stat> {
    let open = line.find('(')?;
    let close = line.rfind(')')?;
    let name = line.get(open + 1..close)?.to_string();
    let mut rest = line.get(close + 1..)?.split_whitespace();
    let state = rest.next()?.chars().next()?;
    let _ppid = rest.next()?;
    let pgrp = rest.next()?.parse().ok()?;
    Some(Stat {
        info: ProcessInfo { pid, name },
        state,
        pgrp,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_parse_stat_name_with_parens_and_spaces() {
        let s = parse_stat(7, "7 (a) b (c) S 1 7 7 0 -1").expect("parsed");
        assert_eq!((s.info.name.as_str(), s.state, s.pgrp), ("a) b (c", 'S', 7));
        assert!(parse_stat(7, "7 (truncated").is_none());
    }

    #[test]
    fn test_command_line_cut_at_char_boundary() {
        assert_eq!(
            command_line(&["sh".into(), "-c".into(), "x".into()]),
            "sh -c x"
        );
        let long = command_line(&["é".repeat(MAX_JOB_COMMAND_BYTES)]);
        assert!(long.len() <= MAX_JOB_COMMAND_BYTES && long.len() >= MAX_JOB_COMMAND_BYTES - 1);
        assert!(long.chars().all(|c| c == 'é'));
    }
}
