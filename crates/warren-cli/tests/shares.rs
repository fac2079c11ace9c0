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
    assert_fork_refused(&vm, "--mount shares cannot be forked");

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

    // `vm cp` refuses a host side inside a share the guest writes, by the path given or
    // as it resolves (a symlink planted there leads where the guest chose); the read-only
    // share is no such place. Control: the same copy to a directory outside the shares.
    std::os::unix::fs::symlink(rw.path(), ro.path().join("into-rw")).expect("symlink");
    let outside = tempfile::tempdir().expect("tempdir");
    for (dst, refused) in [
        (rw.path().join("out"), true),
        (ro.path().join("into-rw"), true),
        (ro.path().join("copies"), false),
        (outside.path().to_path_buf(), false),
    ] {
        let out = vm.warren(&[
            "vm",
            "cp",
            &format!("{}:/etc/hostname", vm.id),
            dst.to_str().expect("utf-8"),
        ]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(!out.status.success(), refused, "{}: {err}", dst.display());
        if refused {
            assert!(err.contains("which VM"), "{}: {err}", dst.display());
        } else {
            assert!(dst.join("hostname").is_file(), "{}", dst.display());
        }
    }
    let out = vm.warren(&[
        "vm",
        "cp",
        rw.path().join("host.txt").to_str().expect("utf-8"),
        &format!("{}:/tmp", vm.id),
    ]);
    assert!(!out.status.success(), "a shared source was packed");
    std::fs::remove_file(ro.path().join("into-rw")).expect("rm");
    std::fs::remove_dir_all(ro.path().join("copies")).expect("rm");

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

/// How many name sets the guest job primes, one about every 0.1 s of guest time (five
/// looks for the marker, [`MARKER_POLL_S`] apart), while the host gets the suspension going:
/// 10 s of guest time, far more than a suspension takes to start even on a loaded host.
const PRIME_SETS: usize = 100;
const MARKER_POLL_S: f64 = 0.02;

/// The host-side names of set `i` of attempt `tag`.
fn set_name(tag: &str, i: usize, what: &str) -> String {
    format!("{tag}-{i}-{what}")
}

/// Every host change made while the VM was suspended (a deletion of a file a guest process
/// holds open, a rename, a replacement, a new file) is what the guest sees at its first access
/// after the resume, although its cache of those names was primed right before the suspension
/// and has not timed out in guest time. Both suspension modes, each on its own names.
///
/// One guest job does the priming and the check, so that only the suspension itself lies
/// between them. How long the host takes to get a suspension going (starting the CLI, the
/// freeze) depends on the host's load, so the job keeps priming: about every 0.1 s it
/// looks up a fresh set of names once (real lookups, each with a full
/// cache timeout ahead of it), until a marker appears that the host creates while the VM is
/// suspended (absent names are never cached, so the job sees it at its first look after the
/// thaw). The host changes every set; the job checks the last set whose priming finished
/// before the marker appeared, and reports, for each name whose cached entry could hide a
/// change, the guest time from its priming lookup to its check. An attempt where that reached the cache timeout proves nothing and is made again on
/// new names.
#[test]
fn test_shares_coherent_after_pause_and_hibernate() {
    common::ensure_image("minimal");
    // The suspension's own steps run in guest time too (the freeze, and for a hibernation the
    // channel's resynchronisation before the thaw), and a loaded host stretches them: the VM's
    // processes (supervisor, QEMU, virtiofsd; they inherit this thread's priority) run ahead
    // of ordinary load.
    rustix::process::setpriority_process(None, -10).expect("raise priority");
    let share = tempfile::tempdir().expect("tempdir");
    let host = share.path();
    let env = TestEnv::new();
    let arg = format!("{}:/workspace", host.display());
    let id = env.create_vm_with("minimal", &["--mount", &arg]);
    let vm = TestVm::adopt(env, id);

    for mode in ["pause", "hibernate"] {
        let mut exercised = false;
        for attempt in 0..8 {
            let tag = format!("{mode}{attempt}");
            for i in 0..PRIME_SETS {
                for (what, text) in [
                    ("held", "held open\n"),
                    ("from", "renamed\n"),
                    ("repl", "old content\n"),
                ] {
                    std::fs::write(host.join(set_name(&tag, i, what)), text).expect("write");
                }
            }
            // bash builtins only between priming and check (`read -t` on a FIFO nobody writes
            // is the sleep): no process starts in the window, so the check runs at the
            // job's first instant after the thaw. A set whose priming the marker interrupted
            // is not the one checked.
            let script = format!(
                "W=/workspace; T={tag}; mkfifo /tmp/$T.fifo; exec 9<>/tmp/$T.fifo; \
                 i=0; last=-1; \
                 while :; do \
                   [[ -e $W/$T.marker ]] && break; \
                   if (( i < {PRIME_SETS} )); then \
                     read -r \"PH[$i]\" _ </proc/uptime; exec {{fd}}<$W/$T-$i-held; fds[i]=$fd; \
                     read -r \"PF[$i]\" _ </proc/uptime; [[ -e $W/$T-$i-from ]]; \
                     read -r \"PR[$i]\" _ </proc/uptime; read -r old <$W/$T-$i-repl; \
                     for s in held to new; do [[ -e $W/$T-$i-$s ]]; done; \
                     [[ -e $W/$T.marker ]] && break; \
                     last=$i; i=$((i+1)); \
                     (( last == 0 )) && echo primed >$W/$T.primed; \
                   fi; \
                   for k in 1 2 3 4 5; do [[ -e $W/$T.marker ]] && break 2; read -t {MARKER_POLL_S} -u 9; done; \
                 done; \
                 P=$W/$T-$last; r=; for s in held from to repl new; do \
                   if [[ -e $P-$s ]]; then r=\"$r $T-$last-$s=1\"; else r=\"$r $T-$last-$s=0\"; fi; \
                   read -r \"C_$s\" _ </proc/uptime; \
                 done; \
                 read -r c1 <$P-repl; read -r C_repl _ </proc/uptime; \
                 read -r c2 <$P-new; read -r c3 <$P-to; read -r h <&${{fds[last]}}; \
                 printf '%s %s %s %s %s %s %s\\n%s\\n%s\\n%s\\n%s\\n%s\\nend\\n' \"$last\" \
                   \"${{PH[last]}}\" \"$C_held\" \"${{PF[last]}}\" \"$C_from\" \"${{PR[last]}}\" \"$C_repl\" \
                   \"$r\" \"$c1\" \"$c2\" \"$c3\" \"$h\" \
                   >$W/$T.result; read -u 9"
            );
            let out = vm.warren(&[
                "vm", "exec", &vm.id, "--detach", "--", "bash", "-c", &script,
            ]);
            let job: serde_json::Value =
                serde_json::from_str(&ok(out, "start the job")).expect("json");
            let job = job["job_id"].as_u64().expect("job id");
            let primed = host.join(format!("{tag}.primed"));
            // Poll tightly: the sooner the suspension starts, the younger the checked set.
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

            for i in 0..PRIME_SETS {
                let n = |what: &str| host.join(set_name(&tag, i, what));
                std::fs::remove_file(n("held")).expect("rm");
                std::fs::rename(n("from"), n("to")).expect("rename");
                let tmp = n("repl.tmp");
                std::fs::write(&tmp, "new content\n").expect("write");
                std::fs::rename(&tmp, n("repl")).expect("replace");
                std::fs::write(n("new"), "created\n").expect("write");
            }
            std::fs::write(host.join(format!("{tag}.marker")), "").expect("marker");

            ok(vm.warren(&["vm", "resume", &vm.id]), "resume");
            let result = host.join(format!("{tag}.result"));
            let mut text = String::new();
            common::wait_until("checked", 60, || {
                text = std::fs::read_to_string(&result).unwrap_or_default();
                text.ends_with("end\n")
            });
            let lines: Vec<&str> = text.lines().collect();
            let head: Vec<&str> = lines[0].split(' ').collect();
            let last: usize = head[0].parse().expect("set number");
            let times: Vec<f64> = head[1..]
                .iter()
                .map(|t| t.parse().expect("uptime"))
                .collect();
            // Per name that a stale cache could hide (a positive entry for `held` and `from`,
            // the old inode behind `repl`; absent names are never cached): the guest time from
            // just before its priming lookup to just after its check. Each entry's timeout
            // started after the former, and the check used the cache before the latter.
            let elapsed = (0..3)
                .map(|k| times[2 * k + 1] - times[2 * k])
                .fold(0.0, f64::max);
            let n = |what: &str| set_name(&tag, last, what);
            let seen = format!(
                " {}=0 {}=0 {}=1 {}=1 {}=1",
                n("held"),
                n("from"),
                n("to"),
                n("repl"),
                n("new")
            );
            assert_eq!(
                &lines[1..5],
                [seen.as_str(), "new content", "created", "renamed"],
                "after {mode}, set {last} (guest time from priming to check {elapsed:.2} s)"
            );
            if mode == "pause" {
                // Held open across the pause: still readable through its descriptor.
                assert_eq!(lines[5], "held open");
            }
            ok(
                vm.warren(&["vm", "cancel", &vm.id, &job.to_string()]),
                "cancel",
            );
            eprintln!(
                "{mode} attempt {attempt}: set {last}, guest time from priming to check at most {elapsed:.3} s"
            );
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
    assert_fork_refused(&vm, "is direct: its files are");
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

/// A fork the VM's shares forbid is refused before anything is saved or admitted: the VM
/// runs on, alone, and still answers.
fn assert_fork_refused(vm: &TestVm, why: &str) {
    let out = vm.warren(&["vm", "fork", &vm.id, "--count", "2"]);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "forked: {err}");
    assert!(
        err.contains("error[invalid_argument]") && err.contains(why),
        "{err}"
    );
    let list = vm.warren(&["vm", "list", "--json"]);
    let vms: serde_json::Value = serde_json::from_slice(&list.stdout).expect("list json");
    assert_eq!(vms.as_array().map(Vec::len), Some(1), "{vms}");
    assert_eq!(vm.state(), "running");
    assert_eq!(vm.sh("echo up").stdout, "up\n");
}

/// `setfacl -m u:<uid>:--- path` over mode bits that let others in.
fn deny_acl(path: &std::path::Path, uid: u32) {
    let mut acl = 2u32.to_le_bytes().to_vec();
    for (tag, perm, id) in [
        (0x01u16, 6u16, u32::MAX), // owner rw-
        (0x02, 0, uid),            // the user ---
        (0x04, 6, u32::MAX),       // group rw-
        (0x10, 6, u32::MAX),       // mask rw-
        (0x20, 6, u32::MAX),       // others rw-
    ] {
        acl.extend_from_slice(&tag.to_le_bytes());
        acl.extend_from_slice(&perm.to_le_bytes());
        acl.extend_from_slice(&id.to_le_bytes());
    }
    rustix::fs::setxattr(
        path,
        "system.posix_acl_access",
        &acl,
        rustix::fs::XattrFlags::empty(),
    )
    .expect("set the ACL");
}

/// A user's share is served by a virtiofsd running as that user, so the host kernel checks
/// every access the guest makes as the user: a file in the shared directory whose ACL denies
/// the user (mode bits allowing everyone) is neither read nor written through the share,
/// though the guest's own checks (mode bits only) let it try. Before, virtiofsd was root for
/// every share: the guest read and wrote such files, and any file below the directory was one
/// guest root away. Control: a plain file of the same modes is read; the guest's new file
/// belongs to the user on the host.
#[test]
fn test_shares_of_a_user_are_served_as_that_user() {
    use std::os::unix::fs::PermissionsExt;
    common::ensure_image("minimal");
    assert!(nix::unistd::geteuid().is_root(), "this test needs root");
    let share = tempfile::tempdir().expect("tempdir");
    let host = share.path();
    std::os::unix::fs::chown(host, Some(4242), Some(4242)).expect("chown");
    std::fs::set_permissions(host, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    for (name, acl) in [("open.txt", false), ("denied", true), ("denied-w", true)] {
        let p = host.join(name);
        std::fs::write(&p, format!("{name} of root\n")).expect("write");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o666)).expect("chmod");
        if acl {
            deny_acl(&p, 4242);
        }
    }
    let env = TestEnv::new();
    // The CLI takes a mount's owner from its real uid (what `sudo` leaves in SUDO_UID's
    // place): Warren runs as root, the share is 4242's.
    let arg = format!("{}:/workspace", host.display());
    let image = common::pinned_image("minimal");
    let out = std::process::Command::new("setpriv")
        .args(["--ruid=4242", "--rgid=4242", "--keep-groups", "--"])
        .arg(common::WARREN)
        .arg("--state-dir")
        .arg(env.state.path())
        .arg("--image-dir")
        .arg(&env.image_dir)
        .args(["vm", "create", "--image", &image, "--json", "--mount", &arg])
        .env(
            "WARREN_ACCEL",
            std::env::var("WARREN_ACCEL").unwrap_or_else(|_| "auto".into()),
        )
        .output()
        .expect("vm create");
    assert!(
        out.status.success(),
        "vm create: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let created: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    let id = created["vm_id"].as_str().expect("vm_id").to_string();
    let vm = TestVm::adopt(env, id);

    let r = vm.sh(
        "cd /workspace; cat open.txt; cat denied && echo read=denied; \
         echo guest >> denied-w && echo wrote=denied-w; echo mine > mine; echo done",
    );
    assert!(
        r.stdout.contains("open.txt of root\n") && r.stdout.contains("done"),
        "control: {}{}",
        r.stdout,
        r.stderr
    );
    assert!(
        !r.stdout.contains("read=") && !r.stdout.contains("wrote="),
        "the ACL's denial did not hold through the share: {}",
        r.stdout
    );
    assert_eq!(
        std::fs::read_to_string(host.join("denied-w")).expect("read"),
        "denied-w of root\n"
    );
    assert_eq!(
        std::fs::metadata(host.join("mine")).expect("mine").uid(),
        4242
    );
    // Every virtiofsd of the VM runs as the user.
    let cg = vm.cgroup_dir().expect("the VM's cgroup");
    let procs = std::fs::read_to_string(cg.join("cgroup.procs")).expect("cgroup.procs");
    let mut daemons = 0;
    for pid in procs.split_whitespace() {
        let exe = std::fs::read_link(format!("/proc/{pid}/exe")).unwrap_or_default();
        if exe.file_name().is_none_or(|n| n != "virtiofsd") {
            continue;
        }
        daemons += 1;
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
        let uids = status
            .lines()
            .find(|l| l.starts_with("Uid:"))
            .expect("Uid line");
        assert_eq!(
            uids.split_whitespace().skip(1).collect::<Vec<_>>(),
            ["4242"; 4],
            "virtiofsd {pid}: {uids}"
        );
    }
    assert!(daemons >= 1, "no virtiofsd in {procs}");
    // A hibernation and resume restart it the same way, the guest's files intact.
    ok(
        vm.warren(&["vm", "suspend", &vm.id, "--mode", "hibernate", "--force"]),
        "hibernate",
    );
    assert_eq!(vm.state(), "hibernated");
    ok(vm.warren(&["vm", "resume", &vm.id]), "resume");
    let r = vm.sh("cat /workspace/mine; cat /workspace/denied && echo read=denied");
    assert_eq!(r.stdout, "mine\n", "{}", r.stderr);
    vm.destroy();
}
