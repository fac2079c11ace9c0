//! Image recipes: recipe files (TOML), strictly parsed, and the canonical description whose
//! digest keys the build caches.
//!
//! A recipe file names a `base` (another recipe, built in), extra Debian packages, symbolic
//! links, pinned npm and Python packages, files copied into the root tree, commands run in it
//! and the root disk's size. The built-in recipes (`minimal`, `dev`, `agents`) are such files,
//! compiled in from `crates/warren-image/recipes/`. Parsing resolves the base chain and
//! flattens it: a [`Recipe`] is everything the builder does, in order.
//!
//! Invariants:
//! - unknown keys, malformed names and out-of-range values are refused (the file is operator
//!   input, but a typo must not silently build something else);
//! - everything that changes the bytes of a built image (suite, packages, sizes, kernel
//!   package, module list, pinned npm and Python packages, the *content* and mode of every
//!   file copied in, the commands, builder logic version) is part of
//!   [`Recipe::description`], so an unchanged digest means the cached stage can be reused.
//!   Paths and modification times of the files on the host are not;
//! - fields a recipe does not use are left out of the description, so the built-in recipes
//!   keep the digests they had when they were Rust constants.

use std::collections::BTreeSet;
use std::fmt;
use std::path::{Component, Path};

use serde::{Deserialize, Serialize};

use crate::agent_cli::NpmAgentCli;
use crate::digest;
use crate::python::PythonPackage;
use crate::ImageError;

/// Bump whenever the build logic changes what ends up in an image.
pub const BUILDER_FORMAT: u32 = 1;

/// Debian suite all recipes are built from.
pub const SUITE: &str = "trixie";

/// Debian mirror used by debootstrap and apt inside the chroot.
pub const MIRROR: &str = "http://deb.debian.org/debian";

/// The metapackage that points at the current cloud kernel of the suite.
pub const KERNEL_METAPACKAGE: &str = "linux-image-cloud-amd64";

/// The recipe whose kernel every image boots (its stage is the kernel stage).
pub const KERNEL_RECIPE: &str = "minimal";

/// Modules the guest agent loads, in load order (dependencies are added by the builder;
/// modules built into the kernel are skipped).
pub const AGENT_MODULES: &[&str] = &[
    "virtio_mmio",
    "virtio_blk",
    "failover",
    "net_failover",
    "virtio_net",
    "vsock",
    "vmw_vsock_virtio_transport_common",
    "vmw_vsock_virtio_transport",
    "overlay",
    "fuse",
    "virtiofs",
];

/// UID and GID of the unprivileged guest user `user`.
pub const USER_ID: u32 = 1000;

/// The built-in recipe files, in display order.
pub const BUILTIN: [(&str, &str); 3] = [
    ("minimal", include_str!("../recipes/minimal.toml")),
    ("dev", include_str!("../recipes/dev.toml")),
    ("agents", include_str!("../recipes/agents.toml")),
];

/// The files built-in recipes copy in, compiled in beside them: `(source, content)`, the
/// source as a built-in recipe's `[[files]]` entry names it (relative to `recipes/`).
pub const BUILTIN_FILES: [(&str, &[u8]); 3] = [
    (
        "browser/warren-browser-mcp",
        include_bytes!("../recipes/browser/warren-browser-mcp"),
    ),
    (
        "browser/mcp.json",
        include_bytes!("../recipes/browser/mcp.json"),
    ),
    (
        "browser/opencode.json",
        include_bytes!("../recipes/browser/opencode.json"),
    ),
];

/// Where a recipe's `[[files]]` sources are read from.
#[derive(Clone, Copy)]
enum FileSource<'a> {
    /// A recipe file's directory on the host.
    Dir(&'a Path),
    /// [`BUILTIN_FILES`] (a built-in recipe's).
    Builtin,
}

/// Names that are not recipe names: what pulled images record as their recipe.
pub const OCI_RECIPE: &str = "oci";

/// Largest recipe file.
const MAX_RECIPE_FILE: u64 = 1 << 20;
/// Largest file copied in, and all of them together (they are held in memory).
const MAX_COPY_FILE: u64 = 32 << 20;
const MAX_COPY_TOTAL: u64 = 64 << 20;
/// Most entries of each list.
const MAX_ITEMS: usize = 1000;
/// Longest command.
const MAX_COMMAND: usize = 64 << 10;
/// Root disk sizes a recipe may ask for, in MiB.
const DISK_MIB: std::ops::RangeInclusive<u64> = 512..=(256 << 10);
/// Deepest base chain.
const MAX_BASE_DEPTH: usize = 4;

/// A recipe file as written (TOML). See the module docs and README's "Recipe files".
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct RecipeFile {
    name: String,
    #[serde(default)]
    base: Option<String>,
    #[serde(default)]
    disk_size_mib: Option<u64>,
    #[serde(default)]
    packages: Vec<String>,
    #[serde(default)]
    links: Vec<LinkSpec>,
    #[serde(default)]
    npm: Vec<NpmAgentCli>,
    #[serde(default)]
    python: Vec<PythonPackage>,
    #[serde(default)]
    files: Vec<FileSpec>,
    #[serde(default)]
    commands: Vec<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct LinkSpec {
    path: String,
    target: String,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileSpec {
    /// Host path, relative to the recipe file's directory.
    source: String,
    /// Absolute path in the image.
    dest: String,
    #[serde(default = "default_mode")]
    mode: u32,
    #[serde(default)]
    uid: u32,
    #[serde(default)]
    gid: u32,
}

fn default_mode() -> u32 {
    0o644
}

/// A file a recipe copies into the image: its content is read when the recipe is loaded and
/// held, so what was hashed is what is written.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CopiedFile {
    pub dest: String,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub sha256: String,
    pub size: u64,
    #[serde(skip)]
    pub content: std::sync::Arc<Vec<u8>>,
}

/// A resolved recipe: its base chain flattened, files read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recipe {
    name: String,
    packages: Vec<String>,
    links: Vec<(String, String)>,
    npm: Vec<NpmAgentCli>,
    python: Vec<PythonPackage>,
    files: Vec<CopiedFile>,
    commands: Vec<String>,
    rootfs_size: u64,
}

/// The canonical, hashed description of a recipe (the agent is hashed separately).
#[derive(Debug, Clone, Serialize)]
pub struct RecipeDescription<'a> {
    pub builder_format: u32,
    pub name: &'a str,
    pub suite: &'static str,
    pub mirror: &'static str,
    pub variant: &'static str,
    pub packages: &'a [String],
    pub rootfs_size: u64,
    pub kernel_package: &'static str,
    pub modules: &'static [&'static str],
    pub user_id: u32,
    /// Pinned npm packages. Left out when empty, so recipes without them keep the digests
    /// they had before the field existed.
    #[serde(skip_serializing_if = "<[_]>::is_empty")]
    pub agent_clis: &'a [NpmAgentCli],
    /// Symbolic links `(link, target)` made in the root tree after the packages.
    #[serde(skip_serializing_if = "<[_]>::is_empty")]
    pub links: &'a [(String, String)],
    /// Pinned Python packages (name, version, the wheel's SHA-256).
    #[serde(skip_serializing_if = "<[_]>::is_empty")]
    pub python: &'a [PythonPackage],
    /// Files copied in: destination, mode, owner, and the content's SHA-256 and size.
    #[serde(skip_serializing_if = "<[_]>::is_empty")]
    pub files: &'a [CopiedFile],
    /// Commands run in the root tree, in order.
    #[serde(skip_serializing_if = "<[_]>::is_empty")]
    pub commands: &'a [String],
}

fn invalid(origin: &str, reason: impl fmt::Display) -> ImageError {
    ImageError::RecipeInvalid(format!("{origin}: {reason}"))
}

/// Recipe names: 1-64 of `a-z 0-9 . _ -`, starting with a letter, not all hex digits (so a
/// name never reads as an image id prefix).
pub fn valid_name(n: &str) -> bool {
    n.len() <= 64
        && n.starts_with(|c: char| c.is_ascii_lowercase())
        && n.bytes().all(|b| {
            b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'.' | b'_' | b'-')
        })
        && !n.bytes().all(|b| b.is_ascii_hexdigit())
}

/// Debian package names (`name` or `name=version`), as apt takes them: never an option.
fn valid_package(p: &str) -> bool {
    let (name, version) = match p.split_once('=') {
        Some((n, v)) => (n, Some(v)),
        None => (p, None),
    };
    let name_ok = (2..=128).contains(&name.len())
        && name.starts_with(|c: char| c.is_ascii_lowercase() || c.is_ascii_digit())
        && name.bytes().all(|b| {
            b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'+' | b'-' | b'.')
        });
    let version_ok = version.is_none_or(|v| {
        !v.is_empty()
            && v.len() <= 128
            && v.starts_with(|c: char| c.is_ascii_digit())
            && v.bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'+' | b'~' | b':' | b'-'))
    });
    name_ok && version_ok
}

/// An absolute, normal path in the image (no `.`, `..`, empty or NUL components), returned
/// without its leading `/`.
pub(crate) fn image_path(p: &str) -> Option<&str> {
    let rel = p.strip_prefix('/')?;
    if rel.is_empty() || p.len() > 4096 || p.contains('\0') || p.ends_with('/') {
        return None;
    }
    Path::new(rel)
        .components()
        .all(|c| matches!(c, Component::Normal(_)))
        .then_some(rel)
        .filter(|r| !r.split('/').any(|c| c.is_empty() || c == "." || c == ".."))
}

impl Recipe {
    /// The built-in recipe `name`.
    pub fn builtin(name: &str) -> Result<Recipe, ImageError> {
        let text = BUILTIN
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, t)| *t)
            .ok_or_else(|| ImageError::UnknownRecipe(name.to_string()))?;
        Self::parse(
            text,
            &format!("built-in recipe {name}"),
            FileSource::Builtin,
            0,
        )
    }

    /// Every built-in recipe, in display order.
    pub fn builtins() -> Vec<Recipe> {
        BUILTIN
            .iter()
            .filter_map(|(n, _)| Recipe::builtin(n).ok())
            .collect()
    }

    /// Whether `name` is a built-in recipe's.
    pub fn is_builtin(name: &str) -> bool {
        BUILTIN.iter().any(|(n, _)| *n == name)
    }

    /// Reads and resolves the recipe file at `path` (files copied in are read relative to its
    /// directory). Its name may not be a built-in recipe's or `oci`.
    pub fn from_file(path: &Path) -> Result<Recipe, ImageError> {
        let origin = path.display().to_string();
        let meta = std::fs::metadata(path).map_err(ImageError::io("stat", path))?;
        if !meta.is_file() || meta.len() > MAX_RECIPE_FILE {
            return Err(invalid(
                &origin,
                format!("not a regular file of at most {MAX_RECIPE_FILE} bytes"),
            ));
        }
        let text = std::fs::read_to_string(path).map_err(ImageError::io("read", path))?;
        let dir = path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        let r = Self::parse(&text, &origin, FileSource::Dir(dir), 0)?;
        if Self::is_builtin(&r.name) || r.name == OCI_RECIPE {
            return Err(invalid(
                &origin,
                format!(
                    "name {:?} is reserved (built-in recipes and pulled images)",
                    r.name
                ),
            ));
        }
        Ok(r)
    }

    fn parse(
        text: &str,
        origin: &str,
        source: FileSource<'_>,
        depth: usize,
    ) -> Result<Recipe, ImageError> {
        let f: RecipeFile = toml::from_str(text).map_err(|e| invalid(origin, e.message()))?;
        if !valid_name(&f.name) {
            return Err(invalid(
                origin,
                format!(
                    "name {:?}: use 1-64 of a-z, 0-9, '.', '_', '-', starting with a letter, \
                     not only hex digits",
                    f.name
                ),
            ));
        }
        let mut r = match &f.base {
            None => Recipe {
                name: String::new(),
                packages: Vec::new(),
                links: Vec::new(),
                npm: Vec::new(),
                python: Vec::new(),
                files: Vec::new(),
                commands: Vec::new(),
                rootfs_size: 0,
            },
            Some(base) => {
                if depth >= MAX_BASE_DEPTH {
                    return Err(invalid(origin, "base chain too deep"));
                }
                let text = BUILTIN
                    .iter()
                    .find(|(n, _)| n == base)
                    .map(|(_, t)| *t)
                    .ok_or_else(|| {
                        invalid(
                            origin,
                            format!(
                                "base {base:?} is not a built-in recipe (minimal, dev, agents)"
                            ),
                        )
                    })?;
                Self::parse(
                    text,
                    &format!("built-in recipe {base}"),
                    FileSource::Builtin,
                    depth + 1,
                )?
            }
        };
        r.name = f.name.clone();
        let total = [
            f.packages.len(),
            f.links.len(),
            f.npm.len(),
            f.python.len(),
            f.files.len(),
            f.commands.len(),
        ];
        if total.iter().any(|n| *n > MAX_ITEMS) {
            return Err(invalid(
                origin,
                format!("a list has more than {MAX_ITEMS} entries"),
            ));
        }
        for p in f.packages {
            if !valid_package(&p) {
                return Err(invalid(
                    origin,
                    format!("package {p:?} is not a Debian package name"),
                ));
            }
            if r.packages.contains(&p) {
                return Err(invalid(origin, format!("package {p:?} listed twice")));
            }
            r.packages.push(p);
        }
        for l in f.links {
            if image_path(&l.path).is_none() || image_path(&l.target).is_none() {
                return Err(invalid(
                    origin,
                    format!(
                        "link {:?} -> {:?}: both must be absolute, normal paths",
                        l.path, l.target
                    ),
                ));
            }
            r.links.push((l.path, l.target));
        }
        for n in f.npm {
            n.validate().map_err(|e| invalid(origin, e))?;
            if r.npm.iter().any(|o| o.command == n.command) {
                return Err(invalid(
                    origin,
                    format!("npm command {:?} listed twice", n.command),
                ));
            }
            r.npm.push(n);
        }
        for p in f.python {
            p.validate().map_err(|e| invalid(origin, e))?;
            if r.python.iter().any(|o| o.name == p.name) {
                return Err(invalid(
                    origin,
                    format!("python package {:?} listed twice", p.name),
                ));
            }
            r.python.push(p);
        }
        if !f.files.is_empty() {
            let mut total = r.files.iter().map(|f| f.size).sum::<u64>();
            for spec in f.files {
                let file = read_copied(source, &spec).map_err(|e| invalid(origin, e))?;
                total += file.size;
                if total > MAX_COPY_TOTAL {
                    return Err(invalid(
                        origin,
                        format!("files copied in exceed {MAX_COPY_TOTAL} bytes together"),
                    ));
                }
                r.files.push(file);
            }
        }
        for c in f.commands {
            if c.trim().is_empty() || c.len() > MAX_COMMAND || c.contains('\0') {
                return Err(invalid(
                    origin,
                    format!("a command is empty, has a NUL or is longer than {MAX_COMMAND} bytes"),
                ));
            }
            r.commands.push(c);
        }
        match f.disk_size_mib {
            Some(mib) if DISK_MIB.contains(&mib) => r.rootfs_size = mib << 20,
            Some(mib) => {
                return Err(invalid(
                    origin,
                    format!("disk_size_mib {mib} outside {DISK_MIB:?}"),
                ))
            }
            None if r.rootfs_size == 0 => {
                return Err(invalid(origin, "disk_size_mib is required without a base"))
            }
            None => {}
        }
        if !r.python.is_empty() && !r.packages.iter().any(|p| p == "python3-pip") {
            return Err(invalid(
                origin,
                "python packages are installed with pip: add python3-pip to packages (or use base dev)",
            ));
        }
        let dests: BTreeSet<&str> = r.files.iter().map(|f| f.dest.as_str()).collect();
        if dests.len() != r.files.len() {
            return Err(invalid(origin, "two files have the same dest"));
        }
        Ok(r)
    }

    /// The recipe's name as used on the command line and in manifests.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Packages installed on top of `debootstrap --variant=minbase`.
    pub fn packages(&self) -> &[String] {
        &self.packages
    }

    /// Symbolic links `(link, target)` made after the packages are installed.
    pub fn links(&self) -> &[(String, String)] {
        &self.links
    }

    /// Pinned npm packages holding native binaries (the agent CLIs), installed into
    /// `/usr/local/bin`.
    pub fn agent_clis(&self) -> &[NpmAgentCli] {
        &self.npm
    }

    /// Pinned Python wheels, downloaded on the host and installed with pip offline.
    pub fn python(&self) -> &[PythonPackage] {
        &self.python
    }

    /// Files copied into the root tree.
    pub fn files(&self) -> &[CopiedFile] {
        &self.files
    }

    /// Commands run in the root tree (chrooted, `/proc` and a minimal `/dev`, no network).
    pub fn commands(&self) -> &[String] {
        &self.commands
    }

    /// Virtual size of the ext4 root disk in bytes (the file is sparse).
    pub fn rootfs_size(&self) -> u64 {
        self.rootfs_size
    }

    /// The canonical description hashed into the stage digest.
    pub fn description(&self) -> RecipeDescription<'_> {
        RecipeDescription {
            builder_format: BUILDER_FORMAT,
            name: &self.name,
            suite: SUITE,
            mirror: MIRROR,
            variant: "minbase",
            packages: &self.packages,
            rootfs_size: self.rootfs_size,
            kernel_package: KERNEL_METAPACKAGE,
            modules: AGENT_MODULES,
            user_id: USER_ID,
            agent_clis: &self.npm,
            links: &self.links,
            python: &self.python,
            files: &self.files,
            commands: &self.commands,
        }
    }

    /// Digest of the recipe alone: keys the expensive stage (rootfs, kernel, modules).
    pub fn stage_digest(&self) -> String {
        digest::sha256_hex(&digest::canonical_json(&self.description()))
    }

    /// Digest of the recipe plus the agent binary's SHA-256: keys the finished image.
    pub fn recipe_digest(&self, agent_sha256: &str) -> String {
        #[derive(Serialize)]
        struct Full<'a> {
            recipe: RecipeDescription<'a>,
            agent_sha256: &'a str,
        }
        digest::sha256_hex(&digest::canonical_json(&Full {
            recipe: self.description(),
            agent_sha256,
        }))
    }
}

/// Reads one file a recipe copies in (from the host, the path relative to the recipe file's
/// directory, or from [`BUILTIN_FILES`] for a built-in recipe).
fn read_copied(source: FileSource<'_>, spec: &FileSpec) -> Result<CopiedFile, String> {
    if image_path(&spec.dest).is_none() {
        return Err(format!(
            "file dest {:?} is not an absolute, normal path",
            spec.dest
        ));
    }
    if spec.mode & !0o7777 != 0 || spec.mode & 0o6000 != 0 {
        return Err(format!(
            "file {:?}: mode {:o} (permission bits only; no set-id bits)",
            spec.dest, spec.mode
        ));
    }
    let content = match source {
        FileSource::Builtin => BUILTIN_FILES
            .iter()
            .find(|(name, _)| *name == spec.source)
            .map(|(_, c)| c.to_vec())
            .ok_or_else(|| format!("{:?} is not a built-in recipe file", spec.source))?,
        FileSource::Dir(dir) => read_host_file(&dir.join(&spec.source))?,
    };
    Ok(CopiedFile {
        dest: spec.dest.clone(),
        mode: spec.mode,
        uid: spec.uid,
        gid: spec.gid,
        sha256: digest::sha256_hex(&content),
        size: content.len() as u64,
        content: std::sync::Arc::new(content),
    })
}

/// A file a recipe file copies in, read from the host: a regular file of at most
/// [`MAX_COPY_FILE`] bytes.
fn read_host_file(src: &Path) -> Result<Vec<u8>, String> {
    let meta = std::fs::metadata(src).map_err(|e| format!("{}: {e}", src.display()))?;
    if !meta.is_file() || meta.len() > MAX_COPY_FILE {
        return Err(format!(
            "{}: not a regular file of at most {MAX_COPY_FILE} bytes",
            src.display()
        ));
    }
    let content = std::fs::read(src).map_err(|e| format!("{}: {e}", src.display()))?;
    if content.len() as u64 > MAX_COPY_FILE {
        return Err(format!(
            "{}: grew past {MAX_COPY_FILE} bytes",
            src.display()
        ));
    }
    Ok(content)
}

impl fmt::Display for Recipe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The digests the built-in recipes had as Rust constants (and so the cached test
    /// images): computed independently (Python's json with sorted keys) from those constants;
    /// `agents` since then with the browser block.
    #[test]
    fn test_builtin_recipe_digests_unchanged() {
        for (name, want) in [
            (
                "minimal",
                "6300547dc9ac785d452544905c867df873485ec1e7c32c621d7df874fe4bb7f7",
            ),
            (
                "dev",
                "38364b9e7eaf3049a156623636c799c70a6e9335b23e8d77e2728502b3c32118",
            ),
            // With the browser block (issue 20): its packages, npm package and files, the
            // files' digests and sizes computed apart from the crate (Python's hashlib).
            (
                "agents",
                "f82c0adf91082e2a4a96dfdb74ad3dbe65a7f3b0402eb66ff71565fa3a64fca0",
            ),
        ] {
            assert_eq!(
                Recipe::builtin(name).expect(name).stage_digest(),
                want,
                "{name}"
            );
        }
    }

    #[test]
    fn test_recipe_digest_agent_changes_digest() {
        let m = Recipe::builtin("minimal").expect("minimal");
        let a = m.recipe_digest(&"a".repeat(64));
        let b = m.recipe_digest(&"b".repeat(64));
        assert_ne!(a, b);
        assert_eq!(a, m.recipe_digest(&"a".repeat(64)));
        let dev = Recipe::builtin("dev").expect("dev");
        assert_ne!(m.stage_digest(), dev.stage_digest());
        assert!(matches!(
            Recipe::builtin("bogus"),
            Err(ImageError::UnknownRecipe(_))
        ));
    }

    #[test]
    fn test_description_agent_clis_only_in_agents_recipe() {
        let dev = Recipe::builtin("dev").expect("dev");
        let text = String::from_utf8(digest::canonical_json(&dev.description())).expect("utf-8");
        assert!(!text.contains("agent_clis"), "{text}");
        let agents = Recipe::builtin("agents").expect("agents");
        let text = String::from_utf8(digest::canonical_json(&agents.description())).expect("utf-8");
        // The three agent CLIs and the browser block's DevTools MCP server.
        assert_eq!(agents.agent_clis().len(), 4);
        for cli in agents.agent_clis() {
            assert!(text.contains(&cli.integrity), "{text}");
        }
        // dev's packages, then the browser block's.
        assert_eq!(
            agents.packages(),
            [
                dev.packages(),
                &["chromium-headless-shell".into(), "gh".into()]
            ]
            .concat()
        );
    }

    fn write_recipe(dir: &Path, text: &str) -> std::path::PathBuf {
        let p = dir.join("r.toml");
        std::fs::write(&p, text).expect("write");
        p
    }

    #[test]
    fn test_recipe_file_file_content_in_digest_path_not() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("a.conf"), "one").expect("write");
        std::fs::write(dir.path().join("b.conf"), "one").expect("write");
        let text = |src: &str| {
            format!(
                "name = \"mine\"\nbase = \"minimal\"\npackages = [\"tree\"]\n\
                 commands = [\"echo hi > /etc/hi\"]\n\
                 [[files]]\nsource = \"{src}\"\ndest = \"/etc/x.conf\"\nmode = 0o600\n"
            )
        };
        let a = Recipe::from_file(&write_recipe(dir.path(), &text("a.conf"))).expect("a");
        let b = Recipe::from_file(&write_recipe(dir.path(), &text("b.conf"))).expect("b");
        assert_eq!(a.stage_digest(), b.stage_digest(), "path is not hashed");
        assert_eq!(a.packages(), ["tree"]);
        assert_eq!(a.rootfs_size(), 2 << 30);
        std::fs::write(dir.path().join("b.conf"), "two").expect("write");
        let c = Recipe::from_file(&write_recipe(dir.path(), &text("b.conf"))).expect("c");
        assert_ne!(a.stage_digest(), c.stage_digest(), "content is hashed");
        assert_eq!(c.files()[0].content.as_slice(), b"two");
        assert_eq!(c.files()[0].mode, 0o600);
    }

    #[test]
    fn test_recipe_file_strict_parsing_refuses() {
        let dir = tempfile::tempdir().expect("tempdir");
        for (bad, why) in [
            ("name = \"x1\"\nbase = \"dev\"\nbogus = 1\n", "unknown"),
            ("name = \"x1\"\nbase = \"dev\"\n[[files]]\nsource = \"a\"\ndest = \"/a\"\nextra = 1\n", "unknown"),
            ("name = \"dev\"\nbase = \"dev\"\n", "reserved"),
            ("name = \"oci\"\nbase = \"dev\"\n", "reserved"),
            ("name = \"beef\"\nbase = \"dev\"\n", "name"),
            ("name = \"Mine\"\nbase = \"dev\"\n", "name"),
            ("name = \"x1\"\nbase = \"ubuntu\"\n", "base"),
            ("name = \"x1\"\n", "disk_size_mib"),
            ("name = \"x1\"\nbase = \"dev\"\npackages = [\"-oAPT::x\"]\n", "package"),
            ("name = \"x1\"\nbase = \"dev\"\npackages = [\"git\"]\n", "twice"),
            ("name = \"x1\"\nbase = \"dev\"\ndisk_size_mib = 1\n", "disk_size_mib"),
            ("name = \"x1\"\nbase = \"dev\"\ncommands = [\"\"]\n", "command"),
            ("name = \"x1\"\nbase = \"dev\"\n[[links]]\npath = \"/a/../b\"\ntarget = \"/c\"\n", "link"),
            ("name = \"x1\"\nbase = \"dev\"\n[[files]]\nsource = \"nope\"\ndest = \"/a\"\n", "nope"),
            ("name = \"x1\"\nbase = \"dev\"\n[[files]]\nsource = \"r.toml\"\ndest = \"a\"\n", "dest"),
            ("name = \"x1\"\nbase = \"dev\"\n[[files]]\nsource = \"r.toml\"\ndest = \"/a\"\nmode = 0o4755\n", "set-id"),
            ("name = \"x1\"\nbase = \"dev\"\n[[python]]\nname = \"x\"\nversion = \"1\"\nsha256 = \"00\"\n", "sha256"),
        ] {
            let err = Recipe::from_file(&write_recipe(dir.path(), bad))
                .expect_err(bad)
                .to_string();
            assert!(err.contains(why), "{bad}: {err}");
        }
    }

    #[test]
    fn test_image_path_normal_absolute_only() {
        assert_eq!(image_path("/etc/x"), Some("etc/x"));
        for bad in ["etc/x", "/", "/a/../b", "/a/./b", "/a//b", "/a/", "/a\0b"] {
            assert_eq!(image_path(bad), None, "{bad}");
        }
    }

    #[test]
    fn test_valid_package_refuses_options_and_junk() {
        for ok in ["git", "g++", "libc6=2.41-1", "python3.13"] {
            assert!(valid_package(ok), "{ok}");
        }
        for bad in ["-o", "Git", "a", "git=", "x y", "git=1;rm"] {
            assert!(!valid_package(bad), "{bad}");
        }
    }
}
