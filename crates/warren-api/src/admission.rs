//! The limits the engine admits resumes under: the service's host limits and the owning
//! workspace's policy (the same pair a create is checked against), read at each resume so
//! a policy written after the VM was made applies.

use std::sync::Arc;

use warren_core::{CoreError, Limits, LimitsFor};

use crate::auth::{Credentials, Policy};

/// The workspace's own admission limits from its policy (a local workspace has none).
pub fn policy_limits(p: &Policy) -> Limits {
    Limits {
        max_vms: p.max_vms,
        max_memory_mib: p.max_memory_mib,
        max_storage_mib: p.max_storage_mib,
    }
}

/// The engine's admission callback over `policies` (its own connection to the database).
pub fn resume_limits(host: Limits, policies: Credentials) -> Arc<LimitsFor> {
    Arc::new(move |workspace: &str| {
        let ws = policies
            .policy(workspace)
            .map_err(|e| CoreError::Admission(format!("policy of {workspace}: {e}")))?
            .map(|p| policy_limits(&p))
            .unwrap_or_default();
        Ok((host, ws))
    })
}
