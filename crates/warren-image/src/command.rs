//! Running helper programs (debootstrap, apt, dpkg-deb, depmod, mkfs.ext4).
//!
//! Long-running commands stream their merged stdout/stderr into a log file; the caller gets
//! each line to summarise as progress, and the log's tail when the command fails.

use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Command, Stdio};

use crate::ImageError;

/// How a logged command ended unsuccessfully.
#[derive(Debug)]
pub(crate) struct Failure {
    pub status: String,
    pub log_tail: String,
}

/// Number of log lines quoted in errors.
const TAIL_LINES: usize = 30;

/// Runs `cmd` with stdout and stderr merged into `log` (appended), calling `on_line` for each
/// output line. Returns `Ok(Err(failure))` when the command ran but failed.
pub(crate) fn run_logged(
    mut cmd: Command,
    log: &Path,
    on_line: &mut dyn FnMut(&str),
) -> Result<Result<(), Failure>, ImageError> {
    let program = format!("{:?}", cmd.get_program());
    let mut log_file = File::options()
        .create(true)
        .append(true)
        .open(log)
        .map_err(ImageError::io("open log", log))?;
    let _ = writeln!(log_file, "$ {cmd:?}");
    let (reader, writer) = std::io::pipe().map_err(ImageError::io("pipe", log))?;
    let writer2 = writer.try_clone().map_err(ImageError::io("pipe", log))?;
    cmd.stdin(Stdio::null()).stdout(writer).stderr(writer2);
    let mut child = cmd.spawn().map_err(|source| ImageError::Spawn {
        program: program.clone(),
        source,
    })?;
    // The Command holds the pipe's write ends; drop it so EOF arrives when the child exits.
    drop(cmd);
    let mut tail: std::collections::VecDeque<String> = std::collections::VecDeque::new();
    for line in BufReader::new(reader).split(b'\n') {
        let Ok(line) = line else { break };
        let line = String::from_utf8_lossy(&line).into_owned();
        let _ = writeln!(log_file, "{line}");
        on_line(&line);
        if tail.len() == TAIL_LINES {
            tail.pop_front();
        }
        tail.push_back(line);
    }
    let status = child
        .wait()
        .map_err(|source| ImageError::Spawn { program, source })?;
    if status.success() {
        Ok(Ok(()))
    } else {
        Ok(Err(Failure {
            status: status.to_string(),
            log_tail: tail.into_iter().collect::<Vec<_>>().join("\n"),
        }))
    }
}

/// Runs `cmd` to completion, returning stdout on success and `(status, stderr+stdout)` on
/// failure.
pub(crate) fn run_output(mut cmd: Command) -> Result<Result<String, Failure>, ImageError> {
    let program = format!("{:?}", cmd.get_program());
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .map_err(|source| ImageError::Spawn { program, source })?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if out.status.success() {
        Ok(Ok(stdout))
    } else {
        let stderr = String::from_utf8_lossy(&out.stderr);
        let text = format!("{stderr}{stdout}");
        let lines: Vec<&str> = text.lines().collect();
        let start = lines.len().saturating_sub(TAIL_LINES);
        Ok(Err(Failure {
            status: out.status.to_string(),
            log_tail: lines[start..].join("\n"),
        }))
    }
}
