//! Host-side decoding of job output read with byte cursors.
//!
//! Text mode: UTF-8 with an incomplete character at the end of a page held back for the next
//! read (the cursor stops before it), unless no more bytes can follow (the output is complete,
//! or the retention limit was reached) in which case it becomes U+FFFD. Invalid bytes become
//! U+FFFD and set the stream's `decoding_errors` flag; a literal U+FFFD in valid input does
//! not. Base64 mode returns the exact bytes.

use base64::Engine;
use serde::Serialize;
use warren_protocol::{JobOutput, JobState};

/// Per-stream byte offsets.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, serde::Deserialize, schemars::JsonSchema,
)]
pub struct Cursor {
    pub stdout: u64,
    pub stderr: u64,
}

#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum Encoding {
    #[serde(rename = "utf-8")]
    Utf8,
    Base64,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, schemars::JsonSchema)]
pub struct StreamFlags {
    pub stdout: bool,
    pub stderr: bool,
}

/// A job's state as clients see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum JobStateName {
    Running,
    Completed,
}

/// One output page as clients see it (field names follow the reference service).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, schemars::JsonSchema)]
pub struct OutputPage {
    pub job_id: String,
    pub encoding: Encoding,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stdout: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stderr: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stdout_base64: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stderr_base64: Option<String>,
    pub next_cursor: Cursor,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub decoding_errors: Option<StreamFlags>,
    pub state: JobStateName,
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
    pub truncated: bool,
    pub timed_out: bool,
    pub cancelled: bool,
    /// Processes the job left running after its main process exited (`cmd &`, `nohup`,
    /// daemons); they may still write output. Stop them with vm_job_cancel.
    pub background_processes: u32,
    /// No more output can come: the job completed, nothing of it runs and both streams
    /// reached end of file. Until then background processes may add output; wait_ms waits
    /// only while the job runs, so poll for it.
    pub output_complete: bool,
}

/// Decodes `bytes` read at some cursor. `final_` says no byte can follow them. Returns the
/// text, how many bytes it consumed, and whether invalid bytes were replaced.
pub fn decode_utf8(bytes: &[u8], final_: bool) -> (String, usize, bool) {
    let mut out = String::with_capacity(bytes.len());
    let mut errors = false;
    let mut rest = bytes;
    loop {
        match std::str::from_utf8(rest) {
            Ok(s) => {
                out.push_str(s);
                return (out, bytes.len(), errors);
            }
            Err(e) => {
                let valid = e.valid_up_to();
                // SAFETY-free: from_utf8 just validated this prefix.
                out.push_str(std::str::from_utf8(&rest[..valid]).expect("invariant: valid prefix"));
                match e.error_len() {
                    Some(n) => {
                        out.push('\u{FFFD}');
                        errors = true;
                        rest = &rest[valid + n..];
                    }
                    None => {
                        // An incomplete character at the end.
                        if final_ {
                            out.push('\u{FFFD}');
                            return (out, bytes.len(), true);
                        }
                        let consumed = bytes.len() - (rest.len() - valid);
                        return (out, consumed, errors);
                    }
                }
            }
        }
    }
}

/// Builds the client page from a guest read made at `cursor`.
pub fn page(job_id: &str, cursor: Cursor, out: &JobOutput, encoding: Encoding) -> OutputPage {
    let (finished, exit) = match out.state {
        JobState::Running => (false, None),
        JobState::Finished(x) => (true, Some(x)),
    };
    let ended = out.output_complete || out.truncated;
    let (mut p_stdout, mut p_stderr, mut b_stdout, mut b_stderr, mut flags) =
        (None, None, None, None, None);
    let next = match encoding {
        Encoding::Base64 => {
            let e = base64::engine::general_purpose::STANDARD;
            b_stdout = Some(e.encode(&out.stdout));
            b_stderr = Some(e.encode(&out.stderr));
            Cursor {
                stdout: cursor.stdout.saturating_add(out.stdout.len() as u64),
                stderr: cursor.stderr.saturating_add(out.stderr.len() as u64),
            }
        }
        Encoding::Utf8 => {
            let so_final = ended
                && cursor.stdout.saturating_add(out.stdout.len() as u64) >= out.stdout_retained;
            let se_final = ended
                && cursor.stderr.saturating_add(out.stderr.len() as u64) >= out.stderr_retained;
            let (so, so_n, so_err) = decode_utf8(&out.stdout, so_final);
            let (se, se_n, se_err) = decode_utf8(&out.stderr, se_final);
            p_stdout = Some(so);
            p_stderr = Some(se);
            flags = Some(StreamFlags {
                stdout: so_err,
                stderr: se_err,
            });
            Cursor {
                stdout: cursor.stdout.saturating_add(so_n as u64),
                stderr: cursor.stderr.saturating_add(se_n as u64),
            }
        }
    };
    OutputPage {
        job_id: job_id.to_string(),
        encoding,
        stdout: p_stdout,
        stderr: p_stderr,
        stdout_base64: b_stdout,
        stderr_base64: b_stderr,
        next_cursor: next,
        decoding_errors: flags,
        state: if finished {
            JobStateName::Completed
        } else {
            JobStateName::Running
        },
        exit_code: exit.and_then(|x| x.code),
        signal: exit.and_then(|x| x.signal),
        truncated: out.truncated,
        timed_out: exit.map(|x| x.timed_out).unwrap_or(false),
        cancelled: exit.map(|x| x.cancelled).unwrap_or(false),
        background_processes: out.background_processes,
        output_complete: out.output_complete,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_decode_utf8_split_char_held_back() {
        let s = "aé".as_bytes(); // 61 c3 a9
        let (t, n, err) = decode_utf8(&s[..2], false);
        assert_eq!((t.as_str(), n, err), ("a", 1, false));
        let (t, n, err) = decode_utf8(&s[1..], false);
        assert_eq!((t.as_str(), n, err), ("é", 2, false));
    }

    #[test]
    fn test_decode_utf8_incomplete_at_eof_replaced_and_flagged() {
        let (t, n, err) = decode_utf8(&[b'a', 0xe2, 0x82], true);
        assert_eq!((t.as_str(), n, err), ("a\u{FFFD}", 3, true));
    }

    #[test]
    fn test_decode_utf8_invalid_byte_flagged_literal_fffd_not() {
        let (t, _, err) = decode_utf8(&[b'x', 0xff, b'y'], false);
        assert_eq!((t.as_str(), err), ("x\u{FFFD}y", true));
        let (t, _, err) = decode_utf8("�".as_bytes(), false);
        assert_eq!((t.as_str(), err), ("\u{FFFD}", false));
    }

    #[test]
    fn test_page_running_holds_split_char_in_cursor() {
        let out = JobOutput {
            stdout: vec![b'h', 0xc3],
            stderr: vec![],
            stdout_retained: 2,
            stderr_retained: 0,
            state: JobState::Running,
            truncated: false,
            output_complete: false,
            background_processes: 0,
        };
        let p = page("1", Cursor::default(), &out, Encoding::Utf8);
        assert_eq!(p.stdout.as_deref(), Some("h"));
        assert_eq!(
            p.next_cursor,
            Cursor {
                stdout: 1,
                stderr: 0
            }
        );
        assert_eq!(p.state, JobStateName::Running);
    }

    #[test]
    fn test_page_finished_with_background_still_holds_split_char() {
        let finished = JobState::Finished(warren_protocol::JobExit {
            code: Some(0),
            signal: None,
            timed_out: false,
            cancelled: false,
        });
        let mut out = JobOutput {
            stdout: vec![b'h', 0xc3],
            stderr: vec![],
            stdout_retained: 2,
            stderr_retained: 0,
            state: finished,
            truncated: false,
            output_complete: false,
            background_processes: 1,
        };
        let p = page("1", Cursor::default(), &out, Encoding::Utf8);
        assert_eq!(p.state, JobStateName::Completed);
        assert_eq!((p.stdout.as_deref(), p.next_cursor.stdout), (Some("h"), 1));
        assert_eq!((p.background_processes, p.output_complete), (1, false));
        out.output_complete = true;
        out.background_processes = 0;
        let p = page("1", Cursor::default(), &out, Encoding::Utf8);
        assert_eq!(
            (p.stdout.as_deref(), p.next_cursor.stdout),
            (Some("h\u{FFFD}"), 2)
        );
    }

    #[test]
    fn test_page_base64_exact_bytes() {
        let out = JobOutput {
            stdout: vec![0, 255],
            stderr: vec![],
            stdout_retained: 2,
            stderr_retained: 0,
            state: JobState::Running,
            truncated: false,
            output_complete: false,
            background_processes: 0,
        };
        let p = page("1", Cursor::default(), &out, Encoding::Base64);
        assert_eq!(p.stdout_base64.as_deref(), Some("AP8="));
        assert!(p.decoding_errors.is_none());
        assert_eq!(p.next_cursor.stdout, 2);
    }
}
