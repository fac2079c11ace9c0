//! The unpacker's memory stays proportional to the names it keeps (a hostile layer or a
//! guest's `vm cp` archive chooses every name). Alone in its binary: the counting allocator
//! sees every thread of the process.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use warren_image::unpack::{unpack, Options, Unpacked};

struct Counting;

static NOW: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards to the system allocator; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract is the system allocator's.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let now = NOW.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(now, Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) };
        NOW.fetch_sub(layout.size(), Ordering::Relaxed);
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

#[test]
fn test_unpack_memory_bounded_by_the_names_it_keeps() {
    // One directory 2,048 levels deep (a 4,095-byte name, the longest handled), named again
    // and again: each entry is 4 KiB of name, and before the fix the unpacker kept every
    // component of every directory entry as an allocation of its own (~115 KiB an entry, 28
    // times the bytes its name limit counted: 7 GiB within that 256 MiB limit).
    let deep = vec!["a"; 2048].join("/");
    let repeats = 200;
    let mut b = tar::Builder::new(Vec::new());
    for _ in 0..repeats {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(tar::EntryType::Directory);
        h.set_size(0);
        h.set_mode(0o755);
        b.append_data(&mut h, &deep, &b""[..]).expect("dir");
    }
    let archive = b.into_inner().expect("archive");
    let dst = tempfile::tempdir().expect("dst");
    let opts = Options {
        max_bytes: u64::MAX,
        block: 0,
        max_entries: 1_000_000,
        keep_owner: false,
        keep_sticky: false,
        whiteouts: false,
        mode_mask: 0,
        dir_mode_set: 0,
        only_in: None,
    };
    let mut done = Unpacked::default();
    let before = NOW.load(Ordering::Relaxed);
    PEAK.store(before, Ordering::Relaxed);
    unpack(&archive[..], dst.path(), &opts, &mut done).expect("unpack");
    let peak = PEAK.load(Ordering::Relaxed) - before;
    assert_eq!(done.dirs, repeats);
    // The tar crate's own buffers and one entry's name and components are a few hundred KiB.
    assert!(
        peak < 2 << 20,
        "unpacking {repeats} entries of one 4 KiB name peaked at {peak} bytes"
    );
}
