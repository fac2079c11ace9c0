//! Unpacking untrusted tar archives into a directory: OCI image layers (with whiteouts) and
//! the archives `vm cp` receives from a guest.
//!
//! The `tar` crate parses; everything is created here, relative to directory descriptors
//! opened through [`crate::tree`] (`openat2` with `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS |
//! RESOLVE_NO_XDEV`), so no entry can leave the directory or write through a symlink another
//! entry (or an earlier layer) made. Rules:
//! - names: absolute paths and `..` are **refused** (the whole unpack fails); `.` components
//!   are skipped, and so is an entry for the root itself (`.`, `./` or `/`);
//! - regular files and directories are made with the entry's permission bits; **set-id bits
//!   are dropped** (counted), the sticky bit is kept only where [`Options::keep_sticky`]
//!   says; owners come from the entry with [`Options::keep_owner`], else the caller's;
//!   files keep their modification time;
//! - symlinks are made as they are: their targets are never followed here (a target such as
//!   `/etc/shadow` or `../../x` resolves only inside the guest, whose root is the image);
//! - hard links only to an entry already in the directory: a target that is absolute or has
//!   `..` is **refused**;
//! - device nodes, FIFOs, sparse and unknown entries are **dropped** (counted);
//! - with [`Options::whiteouts`] (OCI layers), `.wh.<name>` removes `<name>` of the layers
//!   below and `.wh..wh..opq` empties its directory of them;
//! - at most [`Options::max_entries`] entries and [`Options::max_bytes`] of file content.

use std::collections::HashSet;
use std::fs::File;
use std::io::Read;
use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;

use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag};
use nix::sys::stat::Mode;
use nix::unistd::{Gid, Uid};

use crate::tree::{self, c_name, components, err, Tree, TreeError};

/// OCI whiteout prefix and the opaque-directory marker.
const WHITEOUT: &[u8] = b".wh.";
const OPAQUE: &[u8] = b".wh..wh..opq";

/// How to unpack.
#[derive(Debug, Clone, Copy)]
pub struct Options {
    /// Most bytes of file content (over every call sharing the same [`Unpacked`]).
    pub max_bytes: u64,
    /// Most entries (likewise).
    pub max_entries: u64,
    /// Owners from the entries (an image's root tree) instead of the caller's.
    pub keep_owner: bool,
    /// Keep the sticky bit (an image's `/tmp`).
    pub keep_sticky: bool,
    /// Apply OCI whiteouts.
    pub whiteouts: bool,
}

/// What an unpack made (cumulative when passed to several calls).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Unpacked {
    pub entries: u64,
    pub files: u64,
    pub dirs: u64,
    pub links: u64,
    pub bytes: u64,
    /// Entries left out (devices, FIFOs, sparse files, unknown kinds).
    pub skipped: u64,
    /// Files and directories whose set-id bits were dropped.
    pub setid_dropped: u64,
    /// Whiteouts applied.
    pub whiteouts: u64,
}

/// Unpacks the tar stream `input` into the directory `root`, adding to `done`.
pub fn unpack(
    input: impl Read,
    root: &Path,
    opts: &Options,
    done: &mut Unpacked,
) -> Result<(), TreeError> {
    let tree = Tree::open(root)?;
    let mut dir_modes: Vec<(Vec<Vec<u8>>, u32)> = Vec::new();
    // Directories this archive made or named: an opaque whiteout keeps what this layer put
    // in them (names of this archive) and removes the rest.
    let mut made: HashSet<Vec<u8>> = HashSet::new();
    let mut archive = tar::Archive::new(input);
    let entries = archive
        .entries()
        .map_err(|e| err(b"archive", format!("reading: {e}")))?;
    for entry in entries {
        let mut entry = entry.map_err(|e| err(b"archive", format!("reading: {e}")))?;
        done.entries += 1;
        if done.entries > opts.max_entries {
            return Err(err(
                b"archive",
                format!("more than {} entries", opts.max_entries),
            ));
        }
        let name = entry.path_bytes().into_owned();
        // The root directory itself (`/`, as umoci writes it): nothing to make.
        if !name.is_empty() && name.iter().all(|b| *b == b'/') {
            continue;
        }
        let comps = components(&name)?;
        let Some((last, parents)) = comps.split_last() else {
            continue;
        };
        let parent = tree.dir_all(parents)?;
        if opts.whiteouts && last.starts_with(WHITEOUT) {
            if *last == OPAQUE {
                for child in tree.list(&String::from_utf8_lossy(&parents.join(&b'/')))? {
                    let mut full = parents.join(&b'/');
                    if !full.is_empty() {
                        full.push(b'/');
                    }
                    full.extend_from_slice(&child);
                    if !made.contains(&full) {
                        tree::remove_entry(&parent, &child, &full, true)?;
                    }
                }
            } else {
                let target = &last[WHITEOUT.len()..];
                if target.is_empty() || target == b"." || target == b".." {
                    return Err(err(&name, "malformed whiteout"));
                }
                tree::remove_entry(&parent, target, &name, true)?;
            }
            done.whiteouts += 1;
            continue;
        }
        made.insert(comps.join(&b'/'));
        let header = entry.header();
        let raw_mode = header.mode().unwrap_or(0o644);
        let owner = if opts.keep_owner {
            Some((
                header.uid().unwrap_or(0) as u32,
                header.gid().unwrap_or(0) as u32,
            ))
        } else {
            None
        };
        let keep = if opts.keep_sticky { 0o1777 } else { 0o777 };
        let mode = raw_mode & keep;
        let setid = raw_mode & 0o6000 != 0;
        match header.entry_type() {
            tar::EntryType::Regular | tar::EntryType::Continuous => {
                let size = entry.size();
                if done.bytes.saturating_add(size) > opts.max_bytes {
                    return Err(err(
                        &name,
                        format!("content larger than the {}-byte limit", opts.max_bytes),
                    ));
                }
                let mtime = header.mtime().ok();
                let fd = create_file(&parent, last, &name)?;
                let mut file = File::from(fd);
                let copied = std::io::copy(&mut (&mut entry).take(size), &mut file)
                    .map_err(|e| err(&name, format!("writing: {e}")))?;
                if let Some((uid, gid)) = owner {
                    nix::unistd::fchown(
                        file.as_fd(),
                        Some(Uid::from_raw(uid)),
                        Some(Gid::from_raw(gid)),
                    )
                    .map_err(|e| err(&name, format!("chown: {e}")))?;
                }
                nix::sys::stat::fchmod(file.as_fd(), Mode::from_bits_truncate(mode))
                    .map_err(|e| err(&name, format!("chmod: {e}")))?;
                if let Some(mtime) = mtime {
                    let t = std::time::UNIX_EPOCH + std::time::Duration::from_secs(mtime);
                    let _ = file.set_modified(t);
                }
                done.files += 1;
                done.bytes += copied;
                done.setid_dropped += u64::from(setid);
            }
            tar::EntryType::Directory => {
                match nix::sys::stat::mkdirat(
                    parent.as_fd(),
                    c_name(last),
                    Mode::from_bits_truncate(0o700),
                ) {
                    Ok(()) => {}
                    Err(Errno::EEXIST) => {
                        // A non-directory of a lower layer gives way to the directory.
                        if tree.dir(&comps).is_err() {
                            tree::remove_entry(&parent, last, &name, false)?;
                            nix::sys::stat::mkdirat(
                                parent.as_fd(),
                                c_name(last),
                                Mode::from_bits_truncate(0o700),
                            )
                            .map_err(|e| err(&name, format!("mkdir: {e}")))?;
                        }
                    }
                    Err(e) => return Err(err(&name, format!("mkdir: {e}"))),
                }
                // Checks it is a directory of this tree (not a symlink made by an entry).
                let fd = tree.dir(&comps)?;
                if let Some((uid, gid)) = owner {
                    nix::unistd::fchown(
                        fd.as_fd(),
                        Some(Uid::from_raw(uid)),
                        Some(Gid::from_raw(gid)),
                    )
                    .map_err(|e| err(&name, format!("chown: {e}")))?;
                }
                dir_modes.push((comps.iter().map(|c| c.to_vec()).collect(), mode));
                done.dirs += 1;
                done.setid_dropped += u64::from(setid);
            }
            tar::EntryType::Symlink => {
                let target = entry
                    .link_name_bytes()
                    .ok_or_else(|| err(&name, "symlink without a target"))?
                    .into_owned();
                if target.len() > tree::MAX_NAME || target.is_empty() || target.contains(&0) {
                    return Err(err(&name, "symlink target empty, too long or with a NUL"));
                }
                tree::remove_entry(&parent, last, &name, true)?;
                nix::unistd::symlinkat(c_name(&target), parent.as_fd(), c_name(last))
                    .map_err(|e| err(&name, format!("symlink: {e}")))?;
                if let Some((uid, gid)) = owner {
                    nix::unistd::fchownat(
                        parent.as_fd(),
                        c_name(last),
                        Some(Uid::from_raw(uid)),
                        Some(Gid::from_raw(gid)),
                        AtFlags::AT_SYMLINK_NOFOLLOW,
                    )
                    .map_err(|e| err(&name, format!("chown: {e}")))?;
                }
                done.links += 1;
            }
            tar::EntryType::Link => {
                let target = entry
                    .link_name_bytes()
                    .ok_or_else(|| err(&name, "hard link without a target"))?
                    .into_owned();
                let tcomps = components(&target)
                    .map_err(|e| err(&name, format!("hard link target refused: {}", e.reason)))?;
                let Some((tlast, tparents)) = tcomps.split_last() else {
                    return Err(err(&name, "hard link with an empty target"));
                };
                let tparent = tree.dir(tparents)?;
                if tcomps == comps {
                    continue;
                }
                tree::remove_entry(&parent, last, &name, true)?;
                nix::unistd::linkat(
                    tparent.as_fd(),
                    c_name(tlast),
                    parent.as_fd(),
                    c_name(last),
                    AtFlags::empty(),
                )
                .map_err(|e| err(&name, format!("hard link: {e}")))?;
                done.links += 1;
            }
            // PAX and GNU long-name records are consumed by the tar crate.
            _ => done.skipped += 1,
        }
    }
    // Deepest first, so a read-only directory is set after its children were made.
    dir_modes.sort_by_key(|d| std::cmp::Reverse(d.0.len()));
    for (comps, mode) in dir_modes {
        let refs: Vec<&[u8]> = comps.iter().map(Vec::as_slice).collect();
        let fd = tree.dir(&refs)?;
        nix::sys::stat::fchmod(fd.as_fd(), Mode::from_bits_truncate(mode))
            .map_err(|e| err(&comps.join(&b'/'), format!("chmod: {e}")))?;
    }
    Ok(())
}

/// Creates (or replaces) the regular file `name` in `parent`, never through a symlink.
fn create_file(parent: &OwnedFd, name: &[u8], shown: &[u8]) -> Result<OwnedFd, TreeError> {
    let flags =
        OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    let open = || {
        nix::fcntl::openat(
            parent.as_fd(),
            c_name(name),
            flags,
            Mode::from_bits_truncate(0o600),
        )
    };
    match open() {
        Ok(fd) => Ok(fd),
        Err(Errno::EEXIST) => {
            // A name given twice (or by a lower layer): the later entry wins, as with tar.
            tree::remove_entry(parent, name, shown, true)?;
            open().map_err(|e| err(shown, format!("create: {e}")))
        }
        Err(e) => Err(err(shown, format!("create: {e}"))),
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

    fn oci() -> Options {
        Options {
            max_bytes: u64::MAX,
            max_entries: 1000,
            keep_owner: true,
            keep_sticky: true,
            whiteouts: true,
        }
    }

    fn run(a: &[u8], root: &Path) -> Result<Unpacked, TreeError> {
        let mut done = Unpacked::default();
        unpack(a, root, &oci(), &mut done).map(|()| done)
    }

    #[test]
    fn test_unpack_whiteouts_remove_lower_layer_entries() {
        let dst = tempfile::tempdir().expect("dst");
        let lower = archive(|b| {
            for n in ["etc/a", "etc/b", "opq/x", "opq/y"] {
                let mut h = header(tar::EntryType::Regular, 1, 0o644);
                b.append_data(&mut h, n, &b"1"[..]).expect("file");
            }
        });
        run(&lower, dst.path()).expect("lower");
        let upper = archive(|b| {
            let mut h = header(tar::EntryType::Regular, 0, 0o644);
            b.append_data(&mut h, "etc/.wh.a", &b""[..]).expect("wh");
            let mut h = header(tar::EntryType::Directory, 0, 0o755);
            b.append_data(&mut h, "opq", &b""[..]).expect("dir");
            let mut h = header(tar::EntryType::Regular, 1, 0o644);
            b.append_data(&mut h, "opq/new", &b"2"[..]).expect("file");
            let mut h = header(tar::EntryType::Regular, 0, 0o644);
            b.append_data(&mut h, "opq/.wh..wh..opq", &b""[..])
                .expect("opq");
        });
        let got = run(&upper, dst.path()).expect("upper");
        assert_eq!(got.whiteouts, 2);
        assert!(!dst.path().join("etc/a").exists());
        assert!(dst.path().join("etc/b").exists());
        assert!(!dst.path().join("opq/x").exists() && !dst.path().join("opq/y").exists());
        assert_eq!(
            std::fs::read(dst.path().join("opq/new")).expect("new"),
            b"2"
        );
    }

    #[test]
    fn test_unpack_hostile_entries_refused_or_dropped() {
        let dst = tempfile::tempdir().expect("dst");
        let root = dst.path().join("root");
        std::fs::create_dir(&root).expect("mkdir");
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
            let e = run(&a, &root).expect_err(bad);
            assert!(e.reason.contains("refused"), "{e}");
        }
        // A symlink out of the tree, then a file written "through" it: refused.
        let a = archive(|b| {
            let mut h = header(tar::EntryType::Symlink, 0, 0o777);
            b.append_link(&mut h, "out", dst.path()).expect("link");
            let mut h = header(tar::EntryType::Regular, 1, 0o644);
            b.append_data(&mut h, "out/pwned", &b"x"[..]).expect("file");
        });
        assert!(run(&a, &root).is_err());
        assert!(!dst.path().join("pwned").exists());
        // A hard link to a file outside: refused.
        std::fs::write(dst.path().join("secret"), "s").expect("write");
        let a = archive(|b| {
            let mut h = header(tar::EntryType::Link, 0, 0o644);
            h.set_size(0);
            let name = b"../secret";
            h.as_old_mut().linkname[..name.len()].copy_from_slice(name);
            let _ = h.set_path("hard");
            h.set_cksum();
            b.append(&h, &b""[..]).expect("append");
        });
        let e = run(&a, &root).expect_err("hard link out");
        assert!(e.reason.contains("refused"), "{e}");
        assert!(!root.join("hard").exists());
        // Devices dropped, set-id bits dropped, sticky kept.
        let a = archive(|b| {
            let mut h = header(tar::EntryType::Char, 0, 0o666);
            b.append_data(&mut h, "tty", &b""[..]).expect("dev");
            let mut h = header(tar::EntryType::Regular, 2, 0o6755);
            b.append_data(&mut h, "suid", &b"hi"[..]).expect("suid");
            let mut h = header(tar::EntryType::Directory, 0, 0o1777);
            b.append_data(&mut h, "tmp", &b""[..]).expect("tmp");
        });
        let got = run(&a, &root).expect("unpack");
        assert_eq!((got.skipped, got.setid_dropped), (1, 1));
        assert!(!root.join("tty").exists());
        let mode = std::fs::metadata(root.join("suid")).expect("meta").mode();
        assert_eq!(mode & 0o7777, 0o755);
        let mode = std::fs::metadata(root.join("tmp")).expect("meta").mode();
        assert_eq!(mode & 0o7777, 0o1777);
        // The content limit.
        let a = archive(|b| {
            let mut h = header(tar::EntryType::Regular, 3, 0o644);
            b.append_data(&mut h, "big", &b"abc"[..]).expect("big");
        });
        let mut done = Unpacked::default();
        let opts = Options {
            max_bytes: 2,
            ..oci()
        };
        assert!(unpack(&a[..], &root, &opts, &mut done).is_err());
    }
}
