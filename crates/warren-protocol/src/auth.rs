//! Mutual authentication with the per-VM secret.
//!
//! Steps, in order, on every new session:
//! 1. host -> `Hello { host_nonce }`
//! 2. guest -> `HelloReply { guest_nonce, proof = MAC(secret, "guest" | host_nonce | guest_nonce) }`
//! 3. host checks the proof, then -> `Auth { proof = MAC(secret, "host" | guest_nonce | host_nonce) }`
//! 4. guest checks the proof and from then on serves every other request of that session.
//!
//! The secret never crosses the channel; each side proves knowledge of it over fresh nonces, so
//! a replayed transcript is useless.

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Length of nonces and proofs.
pub const NONCE_LEN: usize = 32;

type HmacSha256 = Hmac<Sha256>;

fn mac(secret: &[u8], role: &[u8], first: &[u8], second: &[u8]) -> [u8; 32] {
    // Hmac accepts keys of any length, so new_from_slice cannot fail.
    let mut m = HmacSha256::new_from_slice(secret).expect("invariant: HMAC takes any key length");
    m.update(b"warren-channel-v1/");
    m.update(role);
    m.update(first);
    m.update(second);
    m.finalize().into_bytes().into()
}

/// Proof the guest sends in its reply to `Hello`.
pub fn guest_proof(secret: &[u8], host_nonce: &[u8], guest_nonce: &[u8]) -> [u8; 32] {
    mac(secret, b"guest", host_nonce, guest_nonce)
}

/// Proof the host sends in `Auth`.
pub fn host_proof(secret: &[u8], host_nonce: &[u8], guest_nonce: &[u8]) -> [u8; 32] {
    mac(secret, b"host", guest_nonce, host_nonce)
}

/// The secret a restored copy (template clone, fork) moves to: derived from the secret it
/// was restored with and a fresh host contribution that only crosses this VM's own channel.
/// Another copy of the same memory image knows the old secret but never sees this VM's
/// contribution, so it cannot derive this VM's new secret; and once the guest has moved to
/// the new secret it no longer answers (or accepts) proofs made with the old one.
pub fn rekey(old: &[u8], contribution: &[u8; 32]) -> [u8; 32] {
    mac(old, b"rekey", contribution, b"")
}

/// Proof, made with the old secret, that a `Rekey` request comes from the host.
pub fn rekey_host_proof(old: &[u8], contribution: &[u8; 32]) -> [u8; 32] {
    mac(old, b"rekey-host", contribution, b"")
}

/// Proof, made with the new secret, that the guest moved to it.
pub fn rekey_guest_proof(new: &[u8], contribution: &[u8; 32]) -> [u8; 32] {
    mac(new, b"rekey-guest", contribution, b"")
}

/// Constant-time comparison of a received proof with the expected one.
pub fn verify(expected: &[u8; 32], received: &[u8]) -> bool {
    if received.len() != expected.len() {
        return false;
    }
    expected
        .iter()
        .zip(received)
        .fold(0u8, |acc, (a, b)| acc | (a ^ b))
        == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_proofs_roles_differ() {
        let s = [7u8; 32];
        let h = [1u8; 32];
        let g = [2u8; 32];
        assert_ne!(guest_proof(&s, &h, &g), host_proof(&s, &h, &g));
    }

    #[test]
    fn test_rekey_depends_on_old_secret_and_contribution() {
        let c = [3u8; 32];
        let new = rekey(&[7u8; 32], &c);
        assert_ne!(new, [7u8; 32]);
        assert_ne!(new, rekey(&[8u8; 32], &c));
        assert_ne!(new, rekey(&[7u8; 32], &[4u8; 32]));
        // Every derived value is distinct from the others made from the same inputs.
        assert_ne!(
            rekey_host_proof(&[7u8; 32], &c),
            rekey_guest_proof(&[7u8; 32], &c)
        );
        assert_ne!(new, rekey_host_proof(&[7u8; 32], &c));
    }

    #[test]
    fn test_verify_wrong_secret_rejected() {
        let h = [1u8; 32];
        let g = [2u8; 32];
        let p = guest_proof(&[7u8; 32], &h, &g);
        assert!(verify(&guest_proof(&[7u8; 32], &h, &g), &p));
        assert!(!verify(&guest_proof(&[8u8; 32], &h, &g), &p));
        assert!(!verify(&p, &p[..31]));
    }
}
