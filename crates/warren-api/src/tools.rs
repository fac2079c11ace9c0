//! The tools' arguments and results. These types are the API: their JSON Schemas (derived
//! with schemars, doc comments included) are what MCP discovery and the OpenAPI document
//! publish, and unknown fields are refused everywhere.

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use warren_core::output::{Cursor, Encoding, OutputPage};

/// Arguments of a tool that takes none.
#[derive(Debug, Clone, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct NoArgs {}

/// A VM's network: `off` (no NIC), `allowlist` (only what `egress.allow` names; `on` is
/// the same), or `internet` (every public destination over TCP, minus `egress.deny`; needs
/// the workspace's internet grant).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Network {
    Off,
    // The same as `allowlist` (its original name); a plain comment, so the schema stays a
    // plain enum.
    On,
    Allowlist,
    Internet,
}

impl Network {
    /// The egress mode, `None` for `off`.
    pub fn mode(self) -> Option<warren_vmm::NetMode> {
        match self {
            Network::Off => None,
            Network::On | Network::Allowlist => Some(warren_vmm::NetMode::Allowlist),
            Network::Internet => Some(warren_vmm::NetMode::Internet),
        }
    }
}

/// Allow and deny lists: domain names (`*.example.com` wildcards), `preset:NAME` entries
/// (debian, python, npm, rust, go, github: a package ecosystem's hosts) and IPv4 CIDRs;
/// `allow` may name CIDRs only inside the operator's grant for the workspace (else
/// `forbidden`). Private, loopback, link-local and metadata addresses, the operator's blocked
/// ranges and the host's own addresses are always denied.
#[derive(Debug, Clone, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct EgressArgs {
    #[serde(default)]
    #[schemars(length(max = 256))]
    pub allow: Vec<String>,
    #[serde(default)]
    #[schemars(length(max = 256))]
    pub deny: Vec<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct VmCreateArgs {
    /// Idempotency key: a retry with the same id and arguments returns the original VM.
    /// 1-128 characters of A-Z a-z 0-9 . _ : -
    pub request_id: String,
    /// A configured image name; the default image when omitted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// Guest memory in MiB (default: the image's default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 128, max = 65536))]
    pub memory_mib: Option<u32>,
    /// Virtual CPUs (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 64))]
    pub vcpus: Option<u32>,
    /// Guest networking: "off" (default), "allowlist" (or "on"; needs the workspace's
    /// network grant) or "internet" (needs its internet grant).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<Network>,
    /// Egress policy of a networked VM (fail-closed: nothing is reachable unless allowed).
    /// Secrets and interception rules come from the operator's configuration, never from here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress: Option<EgressArgs>,
    /// Suspend the VM after this many seconds without exec, output or file work while no job
    /// runs (default 300; 0 never).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(max = 604800))]
    pub idle_seconds: Option<u32>,
    /// How an idle VM is suspended: "hibernate" (default) or "pause".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_mode: Option<SuspendModeArg>,
    /// Keep guest RAM in a file in the VM's directory: hibernation becomes a fast standby
    /// (device state only, RAM file flushed to disk). The file counts as storage.
    #[serde(default)]
    pub ram_file: bool,
}

/// Names one VM.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct VmRef {
    pub vm_id: String,
    /// Refuse with `conflict` unless the VM's generation (its memory lineage) is this one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expected_generation: Option<u64>,
}

#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct VmExecArgs {
    pub vm_id: String,
    /// Refuse with `conflict` unless the VM's generation (its memory lineage) is this one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expected_generation: Option<u64>,
    /// Idempotency key: a retry with the same id and arguments returns the same job and never
    /// runs the command twice. 1-128 characters of A-Z a-z 0-9 . _ : -
    pub request_id: String,
    /// A shell command line, run with `bash -c`. Give exactly one of `command` and `argv`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub command: Option<String>,
    /// Program and arguments, run without a shell; the program is looked up in PATH.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub argv: Option<Vec<String>>,
    /// Working directory relative to /workspace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    /// Extra environment variables.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub env: Option<BTreeMap<String, String>>,
    /// Text fed to the command's stdin (at most 128 KiB); /dev/null when omitted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stdin: Option<String>,
    /// Kill the command and all its descendants after this many milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 604800000))]
    pub timeout_ms: Option<u64>,
    /// Wait up to this long for the job to finish, and return its first output page and final
    /// state when it does (default 0: return at once).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(max = 30000))]
    pub wait_ms: Option<u32>,
    /// Run on a guest pseudo-terminal of this size (stderr merged into stdout); input, window
    /// sizes and output then go through the job's terminal, the WebSocket
    /// `GET /v1/vms/{vm_id}/jobs/{job_id}/terminal`. Implies `interactive`. Not with `stdin`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tty: Option<TtyArg>,
    /// Keep the command's stdin open for input sent through the job's terminal endpoint (an
    /// empty message ends it); stdout and stderr stay apart. Not with `stdin`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub interactive: bool,
    /// A one-time secret (43-128 characters of A-Z a-z 0-9 _ -) that gives its holder the
    /// job's broker pipe: the job sees a UNIX socket at /run/warren-broker/broker.sock
    /// (WARREN_BROKER_SOCKET), and the holder takes its connections at
    /// `GET /v1/vms/{vm_id}/jobs/{job_id}/broker` with `X-Broker-Pipe`. Only its hash is
    /// kept, in memory. The answer then has `broker_pipe`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 43, max = 128))]
    pub broker_pipe_token: Option<String>,
}

/// A terminal's size in character cells.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TtyArg {
    #[schemars(range(min = 1))]
    pub rows: u16,
    #[schemars(range(min = 1))]
    pub cols: u16,
}

/// Names one job of one VM.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct JobRef {
    pub vm_id: String,
    /// Refuse with `conflict` unless the VM's generation (its memory lineage) is this one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expected_generation: Option<u64>,
    pub job_id: String,
}

/// Byte offsets to read from; omitted streams start at 0.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CursorArg {
    #[serde(default)]
    pub stdout: u64,
    #[serde(default)]
    pub stderr: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct JobOutputArgs {
    pub vm_id: String,
    /// Refuse with `conflict` unless the VM's generation (its memory lineage) is this one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expected_generation: Option<u64>,
    pub job_id: String,
    /// The `next_cursor` of the previous response; omit on the first call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cursor: Option<CursorArg>,
    /// "utf-8" (default): readable text; "base64": exact bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub encoding: Option<Encoding>,
    /// While the job runs and nothing new is available, wait up to this long for news.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(max = 30000))]
    pub wait_ms: Option<u32>,
    /// Bytes per stream (default and maximum 16384).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 16384))]
    pub max_bytes: Option<u32>,
}

#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ReadFileArgs {
    pub vm_id: String,
    /// Refuse with `conflict` unless the VM's generation (its memory lineage) is this one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expected_generation: Option<u64>,
    /// Path relative to /workspace; escapes and symlinks out of it are refused.
    pub path: String,
    /// Byte offset to start at (default 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offset: Option<u64>,
    /// Bytes to read (default and maximum 131072).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 131072))]
    pub max_bytes: Option<u32>,
}

#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct WriteFileArgs {
    pub vm_id: String,
    /// Refuse with `conflict` unless the VM's generation (its memory lineage) is this one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expected_generation: Option<u64>,
    /// Path relative to /workspace; missing parent directories are created.
    pub path: String,
    /// The bytes to write, base64 (at most 131072 bytes decoded).
    pub content_base64: String,
    /// Append instead of replacing the file (in place, no version returned; cannot be
    /// combined with create_only or expected_version).
    #[serde(default)]
    pub append: bool,
    /// Fail with `conflict` if the path already exists; an existing file is never replaced.
    #[serde(default)]
    pub create_only: bool,
    /// Fail with `conflict` unless the file exists and its version (from vm_read_file or an
    /// earlier write or edit) is this one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expected_version: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct EditFileArgs {
    pub vm_id: String,
    /// Refuse with `conflict` unless the VM's generation (its memory lineage) is this one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expected_generation: Option<u64>,
    /// Path relative to /workspace.
    pub path: String,
    /// Exact text to replace; it must occur exactly once in the file (`invalid_argument`
    /// naming 0 or N matches otherwise).
    pub old_string: String,
    /// The replacement text.
    pub new_string: String,
    /// Fail with `conflict` unless the file's version is this one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expected_version: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct GlobArgs {
    pub vm_id: String,
    /// Refuse with `conflict` unless the VM's generation (its memory lineage) is this one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expected_generation: Option<u64>,
    /// A glob: `*`, `?`, `[abc]`, `{a,b}`, `**`. Without `/` it matches file names at any
    /// depth (`*.rs`); with `/` the path relative to `path` (`src/**/*.rs`; `*` never
    /// crosses `/`).
    pub pattern: String,
    /// Directory to search, relative to /workspace (default: /workspace).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// At most this many paths (default 500).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 2000))]
    pub limit: Option<u32>,
}

#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct GrepArgs {
    pub vm_id: String,
    /// Refuse with `conflict` unless the VM's generation (its memory lineage) is this one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expected_generation: Option<u64>,
    /// A regular expression (Rust regex syntax), matched against each line.
    pub pattern: String,
    /// Only files matching this glob (as in vm_glob).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub glob: Option<String>,
    /// Directory to search, relative to /workspace (default: /workspace).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// Match letters regardless of case.
    #[serde(default)]
    pub case_insensitive: bool,
    /// At most this many matching lines (default 200).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 2000))]
    pub limit: Option<u32>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum SuspendModeArg {
    Pause,
    Hibernate,
}

#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct VmSuspendArgs {
    pub vm_id: String,
    /// Refuse with `conflict` unless the VM's generation (its memory lineage) is this one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expected_generation: Option<u64>,
    /// "hibernate" (default) or "pause".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<SuspendModeArg>,
    /// Suspend even while jobs run (they are frozen and keep their timeout budgets);
    /// otherwise active jobs refuse it with `busy`.
    #[serde(default)]
    pub force: bool,
}

/// A VM as listed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct VmInfo {
    pub vm_id: String,
    /// creating, running, paused, hibernating, hibernated, resuming or failed.
    pub state: String,
    /// The configured image name, or null if the image is no longer configured.
    pub image: Option<String>,
    pub image_id: String,
    /// The accelerator the VM runs under (kvm or tcg).
    pub accel: String,
    pub memory_mib: u32,
    pub vcpus: u32,
    /// The VM's memory lineage: 1 at creation (a session's VM: its session's), +1 on every
    /// fresh boot after its memory was lost (a hibernated VM whose checkpoint could not be
    /// restored).
    pub generation: u64,
    pub created_unix: u64,
    pub boot_ms: Option<u64>,
    /// Why the VM failed, when it did.
    pub reason: Option<String>,
    /// Seconds without work before the VM is suspended (0: never).
    pub idle_seconds: u32,
    /// pause or hibernate.
    pub idle_mode: String,
    /// The last exec, output read, cancel or file operation (host clock, seconds); status
    /// and list calls never move it.
    pub last_active_unix: u64,
    /// off, allowlist or internet.
    pub network: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct VmList {
    pub vms: Vec<VmInfo>,
}

/// Job counts from the guest.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, JsonSchema)]
pub struct JobCounts {
    pub running: u64,
    pub finished: u64,
    /// Finished jobs whose background processes still run (these keep the VM awake).
    pub with_background: u64,
    /// The background processes of those jobs, all together.
    pub background_processes: u64,
}

/// A finished job that left processes running (`cmd &`, `nohup`, a dev server). Stop them
/// with vm_job_cancel on its job_id.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct BackgroundJob {
    pub job_id: String,
    /// The job's command (its argv joined with spaces, at most 256 bytes).
    pub command: String,
    /// How many of its processes still run.
    pub processes: u32,
    /// Up to 16 of them, lowest pid first.
    pub pids: Vec<BackgroundProcess>,
}

#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct BackgroundProcess {
    pub pid: u32,
    /// The process's name (its first 15 bytes).
    pub name: String,
}

impl JobCounts {
    /// Counts the jobs the host recorded before a suspension.
    pub fn of_seen(list: &[warren_core::vm::jobs_seen::SeenJob]) -> Self {
        let running = list
            .iter()
            .filter(|j| j.state == warren_protocol::JobState::Running)
            .count() as u64;
        let background: Vec<_> = list.iter().filter(|j| j.background_processes > 0).collect();
        JobCounts {
            running,
            finished: list.len() as u64 - running,
            with_background: background.len() as u64,
            background_processes: background
                .iter()
                .map(|j| u64::from(j.background_processes))
                .sum(),
        }
    }

    /// Counts the guest's job list and names the jobs with background processes.
    pub fn of(list: &[warren_protocol::JobSummary]) -> (Self, Vec<BackgroundJob>) {
        let running = list
            .iter()
            .filter(|j| j.state == warren_protocol::JobState::Running)
            .count() as u64;
        let background: Vec<BackgroundJob> = list
            .iter()
            .filter(|j| j.background_processes > 0)
            .map(|j| BackgroundJob {
                job_id: j.id.to_string(),
                command: j.command.clone(),
                processes: j.background_processes,
                pids: j
                    .processes
                    .iter()
                    .map(|p| BackgroundProcess {
                        pid: p.pid,
                        name: p.name.clone(),
                    })
                    .collect(),
            })
            .collect();
        let counts = JobCounts {
            running,
            finished: list.len() as u64 - running,
            with_background: background.len() as u64,
            background_processes: background.iter().map(|b| u64::from(b.processes)).sum(),
        };
        (counts, background)
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct VmStatus {
    #[serde(flatten)]
    pub vm: VmInfo,
    /// The guest's jobs while the VM runs; for a suspended VM, as the host saw them just
    /// before the suspension (`jobs_stale`; frozen jobs count as running); null when neither
    /// is known.
    pub jobs: Option<JobCounts>,
    /// Ids of the jobs the guest still retains (or retained when the VM was suspended).
    pub job_ids: Vec<String>,
    /// True when `jobs` and `job_ids` are the host's record of a suspended VM's jobs.
    pub jobs_stale: bool,
    /// When that record was made (host clock, seconds); only when `jobs_stale`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub jobs_seen_unix: Option<u64>,
    /// Finished jobs whose background processes still run, oldest first (empty unless the
    /// VM is running).
    pub background_jobs: Vec<BackgroundJob>,
    /// Guest streams open to the VM through this service (WebSocket streams, copies,
    /// broker attachments and each of their live guest connections).
    #[serde(default)]
    pub open_streams: usize,
}

#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct JobStatus {
    pub job_id: String,
    /// running or completed.
    pub state: String,
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
    pub timed_out: bool,
    pub cancelled: bool,
    pub truncated: bool,
    /// Bytes retained so far per stream.
    pub stdout_bytes: u64,
    pub stderr_bytes: u64,
    /// The VM's state when this was answered. A status call never wakes a suspended VM.
    pub vm_state: String,
    /// True when the VM is suspended and this is the job as the host last saw it, just
    /// before the suspension (a job frozen while running says running).
    pub stale: bool,
    /// When the host last saw the job (host clock, seconds); only when stale.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seen_unix: Option<u64>,
    /// Processes the job left running after its main process exited.
    pub background_processes: u32,
    /// No more output can come (completed, nothing of it runs, both streams at end of file).
    pub output_complete: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct JobCancelled {
    pub job_id: String,
    pub cancelled: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct FileContent {
    pub path: String,
    pub offset: u64,
    pub content_base64: String,
    /// The file's size when read.
    pub size: u64,
    /// Whether this read reached the end of the file.
    pub eof: bool,
    /// The SHA-256 of the whole file's content (64 hex digits) when this was read; pass it
    /// as expected_version to write or edit only if nobody changed the file since. Null for
    /// files larger than 16 MiB.
    pub version: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct FileWritten {
    pub path: String,
    pub bytes_written: u64,
    /// The new content's version; null after an append.
    pub version: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct FileEdited {
    pub path: String,
    /// The new content's version.
    pub version: String,
    /// The file's size after the edit.
    pub size: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct GlobOutput {
    /// Matching regular files, relative to /workspace, sorted. Files ignored by .gitignore
    /// (or .git/info/exclude) and anything in .git are left out; symlinks are neither
    /// followed nor listed.
    pub paths: Vec<String>,
    /// More paths matched than returned, or the search stopped at a work bound.
    pub truncated: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct GrepLine {
    /// Relative to /workspace.
    pub path: String,
    /// 1-based line number.
    pub line: u64,
    /// The line (invalid UTF-8 replaced), cut at 500 characters.
    pub text: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct GrepOutput {
    /// Sorted by path, then line. Same files as vm_glob; binary files (a NUL byte in the
    /// first 8 KiB) are skipped.
    pub matches: Vec<GrepLine>,
    /// More lines matched than returned, or the search stopped at a work bound.
    pub truncated: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct VmDestroyed {
    pub vm_id: String,
    pub destroyed: bool,
}

/// The result of `vm_exec` is an output page of the new job.
pub type ExecResult = OutputPage;

/// Re-exported so the OpenAPI document names it.
pub type CursorResult = Cursor;

/// A session: a private copy of a host repository (or, with `direct`, the directory itself)
/// mounted read-write at /workspace of its own VM. Local callers only, or paths under the
/// operator's host roots.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SessionCreateArgs {
    /// Idempotency key: a retry with the same id and arguments returns the original session
    /// and never makes a second one. 1-128 characters of A-Z a-z 0-9 . _ : - (optional: a
    /// create without one is not idempotent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 128))]
    pub request_id: Option<String>,
    /// Absolute host path of the repository (any directory inside a git checkout; its
    /// toplevel is used). Checked as the caller's uid.
    #[schemars(length(min = 1, max = 4096))]
    pub repo: String,
    /// Session name (default: the project's directory name, made unique).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 64))]
    pub name: Option<String>,
    /// Mount `repo` itself instead of a copy (needs write access; nothing to export).
    #[serde(default)]
    pub direct: bool,
    /// A configured image name; the default image when omitted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// Guest memory in MiB (default: the image's default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 128, max = 65536))]
    pub memory_mib: Option<u32>,
    /// Virtual CPUs (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 64))]
    pub vcpus: Option<u32>,
    /// Size in MiB of the copy's own filesystem, counted as storage of the workspace and
    /// the host; the guest gets ENOSPC when it is full (default: 4096 when a storage limit
    /// applies, else none). Not for `direct`: that directory is the caller's own storage.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 64, max = 1048576))]
    pub storage_mib: Option<u64>,
    /// The session VM's networking, as for `vm_create`: "on" needs the workspace's network
    /// grant. Default "off".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<Network>,
    /// Egress policy of a networked session VM, as for `vm_create`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress: Option<EgressArgs>,
}

/// Names one session of the caller's workspace, by id or name.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SessionRef {
    #[schemars(length(min = 1, max = 64))]
    pub session: String,
    /// Refuse with `conflict` unless the session's generation is this one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expected_generation: Option<u64>,
}

#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SessionExportArgs {
    #[schemars(length(min = 1, max = 64))]
    pub session: String,
    /// Refuse with `conflict` unless the session's generation is this one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expected_generation: Option<u64>,
    /// Branch of the source repository to create or fast-forward (default:
    /// warren/SESSION_NAME).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 255))]
    pub branch: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SessionDeleteArgs {
    #[schemars(length(min = 1, max = 64))]
    pub session: String,
    /// Refuse with `conflict` unless the session's generation is this one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expected_generation: Option<u64>,
    /// Delete even with uncommitted changes or unexported commits.
    #[serde(default)]
    pub force: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct SessionInfo {
    pub session_id: String,
    pub name: String,
    /// The source repository's toplevel (or the directory, when direct).
    pub source: String,
    pub direct: bool,
    /// The host directory mounted at /workspace.
    pub workspace_dir: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vm_id: Option<String>,
    pub created_unix: u64,
    /// Size in MiB of the copy's own filesystem (absent: a plain directory, or direct).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub storage_mib: Option<u64>,
    /// The session's memory lineage, its VM's generation: 1 at creation, +1 on every
    /// recreate (a new VM; the session keeps its id and name) and on every fresh boot of its
    /// VM after memory loss.
    pub generation: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct SessionList {
    pub sessions: Vec<SessionInfo>,
}

/// What deleting the session would lose.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct SessionStatus {
    pub session_id: String,
    /// The session's generation (as in session_list).
    pub generation: u64,
    /// Paths with uncommitted changes (as `git status --porcelain`).
    pub uncommitted: Vec<String>,
    /// Commits not in the source repository.
    pub unexported: Vec<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct SessionExported {
    /// The branch created or fast-forwarded in the source repository.
    pub refname: String,
    pub commit: String,
    pub new_commits: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct SessionDeleted {
    pub session_id: String,
    pub deleted: bool,
}

#[cfg(test)]
mod tests {
    use super::*;
    use warren_protocol::{JobExit, JobId, JobState, JobSummary, ProcessInfo};

    #[test]
    fn test_job_counts_count_and_name_background_jobs() {
        let done = JobState::Finished(JobExit {
            code: Some(0),
            signal: None,
            timed_out: false,
            cancelled: false,
        });
        let job = |id, state, background: u32| JobSummary {
            id: JobId(id),
            state,
            command: format!("job {id}"),
            background_processes: background,
            processes: (0..background.min(2))
                .map(|i| ProcessInfo {
                    pid: 100 + i,
                    name: "srv".into(),
                })
                .collect(),
        };
        let list = [
            job(1, JobState::Running, 0),
            job(2, done, 3),
            job(3, done, 0),
        ];
        let (c, bg) = JobCounts::of(&list);
        assert_eq!(
            (
                c.running,
                c.finished,
                c.with_background,
                c.background_processes
            ),
            (1, 2, 1, 3)
        );
        assert_eq!(bg.len(), 1);
        assert_eq!((bg[0].job_id.as_str(), bg[0].processes), ("2", 3));
        assert_eq!(bg[0].pids.len(), 2);
        assert_eq!(bg[0].command, "job 2");
    }
}

/// `vm_fork`: copies of a running VM.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct VmForkArgs {
    /// Idempotency key: a retry with the same id and arguments returns the original copies.
    /// 1-128 characters of A-Z a-z 0-9 . _ : -
    pub request_id: String,
    pub vm_id: String,
    /// How many copies (1-16), admitted against the limits as one request.
    #[schemars(range(min = 1, max = 16))]
    pub count: u32,
    /// Refuse with `conflict` unless the VM's generation (its memory lineage) is this one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expected_generation: Option<u64>,
}

/// The copies a fork made.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct VmForked {
    pub vms: Vec<VmInfo>,
    /// The fork of a session's VM: the new session of each copy, in the same order (each
    /// with a copy of the session's files).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub session_ids: Vec<String>,
}

/// The warm pools, by shape.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct PoolReport {
    pub pools: Vec<PoolEntry>,
}

/// One warm pool.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct PoolEntry {
    /// The configured image name (null if the image is no longer configured).
    pub image: Option<String>,
    pub image_id: String,
    pub memory_mib: u32,
    pub vcpus: u32,
    /// The operator's target size.
    pub size: u32,
    /// VMs ready to be handed out.
    pub ready: u32,
    /// VMs being restored.
    pub starting: u32,
}
