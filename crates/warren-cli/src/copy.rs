//! `vm cp`'s archives: packing a host file or tree, and unpacking an archive the guest wrote.
//!
//! Packing walks the caller's tree relative to directory descriptors (see [`pack`]) and
//! writes it with the `tar` crate (symlinks stored as links; sockets, FIFOs and devices left
//! out and counted).
//! Unpacking goes through the image layers' unpacker ([`warren_image::unpack`]), because the
//! archive is untrusted input: every entry is created relative to a directory descriptor
//! opened with `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_XDEV)` beneath a
//! private staging directory, so no entry can leave it or write through a symlink another
//! entry made. Rules (that unpacker's, without whiteouts, owners or sticky bits):
//! - names: absolute paths and `..` are refused (the copy fails); `.` components are skipped;
//!   every entry must be the name asked for or beneath it (the guest sends `tar -C parent
//!   name`): any other is refused, so a guest cannot make the host write what it was not
//!   asked for, even in staging;
//! - regular files and directories are made with the entry's permission bits less the
//!   caller's umask (the guest does not decide who else on the host may write the copy),
//!   directories always `u+rwx` (the caller can move and remove its copy), set-id and
//!   sticky bits dropped, owned by the caller; files keep their modification time;
//! - symlinks are made as they are (their targets are never followed here);
//! - hard links only to a file made earlier in the same archive (`..` or absolute refused);
//! - device nodes, FIFOs and sparse or unknown entries are skipped and counted;
//! - at most [`MAX_ENTRIES`] entries and the caller's byte limit.
//!
//! The caller moves the staged result into place only once the whole archive unpacked.

use std::ffi::OsStr;
use std::io::{Read, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use rustix::fs::{AtFlags, FileType, Mode, OFlags};

/// Most entries one archive may have.
pub const MAX_ENTRIES: u64 = 1_000_000;

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

/// Directory levels a packed tree may have (each open while its subtree is packed).
const MAX_DEPTH: usize = 256;

/// What a pack sent.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Packed {
    /// Bytes of file content.
    pub bytes: u64,
    /// Entries left out (sockets, FIFOs, devices).
    pub skipped: u64,
}

/// Writes a tar archive of `name` in the directory `parent` (a file, a directory tree or a
/// symlink; `shown` is its path for messages) to `out`.
///
/// Every entry is reached relative to the descriptor of the directory holding it, opened
/// `O_NOFOLLOW`, and its header made from the descriptor that is read (never from a path):
/// a tree a guest could write while it is packed cannot redirect the packer through a
/// symlink swapped in for a directory or a file, so nothing outside it is read. (The caller
/// resolves `parent`: `crate::host_side`.)
pub fn pack(parent: &OwnedFd, name: &OsStr, shown: &Path, out: impl Write) -> Result<Packed> {
    let mut b = tar::Builder::new(out);
    let mut packed = Packed::default();
    // Open directories being listed, each with its name in the archive.
    let mut stack: Vec<(rustix::fs::Dir, Vec<u8>)> = Vec::new();
    let top = name.as_bytes().to_vec();
    if let Some(dir) = add_entry(&mut b, parent.as_fd(), name, &top, &mut packed)
        .with_context(|| format!("packing {}", shown.display()))?
    {
        stack.push((dir, top.clone()));
    }
    while let Some((dir, prefix)) = stack.last_mut() {
        let Some(entry) = dir.read() else {
            stack.pop();
            continue;
        };
        let entry = entry?;
        let child = entry.file_name();
        if child == c"." || child == c".." {
            continue;
        }
        let child = OsStr::from_bytes(child.to_bytes()).to_owned();
        let mut path = prefix.clone();
        path.push(b'/');
        path.extend_from_slice(child.as_bytes());
        let at = dir.fd()?;
        // `shown` with the entry's path below the top.
        let here = || shown.join(OsStr::from_bytes(&path[top.len() + 1..]));
        let sub = add_entry(&mut b, at, &child, &path, &mut packed)
            .with_context(|| format!("packing {}", here().display()))?;
        if let Some(sub) = sub {
            if stack.len() >= MAX_DEPTH {
                bail!(
                    "{}: deeper than {MAX_DEPTH} directory levels",
                    shown.display()
                );
            }
            stack.push((sub, path));
        }
    }
    b.into_inner()?.flush()?;
    Ok(packed)
}

/// Appends the entry `name` of the directory `at` as `path`; a directory is returned open
/// for its entries to follow.
fn add_entry(
    b: &mut tar::Builder<impl Write>,
    at: BorrowedFd<'_>,
    name: &OsStr,
    path: &[u8],
    packed: &mut Packed,
) -> Result<Option<rustix::fs::Dir>> {
    let path = Path::new(OsStr::from_bytes(path));
    let st = rustix::fs::statat(at, name, AtFlags::SYMLINK_NOFOLLOW)?;
    match FileType::from_raw_mode(st.st_mode) {
        FileType::Directory => {
            let fd = rustix::fs::openat(
                at,
                name,
                OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::empty(),
            )?;
            let st = rustix::fs::fstat(&fd)?;
            let mut h = header(tar::EntryType::Directory, &st, 0);
            b.append_data(&mut h, path, std::io::empty())?;
            Ok(Some(rustix::fs::Dir::new(fd)?))
        }
        FileType::RegularFile => {
            // `O_NONBLOCK`: a FIFO swapped in after the look does not hang the open.
            let fd = rustix::fs::openat(
                at,
                name,
                OFlags::RDONLY
                    | OFlags::NOFOLLOW
                    | OFlags::NONBLOCK
                    | OFlags::NOCTTY
                    | OFlags::CLOEXEC,
                Mode::empty(),
            )?;
            let st = rustix::fs::fstat(&fd)?;
            if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile {
                packed.skipped += 1;
                return Ok(None);
            }
            let size = u64::try_from(st.st_size).unwrap_or(0);
            let mut h = header(tar::EntryType::Regular, &st, size);
            // Exactly `size` bytes whatever the file does meanwhile: cut when it grew,
            // zeros when it shrank (the archive stays well formed).
            let data = std::fs::File::from(fd)
                .take(size)
                .chain(std::io::repeat(0))
                .take(size);
            b.append_data(&mut h, path, data)?;
            packed.bytes += size;
            Ok(None)
        }
        FileType::Symlink => {
            let target = rustix::fs::readlinkat(at, name, Vec::new())?;
            let mut h = header(tar::EntryType::Symlink, &st, 0);
            b.append_link(&mut h, path, OsStr::from_bytes(target.as_bytes()))?;
            Ok(None)
        }
        _ => {
            packed.skipped += 1;
            Ok(None)
        }
    }
}

/// A header of `kind` with `st`'s mode, owner and modification time.
fn header(kind: tar::EntryType, st: &rustix::fs::Stat, size: u64) -> tar::Header {
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(kind);
    h.set_size(size);
    h.set_mode(st.st_mode & 0o7777);
    h.set_uid(u64::from(st.st_uid));
    h.set_gid(u64::from(st.st_gid));
    h.set_mtime(u64::try_from(st.st_mtime).unwrap_or(0));
    h
}

/// The process's umask, read without changing it (`umask(2)` can only set it, and other
/// threads create files meanwhile); `022` if the kernel does not say.
fn umask() -> u32 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Umask:"))
                .and_then(|v| u32::from_str_radix(v.trim(), 8).ok())
        })
        .map_or(0o022, |m| m & 0o777)
}

/// Most entries the progress count looks at before it gives up (it only sizes a bar).
const MAX_SIZED: u64 = 200_000;

/// Bytes of regular-file content in `src`, for progress: `None` past [`MAX_SIZED`] entries
/// or deeper than [`MAX_DEPTH`] (the walk is by path, and never follows a symlink it lists;
/// the copy itself is [`pack`]'s).
pub fn content_size(src: &Path) -> Option<u64> {
    let meta = std::fs::symlink_metadata(src).ok()?;
    if !meta.is_dir() {
        return Some(meta.len());
    }
    let (mut bytes, mut seen) = (0u64, 0u64);
    let mut todo = vec![(src.to_path_buf(), 0usize)];
    while let Some((d, depth)) = todo.pop() {
        for e in std::fs::read_dir(&d).ok()? {
            seen += 1;
            if seen > MAX_SIZED || depth > MAX_DEPTH {
                return None;
            }
            let e = e.ok()?;
            let m = std::fs::symlink_metadata(e.path()).ok()?;
            if m.is_dir() {
                todo.push((e.path(), depth + 1));
            } else if m.is_file() {
                bytes = bytes.saturating_add(m.len());
            }
        }
    }
    Some(bytes)
}

/// Unpacks `input`, an archive of `name` alone, into the open directory `root` (see the
/// module docs); at most `max_bytes` of disk, each entry charged its content rounded up to
/// whole 4 KiB blocks, at least one. The unpacker is the image layers'
/// ([`warren_image::unpack`]), without whiteouts, owners or sticky bits.
pub fn unpack(input: impl Read, root: OwnedFd, name: &OsStr, max_bytes: u64) -> Result<Unpacked> {
    let opts = warren_image::unpack::Options {
        max_bytes,
        block: 4096,
        max_entries: MAX_ENTRIES,
        keep_owner: false,
        keep_sticky: false,
        whiteouts: false,
        mode_mask: umask(),
        dir_mode_set: 0o700,
        only_in: Some(name.as_bytes().to_vec()),
    };
    let mut done = warren_image::unpack::Unpacked::default();
    warren_image::unpack::unpack_fd(input, root, &opts, &mut done)
        .map_err(|e| anyhow!("unpacking the copy: {e}"))?;
    Ok(Unpacked {
        files: done.files,
        dirs: done.dirs,
        links: done.links,
        bytes: done.bytes,
        skipped: done.skipped,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    fn pack_path(src: &Path, out: impl Write) -> Result<Packed> {
        let parent = root(src.parent().expect("parent"));
        pack(&parent, src.file_name().expect("name"), src, out)
    }

    fn root(p: &Path) -> OwnedFd {
        rustix::fs::open(p, OFlags::RDONLY | OFlags::DIRECTORY, Mode::empty()).expect("root")
    }

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
        pack_path(&tree, &mut buf).expect("pack");
        let dst = tempfile::tempdir().expect("dst");
        let got = unpack(&buf[..], root(dst.path()), "tree".as_ref(), u64::MAX).expect("unpack");
        assert_eq!((got.files, got.links, got.skipped), (1, 1, 0));
        let run = dst.path().join("tree/sub/run.sh");
        assert_eq!(std::fs::read(&run).expect("read"), b"#!/bin/sh\n");
        assert_eq!(
            std::fs::metadata(&run).expect("meta").mode() & 0o777,
            0o751 & !umask()
        );
        assert_eq!(
            std::fs::read_link(dst.path().join("tree/link")).expect("link"),
            Path::new("sub/run.sh")
        );
    }

    /// A directory the packer took is swapped for a symlink to a secret tree before its
    /// entries are read (a guest writing a shared source): the packer goes on reading the
    /// directory it opened, never the secret one.
    #[test]
    fn test_pack_reads_the_directories_it_opened_not_a_symlink_swapped_in() {
        struct Swapper {
            out: Vec<u8>,
            tree: std::path::PathBuf,
            secret: std::path::PathBuf,
            swapped: bool,
        }
        impl Write for Swapper {
            fn write(&mut self, d: &[u8]) -> std::io::Result<usize> {
                self.out.extend_from_slice(d);
                if !self.swapped && self.out.windows(6).any(|w| w == b"tree/b") {
                    self.swapped = true;
                    std::fs::rename(self.tree.join("b"), self.tree.join("held"))?;
                    std::os::unix::fs::symlink(&self.secret, self.tree.join("b"))?;
                }
                Ok(d.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let src = tempfile::tempdir().expect("src");
        let tree = src.path().join("tree");
        let secret = src.path().join("secret");
        std::fs::create_dir_all(tree.join("b")).expect("b");
        std::fs::create_dir_all(&secret).expect("secret");
        std::fs::write(tree.join("b/f"), "guest-owned").expect("f");
        std::fs::write(secret.join("f"), "host-secret").expect("secret f");
        let mut w = Swapper {
            out: Vec::new(),
            tree: tree.clone(),
            secret,
            swapped: false,
        };
        pack_path(&tree, &mut w).expect("pack");
        assert!(w.swapped, "the swap never ran");
        let has = |needle: &[u8]| w.out.windows(needle.len()).any(|x| x == needle);
        assert!(has(b"guest-owned"));
        assert!(
            !has(b"host-secret"),
            "the packer followed the swapped-in symlink"
        );
    }

    /// Entries without content still take disk: a guest's thousands of empty files were
    /// free against the limit (it counted content alone) and could fill the destination.
    /// Now each is charged a 4 KiB block. Control: the same archive within a limit that
    /// holds its blocks unpacks.
    #[test]
    fn test_unpack_charges_every_entry_a_block() {
        let a = archive(|b| {
            for i in 0..300 {
                let mut h = header(tar::EntryType::Regular, 0, 0o644);
                b.append_data(&mut h, format!("many/{i}"), &b""[..])
                    .expect("empty");
            }
        });
        let dst = tempfile::tempdir().expect("dst");
        let e = unpack(&a[..], root(dst.path()), "many".as_ref(), 1 << 20).expect_err("256 blocks");
        assert!(e.to_string().contains("on disk larger than"), "{e}");
        let dst = tempfile::tempdir().expect("dst");
        let got = unpack(&a[..], root(dst.path()), "many".as_ref(), 300 * 4096).expect("fits");
        assert_eq!((got.files, got.bytes), (300, 0));
    }

    /// Sockets, FIFOs and devices are left out and counted (a FIFO would hang the read).
    #[test]
    fn test_pack_leaves_out_fifos() {
        let src = tempfile::tempdir().expect("src");
        let tree = src.path().join("tree");
        std::fs::create_dir_all(&tree).expect("tree");
        nix::unistd::mkfifo(
            &tree.join("pipe"),
            nix::sys::stat::Mode::from_bits_truncate(0o644),
        )
        .expect("fifo");
        std::fs::write(tree.join("f"), "x").expect("f");
        let mut buf = Vec::new();
        let packed = pack_path(&tree, &mut buf).expect("pack");
        assert_eq!(
            packed,
            Packed {
                bytes: 1,
                skipped: 1
            }
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
            let e = unpack(&a[..], root(dst.path()), "x".as_ref(), u64::MAX).expect_err(bad);
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
        assert!(unpack(&a[..], root(dst.path()), "out".as_ref(), u64::MAX).is_err());
        assert!(!Path::new("/tmp/pwned").exists());
        let a = archive(|b| {
            let mut h = header(tar::EntryType::Char, 0, 0o666);
            b.append_data(&mut h, "top/tty", &b""[..]).expect("dev");
            let mut h = header(tar::EntryType::Regular, 2, 0o6755);
            b.append_data(&mut h, "top/suid", &b"hi"[..]).expect("suid");
        });
        let got = unpack(&a[..], root(dst.path()), "top".as_ref(), u64::MAX).expect("unpack");
        assert_eq!(got.skipped, 1);
        assert!(!dst.path().join("top/tty").exists());
        let mode = std::fs::metadata(dst.path().join("top/suid"))
            .expect("meta")
            .mode();
        assert_eq!(mode & 0o7777, 0o755 & !umask());
        let a = archive(|b| {
            let mut h = header(tar::EntryType::Regular, 3, 0o644);
            b.append_data(&mut h, "big", &b"abc"[..]).expect("big");
        });
        assert!(unpack(&a[..], root(dst.path()), "big".as_ref(), 2).is_err());
    }

    /// The guest answers a copy of `asked` with an archive that also makes other names (at
    /// the top, or as a sibling the host would move nowhere but write all the same): refused
    /// at the first such entry, before anything of it is written.
    #[test]
    fn test_unpack_refuses_entries_outside_the_name_asked_for() {
        for other in ["other", "asked2/x", "./other/asked"] {
            let dst = tempfile::tempdir().expect("dst");
            let a = archive(|b| {
                let mut h = header(tar::EntryType::Regular, 1, 0o644);
                b.append_data(&mut h, "asked/ok", &b"1"[..]).expect("asked");
                let mut h = header(tar::EntryType::Regular, 1, 0o644);
                b.append_data(&mut h, other, &b"2"[..]).expect("other");
            });
            let e = unpack(&a[..], root(dst.path()), "asked".as_ref(), u64::MAX).expect_err(other);
            assert!(e.to_string().contains("outside what was asked"), "{e}");
            let top = other
                .trim_start_matches("./")
                .split('/')
                .next()
                .expect("top");
            assert!(!dst.path().join(top).exists(), "{other} was written");
        }
        // Control: the name itself, `./`-prefixed names and the tree beneath it.
        let dst = tempfile::tempdir().expect("dst");
        let a = archive(|b| {
            let mut h = header(tar::EntryType::Directory, 0, 0o755);
            b.append_data(&mut h, "./asked/", &b""[..]).expect("dir");
            let mut h = header(tar::EntryType::Regular, 1, 0o644);
            b.append_data(&mut h, "asked/sub/f", &b"1"[..]).expect("f");
        });
        let got = unpack(&a[..], root(dst.path()), "asked".as_ref(), u64::MAX).expect("unpack");
        assert_eq!((got.files, got.dirs), (1, 1));
    }

    /// Modes the guest chose are narrowed by the caller's umask, and directories stay the
    /// caller's to move and remove (a read-only top directory made the move into place fail
    /// for a non-root caller, and the staging copy could not be removed).
    #[test]
    fn test_unpack_modes_follow_the_umask_and_directories_stay_the_callers() {
        let dst = tempfile::tempdir().expect("dst");
        let a = archive(|b| {
            let mut h = header(tar::EntryType::Directory, 0, 0o555);
            b.append_data(&mut h, "top", &b""[..]).expect("top");
            let mut h = header(tar::EntryType::Directory, 0, 0o000);
            b.append_data(&mut h, "top/closed", &b""[..])
                .expect("closed");
            let mut h = header(tar::EntryType::Directory, 0, 0o777);
            b.append_data(&mut h, "top/open", &b""[..]).expect("open");
            let mut h = header(tar::EntryType::Regular, 1, 0o666);
            b.append_data(&mut h, "top/open/f", &b"1"[..]).expect("f");
        });
        unpack(&a[..], root(dst.path()), "top".as_ref(), u64::MAX).expect("unpack");
        let mode = |p: &str| std::fs::metadata(dst.path().join(p)).expect(p).mode() & 0o7777;
        let mask = umask();
        assert_eq!(mode("top"), 0o755 & !mask);
        assert_eq!(mode("top/closed"), 0o700);
        assert_eq!(mode("top/open"), 0o777 & !mask);
        assert_eq!(mode("top/open/f"), 0o666 & !mask);
        assert_ne!(
            mask & 0o002,
            0,
            "the tests run with a umask that clears o+w"
        );
    }
}
