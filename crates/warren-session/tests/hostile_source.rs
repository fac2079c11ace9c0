//! A hostile source repository (issue 13, item 2): nothing in it may lead outside it. Each
//! mechanism is shown live first (git itself follows it: the positive control), then refused
//! before anything is copied, mounted or written, and the same repository without it works.

mod common;

use std::path::{Path, PathBuf};

use common::*;
use warren_session::{export, remove, status, SessionError};

/// `err` is the source refusal, naming a path that ends with `what`.
fn assert_source_refused(err: SessionError, what: &str) {
    match &err {
        SessionError::UnsafeSource { path, .. } => {
            assert!(
                path.ends_with(what),
                "{err}: {} is not {what}",
                path.display()
            )
        }
        other => panic!("expected UnsafeSource for {what}, got {other:?}"),
    }
}

/// No file under `root` (symlinks not followed) other than `except` holds `canary`.
fn assert_nowhere(root: &Path, canary: &str, except: &Path) {
    for rel in files_under(root) {
        let p = root.join(&rel);
        if p == except
            || std::fs::symlink_metadata(&p)
                .unwrap()
                .file_type()
                .is_symlink()
        {
            continue;
        }
        let bytes = std::fs::read(&p).unwrap();
        assert!(
            !String::from_utf8_lossy(&bytes).contains(canary),
            "{} holds the canary",
            p.display()
        );
    }
}

/// A file's bytes, or a directory's [`snapshot`], as text.
fn state_of(p: &Path) -> String {
    if p.is_dir() {
        format!("{:?}", snapshot(p))
    } else {
        String::from_utf8_lossy(&std::fs::read(p).unwrap()).into_owned()
    }
}

/// A session of `f` with one commit in it, for exports.
fn session_with_commit(f: &Fixture, name: &str) -> PathBuf {
    let (s, _) = f.prepare(name);
    let w = ws(&s);
    write(&w, "exported.txt", "from the session\n");
    git(&w, &["add", "exported.txt"]);
    git(&w, &["commit", "-qm", "session work"]);
    s
}

/// The source's `.git/objects` is a symlink to `/`: the whole host would have been linked as
/// the session's source objects and mounted read-only into the guest.
#[test]
fn test_source_objects_symlink_to_root_refused() {
    let f = Fixture::committed();
    let objects = f.src.join(".git/objects");
    let real = f.tmp.path().join("objects-real");
    std::fs::rename(&objects, &real).unwrap();
    std::os::unix::fs::symlink("/", &objects).unwrap();
    // Positive control: git resolves the object directory to `/` through the link.
    let resolved = git(
        &f.src,
        &[
            "rev-parse",
            "--path-format=absolute",
            "--git-path",
            "objects",
        ],
    );
    assert_eq!(
        Path::new(resolved.trim()).canonicalize().unwrap(),
        Path::new("/")
    );
    let s = f.session("s");
    let err = warren_session::prepare(&f.src, &s, None).unwrap_err();
    assert_source_refused(err, ".git/objects");
    assert!(!s.exists(), "nothing is made for a refused source");

    // The same repository without the link: a session, whose mount is the real directory.
    std::fs::remove_file(&objects).unwrap();
    std::fs::rename(&real, &objects).unwrap();
    let (s, p) = f.prepare("s");
    assert_eq!(p.source_objects, objects.canonicalize().unwrap());
    assert_eq!(
        warren_session::source_objects_dir(&s).unwrap(),
        p.source_objects
    );
    status(&s, None).unwrap();

    // Swapped for the link after the session was made: no mount, no status, no export.
    write(&ws(&s), "n.txt", "n\n");
    git(&ws(&s), &["add", "n.txt"]);
    git(&ws(&s), &["commit", "-qm", "n"]);
    std::fs::rename(&objects, &real).unwrap();
    std::os::unix::fs::symlink("/", &objects).unwrap();
    assert!(warren_session::source_objects_dir(&s).is_err());
    assert_source_refused(status(&s, None).unwrap_err(), ".git/objects");
    assert_source_refused(
        export(&s, &f.src, "probe", None).unwrap_err(),
        ".git/objects",
    );
    std::fs::remove_file(&objects).unwrap();
    std::fs::rename(&real, &objects).unwrap();
    assert!(!git_out(&f.src, &["rev-parse", "--verify", "-q", "probe"])
        .status
        .success());
    export(&s, &f.src, "probe", None).expect("the restored source exports");
}

/// The source's `.git/info/exclude` is a symlink to a host secret: it would have been copied
/// into the session's (guest-readable) git directory.
#[test]
fn test_source_info_exclude_symlink_to_host_secret_refused() {
    let f = Fixture::committed();
    let secret = f.tmp.path().join("host-secret");
    std::fs::write(&secret, "HOST-SECRET-CANARY-*\n").unwrap();
    let exclude = f.src.join(".git/info/exclude");
    std::fs::create_dir_all(exclude.parent().unwrap()).unwrap();
    let _ = std::fs::remove_file(&exclude);
    std::os::unix::fs::symlink(&secret, &exclude).unwrap();
    write(&f.src, "HOST-SECRET-CANARY-file", "x\n");
    // Positive control: git reads the secret through the link (its pattern applies).
    assert!(
        git_out(&f.src, &["check-ignore", "-q", "HOST-SECRET-CANARY-file"])
            .status
            .success()
    );
    let s = f.session("s");
    let err = warren_session::prepare(&f.src, &s, None).unwrap_err();
    assert_source_refused(err, ".git/info/exclude");
    assert!(!s.exists(), "nothing is made for a refused source");
    assert_nowhere(f.tmp.path(), "HOST-SECRET-CANARY-*", &secret);

    // The same repository with a plain exclude file: copied and honoured.
    std::fs::remove_file(&exclude).unwrap();
    std::fs::write(&exclude, "*.log\n").unwrap();
    write(&f.src, "debug.log", "ignored\n");
    let (s, _) = f.prepare("s");
    assert_eq!(
        std::fs::read_to_string(ws(&s).join(".git/info/exclude")).unwrap(),
        "*.log\n"
    );
    assert!(
        !ws(&s).join("debug.log").exists(),
        "the exclude was honoured"
    );
    assert!(ws(&s).join("HOST-SECRET-CANARY-file").is_file());
}

/// The source's `.git/commondir` names another repository's git directory: git would read
/// that repository's refs and objects, and an export would write into it.
#[test]
fn test_source_commondir_into_other_repository_refused() {
    let f = Fixture::committed();
    let other = Fixture::committed();
    let other_git = other.src.join(".git").canonicalize().unwrap();
    std::fs::write(
        f.src.join(".git/commondir"),
        format!("{}\n", other_git.display()),
    )
    .unwrap();
    // Positive control: git takes the other repository's git directory as the common one.
    let common = git(
        &f.src,
        &["rev-parse", "--path-format=absolute", "--git-common-dir"],
    );
    assert_eq!(Path::new(common.trim()).canonicalize().unwrap(), other_git);
    let s = f.session("s");
    let err = warren_session::prepare(&f.src, &s, None).unwrap_err();
    assert_source_refused(err, ".git/commondir");
    assert!(!s.exists());

    // Exporting a session of the other repository through this one writes nothing there.
    let s = session_with_commit(&other, "other-s");
    let before = snapshot(&other_git);
    assert_source_refused(
        export(&s, &f.src, "via-commondir", None).unwrap_err(),
        ".git/commondir",
    );
    assert_eq!(snapshot(&other_git), before, "the other repository changed");
    // Positive control: a normal export to the normal repository writes.
    export(&s, &other.src, "direct", None).unwrap();
    assert_ne!(snapshot(&other_git), before);
    assert!(
        git_out(&other.src, &["rev-parse", "--verify", "-q", "direct"])
            .status
            .success()
    );
    assert!(!git_out(
        &other.src,
        &["rev-parse", "--verify", "-q", "via-commondir"]
    )
    .status
    .success());
}

/// The source's `.git` is a `gitdir:` file naming another repository's git directory, or
/// claiming a linked worktree that repository registered somewhere else.
#[test]
fn test_source_gitdir_file_into_other_repository_refused() {
    let f = Fixture::committed();
    let other_git = f.src.join(".git").canonicalize().unwrap();
    let hostile = f.tmp.path().join("hostile");
    write(&hostile, "h.txt", "h\n");
    std::fs::write(
        hostile.join(".git"),
        format!("gitdir: {}\n", other_git.display()),
    )
    .unwrap();
    // Positive control: git opens the other repository from here.
    let found = git(&hostile, &["rev-parse", "--absolute-git-dir"]);
    assert_eq!(Path::new(found.trim()).canonicalize().unwrap(), other_git);
    let s = f.session("s");
    assert_source_refused(
        warren_session::prepare(&hostile, &s, None).unwrap_err(),
        "hostile/.git",
    );
    assert!(!s.exists());

    // A worktree of the other repository, registered at another path, claimed from here.
    let wt = f.tmp.path().join("registered-wt");
    git(
        &f.src,
        &["worktree", "add", "-q", "-b", "wt", wt.to_str().unwrap()],
    );
    let wt_git = other_git.join("worktrees/registered-wt");
    std::fs::write(
        hostile.join(".git"),
        format!("gitdir: {}\n", wt_git.display()),
    )
    .unwrap();
    assert_source_refused(
        warren_session::prepare(&hostile, &s, None).unwrap_err(),
        "hostile/.git",
    );
    assert!(!s.exists());
    // Positive control: the registered worktree itself is a source.
    let p = warren_session::prepare(&wt, &s, None).expect("a registered linked worktree");
    assert_eq!(p.source_git_dir, other_git);
    remove(&s, true, None).unwrap();

    // Exporting through the `gitdir:` file writes nothing into the other repository.
    let s = session_with_commit(&f, "s2");
    let before = snapshot(&other_git);
    for target in [other_git.clone(), wt_git] {
        std::fs::write(
            hostile.join(".git"),
            format!("gitdir: {}\n", target.display()),
        )
        .unwrap();
        assert_source_refused(
            export(&s, &hostile, "via-gitdir", None).unwrap_err(),
            "hostile/.git",
        );
    }
    assert_eq!(snapshot(&other_git), before, "the other repository changed");
    // Positive control: a normal export to the repository by its own path writes.
    export(&s, &f.src, "direct", None).unwrap();
    assert_ne!(snapshot(&other_git), before);
    assert!(
        !git_out(&f.src, &["rev-parse", "--verify", "-q", "via-gitdir"])
            .status
            .success()
    );
}

/// The source's config includes a file from elsewhere (`include.path`, `includeIf`): git
/// would read it as the repository's config.
#[test]
fn test_source_config_includes_refused() {
    let f = Fixture::committed();
    let included = f.tmp.path().join("elsewhere.cfg");
    std::fs::write(&included, "[user]\n\tname = Included From Elsewhere\n").unwrap();
    let conditional = format!("includeIf.gitdir:{}/.path", f.src.display());
    let s_before = session_with_commit(&f, "made-before");
    for key in ["include.path", conditional.as_str()] {
        git(&f.src, &["config", key, included.to_str().unwrap()]);
        // Positive control: git follows the include.
        assert_eq!(
            git(&f.src, &["config", "user.name"]).trim(),
            "Included From Elsewhere",
            "{key}"
        );
        let s = f.session("s");
        assert_source_refused(
            warren_session::prepare(&f.src, &s, None).unwrap_err(),
            ".git/config",
        );
        assert!(!s.exists());
        // A session made before the include: export refuses, nothing is written.
        assert_source_refused(
            export(&s_before, &f.src, "probe", None).unwrap_err(),
            ".git/config",
        );
        assert!(!git_out(&f.src, &["rev-parse", "--verify", "-q", "probe"])
            .status
            .success());
        git(&f.src, &["config", "--unset", key]);
    }
    // The same repository without the include.
    let (s, _) = f.prepare("s");
    status(&s, None).unwrap();
    export(&s_before, &f.src, "probe", None).unwrap();
}

/// The source's `core.worktree` names another directory: git would take that directory as
/// the working tree, and its files would be copied into the session.
#[test]
fn test_source_core_worktree_refused() {
    let f = Fixture::committed();
    let elsewhere = f.tmp.path().join("elsewhere");
    write(&elsewhere, "elsewhere-only.txt", "not the repository's\n");
    git(
        &f.src,
        &["config", "core.worktree", elsewhere.to_str().unwrap()],
    );
    // Positive control: git's working tree is now the other directory.
    let top = git(&f.src.join(".git"), &["rev-parse", "--show-toplevel"]);
    assert_eq!(
        Path::new(top.trim()).canonicalize().unwrap(),
        elsewhere.canonicalize().unwrap()
    );
    let s = f.session("s");
    assert_source_refused(
        warren_session::prepare(&f.src, &s, None).unwrap_err(),
        ".git/config",
    );
    assert!(!s.exists());
    git(&f.src.join(".git"), &["config", "--unset", "core.worktree"]);
    let (s, _) = f.prepare("s");
    assert!(ws(&s).join("a.txt").is_file());
    assert!(!ws(&s).join("elsewhere-only.txt").exists());
}

/// A symlinked `objects/info/alternates` (to a list naming another repository's objects) and
/// an `objects/info/http-alternates` with content: both borrow objects from outside.
#[test]
fn test_source_alternates_symlink_and_http_alternates_refused() {
    let f = Fixture::committed();
    let other = Fixture::committed();
    write(&other.src, "other.txt", "other\n");
    git(&other.src, &["add", "other.txt"]);
    git(&other.src, &["commit", "-qm", "other only"]);
    let other_commit = git(&other.src, &["rev-parse", "HEAD"]).trim().to_string();
    let list = f.tmp.path().join("alternates-list");
    std::fs::write(
        &list,
        format!("{}\n", other.src.join(".git/objects").display()),
    )
    .unwrap();
    let info = f.src.join(".git/objects/info");
    std::fs::create_dir_all(&info).unwrap();
    std::os::unix::fs::symlink(&list, info.join("alternates")).unwrap();
    // Positive control: git borrows the other repository's objects through the link.
    assert!(git_out(&f.src, &["cat-file", "-e", &other_commit])
        .status
        .success());
    let s = f.session("s");
    assert_source_refused(
        warren_session::prepare(&f.src, &s, None).unwrap_err(),
        "objects/info/alternates",
    );
    assert!(!s.exists());
    std::fs::remove_file(info.join("alternates")).unwrap();

    std::fs::write(
        info.join("http-alternates"),
        "https://example.com/objects\n",
    )
    .unwrap();
    assert!(matches!(
        warren_session::prepare(&f.src, &s, None).unwrap_err(),
        SessionError::SourceHasAlternates(_)
    ));
    assert!(!s.exists());
    std::fs::remove_file(info.join("http-alternates")).unwrap();
    f.prepare("s");
}

/// Symlinks at the other paths Warren or host git read or write in the source: the index
/// (copied), HEAD, config, packed-refs, `refs/heads` and `logs` (an export writes there),
/// `objects/pack` (an export indexes its pack there) and `info`. Git follows each.
#[test]
fn test_source_other_symlinked_paths_refused() {
    let f = Fixture::committed();
    git(&f.src, &["pack-refs", "--all"]);
    let s_before = session_with_commit(&f, "made-before");
    let g = f.src.join(".git");
    for name in [
        "index",
        "HEAD",
        "config",
        "packed-refs",
        "refs/heads",
        "logs",
        "objects/pack",
        "info",
    ] {
        let p = g.join(name);
        let moved = f
            .tmp
            .path()
            .join(format!("moved-{}", name.replace('/', "-")));
        std::fs::rename(&p, &moved).unwrap();
        std::os::unix::fs::symlink(&moved, &p).unwrap();
        if name != "HEAD" {
            // Positive control: git works through the link (git refuses a HEAD symlink that
            // does not name a ref by itself).
            assert!(git_out(&f.src, &["status"]).status.success(), "{name}");
        }
        let before = state_of(&moved);
        let s = f.session("s");
        assert_source_refused(warren_session::prepare(&f.src, &s, None).unwrap_err(), name);
        assert!(!s.exists(), "{name}");
        assert_source_refused(export(&s_before, &f.src, "probe", None).unwrap_err(), name);
        assert_eq!(state_of(&moved), before, "{name}: written through the link");
        std::fs::remove_file(&p).unwrap();
        std::fs::rename(&moved, &p).unwrap();
    }
    assert!(!git_out(&f.src, &["rev-parse", "--verify", "-q", "probe"])
        .status
        .success());
    // Positive control: the restored repository exports.
    export(&s_before, &f.src, "probe", None).unwrap();
    f.prepare("s");
}

/// The source's own config runs a program through a lazy fetch: a promisor remote with an
/// `ext::` URL and `protocol.ext.allow=always` (which wins over `-c protocol.allow=never`),
/// reached as soon as host git looks up a missing object (the source's HEAD commit).
#[test]
fn test_source_lazy_fetch_transport_never_runs_on_host() {
    let f = Fixture::committed();
    let s = session_with_commit(&f, "s");
    let marker = f.tmp.path().join("pwned");
    for (k, v) in [
        ("core.repositoryformatversion", "1".to_string()),
        ("extensions.partialClone", "origin".to_string()),
        ("remote.origin.promisor", "true".to_string()),
        (
            "remote.origin.url",
            format!("ext::sh -c touch% {}", marker.display()),
        ),
        ("protocol.ext.allow", "always".to_string()),
    ] {
        git(&f.src, &["config", k, &v]);
    }
    let head = git(&f.src, &["rev-parse", "HEAD"]).trim().to_string();
    std::fs::remove_file(f.src.join(".git/objects").join(&head[..2]).join(&head[2..])).unwrap();
    // Positive control: host git as Warren ran it before (no transport allow-list, lazy fetch
    // on) runs the source's command.
    let out = git_cmd(
        &f.src,
        &[
            "-c",
            "protocol.allow=never",
            "rev-parse",
            "-q",
            "--verify",
            "HEAD^{commit}",
        ],
    )
    .output()
    .unwrap();
    assert!(!out.status.success());
    assert!(marker.exists(), "sanity: the lazy fetch runs the command");
    std::fs::remove_file(&marker).unwrap();

    let _ = warren_session::prepare(&f.src, &f.session("s2"), None);
    assert!(!marker.exists(), "prepare ran the source's command");
    let _ = status(&s, None);
    assert!(!marker.exists(), "status ran the source's command");
    let _ = export(&s, &f.src, "probe", None);
    assert!(!marker.exists(), "export ran the source's command");
}

/// A crafted index naming `.git/hooks/pre-commit` would have copied the source's hook into
/// the session's own git directory (run at the agent's first commit): such a source is
/// refused, and nothing of it lands in the session.
#[test]
fn test_source_index_naming_git_dir_paths_refused() {
    let f = Fixture::committed();
    write(&f.src, ".git/hooks/pre-commit", "#!/bin/sh\nexit 0\n");
    chmod(&f.src, ".git/hooks/pre-commit", 0o755);
    let a = git(&f.src, &["hash-object", "-w", "a.txt"]);
    let hook = git(&f.src, &["hash-object", "-w", ".git/hooks/pre-commit"]);
    for name in [".git/hooks/pre-commit", ".GIT/hooks/pre-commit"] {
        write_index(
            &f.src.join(".git/index"),
            &[(0o100755, hook.trim(), name), (0o100644, a.trim(), "a.txt")],
        );
        let s = f.session(&format!("s{}", name.len()));
        let err = warren_session::prepare(&f.src, &s, None).expect_err(name);
        assert!(
            format!("{err:?}").contains("unexpected path"),
            "{name}: {err:?}"
        );
        assert!(!ws(&s).join(".git/hooks/pre-commit").exists(), "{name}");
    }
    // Control: the same index without that entry prepares.
    write_index(&f.src.join(".git/index"), &[(0o100644, a.trim(), "a.txt")]);
    let (s, _) = f.prepare("control");
    assert!(ws(&s).join("a.txt").exists());
}

/// A source only its owner can enter gives a workspace only its owner can enter: other local
/// users can pass the session's 0711 parents. A 0755 source keeps 0755.
#[test]
fn test_workspace_is_as_private_as_its_source() {
    use std::os::unix::fs::PermissionsExt;
    let f = Fixture::committed();
    for (mode, name) in [(0o700, "private"), (0o755, "open")] {
        std::fs::set_permissions(&f.src, std::fs::Permissions::from_mode(mode)).expect("chmod");
        let (s, _) = f.prepare(name);
        let got = std::fs::metadata(ws(&s))
            .expect("workspace")
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(got, mode, "{name}");
    }
}

/// A session commit that `index-pack --strict` refuses (a `.gitmodules` URL git forbids)
/// after a large blob fails the export and leaves nothing of the pack in the user's
/// repository (index-pack leaves its temporary pack behind when it fails).
#[test]
fn test_a_refused_export_leaves_no_temporary_pack_in_the_source() {
    let f = Fixture::committed();
    let (s, _) = f.prepare("s");
    let w = ws(&s);
    let big: Vec<u8> = (0..4u32 << 20)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    std::fs::write(w.join("!big.bin"), big).expect("big");
    write(
        &w,
        ".gitmodules",
        "[submodule \"x\"]\n\tpath = x\n\turl = --upload-pack=touch /tmp/pwned\n",
    );
    git(&w, &["add", "!big.bin", ".gitmodules"]);
    git(&w, &["commit", "-qm", "refused by fsck"]);
    let pack_dir = f.src.join(".git/objects/pack");
    let temporary = || {
        std::fs::read_dir(&pack_dir)
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|n| n.starts_with("tmp_"))
                    .collect::<Vec<_>>()
            })
            .unwrap_or_default()
    };
    let err = export(&s, &f.src, "refused", None).expect_err("fsck refuses it");
    assert!(format!("{err:?}").contains("index-pack"), "{err:?}");
    assert_eq!(temporary(), Vec::<String>::new());
}

/// The source index's untracked cache carries the source's host path (and the host's
/// `uname`): the session's index, which the guest reads, has none of it.
#[test]
fn test_the_session_index_carries_no_host_path() {
    let f = Fixture::committed();
    git(&f.src, &["config", "core.untrackedCache", "true"]);
    write(&f.src, "untracked.txt", "u\n");
    git(&f.src, &["status", "--porcelain"]);
    let needle = f.src.to_str().expect("utf-8").as_bytes().to_vec();
    let has_path = |index: &[u8]| index.windows(needle.len()).any(|w| w == needle);
    assert!(
        has_path(&std::fs::read(f.src.join(".git/index")).expect("source index")),
        "control: the source index names its path"
    );
    let (s, _) = f.prepare("s");
    let index = std::fs::read(ws(&s).join(".git/index")).expect("session index");
    assert!(
        !has_path(&index),
        "the host path reached the session's index"
    );
    git(&ws(&s), &["status", "--porcelain"]);
}

/// A project's sparse file stays sparse in its session copy: a crafted repository's file
/// can claim a terabyte and allocate nothing.
#[test]
fn test_a_sparse_source_file_stays_sparse_in_the_copy() {
    use std::os::unix::fs::MetadataExt;
    let f = Fixture::committed();
    let sparse = std::fs::File::create(f.src.join("sparse.bin")).expect("sparse");
    sparse.set_len(256 << 20).expect("set_len");
    std::fs::write(f.src.join("tail.txt"), "t").expect("tail");
    let (s, _) = f.prepare("s");
    let copy = std::fs::metadata(ws(&s).join("sparse.bin")).expect("copied");
    assert_eq!(copy.len(), 256 << 20);
    assert!(
        copy.blocks() * 512 < 1 << 20,
        "{} blocks written",
        copy.blocks()
    );
}
