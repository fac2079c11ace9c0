//! The rotation every per-VM log shares (`console.log`, `supervisor.log`, `qemu.stderr`,
//! `virtiofsd-<tag>.log`): a file that would pass [`LOG_HALF`] bytes becomes `<name>.1`
//! (replacing the previous one) and a new file starts, so at most 2 × LOG_HALF bytes (plus
//! one write) are kept, whatever the guest makes its writers print.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

/// Bytes per log file.
pub const LOG_HALF: u64 = 512 * 1024;

/// `path` with `.1` appended: where the older half of a rotated log is.
pub fn old_half(path: &Path) -> PathBuf {
    let mut p = path.as_os_str().to_owned();
    p.push(".1");
    PathBuf::from(p)
}

/// An owner-only log file that rotates at [`LOG_HALF`].
pub struct RotatingFile {
    path: PathBuf,
    file: Option<File>,
    written: u64,
}

impl RotatingFile {
    /// Appends to `path` (what an earlier run left counts toward its half).
    pub fn append_to(path: PathBuf) -> RotatingFile {
        let mut r = RotatingFile {
            path,
            file: None,
            written: 0,
        };
        r.open(true);
        r
    }

    /// Starts `path` empty and removes its older half: a log of one process's run.
    pub fn fresh(path: PathBuf) -> RotatingFile {
        let _ = std::fs::remove_file(old_half(&path));
        let mut r = RotatingFile {
            path,
            file: None,
            written: 0,
        };
        r.open(false);
        r
    }

    fn open(&mut self, append: bool) {
        self.file = warren_vmm::sys::private_file::create(&self.path, append)
            .map_err(|e| {
                // Not `eprintln!`, which panics when standard error fails.
                let _ = writeln!(
                    std::io::stderr(),
                    "log {} unavailable: {e}",
                    self.path.display()
                );
            })
            .ok();
        self.written = self
            .file
            .as_ref()
            .and_then(|f| f.metadata().ok())
            .map(|m| m.len())
            .unwrap_or(0);
    }

    /// The file being written, if it could be opened.
    pub fn file(&self) -> Option<&File> {
        self.file.as_ref()
    }

    /// Writes `data`, first rotating when it would take a non-empty file past [`LOG_HALF`].
    /// Returns whether it rotated (a new file is open). A failed write is dropped: a log
    /// never stops its writer.
    pub fn append(&mut self, data: &[u8]) -> bool {
        let rotate = self.written > 0 && self.written + data.len() as u64 > LOG_HALF;
        if rotate {
            let _ = std::fs::rename(&self.path, old_half(&self.path));
            self.open(true);
        }
        if let Some(f) = self.file.as_mut() {
            if f.write_all(data).is_ok() {
                self.written += data.len() as u64;
            }
        }
        rotate
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_rotation_keeps_two_halves_at_most() {
        let d = tempfile::tempdir().expect("tempdir");
        let path = d.path().join("x.log");
        std::fs::write(old_half(&path), "stale").expect("stale half");
        let mut f = RotatingFile::fresh(path.clone());
        assert!(!old_half(&path).exists(), "a fresh log drops the old half");
        let chunk = vec![b'a'; 16 * 1024];
        let mut rotations = 0;
        for _ in 0..200 {
            rotations += usize::from(f.append(&chunk));
        }
        assert!(rotations >= 5, "{rotations}");
        for p in [path.clone(), old_half(&path)] {
            let len = std::fs::metadata(&p).expect("stat").len();
            assert!(len <= LOG_HALF && len > 0, "{}: {len}", p.display());
        }
        // Appending continues the current half.
        let before = std::fs::metadata(&path).expect("stat").len();
        RotatingFile::append_to(path.clone()).append(b"b");
        assert_eq!(std::fs::metadata(&path).expect("stat").len(), before + 1);
    }
}
