//! What the guest wrote never runs on the host; the source's config and hooks stay out.

mod common;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};

use common::*;
use warren_session::{export, remove, status, Owner, SessionError};

fn guest_config(s: &Path, key: &str, value: &str) {
    git(&ws(s), &["config", key, value]);
}

/// A hook script that creates `marker` when run.
fn hook(dir: &Path, name: &str, marker: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    let p = dir.join(name);
    std::fs::write(&p, format!("#!/bin/sh\ntouch '{}'\n", marker.display())).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
}

/// A command line that creates `marker` when a shell runs it.
fn touch(marker: &Path) -> String {
    format!("touch {}; true", marker.display())
}

/// Runs every host operation on the session (status, export, remove without force) and
/// asserts none of them ran the guest's program: `marker` never appears, and the operations
/// answer from the session's own state (the guest's config, drivers and redirects are
/// ignored, not obeyed).
fn assert_host_git_ignores_guest(f: &Fixture, s: &Path, marker: &Path) {
    let r = status(s, None).expect("status");
    assert!(!marker.exists(), "status ran the guest's program");
    let _ = export(s, &f.src, "attack-probe", None);
    assert!(!marker.exists(), "export ran the guest's program");
    if r.is_clean() {
        remove(s, false, None).expect("remove a clean session");
    } else {
        assert!(matches!(
            remove(s, false, None),
            Err(SessionError::Unsaved { .. })
        ));
        remove(s, true, None).expect("forced remove");
    }
    assert!(!marker.exists(), "remove ran the guest's program");
    assert!(!s.exists());
}

/// Asserts the planted attack is real (an unguarded git just ran it: `marker` exists, the
/// positive control), then that Warren's host git ignores it.
fn real_attack_ignored_by_host_git(f: &Fixture, s: &Path, marker: &Path, control: &str) {
    assert!(marker.exists(), "{control}");
    std::fs::remove_file(marker).unwrap();
    assert_host_git_ignores_guest(f, s, marker);
}

/// The reproduction from the security review: a submodule made in the guest, with its own
/// git directory, config and attributes naming a filter. Host `git status` used to recurse
/// into it (`--ignore-submodules=none`) and run the filter as the session owner.
#[test]
fn test_guest_submodule_filter_never_runs_on_host() {
    let f = Fixture::committed();
    let (s, _) = f.prepare("s");
    let w = ws(&s);
    let marker = f.tmp.path().join("pwned");
    let sub = w.join("sub");
    std::fs::create_dir(&sub).unwrap();
    git(&sub, &["init", "-q"]);
    write(&sub, "f.txt", "hello\n");
    git(&sub, &["add", "f.txt"]);
    git(&sub, &["commit", "-qm", "s"]);
    write(&sub, ".gitattributes", "* filter=x\n");
    git(
        &sub,
        &[
            "config",
            "filter.x.clean",
            &format!("sh -c '{}'; cat", touch(&marker)),
        ],
    );
    std::thread::sleep(std::time::Duration::from_millis(1100));
    write(&sub, "f.txt", "hello\n");
    let head = git(&sub, &["rev-parse", "HEAD"]);
    git(
        &w,
        &[
            "update-index",
            "--add",
            "--cacheinfo",
            &format!("160000,{},sub", head.trim()),
        ],
    );
    // The attack is real: the guest's git (or an unguarded host git) runs the filter.
    let out = git_cmd(&w, &["status", "--porcelain", "--ignore-submodules=none"])
        .output()
        .unwrap();
    assert!(out.status.success());
    real_attack_ignored_by_host_git(
        &f,
        &s,
        &marker,
        "sanity: an unguarded git status runs the submodule's filter",
    );
}

#[test]
fn test_guest_fsmonitor_never_runs_on_host() {
    let f = Fixture::committed();
    let (s, _) = f.prepare("s");
    let marker = f.tmp.path().join("pwned");
    guest_config(&s, "core.fsmonitor", &touch(&marker));
    write(&ws(&s), "a.txt", "changed\n");
    git_out(&ws(&s), &["status"]);
    assert!(
        marker.exists(),
        "sanity: an unguarded git runs the fsmonitor"
    );
    std::fs::remove_file(&marker).unwrap();
    assert_eq!(status(&s, None).unwrap().uncommitted, ["a.txt"]);
    assert_host_git_ignores_guest(&f, &s, &marker);
}

#[test]
fn test_guest_filter_driver_never_runs_on_host() {
    let f = Fixture::committed();
    let (s, _) = f.prepare("s");
    let w = ws(&s);
    let marker = f.tmp.path().join("pwned");
    write(&w, ".gitattributes", "* filter=x\n");
    guest_config(&s, "filter.x.clean", &format!("{}; cat", touch(&marker)));
    guest_config(&s, "filter.x.process", &touch(&marker));
    write(&w, "a.txt", "changed, same size?\n");
    assert_host_git_ignores_guest(&f, &s, &marker);
    // The attack is real: plain git in such a repository runs it.
    let (s2, _) = f.prepare("s2");
    write(&ws(&s2), ".gitattributes", "* filter=x\n");
    guest_config(&s2, "filter.x.clean", &format!("{}; cat", touch(&marker)));
    write(&ws(&s2), "a.txt", "changed\n");
    git(&ws(&s2), &["add", "a.txt"]);
    assert!(marker.exists(), "sanity: an unguarded git runs the filter");
}

#[test]
fn test_guest_textconv_and_diff_drivers_never_run_on_host() {
    let f = Fixture::committed();
    let (s, _) = f.prepare("s");
    let w = ws(&s);
    let marker = f.tmp.path().join("pwned");
    write(&w, ".gitattributes", "* diff=x merge=x\n");
    guest_config(&s, "diff.x.textconv", &touch(&marker));
    guest_config(&s, "diff.x.command", &touch(&marker));
    guest_config(&s, "diff.external", &touch(&marker));
    guest_config(&s, "merge.x.driver", &touch(&marker));
    write(&w, "a.txt", "changed\n");
    git_out(&w, &["diff"]);
    real_attack_ignored_by_host_git(
        &f,
        &s,
        &marker,
        "sanity: an unguarded git diff runs the driver",
    );
}

#[test]
fn test_guest_includes_never_reach_host_git() {
    let f = Fixture::committed();
    let (s, _) = f.prepare("s");
    let marker = f.tmp.path().join("pwned");
    let included = f.tmp.path().join("included.cfg");
    std::fs::write(
        &included,
        format!("[core]\n\tfsmonitor = {}\n", touch(&marker)),
    )
    .unwrap();
    guest_config(&s, "include.path", included.to_str().unwrap());
    guest_config(
        &s,
        &format!("includeIf.gitdir:{}/.path", ws(&s).display()),
        included.to_str().unwrap(),
    );
    write(&ws(&s), "a.txt", "changed\n");
    git_out(&ws(&s), &["status"]);
    real_attack_ignored_by_host_git(
        &f,
        &s,
        &marker,
        "sanity: an unguarded git follows the include",
    );
}

#[test]
fn test_guest_core_programs_and_hooks_path_never_run_on_host() {
    let f = Fixture::committed();
    let (s, _) = f.prepare("s");
    let marker = f.tmp.path().join("pwned");
    let hooks = f.tmp.path().join("guest-hooks");
    for name in ["post-index-change", "reference-transaction", "pre-auto-gc"] {
        hook(&hooks, name, &marker);
    }
    for (key, value) in [
        ("core.hooksPath", hooks.to_str().unwrap().to_string()),
        ("core.pager", touch(&marker)),
        ("core.editor", touch(&marker)),
        ("core.sshCommand", touch(&marker)),
        ("core.askPass", touch(&marker)),
        ("core.alternateRefsCommand", touch(&marker)),
        ("core.worktree", "/".to_string()),
        ("gpg.program", touch(&marker)),
        ("credential.helper", format!("!{}", touch(&marker))),
        ("alias.status", format!("!{}", touch(&marker))),
        (
            "remote.origin.url",
            format!("ext::sh -c {}", touch(&marker)),
        ),
        ("gc.auto", "1".to_string()),
    ] {
        guest_config(&s, key, &value);
    }
    write(&ws(&s), "a.txt", "changed\n");
    // The attack is real: a plain git that writes the index runs the hook. `status` writes
    // it only when it refreshed a racily clean entry (a timing a loaded run did not give),
    // so the control also stages the change, which always writes it.
    let w = ws(&s);
    for args in [&["status"][..], &["add", "a.txt"][..]] {
        let mut plain = std::process::Command::new("git");
        plain
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("HOME", "/nonexistent")
            .env("GIT_CONFIG_NOSYSTEM", "1")
            .env("GIT_CONFIG_GLOBAL", "/dev/null")
            .arg("--git-dir")
            .arg(w.join(".git"))
            .arg("--work-tree")
            .arg(&w)
            .args(args);
        let _ = plain.output().unwrap();
    }
    real_attack_ignored_by_host_git(
        &f,
        &s,
        &marker,
        "sanity: an unguarded git runs the guest's hook",
    );
}

#[test]
fn test_guest_git_dir_redirects_ignored_or_refused() {
    let f = Fixture::committed();
    let evil = Fixture::committed();
    let marker = f.tmp.path().join("pwned");
    git(&evil.src, &["config", "core.fsmonitor", &touch(&marker)]);
    write(&evil.src, "evil-only.txt", "x\n");

    // Alternates and commondir in the guest's git directory are never followed.
    let (s, _) = f.prepare("s");
    let alt = ws(&s).join(".git/objects/info/alternates");
    std::fs::write(
        &alt,
        format!("/etc\n{}\n", evil.src.join(".git/objects").display()),
    )
    .unwrap();
    std::fs::write(
        ws(&s).join(".git/commondir"),
        evil.src.join(".git").to_str().unwrap(),
    )
    .unwrap();
    let r = status(&s, None).unwrap();
    assert!(r.is_clean(), "{r:?}");
    assert!(!marker.exists());

    // A symlinked object directory or pack is refused, not read.
    std::os::unix::fs::symlink(
        evil.src.join(".git/objects/pack"),
        ws(&s).join(".git/objects/xx"),
    )
    .unwrap();
    status(&s, None).unwrap();
    let objects = ws(&s).join(".git/objects");
    std::fs::remove_file(objects.join("xx")).unwrap();
    let first = std::fs::read_dir(evil.src.join(".git/objects"))
        .unwrap()
        .filter_map(Result::ok)
        .find(|e| e.file_name().len() == 2)
        .unwrap()
        .file_name();
    std::os::unix::fs::symlink(
        evil.src.join(".git/objects").join(&first),
        objects.join(&first),
    )
    .unwrap();
    assert!(matches!(
        status(&s, None),
        Err(SessionError::UnsafeGitDir { .. })
    ));
    std::fs::remove_file(objects.join(&first)).unwrap();
    status(&s, None).unwrap();

    // HEAD, refs and the index must be plain files: a symlink or a FIFO is refused at once.
    for name in ["HEAD", "index", "refs/heads/main"] {
        let p = ws(&s).join(".git").join(name);
        let saved = std::fs::read(&p).unwrap();
        std::fs::remove_file(&p).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", &p).unwrap();
        assert!(
            matches!(status(&s, None), Err(SessionError::UnsafeGitDir { .. })),
            "{name}"
        );
        std::fs::remove_file(&p).unwrap();
        nix::unistd::mkfifo(&p, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        let t = std::time::Instant::now();
        assert!(
            matches!(status(&s, None), Err(SessionError::UnsafeGitDir { .. })),
            "{name}"
        );
        assert!(
            t.elapsed() < std::time::Duration::from_secs(10),
            "{name}: blocked"
        );
        std::fs::remove_file(&p).unwrap();
        std::fs::write(&p, saved).unwrap();
    }
    // A HEAD naming something that is not a branch is refused.
    std::fs::write(
        ws(&s).join(".git/HEAD"),
        "ref: refs/heads/../../../../etc/passwd\n",
    )
    .unwrap();
    assert!(matches!(
        status(&s, None),
        Err(SessionError::UnsafeGitDir { .. })
    ));
    std::fs::write(ws(&s).join(".git/HEAD"), "ref: refs/heads/main\n").unwrap();
    status(&s, None).unwrap();

    // `.git` as a `gitdir:` file or as a symlink is refused.
    let (s2, _) = f.prepare("s2");
    let g = ws(&s2).join(".git");
    std::fs::rename(&g, f.tmp.path().join("moved-git")).unwrap();
    std::fs::write(&g, format!("gitdir: {}\n", evil.src.join(".git").display())).unwrap();
    assert!(matches!(
        status(&s2, None),
        Err(SessionError::UnsafeGitDir { .. })
    ));
    std::fs::remove_file(&g).unwrap();
    std::os::unix::fs::symlink(evil.src.join(".git"), &g).unwrap();
    assert!(matches!(
        export(&s2, &f.src, "x", None),
        Err(SessionError::UnsafeGitDir { .. })
    ));
    assert!(!marker.exists());
}

#[test]
fn test_hooks_never_run_on_host() {
    let f = Fixture::committed();
    let marker = f.tmp.path().join("hook-ran");
    let src_hooks = f.src.join(".git/hooks");
    for name in [
        "reference-transaction",
        "post-checkout",
        "post-index-change",
        "pre-auto-gc",
    ] {
        hook(&src_hooks, name, &marker);
    }
    // Sanity: the source's hooks are live for the source's own git.
    git(&f.src, &["update-ref", "refs/heads/probe", "HEAD"]);
    assert!(marker.exists());
    std::fs::remove_file(&marker).unwrap();

    let (s, _) = f.prepare("s");
    let w = ws(&s);
    write(&w, "n.txt", "n\n");
    git(&w, &["add", "n.txt"]);
    git(&w, &["commit", "-qm", "n"]);
    for name in [
        "reference-transaction",
        "post-index-change",
        "pre-auto-gc",
        "post-checkout",
    ] {
        hook(&w.join(".git/hooks"), name, &marker);
    }
    status(&s, None).unwrap();
    export(&s, &f.src, "exported", None).unwrap();
    remove(&s, true, None).unwrap();
    assert!(
        !marker.exists(),
        "a hook ran during prepare/status/export/remove"
    );
}

/// (A source whose config includes other files is refused outright:
/// `hostile_source::test_source_config_includes_refused`.)
#[test]
fn test_source_config_not_copied_identity_is() {
    let f = Fixture::committed();
    for (k, v) in [
        (
            "remote.origin.url",
            "https://user:s3cret-token@example.com/r.git",
        ),
        ("credential.helper", "store"),
        ("core.hooksPath", "/tmp/hooks"),
        ("alias.st", "status"),
        ("user.name", "Source User"),
        ("user.email", "source@example.com"),
    ] {
        git(&f.src, &["config", k, v]);
    }
    let (s, _) = f.prepare("s");
    let cfg = std::fs::read_to_string(ws(&s).join(".git/config")).unwrap();
    for leaked in ["s3cret", "remote", "credential", "hooks", "alias"] {
        assert!(!cfg.contains(leaked), "{leaked} in {cfg}");
    }
    let w = ws(&s);
    assert_eq!(git(&w, &["config", "user.name"]).trim(), "Source User");
    assert_eq!(
        git(&w, &["config", "user.email"]).trim(),
        "source@example.com"
    );
    status(&s, None).unwrap();
}

fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

const NOBODY: Owner = Owner {
    uid: 65534,
    gid: 65534,
};

/// A fixture whose temp dir the unprivileged owner can traverse and whose source it owns.
fn owned_fixture() -> Fixture {
    let f = Fixture::committed();
    std::fs::set_permissions(f.tmp.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    write(&f.src, "run.sh", "#!/bin/sh\n");
    chmod(&f.src, "run.sh", 0o755);
    std::os::unix::fs::symlink("a.txt", f.src.join("link")).unwrap();
    write(&f.src, "d/u.txt", "untracked\n");
    let st = std::process::Command::new("chown")
        .args(["-R", "65534:65534"])
        .arg(&f.src)
        .status()
        .unwrap();
    assert!(st.success());
    f
}

fn owners_under(root: &Path) -> Vec<(PathBuf, u32, u32)> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let e = e.unwrap();
            let m = std::fs::symlink_metadata(e.path()).unwrap();
            out.push((e.path(), m.uid(), m.gid()));
            if m.is_dir() {
                stack.push(e.path());
            }
        }
    }
    out
}

#[test]
fn test_owner_owns_the_copy_and_runs_git() {
    assert!(
        is_root(),
        "this test acts as nobody and needs root, as .ci/run runs the suite"
    );
    let f = owned_fixture();
    let s = f.session("s");
    let p = warren_session::prepare(&f.src, &s, Some(NOBODY)).unwrap();
    assert_eq!(
        (p.files, p.symlinks),
        (3, 1),
        "a.txt, run.sh, d/u.txt and the link"
    );
    let w = ws(&s);
    let all = owners_under(&w);
    assert!(all.len() > 8, "{all:?}");
    for (path, uid, gid) in &all {
        assert_eq!((*uid, *gid), (65534, 65534), "{}", path.display());
    }
    let m = std::fs::metadata(&w).unwrap();
    assert_eq!((m.uid(), m.gid()), (65534, 65534));
    assert_eq!(
        std::fs::metadata(&s).unwrap().permissions().mode() & 0o777,
        0o711
    );

    // The guest user (here: nobody too) commits; host status and export run as nobody.
    let run = |args: &[&str]| {
        let out = git_cmd(&w, args).uid(65534).gid(65534).output().unwrap();
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    run(&["add", "-A"]);
    run(&["commit", "-qm", "as nobody"]);
    assert_eq!(status(&s, Some(NOBODY)).unwrap().unexported.len(), 1);
    export(&s, &f.src, "from-nobody", Some(NOBODY)).unwrap();
    for (path, uid, _) in owners_under(&f.src.join(".git")) {
        assert_eq!(uid, 65534, "{} is not the owner's", path.display());
    }
    remove(&s, false, Some(NOBODY)).unwrap();
}

#[test]
fn test_owner_permissions_apply_to_the_copy() {
    assert!(
        is_root(),
        "this test acts as nobody and needs root, as .ci/run runs the suite"
    );
    let f = owned_fixture();
    // A file in the owner's checkout that the owner cannot read (root's, 0600).
    write(&f.src, "d/root-only.txt", "secret\n");
    chmod(&f.src, "d/root-only.txt", 0o600);
    std::os::unix::fs::chown(f.src.join("d/root-only.txt"), Some(0), Some(0)).unwrap();
    let s = f.session("s");
    let err = warren_session::prepare(&f.src, &s, Some(NOBODY)).unwrap_err();
    // Its own error (the service's `forbidden`), naming the file, not an I/O failure.
    match &err {
        SessionError::Unreadable { path, .. } => {
            assert!(path.ends_with("d/root-only.txt"), "{}", path.display());
        }
        other => panic!("unexpected {other}"),
    }
    assert!(!s.exists(), "a failed prepare leaves nothing behind");
}

/// A guest-written index naming paths outside the working tree (`../`, absolute, `.git`)
/// would make host git stat and hash host files (an oracle for their existence and
/// content): refused before host git looks at the working tree.
#[test]
fn test_guest_index_paths_outside_the_work_tree_refused() {
    let f = Fixture::committed();
    let (s, _) = f.prepare("s");
    let w = ws(&s);
    let blob = git(&w, &["hash-object", "-w", "a.txt"]);
    let blob = blob.trim();
    let index = w.join(".git/index");
    let saved = std::fs::read(&index).unwrap();
    for bad in ["../../outside.txt", "/etc/hostname", ".git/config", "a/./b"] {
        write_index(&index, &[(0o100644, blob, "a.txt"), (0o100644, blob, bad)]);
        // Sanity: git itself reads such an index.
        assert!(git_out(&w, &["ls-files"]).status.success(), "{bad}");
        match status(&s, None) {
            Err(SessionError::UnsafeGitDir { reason, .. }) => {
                assert!(reason.contains("outside the working tree"), "{reason}")
            }
            other => panic!("{bad}: {other:?}"),
        }
    }
    std::fs::write(&index, saved).unwrap();
    assert!(status(&s, None).unwrap().is_clean());
}

/// A gitlink whose directory holds a `.git` file naming the session's own (guest-written)
/// git directory made host git open that directory as a submodule repository and read its
/// config, includes and all. The scratch index marks gitlinks skip-worktree, so nothing under
/// them is opened. Positive control: a plain copy of the index does read it.
#[test]
fn test_guest_gitlink_gitfile_never_reads_guest_config() {
    let f = Fixture::committed();
    let (s, _) = f.prepare("s");
    let w = ws(&s);
    let head = git(&w, &["rev-parse", "HEAD"]);
    git(
        &w,
        &[
            "update-index",
            "--add",
            "--cacheinfo",
            &format!("160000,{},sub", head.trim()),
        ],
    );
    std::fs::create_dir(w.join("sub")).unwrap();
    std::fs::write(w.join("sub/.git"), "gitdir: ../.git\n").unwrap();
    let bad = f.tmp.path().join("not-a-config");
    std::fs::write(&bad, "this line is no config\n").unwrap();
    let cfg = w.join(".git/config");
    let clean_cfg = std::fs::read_to_string(&cfg).unwrap();
    std::fs::write(
        &cfg,
        format!("{clean_cfg}[include]\n\tpath = {}\n", bad.display()),
    )
    .unwrap();

    // Positive control: host git over a clean copy of the git directory still opens the
    // guest's config through the gitlink and fails on the included file.
    let copy = f.tmp.path().join("copy.git");
    let st = std::process::Command::new("cp")
        .args(["-r"])
        .arg(w.join(".git"))
        .arg(&copy)
        .status()
        .unwrap();
    assert!(st.success());
    std::fs::write(copy.join("config"), &clean_cfg).unwrap();
    let out = std::process::Command::new("git")
        .env("GIT_CONFIG_GLOBAL", "/dev/null")
        .arg("--git-dir")
        .arg(&copy)
        .arg("--work-tree")
        .arg(&w)
        .args(["status", "--porcelain", "--ignore-submodules=all"])
        .output()
        .unwrap();
    assert!(
        !out.status.success() && String::from_utf8_lossy(&out.stderr).contains("not-a-config"),
        "sanity: the gitlink path reads the guest's config: {}",
        String::from_utf8_lossy(&out.stderr)
    );

    status(&s, None).expect("status never reads the guest's config");
    let _ = export(&s, &f.src, "gitlink-probe", None);
    remove(&s, true, None).unwrap();
}
