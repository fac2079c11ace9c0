//! Instant workspaces on real VMs (`docs/instant.md`): template clones are isolated from each
//! other and from the template (disk, memory, random output, identity, channel secret) and
//! leave the template's secret for good; a template made on other artifacts is never used;
//! pool hand-outs under 8 concurrent creates are all distinct; a fork of a VM with a running
//! counter yields copies whose counters continue independently; a fork's copies map the
//! parent's saved RAM copy-on-write and hibernate and resume with their own memory.

mod common;

use std::path::PathBuf;

use common::{ok, TestEnv};

/// A VM of `env` (several share one state directory; the environment destroys what is left).
struct Vm<'a> {
    env: &'a TestEnv,
    id: String,
}

impl Vm<'_> {
    fn sh(&self, script: &str) -> std::process::Output {
        self.env
            .run(&["vm", "exec", &self.id, "--", "sh", "-c", script])
    }

    fn warren(&self, args: &[&str]) -> std::process::Output {
        self.env.run(args)
    }

    fn state(&self) -> String {
        self.env
            .record(&self.id)
            .map(|r| r["state"].as_str().unwrap_or("").to_string())
            .unwrap_or_else(|| "gone".into())
    }

    fn destroy(self) {
        ok(self.env.run(&["vm", "destroy", &self.id]), "destroy");
        assert!(
            !self.env.vm_dir(&self.id).exists(),
            "VM directory left behind"
        );
    }
}

fn create_template_vm(env: &TestEnv) -> Vm<'_> {
    let id = env.create_vm_with("minimal", &["--template"]);
    Vm { env, id }
}

fn secret(env: &TestEnv, id: &str) -> Vec<u8> {
    std::fs::read(env.vm_dir(id).join("secret")).expect("secret")
}

/// The one template directory of `env`.
fn template_dir(env: &TestEnv) -> PathBuf {
    let out = ok(env.run(&["vm", "templates", "--json"]), "vm templates");
    let list: serde_json::Value = serde_json::from_str(&out).expect("json");
    let list = list.as_array().expect("array");
    assert_eq!(list.len(), 1, "one template: {out}");
    assert_eq!(list[0]["valid"], true, "{out}");
    env.state
        .path()
        .join("templates")
        .join(list[0]["name"].as_str().expect("name"))
}

fn line(vm: &Vm<'_>, script: &str) -> String {
    ok(vm.sh(script), script).trim().to_string()
}

#[test]
fn test_template_clones_isolated_rekeyed_and_never_on_other_artifacts() {
    common::ensure_image("minimal");
    let env = TestEnv::new();
    let a = create_template_vm(&env);
    let b = create_template_vm(&env);
    let tpl = template_dir(&env);
    // The template's files are nobody's but root's and the clones' group.
    for (f, mode) in [
        ("ram", 0o440),
        ("disk.qcow2", 0o440),
        ("state", 0o400),
        ("secret", 0o400),
    ] {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata(tpl.join(f)).expect("template file");
        assert_eq!(m.mode() & 0o777, mode, "{f}");
    }
    let tsecret = std::fs::read(tpl.join("secret")).expect("template secret");

    // Channel secrets: each clone has its own, neither is the template's.
    let (sa, sb) = (secret(&env, &a.id), secret(&env, &b.id));
    assert_eq!(sa.len(), 32);
    assert_ne!(sa, sb);
    assert_ne!(sa, tsecret);
    assert_ne!(sb, tsecret);

    // Identity: hostname is the VM id, machine ids differ, the clock is the host's.
    for vm in [&a, &b] {
        assert_eq!(line(vm, "hostname"), vm.id);
        assert_eq!(line(vm, "cat /etc/hostname"), vm.id);
        let host_now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
            .as_secs() as i64;
        let guest_now: i64 = line(vm, "date +%s").parse().expect("date");
        assert!(
            (guest_now - host_now).abs() < 120,
            "guest clock {guest_now} vs {host_now}"
        );
    }
    let (ma, mb) = (
        line(&a, "cat /etc/machine-id"),
        line(&b, "cat /etc/machine-id"),
    );
    assert_eq!(ma.len(), 32, "{ma}");
    assert_ne!(ma, mb);
    // Both files are the in-memory ones bound over the disk's (the rekey never writes the
    // root disk on the clone's start), and the guest user cannot change them.
    for f in ["/etc/hostname", "/etc/machine-id"] {
        assert_eq!(
            line(&a, &format!("grep -c ' {f} ' /proc/self/mountinfo")),
            "1",
            "{f} is not bound"
        );
        assert_eq!(
            line(
                &a,
                &format!("echo x 2>/dev/null > {f} && echo changed || echo refused")
            ),
            "refused",
            "{f}"
        );
    }

    // Random output differs (the CRNG was reseeded with host entropy in each).
    let rng = "head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n'";
    assert_ne!(line(&a, rng), line(&b, rng));

    // Disk and memory: what one clone writes the other never sees.
    line(
        &a,
        "echo a > /workspace/disk-a && echo a > /tmp/mem-a && sync",
    );
    assert_eq!(
        line(&b, "ls /workspace/disk-a /tmp/mem-a 2>/dev/null | wc -l"),
        "0"
    );
    line(&b, "echo b > /workspace/disk-b");
    assert_eq!(line(&a, "cat /workspace/disk-a /tmp/mem-a"), "a\na");
    assert_eq!(line(&a, "ls /workspace/disk-b 2>/dev/null | wc -l"), "0");

    // A clone hibernates and resumes on its own secret, into its own memory.
    ok(
        a.warren(&["vm", "suspend", &a.id, "--force"]),
        "hibernate clone",
    );
    assert_eq!(a.state(), "hibernated");
    ok(a.warren(&["vm", "resume", &a.id]), "resume clone");
    assert_eq!(line(&a, "cat /tmp/mem-a"), "a");
    assert_eq!(secret(&env, &a.id), sa);

    // The template's secret no longer opens a clone: with it in place of the clone's own,
    // the restored guest refuses the session (and the fresh boot behind it, whose
    // initramfs carries the clone's own secret, refuses it too).
    ok(
        b.warren(&["vm", "suspend", &b.id, "--force"]),
        "hibernate clone b",
    );
    std::fs::write(env.vm_dir(&b.id).join("secret"), &tsecret).expect("plant old secret");
    let out = b.warren(&["vm", "resume", &b.id]);
    assert!(
        !out.status.success(),
        "a resume with the template's secret must fail"
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("proof"), "{err}");
    b.destroy();

    // A template made on another QEMU (its recorded digest differs) is retired, never used:
    // the next create builds a new one.
    let rec_path = tpl.join("template.json");
    let mut rec: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&rec_path).expect("record")).expect("json");
    rec["artifacts"]["qemu"]["sha256"] = serde_json::Value::String("0".repeat(64));
    std::fs::write(&rec_path, serde_json::to_vec(&rec).expect("json")).expect("tamper");
    let c = create_template_vm(&env);
    let fresh = template_dir(&env);
    assert_ne!(fresh, tpl, "a new template was built");
    assert_ne!(
        std::fs::read(fresh.join("secret")).expect("new template secret"),
        tsecret
    );
    assert!(
        tpl.exists(),
        "the stale template stays while a clone's disk backs onto it"
    );
    assert_eq!(line(&c, "echo ok"), "ok");
    assert_eq!(line(&a, "cat /workspace/disk-a"), "a");
    a.destroy();
    // Unused now: marked, kept through its grace (a create may have just found it), then
    // removed by the next collection (`warren-core::vm::template_gc`).
    let _ = template_dir(&env);
    let mark = tpl.join("retired");
    assert!(tpl.exists() && mark.exists(), "marked, within its grace");
    std::fs::File::options()
        .write(true)
        .open(&mark)
        .and_then(|f| {
            f.set_modified(std::time::SystemTime::now() - std::time::Duration::from_secs(61))
        })
        .expect("age the mark");
    let _ = template_dir(&env);
    assert!(!tpl.exists(), "the stale template goes once no VM uses it");
    c.destroy();
}

#[test]
fn test_pool_handouts_distinct_and_fork_counters_independent() {
    common::ensure_image("minimal");
    let env = TestEnv::new();
    let image = common::pinned_image("minimal");
    // 8 pool VMs, then 8 concurrent creates of their shape: 8 distinct hand-outs.
    ok(
        env.run(&["vm", "pool", "--image", &image, "--size", "8"]),
        "fill the pool",
    );
    let listed: serde_json::Value =
        serde_json::from_str(&ok(env.run(&["vm", "list", "--json"]), "list")).expect("json");
    let mut pool_ids: Vec<String> = listed
        .as_array()
        .expect("array")
        .iter()
        .filter(|r| r["workspace"] == "warren-pool" && r["state"] == "running")
        .map(|r| r["id"].as_str().expect("id").to_string())
        .collect();
    pool_ids.sort();
    assert_eq!(pool_ids.len(), 8, "{listed}");
    let creates: Vec<_> = (0..8)
        .map(|_| {
            env.cmd()
                .args(["vm", "create", "--image", &image, "--template", "--json"])
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .expect("spawn create")
        })
        .collect();
    let mut ids = Vec::new();
    for c in creates {
        let out = c.wait_with_output().expect("create");
        let v: serde_json::Value = serde_json::from_str(&ok(out, "create")).expect("json");
        ids.push(v["vm_id"].as_str().expect("id").to_string());
    }
    let mut distinct = ids.clone();
    distinct.sort();
    distinct.dedup();
    assert_eq!(distinct.len(), 8, "{ids:?}");
    let status: serde_json::Value =
        serde_json::from_str(&ok(env.run(&["vm", "pool"]), "pool status")).expect("json");
    assert!(
        status
            .as_array()
            .expect("array")
            .iter()
            .all(|p| p["ready"] == 0),
        "all 8 handed out: {status}"
    );
    let mut handed = ids.clone();
    handed.sort();
    assert_eq!(handed, pool_ids, "the creates took the pool's VMs");
    let list: serde_json::Value =
        serde_json::from_str(&ok(env.run(&["vm", "list", "--json"]), "list")).expect("json");
    for id in &ids {
        let r = list
            .as_array()
            .expect("array")
            .iter()
            .find(|r| r["id"] == id.as_str())
            .expect("listed");
        assert_ne!(r["workspace"], "warren-pool", "{r}");
    }
    let vms: Vec<Vm<'_>> = ids.into_iter().map(|id| Vm { env: &env, id }).collect();
    let mut vms = vms.into_iter();
    let parent = vms.next().expect("one");
    for vm in vms {
        vm.destroy();
    }

    // A fork of a VM with a running counter: both copies continue counting on their own.
    let started = ok(
        parent.warren(&[
            "vm",
            "exec",
            &parent.id,
            "--detach",
            "--",
            "sh",
            "-c",
            "i=0; while :; do i=$((i+1)); echo $i > /tmp/counter.new; mv /tmp/counter.new /tmp/counter; sleep 0.1; done",
        ]),
        "start the counter",
    );
    let job = serde_json::from_str::<serde_json::Value>(&started).expect("json")["job_id"]
        .as_u64()
        .expect("job id")
        .to_string();
    common::wait_until("counter running", 60, || {
        line(&parent, "cat /tmp/counter 2>/dev/null || echo 0")
            .parse::<u64>()
            .unwrap_or(0)
            > 3
    });
    let out = ok(
        parent.warren(&["vm", "fork", &parent.id, "--count", "2", "--json"]),
        "fork",
    );
    let v: serde_json::Value = serde_json::from_str(&out).expect("json");
    let copies: Vec<Vm<'_>> = v["vm_ids"]
        .as_array()
        .expect("ids")
        .iter()
        .map(|i| Vm {
            env: &env,
            id: i.as_str().expect("id").to_string(),
        })
        .collect();
    assert_eq!(copies.len(), 2);
    let read = |vm: &Vm<'_>| -> u64 { line(vm, "cat /tmp/counter").parse().expect("counter") };
    let at_fork: Vec<u64> = copies.iter().map(read).collect();
    for (vm, start) in copies.iter().zip(&at_fork) {
        assert!(*start > 3, "the copy has the parent's counter: {start}");
        common::wait_until("copy's counter moves on", 60, || read(vm) > start + 5);
        assert_eq!(line(vm, "hostname"), vm.id);
        assert_ne!(secret(&env, &vm.id), secret(&env, &parent.id));
    }
    assert_ne!(secret(&env, &copies[0].id), secret(&env, &copies[1].id));
    // Independent: the copies have the parent's job (same id); cancelling it in one copy
    // stops only that copy's counter.
    ok(
        copies[0].warren(&["vm", "cancel", &copies[0].id, &job]),
        "cancel in one copy",
    );
    let stopped = read(&copies[0]);
    let other = read(&copies[1]);
    common::wait_until("the other copy counts on", 60, || {
        read(&copies[1]) > other + 3
    });
    assert_eq!(
        read(&copies[0]),
        stopped,
        "the cancelled copy's counter stopped"
    );
    line(&copies[0], "echo only-here > /tmp/mark");
    assert_eq!(line(&copies[1], "ls /tmp/mark 2>/dev/null | wc -l"), "0");
    assert_eq!(line(&parent, "ls /tmp/mark 2>/dev/null | wc -l"), "0");
    let p0 = read(&parent);
    common::wait_until("parent's counter moves on", 60, || read(&parent) > p0 + 3);
    let _ = parent.warren(&["vm", "cancel", &parent.id, &job]);
    for c in copies {
        c.destroy();
    }
    parent.destroy();
}

/// A fork of a cold-booted VM (its RAM the machine's own block): the copies map the parent's
/// saved pages copy-on-write instead of loading them, see the parent's memory, keep their
/// writes to themselves, and a copy hibernates and resumes with its own memory (its RAM block
/// keeps the parent's name; a copy that took another lost its memory on its first resume).
#[test]
fn test_fork_of_cold_vm_maps_saved_ram_and_copy_hibernates_with_its_memory() {
    common::ensure_image("minimal");
    let env = TestEnv::new();
    let parent = Vm {
        env: &env,
        id: env.create_vm("minimal"),
    };
    // /dev/shm is memory only: what is there survives only with the VM's memory.
    line(&parent, "echo from-parent > /dev/shm/mark");
    let out = ok(
        parent.warren(&["vm", "fork", &parent.id, "--count", "2", "--json"]),
        "fork",
    );
    let v: serde_json::Value = serde_json::from_str(&out).expect("json");
    let copies: Vec<Vm<'_>> = v["vm_ids"]
        .as_array()
        .expect("ids")
        .iter()
        .map(|i| Vm {
            env: &env,
            id: i.as_str().expect("id").to_string(),
        })
        .collect();
    assert_eq!(copies.len(), 2);
    for c in &copies {
        let pids = common::pids_matching(&format!("process=warren-{}", c.id));
        assert_eq!(pids.len(), 1, "one VMM for {}", c.id);
        let cmd = std::fs::read(format!("/proc/{}/cmdline", pids[0])).expect("cmdline");
        let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
        assert!(
            cmd.contains("id=microvm.ram,") && cmd.contains(",share=off,readonly=on,rom=off"),
            "the copy maps the saved RAM privately: {cmd}"
        );
        assert!(
            cmd.contains(",offset=1048576,"),
            "at the pages region: {cmd}"
        );
        assert!(
            !cmd.contains("/forks/"),
            "the saved state's path is on no command line: {cmd}"
        );
        assert_eq!(line(c, "cat /dev/shm/mark"), "from-parent");
    }
    line(&copies[0], "echo from-copy > /dev/shm/mark");
    assert_eq!(line(&copies[1], "cat /dev/shm/mark"), "from-parent");
    assert_eq!(line(&parent, "cat /dev/shm/mark"), "from-parent");
    // The copy hibernates and resumes into its own memory, not a fresh boot.
    let c0 = &copies[0];
    ok(
        c0.warren(&["vm", "suspend", &c0.id, "--force"]),
        "hibernate copy",
    );
    assert_eq!(c0.state(), "hibernated");
    ok(c0.warren(&["vm", "resume", &c0.id]), "resume copy");
    assert_eq!(line(c0, "cat /dev/shm/mark"), "from-copy");
    let rec = env.record(&c0.id).expect("record");
    assert_eq!(rec["generation"], 1, "no fresh boot: {rec}");
    // A copy settled by an earlier Warren has `mem` in its config for this block: its
    // checkpoint's own block name wins, and it resumes with its memory all the same.
    let cfg_path = env.vm_dir(&c0.id).join("supervisor.json");
    let cfg = std::fs::read_to_string(&cfg_path).expect("config");
    assert!(cfg.contains("\"named_ram\": false"), "{cfg}");
    std::fs::write(
        &cfg_path,
        cfg.replace("\"named_ram\": false", "\"named_ram\": true"),
    )
    .expect("old config");
    ok(
        c0.warren(&["vm", "suspend", &c0.id, "--force"]),
        "hibernate again",
    );
    ok(c0.warren(&["vm", "resume", &c0.id]), "resume again");
    assert_eq!(line(c0, "cat /dev/shm/mark"), "from-copy");
    let rec = env.record(&c0.id).expect("record");
    assert_eq!(rec["generation"], 1, "no fresh boot: {rec}");
    for c in copies {
        c.destroy();
    }
    parent.destroy();
}

/// Through the service: a configured warm pool fills in the background and is reported by
/// `pool_status`; `vm_create` of its shape hands out a pool VM; `vm_fork` makes copies,
/// idempotently under its request id, and only of the caller's own VMs.
#[test]
fn test_service_pool_status_handout_and_vm_fork() {
    use common::daemon::Daemon;
    use serde_json::json;
    let d = Daemon::start_minimal("[images.pooled]\nid = \"{minimal}\"\npool = 2\n");
    let t = d.token("alice", &[]);
    common::wait_until("the warm pool is ready", 600, || {
        d.ok(&t, "pool_status", json!({}))["pools"][0]["ready"] == 2
    });
    let pools = d.ok(&t, "pool_status", json!({}));
    assert_eq!(pools["pools"][0]["image"], "pooled", "{pools}");
    assert_eq!(pools["pools"][0]["size"], 2, "{pools}");

    let vm = d.ok(
        &t,
        "vm_create",
        json!({"request_id": "c1", "image": "pooled"}),
    );
    let id = vm["vm_id"].as_str().expect("vm_id").to_string();
    let r = d.ok(
        &t,
        "vm_exec",
        json!({"vm_id": id, "request_id": "e1", "command": "hostname", "wait_ms": 30000}),
    );
    assert_eq!(r["stdout"], format!("{id}\n"), "{r}");

    let fork = json!({"request_id": "f1", "vm_id": id, "count": 2});
    // A copy being made cannot be destroyed (before, a destroy during the parent's save
    // removed its record alone and the copy then started with none, out of every call's
    // reach): on a throwaway fork of one copy, a destroy of the copy listed `creating` is
    // `busy`, or, landing once the fork ended (the engine retries a held lock for ~200 ms),
    // destroys the copy for good: no VMM of it runs once the fork answered. The fork is
    // played again (up to three) only when it ended before a listing saw its copy.
    let mut seen = false;
    for attempt in 0..3 {
        let throwaway = json!({"request_id": format!("t{attempt}"), "vm_id": id, "count": 1});
        let (answer, made) = std::thread::scope(|s| {
            let forking = s.spawn(|| d.ok(&t, "vm_fork", throwaway.clone()));
            let mut answer = None;
            while answer.is_none() && !forking.is_finished() {
                let listed = d.ok(&t, "vm_list", json!({}));
                let copy = listed["vms"].as_array().and_then(|v| {
                    v.iter()
                        .find(|vm| vm["state"] == "creating" && vm["vm_id"] != id.as_str())
                        .and_then(|vm| vm["vm_id"].as_str())
                        .map(str::to_string)
                });
                if let Some(copy) = copy {
                    let r = d.call(&t, "vm_destroy", json!({"vm_id": copy}));
                    answer = Some((copy, r));
                }
            }
            (answer, forking.join().expect("fork thread"))
        });
        if let Some((copy, r)) = answer {
            eprintln!("destroy of {copy} during its fork: {}", r.text);
            seen = true;
            if r.code() != "busy" {
                assert_eq!(r.status, 200, "{}", r.text);
                assert!(
                    common::pids_matching(&format!("process=warren-{copy}")).is_empty(),
                    "the copy destroyed while its fork ran was started anyway: {made}"
                );
            }
        }
        for v in made["vms"].as_array().into_iter().flatten() {
            d.call(&t, "vm_destroy", json!({"vm_id": v["vm_id"]}));
        }
        if seen {
            break;
        }
    }
    assert!(seen, "no listing saw a copy being made, in three forks");
    let f = d.ok(&t, "vm_fork", fork.clone());
    let copies: Vec<String> = f["vms"]
        .as_array()
        .expect("vms")
        .iter()
        .map(|v| v["vm_id"].as_str().expect("id").to_string())
        .collect();
    assert_eq!(copies.len(), 2, "{f}");
    assert_ne!(copies[0], copies[1]);
    assert!(!copies.contains(&id));
    assert_eq!(
        d.ok(&t, "vm_fork", fork),
        f,
        "a retry answers the same copies"
    );
    let r = d.call(
        &t,
        "vm_fork",
        json!({"request_id": "f1", "vm_id": id, "count": 1}),
    );
    assert_eq!(r.code(), "conflict", "{}", r.text);
    for c in &copies {
        let r = d.ok(
            &t,
            "vm_exec",
            json!({"vm_id": c, "request_id": format!("e-{c}"), "command": "hostname", "wait_ms": 30000}),
        );
        assert_eq!(r["stdout"], format!("{c}\n"), "{r}");
    }
    let bob = d.token("bob", &[]);
    let r = d.call(
        &bob,
        "vm_fork",
        json!({"request_id": "f2", "vm_id": id, "count": 1}),
    );
    assert_eq!(r.code(), "not_found", "{}", r.text);
    let r = d.call(
        &t,
        "vm_fork",
        json!({"request_id": "f3", "vm_id": id, "count": 17}),
    );
    assert_eq!(r.code(), "invalid_argument", "{}", r.text);
    let listed = d.ok(&t, "vm_list", json!({}));
    assert_eq!(listed["vms"].as_array().expect("vms").len(), 3, "{listed}");
}

/// The template files of `state` (pointers and directories), by name.
fn template_files(state: &std::path::Path) -> Vec<String> {
    match std::fs::read_dir(state.join("templates")) {
        Ok(rd) => rd
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".current") || n.starts_with("t-"))
            .collect(),
        Err(_) => vec![],
    }
}

/// A `vm_create` its workspace's limits refuse has no template built for it: nothing boots
/// and no template is kept (before, the template of the shape was built first, a VM of the
/// shape counted in no workspace, and only then was the create refused, so a workspace past
/// its limits could keep having templates built, each booting a VM under the host's limits
/// only and retiring another shape's template past `max_templates`). Control: within its
/// limits the same create builds the template and clones it, a create sent while that
/// builds, which the first's reservation leaves no room for, is refused without a build, and
/// a destroy of the VM being created is refused `busy`.
#[test]
fn test_service_no_template_is_built_for_a_create_its_limits_refuse() {
    use common::daemon::Daemon;
    use serde_json::json;
    let d = Daemon::start_minimal("[images.tpl]\nid = \"{minimal}\"\ntemplate = true\n");
    let t = d.token("small", &["--max-memory-mib", "512"]);
    let state = d.env.state.path().to_path_buf();
    let r = d.call(
        &t,
        "vm_create",
        json!({"request_id": "big", "image": "tpl", "memory_mib": 1024}),
    );
    assert_eq!(r.code(), "quota_exceeded", "{}", r.text);
    assert_eq!(
        template_files(&state),
        Vec::<String>::new(),
        "no template for a refused create"
    );
    assert!(d.all_vms().is_empty(), "nothing booted: {:?}", d.all_vms());

    // Control: within the limits, the template is built and the VM is its clone. While it
    // is built, the VM is reserved (listed `creating`): a create of another shape sent then
    // is refused at once and has no template built (before, each of the requests sent at
    // once was checked against limits nothing had reserved yet, and had its shape built).
    let fits = json!({"request_id": "fits", "image": "tpl", "memory_mib": 512});
    let cut_off = d.send_only(&t, "vm_create", fits.clone());
    let mut creating = String::new();
    common::wait_until("the first create is reserved", 120, || {
        let listed = d.ok(&t, "vm_list", json!({}));
        let found = listed["vms"].as_array().and_then(|v| {
            v.iter()
                .find(|vm| vm["state"] == "creating")
                .and_then(|vm| vm["vm_id"].as_str())
        });
        creating = found.unwrap_or_default().to_string();
        found.is_some()
    });
    // The client hangs up during the build. The create goes on to its end: before, it was
    // cancelled with the connection, leaving the template's build VM running in a workspace
    // no call reaches and the caller's record `creating` for good (its retry answered
    // `outcome_unknown`).
    drop(cut_off);
    let r = d.call(
        &t,
        "vm_create",
        json!({"request_id": "other-shape", "image": "tpl", "memory_mib": 256}),
    );
    assert_eq!(r.code(), "quota_exceeded", "{}", r.text);
    // A destroy while it is created is refused: before, it removed the record alone and
    // the VM then started with none (counted nowhere, out of every call's reach).
    let r = d.call(&t, "vm_destroy", json!({"vm_id": creating}));
    assert_eq!(r.code(), "busy", "{}", r.text);
    // The retry answers `busy` while the cut-off call runs, then its outcome.
    let mut vm = serde_json::Value::Null;
    common::wait_until("the cut-off create's outcome", 300, || {
        let r = d.call(&t, "vm_create", fits.clone());
        if r.code() == "busy" {
            return false;
        }
        assert_eq!(r.status, 200, "the retry of a cut-off create: {}", r.text);
        vm = r.body;
        true
    });
    assert_eq!(vm["vm_id"], creating.as_str(), "{vm}");
    assert_eq!(vm["state"], "running", "{vm}");
    let left: Vec<serde_json::Value> = d
        .all_vms()
        .into_iter()
        .filter(|v| v["workspace"] != "small")
        .collect();
    assert!(left.is_empty(), "no build VM is left: {left:?}");
    let id = vm["vm_id"].as_str().expect("vm_id").to_string();
    let files = template_files(&state);
    assert_eq!(
        files.iter().filter(|n| n.ends_with(".current")).count(),
        1,
        "the template of the first create's shape alone: {files:?}"
    );
    assert!(
        d.env.vm_dir(&id).join("template").exists(),
        "a clone records its template"
    );
    d.ok(&t, "vm_destroy", json!({"vm_id": id}));
}
