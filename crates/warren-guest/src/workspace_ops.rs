//! Whole-file operations with versions, and searches, below the workspace directory.
//!
//! Runs on tokio's blocking pool, like [`crate::files`], as the guest user (`setfsuid`), with
//! the same path rules (workspace-relative, no symlinks, nothing outside).
//!
//! - A file's **version** is the SHA-256 of its content (never its mtime: virtio-fs caches
//!   attributes). [`read_versioned`] hashes the file through the same open file it returns
//!   data from, so data and version describe one content.
//! - [`write_checked`] and [`edit`] hold the path's lock (a process-wide table, see
//!   [`lock_path`]; the chunk writes of `files` take it too), check their precondition,
//!   write the new content to a temporary file in the same directory, fsync it and rename it
//!   over the path. Readers therefore see the old or the new content, never a mix. A
//!   create-only write renames with `RENAME_NOREPLACE` (or `link` + `unlink` where the
//!   filesystem lacks it), so an existing file is never replaced even by a process outside
//!   the agent. A replaced file keeps its permission bits.
//! - [`glob`] and [`grep`] walk with the `ignore` crate: `.gitignore` files (in the search
//!   directory, below and above it) and `.git/info/exclude` apply, also outside a git
//!   repository; global git excludes and `.ignore` files do not. Hidden files are included,
//!   `.git` directories never entered, symlinks never followed (nor returned), only regular
//!   files returned. Work is bounded (`MAX_SEARCH_ENTRIES`, `MAX_GREP_BYTES`); hitting a
//!   bound sets `truncated`, as does a result limit.
//!
//! The walk resolves paths by name below the checked search directory; a process racing to
//! swap a directory for a symlink can at worst make it read what the guest user may read
//! anyway (the walk runs with that user's filesystem identity).

use std::collections::HashSet;
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, LazyLock, Mutex, PoisonError};

use globset::{GlobBuilder, GlobMatcher};
use rustix::fs::{AtFlags, FileType, Mode, OFlags, RenameFlags};
use rustix::io::Errno;
use sha2::{Digest, Sha256};
use warren_protocol::limits::{
    MAX_GREP_BYTES, MAX_GREP_LINE_CHARS, MAX_PATTERN_BYTES, MAX_SEARCH_ENTRIES, MAX_SEARCH_RESULTS,
    MAX_VERSIONED_FILE, MAX_WHOLE_FILE,
};
use warren_protocol::{
    EditFile, ErrorCode, FileVersion, GlobRequest, GlobResult, GrepMatch, GrepRequest, GrepResult,
    GuestError, Precondition, ReadVersioned, Version, VersionedData, WriteChecked,
};

use crate::files::{
    errno_error, io_error, open_beneath, open_parent, open_workspace, regular_file, split_rel_path,
    FilesConfig, FsIdentity,
};

/// Bytes looked at for a NUL to call a file binary (as git and ripgrep do).
const BINARY_PROBE: usize = 8 * 1024;

/// Paths with a whole-file operation in progress, keyed by workspace and relative path.
/// Guarded by its mutex; `freed` is signalled whenever a key is removed.
struct PathLocks {
    busy: Mutex<HashSet<(PathBuf, String)>>,
    freed: Condvar,
}

static LOCKS: LazyLock<PathLocks> = LazyLock::new(|| PathLocks {
    busy: Mutex::new(HashSet::new()),
    freed: Condvar::new(),
});

/// Holds one path's lock until dropped.
pub(crate) struct PathLock {
    key: (PathBuf, String),
}

impl Drop for PathLock {
    fn drop(&mut self) {
        let mut busy = LOCKS.busy.lock().unwrap_or_else(PoisonError::into_inner);
        busy.remove(&self.key);
        LOCKS.freed.notify_all();
    }
}

/// Waits until no other operation holds `rel` (an already validated path: its spelling is
/// canonical) and takes it. Blocking: call on the blocking pool.
pub(crate) fn lock_path(cfg: &FilesConfig, rel: &str) -> PathLock {
    let key = (cfg.workspace.clone(), rel.to_string());
    let mut busy = LOCKS.busy.lock().unwrap_or_else(PoisonError::into_inner);
    while busy.contains(&key) {
        busy = LOCKS
            .freed
            .wait(busy)
            .unwrap_or_else(PoisonError::into_inner);
    }
    busy.insert(key.clone());
    PathLock { key }
}

/// The version of `data`.
pub fn version_of(data: &[u8]) -> Version {
    Sha256::digest(data).into()
}

fn too_large(what: &str) -> GuestError {
    GuestError::new(ErrorCode::TooLarge, what)
}

/// Reads `file` from its start to its end, hashing everything and keeping the bytes within
/// `[offset, offset + len)`. Returns the kept bytes, the bytes read in all and the hash.
fn hash_and_slice(
    file: &File,
    offset: u64,
    len: u32,
) -> Result<(Vec<u8>, u64, Version), GuestError> {
    let mut hasher = Sha256::new();
    let mut kept = Vec::new();
    let end = offset.saturating_add(u64::from(len));
    let mut pos = 0u64;
    let mut buf = vec![0u8; 64 * 1024];
    let mut reader = file;
    loop {
        let n = match reader.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(io_error("read", e)),
        };
        let block = &buf[..n];
        hasher.update(block);
        let (start, stop) = (pos, pos + n as u64);
        if stop > offset && start < end {
            let from = offset.saturating_sub(start) as usize;
            let to = (end.min(stop) - start) as usize;
            kept.extend_from_slice(&block[from..to]);
        }
        pos = stop;
        if pos > MAX_VERSIONED_FILE {
            return Err(too_large(
                "file grew past the versioned-file limit while read",
            ));
        }
    }
    Ok((kept, pos, hasher.finalize().into()))
}

/// Reads up to `len` bytes at `offset` and the whole file's version.
pub fn read_versioned(cfg: &FilesConfig, req: &ReadVersioned) -> Result<VersionedData, GuestError> {
    if req.len > MAX_WHOLE_FILE {
        return Err(GuestError::new(
            ErrorCode::InvalidArgument,
            format!("len exceeds {MAX_WHOLE_FILE}"),
        ));
    }
    split_rel_path(&req.path)?;
    let _identity = FsIdentity::assume(cfg.user);
    let root = open_workspace(cfg)?;
    let fd = open_beneath(
        &root,
        &req.path,
        OFlags::RDONLY | OFlags::NONBLOCK,
        Mode::empty(),
    )
    .map_err(|e| errno_error("open", e))?;
    let (file, size) = regular_file(fd)?;
    if size > MAX_VERSIONED_FILE {
        // Too large to hash on every read: the data comes without a version.
        let want = size.saturating_sub(req.offset).min(u64::from(req.len));
        let mut data = vec![0u8; want as usize];
        let mut filled = 0;
        while filled < data.len() {
            match file.read_at(&mut data[filled..], req.offset + filled as u64) {
                Ok(0) => break,
                Ok(n) => filled += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(io_error("read", e)),
            }
        }
        data.truncate(filled);
        let eof = req.offset.saturating_add(data.len() as u64) >= size;
        return Ok(VersionedData {
            data,
            size,
            eof,
            version: None,
        });
    }
    let (data, size, version) = hash_and_slice(&file, req.offset, req.len)?;
    let eof = req.offset.saturating_add(data.len() as u64) >= size;
    Ok(VersionedData {
        data,
        size,
        eof,
        version: Some(version),
    })
}

/// What is at a path before a whole-file write.
struct Existing {
    mode: Mode,
    version: Option<Version>,
}

/// Looks at `name` in `dir` without following a symlink; hashes it when `hash` says so.
fn existing(dir: &OwnedFd, name: &str, hash: bool) -> Result<Option<Existing>, GuestError> {
    let st = match rustix::fs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW) {
        Ok(st) => st,
        Err(Errno::NOENT) => return Ok(None),
        Err(e) => return Err(errno_error("stat", e)),
    };
    match FileType::from_raw_mode(st.st_mode) {
        FileType::RegularFile => {}
        FileType::Symlink => {
            return Err(GuestError::new(
                ErrorCode::PermissionDenied,
                "the path is a symlink; symlinks are refused",
            ))
        }
        FileType::Directory => return Err(GuestError::new(ErrorCode::WrongType, "is a directory")),
        _ => return Err(GuestError::new(ErrorCode::WrongType, "not a regular file")),
    }
    let mode = Mode::from_raw_mode(st.st_mode & 0o7777);
    let size = u64::try_from(st.st_size).unwrap_or(u64::MAX);
    let version = if hash && size <= MAX_VERSIONED_FILE {
        let fd = open_beneath(dir, name, OFlags::RDONLY | OFlags::NONBLOCK, Mode::empty())
            .map_err(|e| errno_error("open", e))?;
        let (file, _) = regular_file(fd)?;
        Some(hash_and_slice(&file, 0, 0)?.2)
    } else {
        None
    };
    Ok(Some(Existing { mode, version }))
}

static TEMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// Writes `data` to a fresh temporary file in `dir` and renames it to `name`. `create_only`
/// never replaces an existing `name` (`Conflict`). `mode` is the new file's permission bits.
fn replace(
    dir: &OwnedFd,
    name: &str,
    data: &[u8],
    mode: Mode,
    create_only: bool,
) -> Result<(), GuestError> {
    let tmp = format!(
        ".warren-tmp-{}-{}",
        std::process::id(),
        TEMP_COUNTER.fetch_add(1, Ordering::Relaxed)
    );
    let fd = open_beneath(
        dir,
        &tmp,
        OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL,
        mode,
    )
    .map_err(|e| errno_error("create temporary file", e))?;
    let unlink_tmp = || {
        let _ = rustix::fs::unlinkat(dir, tmp.as_str(), AtFlags::empty());
    };
    let written = (|| {
        // The umask may have cleared bits of `mode`.
        rustix::fs::fchmod(&fd, mode).map_err(|e| errno_error("chmod", e))?;
        let mut file = File::from(fd);
        file.write_all(data).map_err(|e| io_error("write", e))?;
        file.sync_all().map_err(|e| io_error("fsync", e))
    })();
    if let Err(e) = written {
        unlink_tmp();
        return Err(e);
    }
    let renamed = if create_only {
        match rustix::fs::renameat_with(dir, tmp.as_str(), dir, name, RenameFlags::NOREPLACE) {
            // The filesystem lacks RENAME_NOREPLACE: link() refuses an existing name too.
            Err(Errno::INVAL) | Err(Errno::NOSYS) => {
                let linked = rustix::fs::linkat(dir, tmp.as_str(), dir, name, AtFlags::empty());
                unlink_tmp();
                linked
            }
            other => other,
        }
    } else {
        rustix::fs::renameat(dir, tmp.as_str(), dir, name)
    };
    match renamed {
        Ok(()) => {}
        Err(Errno::EXIST) => {
            unlink_tmp();
            return Err(GuestError::new(
                ErrorCode::Conflict,
                "the file already exists (create-only)",
            ));
        }
        Err(e) => {
            unlink_tmp();
            return Err(errno_error("rename", e));
        }
    }
    // Make the rename itself durable; a failure here changes nothing the caller can act on.
    if let Ok(d) = open_beneath(dir, ".", OFlags::RDONLY | OFlags::DIRECTORY, Mode::empty()) {
        let _ = rustix::fs::fsync(d.as_fd());
    }
    Ok(())
}

fn conflict_message(current: Option<&Existing>) -> String {
    match current {
        None => "the file does not exist".to_string(),
        Some(Existing {
            version: Some(v), ..
        }) => format!("the file's current version is {}", hex::encode(v)),
        Some(_) => format!("the file is larger than {MAX_VERSIONED_FILE} bytes and has no version"),
    }
}

/// Replaces the whole file if `req.precondition` holds; returns the new version.
pub fn write_checked(cfg: &FilesConfig, req: &WriteChecked) -> Result<FileVersion, GuestError> {
    if req.data.len() > MAX_WHOLE_FILE as usize {
        return Err(too_large(&format!(
            "content exceeds {MAX_WHOLE_FILE} bytes; write larger files in chunks"
        )));
    }
    let parts = split_rel_path(&req.path)?;
    let (name, parents) = parts
        .split_last()
        .ok_or_else(|| GuestError::new(ErrorCode::InvalidArgument, "path is empty"))?;
    let _lock = lock_path(cfg, &req.path);
    let _identity = FsIdentity::assume(cfg.user);
    let root = open_workspace(cfg)?;
    let parent = open_parent(&root, parents, req.create_parents)?;
    let dir = parent.as_ref().unwrap_or(&root);
    if req.precondition == Precondition::CreateOnly {
        // Anything at the path (a directory, a symlink) means it exists.
        match rustix::fs::statat(dir, *name, AtFlags::SYMLINK_NOFOLLOW) {
            Err(Errno::NOENT) => {}
            Ok(_) => {
                return Err(GuestError::new(
                    ErrorCode::Conflict,
                    "the path already exists (create-only)",
                ))
            }
            Err(e) => return Err(errno_error("stat", e)),
        }
    }
    let hash = matches!(req.precondition, Precondition::IfVersion(_));
    let current = existing(dir, name, hash)?;
    match (req.precondition, &current) {
        (Precondition::None, _) => {}
        // Checked above; the rename below refuses a file created since.
        (Precondition::CreateOnly, _) => {}
        (Precondition::IfVersion(want), cur) => {
            if cur.as_ref().and_then(|c| c.version) != Some(want) {
                return Err(GuestError::new(
                    ErrorCode::Conflict,
                    format!(
                        "expected version {} but {}",
                        hex::encode(want),
                        conflict_message(cur.as_ref())
                    ),
                ));
            }
        }
    }
    let mode = current
        .as_ref()
        .map(|c| c.mode)
        .unwrap_or(Mode::from_raw_mode(0o644));
    let create_only = req.precondition == Precondition::CreateOnly;
    replace(dir, name, &req.data, mode, create_only)?;
    Ok(FileVersion {
        version: version_of(&req.data),
        size: req.data.len() as u64,
    })
}

/// Replaces the one occurrence of `req.old` with `req.new`; returns the new version.
pub fn edit(cfg: &FilesConfig, req: &EditFile) -> Result<FileVersion, GuestError> {
    let invalid = |m: String| GuestError::new(ErrorCode::InvalidArgument, m);
    if req.old.is_empty() {
        return Err(invalid("old_string must not be empty".into()));
    }
    if req.old == req.new {
        return Err(invalid("old_string and new_string are identical".into()));
    }
    let parts = split_rel_path(&req.path)?;
    let (name, parents) = parts
        .split_last()
        .ok_or_else(|| invalid("path is empty".into()))?;
    let _lock = lock_path(cfg, &req.path);
    let _identity = FsIdentity::assume(cfg.user);
    let root = open_workspace(cfg)?;
    let parent = open_parent(&root, parents, false)?;
    let dir = parent.as_ref().unwrap_or(&root);
    let fd = open_beneath(dir, name, OFlags::RDONLY | OFlags::NONBLOCK, Mode::empty())
        .map_err(|e| errno_error("open", e))?;
    let (file, size) = regular_file(fd)?;
    if size > MAX_VERSIONED_FILE {
        return Err(too_large(&format!(
            "the file is larger than {MAX_VERSIONED_FILE} bytes; edit it with a command"
        )));
    }
    let mode = Mode::from_raw_mode(
        rustix::fs::fstat(&file)
            .map_err(|e| errno_error("stat", e))?
            .st_mode
            & 0o7777,
    );
    let (content, _, version) = hash_and_slice(&file, 0, u32::MAX)?;
    if let Some(want) = req.expected_version {
        if want != version {
            return Err(GuestError::new(
                ErrorCode::Conflict,
                format!(
                    "expected version {} but the file's current version is {}",
                    hex::encode(want),
                    hex::encode(version)
                ),
            ));
        }
    }
    let old = req.old.as_bytes();
    let mut found = memchr::memmem::find_iter(&content, old);
    let at = match (found.next(), found.count()) {
        (None, _) => {
            return Err(invalid(format!(
                "old_string does not occur in {} (0 matches)",
                req.path
            )))
        }
        (Some(at), 0) => at,
        (Some(_), more) => {
            return Err(invalid(format!(
                "old_string occurs {} times in {}; it must occur exactly once (include more surrounding text)",
                more + 1,
                req.path
            )))
        }
    };
    let mut next = Vec::with_capacity(content.len() - old.len() + req.new.len());
    next.extend_from_slice(&content[..at]);
    next.extend_from_slice(req.new.as_bytes());
    next.extend_from_slice(&content[at + old.len()..]);
    if next.len() as u64 > MAX_VERSIONED_FILE {
        return Err(too_large(&format!(
            "the edited file would exceed {MAX_VERSIONED_FILE} bytes"
        )));
    }
    replace(dir, name, &next, mode, false)?;
    Ok(FileVersion {
        version: version_of(&next),
        size: next.len() as u64,
    })
}

/// A glob as searches use it: without `/` it matches file names at any depth, with `/` the
/// path relative to the search directory (`*` never crosses `/`, `**` does).
pub struct PathGlob {
    matcher: GlobMatcher,
    name_only: bool,
}

impl PathGlob {
    pub fn new(pattern: &str) -> Result<PathGlob, GuestError> {
        let invalid = |m: String| GuestError::new(ErrorCode::InvalidArgument, m);
        if pattern.is_empty() {
            return Err(invalid("glob is empty".into()));
        }
        if pattern.len() > MAX_PATTERN_BYTES {
            return Err(invalid(format!("glob exceeds {MAX_PATTERN_BYTES} bytes")));
        }
        let glob = GlobBuilder::new(pattern)
            .literal_separator(true)
            .backslash_escape(true)
            .build()
            .map_err(|e| invalid(format!("invalid glob: {e}")))?;
        Ok(PathGlob {
            matcher: glob.compile_matcher(),
            name_only: !pattern.contains('/'),
        })
    }

    /// `rel` is relative to the search directory.
    pub fn is_match(&self, rel: &str) -> bool {
        if self.name_only {
            self.matcher.is_match(rel.rsplit('/').next().unwrap_or(rel))
        } else {
            self.matcher.is_match(rel)
        }
    }
}

fn check_limit(limit: u32) -> Result<usize, GuestError> {
    if limit == 0 || limit > MAX_SEARCH_RESULTS {
        return Err(GuestError::new(
            ErrorCode::InvalidArgument,
            format!("limit must be within 1..={MAX_SEARCH_RESULTS}"),
        ));
    }
    Ok(limit as usize)
}

/// The files below the search directory that `glob` accepts (all when `None`), as paths
/// relative to the workspace, sorted; and whether a work bound cut the walk short.
fn walk(
    cfg: &FilesConfig,
    root: &OwnedFd,
    path: Option<&str>,
    glob: Option<&PathGlob>,
) -> Result<(Vec<String>, bool), GuestError> {
    let base = match path {
        Some(p) => {
            split_rel_path(p)?;
            // Refuses symlinks and non-directories on the way, like every other path.
            open_beneath(root, p, OFlags::PATH | OFlags::DIRECTORY, Mode::empty())
                .map_err(|e| errno_error("search directory", e))?;
            cfg.workspace.join(p)
        }
        None => cfg.workspace.clone(),
    };
    let mut builder = ignore::WalkBuilder::new(&base);
    builder
        .standard_filters(false)
        .hidden(false)
        .git_ignore(true)
        .git_exclude(true)
        .git_global(false)
        .ignore(false)
        .parents(true)
        .require_git(false)
        .follow_links(false)
        .filter_entry(|e| e.file_name() != ".git");
    let mut files = Vec::new();
    let mut truncated = false;
    for (seen, entry) in builder.build().enumerate() {
        if seen >= MAX_SEARCH_ENTRIES {
            truncated = true;
            break;
        }
        // Unreadable directories are skipped, as `find` and `rg` do.
        let Ok(entry) = entry else { continue };
        if !entry.file_type().is_some_and(|t| t.is_file()) {
            continue;
        }
        let Some(ws_rel) = rel_str(entry.path(), &cfg.workspace) else {
            // Not representable in the protocol's UTF-8 paths: the result is incomplete.
            truncated = true;
            continue;
        };
        let Some(search_rel) = rel_str(entry.path(), &base) else {
            continue;
        };
        if glob.is_none_or(|g| g.is_match(&search_rel)) {
            files.push(ws_rel);
        }
    }
    files.sort();
    Ok((files, truncated))
}

fn rel_str(path: &Path, base: &Path) -> Option<String> {
    path.strip_prefix(base)
        .ok()?
        .to_str()
        .map(str::to_string)
        .filter(|s| !s.is_empty())
}

/// Files matching `req.pattern` below the search directory.
pub fn glob(cfg: &FilesConfig, req: &GlobRequest) -> Result<GlobResult, GuestError> {
    let limit = check_limit(req.limit)?;
    let matcher = PathGlob::new(&req.pattern)?;
    let _identity = FsIdentity::assume(cfg.user);
    let root = open_workspace(cfg)?;
    let (mut paths, mut truncated) = walk(cfg, &root, req.path.as_deref(), Some(&matcher))?;
    if paths.len() > limit {
        paths.truncate(limit);
        truncated = true;
    }
    Ok(GlobResult { paths, truncated })
}

/// Lines matching `req.pattern` in the text files below the search directory.
pub fn grep(cfg: &FilesConfig, req: &GrepRequest) -> Result<GrepResult, GuestError> {
    let limit = check_limit(req.limit)?;
    if req.pattern.len() > MAX_PATTERN_BYTES {
        return Err(GuestError::new(
            ErrorCode::InvalidArgument,
            format!("pattern exceeds {MAX_PATTERN_BYTES} bytes"),
        ));
    }
    let re = regex::bytes::RegexBuilder::new(&req.pattern)
        .case_insensitive(req.case_insensitive)
        .build()
        .map_err(|e| GuestError::new(ErrorCode::InvalidArgument, format!("invalid regex: {e}")))?;
    let filter = req.glob.as_deref().map(PathGlob::new).transpose()?;
    let _identity = FsIdentity::assume(cfg.user);
    let root = open_workspace(cfg)?;
    let (files, mut truncated) = walk(cfg, &root, req.path.as_deref(), filter.as_ref())?;
    let mut matches = Vec::new();
    let mut budget = MAX_GREP_BYTES;
    'files: for path in files {
        // Files are read through the workspace handle: never through a symlink swapped in
        // since the walk.
        let Ok(fd) = open_beneath(
            &root,
            &path,
            OFlags::RDONLY | OFlags::NONBLOCK,
            Mode::empty(),
        ) else {
            continue;
        };
        let Ok((file, size)) = regular_file(fd) else {
            continue;
        };
        if size > budget {
            truncated = true;
            break;
        }
        let mut content = Vec::with_capacity(size as usize);
        if file.take(budget).read_to_end(&mut content).is_err() {
            continue;
        }
        budget = budget.saturating_sub(content.len() as u64);
        if memchr::memchr(0, &content[..content.len().min(BINARY_PROBE)]).is_some() {
            continue;
        }
        for (i, line) in lines(&content).enumerate() {
            if !re.is_match(line) {
                continue;
            }
            if matches.len() == limit {
                truncated = true;
                break 'files;
            }
            matches.push(GrepMatch {
                path: path.clone(),
                line: i as u64 + 1,
                text: line_text(line),
            });
        }
    }
    Ok(GrepResult { matches, truncated })
}

/// The lines of `content`, without their `\n`; a final `\n` does not start another line.
pub fn lines(content: &[u8]) -> impl Iterator<Item = &[u8]> {
    let body = content.strip_suffix(b"\n").unwrap_or(content);
    body.split(|b| *b == b'\n')
        .take(if content.is_empty() { 0 } else { usize::MAX })
}

/// A matching line as reported: lossy UTF-8, at most `MAX_GREP_LINE_CHARS` characters.
pub fn line_text(line: &[u8]) -> String {
    let text = String::from_utf8_lossy(line);
    match text.char_indices().nth(MAX_GREP_LINE_CHARS) {
        Some((cut, _)) => text[..cut].to_string(),
        None => text.into_owned(),
    }
}

#[cfg(test)]
#[path = "workspace_ops_tests.rs"]
mod tests;
