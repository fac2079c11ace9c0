//! Building images: the expensive, agent-independent *stage* (debootstrap rootfs, kernel,
//! modules) and the cheap *assembly* of an image from a stage plus an agent binary.
//!
//! Stage build steps, in order (run on the caller's thread, progress via callback):
//! 0. Agent CLIs (`agents` recipe): fetch their npm tarballs on the host and verify them
//!    against the recipe's pins (`agent_cli::fetch`), before anything slow.
//! 1. `debootstrap --variant=minbase <suite>` into `<tmp>/root` (log: `<tmp>/build.log`).
//! 2. `apt-get install --no-install-recommends` of the recipe's extra packages in a chroot,
//!    the recipe's links (`fd` for Debian's `fdfind`), then the agent CLIs unpacked under `/usr/local/lib/warren-agents` and linked into
//!    `/usr/local/bin` (`agent_cli::install`).
//! 3. Kernel: resolve + download the cloud kernel `.deb` with the chroot's apt, unpack it,
//!    extract `vmlinux`, `depmod`, decompress the needed modules to plain `.ko`.
//! 4. Root tree: drop apt caches/lists, add `user` (1000:1000), `/workspace` (1000:1000 0755).
//! 5. `mkfs.ext4 -d` into a sparse image of the recipe's size; the tree is then deleted.
//! 6. Hash, record identities in `stage.json`, rename the temp dir to `stages/<digest>`.
//!
//! Invariant: a directory under `stages/` whose name is a digest is complete (it only appears
//! by rename); temp dirs start with `.` and are removed on failure.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde::{Deserialize, Serialize};

use crate::command::{run_logged, run_output};
use crate::digest::{self, FileIdentity};
use crate::initramfs::BaseInitramfs;
use crate::kernel;
use crate::manifest::{
    FileDigest, Manifest, VerifiedRecord, INITRAMFS_FILE, MANIFEST_FILE, MANIFEST_FORMAT,
    ROOTFS_FILE, VMLINUX_FILE,
};
use crate::recipe::{self, Recipe};
use crate::store::{set_mode, BuildProgress};
use crate::tree::Tree;
use crate::ImageError;
use crate::{agent_cli, chroot, python};

/// Record of a finished stage (`stage.json`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StageRecord {
    pub recipe: String,
    pub stage_digest: String,
    pub kernel_release: String,
    pub kernel_package: String,
    /// Plain `.ko` file names under `modules/`, in load order.
    pub modules: Vec<String>,
    pub rootfs_virtual_size: u64,
    /// Digest and identity at hashing time of `vmlinux` and `rootfs.ext4`.
    pub files: BTreeMap<String, (FileDigest, FileIdentity)>,
}

const STAGE_FILE: &str = "stage.json";
const LOG_FILE: &str = "build.log";

/// Loads the stage for `recipe` from `stages_dir`, building it if it is missing (npm tarballs
/// are cached in `downloads_dir`).
pub fn ensure_stage(
    stages_dir: &Path,
    downloads_dir: &Path,
    recipe: &Recipe,
    progress: &mut dyn FnMut(BuildProgress),
) -> Result<(PathBuf, StageRecord), ImageError> {
    let digest = recipe.stage_digest();
    let dir = stages_dir.join(&digest);
    if dir.join(STAGE_FILE).is_file() {
        let path = dir.join(STAGE_FILE);
        let bytes = std::fs::read(&path).map_err(ImageError::io("read", &path))?;
        let rec: StageRecord =
            serde_json::from_slice(&bytes).map_err(|e| ImageError::Manifest {
                path: path.clone(),
                reason: e.to_string(),
            })?;
        progress(BuildProgress::new(
            "stage",
            format!("reusing cached stage {}", &digest[..12]),
        ));
        return Ok((dir, rec));
    }
    let tmp = tempfile::Builder::new()
        .prefix(".stage-")
        .tempdir_in(stages_dir)
        .map_err(ImageError::io("create temp dir in", stages_dir))?;
    // The temp dir is never dropped as a `TempDir`: a failed debootstrap may leave mounts
    // inside it, and a recursive delete must not descend into them.
    let work = tmp.keep();
    let rec = match build_stage(&work, downloads_dir, recipe, &digest, progress) {
        Ok(rec) => rec,
        Err(e) => {
            let e = keep_failed_log(stages_dir, recipe, &work, e);
            cleanup_work_dir(&work);
            return Err(e);
        }
    };
    let kept = work;
    if let Err(e) = std::fs::rename(&kept, &dir) {
        cleanup_work_dir(&kept);
        return Err(ImageError::io("rename", &dir)(e));
    }
    Ok((dir, rec))
}

/// Copies the failed build's log to `<stages_dir>/<recipe>-failed.log` (the work dir is about
/// to be deleted) and points the error at the copy.
fn keep_failed_log(stages_dir: &Path, recipe: &Recipe, work: &Path, e: ImageError) -> ImageError {
    let kept = stages_dir.join(format!("{}-failed.log", recipe.name()));
    if std::fs::copy(work.join(LOG_FILE), &kept).is_err() {
        return e;
    }
    match e {
        ImageError::Debootstrap {
            status, log_tail, ..
        } => ImageError::Debootstrap {
            status,
            log: kept,
            log_tail,
        },
        ImageError::Packages {
            status, log_tail, ..
        } => ImageError::Packages {
            status,
            log: kept,
            log_tail,
        },
        other => other,
    }
}

/// Mount points at or below `dir`, deepest first (from `/proc/self/mountinfo`).
fn mounts_under(dir: &Path) -> Vec<PathBuf> {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return Vec::new();
    };
    let mut out: Vec<PathBuf> = info
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        // mountinfo escapes spaces etc. as octal; our temp paths contain none.
        .map(PathBuf::from)
        .filter(|m| m.starts_with(dir))
        .collect();
    out.sort_by_key(|m| std::cmp::Reverse(m.components().count()));
    out
}

/// Removes a failed build's work dir. Mounts left inside it (debootstrap mounts /proc and
/// /sys in the target) are lazily unmounted first; if any survive, the dir is left in place
/// (with a warning) rather than recursing into a live filesystem.
pub(crate) fn cleanup_work_dir(work: &Path) {
    for m in mounts_under(work) {
        let _ = Command::new("umount").arg("-l").arg(&m).status();
    }
    let left = mounts_under(work);
    if !left.is_empty() {
        tracing::warn!(dir = %work.display(), mounts = ?left, "leaving build dir with mounts in place");
        return;
    }
    if let Err(e) = std::fs::remove_dir_all(work) {
        tracing::warn!(dir = %work.display(), error = %e, "cannot remove build dir");
    }
}

/// Removes leftover `.stage-*` dirs of builds that crashed (the caller holds the build lock,
/// so none of them is in use).
pub(crate) fn cleanup_stale(dir: &Path, prefix: &str) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        if e.file_name().to_string_lossy().starts_with(prefix) {
            cleanup_work_dir(&e.path());
        }
    }
}

fn build_stage(
    work: &Path,
    downloads: &Path,
    recipe: &Recipe,
    digest: &str,
    progress: &mut dyn FnMut(BuildProgress),
) -> Result<StageRecord, ImageError> {
    set_mode(work, 0o755)?;
    let root = work.join("root");
    let log = work.join(LOG_FILE);
    let started = std::time::Instant::now();

    // 0. Agent CLI tarballs, verified against their pins.
    let registry = agent_cli::registry();
    let mut tarballs = Vec::new();
    for cli in recipe.agent_clis() {
        progress(BuildProgress::new(
            "agents",
            format!("fetching {} from {registry}", cli.spec()),
        ));
        tarballs.push((cli, agent_cli::fetch(cli, downloads, &registry)?));
    }
    // ... and Python wheels, verified against theirs.
    let index = python::index();
    let mut wheels = Vec::new();
    for p in recipe.python() {
        progress(BuildProgress::new(
            "python",
            format!("fetching {}=={} from {index}", p.name, p.version),
        ));
        wheels.push((p.clone(), python::fetch(p, downloads, &index)?));
    }

    // 1. debootstrap.
    progress(BuildProgress::new(
        "debootstrap",
        format!(
            "{} {} (log {})",
            recipe::SUITE,
            recipe::MIRROR,
            log.display()
        ),
    ));
    let mut cmd = Command::new("debootstrap");
    cmd.args(["--variant=minbase", recipe::SUITE])
        .arg(&root)
        .arg(recipe::MIRROR);
    let mut summary = LineSummary::new("debootstrap");
    run_logged(cmd, &log, &mut |line| summary.line(line, progress))?.map_err(|f| {
        ImageError::Debootstrap {
            status: f.status,
            log: log.clone(),
            log_tail: f.log_tail,
        }
    })?;
    progress(BuildProgress::new(
        "debootstrap",
        format!("done in {:.0?}", started.elapsed()),
    ));

    // 2. Extra packages.
    let packages = recipe.packages();
    if !packages.is_empty() {
        let apt = ["apt-get", "-q", "-y", "--no-install-recommends", "install"];
        let items: Vec<&str> = packages.iter().map(String::as_str).collect();
        chroot_install(&root, &log, "packages", &apt, &items, progress)?;
    }
    let tree = Tree::open(&root).map_err(setup_err)?;
    for (link, target) in recipe.links() {
        let rel = link.trim_start_matches('/');
        if !tree
            .exists(target.trim_start_matches('/'))
            .map_err(setup_err)?
        {
            return Err(ImageError::RootfsSetup(format!(
                "link {link}: {target} is not in the image after the packages"
            )));
        }
        tree.symlink(rel, target).map_err(setup_err)?;
    }
    for (cli, tarball) in &tarballs {
        let bytes = agent_cli::install(cli, tarball, &root)?;
        progress(BuildProgress::new(
            "agents",
            format!(
                "/usr/local/bin/{} from {} ({} MiB)",
                cli.command,
                cli.spec(),
                bytes >> 20
            ),
        ));
    }

    if !wheels.is_empty() {
        progress(BuildProgress::new(
            "python",
            format!("pip install (offline) of {} wheel(s)", wheels.len()),
        ));
        python::install(&root, &wheels, &log, &mut |_| {})?;
    }
    for f in recipe.files() {
        progress(BuildProgress::new(
            "files",
            format!("{} ({} bytes, mode {:o})", f.dest, f.size, f.mode),
        ));
        tree.write(
            f.dest.trim_start_matches('/'),
            &f.content,
            f.mode,
            (f.uid, f.gid),
        )
        .map_err(setup_err)?;
    }
    for (i, c) in recipe.commands().iter().enumerate() {
        progress(BuildProgress::new(
            "commands",
            format!("{}/{}: {}", i + 1, recipe.commands().len(), first_line(c)),
        ));
        let argv = ["/bin/sh".to_string(), "-c".to_string(), c.clone()];
        chroot::run(&root, &argv, &log, &mut |_| {})?.map_err(|f| ImageError::Packages {
            status: format!("command {} ({})", i + 1, f.status),
            log: log.clone(),
            log_tail: f.log_tail,
        })?;
    }

    // 3. Kernel and modules.
    let kernel_package = kernel::resolve_kernel_package(&root, recipe::KERNEL_METAPACKAGE)?;
    progress(BuildProgress::new(
        "kernel",
        format!("downloading {kernel_package}"),
    ));
    let deb = kernel::download_package(&root, &kernel_package, work)?;
    let unpacked = work.join("kernel");
    kernel::unpack_deb(&deb, &unpacked)?;
    let k = kernel::locate(&unpacked)?;
    progress(BuildProgress::new(
        "kernel",
        format!("extracting vmlinux {}", k.release),
    ));
    let bz = std::fs::read(&k.bzimage).map_err(ImageError::io("read", &k.bzimage))?;
    let vmlinux = kernel::extract_vmlinux(&bz)?;
    let vmlinux_path = work.join(VMLINUX_FILE);
    std::fs::write(&vmlinux_path, &vmlinux).map_err(ImageError::io("write", &vmlinux_path))?;
    drop((bz, vmlinux));

    kernel::depmod(&k)?;
    let read = |name: &str| {
        let p = k.modules_dir.join(name);
        std::fs::read_to_string(&p).map_err(ImageError::io("read", p))
    };
    let order = kernel::load_order(
        &read("modules.dep")?,
        &read("modules.builtin").unwrap_or_default(),
        recipe::AGENT_MODULES,
    )?;
    let modules_out = work.join("modules");
    std::fs::create_dir(&modules_out).map_err(ImageError::io("create", &modules_out))?;
    let mut modules = Vec::new();
    for dep_path in &order {
        let plain = kernel::read_module_plain(&k.modules_dir.join(dep_path))?;
        let name = kernel::plain_file_name(dep_path);
        let dest = modules_out.join(&name);
        std::fs::write(&dest, plain).map_err(ImageError::io("write", &dest))?;
        set_mode(&dest, 0o444)?;
        modules.push(name);
    }
    progress(BuildProgress::new("modules", modules.join(" ")));
    remove_all(&unpacked)?;
    std::fs::remove_file(&deb).map_err(ImageError::io("remove", &deb))?;

    // 4. Root tree.
    progress(BuildProgress::new(
        "rootfs",
        "user, /workspace, apt cleanup".to_string(),
    ));
    clean_apt(&root)?;
    finish_root(&root)?;

    // 5. mkfs.ext4.
    let rootfs = work.join(ROOTFS_FILE);
    let size = recipe.rootfs_size();
    make_ext4(&root, &rootfs, size, progress)?;
    remove_all(&root)?;

    // 6. Hash and record.
    progress(BuildProgress::new(
        "digest",
        "hashing vmlinux and rootfs".to_string(),
    ));
    let mut files = BTreeMap::new();
    for name in [VMLINUX_FILE, ROOTFS_FILE] {
        let p = work.join(name);
        set_mode(&p, 0o444)?;
        let sha256 = digest::sha256_file(&p)?;
        let id = FileIdentity::of(&p)?;
        files.insert(
            name.to_string(),
            (
                FileDigest {
                    sha256,
                    size: id.size,
                },
                id,
            ),
        );
    }
    let rec = StageRecord {
        recipe: recipe.name().to_string(),
        stage_digest: digest.to_string(),
        kernel_release: k.release,
        kernel_package,
        modules,
        rootfs_virtual_size: size,
        files,
    };
    let path = work.join(STAGE_FILE);
    std::fs::write(&path, digest::canonical_json(&rec)).map_err(ImageError::io("write", &path))?;
    progress(BuildProgress::new(
        "stage",
        format!("built in {:.0?}", started.elapsed()),
    ));
    Ok(rec)
}

/// `mkfs.ext4 -d root` into a sparse image of `size` bytes at `out`.
pub(crate) fn make_ext4(
    root: &Path,
    out: &Path,
    size: u64,
    progress: &mut dyn FnMut(BuildProgress),
) -> Result<(), ImageError> {
    progress(BuildProgress::new(
        "mkfs",
        format!("ext4 {} MiB from {}", size >> 20, root.display()),
    ));
    let mut cmd = Command::new("mkfs.ext4");
    cmd.args(["-q", "-F", "-d"])
        .arg(root)
        .args(["-L", "warren-root"])
        .arg(out)
        .arg(format!("{}k", size / 1024));
    run_output(cmd)?.map_err(|f| ImageError::Mkfs {
        status: f.status,
        output: f.log_tail,
    })?;
    Ok(())
}

/// Runs `command items...` in a chroot of `root`, logging to `log` and summarising progress
/// as `phase`.
fn chroot_install(
    root: &Path,
    log: &Path,
    phase: &'static str,
    command: &[&str],
    items: &[&str],
    progress: &mut dyn FnMut(BuildProgress),
) -> Result<(), ImageError> {
    progress(BuildProgress::new(phase, items.join(" ")));
    let mut cmd = Command::new("chroot");
    cmd.arg(root)
        .args(command)
        .args(items)
        .env("DEBIAN_FRONTEND", "noninteractive")
        .env("LC_ALL", "C")
        .env("HOME", "/root");
    let mut summary = LineSummary::new(phase);
    run_logged(cmd, log, &mut |line| summary.line(line, progress))?.map_err(|f| {
        ImageError::Packages {
            status: f.status,
            log: log.to_path_buf(),
            log_tail: f.log_tail,
        }
    })
}

fn remove_all(p: &Path) -> Result<(), ImageError> {
    std::fs::remove_dir_all(p).map_err(ImageError::io("remove", p))
}

/// Empties a directory without removing it.
fn clear_dir(dir: &Path, keep: &[&str]) -> Result<(), ImageError> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Ok(());
    };
    for e in entries {
        let e = e.map_err(ImageError::io("read dir", dir))?;
        if keep.iter().any(|k| e.file_name() == *k) {
            continue;
        }
        let p = e.path();
        let ft = e.file_type().map_err(ImageError::io("stat", &p))?;
        if ft.is_dir() {
            remove_all(&p)?;
        } else {
            std::fs::remove_file(&p).map_err(ImageError::io("remove", &p))?;
        }
    }
    Ok(())
}

/// Drops apt's caches, lists and logs from a debootstrapped tree.
fn clean_apt(root: &Path) -> Result<(), ImageError> {
    clear_dir(&root.join("var/lib/apt/lists"), &["partial", "lock"])?;
    clear_dir(&root.join("var/lib/apt/lists/partial"), &[])?;
    clear_dir(&root.join("var/cache/apt/archives"), &["partial", "lock"])?;
    clear_dir(&root.join("var/cache/apt/archives/partial"), &[])?;
    for f in [
        "var/cache/apt/pkgcache.bin",
        "var/cache/apt/srcpkgcache.bin",
    ] {
        let _ = std::fs::remove_file(root.join(f));
    }
    clear_dir(&root.join("var/log/apt"), &[])?;
    let _ = std::fs::remove_file(root.join("var/log/dpkg.log"));
    let _ = std::fs::remove_file(root.join("var/log/bootstrap.log"));
    Ok(())
}

fn setup_err(e: crate::tree::TreeError) -> ImageError {
    ImageError::RootfsSetup(e.to_string())
}

fn first_line(c: &str) -> String {
    let line = c.lines().next().unwrap_or("");
    let mut out: String = line.chars().take(80).collect();
    if out.len() < c.len() {
        out.push_str(" ...");
    }
    out
}

/// Largest account file read.
const MAX_ACCOUNT_FILE: u64 = 4 << 20;

/// Adds what Warren needs in every root tree: the guest user `user` (1000:1000, an account
/// in `/etc/passwd`, `group`, `shadow`, `gshadow`, home `/home/user` from `/etc/skel`) and
/// `/workspace` (1000:1000, 0755). Every path is opened beneath the tree without following
/// symlinks ([`Tree`]): the tree may be an untrusted image's.
pub(crate) fn finish_root(root: &Path) -> Result<(), ImageError> {
    let tree = Tree::open(root).map_err(setup_err)?;
    let uid = recipe::USER_ID;
    for (file, line, mode) in [
        (
            "etc/passwd",
            format!("user:x:{uid}:{uid}:Warren user:/home/user:/bin/bash"),
            0o644,
        ),
        ("etc/group", format!("user:x:{uid}:"), 0o644),
        ("etc/shadow", "user:!::0:99999:7:::".to_string(), 0o640),
        ("etc/gshadow", "user:!::".to_string(), 0o640),
    ] {
        add_line(&tree, file, &line, mode)?;
    }
    tree.mkdir("home/user", 0o755, (uid, uid))
        .map_err(setup_err)?;
    if let Ok(names) = tree.list("etc/skel") {
        for name in names {
            let Ok(name) = String::from_utf8(name) else {
                continue;
            };
            // Regular files only: anything else is refused by the read and left out.
            if let Ok(Some(data)) = tree.read(&format!("etc/skel/{name}"), MAX_ACCOUNT_FILE) {
                tree.write(&format!("home/user/{name}"), &data, 0o644, (uid, uid))
                    .map_err(setup_err)?;
            }
        }
    }
    tree.mkdir("workspace", 0o755, (uid, uid))
        .map_err(setup_err)
}

/// Appends `line` to an `/etc` account file unless an entry with the same name exists (a
/// missing file is made with `mode`, owned by root; an existing one keeps its mode).
fn add_line(tree: &Tree, rel: &str, line: &str, mode: u32) -> Result<(), ImageError> {
    let mut text = match tree.read(rel, MAX_ACCOUNT_FILE).map_err(setup_err)? {
        Some(b) => String::from_utf8(b)
            .map_err(|_| ImageError::RootfsSetup(format!("/{rel} is not UTF-8")))?,
        None => String::new(),
    };
    let name = line.split(':').next().unwrap_or(line);
    if let Some(existing) = text.lines().find(|l| l.split(':').next() == Some(name)) {
        // An image made from a Warren image has the entry already: the same one is kept.
        let same_ids = |a: &str, b: &str| {
            a.split(':')
                .skip(2)
                .take(2)
                .eq(b.split(':').skip(2).take(2))
        };
        if existing == line
            || (rel.ends_with("passwd") || rel.ends_with("group")) && same_ids(existing, line)
        {
            return Ok(());
        }
        return Err(ImageError::RootfsSetup(format!(
            "/{rel} already has an entry {name:?}"
        )));
    }
    if !text.is_empty() && !text.ends_with('\n') {
        text.push('\n');
    }
    text.push_str(line);
    text.push('\n');
    let (mode, owner) = match tree.stat(rel).map_err(setup_err)? {
        Some(st) => (st.mode & 0o7777, (st.uid, st.gid)),
        None => (mode, (0, 0)),
    };
    tree.write(rel, text.as_bytes(), mode, owner)
        .map_err(setup_err)
}

/// Summarises debootstrap/apt output into a few progress events: one per phase change
/// (`Retrieving`, `Extracting`, `Unpacking`, `Configuring`, `Setting up`...) and one per
/// 25 packages within a phase.
struct LineSummary {
    step: &'static str,
    phase: String,
    count: usize,
}

impl LineSummary {
    fn new(step: &'static str) -> Self {
        LineSummary {
            step,
            phase: String::new(),
            count: 0,
        }
    }

    fn line(&mut self, line: &str, progress: &mut dyn FnMut(BuildProgress)) {
        let body = line.strip_prefix("I: ").unwrap_or(line).trim();
        let mut words = body.split_whitespace();
        let verb = match (words.next(), words.next()) {
            (Some("Setting"), Some("up")) => "Setting up",
            (Some(w), _) if w.starts_with("Get:") => "Downloading",
            (Some(w), Some(_)) => match w {
                "Retrieving" | "Validating" | "Extracting" | "Installing" | "Unpacking"
                | "Configuring" | "Processing" => w,
                _ => return,
            },
            _ => return,
        }
        .to_string();
        if verb != self.phase {
            if self.count > 0 {
                progress(BuildProgress::new(
                    self.step,
                    format!("{} {} packages", self.phase, self.count),
                ));
            }
            self.phase = verb;
            self.count = 0;
            progress(BuildProgress::new(self.step, body.to_string()));
        }
        self.count += 1;
        if self.count.is_multiple_of(25) {
            progress(BuildProgress::new(
                self.step,
                format!("{} ... {}", self.phase, self.count),
            ));
        }
    }
}

/// Assembles an image from a stage and an agent into `out` (a fresh temp dir inside the
/// image store) and returns the manifest. The caller renames `out` to the image id.
/// What an image is assembled for.
pub enum Assembly<'a> {
    /// A recipe build: the kernel and the root filesystem come from the recipe's stage.
    Recipe(&'a Recipe),
    /// A pulled image: the kernel comes from the kernel stage, the root filesystem is
    /// already in the output directory with this digest and identity.
    Oci {
        source: Box<crate::manifest::OciSource>,
        recipe_digest: String,
        rootfs: (FileDigest, FileIdentity),
        rootfs_virtual_size: u64,
    },
}

pub fn assemble(
    stage_dir: &Path,
    stage: &StageRecord,
    kind: Assembly<'_>,
    agent: &Path,
    agent_sha256: &str,
    out: &Path,
    progress: &mut dyn FnMut(BuildProgress),
) -> Result<Manifest, ImageError> {
    progress(BuildProgress::new(
        "initramfs",
        format!("agent {}", agent.display()),
    ));
    let agent_bytes = std::fs::read(agent).map_err(ImageError::io("read", agent))?;
    if digest::sha256_hex(&agent_bytes) != agent_sha256 {
        return Err(ImageError::InvalidInput(format!(
            "agent {} changed during the build",
            agent.display()
        )));
    }
    let mut modules = Vec::new();
    for name in &stage.modules {
        let p = stage_dir.join("modules").join(name);
        let bytes = std::fs::read(&p).map_err(ImageError::io("read", &p))?;
        modules.push((name.clone(), bytes));
    }
    let cpio = BaseInitramfs {
        agent: &agent_bytes,
        modules: &modules,
    }
    .to_bytes();
    let initramfs = out.join(INITRAMFS_FILE);
    std::fs::write(&initramfs, &cpio).map_err(ImageError::io("write", &initramfs))?;
    set_mode(&initramfs, 0o444)?;

    let mut files = BTreeMap::new();
    let mut record = VerifiedRecord::default();
    files.insert(
        INITRAMFS_FILE.to_string(),
        FileDigest {
            sha256: digest::sha256_hex(&cpio),
            size: cpio.len() as u64,
        },
    );
    record
        .files
        .insert(INITRAMFS_FILE.to_string(), FileIdentity::of(&initramfs)?);

    // Stage files are shared by hard link (read-only, same inode); fall back to a sparse copy
    // across filesystems. Their digests are reused if the identity is unchanged.
    let from_stage: &[&str] = match &kind {
        Assembly::Recipe(_) => &[VMLINUX_FILE, ROOTFS_FILE],
        Assembly::Oci { rootfs, .. } => {
            files.insert(ROOTFS_FILE.to_string(), rootfs.0.clone());
            record.files.insert(ROOTFS_FILE.to_string(), rootfs.1);
            &[VMLINUX_FILE]
        }
    };
    for name in from_stage.iter().copied() {
        let src = stage_dir.join(name);
        let dst = out.join(name);
        if std::fs::hard_link(&src, &dst).is_err() {
            progress(BuildProgress::new("install", format!("copying {name}")));
            let mut cmd = Command::new("cp");
            cmd.arg("--sparse=always").arg(&src).arg(&dst);
            run_output(cmd)?
                .map_err(|f| ImageError::io("copy", &dst)(std::io::Error::other(f.log_tail)))?;
            set_mode(&dst, 0o444)?;
        }
        let (recorded, recorded_id) =
            stage.files.get(name).ok_or_else(|| ImageError::Manifest {
                path: stage_dir.join(STAGE_FILE),
                reason: format!("no entry for {name}"),
            })?;
        let id = FileIdentity::of(&dst)?;
        if id != *recorded_id {
            progress(BuildProgress::new("digest", format!("verifying {name}")));
            digest::verify_file(&dst, &recorded.sha256)?;
        }
        files.insert(name.to_string(), recorded.clone());
        record.files.insert(name.to_string(), id);
    }

    let (recipe, recipe_digest, rootfs_virtual_size, oci) = match kind {
        Assembly::Recipe(r) => (
            r.name().to_string(),
            r.recipe_digest(agent_sha256),
            stage.rootfs_virtual_size,
            None,
        ),
        Assembly::Oci {
            source,
            recipe_digest,
            rootfs_virtual_size,
            ..
        } => (
            recipe::OCI_RECIPE.to_string(),
            recipe_digest,
            rootfs_virtual_size,
            Some(*source),
        ),
    };
    let manifest = Manifest {
        format: MANIFEST_FORMAT,
        recipe,
        recipe_digest,
        stage_digest: stage.stage_digest.clone(),
        agent_sha256: agent_sha256.to_string(),
        kernel_release: stage.kernel_release.clone(),
        kernel_package: stage.kernel_package.clone(),
        modules: stage.modules.clone(),
        created_unix: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        rootfs_virtual_size,
        files,
        oci,
    };
    let mpath = out.join(MANIFEST_FILE);
    std::fs::write(&mpath, manifest.canonical_bytes()).map_err(ImageError::io("write", &mpath))?;
    set_mode(&mpath, 0o444)?;
    record.store(out)?;
    set_mode(out, 0o755)?;
    Ok(manifest)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_line_summary_apt_output_few_events() {
        let mut events = Vec::new();
        let mut s = LineSummary::new("packages");
        for i in 0..30 {
            s.line(
                &format!("Preparing to unpack .../{i}-pkg.deb ..."),
                &mut |p| events.push(p),
            );
            s.line(&format!("Unpacking pkg{i} (1.0) ..."), &mut |p| {
                events.push(p)
            });
        }
        s.line("Setting up pkg0 (1.0) ...", &mut |p| events.push(p));
        let details: Vec<&str> = events.iter().map(|e| e.detail.as_str()).collect();
        assert_eq!(
            details,
            [
                "Unpacking pkg0 (1.0) ...",
                "Unpacking ... 25",
                "Unpacking 30 packages",
                "Setting up pkg0 (1.0) ..."
            ]
        );
    }

    #[test]
    fn test_add_line_existing_user_rejected() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("passwd");
        std::fs::write(&p, "root:x:0:0:root:/root:/bin/bash").expect("write");
        let tree = Tree::open(dir.path()).expect("tree");
        add_line(
            &tree,
            "passwd",
            "user:x:1000:1000::/home/user:/bin/bash",
            0o600,
        )
        .expect("add");
        let text = std::fs::read_to_string(&p).expect("read");
        assert!(text.ends_with("\nuser:x:1000:1000::/home/user:/bin/bash\n"));
        assert!(add_line(&tree, "passwd", "user:x:1001:1001::/x:/bin/sh", 0o600).is_err());
        // The same entry again (an image made from a Warren image): kept as it is.
        add_line(
            &tree,
            "passwd",
            "user:x:1000:1000:Warren user:/home/user:/bin/bash",
            0o600,
        )
        .expect("same ids");
        assert_eq!(std::fs::read_to_string(&p).expect("read"), text);
    }

    #[test]
    fn test_finish_root_hostile_tree_writes_nothing_outside() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path().join("root");
        std::fs::create_dir_all(root.join("etc")).expect("mkdir");
        let victim = dir.path().join("victim");
        std::fs::write(&victim, "root:x:0:0::/:/bin/sh\n").expect("write");
        // An image whose /etc/passwd is a symlink to a host file and whose /workspace is a
        // symlink to a host directory.
        std::os::unix::fs::symlink(&victim, root.join("etc/passwd")).expect("link");
        std::os::unix::fs::symlink(dir.path(), root.join("workspace")).expect("link");
        assert!(finish_root(&root).is_err());
        assert_eq!(
            std::fs::read_to_string(&victim).expect("read"),
            "root:x:0:0::/:/bin/sh\n"
        );
    }
}
