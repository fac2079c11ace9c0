//! `warren image pull REF@sha256:…`: an OCI image made into a Warren image, the same
//! content-addressed kind the recipes make.
//!
//! Steps (all inside a `.pull-*` temp directory of the store, renamed to the image id only
//! when complete: an interrupted pull leaves nothing but that directory, which the next
//! build or pull removes):
//! 1. The reference must carry a digest (a tag alone is refused; `warren image resolve`
//!    prints the digest to pin). An image already pulled by this digest with this agent and
//!    kernel stage is reused.
//! 2. The manifest by digest (an index is followed to its `linux/amd64` manifest, also by
//!    digest), each checked against the digest that names it.
//! 3. The cosign signature and attestation tags of the digest; with a policy, they are
//!    checked now, before any layer is downloaded, and a refusal stops the pull.
//! 4. The config: its `Env` applies to every job (a name the job sets keeps the job's value);
//!    `WorkingDir` is recorded but jobs run in `/workspace` as in every Warren image;
//!    `Entrypoint`, `Cmd`, `User` and the rest are ignored (Warren's agent is PID 1, runs what
//!    it is asked to, as the guest user).
//! 5. Each layer: downloaded into a file while hashing (size and digest checked), then
//!    unpacked by [`crate::unpack`] with whiteouts (hostile entries refused or dropped, see
//!    there), within [`PullOptions::max_unpacked`] and the pull's deadline; every gzip
//!    member and zstd frame is read, a zstd window over 100 MiB is refused.
//! 6. The root tree is finished like a recipe's (guest user 1000, `/workspace`, mount
//!    points), `mkfs.ext4 -d` makes the root filesystem, and the kernel, its modules and the
//!    agent come from the kernel stage (the `minimal` recipe's): the image needs nothing of
//!    its own to boot.

use std::io::Read;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::build::{self, Assembly};
use crate::digest::{self, FileIdentity};
use crate::manifest::{FileDigest, OciSource, ROOTFS_FILE, TRUST_FILE};
use crate::oci::{self, Compression, Registry};
use crate::policy::Policy;
use crate::store::{is_static_elf, set_mode, BuildProgress, ImageId, ImageStore};
use crate::{ImageError, Recipe};

/// Bump when the pull's output for the same inputs changes.
const PULL_FORMAT: u32 = 1;

/// Limits of one pull.
#[derive(Debug, Clone, Copy)]
pub struct PullOptions {
    /// Largest compressed layer.
    pub max_layer: u64,
    /// Most bytes of file content unpacked, all layers together.
    pub max_unpacked: u64,
    /// Most entries, all layers together.
    pub max_entries: u64,
    /// The whole pull's deadline.
    pub deadline: Duration,
    /// The root disk's virtual size; default: twice the content plus 1 GiB, at least 2 GiB.
    pub disk_size: Option<u64>,
}

impl Default for PullOptions {
    fn default() -> Self {
        PullOptions {
            max_layer: 8 << 30,
            max_unpacked: 32 << 30,
            max_entries: 2_000_000,
            deadline: Duration::from_secs(3600),
            disk_size: None,
        }
    }
}

/// Prefix of in-progress pulls in the store.
pub(crate) const PULL_PREFIX: &str = ".pull-";

fn progress_event(step: &'static str, detail: String) -> BuildProgress {
    BuildProgress::new(step, detail)
}

/// The digest `reference` (`REF:TAG`) names now, as `REF@sha256:…`.
pub async fn resolve(reference: &str) -> Result<String, ImageError> {
    let r = oci::parse_reference(reference)?;
    if r.digest().is_some() {
        return Err(ImageError::OciReference(format!(
            "{reference} already has a digest"
        )));
    }
    let tag = r.tag().unwrap_or("latest").to_string();
    let mut reg = Registry::new(r.clone())?;
    reg.authenticate().await?;
    let digest = reg.resolve_tag(&tag).await?;
    Ok(format!("{}/{}@{digest}", r.registry(), r.repository()))
}

/// Pulls `reference` (it must carry a digest) into `store` with `agent` as `/init`; checks
/// it against `policy` (if any) before downloading its layers. Returns the image id.
pub async fn pull(
    store: &ImageStore,
    reference: &str,
    agent: &Path,
    policy: Option<&Policy>,
    opts: PullOptions,
    progress: &mut (dyn FnMut(BuildProgress) + Send),
) -> Result<ImageId, ImageError> {
    let r = oci::parse_reference(reference)?;
    let Some(digest) = r.digest().map(str::to_string) else {
        return Err(ImageError::OciReference(format!(
            "{reference} has no digest: pull by digest (REF@sha256:…); \
             `warren image resolve {reference}` prints the digest the tag names now"
        )));
    };
    if !oci::valid_digest(&digest) {
        return Err(ImageError::OciReference(format!(
            "{digest} is not a sha256 digest"
        )));
    }
    if !is_static_elf(agent)? {
        return Err(ImageError::AgentNotStatic(agent.to_path_buf()));
    }
    let agent_sha256 = digest::sha256_file(agent)?;
    let store = store.clone();
    let lock = {
        let s = store.clone();
        tokio::task::spawn_blocking(move || s.lock())
            .await
            .map_err(|e| ImageError::InvalidInput(e.to_string()))??
    };
    build::cleanup_stale(store.root(), PULL_PREFIX);
    build::cleanup_stale(store.root(), ".build-");
    let kernel_recipe = Recipe::builtin(crate::recipe::KERNEL_RECIPE)?;
    #[derive(Serialize)]
    struct Key<'a> {
        kind: &'static str,
        format: u32,
        digest: &'a str,
        kernel_stage: &'a str,
        agent_sha256: &'a str,
        disk_size: Option<u64>,
    }
    let kernel_stage = kernel_recipe.stage_digest();
    let recipe_digest = digest::sha256_hex(&digest::canonical_json(&Key {
        kind: "oci",
        format: PULL_FORMAT,
        digest: &digest,
        kernel_stage: &kernel_stage,
        agent_sha256: &agent_sha256,
        disk_size: opts.disk_size,
    }));
    if let Some(id) = store.built(&recipe_digest)? {
        progress(progress_event(
            "cached",
            format!("image {id} was pulled from {digest}"),
        ));
        drop(lock);
        return Ok(id);
    }
    let work = tempfile::Builder::new()
        .prefix(PULL_PREFIX)
        .tempdir_in(store.root())
        .map_err(ImageError::io("create temp dir in", store.root()))?;
    // The same instant bounds the blocking unpack, which a timeout of this future alone would
    // leave running (and writing into the work directory removed below).
    let deadline = Instant::now() + opts.deadline;
    let steps = BlockingSteps::default();
    let result = steps
        .run(
            opts.deadline,
            pull_into(
                &store,
                r.clone(),
                &digest,
                work.path(),
                agent,
                &agent_sha256,
                &recipe_digest,
                policy,
                opts,
                &kernel_recipe,
                deadline,
                &steps,
                progress,
            ),
        )
        .await
        .unwrap_or_else(|| {
            Err(ImageError::Oci {
                reference: r.whole(),
                reason: format!("the pull's {:?} deadline passed", opts.deadline),
            })
        });
    let manifest = match result {
        Ok(m) => m,
        Err(e) => {
            build::cleanup_work_dir(&work.keep());
            return Err(e);
        }
    };
    let id = ImageId(manifest.id());
    let dest = store.root().join(&id.0);
    if dest.exists() {
        build::cleanup_work_dir(&work.keep());
    } else {
        let kept = work.keep();
        // The unpacked tree is gone; what is left is the image's files.
        if let Err(e) = std::fs::rename(&kept, &dest) {
            build::cleanup_work_dir(&kept);
            return Err(ImageError::io("rename", &dest)(e));
        }
    }
    store.record_build(&recipe_digest, &id)?;
    progress(progress_event("install", format!("image {id}")));
    drop(lock);
    Ok(id)
}

#[allow(clippy::too_many_arguments)]
async fn pull_into(
    store: &ImageStore,
    r: oci_client::Reference,
    digest: &str,
    work: &Path,
    agent: &Path,
    agent_sha256: &str,
    recipe_digest: &str,
    policy: Option<&Policy>,
    opts: PullOptions,
    kernel_recipe: &Recipe,
    deadline: Instant,
    steps: &BlockingSteps,
    progress: &mut (dyn FnMut(BuildProgress) + Send),
) -> Result<crate::manifest::Manifest, ImageError> {
    let refused = |reason: String| ImageError::OciRefused {
        reference: r.whole(),
        reason,
    };
    let mut reg = Registry::new(r.clone())?;
    reg.authenticate().await?;
    progress(progress_event(
        "manifest",
        format!("{}/{}@{digest}", r.registry(), r.repository()),
    ));
    let body = reg.manifest_by_digest(digest).await?;
    let mut doc = oci::parse_manifest(&r, &body)?;
    let mut manifest_digest = digest.to_string();
    if let Some(entries) = doc.manifests.take() {
        let entry = entries
            .iter()
            .find(|e| {
                e.platform
                    .as_ref()
                    .is_some_and(|p| p.os == "linux" && p.architecture == "amd64")
            })
            .ok_or_else(|| refused("the index has no linux/amd64 manifest".into()))?;
        progress(progress_event(
            "manifest",
            format!("linux/amd64: {}", entry.digest),
        ));
        let body = reg.manifest_by_digest(&entry.digest).await?;
        doc = oci::parse_manifest(&r, &body)?;
        if doc.manifests.is_some() {
            return Err(refused("an index inside an index".into()));
        }
        manifest_digest = entry.digest.clone();
    }
    let config_desc = doc
        .config
        .clone()
        .ok_or_else(|| refused("the manifest has no config".into()))?;
    for l in &doc.layers {
        if oci::layer_compression(&l.media_type).is_none() {
            return Err(refused(format!(
                "layer {} has media type {:?}, not a tar layer",
                l.digest, l.media_type
            )));
        }
    }

    // Signatures and attestations: checked before any layer is fetched.
    let material = reg.trust_material(digest).await?;
    progress(progress_event(
        "trust",
        format!(
            "{} signature(s), {} attestation(s)",
            material.signatures.len(),
            material.attestations.len()
        ),
    ));
    if let Some(policy) = policy {
        let v = crate::trust::verify(policy, digest, &material).map_err(|failure| {
            ImageError::Untrusted {
                image: Some(format!("{}/{}@{digest}", r.registry(), r.repository())),
                failure,
            }
        })?;
        progress(progress_event(
            "trust",
            format!(
                "signed by {} (policy version {})",
                v.signed_by, v.policy_version
            ),
        ));
    }

    let config = reg
        .blob_bytes(&config_desc, oci::MAX_MANIFEST as u64)
        .await?;
    let (env, working_dir) = job_config(&config).map_err(refused)?;

    // The kernel stage (built once, shared with the minimal recipe).
    let (stage_dir, stage) = {
        let (stages, downloads) = (
            store.root().join("cache/stages"),
            store.root().join("cache/downloads"),
        );
        let recipe = kernel_recipe.clone();
        blocking_with_progress(steps, progress, move |send| {
            build::ensure_stage(&stages, &downloads, &recipe, send)
        })
        .await?
    };

    let root = work.join("root");
    std::fs::create_dir(&root).map_err(ImageError::io("create", &root))?;
    set_mode(&root, 0o755)?;
    let unpack_opts = crate::unpack::Options {
        max_bytes: opts.max_unpacked,
        block: 0,
        max_entries: opts.max_entries,
        keep_owner: true,
        keep_sticky: true,
        whiteouts: true,
        mode_mask: 0,
        dir_mode_set: 0,
        only_in: None,
    };
    let mut done = crate::unpack::Unpacked::default();
    let n = doc.layers.len();
    for (i, layer) in doc.layers.iter().enumerate() {
        let file = work.join(format!("layer-{i}"));
        let shown = format!("layer {}/{n} {}", i + 1, &layer.digest[..19]);
        progress(progress_event(
            "layer",
            format!("{shown}: {} MiB", layer.size >> 20),
        ));
        reg.blob_to_file(layer, &file, opts.max_layer, &mut |_| {})
            .await?;
        let compression = oci::layer_compression(&layer.media_type).unwrap_or(Compression::None);
        let (root2, file2, r2) = (root.clone(), file.clone(), r.whole());
        let unpack_opts = unpack_opts.clone();
        let step = steps.start();
        let (result, d) = tokio::task::spawn_blocking(move || {
            let _step = step;
            let r = unpack_layer(
                &file2,
                compression,
                &root2,
                &unpack_opts,
                deadline,
                &mut done,
            );
            (r, done)
        })
        .await
        .map_err(|e| ImageError::InvalidInput(e.to_string()))?;
        done = d;
        result.map_err(|e| ImageError::OciRefused {
            reference: r2,
            reason: format!("layer {}: {e}", layer.digest),
        })?;
        std::fs::remove_file(&file).map_err(ImageError::io("remove", &file))?;
    }
    progress(progress_event(
        "unpack",
        format!(
            "{} files, {} dirs, {} links, {} MiB; dropped: {} device/special entries, set-id bits of {}; {} whiteouts",
            done.files,
            done.dirs,
            done.links,
            done.bytes >> 20,
            done.skipped,
            done.setid_dropped,
            done.whiteouts
        ),
    ));

    // Finish, make the file system, assemble.
    let size = opts
        .disk_size
        .unwrap_or_else(|| (done.bytes * 2 + (1 << 30)).max(2 << 30))
        .div_ceil(1 << 20)
        << 20;
    let (work2, root2, agent2, agent_sha2) = (
        work.to_path_buf(),
        root.clone(),
        agent.to_path_buf(),
        agent_sha256.to_string(),
    );
    let source = OciSource {
        repository: format!("{}/{}", r.registry(), r.repository()),
        digest: digest.to_string(),
        manifest_digest,
        layers: doc.layers.iter().map(|l| l.digest.clone()).collect(),
        env,
        working_dir,
    };
    let recipe_digest = recipe_digest.to_string();
    let manifest = blocking_with_progress(steps, progress, move |send| {
        finish(&root2, &work2, size, send)?;
        let rootfs = work2.join(ROOTFS_FILE);
        let id = FileIdentity::of(&rootfs)?;
        let sha256 = digest::sha256_file(&rootfs)?;
        build::assemble(
            &stage_dir,
            &stage,
            Assembly::Oci {
                source: Box::new(source),
                recipe_digest,
                rootfs: (
                    FileDigest {
                        sha256,
                        size: id.size,
                    },
                    id,
                ),
                rootfs_virtual_size: size,
            },
            &agent2,
            &agent_sha2,
            &work2,
            send,
        )
    })
    .await?;
    crate::store::write_atomic(
        &work.join(TRUST_FILE),
        &digest::canonical_json(&material),
        0o444,
    )?;
    Ok(manifest)
}

/// The pull's steps on blocking threads (unpacking, the kernel stage, `mkfs`): a timeout
/// drops the pull's future but cannot stop them, so the pull waits for them to end before it
/// removes its work directory and releases the store's lock. Otherwise they would go on
/// writing into a removed directory, unlocked, or their programs outlive the CLI.
#[derive(Default)]
struct BlockingSteps(Arc<()>);

impl BlockingSteps {
    /// A token a blocking step holds until it ends.
    fn start(&self) -> Arc<()> {
        self.0.clone()
    }

    /// Runs `fut` for at most `limit` (`None` past it), then waits until every blocking
    /// step it started has ended.
    async fn run<T>(
        &self,
        limit: Duration,
        fut: impl std::future::Future<Output = T>,
    ) -> Option<T> {
        let out = tokio::time::timeout(limit, fut).await.ok();
        while Arc::strong_count(&self.0) > 1 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        out
    }
}

/// Runs `f` on a blocking thread, passing its progress events on as they happen.
async fn blocking_with_progress<T: Send + 'static>(
    steps: &BlockingSteps,
    progress: &mut (dyn FnMut(BuildProgress) + Send),
    f: impl FnOnce(&mut dyn FnMut(BuildProgress)) -> Result<T, ImageError> + Send + 'static,
) -> Result<T, ImageError> {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let step = steps.start();
    let handle = tokio::task::spawn_blocking(move || {
        let _step = step;
        f(&mut |p| {
            let _ = tx.send(p);
        })
    });
    while let Some(p) = rx.recv().await {
        progress(p);
    }
    handle
        .await
        .map_err(|e| ImageError::InvalidInput(format!("a pull step panicked: {e}")))?
}

/// A reader that fails once `deadline` has passed: a layer that decompresses into an
/// endless stream stops at the pull's deadline instead of running on in the background.
struct DeadlineReader<R> {
    inner: R,
    deadline: Instant,
}

impl<R: Read> Read for DeadlineReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if Instant::now() >= self.deadline {
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "the pull's deadline passed while unpacking",
            ));
        }
        self.inner.read(buf)
    }
}

/// A valid, empty zstd frame (single segment, content size 0, one empty raw block).
const EMPTY_ZSTD_FRAME: [u8; 9] = [0x28, 0xb5, 0x2f, 0xfd, 0x20, 0x00, 0x01, 0x00, 0x00];

/// A zstd stream of any number of frames, decoded one after the other (the spec allows
/// several, and concatenating encoders write them; `ruzstd`'s streaming decoder stops after
/// the first, so the rest of a layer would be silently left out).
///
/// The decoder keeps a frame's whole window in memory, and checks the window size against
/// its 100 MiB limit only when a frame follows another (the first may declare terabytes).
/// So the decoder is first primed with an empty frame, and every frame of the layer goes
/// through that check.
struct ZstdFrames<R: std::io::BufRead> {
    decoder: ruzstd::decoding::FrameDecoder,
    source: R,
}

impl<R: std::io::BufRead> ZstdFrames<R> {
    fn new(mut source: R) -> Result<ZstdFrames<R>, String> {
        let mut decoder = ruzstd::decoding::FrameDecoder::new();
        decoder
            .init(&EMPTY_ZSTD_FRAME[..])
            .map_err(|e| format!("zstd: {e}"))?;
        decoder
            .reset(&mut source)
            .map_err(|e| format!("zstd: {e}"))?;
        Ok(ZstdFrames { decoder, source })
    }
}

impl<R: std::io::BufRead> Read for ZstdFrames<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        loop {
            let n = self.decoder.read(buf)?;
            if n > 0 {
                return Ok(n);
            }
            if self.decoder.is_finished() {
                if self.source.fill_buf()?.is_empty() {
                    return Ok(0);
                }
                self.decoder
                    .reset(&mut self.source)
                    .map_err(|e| std::io::Error::other(format!("zstd: {e}")))?;
                continue;
            }
            self.decoder
                .decode_blocks(
                    &mut self.source,
                    ruzstd::decoding::BlockDecodingStrategy::UptoBytes(buf.len()),
                )
                .map_err(|e| std::io::Error::other(format!("zstd: {e}")))?;
        }
    }
}

/// Decompresses and unpacks one verified layer file, before `deadline`.
fn unpack_layer(
    file: &Path,
    compression: Compression,
    root: &Path,
    opts: &crate::unpack::Options,
    deadline: Instant,
    done: &mut crate::unpack::Unpacked,
) -> Result<(), String> {
    let f = std::fs::File::open(file).map_err(|e| e.to_string())?;
    let r = std::io::BufReader::new(f);
    let bounded = |inner: Box<dyn Read>| DeadlineReader { inner, deadline };
    let res = match compression {
        Compression::None => crate::unpack::unpack(bounded(Box::new(r)), root, opts, done),
        Compression::Gzip => crate::unpack::unpack(
            // Every member: a gzip file may hold several, and all of them are the layer.
            bounded(Box::new(flate2::read::MultiGzDecoder::new(r))),
            root,
            opts,
            done,
        ),
        Compression::Zstd => {
            let d = ZstdFrames::new(r)?;
            crate::unpack::unpack(bounded(Box::new(d)), root, opts, done)
        }
    };
    res.map_err(|e| e.to_string())
}

/// Warren's additions to the tree, then `mkfs.ext4 -d` into `<work>/rootfs.ext4` (the
/// tree is removed afterwards).
fn finish(
    root: &Path,
    work: &Path,
    size: u64,
    progress: &mut dyn FnMut(BuildProgress),
) -> Result<(), ImageError> {
    progress(progress_event(
        "rootfs",
        "user, /workspace, mount points".into(),
    ));
    let tree = crate::tree::Tree::open(root).map_err(|e| ImageError::RootfsSetup(e.to_string()))?;
    for (dir, mode) in [
        ("proc", 0o555),
        ("sys", 0o555),
        ("dev", 0o755),
        ("run", 0o755),
        ("tmp", 0o1777),
        ("etc", 0o755),
    ] {
        if !tree
            .exists(dir)
            .map_err(|e| ImageError::RootfsSetup(e.to_string()))?
        {
            tree.mkdir(dir, mode, (0, 0))
                .map_err(|e| ImageError::RootfsSetup(e.to_string()))?;
        }
    }
    build::finish_root(root)?;
    build::make_ext4(root, &work.join(ROOTFS_FILE), size, progress)?;
    std::fs::remove_dir_all(root).map_err(ImageError::io("remove", root))
}

/// Most `Env` entries taken from an image config. Every exec carries them with the job's
/// own variables, and an exec request holds at most 1024 variables and 1 MiB
/// (`warren_protocol::limits::MAX_ENV`, `MAX_MESSAGE_BYTES`): an image whose `Env` could
/// never fit is refused at pull rather than failing every exec.
const MAX_IMAGE_ENV: usize = 512;
/// Most bytes of `Env` taken from an image config (see [`MAX_IMAGE_ENV`]).
const MAX_IMAGE_ENV_BYTES: usize = 256 << 10;

/// The config's `Env` and `WorkingDir` (bounded and checked).
fn job_config(config: &[u8]) -> Result<(Vec<String>, Option<String>), String> {
    let v: serde_json::Value =
        serde_json::from_slice(config).map_err(|e| format!("config: {e}"))?;
    let c = &v["config"];
    let mut env = Vec::new();
    if let Some(list) = c["Env"].as_array() {
        if list.len() > MAX_IMAGE_ENV {
            return Err(format!("config: more than {MAX_IMAGE_ENV} Env entries"));
        }
        let total: usize = list.iter().filter_map(|e| e.as_str()).map(str::len).sum();
        if total > MAX_IMAGE_ENV_BYTES {
            return Err(format!(
                "config: Env holds {total} bytes, over the {MAX_IMAGE_ENV_BYTES}-byte limit \
                 (every exec carries it)"
            ));
        }
        for e in list {
            let e = e.as_str().ok_or("config: an Env entry is not a string")?;
            let (name, _) = e.split_once('=').ok_or("config: an Env entry has no '='")?;
            let name_ok = !name.is_empty()
                && name.len() <= 256
                && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
            if !name_ok || e.len() > 32 << 10 || e.contains('\0') {
                return Err(format!("config: Env entry {name:?} malformed or too long"));
            }
            env.push(e.to_string());
        }
    }
    let working_dir = match c["WorkingDir"].as_str() {
        None | Some("") => None,
        Some(w) if crate::recipe::image_path(w).is_some() || w == "/" => Some(w.to_string()),
        Some(w) => {
            return Err(format!(
                "config: WorkingDir {w:?} is not an absolute, normal path"
            ))
        }
    };
    Ok((env, working_dir))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_job_config_env_and_workdir() {
        let (env, wd) = job_config(
            br#"{"config":{"Env":["PATH=/usr/bin","A=b=c"],"WorkingDir":"/srv/app","Entrypoint":["x"]}}"#,
        )
        .expect("config");
        assert_eq!(env, ["PATH=/usr/bin", "A=b=c"]);
        assert_eq!(wd.as_deref(), Some("/srv/app"));
        assert!(job_config(br#"{"config":{"Env":["noequals"]}}"#).is_err());
        assert!(job_config(br#"{"config":{"WorkingDir":"../x"}}"#).is_err());
        assert_eq!(job_config(br#"{}"#).expect("empty"), (vec![], None));
    }

    #[test]
    fn test_job_config_env_fits_an_exec_request() {
        // Every exec carries the image's Env: one that could never fit in an exec request
        // (1024 variables and 1 MiB at most, the job's own included) is refused at pull.
        let entries = |n: usize, len: usize| {
            let list: Vec<String> = (0..n)
                .map(|i| format!("V{i}={}", "x".repeat(len)))
                .collect();
            serde_json::to_vec(&serde_json::json!({"config": {"Env": list}})).expect("json")
        };
        assert!(job_config(&entries(MAX_IMAGE_ENV, 10)).is_ok());
        let e = job_config(&entries(MAX_IMAGE_ENV + 1, 10)).expect_err("count");
        assert!(e.contains("Env"), "{e}");
        let e = job_config(&entries(40, 30 << 10)).expect_err("bytes");
        assert!(e.contains("Env"), "{e}");
    }

    #[tokio::test]
    async fn test_timed_out_pull_waits_for_its_blocking_steps() {
        // A step (mkfs, the kernel stage) still running when the deadline passes: the pull
        // returns only after it ended, so nothing writes into the removed work directory.
        let steps = BlockingSteps::default();
        let ended = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let ended2 = ended.clone();
        let mut progress = |_: BuildProgress| {};
        let out = steps
            .run(Duration::from_millis(20), async {
                blocking_with_progress(&steps, &mut progress, move |_| {
                    std::thread::sleep(Duration::from_millis(500));
                    ended2.store(true, std::sync::atomic::Ordering::SeqCst);
                    Ok(())
                })
                .await
            })
            .await;
        assert!(out.is_none(), "the deadline passed");
        assert!(
            ended.load(std::sync::atomic::Ordering::SeqCst),
            "returned while a blocking step still ran"
        );
    }

    #[test]
    fn test_unpack_layer_stops_at_the_deadline() {
        // A gzip layer of 256 MiB of zeros (a bomb stands in for any slow layer): with the
        // deadline passed, the unpack stops at once instead of running on in the background.
        let dir = tempfile::tempdir().expect("tempdir");
        let layer = dir.path().join("layer");
        let mut gz = flate2::write::GzEncoder::new(
            std::fs::File::create(&layer).expect("create"),
            flate2::Compression::fast(),
        );
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(tar::EntryType::Regular);
        h.set_size(256 << 20);
        h.set_mode(0o644);
        h.set_path("big").expect("path");
        h.set_cksum();
        std::io::Write::write_all(&mut gz, h.as_bytes()).expect("header");
        std::io::copy(&mut std::io::repeat(0).take(256 << 20), &mut gz).expect("zeros");
        gz.finish().expect("finish");
        let root = dir.path().join("root");
        std::fs::create_dir(&root).expect("mkdir");
        let opts = crate::unpack::Options {
            max_bytes: u64::MAX,
            block: 0,
            max_entries: 10,
            keep_owner: false,
            keep_sticky: false,
            whiteouts: true,
            mode_mask: 0,
            dir_mode_set: 0,
            only_in: None,
        };
        let mut done = crate::unpack::Unpacked::default();
        let started = Instant::now();
        let e = unpack_layer(
            &layer,
            Compression::Gzip,
            &root,
            &opts,
            Instant::now(),
            &mut done,
        )
        .expect_err("deadline");
        assert!(e.contains("deadline"), "{e}");
        assert_eq!(done.bytes, 0);
        assert!(started.elapsed() < Duration::from_secs(30));
    }

    /// A zstd frame (no checksum, no content size) with `window` as its window descriptor
    /// byte, holding `data` in raw blocks.
    fn zstd_frame(window: u8, data: &[u8]) -> Vec<u8> {
        let mut out = vec![0x28, 0xb5, 0x2f, 0xfd, 0x00, window];
        let chunks: Vec<&[u8]> = if data.is_empty() {
            vec![&[][..]]
        } else {
            data.chunks(128 << 10).collect()
        };
        for (i, c) in chunks.iter().enumerate() {
            let last = u32::from(i + 1 == chunks.len());
            let h = last | ((c.len() as u32) << 3);
            out.extend_from_slice(&h.to_le_bytes()[..3]);
            out.extend_from_slice(c);
        }
        out
    }

    fn tar_of(files: &[(&str, &[u8])], end: bool) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        for (name, data) in files {
            let mut h = tar::Header::new_gnu();
            h.set_entry_type(tar::EntryType::Regular);
            h.set_size(data.len() as u64);
            h.set_mode(0o644);
            b.append_data(&mut h, name, *data).expect("append");
        }
        if end {
            b.into_inner().expect("tar")
        } else {
            b.get_ref().clone()
        }
    }

    fn unpack_bytes(
        bytes: &[u8],
        compression: Compression,
    ) -> (tempfile::TempDir, Result<(), String>) {
        let dir = tempfile::tempdir().expect("tempdir");
        let layer = dir.path().join("layer");
        std::fs::write(&layer, bytes).expect("write");
        let root = dir.path().join("root");
        std::fs::create_dir(&root).expect("mkdir");
        let opts = crate::unpack::Options {
            max_bytes: u64::MAX,
            block: 0,
            max_entries: 100,
            keep_owner: false,
            keep_sticky: false,
            whiteouts: true,
            mode_mask: 0,
            dir_mode_set: 0,
            only_in: None,
        };
        let mut done = crate::unpack::Unpacked::default();
        let deadline = Instant::now() + Duration::from_secs(600);
        let r = unpack_layer(&layer, compression, &root, &opts, deadline, &mut done);
        (dir, r)
    }

    #[test]
    fn test_zstd_layer_window_bounded_and_every_frame_read() {
        // A window the decoder would keep in memory whole: 2 TiB declared, refused.
        let tar = tar_of(&[("a", b"first")], true);
        let (_d, r) = unpack_bytes(&zstd_frame(0xf8, &tar), Compression::Zstd);
        let e = r.expect_err("huge window");
        assert!(e.contains("window"), "{e}");
        // A layer of two frames (as concatenating encoders write): both are unpacked.
        let first = tar_of(&[("a", b"first")], false);
        let whole = tar_of(&[("a", b"first"), ("b", b"second")], true);
        let mut layer = zstd_frame(0x68, &first);
        layer.extend(zstd_frame(0x68, &whole[first.len()..]));
        let (d, r) = unpack_bytes(&layer, Compression::Zstd);
        r.expect("two frames");
        assert_eq!(
            std::fs::read(d.path().join("root/b")).expect("b"),
            b"second"
        );
        // Frames from an encoder (compressed blocks, a checksum), the tar split across two.
        let big = vec![7u8; 3 << 20];
        let whole = tar_of(&[("c", &big), ("d", b"tail")], true);
        let cut = 1 << 20;
        let mut layer = ruzstd::encoding::compress_to_vec(
            &whole[..cut],
            ruzstd::encoding::CompressionLevel::Fastest,
        );
        layer.extend(ruzstd::encoding::compress_to_vec(
            &whole[cut..],
            ruzstd::encoding::CompressionLevel::Fastest,
        ));
        let (d, r) = unpack_bytes(&layer, Compression::Zstd);
        r.expect("encoded frames");
        assert_eq!(std::fs::read(d.path().join("root/c")).expect("c"), big);
        assert_eq!(std::fs::read(d.path().join("root/d")).expect("d"), b"tail");
    }

    #[test]
    fn test_gzip_layer_every_member_read() {
        let first = tar_of(&[("a", b"first")], false);
        let whole = tar_of(&[("a", b"first"), ("b", b"second")], true);
        let mut layer = Vec::new();
        for part in [&first[..], &whole[first.len()..]] {
            let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
            std::io::Write::write_all(&mut gz, part).expect("gz");
            layer.extend(gz.finish().expect("finish"));
        }
        let (d, r) = unpack_bytes(&layer, Compression::Gzip);
        r.expect("two members");
        assert_eq!(
            std::fs::read(d.path().join("root/b")).expect("b"),
            b"second"
        );
    }
}
