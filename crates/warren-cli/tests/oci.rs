//! OCI images from a real registry on loopback (Debian's `docker-registry`), made with umoci
//! from the `minimal` image's root file system or by the Python helper, pushed with skopeo;
//! signatures and attestations made by an independent implementation (Python's
//! `cryptography`, cosign's formats by hand), checked by Warren under an image policy.
//! Nothing here reaches a registry off this machine.

mod common;

use std::path::Path;
use std::process::Output;

use common::registry::{self, helper, CuttingProxy, Registry};
use common::TestEnv;

const SLSA: &str = "https://slsa.dev/provenance/v1";
const BUILDER: &str = "https://ci.example.com/builder@v1";

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Asserts `out` failed with `error[code]` and every one of `needles` in its message.
fn refused(out: &Output, code: &str, needles: &[&str]) {
    let t = text(out);
    assert!(!out.status.success(), "not refused: {t}");
    assert!(t.contains(&format!("error[{code}]")), "code {code}: {t}");
    for n in needles {
        assert!(t.contains(n), "{n:?} missing: {t}");
    }
}

fn ok(out: Output, what: &str) -> String {
    common::ok(out, what).trim().to_string()
}

fn write_policy(env: &TestEnv, version: u64, expires: &str, keys: &[(&str, &Path)], rules: &str) {
    let mut text = format!("version = {version}\nexpires = {expires}\n");
    for (name, pubkey) in keys {
        let pem = std::fs::read_to_string(pubkey).expect("public key");
        text.push_str(&format!(
            "[[keys]]\nname = \"{name}\"\npublic_key = \"\"\"\n{pem}\"\"\"\n"
        ));
    }
    text.push_str(rules);
    std::fs::write(env.state.path().join("image-policy.toml"), text).expect("policy");
}

fn attestation_rule(builder: &str) -> String {
    format!("[[attestations]]\npredicate_type = \"{SLSA}\"\nbuilder_ids = [\"{builder}\"]\n")
}

fn vm_count(env: &TestEnv) -> usize {
    let out = env.run(&["vm", "list", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    v.as_array().map_or(0, Vec::len)
}

/// Pull by digest under a policy (signature and SLSA attestation made in Python), the tag
/// alone refused and resolved, two images (pulled and local, signed by `warren image sign`)
/// booted side by side with the image's `Env` applied, Warren's signature verified by the
/// independent implementation, then each policy refusal (wrong key, missing attestation,
/// rollback, expiry) with nothing booted, and a token restricted to one image refused the
/// other.
#[test]
fn test_oci_pull_signed_policy_boot_and_refusals() {
    let work =
        tempfile::tempdir_in(common::image_dir().parent().expect("parent")).expect("tempdir");
    let (store, minimal) = registry::private_store(work.path());
    let env = TestEnv::with_image_dir(store.clone());
    let reg = Registry::start();
    let layout = registry::minimal_layout(work.path(), &store, &minimal);
    let digest = reg.push(&layout, "min", "warren/minimal");
    let repo = format!("{}/warren/minimal", reg.addr());
    let keys = work.path();
    helper(&["keygen", &keys.display().to_string(), "k1"]);
    helper(&["keygen", &keys.display().to_string(), "k2"]);
    let (k1, k1pub, k2pub) = (
        keys.join("k1.key"),
        keys.join("k1.pub"),
        keys.join("k2.pub"),
    );
    let k1s = k1.display().to_string();
    helper(&["sign", &reg.addr(), "warren/minimal", &digest, &k1s]);
    helper(&[
        "attest",
        &reg.addr(),
        "warren/minimal",
        &digest,
        &k1s,
        SLSA,
        BUILDER,
    ]);

    // A tag alone is refused; resolve prints what to pin.
    refused(
        &env.run(&["image", "pull", &format!("{repo}:min")]),
        "invalid_argument",
        &["has no digest", "warren image resolve"],
    );
    let pinned = ok(
        env.run(&["image", "resolve", &format!("{repo}:min")]),
        "resolve",
    );
    assert_eq!(pinned, format!("{repo}@{digest}"));

    // Policy v1: k1 trusted, SLSA provenance by BUILDER required. Pull by digest.
    write_policy(
        &env,
        1,
        "2999-01-01T00:00:00Z",
        &[("k1", &k1pub)],
        &attestation_rule(BUILDER),
    );
    let started = std::time::Instant::now();
    let out = env.run(&["image", "pull", &pinned]);
    eprintln!(
        "pull: {:.1?}\n{}",
        started.elapsed(),
        String::from_utf8_lossy(&out.stderr)
    );
    let pulled = ok(out, "pull");
    assert_eq!(pulled.len(), 64, "{pulled}");
    let verified = ok(env.run(&["image", "verify", &pulled]), "verify");
    assert!(
        verified.contains("signed by k1, attested by k1 (policy version 1)"),
        "{verified}"
    );

    // The local minimal image: refused until signed (with provenance) by `warren image sign`.
    refused(
        &env.run(&["vm", "create", "--image", &minimal]),
        "untrusted_image",
        &["signature_missing", &minimal],
    );
    assert_eq!(vm_count(&env), 0, "nothing boots");
    ok(
        env.run(&[
            "image",
            "sign",
            &minimal,
            "--key",
            &k1s,
            "--builder-id",
            BUILDER,
        ]),
        "sign",
    );
    // The independent implementation verifies what Warren signed.
    helper(&[
        "verify-trust",
        &store
            .join(&minimal)
            .join("trust.json")
            .display()
            .to_string(),
        &k1pub.display().to_string(),
        &format!("sha256:{minimal}"),
    ]);

    // Side by side: the pulled image (its config's Env applied to jobs) and the local one.
    // (A failing test's VMs are destroyed by the environment's drop.)
    let pulled_vm = env.create_vm(&pulled);
    let local_vm = env.create_vm(&minimal);
    let run = |vm: &str, script: &str| {
        ok(
            env.run(&["vm", "exec", vm, "--", "sh", "-c", script]),
            script,
        )
    };
    assert_eq!(
        run(&pulled_vm, "echo $WARREN_TEST_IMAGE_ENV; id -u; pwd"),
        "from-the-oci-config\n1000\n/workspace"
    );
    assert_eq!(
        run(&local_vm, "echo ${WARREN_TEST_IMAGE_ENV:-unset}; id -u"),
        "unset\n1000"
    );

    // Wrong key: policy v2 trusts only k2.
    write_policy(&env, 2, "2999-01-01T00:00:00Z", &[("k2", &k2pub)], "");
    refused(
        &env.run(&["vm", "create", "--image", &pulled]),
        "untrusted_image",
        &["unknown_signer", &digest],
    );
    // Missing attestation: v3 trusts k1 but wants another builder.
    write_policy(
        &env,
        3,
        "2999-01-01T00:00:00Z",
        &[("k1", &k1pub)],
        &attestation_rule("https://other.example.com/builder"),
    );
    refused(
        &env.run(&["vm", "create", "--image", &pulled]),
        "untrusted_image",
        &["attestation_missing", "https://other.example.com/builder"],
    );
    // Stale policy: a rollback to v1, then v4 past its expiry.
    write_policy(
        &env,
        1,
        "2999-01-01T00:00:00Z",
        &[("k1", &k1pub)],
        &attestation_rule(BUILDER),
    );
    refused(
        &env.run(&["vm", "create", "--image", &minimal]),
        "untrusted_image",
        &["policy_rollback", "version 1", "version 3"],
    );
    write_policy(
        &env,
        4,
        "2020-01-01T00:00:00Z",
        &[("k1", &k1pub)],
        &attestation_rule(BUILDER),
    );
    refused(
        &env.run(&["vm", "create", "--image", &minimal]),
        "untrusted_image",
        &["policy_expired", "version 4"],
    );
    // Pulls go through the same check: a new image pulled under the expired policy is
    // refused before anything is downloaded.
    refused(
        &env.run(&["image", "pull", &pinned]),
        "untrusted_image",
        &["policy_expired"],
    );
    assert_eq!(
        vm_count(&env),
        2,
        "only the two VMs booted under the valid policy"
    );

    // v5: valid again; a token restricted to the pulled image is refused the local one.
    write_policy(
        &env,
        5,
        "2999-01-01T00:00:00Z",
        &[("k1", &k1pub)],
        &attestation_rule(BUILDER),
    );
    for vm in [&pulled_vm, &local_vm] {
        ok(env.run(&["vm", "destroy", vm]), "destroy");
    }
    let d = common::daemon::Daemon::start_in(
        env,
        &format!(
            "[images.pulled]\nid = \"{pulled}\"\ndefault = true\n[images.local]\nid = \"{minimal}\"\n"
        ),
    );
    let token = d.token("oci", &["--image", "pulled"]);
    let r = d.call(
        &token,
        "vm_create",
        serde_json::json!({"image": "local", "request_id": "oci-1"}),
    );
    // Answered as an unknown image: which images other workspaces have is not told.
    assert_eq!(
        (r.status, r.code()),
        (400, "invalid_argument"),
        "{}",
        r.text
    );
    assert!(r.text.contains("is not configured"), "{}", r.text);
    assert!(d.all_vms().is_empty(), "nothing was created");
}

/// Hostile registry content, none of it booted: layers with an absolute path, `..`, a
/// write through a symlink out, a hard link out (refused: no image), a device node and set-id
/// bits (dropped, say the image's file system); a tampered manifest and a tampered blob
/// (refused); the registry stopped mid-pull (no image, no build record, no temp directory).
#[test]
fn test_oci_hostile_layers_tampering_and_interrupted_pull() {
    let work =
        tempfile::tempdir_in(common::image_dir().parent().expect("parent")).expect("tempdir");
    let (store, _minimal) = registry::private_store(work.path());
    let env = TestEnv::with_image_dir(store.clone());
    let reg = Registry::start();
    let layout = |kind: &str| {
        let dir = work.path().join(kind);
        helper(&["hostile-layout", &dir.display().to_string(), kind]);
        reg.push(&dir, "t", &format!("hostile/{kind}"))
    };
    let images_before = ok(env.run(&["image", "list", "--json"]), "list");
    for (kind, why) in [
        ("abs", "absolute name refused"),
        ("dotdot", "`..` refused"),
        ("symlink-escape", "not a directory of the tree"),
        ("hardlink-escape", "hard link target refused"),
    ] {
        let digest = layout(kind);
        refused(
            &env.run(&[
                "image",
                "pull",
                &format!("{}/hostile/{kind}@{digest}", reg.addr()),
            ]),
            "integrity",
            &[why],
        );
    }
    assert!(!Path::new("/tmp/evil").exists());
    assert_eq!(
        ok(env.run(&["image", "list", "--json"]), "list"),
        images_before
    );

    // Device nodes and set-id bits are dropped; the symlink is kept as it is.
    let digest = layout("special");
    let out = env.run(&[
        "image",
        "pull",
        &format!("{}/hostile/special@{digest}", reg.addr()),
    ]);
    let log = text(&out);
    let id = ok(out, "pull special");
    assert!(
        log.contains("dropped: 1 device/special entries, set-id bits of 1"),
        "{log}"
    );
    let rootfs = store.join(&id).join("rootfs.ext4");
    let debugfs = |cmd: &str| {
        let out = std::process::Command::new("debugfs")
            .args(["-R", cmd])
            .arg(&rootfs)
            .output()
            .expect("debugfs");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    assert!(
        !debugfs("ls -l /dev").contains("evil-null"),
        "device node kept"
    );
    let suid = debugfs("stat /usr/suid");
    assert!(suid.contains("Mode:  0755"), "set-id bits kept: {suid}");
    assert!(debugfs("stat /link-out").contains("Fast link dest: \"/etc/shadow\""));
    assert!(
        debugfs("ls -l /").contains("workspace"),
        "Warren's /workspace"
    );

    // A tampered manifest: a registry answering a digest with other bytes.
    let digest = layout("plain");
    let mut body = std::fs::read(reg.blob_file(&digest)).expect("manifest blob");
    let i = body.iter().position(|b| *b == b'2').expect("a digit");
    body[i] = b'3';
    let port = registry::tampering_registry(body);
    refused(
        &env.run(&[
            "image",
            "pull",
            &format!("127.0.0.1:{port}/hostile/plain@{digest}"),
        ]),
        "integrity",
        &["manifest digest mismatch"],
    );
    // A tampered blob: the layer of another image.
    let dir = work.path().join("tampered-blob");
    helper(&["big-layout", &dir.display().to_string(), "8"]);
    let digest = reg.push(&dir, "t", "hostile/blob");
    let layer = helper(&["layer-digest", &reg.addr(), "hostile/blob", &digest]);
    registry::flip_byte(&reg.blob_file(&layer));
    refused(
        &env.run(&[
            "image",
            "pull",
            &format!("{}/hostile/blob@{digest}", reg.addr()),
        ]),
        "integrity",
        &["does not match its digest"],
    );

    // The registry stops mid-pull: after 4 MiB of a 64 MiB layer went to the client.
    let dir = work.path().join("big");
    helper(&["big-layout", &dir.display().to_string(), "64"]);
    let digest = reg.push(&dir, "t", "big/one");
    let child = reg.child.clone();
    let proxy = CuttingProxy::start(reg.port, 4 << 20, move || {
        if let Some(mut c) = child.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    });
    let out = env.run(&[
        "image",
        "pull",
        &format!("127.0.0.1:{}/big/one@{digest}", proxy.port),
    ]);
    assert!(
        !out.status.success(),
        "pull survived the registry: {}",
        text(&out)
    );
    assert!(
        proxy.cut.load(std::sync::atomic::Ordering::SeqCst),
        "the proxy never cut"
    );
    let ids: Vec<String> = serde_json::from_str::<serde_json::Value>(&ok(
        env.run(&["image", "list", "--json"]),
        "list",
    ))
    .expect("json")
    .as_array()
    .expect("array")
    .iter()
    .map(|i| i["image_id"].as_str().expect("id").to_string())
    .collect();
    assert_eq!(ids.len(), 2, "minimal and special only: {ids:?}");
    let leftovers: Vec<_> = std::fs::read_dir(&store)
        .expect("store")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with('.'))
        .collect();
    assert!(
        leftovers.is_empty(),
        "half-written pull left: {leftovers:?}"
    );
    assert_eq!(
        std::fs::read_dir(store.join("cache/builds"))
            .expect("builds")
            .count(),
        1,
        "one build record (the special image's)"
    );
}
