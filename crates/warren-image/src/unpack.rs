//! Unpacking untrusted tar archives into a directory: OCI image layers (with whiteouts) and
//! the archives `vm cp` receives from a guest.
//!
//! The `tar` crate parses; everything is created here, relative to directory descriptors
//! opened through [`crate::tree`] (`openat2` with `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS |
//! RESOLVE_NO_XDEV`), so no entry can leave the directory or write through a symlink another
//! entry (or an earlier layer) made. Rules:
//! - names: absolute paths and `..` are **refused** (the whole unpack fails); `.` components
//!   are skipped, and so is an entry for the root itself (`.`, `./` or `/`); with
//!   [`Options::only_in`], a name outside the one asked for is **refused**;
//! - regular files and directories are made with the entry's permission bits, less
//!   [`Options::mode_mask`] (directories plus [`Options::dir_mode_set`]); **set-id bits
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
//! - at most [`Options::max_entries`] entries and [`Options::max_bytes`] of file content
//!   (with [`Options::block`], of disk: each entry charged its content rounded up to whole
//!   blocks, at least one block, so a million tiny entries count as what they take);
//!   the names kept until the end (directory modes, names for opaque whiteouts) are kept
//!   once each and bounded with their bookkeeping (`MAX_NAMES_KEPT`);
//!   GNU long names and links and PAX headers are read with limits of their own (the `tar`
//!   crate would buffer them whole, whatever size a header claims); a PAX `size` that
//!   disagrees with the header, and GNU sparse entries with an extended map, are **refused**.

use std::collections::{HashMap, HashSet};
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
#[derive(Debug, Clone)]
pub struct Options {
    /// Most bytes of file content (over every call sharing the same [`Unpacked`]), or with
    /// [`Options::block`] of disk.
    pub max_bytes: u64,
    /// When not 0, [`Options::max_bytes`] counts disk blocks of this size: every entry
    /// made is charged its content rounded up to whole blocks, at least one (`vm cp`: a
    /// guest's million one-byte files or empty directories fill a disk the content sum
    /// never sees). 0: file content alone (image layers).
    pub block: u64,
    /// Most entries (likewise).
    pub max_entries: u64,
    /// Owners from the entries (an image's root tree) instead of the caller's.
    pub keep_owner: bool,
    /// Keep the sticky bit (an image's `/tmp`).
    pub keep_sticky: bool,
    /// Apply OCI whiteouts.
    pub whiteouts: bool,
    /// Permission bits cleared from every file and directory made (`vm cp`: the caller's
    /// umask, so the guest does not decide who else on the host may write its copy).
    pub mode_mask: u32,
    /// Permission bits set on every directory made, after [`Options::mode_mask`] (`vm cp`:
    /// `0o700`, so the caller can always move and remove its copy).
    pub dir_mode_set: u32,
    /// Every entry must be this name or beneath it (`vm cp`: the file or tree asked for);
    /// any other entry is **refused**. `None`: any name in the tree.
    pub only_in: Option<Vec<u8>>,
}

/// What an unpack made (cumulative when passed to several calls).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Unpacked {
    pub entries: u64,
    pub files: u64,
    pub dirs: u64,
    pub links: u64,
    pub bytes: u64,
    /// What was charged against [`Options::max_bytes`].
    pub charged: u64,
    /// Entries left out (devices, FIFOs, sparse files, unknown kinds).
    pub skipped: u64,
    /// Files and directories whose set-id bits were dropped.
    pub setid_dropped: u64,
    /// Whiteouts applied.
    pub whiteouts: u64,
}

/// Charges an entry of `size` content bytes against [`Options::max_bytes`] (see
/// [`Options::block`]); refuses it past the limit.
fn charge(opts: &Options, done: &mut Unpacked, size: u64, name: &[u8]) -> Result<(), TreeError> {
    let cost = match opts.block {
        0 => size,
        b => size.div_ceil(b).max(1).saturating_mul(b),
    };
    let total = done.charged.saturating_add(cost);
    if total > opts.max_bytes {
        let what = if opts.block == 0 {
            "content"
        } else {
            "the copy on disk"
        };
        return Err(err(
            name,
            format!("{what} larger than the {}-byte limit", opts.max_bytes),
        ));
    }
    done.charged = total;
    Ok(())
}

/// Unpacks the tar stream `input` into the directory `root`, adding to `done`.
pub fn unpack(
    input: impl Read,
    root: &Path,
    opts: &Options,
    done: &mut Unpacked,
) -> Result<(), TreeError> {
    unpack_into(input, Tree::open(root)?, opts, done)
}

/// [`unpack`] into a directory the caller holds open (`root`), so nothing is resolved
/// by path from where the caller found it.
pub fn unpack_fd(
    input: impl Read,
    root: std::os::fd::OwnedFd,
    opts: &Options,
    done: &mut Unpacked,
) -> Result<(), TreeError> {
    unpack_into(input, Tree::from_fd(root), opts, done)
}

fn unpack_into(
    input: impl Read,
    tree: Tree,
    opts: &Options,
    done: &mut Unpacked,
) -> Result<(), TreeError> {
    // Names kept for the whole archive, each once and charged with its bookkeeping
    // ([`Kept`]): directories' modes (set at the end), and with whiteouts every name this
    // archive made (an opaque whiteout keeps what this layer put in a directory and removes
    // the rest).
    let mut kept = Kept::default();
    let mut archive = tar::Archive::new(input);
    // Raw entries: the crate would read a GNU long name or link, or a PAX header, into
    // memory whole, whatever size its header claims; [`Extensions`] reads them bounded.
    let entries = archive
        .entries()
        .map_err(|e| err(b"archive", format!("reading: {e}")))?
        .raw(true);
    let mut ext = Extensions::default();
    for entry in entries {
        let mut entry = entry.map_err(|e| err(b"archive", format!("reading: {e}")))?;
        if ext.take_record(&mut entry)? {
            continue;
        }
        let meta = ext.apply(&entry)?;
        done.entries += 1;
        if done.entries > opts.max_entries {
            return Err(err(
                b"archive",
                format!("more than {} entries", opts.max_entries),
            ));
        }
        let name = meta.name;
        // The root directory itself (`/`, as umoci writes it): nothing to make.
        if !name.is_empty() && name.iter().all(|b| *b == b'/') {
            continue;
        }
        let comps = components(&name)?;
        let Some((last, parents)) = comps.split_last() else {
            continue;
        };
        if let Some(top) = &opts.only_in {
            if comps.first().copied() != Some(top.as_slice()) {
                return Err(err(
                    &name,
                    "refused: the entry is outside what was asked for",
                ));
            }
        }
        // One lookup when the parents exist (the usual case), so a deep name repeated costs
        // one path walk, not a mkdir and an open per component.
        let parent = match tree.dir(parents) {
            Ok(fd) => fd,
            Err(_) => tree.dir_all(parents)?,
        };
        if opts.whiteouts && last.starts_with(WHITEOUT) {
            if *last == OPAQUE {
                // Listed through the descriptor: a name is bytes, not necessarily UTF-8.
                let listed = parent.try_clone().map_err(|e| err(&name, e))?;
                for child in tree::list_fd(listed, &name)? {
                    let mut full = parents.join(&b'/');
                    if !full.is_empty() {
                        full.push(b'/');
                    }
                    full.extend_from_slice(&child);
                    if !kept.made.contains(&full) {
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
        let joined = comps.join(&b'/');
        if opts.whiteouts {
            kept.mark_made(&joined)?;
        }
        let header = entry.header();
        let raw_mode = header.mode().unwrap_or(0o644);
        let owner = if opts.keep_owner {
            Some((meta.uid, meta.gid))
        } else {
            None
        };
        let keep = if opts.keep_sticky { 0o1777 } else { 0o777 };
        let mode = raw_mode & keep & !opts.mode_mask;
        let setid = raw_mode & 0o6000 != 0;
        let kind = header.entry_type();
        let makes = matches!(
            kind,
            tar::EntryType::Regular
                | tar::EntryType::Continuous
                | tar::EntryType::Directory
                | tar::EntryType::Symlink
                | tar::EntryType::Link
        );
        if makes {
            charge(opts, done, entry.size(), &name)?;
        }
        match kind {
            tar::EntryType::Regular | tar::EntryType::Continuous => {
                let size = entry.size();
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
                // A time the host's clock cannot hold (a header may say 2^64 - 1 seconds) is
                // not kept: adding it unchecked panics.
                let time = mtime.and_then(|m| {
                    std::time::UNIX_EPOCH.checked_add(std::time::Duration::from_secs(m))
                });
                if let Some(t) = time {
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
                kept.dir_mode(joined, mode | opts.dir_mode_set)?;
                done.dirs += 1;
                done.setid_dropped += u64::from(setid);
            }
            tar::EntryType::Symlink => {
                let target = meta
                    .link
                    .ok_or_else(|| err(&name, "symlink without a target"))?;
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
                let target = meta
                    .link
                    .ok_or_else(|| err(&name, "hard link without a target"))?;
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
            // PAX and GNU long-name records were consumed by [`Extensions`].
            _ => done.skipped += 1,
        }
    }
    if !ext.is_empty() {
        return Err(err(
            b"archive",
            "an extension record describes no entry (the archive ends after it)",
        ));
    }
    // Deepest first, so a read-only directory is set after its children were made.
    let mut dir_modes: Vec<(Vec<u8>, u32)> = kept.dir_modes.into_iter().collect();
    dir_modes.sort_by_key(|d| std::cmp::Reverse(d.0.iter().filter(|b| **b == b'/').count()));
    for (name, mode) in dir_modes {
        let fd = tree.dir(&components(&name)?)?;
        nix::sys::stat::fchmod(fd.as_fd(), Mode::from_bits_truncate(mode))
            .map_err(|e| err(&name, format!("chmod: {e}")))?;
    }
    Ok(())
}

/// Bytes of bookkeeping charged for each name kept besides the name itself (its `Vec`, the
/// table's slot and the allocator's rounding), so [`MAX_NAMES_KEPT`] bounds the memory kept,
/// not only the names' bytes.
const KEPT_OVERHEAD: u64 = 64;

/// The names one archive keeps until its end, each once (an entry repeated, as a hostile
/// archive may repeat a 4 KiB name a million times, keeps nothing more), within
/// [`MAX_NAMES_KEPT`].
#[derive(Default)]
struct Kept {
    /// Directories' modes by name (the last entry's wins, as with tar).
    dir_modes: HashMap<Vec<u8>, u32>,
    /// Every name made (for opaque whiteouts).
    made: HashSet<Vec<u8>>,
    bytes: u64,
}

impl Kept {
    fn charge(&mut self, name: &[u8]) -> Result<(), TreeError> {
        self.bytes += name.len() as u64 + KEPT_OVERHEAD;
        if self.bytes > MAX_NAMES_KEPT {
            return Err(err(
                b"archive",
                format!("more than {MAX_NAMES_KEPT} bytes of names"),
            ));
        }
        Ok(())
    }

    fn mark_made(&mut self, name: &[u8]) -> Result<(), TreeError> {
        if !self.made.contains(name) {
            self.charge(name)?;
            self.made.insert(name.to_vec());
        }
        Ok(())
    }

    fn dir_mode(&mut self, name: Vec<u8>, mode: u32) -> Result<(), TreeError> {
        if let Some(m) = self.dir_modes.get_mut(&name) {
            *m = mode;
            return Ok(());
        }
        self.charge(&name)?;
        self.dir_modes.insert(name, mode);
        Ok(())
    }
}

/// Largest GNU long name or long link record read (a name is at most [`tree::MAX_NAME`]).
const MAX_LONG_NAME: u64 = tree::MAX_NAME as u64 + 1;
/// Largest PAX extended header read (names, owners, times, extended attributes).
const MAX_PAX: u64 = 1 << 20;
/// Most bytes of entry names (with [`KEPT_OVERHEAD`] each) one archive may make the
/// unpacker keep in memory.
const MAX_NAMES_KEPT: u64 = 256 << 20;

/// An entry's name, link target and owner after its extension records.
struct EntryMeta {
    name: Vec<u8>,
    link: Option<Vec<u8>>,
    uid: u32,
    gid: u32,
}

/// The GNU long name and long link records and the PAX extended header that describe the
/// next entry, each read with a size limit (the `tar` crate, iterating normally, would read
/// them whole into memory: a header may claim gigabytes). The precedence is the crate's: a
/// GNU long name over a PAX `path` over the header's name (likewise for link targets).
#[derive(Default)]
struct Extensions {
    long_name: Option<Vec<u8>>,
    long_link: Option<Vec<u8>>,
    pax: Option<Vec<u8>>,
}

impl Extensions {
    fn is_empty(&self) -> bool {
        self.long_name.is_none() && self.long_link.is_none() && self.pax.is_none()
    }

    /// If `entry` is an extension record, reads it (bounded) and returns true.
    fn take_record<R: Read>(&mut self, entry: &mut tar::Entry<'_, R>) -> Result<bool, TreeError> {
        let kind = entry.header().entry_type();
        let (slot, limit, what) = if kind.is_gnu_longname() {
            (&mut self.long_name, MAX_LONG_NAME, "GNU long name")
        } else if kind.is_gnu_longlink() {
            (&mut self.long_link, MAX_LONG_NAME, "GNU long link")
        } else if kind.is_pax_local_extensions() {
            (&mut self.pax, MAX_PAX, "PAX header")
        } else {
            return Ok(false);
        };
        let size = entry.size();
        if size > limit {
            return Err(err(
                b"archive",
                format!("extension record ({what}) of {size} bytes, over the {limit}-byte limit"),
            ));
        }
        if slot.is_some() {
            return Err(err(
                b"archive",
                format!("two extension records ({what}) for one entry"),
            ));
        }
        let mut data = Vec::new();
        entry
            .take(limit)
            .read_to_end(&mut data)
            .map_err(|e| err(b"archive", format!("reading an extension record: {e}")))?;
        *slot = Some(data);
        Ok(true)
    }

    /// The name, link target and owner of `entry` (a real entry), consuming the records.
    fn apply<R: Read>(&mut self, entry: &tar::Entry<'_, R>) -> Result<EntryMeta, TreeError> {
        let header = entry.header();
        if header.as_gnu().is_some_and(|g| g.is_extended()) {
            return Err(err(
                &header.path_bytes(),
                "a GNU sparse file with an extended map (not supported)",
            ));
        }
        let strip = |mut v: Vec<u8>| {
            while v.last() == Some(&0) {
                v.pop();
            }
            v
        };
        let (mut pax_path, mut pax_link, mut uid, mut gid) = (None, None, None, None);
        if let Some(pax) = self.pax.take() {
            for rec in tar::PaxExtensions::new(&pax) {
                let rec = rec.map_err(|e| err(b"archive", format!("PAX header: {e}")))?;
                let number = || {
                    rec.value()
                        .ok()
                        .and_then(|v| v.parse::<u32>().ok())
                        .ok_or_else(|| err(b"archive", "PAX header: an owner is not a number"))
                };
                match rec.key_bytes() {
                    b"path" => pax_path = Some(rec.value_bytes().to_vec()),
                    b"linkpath" => pax_link = Some(rec.value_bytes().to_vec()),
                    b"uid" => uid = Some(number()?),
                    b"gid" => gid = Some(number()?),
                    b"size" => {
                        let size = rec.value().ok().and_then(|v| v.parse::<u64>().ok());
                        if size != Some(entry.size()) {
                            return Err(err(
                                &header.path_bytes(),
                                "the PAX size differs from the header's size (refused: parsers \
                                 would disagree on where the next entry starts)",
                            ));
                        }
                    }
                    _ => {}
                }
            }
        }
        let name = match (self.long_name.take(), pax_path) {
            (Some(n), _) => strip(n),
            (None, Some(p)) => p,
            (None, None) => header.path_bytes().into_owned(),
        };
        let link = match (self.long_link.take(), pax_link) {
            (Some(l), _) => Some(strip(l)),
            (None, Some(l)) => Some(l),
            (None, None) => header.link_name_bytes().map(|l| l.into_owned()),
        };
        Ok(EntryMeta {
            name,
            link,
            uid: uid.unwrap_or_else(|| header.uid().unwrap_or(0) as u32),
            gid: gid.unwrap_or_else(|| header.gid().unwrap_or(0) as u32),
        })
    }
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
    use std::os::unix::ffi::OsStrExt;
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
            block: 0,
            max_entries: 1000,
            keep_owner: true,
            keep_sticky: true,
            whiteouts: true,
            mode_mask: 0,
            dir_mode_set: 0,
            only_in: None,
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
            block: 0,
            ..oci()
        };
        assert!(unpack(&a[..], &root, &opts, &mut done).is_err());
    }

    /// A reader that counts the bytes taken from it.
    struct Counting<R> {
        inner: R,
        taken: std::rc::Rc<std::cell::Cell<u64>>,
    }

    impl<R: Read> Read for Counting<R> {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            let n = self.inner.read(buf)?;
            self.taken.set(self.taken.get() + n as u64);
            Ok(n)
        }
    }

    /// A modification time past what the host's clock type holds (a GNU base-256 field can
    /// say 2^64 - 1 seconds) is not kept; before, adding it to the epoch panicked on input.
    #[test]
    fn test_unpack_absurd_modification_time_is_dropped_not_a_panic() {
        let dst = tempfile::tempdir().expect("dst");
        let a = archive(|b| {
            let mut h = header(tar::EntryType::Regular, 1, 0o644);
            h.set_mtime(u64::MAX);
            b.append_data(&mut h, "late", &b"x"[..]).expect("late");
            let mut h = header(tar::EntryType::Regular, 1, 0o644);
            h.set_mtime(1_000_000);
            b.append_data(&mut h, "dated", &b"y"[..]).expect("dated");
        });
        assert_eq!(
            tar::Archive::new(&a[..])
                .entries()
                .expect("entries")
                .next()
                .expect("first")
                .expect("entry")
                .header()
                .mtime()
                .expect("mtime"),
            u64::MAX,
            "the archive carries the absurd time"
        );
        let got = run(&a, dst.path()).expect("unpack");
        assert_eq!(got.files, 2);
        assert_eq!(std::fs::read(dst.path().join("late")).expect("late"), b"x");
        let dated = std::fs::metadata(dst.path().join("dated")).expect("dated");
        assert_eq!(dated.mtime(), 1_000_000);
    }

    #[test]
    fn test_unpack_opaque_whiteout_in_a_non_utf8_directory() {
        let dst = tempfile::tempdir().expect("dst");
        let raw = |b: &mut tar::Builder<Vec<u8>>, name: &[u8]| {
            let mut h = header(tar::EntryType::Regular, 0, 0o644);
            h.as_old_mut().name[..name.len()].copy_from_slice(name);
            h.set_cksum();
            b.append(&h, &b""[..]).expect("append");
        };
        let lower = archive(|b| raw(b, b"d\xff/old"));
        run(&lower, dst.path()).expect("lower");
        let upper = archive(|b| raw(b, b"d\xff/.wh..wh..opq"));
        run(&upper, dst.path()).expect("upper");
        let dir = dst.path().join(std::ffi::OsStr::from_bytes(b"d\xff"));
        assert!(dir.is_dir());
        assert!(!dir.join("old").exists());
    }

    #[test]
    fn test_unpack_extension_records_bounded_in_memory() {
        // A GNU long name or link, or a PAX header, is read into memory: a hostile layer (or a
        // guest's `vm cp` archive) claiming gigabytes must be refused after a bounded read,
        // never buffered whole. 64 MiB here stands for the 8 GiB a header can claim.
        let dst = tempfile::tempdir().expect("dst");
        let claimed: u64 = 64 << 20;
        for kind in [
            tar::EntryType::GNULongName,
            tar::EntryType::GNULongLink,
            tar::EntryType::XHeader,
        ] {
            let mut h = header(kind, claimed, 0o644);
            h.set_path("././@LongLink").expect("path");
            h.set_cksum();
            let input = std::io::Read::chain(
                std::io::Cursor::new(h.as_bytes().to_vec()),
                std::io::repeat(b'a').take(claimed),
            );
            let taken = std::rc::Rc::new(std::cell::Cell::new(0));
            let counted = Counting {
                inner: input,
                taken: taken.clone(),
            };
            let mut done = Unpacked::default();
            let e = unpack(counted, dst.path(), &oci(), &mut done).expect_err("refused");
            assert!(
                taken.get() < 2 << 20,
                "{kind:?}: read {} bytes before refusing ({e})",
                taken.get()
            );
            assert!(e.reason.contains("extension record"), "{kind:?}: {e}");
        }
    }

    #[test]
    fn test_unpack_long_names_and_pax_records_apply() {
        let dst = tempfile::tempdir().expect("dst");
        let long_dir = "d".repeat(150);
        let long_file = format!("{long_dir}/{}", "f".repeat(150));
        let long_target = "t".repeat(200);
        let a = archive(|b| {
            // GNU long name and long link (the builder writes them for long paths).
            let mut h = header(tar::EntryType::Regular, 2, 0o644);
            b.append_data(&mut h, &long_file, &b"ok"[..]).expect("long");
            let mut h = header(tar::EntryType::Symlink, 0, 0o777);
            b.append_link(&mut h, "ln", &long_target).expect("longlink");
            // PAX path, linkpath, uid and gid.
            b.append_pax_extensions([
                ("path", &b"pax/named"[..]),
                ("uid", &b"1234"[..]),
                ("gid", &b"4321"[..]),
            ])
            .expect("pax");
            let mut h = header(tar::EntryType::Regular, 1, 0o644);
            b.append_data(&mut h, "short", &b"p"[..]).expect("short");
            b.append_pax_extensions([("linkpath", &b"pax/named"[..])])
                .expect("pax");
            let mut h = header(tar::EntryType::Symlink, 0, 0o777);
            b.append_link(&mut h, "plink", "x").expect("plink");
        });
        let got = run(&a, dst.path()).expect("unpack");
        assert_eq!((got.files, got.links), (2, 2));
        assert_eq!(
            std::fs::read(dst.path().join(&long_file)).expect("long"),
            b"ok"
        );
        assert_eq!(
            std::fs::read_link(dst.path().join("ln")).expect("ln"),
            Path::new(&long_target)
        );
        let meta = std::fs::metadata(dst.path().join("pax/named")).expect("pax");
        assert!(!dst.path().join("short").exists());
        if nix::unistd::geteuid().is_root() {
            assert_eq!((meta.uid(), meta.gid()), (1234, 4321));
        }
        assert_eq!(
            std::fs::read_link(dst.path().join("plink")).expect("plink"),
            Path::new("pax/named")
        );
        // A PAX size that disagrees with the header: two parsers would see two archives.
        let a = archive(|b| {
            b.append_pax_extensions([("size", &b"5"[..])]).expect("pax");
            let mut h = header(tar::EntryType::Regular, 1, 0o644);
            b.append_data(&mut h, "sized", &b"x"[..]).expect("sized");
        });
        let e = run(&a, dst.path()).expect_err("pax size");
        assert!(e.reason.contains("size"), "{e}");
        // An extension record with no entry after it.
        let a = archive(|b| {
            b.append_pax_extensions([("path", &b"dangling"[..])])
                .expect("pax");
        });
        assert!(run(&a, dst.path()).is_err());
    }
}
