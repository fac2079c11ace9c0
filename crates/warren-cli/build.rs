//! Build script: records the commit the binary is built from, for `warren --version`.
//!
//! Hand-written rather than with a version-stamping crate: it is one `git rev-parse`, and
//! the reruns it needs (HEAD and the branch it points to, worktrees included) are two
//! `--git-path` look-ups. `WARREN_COMMIT` overrides it (a build from a source archive
//! without `.git`); without either the commit is `unknown`.

use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let s = String::from_utf8(out.stdout).ok()?.trim().to_string();
    (!s.is_empty()).then_some(s)
}

fn main() {
    println!("cargo:rerun-if-env-changed=WARREN_COMMIT");
    let commit = match std::env::var("WARREN_COMMIT") {
        Ok(c) if !c.is_empty() => c,
        _ => {
            for p in ["HEAD", "packed-refs"] {
                if let Some(path) = git(&["rev-parse", "--git-path", p]) {
                    println!("cargo:rerun-if-changed={path}");
                }
            }
            if let Some(r) = git(&["symbolic-ref", "-q", "HEAD"]) {
                if let Some(path) = git(&["rev-parse", "--git-path", &r]) {
                    println!("cargo:rerun-if-changed={path}");
                }
            }
            git(&["rev-parse", "--short=12", "HEAD"]).unwrap_or_else(|| "unknown".into())
        }
    };
    println!("cargo:rustc-env=WARREN_COMMIT={commit}");
}
