//! A token holder's session is a copy of a repository beneath its `[[host_roots]]` entry,
//! never of one that git's upward search finds above it, and only for the workspaces the
//! entry names.

mod common;

use std::path::Path;

use common::daemon::Daemon;
use serde_json::json;

fn git(dir: &Path, args: &[&str]) {
    let out = std::process::Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(["-c", "user.name=t", "-c", "user.email=t@example.com"])
        .args(args)
        .output()
        .expect("git");
    assert!(out.status.success(), "git {args:?}: {out:?}");
}

/// The operator's root is a directory inside a repository it does not cover (a home
/// directory kept in git, say): a token holder that names a directory of its root without a
/// repository of its own is refused, and no session or VM is made. Found by a hostile
/// review: the copy searched upwards from the checked path, past the root, and copied the
/// outer repository's tracked files into the token holder's session. Control: the same path
/// passes the host path check (the call fails on its image instead).
#[test]
fn test_token_session_never_copies_a_repository_above_its_host_root() {
    let outer = tempfile::tempdir().expect("tempdir");
    let outer = outer.path().canonicalize().expect("canonical");
    git(&outer, &["init", "-q"]);
    std::fs::write(outer.join("secret.txt"), "above the root\n").expect("write");
    git(&outer, &["add", "secret.txt"]);
    git(&outer, &["commit", "-q", "-m", "secret"]);
    let root = outer.join("agent");
    let proj = root.join("proj");
    std::fs::create_dir_all(&proj).expect("mkdir");
    std::fs::write(proj.join("notes.txt"), "in the root\n").expect("write");

    let d = Daemon::start_minimal(&format!(
        "[[host_roots]]\npath = {:?}\nuid = 0\nallow_root = true\nworkspaces = [\"roots\"]\n",
        root.display().to_string()
    ));
    let token = d.token("roots", &[]);
    let repo = proj.to_str().expect("utf-8").to_string();

    let control = d.call(
        &token,
        "session_create",
        json!({"repo": repo, "image": "no-such-image"}),
    );
    assert_ne!(control.code(), "forbidden", "control: {}", control.text);

    // The root is workspace `roots`'s: another workspace's token is refused beneath it,
    // before anything is looked up (no VM, no session).
    let other = d.token("elsewhere", &[]);
    let r = d.call(
        &other,
        "session_create",
        json!({"repo": repo, "image": "no-such-image"}),
    );
    assert_eq!(
        (r.status, r.code()),
        (403, "forbidden"),
        "another workspace's token beneath the root: {}",
        r.text
    );

    let r = d.call(&token, "session_create", json!({"repo": repo}));
    assert_eq!(
        (r.status, r.code()),
        (403, "forbidden"),
        "a session of the repository above the root: {}",
        r.text
    );
    assert!(!r.text.contains("secret"), "{}", r.text);
    assert!(d.all_vms().is_empty(), "a refused session left a VM");
    let list = d.ok(&token, "session_list", json!({}));
    assert_eq!(list["sessions"], json!([]), "{list}");
}
