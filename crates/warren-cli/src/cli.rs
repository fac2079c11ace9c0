//! Command-line grammar (clap derive).

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

/// `warren --version`: the package version and the commit it was built from.
pub const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("WARREN_COMMIT"),
    ")"
);

#[derive(Parser, Debug)]
#[command(
    name = "warren",
    version = VERSION,
    about = "Private Linux workspaces in microVMs for AI coding agents"
)]
pub struct Cli {
    /// State directory (default: $XDG_STATE_HOME/warren, /var/lib/warren for root).
    #[arg(long, global = true, env = "WARREN_STATE_DIR")]
    pub state_dir: Option<PathBuf>,
    /// Image store (default: STATE_DIR/images).
    #[arg(long, global = true, env = "WARREN_IMAGE_DIR")]
    pub image_dir: Option<PathBuf>,
    /// A running `warren serve`'s local socket: session commands go through it (host paths
    /// checked as your uid). Default: STATE_DIR/warrend.sock when a service listens there;
    /// otherwise they act on the state directory directly.
    #[arg(long, global = true, env = "WARREN_SOCKET")]
    pub socket: Option<PathBuf>,
    /// More logging (-v info, -vv debug); RUST_LOG overrides.
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    pub verbose: u8,
    /// Print guest-controlled text (file names, console logs, failure reasons, error
    /// messages, path lists) as it is. By default its control characters are escaped
    /// (`\u{1b}`) so a guest cannot drive your terminal. `vm exec`, `vm read` and `vm output`
    /// are always raw; `--json` output is always JSON-escaped.
    #[arg(long, global = true)]
    pub raw: bool,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Guest images.
    #[command(subcommand)]
    Image(ImageCmd),
    /// Virtual machines.
    #[command(subcommand)]
    Vm(VmCmd),
    /// Checks this host: QEMU, firmware, accelerator, cgroups, privileges.
    Preflight {
        #[arg(long)]
        json: bool,
    },
    /// Measures boot, exec and file transfer costs against raw baselines.
    Bench(BenchArgs),
    /// Runs warrend: the JSON HTTP API, MCP at /mcp, and the local control socket.
    Serve {
        /// The service's TOML configuration.
        #[arg(long)]
        config: PathBuf,
    },
    /// Before a host shutdown: hibernates every running or paused VM (jobs are frozen and
    /// continue after resume). Run by `warren-hibernate.service` when the host shuts down.
    Shutdown {
        #[arg(long, required = true)]
        hibernate_all: bool,
        /// The service's configuration: its state and image directories (default: the
        /// global options).
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// Prints a shell completion script for SHELL on stdout (bash, zsh, fish, elvish,
    /// powershell).
    Completions { shell: clap_complete::Shell },
    /// Writes man pages (warren.1 and one per subcommand) into DIR (for packagers).
    #[command(hide = true)]
    ManPages {
        #[arg(long)]
        out_dir: PathBuf,
    },
    /// systemd generator (`/usr/lib/systemd/system-generators/warren-socket-generator`, run
    /// at boot and on daemon-reload): writes warren.socket's addresses for the configuration's
    /// `listen` into NORMAL_DIR/warren.socket.d/.
    #[command(hide = true)]
    SystemdGenerator {
        normal_dir: PathBuf,
        /// systemd passes two more directories; the generator writes only into the first.
        early_dir: Option<PathBuf>,
        late_dir: Option<PathBuf>,
        #[arg(long, default_value = "/etc/warren/warren.toml")]
        config: PathBuf,
    },
    /// Workspace credentials for the service (an operator action).
    #[command(subcommand)]
    Token(TokenCmd),
    /// Sessions: a private copy of a git project mounted at /workspace of a VM of its own.
    #[command(subcommand)]
    Session(SessionCmd),
    /// Runs a coding agent (or a shell, or CMD) in the current project's session VM,
    /// creating the session on first use. Interactive with a terminal, streamed otherwise.
    Run(RunArgs),
    /// Bridges stdin and stdout to a TCP port on the guest's loopback (a guest stdio MCP
    /// server behind a listener becomes an MCP client's command). Exits 0 when the guest
    /// closes normally, 1 otherwise.
    Attach {
        vm: String,
        #[arg(long)]
        port: u16,
        /// Keep the stream open after stdin ends (for downloads: the guest closes it).
        #[arg(long)]
        ignore_stdin_eof: bool,
        #[command(flatten)]
        service: crate::stream_link::ServiceArgs,
    },
    /// Forwards connections to a host loopback port to a guest port: `[LOCAL:]GUEST`
    /// (LOCAL 0 picks a free port; the address is printed first). Runs until Ctrl-C. Only
    /// connections from the caller's own uid are forwarded: loopback is open
    /// to every local user, and each connection acts with the caller's credential.
    PortForward {
        vm: String,
        #[arg(value_name = "[LOCAL:]GUEST")]
        ports: String,
        /// Forwards connections from any local user too (they reach the guest port as you).
        #[arg(long)]
        allow_other_users: bool,
        #[command(flatten)]
        service: crate::stream_link::ServiceArgs,
    },
    /// Answers an agent's OAuth refresh from the host credential file (run by the egress
    /// for wired credentials, not by hand).
    #[command(hide = true)]
    InterceptRefresh {
        /// `LOGIN=FILE` (repeatable): a login this endpoint may refresh and its host file.
        #[arg(long = "source", required = true)]
        sources: Vec<String>,
    },
    /// Runs the per-VM supervisor (started by `vm create`, not by hand).
    #[command(hide = true)]
    Supervise {
        #[arg(long)]
        vm_dir: PathBuf,
    },
}

/// VM devices, with the same names as `vm create`.
#[derive(Args, Debug, Clone, Default)]
pub struct DeviceArgs {
    /// Image id, unique id prefix, or recipe name. Default: dev (agents for a new session
    /// started by warren run claude, codex or opencode).
    #[arg(long)]
    pub image: Option<String>,
    #[arg(long)]
    pub memory_mib: Option<u32>,
    #[arg(long)]
    pub vcpus: Option<u32>,
    /// Also share a host directory: `HOST:GUEST[:ro]` (repeatable; read-only enforced on the
    /// host).
    #[arg(long = "mount", value_name = "HOST:GUEST[:ro]")]
    pub mounts: Vec<String>,
    /// Give a new session's copy a filesystem of its own of this size (MiB): what the guest
    /// writes to /workspace is bounded by it (default: 4096 under a storage limit, else
    /// none). Not with --direct; --mount directories are never counted.
    #[arg(long)]
    pub storage_mib: Option<u64>,
    /// Restore the session's VM from the template of its shape (image, memory, vCPUs, the
    /// session's shares), built on first use, instead of booting it.
    #[arg(long, env = "WARREN_TEMPLATES")]
    pub template: bool,
}

#[derive(Subcommand, Debug)]
pub enum SessionCmd {
    /// Copies the project (HEAD, index, unstaged and untracked non-ignored files, with its own
    /// git directory) and boots a VM with the copy at /workspace.
    Create {
        /// A directory inside a git checkout (its toplevel is used).
        #[arg(long)]
        repo: PathBuf,
        /// Default: the project's directory name (made unique).
        #[arg(long)]
        name: Option<String>,
        /// Mount REPO itself read-write instead of a copy (no git needed).
        #[arg(long)]
        direct: bool,
        #[command(flatten)]
        devices: DeviceArgs,
        #[arg(long)]
        json: bool,
    },
    /// Lists your sessions.
    List {
        #[arg(long)]
        json: bool,
    },
    /// What deleting the session would lose: uncommitted paths and unexported commits.
    Status {
        session: String,
        #[arg(long)]
        json: bool,
    },
    /// Brings the session's commits into the source repository as a branch.
    Export {
        session: String,
        /// Default: `warren/SESSION_NAME`.
        #[arg(long)]
        branch: Option<String>,
    },
    /// Destroys the session's VM and its copy; refuses while work would be lost.
    Delete {
        session: String,
        /// Delete even with uncommitted changes or unexported commits.
        #[arg(long)]
        force: bool,
    },
}

#[derive(Args, Debug)]
pub struct RunArgs {
    /// claude, codex, opencode or shell (default: shell).
    #[arg(value_parser = ["claude", "codex", "opencode", "shell"])]
    pub agent: Option<String>,
    /// Run this instead of the agent's own command.
    #[arg(last = true)]
    pub command: Vec<String>,
    #[command(flatten)]
    pub devices: DeviceArgs,
    /// Replace the session's VM (needed to change its devices).
    #[arg(long)]
    pub recreate: bool,
    /// Mount the project directory itself instead of a copy (first run only).
    #[arg(long)]
    pub direct: bool,
    /// Wire these host credentials (repeatable): the agents' logins (claude, codex, opencode), the API
    /// keys (anthropic-api-key, openai-api-key) and GitHub (github-token). Real values stay
    /// on the host, the VM gets placeholders. Default for claude, codex and opencode: all of
    /// them the host has (the same for every agent, so they share the project's VM).
    #[arg(long = "credentials", value_parser = ["claude", "codex", "opencode",
          "anthropic-api-key", "openai-api-key", "github-token"])]
    pub credentials: Vec<String>,
    /// Wire no credentials (the agent logs in inside the VM, or not at all).
    #[arg(long, conflicts_with = "credentials")]
    pub no_credentials: bool,
    /// Give the session VM a NIC behind Warren's egress (wired credentials imply it, with
    /// their provider hosts allowed): `allowlist` (bare `--network`), `internet` (every
    /// public destination, minus the deny list) or `off`. Applies when the session VM is
    /// created. Put it after the agent name (`warren run claude --network`), or write
    /// `--network=MODE`: a bare `--network` right before the agent would read it as the mode.
    #[arg(long, num_args = 0..=1, default_missing_value = "allowlist", value_name = "MODE",
          value_parser = ["off", "allowlist", "internet"])]
    pub network: Option<String>,
    /// Egress settings (TOML, as for `vm create --egress`) added to the agent's; implies
    /// --network.
    #[arg(long, value_name = "FILE.toml")]
    pub egress: Option<PathBuf>,
    /// Do not give the agent the image's browser (the Chrome DevTools MCP server of the
    /// `agents` image, otherwise named in claude's, codex's and opencode's configuration).
    #[arg(long)]
    pub no_browser: bool,
}

#[derive(Subcommand, Debug)]
pub enum ImageCmd {
    /// Builds an image from a recipe (cached by recipe digest).
    Build {
        /// minimal, dev, or agents (dev plus the Claude Code, Codex and opencode CLIs).
        /// Default: dev.
        #[arg(long)]
        recipe: Option<String>,
        /// A recipe file (TOML; see README "Recipe files"). Root only.
        #[arg(long, value_name = "FILE.toml", conflicts_with = "recipe")]
        recipe_file: Option<PathBuf>,
        /// The static guest agent binary (default: next to this binary or in the target dir).
        #[arg(long, env = "WARREN_GUEST_AGENT")]
        agent: Option<PathBuf>,
    },
    /// Pulls an OCI image by digest (REF@sha256:...) from a registry and makes it a Warren
    /// image (Warren's kernel, agent, guest user and /workspace). A tag alone is refused.
    Pull {
        /// `[registry/]repository[:tag]@sha256:<digest>`.
        reference: String,
        /// The static guest agent binary (default: next to this binary or in the target dir).
        #[arg(long, env = "WARREN_GUEST_AGENT")]
        agent: Option<PathBuf>,
        /// Root disk size in MiB (default: twice the content plus 1 GiB, at least 2 GiB).
        #[arg(long)]
        disk_size_mib: Option<u64>,
        /// The whole pull's deadline in seconds.
        #[arg(long, default_value_t = 3600)]
        timeout_secs: u64,
    },
    /// Prints the digest a tag names now, as REF@sha256:... to pin in `image pull`.
    Resolve {
        /// `[registry/]repository:tag`.
        reference: String,
    },
    /// Signs a local image (cosign-compatible signature over `sha256:<image id>`), and with
    /// --builder-id adds a signed SLSA provenance attestation naming that builder.
    Sign {
        /// Image id, unique id prefix, or recipe name.
        image: String,
        /// ECDSA P-256 private key, PKCS#8 PEM (`warren image keygen` makes one).
        #[arg(long, value_name = "FILE.pem")]
        key: PathBuf,
        /// Also attest SLSA provenance v1 with this builder id.
        #[arg(long)]
        builder_id: Option<String>,
    },
    /// Makes an ECDSA P-256 key pair: PREFIX.key (PKCS#8 PEM, 0600) and PREFIX.pub (for the
    /// image policy's `[[keys]]`).
    Keygen {
        #[arg(long, value_name = "PREFIX")]
        out: PathBuf,
    },
    /// Verifies an image: its files, and under the image policy its signatures and
    /// attestations (what every boot checks).
    Verify {
        /// Image id, unique id prefix, or recipe name.
        image: String,
    },
    /// Lists images, newest first.
    List {
        #[arg(long)]
        json: bool,
    },
    /// Removes an image (refused while a VM uses it).
    Rm { image: String },
}

#[derive(Subcommand, Debug)]
pub enum TokenCmd {
    /// Issues a bearer token for a workspace into a new 0600 file (never printed). The first
    /// token fixes the workspace's policy; a reissue asking for another policy is refused.
    Issue {
        #[arg(long)]
        workspace: String,
        /// File to write the token to (mode 0600).
        #[arg(long)]
        output: PathBuf,
        /// Lifetime in seconds (default: no expiry).
        #[arg(long)]
        ttl: Option<u64>,
        /// Grant guest networking (allow-list mode).
        #[arg(long)]
        allow_network: bool,
        /// Grant internet mode (every public destination; implies --allow-network).
        #[arg(long)]
        allow_internet: bool,
        /// Restrict the workspace to this configured image (repeatable).
        #[arg(long = "image")]
        images: Vec<String>,
        #[arg(long)]
        max_vms: Option<u64>,
        #[arg(long)]
        max_memory_mib: Option<u64>,
        /// Host storage of the workspace, MiB: its VMs' disks and its sessions' copies.
        #[arg(long)]
        max_storage_mib: Option<u64>,
    },
    /// Lists tokens: ids, workspaces, expiry; never secrets.
    List {
        #[arg(long)]
        json: bool,
    },
    /// Revokes one token.
    Revoke { id: String },
    /// Revokes every token of a workspace.
    RevokeWorkspace { workspace: String },
    /// Grants an existing workspace internet mode (and networking), or takes internet mode
    /// away with --off; its tokens act on it from their next request. A reissue never
    /// changes a workspace's policy: this is the explicit way to widen it.
    AllowInternet {
        #[arg(long)]
        workspace: String,
        /// Take the internet grant away instead (networking stays).
        #[arg(long)]
        off: bool,
    },
}

#[derive(Args, Debug, Clone)]
pub struct AccelArg {
    /// Accelerator: kvm, hvf, tcg or auto.
    #[arg(long, env = "WARREN_ACCEL", default_value = "auto")]
    pub accel: String,
}

#[derive(Subcommand, Debug)]
pub enum VmCmd {
    /// Creates and boots a VM, printing its id once the guest answers.
    Create {
        /// Image id, unique id prefix, or recipe name (newest image of it). Default: dev.
        #[arg(long)]
        image: Option<String>,
        #[arg(long)]
        memory_mib: Option<u32>,
        #[arg(long)]
        vcpus: Option<u32>,
        /// Suspend after this many seconds without work (applied while `warren serve` runs;
        /// default 300, 0 never).
        #[arg(long)]
        idle_seconds: Option<u32>,
        /// How an idle VM is suspended.
        #[arg(long, value_parser = ["pause", "hibernate"])]
        idle_mode: Option<String>,
        /// Shares a host directory over virtio-fs: `HOST:GUEST[:ro]` (repeatable). Read-only is
        /// enforced on the host; files the guest user creates belong to you.
        #[arg(long = "mount", value_name = "HOST:GUEST[:ro]")]
        mounts: Vec<String>,
        /// Keep guest RAM in a file in the VM's directory: hibernation becomes a fast
        /// standby (device state only; the RAM file is flushed and counts as storage).
        #[arg(long)]
        ram_file: bool,
        /// Restore from the template of this VM's shape (image, memory, vCPUs, NIC), built
        /// on first use, instead of booting: each clone gets its own disk layer, channel
        /// secret, entropy, hostname and machine id. A VM with a RAM file boots.
        #[arg(long, env = "WARREN_TEMPLATES")]
        template: bool,
        /// Give the VM a NIC behind Warren's fail-closed egress: `allowlist` (bare
        /// `--network`: nothing is reachable unless `--egress` allows it), `internet` (every
        /// public destination over TCP, minus the `--egress` deny list) or `off` (the
        /// default: no NIC at all).
        #[arg(long, num_args = 0..=1, default_missing_value = "allowlist", value_name = "MODE",
              value_parser = ["off", "allowlist", "internet"])]
        network: Option<String>,
        /// Egress policy (TOML: allow, deny, `preset:NAME` entries, upstream_dns,
        /// `[[secrets]]` name/placeholder/hosts/file, upstream_roots, outbound_netns,
        /// host_ca_store); implies --network.
        #[arg(long, value_name = "FILE.toml")]
        egress: Option<std::path::PathBuf>,
        #[command(flatten)]
        accel: AccelArg,
        #[arg(long)]
        json: bool,
    },
    /// Lists VMs with their states (a VM whose VMM died shows as failed, with the reason).
    List {
        #[arg(long)]
        json: bool,
    },
    /// Runs a command in the VM, streaming its output; exits with its exit code.
    Exec {
        vm: String,
        /// Kill the command's whole process tree after this many seconds (exit 124).
        #[arg(long)]
        timeout: Option<f64>,
        /// Working directory relative to /workspace.
        #[arg(long)]
        cwd: Option<String>,
        /// Extra environment, NAME=VALUE (repeatable).
        #[arg(long = "env", value_name = "NAME=VALUE")]
        env: Vec<String>,
        /// Feed this process's stdin to the command (at most 128 KiB, read before it starts).
        #[arg(long, conflicts_with_all = ["tty", "interactive"])]
        stdin: bool,
        /// Run the command on a pseudo-terminal in the guest, with this terminal in raw mode
        /// (keys, Ctrl-C and window size go to the command; stderr is merged into stdout).
        #[arg(short = 't', long, conflicts_with = "detach")]
        tty: bool,
        /// Stream this process's stdin to the command while it runs (end of file closes the
        /// command's stdin); stdout and stderr stay separate. Implied by --tty.
        #[arg(short = 'i', long, conflicts_with = "detach")]
        interactive: bool,
        /// Print the job id as JSON and return without waiting.
        #[arg(long)]
        detach: bool,
        #[command(flatten)]
        service: crate::stream_link::ServiceArgs,
        #[arg(last = true, required = true)]
        command: Vec<String>,
    },
    /// Copies a file or directory tree (modes and symlinks kept) between the host and a
    /// VM: `vm cp HOST_PATH VM:/guest/dir` or `vm cp VM:/guest/path HOST_DIR`. The copy
    /// lands in the destination directory (created when missing) under its own name, and
    /// never replaces an existing one.
    Cp {
        src: String,
        dst: String,
        /// Copying out of the VM: at most this many MiB on disk, each file counted in whole
        /// 4 KiB blocks and every entry as at least one (the guest decides what it sends).
        /// Default: the destination's free space (a file system's reserve for root not
        /// counted) less 1 GiB, or less 5% of a file system smaller than 20 GiB.
        #[arg(long)]
        max_mib: Option<u64>,
        /// Gives up when the guest sends nothing (copying out) or takes nothing (copying
        /// in) for this many seconds.
        #[arg(long, default_value_t = crate::cp_cmd::DEFAULT_IDLE_SECS)]
        idle_timeout: u64,
        #[command(flatten)]
        service: crate::stream_link::ServiceArgs,
    },
    /// Reads a job's retained output at byte cursors, as JSON.
    Output {
        vm: String,
        job: u64,
        #[arg(long, default_value_t = 0)]
        stdout_cursor: u64,
        #[arg(long, default_value_t = 0)]
        stderr_cursor: u64,
        /// utf-8 or base64.
        #[arg(long, default_value = "utf-8")]
        encoding: String,
        /// Wait up to this long for news while the job runs.
        #[arg(long, default_value_t = 0)]
        wait_ms: u32,
        /// Bytes per stream (at most 16384).
        #[arg(long, default_value_t = 16384)]
        max_bytes: u32,
    },
    /// Kills a job's whole process tree: a running job, or the background processes a
    /// finished job left running.
    Cancel { vm: String, job: u64 },
    /// Lists the jobs the guest retains: state, exit code, background processes (what a
    /// finished job left running, e.g. `server &`; stop them with `vm cancel`) and command.
    Jobs {
        vm: String,
        #[arg(long)]
        json: bool,
    },
    /// Writes stdin to PATH (relative to /workspace) in the VM and prints the new version
    /// (SHA-256 of the content) on stdout. Up to 512 KiB replaces the file atomically;
    /// larger content is written in place in chunks and has no version.
    Write {
        vm: String,
        path: String,
        /// Fail with `conflict` if PATH exists (never replaces it).
        #[arg(long, conflicts_with = "expected_version")]
        create_only: bool,
        /// Fail with `conflict` unless PATH's current version is this one.
        #[arg(long, value_name = "VERSION")]
        expected_version: Option<String>,
    },
    /// Prints PATH (relative to /workspace) from the VM to stdout.
    Read {
        vm: String,
        path: String,
        /// Also print `version: <sha256>` on stderr.
        #[arg(long)]
        print_version: bool,
    },
    /// Replaces the one occurrence of --old with --new in PATH; prints the new version.
    Edit {
        vm: String,
        path: String,
        /// Exact text that must occur exactly once.
        #[arg(long)]
        old: String,
        #[arg(long)]
        new: String,
        /// Fail with `conflict` unless PATH's current version is this one.
        #[arg(long, value_name = "VERSION")]
        expected_version: Option<String>,
    },
    /// Lists files matching a glob (without `/`: file names at any depth; with `/`: paths
    /// relative to --path), sorted, skipping .gitignore'd files and .git.
    Glob {
        vm: String,
        pattern: String,
        /// Directory to search, relative to /workspace.
        #[arg(long)]
        path: Option<String>,
        #[arg(long, default_value_t = 500)]
        limit: u32,
        /// `{"paths": [...], "truncated": bool}` instead of one path per line.
        #[arg(long)]
        json: bool,
    },
    /// Prints `path:line:text` for lines matching a regular expression (Rust regex syntax)
    /// in the text files glob would list; exits 1 when nothing matches.
    Grep {
        vm: String,
        pattern: String,
        /// Only files matching this glob.
        #[arg(long)]
        glob: Option<String>,
        /// Directory to search, relative to /workspace.
        #[arg(long)]
        path: Option<String>,
        /// Case-insensitive.
        #[arg(short = 'i', long)]
        ignore_case: bool,
        #[arg(long, default_value_t = 200)]
        limit: u32,
    },
    /// Prints the VM's serial console log.
    Logs { vm: String },
    /// Suspends the VM: `pause` keeps its RAM in the VMM, `hibernate` writes it to disk and
    /// ends the VMM. Refused while jobs run unless --force (they are frozen).
    Suspend {
        vm: String,
        #[arg(long, default_value = "hibernate", value_parser = ["pause", "hibernate"])]
        mode: String,
        #[arg(long)]
        force: bool,
    },
    /// Resumes a paused or hibernated VM; its processes continue where they were.
    Resume {
        vm: String,
        /// After a host update of QEMU, its firmware or the image's kernel (which a VM's
        /// launch is refused on, `integrity`): run the VM on the host's from now on. A
        /// checkpoint taken under another QEMU or firmware cannot be restored: the VM boots
        /// fresh on its disk (files kept; processes and memory lost).
        #[arg(long)]
        accept_new_runtime: bool,
    },
    /// Stops the VM and removes its disk, sockets, cgroup and directory.
    Destroy { vm: String },
    /// Makes COUNT independent copies of a running VM (processes, memory, files), each with
    /// its own identity, secret and disk; prints their ids. The VM pauses briefly and runs on.
    Fork {
        vm: String,
        #[arg(long, default_value_t = 1)]
        count: u32,
        #[arg(long)]
        json: bool,
    },
    /// Lists the templates `vm create --template` restores from.
    Templates {
        #[arg(long)]
        json: bool,
    },
    /// Tops up the warm pool of an image's default shape to SIZE ready VMs (`warren serve`
    /// does this in the background for configured pools), then prints every pool's state.
    Pool {
        /// Image id, prefix or recipe name.
        #[arg(long)]
        image: Option<String>,
        #[arg(long)]
        size: Option<u32>,
    },
}

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// `core`: boot, exec and file costs against raw QEMU and channel baselines; `service`:
    /// the HTTP service against the CLI path; `suspend`: pause, hibernate and resume against
    /// a cold boot; `workspace`: a session's /workspace (virtio-fs) against the guest's disk
    /// (use --image dev; --mib sets the repository size, 64 files per unit); `network`: HTTP
    /// and HTTPS (passed through, intercepted) from a guest through its egress proxy against
    /// the host with and without the proxy (use --image dev; --iterations new connections
    /// per case, --boots downloads of --mib MiB); `load`: --clients clients of --workspaces
    /// workspaces (one VM each) make --requests mixed requests each through HTTP and MCP,
    /// reporting p50/p99 per operation, errors and crossed outputs (exit 1 if any);
    /// `streams`: guest streams, `vm cp` and the file API against a raw virtio-serial port of
    /// the same VM (--boots repetitions of --mib MiB each way, --iterations round trips).
    /// `instant`: create to first exec cold vs from a template vs from the warm pool, 8
    /// concurrent creates, a fork of 4 and resume from fast standby, with the restore's
    /// breakdown (use --boots 20 for p50/p99 over 20).
    /// `image`:
    /// pulling --image's root file system as an OCI image from a loopback registry (--boots
    /// pulls) against building its recipe from scratch (--builds builds) and against the
    /// floor (tar -xzf + mkfs.ext4; use --image dev).
    #[arg(long, default_value = "core", value_parser = ["core", "service", "suspend", "workspace", "network", "load", "streams", "instant", "image"])]
    pub suite: String,
    /// Image to boot.
    #[arg(long, default_value = "minimal")]
    pub image: String,
    /// Boots per boot measurement.
    #[arg(long, default_value_t = 5)]
    pub boots: usize,
    /// Round trips per latency measurement.
    #[arg(long, default_value_t = 300)]
    pub iterations: usize,
    /// MiB moved per throughput measurement.
    #[arg(long, default_value_t = 32)]
    pub mib: usize,
    /// Load suite: concurrent clients (at most 4 per workspace: a VM runs 4 jobs at once).
    #[arg(long, default_value_t = 16)]
    pub clients: usize,
    /// Load suite: workspaces, each with its own token and VM.
    #[arg(long, default_value_t = 4)]
    pub workspaces: usize,
    /// Load suite: requests per client.
    #[arg(long, default_value_t = 1000)]
    pub requests: usize,
    /// Image suite: recipe builds from scratch (each several minutes).
    #[arg(long, default_value_t = 1)]
    pub builds: usize,
    /// Streams suite: the VM's vCPUs (the stream, its raw port and every figure share it).
    #[arg(long, default_value_t = 1)]
    pub vcpus: u32,
    #[command(flatten)]
    pub accel: AccelArg,
    #[arg(long)]
    pub json: bool,
}
