//! The exec request keys the agent remembers during one boot, so that a host retrying an
//! `ExecStart` whose answer it lost (daemon or supervisor crash, reconnection) gets the first
//! job's id back instead of running the command a second time.
//!
//! Owned by the job manager's table and guarded by its lock: the lookup of a key and the
//! insertion that follows it happen under one lock guard, with no await in between, so two
//! identical requests can never both start a job.
//!
//! Invariants: at most `capacity` keys, the oldest forgotten first; a key outlives its job's
//! record on purpose (a retry of a job whose record was evicted must still not run again);
//! `by_key` and `by_job` always hold the same entries.

use std::collections::{BTreeMap, HashMap};

use warren_protocol::JobId;

/// What a remembered key says about a new request carrying it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lookup {
    /// Never seen (or forgotten): the request may start a job.
    New,
    /// The same request already started this job.
    Started(JobId),
    /// A different request already started this job with the key.
    Conflict(JobId),
}

struct Entry {
    job: JobId,
    digest: [u8; 32],
}

/// A bounded map from request key to the job it started and the request's digest.
pub struct RequestKeys {
    capacity: usize,
    by_key: HashMap<String, Entry>,
    /// The same keys by job id. Ids grow, so the first entry is the oldest key.
    by_job: BTreeMap<JobId, String>,
}

impl RequestKeys {
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity,
            by_key: HashMap::new(),
            by_job: BTreeMap::new(),
        }
    }

    pub fn lookup(&self, key: &str, digest: &[u8; 32]) -> Lookup {
        match self.by_key.get(key) {
            None => Lookup::New,
            Some(e) if e.digest == *digest => Lookup::Started(e.job),
            Some(e) => Lookup::Conflict(e.job),
        }
    }

    /// Remembers that `key` started `job`, forgetting the oldest keys beyond the capacity.
    /// `job` must be newer than every remembered job (the job manager's ids grow).
    pub fn insert(&mut self, key: String, job: JobId, digest: [u8; 32]) {
        if let Some(old) = self.by_key.insert(key.clone(), Entry { job, digest }) {
            // Callers look the key up first, so this does not happen; keep both maps equal
            // if it ever does.
            self.by_job.remove(&old.job);
        }
        self.by_job.insert(job, key);
        while self.by_job.len() > self.capacity {
            if let Some((_, oldest)) = self.by_job.pop_first() {
                self.by_key.remove(&oldest);
            }
        }
    }

    /// Forgets the key that started `job`, if any: its start failed, so a retry may succeed.
    pub fn forget(&mut self, job: JobId) {
        if let Some(key) = self.by_job.remove(&job) {
            self.by_key.remove(&key);
        }
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.by_job.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_lookup_same_digest_started_other_conflict() {
        let mut keys = RequestKeys::new(4);
        assert_eq!(keys.lookup("a", &[1; 32]), Lookup::New);
        keys.insert("a".into(), JobId(7), [1; 32]);
        assert_eq!(keys.lookup("a", &[1; 32]), Lookup::Started(JobId(7)));
        assert_eq!(keys.lookup("a", &[2; 32]), Lookup::Conflict(JobId(7)));
        assert_eq!(keys.lookup("b", &[1; 32]), Lookup::New);
    }

    #[test]
    fn test_insert_over_capacity_oldest_forgotten() {
        let mut keys = RequestKeys::new(2);
        for (i, k) in ["a", "b", "c"].into_iter().enumerate() {
            keys.insert(k.into(), JobId(i as u64 + 1), [0; 32]);
        }
        assert_eq!(keys.len(), 2);
        assert_eq!(keys.lookup("a", &[0; 32]), Lookup::New);
        assert_eq!(keys.lookup("b", &[0; 32]), Lookup::Started(JobId(2)));
        assert_eq!(keys.lookup("c", &[0; 32]), Lookup::Started(JobId(3)));
    }

    #[test]
    fn test_forget_by_job_removes_key() {
        let mut keys = RequestKeys::new(2);
        keys.insert("a".into(), JobId(1), [0; 32]);
        keys.forget(JobId(2));
        assert_eq!(keys.len(), 1);
        keys.forget(JobId(1));
        assert_eq!(keys.len(), 0);
        assert_eq!(keys.lookup("a", &[0; 32]), Lookup::New);
    }
}
