//! The SQLite store of VM records. Many CLI processes and the service may use it at once: WAL
//! mode and a busy timeout serialise writers, and admission runs in an immediate transaction so
//! two creators never both pass a limit.

use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

use rusqlite::{params, Connection, OptionalExtension, Transaction, TransactionBehavior};
use serde::Serialize;

/// A VM's lifecycle state as stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum VmState {
    Creating,
    Running,
    Failed,
    /// vCPUs stopped, RAM held by the VMM.
    Paused,
    /// A checkpoint is being written (the VMM still runs).
    Hibernating,
    /// Memory and device state on disk; no VMM, no host RAM.
    Hibernated,
    /// A hibernated VM being restored.
    Resuming,
}

impl VmState {
    pub fn as_str(self) -> &'static str {
        match self {
            VmState::Creating => "creating",
            VmState::Running => "running",
            VmState::Failed => "failed",
            VmState::Paused => "paused",
            VmState::Hibernating => "hibernating",
            VmState::Hibernated => "hibernated",
            VmState::Resuming => "resuming",
        }
    }
    fn parse(s: &str) -> VmState {
        match s {
            "creating" => VmState::Creating,
            "running" => VmState::Running,
            "paused" => VmState::Paused,
            "hibernating" => VmState::Hibernating,
            "hibernated" => VmState::Hibernated,
            "resuming" => VmState::Resuming,
            _ => VmState::Failed,
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct VmRecord {
    pub id: String,
    pub image_id: String,
    pub state: VmState,
    pub reason: Option<String>,
    pub memory_mib: u32,
    pub vcpus: u32,
    pub accel: String,
    pub uid: u32,
    pub created_unix: u64,
    pub boot_ms: Option<u64>,
    /// The owning workspace (`local-<uid>` for the CLI and local callers).
    pub workspace: String,
    /// Storage reserved for the VM's disk (the image's virtual size), MiB.
    pub disk_mib: u64,
    /// The memory lineage: 1 at creation (a session's VM starts at its session's), +1 on
    /// every fresh boot after its memory was lost (a checkpoint that could not be restored).
    pub generation: u64,
    /// The idempotency key of the request that created it, if any.
    pub request_id: Option<String>,
    /// Suspend after this long without work (0: never).
    pub idle_seconds: u32,
    /// `hibernate` or `pause`.
    pub idle_mode: String,
    /// Last exec, output read, cancel or file operation (status and list do not count).
    pub last_active_unix: u64,
    /// Host directories shared into the guest.
    pub mounts: Vec<MountSpec>,
    /// Guest RAM lives in a file in the VM's directory (fast standby hibernation); the file
    /// counts as storage.
    pub ram_file: bool,
}

/// One host directory shared into a VM over virtio-fs.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct MountSpec {
    /// Canonical host directory.
    pub host: PathBuf,
    /// Absolute guest path it is mounted at.
    pub guest: String,
    /// Enforced on the host side (virtiofsd `--readonly`).
    pub read_only: bool,
    /// The host uid/gid the guest user maps to (files the guest creates belong to it).
    pub owner: Option<(u32, u32)>,
    /// The directory's (device, inode) when the mount was made: every later launch refuses
    /// a host path that now leads elsewhere. `None` until first checked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub identity: Option<(u64, u64)>,
}

/// What the VMs already admitted hold, summed over a set of them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub vms: u64,
    /// Memory of VMs that hold it (creating or running).
    pub memory_mib: u64,
    /// Storage reservations: every retained VM's disk (and a hibernated VM's memory image),
    /// plus every session's own filesystem (its storage limit).
    pub disk_mib: u64,
}

/// The state database. Clones share one connection: a second connection opened inside the
/// same process (its open and close of the database file) would drop the first one's POSIX
/// locks, which SQLite relies on.
#[derive(Clone)]
pub struct Store {
    conn: std::sync::Arc<Mutex<Connection>>,
}

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS vms (
    id TEXT PRIMARY KEY,
    image_id TEXT NOT NULL,
    state TEXT NOT NULL,
    reason TEXT,
    memory_mib INTEGER NOT NULL,
    vcpus INTEGER NOT NULL,
    accel TEXT NOT NULL,
    uid INTEGER NOT NULL UNIQUE,
    created_unix INTEGER NOT NULL,
    boot_ms INTEGER
);";

/// Sessions: a workspace copy of a project (or a project directory itself, `direct`) and
/// the VM it is mounted in.
const SESSION_SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS sessions (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    workspace TEXT NOT NULL,
    owner_uid INTEGER NOT NULL,
    owner_gid INTEGER NOT NULL,
    source TEXT NOT NULL,
    source_git TEXT,
    dir TEXT NOT NULL,
    direct INTEGER NOT NULL,
    vm_id TEXT,
    created_unix INTEGER NOT NULL,
    devices TEXT NOT NULL,
    UNIQUE (workspace, name)
);";

/// One session's record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SessionRecord {
    pub id: String,
    pub name: String,
    pub workspace: String,
    pub owner_uid: u32,
    pub owner_gid: u32,
    /// The project: the canonical git toplevel (or the directory itself when `direct`).
    pub source: PathBuf,
    /// The source repository's common git directory (none when `direct`).
    pub source_git: Option<PathBuf>,
    /// The session directory (the copy lives in `dir/workspace`); unused when `direct`.
    pub dir: PathBuf,
    pub direct: bool,
    /// The session's VM, while it has one.
    pub vm_id: Option<String>,
    pub created_unix: u64,
    /// What the VM was created with (image, memory, vcpus, extra mounts), compared by
    /// `warren run` to refuse silently different devices.
    pub devices: serde_json::Value,
    /// The size of the session's own filesystem, MiB, reserved as storage (0: the copy is a
    /// plain directory, or the session is direct).
    pub storage_mib: u64,
    /// The session's memory lineage, always its current VM's generation: 1 at creation, +1
    /// on every recreate (a new VM) and on every fresh boot of its VM after memory loss.
    pub generation: u64,
}

/// Columns added after the first release, with their defaults for existing rows.
const ADDED_COLUMNS: &[(&str, &str)] = &[
    ("workspace", "TEXT NOT NULL DEFAULT 'local-0'"),
    ("disk_mib", "INTEGER NOT NULL DEFAULT 0"),
    ("generation", "INTEGER NOT NULL DEFAULT 1"),
    ("request_id", "TEXT"),
    ("idle_seconds", "INTEGER NOT NULL DEFAULT 300"),
    ("idle_mode", "TEXT NOT NULL DEFAULT 'hibernate'"),
    ("last_active_unix", "INTEGER NOT NULL DEFAULT 0"),
    ("mounts", "TEXT NOT NULL DEFAULT '[]'"),
    ("ram_file", "INTEGER NOT NULL DEFAULT 0"),
];

/// Columns added to `sessions` after the first release.
const ADDED_SESSION_COLUMNS: &[(&str, &str)] = &[
    ("storage_mib", "INTEGER NOT NULL DEFAULT 0"),
    ("generation", "INTEGER NOT NULL DEFAULT 1"),
];

/// Opens (or creates) the database file at `path` as a WAL connection, readable by its owner
/// only: the file is made 0600 before SQLite opens it (SQLite gives its WAL and shared-memory
/// files the database file's mode), and existing WAL and shared-memory files are narrowed.
/// Every opener of the state database goes through this (the service, the CLI's `token`),
/// whichever creates the file first.
///
/// Never opens a descriptor of an existing database file itself: closing one drops every
/// POSIX lock this process holds on the file, the locks of SQLite connections already open
/// in it included (the service opens the store, then the credentials and receipts). A new
/// file is created (`O_EXCL`, 0600) and closed before any connection exists; an existing one
/// is narrowed by path.
pub fn open_private(path: &Path) -> Result<Connection, rusqlite::Error> {
    use std::os::unix::fs::OpenOptionsExt;
    let private = |e: std::io::Error| {
        rusqlite::Error::SqliteFailure(
            rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_CANTOPEN),
            Some(format!("{}: {e}", path.display())),
        )
    };
    match std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(warren_vmm::sys::private_file::MODE)
        .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_CLOEXEC)
        .open(path)
    {
        Ok(new) => drop(new),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            if std::fs::symlink_metadata(path)
                .map_err(private)?
                .file_type()
                .is_symlink()
            {
                return Err(private(std::io::Error::other("a symlink")));
            }
            warren_vmm::sys::private_file::restrict(path).map_err(private)?;
        }
        Err(e) => return Err(private(e)),
    }
    for suffix in ["-wal", "-shm"] {
        let mut p = path.as_os_str().to_owned();
        p.push(suffix);
        warren_vmm::sys::private_file::restrict(Path::new(&p)).map_err(private)?;
    }
    let conn = Connection::open(path)?;
    conn.busy_timeout(std::time::Duration::from_secs(10))?;
    conn.pragma_update(None, "journal_mode", "WAL")?;
    Ok(conn)
}

impl Store {
    /// Opens the existing database at `path` for reading only: no schema, no migration,
    /// nothing written (a reader beside the service, such as `vm cp` learning which
    /// directories VMs write).
    pub fn open_read_only(path: &Path) -> Result<Store, rusqlite::Error> {
        let conn = Connection::open_with_flags(
            path,
            rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY | rusqlite::OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )?;
        conn.busy_timeout(std::time::Duration::from_secs(10))?;
        Ok(Store {
            conn: std::sync::Arc::new(Mutex::new(conn)),
        })
    }

    /// Opens (or creates) the database at `path`, readable by its owner only: the file is
    /// made 0600 before SQLite opens it, and SQLite gives its WAL and shared-memory files the
    /// database file's mode.
    pub fn open(path: &Path) -> Result<Store, rusqlite::Error> {
        let conn = open_private(path)?;
        conn.execute_batch(SCHEMA)?;
        conn.execute_batch(SESSION_SCHEMA)?;
        migrate(&conn)?;
        Ok(Store {
            conn: std::sync::Arc::new(Mutex::new(conn)),
        })
    }

    fn conn(&self) -> MutexGuard<'_, Connection> {
        // A panic while holding the lock cannot leave SQLite inconsistent (transactions roll
        // back on drop), so a poisoned lock is still usable.
        self.conn.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Inserts a new record with the lowest free uid at or above `uid_base`, after `admit`
    /// approved it inside the same immediate transaction (so limits hold across processes).
    pub fn insert<E: From<rusqlite::Error>>(
        &self,
        rec: &mut VmRecord,
        uid_base: u32,
        admit: impl FnOnce(&Transaction<'_>) -> Result<(), E>,
    ) -> Result<(), E> {
        self.immediate(|tx| {
            admit(tx)?;
            insert_in(tx, rec, uid_base)?;
            Ok(())
        })
    }

    /// Runs `f` in one immediate transaction (committed when it succeeds): admission checks
    /// and the changes they allow are one step for every concurrent creator.
    pub(crate) fn immediate<T, E: From<rusqlite::Error>>(
        &self,
        f: impl FnOnce(&Transaction<'_>) -> Result<T, E>,
    ) -> Result<T, E> {
        let mut conn = self.conn();
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let out = f(&tx)?;
        tx.commit()?;
        Ok(out)
    }

    /// Moves `id` from state `from` to `to` after `admit` approved it inside the same
    /// immediate transaction, so the check and the reservation it makes are one step (a
    /// concurrent creator or resumer sees the VM in `to`). `Ok(false)`: the VM was not in
    /// `from`, nothing changed.
    pub fn transition<E: From<rusqlite::Error>>(
        &self,
        id: &str,
        from: VmState,
        to: VmState,
        admit: impl FnOnce(&Transaction<'_>) -> Result<(), E>,
    ) -> Result<bool, E> {
        let mut conn = self.conn();
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let state: Option<String> = tx
            .query_row("SELECT state FROM vms WHERE id = ?1", [id], |r| r.get(0))
            .optional()?;
        if state.as_deref() != Some(from.as_str()) {
            return Ok(false);
        }
        admit(&tx)?;
        tx.execute(
            "UPDATE vms SET state = ?2, reason = NULL WHERE id = ?1",
            params![id, to.as_str()],
        )?;
        tx.commit()?;
        Ok(true)
    }

    pub fn set_state(
        &self,
        id: &str,
        state: VmState,
        reason: Option<&str>,
        boot_ms: Option<u64>,
    ) -> Result<(), rusqlite::Error> {
        self.conn().execute(
            "UPDATE vms SET state = ?2, reason = ?3, boot_ms = COALESCE(?4, boot_ms) WHERE id = ?1",
            params![id, state.as_str(), reason, boot_ms.map(|b| b as i64)],
        )?;
        Ok(())
    }

    pub fn get(&self, id: &str) -> Result<Option<VmRecord>, rusqlite::Error> {
        self.conn()
            .query_row("SELECT * FROM vms WHERE id = ?1", [id], row)
            .optional()
    }

    pub fn list(&self) -> Result<Vec<VmRecord>, rusqlite::Error> {
        let conn = self.conn();
        let mut st = conn.prepare("SELECT * FROM vms ORDER BY created_unix, id")?;
        let rows = st.query_map([], row)?;
        rows.collect()
    }

    /// The VMs of `workspace`.
    pub fn in_workspace(&self, workspace: &str) -> Result<Vec<VmRecord>, rusqlite::Error> {
        let conn = self.conn();
        let mut st =
            conn.prepare("SELECT * FROM vms WHERE workspace = ?1 ORDER BY created_unix, id")?;
        let rows = st.query_map([workspace], row)?;
        rows.collect()
    }

    /// A workspace's VM created by the request `request_id`, if any.
    pub fn by_request(
        &self,
        workspace: &str,
        request_id: &str,
    ) -> Result<Option<VmRecord>, rusqlite::Error> {
        self.conn()
            .query_row(
                "SELECT * FROM vms WHERE workspace = ?1 AND request_id = ?2",
                [workspace, request_id],
                row,
            )
            .optional()
    }

    /// Records work on a VM now (keeps it from idling out). A VM already touched this second
    /// is left as it is: an update that changes no row writes nothing (no journal sync), so a
    /// burst of calls (file chunks, output polls) costs one write a second, not one each.
    pub fn touch(&self, id: &str, now_unix: u64) -> Result<(), rusqlite::Error> {
        self.conn().execute(
            "UPDATE vms SET last_active_unix = ?2 WHERE id = ?1 AND last_active_unix < ?2",
            params![id, now_unix as i64],
        )?;
        Ok(())
    }

    pub fn delete(&self, id: &str) -> Result<(), rusqlite::Error> {
        self.conn().execute("DELETE FROM vms WHERE id = ?1", [id])?;
        Ok(())
    }

    /// A VM using `image_id`, if any.
    /// Runs `check` in an immediate transaction that writes nothing (an admission check
    /// ahead of work that a later, reserving transaction checks again).
    pub fn admit<E: From<rusqlite::Error>>(
        &self,
        check: impl FnOnce(&Transaction<'_>) -> Result<(), E>,
    ) -> Result<(), E> {
        let mut conn = self.conn();
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        check(&tx)
    }

    /// Inserts a session after `admit` approved its storage inside the same immediate
    /// transaction. A constraint violation (a taken name) comes back as the store error.
    pub fn insert_session<E: From<rusqlite::Error>>(
        &self,
        s: &SessionRecord,
        admit: impl FnOnce(&Transaction<'_>) -> Result<(), E>,
    ) -> Result<(), E> {
        let mut conn = self.conn();
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        admit(&tx)?;
        insert_session_in(&tx, s)?;
        tx.commit()?;
        Ok(())
    }

    /// Sessions, oldest first; only `workspace`'s when given.
    pub fn sessions(&self, workspace: Option<&str>) -> Result<Vec<SessionRecord>, rusqlite::Error> {
        let conn = self.conn();
        let mut st = conn.prepare(
            "SELECT * FROM sessions WHERE ?1 IS NULL OR workspace = ?1 ORDER BY created_unix, id",
        )?;
        let rows = st.query_map(params![workspace], session_row)?;
        rows.collect()
    }

    /// Records `vm_id` as the session's VM, booted with `devices`, at `generation`.
    pub fn set_session_vm(
        &self,
        id: &str,
        vm_id: Option<&str>,
        devices: &serde_json::Value,
        generation: u64,
    ) -> Result<(), rusqlite::Error> {
        let changed = self.conn().execute(
            "UPDATE sessions SET vm_id = ?2, devices = ?3, generation = ?4 WHERE id = ?1",
            params![id, vm_id, devices.to_string(), generation as i64],
        )?;
        // A session deleted meanwhile: its new VM must not run on for no session.
        if changed != 1 {
            return Err(rusqlite::Error::QueryReturnedNoRows);
        }
        Ok(())
    }

    /// The VM `vm_id` lost its memory: its generation and that of the session it belongs
    /// to (if any) go up by one, in one transaction. Returns the VM's new generation.
    pub fn bump_generation(&self, vm_id: &str) -> Result<u64, rusqlite::Error> {
        let mut conn = self.conn();
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        tx.execute(
            "UPDATE vms SET generation = generation + 1 WHERE id = ?1",
            [vm_id],
        )?;
        tx.execute(
            "UPDATE sessions SET generation = generation + 1 WHERE vm_id = ?1",
            [vm_id],
        )?;
        let g: i64 = tx.query_row("SELECT generation FROM vms WHERE id = ?1", [vm_id], |r| {
            r.get(0)
        })?;
        tx.commit()?;
        Ok(g as u64)
    }

    pub fn delete_session(&self, id: &str) -> Result<(), rusqlite::Error> {
        self.conn()
            .execute("DELETE FROM sessions WHERE id = ?1", params![id])?;
        Ok(())
    }

    pub fn vm_using_image(&self, image_id: &str) -> Result<Option<String>, rusqlite::Error> {
        self.conn()
            .query_row(
                "SELECT id FROM vms WHERE image_id = ?1 LIMIT 1",
                [image_id],
                |r| r.get(0),
            )
            .optional()
    }
}

/// Inserts session `s` inside the caller's transaction.
pub(crate) fn insert_session_in(
    tx: &Transaction<'_>,
    s: &SessionRecord,
) -> Result<(), rusqlite::Error> {
    tx.execute(
        "INSERT INTO sessions (id, name, workspace, owner_uid, owner_gid, source, source_git,
                               dir, direct, vm_id, created_unix, devices, storage_mib,
                               generation)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14)",
        params![
            s.id,
            s.name,
            s.workspace,
            s.owner_uid,
            s.owner_gid,
            s.source.to_string_lossy(),
            s.source_git
                .as_ref()
                .map(|p| p.to_string_lossy().into_owned()),
            s.dir.to_string_lossy(),
            s.direct,
            s.vm_id,
            s.created_unix as i64,
            s.devices.to_string(),
            s.storage_mib as i64,
            s.generation as i64,
        ],
    )?;
    Ok(())
}

/// Inserts `rec` with the lowest free uid at or above `uid_base` (part of a caller's
/// transaction, after its admission check).
pub(crate) fn insert_in(
    tx: &Transaction<'_>,
    rec: &mut VmRecord,
    uid_base: u32,
) -> Result<(), rusqlite::Error> {
    let used: Vec<u32> = {
        let mut st = tx.prepare("SELECT uid FROM vms ORDER BY uid")?;
        let rows = st.query_map([], |r| r.get(0))?;
        rows.collect::<Result<_, _>>()?
    };
    let mut uid = uid_base;
    for u in used {
        if u == uid {
            uid += 1;
        } else if u > uid {
            break;
        }
    }
    if uid - uid_base >= crate::vm::uid_blocks::BLOCK - 1 {
        // Unreachable under any host limit: a block holds 65,535 VMs (its first id is the
        // state directory's templates group).
        return Err(rusqlite::Error::InvalidParameterName(
            "no free VM uid left in this state directory's block".into(),
        ));
    }
    rec.uid = uid;
    tx.execute(
        "INSERT INTO vms (id, image_id, state, reason, memory_mib, vcpus, accel, uid, created_unix, boot_ms,
                          workspace, disk_mib, generation, request_id, idle_seconds, idle_mode,
                          last_active_unix, mounts, ram_file)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17, ?18, ?19)",
        params![
            rec.id,
            rec.image_id,
            rec.state.as_str(),
            rec.reason,
            rec.memory_mib,
            rec.vcpus,
            rec.accel,
            rec.uid,
            rec.created_unix as i64,
            rec.boot_ms.map(|b| b as i64),
            rec.workspace,
            rec.disk_mib as i64,
            rec.generation as i64,
            rec.request_id,
            rec.idle_seconds,
            rec.idle_mode,
            rec.last_active_unix as i64,
            serde_json::to_string(&rec.mounts).expect("invariant: mounts serialise"),
            rec.ram_file,
        ],
    )?;
    Ok(())
}

/// Sums what admitted VMs and sessions hold; `workspace` restricts it to one workspace.
pub fn usage(tx: &Transaction<'_>, workspace: Option<&str>) -> Result<Usage, rusqlite::Error> {
    tx.query_row(
        "SELECT COUNT(*),
                COALESCE(SUM(CASE WHEN state IN ('creating', 'running', 'paused', 'hibernating', 'resuming') THEN memory_mib ELSE 0 END), 0),
                COALESCE(SUM(disk_mib + CASE WHEN state IN ('hibernating', 'hibernated') THEN memory_mib ELSE 0 END), 0)
                + (SELECT COALESCE(SUM(storage_mib), 0) FROM sessions WHERE ?1 IS NULL OR workspace = ?1)
         FROM vms WHERE ?1 IS NULL OR workspace = ?1",
        [workspace],
        |r| {
            Ok(Usage {
                vms: r.get::<_, i64>(0)? as u64,
                memory_mib: r.get::<_, i64>(1)? as u64,
                disk_mib: r.get::<_, i64>(2)? as u64,
            })
        },
    )
}

fn migrate(conn: &Connection) -> Result<(), rusqlite::Error> {
    let have: Vec<String> = {
        let mut st = conn.prepare("SELECT name FROM pragma_table_info('vms')")?;
        let rows = st.query_map([], |r| r.get(0))?;
        rows.collect::<Result<_, _>>()?
    };
    for (name, decl) in ADDED_COLUMNS {
        if !have.iter().any(|h| h == name) {
            conn.execute_batch(&format!("ALTER TABLE vms ADD COLUMN {name} {decl}"))?;
        }
    }
    let have: Vec<String> = {
        let mut st = conn.prepare("SELECT name FROM pragma_table_info('sessions')")?;
        let rows = st.query_map([], |r| r.get(0))?;
        rows.collect::<Result<_, _>>()?
    };
    for (name, decl) in ADDED_SESSION_COLUMNS {
        if !have.iter().any(|h| h == name) {
            conn.execute_batch(&format!("ALTER TABLE sessions ADD COLUMN {name} {decl}"))?;
        }
    }
    conn.execute_batch(
        "CREATE UNIQUE INDEX IF NOT EXISTS vms_request ON vms (workspace, request_id)",
    )
}

fn session_row(r: &rusqlite::Row<'_>) -> Result<SessionRecord, rusqlite::Error> {
    let devices: String = r.get("devices")?;
    Ok(SessionRecord {
        id: r.get("id")?,
        name: r.get("name")?,
        workspace: r.get("workspace")?,
        owner_uid: r.get("owner_uid")?,
        owner_gid: r.get("owner_gid")?,
        source: PathBuf::from(r.get::<_, String>("source")?),
        source_git: r.get::<_, Option<String>>("source_git")?.map(PathBuf::from),
        dir: PathBuf::from(r.get::<_, String>("dir")?),
        direct: r.get("direct")?,
        vm_id: r.get("vm_id")?,
        created_unix: r.get::<_, i64>("created_unix")? as u64,
        devices: serde_json::from_str(&devices).map_err(|e| {
            rusqlite::Error::FromSqlConversionFailure(0, rusqlite::types::Type::Text, e.into())
        })?,
        storage_mib: r.get::<_, i64>("storage_mib")? as u64,
        generation: r.get::<_, i64>("generation")? as u64,
    })
}

pub(crate) fn row(r: &rusqlite::Row<'_>) -> Result<VmRecord, rusqlite::Error> {
    Ok(VmRecord {
        id: r.get("id")?,
        image_id: r.get("image_id")?,
        state: VmState::parse(&r.get::<_, String>("state")?),
        reason: r.get("reason")?,
        memory_mib: r.get("memory_mib")?,
        vcpus: r.get("vcpus")?,
        accel: r.get("accel")?,
        uid: r.get("uid")?,
        created_unix: r.get::<_, i64>("created_unix")? as u64,
        boot_ms: r.get::<_, Option<i64>>("boot_ms")?.map(|b| b as u64),
        workspace: r.get("workspace")?,
        disk_mib: r.get::<_, i64>("disk_mib")? as u64,
        generation: r.get::<_, i64>("generation")? as u64,
        request_id: r.get("request_id")?,
        idle_seconds: r.get("idle_seconds")?,
        idle_mode: r.get("idle_mode")?,
        last_active_unix: r.get::<_, i64>("last_active_unix")? as u64,
        mounts: {
            let text: String = r.get("mounts")?;
            serde_json::from_str(&text).map_err(|e| {
                rusqlite::Error::FromSqlConversionFailure(0, rusqlite::types::Type::Text, e.into())
            })?
        },
        ram_file: r.get("ram_file")?,
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    fn rec(id: &str) -> VmRecord {
        VmRecord {
            id: id.into(),
            image_id: "img".into(),
            state: VmState::Creating,
            reason: None,
            memory_mib: 512,
            vcpus: 1,
            accel: "tcg".into(),
            uid: 0,
            created_unix: 1,
            boot_ms: None,
            workspace: "w".into(),
            disk_mib: 100,
            generation: 1,
            request_id: None,
            idle_seconds: 0,
            idle_mode: "hibernate".into(),
            last_active_unix: 0,
            mounts: vec![],
            ram_file: false,
        }
    }

    fn ok(_: &Transaction<'_>) -> Result<(), rusqlite::Error> {
        Ok(())
    }

    #[test]
    fn test_insert_allocates_lowest_free_uid() {
        let d = tempfile::tempdir().expect("tempdir");
        let s = Store::open(&d.path().join("db")).expect("open");
        let (mut a, mut b, mut c) = (rec("a"), rec("b"), rec("c"));
        s.insert(&mut a, 100, ok).expect("a");
        s.insert(&mut b, 100, ok).expect("b");
        assert_eq!((a.uid, b.uid), (100, 101));
        s.delete("a").expect("delete");
        s.insert(&mut c, 100, ok).expect("c");
        assert_eq!(c.uid, 100);
    }

    #[test]
    fn test_set_state_failed_keeps_reason() {
        let d = tempfile::tempdir().expect("tempdir");
        let s = Store::open(&d.path().join("db")).expect("open");
        s.insert(&mut rec("a"), 1, ok).expect("insert");
        s.set_state("a", VmState::Failed, Some("qemu died"), None)
            .expect("set");
        let r = s.get("a").expect("get").expect("row");
        assert_eq!(r.state, VmState::Failed);
        assert_eq!(r.reason.as_deref(), Some("qemu died"));
        assert_eq!(s.vm_using_image("img").expect("q").as_deref(), Some("a"));
    }

    #[test]
    fn test_transition_refused_or_stale_changes_nothing() {
        let d = tempfile::tempdir().expect("tempdir");
        let s = Store::open(&d.path().join("db")).expect("open");
        s.insert(&mut rec("a"), 1, ok).expect("a");
        s.set_state("a", VmState::Hibernated, None, None)
            .expect("set");
        let refused: Result<bool, rusqlite::Error> =
            s.transition("a", VmState::Hibernated, VmState::Resuming, |_| {
                Err(rusqlite::Error::InvalidQuery)
            });
        assert!(refused.is_err());
        assert_eq!(
            s.get("a").expect("get").expect("row").state,
            VmState::Hibernated
        );
        // Control: approved, it moves (and the memory counts again); a second try is stale.
        assert_eq!(
            s.transition("a", VmState::Hibernated, VmState::Resuming, ok),
            Ok(true)
        );
        assert_eq!(
            s.get("a").expect("get").expect("row").state,
            VmState::Resuming
        );
        assert_eq!(
            s.transition("a", VmState::Hibernated, VmState::Resuming, ok),
            Ok(false)
        );
    }

    #[test]
    fn test_insert_admission_sees_usage_and_can_refuse() {
        let d = tempfile::tempdir().expect("tempdir");
        let s = Store::open(&d.path().join("db")).expect("open");
        s.insert(&mut rec("a"), 1, ok).expect("a");
        let mut seen = Usage::default();
        let r: Result<(), rusqlite::Error> = s.insert(&mut rec("b"), 1, |tx| {
            seen = usage(tx, Some("w"))?;
            Err(rusqlite::Error::InvalidQuery)
        });
        assert!(r.is_err());
        assert_eq!(
            seen,
            Usage {
                vms: 1,
                memory_mib: 512,
                disk_mib: 100
            }
        );
        assert!(
            s.get("b").expect("get").is_none(),
            "refused insert left a row"
        );
    }

    pub(crate) fn session(
        id: &str,
        name: &str,
        workspace: &str,
        storage_mib: u64,
    ) -> SessionRecord {
        SessionRecord {
            id: id.into(),
            name: name.into(),
            workspace: workspace.into(),
            owner_uid: 0,
            owner_gid: 0,
            source: "/src".into(),
            source_git: None,
            dir: "/s".into(),
            direct: false,
            vm_id: None,
            created_unix: 1,
            devices: serde_json::json!({}),
            storage_mib,
            generation: 1,
        }
    }

    #[test]
    fn test_session_storage_counts_in_usage_and_refused_insert_leaves_nothing() {
        let d = tempfile::tempdir().expect("tempdir");
        let s = Store::open(&d.path().join("db")).expect("open");
        s.insert(&mut rec("a"), 1, ok).expect("a");
        s.insert_session(&session("ses-1", "one", "w", 256), ok)
            .expect("one");
        s.insert_session(&session("ses-2", "two", "other", 1024), ok)
            .expect("two");
        let mut seen = (Usage::default(), Usage::default());
        let r: Result<(), rusqlite::Error> =
            s.insert_session(&session("ses-3", "three", "w", 64), |tx| {
                seen = (usage(tx, Some("w"))?, usage(tx, None)?);
                Err(rusqlite::Error::InvalidQuery)
            });
        assert!(r.is_err());
        // The workspace's VM disk (100) plus its own session (256), not the other's.
        assert_eq!(seen.0.disk_mib, 356);
        assert_eq!(seen.0.vms, 1, "a session is not a VM");
        assert_eq!(seen.1.disk_mib, 100 + 256 + 1024);
        let names: Vec<String> = s
            .sessions(None)
            .expect("list")
            .into_iter()
            .map(|x| x.name)
            .collect();
        assert_eq!(names, ["one", "two"], "refused insert left a row");
        assert_eq!(s.sessions(Some("w")).expect("w")[0].storage_mib, 256);
    }

    #[test]
    fn test_migrate_old_database_opens_with_generation_one() {
        let d = tempfile::tempdir().expect("tempdir");
        let path = d.path().join("db");
        {
            // The first release's tables: no generation (nor any later column) anywhere.
            let c = Connection::open(&path).expect("old db");
            c.execute_batch(SCHEMA).expect("vms");
            c.execute_batch(SESSION_SCHEMA).expect("sessions");
            c.execute(
                "INSERT INTO vms (id, image_id, state, memory_mib, vcpus, accel, uid, created_unix)
                 VALUES ('vm-old', 'img', 'running', 512, 1, 'tcg', 7, 1)",
                [],
            )
            .expect("old vm");
            c.execute(
                "INSERT INTO sessions (id, name, workspace, owner_uid, owner_gid, source, dir,
                                       direct, vm_id, created_unix, devices)
                 VALUES ('ses-old', 'old', 'w', 0, 0, '/src', '/s', 0, 'vm-old', 1, '{}')",
                [],
            )
            .expect("old session");
        }
        let s = Store::open(&path).expect("migrated");
        assert_eq!(s.get("vm-old").expect("get").expect("row").generation, 1);
        assert_eq!(s.sessions(None).expect("list")[0].generation, 1);
        // The migrated rows take part in the lineage like new ones.
        assert_eq!(s.bump_generation("vm-old"), Ok(2));
        assert_eq!(s.sessions(None).expect("list")[0].generation, 2);
        drop(s);
        // Opening again migrates nothing twice and keeps the values.
        let s = Store::open(&path).expect("reopened");
        assert_eq!(s.get("vm-old").expect("get").expect("row").generation, 2);
    }

    #[test]
    fn test_bump_generation_moves_the_vm_and_its_session_only() {
        let d = tempfile::tempdir().expect("tempdir");
        let s = Store::open(&d.path().join("db")).expect("open");
        s.insert(&mut rec("a"), 1, ok).expect("a");
        s.insert(&mut rec("b"), 1, ok).expect("b");
        s.insert_session(&session("ses-1", "one", "w", 0), ok)
            .expect("one");
        s.insert_session(&session("ses-2", "two", "w", 0), ok)
            .expect("two");
        s.set_session_vm("ses-1", Some("a"), &serde_json::json!({}), 4)
            .expect("set");
        s.set_session_vm("ses-2", Some("b"), &serde_json::json!({}), 1)
            .expect("set");
        let g = s.get("a").expect("get").expect("row").generation;
        assert_eq!(
            g, 1,
            "a VM record keeps the generation it was inserted with"
        );
        assert_eq!(s.bump_generation("a"), Ok(2));
        let by_id = |id: &str| {
            s.sessions(None)
                .expect("list")
                .into_iter()
                .find(|x| x.id == id)
                .expect("session")
                .generation
        };
        assert_eq!((by_id("ses-1"), by_id("ses-2")), (5, 1));
        assert_eq!(s.get("b").expect("get").expect("row").generation, 1);
        // An unknown VM is an error and changes nothing.
        assert!(s.bump_generation("nope").is_err());
        assert_eq!((by_id("ses-1"), by_id("ses-2")), (5, 1));
    }
}
