//! The staging directory of an upload (`vm cp` into the guest): made before `tar -x` runs in
//! it, moved into place only once the whole archive unpacked, removed otherwise.
//!
//! The agent does these steps itself, as the guest user's filesystem identity
//! ([`crate::files::FsIdentity`], per thread, on tokio's blocking pool), instead of a shell
//! script around `tar`: under TCG every process start costs the guest's one vCPU ~8 ms, and
//! `mkdir -p`, `mktemp -d`, `mv` and `rm -rf` were five of the six an upload started. The
//! semantics are those of the commands: the directory is made as `mkdir -p` (the user's
//! permissions, the agent's umask), the staging directory as `mktemp -d` (0700, a random
//! name), and an entry is moved with `RENAME_NOREPLACE`, so an existing name is never
//! replaced, even one made while the archive unpacked.

use std::path::{Path, PathBuf};

use rustix::fs::{Mode, RenameFlags, CWD};
use rustix::io::Errno;
use warren_protocol::{ErrorCode, GuestError};

use crate::files::{errno_error, io_error, FsIdentity};

/// The staging directory's name prefix (the host's side uses the same for its own).
const PREFIX: &str = ".warren-cp.";
/// How many random names are tried before giving up.
const NAME_TRIES: usize = 64;
/// How many times removing a staging directory is tried.
const REMOVE_TRIES: u32 = 5;
/// Exit code of an upload refused because a name it brings exists (`EEXIST`).
pub const EXISTS_CODE: i32 = 17;

/// A staging directory below the upload's destination, removed on drop unless placed.
#[derive(Debug)]
pub struct Staging {
    dir: PathBuf,
    path: PathBuf,
    user: Option<u32>,
    placed: bool,
}

impl Staging {
    /// Makes `dir` (as `mkdir -p`) and a fresh staging directory in it, as `user`.
    pub fn prepare(dir: &Path, user: Option<u32>) -> Result<Self, GuestError> {
        let _id = FsIdentity::assume(user);
        std::fs::DirBuilder::new()
            .recursive(true)
            .create(dir)
            .map_err(|e| io_error(&format!("making {}", dir.display()), e))?;
        for _ in 0..NAME_TRIES {
            let path = dir.join(random_name());
            match rustix::fs::mkdir(&path, Mode::RWXU) {
                Ok(()) => {
                    return Ok(Self {
                        dir: dir.to_path_buf(),
                        path,
                        user,
                        placed: false,
                    })
                }
                Err(Errno::EXIST) => continue,
                Err(e) => {
                    return Err(errno_error(
                        &format!("making a directory in {}", dir.display()),
                        e,
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
    /// directory. `Err` is an exit code and its error text: [`EXISTS_CODE`] when a name
    /// exists there (checked for every entry before any moves, and again by each move).
    pub fn place(mut self) -> Result<(), (i32, String)> {
        let result = self.move_entries();
        self.placed = result.is_ok();
        self.remove();
        result
    }

    fn move_entries(&self) -> Result<(), (i32, String)> {
        let _id = FsIdentity::assume(self.user);
        let failed = |what: String, e: std::io::Error| {
            (e.raw_os_error().unwrap_or(1), format!("{what}: {e}"))
        };
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
            match rustix::fs::renameat_with(CWD, &from, CWD, &to, RenameFlags::NOREPLACE) {
                Ok(()) => {}
                Err(Errno::EXIST) => return Err(exists(&to)),
                Err(e) => {
                    return Err((
                        e.raw_os_error(),
                        format!(
                            "moving {} into {}: {e}",
                            name.to_string_lossy(),
                            self.dir.display()
                        ),
                    ))
                }
            }
        }
        Ok(())
    }

    fn remove(&mut self) {
        let _id = FsIdentity::assume(self.user);
        // A `tar` just killed may still finish a call that adds an entry: tried again.
        for attempt in 1..=REMOVE_TRIES {
            match std::fs::remove_dir_all(&self.path) {
                Ok(()) => break,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => break,
                Err(e) if attempt < REMOVE_TRIES => {
                    let _ = e;
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
                Err(e) => crate::console::log(format_args!(
                    "removing the staging directory {}: {e}",
                    self.path.display()
                )),
            }
        }
        self.placed = true;
    }
}

impl Drop for Staging {
    /// An upload that failed or was abandoned leaves nothing behind. The removal runs on the
    /// blocking pool when a runtime is there (a large half-unpacked tree takes a while).
    fn drop(&mut self) {
        if self.placed {
            return;
        }
        let mut this = Self {
            dir: std::mem::take(&mut self.dir),
            path: std::mem::take(&mut self.path),
            user: self.user,
            placed: false,
        };
        self.placed = true;
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                rt.spawn_blocking(move || this.remove());
            }
            Err(_) => this.remove(),
        }
    }
}

/// `.warren-cp.` and 12 random letters and digits.
fn random_name() -> String {
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    let mut bytes = [0u8; 12];
    // The name only has to be unlikely to be taken (a taken one is tried again): the
    // non-blocking source does, even before the CRNG is seeded.
    let _ = rustix::rand::getrandom(&mut bytes, rustix::rand::GetRandomFlags::INSECURE);
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
        s.place().expect("place");
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
            let (code, text) = staged(&dir, &["a", taken]).place().expect_err("refused");
            assert_eq!(code, EXISTS_CODE);
            assert!(text.contains("exists"), "{text}");
            // Nothing moved, nothing replaced, nothing left behind.
            assert_eq!(listing(&dir), ["b", "c"]);
        }
        assert_eq!(std::fs::read(dir.join("b")).expect("b"), b"mine");
    }

    #[test]
    fn test_an_abandoned_upload_leaves_nothing() {
        let root = tempfile::tempdir().expect("tmp");
        let s = staged(root.path(), &["a"]);
        std::fs::create_dir_all(s.path().join("deep/er")).expect("tree");
        drop(s);
        assert!(listing(root.path()).is_empty());
    }
}
