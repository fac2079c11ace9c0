//! Network policy through the service: egress CIDRs and internet mode need the
//! operator's grants.

use super::*;

/// Issue 13 item 7: a token holder could once allow any CIDR (a host's public address, a
/// management network, `0.0.0.0/0`); now CIDRs need the operator's grant for the workspace,
/// and every networked VM carries the operator's `blocked_cidrs` and `intercept_all_tls`.
#[test]
fn test_service_egress_cidrs_need_operator_grant() {
    let d = Daemon::start(
        "[egress]\nblocked_cidrs = [\"198.51.100.0/24\"]\nintercept_all_tls = true\n\
         [egress.cidr_grants]\ncarol = [\"203.0.113.0/24\"]\n",
    );
    let carol = d.token("carol", &["--allow-network"]);
    let dave = d.token("dave", &["--allow-network"]);
    let c = Conformance::fetch(&d, &carol);
    let args = |rid: &str, allow: Value| json!({"request_id": rid, "network": "on", "egress": {"allow": allow}});
    for (token, rid, allow) in [
        (&dave, "d1", json!(["203.0.113.5"])),
        (&dave, "d2", json!(["0.0.0.0/0"])),
        (&carol, "c1", json!(["198.51.100.0/24"])),
        (&carol, "c2", json!(["203.0.112.0/23"])),
    ] {
        let r = c.call(&d, token, "vm_create", args(rid, allow.clone()));
        assert_eq!(
            (r.status, r.code()),
            (403, "forbidden"),
            "{allow}: {}",
            r.text
        );
    }
    // A local caller's workspace (local-0) has no grant either.
    let r = d.local_call("vm_create", args("l1", json!(["203.0.113.5"])), &[]);
    assert_eq!((r.status, r.code()), (403, "forbidden"), "{}", r.text);
    assert!(d.all_vms().is_empty(), "a refused create made a VM");

    // Positive control: inside the grant (and a name) is created, with the operator's settings.
    let r = c.call(
        &d,
        &carol,
        "vm_create",
        args("c3", json!(["203.0.113.0/25", "api.example.com"])),
    );
    assert_eq!(r.status, 200, "{}", r.text);
    let vms = d.all_vms();
    assert_eq!(vms.len(), 1);
    let net = &vms[0]["network"];
    assert_eq!(
        net["allow"],
        json!(["203.0.113.0/25", "api.example.com"]),
        "{net}"
    );
    assert_eq!(net["blocked_cidrs"], json!(["198.51.100.0/24"]), "{net}");
    assert_eq!(net["intercept_all_tls"], json!(true), "{net}");
    // "on" keeps meaning allow-list.
    assert_eq!(net["mode"], "allowlist", "{net}");
    assert_eq!(net["host_ca_store"], false, "{net}");
}

#[test]
fn test_service_internet_mode_needs_the_internet_grant() {
    let d = Daemon::start("[egress]\nhost_ca_store = true\n");
    let erin = d.token("erin", &["--allow-network"]);
    let c = Conformance::fetch(&d, &erin);
    let inet = |rid: &str| json!({"request_id": rid, "network": "internet", "egress": {"deny": ["x.example.com"]}});
    // The network grant is not the internet grant.
    let r = c.call(&d, &erin, "vm_create", inet("e1"));
    assert_eq!((r.status, r.code()), (403, "forbidden"), "{}", r.text);
    assert!(
        r.text.contains("allow-internet"),
        "says how to get it: {}",
        r.text
    );
    // An unknown preset is refused before anything exists.
    let r = c.call(
        &d,
        &erin,
        "vm_create",
        json!({"request_id": "e0", "network": "allowlist", "egress": {"allow": ["preset:nope"]}}),
    );
    assert_eq!(
        (r.status, r.code()),
        (400, "invalid_argument"),
        "{}",
        r.text
    );
    assert!(d.all_vms().is_empty(), "a refused create made a VM");
    // A reissue cannot widen the workspace's policy.
    let file = d.env.state.path().join("erin-wider.token");
    let out = d.env.run(&[
        "token",
        "issue",
        "--workspace",
        "erin",
        "--output",
        file.to_str().expect("utf-8"),
        "--allow-internet",
    ]);
    assert!(!out.status.success(), "a reissue widened the policy");
    assert!(!file.exists());
    let r = c.call(&d, &erin, "vm_create", inet("e2"));
    assert_eq!((r.status, r.code()), (403, "forbidden"), "{}", r.text);

    // The operator's explicit grant: the workspace's existing token may now create it.
    let out = d
        .env
        .run(&["token", "allow-internet", "--workspace", "erin"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r = c.call(&d, &erin, "vm_create", inet("e3"));
    assert_eq!(r.status, 200, "{}", r.text);
    let id = r.body["vm_id"].as_str().expect("vm_id").to_string();
    let status = d.ok(&erin, "vm_status", json!({"vm_id": id}));
    assert_eq!(status["network"], "internet", "{status}");
    let vms = d.all_vms();
    assert_eq!(vms.len(), 1);
    let net = &vms[0]["network"];
    assert_eq!(net["mode"], "internet", "{net}");
    assert_eq!(net["host_ca_store"], true, "{net}");
    assert_eq!(net["deny"], json!(["x.example.com"]), "{net}");

    // The grant taken away: the running VM keeps its mode, but its forks are new VMs and
    // are refused (before, `vm_fork` checked no grant and copied the internet VM).
    let out = d
        .env
        .run(&["token", "allow-internet", "--workspace", "erin", "--off"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r = c.call(
        &d,
        &erin,
        "vm_fork",
        json!({"request_id": "f1", "vm_id": id, "count": 2}),
    );
    assert_eq!((r.status, r.code()), (403, "forbidden"), "{}", r.text);
    assert!(r.text.contains("allow-internet"), "{}", r.text);
    assert_eq!(d.all_vms().len(), 1, "a refused fork made copies");
}
