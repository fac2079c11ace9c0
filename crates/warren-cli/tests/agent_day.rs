//! An agent's day, end to end, through the service's API: a session on a real project with
//! its own test suite (a small library's source release from the Python package index,
//! committed into a git repository by the test), in `internet` mode; the guest installs the
//! test dependencies, runs the tests, a file is changed with `vm_edit_file`, the tests run
//! again, the guest commits, the branch is exported and checked on the host.
//!
//! This test is PLATFORM.md's one exception to "loopback only": the host fetches one source
//! release from the package index and the guest makes one ordinary `pip install`. Each step's
//! time is printed (`step NAME: S s`) for the closing notes.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use base64::Engine;
use common::daemon::Daemon;
use serde_json::{json, Value};

/// The project: a one-module library whose source release ships its test suite.
const PROJECT: &str = "six";
const VERSION: &str = "1.17.0";

fn curl(url: &str, out: &Path, accept: &str) {
    let st = Command::new("curl")
        .args(["-fsSL", "--retry", "2", "--max-time", "120", "-H"])
        .arg(format!("Accept: {accept}"))
        .arg("-o")
        .arg(out)
        .arg(url)
        .status()
        .expect("curl");
    assert!(st.success(), "download {url}");
}

/// The project's source release, checked against the index's own SHA-256, unpacked and
/// committed into a fresh repository under `root`. Returns the repository.
fn project_repo(root: &Path) -> std::path::PathBuf {
    // The index's simple API in its JSON form: every file of the project with its digest.
    let meta = root.join("meta.json");
    curl(
        &format!("https://pypi.org/simple/{PROJECT}/"),
        &meta,
        "application/vnd.pypi.simple.v1+json",
    );
    let meta: Value =
        serde_json::from_slice(&std::fs::read(&meta).expect("read")).expect("index JSON");
    let want = format!("{PROJECT}-{VERSION}.tar.gz");
    let sdist = meta["files"]
        .as_array()
        .expect("files")
        .iter()
        .find(|f| f["filename"] == want.as_str())
        .expect("the source release");
    let tarball = root.join("src.tar.gz");
    curl(sdist["url"].as_str().expect("url"), &tarball, "*/*");
    let sha = Command::new("sha256sum")
        .arg(&tarball)
        .output()
        .expect("sha256sum");
    let sha = String::from_utf8_lossy(&sha.stdout);
    assert_eq!(
        sha.split_whitespace().next(),
        sdist["hashes"]["sha256"].as_str(),
        "the source release matches the index's digest"
    );
    let st = Command::new("tar")
        .args(["--no-same-owner", "-xzf"])
        .arg(&tarball)
        .arg("-C")
        .arg(root)
        .status()
        .expect("tar");
    assert!(st.success());
    let repo = root.join(format!("{PROJECT}-{VERSION}"));
    common::git(&repo, &["init", "-q", "-b", "main"]);
    common::git(&repo, &["add", "-A"]);
    common::git(
        &repo,
        &[
            "-c",
            "user.name=Host",
            "-c",
            "user.email=host@example.com",
            "commit",
            "-qm",
            "upstream release",
        ],
    );
    repo
}

/// Runs `command` in the session VM as a job and waits (up to `limit`) for it to complete,
/// following both output cursors. Returns (exit code, stdout, stderr).
fn run(
    d: &Daemon,
    token: &str,
    vm: &str,
    rid: &str,
    command: &str,
    limit: u64,
) -> (i64, String, String) {
    let r = d.ok(
        token,
        "vm_exec",
        json!({"vm_id": vm, "request_id": rid, "command": command, "wait_ms": 0}),
    );
    let job = r["job_id"].clone();
    let mut cursor = json!({"stdout": 0, "stderr": 0});
    let (mut out, mut err) = (String::new(), String::new());
    let deadline = Instant::now() + Duration::from_secs(limit);
    loop {
        let p = d.ok(
            token,
            "vm_job_output",
            json!({"vm_id": vm, "job_id": job, "cursor": cursor, "wait_ms": 20000}),
        );
        out.push_str(p["stdout"].as_str().unwrap_or(""));
        err.push_str(p["stderr"].as_str().unwrap_or(""));
        let done = p["state"] == "completed" && p["next_cursor"] == cursor;
        cursor = p["next_cursor"].clone();
        if done {
            let code = p["exit_code"].as_i64().unwrap_or(-1);
            return (code, out, err);
        }
        assert!(
            Instant::now() < deadline,
            "{command}: not completed in {limit} s; stdout {out}\nstderr {err}"
        );
    }
}

/// `N passed` from pytest's summary line.
fn passed(out: &str) -> u32 {
    out.lines()
        .rev()
        .find_map(|l| {
            let i = l.find(" passed")?;
            l[..i]
                .rsplit(|c: char| !c.is_ascii_digit())
                .next()?
                .parse()
                .ok()
        })
        .unwrap_or_else(|| panic!("no pytest summary in {out}"))
}

#[test]
fn test_agent_day_install_test_edit_commit_export_through_the_api() {
    let root = tempfile::tempdir().expect("tempdir");
    let root_path = root.path().canonicalize().expect("canonical");
    let mut steps: Vec<(&str, f64)> = Vec::new();
    let t = Instant::now();
    let repo = project_repo(&root_path);
    steps.push((
        "fetch and commit the project on the host",
        t.elapsed().as_secs_f64(),
    ));

    let d = Daemon::start(&format!(
        "[egress]\nhost_ca_store = true\n[[host_roots]]\npath = {:?}\nuid = 0\nallow_root = true\nworkspaces = [\"*\"]\n",
        root_path.display().to_string()
    ));
    let repo_arg = repo.to_str().expect("utf-8").to_string();
    // Without the internet grant, an internet session is refused and nothing is created.
    let plain = d.token("day-plain", &["--allow-network", "--image", "dev"]);
    let r = d.call(
        &plain,
        "session_create",
        json!({"repo": repo_arg, "image": "dev", "network": "internet"}),
    );
    assert_eq!((r.status, r.code()), (403, "forbidden"), "{}", r.text);
    assert!(d.all_vms().is_empty(), "a refused session left a VM");

    let token = d.token(
        "day",
        &["--allow-network", "--allow-internet", "--image", "dev"],
    );
    let t = Instant::now();
    let s = d.ok(
        &token,
        "session_create",
        json!({"repo": repo_arg, "name": "day", "image": "dev", "network": "internet",
               "memory_mib": 1024}),
    );
    steps.push(("session_create (copy + boot)", t.elapsed().as_secs_f64()));
    let vm = s["vm_id"].as_str().expect("vm_id").to_string();

    let t = Instant::now();
    let (code, out, err) = run(
        &d,
        &token,
        &vm,
        "day-install",
        // The image's pip serves the venv: seeding a venv with its own pip takes minutes
        // under TCG.
        "python3 -m venv --without-pip --system-site-packages /tmp/venv && \
         /tmp/venv/bin/python -m pip install -q --no-cache-dir --disable-pip-version-check \
         --no-compile --timeout 60 --retries 2 pytest && echo installed",
        900,
    );
    assert_eq!(code, 0, "pip install: {out}\n{err}");
    assert!(out.ends_with("installed\n"), "{out}");
    steps.push((
        "install the test dependencies (venv + pip)",
        t.elapsed().as_secs_f64(),
    ));

    let pytest = "/tmp/venv/bin/python -m pytest -q -p no:cacheprovider test_six.py 2>&1";
    let t = Instant::now();
    let (code, out, _) = run(&d, &token, &vm, "day-test-1", pytest, 600);
    assert_eq!(code, 0, "{out}");
    let before = passed(&out);
    assert!(before > 50, "{out}");
    steps.push(("run the project's tests", t.elapsed().as_secs_f64()));

    // The agent changes the library and adds a test for the change.
    let t = Instant::now();
    let six = d.ok(
        &token,
        "vm_read_file",
        json!({"vm_id": vm, "path": "six.py", "max_bytes": 131072}),
    );
    let text = base64::engine::general_purpose::STANDARD
        .decode(six["content_base64"].as_str().expect("content"))
        .expect("base64");
    let text = String::from_utf8(text).expect("utf-8");
    let old_version = format!("__version__ = \"{VERSION}\"");
    assert!(text.contains(&old_version), "six.py names its version");
    d.ok(
        &token,
        "vm_edit_file",
        json!({"vm_id": vm, "path": "six.py", "old_string": old_version,
               "new_string": format!("__version__ = \"{VERSION}+warren\"")}),
    );
    d.ok(
        &token,
        "vm_edit_file",
        json!({"vm_id": vm, "path": "test_six.py", "old_string": "import six\n",
               "new_string": "import six\n\n\ndef test_warren_version():\n    assert six.__version__.endswith(\"+warren\")\n"}),
    );
    steps.push((
        "edit two files with vm_edit_file",
        t.elapsed().as_secs_f64(),
    ));

    let t = Instant::now();
    let (code, out, _) = run(&d, &token, &vm, "day-test-2", pytest, 600);
    assert_eq!(code, 0, "{out}");
    assert_eq!(
        passed(&out),
        before + 1,
        "the new test runs and passes: {out}"
    );
    steps.push(("rerun the tests", t.elapsed().as_secs_f64()));

    let t = Instant::now();
    let (code, out, err) = run(
        &d,
        &token,
        &vm,
        "day-commit",
        "git add six.py test_six.py && git -c user.name=Agent -c user.email=agent@example.com \
         commit -qm 'Mark the version as built by Warren' && git status --porcelain | wc -l",
        120,
    );
    assert_eq!(code, 0, "{out}\n{err}");
    steps.push(("commit in the guest", t.elapsed().as_secs_f64()));

    let t = Instant::now();
    let e = d.ok(&token, "session_export", json!({"session": "day"}));
    steps.push(("session_export", t.elapsed().as_secs_f64()));
    assert_eq!(e["refname"], "refs/heads/warren/day", "{e}");
    assert_eq!(e["new_commits"], 1, "{e}");
    // On the host: the branch holds the agent's commit on top of the release.
    let log = Command::new("git")
        .arg("-C")
        .arg(&repo)
        .args(["log", "--format=%s", "main..warren/day"])
        .output()
        .expect("git log");
    assert_eq!(
        String::from_utf8_lossy(&log.stdout),
        "Mark the version as built by Warren\n"
    );
    let show = Command::new("git")
        .arg("-C")
        .arg(&repo)
        .args(["show", "warren/day:six.py"])
        .output()
        .expect("git show");
    assert!(String::from_utf8_lossy(&show.stdout)
        .contains(&format!("__version__ = \"{VERSION}+warren\"")));
    // The host's working tree is untouched.
    let head = std::fs::read_to_string(repo.join("six.py")).expect("read");
    assert!(head.contains(&format!("__version__ = \"{VERSION}\"")));

    // What the test runs left behind (bytecode caches) is not committed: a delete says so
    // and changes nothing until forced.
    let r = d.call(&token, "session_delete", json!({"session": "day"}));
    assert_eq!((r.status, r.code()), (409, "conflict"), "{}", r.text);
    assert!(r.text.contains("__pycache__/"), "{}", r.text);
    d.ok(
        &token,
        "session_delete",
        json!({"session": "day", "force": true}),
    );
    assert!(d.all_vms().is_empty(), "the session's VM is gone");
    for (name, secs) in &steps {
        eprintln!("step {name}: {secs:.1} s");
    }
}
