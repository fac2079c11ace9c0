//! Python packages a recipe pins (`[[python]]`): wheels downloaded on the host from the
//! Python package index and checked against their pinned SHA-256, then installed in the
//! build root with pip, offline.
//!
//! Steps, run on the build thread:
//! 1. [`fetch`] (before debootstrap, so a bad pin fails in seconds): reuse
//!    `<downloads>/python/<sha256>/<file>.whl` if it still hashes to the pin; otherwise ask
//!    the index's simple API in its JSON form (PEP 691: `<index>/simple/<name>/`, at most
//!    16 MiB) for the file whose SHA-256 is the pin, which must be a wheel of the pinned
//!    version, download it with `curl` on the host into a temp file, verify it, rename it.
//! 2. [`install`] (after the packages and links): copy the wheels into the root tree and run
//!    `python3 -m pip install --no-index --no-deps` on them in the confined chroot (no
//!    network): pip never fetches anything, and nothing runs that the pins did not name.
//!
//! `--no-deps`: a recipe pins every package it needs, dependencies included, like a lock file.
//! A wheel is used only after its SHA-256 matched the pin; the index's answer only tells
//! where the file is.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde::{Deserialize, Serialize};

use crate::command::run_output;
use crate::ImageError;

/// The index the wheels come from, unless `WARREN_PYPI_INDEX` names a mirror (safe: every
/// download is checked against its pin).
pub const PYPI_INDEX: &str = "https://pypi.org";
/// Environment variable overriding [`PYPI_INDEX`].
pub const PYPI_INDEX_ENV: &str = "WARREN_PYPI_INDEX";
/// Where the wheels are staged in the root tree while pip installs them.
const STAGING: &str = "tmp/warren-wheels";
/// Largest index answer read.
const MAX_INDEX_JSON: u64 = 16 << 20;

/// One pinned Python package (a recipe's `[[python]]`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PythonPackage {
    /// The project's name on the index.
    pub name: String,
    /// The exact version.
    pub version: String,
    /// SHA-256 (hex) of the wheel to install.
    pub sha256: String,
}

fn plain(s: &str, extra: &[u8]) -> bool {
    !s.is_empty()
        && s.len() <= 128
        && s.starts_with(|c: char| c.is_ascii_alphanumeric())
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || extra.contains(&b))
}

impl PythonPackage {
    /// Checks the fields a recipe file gave.
    pub fn validate(&self) -> Result<(), String> {
        if !plain(&self.name, b"._-") || !plain(&self.version, b".+!_-") {
            return Err(format!(
                "python package {:?} {:?}: not a plain name and version",
                self.name, self.version
            ));
        }
        if self.sha256.len() != 64
            || !self
                .sha256
                .bytes()
                .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
        {
            return Err(format!(
                "python package {}: sha256 must be 64 lowercase hex digits",
                self.name
            ));
        }
        Ok(())
    }

    fn spec(&self) -> String {
        format!("{}=={}", self.name, self.version)
    }
}

/// The index to download from: `$WARREN_PYPI_INDEX` or [`PYPI_INDEX`].
pub fn index() -> String {
    std::env::var(PYPI_INDEX_ENV)
        .ok()
        .filter(|r| !r.trim().is_empty())
        .unwrap_or_else(|| PYPI_INDEX.to_string())
}

fn fetch_err(p: &PythonPackage, reason: impl Into<String>) -> ImageError {
    ImageError::PythonFetch {
        package: p.spec(),
        reason: reason.into(),
    }
}

/// PEP 691's project page.
#[derive(Deserialize)]
struct Project {
    files: Vec<ProjectFile>,
}

#[derive(Deserialize)]
struct ProjectFile {
    filename: String,
    url: String,
    hashes: Digests,
}

#[derive(Deserialize)]
struct Digests {
    #[serde(default)]
    sha256: String,
}

/// PEP 503's normalized project name.
fn normalized(name: &str) -> String {
    let mut out = String::new();
    for c in name.chars() {
        if matches!(c, '-' | '_' | '.') {
            if !out.ends_with('-') {
                out.push('-');
            }
        } else {
            out.push(c.to_ascii_lowercase());
        }
    }
    out
}

/// `curl` downloading `url` into `out`, at most `max` bytes; no URL globbing (a file URL
/// comes from the index's answer: `[1-100000]` or `{a,b}` in it must not fan out).
fn curl_command(url: &str, out: &Path, max: u64) -> Command {
    crate::agent_cli::bounded_curl(
        url,
        out,
        max,
        &["Accept: application/vnd.pypi.simple.v1+json"],
    )
}

fn curl(url: &str, out: &Path, max: u64) -> Result<Result<(), String>, ImageError> {
    Ok(run_output(curl_command(url, out, max))?
        .map(|_| ())
        .map_err(|f| format!("{} ({})", f.log_tail, f.status)))
}

/// Returns the verified wheel of `p` in `downloads`, downloading it from `index` when it is
/// missing or does not match the pin.
pub fn fetch(p: &PythonPackage, downloads: &Path, index: &str) -> Result<PathBuf, ImageError> {
    let dir = downloads.join("python").join(&p.sha256);
    if let Ok(entries) = std::fs::read_dir(&dir) {
        for e in entries.flatten() {
            let path = e.path();
            if path.extension().is_some_and(|x| x == "whl")
                && crate::digest::sha256_file(&path).is_ok_and(|d| d == p.sha256)
            {
                return Ok(path);
            }
        }
    }
    std::fs::create_dir_all(&dir).map_err(ImageError::io("create", &dir))?;
    let json = tempfile::Builder::new()
        .prefix(".python-")
        .tempfile_in(&dir)
        .map_err(ImageError::io("create temp file in", &dir))?;
    let url = format!(
        "{}/simple/{}/",
        index.trim_end_matches('/'),
        normalized(&p.name)
    );
    curl(&url, json.path(), MAX_INDEX_JSON)?.map_err(|e| fetch_err(p, format!("{url}: {e}")))?;
    let bytes = std::fs::read(json.path()).map_err(ImageError::io("read", json.path()))?;
    let project: Project = serde_json::from_slice(&bytes)
        .map_err(|e| fetch_err(p, format!("the index's answer for {url}: {e}")))?;
    let mut file = project
        .files
        .into_iter()
        .find(|f| f.hashes.sha256.eq_ignore_ascii_case(&p.sha256))
        .ok_or_else(|| fetch_err(p, format!("the index has no file with sha256 {}", p.sha256)))?;
    if !file.filename.contains(&format!("-{}-", p.version)) {
        return Err(fetch_err(
            p,
            format!(
                "the pinned file {} is not of version {}",
                file.filename, p.version
            ),
        ));
    }
    if file.url.starts_with('/') {
        // Relative to the index's origin.
        let origin: String = index.split('/').take(3).collect::<Vec<_>>().join("/");
        file.url = format!("{origin}{}", file.url);
    } else if !file.url.starts_with("https://") && !file.url.starts_with("http://") {
        file.url = format!("{url}{}", file.url);
    }
    let name_ok = file.filename.ends_with(".whl")
        && file.filename.len() <= 255
        && !file.filename.starts_with('.')
        && file
            .filename
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-' | b'+' | b'!'));
    if !name_ok {
        return Err(fetch_err(
            p,
            format!(
                "{:?} is not a wheel (only wheels are installed: nothing is built)",
                file.filename
            ),
        ));
    }
    let tmp = tempfile::Builder::new()
        .prefix(".python-")
        .tempfile_in(&dir)
        .map_err(ImageError::io("create temp file in", &dir))?;
    curl(&file.url, tmp.path(), 4 << 30)?
        .map_err(|e| fetch_err(p, format!("{}: {e}", file.url)))?;
    let actual = crate::digest::sha256_file(tmp.path())?;
    if actual != p.sha256 {
        return Err(ImageError::PythonIntegrity {
            package: p.spec(),
            expected: p.sha256.clone(),
            actual,
        });
    }
    let dest = dir.join(&file.filename);
    tmp.persist(&dest)
        .map_err(|e| ImageError::io("rename", &dest)(e.error))?;
    Ok(dest)
}

/// Copies the verified `wheels` into the root tree and installs them with pip in the confined
/// chroot (`log` gets pip's output). The staging directory is removed afterwards.
pub fn install(
    root: &Path,
    wheels: &[(PythonPackage, PathBuf)],
    log: &Path,
    progress: &mut dyn FnMut(&str),
) -> Result<(), ImageError> {
    if wheels.is_empty() {
        return Ok(());
    }
    let tree = crate::tree::Tree::open(root).map_err(|e| ImageError::RootfsSetup(e.to_string()))?;
    let mut argv: Vec<String> = [
        "python3",
        "-m",
        "pip",
        "install",
        "--no-index",
        "--no-deps",
        "--no-cache-dir",
        "--disable-pip-version-check",
        "--break-system-packages",
        "--root-user-action=ignore",
    ]
    .map(String::from)
    .to_vec();
    for (p, wheel) in wheels {
        let name = wheel
            .file_name()
            .and_then(|n| n.to_str())
            .ok_or_else(|| fetch_err(p, "wheel without a file name"))?;
        let bytes = std::fs::read(wheel).map_err(ImageError::io("read", wheel))?;
        if crate::digest::sha256_hex(&bytes) != p.sha256 {
            return Err(ImageError::PythonIntegrity {
                package: p.spec(),
                expected: p.sha256.clone(),
                actual: crate::digest::sha256_hex(&bytes),
            });
        }
        tree.write(&format!("{STAGING}/{name}"), &bytes, 0o644, (0, 0))
            .map_err(|e| ImageError::RootfsSetup(e.to_string()))?;
        argv.push(format!("/{STAGING}/{name}"));
    }
    let result = crate::chroot::run(root, &argv, log, progress);
    let top = tree
        .dir(&[b"tmp"])
        .map_err(|e| ImageError::RootfsSetup(e.to_string()))?;
    crate::tree::remove_entry(&top, b"warren-wheels", b"tmp/warren-wheels", true)
        .map_err(|e| ImageError::RootfsSetup(e.to_string()))?;
    result?.map_err(|f| ImageError::Packages {
        status: format!("pip install: {}", f.status),
        log: log.to_path_buf(),
        log_tail: f.log_tail,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_curl_command_no_globbing() {
        let cmd = curl_command("https://files.example/a[1-9]{x,y}.whl", Path::new("/o"), 7);
        let args: Vec<String> = cmd
            .get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        assert!(args.iter().any(|a| a == "--globoff"), "{args:?}");
        let at = args
            .iter()
            .position(|a| a == "--max-filesize")
            .expect("max");
        assert_eq!(args[at + 1], "7");
    }

    #[test]
    fn test_python_package_validate() {
        let ok = PythonPackage {
            name: "requests".into(),
            version: "2.32.3".into(),
            sha256: "a".repeat(64),
        };
        assert!(ok.validate().is_ok());
        for bad in [
            PythonPackage {
                name: "-r".into(),
                ..ok.clone()
            },
            PythonPackage {
                version: "1; rm".into(),
                ..ok.clone()
            },
            PythonPackage {
                sha256: "A".repeat(64),
                ..ok.clone()
            },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn test_normalized_names() {
        assert_eq!(normalized("Foo.Bar__baz"), "foo-bar-baz");
        assert_eq!(normalized("six"), "six");
    }

    #[test]
    fn test_fetch_cached_wheel_used_without_download() {
        let dir = tempfile::tempdir().expect("tempdir");
        let data = b"pretend wheel";
        let p = PythonPackage {
            name: "x".into(),
            version: "1".into(),
            sha256: crate::digest::sha256_hex(data),
        };
        let at = dir.path().join("python").join(&p.sha256);
        std::fs::create_dir_all(&at).expect("mkdir");
        std::fs::write(at.join("x-1-py3-none-any.whl"), data).expect("write");
        // An unreachable index proves no download was attempted.
        let got = fetch(&p, dir.path(), "http://127.0.0.1:9").expect("cached");
        assert_eq!(got, at.join("x-1-py3-none-any.whl"));
    }
}
