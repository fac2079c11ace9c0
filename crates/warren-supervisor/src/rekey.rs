//! The host half of `Rekey`: a VM restored from another VM's memory (a template clone, a
//! fork) moves to a channel secret of its own and takes its own identity, before anything
//! else is asked of it (protocol: `PROTOCOL.md`, "Restored copies").
//!
//! Steps, in order:
//! 1. draw a fresh 32-byte contribution; the new secret is
//!    `warren_protocol::auth::rekey(old, contribution)`;
//! 2. write the new secret to `secret.next` (0600, fsynced), so a crash from here on never
//!    leaves the host without the secret the guest may already hold;
//! 3. send `Rekey` (contribution, a proof made with the old secret, fresh entropy, the
//!    clock, hostname, machine id) in the session authenticated with the old secret;
//! 4. check the guest's answer: a proof made with the new secret;
//! 5. rename `secret.next` over `secret` and fsync the directory: every later session
//!    (reconnects, resumes, fresh boots through a rebuilt initramfs) uses the new one.
//!
//! A failure anywhere fails the VM's start (its creator destroys it): a copy is never left
//! running on the secret it was copied with.

use rand::RngCore;
use warren_protocol::auth::{rekey, rekey_guest_proof, rekey_host_proof, verify};
use warren_protocol::{GuestResponse, HostRequest, Rekey, SECRET_LEN};

use crate::channel::GuestChannel;
use crate::layout::{CloneSpec, VmDir};
use crate::proto::SupervisorError;

/// Moves the guest behind `ch` from `old` to a new secret; returns the new one.
pub(crate) async fn run(
    ch: &GuestChannel,
    dir: &VmDir,
    old: &[u8],
    spec: &CloneSpec,
) -> Result<Vec<u8>, SupervisorError> {
    let mut contribution = [0u8; 32];
    let mut entropy = [0u8; 32];
    rand::rng().fill_bytes(&mut contribution);
    rand::rng().fill_bytes(&mut entropy);
    let new = rekey(old, &contribution);
    let failed = |what: &str, e: &dyn std::fmt::Display| {
        SupervisorError::Failed(format!("rekeying the restored guest: {what}: {e}"))
    };
    write_secret(&dir.secret_next(), &new).map_err(|e| failed("writing secret.next", &e))?;
    let unix_time_ns = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos() as u64;
    let req = HostRequest::Rekey(Rekey {
        contribution,
        proof: rekey_host_proof(old, &contribution),
        unix_time_ns,
        entropy,
        hostname: spec.hostname.clone(),
        machine_id: spec.machine_id.clone(),
    });
    let answer = crate::server::guest_call(ch, req).await;
    let proof = match answer {
        Ok(GuestResponse::Rekeyed(p)) => p.proof,
        Ok(_) => return Err(failed("guest", &"unexpected answer")),
        Err(e) => return Err(e),
    };
    if !verify(&rekey_guest_proof(&new, &contribution), &proof) {
        return Err(failed("guest", &"wrong proof of the new secret"));
    }
    std::fs::rename(dir.secret_next(), dir.secret())
        .and_then(|()| std::fs::File::open(dir.path())?.sync_all())
        .map_err(|e| failed("replacing the secret", &e))?;
    Ok(new.to_vec())
}

fn write_secret(path: &std::path::Path, secret: &[u8; SECRET_LEN]) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let _ = std::fs::remove_file(path);
    let mut f = std::fs::OpenOptions::new()
        .create_new(true)
        .write(true)
        .mode(0o600)
        .custom_flags(nix::fcntl::OFlag::O_NOFOLLOW.bits())
        .open(path)?;
    f.write_all(secret)?;
    f.sync_all()
}
