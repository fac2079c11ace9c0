//! The fidelity contract: what a session copy holds of the source checkout.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use common::*;
use warren_session::{Head, SessionError, SkipReason};

/// Every byte value, so any text conversion would show.
fn binary_blob() -> Vec<u8> {
    (0..=255u8)
        .chain((0..=255u8).rev())
        .chain(*b"\r\n\0\r")
        .collect()
}

/// A source with every kind of change the contract covers.
fn rich() -> Fixture {
    let f = Fixture::empty();
    let s = &f.src;
    write(s, ".gitignore", "*.log\nbuild/\n");
    write(s, "a.txt", "alpha\n");
    write(s, "dir/b.txt", "bravo\n");
    write(s, "del.txt", "to delete (staged)\n");
    write(s, "gone.txt", "to delete (unstaged)\n");
    write(
        s,
        "ren_old.txt",
        "renamed content that is long enough to be a rename\n",
    );
    write(s, "bin.dat", binary_blob());
    write(s, "run.sh", "#!/bin/sh\necho hi\n");
    chmod(s, "run.sh", 0o755);
    write(s, "mode.sh", "#!/bin/sh\n");
    std::os::unix::fs::symlink("a.txt", s.join("link_in")).expect("symlink");
    std::os::unix::fs::symlink("/etc/passwd", s.join("link_out")).expect("symlink");
    git(s, &["add", "."]);
    git(s, &["commit", "-qm", "base"]);
    // Staged and then further unstaged change to one file (MM).
    write(s, "a.txt", "alpha staged\n");
    git(s, &["add", "a.txt"]);
    write(s, "a.txt", "alpha staged\nand unstaged\n");
    write(s, "dir/b.txt", "bravo unstaged\n");
    git(s, &["rm", "-q", "del.txt"]);
    std::fs::remove_file(s.join("gone.txt")).expect("rm");
    git(s, &["mv", "ren_old.txt", "ren_new.txt"]);
    write(s, "new_staged.txt", "new and staged\n");
    git(s, &["add", "new_staged.txt"]);
    chmod(s, "mode.sh", 0o755);
    let mut bin2 = binary_blob();
    bin2.reverse();
    write(s, "bin_untracked.dat", &bin2);
    write(s, "untracked.txt", "untracked\n");
    write(s, "udir/deep/u.txt", "deep untracked\n");
    std::os::unix::fs::symlink("/etc", s.join("ulink_out")).expect("symlink");
    write(s, "x.log", "ignored\n");
    write(s, "build/out.o", "ignored build\n");
    write(s, "udir/y.log", "ignored nested\n");
    f
}

#[test]
fn test_prepare_rich_source_status_and_diffs_equal() {
    let f = rich();
    let (s, p) = f.prepare("s");
    let w = ws(&s);
    let src_status = porcelain(&f.src);
    // The picture is non-trivial: every kind of entry is there.
    for line in [
        "MM a.txt",
        " M dir/b.txt",
        "D  del.txt",
        " D gone.txt",
        "R  ren_old.txt -> ren_new.txt",
        "A  new_staged.txt",
        " M mode.sh",
        "?? untracked.txt",
        "?? udir/deep/u.txt",
        "?? ulink_out",
        "?? bin_untracked.dat",
    ] {
        assert!(
            src_status.lines().any(|l| l == line),
            "{line} in {src_status}"
        );
    }
    assert_eq!(porcelain(&w), src_status);
    for args in [
        &["diff", "--binary"][..],
        &["diff", "--cached", "--binary"],
        &["diff", "HEAD", "--stat"],
    ] {
        assert_eq!(git(&w, args), git(&f.src, args), "{args:?}");
    }
    assert_eq!(
        git(&w, &["rev-parse", "HEAD"]),
        git(&f.src, &["rev-parse", "HEAD"])
    );
    assert!(
        matches!(p.head, Head::Branch { ref refname, commit: Some(_) } if refname == "refs/heads/main")
    );
    assert!(p.skipped.is_empty(), "{:?}", p.skipped);
    assert_eq!(p.source_toplevel, f.src.canonicalize().unwrap());
}

#[test]
fn test_prepare_ignored_files_not_copied() {
    let f = rich();
    let (s, _) = f.prepare("s");
    let w = ws(&s);
    for p in ["x.log", "build", "udir/y.log"] {
        assert!(std::fs::symlink_metadata(w.join(p)).is_err(), "{p} copied");
    }
    // .gitignore itself is tracked and copied, so the session ignores the same files.
    assert!(w.join(".gitignore").is_file());
    write(&w, "later.log", "x");
    assert!(!porcelain(&w).contains("later.log"));
}

#[test]
fn test_prepare_binary_bytes_and_exec_bits_kept() {
    let f = rich();
    let (s, _) = f.prepare("s");
    let w = ws(&s);
    for p in ["bin.dat", "bin_untracked.dat", "a.txt", "dir/b.txt"] {
        assert_eq!(
            std::fs::read(w.join(p)).unwrap(),
            std::fs::read(f.src.join(p)).unwrap(),
            "{p}"
        );
    }
    let mode = |root: &Path, p: &str| {
        std::fs::metadata(root.join(p))
            .unwrap()
            .permissions()
            .mode()
            & 0o777
    };
    assert_eq!(mode(&w, "run.sh"), 0o755);
    assert_eq!(mode(&w, "mode.sh"), 0o755);
    assert_eq!(mode(&w, "a.txt") & 0o111, 0);
}

#[test]
fn test_prepare_symlinks_recreated_not_followed() {
    let f = rich();
    let (s, p) = f.prepare("s");
    let w = ws(&s);
    for (link, target) in [
        ("link_in", "a.txt"),
        ("link_out", "/etc/passwd"),
        ("ulink_out", "/etc"),
    ] {
        let m = std::fs::symlink_metadata(w.join(link)).unwrap();
        assert!(m.file_type().is_symlink(), "{link}");
        assert_eq!(std::fs::read_link(w.join(link)).unwrap(), Path::new(target));
    }
    assert_eq!(p.symlinks, 3);
}

#[test]
fn test_prepare_deleted_and_renamed_follow_source() {
    let f = rich();
    let (s, _) = f.prepare("s");
    let w = ws(&s);
    for gone in ["del.txt", "gone.txt", "ren_old.txt"] {
        assert!(!w.join(gone).exists(), "{gone}");
    }
    assert!(w.join("ren_new.txt").is_file());
}

#[test]
fn test_prepare_path_under_symlinked_dir_not_read() {
    // A tracked file whose directory became a symlink to outside the repo: git shows it
    // deleted; the copy must not read through the link.
    let f = Fixture::committed();
    let outside = f.tmp.path().join("outside");
    write(&outside, "secret.txt", "outside the repo\n");
    write(&f.src, "sub/secret.txt", "tracked\n");
    git(&f.src, &["add", "."]);
    git(&f.src, &["commit", "-qm", "sub"]);
    std::fs::remove_dir_all(f.src.join("sub")).unwrap();
    std::os::unix::fs::symlink(&outside, f.src.join("sub")).unwrap();
    let (s, _) = f.prepare("s");
    let w = ws(&s);
    assert!(std::fs::symlink_metadata(w.join("sub"))
        .unwrap()
        .file_type()
        .is_symlink());
    assert_eq!(std::fs::read_link(w.join("sub")).unwrap(), outside);
    assert_eq!(porcelain(&w), porcelain(&f.src));
    // Nothing was created under the outside directory.
    assert_eq!(
        files_under(&outside),
        vec![Path::new("secret.txt").to_path_buf()]
    );
}

#[test]
fn test_prepare_empty_repo_without_commits() {
    let f = Fixture::empty();
    write(&f.src, "u.txt", "untracked\n");
    let (s, p) = f.prepare("s");
    let w = ws(&s);
    assert_eq!(
        p.head,
        Head::Branch {
            refname: "refs/heads/main".into(),
            commit: None
        }
    );
    assert_eq!(git(&w, &["symbolic-ref", "HEAD"]).trim(), "refs/heads/main");
    assert_eq!(porcelain(&w), "?? u.txt\n");
    // The session works: a first commit is possible.
    git(&w, &["add", "."]);
    git(&w, &["commit", "-qm", "first"]);
    assert_eq!(git(&w, &["log", "--format=%s"]).trim(), "first");
}

#[test]
fn test_prepare_empty_repo_with_staged_files() {
    let f = Fixture::empty();
    write(&f.src, "s.txt", "staged\n");
    write(&f.src, "u.txt", "untracked\n");
    git(&f.src, &["add", "s.txt"]);
    write(&f.src, "s.txt", "staged\nthen changed\n");
    let (s, _) = f.prepare("s");
    let w = ws(&s);
    assert_eq!(porcelain(&w), porcelain(&f.src));
    assert_eq!(porcelain(&w), "AM s.txt\n?? u.txt\n");
    assert_eq!(
        git(&w, &["diff", "--cached"]),
        git(&f.src, &["diff", "--cached"])
    );
}

#[test]
fn test_prepare_subdirectory_resolves_toplevel() {
    let f = Fixture::committed();
    write(&f.src, "deep/er/x.txt", "x\n");
    let s = f.session("s");
    let p = warren_session::prepare(&f.src.join("deep/er"), &s, None).unwrap();
    assert_eq!(p.source_toplevel, f.src.canonicalize().unwrap());
    assert!(ws(&s).join("a.txt").is_file());
    assert!(ws(&s).join("deep/er/x.txt").is_file());
}

#[test]
fn test_prepare_linked_worktree_source() {
    let f = Fixture::committed();
    let wt = f.tmp.path().join("wt");
    git(
        &f.src,
        &[
            "worktree",
            "add",
            "-q",
            "-b",
            "feature",
            wt.to_str().unwrap(),
        ],
    );
    assert!(wt.join(".git").is_file());
    write(&wt, "a.txt", "changed in worktree\n");
    write(&wt, "w.txt", "staged in worktree\n");
    git(&wt, &["add", "w.txt"]);
    let s = f.session("s");
    let p = warren_session::prepare(&wt, &s, None).unwrap();
    assert_eq!(p.source_toplevel, wt.canonicalize().unwrap());
    assert_eq!(p.source_git_dir, f.src.join(".git").canonicalize().unwrap());
    assert_eq!(
        p.source_objects,
        f.src.join(".git/objects").canonicalize().unwrap()
    );
    assert!(matches!(p.head, Head::Branch { ref refname, .. } if refname == "refs/heads/feature"));
    assert_eq!(porcelain(&ws(&s)), porcelain(&wt));
    assert_eq!(porcelain(&wt), " M a.txt\nA  w.txt\n");
    assert!(
        ws(&s).join(".git").is_dir(),
        "the session has a real git directory"
    );
}

#[test]
fn test_prepare_detached_head() {
    let f = Fixture::committed();
    let sha = git(&f.src, &["rev-parse", "HEAD"]).trim().to_string();
    git(&f.src, &["checkout", "-q", "--detach"]);
    let (s, p) = f.prepare("s");
    assert_eq!(
        p.head,
        Head::Detached {
            commit: sha.clone()
        }
    );
    let w = ws(&s);
    assert!(!git_out(&w, &["symbolic-ref", "-q", "HEAD"])
        .status
        .success());
    assert_eq!(git(&w, &["rev-parse", "HEAD"]).trim(), sha);
}

#[test]
fn test_prepare_branches_and_tags_copied() {
    let f = Fixture::committed();
    git(&f.src, &["branch", "other"]);
    git(&f.src, &["tag", "-a", "-m", "annotated", "v1"]);
    git(&f.src, &["tag", "light"]);
    let (s, _) = f.prepare("s");
    let list = |d: &Path| {
        git(
            d,
            &[
                "for-each-ref",
                "--format=%(refname) %(objectname)",
                "refs/heads",
                "refs/tags",
            ],
        )
    };
    assert_eq!(list(&ws(&s)), list(&f.src));
    assert_eq!(list(&ws(&s)).lines().count(), 4);
}

#[test]
fn test_prepare_submodule_left_empty() {
    let f = Fixture::committed();
    let sub = f.tmp.path().join("subrepo");
    std::fs::create_dir(&sub).unwrap();
    git(&sub, &["init", "-q"]);
    write(&sub, "s.txt", "sub\n");
    git(&sub, &["add", "."]);
    git(&sub, &["commit", "-qm", "sub"]);
    git(
        &f.src,
        &[
            "-c",
            "protocol.file.allow=always",
            "submodule",
            "add",
            "-q",
            sub.to_str().unwrap(),
            "mod",
        ],
    );
    git(&f.src, &["commit", "-qm", "add submodule"]);
    // An untracked nested repository, too.
    let nested = f.src.join("nested");
    std::fs::create_dir(&nested).unwrap();
    git(&nested, &["init", "-q"]);
    let (s, p) = f.prepare("s");
    let w = ws(&s);
    assert!(w.join("mod").is_dir());
    assert_eq!(std::fs::read_dir(w.join("mod")).unwrap().count(), 0);
    assert!(!w.join("nested").exists());
    let reasons: Vec<_> = p
        .skipped
        .iter()
        .map(|k| (k.path.to_str().unwrap().to_string(), k.reason))
        .collect();
    assert!(
        reasons.contains(&("mod".into(), SkipReason::Submodule)),
        "{reasons:?}"
    );
    assert!(
        reasons.contains(&("nested".into(), SkipReason::NestedRepository)),
        "{reasons:?}"
    );
    // An unpopulated submodule is clean; the nested repository is the only difference.
    assert_eq!(porcelain(&w), "");
    assert_eq!(porcelain(&f.src), "?? nested/\n");
}

#[test]
fn test_prepare_non_git_directory_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let plain = tmp.path().join("plain");
    std::fs::create_dir(&plain).unwrap();
    let s = tmp.path().join("s");
    let err = warren_session::prepare(&plain, &s, None).unwrap_err();
    assert!(matches!(err, SessionError::NotARepository(_)), "{err}");
    assert!(!s.exists());
    assert_eq!(
        warren_session::direct(&plain).unwrap(),
        plain.canonicalize().unwrap()
    );
    assert!(matches!(
        warren_session::direct(&plain.join("missing")),
        Err(SessionError::Io { .. })
    ));
}

#[test]
fn test_prepare_bare_repository_refused() {
    let f = Fixture::committed();
    let bare = f.tmp.path().join("bare.git");
    git(
        f.tmp.path(),
        &[
            "clone",
            "-q",
            "--bare",
            f.src.to_str().unwrap(),
            bare.to_str().unwrap(),
        ],
    );
    let err = warren_session::prepare(&bare, &f.session("s"), None).unwrap_err();
    assert!(matches!(err, SessionError::BareRepository(_)), "{err}");
    // The .git directory of a checkout is not a working tree either.
    let err = warren_session::prepare(&f.src.join(".git"), &f.session("s"), None).unwrap_err();
    assert!(matches!(err, SessionError::BareRepository(_)), "{err}");
    assert!(!f.session("s").exists());
}

#[test]
fn test_prepare_source_with_alternates_refused() {
    let f = Fixture::committed();
    let shared = f.tmp.path().join("shared");
    git(
        f.tmp.path(),
        &[
            "clone",
            "-q",
            "--shared",
            f.src.to_str().unwrap(),
            shared.to_str().unwrap(),
        ],
    );
    let err = warren_session::prepare(&shared, &f.session("s"), None).unwrap_err();
    assert!(matches!(err, SessionError::SourceHasAlternates(_)), "{err}");
}

#[test]
fn test_prepare_existing_session_dir_refused() {
    let f = Fixture::committed();
    let s = f.session("s");
    std::fs::create_dir(&s).unwrap();
    write(&s, "keep", "x");
    let err = warren_session::prepare(&f.src, &s, None).unwrap_err();
    assert!(matches!(err, SessionError::SessionExists(_)), "{err}");
    assert!(
        s.join("keep").is_file(),
        "an existing directory is left alone"
    );
}

#[test]
fn test_layout_relative_alternates_and_link() {
    let f = Fixture::committed();
    let (s, p) = f.prepare("s");
    let alt = std::fs::read_to_string(ws(&s).join(".git/objects/info/alternates")).unwrap();
    assert_eq!(alt, format!("{}\n", warren_session::ALTERNATES_ENTRY));
    let link = s.join(warren_session::SOURCE_OBJECTS_LINK);
    assert_eq!(
        std::fs::read_link(&link).unwrap(),
        f.src.join(".git/objects").canonicalize().unwrap()
    );
    assert_eq!(
        warren_session::source_objects_dir(&s).unwrap(),
        p.source_objects
    );
    // No hooks, no copied config.
    assert!(!ws(&s).join(".git/hooks").exists());
}

#[test]
fn test_session_dir_moved_still_works() {
    let f = rich();
    let (s, _) = f.prepare("s");
    let moved = f.session("moved");
    std::fs::rename(&s, &moved).unwrap();
    let w = ws(&moved);
    assert_eq!(porcelain(&w), porcelain(&f.src));
    assert_eq!(git(&w, &["log", "--format=%s"]).trim(), "base");
    git(&w, &["fsck", "--no-progress"]);
}

#[test]
fn test_guest_layout_resolves_through_root_link() {
    // What the guest sees: R/workspace is the copy, R/.warren-source-objects the read-only
    // source objects. The same relative entry must resolve there.
    let f = rich();
    let (s, _) = f.prepare("s");
    let root = f.tmp.path().join("guest-root");
    std::fs::create_dir(&root).unwrap();
    std::fs::rename(ws(&s), root.join("workspace")).unwrap();
    // The guest mounts the directory itself; a link from elsewhere stands in for the mount.
    std::os::unix::fs::symlink(
        f.src.join(".git/objects"),
        root.join(".warren-source-objects"),
    )
    .unwrap();
    let w = root.join("workspace");
    assert_eq!(git(&w, &["log", "--format=%s"]).trim(), "base");
    assert_eq!(git(&w, &["cat-file", "-p", "HEAD:dir/b.txt"]), "bravo\n");
    assert_eq!(porcelain(&w), porcelain(&f.src));
    // Without the source objects the copy cannot read its history: the link is what works.
    std::fs::remove_file(root.join(".warren-source-objects")).unwrap();
    assert!(!git_out(&w, &["cat-file", "-p", "HEAD:dir/b.txt"])
        .status
        .success());
}

#[test]
fn test_prepare_split_index_source() {
    let f = Fixture::committed();
    git(&f.src, &["update-index", "--split-index"]);
    write(&f.src, "s.txt", "staged\n");
    git(&f.src, &["add", "s.txt"]);
    write(&f.src, "a.txt", "unstaged\n");
    let shared = std::fs::read_dir(f.src.join(".git"))
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .starts_with("sharedindex.")
        })
        .count();
    assert!(shared > 0, "the source really has a split index");
    let (s, _) = f.prepare("s");
    let w = ws(&s);
    assert_eq!(porcelain(&w), " M a.txt\nA  s.txt\n");
    assert_eq!(porcelain(&w), porcelain(&f.src));
    let leftovers = std::fs::read_dir(w.join(".git"))
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .starts_with("sharedindex.")
        })
        .count();
    assert_eq!(leftovers, 0, "the session index is whole");
}
