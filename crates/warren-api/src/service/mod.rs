//! The one implementation behind both transports: argument validation, authorization,
//! idempotency and the engine calls. HTTP and MCP only move JSON in and out of [`Service::call`].

mod files;
mod instant;
pub mod job_streams;
mod jobs;
mod run_to_end;
mod sessions;
pub mod streams;
mod tool_defs;

pub use sessions::session_info;
pub use tool_defs::{tool_defs, ToolDef};

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use base64::Engine;
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};
use warren_core::output::{self, Cursor, Encoding, OutputPage};
use warren_core::store::{VmRecord, VmState};
use warren_core::workspace_ops::{parse_version, version_hex};
use warren_core::{CoreError, CreateVm, Limits, Warren, WarrenConfig};
use warren_image::ImageId;
use warren_protocol::limits::MAX_SEARCH_RESULTS;
use warren_protocol::limits::{
    MAX_FILE_CHUNK, MAX_OUTPUT_WAIT_MS, MAX_READ_PER_STREAM, MAX_STDIN_BYTES,
};
use warren_protocol::{
    EditFile, ExecInteractive, ExecStart, GlobRequest, GrepRequest, JobId, JobOutput,
    JobOutputRequest, JobState, Precondition, WindowSize, WriteMode,
};
use warren_vmm::accel::AccelChoice;

use crate::auth::{Credentials, Principal};
use crate::caps::{is_long_poll, CallerCaps};
use crate::config::ServiceConfig;
use crate::error::ApiError;
use crate::receipts::{args_hash, validate_request_id, Claim, Receipts};
use crate::tools::*;

/// Paths `vm_glob` returns unless told otherwise.
const DEFAULT_GLOB_LIMIT: u32 = 500;
/// Lines `vm_grep` returns unless told otherwise.
const DEFAULT_GREP_LIMIT: u32 = 200;

fn search_limit(limit: Option<u32>, default: u32) -> Result<u32, ApiError> {
    let limit = limit.unwrap_or(default);
    if limit == 0 || limit > MAX_SEARCH_RESULTS {
        return Err(ApiError::invalid(format!(
            "limit must be within 1..={MAX_SEARCH_RESULTS}"
        )));
    }
    Ok(limit)
}

pub struct Service {
    warren: Warren,
    creds: Credentials,
    receipts: Receipts,
    cfg: ServiceConfig,
    tools: Vec<ToolDef>,
    /// Idempotency keys being acted on by this process right now.
    in_flight: Mutex<HashSet<String>>,
    /// Per-credential caps on requests and long-polls in flight.
    caps: CallerCaps,
    /// Open guest streams (`crate::streams`).
    streams: crate::streams::Streams,
    /// Job broker pipes (`crate::broker`), in memory only.
    pipes: crate::broker::Pipes,
    /// Calls running to their end ([`Service::call_to_end`]), for the stop to wait for.
    detached: tokio::sync::watch::Sender<usize>,
}

/// Removes an in-flight key when the request ends, however it ends.
struct InFlight<'a> {
    set: &'a Mutex<HashSet<String>>,
    key: String,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.set
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.key);
    }
}

pub(crate) fn parse<T: DeserializeOwned>(args: Value) -> Result<T, ApiError> {
    let args = match args {
        Value::Null => Value::Object(Map::new()),
        Value::Object(m) => Value::Object(m),
        other => {
            return Err(ApiError::invalid(format!(
                "arguments must be a JSON object, not {}",
                kind(&other)
            )))
        }
    };
    serde_json::from_value(args).map_err(|e| ApiError::invalid(e.to_string()))
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// A new VM's memory (the request, else the image's default) after checking it and `vcpus`
/// against the engine's ranges and the image's minimum.
fn checked_size(
    name: &str,
    img: &crate::config::ImageConfig,
    memory_mib: Option<u32>,
    vcpus: Option<u32>,
) -> Result<u32, ApiError> {
    let memory = memory_mib
        .or(img.memory_mib)
        .or(img.min_memory_mib)
        .unwrap_or(warren_core::vm::DEFAULT_MEMORY_MIB);
    if !warren_core::vm::MEMORY_MIB_RANGE.contains(&memory) {
        return Err(ApiError::invalid(format!(
            "memory_mib must be within {:?}",
            warren_core::vm::MEMORY_MIB_RANGE
        )));
    }
    if let Some(min) = img.min_memory_mib {
        if memory < min {
            return Err(ApiError::invalid(format!(
                "image {name} needs at least {min} MiB of memory"
            )));
        }
    }
    if let Some(v) = vcpus {
        if !warren_core::vm::VCPUS_RANGE.contains(&v) {
            return Err(ApiError::invalid(format!(
                "vcpus must be within {:?}",
                warren_core::vm::VCPUS_RANGE
            )));
        }
    }
    Ok(memory)
}

/// The workspace's own admission limits (its token policy).
fn workspace_limits(p: &Principal) -> Limits {
    crate::admission::policy_limits(&p.policy)
}

/// Whether the principal's grant lets it boot the configured image `name`.
pub(crate) fn image_allowed(p: &Principal, name: &str) -> bool {
    p.policy
        .images
        .as_ref()
        .is_none_or(|allowed| allowed.iter().any(|a| a == name))
}

fn to_value<T: Serialize>(v: T) -> Result<Value, ApiError> {
    serde_json::to_value(v).map_err(|e| ApiError::internal(format!("encoding a result: {e}")))
}

pub(crate) fn parse_job(id: &str) -> Result<JobId, ApiError> {
    id.parse::<u64>()
        .map(JobId)
        .map_err(|_| ApiError::invalid(format!("job_id {id:?} is not a job id")))
}

/// A `JobOutput` read at `at`, waiting at most `wait` (capped at the protocol's maximum).
pub(crate) fn output_request(
    job: JobId,
    at: Cursor,
    max_bytes: u32,
    wait: Duration,
) -> JobOutputRequest {
    JobOutputRequest {
        job,
        stdout_cursor: at.stdout,
        stderr_cursor: at.stderr,
        max_bytes,
        wait_ms: wait.as_millis().min(u128::from(MAX_OUTPUT_WAIT_MS)) as u32,
    }
}

/// A receipt's stored outcome: `{"ok": value}` or `{"error": {"code", "message"}}`.
fn replay(stored: Value) -> Result<Value, ApiError> {
    if let Some(v) = stored.get("ok") {
        return Ok(v.clone());
    }
    let code = stored
        .pointer("/error/code")
        .and_then(Value::as_str)
        .and_then(|c| crate::error::CODES.iter().copied().find(|x| *x == c))
        .unwrap_or("internal");
    let message = stored
        .pointer("/error/message")
        .and_then(Value::as_str)
        .unwrap_or("the original request failed");
    Err(ApiError::new(code, message))
}

impl Service {
    /// Opens the engine and the credential and receipt tables of `cfg.state_dir`.
    pub fn open(cfg: ServiceConfig, supervisor_exe: PathBuf) -> Result<Service, ApiError> {
        let mut wc = WarrenConfig::new(cfg.state_dir.clone(), supervisor_exe);
        wc.image_dir = cfg.image_dir();
        wc.accel = cfg
            .accel
            .parse::<AccelChoice>()
            .map_err(|e| ApiError::invalid(e.to_string()))?;
        wc.boot_timeout = Duration::from_secs(cfg.boot_timeout_secs);
        if cfg.max_templates == 0 {
            return Err(ApiError::invalid(
                "max_templates must be at least 1 (turn templates off per image instead)",
            ));
        }
        wc.max_templates = cfg.max_templates;
        let mut warren = Warren::open(wc)?;
        let db = cfg.state_dir.join("warren.db");
        let creds = Credentials::open(&db)?;
        // Resumes and wakes pass the same memory limits as creates.
        warren.set_admission(crate::admission::resume_limits(
            cfg.host_limits(),
            Credentials::open(&db)?,
        ));
        let receipts = Receipts::open(&db)?;
        let names: Vec<String> = cfg.images.keys().cloned().collect();
        Ok(Service {
            warren,
            creds,
            receipts,
            tools: tool_defs(&names),
            caps: CallerCaps::new(
                cfg.http.max_requests_per_token,
                cfg.http.max_long_polls_per_token,
            ),
            streams: crate::streams::Streams::new(cfg.streams.clone()),
            pipes: crate::broker::Pipes::default(),
            cfg,
            in_flight: Mutex::new(HashSet::new()),
            detached: tokio::sync::watch::Sender::new(0),
        })
    }

    pub fn tools(&self) -> &[ToolDef] {
        &self.tools
    }

    /// The tools as `p` is shown them: `image` enums name only the images its grant allows.
    pub fn tools_for(&self, p: &Principal) -> Vec<ToolDef> {
        if p.policy.images.is_none() {
            return self.tools.clone();
        }
        let names: Vec<String> = self
            .cfg
            .images
            .keys()
            .filter(|n| image_allowed(p, n))
            .cloned()
            .collect();
        tool_defs(&names)
    }

    pub fn credentials(&self) -> &Credentials {
        &self.creds
    }

    pub fn config(&self) -> &ServiceConfig {
        &self.cfg
    }

    /// The per-credential caps (`crate::caps`).
    pub fn caps(&self) -> &CallerCaps {
        &self.caps
    }

    pub fn engine(&self) -> &Warren {
        &self.warren
    }

    /// Removes what creates and destroys that died half-way left in `vms/`
    /// (`Warren::sweep_vm_dirs`), forever: at once, then every `every` (what a crash just
    /// before a quick restart left is too young for the first sweep). Run in the background
    /// once the service serves, so a large leftover never delays its start.
    pub async fn sweep_leftovers(&self, every: Duration) {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let swept = self.warren.sweep_vm_dirs().await;
            if !swept.is_empty() {
                tracing::info!(
                    removed = swept.len(),
                    "VM directories no record names removed"
                );
            }
        }
    }

    /// Suspends idle VMs forever, checking every `every`. Each VM's suspension is a task of
    /// its own, so VMs are suspended concurrently and a guest that does not answer holds up
    /// only itself (until its calls' deadlines fail them); a VM whose suspension is still
    /// under way is not started on again.
    pub async fn idle_loop(self: Arc<Self>, every: Duration) {
        // The VMs being suspended now, by task; only this loop adds and removes them.
        let mut busy: HashMap<tokio::task::Id, String> = HashMap::new();
        let mut tasks = tokio::task::JoinSet::new();
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            tokio::select! {
                _ = tick.tick() => {
                    for (vm, mode, seen) in self.warren.idle_vms() {
                        if busy.values().any(|b| *b == vm) {
                            continue;
                        }
                        if self.streams.count(&vm) > 0 {
                            // An open stream is activity: the idle clock starts again.
                            self.warren.note_activity(&vm);
                            continue;
                        }
                        let service = self.clone();
                        let id = vm.clone();
                        let task = tasks.spawn(async move {
                            service.warren.suspend_idle_vm(&id, mode, seen).await
                        });
                        busy.insert(task.id(), vm);
                    }
                }
                Some(done) = tasks.join_next_with_id() => {
                    let (task, r) = match done {
                        Ok((task, r)) => (task, r),
                        Err(e) => {
                            busy.remove(&e.id());
                            tracing::error!(error = %e, "idle suspension task failed");
                            continue;
                        }
                    };
                    let vm = busy.remove(&task).unwrap_or_default();
                    match r {
                        None => {}
                        Some(Ok(state)) => {
                            tracing::info!(%vm, state = state.as_str(), "idle VM suspended")
                        }
                        Some(Err(e)) => {
                            tracing::warn!(%vm, error = %crate::error::format_chain(&e), "idle suspend failed")
                        }
                    }
                }
            }
        }
    }

    /// Checks the host before serving: every image verified, the accelerator usable, and
    /// free disk for the storage reservation. Returns warnings; an error says what to fix.
    pub async fn preflight(&self) -> Result<Vec<String>, String> {
        let mut warnings = Vec::new();
        let mut default = None;
        for (name, img) in &self.cfg.images {
            let id = ImageId::parse(&img.id).map_err(|e| format!("images.{name}: {e}"))?;
            let v = self
                .warren
                .images()
                .verify(&id)
                .map_err(|e| format!("images.{name} ({}): {e}", id.short()))?;
            if name == self.cfg.default_image() {
                default = Some(v);
            }
        }
        let image = default.ok_or("no default image")?;
        let (adopted, failed) = self
            .warren
            .adopt_supervisors()
            .await
            .map_err(|e| format!("re-adopting VMs: {}", crate::error::format_chain(&e)))?;
        tracing::info!(
            adopted = adopted.len(),
            failed = failed.len(),
            "VMs re-adopted"
        );
        for id in failed {
            warnings.push(format!("VM {id} was not re-adopted and is marked failed"));
        }
        let (accel, warning) = self
            .warren
            .resolve_accel(&image)
            .await
            .map_err(|e| format!("accelerator: {}", crate::error::format_chain(&e)))?;
        warnings.extend(warning);
        tracing::info!(%accel, "accelerator usable");
        if let Some(gib) = self.cfg.limits.max_storage_gib {
            let st = nix::sys::statvfs::statvfs(&self.cfg.state_dir)
                .map_err(|e| format!("statvfs {}: {e}", self.cfg.state_dir.display()))?;
            let free = st.blocks_available() as u64 * st.fragment_size() as u64;
            let reserved: u64 = self
                .warren
                .list_vms()
                .map_err(|e| e.to_string())?
                .iter()
                .map(|v| v.disk_mib << 20)
                .sum::<u64>()
                + self
                    .warren
                    .list_sessions(None)
                    .map_err(|e| e.to_string())?
                    .iter()
                    .map(|s| s.storage_mib << 20)
                    .sum::<u64>();
            let want = (gib << 30).saturating_sub(reserved);
            if free < want {
                return Err(format!(
                    "{} has {} MiB free, but limits.max_storage_gib = {gib} needs {} MiB more for VM disks and session storage; free space or lower the limit",
                    self.cfg.state_dir.display(),
                    free >> 20,
                    want >> 20
                ));
            }
            // Under a storage limit every session copy needs a filesystem of its own.
            for (what, r) in warren_session::volume::host_support() {
                if let Err(e) = r {
                    warnings.push(format!(
                        "session storage: {what}: {e}; session_create (copies) will fail with unavailable"
                    ));
                }
            }
        }
        Ok(warnings)
    }

    /// Runs one tool for `p` in place (cancelled with the returned future).
    pub async fn call(&self, p: &Principal, tool: &str, args: Value) -> Result<Value, ApiError> {
        let t = Instant::now();
        let r = match is_long_poll(tool, &args).then(|| self.caps.long_poll(p)) {
            Some(Err(e)) => Err(e),
            slot => {
                let _slot = slot;
                // Every wake of the VM inside the work checks the caller's generation too.
                let expected = args.get("expected_generation").and_then(Value::as_u64);
                warren_core::vm::expecting_generation(expected, self.dispatch(p, tool, args)).await
            }
        };
        let ms = t.elapsed().as_millis() as u64;
        match &r {
            Ok(_) => tracing::info!(workspace = %p.workspace, tool, ms, "ok"),
            Err(e) => tracing::info!(workspace = %p.workspace, tool, ms, code = e.code, "refused"),
        }
        r
    }

    async fn dispatch(&self, p: &Principal, tool: &str, args: Value) -> Result<Value, ApiError> {
        match tool {
            "vm_create" => self.vm_create(p, parse(args)?).await,
            "vm_list" => {
                let _: NoArgs = parse(args)?;
                self.vm_list(p)
            }
            "vm_status" => self.vm_status(p, parse(args)?).await,
            "vm_exec" => self.vm_exec(p, parse(args)?).await,
            "vm_job_status" => self.vm_job_status(p, parse(args)?).await,
            "vm_job_output" => self.vm_job_output(p, parse(args)?).await,
            "vm_job_cancel" => self.vm_job_cancel(p, parse(args)?).await,
            "vm_read_file" => self.vm_read_file(p, parse(args)?).await,
            "vm_write_file" => self.vm_write_file(p, parse(args)?).await,
            "vm_edit_file" => self.vm_edit_file(p, parse(args)?).await,
            "vm_glob" => self.vm_glob(p, parse(args)?).await,
            "vm_grep" => self.vm_grep(p, parse(args)?).await,
            "vm_destroy" => self.vm_destroy(p, parse(args)?).await,
            "vm_suspend" => self.vm_suspend(p, parse(args)?).await,
            "vm_fork" => self.vm_fork(p, parse(args)?).await,
            "pool_status" => {
                parse::<NoArgs>(args)?;
                self.pool_status(p)
            }
            "session_create" => self.session_create(p, parse(args)?).await,
            "session_list" | "session_status" | "session_export" | "session_delete" => {
                self.session_tool(p, tool, args).await
            }
            "vm_resume" => {
                let a: VmRef = parse(args)?;
                let rec = self.owned(p, &a.vm_id, a.expected_generation)?;
                let rec = self.warren.resume_vm(&rec.id).await?;
                to_value(self.info(rec))
            }
            _ => Err(ApiError::new(
                "unknown_tool",
                format!(
                    "no tool {:?}; tools: {}",
                    tool.chars().take(64).collect::<String>(),
                    self.tools
                        .iter()
                        .map(|t| t.name)
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            )),
        }
    }

    fn image_name(&self, image_id: &str) -> Option<String> {
        self.cfg
            .images
            .iter()
            .find(|(_, i)| i.id == image_id)
            .map(|(n, _)| n.clone())
    }

    fn info(&self, r: VmRecord) -> VmInfo {
        let network = match self.warren.vm_network(&r.id) {
            Some(n) => n.mode.as_str().to_string(),
            None => "off".to_string(),
        };
        VmInfo {
            network,
            image: self.image_name(&r.image_id),
            vm_id: r.id,
            state: r.state.as_str().to_string(),
            image_id: r.image_id,
            accel: r.accel,
            memory_mib: r.memory_mib,
            vcpus: r.vcpus,
            generation: r.generation,
            created_unix: r.created_unix,
            boot_ms: r.boot_ms,
            reason: r.reason,
            idle_seconds: r.idle_seconds,
            idle_mode: r.idle_mode,
            last_active_unix: r.last_active_unix,
        }
    }

    /// [`Service::owned`] for a call that does work in the guest, which wakes a suspended VM.
    /// With `expected_generation`, a suspended VM is woken here first and the generation
    /// checked again: a wake whose restore fails boots fresh memory (a new generation), and a
    /// caller holding the old one must not run on it.
    pub(super) async fn owned_for_work(
        &self,
        p: &Principal,
        vm_id: &str,
        expected_generation: Option<u64>,
    ) -> Result<VmRecord, ApiError> {
        let rec = self.owned(p, vm_id, expected_generation)?;
        if expected_generation.is_none()
            || !matches!(rec.state, VmState::Paused | VmState::Hibernated)
        {
            return Ok(rec);
        }
        // As the work itself would wake it: counted as activity first, then resumed.
        self.warren.awake_client(&rec.id).await?;
        self.owned(p, vm_id, expected_generation)
    }

    /// The caller's VM: another workspace's VM is indistinguishable from a missing one.
    fn owned(
        &self,
        p: &Principal,
        vm_id: &str,
        expected_generation: Option<u64>,
    ) -> Result<VmRecord, ApiError> {
        let shape_ok = !vm_id.is_empty()
            && vm_id.len() <= 64
            && vm_id
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
        if !shape_ok {
            return Err(ApiError::invalid(format!(
                "vm_id {:?} is not a VM id",
                vm_id.chars().take(64).collect::<String>()
            )));
        }
        match self.warren.get_vm(vm_id) {
            Ok(r) if r.workspace == p.workspace => {
                warren_core::vm::check_generation(
                    &format!("VM {vm_id}"),
                    r.generation,
                    expected_generation,
                )?;
                Ok(r)
            }
            Ok(_) | Err(CoreError::VmNotFound(_)) => Err(ApiError::no_vm(vm_id)),
            Err(e) => Err(e.into()),
        }
    }

    /// Marks an idempotency key as being acted on; a concurrent duplicate gets `busy`.
    fn enter(&self, p: &Principal, tool: &str, request_id: &str) -> Result<InFlight<'_>, ApiError> {
        let key = format!("{}\0{tool}\0{request_id}", p.workspace);
        let mut set = self.in_flight.lock().unwrap_or_else(|e| e.into_inner());
        if !set.insert(key.clone()) {
            return Err(ApiError::new(
                "busy",
                format!("request {request_id} is still being processed; retry later"),
            ));
        }
        Ok(InFlight {
            set: &self.in_flight,
            key,
        })
    }

    async fn vm_create(&self, p: &Principal, a: VmCreateArgs) -> Result<Value, ApiError> {
        validate_request_id(&a.request_id)?;
        let (name, img) = self.configured_image(p, a.image.as_deref())?;
        let network = self.network_for(p, a.network, a.egress.clone())?;
        let memory = checked_size(&name, &img, a.memory_mib, a.vcpus)?;
        if a.idle_seconds.is_some_and(|s| s > 604_800) {
            return Err(ApiError::invalid(
                "idle_seconds must be at most 604800 (a week)",
            ));
        }
        let hash = args_hash(&a);
        let rid = a.request_id.as_str();
        let _guard = self.enter(p, "vm_create", rid)?;
        match self.receipts.claim(&p.workspace, "vm_create", rid, &hash)? {
            Claim::Done(v) => return replay(v),
            Claim::Pending => {
                // An earlier attempt was cut off; its VM row says how far it got.
                if let Some(rec) = self.warren.vm_by_request(&p.workspace, rid)? {
                    return self.settle_create(p, rid, rec);
                }
            }
            Claim::New => {}
        }
        let req = CreateVm {
            image: Some(img.id.clone()),
            memory_mib: Some(memory),
            vcpus: a.vcpus,
            workspace: p.workspace.clone(),
            request_id: Some(rid.to_string()),
            host_limits: self.cfg.host_limits(),
            workspace_limits: workspace_limits(p),
            idle_seconds: a.idle_seconds,
            idle_mode: a.idle_mode.map(|m| match m {
                SuspendModeArg::Pause => warren_core::SuspendMode::Pause,
                SuspendModeArg::Hibernate => warren_core::SuspendMode::Hibernate,
            }),
            mounts: vec![],
            ram_file: a.ram_file,
            network,
            generation: None,
            raw_bench_port: false,
            template: img.template || img.pool > 0,
        };
        let r = self
            .warren
            .create_vm(&req, &mut |w| tracing::warn!("{w}"))
            .await;
        match r {
            Ok(rec) => self.settle_create(p, rid, rec),
            Err(e) => {
                let e = ApiError::from(e);
                if self.warren.vm_by_request(&p.workspace, rid)?.is_some() {
                    // A VM was admitted and failed: that is this request's outcome.
                    self.receipts.complete(
                        &p.workspace,
                        "vm_create",
                        rid,
                        &serde_json::json!({ "error": { "code": e.code, "message": e.message } }),
                    )?;
                } else {
                    self.receipts.release(&p.workspace, "vm_create", rid)?;
                }
                Err(e)
            }
        }
    }

    /// The network a `vm_create` or `session_create` asks for, checked against the
    /// workspace's grants (the same rules for both).
    fn network_for(
        &self,
        p: &Principal,
        network: Option<Network>,
        egress: Option<EgressArgs>,
    ) -> Result<Option<warren_core::NetworkRequest>, ApiError> {
        let mode = network.and_then(Network::mode);
        match mode {
            Some(warren_vmm::NetMode::Internet) if !p.policy.allow_internet => {
                return Err(ApiError::forbidden(format!(
                    "workspace {} has no internet grant (the operator grants it: \
                     `warren token allow-internet --workspace {}`)",
                    p.workspace, p.workspace
                )));
            }
            Some(_) if !p.policy.allow_network => {
                return Err(ApiError::forbidden(format!(
                    "workspace {} has no network grant",
                    p.workspace
                )));
            }
            _ => {}
        }
        if egress.is_some() && mode.is_none() {
            return Err(ApiError::invalid(
                "egress needs network \"allowlist\" (or \"on\") or \"internet\"",
            ));
        }
        match mode {
            Some(mode) => Ok(Some(crate::egress::network_request(
                &self.cfg, p, mode, egress,
            )?)),
            None => Ok(None),
        }
    }

    /// A configured image the principal may use (the default when `None`).
    fn configured_image(
        &self,
        p: &Principal,
        name: Option<&str>,
    ) -> Result<(String, crate::config::ImageConfig), ApiError> {
        let name = name.unwrap_or_else(|| self.cfg.default_image()).to_string();
        let Some(img) = self
            .cfg
            .images
            .get(&name)
            .filter(|_| image_allowed(p, &name))
        else {
            // Only the images this workspace may use are named: the others are the
            // operator's business, not the caller's. An image configured for other
            // workspaces gets the answer an unknown one gets (before, `forbidden` told a
            // caller which names other workspaces' images have: a hostile review).
            let usable = self
                .cfg
                .images
                .keys()
                .filter(|n| image_allowed(p, n))
                .cloned()
                .collect::<Vec<_>>();
            return Err(ApiError::invalid(format!(
                "image {name:?} is not configured; configured for workspace {}: {}",
                p.workspace,
                if usable.is_empty() {
                    "none".to_string()
                } else {
                    usable.join(", ")
                }
            )));
        };
        Ok((name, img.clone()))
    }

    fn settle_create(&self, p: &Principal, rid: &str, rec: VmRecord) -> Result<Value, ApiError> {
        let stored = match rec.state {
            VmState::Running
            | VmState::Paused
            | VmState::Hibernating
            | VmState::Hibernated
            | VmState::Resuming => serde_json::json!({ "ok": to_value(self.info(rec))? }),
            VmState::Failed => serde_json::json!({ "error": {
                "code": "unavailable",
                "message": format!("the VM failed to boot: {}", rec.reason.unwrap_or_default()),
            }}),
            VmState::Creating => {
                return Err(ApiError::new(
                    "outcome_unknown",
                    format!(
                        "VM {} of request {rid} was left half-created; destroy it and use a new request_id",
                        rec.id
                    ),
                ))
            }
        };
        self.receipts
            .complete(&p.workspace, "vm_create", rid, &stored)?;
        replay(stored)
    }

    fn vm_list(&self, p: &Principal) -> Result<Value, ApiError> {
        let vms = self
            .warren
            .list_vms()?
            .into_iter()
            .filter(|r| r.workspace == p.workspace)
            .map(|r| self.info(r))
            .collect();
        to_value(VmList { vms })
    }

    async fn vm_status(&self, p: &Principal, a: VmRef) -> Result<Value, ApiError> {
        let rec = self.owned(p, &a.vm_id, a.expected_generation)?;
        let rec_id = rec.id.clone();
        let running = rec.state == VmState::Running;
        let mut seen_unix = None;
        let (jobs, job_ids, background_jobs) = if running {
            let list = self.warren.job_list(&rec.id).await?;
            let (counts, background) = JobCounts::of(&list);
            (
                Some(counts),
                list.iter().map(|j| j.id.to_string()).collect(),
                background,
            )
        } else if let Some(seen) = matches!(
            rec.state,
            VmState::Paused | VmState::Hibernating | VmState::Hibernated | VmState::Resuming
        )
        .then(|| self.warren.jobs_seen(&rec.id))
        .flatten()
        {
            // Never the guest: a status call does not wake a suspended VM.
            seen_unix = Some(seen.seen_unix);
            (
                Some(JobCounts::of_seen(&seen.jobs)),
                seen.jobs.iter().map(|j| j.job_id.clone()).collect(),
                vec![],
            )
        } else {
            (None, vec![], vec![])
        };
        to_value(VmStatus {
            vm: self.info(rec),
            jobs,
            job_ids,
            jobs_stale: seen_unix.is_some(),
            jobs_seen_unix: seen_unix,
            background_jobs,
            open_streams: self.streams.count(&rec_id),
        })
    }

    async fn vm_suspend(&self, p: &Principal, a: VmSuspendArgs) -> Result<Value, ApiError> {
        let rec = self.owned(p, &a.vm_id, a.expected_generation)?;
        let mode = match a.mode.unwrap_or(SuspendModeArg::Hibernate) {
            SuspendModeArg::Pause => warren_core::SuspendMode::Pause,
            SuspendModeArg::Hibernate => warren_core::SuspendMode::Hibernate,
        };
        let open = self.streams.count(&rec.id);
        if open > 0 && !a.force {
            return Err(ApiError::new(
                "busy",
                format!("{open} stream(s) are open to the VM; close them or pass force"),
            ));
        }
        self.streams
            .close_vm(&rec.id, crate::streams::CloseReason::Suspended);
        let rec = self.warren.suspend_vm(&rec.id, mode, a.force).await?;
        to_value(self.info(rec))
    }

    /// What the service keeps for VM `vm` goes before it is destroyed: its streams close
    /// (1001) and its broker pipes' entries are dropped.
    pub(super) fn forget_vm(&self, vm: &str) {
        self.streams
            .close_vm(vm, crate::streams::CloseReason::Destroyed);
        self.pipes.remove_vm(vm);
    }

    async fn vm_destroy(&self, p: &Principal, a: VmRef) -> Result<Value, ApiError> {
        let rec = self.owned(p, &a.vm_id, a.expected_generation)?;
        self.forget_vm(&rec.id);
        self.warren.destroy_vm(&rec.id).await?;
        to_value(VmDestroyed {
            vm_id: rec.id,
            destroyed: true,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_parse_refuses_unknown_fields_and_wrong_types() {
        let e = parse::<VmRef>(serde_json::json!({"vm_id": "a", "x": 1})).expect_err("unknown");
        assert!(e.message.contains("unknown field"), "{e}");
        let e = parse::<VmRef>(serde_json::json!({"vm_id": 5})).expect_err("type");
        assert_eq!(e.code, "invalid_argument");
        let e = parse::<VmRef>(serde_json::json!([1])).expect_err("array");
        assert!(e.message.contains("JSON object"), "{e}");
        assert!(parse::<NoArgs>(Value::Null).is_ok());
    }

    #[test]
    fn test_replay_error_keeps_code() {
        let e = replay(serde_json::json!({"error": {"code": "unavailable", "message": "m"}}))
            .expect_err("error");
        assert_eq!((e.code, e.message.as_str()), ("unavailable", "m"));
    }
}
