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

fn assert_unsafe_config(r: Result<impl std::fmt::Debug, SessionError>, key: &str) {
    match r {
        Err(SessionError::UnsafeConfig { key: k }) => assert_eq!(k, key),
        other => panic!("expected UnsafeConfig({key}), got {other:?}"),
    }
}

/// A hook script that creates `marker` when run.
fn hook(dir: &Path, name: &str, marker: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    let p = dir.join(name);
    std::fs::write(&p, format!("#!/bin/sh\ntouch '{}'\n", marker.display())).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
}

#[test]
fn test_guest_fsmonitor_refused_without_running() {
    let f = Fixture::committed();
    let (s, _) = f.prepare("s");
    let marker = f.tmp.path().join("pwned");
    guest_config(&s, "core.fsmonitor", &format!("touch {}", marker.display()));
    write(&ws(&s), "a.txt", "changed\n");
    assert_unsafe_config(status(&s, None), "core.fsmonitor");
    assert_unsafe_config(export(&s, &f.src, "x", None), "core.fsmonitor");
    assert_unsafe_config(remove(&s, false, None), "core.fsmonitor");
    assert!(!marker.exists(), "the guest's fsmonitor ran on the host");
    assert!(s.exists());
    remove(&s, true, None).unwrap();
    assert!(!s.exists());
}

#[test]
fn test_guest_filter_driver_refused_without_running() {
    let f = Fixture::committed();
    let (s, _) = f.prepare("s");
    let w = ws(&s);
    let marker = f.tmp.path().join("pwned");
    write(&w, ".gitattributes", "* filter=x\n");
    guest_config(
        &s,
        "filter.x.clean",
        &format!("touch {}; cat", marker.display()),
    );
    write(&w, "a.txt", "changed, same size?\n");
    assert_unsafe_config(status(&s, None), "filter.x.clean");
    assert!(!marker.exists(), "the guest's filter ran on the host");
    // The attack is real: plain git in that repository runs it.
    git(&w, &["add", "a.txt"]);
    assert!(marker.exists(), "sanity: an unguarded git runs the filter");
}

#[test]
fn test_guest_config_keys_refused_by_name() {
    let f = Fixture::committed();
    let (s, _) = f.prepare("s");
    let cfg = ws(&s).join(".git/config");
    let clean = std::fs::read_to_string(&cfg).unwrap();
    for (key, value) in [
        ("include.path", "/etc/gitconfig"),
        ("includeIf.gitdir:/.path", "/x"),
        ("alias.st", "!touch /tmp/x"),
        ("core.pager", "touch /tmp/x"),
        ("core.sshCommand", "touch /tmp/x"),
        ("core.hooksPath", "/tmp"),
        ("core.worktree", "/"),
        ("diff.x.textconv", "touch /tmp/x"),
        ("extensions.worktreeConfig", "true"),
        ("remote.origin.url", "ext::sh -c touch% /tmp/x"),
    ] {
        std::fs::write(&cfg, &clean).unwrap();
        guest_config(&s, key, value);
        // git prints section and name lowercased, the subsection as written.
        let printed = match key.split_once('.') {
            Some((sec, rest)) => match rest.rsplit_once('.') {
                Some((sub, name)) => {
                    format!("{}.{sub}.{}", sec.to_lowercase(), name.to_lowercase())
                }
                None => format!("{}.{}", sec.to_lowercase(), rest.to_lowercase()),
            },
            None => key.to_string(),
        };
        assert_unsafe_config(status(&s, None), &printed);
    }
    std::fs::write(&cfg, &clean).unwrap();
    // Harmless guest settings are fine.
    guest_config(&s, "user.name", "Guest");
    guest_config(&s, "branch.main.description", "x");
    status(&s, None).unwrap();
}

#[test]
fn test_guest_git_dir_redirects_refused() {
    let f = Fixture::committed();
    let evil = Fixture::committed();
    let marker = f.tmp.path().join("pwned");
    git(
        &evil.src,
        &[
            "config",
            "core.fsmonitor",
            &format!("touch {}", marker.display()),
        ],
    );

    let (s, _) = f.prepare("s");
    let alt = ws(&s).join(".git/objects/info/alternates");
    std::fs::write(&alt, "/etc\n").unwrap();
    assert!(matches!(
        status(&s, None),
        Err(SessionError::UnsafeGitDir { .. })
    ));
    std::fs::write(
        &alt,
        format!("{}\n/etc\n", warren_session::ALTERNATES_ENTRY),
    )
    .unwrap();
    assert!(matches!(
        status(&s, None),
        Err(SessionError::UnsafeGitDir { .. })
    ));
    std::fs::write(&alt, format!("{}\n", warren_session::ALTERNATES_ENTRY)).unwrap();
    status(&s, None).unwrap();

    std::fs::write(
        ws(&s).join(".git/commondir"),
        evil.src.join(".git").to_str().unwrap(),
    )
    .unwrap();
    assert!(matches!(
        status(&s, None),
        Err(SessionError::UnsafeGitDir { .. })
    ));

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
        ("include.path", "/tmp/other"),
        ("user.name", "Source User"),
        ("user.email", "source@example.com"),
    ] {
        git(&f.src, &["config", k, v]);
    }
    let (s, _) = f.prepare("s");
    let cfg = std::fs::read_to_string(ws(&s).join(".git/config")).unwrap();
    for leaked in [
        "s3cret",
        "remote",
        "credential",
        "hooks",
        "alias",
        "include",
    ] {
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
    if !is_root() {
        eprintln!("skipped: needs root to act as nobody");
        return;
    }
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
    if !is_root() {
        eprintln!("skipped: needs root to act as nobody");
        return;
    }
    let f = owned_fixture();
    // A file in the owner's checkout that the owner cannot read (root's, 0600).
    write(&f.src, "d/root-only.txt", "secret\n");
    chmod(&f.src, "d/root-only.txt", 0o600);
    std::os::unix::fs::chown(f.src.join("d/root-only.txt"), Some(0), Some(0)).unwrap();
    let s = f.session("s");
    let err = warren_session::prepare(&f.src, &s, Some(NOBODY)).unwrap_err();
    match &err {
        SessionError::Io { source, path, .. } => {
            assert_eq!(source.kind(), std::io::ErrorKind::PermissionDenied, "{err}");
            assert!(path.ends_with("d/root-only.txt"), "{}", path.display());
        }
        other => panic!("unexpected {other}"),
    }
    assert!(!s.exists(), "a failed prepare leaves nothing behind");
}
