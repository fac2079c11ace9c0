//! Agent CLIs (Claude Code, Codex, opencode) installed into a recipe's root filesystem from
//! the npm registry.
//!
//! Each of them publishes its native Linux x86-64 binary as an npm package of its own, which
//! needs no Node.js: the `agents` recipe installs those, not the Node wrappers. The packages are
//! pinned in the recipe (`[[npm]]` of `recipes/agents.toml`) by name, version and the
//! registry's `dist.integrity` (SHA-512); the pins are part of the recipe description, so changing one changes the stage digest and the
//! image is rebuilt.
//!
//! Steps, run on the build thread:
//! 1. [`fetch`] (before debootstrap, so a bad pin fails in seconds): reuse
//!    `<downloads>/<package>-<version>.tgz` if its SHA-512 matches the pin; otherwise download
//!    the tarball with `curl` on the host (the host's CA store and proxy environment apply,
//!    which a chroot would not have) into a temp file, verify it against the pin, rename it.
//! 2. [`install`] (after the recipe's packages): unpack the verified tarball into
//!    `<root>/usr/local/lib/warren-agents/<command>-<version>/` and link
//!    `/usr/local/bin/<command>` to the package's binary.
//!
//! Invariant: a tarball is used only after its SHA-512 matched the pin, and unpacking creates
//! only regular files and directories inside the package directory: symlinks, hard links,
//! devices, absolute paths and `..` are refused, so an entry can neither escape nor be
//! redirected.

use std::fs::File;
use std::io::{BufReader, Read};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};
use std::process::Command;

use base64::Engine as _;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha512};

use crate::command::run_output;
use crate::ImageError;

/// The registry the tarballs come from, unless `WARREN_NPM_REGISTRY` names a mirror (safe:
/// every download is checked against its pinned integrity).
pub const NPM_REGISTRY: &str = "https://registry.npmjs.org";

/// Environment variable overriding [`NPM_REGISTRY`].
pub const NPM_REGISTRY_ENV: &str = "WARREN_NPM_REGISTRY";

/// Where the packages are unpacked, relative to the guest's root.
pub const INSTALL_DIR: &str = "usr/local/lib/warren-agents";

/// One agent CLI: a pinned npm package holding a native binary (a recipe's `[[npm]]`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NpmAgentCli {
    /// The command installed in `/usr/local/bin` (what `warren run <agent>` starts).
    pub command: String,
    /// The npm package name.
    pub package: String,
    /// The package version (Codex's native builds are versions `<release>-linux-x64` of
    /// `@openai/codex` itself).
    pub version: String,
    /// The registry's `dist.integrity` for this version: `sha512-` and the base64 digest of
    /// the tarball.
    pub integrity: String,
    /// The executable's path inside the package (below the tarball's `package/` directory).
    pub binary: String,
}

impl NpmAgentCli {
    /// Checks the fields a recipe file gave: names that stay inside their directories and
    /// URLs, a SHA-512 pin.
    pub fn validate(&self) -> Result<(), String> {
        let plain = |s: &str| {
            !s.is_empty()
                && s.len() <= 214
                && s.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~'))
                && s != "."
                && s != ".."
        };
        let package_ok = match self.package.strip_prefix('@') {
            Some(scoped) => scoped
                .split_once('/')
                .is_some_and(|(scope, name)| plain(scope) && plain(name)),
            None => plain(&self.package),
        };
        let binary_ok = self.binary.split('/').all(plain);
        if !plain(&self.command) || !package_ok || !plain(&self.version) || !binary_ok {
            return Err(format!(
                "npm package {:?}: command, package, version or binary is not a plain name",
                self.spec()
            ));
        }
        self.pinned_sha512().map(|_| ()).map_err(|_| {
            format!(
                "npm package {}: integrity must be sha512-<base64>",
                self.spec()
            )
        })
    }

    /// `package@version`, as npm spells it.
    pub fn spec(&self) -> String {
        format!("{}@{}", self.package, self.version)
    }

    /// The release the binary reports in `--version`: the version without a platform suffix.
    pub fn release(&self) -> &str {
        self.version.split('-').next().unwrap_or(&self.version)
    }

    /// The tarball's URL under `registry` (the registry's fixed layout:
    /// `<registry>/<name>/-/<name without scope>-<version>.tgz`).
    pub fn tarball_url(&self, registry: &str) -> String {
        let base = self.package.rsplit('/').next().unwrap_or(&self.package);
        format!(
            "{}/{}/-/{base}-{}.tgz",
            registry.trim_end_matches('/'),
            self.package,
            self.version
        )
    }

    /// File name of the cached tarball (a scope's `/` becomes `+`).
    fn cache_name(&self) -> String {
        format!("{}-{}.tgz", self.package.replace('/', "+"), self.version)
    }

    /// The package's directory, relative to the guest's root.
    fn install_dir(&self) -> PathBuf {
        Path::new(INSTALL_DIR).join(format!("{}-{}", self.command, self.version))
    }

    /// The pinned SHA-512, decoded.
    fn pinned_sha512(&self) -> Result<Vec<u8>, ImageError> {
        self.integrity
            .strip_prefix("sha512-")
            .and_then(|b| base64::engine::general_purpose::STANDARD.decode(b).ok())
            .filter(|d| d.len() == 64)
            .ok_or_else(|| ImageError::NpmIntegrity {
                package: self.spec(),
                expected: self.integrity.to_string(),
                actual: "no valid sha512 pin".to_string(),
            })
    }
}

/// The registry to download from: `$WARREN_NPM_REGISTRY` or [`NPM_REGISTRY`].
pub fn registry() -> String {
    std::env::var(NPM_REGISTRY_ENV)
        .ok()
        .filter(|r| !r.trim().is_empty())
        .unwrap_or_else(|| NPM_REGISTRY.to_string())
}

/// The `sha512-<base64>` integrity string of the file at `path`.
fn file_integrity(path: &Path) -> Result<String, ImageError> {
    let mut f = File::open(path).map_err(ImageError::io("open", path))?;
    let mut h = Sha512::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(ImageError::io("read", path))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(format!(
        "sha512-{}",
        base64::engine::general_purpose::STANDARD.encode(h.finalize())
    ))
}

/// Checks the file at `path` against `cli`'s pin.
fn verify(cli: &NpmAgentCli, path: &Path) -> Result<(), ImageError> {
    let pinned = cli.pinned_sha512()?;
    let actual = file_integrity(path)?;
    let expected = format!(
        "sha512-{}",
        base64::engine::general_purpose::STANDARD.encode(pinned)
    );
    if actual == expected {
        Ok(())
    } else {
        Err(ImageError::NpmIntegrity {
            package: cli.spec(),
            expected,
            actual,
        })
    }
}

/// Returns the verified tarball of `cli` in `downloads`, downloading it from `registry` with
/// `curl` when it is missing or does not match the pin.
pub fn fetch(cli: &NpmAgentCli, downloads: &Path, registry: &str) -> Result<PathBuf, ImageError> {
    let cached = downloads.join(cli.cache_name());
    if cached.is_file() && verify(cli, &cached).is_ok() {
        return Ok(cached);
    }
    let url = cli.tarball_url(registry);
    let tmp = tempfile::Builder::new()
        .prefix(PARTIAL_PREFIX)
        .tempfile_in(downloads)
        .map_err(ImageError::io("create temp file in", downloads))?;
    run_output(curl_command(&url, tmp.path()))?.map_err(|f| ImageError::NpmFetch {
        package: cli.spec(),
        url: url.clone(),
        status: f.status,
        output: f.log_tail,
    })?;
    verify(cli, tmp.path())?;
    tmp.persist(&cached)
        .map_err(|e| ImageError::io("rename", &cached)(e.error))?;
    Ok(cached)
}

/// Largest package tarball downloaded.
const MAX_TARBALL: u64 = 1 << 30;

/// `curl` downloading an npm tarball `url` into `out` ([`bounded_curl`]).
fn curl_command(url: &str, out: &Path) -> Command {
    bounded_curl(url, out, MAX_TARBALL, &[])
}

/// `curl` downloading `url` into `out` with `headers`: at most `max` bytes and bounded in
/// time (a registry or mirror sending an endless body must not fill the disk or hold the
/// build forever), no URL globbing (a URL from a registry's answer must not fan out),
/// HTTP(S) only. Shared by npm and Python package downloads.
pub(crate) fn bounded_curl(url: &str, out: &Path, max: u64, headers: &[&str]) -> Command {
    let mut cmd = Command::new("curl");
    for h in headers {
        cmd.arg("--header").arg(h);
    }
    cmd.args([
        "--fail",
        "--silent",
        "--show-error",
        "--location",
        "--globoff",
        "--proto",
        "=https,http",
        "--retry",
        "3",
        "--connect-timeout",
        "30",
        "--max-time",
        "1800",
        "--max-filesize",
    ])
    .arg(max.to_string())
    .arg("--output")
    .arg(out)
    .arg(url);
    cmd
}

/// Prefix of in-progress downloads (removed by [`remove_partial_downloads`]).
const PARTIAL_PREFIX: &str = ".npm-";

/// Removes downloads a crashed build left behind (the caller holds the build lock).
pub(crate) fn remove_partial_downloads(downloads: &Path) {
    let Ok(entries) = std::fs::read_dir(downloads) else {
        return;
    };
    for e in entries.flatten() {
        if e.file_name().to_string_lossy().starts_with(PARTIAL_PREFIX) {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// Unpacks `cli`'s verified `tarball` into the root tree `root` and links
/// `/usr/local/bin/<command>` to its binary. Returns the package's size in bytes.
pub fn install(cli: &NpmAgentCli, tarball: &Path, root: &Path) -> Result<u64, ImageError> {
    let unpack_err = |reason: String| ImageError::NpmUnpack {
        package: cli.spec(),
        reason,
    };
    let rel = cli.install_dir();
    let dest = root.join(&rel);
    // The packages' maintainer scripts ran as root in this tree before: every directory on
    // the way is checked to be a real directory, never a link they planted (which the host
    // kernel would follow out of the tree).
    std::fs::create_dir_all(root).map_err(ImageError::io("create", root))?;
    if let Some(parent) = rel.parent() {
        real_dirs(root, parent, &cli.spec())?;
    }
    std::fs::create_dir(&dest).map_err(ImageError::io("create", &dest))?;
    let file = File::open(tarball).map_err(ImageError::io("open", tarball))?;
    let size = unpack(BufReader::new(file), &dest).map_err(unpack_err)?;

    let binary = dest.join(&cli.binary);
    let is_file = std::fs::symlink_metadata(&binary)
        .map(|m| m.is_file())
        .unwrap_or(false);
    if !is_file {
        return Err(unpack_err(format!(
            "the package has no file {}",
            cli.binary
        )));
    }
    // Executable whatever the archive says, as npm makes a package's bins (a Node.js
    // package's bin is a `#!/usr/bin/env node` script, often 0644 in the tarball).
    std::fs::set_permissions(&binary, std::fs::Permissions::from_mode(0o755))
        .map_err(ImageError::io("chmod", &binary))?;
    let bin_dir = root.join("usr/local/bin");
    real_dirs(root, Path::new("usr/local/bin"), &cli.spec())?;
    let link = bin_dir.join(&cli.command);
    // Relative, so it resolves the same inside the guest and in the build tree.
    let target = Path::new("..").join(rel.strip_prefix("usr/local").unwrap_or(&rel));
    std::os::unix::fs::symlink(target.join(&cli.binary), &link)
        .map_err(ImageError::io("symlink", &link))?;
    Ok(size)
}

/// Makes each directory of the relative path `rel` under `root` that is missing, and refuses
/// any that exists as something else than a directory (a symbolic link included). Nothing
/// runs in the tree meanwhile (the chroot's commands have ended), so what is checked is what
/// is used.
fn real_dirs(root: &Path, rel: &Path, package: &str) -> Result<(), ImageError> {
    let mut at = root.to_path_buf();
    for c in rel.components() {
        let Component::Normal(name) = c else {
            return Err(ImageError::NpmUnpack {
                package: package.to_string(),
                reason: format!("{} is not a plain relative path", rel.display()),
            });
        };
        at.push(name);
        match std::fs::symlink_metadata(&at) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => {
                return Err(ImageError::NpmUnpack {
                    package: package.to_string(),
                    reason: format!(
                        "{} is not a directory (a link is never followed)",
                        at.display()
                    ),
                })
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                std::fs::create_dir(&at).map_err(ImageError::io("create", &at))?
            }
            Err(e) => return Err(ImageError::io("stat", &at)(e)),
        }
    }
    Ok(())
}

/// Unpacks a gzipped npm tarball into the empty directory `dest`, dropping the first path
/// component (`package/`) as npm does. Only regular files and directories with plain relative
/// names are accepted; files are 0755 when the archive marks them executable, else 0644.
/// Returns the unpacked size in bytes.
fn unpack(tarball: impl Read, dest: &Path) -> Result<u64, String> {
    let mut archive = tar::Archive::new(flate2::read::GzDecoder::new(tarball));
    let mut total = 0u64;
    let entries = archive.entries().map_err(|e| format!("reading: {e}"))?;
    for entry in entries {
        let mut entry = entry.map_err(|e| format!("reading: {e}"))?;
        let kind = entry.header().entry_type();
        if kind == tar::EntryType::XGlobalHeader {
            continue;
        }
        let raw = entry
            .path()
            .map_err(|e| format!("entry name: {e}"))?
            .into_owned();
        let Some(rel) = package_relative(&raw) else {
            return Err(format!("refusing entry {}", raw.display()));
        };
        let path = dest.join(&rel);
        match kind {
            tar::EntryType::Directory => {
                std::fs::create_dir_all(&path).map_err(|e| format!("{}: {e}", path.display()))?;
            }
            tar::EntryType::Regular | tar::EntryType::Continuous => {
                // Every directory under `dest` was created here and no entry can make a
                // symlink, so these paths cannot leave `dest`.
                if let Some(parent) = path.parent() {
                    std::fs::create_dir_all(parent)
                        .map_err(|e| format!("{}: {e}", parent.display()))?;
                }
                let exec = entry
                    .header()
                    .mode()
                    .map(|m| m & 0o111 != 0)
                    .unwrap_or(false);
                let mut out = std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .mode(if exec { 0o755 } else { 0o644 })
                    .open(&path)
                    .map_err(|e| format!("{}: {e}", path.display()))?;
                total += std::io::copy(&mut entry, &mut out)
                    .map_err(|e| format!("{}: {e}", path.display()))?;
            }
            other => {
                return Err(format!(
                    "refusing {} (type {other:?}): only files and directories are allowed",
                    raw.display()
                ));
            }
        }
    }
    Ok(total)
}

/// The entry's path below its first component, if every component is a plain name (`.`
/// components are dropped; `..`, roots and an empty remainder are refused).
fn package_relative(raw: &Path) -> Option<PathBuf> {
    let mut parts = Vec::new();
    for c in raw.components() {
        match c {
            Component::Normal(p) => parts.push(p),
            Component::CurDir => {}
            Component::ParentDir | Component::RootDir | Component::Prefix(_) => return None,
        }
    }
    if parts.len() < 2 {
        return None;
    }
    Some(parts[1..].iter().collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A gzipped tar archive of `entries` (name, type, data), names written raw so that
    /// hostile ones survive.
    fn tarball(entries: &[(&str, tar::EntryType, &[u8])]) -> Vec<u8> {
        tarball_with_mode(entries, 0o755)
    }

    fn tarball_with_mode(entries: &[(&str, tar::EntryType, &[u8])], mode: u32) -> Vec<u8> {
        let mut b = tar::Builder::new(flate2::write::GzEncoder::new(
            Vec::new(),
            flate2::Compression::fast(),
        ));
        for (name, kind, data) in entries {
            let mut h = tar::Header::new_gnu();
            {
                let gnu = h.as_gnu_mut().expect("gnu header");
                gnu.name[..name.len()].copy_from_slice(name.as_bytes());
            }
            h.set_entry_type(*kind);
            h.set_mode(mode);
            h.set_size(data.len() as u64);
            if *kind == tar::EntryType::Symlink {
                h.set_link_name("/etc/passwd").expect("link name");
            }
            h.set_cksum();
            b.append(&h, *data).expect("append");
        }
        b.into_inner().expect("tar").finish().expect("gzip")
    }

    fn agent_clis() -> Vec<NpmAgentCli> {
        crate::Recipe::builtin("agents")
            .expect("agents")
            .agent_clis()
            .to_vec()
    }

    #[test]
    fn test_curl_command_bounded() {
        let cmd = curl_command("https://registry.example/x/-/x-1.tgz", Path::new("/tmp/o"));
        let args: Vec<String> = cmd
            .get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        for (flag, value) in [
            ("--max-filesize", Some(MAX_TARBALL.to_string())),
            ("--max-time", Some("1800".to_string())),
            ("--proto", Some("=https,http".to_string())),
            ("--globoff", None),
        ] {
            let at = args.iter().position(|a| a == flag);
            assert!(at.is_some(), "{flag} in {args:?}");
            if let (Some(at), Some(v)) = (at, value) {
                assert_eq!(args.get(at + 1), Some(&v), "{flag}");
            }
        }
        assert_eq!(
            args.last().map(String::as_str),
            Some("https://registry.example/x/-/x-1.tgz")
        );
    }

    #[test]
    fn test_agent_clis_pins_are_sha512() {
        for cli in agent_clis() {
            assert!(cli.validate().is_ok(), "{}", cli.spec());
            assert!(cli.pinned_sha512().is_ok(), "{}", cli.spec());
            assert!(!cli.binary.starts_with('/') && !cli.binary.contains(".."));
        }
    }

    #[test]
    fn test_tarball_url_scoped_and_unscoped() {
        let codex = agent_clis()[1].clone();
        assert_eq!(
            codex.tarball_url("https://registry.npmjs.org/"),
            "https://registry.npmjs.org/@openai/codex/-/codex-0.171.0-linux-x64.tgz"
        );
        assert_eq!(codex.release(), "0.171.0");
        assert_eq!(
            agent_clis()[2].tarball_url(NPM_REGISTRY),
            "https://registry.npmjs.org/opencode-linux-x64/-/opencode-linux-x64-1.18.33.tgz"
        );
    }

    #[test]
    fn test_verify_mismatch_names_package() {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = dir.path().join("t.tgz");
        std::fs::write(&f, b"not the package").expect("write");
        let err = verify(&agent_clis()[0], &f).expect_err("mismatch");
        let msg = err.to_string();
        assert!(
            msg.contains("@anthropic-ai/claude-code-linux-x64@2.1.332"),
            "{msg}"
        );
    }

    #[test]
    fn test_fetch_cached_tarball_matching_pin_used_without_download() {
        let dir = tempfile::tempdir().expect("tempdir");
        let data = b"pretend tarball";
        let integrity = format!(
            "sha512-{}",
            base64::engine::general_purpose::STANDARD.encode(Sha512::digest(data))
        );
        let cli = NpmAgentCli {
            integrity,
            ..agent_clis()[2].clone()
        };
        std::fs::write(dir.path().join(cli.cache_name()), data).expect("write");
        // An unreachable registry proves no download was attempted.
        let got = fetch(&cli, dir.path(), "http://127.0.0.1:9").expect("cached");
        assert_eq!(got, dir.path().join("opencode-linux-x64-1.18.33.tgz"));
    }

    #[test]
    fn test_unpack_package_files_and_modes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let tgz = tarball(&[
            ("package/bin/", tar::EntryType::Directory, b""),
            ("package/bin/tool", tar::EntryType::Regular, b"#!/bin/sh\n"),
            ("package/package.json", tar::EntryType::Regular, b"{}"),
        ]);
        let n = unpack(&tgz[..], dir.path()).expect("unpack");
        assert_eq!(n, 12);
        let tool = dir.path().join("bin/tool");
        assert_eq!(std::fs::read(&tool).expect("read"), b"#!/bin/sh\n");
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&tool).expect("stat").permissions().mode();
        assert_eq!(mode & 0o777, 0o755);
    }

    #[test]
    fn test_unpack_escaping_or_linking_entries_refused() {
        for (name, kind) in [
            ("package/../../etc/x", tar::EntryType::Regular),
            ("/etc/x", tar::EntryType::Regular),
            ("package/link", tar::EntryType::Symlink),
            ("package/hard", tar::EntryType::Link),
            ("package/dev", tar::EntryType::Char),
            ("package", tar::EntryType::Regular),
        ] {
            let dir = tempfile::tempdir().expect("tempdir");
            let dest = dir.path().join("dest");
            std::fs::create_dir(&dest).expect("mkdir");
            let tgz = tarball(&[(name, kind, b"x")]);
            assert!(unpack(&tgz[..], &dest).is_err(), "{name} accepted");
            assert!(!dir.path().join("etc").exists());
        }
    }

    /// `DIR/t.tgz`: an opencode package holding only its binary, `bin`, 0644 as a Node.js
    /// package's script bin is.
    fn opencode_tarball(dir: &Path) -> PathBuf {
        let t = dir.join("t.tgz");
        let tgz = tarball_with_mode(
            &[("package/bin/opencode", tar::EntryType::Regular, b"bin")],
            0o644,
        );
        std::fs::write(&t, tgz).expect("write");
        t
    }

    #[test]
    fn test_install_links_command_to_binary() {
        let dir = tempfile::tempdir().expect("tempdir");
        let t = opencode_tarball(dir.path());
        let root = dir.path().join("root");
        install(&agent_clis()[2], &t, &root).expect("install");
        let link = root.join("usr/local/bin/opencode");
        assert_eq!(
            std::fs::read_link(&link).expect("link"),
            Path::new("../lib/warren-agents/opencode-1.18.33/bin/opencode")
        );
        assert_eq!(std::fs::read(&link).expect("read through link"), b"bin");
    }

    #[test]
    fn test_install_missing_binary_fails() {
        let dir = tempfile::tempdir().expect("tempdir");
        let tgz = tarball(&[("package/README.md", tar::EntryType::Regular, b"hi")]);
        let t = dir.path().join("t.tgz");
        std::fs::write(&t, tgz).expect("write");
        let err = install(&agent_clis()[0], &t, &dir.path().join("root")).expect_err("no binary");
        assert!(err.to_string().contains("claude-code-linux-x64"), "{err}");
    }

    /// A bin that the tarball has 0644 (a Node.js script) is made executable, as npm does.
    #[test]
    fn test_install_makes_the_binary_executable() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("tempdir");
        let t = opencode_tarball(dir.path());
        let root = dir.path().join("root");
        install(&agent_clis()[2], &t, &root).expect("install");
        let mode = std::fs::metadata(root.join("usr/local/bin/opencode"))
            .expect("stat")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o755);
    }

    /// A link planted in the root tree where the install goes (as a package's maintainer
    /// script could, running as root in the chroot) is refused, never followed: nothing is
    /// written outside the tree.
    #[test]
    fn test_install_refuses_links_planted_on_its_path() {
        for planted in [
            "usr/local/lib",
            "usr/local/lib/warren-agents",
            "usr/local/bin",
            "usr",
        ] {
            let dir = tempfile::tempdir().expect("tempdir");
            let t = opencode_tarball(dir.path());
            let root = dir.path().join("root");
            let outside = dir.path().join("outside");
            std::fs::create_dir_all(&outside).expect("outside");
            let at = root.join(planted);
            std::fs::create_dir_all(at.parent().expect("parent")).expect("parents");
            std::os::unix::fs::symlink(&outside, &at).expect("plant");
            let err = install(&agent_clis()[2], &t, &root).expect_err(planted);
            assert!(
                err.to_string().contains("not a directory"),
                "{planted}: {err}"
            );
            assert_eq!(
                std::fs::read_dir(&outside).expect("outside").count(),
                0,
                "{planted}: written outside the tree"
            );
        }
    }
}
