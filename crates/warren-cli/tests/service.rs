//! End-to-end tests of `warren serve` (warrend) over HTTP and the local socket, on real VMs.
//! Every response checked here is also validated against the service's own OpenAPI document.

mod common;
#[path = "service/policy.rs"]
mod policy;

use common::daemon::{wait_job, Daemon, Resp};
use serde_json::{json, Value};

/// Validates responses against the OpenAPI document the service publishes.
struct Conformance {
    doc: Value,
}

impl Conformance {
    fn fetch(d: &Daemon, token: &str) -> Conformance {
        let r = d.request(
            "GET",
            "/v1/openapi.json",
            &[("Authorization", &format!("Bearer {token}"))],
            b"",
        );
        assert_eq!(r.status, 200, "openapi: {}", r.text);
        assert_eq!(r.body["openapi"], "3.1.0");
        Conformance { doc: r.body }
    }

    fn check(&self, tool: &str, r: &Resp) {
        let class = match r.status {
            200 => "200",
            400..=499 => "4XX",
            _ => "5XX",
        };
        let schema = warren_api::openapi::response_schema(&self.doc, tool, class)
            .unwrap_or_else(|| panic!("no schema for {tool} {class}"));
        let v = jsonschema::validator_for(&schema).expect("compile schema");
        let errors: Vec<String> = v.iter_errors(&r.body).map(|e| e.to_string()).collect();
        assert!(
            errors.is_empty(),
            "{tool} {} does not match the OpenAPI document: {errors:?}\n{}",
            r.status,
            r.text
        );
    }

    /// Calls a tool, checks conformance, and returns the response.
    fn call(&self, d: &Daemon, token: &str, tool: &str, args: Value) -> Resp {
        let r = d.call(token, tool, args);
        self.check(tool, &r);
        r
    }
}

#[test]
fn test_service_tools_end_to_end_match_openapi() {
    let d = Daemon::start("");
    let t = d.token("alice", &[]);
    let c = Conformance::fetch(&d, &t);

    let r = c.call(&d, &t, "vm_create", json!({"request_id": "create-1"}));
    assert_eq!(r.status, 200, "{}", r.text);
    let vm = r.body["vm_id"].as_str().expect("vm_id").to_string();
    assert_eq!(r.body["image"], "minimal");
    assert_eq!(r.body["state"], "running");

    let r = c.call(&d, &t, "vm_list", json!({}));
    assert_eq!(r.body["vms"][0]["vm_id"], vm);

    // A short command: first output and final state in one call.
    let r = c.call(
        &d,
        &t,
        "vm_exec",
        json!({"vm_id": vm, "request_id": "e1", "command": "echo out; echo err >&2; exit 3", "wait_ms": 20000}),
    );
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.body["state"], "completed");
    assert_eq!(r.body["exit_code"], 3);
    assert_eq!(r.body["stdout"], "out\n");
    assert_eq!(r.body["stderr"], "err\n");
    let job = r.body["job_id"].as_str().expect("job").to_string();

    let r = c.call(&d, &t, "vm_job_status", json!({"vm_id": vm, "job_id": job}));
    assert_eq!(
        (
            r.body["state"].clone(),
            r.body["exit_code"].clone(),
            r.body["stdout_bytes"].clone()
        ),
        (json!("completed"), json!(3), json!(4))
    );

    // Cursors: read from the middle, base64 mode.
    let r = c.call(
        &d,
        &t,
        "vm_job_output",
        json!({"vm_id": vm, "job_id": job, "cursor": {"stdout": 1}, "encoding": "base64"}),
    );
    assert_eq!(r.body["stdout_base64"], "dXQK"); // "ut\n"
    assert_eq!(r.body["next_cursor"], json!({"stdout": 4, "stderr": 4}));

    // A long job: returns running, is cancelled, and reports it.
    let r = c.call(
        &d,
        &t,
        "vm_exec",
        json!({"vm_id": vm, "request_id": "e2", "argv": ["sleep", "600"], "wait_ms": 200}),
    );
    assert_eq!(r.body["state"], "running", "{}", r.text);
    let sleeper = r.body["job_id"].as_str().expect("job").to_string();
    let r = c.call(&d, &t, "vm_status", json!({"vm_id": vm}));
    assert_eq!(r.body["jobs"]["running"], 1, "{}", r.text);
    assert_eq!(r.body["generation"], 1);
    assert_eq!(
        r.body["accel"].as_str().map(|a| a == "tcg" || a == "kvm"),
        Some(true)
    );
    let r = c.call(
        &d,
        &t,
        "vm_job_cancel",
        json!({"vm_id": vm, "job_id": sleeper}),
    );
    assert_eq!(r.body["cancelled"], true);
    let (_, last) = wait_job(&d, &t, &vm, &sleeper);
    assert_eq!(last["cancelled"], true);

    // Files.
    let r = c.call(
        &d,
        &t,
        "vm_write_file",
        json!({"vm_id": vm, "path": "dir/a.txt", "content_base64": "aGVsbG8K"}),
    );
    assert_eq!(r.body["bytes_written"], 6, "{}", r.text);
    let r = c.call(
        &d,
        &t,
        "vm_write_file",
        json!({"vm_id": vm, "path": "dir/a.txt", "content_base64": "Ynll", "append": true}),
    );
    assert_eq!(r.status, 200);
    let r = c.call(
        &d,
        &t,
        "vm_read_file",
        json!({"vm_id": vm, "path": "dir/a.txt"}),
    );
    assert_eq!(r.body["content_base64"], "aGVsbG8KYnll");
    assert_eq!(r.body["eof"], true);
    let r = c.call(
        &d,
        &t,
        "vm_read_file",
        json!({"vm_id": vm, "path": "../etc/passwd"}),
    );
    assert!(r.status >= 400 && r.status < 500, "{}", r.text);
    // The command sees what the file tools wrote.
    let r = c.call(
        &d,
        &t,
        "vm_exec",
        json!({"vm_id": vm, "request_id": "e3", "command": "cat dir/a.txt", "wait_ms": 20000}),
    );
    assert_eq!(r.body["stdout"], "hello\nbye");

    // Suspend and resume: status does not wake a paused VM, work does.
    let r = c.call(&d, &t, "vm_suspend", json!({"vm_id": vm, "mode": "pause"}));
    assert_eq!(r.body["state"], "paused", "{}", r.text);
    let r = c.call(&d, &t, "vm_status", json!({"vm_id": vm}));
    assert_eq!(r.body["state"], "paused", "{}", r.text);
    let r = c.call(
        &d,
        &t,
        "vm_exec",
        json!({"vm_id": vm, "request_id": "e4", "argv": ["cat", "dir/a.txt"], "wait_ms": 20000}),
    );
    assert_eq!(r.body["stdout"], "hello\nbye", "{}", r.text);
    let r = c.call(&d, &t, "vm_suspend", json!({"vm_id": vm}));
    assert_eq!(r.body["state"], "hibernated", "{}", r.text);
    assert_eq!(r.body["generation"], 1);
    let r = c.call(&d, &t, "vm_resume", json!({"vm_id": vm}));
    assert_eq!(
        (r.body["state"].clone(), r.body["generation"].clone()),
        (json!("running"), json!(1)),
        "{}",
        r.text
    );

    let r = c.call(&d, &t, "vm_destroy", json!({"vm_id": vm}));
    assert_eq!(r.body["destroyed"], true);
    let r = c.call(&d, &t, "vm_status", json!({"vm_id": vm}));
    assert_eq!((r.status, r.code()), (404, "not_found"));
    assert!(d.all_vms().is_empty());
}

#[test]
fn test_service_workspace_isolation_tokens_and_local_socket() {
    let d = Daemon::start("");
    let alice = d.token("alice", &[]);
    let bob = d.token("bob", &["--image", "dev"]);
    let c = Conformance::fetch(&d, &alice);
    let vm = c.ok_create(&d, &alice, "a-1");

    // Another workspace's VM does not exist for bob, whatever the tool.
    let foreign = [
        ("vm_status", json!({"vm_id": vm})),
        (
            "vm_exec",
            json!({"vm_id": vm, "request_id": "b", "command": "true"}),
        ),
        ("vm_job_status", json!({"vm_id": vm, "job_id": "1"})),
        ("vm_job_output", json!({"vm_id": vm, "job_id": "1"})),
        ("vm_job_cancel", json!({"vm_id": vm, "job_id": "1"})),
        ("vm_read_file", json!({"vm_id": vm, "path": "x"})),
        (
            "vm_write_file",
            json!({"vm_id": vm, "path": "x", "content_base64": ""}),
        ),
        ("vm_suspend", json!({"vm_id": vm})),
        ("vm_resume", json!({"vm_id": vm})),
        ("vm_destroy", json!({"vm_id": vm})),
    ];
    for (tool, args) in &foreign {
        let r = c.call(&d, &bob, tool, args.clone());
        assert_eq!(
            (r.status, r.code()),
            (404, "not_found"),
            "{tool}: {}",
            r.text
        );
    }
    assert_eq!(
        c.call(&d, &bob, "vm_list", json!({})).body["vms"],
        json!([])
    );
    // An image not granted is answered as an unknown one (no oracle of other workspaces'
    // image names), an ungranted network is 403; neither creates anything.
    let r = c.call(
        &d,
        &bob,
        "vm_create",
        json!({"request_id": "b1", "image": "minimal"}),
    );
    assert_eq!(
        (r.status, r.code()),
        (400, "invalid_argument"),
        "{}",
        r.text
    );
    let unknown = c.call(
        &d,
        &bob,
        "vm_create",
        json!({"request_id": "b0", "image": "nosuch"}),
    );
    assert_eq!(
        r.body["error"]["message"]
            .as_str()
            .map(|m| m.replace("\"minimal\"", "\"nosuch\"")),
        unknown.body["error"]["message"]
            .as_str()
            .map(str::to_string),
        "{}",
        r.text
    );
    let r = c.call(
        &d,
        &bob,
        "vm_create",
        json!({"request_id": "b2", "image": "dev", "network": "on"}),
    );
    assert_eq!((r.status, r.code()), (403, "forbidden"), "{}", r.text);
    assert_eq!(d.all_vms().len(), 1);

    // Local socket: root is local-0 and sees none of alice's VMs; another uid neither.
    let r = d.local_call("vm_status", json!({"vm_id": vm}), &[]);
    assert_eq!((r.status, r.code()), (404, "not_found"), "{}", r.text);
    let r = d.local_call_as(4242, "vm_status", json!({"vm_id": vm}));
    assert_eq!((r.status, r.code()), (404, "not_found"), "{}", r.text);
    let r = d.local_call_as(4242, "vm_list", json!({}));
    assert_eq!(r.body["vms"], json!([]), "{}", r.text);
    // Only root may name a workspace, and then acts as it.
    let r = d.local_call_as(4242, "vm_list", json!({}));
    assert_eq!(r.status, 200);
    let r = d.request(
        "GET",
        "/v1/tools/vm_list",
        &[("Authorization", &format!("Bearer {alice}"))],
        b"",
    );
    assert_eq!(
        (r.status, r.code()),
        (405, "method_not_allowed"),
        "{}",
        r.text
    );
    let out = std::process::Command::new("setpriv")
        .args([
            "--reuid=4242",
            "--regid=4242",
            "--clear-groups",
            "curl",
            "-sS",
            "-i",
        ])
        .args([
            "-H",
            "X-Warren-Workspace: alice",
            "-H",
            "Content-Type: application/json",
        ])
        .args(["-d", "{}", "--unix-socket"])
        .arg(&d.socket)
        .arg("http://warrend/v1/tools/vm_list")
        .output()
        .expect("curl");
    let r = common::daemon::parse_response(&out.stdout);
    assert_eq!((r.status, r.code()), (403, "forbidden"), "{}", r.text);
    let r = d.local_call("vm_list", json!({}), &[("X-Warren-Workspace", "alice")]);
    assert_eq!(r.body["vms"][0]["vm_id"], vm, "{}", r.text);

    // Revocation and expiry take effect on the next request. Expiry is counted in whole
    // seconds from the issue: a 5 s token is good for at least 4 s (room for a loaded host
    // between issuing it and using it) and certainly expired 6 s after it was issued.
    let short = d.token("alice", &["--ttl", "5"]);
    let issued = std::time::Instant::now();
    assert_eq!(c.call(&d, &short, "vm_list", json!({})).status, 200);
    std::thread::sleep(std::time::Duration::from_millis(6100).saturating_sub(issued.elapsed()));
    let r = c.call(&d, &short, "vm_list", json!({}));
    assert_eq!((r.status, r.code()), (401, "unauthenticated"));
    assert!(r.body["error"]["message"]
        .as_str()
        .unwrap_or("")
        .contains("expired"));
    assert_eq!(r.header("www-authenticate"), Some("Bearer"));
    let out = d.env.run(&["token", "revoke-workspace", "bob"]);
    assert!(out.status.success());
    let r = c.call(&d, &bob, "vm_list", json!({}));
    assert_eq!((r.status, r.code()), (401, "unauthenticated"));
    let r = c.call(&d, "wrn_forged", "vm_list", json!({}));
    assert_eq!(r.status, 401);
    // Token listing shows ids and workspaces, never secrets.
    let out = d.env.run(&["token", "list", "--json"]);
    let listing = String::from_utf8_lossy(&out.stdout);
    assert!(listing.contains("\"alice\"") && !listing.contains(&alice[4..]));
    // A reissue asking for another policy is refused.
    let out = d.env.run(&[
        "token",
        "issue",
        "--workspace",
        "bob",
        "--output",
        "/dev/null",
        "--max-vms",
        "9",
    ]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("error[conflict]"));

    // Alice's VM was untouched by all of this.
    let r = c.call(
        &d,
        &alice,
        "vm_exec",
        json!({"vm_id": vm, "request_id": "a-e", "command": "echo still", "wait_ms": 20000}),
    );
    assert_eq!(r.body["stdout"], "still\n", "{}", r.text);
}

#[test]
fn test_service_idempotent_create_and_exec_survive_crash() {
    let mut d = Daemon::start("");
    let t = d.token("alice", &[]);
    let c = Conformance::fetch(&d, &t);
    let vm = c.ok_create(&d, &t, "c-1");
    // Same id and arguments: the same VM, not a second one.
    assert_eq!(c.ok_create(&d, &t, "c-1"), vm);
    assert_eq!(d.all_vms().len(), 1);
    let r = c.call(
        &d,
        &t,
        "vm_create",
        json!({"request_id": "c-1", "vcpus": 2}),
    );
    assert_eq!((r.status, r.code()), (409, "conflict"), "{}", r.text);

    let exec = json!({"vm_id": vm, "request_id": "x-1", "command": "echo ran >> log; wc -l < log", "wait_ms": 20000});
    let first = c.call(&d, &t, "vm_exec", exec.clone());
    assert_eq!(first.body["stdout"], "1\n", "{}", first.text);
    let again = c.call(&d, &t, "vm_exec", exec.clone());
    assert_eq!(again.body["job_id"], first.body["job_id"]);
    assert_eq!(again.body["stdout"], "1\n", "ran twice: {}", again.text);
    let mut changed = exec.clone();
    changed["command"] = json!("echo other");
    let r = c.call(&d, &t, "vm_exec", changed);
    assert_eq!((r.status, r.code()), (409, "conflict"));

    // A crash after the guest started the job but before the receipt was completed: the
    // retry asks the guest by key and gets the job that already ran.
    d.crash();
    let db = rusqlite::Connection::open(d.env.state.path().join("warren.db")).expect("db");
    let n = db
        .execute(
            "UPDATE receipts SET state = 'pending', result = NULL WHERE request_id = 'x-1'",
            [],
        )
        .expect("update");
    assert_eq!(n, 1);
    drop(db);
    // A record left readable by all (written before records were made owner-only) is
    // narrowed when the service starts.
    // (An earlier boot's exit record, as a VM booted again keeps it.)
    let old = d.env.vm_dir(&vm).join("exit.json");
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::write(
            &old,
            r#"{"requested":true,"reason":"stopped","boot_again":false,"unix_time":0}"#,
        )
        .expect("an older record");
        std::fs::set_permissions(&old, std::fs::Permissions::from_mode(0o644))
            .expect("an older record's mode");
    }
    d.spawn();
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&old)
            .expect("record")
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(mode, 0o600, "exit.json after a restart");
    }
    std::fs::remove_file(&old).expect("remove the record");
    let retry = c.call(&d, &t, "vm_exec", exec.clone());
    assert_eq!(retry.body["job_id"], first.body["job_id"], "{}", retry.text);
    let count = c.call(
        &d,
        &t,
        "vm_exec",
        json!({"vm_id": vm, "request_id": "x-2", "command": "wc -l < log", "wait_ms": 20000}),
    );
    assert_eq!(count.body["stdout"], "1\n", "the command ran again");
    // The VM kept running across the service crash.
    assert_eq!(
        c.call(&d, &t, "vm_status", json!({"vm_id": vm})).body["state"],
        "running"
    );

    // When the VM that would know is gone, the outcome cannot be determined: refused.
    let db = rusqlite::Connection::open(d.env.state.path().join("warren.db")).expect("db");
    db.execute(
        "UPDATE receipts SET state = 'pending', result = NULL WHERE request_id = 'x-2'",
        [],
    )
    .expect("update");
    drop(db);
    let pid: i32 = std::fs::read_to_string(d.env.vm_dir(&vm).join("supervisor.lock"))
        .expect("lock")
        .trim()
        .parse()
        .expect("pid");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("kill supervisor");
    common::wait_until("VM failed", 30, || {
        // Until the kill lands, status may still reach for the dying supervisor (503).
        d.call(&t, "vm_status", json!({"vm_id": vm})).body["state"] == "failed"
    });
    let r = c.call(
        &d,
        &t,
        "vm_exec",
        json!({"vm_id": vm, "request_id": "x-2", "command": "wc -l < log", "wait_ms": 20000}),
    );
    assert_eq!((r.status, r.code()), (409, "outcome_unknown"), "{}", r.text);
}

#[test]
fn test_service_bad_requests_and_quotas_change_nothing() {
    let d = Daemon::start("[limits]\nmax_storage_gib = 1\n");
    let t = d.token("alice", &[]);
    let small = d.token("small", &["--max-memory-mib", "256"]);
    let c = Conformance::fetch(&d, &t);
    let auth = format!("Bearer {t}");
    // (tool, extra headers, body, expected status, expected code)
    type Case<'a> = (&'a str, Vec<(&'a str, &'a str)>, Vec<u8>, u16, &'a str);
    let bad: Vec<Case> = vec![
        ("vm_list", vec![], b"{".to_vec(), 400, "invalid_argument"),
        ("vm_list", vec![], b"[]".to_vec(), 400, "invalid_argument"),
        (
            "vm_list",
            vec![],
            br#"{"extra": 1}"#.to_vec(),
            400,
            "invalid_argument",
        ),
        (
            "vm_create",
            vec![],
            br#"{"request_id": 5}"#.to_vec(),
            400,
            "invalid_argument",
        ),
        (
            "vm_create",
            vec![],
            br#"{"memory_mib": 512}"#.to_vec(),
            400,
            "invalid_argument",
        ),
        (
            "vm_create",
            vec![],
            br#"{"request_id": "a b"}"#.to_vec(),
            400,
            "invalid_argument",
        ),
        (
            "vm_create",
            vec![],
            br#"{"request_id": "r", "image": "nope"}"#.to_vec(),
            400,
            "invalid_argument",
        ),
        (
            "vm_exec",
            vec![],
            br#"{"vm_id": "vm-000000000000", "request_id": "r", "command": "x"}"#.to_vec(),
            404,
            "not_found",
        ),
        (
            "vm_exec",
            vec![],
            br#"{"vm_id": "../x", "request_id": "r", "command": "x"}"#.to_vec(),
            400,
            "invalid_argument",
        ),
        ("nope", vec![], b"{}".to_vec(), 404, "unknown_tool"),
        (
            "vm_list",
            vec![("Content-Type", "text/plain")],
            b"{}".to_vec(),
            415,
            "unsupported_media_type",
        ),
        (
            "vm_list",
            vec![],
            vec![b' '; 300_000],
            413,
            "payload_too_large",
        ),
        (
            "vm_list",
            vec![("Origin", "http://evil.example")],
            b"{}".to_vec(),
            403,
            "forbidden",
        ),
        (
            "vm_list",
            vec![("Host", "evil.example")],
            b"{}".to_vec(),
            403,
            "forbidden",
        ),
    ];
    for (tool, extra, body, status, code) in bad {
        let mut h = vec![("Authorization", auth.as_str())];
        let ct = extra
            .iter()
            .find(|(k, _)| *k == "Content-Type")
            .map(|(_, v)| *v);
        h.extend(extra.iter().filter(|(k, _)| *k != "Content-Type").cloned());
        let r = d.request(
            "POST",
            &format!("/v1/tools/{tool}"),
            &[h, vec![("Content-Type", ct.unwrap_or("application/json"))]].concat(),
            &body,
        );
        assert_eq!(
            (r.status, r.code()),
            (status, code),
            "{tool} {}: {}",
            String::from_utf8_lossy(&body[..body.len().min(80)]),
            r.text
        );
        if tool != "nope" && !r.text.is_empty() {
            c.check(if tool == "nope" { "vm_list" } else { tool }, &r);
        }
    }
    // Over the workspace's memory quota, then over the host's storage: refused, nothing made.
    let r = c.call(
        &d,
        &small,
        "vm_create",
        json!({"request_id": "q1", "memory_mib": 512}),
    );
    assert_eq!((r.status, r.code()), (429, "quota_exceeded"), "{}", r.text);
    assert!(r.body["error"]["message"]
        .as_str()
        .unwrap_or("")
        .contains("workspace small"));
    let r = c.call(&d, &t, "vm_create", json!({"request_id": "q2"}));
    assert_eq!((r.status, r.code()), (429, "quota_exceeded"), "{}", r.text);
    assert!(r.body["error"]["message"]
        .as_str()
        .unwrap_or("")
        .contains("host"));
    assert!(d.all_vms().is_empty(), "a refused request created a VM");
    // A session copy's storage counts against the host's storage too: one asking more than
    // the 1 GiB host limit, and one asking nothing (under a limit it gets the 4 GiB
    // default, never an unbounded directory), are refused before anything is made.
    let src = tempfile::tempdir().expect("tempdir");
    common::git(src.path(), &["init", "-q", "-b", "main"]);
    let repo = src.path().to_str().expect("utf-8");
    for args in [
        json!({"repo": repo, "storage_mib": 2048}),
        json!({"repo": repo}),
    ] {
        let r = d.local_call("session_create", args.clone(), &[]);
        assert_eq!(
            (r.status, r.code()),
            (429, "quota_exceeded"),
            "{args}: {}",
            r.text
        );
        assert!(
            r.text
                .contains("session storage: host limit of 1024 MiB of storage"),
            "{}",
            r.text
        );
    }
    let r = d.local_call(
        "session_create",
        json!({"repo": repo, "direct": true, "storage_mib": 256}),
        &[],
    );
    assert_eq!(
        (r.status, r.code()),
        (400, "invalid_argument"),
        "{}",
        r.text
    );
    let sessions = d.env.state.path().join("sessions");
    let left: Vec<_> = std::fs::read_dir(&sessions)
        .map(|e| e.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "a refused session left {left:?}");
    // A refused create leaves its request_id free for a corrected retry.
    let r = c.call(
        &d,
        &small,
        "vm_create",
        json!({"request_id": "q1", "memory_mib": 256}),
    );
    assert_eq!(
        r.code(),
        "quota_exceeded",
        "host storage still refuses: {}",
        r.text
    );
    // Two session creates sent at once, each within the host's storage alone but not
    // together: the second is checked once the first's row reserves its storage, so at most
    // one filesystem is ever made (before, both passed the check, each made a filesystem and
    // copied the repository, and one was refused only then: a hostile review). Both end
    // refused here (the first by its VM's disk against the same 1 GiB).
    let seen = std::sync::atomic::AtomicUsize::new(0);
    let done = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        s.spawn(|| {
            while !done.load(std::sync::atomic::Ordering::SeqCst) {
                let images = std::fs::read_dir(&sessions)
                    .map(|rd| {
                        rd.flatten()
                            .filter(|e| e.file_name().to_string_lossy().ends_with(".img"))
                            .count()
                    })
                    .unwrap_or(0);
                seen.fetch_max(images, std::sync::atomic::Ordering::SeqCst);
                std::thread::sleep(std::time::Duration::from_millis(2));
            }
        });
        let creates: Vec<_> = (0..2)
            .map(|_| {
                s.spawn(|| {
                    d.local_call(
                        "session_create",
                        json!({"repo": repo, "storage_mib": 768}),
                        &[],
                    )
                })
            })
            .collect();
        for c in creates {
            let r = c.join().expect("session create");
            assert_eq!(r.code(), "quota_exceeded", "{}", r.text);
        }
        done.store(true, std::sync::atomic::Ordering::SeqCst);
    });
    let seen = seen.load(std::sync::atomic::Ordering::SeqCst);
    assert_eq!(
        seen, 1,
        "session filesystems at once (the first's seen: control)"
    );
    // The service refuses a second instance on the same state directory.
    let out = std::process::Command::new(common::WARREN)
        .args(["serve", "--config"])
        .arg(&d.config)
        .output()
        .expect("second serve");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("another warrend"));
}

#[test]
fn test_service_config_refused_before_serving() {
    let env = common::TestEnv::new();
    let cfg = env.state.path().join("bad.toml");
    let try_serve = |text: &str| {
        std::fs::write(&cfg, text).expect("write");
        let out = std::process::Command::new(common::WARREN)
            .args(["serve", "--config"])
            .arg(&cfg)
            .output()
            .expect("serve");
        assert!(!out.status.success(), "served with {text:?}");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let state = env.state.path().display().to_string();
    let id = "0".repeat(64);
    let e = try_serve(&format!(
        "state_dir = {state:?}\nlistne = 1\n[images.a]\nid = \"{id}\"\n"
    ));
    assert!(e.contains("listne"), "{e}");
    let e = try_serve(&format!(
        "state_dir = {state:?}\n[images.a]\nid = \"xyz\"\n"
    ));
    assert!(e.contains("not an image id"), "{e}");
    // A well-formed id that is not in the store fails preflight with the image named.
    let e = try_serve(&format!(
        "state_dir = {state:?}\nimage_dir = {:?}\n[http]\nlisten = \"127.0.0.1:0\"\n[images.a]\nid = \"{id}\"\n",
        env.image_dir
    ));
    assert!(
        e.contains("preflight failed") && e.contains("images.a"),
        "{e}"
    );
}

#[test]
fn test_service_concurrent_clients_and_cli_share_state() {
    let d = Daemon::start("");
    let t = d.token("alice", &[]);
    let c = Conformance::fetch(&d, &t);
    let vms = [c.ok_create(&d, &t, "v1"), c.ok_create(&d, &t, "v2")];
    let d = &d;
    let t = t.as_str();
    std::thread::scope(|s| {
        // The CLI works on the same state directory meanwhile, through the supervisors.
        let cli = s.spawn(|| {
            let id = d.env.create_vm("minimal");
            let out = d.env.run(&["vm", "exec", &id, "--", "echo", "cli"]);
            assert_eq!(String::from_utf8_lossy(&out.stdout), "cli\n");
            for _ in 0..5 {
                assert!(d.env.run(&["vm", "list", "--json"]).status.success());
            }
            id
        });
        let clients: Vec<_> = (0..8)
            .map(|k| {
                let vm = vms[k % 2].clone();
                s.spawn(move || {
                    for i in 0..50 {
                        let tag = format!("c{k}-{i}");
                        let r = d.call(
                            t,
                            "vm_exec",
                            json!({"vm_id": vm, "request_id": tag, "argv": ["echo", tag], "wait_ms": 20000}),
                        );
                        assert_eq!(r.status, 200, "{tag}: {}", r.text);
                        let mut page = r.body;
                        if page["state"] != "completed" {
                            let job = page["job_id"].as_str().expect("job").to_string();
                            let (out, last) = wait_job(d, t, &vm, &job);
                            page = last;
                            page["stdout"] = json!(out);
                        }
                        assert_eq!(page["stdout"], format!("{tag}\n"), "crossed output");
                        assert_eq!(page["exit_code"], 0);
                    }
                })
            })
            .collect();
        for h in clients {
            h.join().expect("client");
        }
        let cli_vm = cli.join().expect("cli");
        // The CLI's VM belongs to local-0, not to alice.
        let listed = d.ok(t, "vm_list", json!({}));
        let ids: Vec<&str> = listed["vms"]
            .as_array()
            .expect("vms")
            .iter()
            .filter_map(|v| v["vm_id"].as_str())
            .collect();
        assert_eq!(ids.len(), 2, "{listed}");
        assert!(!ids.contains(&cli_vm.as_str()));
        let r = d.local_call("vm_list", json!({}), &[]);
        assert_eq!(r.body["vms"][0]["vm_id"], cli_vm.as_str(), "{}", r.text);
        // Another local uid cannot reach root's (local-0's) VM either.
        let r = d.local_call_as(
            4242,
            "vm_exec",
            json!({"vm_id": cli_vm, "request_id": "x", "argv": ["true"]}),
        );
        assert_eq!((r.status, r.code()), (404, "not_found"), "{}", r.text);
    });
    // Distinct uids, all running.
    let all = d.all_vms();
    assert_eq!(all.len(), 3);
    let mut uids: Vec<u64> = all.iter().filter_map(|v| v["uid"].as_u64()).collect();
    uids.sort();
    uids.dedup();
    assert_eq!(uids.len(), 3);
    assert!(all.iter().all(|v| v["state"] == "running"), "{all:?}");
}

#[test]
fn test_service_idle_suspend_restart_keeps_suspended_vms_and_shutdown() {
    let mut d = Daemon::start("");
    let t = d.token("alice", &[]);
    let c = Conformance::fetch(&d, &t);
    let r = c.call(
        &d,
        &t,
        "vm_create",
        json!({"request_id": "idle", "idle_seconds": 3}),
    );
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.body["idle_seconds"], 3);
    let idle = r.body["vm_id"].as_str().expect("vm").to_string();
    let r = c.call(
        &d,
        &t,
        "vm_create",
        json!({"request_id": "busy", "idle_seconds": 0}),
    );
    let awake = r.body["vm_id"].as_str().expect("vm").to_string();
    let state =
        |d: &Daemon, vm: &str| d.call(&t, "vm_status", json!({"vm_id": vm})).body["state"].clone();

    // Idle: hibernated by the service; polling its status neither wakes it nor keeps it up.
    common::wait_until("idle VM hibernated", 60, || {
        state(&d, &idle) == "hibernated"
    });
    for _ in 0..3 {
        std::thread::sleep(std::time::Duration::from_millis(500));
        assert_eq!(state(&d, &idle), "hibernated");
    }
    assert_eq!(
        state(&d, &awake),
        "running",
        "idle_seconds = 0 must never suspend"
    );
    // A stale generation is refused, never silently served.
    let r = c.call(
        &d,
        &t,
        "vm_status",
        json!({"vm_id": idle, "expected_generation": 7}),
    );
    assert_eq!((r.status, r.code()), (409, "conflict"), "{}", r.text);

    // A service crash leaves each VM as it was: hibernated, paused, running.
    let r = c.call(
        &d,
        &t,
        "vm_suspend",
        json!({"vm_id": awake, "mode": "pause"}),
    );
    assert_eq!(r.body["state"], "paused", "{}", r.text);
    // What a create and a destroy that died half-way leave in `vms/` (a directory no record
    // names; one moved out of its VM's name) is removed at the next start; the VMs' own
    // directories stay. (Before, they stayed for good, disks and all.)
    let vms = d.env.state.path().join("vms");
    let leftovers = [
        vms.join("vm-0000000000fe"),
        vms.join(".destroyed-vm-0000000000ff-4294967294"),
    ];
    for p in &leftovers {
        // What a create makes before its record; a destroy's holds anything.
        std::fs::create_dir_all(p.join("run")).expect("mkdir");
        if p.ends_with(".destroyed-vm-0000000000ff-4294967294") {
            std::fs::write(p.join("disk.qcow2"), b"disk").expect("write");
        }
        let old = std::time::SystemTime::now() - std::time::Duration::from_secs(300);
        std::fs::File::open(p)
            .and_then(|f| f.set_modified(old))
            .expect("mtime");
    }
    d.crash();
    d.spawn();
    // Swept in the background once the service serves.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while leftovers.iter().any(|p| p.exists()) && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    for p in &leftovers {
        assert!(!p.exists(), "{} left", p.display());
    }
    for vm in [&idle, &awake] {
        assert!(vms.join(vm).is_dir(), "{vm}'s directory");
    }
    assert_eq!(state(&d, &idle), "hibernated");
    assert_eq!(state(&d, &awake), "paused");
    for (vm, rid) in [(&idle, "w1"), (&awake, "w2")] {
        let r = c.call(
            &d,
            &t,
            "vm_exec",
            json!({"vm_id": vm, "request_id": rid, "command": "echo woke", "wait_ms": 20000, "expected_generation": 1}),
        );
        assert_eq!(r.body["stdout"], "woke\n", "{}", r.text);
        assert_eq!(state(&d, vm), "running");
    }

    // Host shutdown: every VM hibernated, nothing lost.
    let out = d.env.run(&["shutdown", "--hibernate-all"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(state(&d, &idle), "hibernated");
    assert_eq!(state(&d, &awake), "hibernated");
    let r = c.call(&d, &t, "vm_resume", json!({"vm_id": awake}));
    assert_eq!(r.body["state"], "running", "{}", r.text);

    // Re-adoption checks identity: a record whose socket leads to another VM's supervisor
    // is marked failed with the reason, and the genuine one is re-adopted.
    let r = c.call(&d, &t, "vm_resume", json!({"vm_id": idle}));
    assert_eq!(r.body["state"], "running", "{}", r.text);
    d.crash();
    let (idle_sock, awake_sock) = (
        d.env.vm_dir(&idle).join("supervisor.sock"),
        d.env.vm_dir(&awake).join("supervisor.sock"),
    );
    let saved = idle_sock.with_extension("orig");
    std::fs::hard_link(&idle_sock, &saved).expect("link");
    let impostor = idle_sock.with_extension("tmp");
    std::fs::hard_link(&awake_sock, &impostor).expect("link");
    std::fs::rename(&impostor, &idle_sock).expect("rename");
    d.spawn();
    let r = d.call(&t, "vm_status", json!({"vm_id": idle}));
    assert_eq!(r.body["state"], "failed", "{}", r.text);
    assert!(
        r.text.contains("identity mismatch"),
        "reason names the mismatch: {}",
        r.text
    );
    assert_eq!(state(&d, &awake), "running");
    std::fs::rename(&saved, &idle_sock).expect("restore");
}

/// Sessions through the service's local socket: `warren --socket S session ...` creates,
/// lists, reports, exports and deletes a session of the caller; a repository the caller's uid
/// cannot read is refused (checked as that uid), as is any host path from a token holder
/// outside the operator's host roots.
#[test]
fn test_service_sessions_over_local_socket_checked_as_caller() {
    let d = Daemon::start("");
    let dir = tempfile::tempdir().expect("tempdir");
    let repo = dir.path().canonicalize().expect("canonical");
    std::fs::set_permissions(&repo, std::os::unix::fs::PermissionsExt::from_mode(0o700))
        .expect("chmod");
    let git = |args: &[&str]| common::git(&repo, args);
    git(&["init", "-q", "-b", "main"]);
    std::fs::write(repo.join("a.txt"), "committed\n").expect("write");
    git(&["add", "-A"]);
    git(&["commit", "-qm", "initial"]);
    std::fs::write(repo.join("untracked.txt"), "from the host\n").expect("write");
    let warren = |pre: &[&str], args: &[&str]| {
        let mut c = std::process::Command::new(pre.first().copied().unwrap_or(common::WARREN));
        if !pre.is_empty() {
            c.args(&pre[1..]).arg(common::WARREN);
        }
        c.arg("--socket").arg(&d.socket).args(args);
        c.output().expect("warren")
    };
    let repo_arg = repo.to_str().expect("utf-8");

    // Another local uid cannot name root's private repository.
    let out = warren(
        &["setpriv", "--reuid=4242", "--regid=4242", "--clear-groups"],
        &["session", "create", "--repo", repo_arg],
    );
    assert_eq!(out.status.code(), Some(125));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("error[forbidden]"), "{err}");
    // A token holder: no host roots configured, so no host path at all.
    let token = d.token("tok-sessions", &[]);
    let r = d.call(&token, "session_create", json!({"repo": repo_arg}));
    assert_eq!((r.status, r.code()), (403, "forbidden"), "{}", r.text);
    // Bad input: clean codes, nothing created.
    for (tool, args, want) in [
        (
            "session_create",
            json!({"repo": repo_arg, "bogus": 1}),
            (400, "invalid_argument"),
        ),
        (
            "session_create",
            json!({"repo": "relative/dir"}),
            (400, "invalid_argument"),
        ),
        (
            "session_create",
            json!({"repo": repo_arg, "name": "bad name!"}),
            (400, "invalid_argument"),
        ),
        (
            "session_create",
            json!({"repo": repo_arg, "image": "nope"}),
            (400, "invalid_argument"),
        ),
        (
            "session_status",
            json!({"session": "nope"}),
            (404, "not_found"),
        ),
        ("session_delete", json!({}), (400, "invalid_argument")),
    ] {
        let r = d.local_call(tool, args.clone(), &[]);
        assert_eq!((r.status, r.code()), want, "{tool} {args}: {}", r.text);
    }
    assert!(d.all_vms().is_empty(), "a refused session left a VM");
    let r = d.local_call("session_list", json!({}), &[]);
    assert_eq!(r.body["sessions"], json!([]), "{}", r.text);

    // Root, through the socket.
    let out = warren(
        &[],
        &[
            "session", "create", "--repo", repo_arg, "--image", "dev", "--name", "svc", "--json",
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let s: Value = serde_json::from_slice(&out.stdout).expect("session JSON");
    let vm = s["vm_id"].as_str().expect("vm_id").to_string();
    assert_eq!(s["name"], "svc");
    assert_eq!(s["source"], repo_arg);
    let out = warren(&[], &["session", "list", "--json"]);
    let list: Value = serde_json::from_slice(&out.stdout).expect("list JSON");
    assert_eq!(list.as_array().map(Vec::len), Some(1), "{list}");
    // The guest works on the copy (untracked file included) and commits.
    let r = d.local_call(
        "vm_exec",
        json!({"request_id": "s1", "vm_id": vm, "wait_ms": 30000, "command":
            "cat untracked.txt && git add -A && git -c user.name=G -c user.email=g@example.com commit -qm guest && echo done"}),
        &[],
    );
    assert_eq!(r.body["stdout"], "from the host\ndone\n", "{}", r.text);
    // `vm cp` through the service stays out of the directories its VMs write (it asks the
    // service, which knows them for every workspace): the session's copy is one. Control:
    // a directory outside it copies.
    let copy_dir = s["workspace_dir"].as_str().expect("workspace_dir");
    let from = format!("{vm}:/etc/hostname");
    let out = warren(&[], &["vm", "cp", &from, &format!("{copy_dir}/into")]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("which VM of the service can write"), "{err}");
    let outside = tempfile::tempdir().expect("outside");
    let out = warren(
        &[],
        &["vm", "cp", &from, outside.path().to_str().expect("utf-8")],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(outside.path().join("hostname").is_file());
    let out = warren(&[], &["session", "status", "svc", "--json"]);
    let st: Value = serde_json::from_slice(&out.stdout).expect("status JSON");
    assert_eq!(st["unexported"].as_array().map(Vec::len), Some(1), "{st}");
    assert_eq!(st["generation"], 1, "{st}");
    // Delete refuses with unexported work; export, then delete.
    let out = warren(&[], &["session", "delete", "svc"]);
    assert_eq!(out.status.code(), Some(125));
    assert!(String::from_utf8_lossy(&out.stderr).contains("error[conflict]"));
    let out = warren(
        &[],
        &["session", "export", "svc", "--branch", "from-service"],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        git(&["log", "--format=%s", "-1", "from-service"]),
        "guest\n"
    );
    let out = warren(&[], &["session", "delete", "svc"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(d.all_vms().is_empty(), "the session's VM is gone");
}

impl Conformance {
    fn ok_create(&self, d: &Daemon, token: &str, rid: &str) -> String {
        let r = self.call(d, token, "vm_create", json!({"request_id": rid}));
        assert_eq!(r.status, 200, "{}", r.text);
        r.body["vm_id"].as_str().expect("vm_id").to_string()
    }
}
