use std::os::unix::fs::PermissionsExt;
use std::sync::{Arc, Barrier};

use super::*;

fn cfg(dir: &tempfile::TempDir) -> FilesConfig {
    FilesConfig {
        workspace: dir.path().to_path_buf(),
        user: None,
    }
}

fn put(dir: &tempfile::TempDir, rel: &str, data: &[u8]) {
    let p = dir.path().join(rel);
    std::fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
    std::fs::write(p, data).expect("write");
}

fn checked(path: &str, data: &[u8], precondition: Precondition) -> WriteChecked {
    WriteChecked {
        path: path.into(),
        data: data.to_vec(),
        precondition,
        create_parents: true,
    }
}

fn rv(path: &str, offset: u64, len: u32) -> ReadVersioned {
    ReadVersioned {
        path: path.into(),
        offset,
        len,
    }
}

fn edit_req(path: &str, old: &str, new: &str, expected: Option<Version>) -> EditFile {
    EditFile {
        path: path.into(),
        old: old.into(),
        new: new.into(),
        expected_version: expected,
    }
}

/// Names in `dir` that are not in `keep`: leftover temporary files.
fn leftovers(dir: &Path, keep: &[&str]) -> Vec<String> {
    std::fs::read_dir(dir)
        .expect("read_dir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .filter(|n| !keep.contains(&n.as_str()))
        .collect()
}

#[test]
fn test_read_versioned_version_is_sha256_of_whole_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let payload: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
    put(&dir, "d/f", &payload);
    let whole = version_of(&payload);
    let r = read_versioned(&cfg(&dir), &rv("d/f", 0, MAX_WHOLE_FILE)).expect("read");
    assert_eq!(
        (r.data.as_slice(), r.size, r.eof),
        (&payload[..], 200_000, true)
    );
    assert_eq!(r.version, Some(whole));
    // A slice carries the whole file's version too.
    let r = read_versioned(&cfg(&dir), &rv("d/f", 70_000, 100)).expect("read");
    assert_eq!(r.data, payload[70_000..70_100]);
    assert!(!r.eof);
    assert_eq!(r.version, Some(whole));
    // len 0: the version only.
    let r = read_versioned(&cfg(&dir), &rv("d/f", 0, 0)).expect("read");
    assert!(r.data.is_empty());
    assert_eq!(r.version, Some(whole));
    let err = read_versioned(&cfg(&dir), &rv("d/f", 0, MAX_WHOLE_FILE + 1)).expect_err("len");
    assert_eq!(err.code, ErrorCode::InvalidArgument);
}

#[test]
fn test_read_versioned_file_above_limit_has_no_version() {
    let dir = tempfile::tempdir().expect("tempdir");
    let f = File::create(dir.path().join("big")).expect("create");
    f.set_len(MAX_VERSIONED_FILE + 1).expect("set_len");
    let r = read_versioned(&cfg(&dir), &rv("big", 5, 10)).expect("read");
    assert_eq!(
        (r.data, r.size, r.version),
        (vec![0; 10], MAX_VERSIONED_FILE + 1, None)
    );
}

#[test]
fn test_read_versioned_symlink_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::os::unix::fs::symlink("/etc/hostname", dir.path().join("l")).expect("symlink");
    let err = read_versioned(&cfg(&dir), &rv("l", 0, 10)).expect_err("symlink");
    assert_eq!(err.code, ErrorCode::PermissionDenied);
    let err = read_versioned(&cfg(&dir), &rv("../x", 0, 10)).expect_err("escape");
    assert_eq!(err.code, ErrorCode::InvalidArgument);
}

#[test]
fn test_write_checked_unconditional_creates_and_replaces_keeping_mode() {
    let dir = tempfile::tempdir().expect("tempdir");
    let c = cfg(&dir);
    let v = write_checked(&c, &checked("a/b/f", b"one", Precondition::None)).expect("create");
    assert_eq!((v.version, v.size), (version_of(b"one"), 3));
    let p = dir.path().join("a/b/f");
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o751)).expect("chmod");
    let v = write_checked(&c, &checked("a/b/f", b"second", Precondition::None)).expect("replace");
    assert_eq!(v.version, version_of(b"second"));
    assert_eq!(std::fs::read(&p).expect("read"), b"second");
    let mode = std::fs::metadata(&p).expect("stat").permissions().mode() & 0o7777;
    assert_eq!(mode, 0o751);
    assert!(leftovers(&dir.path().join("a/b"), &["f"]).is_empty());
}

#[test]
fn test_write_checked_create_only_existing_conflict_unchanged() {
    let dir = tempfile::tempdir().expect("tempdir");
    let c = cfg(&dir);
    write_checked(&c, &checked("f", b"first", Precondition::CreateOnly)).expect("create");
    let err =
        write_checked(&c, &checked("f", b"second", Precondition::CreateOnly)).expect_err("exists");
    assert_eq!(err.code, ErrorCode::Conflict);
    assert_eq!(std::fs::read(dir.path().join("f")).expect("read"), b"first");
    std::fs::create_dir(dir.path().join("d")).expect("mkdir");
    let err = write_checked(&c, &checked("d", b"x", Precondition::CreateOnly)).expect_err("dir");
    assert_eq!(err.code, ErrorCode::Conflict);
    assert!(leftovers(dir.path(), &["f", "d"]).is_empty());
}

#[test]
fn test_write_checked_if_version_stale_conflict_names_current() {
    let dir = tempfile::tempdir().expect("tempdir");
    let c = cfg(&dir);
    let v1 = write_checked(&c, &checked("f", b"v1", Precondition::None)).expect("write");
    let v2 = write_checked(
        &c,
        &checked("f", b"v2", Precondition::IfVersion(v1.version)),
    )
    .expect("matching version");
    let err = write_checked(
        &c,
        &checked("f", b"v3", Precondition::IfVersion(v1.version)),
    )
    .expect_err("stale");
    assert_eq!(err.code, ErrorCode::Conflict);
    assert!(err.message.contains(&hex::encode(v2.version)), "{err}");
    assert_eq!(std::fs::read(dir.path().join("f")).expect("read"), b"v2");
    let err = write_checked(
        &c,
        &checked("gone", b"x", Precondition::IfVersion(v1.version)),
    )
    .expect_err("missing");
    assert_eq!(err.code, ErrorCode::Conflict);
    assert!(!dir.path().join("gone").exists());
}

#[test]
fn test_write_checked_bad_requests_change_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let outside = tempfile::tempdir().expect("tempdir");
    let c = cfg(&dir);
    let big = vec![1u8; MAX_WHOLE_FILE as usize + 1];
    let err = write_checked(&c, &checked("f", &big, Precondition::None)).expect_err("big");
    assert_eq!(err.code, ErrorCode::TooLarge);
    std::os::unix::fs::symlink(outside.path(), dir.path().join("out")).expect("symlink");
    std::os::unix::fs::symlink("/etc/hostname", dir.path().join("l")).expect("symlink");
    for p in ["out/f", "l"] {
        let err = write_checked(&c, &checked(p, b"x", Precondition::None)).expect_err(p);
        assert_eq!(err.code, ErrorCode::PermissionDenied, "{p}");
    }
    assert!(leftovers(outside.path(), &[]).is_empty());
    let mut req = checked("no/parent/f", b"x", Precondition::None);
    req.create_parents = false;
    assert_eq!(
        write_checked(&c, &req).expect_err("parents").code,
        ErrorCode::NotFound
    );
    assert!(leftovers(dir.path(), &["out", "l"]).is_empty());
}

/// Runs `n` threads that start together, each with its own payload.
fn race<T: Send + 'static>(n: usize, f: impl Fn(usize) -> T + Send + Sync + 'static) -> Vec<T> {
    let barrier = Arc::new(Barrier::new(n));
    let f = Arc::new(f);
    let threads: Vec<_> = (0..n)
        .map(|i| {
            let (b, f) = (barrier.clone(), f.clone());
            std::thread::spawn(move || {
                b.wait();
                f(i)
            })
        })
        .collect();
    threads
        .into_iter()
        .map(|t| t.join().expect("thread"))
        .collect()
}

#[test]
fn test_write_checked_create_only_race_exactly_one_wins() {
    for round in 0..20 {
        let dir = tempfile::tempdir().expect("tempdir");
        let c = cfg(&dir);
        let results = race(8, move |i| {
            write_checked(
                &c,
                &checked(
                    "f",
                    format!("writer {i}").as_bytes(),
                    Precondition::CreateOnly,
                ),
            )
        });
        let winners: Vec<usize> = (0..8).filter(|i| results[*i].is_ok()).collect();
        assert_eq!(winners.len(), 1, "round {round}: {results:?}");
        for r in results.iter().filter_map(|r| r.as_ref().err()) {
            assert_eq!(r.code, ErrorCode::Conflict);
        }
        let content = std::fs::read(dir.path().join("f")).expect("read");
        assert_eq!(content, format!("writer {}", winners[0]).as_bytes());
        assert!(leftovers(dir.path(), &["f"]).is_empty());
    }
}

#[test]
fn test_write_checked_if_version_race_exactly_one_wins() {
    for round in 0..20 {
        let dir = tempfile::tempdir().expect("tempdir");
        let c = cfg(&dir);
        let base = write_checked(&c, &checked("f", b"base", Precondition::None))
            .expect("base")
            .version;
        let results = race(8, move |i| {
            write_checked(
                &c,
                &checked(
                    "f",
                    format!("writer {i}").as_bytes(),
                    Precondition::IfVersion(base),
                ),
            )
        });
        let winners: Vec<usize> = (0..8).filter(|i| results[*i].is_ok()).collect();
        assert_eq!(winners.len(), 1, "round {round}: {results:?}");
        let won = results[winners[0]].as_ref().expect("winner");
        for r in results.iter().filter_map(|r| r.as_ref().err()) {
            assert_eq!(r.code, ErrorCode::Conflict);
            assert!(r.message.contains(&hex::encode(won.version)), "{r}");
        }
        let content = std::fs::read(dir.path().join("f")).expect("read");
        assert_eq!(version_of(&content), won.version);
    }
}

#[test]
fn test_read_versioned_during_replacements_never_mixes_contents() {
    let dir = tempfile::tempdir().expect("tempdir");
    let c = cfg(&dir);
    let a = vec![b'a'; 300_000];
    let b = vec![b'b'; 200_000];
    write_checked(&c, &checked("f", &a, Precondition::None)).expect("write");
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (c, stop, a, b) = (c.clone(), stop.clone(), a.clone(), b.clone());
        std::thread::spawn(move || {
            let mut n = 0;
            while !stop.load(Ordering::Relaxed) {
                let data = if n % 2 == 0 { &b } else { &a };
                write_checked(&c, &checked("f", data, Precondition::None)).expect("write");
                n += 1;
            }
        })
    };
    for _ in 0..200 {
        let r = read_versioned(&c, &rv("f", 0, MAX_WHOLE_FILE)).expect("read");
        assert!(r.eof);
        assert!(
            r.data == a || r.data == b,
            "mixed content of {} bytes",
            r.data.len()
        );
        assert_eq!(r.version, Some(version_of(&r.data)));
    }
    stop.store(true, Ordering::Relaxed);
    writer.join().expect("writer");
}

#[test]
fn test_edit_replaces_single_occurrence_keeping_mode() {
    let dir = tempfile::tempdir().expect("tempdir");
    let c = cfg(&dir);
    put(&dir, "src/m.rs", b"fn a() {}\nfn b() {}\n");
    let p = dir.path().join("src/m.rs");
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    let before = version_of(b"fn a() {}\nfn b() {}\n");
    let v = edit(&c, &edit_req("src/m.rs", "fn b", "pub fn b", Some(before))).expect("edit");
    let after = std::fs::read(&p).expect("read");
    assert_eq!(after, b"fn a() {}\npub fn b() {}\n");
    assert_eq!(
        (v.version, v.size),
        (version_of(&after), after.len() as u64)
    );
    let mode = std::fs::metadata(&p).expect("stat").permissions().mode() & 0o7777;
    assert_eq!(mode, 0o600);
    assert!(leftovers(&dir.path().join("src"), &["m.rs"]).is_empty());
}

#[test]
fn test_edit_zero_or_many_matches_and_stale_version_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let c = cfg(&dir);
    put(&dir, "f", b"x = 1\nx = 1\ny = 2\n");
    let orig = std::fs::read(dir.path().join("f")).expect("read");
    let err = edit(&c, &edit_req("f", "z = 3", "z = 4", None)).expect_err("none");
    assert_eq!(err.code, ErrorCode::InvalidArgument);
    assert!(err.message.contains("0 matches"), "{err}");
    let err = edit(&c, &edit_req("f", "x = 1", "x = 5", None)).expect_err("two");
    assert_eq!(err.code, ErrorCode::InvalidArgument);
    assert!(err.message.contains("occurs 2 times"), "{err}");
    let err = edit(&c, &edit_req("f", "y = 2", "y = 3", Some([0; 32]))).expect_err("stale");
    assert_eq!(err.code, ErrorCode::Conflict);
    assert!(
        err.message.contains(&hex::encode(version_of(&orig))),
        "{err}"
    );
    for (old, new) in [("", "a"), ("y", "y")] {
        let err = edit(&c, &edit_req("f", old, new, None)).expect_err("invalid");
        assert_eq!(err.code, ErrorCode::InvalidArgument);
    }
    assert_eq!(
        edit(&c, &edit_req("missing", "a", "b", None))
            .expect_err("missing")
            .code,
        ErrorCode::NotFound
    );
    assert_eq!(std::fs::read(dir.path().join("f")).expect("read"), orig);
}

#[test]
fn test_edit_concurrent_same_expected_version_one_wins() {
    let dir = tempfile::tempdir().expect("tempdir");
    let c = cfg(&dir);
    put(&dir, "f", b"counter = 0\n");
    let base = version_of(b"counter = 0\n");
    let results = race(6, move |i| {
        edit(
            &c,
            &edit_req(
                "f",
                "counter = 0",
                &format!("counter = {}", i + 1),
                Some(base),
            ),
        )
    });
    assert_eq!(
        results.iter().filter(|r| r.is_ok()).count(),
        1,
        "{results:?}"
    );
    assert!(results
        .iter()
        .filter_map(|r| r.as_ref().err())
        .all(|e| e.code == ErrorCode::Conflict));
}

/// A tree with everything searches must treat specially.
fn search_tree() -> (tempfile::TempDir, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("tempdir");
    let outside = tempfile::tempdir().expect("tempdir");
    put(&outside, "secret.rs", b"needle outside\n");
    put(&dir, ".gitignore", b"target/\n*.log\n!keep.log\n");
    put(&dir, ".git/info/exclude", b"excluded.txt\n");
    put(&dir, ".git/config.rs", b"needle in git dir\n");
    put(&dir, "src/main.rs", b"fn main() {\n    needle();\n}\n");
    put(
        &dir,
        "src/lib.rs",
        b"// Needle in caps\npub fn needle() {}\n",
    );
    put(
        &dir,
        "src/deep/x/y.rs",
        b"no match here\nneedle at line 2\n",
    );
    put(&dir, "src/.hidden.rs", b"needle hidden\n");
    put(&dir, "src/.gitignore", b"gen.rs\n");
    put(&dir, "src/gen.rs", b"needle generated\n");
    put(&dir, "target/debug/out.rs", b"needle built\n");
    put(&dir, "app.log", b"needle log\n");
    put(&dir, "keep.log", b"needle kept\n");
    put(&dir, "excluded.txt", b"needle excluded\n");
    put(&dir, "bin.dat", b"needle\0binary\n");
    put(
        &dir,
        "notes.txt",
        &[b"x".repeat(700), b"needle".to_vec()].concat(),
    );
    std::os::unix::fs::symlink(outside.path(), dir.path().join("link")).expect("symlink");
    std::os::unix::fs::symlink("src/main.rs", dir.path().join("main-link.rs")).expect("symlink");
    (dir, outside)
}

fn globq(pattern: &str, path: Option<&str>, limit: u32) -> GlobRequest {
    GlobRequest {
        pattern: pattern.into(),
        path: path.map(Into::into),
        limit,
    }
}

#[test]
fn test_glob_respects_ignores_hidden_symlinks_and_sorts() {
    let (dir, _outside) = search_tree();
    let c = cfg(&dir);
    let r = glob(&c, &globq("*.rs", None, 100)).expect("glob");
    assert_eq!(
        r.paths,
        [
            "src/.hidden.rs",
            "src/deep/x/y.rs",
            "src/lib.rs",
            "src/main.rs"
        ]
    );
    assert!(!r.truncated);
    let r = glob(&c, &globq("*", None, 100)).expect("glob");
    assert_eq!(
        r.paths,
        [
            ".gitignore",
            "bin.dat",
            "keep.log",
            "notes.txt",
            "src/.gitignore",
            "src/.hidden.rs",
            "src/deep/x/y.rs",
            "src/lib.rs",
            "src/main.rs"
        ]
    );
    // A pattern with '/' matches the path relative to the search directory.
    let r = glob(&c, &globq("src/*.rs", None, 100)).expect("glob");
    assert_eq!(r.paths, ["src/.hidden.rs", "src/lib.rs", "src/main.rs"]);
    let r = glob(&c, &globq("**/x/*.rs", None, 100)).expect("glob");
    assert_eq!(r.paths, ["src/deep/x/y.rs"]);
    let r = glob(&c, &globq("deep/**", Some("src"), 100)).expect("glob");
    assert_eq!(r.paths, ["src/deep/x/y.rs"]);
}

#[test]
fn test_glob_limit_truncates_and_bad_requests_refused() {
    let (dir, _outside) = search_tree();
    let c = cfg(&dir);
    let r = glob(&c, &globq("*.rs", None, 2)).expect("glob");
    assert_eq!(r.paths, ["src/.hidden.rs", "src/deep/x/y.rs"]);
    assert!(r.truncated);
    for (q, code) in [
        (globq("a[", None, 10), ErrorCode::InvalidArgument),
        (globq("", None, 10), ErrorCode::InvalidArgument),
        (globq("*", None, 0), ErrorCode::InvalidArgument),
        (
            globq("*", None, MAX_SEARCH_RESULTS + 1),
            ErrorCode::InvalidArgument,
        ),
        (globq("*", Some("../x"), 10), ErrorCode::InvalidArgument),
        (globq("*", Some("link"), 10), ErrorCode::PermissionDenied),
        (globq("*", Some("missing"), 10), ErrorCode::NotFound),
        (globq("*", Some("notes.txt"), 10), ErrorCode::WrongType),
    ] {
        assert_eq!(glob(&c, &q).expect_err(&q.pattern).code, code, "{q:?}");
    }
}

fn grepq(pattern: &str, glob: Option<&str>, ci: bool, limit: u32) -> GrepRequest {
    GrepRequest {
        pattern: pattern.into(),
        glob: glob.map(Into::into),
        path: None,
        case_insensitive: ci,
        limit,
    }
}

fn hits(r: &GrepResult) -> Vec<(String, u64)> {
    r.matches.iter().map(|m| (m.path.clone(), m.line)).collect()
}

#[test]
fn test_grep_skips_ignored_binary_and_symlinked_files() {
    let (dir, _outside) = search_tree();
    let c = cfg(&dir);
    let r = grep(&c, &grepq("needle", None, false, 100)).expect("grep");
    let want: Vec<(String, u64)> = [
        ("keep.log", 1),
        ("notes.txt", 1),
        ("src/.hidden.rs", 1),
        ("src/deep/x/y.rs", 2),
        ("src/lib.rs", 2),
        ("src/main.rs", 2),
    ]
    .into_iter()
    .map(|(p, l)| (p.to_string(), l))
    .collect();
    assert_eq!(hits(&r), want);
    assert!(!r.truncated);
    assert_eq!(r.matches[5].text, "    needle();");
    // The 706-character line is cut to the limit.
    assert_eq!(r.matches[1].text.chars().count(), MAX_GREP_LINE_CHARS);
}

#[test]
fn test_grep_case_glob_filter_and_limit() {
    let (dir, _outside) = search_tree();
    let c = cfg(&dir);
    let r = grep(&c, &grepq("^// needle", Some("*.rs"), true, 100)).expect("grep");
    assert_eq!(hits(&r), [("src/lib.rs".to_string(), 1)]);
    assert_eq!(r.matches[0].text, "// Needle in caps");
    let r = grep(&c, &grepq("needle", Some("src/*.rs"), false, 2)).expect("grep");
    assert_eq!(
        hits(&r),
        [
            ("src/.hidden.rs".to_string(), 1),
            ("src/lib.rs".to_string(), 2)
        ]
    );
    assert!(r.truncated);
    let mut q = grepq("needle", None, false, 10);
    q.path = Some("src/deep".into());
    let r = grep(&c, &q).expect("grep");
    assert_eq!(hits(&r), [("src/deep/x/y.rs".to_string(), 2)]);
    let err = grep(&c, &grepq("(", None, false, 10)).expect_err("regex");
    assert_eq!(err.code, ErrorCode::InvalidArgument);
}

#[test]
fn test_lines_and_line_text_edges() {
    let collect = |c: &[u8]| lines(c).map(<[u8]>::to_vec).collect::<Vec<_>>();
    assert!(collect(b"").is_empty());
    assert_eq!(collect(b"\n"), [b"".to_vec()]);
    assert_eq!(collect(b"a\nb"), [b"a".to_vec(), b"b".to_vec()]);
    assert_eq!(
        collect(b"a\n\nb\n"),
        [b"a".to_vec(), b"".to_vec(), b"b".to_vec()]
    );
    assert_eq!(line_text(&[b'a', 0xff]), "a\u{fffd}");
    let long = "é".repeat(MAX_GREP_LINE_CHARS + 3);
    assert_eq!(
        line_text(long.as_bytes()).chars().count(),
        MAX_GREP_LINE_CHARS
    );
}
