//! Limits enforced by the guest agent and relied upon by the host. Values follow the
//! reference service's documented bounds.

/// Jobs that may run at once in one VM.
pub const MAX_RUNNING_JOBS: usize = 4;
/// Job records retained per VM; the oldest finished one without background processes is
/// evicted first.
pub const MAX_JOB_RECORDS: usize = 256;
/// Jobs whose cgroup holds processes at once: the running jobs plus the finished jobs whose
/// background processes still run. A start is refused (`QuotaExceeded`) while this many
/// hold processes; their records are never evicted.
pub const MAX_LIVE_JOBS: usize = 16;
/// Processes `JobList` names per job with background processes (it counts them all).
pub const MAX_LISTED_PROCESSES: usize = 16;
/// Longest command `JobList` reports per job, in bytes (cut at a character boundary).
pub const MAX_JOB_COMMAND_BYTES: usize = 256;
/// Output bytes retained per job across stdout and stderr together.
pub const MAX_RETAINED_OUTPUT: u64 = 256 * 1024;
/// Bytes returned per stream per output read.
pub const MAX_READ_PER_STREAM: u32 = 16 * 1024;
/// Bytes per file read or write call.
pub const MAX_FILE_CHUNK: u32 = 128 * 1024;
/// Largest content of one whole-file operation (a versioned read's data, a checked write):
/// fits one message with room for the path and framing.
pub const MAX_WHOLE_FILE: u32 = 512 * 1024;
/// Largest file that gets a version (hashed on read, checked on write, edited in memory).
pub const MAX_VERSIONED_FILE: u64 = 16 * 1024 * 1024;
/// Most paths or matching lines one glob or grep returns.
pub const MAX_SEARCH_RESULTS: u32 = 2000;
/// Most directory entries one glob or grep visits; past it the result is `truncated`.
pub const MAX_SEARCH_ENTRIES: usize = 50_000;
/// Most file bytes one grep reads; past it the result is `truncated`.
pub const MAX_GREP_BYTES: u64 = 64 * 1024 * 1024;
/// Longest line text a grep match carries, in characters.
pub const MAX_GREP_LINE_CHARS: usize = 500;
/// Longest glob or regular expression accepted, in bytes.
pub const MAX_PATTERN_BYTES: usize = 4096;
/// Longest long-poll an output read may ask for.
pub const MAX_OUTPUT_WAIT_MS: u32 = 30_000;
/// Largest encoded message in either direction (a file chunk plus headroom).
pub const MAX_MESSAGE_BYTES: usize = 1024 * 1024;
/// Longest path accepted for file operations and cwd.
pub const MAX_PATH_BYTES: usize = 4096;
/// Most argv entries, env entries and bytes of stdin accepted by exec.
pub const MAX_ARGV: usize = 4096;
pub const MAX_ENV: usize = 1024;
pub const MAX_STDIN_BYTES: usize = 128 * 1024;
/// Bytes per `JobInput` request.
pub const MAX_INPUT_CHUNK: usize = 64 * 1024;
/// Longest `ExecStart::request_key` accepted, in bytes.
pub const MAX_REQUEST_KEY_BYTES: usize = 128;
/// Exec request keys the guest remembers per boot (the most recent ones; older keys are
/// forgotten first). A host retry is deduplicated only while its key is still remembered.
pub const MAX_REQUEST_KEYS: usize = 4096;
/// uid/gid commands and file operations run as in the guest.
pub const GUEST_USER_ID: u32 = 1000;
