//! Job broker pipes on the host: the pipes `vm_exec` registered (`broker_pipe_token`), and the
//! controller's framing (`GET /v1/vms/{vm_id}/jobs/{job_id}/broker`, served by
//! `crate::broker_ws`).
//!
//! A pipe is kept in memory only: the workspace, the VM, the job, the VM's generation when
//! the job started and the SHA-256 of the controller's one-time token (never the token,
//! never in receipts, logs, status or the guest). A retried `vm_exec` does not replace the
//! hash. Job ids start again at 1 when a VM boots fresh (and only then does its generation
//! change), so a pipe of an older generation names a job of a boot that is gone: it is
//! replaced by a new registration and refused (and forgotten) at attach, so an old token can
//! never reach the new boot's job of the same number; it never counts as the new job's pipe
//! ([`Pipes::has`]), nor is the new pipe forgotten when the old job's end is seen
//! ([`Pipes::end`]). An attachment keeps the generation it was made for: the controller's end
//! (`crate::broker_ws`) closes it once the VM is in another. A wrong token, another workspace,
//! an unknown job or a job without a pipe are all the same `not_found`; a second concurrent
//! attachment, or one more than [`MAX_ATTACHED_PER_VM`] on a VM, is `busy`. Pipes end when
//! their job's processes are all gone, when their VM is destroyed, and with the service.
//!
//! The controller's byte stream is a sequence of big-endian frames, which WebSocket
//! messages may split or combine ([`FrameReader`]):
//!
//! | kind  | type | layout                                           |
//! |-------|------|--------------------------------------------------|
//! | open  | 1    | `u8 type, u32 conn_id` (service -> controller)   |
//! | data  | 2    | `u8 type, u32 conn_id, u32 len, len bytes`, `len <= 65536` |
//! | close | 3    | `u8 type, u32 conn_id`                           |
//!
//! Hand-written: the format is this API's own, and nine bytes of header need no crate.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use sha2::{Digest, Sha256};
use warren_protocol::JobId;

use crate::error::ApiError;

/// Attached pipes one VM may have at once.
pub const MAX_ATTACHED_PER_VM: usize = 4;
/// Largest data frame payload.
pub const MAX_DATA: usize = 65536;
/// Frame types.
pub const OPEN: u8 = 1;
pub const DATA: u8 = 2;
pub const CLOSE: u8 = 3;

/// Checks a controller token's shape: 43-128 characters of `A-Z a-z 0-9 _ -`.
pub fn validate_token(token: &str) -> Result<(), ApiError> {
    let ok = (43..=128).contains(&token.len())
        && token
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(ApiError::invalid(
            "broker_pipe_token must be 43-128 characters of A-Z a-z 0-9 _ -",
        ))
    }
}

fn hash(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

struct Pipe {
    workspace: String,
    generation: u64,
    token_hash: [u8; 32],
    attached: bool,
}

type Key = (String, JobId);

/// Every broker pipe of the service.
#[derive(Clone, Default)]
pub struct Pipes {
    inner: Arc<Mutex<HashMap<Key, Pipe>>>,
}

/// An attached controller's hold on its pipe; dropping it detaches.
pub struct Attachment {
    key: Key,
    /// The generation of the pipe attached to: a newer boot's pipe that replaced it under the
    /// same key is not this attachment's to free.
    generation: u64,
    inner: Arc<Mutex<HashMap<Key, Pipe>>>,
}

impl Attachment {
    /// The VM generation (boot) the attachment was made for: its job's.
    pub fn generation(&self) -> u64 {
        self.generation
    }
}

impl Drop for Attachment {
    fn drop(&mut self) {
        if let Some(p) = lock(&self.inner).get_mut(&self.key) {
            if p.generation == self.generation {
                p.attached = false;
            }
        }
    }
}

fn lock(m: &Mutex<HashMap<Key, Pipe>>) -> MutexGuard<'_, HashMap<Key, Pipe>> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Pipes {
    /// Registers the pipe of `job`, started in the VM's generation `generation`; an
    /// existing one of the same generation (a retried request) keeps its hash, one of an older
    /// generation (a job of a lost boot with the same number) is replaced, and one of a newer
    /// generation stays (this registration, late, is of a lost boot's job).
    pub fn register(&self, workspace: &str, vm: &str, generation: u64, job: JobId, token: &str) {
        let fresh = || Pipe {
            workspace: workspace.to_string(),
            generation,
            token_hash: hash(token),
            attached: false,
        };
        let mut pipes = lock(&self.inner);
        let pipe = pipes.entry((vm.to_string(), job)).or_insert_with(fresh);
        if pipe.generation < generation {
            *pipe = fresh();
        }
    }

    /// Whether `job` of generation `generation` has a pipe (a pipe under the same number of
    /// another generation is another boot's job's).
    pub fn has(&self, vm: &str, generation: u64, job: JobId) -> bool {
        lock(&self.inner)
            .get(&(vm.to_string(), job))
            .is_some_and(|p| p.generation == generation)
    }

    /// Attaches the controller holding `token` to `job` of the VM's current generation
    /// `generation` (see the module docs for the refusals).
    pub fn attach(
        &self,
        workspace: &str,
        vm: &str,
        generation: u64,
        job: JobId,
        token: &str,
    ) -> Result<Attachment, ApiError> {
        let not_found = || ApiError::new("not_found", format!("no broker pipe for job {job}"));
        let mut pipes = lock(&self.inner);
        let key = (vm.to_string(), job);
        let given = hash(token);
        let attached_on_vm = pipes
            .iter()
            .filter(|((v, _), p)| v == vm && p.attached)
            .count();
        let pipe = pipes.get_mut(&key).ok_or_else(not_found)?;
        if pipe.generation != generation {
            // Its job belonged to a boot that is gone (forgotten unless still attached); a
            // newer boot's pipe is refused to a caller that read an older generation, and kept.
            if pipe.generation < generation && !pipe.attached {
                pipes.remove(&key);
            }
            return Err(not_found());
        }
        // Compared in full whatever the bytes: no early exit on the first difference.
        let same = pipe
            .token_hash
            .iter()
            .zip(given.iter())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0;
        if !same || pipe.workspace != workspace {
            return Err(not_found());
        }
        if pipe.attached {
            return Err(ApiError::new(
                "busy",
                format!("job {job}'s broker pipe already has a controller"),
            ));
        }
        if attached_on_vm >= MAX_ATTACHED_PER_VM {
            return Err(ApiError::new(
                "busy",
                format!("the VM has {attached_on_vm} attached broker pipes, the most it may"),
            ));
        }
        pipe.attached = true;
        Ok(Attachment {
            key,
            generation,
            inner: self.inner.clone(),
        })
    }

    /// Forgets the pipe of `job`, whatever its generation (the sweep of finished jobs).
    pub fn remove(&self, vm: &str, job: JobId) {
        lock(&self.inner).remove(&(vm.to_string(), job));
    }

    /// Forgets the pipe of `job` of generation `generation` (its job ended); a pipe of another
    /// boot's job under the same number stays.
    pub fn end(&self, vm: &str, generation: u64, job: JobId) {
        let mut pipes = lock(&self.inner);
        let key = (vm.to_string(), job);
        if pipes.get(&key).is_some_and(|p| p.generation == generation) {
            pipes.remove(&key);
        }
    }

    /// Forgets every pipe of `vm` (destroyed).
    pub fn remove_vm(&self, vm: &str) {
        lock(&self.inner).retain(|(v, _), _| v != vm);
    }

    /// The pipes of `vm` (for the sweep of finished jobs).
    pub fn jobs_of(&self, vm: &str) -> Vec<JobId> {
        lock(&self.inner)
            .keys()
            .filter(|(v, _)| v == vm)
            .map(|(_, j)| *j)
            .collect()
    }
}

/// A frame from the controller.
#[derive(Debug, PartialEq, Eq)]
pub enum Frame {
    Data(u32, Vec<u8>),
    Close(u32),
}

/// Why the controller's bytes break the framing.
#[derive(Debug, PartialEq, Eq)]
pub enum FrameError {
    /// A type the controller may not send (open) or that does not exist.
    Type(u8),
    /// Connection id 0.
    ZeroId,
    /// A data frame longer than [`MAX_DATA`].
    TooLong(u32),
}

impl std::fmt::Display for FrameError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FrameError::Type(t) => write!(f, "frame type {t} is not data (2) or close (3)"),
            FrameError::ZeroId => write!(f, "connection id 0"),
            FrameError::TooLong(n) => write!(f, "data frame of {n} bytes (at most {MAX_DATA})"),
        }
    }
}

/// Reassembles the controller's frames from message payloads; holds at most one frame's
/// bytes.
#[derive(Default)]
pub struct FrameReader {
    buf: Vec<u8>,
}

impl FrameReader {
    /// Adds `bytes` and returns the complete frames they finish.
    pub fn feed(&mut self, bytes: &[u8]) -> Result<Vec<Frame>, FrameError> {
        self.buf.extend_from_slice(bytes);
        let mut frames = Vec::new();
        let mut at = 0;
        loop {
            let rest = &self.buf[at..];
            let Some(&kind) = rest.first() else { break };
            if kind != DATA && kind != CLOSE {
                return Err(FrameError::Type(kind));
            }
            if rest.len() < 5 {
                break;
            }
            let id = u32::from_be_bytes([rest[1], rest[2], rest[3], rest[4]]);
            if id == 0 {
                return Err(FrameError::ZeroId);
            }
            if kind == CLOSE {
                frames.push(Frame::Close(id));
                at += 5;
                continue;
            }
            if rest.len() < 9 {
                break;
            }
            let len = u32::from_be_bytes([rest[5], rest[6], rest[7], rest[8]]);
            if len as usize > MAX_DATA {
                return Err(FrameError::TooLong(len));
            }
            let end = 9 + len as usize;
            if rest.len() < end {
                break;
            }
            frames.push(Frame::Data(id, rest[9..end].to_vec()));
            at += end;
        }
        self.buf.drain(..at);
        Ok(frames)
    }
}

/// Encodes an open frame.
pub fn open_frame(id: u32) -> Vec<u8> {
    let mut v = vec![OPEN];
    v.extend_from_slice(&id.to_be_bytes());
    v
}

/// Encodes a close frame.
pub fn close_frame(id: u32) -> Vec<u8> {
    let mut v = vec![CLOSE];
    v.extend_from_slice(&id.to_be_bytes());
    v
}

/// Encodes data frames for `data` (split at [`MAX_DATA`]).
pub fn data_frames(id: u32, data: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(data.len() + 9 * (data.len() / MAX_DATA + 1));
    for chunk in data.chunks(MAX_DATA) {
        v.push(DATA);
        v.extend_from_slice(&id.to_be_bytes());
        v.extend_from_slice(&(chunk.len() as u32).to_be_bytes());
        v.extend_from_slice(chunk);
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOKEN: &str = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQ";

    #[test]
    fn test_token_shape_checked() {
        assert!(validate_token(TOKEN).is_ok());
        assert!(validate_token(&TOKEN[..42]).is_err());
        assert!(validate_token(&"a".repeat(129)).is_err());
        assert!(validate_token(&format!("{}!", &TOKEN[..43])).is_err());
    }

    #[test]
    fn test_attach_refusals_and_detach() {
        let p = Pipes::default();
        p.register("w", "vm1", 1, JobId(1), TOKEN);
        // A retry with another token keeps the first hash.
        p.register("w", "vm1", 1, JobId(1), &"x".repeat(43));
        let other = "y".repeat(43);
        assert_eq!(
            p.attach("w", "vm1", 1, JobId(1), &other)
                .err()
                .map(|e| e.code),
            Some("not_found")
        );
        assert_eq!(
            p.attach("w2", "vm1", 1, JobId(1), TOKEN)
                .err()
                .map(|e| e.code),
            Some("not_found")
        );
        assert_eq!(
            p.attach("w", "vm1", 1, JobId(2), TOKEN)
                .err()
                .map(|e| e.code),
            Some("not_found")
        );
        let a = p.attach("w", "vm1", 1, JobId(1), TOKEN).expect("attach");
        assert_eq!(
            p.attach("w", "vm1", 1, JobId(1), TOKEN)
                .err()
                .map(|e| e.code),
            Some("busy")
        );
        drop(a);
        let _a = p.attach("w", "vm1", 1, JobId(1), TOKEN).expect("again");
        p.remove_vm("vm1");
        assert!(!p.has("vm1", 1, JobId(1)));
    }

    /// Job ids start again when a VM boots fresh (a new generation): a token registered
    /// for job 1 of the lost boot never attaches to job 1 of the new one, and the new
    /// registration's token does. (Before, the old pipe kept its hash: the old token
    /// reached the new job's connections and the new one was refused.)
    #[test]
    fn test_a_pipe_of_a_lost_boot_never_reaches_the_new_boots_job() {
        let p = Pipes::default();
        let old = "o".repeat(43);
        p.register("w", "vm", 1, JobId(1), &old);
        // Generation 2: the VM booted fresh, its new job 1 has another controller.
        assert_eq!(
            p.attach("w", "vm", 2, JobId(1), &old).err().map(|e| e.code),
            Some("not_found"),
            "attach after the boot, before any new registration"
        );
        assert!(!p.has("vm", 1, JobId(1)), "forgotten");
        p.register("w", "vm", 1, JobId(1), &old);
        p.register("w", "vm", 2, JobId(1), TOKEN);
        assert_eq!(
            p.attach("w", "vm", 2, JobId(1), &old).err().map(|e| e.code),
            Some("not_found")
        );
        assert!(p.attach("w", "vm", 2, JobId(1), TOKEN).is_ok());
    }

    /// A controller still attached to a lost boot's pipe when the new boot's job of the same
    /// number registers: its detaching later must not free the new pipe, which its own
    /// controller holds. (Before, the old attachment's drop cleared the new pipe's flag and a
    /// second concurrent attachment with the new token succeeded.)
    #[test]
    fn test_an_old_boots_detach_leaves_the_new_pipe_attached() {
        let p = Pipes::default();
        let old = "o".repeat(43);
        p.register("w", "vm", 1, JobId(1), &old);
        let stale = p.attach("w", "vm", 1, JobId(1), &old).expect("attach");
        p.register("w", "vm", 2, JobId(1), TOKEN);
        let _current = p.attach("w", "vm", 2, JobId(1), TOKEN).expect("attach");
        drop(stale);
        assert_eq!(
            p.attach("w", "vm", 2, JobId(1), TOKEN)
                .err()
                .map(|e| e.code),
            Some("busy"),
            "a second controller on the new pipe"
        );
    }

    /// Whether a job has a pipe, and forgetting it when its job ended, are of the job's own
    /// generation: after a fresh boot (job ids start again) the lost boot's pipe is not the
    /// new job's, and the lost job's end does not forget the new job's pipe. (Before, `has`
    /// answered for any generation, so a replayed `vm_exec` could report another boot's pipe,
    /// and the end of a lost boot's job forgot the new boot's pipe.)
    #[test]
    fn test_has_and_end_are_of_the_pipes_own_generation() {
        let p = Pipes::default();
        let old = "o".repeat(43);
        p.register("w", "vm", 1, JobId(1), &old);
        assert!(p.has("vm", 1, JobId(1)), "control");
        assert!(
            !p.has("vm", 2, JobId(1)),
            "a lost boot's pipe in generation 2"
        );
        p.register("w", "vm", 2, JobId(1), TOKEN);
        assert!(!p.has("vm", 1, JobId(1)), "replaced");
        p.end("vm", 1, JobId(1));
        assert!(
            p.has("vm", 2, JobId(1)),
            "the lost job's end leaves the new pipe"
        );
        // A late registration of the lost boot's job, and an attach by a caller that read
        // the old generation, leave the new pipe as it is.
        p.register("w", "vm", 1, JobId(1), &old);
        assert_eq!(
            p.attach("w", "vm", 1, JobId(1), &old).err().map(|e| e.code),
            Some("not_found")
        );
        assert!(p.has("vm", 2, JobId(1)));
        let a = p
            .attach("w", "vm", 2, JobId(1), TOKEN)
            .expect("the new token");
        assert_eq!(a.generation(), 2);
        p.end("vm", 2, JobId(1));
        assert!(!p.has("vm", 2, JobId(1)), "its own end forgets it");
    }

    #[test]
    fn test_attached_pipes_per_vm_capped() {
        let p = Pipes::default();
        let held: Vec<_> = (1..=MAX_ATTACHED_PER_VM as u64)
            .map(|j| {
                p.register("w", "vm", 1, JobId(j), TOKEN);
                p.attach("w", "vm", 1, JobId(j), TOKEN).expect("attach")
            })
            .collect();
        p.register("w", "vm", 1, JobId(99), TOKEN);
        assert_eq!(
            p.attach("w", "vm", 1, JobId(99), TOKEN)
                .err()
                .map(|e| e.code),
            Some("busy")
        );
        drop(held);
        assert!(p.attach("w", "vm", 1, JobId(99), TOKEN).is_ok());
    }

    #[test]
    fn test_frames_split_and_combined() {
        let mut bytes = data_frames(7, b"hello");
        bytes.extend(close_frame(7));
        let mut r = FrameReader::default();
        let mut got = Vec::new();
        for b in &bytes {
            got.extend(r.feed(std::slice::from_ref(b)).expect("byte by byte"));
        }
        assert_eq!(
            got,
            vec![Frame::Data(7, b"hello".to_vec()), Frame::Close(7)]
        );
        let mut r = FrameReader::default();
        assert_eq!(r.feed(&bytes).expect("at once").len(), 2);
    }

    #[test]
    fn test_frames_refused() {
        let mut r = FrameReader::default();
        assert_eq!(r.feed(&open_frame(1)), Err(FrameError::Type(OPEN)));
        let mut r = FrameReader::default();
        assert_eq!(r.feed(&close_frame(0)), Err(FrameError::ZeroId));
        let mut r = FrameReader::default();
        let mut big = vec![DATA, 0, 0, 0, 1];
        big.extend_from_slice(&(MAX_DATA as u32 + 1).to_be_bytes());
        assert_eq!(r.feed(&big), Err(FrameError::TooLong(MAX_DATA as u32 + 1)));
        let mut r = FrameReader::default();
        assert_eq!(r.feed(&[9]), Err(FrameError::Type(9)));
    }

    #[test]
    fn test_data_frames_split_at_the_limit() {
        let data = vec![1u8; MAX_DATA + 3];
        let mut r = FrameReader::default();
        let got = r.feed(&data_frames(2, &data)).expect("frames");
        assert_eq!(got.len(), 2);
        assert!(matches!(&got[1], Frame::Data(2, d) if d.len() == 3));
    }
}
