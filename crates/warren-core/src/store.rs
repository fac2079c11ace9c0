//! The SQLite store of VM records. Many CLI processes may use it at once: WAL mode and a busy
//! timeout serialise writers.

use std::path::Path;

use rusqlite::{params, Connection, OptionalExtension};
use serde::Serialize;

/// A VM's lifecycle state as stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum VmState {
    Creating,
    Running,
    Failed,
}

impl VmState {
    pub fn as_str(self) -> &'static str {
        match self {
            VmState::Creating => "creating",
            VmState::Running => "running",
            VmState::Failed => "failed",
        }
    }
    fn parse(s: &str) -> VmState {
        match s {
            "creating" => VmState::Creating,
            "running" => VmState::Running,
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
}

pub struct Store {
    conn: Connection,
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

impl Store {
    pub fn open(path: &Path) -> Result<Store, rusqlite::Error> {
        let conn = Connection::open(path)?;
        conn.busy_timeout(std::time::Duration::from_secs(10))?;
        conn.pragma_update(None, "journal_mode", "WAL")?;
        conn.execute_batch(SCHEMA)?;
        Ok(Store { conn })
    }

    /// Inserts a new record with the lowest free uid at or above `uid_base`.
    pub fn insert(&self, rec: &mut VmRecord, uid_base: u32) -> Result<(), rusqlite::Error> {
        let tx = self.conn.unchecked_transaction()?;
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
        rec.uid = uid;
        tx.execute(
            "INSERT INTO vms (id, image_id, state, reason, memory_mib, vcpus, accel, uid, created_unix, boot_ms)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)",
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
                rec.boot_ms.map(|b| b as i64)
            ],
        )?;
        tx.commit()
    }

    pub fn set_state(
        &self,
        id: &str,
        state: VmState,
        reason: Option<&str>,
        boot_ms: Option<u64>,
    ) -> Result<(), rusqlite::Error> {
        self.conn.execute(
            "UPDATE vms SET state = ?2, reason = ?3, boot_ms = COALESCE(?4, boot_ms) WHERE id = ?1",
            params![id, state.as_str(), reason, boot_ms.map(|b| b as i64)],
        )?;
        Ok(())
    }

    pub fn get(&self, id: &str) -> Result<Option<VmRecord>, rusqlite::Error> {
        self.conn
            .query_row("SELECT * FROM vms WHERE id = ?1", [id], row)
            .optional()
    }

    pub fn list(&self) -> Result<Vec<VmRecord>, rusqlite::Error> {
        let mut st = self
            .conn
            .prepare("SELECT * FROM vms ORDER BY created_unix, id")?;
        let rows = st.query_map([], row)?;
        rows.collect()
    }

    pub fn delete(&self, id: &str) -> Result<(), rusqlite::Error> {
        self.conn.execute("DELETE FROM vms WHERE id = ?1", [id])?;
        Ok(())
    }

    /// A VM using `image_id`, if any.
    pub fn vm_using_image(&self, image_id: &str) -> Result<Option<String>, rusqlite::Error> {
        self.conn
            .query_row(
                "SELECT id FROM vms WHERE image_id = ?1 LIMIT 1",
                [image_id],
                |r| r.get(0),
            )
            .optional()
    }
}

fn row(r: &rusqlite::Row<'_>) -> Result<VmRecord, rusqlite::Error> {
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
    })
}

#[cfg(test)]
mod tests {
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
        }
    }

    #[test]
    fn test_insert_allocates_lowest_free_uid() {
        let d = tempfile::tempdir().expect("tempdir");
        let s = Store::open(&d.path().join("db")).expect("open");
        let (mut a, mut b, mut c) = (rec("a"), rec("b"), rec("c"));
        s.insert(&mut a, 100).expect("a");
        s.insert(&mut b, 100).expect("b");
        assert_eq!((a.uid, b.uid), (100, 101));
        s.delete("a").expect("delete");
        s.insert(&mut c, 100).expect("c");
        assert_eq!(c.uid, 100);
    }

    #[test]
    fn test_set_state_failed_keeps_reason() {
        let d = tempfile::tempdir().expect("tempdir");
        let s = Store::open(&d.path().join("db")).expect("open");
        s.insert(&mut rec("a"), 1).expect("insert");
        s.set_state("a", VmState::Failed, Some("qemu died"), None)
            .expect("set");
        let r = s.get("a").expect("get").expect("row");
        assert_eq!(r.state, VmState::Failed);
        assert_eq!(r.reason.as_deref(), Some("qemu died"));
        assert_eq!(s.vm_using_image("img").expect("q").as_deref(), Some("a"));
    }
}
