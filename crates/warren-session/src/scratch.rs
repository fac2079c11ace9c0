//! The host-owned git directory host git reads a session copy through.
//!
//! Everything under `S/workspace/.git` belongs to the guest, so host git never opens it as a
//! repository: git always reads `$GIT_DIR/config` (and from there includes, drivers, hooks
//! paths, fsmonitor and other programs), follows `commondir` and alternates, and recurses into
//! submodules. For each operation, [`Scratch::build`] makes a fresh git directory that Warren
//! owns instead, `S/.warren-hostgit-<random>` (0700, the session owner's): inside the session
//! directory but outside the workspace the guest sees, so whatever it holds is on the
//! session's own file system when the session has a storage limit (`volume.rs`) and counts
//! against that limit, never against the host's temp directory:
//!
//! - `config`: written here (format version, object format from the *source* repository,
//!   nothing that names a program);
//! - `info/attributes`: every conversion and driver attribute unspecified, so in-tree
//!   `.gitattributes` select nothing (this file takes precedence over the tree's);
//! - `HEAD`, `index`, `info/exclude`, `packed-refs` (branches only, filtered line by line as
//!   it is read) and `refs/heads/**`: copies of the session's, each opened beneath the
//!   session git directory without following a symlink or crossing a mount (`openat2`),
//!   non-blocking, regular files only, size-capped, streamed rather than read whole into the
//!   service's memory; HEAD and every ref are checked to be a commit id or a branch;
//! - `objects/`: the session's own loose objects and packs (same rules; the session's
//!   `objects/info` is ignored) as hard links to the very files opened and checked, which
//!   costs neither space nor copying however large the guest made them (a copy, counted
//!   against a budget, only where the kernel refuses the link), and
//!   `objects/info/alternates` naming the source's object directory through the host-owned
//!   `S/.warren-source-objects` link;
//! - the source's `shallow` file, if the source has one.
//!
//! Host git then runs with `--git-dir=<scratch> --work-tree=S/workspace`: the guest's files
//! are data (index, refs, objects, patterns), parsed by git, never configuration or code. What
//! a guest can still do is lie about its own session (a wrong index or refs, or objects it
//! changes while git reads them); it cannot make the host run anything or read outside the
//! session and the source's objects. Git never writes into an existing object or index file
//! (new files are written beside and renamed), so the links never carry a write back.

use std::ffi::OsStr;
use std::fs;
use std::io::{self, BufRead, Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::fcntl::{Flock, FlockArg, OFlag};
use nix::sys::stat::Mode;

use crate::beneath::{self, Kind, Side, Tree};
use crate::copy::{as_owner, as_owner_in_reserve};
use crate::git::{Git, Owner, Repo};
use crate::guard::SessionPaths;
use crate::SessionError;

/// Largest `HEAD`, loose ref or `info/exclude` copied.
const MAX_SMALL_FILE: u64 = 1 << 20;
/// Largest `index` or `packed-refs` copied.
const MAX_INDEX: u64 = 512 << 20;
/// Most bytes of session objects copied per operation (only where a link was refused).
const MAX_OBJECT_BYTES: u64 = 2 << 30;
/// Longest `packed-refs` line kept: longer ones are no branch Warren accepts.
const MAX_PACKED_LINE: u64 = 8 << 10;
/// The scratch directories' name prefix inside the session directory.
const SCRATCH_PREFIX: &str = ".warren-hostgit-";
/// How old an unlocked scratch directory must be before it is taken for a leftover.
const STALE_AFTER: Duration = Duration::from_secs(60);
/// Most files copied per operation (loose objects, packs, refs).
const MAX_FILES: usize = 200_000;
/// Deepest branch name (`refs/heads/a/b/...`).
const MAX_REF_DEPTH: usize = 16;

/// Attributes that could change what git does with a path: unspecified for every path.
const NEUTRAL_ATTRIBUTES: &str =
    "* !text !eol !crlf !filter !diff !merge !ident !working-tree-encoding !binary\n";

/// A scratch git directory; removed on drop.
#[derive(Debug)]
pub(crate) struct Scratch {
    dir: PathBuf,
    work_tree: PathBuf,
    /// Held while the directory is in use: [`sweep_stale`] removes only unlocked ones.
    _lock: Flock<fs::File>,
}

impl Drop for Scratch {
    fn drop(&mut self) {
        // Our own directory, 0700, holding copies of what the guest made: removed without
        // recursion.
        let _ = crate::remove_tree(&self.dir);
    }
}

impl Scratch {
    /// Builds the scratch directory for the session at `paths` (checked by the caller with
    /// [`crate::guard::check`]), acting as `git`'s owner.
    pub(crate) fn build(paths: &SessionPaths, git: &Git) -> Result<Scratch, SessionError> {
        let source_objects = paths.source_objects()?;
        let source_git = source_objects
            .parent()
            .ok_or_else(|| SessionError::NotASession {
                path: paths.root.clone(),
                reason: "the source objects link has no parent directory".into(),
            })?
            .to_path_buf();
        // The source is checked again: it may have changed since the session was made.
        let source = crate::source::open_common(git, &source_git)?;
        if source.objects_dir() != source_objects {
            return Err(SessionError::NotASession {
                path: paths.root.clone(),
                reason: format!(
                    "the source objects link names {}, not an object directory",
                    source_objects.display()
                ),
            });
        }
        let sha256 = git.line(
            Repo::GitDir(&source_git),
            &["rev-parse", "--show-object-format"],
        )? == "sha256";
        // Opened as the owner, copied (streamed) into the scratch directory below.
        let shallow = as_owner(git.run_as(), || source.common.file("shallow"))?;
        let shallow_path = source.common.path().join("shallow");
        let session_git = paths.git_dir.clone();
        let owner = git.run_as();
        // Removed on drop from here on, whatever fails (or panics) below.
        let scratch = as_owner_in_reserve(None, || {
            Scratch::create(&paths.root, owner, paths.workspace.clone())
        })?;
        as_owner_in_reserve(owner, || {
            fill(
                &scratch.dir,
                &session_git,
                &source_objects,
                sha256,
                shallow.map(|fd| (fd, shallow_path.as_path())),
            )
        })
        .map_err(storage_full)?;
        scratch
            .sanitize_index(git, &session_git)
            .map_err(storage_full)?;
        Ok(scratch)
    }

    /// A new 0700 scratch directory for `owner` in the session directory `base`, locked while
    /// this value lives. Made as the service: `S` is host-owned and out of the guest's reach,
    /// so nothing can be planted in the name between the `mkdir` and the `chown`. Leftovers of
    /// a service that died mid-operation go first ([`sweep_stale`]).
    fn create(
        base: &Path,
        owner: Option<Owner>,
        work_tree: PathBuf,
    ) -> Result<Scratch, SessionError> {
        sweep_stale(base);
        for _ in 0..16 {
            let mut nonce = [0u8; 8];
            fs::File::open("/dev/urandom")
                .and_then(|mut f| f.read_exact(&mut nonce))
                .map_err(SessionError::io("read", "/dev/urandom"))?;
            let dir = base.join(format!(
                "{SCRATCH_PREFIX}{}",
                nonce.iter().map(|b| format!("{b:02x}")).collect::<String>()
            ));
            match fs::DirBuilder::new().mode(0o700).create(&dir) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(storage_full(SessionError::io("create", &dir)(e))),
            }
            let lock = open_dir(&dir).and_then(|d| {
                Flock::lock(d, FlockArg::LockExclusiveNonblock).map_err(|(_, e)| io::Error::from(e))
            });
            let lock = match lock {
                Ok(lock) => lock,
                Err(e) => {
                    let _ = fs::remove_dir(&dir);
                    return Err(SessionError::io("lock", &dir)(e));
                }
            };
            let scratch = Scratch {
                dir,
                work_tree,
                _lock: lock,
            };
            if let Some(o) = owner {
                std::os::unix::fs::chown(&scratch.dir, Some(o.uid), Some(o.gid))
                    .map_err(SessionError::io("chown", &scratch.dir))?;
            }
            return Ok(scratch);
        }
        Err(SessionError::io("create", base)(io::Error::from(
            io::ErrorKind::AlreadyExists,
        )))
    }

    /// Checks the copied index before any git reads the working tree through it: every path
    /// must stay inside the working tree (no `..`, `.`, empty or `.git` component, nothing
    /// absolute), and gitlinks are marked skip-worktree, so git never looks into a
    /// submodule's directory (where a `.git` file could name any git directory, the session's
    /// own guest-written one included). Runs git over an empty working tree of our own.
    fn sanitize_index(&self, git: &Git, session_git: &Path) -> Result<(), SessionError> {
        let empty = self.dir.join("empty-work-tree");
        as_owner_in_reserve(git.run_as(), || mkdir(&empty))?;
        // Confined like every git over a session (and so with the volume reserve's group,
        // where `update-index` writes its new index).
        let repo = Repo::Session {
            git_dir: &self.dir,
            work_tree: &empty,
        };
        let listing = git.run(repo, &["ls-files", "--stage", "-z"])?;
        let mut gitlinks = Vec::new();
        for rec in listing.split(|&b| b == 0).filter(|r| !r.is_empty()) {
            // "<mode> <oid> <stage>\t<path>"
            let Some(tab) = rec.iter().position(|&b| b == b'\t') else {
                return Err(unsafe_dir(session_git, "the index cannot be listed"));
            };
            let (meta, path) = (&rec[..tab], &rec[tab + 1..]);
            if !index_path_ok(path) {
                return Err(unsafe_dir(
                    session_git,
                    format!(
                        "the index names {:?}, outside the working tree",
                        String::from_utf8_lossy(path)
                    ),
                ));
            }
            if meta.starts_with(b"160000 ") {
                gitlinks.extend_from_slice(path);
                gitlinks.push(0);
            }
        }
        if !gitlinks.is_empty() {
            git.run_with(
                repo,
                &["update-index", "--skip-worktree", "-z", "--stdin"],
                Some(&gitlinks),
            )?;
        }
        Ok(())
    }

    /// Where host git runs: the scratch git directory over the session's working tree.
    pub(crate) fn repo(&self) -> Repo<'_> {
        Repo::Session {
            git_dir: &self.dir,
            work_tree: &self.work_tree,
        }
    }
}

fn unsafe_dir(path: &Path, reason: impl Into<String>) -> SessionError {
    SessionError::UnsafeGitDir {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

/// Removes the scratch directories in the session directory `base` that no call holds (a
/// service that died during one left them) and that are older than [`STALE_AFTER`] (a new
/// one is locked an instant after it is made). Best effort: a failure leaves them for the
/// next call or the session's deletion.
fn sweep_stale(base: &Path) {
    let Ok(list) = fs::read_dir(base) else {
        return;
    };
    for entry in list.flatten() {
        if !entry
            .file_name()
            .as_bytes()
            .starts_with(SCRATCH_PREFIX.as_bytes())
        {
            continue;
        }
        let path = entry.path();
        let old = fs::symlink_metadata(&path)
            .ok()
            .filter(|m| m.is_dir())
            .is_some_and(|m| {
                m.modified()
                    .ok()
                    .and_then(|t| t.elapsed().ok())
                    .is_some_and(|age| age > STALE_AFTER)
            });
        if !old {
            continue;
        }
        let Ok(dir) = open_dir(&path) else {
            continue;
        };
        if let Ok(_unused) = Flock::lock(dir, FlockArg::LockExclusiveNonblock) {
            let _ = crate::remove_tree(&path);
        }
    }
}

/// The directory at `path` (not through a final symlink), open for locking.
fn open_dir(path: &Path) -> io::Result<fs::File> {
    fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc_nofollow() | OFlag::O_DIRECTORY.bits())
        .open(path)
}

/// A failure for want of room (on a session's own file system: its storage limit) as
/// [`SessionError::StorageFull`].
fn storage_full(e: SessionError) -> SessionError {
    let full = match &e {
        SessionError::Io { source, .. } => matches!(
            source.raw_os_error(),
            Some(c) if c == nix::libc::ENOSPC || c == nix::libc::EDQUOT
        ),
        SessionError::Git { stderr, .. } => {
            stderr.contains("No space left on device") || stderr.contains("Out of diskspace")
        }
        _ => false,
    };
    if full {
        tracing::warn!(error = %e, "no room for host git's scratch directory");
        SessionError::StorageFull
    } else {
        e
    }
}

fn fill(
    dir: &Path,
    session_git: &Path,
    source_objects: &Path,
    sha256: bool,
    shallow: Option<(OwnedFd, &Path)>,
) -> Result<(), SessionError> {
    let git_dir = open_session_git(session_git)?;
    let mut budget = Budget::default();
    for sub in [
        "info",
        "objects",
        "objects/info",
        "objects/pack",
        "refs",
        "refs/heads",
    ] {
        mkdir(&dir.join(sub))?;
    }
    let mut config = String::from("[core]\n\trepositoryformatversion = ");
    config.push_str(if sha256 { "1\n" } else { "0\n" });
    config.push_str("\tbare = false\n\tfilemode = true\n\tsymlinks = true\n");
    config.push_str("\tlogallrefupdates = false\n");
    if sha256 {
        config.push_str("[extensions]\n\tobjectformat = sha256\n");
    }
    create(&dir.join("config"), config.as_bytes())?;
    create(&dir.join("info/attributes"), NEUTRAL_ATTRIBUTES.as_bytes())?;
    let mut alternates = source_objects.as_os_str().as_bytes().to_vec();
    alternates.push(b'\n');
    create(&dir.join("objects/info/alternates"), &alternates)?;
    if let Some((fd, from)) = shallow {
        copy_capped(fd, from, &dir.join("shallow"), MAX_INDEX)?;
    }

    let head = git_dir
        .read("HEAD", MAX_SMALL_FILE)?
        .ok_or_else(|| unsafe_dir(session_git, "HEAD is missing"))?;
    if !valid_ref_value(&head, sha256) {
        return Err(unsafe_dir(
            session_git,
            "HEAD is neither a commit id nor a branch",
        ));
    }
    create(&dir.join("HEAD"), &head)?;
    if let Some(bytes) = git_dir.read("info/exclude", MAX_SMALL_FILE)? {
        create(&dir.join("info/exclude"), &bytes)?;
    }
    // The index is copied, not linked: it is checked (`sanitize_index`) and must stay what
    // was checked.
    if let Some(index) = git_dir.file("index")? {
        copy_capped(
            index,
            &session_git.join("index"),
            &dir.join("index"),
            MAX_INDEX,
        )?;
    }
    if let Some(packed) = git_dir.file("packed-refs")? {
        let from = session_git.join("packed-refs");
        let len = capped_len(&packed, &from, MAX_INDEX)?;
        let mut input = io::BufReader::new(fs::File::from(packed).take(len));
        let mut out = io::BufWriter::new(create_file(&dir.join("packed-refs"))?);
        packed_branches(&mut input, &mut out, sha256)
            .and_then(|()| out.flush())
            .map_err(SessionError::io("copy", &from))?;
    }
    copy_refs(&git_dir, dir, sha256, &mut budget)?;
    copy_objects(&git_dir, dir, &mut budget)
}

/// What one build has copied so far.
#[derive(Default)]
struct Budget {
    files: usize,
    bytes: u64,
}

impl Budget {
    fn take(&mut self, bytes: u64, session_git: &Path) -> Result<(), SessionError> {
        self.files += 1;
        self.bytes += bytes;
        if self.files > MAX_FILES || self.bytes > MAX_OBJECT_BYTES {
            return Err(SessionError::TooLarge {
                what: format!("{}'s objects and refs", session_git.display()),
                limit: format!("{MAX_FILES} files and {} GiB", MAX_OBJECT_BYTES >> 30),
            });
        }
        Ok(())
    }
}

/// `S/workspace/.git` as a directory: a `.git` file, a symlink or anything but a real
/// directory is refused.
fn open_session_git(session_git: &Path) -> Result<Tree, SessionError> {
    let workspace = session_git
        .parent()
        .ok_or_else(|| unsafe_dir(session_git, "no working tree"))?;
    let ws = nix::fcntl::open(
        workspace,
        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC | OFlag::O_NOFOLLOW,
        Mode::empty(),
    )
    .map_err(|e| SessionError::io("open", workspace)(e.into()))?;
    Tree::open_at(&ws, workspace, Path::new(".git"), Side::Session)
        .map_err(|_| unsafe_dir(session_git, ".git is not a directory"))
}

fn copy_refs(
    git_dir: &Tree,
    dir: &Path,
    sha256: bool,
    budget: &mut Budget,
) -> Result<(), SessionError> {
    let session_git = git_dir.path();
    let mut stack = vec![(PathBuf::from("refs/heads"), 0usize)];
    while let Some((rel, depth)) = stack.pop() {
        let Some(fd) = git_dir.dir_fd(&rel)? else {
            continue;
        };
        for (name, kind) in beneath::entries(fd, &session_git.join(&rel))? {
            budget.take(0, session_git)?;
            if !valid_ref_component(&name) {
                // A name git would not accept as a branch: not a branch host git sees.
                continue;
            }
            let child = rel.join(OsStr::from_bytes(&name));
            if kind == Kind::Dir {
                if depth >= MAX_REF_DEPTH {
                    return Err(unsafe_dir(session_git, "branch names nest too deep"));
                }
                mkdir(&dir.join(&child))?;
                stack.push((child, depth + 1));
                continue;
            }
            let Some(value) = git_dir.read(&child, MAX_SMALL_FILE)? else {
                continue;
            };
            budget.take(value.len() as u64, session_git)?;
            if name.ends_with(b".lock") || !valid_ref_value(&value, sha256) {
                continue;
            }
            create(&dir.join(&child), &value)?;
        }
    }
    Ok(())
}

fn copy_objects(git_dir: &Tree, dir: &Path, budget: &mut Budget) -> Result<(), SessionError> {
    let session_git = git_dir.path();
    let objects = Path::new("objects");
    let Some(fd) = git_dir.dir_fd(objects)? else {
        return Ok(());
    };
    for (name, kind) in beneath::entries(fd, &session_git.join(objects))? {
        let loose = name.len() == 2 && name.iter().all(u8::is_ascii_hexdigit);
        if !(loose || name == b"pack") {
            // `info` (alternates, packs lists) and anything unexpected is not used.
            continue;
        }
        if kind != Kind::Dir {
            return Err(unsafe_dir(
                &session_git.join(objects).join(OsStr::from_bytes(&name)),
                "is not a plain directory",
            ));
        }
        let sub = objects.join(OsStr::from_bytes(&name));
        let Some(sub_fd) = git_dir.dir_fd(&sub)? else {
            continue;
        };
        if loose {
            mkdir(&dir.join(&sub))?;
        }
        for (file, _) in beneath::entries(sub_fd, &session_git.join(&sub))? {
            budget.take(0, session_git)?;
            let wanted = if loose {
                file.len() >= 38 && file.iter().all(u8::is_ascii_hexdigit)
            } else {
                file.starts_with(b"pack-")
                    && [&b".pack"[..], b".idx", b".rev"]
                        .iter()
                        .any(|ext| file.ends_with(ext))
                    && file
                        .iter()
                        .all(|b| b.is_ascii_alphanumeric() || b"-.".contains(b))
            };
            if !wanted {
                continue;
            }
            let rel = sub.join(OsStr::from_bytes(&file));
            let Some(src) = git_dir.file(&rel)? else {
                continue;
            };
            place(
                src,
                &dir.join(&rel),
                &session_git.join(&rel),
                budget,
                session_git,
            )?;
        }
    }
    Ok(())
}

/// The size of the open file `fd`, refused (`TooLarge`) past `cap`.
fn capped_len(fd: &OwnedFd, from: &Path, cap: u64) -> Result<u64, SessionError> {
    capped_stat(fd, from, cap).map(|st| st.st_size as u64)
}

/// [`capped_len`], also refused when the file is sparse: git never writes sparse files, and
/// a sparse one (a guest's terabyte of holes) would be copied as real data.
fn checked_len(fd: &OwnedFd, from: &Path, cap: u64) -> Result<u64, SessionError> {
    let st = capped_stat(fd, from, cap)?;
    let len = st.st_size as u64;
    if len > 1 << 20 && (st.st_blocks as u64) * 512 < len / 2 {
        return Err(unsafe_dir(from, "is a sparse file"));
    }
    Ok(len)
}

fn capped_stat(
    fd: &OwnedFd,
    from: &Path,
    cap: u64,
) -> Result<nix::sys::stat::FileStat, SessionError> {
    let st =
        nix::sys::stat::fstat(fd.as_fd()).map_err(|e| SessionError::io("stat", from)(e.into()))?;
    if st.st_size as u64 > cap {
        return Err(SessionError::TooLarge {
            what: from.display().to_string(),
            limit: format!("{cap} bytes"),
        });
    }
    Ok(st)
}

/// Copies `len` bytes of the open file `src` (at `from`) to the new file `to`, streamed: the
/// file may grow while it is copied, and never more than its checked size is copied.
fn copy_len(src: OwnedFd, len: u64, from: &Path, to: &Path) -> Result<(), SessionError> {
    let mut out = create_file(to)?;
    io::copy(&mut fs::File::from(src).take(len), &mut out)
        .map_err(SessionError::io("copy", from))?;
    Ok(())
}

/// Copies the open file `src` (at `from`) to the new file `to`, refused past `cap` bytes or
/// when sparse ([`checked_len`]).
fn copy_capped(src: OwnedFd, from: &Path, to: &Path, cap: u64) -> Result<(), SessionError> {
    let len = checked_len(&src, from, cap)?;
    copy_len(src, len, from, to)
}

/// Puts the object file open as `src` at `to`: a hard link to that very inode (checked a
/// regular file when it was opened beneath the session), or a copy where the kernel refuses
/// the link (a file with the most links a file system allows, one deleted since it was
/// opened); only copies count against the budget's bytes.
fn place(
    src: OwnedFd,
    to: &Path,
    from: &Path,
    budget: &mut Budget,
    session_git: &Path,
) -> Result<(), SessionError> {
    use std::os::fd::AsRawFd;
    // The descriptor's magic link names the opened inode itself, whatever happened to its
    // name since; the process may always follow its own descriptors' links.
    let by_fd = format!("/proc/thread-self/fd/{}", src.as_raw_fd());
    match nix::unistd::linkat(
        nix::fcntl::AT_FDCWD,
        by_fd.as_str(),
        nix::fcntl::AT_FDCWD,
        to,
        nix::fcntl::AtFlags::AT_SYMLINK_FOLLOW,
    ) {
        Ok(()) => return Ok(()),
        Err(e) => tracing::debug!(from = %from.display(), error = %e, "object copied, not linked"),
    }
    let len = checked_len(&src, from, u64::MAX)?;
    budget.take(len, session_git)?;
    copy_len(src, len, from, to)
}

/// A new file of ours (never through a link), 0600.
fn create_file(p: &Path) -> Result<fs::File, SessionError> {
    fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc_nofollow())
        .open(p)
        .map_err(SessionError::io("create", p))
}

fn libc_nofollow() -> i32 {
    OFlag::O_NOFOLLOW.bits()
}

fn mkdir(p: &Path) -> Result<(), SessionError> {
    match fs::DirBuilder::new().mode(0o700).create(p) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(SessionError::io("create", p)(e)),
    }
}

fn create(p: &Path, bytes: &[u8]) -> Result<(), SessionError> {
    create_file(p)?
        .write_all(bytes)
        .map_err(SessionError::io("write", p))
}

/// An index path git itself would accept (`verify_path`): relative, no empty, `.`, `..` or
/// `.git` (any case) component.
pub(crate) fn index_path_ok(p: &[u8]) -> bool {
    !p.is_empty()
        && !p.starts_with(b"/")
        && p.split(|&b| b == b'/')
            .all(|c| !c.is_empty() && c != b"." && c != b".." && !c.eq_ignore_ascii_case(b".git"))
}

fn is_oid(b: &[u8], sha256: bool) -> bool {
    b.len() == if sha256 { 64 } else { 40 }
        && b.iter().all(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f'))
}

/// A `HEAD` or loose ref: a commit id, or `ref: refs/heads/<branch>` (one line).
pub(crate) fn valid_ref_value(v: &[u8], sha256: bool) -> bool {
    let line = v.strip_suffix(b"\n").unwrap_or(v);
    if is_oid(line, sha256) {
        return true;
    }
    line.strip_prefix(b"ref: refs/heads/")
        .is_some_and(|name| !name.is_empty() && name.split(|&b| b == b'/').all(valid_ref_component))
}

/// One component of a branch name, conservatively: what git accepts and nothing that could
/// mean something else to a file system or an argument parser.
pub(crate) fn valid_ref_component(c: &[u8]) -> bool {
    !c.is_empty()
        && c.len() <= 255
        && !c.starts_with(b".")
        && !c.starts_with(b"-")
        && !c.ends_with(b".lock")
        && !c.windows(2).any(|w| w == b"..")
        && c.iter()
            .all(|&b| b.is_ascii_alphanumeric() || b"._-+=,@".contains(&b))
        && !c.windows(2).any(|w| w == b"@{")
}

/// Writes the branch lines of the `packed-refs` file read from `input` (with their peeled
/// lines) to `out`, everything else dropped; read a line at a time, a line longer than
/// [`MAX_PACKED_LINE`] skipped whole.
pub(crate) fn packed_branches(
    input: &mut impl BufRead,
    out: &mut impl Write,
    sha256: bool,
) -> io::Result<()> {
    out.write_all(b"# pack-refs with: peeled sorted \n")?;
    let mut keep_peel = false;
    let mut line = Vec::new();
    loop {
        line.clear();
        let n = (&mut *input)
            .take(MAX_PACKED_LINE)
            .read_until(b'\n', &mut line)?;
        if n == 0 {
            return Ok(());
        }
        if line.last() == Some(&b'\n') {
            line.pop();
        } else if n as u64 == MAX_PACKED_LINE {
            // Too long for any branch: skip the rest of it.
            input.skip_until(b'\n')?;
            keep_peel = false;
            continue;
        }
        if let Some(peeled) = line.strip_prefix(b"^") {
            if keep_peel && is_oid(peeled, sha256) {
                out.write_all(&line)?;
                out.write_all(b"\n")?;
            }
            keep_peel = false;
            continue;
        }
        keep_peel = false;
        let Some(sp) = line.iter().position(|&b| b == b' ') else {
            continue;
        };
        let (oid, name) = (&line[..sp], &line[sp + 1..]);
        let branch = name
            .strip_prefix(b"refs/heads/")
            .is_some_and(|n| !n.is_empty() && n.split(|&b| b == b'/').all(valid_ref_component));
        if is_oid(oid, sha256) && branch {
            out.write_all(&line)?;
            out.write_all(b"\n")?;
            keep_peel = true;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "0123456789abcdef0123456789abcdef01234567";

    #[test]
    fn test_ref_values_are_ids_or_branches() {
        assert!(valid_ref_value(format!("{A}\n").as_bytes(), false));
        assert!(valid_ref_value(b"ref: refs/heads/main\n", false));
        assert!(valid_ref_value(b"ref: refs/heads/feature/x-1\n", false));
        for bad in [
            &b"ref: refs/remotes/x"[..],
            b"ref: refs/heads/../../config",
            b"ref: refs/heads/.hidden",
            b"ref: refs/heads/-x",
            b"ref: refs/heads/",
            b"ref: refs/heads/a b",
            b"0123",
            b"",
        ] {
            assert!(
                !valid_ref_value(bad, false),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
        assert!(!valid_ref_value(format!("{A}\n").as_bytes(), true));
    }

    #[test]
    fn test_index_paths_stay_in_the_work_tree() {
        for good in [
            &b"a.txt"[..],
            b"src/lib.rs",
            b".gitignore",
            b"a/.github/x",
            b"sub",
        ] {
            assert!(index_path_ok(good), "{:?}", String::from_utf8_lossy(good));
        }
        for bad in [
            &b"../outside"[..],
            b"a/../../b",
            b"/etc/hostname",
            b"a//b",
            b"./a",
            b".git/config",
            b"x/.GIT/hooks",
            b"",
            b"a/",
        ] {
            assert!(!index_path_ok(bad), "{:?}", String::from_utf8_lossy(bad));
        }
    }

    fn git_in(dir: &Path, args: &[&str]) {
        let out = std::process::Command::new("git")
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("HOME", "/nonexistent")
            .env("GIT_CONFIG_NOSYSTEM", "1")
            .args(["-c", "user.name=T", "-c", "user.email=t@example.com"])
            .args(["-c", "init.defaultBranch=main", "-c", "safe.directory=*"])
            .arg("-C")
            .arg(dir)
            .args(args)
            .output()
            .expect("git");
        assert!(out.status.success(), "git {args:?}: {out:?}");
    }

    fn scratch_dirs(session: &Path) -> Vec<PathBuf> {
        fs::read_dir(session)
            .expect("list")
            .flatten()
            .filter(|e| {
                e.file_name()
                    .as_bytes()
                    .starts_with(SCRATCH_PREFIX.as_bytes())
            })
            .map(|e| e.path())
            .collect()
    }

    /// The scratch directory is made in the session directory (on the session's own file
    /// system when it has one), links the session's objects rather than copying them, copies
    /// the index it checks, and is gone after use, as are leftovers of a dead service.
    #[test]
    fn test_scratch_links_objects_in_the_session_directory() {
        use std::os::unix::fs::MetadataExt;
        let tmp = tempfile::tempdir().expect("tempdir");
        let src = tmp.path().join("src");
        fs::create_dir(&src).expect("mkdir");
        git_in(&src, &["init", "-q"]);
        fs::write(src.join("a.txt"), "alpha\n").expect("write");
        git_in(&src, &["add", "."]);
        git_in(&src, &["commit", "-qm", "one"]);
        let s = tmp.path().join("s");
        crate::prepare(&src, &s, None).expect("prepare");
        let ws = s.join(crate::WORKSPACE_DIR);
        // A guest commit of a blob, packed by the guest's own gc.
        let blob: Vec<u8> = (0..4u32 << 20)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        fs::write(ws.join("big.bin"), &blob).expect("write");
        git_in(&ws, &["add", "big.bin"]);
        git_in(&ws, &["commit", "-qm", "big"]);
        git_in(&ws, &["gc", "-q"]);
        // A leftover of a service that died mid-operation, two hours old.
        let stale = s.join(format!("{SCRATCH_PREFIX}0011223344556677"));
        fs::create_dir(&stale).expect("mkdir");
        fs::write(stale.join("index"), "x").expect("write");
        let two_hours_ago = std::time::SystemTime::now() - Duration::from_secs(7200);
        fs::File::open(&stale)
            .and_then(|d| d.set_modified(two_hours_ago))
            .expect("age");

        // Another call's, as old but still in use (locked): left alone.
        let busy = s.join(format!("{SCRATCH_PREFIX}8899aabbccddeeff"));
        fs::create_dir(&busy).expect("mkdir");
        fs::File::open(&busy)
            .and_then(|d| d.set_modified(two_hours_ago))
            .expect("age");
        let held = Flock::lock(open_dir(&busy).expect("open"), FlockArg::LockExclusive)
            .map_err(|(_, e)| e)
            .expect("lock");

        let git = Git::new(None).expect("git");
        let paths = SessionPaths::new(&s);
        let scratch = Scratch::build(&paths, &git).expect("build");
        assert!(!stale.exists(), "a stale scratch directory stays");
        assert!(busy.exists(), "a scratch directory in use was removed");
        drop(held);
        fs::remove_dir(&busy).expect("rmdir");
        assert_eq!(scratch_dirs(&s), vec![scratch.dir.clone()]);
        let inode = |p: &Path| {
            let m = fs::metadata(p).expect("stat");
            (m.dev(), m.ino())
        };
        let packs = ws.join(".git/objects/pack");
        let mut linked = 0;
        for e in fs::read_dir(&packs).expect("packs").flatten() {
            let name = e.file_name();
            if name.as_bytes().ends_with(b".pack") {
                let copy = scratch.dir.join("objects/pack").join(&name);
                assert_eq!(inode(&copy), inode(&e.path()), "the pack was copied");
                linked += 1;
            }
        }
        assert!(linked > 0, "the guest's gc made no pack");
        assert_ne!(
            inode(&scratch.dir.join("index")),
            inode(&ws.join(".git/index")),
            "the checked index must be a copy"
        );
        // Host git reads the session through it.
        let out = git
            .run(scratch.repo(), &["cat-file", "-s", "HEAD:big.bin"])
            .expect("cat-file");
        assert_eq!(
            String::from_utf8_lossy(&out).trim(),
            (4u32 << 20).to_string()
        );
        drop(scratch);
        assert!(scratch_dirs(&s).is_empty(), "the scratch directory stays");
        // The session's own files are untouched.
        assert_eq!(fs::read(ws.join("big.bin")).expect("read"), blob);
        git_in(&ws, &["fsck", "--no-progress"]);

        // A sparse index (a few blocks claiming 400 MiB) is refused, not written out in full,
        // and its scratch directory goes with the refusal.
        let index = ws.join(".git/index");
        let f = fs::OpenOptions::new()
            .write(true)
            .open(&index)
            .expect("index");
        f.set_len(400 << 20).expect("grow");
        drop(f);
        let e = Scratch::build(&paths, &git).expect_err("sparse index");
        assert!(e.to_string().contains("sparse"), "{e}");
        assert!(
            scratch_dirs(&s).is_empty(),
            "a refused build left its directory"
        );
    }

    #[test]
    fn test_packed_refs_keep_branches_only() {
        let packed = format!(
            "# pack-refs with: peeled fully-peeled sorted \n{A} refs/heads/main\n^{A}\n\
             {A} refs/tags/v1\n^{A}\n{A} refs/heads/../x\nnot a line\n{A} refs/heads/dev\n"
        );
        let filter = |input: &str| {
            let mut out = Vec::new();
            packed_branches(&mut input.as_bytes(), &mut out, false).expect("filter");
            String::from_utf8(out).expect("utf8")
        };
        let out = filter(&packed);
        assert_eq!(
            out,
            format!(
                "# pack-refs with: peeled sorted \n{A} refs/heads/main\n^{A}\n{A} refs/heads/dev\n"
            )
        );
        // A line longer than any branch is skipped whole, with its peeled line, and the
        // filter goes on after it.
        let long = format!(
            "{A} refs/heads/{}\n^{A}\n{A} refs/heads/dev\n{A} refs/heads/last",
            "a".repeat(MAX_PACKED_LINE as usize * 3)
        );
        assert_eq!(
            filter(&long),
            format!("# pack-refs with: peeled sorted \n{A} refs/heads/dev\n{A} refs/heads/last\n")
        );
    }
}
