//! The agent's secret and identity, and `Rekey`: how a VM restored from another VM's memory
//! (a template clone, a fork) stops being a copy.
//!
//! A restored copy starts with everything its source had in memory: the channel secret, the
//! kernel's CRNG state, the agent's nonce state, the hostname and machine id. `Rekey`, sent by
//! the supervisor as the first request of the first authenticated session after the restore,
//! changes each of them, in this order:
//! 1. checks the request's proof, made with the current (old) secret, on top of the session's
//!    own authentication;
//! 2. mixes the host's entropy into the pool (credited) and reseeds the CRNG
//!    (`RNDRESEEDCRNG`), so nothing after this step draws from the copied state;
//! 3. replaces the agent's nonce salt with fresh CRNG bytes (the agent's only userspace
//!    random state: see [`session_nonce`]);
//! 4. sets the wall clock;
//! 5. derives the new secret from the old one and the host's contribution
//!    (`warren_protocol::auth::rekey`) and replaces the old one, which from then on neither
//!    proves nor verifies anything: a later `Hello`/`Auth` made with it fails;
//! 6. sets the hostname and rewrites `/etc/hostname` and `/etc/machine-id`, which live in
//!    memory ([`crate::identity_files`]: the disk's machine id follows a moment later);
//! 7. answers with a proof made with the new secret.

use std::sync::{PoisonError, RwLock};

use sha2::{Digest, Sha256};
use warren_protocol::auth::{rekey, rekey_guest_proof, rekey_host_proof, verify};
use warren_protocol::{
    ErrorCode, GuestError, GuestResponse, Rekey, RekeyProof, Response, SECRET_LEN,
};

/// The per-VM secret, replaced by `Rekey`. Never printed.
pub struct Secret(RwLock<[u8; SECRET_LEN]>);

impl Secret {
    pub fn new(bytes: [u8; SECRET_LEN]) -> Secret {
        Secret(RwLock::new(bytes))
    }

    /// The current secret.
    pub fn get(&self) -> [u8; SECRET_LEN] {
        *self.0.read().unwrap_or_else(PoisonError::into_inner)
    }

    fn set(&self, bytes: [u8; SECRET_LEN]) {
        *self.0.write().unwrap_or_else(PoisonError::into_inner) = bytes;
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

/// Mixed into every guest nonce; replaced by `Rekey` with fresh CRNG bytes.
static NONCE_SALT: RwLock<[u8; 32]> = RwLock::new([0; 32]);

/// The guest's nonce for a `Hello`: `base` (insecure random bytes, boot clock and a counter,
/// which two copies of one memory image can share right after the restore, before any host
/// entropy arrived) hashed with the host's nonce for this session (fresh host randomness, so
/// two copies' nonces differ from their very first session) and the salt `Rekey` replaced.
pub fn session_nonce(base: [u8; 32], host_nonce: &[u8; 32]) -> [u8; 32] {
    let salt = *NONCE_SALT.read().unwrap_or_else(PoisonError::into_inner);
    let mut h = Sha256::new();
    h.update(b"warren-guest-nonce-v1");
    h.update(base);
    h.update(host_nonce);
    h.update(salt);
    h.finalize().into()
}

/// Longest hostname accepted (a DNS label).
const MAX_HOSTNAME: usize = 63;

fn invalid(msg: impl Into<String>) -> GuestError {
    GuestError::new(ErrorCode::InvalidArgument, msg)
}

fn valid_hostname(h: &str) -> bool {
    !h.is_empty()
        && h.len() <= MAX_HOSTNAME
        && !h.starts_with('-')
        && h.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

fn valid_machine_id(m: &str) -> bool {
    m.len() == 32
        && m.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// Handles `Rekey` (see the module docs). `pid1`: apply the system-wide parts (entropy,
/// clock, hostname, machine id); off in tests, where only the secret and the salt change.
pub fn handle(secret: &Secret, pid1: bool, req: &Rekey) -> Response {
    if !valid_hostname(&req.hostname) {
        return Err(invalid(
            "hostname must be 1-63 bytes of [a-z0-9-], not starting with '-'",
        ));
    }
    if !valid_machine_id(&req.machine_id) {
        return Err(invalid("machine id must be 32 lowercase hex digits"));
    }
    let old = secret.get();
    if !verify(&rekey_host_proof(&old, &req.contribution), &req.proof) {
        return Err(GuestError::new(
            ErrorCode::Unauthenticated,
            "bad rekey proof",
        ));
    }
    if pid1 {
        crate::session::add_entropy(&req.entropy);
    }
    let mut salt = [0u8; 32];
    // The CRNG was just reseeded with the host's entropy; the salt also takes the
    // host's entropy directly, so it differs per copy even where getrandom is unavailable.
    let _ = rustix::rand::getrandom(&mut salt, rustix::rand::GetRandomFlags::INSECURE);
    let mut h = Sha256::new();
    h.update(salt);
    h.update(req.entropy);
    h.update(req.contribution);
    *NONCE_SALT.write().unwrap_or_else(PoisonError::into_inner) = h.finalize().into();
    if pid1 {
        crate::session::set_clock(req.unix_time_ns);
    }
    let new = rekey(&old, &req.contribution);
    secret.set(new);
    if pid1 {
        set_identity(&req.hostname, &req.machine_id);
    }
    Ok(GuestResponse::Rekeyed(RekeyProof {
        proof: rekey_guest_proof(&new, &req.contribution),
    }))
}

/// Hostname and machine id ([`crate::identity_files`]). A failure is logged on the console:
/// the channel secret (the part that matters for isolation) has already moved, and a copy
/// with the old hostname still works.
fn set_identity(hostname: &str, machine_id: &str) {
    if let Err(e) = rustix::system::sethostname(hostname.as_bytes()) {
        crate::console::log(format_args!("sethostname: {e}"));
    }
    crate::identity_files::set(hostname, machine_id);
}

#[cfg(test)]
mod tests {
    use super::*;
    use warren_protocol::auth::rekey_host_proof;

    fn request(old: &[u8; 32], contribution: [u8; 32]) -> Rekey {
        Rekey {
            contribution,
            proof: rekey_host_proof(old, &contribution),
            unix_time_ns: 1,
            entropy: [9; 32],
            hostname: "vm-0123".into(),
            machine_id: "0123456789abcdef0123456789abcdef".into(),
        }
    }

    #[test]
    fn test_rekey_replaces_secret_and_proves_new_one() {
        let s = Secret::new([7; 32]);
        let r = request(&[7; 32], [1; 32]);
        let new = rekey(&[7; 32], &[1; 32]);
        match handle(&s, false, &r) {
            Ok(GuestResponse::Rekeyed(p)) => {
                assert!(verify(&rekey_guest_proof(&new, &[1; 32]), &p.proof))
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(s.get(), new);
        // The same request again is made with the old secret: refused, nothing changes.
        let e = handle(&s, false, &r).expect_err("old proof refused");
        assert_eq!(e.code, ErrorCode::Unauthenticated);
        assert_eq!(s.get(), new);
    }

    #[test]
    fn test_rekey_bad_input_changes_nothing() {
        let s = Secret::new([7; 32]);
        let mut wrong = request(&[8; 32], [1; 32]);
        assert_eq!(
            handle(&s, false, &wrong).expect_err("bad proof").code,
            ErrorCode::Unauthenticated
        );
        wrong = request(&[7; 32], [1; 32]);
        for h in ["", "-x", "UPPER", "a.b", &"x".repeat(64)] {
            let mut r = wrong.clone();
            r.hostname = h.into();
            assert_eq!(
                handle(&s, false, &r).expect_err("hostname").code,
                ErrorCode::InvalidArgument,
                "{h}"
            );
        }
        for m in ["", "0123", &"G".repeat(32), &"A".repeat(32)] {
            let mut r = wrong.clone();
            r.machine_id = m.into();
            assert_eq!(
                handle(&s, false, &r).expect_err("machine id").code,
                ErrorCode::InvalidArgument,
                "{m}"
            );
        }
        assert_eq!(s.get(), [7; 32]);
    }

    #[test]
    fn test_session_nonce_differs_per_host_nonce() {
        let base = [5; 32];
        assert_ne!(session_nonce(base, &[1; 32]), session_nonce(base, &[2; 32]));
    }
}
