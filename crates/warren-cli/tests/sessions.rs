//! Sessions on real VMs (dev image, which has git): two sessions of one repository are
//! isolated from each other and from the source, the guest sees the source checkout's state,
//! edits reach the host within the call, commits are exported as a branch, the guest cannot
//! touch the source's objects, config or hooks, deletion refuses unsaved work, and
//! `warren run` works in a fresh project.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use common::{git, ok, TestEnv};

/// A repository with one commit, then every kind of uncommitted state.
fn source_repo(dir: &Path) {
    git(dir, &["init", "-q", "-b", "main"]);
    std::fs::write(dir.join("keep.txt"), "keep\n").unwrap();
    std::fs::write(dir.join("edit.txt"), "v1\n").unwrap();
    std::fs::write(dir.join("gone.txt"), "gone\n").unwrap();
    std::fs::write(dir.join("old-name.txt"), "moved\n").unwrap();
    std::fs::write(dir.join("blob.bin"), [0u8, 1, 2, 255, 0, 7]).unwrap();
    std::os::unix::fs::symlink("keep.txt", dir.join("link")).unwrap();
    std::fs::write(dir.join(".gitignore"), "*.log\n").unwrap();
    git(dir, &["add", "-A"]);
    git(dir, &["commit", "-qm", "initial"]);
    std::fs::write(dir.join("staged.txt"), "staged\n").unwrap();
    git(dir, &["add", "staged.txt"]);
    git(dir, &["mv", "old-name.txt", "new-name.txt"]);
    std::fs::write(dir.join("edit.txt"), "v2 unstaged\n").unwrap();
    std::fs::remove_file(dir.join("gone.txt")).unwrap();
    std::fs::write(dir.join("untracked.txt"), "untracked\n").unwrap();
    std::fs::write(dir.join("debug.log"), "ignored\n").unwrap();
    // What the guest must never see or trigger.
    git(dir, &["config", "warren.canary", "SOURCE-CONFIG-CANARY"]);
    let hook = dir.join(".git/hooks/post-commit");
    std::fs::write(
        &hook,
        format!("#!/bin/sh\ntouch {}/HOOK-RAN\n", dir.display()),
    )
    .unwrap();
    std::fs::set_permissions(&hook, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
}

struct Sessions<'a> {
    env: &'a TestEnv,
    names: Vec<String>,
}

impl Sessions<'_> {
    fn create(&mut self, repo: &Path, name: &str) -> serde_json::Value {
        let dev = common::image_id("dev");
        let out = self.env.run(&[
            "session",
            "create",
            "--repo",
            &repo.display().to_string(),
            "--name",
            name,
            "--image",
            &dev,
            "--json",
        ]);
        assert!(
            out.status.success(),
            "session create: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        self.names.push(name.to_string());
        serde_json::from_slice(&out.stdout).expect("json")
    }
}

impl Drop for Sessions<'_> {
    fn drop(&mut self) {
        for n in &self.names {
            let _ = self.env.run(&["session", "delete", n, "--force"]);
        }
    }
}

/// `sh -c script` in the session's VM, as `(code, stdout, stderr)`.
fn sh(env: &TestEnv, vm: &str, script: &str) -> (i32, String, String) {
    let out = env.run(&["vm", "exec", vm, "--", "sh", "-c", script]);
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn test_sessions_isolated_faithful_exported_and_guarded() {
    common::ensure_image("dev");
    let env = TestEnv::new();
    let src_dir = tempfile::tempdir().expect("tempdir");
    let src = src_dir.path().canonicalize().unwrap();
    source_repo(&src);
    let source_status = git(&src, &["status", "--porcelain"]);
    let source_log = git(&src, &["log", "--format=%H"]);
    let mut sessions = Sessions {
        env: &env,
        names: vec![],
    };
    let a = sessions.create(&src, "a");
    let b = sessions.create(&src, "b");
    let (vm_a, vm_b) = (
        a["vm_id"].as_str().unwrap().to_string(),
        b["vm_id"].as_str().unwrap().to_string(),
    );
    assert_ne!(vm_a, vm_b, "two sessions, two VMs");
    let ws_a = PathBuf::from(a["workspace_dir"].as_str().unwrap());
    assert_ne!(ws_a, PathBuf::from(b["workspace_dir"].as_str().unwrap()));

    // The guest sees the source checkout's staged, unstaged, untracked, deleted and renamed
    // state; ignored files stay behind; binary and symlink come through as they are.
    let (code, out, err) = sh(
        &env,
        &vm_a,
        "cd /workspace && git status --porcelain && echo --- && od -An -tx1 blob.bin && \
         readlink link && test ! -e debug.log && echo no-log",
    );
    assert_eq!(code, 0, "{err}");
    let (status, rest) = out.split_once("---\n").expect("marker");
    assert_eq!(status, source_status);
    assert!(rest.contains("00 01 02 ff 00 07"), "{rest}");
    assert!(rest.contains("keep.txt\nno-log"), "{rest}");

    // A guest edit is on the host when the call returns.
    let (code, _, err) = sh(&env, &vm_a, "echo from-guest > /workspace/guest.txt");
    assert_eq!(code, 0, "{err}");
    assert_eq!(
        std::fs::read_to_string(ws_a.join("guest.txt")).unwrap(),
        "from-guest\n"
    );

    // Commit and branch in a; b and the source see none of it, and no source hook runs.
    let (code, _, err) = sh(
        &env,
        &vm_a,
        "cd /workspace && git -c user.name=G -c user.email=g@example.com add -A && \
         git -c user.name=G -c user.email=g@example.com commit -qm 'from session a' && \
         git branch feature-a && git log --oneline | head -1",
    );
    assert_eq!(code, 0, "{err}");
    let (_, out_b, _) = sh(
        &env,
        &vm_b,
        "cd /workspace && git log --oneline && git branch && test ! -e guest.txt && echo clean",
    );
    assert!(!out_b.contains("from session a"), "{out_b}");
    assert!(!out_b.contains("feature-a"), "{out_b}");
    assert!(out_b.ends_with("clean\n"), "{out_b}");
    assert_eq!(git(&src, &["status", "--porcelain"]), source_status);
    assert_eq!(git(&src, &["log", "--format=%H"]), source_log);
    assert!(!src.join("HOOK-RAN").exists(), "a source hook ran");

    // The source's object store is read-only; its config and hooks are nowhere in the guest.
    let (code, out, err) = sh(
        &env,
        &vm_b,
        "touch /.warren-source-objects/x 2>&1; echo rc=$?; \
         grep -rs SOURCE-CONFIG-CANARY /workspace /.warren-source-objects /agent-state; \
         echo grep=$?; ls /workspace/.git/hooks | grep -c post-commit",
    );
    assert!(out.contains("Read-only file system"), "{out}{err}");
    assert!(out.contains("grep=1"), "canary visible: {out}");
    assert!(out.trim_end().ends_with('0'), "source hook copied: {out}");
    let _ = code;

    // Export a's commit to the source as a branch.
    ok(
        env.run(&["session", "export", "a", "--branch", "from-a"]),
        "export",
    );
    let log = git(&src, &["log", "--format=%s", "from-a"]);
    assert!(log.starts_with("from session a\n"), "{log}");
    assert!(
        !src.join("HOOK-RAN").exists(),
        "a source hook ran on export"
    );

    // Deleting b (which still has the copied uncommitted work) needs --force; a is clean.
    let out = env.run(&["session", "delete", "b"]);
    assert!(!out.status.success());
    let msg = String::from_utf8_lossy(&out.stderr);
    assert!(msg.contains("uncommitted"), "{msg}");
    ok(env.run(&["session", "delete", "b", "--force"]), "delete b");
    ok(env.run(&["session", "delete", "a"]), "delete a (clean)");
    sessions.names.clear();
    assert!(env.record(&vm_a).is_none() && env.record(&vm_b).is_none());
    assert!(!ws_a.exists(), "session copy left behind");
    assert_eq!(
        git(&src, &["log", "--format=%s", "-1", "from-a"]),
        "from session a\n"
    );
    failed_start_leaves_no_vm(&env, &src);
}

/// A session create whose VM fails to boot leaves nothing behind: no session, and no VM
/// record or directory counted against the limits (before, the failed VM stayed, one per
/// attempt, and a client retrying the create piled them up: a hostile review). `env` has no
/// VM or session left.
fn failed_start_leaves_no_vm(env: &TestEnv, repo: &Path) {
    // A QEMU that exits at once: the VM is admitted, then fails to boot.
    let bin = tempfile::tempdir().expect("tempdir");
    std::fs::set_permissions(bin.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let qemu = bin.path().join("qemu-system-x86_64");
    std::fs::write(&qemu, "#!/bin/sh\nexit 1\n").expect("write");
    std::fs::set_permissions(&qemu, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let out = env
        .cmd()
        .env("WARREN_QEMU", &qemu)
        .args(["session", "create", "--repo"])
        .arg(repo)
        .args(["--image", &common::image_id("dev")])
        .output()
        .expect("run warren");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("failed to boot"),
        "{err}"
    );
    let vms = ok(env.run(&["vm", "list", "--json"]), "vm list");
    assert_eq!(vms.trim(), "[]", "a failed start left a VM: {vms}");
    let sessions = ok(env.run(&["session", "list", "--json"]), "session list");
    assert_eq!(sessions.trim(), "[]", "{sessions}");
    let left: Vec<_> = std::fs::read_dir(env.state.path().join("vms"))
        .expect("vms")
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

#[test]
fn test_run_shell_git_status_in_fresh_project_reuses_session() {
    common::ensure_image("dev");
    let env = TestEnv::new();
    let dir = tempfile::tempdir().expect("tempdir");
    let proj = dir.path().canonicalize().unwrap();
    git(&proj, &["init", "-q", "-b", "main"]);
    std::fs::create_dir(proj.join("sub")).unwrap();
    std::fs::write(proj.join("sub/new.txt"), "x\n").unwrap();
    let run = |args: &[&str]| -> Output {
        Command::new(common::WARREN)
            .arg("--state-dir")
            .arg(env.state.path())
            .arg("--image-dir")
            .arg(&env.image_dir)
            .arg("run")
            .args(args)
            .current_dir(proj.join("sub"))
            .stdin(Stdio::null())
            .output()
            .expect("warren run")
    };
    let dev = common::image_id("dev");
    let out = run(&[
        "--image",
        &dev,
        "shell",
        "--",
        "sh",
        "-c",
        "pwd; git status --short",
    ]);
    let stdout = ok(out, "warren run");
    assert_eq!(stdout, "/workspace/sub\n?? ./\n", "{stdout}");
    // A second run in the same project: same session, same VM; exit codes propagate.
    let out = run(&["shell", "--", "sh", "-c", "echo again; exit 7"]);
    assert_eq!(out.status.code(), Some(7));
    assert_eq!(String::from_utf8_lossy(&out.stdout), "again\n");
    let list = ok(env.run(&["session", "list", "--json"]), "list");
    let v: serde_json::Value = serde_json::from_str(&list).unwrap();
    assert_eq!(v.as_array().unwrap().len(), 1, "{v}");
    // On a terminal (util-linux `script` provides one), the command gets a guest
    // pseudo-terminal, input typed on the terminal reaches it, and its exit code comes back.
    let inner = format!(
        "{} --state-dir {} --image-dir {} run -- sh -c 'tty; read x; echo got:$x; exit 5'",
        common::WARREN,
        env.state.path().display(),
        env.image_dir.display()
    );
    let mut child = Command::new("script")
        .args(["-qec", &inner, "/dev/null"])
        .current_dir(proj.join("sub"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("script");
    {
        use std::io::Write;
        let mut input = child.stdin.take().expect("stdin");
        std::thread::sleep(std::time::Duration::from_secs(3));
        input.write_all(b"hello\r").expect("type");
        std::thread::sleep(std::time::Duration::from_secs(2));
    }
    let out = child.wait_with_output().expect("script");
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(5), "{text}");
    assert!(text.contains("/dev/pts/"), "{text}");
    assert!(text.contains("got:hello"), "{text}");

    // Different devices for the running session are refused.
    let out = run(&["--memory-mib", "1024", "shell", "--", "true"]);
    assert_eq!(out.status.code(), Some(125));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--recreate"));
    ok(
        env.run(&[
            "session",
            "delete",
            v[0]["name"].as_str().unwrap(),
            "--force",
        ]),
        "delete",
    );
}

/// A hostile guest plants, in its session copy, every way it knows to make host git run its
/// code: the security review's submodule with a filter driver, an fsmonitor, a filter and a
/// textconv driver on the main repository, a relative `include.path`, and hooks. Host
/// `session status`, `session export` and `session delete` then run, and the host marker
/// never appears. Positive control: the host git invocation Warren used to make (`git status
/// --ignore-submodules=none` in the copy) runs the guest's code.
#[test]
fn test_hostile_guest_git_config_never_runs_on_host() {
    common::ensure_image("dev");
    let env = TestEnv::new();
    let src_dir = tempfile::tempdir().expect("tempdir");
    let src = src_dir.path().canonicalize().unwrap();
    git(&src, &["init", "-q", "-b", "main"]);
    std::fs::write(src.join("a.txt"), "alpha\n").unwrap();
    git(&src, &["add", "-A"]);
    git(&src, &["commit", "-qm", "initial"]);
    let mut sessions = Sessions {
        env: &env,
        names: vec![],
    };
    let s = sessions.create(&src, "hostile");
    let vm = s["vm_id"].as_str().unwrap().to_string();
    let ws = PathBuf::from(s["workspace_dir"].as_str().unwrap());
    let marker = std::env::temp_dir().join(format!("warren-hostgit-marker-{}", std::process::id()));
    let _ = std::fs::remove_file(&marker);
    let m = marker.display();
    let (code, _, err) = sh(
        &env,
        &vm,
        &format!(
            "set -e; cd /workspace; G='git -c user.name=G -c user.email=g@example.com'; \
             mkdir sub && cd sub && git init -q && echo hello > f.txt && git add f.txt && \
             $G commit -qm s && echo '* filter=x' > .gitattributes && \
             git config filter.x.clean \"sh -c 'id > {m}'; cat\" && sleep 1 && touch f.txt && cd .. && \
             git update-index --add --cacheinfo 160000,$(git -C sub rev-parse HEAD),sub && \
             git config core.fsmonitor 'id > {m}; true' && \
             echo '*.txt filter=y diff=y' > .gitattributes && \
             git config filter.y.clean \"sh -c 'id > {m}'; cat\" && \
             git config diff.y.textconv 'id > {m}; cat' && \
             printf '[core]\\n\\tpager = id > {m}\\n' > .git/evil.cfg && \
             git config include.path evil.cfg && \
             mkdir -p .git/hooks && printf '#!/bin/sh\\nid > {m}\\n' > .git/hooks/post-index-change && \
             chmod +x .git/hooks/post-index-change && \
             echo changed > a.txt && $G commit -qam 'guest commit' --no-verify"
        ),
    );
    assert_eq!(code, 0, "{err}");
    assert!(
        !marker.exists(),
        "the guest could write the host marker itself"
    );

    let st = ok(
        env.run(&["session", "status", "hostile", "--json"]),
        "status",
    );
    assert!(
        st.contains("guest commit") || st.contains("unexported"),
        "{st}"
    );
    assert!(st.contains("\"generation\":1"), "{st}");
    assert!(
        !marker.exists(),
        "session status ran guest code on the host"
    );
    ok(
        env.run(&["session", "export", "hostile", "--branch", "from-hostile"]),
        "export",
    );
    assert!(
        !marker.exists(),
        "session export ran guest code on the host"
    );
    assert_eq!(
        git(&src, &["log", "--format=%s", "-1", "from-hostile"]),
        "guest commit\n"
    );
    let out = env.run(&["session", "delete", "hostile"]);
    assert!(
        !out.status.success(),
        "uncommitted work must refuse the delete"
    );
    assert!(
        !marker.exists(),
        "session delete ran guest code on the host"
    );

    // Positive control: the old host invocation runs the guest's code (as this user).
    Command::new("git")
        .args([
            "-c",
            "safe.directory=*",
            "status",
            "--porcelain",
            "--ignore-submodules=none",
        ])
        .current_dir(&ws)
        .env("GIT_CONFIG_GLOBAL", "/dev/null")
        .output()
        .expect("git");
    let _ = out;
    assert!(
        marker.exists(),
        "sanity: the planted attack does run under plain host git"
    );
    let _ = std::fs::remove_file(&marker);
    ok(
        env.run(&["session", "delete", "hostile", "--force"]),
        "delete",
    );
    sessions.names.clear();
}

/// Issue 13, item 2: a hostile source repository whose `.git/info/exclude` links to a host
/// secret (it would have been copied into the guest's git directory) or whose `.git/objects`
/// links to `/` (the whole host would have been mounted read-only at
/// `/.warren-source-objects`). `session create` refuses each with `invalid_argument` before
/// anything is copied or a VM booted, and the secret reaches no guest. Positive control: the
/// same repository without the links boots, its guest has the normal exclude (honoured) and the
/// real object directory, and the canary is nowhere in the guest.
#[test]
fn test_hostile_source_links_never_reach_the_guest() {
    common::ensure_image("dev");
    let env = TestEnv::new();
    let dir = tempfile::tempdir().expect("tempdir");
    let root = dir.path().canonicalize().unwrap();
    let src = root.join("src");
    std::fs::create_dir(&src).unwrap();
    git(&src, &["init", "-q", "-b", "main"]);
    std::fs::write(src.join("a.txt"), "alpha\n").unwrap();
    git(&src, &["add", "-A"]);
    git(&src, &["commit", "-qm", "initial"]);
    std::fs::write(src.join("debug.log"), "ignored\n").unwrap();
    let secret = root.join("host-secret");
    std::fs::write(&secret, "HOST-SECRET-CANARY\n").unwrap();
    let exclude = src.join(".git/info/exclude");
    let objects = src.join(".git/objects");
    let real_objects = root.join("objects-real");
    let dev = common::image_id("dev");
    let create = |name: &str| {
        env.run(&[
            "session",
            "create",
            "--repo",
            src.to_str().unwrap(),
            "--name",
            name,
            "--image",
            &dev,
            "--json",
        ])
    };
    let refused = |out: Output, what: &str| {
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(!out.status.success(), "{what}: created");
        assert!(
            err.contains("error[invalid_argument]") && err.contains("source repository refused"),
            "{what}: {err}"
        );
        assert!(err.contains(what), "{what}: {err}");
    };

    std::fs::remove_file(&exclude).unwrap();
    std::os::unix::fs::symlink(&secret, &exclude).unwrap();
    refused(create("hostile-exclude"), ".git/info/exclude");
    std::fs::remove_file(&exclude).unwrap();
    std::fs::write(&exclude, "*.log\n").unwrap();

    std::fs::rename(&objects, &real_objects).unwrap();
    std::os::unix::fs::symlink("/", &objects).unwrap();
    refused(create("hostile-objects"), ".git/objects");
    std::fs::remove_file(&objects).unwrap();
    std::fs::rename(&real_objects, &objects).unwrap();

    let list = ok(env.run(&["session", "list", "--json"]), "list");
    assert_eq!(list.trim(), "[]", "a refused create left a session: {list}");
    let sessions_dir = env.state.path().join("sessions");
    let left = std::fs::read_dir(&sessions_dir)
        .map(|d| d.count())
        .unwrap_or(0);
    assert_eq!(left, 0, "a refused create left a copy");

    // Positive control: the same repository without the links.
    let mut sessions = Sessions {
        env: &env,
        names: vec![],
    };
    let s = sessions.create(&src, "clean-source");
    let vm = s["vm_id"].as_str().unwrap().to_string();
    let (code, out, err) = sh(
        &env,
        &vm,
        "set -e; cat /workspace/.git/info/exclude; test ! -e /workspace/debug.log; \
         ls /.warren-source-objects; git -C /workspace log --format=%s; \
         if grep -rqs HOST-SECRET-CANARY /workspace /.warren-source-objects; then exit 3; fi; \
         echo clean",
    );
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.starts_with("*.log\n"), "the normal exclude: {out}");
    assert!(out.contains("info\n") && out.contains("initial\n"), "{out}");
    assert!(
        !out.contains("etc\n") && !out.contains("proc\n"),
        "the host's root: {out}"
    );
    assert!(out.ends_with("clean\n"), "{out}");
}
