//! How many templates a host keeps, and when their files go.
//!
//! - **Cap.** At most `WarrenConfig::max_templates` shapes have a current template. Each
//!   pointer's (`<key digest>.current`) modification time is its last use (a clone touches
//!   it); a build that makes one more than the cap retires the least recently used others'
//!   pointers. A caller who can vary the shape (memory, vCPUs, shares' guest paths) can
//!   therefore make Warren build templates, but not keep more than the cap of them on disk:
//!   before, every shape's template stayed for good.
//! - **Retired files.** A template directory that is neither current nor backing any VM's
//!   disk is first marked (`retired`, with the time it was first seen so), and deleted by a
//!   later collection once the mark is `RETIRE_GRACE` old. A create holds the template it
//!   found pinned (a shared `flock` on its directory, `Template::pin`) until it is done
//!   with it, and its clone's marker keeps it after that: a collection deletes only an
//!   unpinned directory, holding its exclusive lock while the files go, and a create that
//!   finds a template being deleted builds another.

use std::path::Path;
use std::time::{Duration, SystemTime};

use super::template::{
    build_key_digest, build_lock, read_record, superseded_model, valid_dir_name, STALE_BUILD,
    TEMPLATE_MARKER, TEMPLATE_WORKSPACE,
};
use super::Warren;
use crate::error::CoreError;

/// How long a retired template's files stay before they are deleted.
pub(super) const RETIRE_GRACE: Duration = Duration::from_secs(60);
/// The mark on a retired template's directory.
const RETIRED: &str = "retired";
/// Templates kept when the configuration names no cap.
pub const DEFAULT_MAX_TEMPLATES: usize = 16;

/// Records that the template behind `pointer` was just used (its last use orders eviction).
/// Best effort: a pointer that cannot be touched only ages.
pub(super) fn note_use(pointer: &Path) {
    let touched = std::fs::File::options()
        .write(true)
        .open(pointer)
        .and_then(|f| f.set_modified(SystemTime::now()));
    if let Err(e) = touched {
        tracing::debug!(error = %e, pointer = %pointer.display(), "noting a template's use");
    }
}

/// The template directory names VMs' markers name (the templates their disks stand on);
/// `None` when the VMs' directory cannot be listed (nothing may then be taken for unused).
fn templates_in_use(state_dir: &Path) -> Option<Vec<String>> {
    let vms = state_dir.join("vms");
    let entries = match std::fs::read_dir(&vms) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Some(Vec::new()),
        Err(e) => {
            tracing::warn!(error = %e, dir = %vms.display(), "listing the VMs for templates in use");
            return None;
        }
    };
    Some(
        entries
            .flatten()
            .filter_map(|e| std::fs::read_to_string(e.path().join(TEMPLATE_MARKER)).ok())
            .map(|s| s.trim().to_string())
            .collect(),
    )
}

/// Deletes the retired template `dir` unless a create holds it (`Template::pin`) or, once
/// its exclusive lock is held, a VM's marker names it: the lock makes a create that finds it
/// now see it gone, and the markers are read again under the lock because a create that held
/// the pin while the collection first read them has written its clone's marker before
/// letting go.
fn remove_unpinned(state_dir: &Path, dir: &Path) {
    let name = dir.display();
    let file = match std::fs::File::open(dir) {
        Ok(f) => f,
        Err(err) => {
            tracing::warn!(error = %err, template = %name, "opening an unused template");
            return;
        }
    };
    match file.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => {
            tracing::debug!(template = %name, "an unused template is pinned by a create; kept");
            return;
        }
        Err(std::fs::TryLockError::Error(err)) => {
            tracing::warn!(error = %err, template = %name, "locking an unused template");
            return;
        }
    }
    let dir_name = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    match templates_in_use(state_dir) {
        Some(used) if !used.contains(&dir_name) => {}
        _ => {
            tracing::debug!(template = %name, "a VM took the template on while it was collected; kept");
            return;
        }
    }
    // Without recursion: a template holds what its build VM's VMM left in `run/`, a tree
    // of any depth (see `warren_session::remove_tree`).
    if let Err(err) = warren_session::remove_tree(dir) {
        tracing::warn!(error = %err, template = %name, "removing an unused template");
    }
}

/// Whether no build holds the lock at `path` (taken and let go at once). A missing templates
/// directory holds no build; any other failure counts as held.
fn lock_free(path: &Path) -> bool {
    match warren_supervisor::layout::open_lock_file(path) {
        Ok(f) => nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockExclusiveNonblock).is_ok(),
        Err(e) => e.kind() == std::io::ErrorKind::NotFound,
    }
}

/// Whether no build holds any key's lock under `root`.
fn all_locks_free(root: &Path) -> bool {
    let entries = match std::fs::read_dir(root) {
        Ok(entries) => entries,
        Err(e) => return e.kind() == std::io::ErrorKind::NotFound,
    };
    for e in entries {
        let Ok(e) = e else { return false };
        if e.file_name().to_string_lossy().ends_with(".lock") && !lock_free(&e.path()) {
            return false;
        }
    }
    true
}

impl Warren {
    /// Retires the least recently used current templates past the cap, never `keep` (the
    /// pointer of the template just built).
    pub(super) fn evict_templates(&self, keep: &Path) {
        let root = self.templates_dir();
        let Ok(entries) = std::fs::read_dir(&root) else {
            return;
        };
        let mut pointers: Vec<(SystemTime, std::path::PathBuf)> = entries
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().ends_with(".current"))
            .map(|e| {
                let used = e
                    .metadata()
                    .and_then(|m| m.modified())
                    .unwrap_or(SystemTime::UNIX_EPOCH);
                (used, e.path())
            })
            .collect();
        let cap = self.cfg.max_templates.max(1);
        if pointers.len() <= cap {
            return;
        }
        pointers.sort();
        let mut over = pointers.len() - cap;
        for (_, p) in pointers {
            if over == 0 {
                break;
            }
            if p == keep {
                continue;
            }
            // A mark from a moment the template looked unused (a collection between its
            // build's rename and its pointer's, or a pointer it could not read) would cut
            // the grace short of a create that found it just now: its grace starts here.
            // Dropped before the pointer goes, so no collection sees the old mark on an
            // unused template.
            if let Ok(name) = std::fs::read_to_string(&p) {
                let name = name.trim();
                if valid_dir_name(name) {
                    let _ = std::fs::remove_file(root.join(name).join(RETIRED));
                }
            }
            match std::fs::remove_file(&p) {
                Ok(()) => {
                    tracing::info!(pointer = %p.display(), cap, "retiring the least recently used template");
                    over -= 1;
                }
                Err(e) => tracing::warn!(error = %e, pointer = %p.display(), "retiring a template"),
            }
        }
    }

    /// Destroys template build VMs that no build holds: one whose build's process died (an
    /// engine stopped or killed mid-build) would otherwise run on in `warren-templates`,
    /// which no caller may reach, holding host memory and a VM uid for good. A build holds
    /// its key's lock (`<key digest>.lock`) from before its VM's record is inserted until
    /// the VM is destroyed, and names the VM's request `build-<key digest>-<random>`: a
    /// listed build VM whose key's lock is free has no build. (A build VM of an older engine,
    /// without that name, counts as held while any key's lock is.) Any doubt (a lock or the
    /// directory unreadable) leaves the VM alone. Returns the VMs destroyed.
    pub async fn sweep_template_builds(&self) -> Result<Vec<String>, CoreError> {
        let builds = self.store.in_workspace(TEMPLATE_WORKSPACE)?;
        if builds.is_empty() {
            return Ok(Vec::new());
        }
        let root = self.templates_dir();
        let mut orphans = Vec::new();
        for rec in builds {
            let free = match rec.request_id.as_deref().and_then(build_key_digest) {
                Some(digest) => lock_free(&build_lock(&root, digest)),
                None => all_locks_free(&root),
            };
            if free {
                orphans.push(rec.id);
            }
        }
        // No lock is held while they go: a build that starts now makes a VM of its own.
        let mut destroyed = Vec::new();
        for id in orphans {
            match self.destroy_vm(&id).await {
                Ok(()) => {
                    tracing::warn!(vm = %id, "destroyed a template build VM its build left");
                    destroyed.push(id);
                }
                Err(CoreError::VmNotFound(_)) => {}
                Err(e) => {
                    tracing::warn!(vm = %id, error = %e, "destroying a left template build VM")
                }
            }
        }
        Ok(destroyed)
    }

    /// Deletes template directories that are neither current nor backing any VM's disk
    /// once they have been so for [`RETIRE_GRACE`] (module docs), and a crashed build's
    /// leftovers.
    pub(super) fn collect_templates(&self) {
        let root = self.templates_dir();
        let Ok(entries) = std::fs::read_dir(&root) else {
            return;
        };
        // Unreadable VMs: no template is known to be unused.
        let Some(mut used) = templates_in_use(&self.cfg.state_dir) else {
            return;
        };
        let mut dirs = Vec::new();
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with("building-") || name.starts_with("shares-") {
                // A build's staging or stand-in shares a crash left behind (a build in
                // progress is far younger).
                let stale = e
                    .metadata()
                    .and_then(|m| m.modified())
                    .ok()
                    .and_then(|t| t.elapsed().ok())
                    .is_some_and(|age| age > STALE_BUILD);
                if stale {
                    // The build's guest and VMM shaped them: removed without recursion.
                    if let Err(err) = warren_session::remove_tree(&e.path()) {
                        tracing::warn!(error = %err, %name, "removing a crashed template build's files");
                    }
                }
                continue;
            }
            if name.ends_with(".current") {
                if let Ok(n) = std::fs::read_to_string(e.path()) {
                    let n = n.trim().to_string();
                    let superseded = valid_dir_name(&n)
                        && read_record(&root.join(&n)).is_ok_and(|r| superseded_model(&r.key));
                    if superseded {
                        // No create asks for this key again: drop the pointer, and the
                        // files go below unless a VM's disk still stands on them.
                        if let Err(err) = std::fs::remove_file(e.path()) {
                            tracing::warn!(error = %err, %name, "removing a superseded template");
                        }
                    } else {
                        used.push(n);
                    }
                }
            } else if valid_dir_name(&name) {
                dirs.push(name);
            }
        }
        for name in dirs {
            if used.contains(&name) {
                // In use again (or still): a mark from before no longer counts.
                let _ = std::fs::remove_file(root.join(&name).join(RETIRED));
                continue;
            }
            let mark = root.join(&name).join(RETIRED);
            let age = std::fs::metadata(&mark)
                .and_then(|m| m.modified())
                .ok()
                .map(|t| t.elapsed().unwrap_or_default());
            match age {
                None => {
                    if let Err(err) = std::fs::write(&mark, b"") {
                        tracing::warn!(error = %err, %name, "marking a retired template");
                    }
                }
                Some(age) if age >= RETIRE_GRACE => {
                    remove_unpinned(&self.cfg.state_dir, &root.join(&name))
                }
                Some(_) => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::template::{Template, TemplateKey};
    use super::*;

    /// An engine on a fresh state directory keeping at most `cap` templates.
    fn engine(cap: usize) -> (tempfile::TempDir, Warren) {
        let state = tempfile::tempdir().expect("state");
        let mut cfg =
            crate::WarrenConfig::new(state.path().to_path_buf(), "/usr/bin/warren".into());
        cfg.max_templates = cap;
        (state, Warren::open(cfg).expect("open"))
    }

    /// A template of `memory_mib` in `w`'s store (record and pointer, no files), its
    /// pointer last used `age` ago; returns (directory, pointer).
    fn fake(
        w: &Warren,
        memory_mib: u32,
        age: Duration,
    ) -> (std::path::PathBuf, std::path::PathBuf) {
        let key = TemplateKey {
            image_id: "a".repeat(64),
            memory_mib,
            vcpus: 1,
            accel: "tcg".into(),
            cpu: warren_vmm::qemu::TCG_CPU.into(),
            shares: vec![],
            network: false,
        };
        let (_, dir, pointer) = super::super::template::tests::fake_template(w, &key, "00000000");
        age_file(&pointer, age);
        (dir, pointer)
    }

    fn age_file(p: &Path, age: Duration) {
        std::fs::File::options()
            .write(true)
            .open(p)
            .and_then(|f| f.set_modified(SystemTime::now() - age))
            .expect("set mtime");
    }

    /// Past the cap, a build retires the least recently used templates (never the one just
    /// built, however old its pointer); their files stay through the grace period and go
    /// after it. A use moves a template to the back of the line. (Before, every shape's
    /// template was kept for good.)
    #[test]
    fn test_templates_past_the_cap_are_retired_least_recently_used_first() {
        let (_state, w) = engine(2);
        let hour = Duration::from_secs(3600);
        let (d1, p1) = fake(&w, 256, 4 * hour);
        let (d2, p2) = fake(&w, 384, 3 * hour);
        let (d3, p3) = fake(&w, 512, 2 * hour);
        let (d4, p4) = fake(&w, 640, 5 * hour);
        note_use(&p1);
        w.evict_templates(&p4);
        assert!(p1.exists(), "used just now");
        assert!(
            !p2.exists() && !p3.exists(),
            "the least recently used two retired"
        );
        assert!(p4.exists(), "the template just built stays");
        w.collect_templates();
        assert!(
            d2.exists() && d3.exists(),
            "their files stay through the grace period"
        );
        age_file(&d2.join(RETIRED), RETIRE_GRACE + Duration::from_secs(1));
        w.collect_templates();
        assert!(!d2.exists(), "gone after the grace period");
        assert!(d3.exists(), "still within it");
        assert!(d1.exists() && d4.exists(), "current templates are kept");
        // Within the cap nothing is retired.
        w.evict_templates(&p4);
        assert!(p1.exists() && p4.exists());
    }

    /// A template retired with a mark left from a moment it looked unused (a collection
    /// between its build's two renames) still gets its full grace: a create may have found
    /// it just before its pointer went. (Before, the old mark let the collection right after
    /// the eviction delete it.)
    #[test]
    fn test_a_retired_template_gets_its_grace_whatever_an_older_mark() {
        let (_state, w) = engine(1);
        let hour = Duration::from_secs(3600);
        let (d1, p1) = fake(&w, 256, 2 * hour);
        std::fs::write(d1.join(RETIRED), b"").expect("mark");
        age_file(&d1.join(RETIRED), 2 * RETIRE_GRACE);
        let (_d2, p2) = fake(&w, 384, hour);
        note_use(&p2);
        w.evict_templates(&p2);
        assert!(!p1.exists(), "retired");
        w.collect_templates();
        assert!(d1.exists(), "within its grace");
        age_file(&d1.join(RETIRED), RETIRE_GRACE + Duration::from_secs(1));
        w.collect_templates();
        assert!(!d1.exists(), "gone after it");
    }

    /// A retired template whose files a VM's disk uses (its marker names it) is kept
    /// whatever the mark's age.
    #[test]
    fn test_a_retired_template_a_vm_uses_is_kept() {
        let (_state, w) = engine(1);
        let hour = Duration::from_secs(3600);
        let (d1, p1) = fake(&w, 256, 2 * hour);
        let (_d2, p2) = fake(&w, 384, hour);
        w.evict_templates(&p2);
        assert!(!p1.exists());
        let vm = w.cfg.state_dir.join("vms/vm-000000000001");
        std::fs::create_dir_all(&vm).expect("vm dir");
        let name = d1.file_name().expect("name").to_string_lossy().into_owned();
        std::fs::write(vm.join(TEMPLATE_MARKER), &name).expect("marker");
        std::fs::write(d1.join(RETIRED), b"").expect("mark");
        age_file(&d1.join(RETIRED), 2 * RETIRE_GRACE);
        w.collect_templates();
        assert!(d1.exists(), "a VM's disk stands on it");
        assert!(!d1.join(RETIRED).exists(), "in use: the mark is dropped");
    }

    /// A create holds the template it found pinned: a retired template past its grace is
    /// kept while it is pinned (before, only the grace kept it: a create slower than that
    /// between finding it and writing its clone's marker lost its files), and goes once the
    /// pin is dropped. A template being deleted (its exclusive lock held) is not found.
    #[test]
    fn test_a_pinned_template_outlives_its_grace_and_one_being_deleted_is_not_found() {
        let (_state, w) = engine(1);
        let hour = Duration::from_secs(3600);
        let (d1, p1) = fake(&w, 256, 2 * hour);
        let (_d2, p2) = fake(&w, 384, hour);
        let pin = Template::pin(d1.clone())
            .expect("pin")
            .expect("the template is there");
        w.evict_templates(&p2);
        assert!(!p1.exists(), "retired");
        w.collect_templates();
        age_file(&d1.join(RETIRED), 2 * RETIRE_GRACE);
        w.collect_templates();
        assert!(d1.exists(), "a create holds it");
        drop(pin);
        w.collect_templates();
        assert!(!d1.exists(), "unpinned and past its grace: deleted");

        let (d3, _p3) = fake(&w, 512, hour);
        let deleting = std::fs::File::open(&d3).expect("open");
        deleting.try_lock().expect("exclusive");
        assert!(
            Template::pin(d3.clone()).expect("pin").is_none(),
            "a template being deleted is found"
        );
        drop(deleting);
        assert!(Template::pin(d3).expect("pin").is_some());
    }

    /// The last step of a collection, once it holds a retired template's exclusive lock: a
    /// VM whose marker names the template keeps it. Found by a hostile review: the markers
    /// were read once, before the loop; a create that held the pin then (no marker yet) and
    /// wrote its clone's marker and let go before the collection took the lock lost its
    /// disk's backing file. Control: with no marker the template goes.
    #[test]
    fn test_a_template_a_vm_took_on_during_a_collection_is_kept() {
        let (_state, w) = engine(1);
        let hour = Duration::from_secs(3600);
        let (d1, _p1) = fake(&w, 256, 2 * hour);
        let (d2, _p2) = fake(&w, 384, hour);
        let vm = w.cfg.state_dir.join("vms/vm-000000000001");
        std::fs::create_dir_all(&vm).expect("vm dir");
        let name = d1.file_name().expect("name").to_string_lossy().into_owned();
        std::fs::write(vm.join(TEMPLATE_MARKER), format!("{name}\n")).expect("marker");
        remove_unpinned(&w.cfg.state_dir, &d1);
        assert!(d1.exists(), "a VM's disk stands on it");
        remove_unpinned(&w.cfg.state_dir, &d2);
        assert!(!d2.exists(), "control: an unused one goes");
    }

    #[tokio::test]
    async fn test_sweep_destroys_build_vms_only_when_no_build_holds_a_key_lock() {
        let (_state, w) = engine(4);
        // A build VM (request id `rid`, or none: an older engine's) or, with `rid` empty
        // and an id ending in c1, a caller's VM.
        let insert = |id: &str, rid: &str| {
            let mut rec = crate::vm::test_vm(id);
            if !id.ends_with("c1") {
                rec.workspace = TEMPLATE_WORKSPACE.into();
            }
            rec.request_id = (!rid.is_empty()).then(|| rid.to_string());
            rec.state = crate::store::VmState::Failed;
            w.store
                .insert(&mut rec, w.first_vm_uid(), |_| Ok::<(), CoreError>(()))
                .expect("insert");
            rec.id
        };
        let (d, e) = ("d".repeat(32), "e".repeat(32));
        let build = insert("vm-0000000000b1", &format!("build-{d}-00000001"));
        let other_key = insert("vm-0000000000b2", &format!("build-{e}-00000002"));
        let older = insert("vm-0000000000b3", "");
        let callers = insert("vm-0000000000c1", "");
        let root = w.templates_dir();
        std::fs::create_dir_all(&root).expect("templates");
        let lock = |digest: &str| {
            let f = warren_supervisor::layout::open_lock_file(&root.join(format!("{digest}.lock")))
                .expect("lock file");
            nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockExclusiveNonblock)
                .expect("a build's lock")
        };
        // A build holds key d: its VM stays, and so does the older engine's build VM (which
        // key it is for is not recorded); key e's build is gone.
        let held = lock(&d);
        let swept = w.sweep_template_builds().await.expect("sweep");
        assert_eq!(swept, vec![other_key.clone()]);
        assert!(w.store.get(&build).expect("get").is_some());
        assert!(w.store.get(&older).expect("get").is_some());
        // The build ended (its process died): its VM is an orphan; a caller's VM is not.
        drop(held);
        let swept = w.sweep_template_builds().await.expect("sweep");
        assert_eq!(swept, vec![build.clone(), older.clone()]);
        assert!(w.store.get(&build).expect("get").is_none());
        assert!(w.store.get(&callers).expect("get").is_some());
        // Nothing left: nothing to do.
        assert!(w.sweep_template_builds().await.expect("sweep").is_empty());
        // The name a build gives its VM names its key.
        let key = TemplateKey {
            image_id: "a".repeat(64),
            memory_mib: 512,
            vcpus: 1,
            accel: "tcg".into(),
            cpu: warren_vmm::qemu::TCG_CPU.into(),
            shares: vec![],
            network: false,
        };
        let rid = format!("build-{}-0a0b0c0d", key.digest());
        assert_eq!(build_key_digest(&rid), Some(key.digest().as_str()));
        assert_eq!(build_key_digest("build-zz-1"), None);
    }
}
