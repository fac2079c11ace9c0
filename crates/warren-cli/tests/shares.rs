//! Host directories shared over virtio-fs on a real VM: edits flow both ways at once, the
//! guest user acts as the owner, read-only is enforced by the host, nothing else of the host
//! shows, and a hibernated VM with a share resumes after host-side changes (deletions too).

mod common;

use std::os::unix::fs::MetadataExt;

use common::{ok, TestEnv, TestVm};

#[test]
fn test_shares_edit_both_ways_ownership_readonly_and_hibernate() {
    common::ensure_image("minimal");
    let rw = tempfile::tempdir().expect("tempdir");
    let ro = tempfile::tempdir().expect("tempdir");
    std::fs::write(rw.path().join("host.txt"), "from host\n").expect("write");
    std::fs::write(ro.path().join("readme"), "read only\n").expect("write");
    let env = TestEnv::new();
    let rw_arg = format!("{}:/workspace", rw.path().display());
    let ro_arg = format!("{}:/data/ref:ro", ro.path().display());
    let id = env.create_vm_with("minimal", &["--mount", &rw_arg, "--mount", &ro_arg]);
    let vm = TestVm::adopt(env, id);
    let owner = nix::unistd::getuid().as_raw();

    // Host files appear as the guest user's and are writable by it.
    let r = vm.sh(
        "set -e; stat -c '%u %n' /workspace/host.txt; echo more >> /workspace/host.txt; \
         echo guest > /workspace/made-in-guest; mkdir -p /workspace/d/e; \
         grep -c virtiofs /proc/mounts",
    );
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(
        r.stdout.starts_with("1000 /workspace/host.txt\n"),
        "{}",
        r.stdout
    );
    assert_eq!(
        r.stdout.lines().last(),
        Some("2"),
        "exactly the two shares: {}",
        r.stdout
    );
    // ...and the guest's edits are on the host as soon as the exec returned, owned by the owner.
    assert_eq!(
        std::fs::read_to_string(rw.path().join("host.txt")).expect("read"),
        "from host\nmore\n"
    );
    let made = rw.path().join("made-in-guest");
    assert_eq!(std::fs::read_to_string(&made).expect("read"), "guest\n");
    assert_eq!(std::fs::metadata(&made).expect("stat").uid(), owner);
    assert_eq!(
        std::fs::metadata(rw.path().join("d/e"))
            .expect("stat")
            .uid(),
        owner
    );

    // Host edits are visible to the next guest read.
    std::fs::write(rw.path().join("host.txt"), "rewritten on host\n").expect("write");
    let r = vm.sh("cat /workspace/host.txt");
    assert_eq!(r.stdout, "rewritten on host\n");

    // Read-only share: readable, every write refused, host unchanged.
    let r = vm.sh("cat /data/ref/readme; echo x > /data/ref/new 2>&1; echo rc=$?; touch /data/ref/readme; echo rc=$?");
    assert!(r.stdout.starts_with("read only\n"), "{}", r.stdout);
    assert_eq!(r.stdout.matches("rc=").count(), 2, "{}", r.stdout);
    assert!(!r.stdout.contains("rc=0"), "{}{}", r.stdout, r.stderr);
    assert!(r.stderr.contains("Read-only file system"), "{}", r.stderr);
    assert_eq!(std::fs::read_dir(ro.path()).expect("ls").count(), 1);

    // No host path is visible: the shares' host names appear nowhere in the guest.
    let r = vm.sh("cat /proc/mounts; ls /");
    assert!(
        !r.stdout.contains(&rw.path().display().to_string()),
        "{}",
        r.stdout
    );
    assert!(!r.stdout.contains("/tmp/."), "{}", r.stdout);

    // Hibernate with a process holding a file open on the share; change and delete files on
    // the host meanwhile; the restore succeeds and the guest sees the new host state.
    std::fs::write(rw.path().join("doomed"), "soon gone\n").expect("write");
    let job = vm.detach(
        "exec 3</workspace/doomed; i=0; while true; do i=$((i+1)); echo $i > /workspace/tick; sleep 0.2; done",
    );
    common::wait_until("ticks", 30, || rw.path().join("tick").exists());
    ok(
        vm.warren(&["vm", "suspend", &vm.id, "--mode", "hibernate", "--force"]),
        "hibernate",
    );
    assert_eq!(vm.state(), "hibernated");
    let before: u64 = std::fs::read_to_string(rw.path().join("tick"))
        .expect("tick")
        .trim()
        .parse()
        .expect("number");
    std::fs::remove_file(rw.path().join("doomed")).expect("rm");
    std::fs::write(rw.path().join("while-asleep"), "hello again\n").expect("write");
    ok(vm.warren(&["vm", "resume", &vm.id]), "resume");
    let r = vm.sh("cat /workspace/while-asleep; test -e /workspace/doomed; echo doomed=$?");
    assert_eq!(r.stdout, "hello again\ndoomed=1\n", "{}", r.stderr);
    common::wait_until("ticking again", 30, || {
        std::fs::read_to_string(rw.path().join("tick"))
            .ok()
            .and_then(|t| t.trim().parse::<u64>().ok())
            .is_some_and(|n| n > before + 2)
    });
    let st = vm.output(job, &[]);
    assert_eq!(st["state"], "running", "{st}");
    vm.destroy();
}

/// How long the guest kernel trusts a share's cached names and attributes: virtiofsd's
/// `--cache=auto` answers every lookup with a 1 s entry and attribute timeout
/// (`warren_vmm::qemu::virtiofs`).
const SHARE_CACHE_TIMEOUT_S: f64 = 1.0;

/// Every host change made while the VM was suspended (a deletion of a file a guest process
/// holds open, a rename, a replacement, a new file) is what the guest sees at its first access
/// after the resume, although its cache of those names was primed right before the suspension
/// and has not timed out in guest time. Both suspension modes, each on its own names.
///
/// One guest job does the priming and the check, so that only the suspension itself lies
/// between them: it looks every name up once (new names, so these are real lookups), reports
/// on the share, then waits for a marker the host creates while the VM is suspended (absent
/// names are never cached, so it sees the marker at its first look after the thaw) and checks
/// every name. It reports the guest time between priming and check; an attempt where that
/// reached the cache timeout proves nothing and is made again on new names.
#[test]
fn test_shares_coherent_after_pause_and_hibernate() {
    common::ensure_image("minimal");
    // What this test times is guest time, which a loaded host stretches: the VM's processes
    // (supervisor, QEMU, virtiofsd; they inherit this thread's priority) run ahead of
    // ordinary load, so the window between priming and check stays what the guest needs.
    rustix::process::setpriority_process(None, -10).expect("raise priority");
    let share = tempfile::tempdir().expect("tempdir");
    let host = share.path();
    let env = TestEnv::new();
    let arg = format!("{}:/workspace", host.display());
    let id = env.create_vm_with("minimal", &["--mount", &arg]);
    let vm = TestVm::adopt(env, id);

    for mode in ["pause", "hibernate"] {
        let mut exercised = false;
        for attempt in 0..3 {
            let tag = format!("{mode}{attempt}");
            let n = |name: &str| format!("{tag}-{name}");
            let (held, from, to, repl, new) = (n("held"), n("from"), n("to"), n("repl"), n("new"));
            std::fs::write(host.join(&held), "held open\n").expect("write");
            std::fs::write(host.join(&from), "renamed\n").expect("write");
            std::fs::write(host.join(&repl), "old content\n").expect("write");
            let list = [&held, &from, &to, &repl, &new]
                .iter()
                .map(|p| format!("/workspace/{p}"))
                .collect::<Vec<_>>()
                .join(" ");
            // bash builtins only between priming and check (`read -t` on a FIFO nobody writes
            // is the sleep): no process starts in the window, so the check runs at the
            // job's first instant after the thaw.
            let script = format!(
                "exec 3</workspace/{held}; W=/workspace; mkfifo /tmp/{tag}.fifo; exec 9<>/tmp/{tag}.fifo; \
                 read -r t0 _ </proc/uptime; \
                 for p in {list}; do [[ -e $p ]]; done; read -r old <$W/{repl}; \
                 echo primed >$W/{tag}.primed; \
                 until [[ -e $W/{tag}.marker ]]; do read -t 0.02 -u 9; done; \
                 r=; for p in {list}; do \
                   if [[ -e $p ]]; then r=\"$r ${{p##*/}}=1\"; else r=\"$r ${{p##*/}}=0\"; fi; \
                 done; \
                 read -r c1 <$W/{repl}; read -r c2 <$W/{new}; read -r c3 <$W/{to}; read -r h <&3; \
                 read -r t1 _ </proc/uptime; \
                 printf '%s %s\\n%s\\n%s\\n%s\\n%s\\n%s\\nend\\n' \"$t0\" \"$t1\" \"$r\" \"$c1\" \"$c2\" \"$c3\" \"$h\" \
                   >$W/{tag}.result; read -u 9"
            );
            let out = vm.warren(&[
                "vm", "exec", &vm.id, "--detach", "--", "bash", "-c", &script,
            ]);
            let job: serde_json::Value =
                serde_json::from_str(&ok(out, "start the job")).expect("json");
            let job = job["job_id"].as_u64().expect("job id");
            // Poll tightly: guest time runs until the suspension stops it.
            let primed = host.join(format!("{tag}.primed"));
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
            while !primed.exists() {
                assert!(std::time::Instant::now() < deadline, "the job never primed");
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            ok(
                vm.warren(&["vm", "suspend", &vm.id, "--mode", mode, "--force"]),
                mode,
            );
            let expected_state = if mode == "pause" {
                "paused"
            } else {
                "hibernated"
            };
            assert_eq!(vm.state(), expected_state);

            std::fs::remove_file(host.join(&held)).expect("rm");
            std::fs::rename(host.join(&from), host.join(&to)).expect("rename");
            let tmp = host.join(format!("{repl}.tmp"));
            std::fs::write(&tmp, "new content\n").expect("write");
            std::fs::rename(&tmp, host.join(&repl)).expect("replace");
            std::fs::write(host.join(&new), "created\n").expect("write");
            std::fs::write(host.join(format!("{tag}.marker")), "").expect("marker");

            ok(vm.warren(&["vm", "resume", &vm.id]), "resume");
            let result = host.join(format!("{tag}.result"));
            let mut text = String::new();
            common::wait_until("checked", 60, || {
                text = std::fs::read_to_string(&result).unwrap_or_default();
                text.ends_with("end\n")
            });
            let lines: Vec<&str> = text.lines().collect();
            let times: Vec<f64> = lines[0]
                .split(' ')
                .map(|t| t.parse().expect("uptime"))
                .collect();
            let elapsed = times[1] - times[0];
            let seen = format!(" {held}=0 {from}=0 {to}=1 {repl}=1 {new}=1");
            assert_eq!(
                &lines[1..5],
                [seen.as_str(), "new content", "created", "renamed"],
                "after {mode} (guest time from priming to check {elapsed:.2} s)"
            );
            if mode == "pause" {
                // Held open across the pause: still readable through its descriptor.
                assert_eq!(lines[5], "held open");
            }
            ok(
                vm.warren(&["vm", "cancel", &vm.id, &job.to_string()]),
                "cancel",
            );
            eprintln!("{mode} attempt {attempt}: guest time from priming to check {elapsed:.3} s");
            if elapsed < SHARE_CACHE_TIMEOUT_S {
                exercised = true;
                break;
            }
        }
        assert!(
            exercised,
            "after {mode}: every attempt took {SHARE_CACHE_TIMEOUT_S} s of guest time or more \
             from priming to check, so none exercised the cache"
        );
    }
    vm.destroy();
}

/// A share owned by root (root's `--mount`, as the README's set-up runs Warren): the guest
/// user acts as root on it, yet cannot leave a set-user-ID or set-group-ID file, a device node
/// or a file capability on the host. Positive control: the same commands on the guest's own
/// tmpfs do set the bits.
#[test]
fn test_shares_refuse_set_id_files_and_devices_for_a_root_owner() {
    common::ensure_image("minimal");
    let share = tempfile::tempdir().expect("tempdir");
    let host = share.path();
    assert_eq!(
        std::fs::metadata(host).expect("stat").uid(),
        0,
        "run as root"
    );
    let env = TestEnv::new();
    let arg = format!("{}:/workspace", host.display());
    let id = env.create_vm_with("minimal", &["--mount", &arg]);
    let vm = TestVm::adopt(env, id);
    let r = vm.sh(
        "cd /workspace; cp /bin/sh sh; chmod u+s sh; echo suid=$?; chmod g+s sh; echo sgid=$?; \
         install -m 4755 /bin/true t 2>/dev/null; echo install=$?; mkdir -m 2755 d 2>/dev/null; \
         echo mkdir=$?; touch f; chmod 6755 f; echo both=$?; mknod c c 1 3 2>/dev/null; \
         echo mknod=$?; mkfifo p; echo fifo=$?; chmod 755 f; echo plain=$?; \
         cp /bin/sh /tmp/sh && chmod 6755 /tmp/sh && stat -c control=%a /tmp/sh",
    );
    let out = r.stdout.clone();
    for refused in ["suid", "sgid", "install", "mkdir", "both", "mknod"] {
        assert!(
            !out.contains(&format!("{refused}=0")),
            "{refused} succeeded through the share: {out}{}",
            r.stderr
        );
    }
    assert!(
        out.contains("fifo=0") && out.contains("plain=0"),
        "{out}{}",
        r.stderr
    );
    assert!(out.contains("control=6755"), "the guest's own tmpfs: {out}");
    let mut stack = vec![host.to_path_buf()];
    let mut seen = 0;
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).expect("ls").flatten() {
            let m = std::fs::symlink_metadata(e.path()).expect("stat");
            seen += 1;
            assert_eq!(
                m.mode() & 0o6000,
                0,
                "set-ID bit on the host: {:?}",
                e.path()
            );
            use std::os::unix::fs::FileTypeExt;
            let t = m.file_type();
            assert!(
                !t.is_char_device() && !t.is_block_device(),
                "device node on the host: {:?}",
                e.path()
            );
            if t.is_dir() {
                stack.push(e.path());
            }
        }
    }
    assert!(seen >= 3, "the guest's files are on the host ({seen})");
    vm.destroy();
}

/// A share is the directory that was checked when it was made: while a direct session's VM
/// is hibernated, its directory is replaced by a symlink to `/` (then by another directory);
/// each resume is refused with `conflict`, the VM stays hibernated, and nothing of the host's
/// `/` reaches the guest. Put back, the same VM resumes.
#[test]
fn test_shares_refuse_a_directory_replaced_while_hibernated() {
    common::ensure_image("minimal");
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("project");
    std::fs::create_dir(&dir).expect("mkdir");
    std::fs::write(dir.join("mine.txt"), "mine\n").expect("write");
    let env = TestEnv::new();
    let out = env.run(&[
        "session",
        "create",
        "--repo",
        &dir.display().to_string(),
        "--direct",
        "--name",
        "swap",
        "--image",
        &common::image_id("minimal"),
        "--json",
    ]);
    let s: serde_json::Value = serde_json::from_str(&ok(out, "session create")).expect("json");
    let vm = TestVm::adopt(env, s["vm_id"].as_str().expect("vm id").to_string());
    assert_eq!(vm.sh("cat /workspace/mine.txt").stdout, "mine\n");
    let aside = tmp.path().join("project.aside");
    for replacement in ["symlink to /", "another directory"] {
        ok(
            vm.warren(&["vm", "suspend", &vm.id, "--mode", "hibernate"]),
            "hibernate",
        );
        std::fs::rename(&dir, &aside).expect("move aside");
        if replacement == "symlink to /" {
            std::os::unix::fs::symlink("/", &dir).expect("symlink");
        } else {
            std::fs::create_dir(&dir).expect("mkdir");
        }
        let out = vm.warren(&["vm", "resume", &vm.id]);
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(!out.status.success(), "{replacement}: resumed");
        assert!(err.contains("error[conflict]"), "{replacement}: {err}");
        assert!(err.contains("not the directory that was checked"), "{err}");
        assert_eq!(vm.state(), "hibernated", "{replacement}: {err}");
        // An exec (which wakes a VM) is refused the same way.
        let r = vm.sh("ls /workspace");
        assert_ne!(r.code, 0, "{replacement}: {}", r.stdout);
        assert!(
            !r.stdout.contains("etc"),
            "the host's / reached the guest: {}",
            r.stdout
        );
        if replacement == "symlink to /" {
            std::fs::remove_file(&dir).expect("rm symlink");
        } else {
            std::fs::remove_dir(&dir).expect("rmdir");
        }
        std::fs::rename(&aside, &dir).expect("put back");
        ok(
            vm.warren(&["vm", "resume", &vm.id]),
            "resume after putting it back",
        );
        assert_eq!(vm.sh("cat /workspace/mine.txt").stdout, "mine\n");
    }
    let env_cmd = vm.warren(&["session", "list", "--json"]);
    assert!(env_cmd.status.success());
    vm.destroy();
}
