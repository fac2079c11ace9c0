//! Test helpers: a git with a hermetic environment, repository fixtures and snapshots.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// A git command as a user (or the guest) would run it, minus their global config.
pub fn git_cmd(dir: &Path, args: &[&str]) -> Command {
    let mut cmd = Command::new("git");
    cmd.env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("HOME", "/nonexistent")
        .env("LC_ALL", "C")
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .env("GIT_CONFIG_GLOBAL", "/dev/null")
        .env("GIT_AUTHOR_NAME", "Test")
        .env("GIT_AUTHOR_EMAIL", "test@example.com")
        .env("GIT_COMMITTER_NAME", "Test")
        .env("GIT_COMMITTER_EMAIL", "test@example.com")
        .args(["-c", "init.defaultBranch=main", "-c", "safe.directory=*"])
        .arg("-C")
        .arg(dir)
        .args(args);
    cmd
}

pub fn git_out(dir: &Path, args: &[&str]) -> Output {
    git_cmd(dir, args).output().expect("run git")
}

/// Runs git, asserts success, returns stdout.
pub fn git(dir: &Path, args: &[&str]) -> String {
    let out = git_out(dir, args);
    assert!(
        out.status.success(),
        "git {args:?} in {} failed: {}",
        dir.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

pub fn write(root: &Path, rel: &str, content: impl AsRef<[u8]>) {
    let p = root.join(rel);
    std::fs::create_dir_all(p.parent().expect("has parent")).expect("mkdir");
    std::fs::write(p, content).expect("write");
}

pub fn chmod(root: &Path, rel: &str, mode: u32) {
    std::fs::set_permissions(root.join(rel), std::fs::Permissions::from_mode(mode)).expect("chmod");
}

/// A temp dir holding `src/` (a fresh repository) and room for sessions.
pub struct Fixture {
    pub tmp: tempfile::TempDir,
    pub src: PathBuf,
}

impl Fixture {
    /// An empty repository (no commits), default branch `main`.
    pub fn empty() -> Self {
        let tmp = tempfile::tempdir().expect("tempdir");
        let src = tmp.path().join("src");
        std::fs::create_dir(&src).expect("mkdir src");
        git(&src, &["init", "-q"]);
        Fixture { tmp, src }
    }

    /// A repository with one commit of `a.txt`.
    pub fn committed() -> Self {
        let f = Fixture::empty();
        write(&f.src, "a.txt", "alpha\n");
        git(&f.src, &["add", "."]);
        git(&f.src, &["commit", "-qm", "initial"]);
        f
    }

    pub fn session(&self, name: &str) -> PathBuf {
        self.tmp.path().join(name)
    }

    pub fn prepare(&self, name: &str) -> (PathBuf, warren_session::Prepared) {
        let s = self.session(name);
        let p = warren_session::prepare(&self.src, &s, None).expect("prepare");
        (s, p)
    }
}

pub fn ws(session: &Path) -> PathBuf {
    warren_session::workspace_dir(session)
}

/// `git status --porcelain` with every untracked file listed.
pub fn porcelain(dir: &Path) -> String {
    git(dir, &["status", "--porcelain=v1", "--untracked-files=all"])
}

/// Every entry under `root` (symlinks not followed): type, size, mode, mtime.
pub fn snapshot(root: &Path) -> BTreeMap<PathBuf, (u32, u64, i64, i64)> {
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).expect("read_dir") {
            let e = e.expect("entry");
            let m = std::fs::symlink_metadata(e.path()).expect("lstat");
            let rel = e
                .path()
                .strip_prefix(root)
                .expect("under root")
                .to_path_buf();
            out.insert(rel, (m.mode(), m.len(), m.mtime(), m.mtime_nsec()));
            if m.is_dir() {
                stack.push(e.path());
            }
        }
    }
    out
}

/// Files (not directories) under `root`, relative.
pub fn files_under(root: &Path) -> Vec<PathBuf> {
    snapshot(root)
        .into_iter()
        .filter(|(_, (mode, ..))| mode & 0o170000 != 0o040000)
        .map(|(p, _)| p)
        .collect()
}

/// An index in git's v2 format holding `entries` (mode, object id, path), with its checksum:
/// git itself refuses to write one naming `.git/...` or `..`, a crafted or guest-written one
/// need not.
pub fn write_index(to: &Path, entries: &[(u32, &str, &str)]) {
    let mut b = b"DIRC".to_vec();
    b.extend_from_slice(&2u32.to_be_bytes());
    b.extend_from_slice(&(entries.len() as u32).to_be_bytes());
    for (mode, oid, path) in entries {
        let start = b.len();
        b.extend_from_slice(&[0u8; 24]); // ctime, mtime, dev, ino
        b.extend_from_slice(&mode.to_be_bytes());
        b.extend_from_slice(&[0u8; 12]); // uid, gid, size
        for i in 0..20 {
            b.push(u8::from_str_radix(&oid[2 * i..2 * i + 2], 16).unwrap());
        }
        b.extend_from_slice(&(path.len() as u16).to_be_bytes());
        b.extend_from_slice(path.as_bytes());
        let len = b.len() - start;
        let padded = (len + 8) / 8 * 8;
        b.resize(start + padded, 0);
    }
    let tmp = to.with_extension("body");
    std::fs::write(&tmp, &b).unwrap();
    let sum = std::process::Command::new("sha1sum")
        .arg(&tmp)
        .output()
        .unwrap();
    let hex = String::from_utf8(sum.stdout).unwrap();
    for i in 0..20 {
        b.push(u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap());
    }
    std::fs::remove_file(&tmp).unwrap();
    std::fs::write(to, b).unwrap();
}
