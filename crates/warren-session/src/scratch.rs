//! The host-owned git directory host git reads a session copy through.
//!
//! Everything under `S/workspace/.git` belongs to the guest, so host git never opens it as a
//! repository: git always reads `$GIT_DIR/config` (and from there includes, drivers, hooks
//! paths, fsmonitor and other programs), follows `commondir` and alternates, and recurses into
//! submodules. For each operation, [`Scratch::build`] makes a fresh git directory that Warren
//! owns instead, in the system temp directory (0700, the session owner's):
//!
//! - `config`: written here (format version, object format from the *source* repository,
//!   nothing that names a program);
//! - `info/attributes`: every conversion and driver attribute unspecified, so in-tree
//!   `.gitattributes` select nothing (this file takes precedence over the tree's);
//! - `HEAD`, `index`, `info/exclude`, `packed-refs` (branches only) and `refs/heads/**`:
//!   copies of the session's, each opened beneath the session git directory without following
//!   a symlink or crossing a mount (`openat2`), non-blocking, regular files only, size-capped;
//!   HEAD and every ref are checked to be a commit id or a branch;
//! - `objects/`: copies of the session's own loose objects and packs (same rules; the
//!   session's `objects/info` is ignored), and `objects/info/alternates` naming the source's
//!   object directory through the host-owned `S/.warren-source-objects` link;
//! - the source's `shallow` file, if the source has one.
//!
//! Host git then runs with `--git-dir=<scratch> --work-tree=S/workspace`: the guest's files
//! are data (index, refs, objects, patterns), parsed by git, never configuration or code. What
//! a guest can still do is lie about its own session (a wrong index or refs); it cannot make
//! the host run anything or read outside the session and the source's objects.

use std::ffi::OsStr;
use std::fs;
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use nix::fcntl::OFlag;
use nix::sys::stat::Mode;

use crate::beneath::{self, Kind, Side, Tree};
use crate::copy::as_owner;
use crate::git::{Git, Repo};
use crate::guard::SessionPaths;
use crate::SessionError;

/// Largest `HEAD`, loose ref or `info/exclude` copied.
const MAX_SMALL_FILE: u64 = 1 << 20;
/// Largest `index` or `packed-refs` copied.
const MAX_INDEX: u64 = 512 << 20;
/// Most bytes of session objects copied per operation.
const MAX_OBJECT_BYTES: u64 = 2 << 30;
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
        let shallow = as_owner(git.run_as(), || source.common.read("shallow", MAX_INDEX))?;
        let session_git = paths.git_dir.clone();
        let work_tree = paths.workspace.clone();
        let owner = git.run_as();
        let dir = as_owner(owner, || {
            let dir = make_private_dir()?;
            let filled = fill(
                &dir,
                &session_git,
                &source_objects,
                sha256,
                shallow.as_deref(),
            );
            if filled.is_err() {
                let _ = crate::remove_tree(&dir);
            }
            filled.map(|()| dir)
        })?;
        let scratch = Scratch { dir, work_tree };
        scratch.sanitize_index(git, &session_git)?;
        Ok(scratch)
    }

    /// Checks the copied index before any git reads the working tree through it: every path
    /// must stay inside the working tree (no `..`, `.`, empty or `.git` component, nothing
    /// absolute), and gitlinks are marked skip-worktree, so git never looks into a
    /// submodule's directory (where a `.git` file could name any git directory, the session's
    /// own guest-written one included). Runs git over an empty working tree of our own.
    fn sanitize_index(&self, git: &Git, session_git: &Path) -> Result<(), SessionError> {
        let empty = self.dir.join("empty-work-tree");
        as_owner(git.run_as(), || mkdir(&empty))?;
        let repo = Repo::Explicit {
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

/// A new 0700 directory under the temp directory (mkdir never follows a planted link).
fn make_private_dir() -> Result<PathBuf, SessionError> {
    let base = std::env::temp_dir();
    for _ in 0..16 {
        let mut nonce = [0u8; 8];
        fs::File::open("/dev/urandom")
            .and_then(|mut f| f.read_exact(&mut nonce))
            .map_err(SessionError::io("read", "/dev/urandom"))?;
        let dir = base.join(format!(
            "warren-hostgit-{}",
            nonce.iter().map(|b| format!("{b:02x}")).collect::<String>()
        ));
        match fs::DirBuilder::new().mode(0o700).create(&dir) {
            Ok(()) => return Ok(dir),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(SessionError::io("create", &dir)(e)),
        }
    }
    Err(SessionError::io("create", base)(io::Error::from(
        io::ErrorKind::AlreadyExists,
    )))
}

fn fill(
    dir: &Path,
    session_git: &Path,
    source_objects: &Path,
    sha256: bool,
    shallow: Option<&[u8]>,
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
    if let Some(s) = shallow {
        create(&dir.join("shallow"), s)?;
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
    for (name, cap) in [("index", MAX_INDEX), ("info/exclude", MAX_SMALL_FILE)] {
        if let Some(bytes) = git_dir.read(name, cap)? {
            create(&dir.join(name), &bytes)?;
        }
    }
    if let Some(packed) = git_dir.read("packed-refs", MAX_INDEX)? {
        create(&dir.join("packed-refs"), &packed_branches(&packed, sha256))?;
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
            copy_fd(
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

fn copy_fd(
    src: OwnedFd,
    to: &Path,
    from: &Path,
    budget: &mut Budget,
    session_git: &Path,
) -> Result<(), SessionError> {
    let st =
        nix::sys::stat::fstat(src.as_fd()).map_err(|e| SessionError::io("stat", from)(e.into()))?;
    let len = st.st_size as u64;
    // Git never writes sparse objects; a sparse one would be copied as real data.
    if len > 1 << 20 && (st.st_blocks as u64) * 512 < len / 2 {
        return Err(unsafe_dir(from, "is a sparse file"));
    }
    budget.take(len, session_git)?;
    let mut src = fs::File::from(src);
    let mut dst = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o400)
        .custom_flags(libc_nofollow())
        .open(to)
        .map_err(SessionError::io("create", to))?;
    // The file may grow while it is copied; never copy more than its size said.
    io::copy(&mut (&mut src).take(len), &mut dst).map_err(SessionError::io("copy", from))?;
    Ok(())
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
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc_nofollow())
        .open(p)
        .map_err(SessionError::io("create", p))?;
    f.write_all(bytes).map_err(SessionError::io("write", p))
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

/// The branch lines of a `packed-refs` file (with their peeled lines), everything else
/// dropped.
pub(crate) fn packed_branches(packed: &[u8], sha256: bool) -> Vec<u8> {
    let mut out = b"# pack-refs with: peeled sorted \n".to_vec();
    let mut keep_peel = false;
    for line in packed.split(|&b| b == b'\n') {
        if let Some(peeled) = line.strip_prefix(b"^") {
            if keep_peel && is_oid(peeled, sha256) {
                out.extend_from_slice(line);
                out.push(b'\n');
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
            out.extend_from_slice(line);
            out.push(b'\n');
            keep_peel = true;
        }
    }
    out
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

    #[test]
    fn test_packed_refs_keep_branches_only() {
        let packed = format!(
            "# pack-refs with: peeled fully-peeled sorted \n{A} refs/heads/main\n^{A}\n\
             {A} refs/tags/v1\n^{A}\n{A} refs/heads/../x\nnot a line\n{A} refs/heads/dev\n"
        );
        let out = String::from_utf8(packed_branches(packed.as_bytes(), false)).unwrap();
        assert_eq!(
            out,
            format!(
                "# pack-refs with: peeled sorted \n{A} refs/heads/main\n^{A}\n{A} refs/heads/dev\n"
            )
        );
    }
}
