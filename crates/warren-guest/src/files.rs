//! File operations below the workspace directory, on behalf of the host.
//!
//! Runs on tokio's blocking pool (the callers use `spawn_blocking`). Every operation assumes
//! the guest user's filesystem identity (`setfsuid`/`setfsgid`, which are per thread) for its
//! duration, so permissions and ownership are those of uid 1000, and restores it afterwards.
//!
//! Paths are relative to the workspace and validated lexically first (no absolute paths, no
//! empty, `.` or `..` components, no NUL, at most `MAX_PATH_BYTES`), then resolved with
//! `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)` from an `O_PATH`
//! handle of the workspace: a symlink anywhere in the path is refused with `PermissionDenied`.

use std::fs::File;
use std::io::Write;
use std::os::fd::OwnedFd;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;

use nix::unistd::{setfsgid, setfsuid, Gid, Uid};
use rustix::fs::{Mode, OFlags, ResolveFlags};
use rustix::io::Errno;
use warren_protocol::limits::{MAX_FILE_CHUNK, MAX_PATH_BYTES};
use warren_protocol::{
    ErrorCode, FileData, FileRead, FileWrite, FileWritten, GuestError, WriteMode,
};

/// Where file operations happen and as whom.
#[derive(Debug, Clone)]
pub struct FilesConfig {
    /// The workspace root (`/workspace` in the guest).
    pub workspace: PathBuf,
    /// Filesystem uid/gid to assume; `None` keeps the caller's (tests on a host).
    pub user: Option<u32>,
}

const RESOLVE: ResolveFlags = ResolveFlags::BENEATH
    .union(ResolveFlags::NO_SYMLINKS)
    .union(ResolveFlags::NO_MAGICLINKS);

/// Validates a workspace-relative path and returns its components.
pub fn split_rel_path(path: &str) -> Result<Vec<&str>, GuestError> {
    let invalid = |why: &str| GuestError::new(ErrorCode::InvalidArgument, format!("path {why}"));
    if path.is_empty() {
        return Err(invalid("is empty"));
    }
    if path.len() > MAX_PATH_BYTES {
        return Err(invalid("is too long"));
    }
    if path.contains('\0') {
        return Err(invalid("contains NUL"));
    }
    if path.starts_with('/') {
        return Err(invalid("must be relative to the workspace"));
    }
    let parts: Vec<&str> = path.split('/').collect();
    if parts
        .iter()
        .any(|p| p.is_empty() || *p == "." || *p == "..")
    {
        return Err(invalid("has an empty, '.' or '..' component"));
    }
    Ok(parts)
}

/// Maps a failed filesystem call to a typed error. `what` says which step failed (never the
/// payload).
pub fn errno_error(what: &str, err: Errno) -> GuestError {
    let code = match err {
        Errno::NOENT => ErrorCode::NotFound,
        // ELOOP: a symlink on the path; EXDEV: resolution would leave the workspace.
        Errno::LOOP | Errno::XDEV => {
            return GuestError::new(
                ErrorCode::PermissionDenied,
                format!("{what}: symlinks and paths leaving the workspace are refused"),
            )
        }
        Errno::ISDIR | Errno::NOTDIR => ErrorCode::WrongType,
        Errno::ACCESS | Errno::PERM | Errno::ROFS => ErrorCode::PermissionDenied,
        Errno::NAMETOOLONG | Errno::INVAL => ErrorCode::InvalidArgument,
        _ => ErrorCode::Io,
    };
    GuestError::new(code, format!("{what}: {err}"))
}

pub(crate) fn io_error(what: &str, err: std::io::Error) -> GuestError {
    match err.raw_os_error() {
        Some(raw) => errno_error(what, Errno::from_raw_os_error(raw)),
        None => GuestError::new(ErrorCode::Io, format!("{what}: {err}")),
    }
}

/// Assumes a filesystem identity for the current thread until dropped.
pub(crate) struct FsIdentity {
    previous: Option<(Uid, Gid)>,
}

impl FsIdentity {
    pub(crate) fn assume(user: Option<u32>) -> Self {
        let previous = user.map(|id| {
            let gid = setfsgid(Gid::from_raw(id));
            let uid = setfsuid(Uid::from_raw(id));
            (uid, gid)
        });
        Self { previous }
    }
}

impl Drop for FsIdentity {
    fn drop(&mut self) {
        if let Some((uid, gid)) = self.previous {
            setfsuid(uid);
            setfsgid(gid);
        }
    }
}

pub(crate) fn open_workspace(cfg: &FilesConfig) -> Result<OwnedFd, GuestError> {
    rustix::fs::open(
        &cfg.workspace,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| errno_error("open workspace", e))
}

pub(crate) fn open_beneath(
    root: &OwnedFd,
    path: &str,
    flags: OFlags,
    mode: Mode,
) -> Result<OwnedFd, Errno> {
    loop {
        match rustix::fs::openat2(root, path, flags | OFlags::CLOEXEC, mode, RESOLVE) {
            // openat2 may ask for a retry when a rename raced with the lookup.
            Err(Errno::AGAIN) | Err(Errno::INTR) => continue,
            other => return other,
        }
    }
}

/// Opens a directory (`None`: the workspace itself) as `O_PATH`, for a job's cwd.
pub fn open_dir(cfg: &FilesConfig, rel: Option<&str>) -> Result<OwnedFd, GuestError> {
    let _identity = FsIdentity::assume(cfg.user);
    let root = open_workspace(cfg)?;
    let Some(rel) = rel else {
        return Ok(root);
    };
    split_rel_path(rel)?;
    open_beneath(&root, rel, OFlags::PATH | OFlags::DIRECTORY, Mode::empty())
        .map_err(|e| errno_error("cwd", e))
}

pub(crate) fn regular_file(fd: OwnedFd) -> Result<(File, u64), GuestError> {
    let st = rustix::fs::fstat(&fd).map_err(|e| errno_error("stat", e))?;
    let kind = rustix::fs::FileType::from_raw_mode(st.st_mode);
    if kind == rustix::fs::FileType::Directory {
        return Err(GuestError::new(ErrorCode::WrongType, "is a directory"));
    }
    if kind != rustix::fs::FileType::RegularFile {
        return Err(GuestError::new(ErrorCode::WrongType, "not a regular file"));
    }
    // st_size of a regular file is never negative.
    Ok((File::from(fd), u64::try_from(st.st_size).unwrap_or(0)))
}

/// Reads up to `len` bytes at `offset`.
pub fn read(cfg: &FilesConfig, req: &FileRead) -> Result<FileData, GuestError> {
    if req.len > MAX_FILE_CHUNK {
        return Err(GuestError::new(
            ErrorCode::InvalidArgument,
            format!("len exceeds {MAX_FILE_CHUNK}"),
        ));
    }
    split_rel_path(&req.path)?;
    let _identity = FsIdentity::assume(cfg.user);
    let root = open_workspace(cfg)?;
    // O_NONBLOCK: opening a FIFO must not hang the agent; it is refused below anyway.
    let fd = open_beneath(
        &root,
        &req.path,
        OFlags::RDONLY | OFlags::NONBLOCK,
        Mode::empty(),
    )
    .map_err(|e| errno_error("open", e))?;
    let (file, size) = regular_file(fd)?;
    let want = size.saturating_sub(req.offset).min(u64::from(req.len));
    // `want` is at most MAX_FILE_CHUNK.
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
    Ok(FileData { data, size, eof })
}

/// Creates the missing directories of `parents` one component at a time, never following
/// symlinks, and returns the innermost one.
pub(crate) fn ensure_dirs(root: &OwnedFd, parents: &[&str]) -> Result<Option<OwnedFd>, GuestError> {
    let mut cur: Option<OwnedFd> = None;
    for name in parents {
        let base = cur.as_ref().unwrap_or(root);
        let flags = OFlags::PATH | OFlags::DIRECTORY;
        let next = match open_beneath(base, name, flags, Mode::empty()) {
            Ok(fd) => fd,
            Err(Errno::NOENT) => {
                match rustix::fs::mkdirat(base, *name, Mode::from_raw_mode(0o755)) {
                    Ok(()) | Err(Errno::EXIST) => {}
                    Err(e) => return Err(errno_error("mkdir", e)),
                }
                open_beneath(base, name, flags, Mode::empty())
                    .map_err(|e| errno_error("open dir", e))?
            }
            Err(e) => return Err(errno_error("open dir", e)),
        };
        cur = Some(next);
    }
    Ok(cur)
}

/// Opens the directory holding a file (`None`: the workspace itself), creating it first when
/// `create` says so.
pub(crate) fn open_parent(
    root: &OwnedFd,
    parents: &[&str],
    create: bool,
) -> Result<Option<OwnedFd>, GuestError> {
    if create {
        return ensure_dirs(root, parents);
    }
    if parents.is_empty() {
        return Ok(None);
    }
    let dir = parents.join("/");
    open_beneath(root, &dir, OFlags::PATH | OFlags::DIRECTORY, Mode::empty())
        .map(Some)
        .map_err(|e| errno_error("open parent", e))
}

/// Writes `data` as `mode` says and returns the file size afterwards.
pub fn write(cfg: &FilesConfig, req: &FileWrite) -> Result<FileWritten, GuestError> {
    if req.data.len() > MAX_FILE_CHUNK as usize {
        return Err(GuestError::new(
            ErrorCode::InvalidArgument,
            format!("data exceeds {MAX_FILE_CHUNK} bytes"),
        ));
    }
    let parts = split_rel_path(&req.path)?;
    // Chunk writes serialise with the whole-file operations on the same path.
    let _lock = crate::workspace_ops::lock_path(cfg, &req.path);
    let _identity = FsIdentity::assume(cfg.user);
    let root = open_workspace(cfg)?;
    let (name, parents) = parts
        .split_last()
        .ok_or_else(|| GuestError::new(ErrorCode::InvalidArgument, "path is empty"))?;
    let parent = open_parent(&root, parents, req.create_parents)?;
    let base = parent.as_ref().unwrap_or(&root);
    let mut flags = OFlags::WRONLY | OFlags::CREATE | OFlags::NONBLOCK;
    match req.mode {
        WriteMode::Truncate => flags |= OFlags::TRUNC,
        WriteMode::Append => flags |= OFlags::APPEND,
        WriteMode::At(_) => {}
    }
    let fd = open_beneath(base, name, flags, Mode::from_raw_mode(0o644))
        .map_err(|e| errno_error("open", e))?;
    let (mut file, _) = regular_file(fd)?;
    match req.mode {
        WriteMode::Truncate | WriteMode::Append => file
            .write_all(&req.data)
            .map_err(|e| io_error("write", e))?,
        WriteMode::At(offset) => file
            .write_all_at(&req.data, offset)
            .map_err(|e| io_error("write", e))?,
    }
    let size = file.metadata().map_err(|e| io_error("stat", e))?.len();
    Ok(FileWritten { size })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(dir: &tempfile::TempDir) -> FilesConfig {
        FilesConfig {
            workspace: dir.path().to_path_buf(),
            user: None,
        }
    }

    fn write_req(path: &str, mode: WriteMode, data: &[u8], create_parents: bool) -> FileWrite {
        FileWrite {
            path: path.into(),
            mode,
            data: data.to_vec(),
            create_parents,
        }
    }

    #[test]
    fn test_path_validation_bad_paths_invalid_argument() {
        let long = "a".repeat(MAX_PATH_BYTES + 1);
        for p in [
            "",
            "/etc/passwd",
            "a/../b",
            "..",
            "a//b",
            "./a",
            "a/",
            "a\0b",
            &long,
        ] {
            let err = split_rel_path(p).expect_err(p);
            assert_eq!(err.code, ErrorCode::InvalidArgument, "{p:?}");
        }
        assert_eq!(split_rel_path("a/b.c/d").expect("valid"), ["a", "b.c", "d"]);
    }

    #[test]
    fn test_file_roundtrip_chunks_larger_than_chunk_preserved() {
        let dir = tempfile::tempdir().expect("tempdir");
        let c = cfg(&dir);
        let payload: Vec<u8> = (0..300_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let chunk = MAX_FILE_CHUNK as usize;
        for (i, part) in payload.chunks(chunk).enumerate() {
            let mode = if i == 0 {
                WriteMode::Truncate
            } else {
                WriteMode::Append
            };
            write(&c, &write_req("sub/dir/f.bin", mode, part, true)).expect("write");
        }
        let mut back = Vec::new();
        loop {
            let d = read(
                &c,
                &FileRead {
                    path: "sub/dir/f.bin".into(),
                    offset: back.len() as u64,
                    len: MAX_FILE_CHUNK,
                },
            )
            .expect("read");
            assert_eq!(d.size, payload.len() as u64);
            back.extend_from_slice(&d.data);
            if d.eof {
                break;
            }
        }
        assert_eq!(back, payload);
    }

    #[test]
    fn test_file_write_at_offset_extends_and_overwrites() {
        let dir = tempfile::tempdir().expect("tempdir");
        let c = cfg(&dir);
        write(&c, &write_req("f", WriteMode::Truncate, b"hello", false)).expect("write");
        let w = write(&c, &write_req("f", WriteMode::At(3), b"LOWORLD", false)).expect("write");
        assert_eq!(w.size, 10);
        assert_eq!(
            std::fs::read(dir.path().join("f")).expect("read"),
            b"helLOWORLD"
        );
    }

    #[test]
    fn test_file_symlink_escape_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let outside = tempfile::tempdir().expect("tempdir");
        std::fs::write(outside.path().join("secret"), b"x").expect("write");
        std::os::unix::fs::symlink(outside.path(), dir.path().join("link")).expect("symlink");
        std::os::unix::fs::symlink("/etc/hostname", dir.path().join("f")).expect("symlink");
        let c = cfg(&dir);
        for path in ["link/secret", "f"] {
            let err = read(
                &c,
                &FileRead {
                    path: path.into(),
                    offset: 0,
                    len: 10,
                },
            )
            .expect_err(path);
            assert_eq!(err.code, ErrorCode::PermissionDenied, "{path}");
        }
        let err = write(&c, &write_req("link/new", WriteMode::Truncate, b"x", true))
            .expect_err("write through symlink");
        assert_eq!(err.code, ErrorCode::PermissionDenied);
        assert!(!outside.path().join("new").exists());
        let err = write(&c, &write_req("f", WriteMode::Truncate, b"x", false))
            .expect_err("write to symlink");
        assert_eq!(err.code, ErrorCode::PermissionDenied);
    }

    #[test]
    fn test_file_errors_typed_codes() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir(dir.path().join("d")).expect("mkdir");
        let c = cfg(&dir);
        let rd = |p: &str, len| {
            read(
                &c,
                &FileRead {
                    path: p.into(),
                    offset: 0,
                    len,
                },
            )
        };
        assert_eq!(
            rd("missing", 1).expect_err("missing").code,
            ErrorCode::NotFound
        );
        assert_eq!(rd("d", 1).expect_err("dir").code, ErrorCode::WrongType);
        assert_eq!(
            rd("d", MAX_FILE_CHUNK + 1).expect_err("len").code,
            ErrorCode::InvalidArgument
        );
        let err = write(
            &c,
            &write_req("no/such/f", WriteMode::Truncate, b"x", false),
        )
        .expect_err("no parents");
        assert_eq!(err.code, ErrorCode::NotFound);
    }
}
