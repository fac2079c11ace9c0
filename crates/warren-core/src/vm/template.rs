//! Templates: a VM booted once per shape and saved, so later creates of that shape restore
//! it instead of booting.
//!
//! **Shape** ([`TemplateKey`]): image, memory, vCPUs, accelerator, CPU model and device set
//! (the shares' guest paths and modes, NIC or not). Templates serve every VM but `--ram-file`
//! ones: plain `vm create`/`vm_create` and the session VMs of `warren run` and
//! `session_create` (their shares are part of the shape; which host directories they show
//! is each clone's own). A share needs guest RAM the device backend can map, while a plain
//! clone's RAM is a private mapping of the template's file: a clone with shares gets a
//! shared memfd of its own holding the template's RAM instead (`warren_vmm::sys::clone_ram`).
//! See `docs/instant.md`.
//!
//! **Build** (once per shape, under a lock file so concurrent creates build it once): a
//! normal cold create with guest RAM in a file (counted against the host limits while it
//! runs), then a fast-standby hibernation (vCPUs stopped, device state saved, the RAM file
//! flushed). Its RAM file, device state, disk overlay (the frozen disk layer, over the
//! image) and secret move to a new directory `STATE/templates/t-<key digest>-<random>/` with
//! `template.json` (the key and the QEMU, firmware and kernel the template was made on), and
//! the build VM is destroyed. The pointer `STATE/templates/<key digest>.current` (the
//! directory's name) is then replaced by one rename, so a create sees a complete template or
//! none. A template directory never changes or moves: clones' disks name its layer as their
//! backing file.
//!
//! **Files and access.** Root's, group `Warren::template_gid` (the first id of the state
//! directory's uid block, given to its own VMMs only): the directory 0750, the RAM file and
//! the disk layer 0440 (a clone's VMM, in that group, maps the one and reads the other as
//! its backing file), the device state, the secret and the record 0400 (root copies the
//! state into the clone's own directory). Nothing else can read them.
//!
//! **Clone** (`create_vm` with `template`): the clone's disk is a qcow2 overlay of its own over
//! the template's layer; its RAM a private copy-on-write mapping of the template's RAM file;
//! its device state a copy of the template's. The supervisor restores it, authenticates with
//! the template's secret and at once moves the guest to a secret of its own with fresh
//! entropy, the clock, hostname and machine id (`warren-supervisor::rekey`, protocol
//! `Rekey`), then thaws it. Afterwards the clone's per-VM initramfs is written with its
//! new secret and its supervisor config is rewritten for later launches (a resume restores
//! into anonymous RAM, a fresh boot boots its own disk).
//!
//! **Invalidation.** A template is used only while the image (its id is the manifest
//! digest, which covers the root filesystem, kernel and initramfs), the QEMU binary, the
//! firmware and the kernel are byte-for-byte the ones it was made on: any difference retires
//! it (its pointer is removed; the directory is deleted once no VM's disk backs onto it,
//! which each VM's `template` marker records) and the next create builds a new one.

use std::os::unix::fs::{chown, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use rand::RngCore;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use warren_image::VerifiedImage;
use warren_supervisor::{SupervisorConfig, VmDir};
use warren_vmm::backend::MemMib;
use warren_vmm::{Accel, LaunchSpec};

use super::artifacts::RuntimeArtifacts;
use super::{write_private, CreateVm, SuspendMode, Warren};
use crate::error::CoreError;
use crate::store::{MountSpec, VmRecord};

/// The workspace template builds run in (their VMs exist only while the template is made).
pub const TEMPLATE_WORKSPACE: &str = "warren-templates";
/// File in a clone's VM directory naming the template its disk backs onto.
pub(super) const TEMPLATE_MARKER: &str = "template";
pub(super) const RECORD: &str = "template.json";
/// A build's staging directory or stand-in shares older than this were left by a crash.
pub(super) const STALE_BUILD: Duration = Duration::from_secs(3600);
/// Largest `template.json` accepted.
const MAX_RECORD_BYTES: u64 = 16 * 1024;

/// The shape a template serves.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TemplateKey {
    pub image_id: String,
    pub memory_mib: u32,
    pub vcpus: u32,
    pub accel: String,
    pub cpu: String,
    /// The shares in the order they are attached (tags `fs0`, `fs1`, ...).
    pub shares: Vec<TemplateShare>,
    pub network: bool,
}

/// One share of a template's shape: where the guest mounts it and how. The host directory
/// is not part of the shape: each clone's virtiofsd serves its own.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TemplateShare {
    pub guest: String,
    pub read_only: bool,
}

impl TemplateKey {
    /// The directory name: a digest of the whole key.
    pub fn digest(&self) -> String {
        let json = serde_json::to_vec(self).expect("invariant: key serialises");
        hex::encode(&Sha256::digest(&json)[..16])
    }
}

/// A key whose CPU model is not the one new VMs of its accelerator get now (Warren changed
/// its default, e.g. TCG `max` to [`warren_vmm::qemu::TCG_CPU`]): creates only ask for keys
/// with the current model, so such a template is never used again.
pub(super) fn superseded_model(key: &TemplateKey) -> bool {
    // The key names its accelerator as `Accel` displays it (see `template_key`).
    [warren_vmm::Accel::Tcg, warren_vmm::Accel::Kvm]
        .into_iter()
        .find(|a| a.to_string() == key.accel)
        .is_some_and(|a| key.cpu != warren_vmm::qemu::default_cpu(a))
}

/// `template.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TemplateRecord {
    pub key: TemplateKey,
    pub artifacts: RuntimeArtifacts,
    pub created_unix: u64,
    /// Milliseconds the build's cold boot took.
    pub boot_ms: u64,
}

/// A usable template, pinned: while it (or a clone of it) lives, a collection leaves its
/// files alone (`template_gc`).
#[derive(Debug, Clone)]
pub struct Template {
    pub dir: PathBuf,
    pub record: TemplateRecord,
    /// The template directory held open with a shared `flock`.
    _pin: std::sync::Arc<std::fs::File>,
}

impl Template {
    /// Pins the template in `dir` and reads its record; `None` when it is gone or being
    /// deleted (a collection holds the directory's exclusive lock while it deletes it).
    pub(super) fn pin(dir: PathBuf) -> Result<Option<Template>, CoreError> {
        let file = match std::fs::File::open(&dir) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(CoreError::io("open", &dir, e)),
        };
        match file.try_lock_shared() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => return Ok(None),
            Err(std::fs::TryLockError::Error(e)) => return Err(CoreError::io("lock", &dir, e)),
        }
        // Deleted between the open and the lock: its record is gone with it.
        if !dir.join(RECORD).exists() {
            return Ok(None);
        }
        Ok(Some(Template {
            record: read_record(&dir)?,
            dir,
            _pin: std::sync::Arc::new(file),
        }))
    }
}

/// What `warren template list` shows.
#[derive(Debug, Clone, Serialize)]
pub struct TemplateInfo {
    pub name: String,
    pub key: TemplateKey,
    pub created_unix: u64,
    pub valid: bool,
}

fn io<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> CoreError + 'a {
    move |e| CoreError::io(op, path, e)
}

/// The lock a build of the key `digest` holds, under the templates directory `root`, from
/// before its build VM's record is inserted until that VM is destroyed.
pub(super) fn build_lock(root: &Path, digest: &str) -> PathBuf {
    root.join(format!("{digest}.lock"))
}

/// The request id of a build VM of `key`: `build-<key digest>-<random>`, read back by
/// [`build_key_digest`].
fn build_request_id(key: &TemplateKey) -> String {
    format!(
        "build-{}-{}",
        key.digest(),
        hex::encode(rand::random::<[u8; 4]>())
    )
}

/// The key digest a build VM's request id names (see [`build_request_id`]).
pub(super) fn build_key_digest(request_id: &str) -> Option<&str> {
    let digest = request_id.strip_prefix("build-")?.split('-').next()?;
    (digest.len() == 32 && digest.bytes().all(|b| b.is_ascii_hexdigit())).then_some(digest)
}

pub(super) fn read_record(dir: &Path) -> Result<TemplateRecord, CoreError> {
    use std::io::Read;
    let path = dir.join(RECORD);
    let mut bytes = Vec::new();
    std::fs::File::open(&path)
        .map_err(io("open", &path))?
        .take(MAX_RECORD_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(io("read", &path))?;
    if bytes.len() as u64 > MAX_RECORD_BYTES {
        return Err(CoreError::InvalidArgument(format!(
            "{} is too large",
            path.display()
        )));
    }
    serde_json::from_slice(&bytes)
        .map_err(|e| CoreError::InvalidArgument(format!("{}: {e}", path.display())))
}

impl Warren {
    pub(super) fn templates_dir(&self) -> PathBuf {
        self.cfg.state_dir.join("templates")
    }

    /// The key of the template that could serve `req` on `image` under `accel`; `None` for
    /// shapes templates do not serve (a RAM file).
    pub(super) fn template_key(
        &self,
        req: &CreateVm,
        image: &VerifiedImage,
        accel: Accel,
    ) -> Option<TemplateKey> {
        if req.ram_file {
            return None;
        }
        Some(TemplateKey {
            image_id: image.id.to_string(),
            memory_mib: req.memory_mib.unwrap_or(super::DEFAULT_MEMORY_MIB),
            vcpus: req.vcpus.unwrap_or(super::DEFAULT_VCPUS),
            accel: accel.to_string(),
            cpu: warren_vmm::qemu::default_cpu(accel).to_string(),
            shares: req
                .mounts
                .iter()
                .map(|m| TemplateShare {
                    guest: m.guest.clone(),
                    read_only: m.read_only,
                })
                .collect(),
            network: req.network.is_some(),
        })
    }

    /// The pointer to the current template of `key`: a file holding its directory's name.
    pub(super) fn current_path(&self, key: &TemplateKey) -> PathBuf {
        self.templates_dir()
            .join(format!("{}.current", key.digest()))
    }

    /// The valid template for `key`, if there is one. One made on other artifacts is retired.
    pub(super) fn find_template(
        &self,
        key: &TemplateKey,
        image: &VerifiedImage,
    ) -> Result<Option<Template>, CoreError> {
        let current = self.current_path(key);
        let name = match std::fs::read_to_string(&current) {
            Ok(n) => n.trim().to_string(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(CoreError::io("read", &current, e)),
        };
        if !valid_dir_name(&name) {
            return Err(CoreError::InvalidArgument(format!(
                "{}: not a template directory name",
                current.display()
            )));
        }
        let dir = self.templates_dir().join(&name);
        let Some(t) = Template::pin(dir)? else {
            return Ok(None);
        };
        let now = RuntimeArtifacts::current(image, &super::probe_cache_dir(&self.cfg.state_dir))?;
        if t.record.key != *key || t.record.artifacts != now {
            tracing::warn!(
                template = %t.dir.display(),
                "the template was made on another image, QEMU, firmware or kernel; retiring it"
            );
            // Unpinned first: the collection below may then take its files.
            drop(t);
            std::fs::remove_file(&current).map_err(io("remove", &current))?;
            self.collect_templates();
            return Ok(None);
        }
        super::template_gc::note_use(&current);
        Ok(Some(t))
    }

    /// The template for `key`, built now if there is none (at most one build per key at a
    /// time; a concurrent caller waits for it).
    pub(super) async fn template_for(
        &self,
        key: &TemplateKey,
        req: &CreateVm,
        image: &VerifiedImage,
    ) -> Result<Template, CoreError> {
        if let Some(t) = self.find_template(key, image)? {
            return Ok(t);
        }
        let root = self.templates_dir();
        std::fs::create_dir_all(&root).map_err(io("create", &root))?;
        std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o711))
            .map_err(io("chmod", &root))?;
        let lock_path = build_lock(&root, &key.digest());
        let deadline = std::time::Instant::now() + self.cfg.boot_timeout * 2;
        let _lock = loop {
            let f = warren_supervisor::layout::open_lock_file(&lock_path)
                .map_err(io("open", &lock_path))?;
            match nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockExclusiveNonblock) {
                Ok(l) => break l,
                Err(_) if std::time::Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(50)).await
                }
                Err(_) => {
                    return Err(CoreError::Busy(format!(
                        "the template {} is still being built",
                        key.digest()
                    )))
                }
            }
        };
        // Another process may have built it while this one waited.
        if let Some(t) = self.find_template(key, image)? {
            return Ok(t);
        }
        self.build_template(key, req, image).await
    }

    async fn build_template(
        &self,
        key: &TemplateKey,
        req: &CreateVm,
        image: &VerifiedImage,
    ) -> Result<Template, CoreError> {
        let t = std::time::Instant::now();
        // Empty directories stand in for the shares while the template boots: which host
        // directories a share shows is each clone's own.
        let shares = BuildShares::make(&self.templates_dir(), key)?;
        let rid = build_request_id(key);
        let build = CreateVm {
            image: Some(image.id.to_string()),
            memory_mib: Some(key.memory_mib),
            vcpus: Some(key.vcpus),
            workspace: TEMPLATE_WORKSPACE.to_string(),
            request_id: Some(rid.clone()),
            // The VM the build is for was admitted and reserved (`creating`) against the
            // host's VM and memory limits before the build, and runs only after the build VM
            // is gone: counted again, a host one VM short of its limits would refuse a
            // template create that a cold create passes. The storage the build keeps (its
            // RAM file and disk layer, as the template) is checked here.
            host_limits: super::Limits {
                max_storage_mib: req.host_limits.max_storage_mib,
                ..super::Limits::default()
            },
            idle_seconds: Some(0),
            ram_file: true,
            mounts: shares.mounts.clone(),
            // A NIC whose egress allows nothing: the clone's supervisor sets up its own.
            network: key.network.then(super::NetworkRequest::default),
            ..CreateVm::default()
        };
        let mut ignore = |_: &str| {};
        let made = match Box::pin(self.create_vm(&build, &mut ignore)).await {
            Ok(rec) => {
                let made = self.save_template(key, &rec).await;
                if let Err(e) = self.destroy_vm(&rec.id).await {
                    tracing::warn!(vm = %rec.id, error = %e, "destroying a template's build VM");
                }
                made
            }
            Err(e) => {
                // A build VM that failed to boot keeps a `failed` record in a workspace no
                // caller may reach: it goes with the failed build.
                if let Ok(Some(rec)) = self.store.by_request(TEMPLATE_WORKSPACE, &rid) {
                    if let Err(e) = self.destroy_vm(&rec.id).await {
                        tracing::warn!(vm = %rec.id, error = %e, "destroying a failed template build VM");
                    }
                }
                Err(e)
            }
        };
        shares.remove();
        let dir = made?;
        tracing::info!(
            template = %dir.display(),
            ms = t.elapsed().as_millis() as u64,
            "template built"
        );
        Template::pin(dir.clone())?.ok_or_else(|| {
            CoreError::Conflict(format!(
                "the template {} was deleted as it was built",
                dir.display()
            ))
        })
    }

    /// Hibernates the build VM `rec` (fast standby) and moves its files into the template.
    async fn save_template(&self, key: &TemplateKey, rec: &VmRecord) -> Result<PathBuf, CoreError> {
        // What every clone's first exec needs (the shell, the job path, libc) is then in the
        // template's page cache instead of on its disk.
        self.warm(&rec.id, &["sh", "-c", "true"]).await?;
        self.suspend_vm(&rec.id, SuspendMode::Hibernate, true)
            .await?;
        let vm = self.vm_dir(&rec.id);
        let artifacts = RuntimeArtifacts::load(&vm)?.ok_or_else(|| {
            CoreError::InvalidArgument("the build VM has no artifacts record".into())
        })?;
        let root = self.templates_dir();
        let mut id = [0u8; 4];
        rand::rng().fill_bytes(&mut id);
        let staging = root.join(format!("building-{}-{}", key.digest(), hex::encode(id)));
        std::fs::create_dir(&staging).map_err(io("create", &staging))?;
        let run = vm.run_dir();
        let moves = [
            (run.join("guest.ram"), "ram", 0o440),
            (run.join("disk.qcow2"), "disk.qcow2", 0o440),
            (vm.checkpoint_state(), "state", 0o400),
            (vm.secret(), "secret", 0o400),
        ];
        let root_user = nix::unistd::geteuid().is_root();
        let result = (|| -> Result<PathBuf, CoreError> {
            for (from, to, mode) in &moves {
                let dest = staging.join(to);
                std::fs::rename(from, &dest).map_err(io("rename", from))?;
                // The build VM's VMM wrote most of these: owner and mode change through a
                // checked descriptor, never through a link it could have planted.
                let owner = root_user.then_some((0, self.template_gid()));
                warren_vmm::sys::vmm_file::claim_regular(&dest, owner, *mode)
                    .map_err(io("claim", &dest))?;
            }
            let record = TemplateRecord {
                key: key.clone(),
                artifacts,
                created_unix: super::now_unix(),
                boot_ms: rec.boot_ms.unwrap_or(0),
            };
            let body = serde_json::to_vec_pretty(&record).expect("invariant: record serialises");
            write_private(&staging.join(RECORD), &body)?;
            if root_user {
                chown(&staging, Some(0), Some(self.template_gid()))
                    .map_err(io("chown", &staging))?;
            }
            std::fs::set_permissions(&staging, std::fs::Permissions::from_mode(0o750))
                .map_err(io("chmod", &staging))?;
            for f in ["ram", "disk.qcow2", "state", "secret", RECORD] {
                std::fs::File::open(staging.join(f))
                    .and_then(|f| f.sync_all())
                    .map_err(io("fsync", &staging))?;
            }
            let name = format!("t-{}-{}", key.digest(), hex::encode(id));
            std::fs::rename(&staging, root.join(&name)).map_err(io("rename", &staging))?;
            // Published by one rename of the pointer: a create sees the old template or the
            // new one, complete.
            let current = self.current_path(key);
            let tmp = root.join(format!("{}.current.tmp", key.digest()));
            let _ = std::fs::remove_file(&tmp);
            write_private(&tmp, name.as_bytes())?;
            std::fs::rename(&tmp, &current).map_err(io("rename", &tmp))?;
            std::fs::File::open(&root)
                .and_then(|f| f.sync_all())
                .map_err(io("fsync", &root))?;
            Ok(root.join(name))
        })();
        if result.is_err() {
            // What the build VM's VMM left at a file's name in `run/` (a directory tree of any
            // depth) may have been moved in: removed without recursion.
            let _ = warren_session::remove_tree(&staging);
        }
        if let Ok(dir) = &result {
            let ram = dir.join("ram");
            let _ = tokio::task::spawn_blocking(move || warm_page_cache(&ram)).await;
            self.evict_templates(&self.current_path(key));
        }
        self.collect_templates();
        result
    }

    /// Lists the current templates (valid: made on the host's current QEMU and firmware),
    /// deleting unused ones first.
    pub fn list_templates(&self) -> Result<Vec<TemplateInfo>, CoreError> {
        self.collect_templates();
        let mut out = Vec::new();
        let Ok(entries) = std::fs::read_dir(self.templates_dir()) else {
            return Ok(out);
        };
        let (qemu, firmware) = warren_supervisor::vmm_digests();
        for e in entries.flatten() {
            let file = e.file_name().to_string_lossy().into_owned();
            if !file.ends_with(".current") {
                continue;
            }
            let Ok(name) = std::fs::read_to_string(e.path()) else {
                continue;
            };
            let name = name.trim().to_string();
            if !valid_dir_name(&name) {
                continue;
            }
            if let Ok(r) = read_record(&self.templates_dir().join(&name)) {
                out.push(TemplateInfo {
                    name,
                    valid: r.artifacts.qemu.sha256 == qemu
                        && r.artifacts.firmware.sha256 == firmware,
                    key: r.key,
                    created_unix: r.created_unix,
                });
            }
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    /// Starts VM `rec` as a clone of `tpl` (see the module docs); returns its start in ms.
    pub(super) async fn start_clone(
        &self,
        rec: &VmRecord,
        image: &VerifiedImage,
        accel: Accel,
        virtiofsd: Option<PathBuf>,
        network: Option<warren_vmm::NetSpec>,
        tpl: &Template,
    ) -> Result<u64, CoreError> {
        let (dir, run_as) = self.made_vm_dir(rec);
        let run = dir.run_dir();
        let give = |path: &Path| super::create::give(path, run_as);
        tpl.record.artifacts.store(&dir)?;
        let name = tpl
            .dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        write_private(&dir.path().join(TEMPLATE_MARKER), name.as_bytes())?;
        let disk = run.join("disk.qcow2");
        let size = std::fs::metadata(&image.rootfs)
            .map_err(io("stat", &image.rootfs))?
            .len();
        warren_vmm::disk::create_overlay_of_layer(&tpl.dir.join("disk.qcow2"), size, &disk)?;
        give(&disk)?;
        let state = dir.checkpoint_state();
        std::fs::copy(tpl.dir.join("state"), &state).map_err(io("copy", &state))?;
        give(&state)?;
        let secret = std::fs::read(tpl.dir.join("secret")).map_err(io("read", &tpl.dir))?;
        write_private(&dir.secret(), &secret)?;
        let root = nix::unistd::geteuid().is_root();
        let cgroup = if root {
            warren_vmm::sys::cgroup::Hierarchy::detect().map(|h| h.vm_cgroup(&rec.id))
        } else {
            None
        };
        let mut machine_id = [0u8; 16];
        rand::rng().fill_bytes(&mut machine_id);
        // Its shares (the template's guest paths and tags, this VM's own directories) are
        // attached as a fresh boot would attach them; the kernel arguments only matter to a
        // later fresh boot (the restored guest mounted the template's at its boot).
        let (shares, mut extra_cmdline) = super::mounts::shares_of(&rec.mounts);
        if network.is_some() {
            extra_cmdline.push(warren_supervisor::network::guest_kernel_arg());
        }
        let template_ram = tpl.dir.join("ram");
        // With shares, the backend copies the template's RAM into a shared memfd of the
        // clone's own (`warren_vmm::sys::clone_ram`); without, QEMU maps the file privately.
        let (template_ram, clone_ram) = if shares.is_empty() {
            (Some(template_ram), None)
        } else {
            (None, Some(template_ram))
        };
        let mut cfg = SupervisorConfig {
            vm_id: rec.id.clone(),
            launch: LaunchSpec {
                name: rec.id.clone(),
                run_dir: run.clone(),
                stderr_log: dir.qemu_stderr(),
                kernel: image.kernel.clone(),
                // Only loaded, then overwritten by the restore; the clone's own (with its new
                // secret) is written once the rekey is done.
                initramfs: image.initramfs.clone(),
                disk,
                memory: MemMib(rec.memory_mib),
                vcpus: rec.vcpus,
                accel,
                cpu: Some(tpl.record.key.cpu.clone()),
                extra_cmdline,
                run_as,
                cgroup,
                incoming: true,
                shares,
                virtiofsd,
                ram_file: None,
                network,
                template_ram,
                clone_ram,
                fork_ram: None,
                named_ram: false,
                groups: if root {
                    vec![self.template_gid()]
                } else {
                    vec![]
                },
                bench_port: None,
                view_readable: vec![],
            },
            boot_timeout_ms: self.cfg.boot_timeout.as_millis() as u64,
            restore: true,
            clone: Some(warren_supervisor::CloneSpec {
                hostname: rec.id.clone(),
                machine_id: hex::encode(machine_id),
            }),
            restore_from: None,
        };
        let body = serde_json::to_vec_pretty(&cfg).expect("invariant: config serialises");
        write_private(&dir.config(), &body)?;
        super::create::hand_over_run(&dir, run_as)?;
        let ms = self.launch_and_wait(&dir).await?;
        // The template's device state is consumed.
        let _ = std::fs::remove_file(&state);
        settle_copy(&dir, &image.initramfs, &mut cfg, run_as)?;
        Ok(ms)
    }
}

/// Reads a template's RAM file once, holes included, so its whole content is in the page
/// cache: a clone's pages, and every page a fork's save of a clone reads (it reads all of
/// guest RAM, and a hole first read through a clone's mapping costs a new zeroed page: ~1 s
/// for a 512 MiB guest against ~0.2 s once cached). Best effort: the cache is the kernel's
/// to evict.
fn warm_page_cache(path: &Path) {
    let t = std::time::Instant::now();
    let read =
        std::fs::File::open(path).and_then(|mut f| std::io::copy(&mut f, &mut std::io::sink()));
    match read {
        Ok(bytes) => tracing::debug!(
            bytes,
            ms = t.elapsed().as_millis() as u64,
            "template RAM read into the page cache"
        ),
        Err(e) => tracing::debug!(error = %e, "reading the template RAM into the page cache"),
    }
}

/// After a restored copy (template clone, fork) came up with a secret of its own: writes
/// its per-VM initramfs with that secret and rewrites its supervisor config for later
/// launches (a resume restores into anonymous RAM under the block name it started with:
/// `mem`, or a fork parent's machine block; a fresh boot boots its own disk with its own
/// initramfs).
pub(super) fn settle_copy(
    dir: &VmDir,
    base_initramfs: &Path,
    cfg: &mut SupervisorConfig,
    run_as: Option<(u32, u32)>,
) -> Result<(), CoreError> {
    let secret = std::fs::read(dir.secret()).map_err(io("read", dir.path()))?;
    // The copy's VMM runs and owns `run/` by now: the file is made in the VM's own (root's)
    // directory, given its owner and mode through its descriptor, and renamed in (a rename
    // replaces whatever the VMM left at that name and never follows it).
    let staged = dir.path().join("initramfs.cpio.new");
    warren_image::write_vm_initramfs(base_initramfs, &secret, &staged)?;
    warren_vmm::sys::vmm_file::claim_regular(&staged, run_as, 0o400)
        .map_err(io("claim", &staged))?;
    let initramfs = dir.run_dir().join("initramfs.cpio");
    std::fs::rename(&staged, &initramfs).map_err(io("rename", &staged))?;
    cfg.launch.initramfs = initramfs;
    // The RAM block keeps the name the copy started with, which its own checkpoints use: a
    // template's (`mem`) or a fork parent's (`mem`, or the machine's own).
    cfg.launch.named_ram =
        cfg.launch.named_ram || cfg.launch.template_ram.is_some() || cfg.launch.clone_ram.is_some();
    cfg.launch.template_ram = None;
    cfg.launch.clone_ram = None;
    cfg.launch.fork_ram = None;
    cfg.launch.incoming = false;
    cfg.restore = false;
    cfg.clone = None;
    cfg.restore_from = None;
    replace_config(dir, cfg)
}

impl Warren {
    /// Runs `argv` in VM `id` and waits for it (at most a minute): a restored VM's VMM
    /// translates the exec path once, before a caller's first exec needs it.
    pub(super) async fn warm(&self, id: &str, argv: &[&str]) -> Result<(), CoreError> {
        let job = self
            .exec_start(
                id,
                warren_protocol::ExecStart {
                    argv: argv.iter().map(|a| a.to_string()).collect(),
                    env: vec![],
                    cwd: None,
                    stdin: None,
                    timeout_ms: Some(60_000),
                    request_key: None,
                },
            )
            .await?;
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        // Past what was seen, so output does not end the wait early (only the job's end).
        let mut at = (0, 0);
        while std::time::Instant::now() < deadline {
            let out = self
                .job_output(
                    id,
                    warren_protocol::JobOutputRequest {
                        job,
                        stdout_cursor: at.0,
                        stderr_cursor: at.1,
                        max_bytes: 0,
                        wait_ms: 5_000,
                    },
                )
                .await?;
            if matches!(out.state, warren_protocol::JobState::Finished(_)) {
                return Ok(());
            }
            at = (out.stdout_retained.max(at.0), out.stderr_retained.max(at.1));
        }
        Err(CoreError::BootFailed(format!(
            "warming {id}: `{}` did not finish",
            argv.join(" ")
        )))
    }
}

/// The empty host directories a template's build VM shares (one per share of the shape),
/// under `STATE/templates/shares-<key digest>-<random>/`, owned by the user Warren runs as
/// (root's when it runs as root, served by a root virtiofsd): the guest sees them as its
/// user's, as it will see a clone's own. Never `nobody`: a share is served by a virtiofsd
/// running as its owner, and every other process of a uid may trace that one, which maps all
/// of the build VM's RAM (the memory every clone of the template starts from).
struct BuildShares {
    root: Option<PathBuf>,
    mounts: Vec<MountSpec>,
}

impl BuildShares {
    fn make(templates: &Path, key: &TemplateKey) -> Result<Self, CoreError> {
        if key.shares.is_empty() {
            return Ok(BuildShares {
                root: None,
                mounts: vec![],
            });
        }
        let mut id = [0u8; 4];
        rand::rng().fill_bytes(&mut id);
        let root = templates.join(format!("shares-{}-{}", key.digest(), hex::encode(id)));
        std::fs::create_dir(&root).map_err(io("create", &root))?;
        let mut made = BuildShares {
            root: Some(root.clone()),
            mounts: vec![],
        };
        let owner = (
            nix::unistd::geteuid().as_raw(),
            nix::unistd::getegid().as_raw(),
        );
        for (i, share) in key.shares.iter().enumerate() {
            let dir = root.join(format!("fs{i}"));
            let made_dir = std::fs::create_dir(&dir)
                .and_then(|()| chown(&dir, Some(owner.0), Some(owner.1)))
                .and_then(|()| dir.canonicalize());
            let host = match made_dir {
                Ok(h) => h,
                Err(e) => {
                    made.remove();
                    return Err(CoreError::io("create", &dir, e));
                }
            };
            made.mounts.push(MountSpec {
                host,
                guest: share.guest.clone(),
                read_only: share.read_only,
                owner: Some(owner),
                identity: None,
            });
        }
        Ok(made)
    }

    fn remove(&self) {
        if let Some(root) = &self.root {
            // The build's guest wrote into them (as root, through a root virtiofsd): a tree of
            // any depth, removed without recursion.
            if let Err(e) = warren_session::remove_tree(root) {
                tracing::warn!(dir = %root.display(), error = %e, "removing a template build's shares");
            }
        }
    }
}

/// A template directory's name: `t-<32 hex>-<8 hex>`.
pub(super) fn valid_dir_name(name: &str) -> bool {
    name.len() == 2 + 32 + 1 + 8
        && name.starts_with("t-")
        && name.as_bytes()[34] == b'-'
        && name[2..34]
            .bytes()
            .chain(name[35..].bytes())
            .all(|b| b.is_ascii_hexdigit())
}

/// Rewrites a VM's supervisor config through a temporary file and a rename.
pub(super) fn replace_config(dir: &VmDir, cfg: &SupervisorConfig) -> Result<(), CoreError> {
    let body = serde_json::to_vec_pretty(cfg).expect("invariant: config serialises");
    let tmp = dir.path().join("supervisor.json.tmp");
    let _ = std::fs::remove_file(&tmp);
    write_private(&tmp, &body)?;
    std::fs::rename(&tmp, dir.config()).map_err(|e| CoreError::io("rename", &tmp, e))
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// A template of `key` in `w`'s store, its directory named with `suffix`: a record made
    /// on stand-in artifacts and the pointer, no files. Returns (name, directory, pointer).
    pub(in crate::vm) fn fake_template(
        w: &crate::Warren,
        key: &TemplateKey,
        suffix: &str,
    ) -> (String, PathBuf, PathBuf) {
        let art = || crate::vm::artifacts::Artifact {
            path: "/x".into(),
            sha256: "0".repeat(64),
        };
        let name = format!("t-{}-{suffix}", key.digest());
        let dir = w.templates_dir().join(&name);
        std::fs::create_dir_all(&dir).expect("dir");
        let record = TemplateRecord {
            key: key.clone(),
            artifacts: crate::vm::artifacts::RuntimeArtifacts {
                qemu: art(),
                firmware: art(),
                kernel: art(),
            },
            created_unix: 1,
            boot_ms: 1,
        };
        std::fs::write(dir.join(RECORD), serde_json::to_vec(&record).expect("json"))
            .expect("record");
        let pointer = w.current_path(key);
        std::fs::write(&pointer, &name).expect("pointer");
        (name, dir, pointer)
    }

    fn key() -> TemplateKey {
        TemplateKey {
            image_id: "a".repeat(64),
            memory_mib: 512,
            vcpus: 1,
            accel: "tcg".into(),
            cpu: "max".into(),
            shares: vec![],
            network: false,
        }
    }

    /// A template made with the old TCG model loses its pointer and its files; one with
    /// the current model is listed and kept.
    #[test]
    fn test_list_templates_retires_a_superseded_cpu_model() {
        let state = tempfile::tempdir().expect("state");
        let w = crate::Warren::open(crate::WarrenConfig::new(
            state.path().to_path_buf(),
            "/usr/bin/warren".into(),
        ))
        .expect("open");
        let mut made = vec![];
        for (n, cpu) in [("1", "max"), ("2", warren_vmm::qemu::TCG_CPU)] {
            let k = TemplateKey {
                cpu: cpu.into(),
                ..key()
            };
            let (name, dir, pointer) = fake_template(&w, &k, &format!("0000000{n}"));
            made.push((name, dir, pointer));
        }
        let listed = w.list_templates().expect("list");
        let names: Vec<&str> = listed.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, [made[1].0.as_str()]);
        assert!(!made[0].2.exists(), "old model retired");
        // Its files go once retired for the grace period (`template_gc`).
        let mark = made[0].1.join("retired");
        std::fs::File::options()
            .write(true)
            .open(&mark)
            .and_then(|f| {
                f.set_modified(
                    std::time::SystemTime::now()
                        - super::super::template_gc::RETIRE_GRACE
                        - Duration::from_secs(1),
                )
            })
            .expect("age the mark");
        w.list_templates().expect("list");
        assert!(!made[0].1.exists(), "old model's files removed");
        assert!(
            made[1].1.exists() && made[1].2.exists(),
            "current model kept"
        );
    }

    #[test]
    fn test_superseded_model_is_a_cpu_new_vms_no_longer_get() {
        assert!(superseded_model(&key()), "TCG `max` before -erms,-fsrm");
        let now = TemplateKey {
            cpu: warren_vmm::qemu::TCG_CPU.into(),
            ..key()
        };
        assert!(!superseded_model(&now));
        let kvm = TemplateKey {
            accel: "kvm".into(),
            cpu: "host".into(),
            ..key()
        };
        assert!(!superseded_model(&kvm));
        let unknown = TemplateKey {
            accel: "hvf".into(),
            ..key()
        };
        assert!(!superseded_model(&unknown), "kept when in doubt");
    }

    #[test]
    fn test_key_digest_differs_for_every_field() {
        let base = key().digest();
        let variants = [
            TemplateKey {
                image_id: "b".repeat(64),
                ..key()
            },
            TemplateKey {
                memory_mib: 1024,
                ..key()
            },
            TemplateKey { vcpus: 2, ..key() },
            TemplateKey {
                accel: "kvm".into(),
                ..key()
            },
            TemplateKey {
                cpu: "host".into(),
                ..key()
            },
            TemplateKey {
                shares: vec![TemplateShare {
                    guest: "/workspace".into(),
                    read_only: false,
                }],
                ..key()
            },
            TemplateKey {
                shares: vec![TemplateShare {
                    guest: "/workspace".into(),
                    read_only: true,
                }],
                ..key()
            },
            TemplateKey {
                shares: vec![TemplateShare {
                    guest: "/work".into(),
                    read_only: false,
                }],
                ..key()
            },
            TemplateKey {
                network: true,
                ..key()
            },
        ];
        for v in variants {
            assert_ne!(v.digest(), base, "{v:?}");
        }
        assert_eq!(key().digest(), base);
    }

    /// A root Warren's template build shares its stand-in directories as root's, so their
    /// virtiofsd runs as root: found by a hostile review, they were `nobody`'s and, with
    /// shares served as their owner, so was their virtiofsd, which any process running as
    /// `nobody` could trace or signal, and through it (the build VM's vhost-user backend,
    /// mapping all its RAM) write into the memory every clone of the template starts from.
    #[test]
    fn test_template_build_shares_are_served_as_no_shared_uid() {
        use std::os::unix::fs::MetadataExt;
        assert!(nix::unistd::geteuid().is_root(), "this test needs root");
        let d = tempfile::tempdir().expect("tempdir");
        let key = TemplateKey {
            shares: vec![TemplateShare {
                guest: "/workspace".into(),
                read_only: false,
            }],
            ..key()
        };
        let made = BuildShares::make(d.path(), &key).expect("make");
        assert_eq!(made.mounts.len(), 1);
        for m in &made.mounts {
            assert_eq!(m.owner, Some((0, 0)), "{m:?}");
            assert_eq!(std::fs::metadata(&m.host).expect("stat").uid(), 0);
        }
        made.remove();
    }
}
