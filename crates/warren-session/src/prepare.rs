//! Preparing a session: the session-owned copy of a source checkout.
//!
//! Steps, in order:
//! 1. Resolve the source and check it (`source`: nothing in it may lead outside it), then
//!    read its object format, HEAD, branches and tags (read-only git commands over the checked
//!    git directory, named explicitly).
//! 2. Create `S` (0711) and `S/workspace` (the owner's), and link
//!    `S/.warren-source-objects` to the source's object directory.
//! 3. `git init --template=` the workspace (no hooks, no sample files), point its
//!    `objects/info/alternates` at the link by a relative path, recreate HEAD, branches and
//!    tags, and set identity and line-ending config read from the source.
//! 4. Copy the source index (staged content; the staged blobs are already in the source
//!    object store) and the working-tree files ([`crate::copy`]), then refresh the index. The
//!    index, its split-index parts and `info/exclude` are read through the descriptors the
//!    check opened, beneath the source's git directory, never through a symlink.
//!
//! A failure after step 2 removes `S` again.

use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use crate::beneath::Tree;
use crate::copy::{as_owner, copy_entries, Entry, SkipReason, Skipped};
use crate::git::{nul_fields, os_path, text, Git, Repo};
use crate::guard::{self, SessionPaths};
use crate::source::{self, Repository};
use crate::{Owner, SessionError, ALTERNATES_ENTRY};

/// The source's HEAD, as the session starts with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Head {
    /// On a branch (`refs/heads/...`); `commit` is `None` while the branch is unborn (a
    /// repository with no commits).
    Branch {
        refname: String,
        commit: Option<String>,
    },
    /// Detached at a commit.
    Detached { commit: String },
}

/// What [`prepare`] made.
#[derive(Debug, Clone)]
pub struct Prepared {
    /// The canonical top of the source working tree (a subdirectory given as source resolves
    /// to it).
    pub source_toplevel: PathBuf,
    /// The source's canonical common git directory (what `export` writes to).
    pub source_git_dir: PathBuf,
    /// The source's canonical object directory: the host directory to mount read-only at
    /// [`crate::GUEST_SOURCE_OBJECTS`].
    pub source_objects: PathBuf,
    /// (device, inode) of `source_objects` as checked: what the mount must still be.
    pub source_objects_identity: (u64, u64),
    pub head: Head,
    /// Regular files copied into the workspace.
    pub files: u64,
    /// Symlinks recreated in the workspace.
    pub symlinks: u64,
    /// Bytes of regular files copied.
    pub bytes: u64,
    /// Paths not copied, with the reason.
    pub skipped: Vec<Skipped>,
}

/// Config copied from the source (local, then the owner's global config) when set.
const COPIED_KEYS: &[&str] = &["user.name", "user.email", "core.autocrlf", "core.eol"];

/// Prepares the session directory `session_dir` (which must not exist; its parent must) as a
/// copy of the git checkout containing `source`. See the crate docs for the layout and
/// `docs/sessions.md` for the fidelity contract.
#[tracing::instrument(skip_all, fields(source = %source.display(), session = %session_dir.display()))]
pub fn prepare(
    source: &Path,
    session_dir: &Path,
    owner: Option<Owner>,
) -> Result<Prepared, SessionError> {
    let git = Git::new(owner)?;
    let src = resolve_source(&git, source)?;
    match std::fs::symlink_metadata(session_dir) {
        Ok(_) => return Err(SessionError::SessionExists(session_dir.to_path_buf())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(SessionError::io("stat", session_dir)(e)),
    }
    std::fs::create_dir(session_dir).map_err(|e| match e.kind() {
        std::io::ErrorKind::AlreadyExists => SessionError::SessionExists(session_dir.to_path_buf()),
        _ => SessionError::io("create directory", session_dir)(e),
    })?;
    let paths = SessionPaths::new(session_dir);
    match build(&git, &src, &paths) {
        Ok(p) => {
            tracing::info!(files = p.files, bytes = p.bytes, "session prepared");
            Ok(p)
        }
        Err(e) => {
            if let Err(cleanup) = crate::remove_tree(session_dir) {
                tracing::warn!(error = %cleanup, "removing the half-made session failed");
            }
            Err(e)
        }
    }
}

/// Direct mode: validates `dir` and returns its canonical path, which the caller mounts
/// itself. No copy, no git requirement.
pub fn direct(dir: &Path) -> Result<PathBuf, SessionError> {
    direct_checked(dir, None).map(|(path, _)| path)
}

/// [`direct`], and the directory's identity (device, inode), read from the directory opened
/// at its canonical path without following any symlink. With `want` (the identity a check of
/// the caller's access found, [`crate::access::check_access`]) another directory is refused
/// ([`SessionError::DirectoryChanged`]): a path swapped since the check is never shared.
pub fn direct_checked(
    dir: &Path,
    want: Option<(u64, u64)>,
) -> Result<(PathBuf, (u64, u64)), SessionError> {
    use nix::fcntl::{OFlag, OpenHow, ResolveFlag};
    use std::os::unix::fs::MetadataExt;
    let canonical = dir
        .canonicalize()
        .map_err(SessionError::io("resolve", dir))?;
    // No O_NOFOLLOW: a symlink swapped in for the last component is refused (ELOOP) like
    // one anywhere else, never opened as the link.
    let how = OpenHow::new()
        .flags(OFlag::O_PATH | OFlag::O_CLOEXEC)
        .resolve(ResolveFlag::RESOLVE_NO_SYMLINKS | ResolveFlag::RESOLVE_NO_MAGICLINKS);
    let fd = match nix::fcntl::openat2(nix::fcntl::AT_FDCWD, &canonical, how) {
        Ok(fd) => fd,
        Err(nix::errno::Errno::ELOOP | nix::errno::Errno::ENOENT) if want.is_some() => {
            return Err(SessionError::DirectoryChanged(dir.to_path_buf()))
        }
        Err(e) => return Err(SessionError::io("open", &canonical)(e.into())),
    };
    let meta = std::fs::File::from(fd)
        .metadata()
        .map_err(SessionError::io("stat", &canonical))?;
    if !meta.is_dir() {
        return Err(SessionError::NotADirectory(dir.to_path_buf()));
    }
    let found = (meta.dev(), meta.ino());
    if want.is_some_and(|w| w != found) {
        return Err(SessionError::DirectoryChanged(dir.to_path_buf()));
    }
    Ok((canonical, found))
}

/// Everything read from the source before anything is created.
struct Source {
    toplevel: PathBuf,
    /// The checked repository, its directories held open.
    repo: Repository,
    object_format: String,
    head: Head,
    /// `(refname, oid)` of branches and tags.
    refs: Vec<(String, String)>,
    entries: Vec<Entry>,
    skipped: Vec<Skipped>,
    config: Vec<(String, String)>,
}

fn resolve_source(git: &Git, source: &Path) -> Result<Source, SessionError> {
    let meta = std::fs::metadata(source).map_err(SessionError::io("stat", source))?;
    if !meta.is_dir() {
        return Err(SessionError::NotADirectory(source.to_path_buf()));
    }
    let repo = source::open_worktree(git, source)?;
    let toplevel = repo
        .toplevel
        .clone()
        .expect("invariant: opened from a working tree");
    let at = Repo::Explicit {
        git_dir: repo.git_dir.path(),
        work_tree: &toplevel,
    };
    let object_format = git.line(at, &["rev-parse", "--show-object-format"])?;
    let head = read_head(git, at)?;
    let refs = git
        .line(
            at,
            &[
                "for-each-ref",
                "--format=%(refname) %(objectname)",
                "refs/heads",
                "refs/tags",
            ],
        )?
        .lines()
        .filter_map(|l| l.split_once(' '))
        .map(|(r, o)| (r.to_string(), o.to_string()))
        .collect();
    let (entries, skipped) = list_entries(git, at)?;
    let mut config = Vec::new();
    for key in COPIED_KEYS {
        if let Some(v) = source_setting(git, &repo, key)? {
            config.push((key.to_string(), v));
        }
    }
    Ok(Source {
        toplevel,
        repo,
        object_format,
        head,
        refs,
        entries,
        skipped,
        config,
    })
}

fn read_head(git: &Git, at: Repo<'_>) -> Result<Head, SessionError> {
    let commit = {
        let out = git.output(at, &["rev-parse", "--verify", "-q", "HEAD^{commit}"], None)?;
        out.status.success().then(|| text(&out.stdout))
    };
    let sym = git.output(at, &["symbolic-ref", "-q", "HEAD"], None)?;
    match (sym.status.code(), commit) {
        (Some(0), commit) => Ok(Head::Branch {
            refname: text(&sym.stdout),
            commit,
        }),
        (Some(1), Some(commit)) => Ok(Head::Detached { commit }),
        _ => Err(SessionError::Git {
            args: "symbolic-ref -q HEAD".into(),
            status: sym.status.to_string(),
            stderr: text(&sym.stderr),
        }),
    }
}

/// Tracked paths (from the index, so staged additions and renames are included) and
/// untracked, non-ignored paths, in that order.
fn list_entries(git: &Git, at: Repo<'_>) -> Result<(Vec<Entry>, Vec<Skipped>), SessionError> {
    let mut entries = Vec::new();
    let mut skipped = Vec::new();
    let staged = git.run(at, &["ls-files", "-z", "--stage"])?;
    let mut last: Option<&[u8]> = None;
    for rec in nul_fields(&staged) {
        // "<mode> <oid> <stage>\t<path>"; an unmerged path appears once per stage.
        let Some(tab) = rec.iter().position(|b| *b == b'\t') else {
            continue;
        };
        let (meta, path) = (&rec[..tab], &rec[tab + 1..]);
        if last == Some(path) {
            continue;
        }
        last = Some(path);
        if !crate::scratch::index_path_ok(path) {
            // Git never writes such a path; a crafted index can name `.git/hooks/...`,
            // which the copy would put in the session's own git directory.
            return Err(SessionError::Io {
                op: "copy unexpected path",
                path: os_path(path),
                source: std::io::Error::from(std::io::ErrorKind::InvalidInput),
            });
        }
        entries.push(Entry {
            path: os_path(path),
            gitlink: meta.starts_with(b"160000 "),
        });
    }
    let others = git.run(at, &["ls-files", "-z", "--others", "--exclude-standard"])?;
    for path in nul_fields(&others) {
        if let Some(dir) = path.strip_suffix(b"/") {
            // git lists an untracked nested repository as "dir/" and never looks inside.
            skipped.push(Skipped {
                path: os_path(dir),
                reason: SkipReason::NestedRepository,
            });
            continue;
        }
        entries.push(Entry {
            path: os_path(path),
            gitlink: false,
        });
    }
    Ok((entries, skipped))
}

/// `key` from the source repository's own config (as checked), else from the owner's global
/// config (`~/.gitconfig`, then `~/.config/git/config`), read as files without includes.
fn source_setting(git: &Git, repo: &Repository, key: &str) -> Result<Option<String>, SessionError> {
    if let Some(v) = repo.setting(key) {
        return Ok(Some(v.to_string()));
    }
    let home = match git.run_as() {
        Some(o) => nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(o.uid))
            .ok()
            .flatten()
            .map(|u| u.dir),
        None => std::env::var_os("HOME").map(PathBuf::from),
    };
    let Some(home) = home else { return Ok(None) };
    for file in [home.join(".gitconfig"), home.join(".config/git/config")] {
        if !file.is_file() {
            continue;
        }
        let mut arg = std::ffi::OsString::from("--file=");
        arg.push(file.as_os_str());
        let out = git.output(
            Repo::None,
            &[
                std::ffi::OsStr::new("config"),
                std::ffi::OsStr::new("--no-includes"),
                &arg,
                std::ffi::OsStr::new("--get"),
                std::ffi::OsStr::new(key),
            ],
            None,
        )?;
        if out.status.success() {
            return Ok(Some(text(&out.stdout)));
        }
    }
    Ok(None)
}

fn build(git: &Git, src: &Source, paths: &SessionPaths) -> Result<Prepared, SessionError> {
    use std::os::unix::fs::PermissionsExt;
    let run_as = git.run_as();
    std::fs::set_permissions(&paths.root, std::fs::Permissions::from_mode(0o711))
        .map_err(SessionError::io("chmod", &paths.root))?;
    std::fs::create_dir(&paths.workspace)
        .map_err(SessionError::io("create directory", &paths.workspace))?;
    if let Some(o) = run_as {
        std::os::unix::fs::chown(&paths.workspace, Some(o.uid), Some(o.gid))
            .map_err(SessionError::io("chown", &paths.workspace))?;
    }
    // As private as its source: other local users can pass the 0711 parents, so a
    // workspace left at 0755 let them read a copy of a project only its owner could.
    let top_mode = std::fs::metadata(&src.toplevel)
        .map_err(SessionError::io("stat", &src.toplevel))?
        .permissions()
        .mode()
        & 0o777;
    std::fs::set_permissions(
        &paths.workspace,
        std::fs::Permissions::from_mode(top_mode | 0o700),
    )
    .map_err(SessionError::io("chmod", &paths.workspace))?;
    std::os::unix::fs::symlink(src.repo.objects_dir(), &paths.link)
        .map_err(SessionError::io("symlink", &paths.link))?;

    let mut init = vec![
        std::ffi::OsString::from("init"),
        "-q".into(),
        "--template=".into(),
    ];
    init.push(format!("--object-format={}", src.object_format).into());
    init.push(paths.workspace.clone().into());
    git.run(Repo::None, &init)?;

    let repo = paths.repo();
    let git_dir = paths.git_dir.clone();
    as_owner(run_as, || {
        let info = git_dir.join("objects/info");
        std::fs::create_dir_all(&info).map_err(SessionError::io("create directory", &info))?;
        let alt = info.join("alternates");
        std::fs::write(&alt, format!("{ALTERNATES_ENTRY}\n"))
            .map_err(SessionError::io("write", &alt))?;
        // The source's own exclude rules keep the session's view of ignored files the same.
        if let Some(rules) = src.repo.common.file("info/exclude")? {
            let dir = git_dir.join("info");
            std::fs::create_dir_all(&dir).map_err(SessionError::io("create directory", &dir))?;
            copy_fd(
                rules,
                &src.repo.common.path().join("info/exclude"),
                &dir.join("exclude"),
            )?;
        }
        Ok(())
    })?;

    if !src.refs.is_empty() {
        let mut batch = Vec::new();
        for (name, oid) in &src.refs {
            batch.extend_from_slice(format!("create {name} {oid}\n").as_bytes());
        }
        git.run_with(repo, &["update-ref", "--stdin"], Some(&batch))?;
    }
    match &src.head {
        Head::Branch { refname, .. } => {
            git.run(repo, &["symbolic-ref", "HEAD", refname])?;
        }
        Head::Detached { commit } => {
            git.run(repo, &["update-ref", "--no-deref", "HEAD", commit])?;
        }
    }
    for (key, value) in &src.config {
        git.run(repo, &["config", key, value])?;
    }

    let (stats, shared) = as_owner(run_as, || {
        let shared = copy_index(&src.repo.git_dir, &paths.git_dir)?;
        let stats = copy_entries(&src.toplevel, &paths.workspace, &src.entries, None)?;
        Ok((stats, shared))
    })?;
    if !shared.is_empty() {
        // A split index refers to its shared part by name; fold it in and drop the copies.
        git.run(repo, &["update-index", "--no-split-index"])?;
        for f in shared {
            if let Err(e) = std::fs::remove_file(&f) {
                tracing::debug!(error = %e, file = %f.display(), "removing a shared index copy");
            }
        }
    }
    // The source index's untracked cache names the source's host path and the host's
    // `uname`, and a file system monitor's token is the host's: neither is for the guest.
    git.run(
        repo,
        &[
            "update-index",
            "-q",
            "--refresh",
            "--no-untracked-cache",
            "--no-fsmonitor",
        ],
    )?;
    guard::check(paths)?;

    let mut skipped = src.skipped.clone();
    skipped.extend(stats.skipped);
    Ok(Prepared {
        source_toplevel: src.toplevel.clone(),
        source_git_dir: src.repo.common_dir().to_path_buf(),
        source_objects: src.repo.objects_dir().to_path_buf(),
        source_objects_identity: src.repo.objects_identity,
        head: src.head.clone(),
        files: stats.files,
        symlinks: stats.symlinks,
        bytes: stats.bytes,
        skipped,
    })
}

/// Copies the source index (if any) and the split-index shared files next to it from the
/// source's (worktree) git directory into the session git directory; returns the shared files
/// copied.
fn copy_index(from: &Tree, git_dir: &Path) -> Result<Vec<PathBuf>, SessionError> {
    let Some(index) = from.file("index")? else {
        return Ok(Vec::new());
    };
    copy_fd(index, &from.path().join("index"), &git_dir.join("index"))?;
    let mut shared = Vec::new();
    for (name, _) in from.entries()? {
        if !name.starts_with(b"sharedindex.") {
            continue;
        }
        let name = std::ffi::OsStr::from_bytes(&name);
        if let Some(fd) = from.file(name)? {
            let to = git_dir.join(name);
            copy_fd(fd, &from.path().join(name), &to)?;
            shared.push(to);
        }
    }
    Ok(shared)
}

/// Copies an open source file to a new file `to` (0644 before the umask).
fn copy_fd(from: OwnedFd, what: &Path, to: &Path) -> Result<(), SessionError> {
    let mut input = std::fs::File::from(from);
    let mut output = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o644)
        .custom_flags(nix::fcntl::OFlag::O_NOFOLLOW.bits())
        .open(to)
        .map_err(SessionError::io("create", to))?;
    std::io::copy(&mut input, &mut output).map_err(SessionError::io("copy", what))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A direct session's directory is the one a check allowed: swapped for a symlink (to a
    /// directory the caller could not have named) or for another directory renamed into its
    /// place after the check, it is refused; moved elsewhere and linked back, it is still
    /// that directory.
    #[test]
    fn test_direct_refuses_a_directory_swapped_after_the_check() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let base = tmp.path().canonicalize().expect("canonical");
        let dir = base.join("project");
        std::fs::create_dir(&dir).expect("mkdir");
        let (path, checked) = direct_checked(&dir, None).expect("direct");
        assert_eq!(path, dir);
        assert_eq!(
            direct_checked(&dir, Some(checked)).expect("same").1,
            checked
        );
        // Swapped for a symlink to another directory (say `/etc`).
        let aside = base.join("aside");
        std::fs::rename(&dir, &aside).expect("rename");
        let other = base.join("other");
        std::fs::create_dir(&other).expect("mkdir");
        std::os::unix::fs::symlink(&other, &dir).expect("symlink");
        let e = direct_checked(&dir, Some(checked)).expect_err("a link to another directory");
        assert!(matches!(e, SessionError::DirectoryChanged(_)), "{e}");
        // Control: unchecked, the link is followed (what the service's check closes).
        assert_eq!(direct_checked(&dir, None).expect("unchecked").0, other);
        // Another directory renamed into its place.
        std::fs::remove_file(&dir).expect("unlink");
        std::fs::rename(&other, &dir).expect("rename");
        let e = direct_checked(&dir, Some(checked)).expect_err("another directory");
        assert!(matches!(e, SessionError::DirectoryChanged(_)), "{e}");
        // The checked directory itself, moved and linked back: still that directory.
        std::fs::remove_dir(&dir).expect("rmdir");
        std::os::unix::fs::symlink(&aside, &dir).expect("symlink");
        let (path, id) = direct_checked(&dir, Some(checked)).expect("the same directory");
        assert_eq!((path, id), (aside, checked));
    }
}
