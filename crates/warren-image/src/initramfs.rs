//! Uncompressed cpio "newc" archives: the base initramfs and the per-VM secret archive.
//!
//! Layout of the base archive: directories `/dev /proc /sys /newroot /warren /etc/warren
//! /lib/modules`, `/init` (the agent, 0755), `/lib/modules/<name>.ko` and
//! `/etc/warren/modules` (one module path per line, in load order).
//!
//! The kernel unpacks concatenated archives in order, skipping zero padding between them as
//! long as every archive starts 4-byte aligned; [`write_vm_initramfs`] relies on that to append
//! `/warren/secret` after the shared base. Every archive written here ends with a
//! `TRAILER!!!` entry and is zero-padded to a multiple of 512 bytes.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use crate::ImageError;

/// Path (inside the initramfs) of the module list read by the agent.
pub const MODULE_LIST_PATH: &str = "etc/warren/modules";
/// Directory (inside the initramfs) holding the plain `.ko` files.
pub const MODULE_DIR: &str = "lib/modules";
/// Path (inside the initramfs) of the per-VM secret.
pub const SECRET_PATH: &str = "warren/secret";
/// Required length of the per-VM secret.
pub const SECRET_LEN: usize = 32;

const S_IFDIR: u32 = 0o040000;
const S_IFREG: u32 = 0o100000;
const TRAILER: &str = "TRAILER!!!";
const NEWC_MAGIC: &[u8; 6] = b"070701";
const HEADER_LEN: usize = 110;

/// Builds a newc archive in memory. Entries get increasing inode numbers, mtime 0 and
/// uid/gid 0, so equal input yields byte-identical output.
#[derive(Debug, Default)]
pub struct CpioWriter {
    buf: Vec<u8>,
    next_ino: u32,
}

impl CpioWriter {
    /// An empty archive.
    pub fn new() -> Self {
        CpioWriter {
            buf: Vec::new(),
            next_ino: 1,
        }
    }

    /// Adds a directory (`name` without leading slash; parents must be added first).
    pub fn dir(&mut self, name: &str, perm: u32) {
        self.entry(name, S_IFDIR | (perm & 0o7777), 2, &[]);
    }

    /// Adds a regular file.
    pub fn file(&mut self, name: &str, perm: u32, data: &[u8]) {
        self.entry(name, S_IFREG | (perm & 0o7777), 1, data);
    }

    /// Appends the trailer, pads to 512 bytes and returns the archive.
    pub fn finish(mut self) -> Vec<u8> {
        self.header(TRAILER, 0, 0, 1, 0);
        self.pad_to(512);
        self.buf
    }

    fn entry(&mut self, name: &str, mode: u32, nlink: u32, data: &[u8]) {
        let ino = self.next_ino;
        self.next_ino += 1;
        self.header(name, ino, mode, nlink, data.len());
        self.buf.extend_from_slice(data);
        self.pad_to(4);
    }

    fn header(&mut self, name: &str, ino: u32, mode: u32, nlink: u32, size: usize) {
        let name = name.trim_start_matches('/');
        let fields: [u64; 13] = [
            u64::from(ino),
            u64::from(mode),
            0, // uid
            0, // gid
            u64::from(nlink),
            0, // mtime
            size as u64,
            0, // devmajor
            0, // devminor
            0, // rdevmajor
            0, // rdevminor
            (name.len() + 1) as u64,
            0, // check
        ];
        self.buf.extend_from_slice(NEWC_MAGIC);
        for f in fields {
            self.buf.extend_from_slice(format!("{f:08x}").as_bytes());
        }
        self.buf.extend_from_slice(name.as_bytes());
        self.buf.push(0);
        self.pad_to(4);
    }

    fn pad_to(&mut self, align: usize) {
        let rem = self.buf.len() % align;
        if rem != 0 {
            self.buf.resize(self.buf.len() + align - rem, 0);
        }
    }
}

/// The inputs of a base initramfs.
#[derive(Debug)]
pub struct BaseInitramfs<'a> {
    /// The agent binary, installed as `/init`.
    pub agent: &'a [u8],
    /// `(file name, plain .ko bytes)` in load order.
    pub modules: &'a [(String, Vec<u8>)],
}

impl BaseInitramfs<'_> {
    /// Serializes the base archive.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut w = CpioWriter::new();
        for d in [
            "dev",
            "proc",
            "sys",
            "newroot",
            "etc",
            "etc/warren",
            "lib",
            MODULE_DIR,
        ] {
            w.dir(d, 0o755);
        }
        w.dir("warren", 0o700);
        w.file("init", 0o755, self.agent);
        let mut list = String::new();
        for (name, bytes) in self.modules {
            let path = format!("{MODULE_DIR}/{name}");
            w.file(&path, 0o644, bytes);
            list.push('/');
            list.push_str(&path);
            list.push('\n');
        }
        w.file(MODULE_LIST_PATH, 0o644, list.as_bytes());
        w.finish()
    }
}

/// The small archive appended per VM: `/warren/secret`, mode 0400.
pub fn secret_archive(secret: &[u8]) -> Result<Vec<u8>, ImageError> {
    if secret.len() != SECRET_LEN {
        return Err(ImageError::InvalidInput(format!(
            "secret must be {SECRET_LEN} bytes, got {}",
            secret.len()
        )));
    }
    let mut w = CpioWriter::new();
    w.dir("warren", 0o700);
    w.file(SECRET_PATH, 0o400, secret);
    Ok(w.finish())
}

/// Writes `out` = the base initramfs at `base` followed by an archive holding `/warren/secret`.
/// `out` is created with mode 0400 (it carries the secret) and replaced if it exists.
pub fn write_vm_initramfs(base: &Path, secret: &[u8], out: &Path) -> Result<(), ImageError> {
    let extra = secret_archive(secret)?;
    let mut src = File::open(base).map_err(ImageError::io("open", base))?;
    let base_len = src.metadata().map_err(ImageError::io("stat", base))?.len();
    if base_len % 4 != 0 {
        return Err(ImageError::InvalidInput(format!(
            "base initramfs {} is not 4-byte aligned",
            base.display()
        )));
    }
    match std::fs::remove_file(out) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(ImageError::io("remove", out)(e)),
    }
    let mut dst = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o400)
        .open(out)
        .map_err(ImageError::io("create", out))?;
    std::io::copy(&mut src, &mut dst).map_err(ImageError::io("copy to", out))?;
    dst.write_all(&extra)
        .map_err(ImageError::io("write", out))?;
    dst.flush().map_err(ImageError::io("write", out))?;
    Ok(())
}

/// One parsed archive member (used by tests and by image import checks).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CpioEntry {
    pub name: String,
    pub mode: u32,
    pub data: Vec<u8>,
}

/// Parses one or more concatenated newc archives the way the kernel does: entries until
/// `TRAILER!!!`, then zero padding, then possibly another archive.
pub fn parse_newc(mut buf: &[u8]) -> Result<Vec<CpioEntry>, String> {
    let mut out = Vec::new();
    let mut archives = 0;
    let total = buf.len();
    loop {
        while let Some((&0, rest)) = buf.split_first() {
            buf = rest;
        }
        if buf.is_empty() {
            break;
        }
        if !(total - buf.len()).is_multiple_of(4) {
            return Err("archive does not start 4-byte aligned".into());
        }
        archives += 1;
        // One archive.
        loop {
            let pos = total - buf.len();
            if buf.len() < HEADER_LEN || &buf[..6] != NEWC_MAGIC {
                return Err(format!("bad header at offset {pos}"));
            }
            let field = |i: usize| -> Result<usize, String> {
                let s = std::str::from_utf8(&buf[6 + i * 8..14 + i * 8])
                    .map_err(|_| format!("non-ascii header at {pos}"))?;
                usize::from_str_radix(s, 16).map_err(|_| format!("bad hex at {pos}"))
            };
            let mode = field(1)? as u32;
            let size = field(6)?;
            let namesize = field(11)?;
            let name_end = HEADER_LEN + namesize;
            let data_start = name_end.div_ceil(4) * 4;
            let data_end = data_start + size;
            if buf.len() < data_end || namesize == 0 || buf[name_end - 1] != 0 {
                return Err(format!("truncated entry at {pos}"));
            }
            let name = String::from_utf8_lossy(&buf[HEADER_LEN..name_end - 1]).into_owned();
            let data = buf[data_start..data_end].to_vec();
            buf = &buf[(data_end.div_ceil(4) * 4).min(buf.len())..];
            if name == TRAILER {
                break;
            }
            out.push(CpioEntry { name, mode, data });
        }
    }
    if archives == 0 {
        return Err("empty archive".into());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample_base() -> Vec<u8> {
        let modules = vec![
            ("virtio_mmio.ko".to_string(), b"\x7fELFmmio".to_vec()),
            ("virtio_blk.ko".to_string(), b"\x7fELFblk12".to_vec()),
        ];
        BaseInitramfs {
            agent: b"#!agent-binary",
            modules: &modules,
        }
        .to_bytes()
    }

    #[test]
    fn test_cpio_writer_roundtrip_parses_back() {
        let bytes = sample_base();
        assert_eq!(bytes.len() % 512, 0);
        let entries = parse_newc(&bytes).expect("parse");
        let init = entries.iter().find(|e| e.name == "init").expect("init");
        assert_eq!(init.mode, S_IFREG | 0o755);
        assert_eq!(init.data, b"#!agent-binary");
        let list = entries
            .iter()
            .find(|e| e.name == MODULE_LIST_PATH)
            .expect("list");
        assert_eq!(
            list.data,
            b"/lib/modules/virtio_mmio.ko\n/lib/modules/virtio_blk.ko\n"
        );
        for d in ["dev", "proc", "sys", "newroot", "warren"] {
            let e = entries.iter().find(|e| e.name == d).expect("dir");
            assert_eq!(e.mode & S_IFDIR, S_IFDIR);
        }
    }

    #[test]
    fn test_cpio_writer_output_accepted_by_cpio_tool() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("a.cpio");
        std::fs::write(&p, sample_base()).expect("write");
        let Ok(out) = std::process::Command::new("cpio")
            .arg("-it")
            .stdin(File::open(&p).expect("open"))
            .output()
        else {
            return; // cpio not installed: the parser test covers the format.
        };
        assert!(out.status.success());
        let listing = String::from_utf8_lossy(&out.stdout);
        assert!(listing.lines().any(|l| l == "init"));
        assert!(listing.lines().any(|l| l == "lib/modules/virtio_blk.ko"));
    }

    #[test]
    fn test_vm_initramfs_concatenated_contains_secret() {
        let dir = tempfile::tempdir().expect("tempdir");
        let base = dir.path().join("base.cpio");
        let out = dir.path().join("vm.cpio");
        std::fs::write(&base, sample_base()).expect("write");
        let secret = [7u8; SECRET_LEN];
        write_vm_initramfs(&base, &secret, &out).expect("write vm");
        // Rewriting replaces the read-only file.
        write_vm_initramfs(&base, &secret, &out).expect("rewrite vm");
        let bytes = std::fs::read(&out).expect("read");
        let entries = parse_newc(&bytes).expect("parse");
        let s = entries
            .iter()
            .find(|e| e.name == SECRET_PATH)
            .expect("secret");
        assert_eq!(s.data, secret);
        assert_eq!(s.mode, S_IFREG | 0o400);
        assert!(entries.iter().any(|e| e.name == "init"));
        assert_eq!(bytes.len() % 512, 0);
    }

    #[test]
    fn test_vm_initramfs_wrong_secret_len_rejected() {
        assert!(secret_archive(&[1u8; 5]).is_err());
    }
}
