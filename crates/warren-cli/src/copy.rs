//! `vm cp`'s archives: packing a host file or tree, and unpacking an archive the guest wrote.
//!
//! Packing uses the `tar` crate over the caller's own files (symlinks stored as links).
//! Unpacking parses the guest's archive with the `tar` crate but creates everything itself,
//! because the archive is untrusted input: every entry is created relative to a directory
//! descriptor opened with `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_XDEV)`
//! beneath a private staging directory, so no entry can leave it or write through a
//! symlink another entry made. Rules:
//! - names: absolute paths and `..` are refused (the copy fails); `.` components are skipped;
//! - regular files and directories are made with the entry's permission bits, set-id and
//!   sticky bits dropped, owned by the caller; files keep their modification time;
//! - symlinks are made as they are (their targets are never followed here);
//! - hard links only to a file made earlier in the same archive;
//! - device nodes, FIFOs and sparse or unknown entries are skipped and counted;
//! - at most [`MAX_ENTRIES`] entries and the caller's byte limit.
//!
//! The caller moves the staged result into place only once the whole archive unpacked.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use nix::errno::Errno;
use nix::fcntl::{OFlag, OpenHow, ResolveFlag};
use nix::sys::stat::Mode;

/// Most entries one archive may have.
pub const MAX_ENTRIES: u64 = 1_000_000;
/// Longest entry name or link target.
const MAX_NAME: usize = 4096;

/// What an unpack made.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Unpacked {
    pub files: u64,
    pub dirs: u64,
    pub links: u64,
    pub bytes: u64,
    /// Entries left out (devices, FIFOs, sparse files, unknown kinds).
    pub skipped: u64,
}

/// Writes a tar archive of `src` (a file, a directory tree or a symlink), named by its last
/// component, to `out`. Returns the bytes of file content packed.
pub fn pack(src: &Path, out: impl Write) -> Result<u64> {
    let name = src
        .file_name()
        .ok_or_else(|| anyhow!("{}: name a file or directory", src.display()))?;
    let meta = std::fs::symlink_metadata(src).with_context(|| src.display().to_string())?;
    let mut b = tar::Builder::new(out);
    b.follow_symlinks(false);
    let mut bytes = 0;
    if meta.is_dir() {
        for entry in walk(src)? {
            if entry.1.is_file() {
                bytes += entry.1.len();
            }
        }
        b.append_dir_all(name, src)
            .with_context(|| format!("packing {}", src.display()))?;
    } else {
        bytes = meta.len();
        b.append_path_with_name(src, name)
            .with_context(|| format!("packing {}", src.display()))?;
    }
    b.into_inner()?.flush()?;
    Ok(bytes)
}

/// Every path below `dir` with its metadata (not following symlinks).
fn walk(dir: &Path) -> Result<Vec<(std::path::PathBuf, std::fs::Metadata)>> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).with_context(|| d.display().to_string())? {
            let e = e?;
            let m = std::fs::symlink_metadata(e.path())?;
            if m.is_dir() {
                todo.push(e.path());
            }
            out.push((e.path(), m));
        }
    }
    Ok(out)
}

/// Bytes of regular-file content in `src`, for progress.
pub fn content_size(src: &Path) -> u64 {
    match std::fs::symlink_metadata(src) {
        Ok(m) if m.is_dir() => walk(src)
            .map(|v| v.iter().filter(|e| e.1.is_file()).map(|e| e.1.len()).sum())
            .unwrap_or(0),
        Ok(m) => m.len(),
        Err(_) => 0,
    }
}

fn beneath() -> OpenHow {
    OpenHow::new()
        .flags(OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC | OFlag::O_RDONLY)
        .resolve(
            ResolveFlag::RESOLVE_BENEATH
                | ResolveFlag::RESOLVE_NO_SYMLINKS
                | ResolveFlag::RESOLVE_NO_XDEV,
        )
}

/// Opens the directory `comps` below `root` (the root itself for none).
fn open_dir(root: &OwnedFd, comps: &[&[u8]]) -> Result<OwnedFd> {
    let rel = if comps.is_empty() {
        b".".to_vec()
    } else {
        comps.join(&b'/')
    };
    let p = Path::new(std::ffi::OsStr::from_bytes(&rel));
    nix::fcntl::openat2(root.as_fd(), p, beneath()).map_err(|e| {
        anyhow!(
            "{}: not a directory of this copy ({e})",
            String::from_utf8_lossy(&rel)
        )
    })
}

/// The normal components of an entry name; absolute names and `..` are refused.
fn components(name: &[u8]) -> Result<Vec<&[u8]>> {
    if name.len() > MAX_NAME {
        bail!("an entry name is longer than {MAX_NAME} bytes");
    }
    if name.first() == Some(&b'/') {
        bail!(
            "absolute entry name {:?} refused",
            String::from_utf8_lossy(name)
        );
    }
    let mut out = Vec::new();
    for c in name.split(|b| *b == b'/') {
        match c {
            b"" | b"." => {}
            b".." => bail!(
                "entry name {:?} leaves the copy",
                String::from_utf8_lossy(name)
            ),
            c => out.push(c),
        }
    }
    Ok(out)
}

fn c_name(b: &[u8]) -> &Path {
    Path::new(std::ffi::OsStr::from_bytes(b))
}

/// Unpacks `input` into the directory `root` (see the module docs); at most `max_bytes` of
/// file content.
pub fn unpack(input: impl Read, root: &Path, max_bytes: u64) -> Result<Unpacked> {
    let root_fd = nix::fcntl::open(
        root,
        OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC | OFlag::O_RDONLY,
        Mode::empty(),
    )
    .with_context(|| root.display().to_string())?;
    let mut done = Unpacked::default();
    let mut dir_modes: Vec<(Vec<Vec<u8>>, u32)> = Vec::new();
    let mut archive = tar::Archive::new(input);
    let mut count = 0u64;
    for entry in archive.entries().context("reading the archive")? {
        let mut entry = entry.context("reading the archive")?;
        count += 1;
        if count > MAX_ENTRIES {
            bail!("the archive has more than {MAX_ENTRIES} entries");
        }
        let name = entry.path_bytes().into_owned();
        let comps = components(&name)?;
        let Some((last, parents)) = comps.split_last() else {
            continue;
        };
        let parent = open_dir(&root_fd, parents)?;
        let mode = entry.header().mode().unwrap_or(0o644) & 0o777;
        let shown = String::from_utf8_lossy(&name).into_owned();
        match entry.header().entry_type() {
            tar::EntryType::Regular | tar::EntryType::Continuous => {
                let size = entry.size();
                if done.bytes.saturating_add(size) > max_bytes {
                    bail!("the copy is larger than the {max_bytes}-byte limit");
                }
                let file = create_file(&parent, last, &shown)?;
                let mut file = File::from(file);
                let copied = std::io::copy(&mut (&mut entry).take(size), &mut file)
                    .with_context(|| format!("writing {shown}"))?;
                file.set_permissions(std::fs::Permissions::from_mode(mode))?;
                if let Ok(mtime) = entry.header().mtime() {
                    let t = std::time::UNIX_EPOCH + std::time::Duration::from_secs(mtime);
                    let _ = file.set_modified(t);
                }
                done.files += 1;
                done.bytes += copied;
            }
            tar::EntryType::Directory => {
                match nix::sys::stat::mkdirat(
                    parent.as_fd(),
                    c_name(last),
                    Mode::from_bits_truncate(0o700),
                ) {
                    Ok(()) | Err(Errno::EEXIST) => {}
                    Err(e) => bail!("making directory {shown}: {e}"),
                }
                // Checks it is a directory of this copy (not a symlink made by an entry).
                open_dir(&root_fd, &comps)?;
                dir_modes.push((comps.iter().map(|c| c.to_vec()).collect(), mode));
                done.dirs += 1;
            }
            tar::EntryType::Symlink => {
                let target = entry
                    .link_name_bytes()
                    .ok_or_else(|| anyhow!("symlink {shown} has no target"))?
                    .into_owned();
                if target.len() > MAX_NAME {
                    bail!("symlink {shown}: target longer than {MAX_NAME} bytes");
                }
                remove_existing(&parent, last)?;
                nix::unistd::symlinkat(c_name(&target), parent.as_fd(), c_name(last))
                    .with_context(|| format!("making symlink {shown}"))?;
                done.links += 1;
            }
            tar::EntryType::Link => {
                let target = entry
                    .link_name_bytes()
                    .ok_or_else(|| anyhow!("hard link {shown} has no target"))?
                    .into_owned();
                let tcomps = components(&target)?;
                let Some((tlast, tparents)) = tcomps.split_last() else {
                    bail!("hard link {shown} has an empty target");
                };
                let tparent = open_dir(&root_fd, tparents)?;
                remove_existing(&parent, last)?;
                nix::unistd::linkat(
                    tparent.as_fd(),
                    c_name(tlast),
                    parent.as_fd(),
                    c_name(last),
                    nix::fcntl::AtFlags::empty(),
                )
                .with_context(|| format!("making hard link {shown}"))?;
                done.links += 1;
            }
            _ => done.skipped += 1,
        }
    }
    // Deepest first, so a read-only directory is set after its children were made.
    dir_modes.sort_by_key(|d| std::cmp::Reverse(d.0.len()));
    for (comps, mode) in dir_modes {
        let refs: Vec<&[u8]> = comps.iter().map(Vec::as_slice).collect();
        let fd = open_dir(&root_fd, &refs)?;
        nix::sys::stat::fchmod(fd.as_fd(), Mode::from_bits_truncate(mode))?;
    }
    Ok(done)
}

/// Creates (or replaces) the regular file `name` in `parent`, never through a symlink.
fn create_file(parent: &OwnedFd, name: &[u8], shown: &str) -> Result<OwnedFd> {
    let flags =
        OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    match nix::fcntl::openat(
        parent.as_fd(),
        c_name(name),
        flags,
        Mode::from_bits_truncate(0o600),
    ) {
        Ok(fd) => Ok(fd),
        Err(Errno::EEXIST) => {
            // A name the archive gave twice: the later entry wins, as with tar.
            remove_existing(parent, name)?;
            nix::fcntl::openat(
                parent.as_fd(),
                c_name(name),
                flags,
                Mode::from_bits_truncate(0o600),
            )
            .with_context(|| format!("creating {shown}"))
        }
        Err(e) => Err(anyhow!("creating {shown}: {e}")),
    }
}

/// Removes a non-directory at `name` in `parent`, if any.
fn remove_existing(parent: &OwnedFd, name: &[u8]) -> Result<()> {
    match nix::unistd::unlinkat(
        parent.as_fd(),
        c_name(name),
        nix::unistd::UnlinkatFlags::NoRemoveDir,
    ) {
        Ok(()) | Err(Errno::ENOENT) => Ok(()),
        Err(e) => Err(anyhow!("replacing {}: {e}", String::from_utf8_lossy(name))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    fn archive(build: impl FnOnce(&mut tar::Builder<Vec<u8>>)) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        build(&mut b);
        b.into_inner().expect("archive")
    }

    fn header(kind: tar::EntryType, size: u64, mode: u32) -> tar::Header {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(kind);
        h.set_size(size);
        h.set_mode(mode);
        h
    }

    #[test]
    fn test_pack_unpack_keeps_modes_symlinks_and_content() {
        let src = tempfile::tempdir().expect("src");
        let tree = src.path().join("tree");
        std::fs::create_dir_all(tree.join("sub")).expect("mkdir");
        std::fs::write(tree.join("sub/run.sh"), "#!/bin/sh\n").expect("write");
        std::fs::set_permissions(
            tree.join("sub/run.sh"),
            std::fs::Permissions::from_mode(0o751),
        )
        .expect("chmod");
        std::os::unix::fs::symlink("sub/run.sh", tree.join("link")).expect("symlink");
        let mut buf = Vec::new();
        pack(&tree, &mut buf).expect("pack");
        let dst = tempfile::tempdir().expect("dst");
        let got = unpack(&buf[..], dst.path(), u64::MAX).expect("unpack");
        assert_eq!((got.files, got.links, got.skipped), (1, 1, 0));
        let run = dst.path().join("tree/sub/run.sh");
        assert_eq!(std::fs::read(&run).expect("read"), b"#!/bin/sh\n");
        assert_eq!(std::fs::metadata(&run).expect("meta").mode() & 0o777, 0o751);
        assert_eq!(
            std::fs::read_link(dst.path().join("tree/link")).expect("link"),
            Path::new("sub/run.sh")
        );
    }

    #[test]
    fn test_unpack_refuses_escapes_and_drops_devices_and_setid() {
        let dst = tempfile::tempdir().expect("dst");
        for bad in ["../x", "/etc/x", "a/../../x"] {
            let a = archive(|b| {
                let mut h = header(tar::EntryType::Regular, 1, 0o644);
                let _ = h.set_path("placeholder");
                // Raw names: the builder itself refuses `..`, an attacker's archive does not.
                let name = bad.as_bytes();
                h.as_old_mut().name[..name.len()].copy_from_slice(name);
                h.as_old_mut().name[name.len()..].fill(0);
                h.set_cksum();
                b.append(&h, &b"x"[..]).expect("append");
            });
            let e = unpack(&a[..], dst.path(), u64::MAX).expect_err(bad);
            assert!(
                e.to_string().contains("refused") || e.to_string().contains("leaves"),
                "{e}"
            );
        }
        // A symlink out of the copy, then a file written "through" it: refused.
        let a = archive(|b| {
            let mut h = header(tar::EntryType::Symlink, 0, 0o777);
            b.append_link(&mut h, "out", "/tmp").expect("link");
            let mut h = header(tar::EntryType::Regular, 1, 0o644);
            b.append_data(&mut h, "out/pwned", &b"x"[..]).expect("file");
        });
        assert!(unpack(&a[..], dst.path(), u64::MAX).is_err());
        assert!(!Path::new("/tmp/pwned").exists());
        let a = archive(|b| {
            let mut h = header(tar::EntryType::Char, 0, 0o666);
            b.append_data(&mut h, "tty", &b""[..]).expect("dev");
            let mut h = header(tar::EntryType::Regular, 2, 0o6755);
            b.append_data(&mut h, "suid", &b"hi"[..]).expect("suid");
        });
        let got = unpack(&a[..], dst.path(), u64::MAX).expect("unpack");
        assert_eq!(got.skipped, 1);
        assert!(!dst.path().join("tty").exists());
        let mode = std::fs::metadata(dst.path().join("suid"))
            .expect("meta")
            .mode();
        assert_eq!(mode & 0o7777, 0o755);
        let a = archive(|b| {
            let mut h = header(tar::EntryType::Regular, 3, 0o644);
            b.append_data(&mut h, "big", &b"abc"[..]).expect("big");
        });
        assert!(unpack(&a[..], dst.path(), 2).is_err());
    }
}
