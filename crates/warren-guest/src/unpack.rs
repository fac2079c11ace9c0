//! The staging directory of an upload (`vm cp` into the guest): made before `tar -x` runs in
//! it, its entries moved into place only once the whole archive unpacked and the host ended
//! its input cleanly.
//!
//! The agent does these steps itself, as the guest user's filesystem identity
//! ([`crate::files::FsIdentity`], per thread, on tokio's blocking pool), instead of a shell
//! script around `tar`: under TCG every process start costs the guest's one vCPU ~8 ms, and
//! `mkdir -p`, `mktemp -d` and `mv` were four of the six an upload started. The semantics
//! are those of the commands: the directory is made as `mkdir -p` (the user's permissions,
//! the agent's umask), the staging directory as `mktemp -d` (0700, a random name), and an
//! entry is moved with `RENAME_NOREPLACE`, so an existing name is never replaced, even one
//! made while the archive unpacked. Only an empty staging directory is removed here (one
//! `rmdir`): a tree in it (a failed upload, or anything the guest user put there) is removed
//! by `rm -rf` as the guest user ([`crate::streams`]), never by the agent, whose descriptors
//! and stack a deep tree could exhaust.

use std::path::{Path, PathBuf};

use rustix::fs::{Mode, RenameFlags, CWD};
use rustix::io::Errno;
use warren_protocol::{ErrorCode, GuestError};

use crate::files::FsIdentity;

/// The staging directory's name prefix.
const PREFIX: &str = ".warren-cp.";
/// How many random names are tried before giving up.
const NAME_TRIES: usize = 64;
/// Exit code of an upload refused because a name it brings exists (`EEXIST`).
pub const EXISTS_CODE: i32 = 17;
/// Exit code of an upload whose entries could not be moved into place otherwise (`mv`'s).
const MOVE_FAILED_CODE: i32 = 1;

/// A staging directory below an upload's destination.
#[derive(Debug)]
pub struct Staging {
    dir: PathBuf,
    path: PathBuf,
    user: Option<u32>,
}

impl Staging {
    /// Makes `dir` (as `mkdir -p`) and a fresh staging directory in it, as `user`.
    pub fn prepare(dir: &Path, user: Option<u32>) -> Result<Self, GuestError> {
        let _id = FsIdentity::assume(user);
        std::fs::DirBuilder::new()
            .recursive(true)
            .create(dir)
            .map_err(|e| fs_error(&format!("making {}", dir.display()), e))?;
        for _ in 0..NAME_TRIES {
            let path = dir.join(random_name());
            match rustix::fs::mkdir(&path, Mode::RWXU) {
                Ok(()) => {
                    return Ok(Self {
                        dir: dir.to_path_buf(),
                        path,
                        user,
                    })
                }
                Err(Errno::EXIST) => continue,
                Err(e) => {
                    return Err(fs_error(
                        &format!("making a directory in {}", dir.display()),
                        e.into(),
                    ))
                }
            }
        }
        Err(GuestError::new(
            ErrorCode::Io,
            format!("no free staging name in {}", dir.display()),
        ))
    }

    /// Where `tar -x` unpacks.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Moves every unpacked entry into the destination directory, then removes the staging
    /// directory if it is empty. `Ok(true)`: nothing is left; `Ok(false)`: the staging
    /// directory still holds something (see the module docs). `Err` is an exit code and its
    /// error text: [`EXISTS_CODE`] when a name exists there (checked for every entry before
    /// any moves, and again by each move).
    pub fn place(&self) -> Result<bool, (i32, String)> {
        let _id = FsIdentity::assume(self.user);
        self.move_entries()?;
        Ok(rustix::fs::rmdir(&self.path).is_ok())
    }

    /// Removes the staging directory if it is empty; whether it is gone.
    pub fn remove_if_empty(&self) -> bool {
        let _id = FsIdentity::assume(self.user);
        rustix::fs::rmdir(&self.path).is_ok()
    }

    fn move_entries(&self) -> Result<(), (i32, String)> {
        let failed = |what: String, e: std::io::Error| (MOVE_FAILED_CODE, format!("{what}: {e}"));
        let mut names = Vec::new();
        let entries = std::fs::read_dir(&self.path)
            .map_err(|e| failed(format!("reading {}", self.path.display()), e))?;
        for entry in entries {
            let entry = entry.map_err(|e| failed(format!("reading {}", self.path.display()), e))?;
            names.push(entry.file_name());
        }
        let exists = |to: &Path| {
            (
                EXISTS_CODE,
                format!("{} exists; remove it or copy elsewhere", to.display()),
            )
        };
        for name in &names {
            let to = self.dir.join(name);
            if std::fs::symlink_metadata(&to).is_ok() {
                return Err(exists(&to));
            }
        }
        for name in &names {
            let (from, to) = (self.path.join(name), self.dir.join(name));
            let moved =
                match rustix::fs::renameat_with(CWD, &from, CWD, &to, RenameFlags::NOREPLACE) {
                    // A file system without the flag (some FUSE or network ones): checked just
                    // above, then a plain rename, as `mv` does there.
                    Err(Errno::INVAL) if std::fs::symlink_metadata(&to).is_err() => {
                        rustix::fs::rename(&from, &to)
                    }
                    other => other,
                };
            match moved {
                Ok(()) => {}
                Err(Errno::EXIST) => return Err(exists(&to)),
                Err(e) => {
                    return Err(failed(
                        format!(
                            "moving {} into {}",
                            name.to_string_lossy(),
                            self.dir.display()
                        ),
                        e.into(),
                    ))
                }
            }
        }
        Ok(())
    }
}

/// A failed directory step as a typed error (these are guest paths, not workspace paths:
/// no workspace wording).
fn fs_error(what: &str, e: std::io::Error) -> GuestError {
    let code = match e.kind() {
        std::io::ErrorKind::PermissionDenied | std::io::ErrorKind::ReadOnlyFilesystem => {
            ErrorCode::PermissionDenied
        }
        std::io::ErrorKind::NotFound => ErrorCode::NotFound,
        std::io::ErrorKind::NotADirectory => ErrorCode::WrongType,
        _ => ErrorCode::Io,
    };
    GuestError::new(code, format!("{what}: {e}"))
}

/// `.warren-cp.` and 12 random letters and digits.
fn random_name() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    let mut bytes = [0u8; 12];
    // The name only has to be unlikely to be taken (a taken one is tried again): the
    // non-blocking source does, even before the CRNG is seeded. Where it is missing, the
    // clock and a counter still give every try another name.
    if rustix::rand::getrandom(&mut bytes, rustix::rand::GetRandomFlags::INSECURE).is_err() {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        let mixed = nanos ^ COUNTER.fetch_add(1, Ordering::Relaxed).rotate_left(40);
        bytes[..8].copy_from_slice(&mixed.to_le_bytes());
        bytes[8..].copy_from_slice(&std::process::id().to_le_bytes());
    }
    let mut name = String::from(PREFIX);
    name.extend(
        bytes
            .iter()
            .map(|b| char::from(ALPHABET[usize::from(*b) % ALPHABET.len()])),
    );
    name
}

#[cfg(test)]
mod tests {
    use super::*;

    fn staged(dir: &Path, entries: &[&str]) -> Staging {
        let s = Staging::prepare(dir, None).expect("prepare");
        for e in entries {
            std::fs::write(s.path().join(e), e).expect("unpacked entry");
        }
        s
    }

    fn listing(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .expect("ls")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn test_an_upload_is_placed_whole_and_its_staging_removed() {
        let root = tempfile::tempdir().expect("tmp");
        let dir = root.path().join("a/b");
        let s = staged(&dir, &["x", ".hidden"]);
        let mode = std::fs::metadata(s.path()).expect("staging").permissions();
        assert_eq!(
            std::os::unix::fs::PermissionsExt::mode(&mode) & 0o777,
            0o700
        );
        assert_eq!(s.place(), Ok(true), "nothing left");
        assert_eq!(listing(&dir), [".hidden", "x"]);
        assert_eq!(std::fs::read(dir.join("x")).expect("x"), b"x");
    }

    #[test]
    fn test_an_existing_name_refuses_the_whole_upload() {
        let root = tempfile::tempdir().expect("tmp");
        let dir = root.path().to_path_buf();
        std::fs::write(dir.join("b"), "mine").expect("existing");
        std::os::unix::fs::symlink("nowhere", dir.join("c")).expect("dangling link");
        for taken in ["b", "c"] {
            let s = staged(&dir, &["a", taken]);
            let (code, text) = s.place().expect_err("refused");
            assert_eq!(code, EXISTS_CODE);
            assert!(text.contains("exists"), "{text}");
            // Nothing moved, nothing replaced; the staging directory is left to `rm -rf`.
            assert_eq!(listing(s.path()), ["a", taken]);
            std::fs::remove_dir_all(s.path()).expect("clean");
            assert_eq!(listing(&dir), ["b", "c"]);
        }
        assert_eq!(std::fs::read(dir.join("b")).expect("b"), b"mine");
    }

    /// A staging directory that still holds something after the moves (put there by the
    /// guest user) is only reported, never walked by the agent.
    #[test]
    fn test_a_staging_directory_that_is_not_empty_is_left_to_the_caller() {
        let root = tempfile::tempdir().expect("tmp");
        let s = staged(root.path(), &["a"]);
        assert!(s.move_entries().is_ok());
        // An entry made after the moves' listing, as a racing guest user could.
        let late = s.path().join(".late");
        std::fs::create_dir_all(late.join("deep/er")).expect("tree");
        assert!(!s.remove_if_empty(), "not empty");
        assert!(late.join("deep/er").is_dir(), "untouched");
        assert_eq!(listing(root.path()).len(), 2, "a and the staging directory");
    }

    #[test]
    fn test_a_directory_that_cannot_be_made_is_a_typed_refusal() {
        let root = tempfile::tempdir().expect("tmp");
        std::fs::write(root.path().join("file"), "x").expect("file");
        let err = Staging::prepare(&root.path().join("file/sub"), None).expect_err("refused");
        assert_eq!(err.code, ErrorCode::WrongType, "{err:?}");
        assert!(!err.message.contains("workspace"), "{err:?}");
    }
}
