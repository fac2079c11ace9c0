//! Real-VM test of versioned file operations, edit, glob and grep through the HTTP service.
//! One VM serves every case (boots are expensive under TCG); each case is a function.
//!
//! glob and grep are checked against an independent computation on the host: the same tree
//! is built in a host git repository, its file list comes from `git ls-files --cached
//! --others --exclude-standard` (not the `ignore` crate the guest uses), and matching is
//! done here with `globset` and `regex`.

mod common;

use std::path::Path;
use std::process::Command;
use std::sync::Barrier;

use base64::Engine;
use common::daemon::{wait_job, Daemon, Resp};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

fn sha(data: &[u8]) -> String {
    hex::encode(Sha256::digest(data))
}

fn b64(data: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(data)
}

fn unb64(v: &Value) -> Vec<u8> {
    base64::engine::general_purpose::STANDARD
        .decode(v.as_str().expect("base64 string"))
        .expect("base64")
}

struct Ctx {
    d: Daemon,
    token: String,
    vm: String,
    requests: std::sync::atomic::AtomicU64,
}

impl Ctx {
    fn call(&self, tool: &str, mut args: Value) -> Resp {
        args["vm_id"] = json!(self.vm);
        self.d.call(&self.token, tool, args)
    }

    fn ok(&self, tool: &str, args: Value) -> Value {
        let r = self.call(tool, args);
        assert_eq!(r.status, 200, "{tool}: {}", r.text);
        r.body
    }

    /// Expects `code` (and its HTTP status class) and returns the message.
    fn refused(&self, tool: &str, args: Value, code: &str) -> String {
        let r = self.call(tool, args);
        assert_eq!(r.code(), code, "{tool}: {}", r.text);
        assert!(r.status >= 400, "{tool}: {}", r.status);
        r.body["error"]["message"]
            .as_str()
            .unwrap_or("")
            .to_string()
    }

    fn write(&self, path: &str, data: &[u8], extra: Value) -> Resp {
        let mut args = json!({"path": path, "content_base64": b64(data)});
        if let Value::Object(m) = extra {
            for (k, v) in m {
                args[k] = v;
            }
        }
        self.call("vm_write_file", args)
    }

    fn read(&self, path: &str) -> (Vec<u8>, String) {
        let r = self.ok("vm_read_file", json!({"path": path}));
        assert_eq!(r["eof"], true);
        (
            unb64(&r["content_base64"]),
            r["version"].as_str().expect("version").to_string(),
        )
    }

    /// Runs `script` with bash in /workspace; returns (exit code, stdout).
    fn sh(&self, script: &str, stdin: Option<&str>) -> (i64, String) {
        let n = self
            .requests
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut args =
            json!({"request_id": format!("sh-{n}"), "command": script, "wait_ms": 30000});
        if let Some(s) = stdin {
            args["stdin"] = json!(s);
        }
        let mut r = self.ok("vm_exec", args);
        if r["state"] != "completed" {
            let job = r["job_id"].as_str().expect("job").to_string();
            let (out, last) = wait_job(&self.d, &self.token, &self.vm, &job);
            r = last;
            r["stdout"] = json!(out);
        }
        (
            r["exit_code"].as_i64().unwrap_or(-1),
            r["stdout"].as_str().unwrap_or("").to_string(),
        )
    }
}

#[test]
fn test_workspace_ops_end_to_end() {
    let d = Daemon::start("");
    let token = d.token("alice", &[]);
    let r = d.call(&token, "vm_create", json!({"request_id": "ws-ops"}));
    assert_eq!(r.status, 200, "{}", r.text);
    let vm = r.body["vm_id"].as_str().expect("vm_id").to_string();
    let c = Ctx {
        d,
        token,
        vm,
        requests: Default::default(),
    };
    versions_and_preconditions(&c);
    racing_writers(&c);
    edits(&c);
    exec_sees_the_same_state(&c);
    search_matches_host(&c);
    cli_commands(&c);
    searches_wake_a_suspended_vm(&c);
}

fn searches_wake_a_suspended_vm(c: &Ctx) {
    for (mode, tool, args) in [
        ("pause", "vm_grep", json!({"pattern": "uno", "path": "cli"})),
        (
            "hibernate",
            "vm_edit_file",
            json!({"path": "cli/a.txt", "old_string": "uno", "new_string": "eins"}),
        ),
    ] {
        let r = c.ok("vm_suspend", json!({"mode": mode}));
        assert_ne!(r["state"], "running", "{mode}");
        c.ok(tool, args);
        assert_eq!(c.ok("vm_status", json!({}))["state"], "running", "{mode}");
    }
    assert_eq!(c.read("cli/a.txt").0, b"eins\n");
}

fn versions_and_preconditions(c: &Ctx) {
    let data = b"hello versions\n";
    let r = c.write("v/a.txt", data, json!({}));
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.body["version"], sha(data));
    assert_eq!(r.body["bytes_written"], data.len());
    let (back, version) = c.read("v/a.txt");
    assert_eq!(
        (back.as_slice(), version.as_str()),
        (&data[..], sha(data).as_str())
    );
    // A partial read carries the whole file's version.
    let r = c.ok(
        "vm_read_file",
        json!({"path": "v/a.txt", "offset": 6, "max_bytes": 3}),
    );
    assert_eq!(unb64(&r["content_base64"]), b"ver");
    assert_eq!(r["version"], sha(data));

    // Create-only: refused on an existing file, which stays as it was.
    let msg = c.refused(
        "vm_write_file",
        json!({"path": "v/a.txt", "content_base64": b64(b"x"), "create_only": true}),
        "conflict",
    );
    assert!(msg.contains("exists"), "{msg}");
    assert_eq!(c.read("v/a.txt").0, data);
    let r = c.write("v/new.txt", b"new", json!({"create_only": true}));
    assert_eq!(r.body["version"], sha(b"new"), "{}", r.text);

    // Conditional replace: the current version wins, a stale one is refused and named.
    let r = c.write("v/a.txt", b"second", json!({"expected_version": sha(data)}));
    assert_eq!(r.body["version"], sha(b"second"), "{}", r.text);
    let msg = c.refused(
        "vm_write_file",
        json!({"path": "v/a.txt", "content_base64": b64(b"third"), "expected_version": sha(data)}),
        "conflict",
    );
    assert!(msg.contains(&sha(b"second")), "{msg}");
    assert_eq!(c.read("v/a.txt").0, b"second");
    c.refused(
        "vm_write_file",
        json!({"path": "v/missing.txt", "content_base64": b64(b"x"), "expected_version": sha(b"")}),
        "conflict",
    );

    // Bad combinations and versions change nothing.
    for args in [
        json!({"path": "v/a.txt", "content_base64": "", "create_only": true, "expected_version": sha(b"")}),
        json!({"path": "v/a.txt", "content_base64": "", "append": true, "create_only": true}),
        json!({"path": "v/a.txt", "content_base64": "", "expected_version": "abc"}),
        json!({"path": "../a.txt", "content_base64": ""}),
    ] {
        c.refused("vm_write_file", args, "invalid_argument");
    }
    assert_eq!(c.read("v/a.txt").0, b"second");
    // Append still works, without a version.
    let r = c.write("v/a.txt", b"+", json!({"append": true}));
    assert_eq!(r.body["version"], Value::Null, "{}", r.text);
    assert_eq!(c.read("v/a.txt"), (b"second+".to_vec(), sha(b"second+")));
}

/// Two API writers at once, several rounds: exactly one wins, the other gets `conflict`.
fn racing_writers(c: &Ctx) {
    for round in 0..3 {
        // Create-only.
        let path = format!("race/create-{round}.txt");
        let results = race(|i| {
            c.write(
                &path,
                format!("writer {i}").as_bytes(),
                json!({"create_only": true}),
            )
        });
        let winner = one_winner(&results);
        assert_eq!(c.read(&path).0, format!("writer {winner}").as_bytes());

        // Conditional replace from the same base version.
        let path = format!("race/replace-{round}.txt");
        let base = c.write(&path, b"base", json!({})).body["version"].clone();
        let results = race(|i| {
            c.write(
                &path,
                format!("writer {i}").as_bytes(),
                json!({"expected_version": base.clone()}),
            )
        });
        let winner = one_winner(&results);
        let want = format!("writer {winner}");
        assert_eq!(
            c.read(&path),
            (want.as_bytes().to_vec(), sha(want.as_bytes()))
        );
    }
}

fn race(f: impl Fn(usize) -> Resp + Sync) -> Vec<Resp> {
    let barrier = Barrier::new(2);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..2)
            .map(|i| {
                let (b, f) = (&barrier, &f);
                s.spawn(move || {
                    b.wait();
                    f(i)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("writer thread"))
            .collect()
    })
}

fn one_winner(results: &[Resp]) -> usize {
    let winners: Vec<usize> = (0..results.len())
        .filter(|i| results[*i].status == 200)
        .collect();
    assert_eq!(winners.len(), 1, "{results:?}");
    for r in results.iter().filter(|r| r.status != 200) {
        assert_eq!((r.status, r.code()), (409, "conflict"), "{}", r.text);
    }
    winners[0]
}

fn edits(c: &Ctx) {
    let text = b"fn a() {}\nlet b = 1;\nlet b = 1;\n";
    let v0 = c.write("e/m.rs", text, json!({})).body["version"].clone();
    let r = c.ok(
        "vm_edit_file",
        json!({"path": "e/m.rs", "old_string": "fn a()", "new_string": "pub fn a()", "expected_version": v0}),
    );
    let want = b"pub fn a() {}\nlet b = 1;\nlet b = 1;\n";
    assert_eq!(r["version"], sha(want));
    assert_eq!(r["size"], want.len());
    assert_eq!(c.read("e/m.rs"), (want.to_vec(), sha(want)));

    let msg = c.refused(
        "vm_edit_file",
        json!({"path": "e/m.rs", "old_string": "fn z()", "new_string": "x"}),
        "invalid_argument",
    );
    assert!(msg.contains("0 matches"), "{msg}");
    let msg = c.refused(
        "vm_edit_file",
        json!({"path": "e/m.rs", "old_string": "let b = 1;", "new_string": "let b = 2;"}),
        "invalid_argument",
    );
    assert!(msg.contains("occurs 2 times"), "{msg}");
    let msg = c.refused(
        "vm_edit_file",
        json!({"path": "e/m.rs", "old_string": "pub fn a()", "new_string": "fn a()", "expected_version": v0}),
        "conflict",
    );
    assert!(msg.contains(&sha(want)), "{msg}");
    c.refused(
        "vm_edit_file",
        json!({"path": "e/none.rs", "old_string": "a", "new_string": "b"}),
        "not_found",
    );
    assert_eq!(c.read("e/m.rs").0, want);
}

fn exec_sees_the_same_state(c: &Ctx) {
    // What the API wrote, exec reads, with the same hash and the guest user as owner.
    let data = b"written by the API\n";
    c.write("x/api.txt", data, json!({}));
    let (code, out) = c.sh(
        "cat x/api.txt; sha256sum x/api.txt; stat -c %u x/api.txt",
        None,
    );
    assert_eq!(code, 0);
    assert_eq!(
        out,
        format!("written by the API\n{}  x/api.txt\n1000\n", sha(data))
    );
    // What exec wrote, the API reads with the right version.
    let (code, _) = c.sh("printf 'from exec\\n' > x/exec.txt", None);
    assert_eq!(code, 0);
    assert_eq!(
        c.read("x/exec.txt"),
        (b"from exec\n".to_vec(), sha(b"from exec\n"))
    );
    // A change made by exec (same size, same second) is a new version: a write expecting
    // the old one is refused.
    let before = sha(data);
    let (code, _) = c.sh("printf 'WRITTEN by the API\\n' > x/api.txt", None);
    assert_eq!(code, 0);
    c.refused(
        "vm_write_file",
        json!({"path": "x/api.txt", "content_base64": b64(b"lost update"), "expected_version": before}),
        "conflict",
    );
    let (_, out) = c.sh("cat x/api.txt", None);
    assert_eq!(out, "WRITTEN by the API\n");
    // An edit through the API is seen by the next command.
    c.ok(
        "vm_edit_file",
        json!({"path": "x/api.txt", "old_string": "WRITTEN", "new_string": "edited"}),
    );
    let (_, out) = c.sh("cat x/api.txt", None);
    assert_eq!(out, "edited by the API\n");
}

/// The deterministic tree both sides search.
fn build_tree(root: &Path) {
    let put = |rel: &str, data: &[u8]| {
        let p = root.join(rel);
        std::fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
        std::fs::write(p, data).expect("write");
    };
    put(".gitignore", b"target/\n*.log\n!keep.log\n/build\n");
    put("src/.gitignore", b"generated.rs\n");
    put("src/main.rs", b"fn main() {\n    needle();\n}\n");
    put(
        "src/lib.rs",
        b"// Needle in caps\npub fn needle() {}\nfn other() {}\n",
    );
    put("src/generated.rs", b"fn needle_generated() {}\n");
    put(
        "src/nested/deep/mod.rs",
        b"no match\n\n  fn  spaced() { needle }\n",
    );
    put("src/.hidden.rs", b"fn hidden() { NEEDLE }\n");
    put(".config/settings.toml", b"needle = true\n");
    put("docs/README.md", b"# Needle docs\nneedle\nneedles\n");
    put("docs/name with space.txt", b"a needle with spaces\n");
    put(
        "docs/\u{fc}n\u{ef}c\u{f6}de.rs",
        "fn ünï() { \"needle\" }\n".as_bytes(),
    );
    put("target/debug/out.rs", b"fn needle_built() {}\n");
    put("build/x.rs", b"fn needle_root_build() {}\n");
    put("sub/build/y.rs", b"fn needle_sub_build() {}\n");
    put("app.log", b"needle log\n");
    put("keep.log", b"needle kept\n");
    put("excluded.txt", b"needle excluded\n");
    put("bin.dat", b"needle\0binary\n");
    put("crlf.txt", b"needle\r\nother\r\n");
    put("latin1.txt", b"caf\xe9 needle\n");
    put("empty.txt", b"");
    put(
        "long.txt",
        &[b"needle ".repeat(100), b"\n".to_vec()].concat(),
    );
    for i in 0..30 {
        put(
            &format!("many/f{i:02}.rs"),
            format!("fn f{i}() {{ needle }}\n").as_bytes(),
        );
    }
    std::os::unix::fs::symlink("src", root.join("link-to-src")).expect("symlink");
    std::os::unix::fs::symlink("src/main.rs", root.join("link.rs")).expect("symlink");
}

fn git(root: &Path, args: &[&str]) -> Vec<u8> {
    let out = Command::new("git")
        .arg("-C")
        .arg(root)
        .args([
            "-c",
            "core.excludesFile=/dev/null",
            "-c",
            "user.name=t",
            "-c",
            "user.email=t@t",
        ])
        .args(args)
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .env("HOME", root)
        .output()
        .expect("run git");
    assert!(
        out.status.success(),
        "git {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

/// The files the guest should search, by git's rules: tracked and untracked, not ignored;
/// regular files only (symlinks are neither followed nor listed). Relative to `root`.
fn host_files(root: &Path) -> Vec<String> {
    let out = git(
        root,
        &[
            "ls-files",
            "-z",
            "--cached",
            "--others",
            "--exclude-standard",
        ],
    );
    let mut files: Vec<String> = out
        .split(|b| *b == 0)
        .filter(|p| !p.is_empty())
        .map(|p| String::from_utf8(p.to_vec()).expect("utf-8 path"))
        .filter(|p| {
            std::fs::symlink_metadata(root.join(p))
                .map(|m| m.file_type().is_file())
                .unwrap_or(false)
        })
        .collect();
    files.sort();
    files.dedup();
    files
}

/// The documented glob rule: without `/` the file name, with `/` the path below the search
/// directory.
fn host_glob(pattern: &str) -> impl Fn(&str) -> bool {
    let m = globset::GlobBuilder::new(pattern)
        .literal_separator(true)
        .backslash_escape(true)
        .build()
        .expect("glob")
        .compile_matcher();
    let name_only = !pattern.contains('/');
    move |rel: &str| {
        if name_only {
            m.is_match(rel.rsplit('/').next().unwrap_or(rel))
        } else {
            m.is_match(rel)
        }
    }
}

/// (guest path, search-relative path) of every host file below `sub` of the tree.
fn below<'a>(files: &'a [String], sub: &'a str) -> impl Iterator<Item = (String, &'a str)> + 'a {
    files.iter().filter_map(move |f| {
        let rel = if sub.is_empty() {
            Some(f.as_str())
        } else {
            f.strip_prefix(sub).and_then(|r| r.strip_prefix('/'))
        }?;
        Some((format!("tree/{f}"), rel))
    })
}

fn expected_glob(files: &[String], pattern: &str, sub: &str) -> Vec<String> {
    let m = host_glob(pattern);
    let mut v: Vec<String> = below(files, sub)
        .filter(|(_, rel)| m(rel))
        .map(|(p, _)| p)
        .collect();
    v.sort();
    v
}

fn expected_grep(
    root: &Path,
    files: &[String],
    pattern: &str,
    ci: bool,
    glob: Option<&str>,
    sub: &str,
) -> Vec<Value> {
    let re = regex::bytes::RegexBuilder::new(pattern)
        .case_insensitive(ci)
        .build()
        .expect("regex");
    let filter = glob.map(host_glob);
    let mut hits = Vec::new();
    for (path, rel) in below(files, sub) {
        if filter.as_ref().is_some_and(|f| !f(rel)) {
            continue;
        }
        let data = std::fs::read(root.join(path.trim_start_matches("tree/"))).expect("read");
        if data[..data.len().min(8192)].contains(&0) {
            continue;
        }
        if data.is_empty() {
            continue;
        }
        let body = data.strip_suffix(b"\n").unwrap_or(&data);
        for (i, line) in body.split(|b| *b == b'\n').enumerate() {
            if re.is_match(line) {
                let text: String = String::from_utf8_lossy(line).chars().take(500).collect();
                hits.push((path.clone(), i as u64 + 1, text));
            }
        }
    }
    hits.sort();
    hits.into_iter()
        .map(|(path, line, text)| json!({"path": path, "line": line, "text": text}))
        .collect()
}

fn search_matches_host(c: &Ctx) {
    let host = tempfile::tempdir().expect("tempdir");
    let root = host.path();
    build_tree(root);
    git(root, &["init", "-q"]);
    std::fs::write(root.join(".git/info/exclude"), b"excluded.txt\n").expect("exclude");
    // Some files tracked, the rest untracked: both kinds are searched.
    git(root, &["add", "src", "docs", ".gitignore"]);
    git(root, &["commit", "-q", "-m", "tracked part"]);
    let files = host_files(root);
    // The host computation itself sees what the rules say.
    for present in [
        "src/main.rs",
        "keep.log",
        "sub/build/y.rs",
        "src/.hidden.rs",
        "many/f07.rs",
    ] {
        assert!(
            files.iter().any(|f| f == present),
            "{present} missing: {files:?}"
        );
    }
    for absent in [
        "app.log",
        "excluded.txt",
        "build/x.rs",
        "target/debug/out.rs",
        "src/generated.rs",
        "link.rs",
    ] {
        assert!(
            !files.iter().any(|f| f == absent),
            "{absent} listed: {files:?}"
        );
    }

    // The same tree in the guest: tar (without git's objects and hooks), base64, exec stdin.
    let tar = Command::new("tar")
        .arg("-C")
        .arg(root)
        .args([
            "--exclude=./.git/objects",
            "--exclude=./.git/hooks",
            "-cf",
            "-",
            ".",
        ])
        .output()
        .expect("tar");
    assert!(tar.status.success());
    let encoded = b64(&tar.stdout);
    assert!(
        encoded.len() < 128 * 1024,
        "tree archive too large: {}",
        encoded.len()
    );
    let (code, out) = c.sh(
        "mkdir tree && base64 -d | tar -x --no-same-owner -C tree && echo ok",
        Some(&encoded),
    );
    assert_eq!((code, out.as_str()), (0, "ok\n"));

    for (pattern, sub) in [
        ("*", ""),
        ("*.rs", ""),
        ("src/**/*.rs", ""),
        ("**/*.{md,toml}", ""),
        ("*.rs", "src"),
        ("deep/*", "src/nested"),
        ("[a-f]*", ""),
    ] {
        let path = if sub.is_empty() {
            "tree".to_string()
        } else {
            format!("tree/{sub}")
        };
        let r = c.ok(
            "vm_glob",
            json!({"pattern": pattern, "path": path, "limit": 2000}),
        );
        let want = expected_glob(&files, pattern, sub);
        assert!(
            !want.is_empty(),
            "{pattern} in {sub:?} matches nothing on the host"
        );
        assert_eq!(r["paths"], json!(want), "glob {pattern:?} in {sub:?}");
        assert_eq!(r["truncated"], false);
    }

    for (pattern, ci, glob, sub) in [
        ("needle", false, None, ""),
        ("NEEDLE", true, Some("*.rs"), ""),
        (r"^\s*fn\s+\w+", false, None, ""),
        ("needle$", false, None, ""),
        (r"caf(?-u:\xE9) needle", false, None, ""),
        ("needle", false, Some("src/**"), ""),
        ("needle", true, None, "src"),
    ] {
        let path = if sub.is_empty() {
            "tree".to_string()
        } else {
            format!("tree/{sub}")
        };
        let mut args =
            json!({"pattern": pattern, "path": path, "case_insensitive": ci, "limit": 2000});
        if let Some(g) = glob {
            args["glob"] = json!(g);
        }
        let r = c.ok("vm_grep", args);
        let want = expected_grep(root, &files, pattern, ci, glob, sub);
        assert!(!want.is_empty(), "{pattern} matches nothing on the host");
        assert_eq!(
            r["matches"],
            json!(want),
            "grep {pattern:?} ci={ci} glob={glob:?} in {sub:?}"
        );
        assert_eq!(r["truncated"], false);
    }

    // Limits: the first results in order, flagged as truncated.
    let r = c.ok(
        "vm_glob",
        json!({"pattern": "*.rs", "path": "tree", "limit": 5}),
    );
    let want: Vec<String> = expected_glob(&files, "*.rs", "")
        .into_iter()
        .take(5)
        .collect();
    assert_eq!(
        (r["paths"].clone(), r["truncated"].clone()),
        (json!(want), json!(true))
    );
    let r = c.ok(
        "vm_grep",
        json!({"pattern": "needle", "path": "tree", "limit": 3}),
    );
    let want: Vec<Value> = expected_grep(root, &files, "needle", false, None, "")
        .into_iter()
        .take(3)
        .collect();
    assert_eq!(
        (r["matches"].clone(), r["truncated"].clone()),
        (json!(want), json!(true))
    );

    // Bad requests are refused with a clear code.
    for (tool, args, code) in [
        ("vm_grep", json!({"pattern": "("}), "invalid_argument"),
        ("vm_glob", json!({"pattern": "a["}), "invalid_argument"),
        (
            "vm_glob",
            json!({"pattern": "*", "path": "../etc"}),
            "invalid_argument",
        ),
        (
            "vm_glob",
            json!({"pattern": "*", "path": "tree/link-to-src"}),
            "forbidden",
        ),
        (
            "vm_glob",
            json!({"pattern": "*", "limit": 0}),
            "invalid_argument",
        ),
        (
            "vm_grep",
            json!({"pattern": "x", "path": "nowhere"}),
            "not_found",
        ),
    ] {
        c.refused(tool, args, code);
    }
}

/// The CLI's commands on the same VM (its engine opens the service's state directory).
fn cli_commands(c: &Ctx) {
    let cli = |args: &[&str], stdin: Option<&[u8]>| {
        use std::io::Write;
        let mut cmd = c.d.env.cmd();
        cmd.args(args)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        let mut child = cmd.spawn().expect("spawn warren");
        let mut input = child.stdin.take().expect("stdin");
        // A command that fails early may not read its input.
        let _ = input.write_all(stdin.unwrap_or(b""));
        drop(input);
        let out = child.wait_with_output().expect("wait");
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let vm = c.vm.as_str();
    let (code, out, err) = cli(
        &["vm", "write", vm, "cli/a.txt", "--create-only"],
        Some(b"one\n"),
    );
    assert_eq!((code, out.trim()), (0, sha(b"one\n").as_str()), "{err}");
    let (code, _, err) = cli(
        &["vm", "write", vm, "cli/a.txt", "--create-only"],
        Some(b"two\n"),
    );
    assert_eq!(code, 125);
    assert!(err.contains("error[conflict]"), "{err}");
    let stale = sha(b"other");
    let (code, _, err) = cli(
        &["vm", "write", vm, "cli/a.txt", "--expected-version", &stale],
        Some(b"x"),
    );
    assert!(code == 125 && err.contains("error[conflict]"), "{err}");
    let (code, out, err) = cli(&["vm", "read", vm, "cli/a.txt", "--print-version"], None);
    assert_eq!((code, out.as_str()), (0, "one\n"));
    assert!(
        err.contains(&format!("version: {}", sha(b"one\n"))),
        "{err}"
    );
    let (code, out, err) = cli(
        &[
            "vm",
            "edit",
            vm,
            "cli/a.txt",
            "--old",
            "one",
            "--new",
            "uno",
            "--expected-version",
            &sha(b"one\n"),
        ],
        None,
    );
    assert_eq!((code, out.trim()), (0, sha(b"uno\n").as_str()), "{err}");
    let (code, out, _) = cli(&["vm", "glob", vm, "*.txt", "--path", "cli"], None);
    assert_eq!((code, out.as_str()), (0, "cli/a.txt\n"));
    let (code, out, _) = cli(&["vm", "grep", vm, "UNO", "-i", "--path", "cli"], None);
    assert_eq!((code, out.as_str()), (0, "cli/a.txt:1:uno\n"));
    let (code, out, _) = cli(&["vm", "grep", vm, "absent", "--path", "cli"], None);
    assert_eq!((code, out.as_str()), (1, ""));
    // Content above the whole-file limit goes in chunks, unconditionally, without a version.
    let big: Vec<u8> = (0..600 * 1024u32).map(|i| (i % 253) as u8).collect();
    let (code, out, err) = cli(&["vm", "write", vm, "cli/big.bin"], Some(&big));
    assert_eq!((code, out.as_str()), (0, ""), "{err}");
    let (code, _, err) = cli(
        &["vm", "write", vm, "cli/big.bin", "--create-only"],
        Some(&big),
    );
    assert!(code == 125 && err.contains("invalid_argument"), "{err}");
    let (code, _, err) = cli(&["vm", "read", vm, "cli/big.bin", "--print-version"], None);
    assert_eq!(code, 0);
    assert!(err.contains(&format!("version: {}", sha(&big))), "{err}");
}
