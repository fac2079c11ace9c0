//! Session VMs from templates, and forks of a session's VM, on real VMs (`docs/instant.md`):
//! a session created with `--template` restores the template of its shape (its shares are
//! part of the shape) and shows its own files, not the template's stand-ins or another
//! session's; a fork of a session's VM makes a new session per copy whose files are a copy
//! of the parent's taken at the fork, and a process holding a file open in the workspace goes
//! on writing each copy's own file.

mod common;

use std::path::{Path, PathBuf};

use common::{ok, one_commit_repo, wait_until, TestEnv};

fn json(out: std::process::Output, what: &str) -> serde_json::Value {
    serde_json::from_str(&ok(out, what)).expect("json")
}

fn sh(env: &TestEnv, vm: &str, script: &str) -> String {
    ok(
        env.run(&["vm", "exec", vm, "--", "sh", "-c", script]),
        script,
    )
    .trim()
    .to_string()
}

/// Lines in `path`, 0 while it is missing.
fn lines(path: &Path) -> usize {
    std::fs::read_to_string(path)
        .map(|s| s.lines().count())
        .unwrap_or(0)
}

fn workspace(v: &serde_json::Value) -> PathBuf {
    PathBuf::from(v["workspace_dir"].as_str().expect("workspace_dir"))
}

#[test]
fn test_session_template_clones_and_session_forks_get_files_of_their_own() {
    common::ensure_image("minimal");
    let env = TestEnv::new();
    let image = common::pinned_image("minimal");
    let (_g1, repo1) = one_commit_repo();
    let (_g2, repo2) = one_commit_repo();
    std::fs::write(repo2.join("only-in-two.txt"), "two\n").expect("write");
    let create = |repo: &Path, name: &str| {
        json(
            env.run(&[
                "session",
                "create",
                "--repo",
                &repo.display().to_string(),
                "--name",
                name,
                "--image",
                &image,
                "--template",
                "--json",
            ]),
            "session create",
        )
    };
    // The first builds the template of the session shape, the second restores it.
    let one = create(&repo1, "one");
    let two = create(&repo2, "two");
    let vm2 = two["vm_id"].as_str().expect("vm").to_string();
    let templates = json(env.run(&["vm", "templates", "--json"]), "templates");
    let list = templates.as_array().expect("array");
    assert_eq!(list.len(), 1, "one template for both sessions: {templates}");
    let guests: Vec<&str> = list[0]["key"]["shares"]
        .as_array()
        .expect("shares")
        .iter()
        .map(|s| s["guest"].as_str().expect("guest"))
        .collect();
    assert_eq!(
        guests,
        ["/workspace", "/.warren-source-objects", "/agent-state"],
        "{templates}"
    );
    assert!(
        env.vm_dir(&vm2).join("template").exists(),
        "the second session's VM is a template clone"
    );
    // Its RAM is a shared memfd of its own (virtiofsd maps it), never the template's file.
    let qemu = common::pids_matching(&format!("warren-{vm2}"))
        .into_iter()
        .find_map(|pid| {
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            cmd.contains("qemu-system").then_some(cmd)
        })
        .expect("the clone's QEMU");
    assert!(
        qemu.contains("mem-path=/proc/self/fd/39,share=on") && !qemu.contains("/templates/"),
        "{qemu}"
    );

    // Its shares are its own directories, as the host has them right now (the root's
    // attributes too, which the template cached for its stand-in directory).
    let ws2 = workspace(&two);
    let seen = sh(
        &env,
        &vm2,
        "stat -c %Y /workspace; ls /workspace; cat /etc/hostname",
    );
    let host_mtime = std::fs::metadata(&ws2)
        .expect("stat")
        .modified()
        .expect("mtime")
        .duration_since(std::time::UNIX_EPOCH)
        .expect("epoch")
        .as_secs();
    let mut seen = seen.lines();
    assert_eq!(
        seen.next(),
        Some(host_mtime.to_string().as_str()),
        "the workspace root's attributes are the host's"
    );
    let rest: Vec<&str> = seen.collect();
    assert!(rest.contains(&"only-in-two.txt"), "{rest:?}");
    assert!(rest.contains(&vm2.as_str()), "own hostname: {rest:?}");
    sh(&env, &vm2, "echo from-guest > /workspace/guest.txt");
    assert_eq!(
        std::fs::read_to_string(ws2.join("guest.txt")).expect("guest write on the host"),
        "from-guest\n"
    );
    assert!(!workspace(&one).join("guest.txt").exists());
    assert!(!workspace(&one).join("only-in-two.txt").exists());

    // A process holding a workspace file open, then a fork of two copies.
    sh(
        &env,
        &vm2,
        "cd /workspace && (exec 3>>/workspace/log; i=0; while true; do i=$((i+1)); echo $i >&3; sleep 0.1; done) >/dev/null 2>&1 &",
    );
    wait_until("the counter to run", 60, || lines(&ws2.join("log")) >= 3);
    let forked = json(
        env.run(&["vm", "fork", &vm2, "--count", "2", "--json"]),
        "fork",
    );
    let vms: Vec<String> = forked["vm_ids"]
        .as_array()
        .expect("vm_ids")
        .iter()
        .map(|v| v.as_str().expect("id").to_string())
        .collect();
    let sessions: Vec<String> = forked["session_ids"]
        .as_array()
        .expect("a session's fork names its new sessions")
        .iter()
        .map(|v| v.as_str().expect("id").to_string())
        .collect();
    assert_eq!((vms.len(), sessions.len()), (2, 2), "{forked}");
    let listed = json(env.run(&["session", "list", "--json"]), "session list");
    let copies: Vec<&serde_json::Value> = listed
        .as_array()
        .expect("array")
        .iter()
        .filter(|s| sessions.iter().any(|id| s["session_id"] == id.as_str()))
        .collect();
    assert_eq!(copies.len(), 2, "{listed}");
    let dirs: Vec<PathBuf> = copies.iter().map(|s| workspace(s)).collect();
    for (s, d) in copies.iter().zip(&dirs) {
        assert_ne!(d, &ws2);
        assert!(vms.iter().any(|v| s["vm_id"] == v.as_str()), "{s}");
        assert_eq!(
            std::fs::read_to_string(d.join("guest.txt")).expect("copied"),
            "from-guest\n"
        );
    }
    // Every counter goes on, each into its own file: the copies' descriptors were re-opened
    // on their own workspaces.
    let at_fork: Vec<usize> = dirs.iter().map(|d| lines(&d.join("log"))).collect();
    assert!(at_fork.iter().all(|n| *n >= 3), "{at_fork:?}");
    let parent_then = lines(&ws2.join("log"));
    wait_until("all three counters to advance", 60, || {
        lines(&ws2.join("log")) > parent_then + 5
            && dirs
                .iter()
                .zip(&at_fork)
                .all(|(d, n)| lines(&d.join("log")) > n + 5)
    });
    for d in &dirs {
        let text = std::fs::read_to_string(d.join("log")).expect("log");
        let numbers: Vec<u64> = text.lines().filter_map(|l| l.parse().ok()).collect();
        assert!(
            numbers.windows(2).all(|w| w[1] == w[0] + 1),
            "one counter per file, no gap or interleaving: {numbers:?}"
        );
    }
    // A write in one copy is in its own workspace only.
    sh(&env, &vms[0], "echo mine > /workspace/copy-zero.txt");
    let own = copies
        .iter()
        .position(|s| s["vm_id"] == vms[0].as_str())
        .expect("copy 0's session");
    assert!(dirs[own].join("copy-zero.txt").exists());
    assert!(!dirs[1 - own].join("copy-zero.txt").exists());
    assert!(!ws2.join("copy-zero.txt").exists());

    for name in ["one", "two"].into_iter().map(String::from).chain(
        copies
            .iter()
            .map(|s| s["name"].as_str().expect("name").to_string()),
    ) {
        ok(
            env.run(&["session", "delete", &name, "--force"]),
            "session delete",
        );
    }
    for d in &dirs {
        assert!(!d.exists(), "a forked session's copy is deleted with it");
    }
}
