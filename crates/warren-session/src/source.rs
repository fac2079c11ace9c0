//! The source repository, checked before Warren reads, copies, mounts or writes anything of it.
//!
//! A source repository is handed to Warren by whoever creates the session, and may be hostile:
//! its `.git` may be a symlink or a `gitdir:` file naming another repository, a `commondir`
//! may lead into one, `objects` may be a symlink to `/` (which the guest would then get
//! mounted), `info/exclude` a symlink to a host secret (which would be copied into the guest's
//! copy), its config may include files from elsewhere or move the working tree. So the
//! repository is found by Warren itself, not by git's discovery, and everything is opened
//! beneath its canonical git directory with [`crate::beneath`] (no symlink, no mount
//! crossing, regular files only), as the session's owner:
//!
//! - the repository is the nearest directory at or above the named one holding `.git` (the
//!   same search git makes, stopping at a file system boundary). `.git` must be a real
//!   directory, or a `gitdir:` file of a **linked worktree registered by its repository**:
//!   the file names `<common>/worktrees/<id>`, that directory's `commondir` leads back to
//!   `<common>` and its `gitdir` names this `.git` file. A symlinked `.git`, a separate git
//!   directory, a submodule checkout or a `gitdir:` file into any other repository is
//!   refused;
//! - the common git directory has no `commondir`, its `objects` is a real directory whose
//!   entries (and those of `objects/pack` and `objects/info`) are no symlinks, it borrows no
//!   objects (`objects/info/alternates` and `objects/info/http-alternates`: refused with
//!   [`SessionError::SourceHasAlternates`]), and `HEAD`, `config`, `config.worktree`,
//!   `index`, `packed-refs`, `shallow` and `info/exclude` are regular files where present;
//!   `refs`, `logs`, `worktrees` and `reftable` hold no symlink at any depth;
//! - its config (`config`, and `config.worktree` of the common and the worktree's git
//!   directory) is parsed as data (`git config --file=- --no-includes`) and refused when it
//!   includes other files (`include.path`, `includeIf.*.path`) or moves the working tree
//!   (`core.worktree`);
//! - then git's own discovery, run once from the working tree (or the git directory), must
//!   find the same three directories; git refuses a repository the owner does not own on its
//!   own there. Every later git command names the git directory explicitly.
//!
//! Anything refused is [`SessionError::UnsafeSource`], before anything is created, mounted
//! or written. `status` and `export` run the same checks on the recorded common git
//! directory each time, before host git reads or writes it.

use std::os::fd::AsFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use crate::beneath::{Kind, Side, Tree};
use crate::copy::as_owner;
use crate::git::{Git, Repo};
use crate::SessionError;

/// Largest `gitdir:` file, `commondir`, `gitdir` back-link or alternates file read.
const MAX_POINTER: u64 = 64 << 10;
/// Largest config file read.
const MAX_CONFIG: u64 = 4 << 20;
/// Most entries walked under `refs`, `logs`, `worktrees` and `reftable` together.
const MAX_ENTRIES: usize = 1_000_000;
/// Deepest directory walked there.
const MAX_DEPTH: usize = 64;

/// Regular files of a git directory that Warren or host git read or write, checked where
/// present.
const FILES: &[&str] = &[
    "HEAD",
    "config",
    "config.worktree",
    "index",
    "packed-refs",
    "shallow",
    "commondir",
    "gitdir",
    "info/exclude",
];
/// Directories walked whole: no symlink anywhere beneath them.
const WALKED: &[&str] = &["refs", "logs", "worktrees", "reftable"];

/// A checked source repository.
#[derive(Debug)]
pub(crate) struct Repository {
    /// The canonical top of the working tree; `None` when opened from a git directory.
    pub toplevel: Option<PathBuf>,
    /// The working tree's own git directory (the common one for the main worktree).
    pub git_dir: Tree,
    /// The canonical common git directory.
    pub common: Tree,
    /// The object directory, open.
    pub objects: Tree,
    /// (device, inode) of the object directory.
    pub objects_identity: (u64, u64),
    /// The repository's config entries (`config`, then the worktree's `config.worktree`
    /// when `extensions.worktreeConfig` is on), keys as `git config --list` spells them.
    pub config: Vec<(String, String)>,
}

impl Repository {
    pub(crate) fn common_dir(&self) -> &Path {
        self.common.path()
    }

    pub(crate) fn objects_dir(&self) -> &Path {
        self.objects.path()
    }

    /// The last value of `key` in the repository's own config.
    pub(crate) fn setting(&self, key: &str) -> Option<&str> {
        self.config
            .iter()
            .rev()
            .find(|(k, _)| k.eq_ignore_ascii_case(key))
            .map(|(_, v)| v.as_str())
    }
}

fn refuse(path: &Path, reason: impl Into<String>) -> SessionError {
    Side::Source.refuse(path, reason)
}

/// The repository whose working tree contains the directory `source` (for `prepare`): a
/// bare repository or a git directory is [`SessionError::BareRepository`], no repository
/// [`SessionError::NotARepository`].
pub(crate) fn open_worktree(git: &Git, source: &Path) -> Result<Repository, SessionError> {
    let opened = as_owner(git.run_as(), || match discover(source)? {
        Found::GitDir(_) => Err(SessionError::BareRepository(source.to_path_buf())),
        Found::WorkTree { top, gitfile } => open_fs(Some(top), gitfile, None),
    })?;
    finish(git, opened)
}

/// The repository at `path`, a working tree (or a directory in one) or a git directory (for
/// `export`, which is given either).
pub(crate) fn open_any(git: &Git, path: &Path) -> Result<Repository, SessionError> {
    let opened = as_owner(git.run_as(), || match discover(path)? {
        Found::GitDir(dir) => open_fs(None, false, Some(dir)),
        Found::WorkTree { top, gitfile } => open_fs(Some(top), gitfile, None),
    })?;
    finish(git, opened)
}

/// The common git directory a session recorded (canonical then), checked again.
pub(crate) fn open_common(git: &Git, common_dir: &Path) -> Result<Repository, SessionError> {
    let opened = as_owner(git.run_as(), || {
        if common_dir.canonicalize().ok().as_deref() != Some(common_dir) {
            return Err(refuse(
                common_dir,
                "the source's git directory is gone or now leads elsewhere",
            ));
        }
        let common = Tree::open(common_dir, Side::Source)?;
        if common.file("commondir")?.is_some() {
            return Err(common.refuse("commondir", "leads to another repository's git directory"));
        }
        let git_dir = Tree::open(common_dir, Side::Source)?;
        open_checked(None, git_dir, common)
    })?;
    finish(git, opened)
}

/// Where discovery stopped.
enum Found {
    /// `top/.git` exists: a directory, or a file when `gitfile`.
    WorkTree { top: PathBuf, gitfile: bool },
    /// This directory is a git directory itself (a bare repository or inside `.git`).
    GitDir(PathBuf),
}

/// Git's repository search, without following `.git` anywhere: from the canonical `start`
/// upwards, the first directory holding `.git` (or being a git directory), on the same file
/// system.
fn discover(start: &Path) -> Result<Found, SessionError> {
    use std::os::unix::fs::MetadataExt;
    let canonical = start
        .canonicalize()
        .map_err(SessionError::io("resolve", start))?;
    let dev = std::fs::symlink_metadata(&canonical)
        .map_err(SessionError::io("stat", &canonical))?
        .dev();
    let mut dir = canonical.as_path();
    loop {
        let dotgit = dir.join(".git");
        match std::fs::symlink_metadata(&dotgit) {
            Ok(m) if m.file_type().is_symlink() => {
                return Err(refuse(&dotgit, "is a symlink"));
            }
            Ok(m) if m.is_dir() => {
                if is_git_directory(&dotgit) {
                    return Ok(Found::WorkTree {
                        top: dir.to_path_buf(),
                        gitfile: false,
                    });
                }
                // Git skips a `.git` directory that is no repository, and so do we.
            }
            Ok(m) if m.is_file() => {
                return Ok(Found::WorkTree {
                    top: dir.to_path_buf(),
                    gitfile: true,
                });
            }
            Ok(_) => return Err(refuse(&dotgit, "is neither a directory nor a gitdir: file")),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(SessionError::io("stat", &dotgit)(e)),
        }
        if is_git_directory(dir) {
            return Ok(Found::GitDir(dir.to_path_buf()));
        }
        let Some(parent) = dir.parent() else { break };
        match std::fs::symlink_metadata(parent) {
            Ok(m) if m.dev() == dev => dir = parent,
            _ => break,
        }
    }
    Err(SessionError::NotARepository(start.to_path_buf()))
}

/// What git takes for a git directory: `HEAD`, and `objects` and `refs` (or a `commondir`).
fn is_git_directory(dir: &Path) -> bool {
    let has = |n: &str| std::fs::symlink_metadata(dir.join(n)).is_ok();
    has("HEAD") && (has("commondir") || (has("objects") && has("refs")))
}

/// The file-system half of opening: the directories, checked; no git run yet.
struct Opened {
    repo: Repository,
    /// The common `config`.
    config: Vec<u8>,
    /// The worktree's `config.worktree` (the common one's for the main worktree).
    worktree_config: Option<Vec<u8>>,
}

fn open_fs(
    toplevel: Option<PathBuf>,
    gitfile: bool,
    git_dir: Option<PathBuf>,
) -> Result<Opened, SessionError> {
    let (git_dir, common) = match (&toplevel, git_dir) {
        (Some(top), _) if gitfile => linked_worktree(top)?,
        (Some(top), _) => {
            // A real directory (discovery checked) under a canonical path: canonical.
            let dir = top.join(".git");
            let common = Tree::open(&dir, Side::Source)?;
            if common.file("commondir")?.is_some() {
                return Err(
                    common.refuse("commondir", "leads to another repository's git directory")
                );
            }
            (Tree::open(&dir, Side::Source)?, common)
        }
        (None, Some(dir)) => {
            let tree = Tree::open(&dir, Side::Source)?;
            if tree.file("commondir")?.is_some() {
                // A linked worktree's own git directory: its repository is the common one.
                let common = linked_common(&tree)?;
                (tree, common)
            } else {
                (Tree::open(&dir, Side::Source)?, tree)
            }
        }
        (None, None) => unreachable!("invariant: a working tree or a git directory"),
    };
    open_checked(toplevel, git_dir, common)
}

/// Checks the common git directory and reads the config files, as data.
fn open_checked(
    toplevel: Option<PathBuf>,
    git_dir: Tree,
    common: Tree,
) -> Result<Opened, SessionError> {
    let objects = check_common(&common)?;
    let st = nix::sys::stat::fstat(objects.fd().as_fd())
        .map_err(|e| SessionError::io("stat", objects.path())(e.into()))?;
    let objects_identity = (st.st_dev as u64, st.st_ino as u64);
    for f in FILES {
        git_dir.file(f)?;
    }
    let config = common.read("config", MAX_CONFIG)?.unwrap_or_default();
    let worktree_config = git_dir.read("config.worktree", MAX_CONFIG)?;
    Ok(Opened {
        repo: Repository {
            toplevel,
            git_dir,
            common,
            objects,
            objects_identity,
            config: Vec::new(),
        },
        config,
        worktree_config,
    })
}

/// `top/.git` is a `gitdir:` file: it must be a linked worktree its repository registered.
/// Returns the worktree's git directory and the common one.
fn linked_worktree(top: &Path) -> Result<(Tree, Tree), SessionError> {
    let dotgit = top.join(".git");
    let gitfile = pointer_file(&dotgit)?;
    let named = gitfile
        .strip_prefix("gitdir: ")
        .ok_or_else(|| refuse(&dotgit, "is a file but not a gitdir: file"))?;
    let named = top.join(named);
    let not_linked = |why: &str| {
        refuse(
            &dotgit,
            format!(
                "is a gitdir: file naming {}, which {why}; only a linked worktree registered \
                 by its repository is accepted (not a separate git directory, a submodule \
                 checkout or another repository)",
                named.display()
            ),
        )
    };
    let g = named
        .canonicalize()
        .map_err(|_| not_linked("does not exist"))?;
    let (Some(id), Some(worktrees)) = (g.file_name(), g.parent()) else {
        return Err(not_linked("is not <repository>/worktrees/<id>"));
    };
    if worktrees.file_name().map(|n| n.as_bytes()) != Some(b"worktrees") {
        return Err(not_linked("is not <repository>/worktrees/<id>"));
    }
    let Some(common_path) = worktrees.parent() else {
        return Err(not_linked("is not <repository>/worktrees/<id>"));
    };
    let common = Tree::open(common_path, Side::Source)?;
    let git_dir = Tree::open_at(
        common.fd(),
        common.path(),
        &Path::new("worktrees").join(id),
        Side::Source,
    )?;
    if linked_common(&git_dir)?.path() != common.path() {
        return Err(not_linked("belongs to another repository (its commondir)"));
    }
    // The repository's record of where this worktree is: git writes it on `worktree add`.
    let back = git_dir
        .read("gitdir", MAX_POINTER)?
        .ok_or_else(|| not_linked("has no gitdir record"))?;
    let back = git_dir.path().join(trimmed(&back));
    if back.canonicalize().ok().as_deref() != Some(dotgit.as_path()) {
        return Err(not_linked(&format!(
            "registers another working tree ({})",
            back.display()
        )));
    }
    if common.file("commondir")?.is_some() {
        return Err(common.refuse("commondir", "leads to another repository's git directory"));
    }
    Ok((git_dir, common))
}

/// The common git directory a worktree's git directory `tree` (`<common>/worktrees/<id>`)
/// names in its `commondir`: it must be that `<common>`, canonical.
fn linked_common(tree: &Tree) -> Result<Tree, SessionError> {
    let content = tree
        .read("commondir", MAX_POINTER)?
        .ok_or_else(|| tree.refuse("commondir", "is missing"))?;
    let named = tree.path().join(trimmed(&content));
    let parent = tree.path().parent().and_then(Path::parent);
    let canonical = named.canonicalize().ok();
    if canonical.is_none()
        || canonical.as_deref() != parent
        || tree
            .path()
            .parent()
            .and_then(Path::file_name)
            .map(|n| n.as_bytes())
            != Some(b"worktrees")
    {
        return Err(tree.refuse(
            "commondir",
            format!(
                "leads to {}, not to the repository holding this worktree",
                named.display()
            ),
        ));
    }
    let common = Tree::open(parent.expect("invariant: checked above"), Side::Source)?;
    Tree::open_at(
        common.fd(),
        common.path(),
        tree.path()
            .strip_prefix(common.path())
            .expect("invariant: beneath its common directory"),
        Side::Source,
    )?;
    Ok(common)
}

/// A small file read without following a link (a `.git` file is not beneath any directory
/// Warren holds open: its parent is the canonical working tree).
fn pointer_file(path: &Path) -> Result<String, SessionError> {
    let parent = path.parent().expect("invariant: a .git path has a parent");
    let dir = Tree::open(parent, Side::Source)?;
    let bytes = dir
        .read(path.file_name().expect("invariant: named"), MAX_POINTER)?
        .ok_or_else(|| refuse(path, "vanished"))?;
    Ok(trimmed(&bytes).to_string())
}

fn trimmed(bytes: &[u8]) -> &str {
    // Git strips trailing newlines and carriage returns.
    std::str::from_utf8(bytes)
        .unwrap_or("\u{fffd}")
        .trim_end_matches(['\n', '\r'])
}

/// The checks on the common git directory (module docs); returns its object directory.
fn check_common(common: &Tree) -> Result<Tree, SessionError> {
    let objects = common
        .subtree("objects")?
        .ok_or_else(|| common.refuse("objects", "is missing"))?;
    for (name, kind) in objects.entries()? {
        let rel = Path::new(std::ffi::OsStr::from_bytes(&name));
        if kind == Kind::Symlink {
            return Err(objects.refuse(rel, "is a symlink"));
        }
        if (name == b"pack" || name == b"info") && kind == Kind::Dir {
            let sub = objects
                .subtree(rel)?
                .expect("invariant: listed a moment ago");
            for (n, k) in sub.entries()? {
                if k == Kind::Symlink {
                    return Err(sub.refuse(std::ffi::OsStr::from_bytes(&n), "is a symlink"));
                }
            }
        }
    }
    for name in ["info/alternates", "info/http-alternates"] {
        if let Some(content) = objects.read(name, MAX_POINTER)? {
            if content
                .split(|b| *b == b'\n')
                .any(|l| !l.is_empty() && !l.starts_with(b"#"))
            {
                return Err(SessionError::SourceHasAlternates(
                    objects.path().to_path_buf(),
                ));
            }
        }
    }
    common.subtree("info")?;
    for f in FILES {
        common.file(f)?;
    }
    let mut budget = 0usize;
    for top in WALKED {
        let Some(tree) = common.subtree(top)? else {
            continue;
        };
        walk(tree, 0, &mut budget)?;
    }
    Ok(objects)
}

/// Refuses any symlink beneath `tree`.
fn walk(tree: Tree, depth: usize, budget: &mut usize) -> Result<(), SessionError> {
    if depth > MAX_DEPTH {
        return Err(tree.refuse("", "nests too deep"));
    }
    for (name, kind) in tree.entries()? {
        *budget += 1;
        if *budget > MAX_ENTRIES {
            return Err(SessionError::TooLarge {
                what: format!("the refs and logs under {}", tree.path().display()),
                limit: format!("{MAX_ENTRIES} entries"),
            });
        }
        let rel = std::ffi::OsStr::from_bytes(&name);
        match kind {
            Kind::Symlink => return Err(tree.refuse(rel, "is a symlink")),
            Kind::Dir => {
                let sub = tree.subtree(rel)?.expect("invariant: listed a moment ago");
                walk(sub, depth + 1, budget)?;
            }
            Kind::Other => {}
        }
    }
    Ok(())
}

/// The git half: config parsed as data and checked, then git's own discovery compared.
fn finish(git: &Git, opened: Opened) -> Result<Repository, SessionError> {
    let Opened {
        mut repo,
        config,
        worktree_config,
    } = opened;
    let mut entries = parse_config(git, &config, &repo.common.path().join("config"))?;
    // Checked whatever the extension says; used only when it is on, as git does.
    if let Some(bytes) = &worktree_config {
        let per = parse_config(git, bytes, &repo.git_dir.path().join("config.worktree"))?;
        let on = entries
            .iter()
            .rev()
            .find(|(k, _)| k == "extensions.worktreeconfig")
            .is_some_and(|(_, v)| {
                matches!(v.to_ascii_lowercase().as_str(), "true" | "yes" | "on" | "1")
            });
        if on {
            entries.extend(per);
        }
    }
    repo.config = entries;
    same_as_git(git, &repo)?;
    Ok(repo)
}

/// Parses a config file's bytes (`git config --file=- --no-includes --list -z`: git opens no
/// file) and refuses what leads outside the repository.
fn parse_config(
    git: &Git,
    bytes: &[u8],
    path: &Path,
) -> Result<Vec<(String, String)>, SessionError> {
    let listed = git.run_with(
        Repo::None,
        &["config", "--file=-", "--no-includes", "--list", "-z"],
        Some(bytes),
    )?;
    let mut out = Vec::new();
    for rec in listed.split(|b| *b == 0).filter(|r| !r.is_empty()) {
        let rec = String::from_utf8_lossy(rec);
        let (key, value) = rec.split_once('\n').unwrap_or((&rec, ""));
        let lower = key.to_ascii_lowercase();
        let include = (lower.starts_with("include.") || lower.starts_with("includeif."))
            && lower.ends_with(".path");
        if include {
            return Err(refuse(
                path,
                format!(
                    "{key} includes another config file ({value}); Warren does not follow includes"
                ),
            ));
        }
        if lower == "core.worktree" {
            return Err(refuse(
                path,
                format!("core.worktree moves the working tree elsewhere ({value})"),
            ));
        }
        out.push((key.to_string(), value.to_string()));
    }
    Ok(out)
}

/// Runs git's discovery once (which also refuses a repository the owner does not own) and
/// requires it to find what Warren found.
fn same_as_git(git: &Git, repo: &Repository) -> Result<(), SessionError> {
    let (from, args): (&Path, &[&str]) = match &repo.toplevel {
        Some(top) => (
            top,
            &[
                "rev-parse",
                "--path-format=absolute",
                "--show-toplevel",
                "--absolute-git-dir",
                "--git-common-dir",
            ],
        ),
        None => (
            repo.git_dir.path(),
            &[
                "rev-parse",
                "--path-format=absolute",
                "--absolute-git-dir",
                "--git-common-dir",
            ],
        ),
    };
    let out = git.line(Repo::At(from), args)?;
    let found: Vec<Option<PathBuf>> = out
        .lines()
        .map(|l| Path::new(l).canonicalize().ok())
        .collect();
    let mut want: Vec<Option<PathBuf>> = Vec::new();
    if let Some(top) = &repo.toplevel {
        want.push(Some(top.clone()));
    }
    want.push(Some(repo.git_dir.path().to_path_buf()));
    want.push(Some(repo.common.path().to_path_buf()));
    if found != want {
        return Err(refuse(
            from,
            format!(
                "git resolves this repository differently ({})",
                out.replace('\n', ", ")
            ),
        ));
    }
    Ok(())
}
