//! The messages of protocol version [`crate::PROTOCOL_VERSION`]: one enum per direction.
//!
//! Encoding is postcard. Variants are identified by position, so new variants are only ever
//! appended, and a field change means a new version (see `PROTOCOL.md`). The schema snapshot
//! test in this file pins the encoding of every variant.

use serde::{Deserialize, Serialize};

/// A job's id, unique within one guest boot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct JobId(pub u64);

impl std::fmt::Display for JobId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Host -> guest: one per HTTP/2 request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum HostRequest {
    /// First request of a session: version negotiation and the host's challenge.
    Hello(Hello),
    /// Second request: the host's proof, plus clock and entropy for the guest.
    Auth(Auth),
    /// Liveness and round-trip measurement.
    Ping,
    /// Starts a job.
    ExecStart(ExecStart),
    /// Reads retained output at byte cursors, optionally waiting for news.
    JobOutput(JobOutputRequest),
    /// Kills a job's whole cgroup: a running job and everything it started, or the
    /// background processes a finished job left running.
    JobCancel(JobId),
    /// Reads part of a file below /workspace.
    FileRead(FileRead),
    /// Writes part of a file below /workspace.
    FileWrite(FileWrite),
    /// Measures in-guest costs for `warren bench`.
    Bench(BenchRequest),
    /// Throughput probe: the guest discards the bytes.
    Discard(#[serde(with = "serde_bytes")] Vec<u8>),
    /// Throughput probe: the guest answers with this many zero bytes (at most one message).
    Source(u32),
    /// Syncs the filesystem and powers the guest off.
    PowerOff,
    /// Every retained job with its state, oldest first.
    JobList,
    /// Before the VM's vCPUs stop: freezes every job's cgroup and stops timeout clocks.
    Freeze,
    /// After they run again: sets the wall clock, reseeds the RNG, restores the remaining
    /// timeout budgets and thaws the jobs.
    Thaw(Thaw),
    /// Reads part of a file below /workspace together with the whole file's version.
    ReadVersioned(ReadVersioned),
    /// Replaces a whole file atomically, under a precondition.
    WriteChecked(WriteChecked),
    /// Replaces the one occurrence of a string in a file.
    Edit(EditFile),
    /// Files below /workspace whose path matches a glob.
    Glob(GlobRequest),
    /// Lines of files below /workspace that match a regular expression.
    Grep(GrepRequest),
    /// Starts a job whose input is streamed with `JobInput`: on a pseudo-terminal (`tty`) or
    /// on a stdin pipe. Answers `ExecStarted`.
    ExecInteractive(ExecInteractive),
    /// Writes bytes to an interactive job's terminal or stdin pipe, then optionally closes
    /// the input. Answers `InputWritten` once the bytes are written (backpressure).
    JobInput(JobInput),
    /// Sets the window size of a terminal job (the kernel signals SIGWINCH to its
    /// foreground process group). Answers `Resized`.
    JobResize(JobResize),
    /// The VM's egress CA certificate (PEM): the agent writes a trust bundle (system roots +
    /// this CA) and points every later job at it (`SSL_CERT_FILE` and friends). Answers
    /// `CaInstalled`.
    InstallCa(String),
    /// Since version 5. `JobOutput` whose release point is given apart from the read cursors:
    /// for an interactive job the guest drops only the bytes before `release_*` (which the
    /// reader acknowledged having), so a reader that lost what it read last can read it again.
    /// Answers `JobOutput`.
    JobOutputAcked(JobOutputAcked),
    /// Since version 5. Starts a job with a broker pipe: a UNIX socket at
    /// `/run/warren-broker/broker.sock`, visible only in the job's own mount namespace and
    /// answering only processes of the job's cgroup, whose connections the host takes with
    /// `StreamTarget::BrokerAccept`. Answers `ExecStarted`.
    ExecBroker(ExecStart),
    /// Since version 6. A VM restored from another VM's memory (a template clone or a
    /// fork) takes its own identity: fresh entropy and a reseeded CRNG first, the wall clock, its own channel
    /// secret derived from the old one and a host contribution (`crate::auth::rekey`), its
    /// hostname and machine id. Answers `Rekeyed` with a proof of the new secret.
    Rekey(Rekey),
}

/// A job output read with a separate release point (see `HostRequest::JobOutputAcked`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobOutputAcked {
    pub read: JobOutputRequest,
    /// At most the read cursors.
    pub release_stdout: u64,
    pub release_stderr: u64,
}

/// Guest -> host: the success half of every response.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum GuestResponse {
    Hello(HelloReply),
    Authenticated(AgentInfo),
    Pong,
    ExecStarted(JobId),
    JobOutput(JobOutput),
    JobCancelled,
    FileData(FileData),
    FileWritten(FileWritten),
    Bench(BenchReply),
    Discarded,
    Source(#[serde(with = "serde_bytes")] Vec<u8>),
    PoweringOff,
    Jobs(Vec<JobSummary>),
    /// How many jobs were running when frozen.
    Frozen(u32),
    Thawed,
    VersionedData(VersionedData),
    /// Answer to `WriteChecked` and `Edit`: the file's new version.
    FileVersioned(FileVersion),
    Glob(GlobResult),
    Grep(GrepResult),
    /// `JobInput` wrote all its bytes (and closed the input when asked).
    InputWritten,
    /// `JobResize` set the terminal's size.
    Resized,
    /// `InstallCa` wrote the bundle.
    CaInstalled,
    /// `Rekey` replaced the secret: the proof is `auth::rekey_guest_proof` under the new one.
    Rekeyed(RekeyProof),
}

/// A restored copy's new identity and secret (see `HostRequest::Rekey`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rekey {
    /// Fresh host randomness the new secret is derived from (never reused by the host).
    pub contribution: [u8; 32],
    /// `auth::rekey_host_proof(old secret, contribution)`: the request is authenticated with
    /// the old secret on top of the session's own authentication.
    pub proof: [u8; 32],
    /// Host wall clock, nanoseconds since the Unix epoch.
    pub unix_time_ns: u64,
    /// Fresh host randomness mixed in (and credited) before anything else, then the CRNG is
    /// reseeded: two copies of one memory image never share random streams.
    pub entropy: [u8; 32],
    /// The guest's new hostname (`[a-z0-9-]`, 1..=63 bytes).
    pub hostname: String,
    /// The guest's new `/etc/machine-id` (32 lowercase hex digits).
    pub machine_id: String,
}

/// The guest's proof that it holds the new secret.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RekeyProof {
    pub proof: [u8; 32],
}

/// Host facts for a resumed guest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Thaw {
    /// Host wall clock, nanoseconds since the Unix epoch.
    pub unix_time_ns: u64,
    /// Fresh host randomness; the guest mixes it in and reseeds its CRNG, so two resumes of
    /// one checkpoint never share random streams.
    pub entropy: [u8; 32],
}

/// One retained job, as `JobList` reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobSummary {
    pub id: JobId,
    pub state: JobState,
    /// The job's argv joined with spaces, cut to at most `MAX_JOB_COMMAND_BYTES`.
    pub command: String,
    /// Processes still in the job's cgroup after its main process exited (0 while it runs).
    pub background_processes: u32,
    /// Some of those processes (at most `MAX_LISTED_PROCESSES`, lowest pids first).
    pub processes: Vec<ProcessInfo>,
}

/// A process of a job's cgroup.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessInfo {
    pub pid: u32,
    /// Its `comm` (at most 15 bytes).
    pub name: String,
}

/// Every response body is this, postcard-encoded.
pub type Response = Result<GuestResponse, GuestError>;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// Highest version the host speaks.
    pub max_version: u32,
    /// Lowest version the host speaks.
    pub min_version: u32,
    pub host_nonce: [u8; 32],
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HelloReply {
    /// The version the guest chose for this session.
    pub version: u32,
    pub guest_nonce: [u8; 32],
    pub proof: [u8; 32],
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Auth {
    pub proof: [u8; 32],
    /// Host wall clock, nanoseconds since the Unix epoch; the guest sets its clock from it
    /// (covers resume after a snapshot as well as boot).
    pub unix_time_ns: u64,
    /// Fresh host randomness mixed into the guest's pool.
    pub entropy: [u8; 32],
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentInfo {
    pub agent_version: String,
    pub kernel_release: String,
    /// Guest `/proc/sys/kernel/random/boot_id`.
    pub boot_id: String,
    pub uptime_ms: u64,
}

/// Starts `argv` as uid 1000 in a cgroup of its own.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExecStart {
    /// Program and arguments; `argv[0]` is looked up in `PATH`.
    pub argv: Vec<String>,
    /// Extra environment on top of the agent's base environment.
    pub env: Vec<(String, String)>,
    /// Working directory relative to /workspace; `None` is /workspace itself.
    pub cwd: Option<String>,
    /// Bytes for stdin; `None` means /dev/null.
    pub stdin: Option<serde_bytes::ByteBuf>,
    /// Kills the job's cgroup after this long.
    pub timeout_ms: Option<u64>,
    /// Idempotency key chosen by the host, at most `MAX_REQUEST_KEY_BYTES` bytes (and not
    /// empty), so that retrying a start whose answer was lost cannot run the command twice.
    /// While the guest remembers the key (this boot, the most recent `MAX_REQUEST_KEYS` keys,
    /// even after the job's record is evicted), an identical request with it answers the
    /// first job's id without starting anything, and a different request with it is a
    /// `Conflict` error. A refused start does not keep its key. `None`: every request
    /// starts a new job.
    pub request_key: Option<String>,
}

impl ExecStart {
    /// SHA-256 of the request's postcard encoding (key included). "The same request" for a
    /// reused `request_key` means the same digest, that is the same bytes on the wire.
    pub fn digest(&self) -> Result<[u8; 32], CodecError> {
        use sha2::{Digest, Sha256};
        let bytes = postcard::to_stdvec(self)?;
        Ok(Sha256::digest(&bytes).into())
    }
}

/// A terminal's size in character cells.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct WindowSize {
    pub rows: u16,
    pub cols: u16,
}

/// Starts a job whose stdin stays open for `JobInput`.
///
/// With `tty`, the job runs on a new pseudo-terminal of that initial size: it is the
/// controlling terminal of the job's session and its stdin, stdout and stderr, so all output
/// arrives as the job's stdout (stderr stays empty) and `TERM` defaults to `xterm-256color`.
/// Without, stdin is a pipe and stdout and stderr stay separate.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExecInteractive {
    /// argv, env, cwd, timeout and request key as for `ExecStart`; `stdin` must be `None`
    /// (input is sent with `JobInput`). A request key is shared with `ExecStart`: the same
    /// key with a different request (of either kind) is a `Conflict`.
    pub start: ExecStart,
    /// Run on a pseudo-terminal of this size (rows and cols at least 1).
    pub tty: Option<WindowSize>,
}

impl ExecInteractive {
    /// SHA-256 of the request's postcard encoding, as [`ExecStart::digest`].
    pub fn digest(&self) -> Result<[u8; 32], CodecError> {
        use sha2::{Digest, Sha256};
        let bytes = postcard::to_stdvec(self)?;
        Ok(Sha256::digest(&bytes).into())
    }
}

/// Input for an interactive job.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobInput {
    pub job: JobId,
    /// At most `MAX_INPUT_CHUNK` bytes. On a terminal they go through its line discipline:
    /// 0x03 (Ctrl-C) signals SIGINT to the foreground process group, and so on.
    #[serde(with = "serde_bytes")]
    pub data: Vec<u8>,
    /// After `data`, end the input: a pipe is closed; a terminal gets its EOF character
    /// (Ctrl-D, which ends input only where the terminal is in canonical mode) and takes
    /// no further input.
    pub eof: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobResize {
    pub job: JobId,
    pub size: WindowSize,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobOutputRequest {
    pub job: JobId,
    pub stdout_cursor: u64,
    pub stderr_cursor: u64,
    /// At most this many bytes per stream (capped at `MAX_READ_PER_STREAM`).
    pub max_bytes: u32,
    /// When nothing is available past both cursors and the job runs, wait up to this long for
    /// output or the job's end (capped at `MAX_OUTPUT_WAIT_MS`).
    pub wait_ms: u32,
}

/// How a finished job ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobExit {
    /// Exit code when the main process exited normally.
    pub code: Option<i32>,
    /// Signal number when it was killed by a signal.
    pub signal: Option<i32>,
    /// The timeout fired.
    pub timed_out: bool,
    /// A `JobCancel` killed it.
    pub cancelled: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum JobState {
    Running,
    /// The main process ended. Processes it left in the job's cgroup may still run and
    /// write to the job's pipes: see `JobOutput::background_processes` and
    /// `JobOutput::output_complete`.
    Finished(JobExit),
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobOutput {
    #[serde(with = "serde_bytes")]
    pub stdout: Vec<u8>,
    #[serde(with = "serde_bytes")]
    pub stderr: Vec<u8>,
    /// Bytes retained so far per stream; a cursor equal to this is caught up.
    pub stdout_retained: u64,
    pub stderr_retained: u64,
    pub state: JobState,
    /// Output beyond the retention limit was discarded.
    pub truncated: bool,
    /// No byte can follow: the job finished, its cgroup is empty and both pipes reached end
    /// of file. Until then background processes may still append output (a long-poll waits
    /// only while the main process runs, so it is read by polling).
    pub output_complete: bool,
    /// Processes still in the job's cgroup after its main process exited (0 while it runs).
    pub background_processes: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileRead {
    pub path: String,
    pub offset: u64,
    /// At most `MAX_FILE_CHUNK`.
    pub len: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileData {
    #[serde(with = "serde_bytes")]
    pub data: Vec<u8>,
    /// File size when read.
    pub size: u64,
    /// `offset + data.len() >= size`.
    pub eof: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum WriteMode {
    /// Create or truncate, then write at 0.
    Truncate,
    /// Create if missing, write at the end.
    Append,
    /// Create if missing, write at this offset.
    At(u64),
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileWrite {
    pub path: String,
    pub mode: WriteMode,
    /// At most `MAX_FILE_CHUNK`.
    #[serde(with = "serde_bytes")]
    pub data: Vec<u8>,
    /// Create missing parent directories.
    pub create_parents: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileWritten {
    /// File size after the write.
    pub size: u64,
}

/// A file's version: the SHA-256 of its content (not its mtime, which virtio-fs may cache).
pub type Version = [u8; 32];

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReadVersioned {
    pub path: String,
    pub offset: u64,
    /// At most `MAX_WHOLE_FILE`; 0 asks for the version only.
    pub len: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VersionedData {
    #[serde(with = "serde_bytes")]
    pub data: Vec<u8>,
    /// File size when read.
    pub size: u64,
    /// `offset + data.len() >= size`.
    pub eof: bool,
    /// SHA-256 of the whole file, read through the same open file as `data`; `None` when
    /// the file is larger than `MAX_VERSIONED_FILE`.
    pub version: Option<Version>,
}

/// What must hold for a `WriteChecked` to replace the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Precondition {
    /// Create or replace.
    None,
    /// The path must not exist (`Conflict` otherwise); an existing file is never replaced.
    CreateOnly,
    /// The file must exist with this version (`Conflict` otherwise).
    IfVersion(Version),
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WriteChecked {
    pub path: String,
    /// The whole new content, at most `MAX_WHOLE_FILE` bytes.
    #[serde(with = "serde_bytes")]
    pub data: Vec<u8>,
    pub precondition: Precondition,
    /// Create missing parent directories.
    pub create_parents: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EditFile {
    pub path: String,
    /// Must occur exactly once in the file (not empty).
    pub old: String,
    pub new: String,
    /// `Conflict` unless the file has this version.
    pub expected_version: Option<Version>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileVersion {
    pub version: Version,
    pub size: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GlobRequest {
    /// A glob (`*`, `?`, `[..]`, `{a,b}`, `**`); without `/` it matches file names at any
    /// depth, with `/` the path relative to the search directory.
    pub pattern: String,
    /// Search directory relative to /workspace; `None` is /workspace.
    pub path: Option<String>,
    /// At most this many paths (capped at `MAX_SEARCH_RESULTS`).
    pub limit: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GlobResult {
    /// Paths relative to /workspace, sorted.
    pub paths: Vec<String>,
    /// More paths matched than returned, or the search stopped at a work bound.
    pub truncated: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GrepRequest {
    /// A regular expression (Rust `regex` syntax), matched against each line.
    pub pattern: String,
    /// Only files matching this glob (as in `GlobRequest::pattern`).
    pub glob: Option<String>,
    pub path: Option<String>,
    pub case_insensitive: bool,
    /// At most this many matching lines (capped at `MAX_SEARCH_RESULTS`).
    pub limit: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GrepMatch {
    /// Relative to /workspace.
    pub path: String,
    /// 1-based.
    pub line: u64,
    /// The line without its newline, lossily UTF-8, at most `MAX_GREP_LINE_CHARS` characters.
    pub text: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GrepResult {
    /// Sorted by path, then line.
    pub matches: Vec<GrepMatch>,
    pub truncated: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum BenchRequest {
    /// fork+exec+wait of `/bin/true` in the guest, this many times.
    ForkExecWait { iterations: u32 },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BenchReply {
    /// One duration per iteration, nanoseconds.
    pub samples_ns: Vec<u64>,
}

/// Stable machine-readable error codes (see `PROTOCOL.md`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ErrorCode {
    InvalidArgument,
    NotFound,
    QuotaExceeded,
    PermissionDenied,
    Unauthenticated,
    VersionMismatch,
    /// The path exists but is of the wrong kind (a directory where a file was expected, ...).
    WrongType,
    Io,
    Internal,
    /// The request contradicts an earlier one (an exec request key reused for a different
    /// request), or a file precondition failed (it exists, or its version changed).
    Conflict,
    /// The file is too large for a whole-file operation.
    TooLarge,
}

impl ErrorCode {
    /// The code as the stable snake_case string used by the CLI and the API.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::InvalidArgument => "invalid_argument",
            ErrorCode::NotFound => "not_found",
            ErrorCode::QuotaExceeded => "quota_exceeded",
            ErrorCode::PermissionDenied => "forbidden",
            ErrorCode::Unauthenticated => "unauthenticated",
            ErrorCode::VersionMismatch => "version_mismatch",
            ErrorCode::WrongType => "invalid_argument",
            ErrorCode::Io => "io_error",
            ErrorCode::Internal => "internal",
            ErrorCode::Conflict => "conflict",
            ErrorCode::TooLarge => "too_large",
        }
    }
}

/// A typed error from the guest: a code plus a human-readable detail.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{message}")]
pub struct GuestError {
    pub code: ErrorCode,
    pub message: String,
}

impl GuestError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }
}

/// Encoding or decoding failed.
#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    #[error("message of {0} bytes exceeds the limit")]
    TooLarge(usize),
    #[error("malformed message")]
    Malformed(#[from] postcard::Error),
    /// A header value that is not lowercase hex of even length.
    #[error("malformed header value")]
    BadHeader,
}

/// Encodes a message body.
pub fn encode<T: Serialize>(msg: &T) -> Result<Vec<u8>, CodecError> {
    let v = postcard::to_stdvec(msg)?;
    if v.len() > crate::limits::MAX_MESSAGE_BYTES {
        return Err(CodecError::TooLarge(v.len()));
    }
    Ok(v)
}

/// Decodes a message body, refusing oversized ones.
pub fn decode<'a, T: Deserialize<'a>>(bytes: &'a [u8]) -> Result<T, CodecError> {
    if bytes.len() > crate::limits::MAX_MESSAGE_BYTES {
        return Err(CodecError::TooLarge(bytes.len()));
    }
    Ok(postcard::from_bytes(bytes)?)
}

/// The start of an error answer ([`Response`]'s `Err`) whose message is longer than `max`
/// bytes, told from the answer's first bytes, so a receiver can stop reading it there: the
/// error's code, the message's first `max` bytes (cut back to a character boundary) and the
/// message's whole length. `None` while those bytes are not all there, and for any other
/// answer (read whole, as before). A message whose first `max` bytes are not UTF-8 is
/// malformed, as its whole decode would be. The head is decoded with postcard itself: the
/// `Result`'s variant index, the code's and the string's length are its varints.
pub fn long_error_head(
    bytes: &[u8],
    max: usize,
) -> Option<Result<(ErrorCode, &str, usize), CodecError>> {
    let (variant, rest) = postcard::take_from_bytes::<u32>(bytes).ok()?;
    if variant != 1 {
        return None;
    }
    let (code, rest) = match postcard::take_from_bytes::<ErrorCode>(rest) {
        Ok(v) => v,
        Err(postcard::Error::DeserializeUnexpectedEnd) => return None,
        Err(e) => return Some(Err(e.into())),
    };
    let (len, rest) = postcard::take_from_bytes::<usize>(rest).ok()?;
    if len <= max || rest.len() < max {
        return None;
    }
    let text = match std::str::from_utf8(&rest[..max]) {
        Ok(t) => t,
        // Only a character cut at the end: keep what precedes it.
        Err(e) if e.error_len().is_none() => {
            std::str::from_utf8(&rest[..e.valid_up_to()]).unwrap_or_default()
        }
        Err(_) => return Some(Err(postcard::Error::DeserializeBadUtf8.into())),
    };
    Some(Ok((code, text, len)))
}

#[cfg(test)]
mod tests;
