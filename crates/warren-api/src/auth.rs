//! Workspaces, their bearer tokens, and the principal every request acts as.
//!
//! Tokens are opaque random strings; only their SHA-256 is stored. A workspace's policy is
//! fixed when its first token is issued: reissuing never widens it. The one change made
//! afterwards is the operator's explicit internet grant ([`Credentials::set_internet`]).

use std::path::Path;
use std::sync::Mutex;

use base64::Engine;
use rand::RngCore;
use rusqlite::{params, Connection, OptionalExtension};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::error::ApiError;
use crate::subuid::Subordinates;

/// Prefix of every token: recognisable in a leaked log, so scanners can find it.
pub const TOKEN_PREFIX: &str = "wrn_";
/// Workspaces named `local-<uid>` belong to local users; tokens are never issued for them.
pub const LOCAL_PREFIX: &str = "local-";

/// What a workspace may do, fixed at its first token.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Policy {
    pub allow_network: bool,
    /// Internet mode (`vm_create` with `network: "internet"`): every public destination.
    /// Granted with `--allow-internet` at the first token, or later by the operator's
    /// `warren token allow-internet` (a policy written before this field existed has none).
    #[serde(default)]
    pub allow_internet: bool,
    /// Configured image names it may boot; `None` allows every configured image.
    pub images: Option<Vec<String>>,
    pub max_vms: Option<u64>,
    pub max_memory_mib: Option<u64>,
    /// Host storage of the workspace: its VMs' disk reservations plus its sessions' own
    /// filesystems (a policy written before this field existed has none).
    #[serde(default)]
    pub max_storage_mib: Option<u64>,
}

/// How the caller reached the service.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Via {
    /// A bearer token over HTTP.
    Token { token_id: String },
    /// The local UNIX socket, identified by SO_PEERCRED.
    Local { uid: u32 },
}

/// The authenticated caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Principal {
    pub workspace: String,
    pub policy: Policy,
    pub via: Via,
}

/// The credential a caller's per-credential caps count under (requests, long-polls, MCP
/// sessions): a subordinate uid's (`crate::subuid`) is the local user owning its range, so
/// one user acting as many uids of it (a user namespace) shares one set of caps, as it
/// shares one share of connections (found by a hostile review: 32 such uids held all 512 of
/// the service's MCP sessions). Any other credential is itself.
pub(crate) fn counted_via(via: &Via, subordinates: &Subordinates) -> Via {
    match via {
        Via::Local { uid } => Via::Local {
            uid: subordinates.owner_of(*uid),
        },
        other => other.clone(),
    }
}

/// The workspace a workspace's caps count under (MCP sessions, streams): a subordinate
/// uid's local workspace is its owner's (see [`counted_via`]); any other is itself.
pub(crate) fn counted_workspace(workspace: &str, subordinates: &Subordinates) -> String {
    let Some(uid) = workspace
        .strip_prefix(LOCAL_PREFIX)
        .and_then(|n| n.parse::<u32>().ok())
    else {
        return workspace.to_string();
    };
    let owner = subordinates.owner_of(uid);
    if owner == uid {
        workspace.to_string()
    } else {
        warren_core::local_workspace(owner)
    }
}

impl Principal {
    /// A local user: its own workspace, every image, network (internet mode too: it reaches
    /// no more than the user already can from the host) allowed, host limits only.
    pub fn local(uid: u32) -> Principal {
        Principal {
            workspace: warren_core::local_workspace(uid),
            policy: Policy {
                allow_network: true,
                allow_internet: true,
                ..Policy::default()
            },
            via: Via::Local { uid },
        }
    }
}

/// The policy a token issue asks for; `None` fields ask nothing (keep or default).
#[derive(Debug, Clone, Default)]
pub struct PolicyRequest {
    pub allow_network: Option<bool>,
    pub allow_internet: Option<bool>,
    pub images: Option<Vec<String>>,
    pub max_vms: Option<u64>,
    pub max_memory_mib: Option<u64>,
    pub max_storage_mib: Option<u64>,
}

/// A token's public facts (never its secret).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TokenInfo {
    pub id: String,
    pub workspace: String,
    pub created_unix: u64,
    pub expires_unix: Option<u64>,
    pub revoked: bool,
}

/// The credential tables, in the service's SQLite database.
pub struct Credentials {
    conn: Mutex<Connection>,
}

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS workspaces (
    name TEXT PRIMARY KEY,
    policy TEXT NOT NULL,
    created_unix INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS tokens (
    id TEXT PRIMARY KEY,
    workspace TEXT NOT NULL REFERENCES workspaces(name),
    hash BLOB NOT NULL UNIQUE,
    created_unix INTEGER NOT NULL,
    expires_unix INTEGER,
    revoked INTEGER NOT NULL DEFAULT 0
);";

/// The prefix of the engine's own workspaces (the warm pool's VMs, which any workspace may
/// be handed, and template builds, which every clone of a shape copies): no token, header or
/// grant may name one.
pub const ENGINE_PREFIX: &str = "warren-";

/// Checks a workspace name: 1-63 of `[a-z0-9-]`, starting with a letter or digit, and not
/// one of the engine's ([`ENGINE_PREFIX`]).
pub fn validate_workspace(name: &str) -> Result<(), ApiError> {
    if name.starts_with(ENGINE_PREFIX) {
        return Err(ApiError::invalid(format!(
            "workspace names starting with {ENGINE_PREFIX:?} are Warren's own (the warm pool, \
             template builds)"
        )));
    }
    let ok = !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-');
    if ok {
        Ok(())
    } else {
        Err(ApiError::invalid(format!(
            "workspace name {name:?} must be 1-63 characters of a-z, 0-9 and '-', not starting with '-'"
        )))
    }
}

pub(crate) fn open_db(path: &Path) -> Result<Connection, rusqlite::Error> {
    warren_core::store::open_private(path)
}

pub(crate) fn now_unix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs()
}

fn hash_token(token: &str) -> Vec<u8> {
    Sha256::digest(token.as_bytes()).to_vec()
}

impl Credentials {
    pub fn open(db: &Path) -> Result<Credentials, ApiError> {
        let conn = open_db(db)?;
        conn.execute_batch(SCHEMA)?;
        Ok(Credentials {
            conn: Mutex::new(conn),
        })
    }

    fn conn(&self) -> std::sync::MutexGuard<'_, Connection> {
        self.conn.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Issues a new token for `workspace`, creating the workspace with the requested policy,
    /// or checking the request against its existing policy. Returns the token's facts and its
    /// secret, which the caller writes to a private file and never prints.
    pub fn issue(
        &self,
        workspace: &str,
        ttl_secs: Option<u64>,
        req: &PolicyRequest,
    ) -> Result<(TokenInfo, String), ApiError> {
        validate_workspace(workspace)?;
        if workspace.starts_with(LOCAL_PREFIX) {
            return Err(ApiError::invalid(format!(
                "workspaces named {LOCAL_PREFIX}* belong to local users and take no tokens"
            )));
        }
        if ttl_secs == Some(0) {
            return Err(ApiError::invalid("--ttl must be at least 1 second"));
        }
        let mut conn = self.conn();
        let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
        let existing: Option<String> = tx
            .query_row(
                "SELECT policy FROM workspaces WHERE name = ?1",
                [workspace],
                |r| r.get(0),
            )
            .optional()?;
        let now = now_unix();
        match existing {
            Some(p) => {
                let have: Policy = serde_json::from_str(&p)
                    .map_err(|e| ApiError::internal(format!("stored policy: {e}")))?;
                check_reissue(workspace, &have, req)?;
            }
            None => {
                let mut images = req.images.clone();
                if let Some(i) = images.as_mut() {
                    i.sort();
                    i.dedup();
                }
                let allow_internet = req.allow_internet.unwrap_or(false);
                let policy = Policy {
                    allow_network: req.allow_network.unwrap_or(false) || allow_internet,
                    allow_internet,
                    images,
                    max_vms: req.max_vms,
                    max_memory_mib: req.max_memory_mib,
                    max_storage_mib: req.max_storage_mib,
                };
                let body = serde_json::to_string(&policy)
                    .map_err(|e| ApiError::internal(e.to_string()))?;
                tx.execute(
                    "INSERT INTO workspaces (name, policy, created_unix) VALUES (?1, ?2, ?3)",
                    params![workspace, body, now as i64],
                )?;
            }
        }
        let mut secret = [0u8; 32];
        rand::rng().fill_bytes(&mut secret);
        let token = format!(
            "{TOKEN_PREFIX}{}",
            base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(secret)
        );
        let mut idb = [0u8; 6];
        rand::rng().fill_bytes(&mut idb);
        let info = TokenInfo {
            id: format!("tok-{}", hex::encode(idb)),
            workspace: workspace.to_string(),
            created_unix: now,
            expires_unix: ttl_secs.map(|t| now.saturating_add(t)),
            revoked: false,
        };
        tx.execute(
            "INSERT INTO tokens (id, workspace, hash, created_unix, expires_unix) VALUES (?1, ?2, ?3, ?4, ?5)",
            params![
                info.id,
                workspace,
                hash_token(&token),
                now as i64,
                info.expires_unix.map(|e| e as i64)
            ],
        )?;
        tx.commit()?;
        Ok((info, token))
    }

    pub fn list(&self) -> Result<Vec<TokenInfo>, ApiError> {
        let conn = self.conn();
        let mut st = conn.prepare(
            "SELECT id, workspace, created_unix, expires_unix, revoked FROM tokens ORDER BY created_unix, id",
        )?;
        let rows = st.query_map([], |r| {
            Ok(TokenInfo {
                id: r.get(0)?,
                workspace: r.get(1)?,
                created_unix: r.get::<_, i64>(2)? as u64,
                expires_unix: r.get::<_, Option<i64>>(3)?.map(|e| e as u64),
                revoked: r.get::<_, i64>(4)? != 0,
            })
        })?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    /// Revokes one token; `not_found` when there is no such token.
    pub fn revoke(&self, id: &str) -> Result<(), ApiError> {
        let n = self
            .conn()
            .execute("UPDATE tokens SET revoked = 1 WHERE id = ?1", [id])?;
        if n == 0 {
            return Err(ApiError::new("not_found", format!("no token {id}")));
        }
        Ok(())
    }

    /// Revokes every token of a workspace; returns how many were still active.
    pub fn revoke_workspace(&self, workspace: &str) -> Result<usize, ApiError> {
        let conn = self.conn();
        let known: Option<String> = conn
            .query_row(
                "SELECT name FROM workspaces WHERE name = ?1",
                [workspace],
                |r| r.get(0),
            )
            .optional()?;
        if known.is_none() {
            return Err(ApiError::new(
                "not_found",
                format!("no workspace {workspace}"),
            ));
        }
        Ok(conn.execute(
            "UPDATE tokens SET revoked = 1 WHERE workspace = ?1 AND revoked = 0",
            [workspace],
        )?)
    }

    /// The principal a bearer token acts as. Unknown, revoked and expired tokens are all
    /// `unauthenticated`, with a message that says which (never echoing the token).
    pub fn authenticate(&self, token: &str) -> Result<Principal, ApiError> {
        let unauth = |m: &str| ApiError::new("unauthenticated", m);
        if !token.starts_with(TOKEN_PREFIX) || token.len() > 256 {
            return Err(unauth("not a Warren token"));
        }
        let row: Option<(String, String, Option<i64>, i64, String)> = self
            .conn()
            .query_row(
                "SELECT t.id, t.workspace, t.expires_unix, t.revoked, w.policy
                 FROM tokens t JOIN workspaces w ON w.name = t.workspace WHERE t.hash = ?1",
                [hash_token(token)],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?)),
            )
            .optional()?;
        let Some((id, workspace, expires, revoked, policy)) = row else {
            return Err(unauth("unknown token"));
        };
        if workspace.starts_with(ENGINE_PREFIX) {
            // Issued before the engine's names were reserved: it would reach pool VMs and
            // template builds.
            return Err(unauth(
                "the token's workspace is reserved for Warren itself",
            ));
        }
        if revoked != 0 {
            return Err(unauth("the token was revoked"));
        }
        if expires.is_some_and(|e| (e as u64) <= now_unix()) {
            return Err(unauth("the token expired"));
        }
        let policy: Policy = serde_json::from_str(&policy)
            .map_err(|e| ApiError::internal(format!("stored policy: {e}")))?;
        Ok(Principal {
            workspace,
            policy,
            via: Via::Token { token_id: id },
        })
    }

    /// Whether `p`'s credential still holds: a long-lived stream asks every few seconds, so
    /// a revoked or expired token stops it. The local socket's callers always hold.
    pub fn recheck(&self, p: &Principal) -> Result<(), ApiError> {
        let Via::Token { token_id } = &p.via else {
            return Ok(());
        };
        self.recheck_token(token_id)
    }

    /// Whether the token `token_id` still holds (exists, not revoked, not expired).
    pub fn recheck_token(&self, token_id: &str) -> Result<(), ApiError> {
        let unauth = |m: &str| ApiError::new("unauthenticated", m);
        let row: Option<(Option<i64>, i64)> = self
            .conn()
            .query_row(
                "SELECT expires_unix, revoked FROM tokens WHERE id = ?1",
                [token_id],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .optional()?;
        match row {
            None => Err(unauth("the token no longer exists")),
            Some((_, revoked)) if revoked != 0 => Err(unauth("the token was revoked")),
            Some((Some(e), _)) if (e as u64) <= now_unix() => Err(unauth("the token expired")),
            Some(_) => Ok(()),
        }
    }

    /// The operator's explicit change of an existing workspace's internet grant (a reissue
    /// never changes a policy). Granting it grants networking too; taking it away leaves
    /// networking. Every token of the workspace acts on the new policy from its next
    /// request; VMs already created keep the mode they were created with.
    pub fn set_internet(&self, workspace: &str, allow: bool) -> Result<(), ApiError> {
        let mut conn = self.conn();
        let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
        let stored: Option<String> = tx
            .query_row(
                "SELECT policy FROM workspaces WHERE name = ?1",
                [workspace],
                |r| r.get(0),
            )
            .optional()?;
        let Some(stored) = stored else {
            return Err(ApiError::new(
                "not_found",
                format!("no workspace {workspace} (issue its first token with --allow-internet)"),
            ));
        };
        let mut policy: Policy = serde_json::from_str(&stored)
            .map_err(|e| ApiError::internal(format!("stored policy: {e}")))?;
        policy.allow_internet = allow;
        if allow {
            policy.allow_network = true;
        }
        let body = serde_json::to_string(&policy).map_err(|e| ApiError::internal(e.to_string()))?;
        tx.execute(
            "UPDATE workspaces SET policy = ?2 WHERE name = ?1",
            params![workspace, body],
        )?;
        tx.commit()?;
        Ok(())
    }

    /// A token workspace's policy, if the workspace exists.
    pub fn policy(&self, workspace: &str) -> Result<Option<Policy>, ApiError> {
        let p: Option<String> = self
            .conn()
            .query_row(
                "SELECT policy FROM workspaces WHERE name = ?1",
                [workspace],
                |r| r.get(0),
            )
            .optional()?;
        p.map(|p| {
            serde_json::from_str(&p).map_err(|e| ApiError::internal(format!("stored policy: {e}")))
        })
        .transpose()
    }
}

fn check_reissue(workspace: &str, have: &Policy, req: &PolicyRequest) -> Result<(), ApiError> {
    let mut diffs = Vec::new();
    if let Some(n) = req.allow_network {
        if n != have.allow_network {
            diffs.push(format!(
                "--allow-network (workspace has {})",
                have.allow_network
            ));
        }
    }
    if let Some(n) = req.allow_internet {
        if n != have.allow_internet {
            diffs.push(format!(
                "--allow-internet (workspace has {}; the operator grants it with \
                 `warren token allow-internet`)",
                have.allow_internet
            ));
        }
    }
    if let Some(i) = &req.images {
        let mut i = i.clone();
        i.sort();
        i.dedup();
        if Some(&i) != have.images.as_ref() {
            diffs.push(format!("--image (workspace has {:?})", have.images));
        }
    }
    if req.max_vms.is_some() && req.max_vms != have.max_vms {
        diffs.push(format!("--max-vms (workspace has {:?})", have.max_vms));
    }
    if req.max_memory_mib.is_some() && req.max_memory_mib != have.max_memory_mib {
        diffs.push(format!(
            "--max-memory-mib (workspace has {:?})",
            have.max_memory_mib
        ));
    }
    if req.max_storage_mib.is_some() && req.max_storage_mib != have.max_storage_mib {
        diffs.push(format!(
            "--max-storage-mib (workspace has {:?})",
            have.max_storage_mib
        ));
    }
    if diffs.is_empty() {
        Ok(())
    } else {
        Err(ApiError::conflict(format!(
            "workspace {workspace} exists with another policy; a reissue keeps it: {}",
            diffs.join(", ")
        )))
    }
}

/// Writes a token to `path` with mode 0600, replacing the file atomically. The temporary
/// file beside it has a random name (`O_EXCL`, mode 0600 from its creation): a name another
/// user of the directory could guess and take first would make the issue fail.
pub fn write_token_file(path: &Path, token: &str) -> std::io::Result<()> {
    use std::io::Write;
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let mut tmp = tempfile::Builder::new()
        .prefix(".warren-token-")
        .permissions(std::os::unix::fs::PermissionsExt::from_mode(0o600))
        .tempfile_in(dir)?;
    tmp.write_all(format!("{token}\n").as_bytes())?;
    tmp.as_file().sync_all()?;
    tmp.persist(path).map_err(|e| e.error)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn creds() -> (tempfile::TempDir, Credentials) {
        let d = tempfile::tempdir().expect("tempdir");
        let c = Credentials::open(&d.path().join("db")).expect("open");
        (d, c)
    }

    /// A database the credentials create (`warren token issue` before the service's first
    /// start) is its owner's only, its WAL too; the token file is 0600 and nothing else is
    /// left beside it.
    #[test]
    fn test_credentials_create_an_owner_only_database_and_token_file() {
        use std::os::unix::fs::MetadataExt;
        let (d, c) = creds();
        let (_, token) = c
            .issue("alice", None, &PolicyRequest::default())
            .expect("issue");
        for name in ["db", "db-wal"] {
            let mode = std::fs::metadata(d.path().join(name)).expect("stat").mode();
            assert_eq!(mode & 0o777, 0o600, "{name}");
        }
        let out = tempfile::tempdir().expect("tempdir");
        let file = out.path().join("token");
        write_token_file(&file, &token).expect("write");
        assert_eq!(
            std::fs::metadata(&file).expect("stat").mode() & 0o777,
            0o600
        );
        assert_eq!(std::fs::read_dir(out.path()).expect("list").count(), 1);
        assert_eq!(
            std::fs::read_to_string(&file).expect("read"),
            format!("{token}\n")
        );
    }

    #[test]
    fn test_issue_then_authenticate_stores_only_hash() {
        let (d, c) = creds();
        let (info, token) = c
            .issue("alice", None, &PolicyRequest::default())
            .expect("issue");
        let p = c.authenticate(&token).expect("auth");
        assert_eq!(p.workspace, "alice");
        assert_eq!(
            p.via,
            Via::Token {
                token_id: info.id.clone()
            }
        );
        let raw = std::fs::read(d.path().join("db")).expect("read db");
        let needle = token.as_bytes();
        assert!(
            !raw.windows(needle.len()).any(|w| w == needle),
            "token stored in clear"
        );
    }

    #[test]
    fn test_revoked_and_expired_tokens_unauthenticated() {
        let (_d, c) = creds();
        let (info, t1) = c.issue("bob", None, &PolicyRequest::default()).expect("1");
        let (_, t2) = c.issue("bob", None, &PolicyRequest::default()).expect("2");
        c.revoke(&info.id).expect("revoke");
        assert_eq!(
            c.authenticate(&t1).expect_err("revoked").code,
            "unauthenticated"
        );
        assert!(c.authenticate(&t2).is_ok(), "other token still valid");
        assert_eq!(c.revoke_workspace("bob").expect("revoke ws"), 1);
        assert!(c.authenticate(&t2).is_err());
        c.conn()
            .execute("UPDATE tokens SET revoked = 0, expires_unix = 1", [])
            .expect("age");
        let e = c.authenticate(&t2).expect_err("expired");
        assert!(e.message.contains("expired"), "{e}");
        assert_eq!(
            c.authenticate("wrn_nope").expect_err("unknown").code,
            "unauthenticated"
        );
    }

    #[test]
    fn test_reissue_keeps_policy_and_refuses_different_one() {
        let (_d, c) = creds();
        let want = PolicyRequest {
            allow_network: Some(true),
            allow_internet: None,
            images: Some(vec!["dev".into()]),
            max_vms: Some(2),
            max_memory_mib: None,
            max_storage_mib: Some(2048),
        };
        c.issue("carol", None, &want).expect("first");
        let (_, t) = c
            .issue("carol", None, &PolicyRequest::default())
            .expect("reissue without flags");
        let p = c.authenticate(&t).expect("auth").policy;
        assert!(p.allow_network);
        assert_eq!(p.max_vms, Some(2));
        assert_eq!(p.max_storage_mib, Some(2048));
        assert_eq!(
            crate::admission::policy_limits(&p).max_storage_mib,
            Some(2048)
        );
        c.issue("carol", None, &want).expect("same policy");
        let other_storage = PolicyRequest {
            max_storage_mib: Some(4096),
            ..PolicyRequest::default()
        };
        let e = c
            .issue("carol", None, &other_storage)
            .expect_err("another storage limit");
        assert!(e.message.contains("--max-storage-mib"), "{e}");
        let wider = PolicyRequest {
            max_vms: Some(5),
            ..PolicyRequest::default()
        };
        assert_eq!(
            c.issue("carol", None, &wider).expect_err("wider").code,
            "conflict"
        );
    }

    #[test]
    fn test_internet_grant_at_issue_or_by_operator_never_by_reissue() {
        let (_d, c) = creds();
        let inet = PolicyRequest {
            allow_internet: Some(true),
            ..PolicyRequest::default()
        };
        let (_, t) = c.issue("erin", None, &inet).expect("first");
        let p = c.authenticate(&t).expect("auth").policy;
        assert!(
            p.allow_internet && p.allow_network,
            "internet implies network"
        );
        // A workspace without it: a reissue asking for it is refused, and changes nothing.
        let net = PolicyRequest {
            allow_network: Some(true),
            ..PolicyRequest::default()
        };
        let (_, t) = c.issue("frank", None, &net).expect("first");
        let e = c.issue("frank", None, &inet).expect_err("reissue widens");
        assert_eq!(e.code, "conflict");
        assert!(e.message.contains("allow-internet"), "{e}");
        assert!(!c.authenticate(&t).expect("auth").policy.allow_internet);
        // The operator's explicit grant reaches the existing token at once.
        c.set_internet("frank", true).expect("grant");
        assert!(c.authenticate(&t).expect("auth").policy.allow_internet);
        c.set_internet("frank", false).expect("take back");
        let p = c.authenticate(&t).expect("auth").policy;
        assert!(!p.allow_internet && p.allow_network);
        assert_eq!(
            c.set_internet("nobody", true).expect_err("unknown").code,
            "not_found"
        );
        // A policy stored before the field existed reads as no internet.
        let old: Policy = serde_json::from_str(
            r#"{"allow_network":true,"images":null,"max_vms":null,"max_memory_mib":null}"#,
        )
        .expect("old policy");
        assert!(!old.allow_internet);
    }

    #[test]
    fn test_bad_workspace_names_refused() {
        let (_d, c) = creds();
        for n in ["", "-a", "A", "a/b", "local-0", &"x".repeat(64)] {
            assert!(
                c.issue(n, None, &PolicyRequest::default()).is_err(),
                "{n:?} accepted"
            );
        }
    }

    /// The engine's own workspaces (the warm pool's VMs, template builds) take no token, and
    /// a token issued for one before they were reserved no longer authenticates.
    #[test]
    fn test_engine_workspaces_take_no_tokens() {
        let (_d, c) = creds();
        for n in [
            warren_core::vm::pool::POOL_WORKSPACE,
            warren_core::vm::template::TEMPLATE_WORKSPACE,
            "warren-anything",
        ] {
            assert!(n.starts_with(ENGINE_PREFIX), "{n}");
            let e = c
                .issue(n, None, &PolicyRequest::default())
                .expect_err("engine workspace");
            assert_eq!(e.code, "invalid_argument", "{e}");
        }
        let (_, token) = c
            .issue("alice", None, &PolicyRequest::default())
            .expect("issue");
        {
            let conn = c.conn();
            conn.execute(
                "INSERT INTO workspaces (name, policy, created_unix)
                 SELECT 'warren-pool', policy, created_unix FROM workspaces WHERE name = 'alice'",
                [],
            )
            .expect("old workspace row");
            conn.execute("UPDATE tokens SET workspace = 'warren-pool'", [])
                .expect("old token");
        }
        let e = c.authenticate(&token).expect_err("reserved");
        assert_eq!(e.code, "unauthenticated", "{e}");
    }

    #[test]
    fn test_token_file_private() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().expect("tempdir");
        let p = d.path().join("t");
        write_token_file(&p, "wrn_x").expect("write");
        let m = std::fs::metadata(&p).expect("stat").permissions().mode();
        assert_eq!(m & 0o777, 0o600);
    }
}
