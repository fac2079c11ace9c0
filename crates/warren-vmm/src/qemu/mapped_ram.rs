//! A fork's copies map the parent's saved RAM instead of loading it.
//!
//! A checkpoint written with QEMU's `mapped-ram` capability keeps each RAM block's pages at
//! fixed offsets of the file: after the block's header comes a bitmap of the pages written,
//! then (1 MiB aligned) the block's pages, each at its guest offset; a page never written (a
//! zero page) is a hole that reads as zeros. The region is thus the block's whole content,
//! and a copy can map it privately (`memory-backend-file,offset=`, copy-on-write) instead of
//! reading every page into memory of its own. [`detach_block`] finds the region of guest RAM
//! and clears its bitmap, so the restore reads no page of it and loads only device state and
//! the small blocks (firmware, ROMs) into memory.
//!
//! Written by hand: no crate reads QEMU's migration stream, and only one header is needed.
//! It is found by its exact bytes (the block's name, its length, format version 1, 4 KiB
//! pages) in the file's first [`HEAD`] bytes, must occur once, and every offset in it is
//! checked against the layout QEMU writes and the file's length. The file was written by the
//! parent's VMM: whatever it holds only ever reaches the parent's own copies.

use std::fs::OpenOptions;
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;

/// The RAM block of a microvm whose memory is the machine's own (no `memory-backend=`).
pub const DEFAULT_RAM_ID: &str = "microvm.ram";
/// Bytes of the file searched for the block's header.
pub const HEAD: usize = 64 << 10;
const VERSION: u32 = 1;
const PAGE: u64 = 4096;
/// The pages region's alignment in the file.
const ALIGN: u64 = 1 << 20;
/// Bytes a checkpoint may hold past its guest RAM (the firmware and ROM blocks, each 1 MiB
/// aligned, and device state: ~5 MiB for a microvm).
pub const SLACK: u64 = 64 << 20;
/// Version, page size, bitmap offset, pages offset.
const HEADER_LEN: u64 = 4 + 8 + 8 + 8;

/// Where a RAM block's bitmap and pages are in a `mapped-ram` checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockRegion {
    pub bitmap_offset: u64,
    pub bitmap_len: u64,
    pub pages_offset: u64,
}

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg)
}

/// The region of block `name` (`len` bytes of RAM) in a checkpoint of `file_len` bytes
/// whose first bytes are `head`.
pub fn find_block(head: &[u8], name: &str, len: u64, file_len: u64) -> io::Result<BlockRegion> {
    let name_len = u8::try_from(name.len())
        .ok()
        .filter(|n| *n > 0)
        .ok_or_else(|| invalid(format!("RAM block name {name:?}")))?;
    if len == 0 || !len.is_multiple_of(PAGE) {
        return Err(invalid(format!("RAM block length {len}")));
    }
    let mut needle = Vec::with_capacity(1 + name.len() + 8 + 4 + 8);
    needle.push(name_len);
    needle.extend_from_slice(name.as_bytes());
    needle.extend_from_slice(&len.to_be_bytes());
    needle.extend_from_slice(&VERSION.to_be_bytes());
    needle.extend_from_slice(&PAGE.to_be_bytes());
    let head = &head[..head.len().min(HEAD)];
    let mut found = head
        .windows(needle.len())
        .enumerate()
        .filter(|(_, w)| *w == needle.as_slice())
        .map(|(i, _)| i);
    let at = found
        .next()
        .ok_or_else(|| invalid(format!("no mapped-ram header of RAM block {name:?}")))?;
    if found.next().is_some() {
        return Err(invalid(format!(
            "more than one mapped-ram header of RAM block {name:?}"
        )));
    }
    let offsets = at + needle.len();
    let word = |i: usize| -> io::Result<u64> {
        head.get(offsets + 8 * i..offsets + 8 * (i + 1))
            .and_then(|b| <[u8; 8]>::try_from(b).ok())
            .map(u64::from_be_bytes)
            .ok_or_else(|| invalid("mapped-ram header cut short".into()))
    };
    let (bitmap_offset, pages_offset) = (word(0)?, word(1)?);
    // The header starts after the name and length; the bitmap right after the header.
    let header_at = (at + 1 + name.len() + 8) as u64;
    let pages = len / PAGE;
    let bitmap_len = pages.div_ceil(64) * 8;
    let expect_pages = (header_at + HEADER_LEN + bitmap_len).next_multiple_of(ALIGN);
    if bitmap_offset != header_at + HEADER_LEN || pages_offset != expect_pages {
        return Err(invalid(format!(
            "mapped-ram header of {name:?}: bitmap at {bitmap_offset}, pages at {pages_offset}; \
             expected {} and {expect_pages}",
            header_at + HEADER_LEN
        )));
    }
    match pages_offset.checked_add(len) {
        Some(end) if end <= file_len => Ok(BlockRegion {
            bitmap_offset,
            bitmap_len,
            pages_offset,
        }),
        _ => Err(invalid(format!(
            "RAM block {name:?} runs past the checkpoint's end ({file_len} bytes)"
        ))),
    }
}

/// The name of guest RAM's block (`mem` or [`DEFAULT_RAM_ID`], `len` bytes) in the
/// `mapped-ram` checkpoint at `path`, when exactly one of them is found: a restore must
/// name its RAM as the checkpoint does. `None` when neither or both are (or on any error).
pub fn guest_ram_block(path: &Path, len: u64) -> Option<&'static str> {
    let f = crate::sys::vmm_file::open_regular(path).ok()?;
    let file_len = f.metadata().ok()?.len();
    let mut head = vec![0u8; HEAD.min(usize::try_from(file_len).ok()?)];
    f.read_exact_at(&mut head, 0).ok()?;
    let found: Vec<&'static str> = ["mem", DEFAULT_RAM_ID]
        .into_iter()
        .filter(|n| find_block(&head, n, len, file_len).is_ok())
        .collect();
    match found.as_slice() {
        [one] => Some(one),
        _ => None,
    }
}

/// Clears block `name`'s page bitmap in checkpoint `path` (a regular file reached without a
/// final symlink, at most `len` + [`SLACK`] bytes: the copies keep it as long as they run)
/// so a restore reads none of its pages, and returns the offset of its pages region, which
/// the restored VMM maps as the block instead. Call it once no other process can write the
/// file (`sys::vmm_file::refuse_writers`); the open never waits (`O_NONBLOCK`: a lease
/// another process holds refuses it instead of blocking until the lease breaks).
pub fn detach_block(path: &Path, name: &str, len: u64) -> io::Result<u64> {
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)?;
    let meta = f.metadata()?;
    if !meta.is_file() {
        return Err(invalid(format!("{} is not a regular file", path.display())));
    }
    if meta.len() > len.saturating_add(SLACK) {
        return Err(invalid(format!(
            "the checkpoint is {} bytes, more than {len} bytes of RAM allow",
            meta.len()
        )));
    }
    let mut head = vec![0u8; HEAD.min(usize::try_from(meta.len()).unwrap_or(HEAD))];
    f.read_exact_at(&mut head, 0)?;
    let r = find_block(&head, name, len, meta.len())?;
    // At most 4 KiB per 128 MiB of RAM.
    let zeros = vec![0u8; usize::try_from(r.bitmap_len).map_err(|e| invalid(e.to_string()))?];
    f.write_all_at(&zeros, r.bitmap_offset)?;
    Ok(r.pages_offset)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file laid out as QEMU writes one: stream bytes, the block's name, length and header,
    /// the bitmap, then the pages at 1 MiB.
    fn checkpoint(name: &str, len: u64, prefix: usize) -> (Vec<u8>, BlockRegion) {
        let mut b = vec![0x5a; prefix];
        b.push(name.len() as u8);
        b.extend_from_slice(name.as_bytes());
        b.extend_from_slice(&len.to_be_bytes());
        let header_at = b.len() as u64;
        let bitmap_offset = header_at + HEADER_LEN;
        let bitmap_len = (len / PAGE).div_ceil(64) * 8;
        let pages_offset = (bitmap_offset + bitmap_len).next_multiple_of(ALIGN);
        b.extend_from_slice(&VERSION.to_be_bytes());
        b.extend_from_slice(&PAGE.to_be_bytes());
        b.extend_from_slice(&bitmap_offset.to_be_bytes());
        b.extend_from_slice(&pages_offset.to_be_bytes());
        b.resize((bitmap_offset + bitmap_len) as usize, 0xff);
        (
            b,
            BlockRegion {
                bitmap_offset,
                bitmap_len,
                pages_offset,
            },
        )
    }

    #[test]
    fn test_find_block_reads_qemu_layout() {
        let (b, want) = checkpoint("microvm.ram", 512 << 20, 0x5c);
        let got = find_block(
            &b,
            "microvm.ram",
            512 << 20,
            want.pages_offset + (512 << 20),
        )
        .expect("found");
        assert_eq!(got, want);
        // The layout seen in a real QEMU 10.0 checkpoint of a 512 MiB microvm.
        assert_eq!(got.bitmap_offset, 0x8c);
        assert_eq!(got.pages_offset, 0x10_0000);
        assert_eq!(got.bitmap_len, 16384);
    }

    #[test]
    fn test_find_block_refuses_wrong_name_length_or_short_file() {
        let (b, want) = checkpoint("mem", 256 << 20, 100);
        let end = want.pages_offset + (256 << 20);
        assert!(find_block(&b, "mem", 256 << 20, end).is_ok());
        assert!(
            find_block(&b, "mem", 512 << 20, end).is_err(),
            "other length"
        );
        assert!(
            find_block(&b, "microvm.ram", 256 << 20, end).is_err(),
            "other name"
        );
        assert!(
            find_block(&b, "mem", 256 << 20, end - 1).is_err(),
            "past the end"
        );
        assert!(find_block(&b, "", 256 << 20, end).is_err(), "empty name");
    }

    #[test]
    fn test_find_block_refuses_offsets_qemu_would_not_write() {
        for (field, value) in [(0usize, 0x8du64), (1, 0x20_0000), (1, u64::MAX)] {
            let (mut b, want) = checkpoint("mem", 256 << 20, 10);
            let at = want.bitmap_offset as usize - 16 + 8 * field;
            b[at..at + 8].copy_from_slice(&value.to_be_bytes());
            assert!(
                find_block(&b, "mem", 256 << 20, u64::MAX).is_err(),
                "field {field} = {value:#x}"
            );
        }
    }

    #[test]
    fn test_find_block_refuses_two_headers() {
        let (mut b, want) = checkpoint("mem", 256 << 20, 10);
        let one = b[10..want.bitmap_offset as usize].to_vec();
        b.truncate(want.bitmap_offset as usize);
        b.extend_from_slice(&one);
        assert!(find_block(&b, "mem", 256 << 20, u64::MAX).is_err());
    }

    #[test]
    fn test_detach_block_clears_only_the_bitmap() {
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("state");
        let len = 8u64 << 20;
        let (mut b, want) = checkpoint("mem", len, 64);
        b.resize((want.pages_offset + len) as usize, 0x77);
        std::fs::write(&path, &b).expect("write");
        // Positive control of the size bound: the same file grown past it is refused.
        let big = dir.path().join("big");
        std::fs::write(&big, &b).expect("write");
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&big)
            .expect("open");
        f.set_len(len + SLACK + 1).expect("grow");
        assert!(detach_block(&big, "mem", len).is_err(), "oversized");
        assert_eq!(
            detach_block(&path, "mem", len).expect("detach"),
            want.pages_offset
        );
        let after = std::fs::read(&path).expect("read");
        let bm = want.bitmap_offset as usize..(want.bitmap_offset + want.bitmap_len) as usize;
        assert!(after[bm.clone()].iter().all(|x| *x == 0));
        assert_eq!(after[..bm.start], b[..bm.start]);
        assert_eq!(after[bm.end..], b[bm.end..]);
        assert_eq!(guest_ram_block(&path, len), Some("mem"));
        assert_eq!(guest_ram_block(&path, len * 2), None, "other length");
        // A symlink is not followed.
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&path, &link).expect("symlink");
        assert!(detach_block(&link, "mem", len).is_err());
    }
}
