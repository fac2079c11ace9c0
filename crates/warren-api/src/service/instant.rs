//! `vm_fork` and `pool_status`, and the warm pools' background refill (`docs/instant.md`).

use std::time::Duration;

use serde_json::Value;
use warren_core::store::VmState;
use warren_core::{ForkVm, PoolShape};

use super::{replay, to_value, workspace_limits, Service};
use crate::auth::Principal;
use crate::error::ApiError;
use crate::receipts::{args_hash, validate_request_id, Claim};
use crate::tools::*;

impl Service {
    /// The copies of a networked VM are new VMs: admitted under the workspace's network
    /// grants as they are now (an internet grant taken away, a CIDR grant narrowed, refuse
    /// the fork), with the operator's current secrets, intercepts and blocked ranges, and
    /// the parent's own allow and deny lists.
    fn fork_network(
        &self,
        p: &Principal,
        vm_id: &str,
    ) -> Result<Option<warren_core::NetworkRequest>, ApiError> {
        self.fork_network_of(p, self.warren.vm_network_checked(vm_id)?)
    }

    /// [`Service::fork_network`] of a parent launched with `net`.
    fn fork_network_of(
        &self,
        p: &Principal,
        net: Option<warren_vmm::NetSpec>,
    ) -> Result<Option<warren_core::NetworkRequest>, ApiError> {
        let Some(net) = net else {
            return Ok(None);
        };
        let mode = match net.mode {
            warren_vmm::NetMode::Internet => Network::Internet,
            warren_vmm::NetMode::Allowlist => Network::Allowlist,
        };
        let egress = EgressArgs {
            allow: net.allow,
            deny: net.deny,
        };
        self.network_for(p, Some(mode), Some(egress))
    }

    pub(super) async fn vm_fork(&self, p: &Principal, a: VmForkArgs) -> Result<Value, ApiError> {
        validate_request_id(&a.request_id)?;
        if !(1..=warren_core::vm::fork::MAX_FORK_COUNT).contains(&a.count) {
            return Err(ApiError::invalid(format!(
                "count must be within 1..={}",
                warren_core::vm::fork::MAX_FORK_COUNT
            )));
        }
        let parent = self
            .owned_for_work(p, &a.vm_id, a.expected_generation)
            .await?;
        let hash = args_hash(&a);
        let rid = a.request_id.as_str();
        let _guard = self.enter(p, "vm_fork", rid)?;
        match self.receipts.claim(&p.workspace, "vm_fork", rid, &hash)? {
            Claim::Done(v) => return replay(v),
            Claim::Pending => {
                // An earlier attempt was cut off after its admission: its copies say how far
                // it got; none is trusted to be complete.
                let first = warren_core::vm::fork::copy_request_id(rid, 0);
                if self.warren.vm_by_request(&p.workspace, &first)?.is_some() {
                    return Err(ApiError::new(
                        "outcome_unknown",
                        format!("the copies of request {rid} were left half-made; list and destroy them, then use a new request_id"),
                    ));
                }
            }
            Claim::New => {}
        }
        let req = ForkVm {
            vm_id: parent.id.clone(),
            count: a.count,
            request_id: Some(rid.to_string()),
            host_limits: self.cfg.host_limits(),
            workspace_limits: workspace_limits(p),
            network: self.fork_network(p, &parent.id)?,
        };
        match self.warren.fork_vm(&req).await {
            Ok(copies) => {
                let session_ids = self.warren.sessions_of_vms(&copies)?;
                let out = VmForked {
                    vms: copies.into_iter().map(|r| self.info(r)).collect(),
                    session_ids,
                };
                let stored = serde_json::json!({ "ok": to_value(&out)? });
                self.receipts
                    .complete(&p.workspace, "vm_fork", rid, &stored)?;
                replay(stored)
            }
            Err(e) => {
                let e = ApiError::from(e);
                let made = self
                    .warren
                    .vm_by_request(
                        &p.workspace,
                        &warren_core::vm::fork::copy_request_id(rid, 0),
                    )?
                    .is_some_and(|r| r.state == VmState::Failed);
                if made {
                    self.receipts.complete(
                        &p.workspace,
                        "vm_fork",
                        rid,
                        &serde_json::json!({ "error": { "code": e.code, "message": e.message } }),
                    )?;
                } else {
                    self.receipts.release(&p.workspace, "vm_fork", rid)?;
                }
                Err(e)
            }
        }
    }

    /// The warm pools of the images the principal may use (the others are not named).
    pub(super) fn pool_status(&self, p: &Principal) -> Result<Value, ApiError> {
        let now = self.warren.pool_status()?;
        let mut pools = Vec::new();
        for (name, img) in &self.cfg.images {
            if img.pool == 0 || !super::image_allowed(p, name) {
                continue;
            }
            let memory = img
                .memory_mib
                .or(img.min_memory_mib)
                .unwrap_or(warren_core::vm::DEFAULT_MEMORY_MIB);
            let found = now.iter().find(|s| {
                s.image_id == img.id
                    && s.memory_mib == memory
                    && s.vcpus == warren_core::vm::DEFAULT_VCPUS
            });
            pools.push(PoolEntry {
                image: Some(name.clone()),
                image_id: img.id.clone(),
                memory_mib: memory,
                vcpus: warren_core::vm::DEFAULT_VCPUS,
                size: img.pool,
                ready: found.map_or(0, |s| s.ready),
                starting: found.map_or(0, |s| s.starting),
            });
        }
        to_value(PoolReport { pools })
    }

    /// Keeps every configured warm pool at its size, checking every `every`, and sweeps
    /// template build VMs no build holds; one image's
    /// failure (host limits reached, a template that cannot be built) is logged and retried
    /// at the next check.
    pub async fn pool_loop(self: std::sync::Arc<Self>, every: Duration) {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            // Build VMs whose build's process died (`Warren::sweep_template_builds`).
            if let Err(e) = self.warren.sweep_template_builds().await {
                tracing::warn!(error = %crate::error::format_chain(&e), "sweeping template build VMs failed");
            }
            for (name, img) in &self.cfg.images {
                if img.pool == 0 {
                    continue;
                }
                let shape = PoolShape {
                    image: img.id.clone(),
                    memory_mib: img.memory_mib.or(img.min_memory_mib),
                    vcpus: None,
                };
                match self
                    .warren
                    .fill_pool(&shape, img.pool, self.cfg.host_limits())
                    .await
                {
                    Ok(0) => {}
                    Ok(n) => tracing::info!(image = %name, started = n, "warm pool refilled"),
                    Err(e) => {
                        tracing::warn!(image = %name, error = %crate::error::format_chain(&e), "warm pool refill failed")
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::auth::PolicyRequest;

    fn launched(mode: warren_vmm::NetMode, allow: &[&str]) -> warren_vmm::NetSpec {
        warren_vmm::NetSpec {
            netns: "warren-vm-000000000001".into(),
            mac: "52:54:00:00:00:01".into(),
            upstream_dns: "127.0.0.53:53".parse().expect("addr"),
            outbound_netns: None,
            allow: allow.iter().map(|a| a.to_string()).collect(),
            deny: vec!["bad.example.com".into()],
            secrets: vec![],
            upstream_roots: None,
            intercepts: vec![],
            blocked_cidrs: vec![],
            intercept_all_tls: false,
            mode,
            host_ca_store: false,
            secret_headers: vec![],
        }
    }

    /// A fork's copies record request ids no caller can send: a `vm_create` (or another
    /// fork) with the id of a fork's copy is not possible. (Before, fork `x`'s first copy
    /// recorded `x.0`, which a `vm_create` with request id `x.0` collided with on the
    /// store's unique index, or, cut off and retried, adopted as its own VM.)
    #[test]
    fn test_a_fork_copy_request_id_is_no_callers_request_id() {
        for rid in ["x", "x.0", "a:b-c_d", &"r".repeat(128)] {
            for i in [0, 1, 9] {
                let copy = warren_core::vm::fork::copy_request_id(rid, i);
                assert!(
                    crate::receipts::validate_request_id(&copy).is_err(),
                    "{copy} is a valid caller request id"
                );
            }
        }
        assert_ne!(
            warren_core::vm::fork::copy_request_id("x", 0),
            warren_core::vm::fork::copy_request_id("x", 1)
        );
    }

    /// A fork's copies are new VMs: a workspace whose internet grant was taken away, or whose
    /// CIDR grant no longer covers the parent's allow list, cannot fork its old internet or
    /// allow-listed VM into new ones; the copies otherwise get the parent's lists under the
    /// operator's current settings. (Before, `vm_fork` checked no network grant at all.)
    #[test]
    fn test_a_fork_is_admitted_under_the_current_network_grants() {
        let dir = tempfile::tempdir().expect("tmp");
        let service = crate::ws::tests::test_service_with(
            dir.path(),
            "[egress]\nblocked_cidrs = [\"10.9.0.0/16\"]\n",
        );
        let creds = service.credentials();
        let (_, tok) = creds
            .issue(
                "alice",
                None,
                &PolicyRequest {
                    allow_internet: Some(true),
                    ..PolicyRequest::default()
                },
            )
            .expect("issue");
        let p = creds.authenticate(&tok).expect("auth");
        let internet = launched(warren_vmm::NetMode::Internet, &["example.com"]);
        let now = service
            .fork_network_of(&p, Some(internet.clone()))
            .expect("granted")
            .expect("networked");
        assert_eq!(now.mode, warren_vmm::NetMode::Internet);
        assert_eq!(now.allow, vec!["example.com".to_string()]);
        assert_eq!(now.deny, vec!["bad.example.com".to_string()]);
        assert_eq!(
            now.blocked_cidrs,
            vec!["10.9.0.0/16".to_string()],
            "the operator's, now"
        );
        assert!(service.fork_network_of(&p, None).expect("off").is_none());

        creds
            .set_internet("alice", false)
            .expect("take the grant away");
        let p = creds.authenticate(&tok).expect("auth");
        let e = service
            .fork_network_of(&p, Some(internet))
            .expect_err("no internet grant");
        assert_eq!(e.code, "forbidden", "{e}");
        // An allow-listed parent naming a CIDR outside the workspace's grant (none here).
        let cidr = launched(warren_vmm::NetMode::Allowlist, &["10.1.2.0/24"]);
        assert!(service.fork_network_of(&p, Some(cidr)).is_err());
        let plain = launched(warren_vmm::NetMode::Allowlist, &["example.com"]);
        assert!(service.fork_network_of(&p, Some(plain)).is_ok());
    }
}

#[cfg(test)]
mod image_tests {
    use crate::auth::PolicyRequest;

    /// A workspace limited to some images is told about those only: `pool_status` leaves the
    /// others' pools out, an unknown image's error names only the usable ones, and another
    /// workspace's image is answered as an unknown one. (Before, both named every configured
    /// image, and another's image was `forbidden`, which told that it exists.)
    #[test]
    fn test_pool_status_and_image_errors_name_only_usable_images() {
        let dir = tempfile::tempdir().expect("tmp");
        let service = crate::ws::tests::test_service_with(
            dir.path(),
            &format!(
                "pool = 1\ndefault = true\n[images.secretimg]\nid = \"{}\"\npool = 2\n",
                "1".repeat(64)
            ),
        );
        let creds = service.credentials();
        let (_, tok) = creds
            .issue(
                "alice",
                None,
                &PolicyRequest {
                    images: Some(vec!["dev".into()]),
                    ..PolicyRequest::default()
                },
            )
            .expect("issue");
        let alice = creds.authenticate(&tok).expect("auth");
        let pools = service.pool_status(&alice).expect("status").to_string();
        assert!(pools.contains("\"dev\""), "{pools}");
        assert!(!pools.contains("secretimg"), "{pools}");
        let e = service
            .configured_image(&alice, Some("nope"))
            .expect_err("unknown");
        assert_eq!(e.code, "invalid_argument");
        assert!(e.message.contains("dev"), "{e}");
        assert!(!e.message.contains("secretimg"), "{e}");
        // An image configured for others is answered as an unknown one: no oracle of names.
        let other = service
            .configured_image(&alice, Some("secretimg"))
            .expect_err("not granted");
        assert_eq!(other.code, e.code);
        assert_eq!(
            other.message.replace("\"secretimg\"", "\"nope\""),
            e.message,
            "{other}"
        );
        let enum_of = |tools: &[crate::service::ToolDef]| {
            let t = tools
                .iter()
                .find(|t| t.name == "vm_create")
                .expect("vm_create");
            t.input_schema["properties"]["image"]["enum"].to_string()
        };
        assert_eq!(enum_of(&service.tools_for(&alice)), "[\"dev\"]");

        let (_, tok) = creds
            .issue("bob", None, &PolicyRequest::default())
            .expect("issue");
        let bob = creds.authenticate(&tok).expect("auth");
        let pools = service.pool_status(&bob).expect("status").to_string();
        assert!(
            pools.contains("secretimg") && pools.contains("\"dev\""),
            "{pools}"
        );
        let e = service
            .configured_image(&bob, Some("nope"))
            .expect_err("unknown");
        assert!(e.message.contains("secretimg"), "{e}");
        assert_eq!(enum_of(&service.tools_for(&bob)), "[\"dev\",\"secretimg\"]");
    }
}
