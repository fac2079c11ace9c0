//! `TestVm`: a real VM booted under the host's accelerator (TCG on our machines) through the
//! `warren` binary, with a private state directory and the shared image store.
//!
//! The image store is `$WARREN_TEST_IMAGE_DIR` (set by `.ci/run`), falling back to
//! `target/test-images`; images are built on first use through the build cache, so after
//! `.ci/run`'s build step this costs nothing. `Drop` destroys the VM, checks that nothing is
//! left behind, and fails the test if the VM ended abnormally while the test did not expect it.
#![allow(dead_code)]

pub mod daemon;
pub mod registry;
pub mod wsclient;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::{Mutex, OnceLock};

pub const WARREN: &str = env!("CARGO_BIN_EXE_warren");

/// The repository's root.
pub fn repo() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
}

/// The Python of the venv holding the official MCP SDK, creating the venv first if needed
/// (`scripts/mcp-venv.sh`; idempotent, ~1 s when it exists).
pub fn mcp_python() -> PathBuf {
    let st = Command::new(repo().join("scripts/mcp-venv.sh"))
        .status()
        .expect("run scripts/mcp-venv.sh");
    assert!(st.success(), "scripts/mcp-venv.sh failed");
    let venv = std::env::var_os("WARREN_MCP_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/cache/warren-test/mcp-venv"));
    venv.join("bin/python")
}

pub fn image_dir() -> PathBuf {
    std::env::var_os("WARREN_TEST_IMAGE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../../target/test-images"
            ))
        })
}

/// Builds (or finds in the cache) the image for `recipe`, once per test process.
pub fn ensure_image(recipe: &str) {
    image_id(recipe);
}

/// The id of the image this build of Warren makes for `recipe` (built or found in the
/// cache once per test process). Tests boot by id: the shared image store may hold newer
/// images of the same recipe made by other builds, which a recipe name would pick.
pub fn image_id(recipe: &str) -> String {
    static IDS: OnceLock<Mutex<BTreeMap<String, String>>> = OnceLock::new();
    let ids = IDS.get_or_init(Default::default);
    let mut ids = ids.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(id) = ids.get(recipe) {
        return id.clone();
    }
    let id = build_image(recipe);
    ids.insert(recipe.to_string(), id.clone());
    id
}

/// `image` with a recipe name replaced by [`image_id`].
pub fn pinned_image(image: &str) -> String {
    if matches!(image, "minimal" | "dev" | "agents") {
        image_id(image)
    } else {
        image.to_string()
    }
}

fn build_image(recipe: &str) -> String {
    let state = tempfile::tempdir().expect("tempdir");
    let out = Command::new(WARREN)
        .args(["--state-dir"])
        .arg(state.path())
        .arg("--image-dir")
        .arg(image_dir())
        .args(["image", "build", "--recipe", recipe])
        .stderr(Stdio::inherit())
        .output()
        .expect("run warren image build");
    assert!(out.status.success(), "image build failed");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// A private state directory sharing the image store.
pub struct TestEnv {
    pub state: tempfile::TempDir,
    pub image_dir: PathBuf,
}

impl TestEnv {
    pub fn new() -> Self {
        Self::with_image_dir(image_dir())
    }

    /// An environment using its own image store.
    pub fn with_image_dir(image_dir: PathBuf) -> Self {
        TestEnv {
            state: tempfile::Builder::new()
                .prefix("warren-test-")
                .tempdir()
                .expect("tempdir"),
            image_dir,
        }
    }

    pub fn cmd(&self) -> Command {
        let mut c = Command::new(WARREN);
        c.arg("--state-dir")
            .arg(self.state.path())
            .arg("--image-dir")
            .arg(&self.image_dir)
            .env(
                "WARREN_ACCEL",
                std::env::var("WARREN_ACCEL").unwrap_or_else(|_| "auto".into()),
            );
        c
    }

    pub fn run(&self, args: &[&str]) -> Output {
        self.cmd().args(args).output().expect("run warren")
    }

    pub fn vm_dir(&self, id: &str) -> PathBuf {
        self.state.path().join("vms").join(id)
    }

    /// `vm create --image <image>`; panics with the CLI's message on failure. Returns the id.
    pub fn create_vm(&self, image: &str) -> String {
        self.create_vm_with(image, &[])
    }

    /// `vm create --image <image> <extra...>`.
    pub fn create_vm_with(&self, image: &str, extra: &[&str]) -> String {
        let image = pinned_image(image);
        let mut args = vec!["vm", "create", "--image", &image, "--json"];
        args.extend_from_slice(extra);
        let out = self.run(&args);
        assert!(
            out.status.success(),
            "vm create failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("create json");
        v["vm_id"].as_str().expect("vm_id").to_string()
    }

    /// The VM's record from `vm list --json`.
    pub fn record(&self, id: &str) -> Option<serde_json::Value> {
        let out = self.run(&["vm", "list", "--json"]);
        assert!(
            out.status.success(),
            "vm list: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("list json");
        v.as_array()
            .expect("array")
            .iter()
            .find(|r| r["id"] == id)
            .cloned()
    }
}

pub struct TestVm {
    pub env: TestEnv,
    pub id: String,
    /// The test kills or breaks the VM on purpose.
    pub expect_failure: bool,
    destroyed: bool,
}

pub struct Run {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
    pub raw_stdout: Vec<u8>,
}

impl TestVm {
    pub fn boot() -> TestVm {
        Self::boot_image("minimal")
    }

    pub fn boot_image(recipe: &str) -> TestVm {
        ensure_image(recipe);
        let env = TestEnv::new();
        let id = env.create_vm(recipe);
        TestVm {
            env,
            id,
            expect_failure: false,
            destroyed: false,
        }
    }

    /// Takes charge of a VM created some other way in `env` (destroyed on drop).
    pub fn adopt(env: TestEnv, id: String) -> TestVm {
        TestVm {
            env,
            id,
            expect_failure: false,
            destroyed: false,
        }
    }

    pub fn warren(&self, args: &[&str]) -> Output {
        self.env.run(args)
    }

    /// Runs `sh -c script` in the guest through `warren vm exec`.
    pub fn sh(&self, script: &str) -> Run {
        self.exec_args(&[], &["sh", "-c", script])
    }

    pub fn exec_args(&self, opts: &[&str], argv: &[&str]) -> Run {
        let mut args = vec!["vm", "exec", self.id.as_str()];
        args.extend_from_slice(opts);
        args.push("--");
        args.extend_from_slice(argv);
        let out = self.warren(&args);
        Run {
            code: out.status.code().unwrap_or(-1),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
            raw_stdout: out.stdout,
        }
    }

    /// Starts a job without waiting; returns its id.
    pub fn detach(&self, script: &str) -> u64 {
        let out = self.warren(&["vm", "exec", &self.id, "--detach", "--", "sh", "-c", script]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
        v["job_id"].as_u64().expect("job id")
    }

    /// `vm output` as JSON.
    pub fn output(&self, job: u64, extra: &[&str]) -> serde_json::Value {
        let j = job.to_string();
        let mut args = vec!["vm", "output", self.id.as_str(), j.as_str()];
        args.extend_from_slice(extra);
        let out = self.warren(&args);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).expect("output json")
    }

    /// Waits until the job completes (following the cursors so each read long-polls);
    /// returns its last page.
    pub fn wait_job(&self, job: u64) -> serde_json::Value {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(180);
        let (mut so, mut se) = (0u64, 0u64);
        while std::time::Instant::now() < deadline {
            let p = self.output(
                job,
                &[
                    "--wait-ms",
                    "2000",
                    "--encoding",
                    "base64",
                    "--stdout-cursor",
                    &so.to_string(),
                    "--stderr-cursor",
                    &se.to_string(),
                ],
            );
            if p["state"] == "completed" {
                return p;
            }
            so = p["next_cursor"]["stdout"].as_u64().expect("cursor");
            se = p["next_cursor"]["stderr"].as_u64().expect("cursor");
        }
        panic!("job {job} did not complete");
    }

    pub fn state(&self) -> String {
        self.env
            .record(&self.id)
            .map(|r| r["state"].as_str().unwrap_or("").to_string())
            .unwrap_or_else(|| "gone".into())
    }

    /// Pid of this VM's QEMU (its `-name` carries the VM id).
    pub fn qemu_pids(&self) -> Vec<i32> {
        pids_matching(&format!("process=warren-{}", self.id))
    }

    pub fn supervisor_pid(&self) -> i32 {
        std::fs::read_to_string(self.env.vm_dir(&self.id).join("supervisor.lock"))
            .expect("lock file")
            .trim()
            .parse()
            .expect("pid")
    }

    pub fn cgroup_dir(&self) -> Option<PathBuf> {
        ["/sys/fs/cgroup/unified/warren", "/sys/fs/cgroup/warren"]
            .iter()
            .map(|r| Path::new(r).join(&self.id))
            .find(|p| p.parent().map(|x| x.exists()).unwrap_or(false))
    }

    /// Destroys the VM and asserts nothing of it remains.
    pub fn destroy(mut self) {
        self.destroy_inner();
    }

    fn destroy_inner(&mut self) {
        if self.destroyed {
            return;
        }
        self.destroyed = true;
        let state = self.state();
        let out = self.warren(&["vm", "destroy", &self.id]);
        assert!(
            out.status.success(),
            "destroy failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            !self.env.vm_dir(&self.id).exists(),
            "VM directory left behind"
        );
        assert!(self.qemu_pids().is_empty(), "QEMU left running");
        if let Some(cg) = self.cgroup_dir() {
            assert!(!cg.exists(), "cgroup left behind: {}", cg.display());
        }
        if !self.expect_failure {
            assert_eq!(state, "running", "the VM ended abnormally");
        }
    }
}

impl Drop for TestEnv {
    /// Destroys whatever VM a test left in its state directory (sessions' VMs, VMs of a test
    /// that failed half-way), so no supervisor outlives the directory it runs from.
    fn drop(&mut self) {
        let Ok(out) = self.cmd().args(["vm", "list", "--json"]).output() else {
            return;
        };
        let list: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        for vm in list.as_array().into_iter().flatten() {
            if let Some(id) = vm["id"].as_str().or_else(|| vm["vm_id"].as_str()) {
                if std::thread::panicking() {
                    print_vm_logs(self, id);
                }
                let _ = self.cmd().args(["vm", "destroy", id]).output();
            }
        }
    }
}

/// Prints the last lines of a VM's logs (for a failing test, before its directory goes).
pub fn print_vm_logs(env: &TestEnv, id: &str) {
    for f in ["supervisor.log", "console.log", "qemu.stderr"] {
        let text = std::fs::read_to_string(env.vm_dir(id).join(f)).unwrap_or_default();
        let tail: Vec<&str> = text.lines().rev().take(30).collect();
        eprintln!("--- {id} {f} (last lines)");
        for l in tail.iter().rev() {
            eprintln!("{l}");
        }
    }
}

impl Drop for TestVm {
    fn drop(&mut self) {
        if std::thread::panicking() {
            print_vm_logs(&self.env, &self.id);
            let _ = self.warren(&["vm", "destroy", &self.id]);
            return;
        }
        self.destroy_inner();
    }
}

/// Asserts `out` succeeded (showing its stderr otherwise) and returns its stdout.
pub fn ok(out: Output, what: &str) -> String {
    assert!(
        out.status.success(),
        "{what}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Pids whose command line contains `needle`.
pub fn pids_matching(needle: &str) -> Vec<i32> {
    let mut v = Vec::new();
    for e in std::fs::read_dir("/proc").expect("/proc").flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        if let Ok(c) = std::fs::read(e.path().join("cmdline")) {
            let c = String::from_utf8_lossy(&c).replace('\0', " ");
            if c.contains(needle) && pid != std::process::id() as i32 {
                v.push(pid);
            }
        }
    }
    v
}

pub fn wait_until(what: &str, secs: u64, mut f: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(secs);
    while !f() {
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// Runs git in `dir` with a fixed identity; panics unless it succeeds; returns its stdout.
pub fn git(dir: &Path, args: &[&str]) -> String {
    let out = Command::new("git")
        .args(["-c", "user.name=T", "-c", "user.email=t@example.com"])
        .args(args)
        .current_dir(dir)
        .output()
        .expect("git");
    assert!(
        out.status.success(),
        "git {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A fresh repository (canonical path) with one commit, "initial", holding `a.txt`
/// ("committed\n"); the directory lives as long as the returned guard.
pub fn one_commit_repo() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("tempdir");
    let repo = dir.path().canonicalize().expect("canonical");
    git(&repo, &["init", "-q", "-b", "main"]);
    std::fs::write(repo.join("a.txt"), "committed\n").expect("write");
    git(&repo, &["add", "-A"]);
    git(&repo, &["commit", "-qm", "initial"]);
    (dir, repo)
}
