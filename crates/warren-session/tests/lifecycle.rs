//! Sessions over time: isolation, status, export and removal.

mod common;

use common::*;
use warren_session::{export, remove, status, SessionError};

fn commit_in(w: &std::path::Path, file: &str, content: &str, msg: &str) -> String {
    write(w, file, content);
    git(w, &["add", file]);
    git(w, &["commit", "-qm", msg]);
    git(w, &["rev-parse", "HEAD"]).trim().to_string()
}

#[test]
fn test_two_sessions_isolated_from_each_other_and_source() {
    let f = Fixture::committed();
    write(&f.src, "wip.txt", "work in progress\n");
    let (s1, _) = f.prepare("s1");
    let (s2, _) = f.prepare("s2");
    let src_git = snapshot(&f.src.join(".git"));
    let src_head = git(&f.src, &["rev-parse", "HEAD"]);
    let (w1, w2) = (ws(&s1), ws(&s2));

    write(&w1, "a.txt", "edited in s1\n");
    let c1 = commit_in(&w1, "s1.txt", "only s1\n", "s1 commit");
    git(&w1, &["branch", "s1-branch"]);

    assert_eq!(
        std::fs::read_to_string(w2.join("a.txt")).unwrap(),
        "alpha\n"
    );
    assert!(!w2.join("s1.txt").exists());
    assert_eq!(git(&w2, &["rev-parse", "HEAD"]), src_head);
    assert!(
        !git_out(&w2, &["cat-file", "-e", &c1]).status.success(),
        "s1's commit is not visible in s2"
    );
    assert!(!git_out(&w2, &["rev-parse", "--verify", "-q", "s1-branch"])
        .status
        .success());
    assert_eq!(porcelain(&w2), "?? wip.txt\n");

    assert_eq!(
        std::fs::read_to_string(f.src.join("a.txt")).unwrap(),
        "alpha\n"
    );
    assert_eq!(git(&f.src, &["rev-parse", "HEAD"]), src_head);
    assert!(!git_out(&f.src, &["cat-file", "-e", &c1]).status.success());
    assert_eq!(
        snapshot(&f.src.join(".git")),
        src_git,
        "the source .git changed"
    );
}

#[test]
fn test_session_commit_writes_objects_only_in_session() {
    let f = Fixture::committed();
    let before = snapshot(&f.src.join(".git"));
    let (s, _) = f.prepare("s");
    let w = ws(&s);
    let objects_before = files_under(&w.join(".git/objects")).len();
    let c = commit_in(&w, "new.txt", "new\n", "session commit");
    status(&s, None).unwrap();
    let objects_after = files_under(&w.join(".git/objects"));
    // commit + tree + blob, loose in the session's own store.
    assert_eq!(objects_after.len(), objects_before + 3, "{objects_after:?}");
    let loose = format!("{}/{}", &c[..2], &c[2..]);
    assert!(objects_after
        .iter()
        .any(|p| p.to_str() == Some(loose.as_str())));
    assert_eq!(
        snapshot(&f.src.join(".git")),
        before,
        "prepare, commit or status touched the source .git"
    );
}

#[test]
fn test_status_reports_uncommitted_and_unexported() {
    let f = Fixture::committed();
    let (s, _) = f.prepare("s");
    let w = ws(&s);
    assert!(status(&s, None).unwrap().is_clean());

    write(&w, "a.txt", "changed\n");
    write(&w, "dir/u.txt", "untracked\n");
    let r = status(&s, None).unwrap();
    assert_eq!(
        r.uncommitted,
        vec!["a.txt".to_string(), "dir/u.txt".to_string()]
    );
    assert!(r.unexported.is_empty());

    git(&w, &["add", "-A"]);
    git(&w, &["commit", "-qm", "one"]);
    let c2 = commit_in(&w, "b.txt", "b\n", "two");
    git(&w, &["mv", "b.txt", "c.txt"]);
    let r = status(&s, None).unwrap();
    assert_eq!(r.uncommitted, vec!["c.txt".to_string()]);
    assert_eq!(r.unexported.len(), 2);
    assert_eq!(r.unexported[0], c2);

    // A commit only on another session branch counts too.
    git(&w, &["reset", "-q", "--hard"]);
    git(&w, &["checkout", "-q", "-b", "side", "HEAD~2"]);
    let r = status(&s, None).unwrap();
    assert_eq!(r.unexported.len(), 2, "commits on main stay unexported");
}

#[test]
fn test_export_creates_branch_with_session_commit() {
    let f = Fixture::committed();
    write(&f.src, "staged.txt", "staged only in the source index\n");
    git(&f.src, &["add", "staged.txt"]);
    let (s, p) = f.prepare("s");
    let w = ws(&s);
    git(&w, &["commit", "-qm", "commit the staged file"]);
    let c = commit_in(&w, "new.txt", "from the session\n", "session work");
    assert_eq!(status(&s, None).unwrap().unexported.len(), 2);

    let e = export(&s, &f.src, "session/one", None).unwrap();
    assert_eq!(e.refname, "refs/heads/session/one");
    assert_eq!(e.commit, c);
    assert_eq!(e.previous, None);
    assert_eq!(e.new_commits, 2);
    assert_eq!(git(&f.src, &["rev-parse", "session/one"]).trim(), c);
    assert_eq!(
        git(&f.src, &["show", "session/one:new.txt"]),
        "from the session\n"
    );
    assert_eq!(
        git(&f.src, &["show", "session/one:staged.txt"]),
        "staged only in the source index\n"
    );
    git(
        &f.src,
        &["fsck", "--strict", "--no-progress", "--no-dangling"],
    );
    // The source's checkout is untouched.
    assert_eq!(
        git(&f.src, &["symbolic-ref", "HEAD"]).trim(),
        "refs/heads/main"
    );
    assert_eq!(porcelain(&f.src), "A  staged.txt\n");
    assert!(status(&s, None).unwrap().is_clean());
    // It also works with the git dir or a subdirectory as the source path.
    assert_eq!(
        export(&s, &p.source_git_dir, "session/one", None)
            .unwrap()
            .new_commits,
        0
    );
}

#[test]
fn test_export_fast_forward_then_refuses_diverged_branch() {
    let f = Fixture::committed();
    let (s, _) = f.prepare("s");
    let w = ws(&s);
    let c1 = commit_in(&w, "n.txt", "1\n", "one");
    export(&s, &f.src, "feat", None).unwrap();
    let c2 = commit_in(&w, "n.txt", "2\n", "two");
    let e = export(&s, &f.src, "feat", None).unwrap();
    assert_eq!(e.previous.as_deref(), Some(c1.as_str()));
    assert_eq!((e.commit.as_str(), e.new_commits), (c2.as_str(), 1));

    // The branch moves on in the source: the session's next export is no fast-forward.
    git(&f.src, &["branch", "other", "main"]);
    git(
        &f.src,
        &["update-ref", "refs/heads/feat", "refs/heads/main"],
    );
    let main = git(&f.src, &["rev-parse", "main"]).trim().to_string();
    let wt = f.tmp.path().join("wt");
    git(
        &f.src,
        &["worktree", "add", "-q", wt.to_str().unwrap(), "feat"],
    );
    commit_in(&wt, "theirs.txt", "x\n", "theirs");
    git(&f.src, &["worktree", "remove", wt.to_str().unwrap()]);
    let theirs = git(&f.src, &["rev-parse", "feat"]).trim().to_string();
    assert_ne!(theirs, main);
    let err = export(&s, &f.src, "feat", None).unwrap_err();
    assert!(
        matches!(err, SessionError::NotFastForward { ref existing, .. } if *existing == theirs),
        "{err}"
    );
    assert_eq!(
        git(&f.src, &["rev-parse", "feat"]).trim(),
        theirs,
        "the branch was not moved"
    );
}

#[test]
fn test_export_refuses_checked_out_branch() {
    let f = Fixture::committed();
    let (s, _) = f.prepare("s");
    commit_in(&ws(&s), "n.txt", "1\n", "one");
    let before = git(&f.src, &["rev-parse", "main"]);
    let err = export(&s, &f.src, "main", None).unwrap_err();
    assert!(
        matches!(err, SessionError::BranchCheckedOut { .. }),
        "{err}"
    );
    assert_eq!(git(&f.src, &["rev-parse", "main"]), before);
}

#[test]
fn test_export_refuses_unborn_checked_out_branch() {
    // An empty source: its worktree sits on unborn main.
    let f = Fixture::empty();
    let (s, _) = f.prepare("s");
    assert!(matches!(
        export(&s, &f.src, "x", None),
        Err(SessionError::NothingToExport)
    ));
    commit_in(&ws(&s), "n.txt", "1\n", "one");
    let err = export(&s, &f.src, "main", None).unwrap_err();
    assert!(
        matches!(err, SessionError::BranchCheckedOut { .. }),
        "{err}"
    );
    let e = export(&s, &f.src, "first", None).unwrap();
    assert_eq!(e.new_commits, 1);
    assert_eq!(git(&f.src, &["log", "--format=%s", "first"]).trim(), "one");
}

#[test]
fn test_export_invalid_branch_names_refused() {
    let f = Fixture::committed();
    let (s, _) = f.prepare("s");
    commit_in(&ws(&s), "n.txt", "1\n", "one");
    for bad in [
        "",
        "-x",
        "a b",
        "bad..name",
        "x.lock",
        "@{-1}",
        "HEAD",
        "a~1",
        "/x",
        "refs/heads/",
    ] {
        let err = export(&s, &f.src, bad, None).unwrap_err();
        assert!(
            matches!(err, SessionError::InvalidBranch(_)),
            "{bad:?}: {err}"
        );
    }
}

#[test]
fn test_export_to_other_repository_refused() {
    let f = Fixture::committed();
    let other = Fixture::committed();
    let (s, _) = f.prepare("s");
    commit_in(&ws(&s), "n.txt", "1\n", "one");
    let err = export(&s, &other.src, "x", None).unwrap_err();
    assert!(matches!(err, SessionError::SourceMismatch { .. }), "{err}");
    assert!(!git_out(&other.src, &["rev-parse", "--verify", "-q", "x"])
        .status
        .success());
}

#[test]
fn test_remove_refuses_with_work_then_force_keeps_source() {
    let f = Fixture::committed();
    let (s, p) = f.prepare("s");
    let w = ws(&s);
    commit_in(&w, "n.txt", "1\n", "one");
    write(&w, "dirty.txt", "x\n");
    let before = snapshot(&p.source_objects);
    let err = remove(&s, false, None).unwrap_err();
    match &err {
        SessionError::Unsaved {
            uncommitted,
            unexported,
        } => {
            assert_eq!(uncommitted, &vec!["dirty.txt".to_string()]);
            assert_eq!(*unexported, 1);
        }
        other => panic!("unexpected {other}"),
    }
    assert!(err.to_string().contains("dirty.txt"), "{err}");
    assert!(s.exists());
    remove(&s, true, None).unwrap();
    assert!(!s.exists());
    assert!(p.source_objects.is_dir());
    assert_eq!(
        snapshot(&p.source_objects),
        before,
        "removal touched the source objects"
    );
    assert_eq!(git(&f.src, &["log", "--format=%s"]).trim(), "initial");
}

#[test]
fn test_remove_clean_and_exported_session() {
    let f = Fixture::committed();
    let (s, _) = f.prepare("s");
    commit_in(&ws(&s), "n.txt", "1\n", "one");
    export(&s, &f.src, "done", None).unwrap();
    remove(&s, false, None).unwrap();
    assert!(!s.exists());
    assert!(matches!(
        remove(&s, false, None),
        Err(SessionError::Io { .. })
    ));
}

#[test]
fn test_remove_refuses_non_session_directory() {
    let tmp = tempfile::tempdir().unwrap();
    write(tmp.path(), "file", "x");
    let err = remove(tmp.path(), true, None).unwrap_err();
    assert!(matches!(err, SessionError::NotASession { .. }), "{err}");
    assert!(tmp.path().join("file").exists());
}

/// A shallow source (a `--depth 1` clone): status and export work over its missing history
/// (the scratch directory carries a streamed copy of its `shallow` file).
#[test]
fn test_status_and_export_over_a_shallow_source() {
    let f = Fixture::committed();
    commit_in(&f.src, "b.txt", "b\n", "second");
    let clone = f.tmp.path().join("clone");
    let url = format!("file://{}", f.src.display());
    let out = git_cmd(
        f.tmp.path(),
        &["clone", "-q", "--depth", "1", &url, "clone"],
    )
    .output()
    .expect("clone");
    assert!(out.status.success(), "{out:?}");
    assert!(clone.join(".git/shallow").is_file(), "not a shallow clone");
    let s = f.session("s");
    warren_session::prepare(&clone, &s, None).expect("prepare");
    let w = ws(&s);
    assert!(status(&s, None).unwrap().is_clean());
    let c = commit_in(&w, "c.txt", "c\n", "session work");
    let r = status(&s, None).unwrap();
    assert_eq!(r.unexported, vec![c.clone()]);
    let e = export(&s, &clone, "session/shallow", None).unwrap();
    assert_eq!((e.commit.as_str(), e.new_commits), (c.as_str(), 1));
    assert_eq!(git(&clone, &["show", "session/shallow:c.txt"]), "c\n");
}
