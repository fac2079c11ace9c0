//! Durable idempotency receipts for `vm_create` and `vm_exec`, keyed by (workspace, tool,
//! request_id) with the SHA-256 of the request's canonical arguments.
//!
//! A receipt is written `pending` before the action and completed after it. A pending receipt
//! found by a later request means the action's outcome was never recorded (the service
//! crashed, or the call was cut off): the tool decides from the engine's state whether it can
//! be determined, and refuses with `outcome_unknown` when it cannot.

use std::path::Path;
use std::sync::Mutex;

use rusqlite::{params, Connection, OptionalExtension};
use sha2::{Digest, Sha256};

use crate::auth::{counted_workspace, now_unix, open_db};
use crate::error::ApiError;
use crate::subuid::Subordinates;

/// Receipts kept per workspace (the workspaces of a user's subordinate uids and its own
/// together, `crate::auth::counted_workspace`); the oldest are forgotten first.
pub const MAX_RECEIPTS_PER_WORKSPACE: u64 = 4096;

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS receipts (
    workspace TEXT NOT NULL,
    tool TEXT NOT NULL,
    request_id TEXT NOT NULL,
    args_hash TEXT NOT NULL,
    state TEXT NOT NULL,
    result TEXT,
    seq INTEGER NOT NULL,
    created_unix INTEGER NOT NULL,
    PRIMARY KEY (workspace, tool, request_id)
);
CREATE INDEX IF NOT EXISTS receipts_age ON receipts (workspace, seq);";

/// What a request finds when it claims its key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// Never seen: the caller performs the action.
    New,
    /// Completed before: its recorded result (a success value or an error body).
    Done(serde_json::Value),
    /// Begun but never completed: the outcome must be determined before anything runs.
    Pending,
}

pub struct Receipts {
    conn: Mutex<Connection>,
    /// Whom a local uid's workspace counts as (`crate::auth::counted_workspace`).
    subordinates: Subordinates,
}

/// Checks a request id: 1-128 characters of `A-Za-z0-9._:-`.
pub fn validate_request_id(id: &str) -> Result<(), ApiError> {
    let ok = !id.is_empty()
        && id.len() <= 128
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._:-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(ApiError::invalid(
            "request_id must be 1-128 characters of A-Z a-z 0-9 . _ : -",
        ))
    }
}

/// The hash of a request's canonical arguments (`serde_json` of the parsed arguments struct:
/// fixed field order, defaults omitted).
pub fn args_hash<T: serde::Serialize>(args: &T) -> String {
    let body = serde_json::to_vec(args).unwrap_or_default();
    hex::encode(Sha256::digest(&body))
}

impl Receipts {
    pub fn open(db: &Path) -> Result<Receipts, ApiError> {
        let conn = open_db(db)?;
        conn.execute_batch(SCHEMA)?;
        // Added later: the workspace a receipt counts under (its own, or for a subordinate
        // uid's, its owner's); rows from before have none and count only per workspace.
        let has_counted = conn
            .prepare("SELECT 1 FROM pragma_table_info('receipts') WHERE name = 'counted'")?
            .exists([])?;
        if !has_counted {
            conn.execute_batch("ALTER TABLE receipts ADD COLUMN counted TEXT;")?;
        }
        conn.execute_batch("CREATE INDEX IF NOT EXISTS receipts_counted ON receipts (counted);")?;
        Ok(Receipts {
            conn: Mutex::new(conn),
            subordinates: Subordinates::shared(),
        })
    }

    /// These receipts with subordinate uids' workspaces counted as `subordinates` says.
    #[cfg(test)]
    pub(crate) fn with_subordinates(mut self, subordinates: Subordinates) -> Receipts {
        self.subordinates = subordinates;
        self
    }

    fn conn(&self) -> std::sync::MutexGuard<'_, Connection> {
        self.conn.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Claims a key: records a pending receipt if it is new; refuses a known key whose
    /// arguments differ with `conflict`.
    pub fn claim(
        &self,
        workspace: &str,
        tool: &str,
        request_id: &str,
        hash: &str,
    ) -> Result<Claim, ApiError> {
        let mut conn = self.conn();
        let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
        let row: Option<(String, String, Option<String>)> = tx
            .query_row(
                "SELECT args_hash, state, result FROM receipts
                 WHERE workspace = ?1 AND tool = ?2 AND request_id = ?3",
                params![workspace, tool, request_id],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
            )
            .optional()?;
        let claim = match row {
            Some((h, _, _)) if h != hash => {
                return Err(ApiError::conflict(format!(
                    "request_id {request_id} was already used for {tool} with other arguments"
                )))
            }
            Some((_, state, result)) if state == "done" => Claim::Done(
                result
                    .and_then(|r| serde_json::from_str(&r).ok())
                    .unwrap_or(serde_json::Value::Null),
            ),
            Some(_) => Claim::Pending,
            None => {
                let seq: i64 = tx.query_row(
                    "SELECT COALESCE(MAX(seq), 0) + 1 FROM receipts WHERE workspace = ?1",
                    [workspace],
                    |r| r.get(0),
                )?;
                let counted = counted_workspace(workspace, &self.subordinates);
                tx.execute(
                    "INSERT INTO receipts (workspace, tool, request_id, args_hash, state, seq, created_unix, counted)
                     VALUES (?1, ?2, ?3, ?4, 'pending', ?5, ?6, ?7)",
                    params![workspace, tool, request_id, hash, seq, now_unix() as i64, counted],
                )?;
                // Forget the oldest beyond the cap.
                tx.execute(
                    "DELETE FROM receipts WHERE workspace = ?1 AND seq <= ?2",
                    params![workspace, seq - MAX_RECEIPTS_PER_WORKSPACE as i64],
                )?;
                if counted != workspace {
                    // A subordinate uid's: the workspaces of all of its owner's range share
                    // one cap (found by a hostile review: each of 65,536 uids kept 4,096
                    // receipts of its own in root's database). The owner's own receipts are
                    // never pruned for them (a process of a user's container must not make
                    // a retry of the user's own call run twice).
                    tx.execute(
                        "DELETE FROM receipts WHERE counted = ?1 AND workspace != ?1
                         AND rowid <= (
                             SELECT rowid FROM receipts WHERE counted = ?1 AND workspace != ?1
                             ORDER BY rowid DESC LIMIT 1 OFFSET ?2)",
                        params![counted, MAX_RECEIPTS_PER_WORKSPACE as i64],
                    )?;
                }
                Claim::New
            }
        };
        tx.commit()?;
        Ok(claim)
    }

    /// Records the outcome of a claimed request.
    pub fn complete(
        &self,
        workspace: &str,
        tool: &str,
        request_id: &str,
        result: &serde_json::Value,
    ) -> Result<(), ApiError> {
        self.conn().execute(
            "UPDATE receipts SET state = 'done', result = ?4
             WHERE workspace = ?1 AND tool = ?2 AND request_id = ?3",
            params![workspace, tool, request_id, result.to_string()],
        )?;
        Ok(())
    }

    /// Forgets a claim whose action certainly did not happen, so the id can be used again.
    pub fn release(&self, workspace: &str, tool: &str, request_id: &str) -> Result<(), ApiError> {
        self.conn().execute(
            "DELETE FROM receipts WHERE workspace = ?1 AND tool = ?2 AND request_id = ?3 AND state = 'pending'",
            params![workspace, tool, request_id],
        )?;
        Ok(())
    }

    #[cfg(test)]
    fn count(&self, workspace: &str) -> i64 {
        self.conn()
            .query_row(
                "SELECT COUNT(*) FROM receipts WHERE workspace = ?1",
                [workspace],
                |r| r.get(0),
            )
            .unwrap_or(-1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn receipts() -> (tempfile::TempDir, Receipts) {
        let d = tempfile::tempdir().expect("tempdir");
        let r = Receipts::open(&d.path().join("db")).expect("open");
        (d, r)
    }

    #[test]
    fn test_claim_new_pending_done_and_conflict() {
        let (_d, r) = receipts();
        assert_eq!(r.claim("w", "vm_exec", "a", "h1").expect("1"), Claim::New);
        assert_eq!(
            r.claim("w", "vm_exec", "a", "h1").expect("2"),
            Claim::Pending
        );
        let v = serde_json::json!({"job_id": "3"});
        r.complete("w", "vm_exec", "a", &v).expect("complete");
        assert_eq!(
            r.claim("w", "vm_exec", "a", "h1").expect("3"),
            Claim::Done(v)
        );
        assert_eq!(
            r.claim("w", "vm_exec", "a", "h2")
                .expect_err("changed")
                .code,
            "conflict"
        );
        // Keys are per workspace and per tool.
        assert_eq!(r.claim("v", "vm_exec", "a", "h2").expect("4"), Claim::New);
        assert_eq!(r.claim("w", "vm_create", "a", "h2").expect("5"), Claim::New);
    }

    #[test]
    fn test_release_allows_reuse() {
        let (_d, r) = receipts();
        r.claim("w", "t", "a", "h1").expect("claim");
        r.release("w", "t", "a").expect("release");
        assert_eq!(r.claim("w", "t", "a", "h2").expect("again"), Claim::New);
    }

    #[test]
    fn test_history_capped_per_workspace() {
        let (_d, r) = receipts();
        for i in 0..(MAX_RECEIPTS_PER_WORKSPACE + 10) {
            r.claim("w", "t", &format!("r{i}"), "h").expect("claim");
        }
        assert_eq!(r.count("w"), MAX_RECEIPTS_PER_WORKSPACE as i64);
        // The oldest were forgotten, the newest kept.
        assert_eq!(r.claim("w", "t", "r0", "x").expect("old"), Claim::New);
    }

    /// The workspaces of one user's subordinate uids share one cap (found by a hostile
    /// review: each uid of a range kept a cap of its own), which never prunes the user's
    /// own receipts. Control: another user's workspace keeps its own receipts.
    #[test]
    fn test_history_capped_per_owner_of_subordinate_uids() {
        let (d, r) = receipts();
        let r = r.with_subordinates(Subordinates::fixed(vec![(100_000, 65_536, 1000)]));
        r.claim("local-1000", "t", "own", "h").expect("the owner's");
        r.claim("local-2000", "t", "other", "h")
            .expect("another user's");
        for i in 0..(MAX_RECEIPTS_PER_WORKSPACE + 10) {
            let ws = format!("local-{}", 100_000 + i % 8);
            r.claim(&ws, "t", &format!("r{i}"), "h").expect("claim");
        }
        let group: i64 = (0..8)
            .map(|u| r.count(&format!("local-{}", 100_000 + u)))
            .sum::<i64>();
        assert_eq!(group, MAX_RECEIPTS_PER_WORKSPACE as i64);
        assert_eq!(
            r.claim("local-100000", "t", "r0", "x").expect("old"),
            Claim::New
        );
        // The owner's own receipt is never pruned for its subordinate uids' (found by a
        // hostile review of the first fix: a retry of it would have run again).
        assert_eq!(
            r.claim("local-1000", "t", "own", "x")
                .expect_err("kept")
                .code,
            "conflict"
        );
        assert_eq!(r.count("local-2000"), 1);
        // A database from before the column reopens with it.
        drop(r);
        Receipts::open(&d.path().join("db")).expect("reopen");
    }

    #[test]
    fn test_request_id_validation() {
        assert!(validate_request_id("build-1:a.b_c").is_ok());
        for bad in ["", "a b", "é", &"x".repeat(129)] {
            assert!(validate_request_id(bad).is_err(), "{bad:?}");
        }
    }
}
