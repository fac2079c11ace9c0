//! Removing a directory tree the guest could have shaped, without recursion.
//!
//! `std::fs::remove_dir_all` recurses once per directory level and holds a descriptor per
//! level: a guest that made 15,000 nested directories in its session overflowed the stack
//! of the service's 2 MiB blocking thread when the session was deleted (the whole service
//! aborted), and a few thousand ran a process with 1,024 descriptors out of them. This walk
//! keeps at most [`MAX_OPEN`] directories open, in a loop: a directory found deeper than
//! that is moved up to the top of the tree being removed (a rename within it) and removed
//! from there on a later pass. It never follows a symlink (directories are opened with
//! `O_NOFOLLOW`, links are unlinked themselves) and never leaves the tree: every step is
//! relative to a descriptor of a directory in it, none goes through `..`. Hand-written
//! because std's and the crates' walks recurse; it is one loop over `rustix` calls.

use std::ffi::{CStr, CString};
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::Path;

use rustix::fs::{AtFlags, Dir, FileType, Mode, OFlags, RenameFlags, CWD};
use rustix::io::Errno;

/// Directories open at once below the tree's top.
const MAX_OPEN: usize = 32;
/// Entries a removal may meet in all before it gives up (a tree that keeps growing while it
/// is removed).
const MAX_SEEN: u64 = 100_000_000;

/// Removes `path` and everything below it; a missing `path` is no error.
pub fn remove_tree(path: &Path) -> io::Result<()> {
    remove_tree_at(CWD, path)
}

/// Removes `name` in the directory `at` and everything below it, without resolving
/// anything by path from elsewhere (a caller holding `at` open is not redirected by a
/// rename or symlink above it); a missing `name` is no error.
pub fn remove_tree_at(at: impl AsFd, name: &Path) -> io::Result<()> {
    let at = at.as_fd();
    let st = match rustix::fs::statat(at, name, AtFlags::SYMLINK_NOFOLLOW) {
        Ok(st) => st,
        Err(Errno::NOENT) => return Ok(()),
        Err(e) => return Err(e.into()),
    };
    if FileType::from_raw_mode(st.st_mode) != FileType::Directory {
        return ignore(
            rustix::fs::unlinkat(at, name, AtFlags::empty()),
            &[Errno::NOENT],
        );
    }
    let top = open_dir(at, name)?;
    empty(&top)?;
    drop(top);
    ignore(
        rustix::fs::unlinkat(at, name, AtFlags::REMOVEDIR),
        &[Errno::NOENT],
    )
}

fn open_dir<P: rustix::path::Arg>(at: impl AsFd, name: P) -> Result<OwnedFd, Errno> {
    rustix::fs::openat(
        at,
        name,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
}

/// An open directory below the top and its name in its parent.
struct Level {
    dir: Dir,
    name: CString,
}

/// Removes everything in the directory `top`.
fn empty(top: &OwnedFd) -> io::Result<()> {
    let mut top_dir = Dir::read_from(top)?;
    let mut stack: Vec<Level> = Vec::new();
    let (mut seen, mut seen_this_pass, mut moved) = (0u64, 0u64, 0u64);
    loop {
        let depth = stack.len();
        let cur = match stack.last_mut() {
            Some(level) => &mut level.dir,
            None => &mut top_dir,
        };
        let Some(entry) = cur.read() else {
            // This directory's listing ended.
            match stack.pop() {
                Some(level) => {
                    let parent = match stack.last() {
                        Some(l) => l.dir.fd()?,
                        None => top.as_fd(),
                    };
                    // Not empty: something was added while it was read; the next pass
                    // reads it again.
                    ignore(
                        rustix::fs::unlinkat(parent, &level.name, AtFlags::REMOVEDIR),
                        &[Errno::NOENT, Errno::NOTEMPTY],
                    )?;
                }
                None if seen_this_pass == 0 => return Ok(()),
                None => {
                    // Another pass: entries moved up, or added, since the listing began.
                    seen_this_pass = 0;
                    top_dir.rewind();
                }
            }
            continue;
        };
        let entry = entry?;
        let name = entry.file_name();
        if name == c"." || name == c".." {
            continue;
        }
        seen += 1;
        seen_this_pass += 1;
        if seen > MAX_SEEN {
            return Err(io::Error::other(
                "the tree kept changing while it was removed",
            ));
        }
        let name = name.to_owned();
        let kind = entry.file_type();
        let at = cur.fd()?;
        let is_dir = match kind {
            FileType::Directory => true,
            FileType::Unknown => rustix::fs::statat(at, &name, AtFlags::SYMLINK_NOFOLLOW)
                .map(|st| FileType::from_raw_mode(st.st_mode) == FileType::Directory)
                .unwrap_or(false),
            _ => false,
        };
        if !is_dir {
            ignore(
                rustix::fs::unlinkat(at, &name, AtFlags::empty()),
                &[Errno::NOENT],
            )?;
            continue;
        }
        if depth < MAX_OPEN {
            match open_dir(at, &name) {
                Ok(fd) => stack.push(Level {
                    dir: Dir::new(fd)?,
                    name,
                }),
                // Replaced meanwhile by something that is no directory: unlinked as such.
                Err(Errno::LOOP | Errno::NOTDIR) => ignore(
                    rustix::fs::unlinkat(at, &name, AtFlags::empty()),
                    &[Errno::NOENT],
                )?,
                Err(e) => ignore(Err(e), &[Errno::NOENT])?,
            }
        } else {
            move_up(at, &name, top, &mut moved)?;
        }
    }
}

/// Moves the directory `name` in `at` to the top of the tree under a name of its own.
fn move_up(at: BorrowedFd<'_>, name: &CStr, top: &OwnedFd, moved: &mut u64) -> io::Result<()> {
    loop {
        let to = format!(".warren-remove-{moved}");
        *moved += 1;
        match rustix::fs::renameat_with(at, name, top, to.as_str(), RenameFlags::NOREPLACE) {
            Ok(()) | Err(Errno::NOENT) => return Ok(()),
            Err(Errno::EXIST) => continue,
            Err(e) => return Err(e.into()),
        }
    }
}

/// `Ok` for success and for the errors listed.
fn ignore(r: Result<(), Errno>, fine: &[Errno]) -> io::Result<()> {
    match r {
        Ok(()) => Ok(()),
        Err(e) if fine.contains(&e) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Far deeper than the stack of a 2 MiB thread allowed `remove_dir_all` (it aborted at
    /// 15,000), with files and symlinks on the way, removed on such a thread.
    #[test]
    fn test_a_deep_tree_is_removed_on_a_small_stack() {
        let root = tempfile::tempdir().expect("tmp");
        let outside = root.path().join("outside");
        std::fs::create_dir(&outside).expect("outside");
        std::fs::write(outside.join("keep"), "keep").expect("keep");
        let tree = root.path().join("tree");
        std::fs::create_dir(&tree).expect("tree");
        // Built with descriptors (a path this deep is longer than PATH_MAX).
        let mut cur = open_dir(CWD, &tree).expect("open");
        for i in 0..20_000u32 {
            if i % 1000 == 0 {
                rustix::fs::symlinkat(&outside, &cur, "link").expect("symlink");
                let f = rustix::fs::openat(
                    &cur,
                    "file",
                    OFlags::CREATE | OFlags::WRONLY | OFlags::CLOEXEC,
                    Mode::RUSR,
                )
                .expect("file");
                drop(f);
            }
            rustix::fs::mkdirat(&cur, "d", Mode::RWXU).expect("mkdir");
            cur = open_dir(&cur, "d").expect("descend");
        }
        drop(cur);
        let removing = tree.clone();
        let removed = std::thread::Builder::new()
            .stack_size(2 << 20)
            .spawn(move || remove_tree(&removing))
            .expect("thread")
            .join()
            .expect("no panic");
        removed.expect("removed");
        assert!(!tree.exists());
        assert_eq!(
            std::fs::read(outside.join("keep")).expect("a link's target stays"),
            b"keep"
        );
    }

    #[test]
    fn test_a_wide_tree_a_file_and_a_missing_path() {
        let root = tempfile::tempdir().expect("tmp");
        let tree = root.path().join("tree");
        for i in 0..300 {
            std::fs::create_dir_all(tree.join(format!("{i}/a/b"))).expect("mkdir");
            std::fs::write(tree.join(format!("{i}/a/f")), "x").expect("file");
        }
        remove_tree(&tree).expect("wide");
        assert!(!tree.exists());
        let file = root.path().join("file");
        std::fs::write(&file, "x").expect("file");
        remove_tree(&file).expect("a file");
        assert!(!file.exists());
        remove_tree(&root.path().join("missing")).expect("missing is fine");
        // A symlink at the top is removed, never followed.
        std::fs::create_dir(root.path().join("target")).expect("target");
        std::fs::write(root.path().join("target/x"), "x").expect("x");
        std::os::unix::fs::symlink(root.path().join("target"), root.path().join("link"))
            .expect("link");
        remove_tree(&root.path().join("link")).expect("link");
        assert!(root.path().join("target/x").exists());
    }
}
