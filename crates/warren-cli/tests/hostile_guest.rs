//! The hostile-guest harness (issue 14, item 7): a guest that speaks the channel
//! adversarially against a real supervisor, through the listening socket the supervisor
//! binds for QEMU. The guest is `warren-hostile-qemu` (`tests/harness/fake_qemu.rs`), a
//! stand-in for QEMU that the service's `$WARREN_QEMU` names: it claims the behaviour the test
//! wrote into the harness directory, and with none it execs the real QEMU, so a well-behaved
//! VM runs beside the hostile one under the same service.
//!
//! Every test: the good VM's exec round-trip p99 idle, the hostile VM created (it
//! authenticates like the agent), the attack, the good VM's p99 during it, then the bounds:
//! the hostile VM's supervisor alive with peak RSS (`VmHWM`) under 64 MiB, the service's
//! peak grown by under 128 MiB, the good p99 within 2x idle (50 ms floor for scheduler noise
//! on a loaded 2-core machine), and every call to the hostile VM answered with a typed error
//! within its deadline. A round whose p99 alone is over its bound is played again with a fresh
//! baseline, up to three rounds (another test's load can change between the baseline and the
//! attack; the attack's own interference fails every round).

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::daemon::Daemon;
use serde_json::{json, Value};

const SUPERVISOR_PEAK_KIB: u64 = 64 * 1024;
const SERVICE_GROWTH_KIB: u64 = 128 * 1024;
const SAMPLES: usize = 20;
/// Sampling windows under attack at most, per round (see [`Harness::run`]).
const WINDOWS: usize = 3;
/// Rounds of an attack at most, each with its own baseline (see [`Harness::run`]).
const ROUNDS: usize = 3;

struct Harness {
    d: Daemon,
    dir: tempfile::TempDir,
    token: String,
    good: String,
    idle_p99: Duration,
    service_hwm_before: u64,
    /// Set while the good VM is sampled; an attack that would otherwise end early holds on
    /// while it is set (see [`Harness::hold_while_sampling`]).
    sampling: std::sync::atomic::AtomicBool,
    /// How many times the attack has been played in full (request ids stay unique).
    round: std::sync::atomic::AtomicUsize,
}

fn real_qemu() -> String {
    std::env::var("WARREN_QEMU").unwrap_or_else(|_| {
        let out = std::process::Command::new("sh")
            .args(["-c", "command -v qemu-system-x86_64"])
            .output()
            .expect("sh");
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    })
}

/// `field` (`VmHWM`, `VmRSS`) of `/proc/<pid>/status`, in KiB.
fn status_kib(pid: u32, field: &str) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    s.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("no {field} for pid {pid}"))
}

/// One exec round trip of the good VM, under a request id of its own (a repeated id would be
/// answered from the service's record without reaching the guest).
fn exec_rtt(d: &Daemon, t: &str, vm: &str) -> Duration {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let start = Instant::now();
    let r = d.call(
        t,
        "vm_exec",
        json!({"vm_id": vm, "request_id": format!("rtt-{n}"), "argv": ["true"], "wait_ms": 20000}),
    );
    assert_eq!(r.status, 200, "good VM exec: {}", r.text);
    assert_eq!(r.body["exit_code"], 0, "{}", r.text);
    start.elapsed()
}

fn p99(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    let n = samples.len();
    samples[(n * 99 / 100).min(n - 1)]
}

impl Harness {
    fn start() -> Harness {
        common::ensure_image("minimal");
        let dir = tempfile::Builder::new()
            .prefix("warren-hostile-")
            .tempdir()
            .expect("tempdir");
        {
            use std::os::unix::fs::PermissionsExt;
            // The VMM runs as the VM's own uid: it claims and reports in here.
            std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777))
                .expect("chmod");
        }
        let fake = env!("CARGO_BIN_EXE_warren-hostile-qemu");
        let real = real_qemu();
        let harness_dir = dir.path().to_str().expect("utf-8").to_string();
        let d = Daemon::start_env(
            "",
            &[
                ("WARREN_QEMU", fake),
                ("WARREN_HARNESS_REAL_QEMU", &real),
                ("WARREN_HARNESS_DIR", &harness_dir),
                // The stand-in claims and reports there: in its view (`warren-vmm::sys::view`).
                ("WARREN_TEST_VMM_DIR", &harness_dir),
                ("WARREN_ACCEL", "tcg"),
            ],
        );
        let token = d.token("hostile", &[]);
        let r = d.ok(&token, "vm_create", json!({"request_id": "good"}));
        let good = r["vm_id"].as_str().expect("vm id").to_string();
        exec_rtt(&d, &token, &good); // warm-up
        let idle_p99 = p99((0..SAMPLES).map(|_| exec_rtt(&d, &token, &good)).collect());
        let service_hwm_before = status_kib(d.pid().expect("service pid"), "VmHWM");
        Harness {
            d,
            dir,
            token,
            good,
            idle_p99,
            service_hwm_before,
            sampling: std::sync::atomic::AtomicBool::new(false),
            round: std::sync::atomic::AtomicUsize::new(0),
        }
    }

    /// Keeps an attack going (its calls pending) until the sampling is over, at most 60 s.
    fn hold_while_sampling(&self) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while self.sampling.load(std::sync::atomic::Ordering::SeqCst) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Creates the VM that plays `behaviour` in round `round`; returns its id and its
    /// supervisor's pid. The counters of an earlier round's guest (gone by now) are removed,
    /// so a positive control counts this round's only.
    fn hostile(&self, behaviour: &str, round: usize) -> (String, u32) {
        for e in std::fs::read_dir(self.dir.path()).expect("dir").flatten() {
            if e.file_name().to_string_lossy().starts_with("stats-") {
                std::fs::remove_file(e.path()).expect("remove an earlier round's counters");
            }
        }
        std::fs::write(self.dir.path().join("next"), behaviour).expect("write behaviour");
        let r = self.d.ok(
            &self.token,
            "vm_create",
            json!({"request_id": format!("hostile-{behaviour}-{round}")}),
        );
        let id = r["vm_id"].as_str().expect("vm id").to_string();
        assert!(
            !self.dir.path().join("next").exists(),
            "the hostile VMM claimed its behaviour"
        );
        let pid = std::fs::read_to_string(self.d.env.vm_dir(&id).join("supervisor.lock"))
            .expect("supervisor.lock")
            .trim()
            .parse()
            .expect("pid");
        (id, pid)
    }

    /// A call of the hostile VM: an exec whose `argv[0]` names the attack variant.
    fn hostile_exec(&self, vm: &str, variant: &str, n: usize) -> (u16, Value, Duration) {
        let start = Instant::now();
        let r = self.d.call(
            &self.token,
            "vm_exec",
            json!({"vm_id": vm,
                   "request_id": format!("{variant}-{}-{n}", self.round.load(std::sync::atomic::Ordering::SeqCst)),
                   "argv": [variant],
                   "wait_ms": 1000}),
        );
        (r.status, r.body, start.elapsed())
    }

    /// The harness guest's counters (`sessions`, `flooded`).
    fn stat(&self, key: &str) -> u64 {
        let mut total = 0;
        for e in std::fs::read_dir(self.dir.path()).expect("dir").flatten() {
            if !e.file_name().to_string_lossy().starts_with("stats-") {
                continue;
            }
            let text = std::fs::read_to_string(e.path()).unwrap_or_default();
            total += text
                .lines()
                .find_map(|l| l.strip_prefix(key)?.trim().parse::<u64>().ok())
                .unwrap_or(0);
        }
        total
    }

    /// Runs `attack` while sampling the good VM's round trips; checks every bound.
    ///
    /// A round: the hostile VM is created, the attack is played over and over while the good
    /// VM's p99 is taken over windows of [`SAMPLES`] round trips (up to [`WINDOWS`]), the
    /// hostile VM's resource bounds are checked and it is destroyed. An interference the
    /// attack causes shows in every window, whereas one scheduler stall of a loaded 2-core
    /// host (20 samples make the p99 their maximum) does not: the first window within the
    /// bound whose end the attack outlived counts; without one, the best window is the figure
    /// checked.
    ///
    /// Over the bound, the good VM is measured again with the hostile VM gone and the worse
    /// of its figures before and after is the baseline. Another test's VM booting beside this
    /// one can still load the host for exactly the seconds of the attack (CI runs two tests at
    /// once), so a round over its bound is played again, up to [`ROUNDS`], each with its own
    /// baseline taken just before: an interference of the attack's own fails every round.
    fn run(self, behaviour: &str, attack: impl Fn(&Harness, &str) + Sync) {
        let mut failed = Vec::new();
        for round in 0..ROUNDS {
            let before = if round == 0 {
                self.idle_p99
            } else {
                self.good_p99()
            };
            match self.round_of(behaviour, &attack, before, round) {
                Ok(()) => return,
                Err(why) => {
                    eprintln!("hostile {behaviour}: round {round} over its bound: {why}");
                    failed.push(why);
                }
            }
        }
        panic!("{behaviour}: the good VM's p99 was over its bound in every round: {failed:?}");
    }

    fn good_p99(&self) -> Duration {
        p99((0..SAMPLES)
            .map(|_| exec_rtt(&self.d, &self.token, &self.good))
            .collect())
    }

    /// One round of [`Harness::run`]: panics on a broken bound of the hostile VM; `Err` when
    /// only the good VM's p99 was over its bound.
    fn round_of(
        &self,
        behaviour: &str,
        attack: &(impl Fn(&Harness, &str) + Sync),
        before: Duration,
        round: usize,
    ) -> Result<(), String> {
        let (vm, sup) = self.hostile(behaviour, round);
        let bound = |idle: Duration| (idle * 2).max(idle + Duration::from_millis(50));
        self.sampling
            .store(true, std::sync::atomic::Ordering::SeqCst);
        let (attacked, ()) = std::thread::scope(|s| {
            let h = self;
            let vm = vm.as_str();
            // The attack is played again and again until the sampling is over.
            let a = s.spawn(move || loop {
                attack(h, vm);
                h.round.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                if !h.sampling.load(std::sync::atomic::Ordering::SeqCst) {
                    break;
                }
            });
            // Let the attack get going before sampling.
            std::thread::sleep(Duration::from_millis(500));
            let mut windows = Vec::new();
            let mut passed = None;
            for w in 0..WINDOWS {
                let p = h.good_p99();
                let attack_ran = !a.is_finished();
                windows.push(p);
                if p <= bound(before) && (w == 0 || attack_ran) {
                    passed = Some(p);
                    break;
                }
                if !attack_ran {
                    break;
                }
            }
            h.sampling.store(false, std::sync::atomic::Ordering::SeqCst);
            eprintln!("hostile {behaviour}: good exec p99 per window {windows:?}");
            let best = windows.iter().min().copied().unwrap_or_default();
            (passed.unwrap_or(best), a.join().expect("attack thread"))
        });
        assert!(
            Path::new(&format!("/proc/{sup}")).exists(),
            "{behaviour}: the hostile VM's supervisor died"
        );
        let sup_peak = status_kib(sup, "VmHWM");
        let service = self.d.pid().expect("service pid");
        let growth = status_kib(service, "VmHWM").saturating_sub(self.service_hwm_before);
        eprintln!(
            "hostile {behaviour}: supervisor peak {sup_peak} KiB, service growth {growth} KiB, \
             good exec p99 before {before:?} under attack {attacked:?}"
        );
        assert!(
            sup_peak < SUPERVISOR_PEAK_KIB,
            "{behaviour}: supervisor peak {sup_peak} KiB"
        );
        assert!(
            growth < SERVICE_GROWTH_KIB,
            "{behaviour}: service grew {growth} KiB"
        );
        // The service still serves the hostile VM's owner, and destroys the VM cleanly.
        let r = self.d.call(&self.token, "vm_destroy", json!({"vm_id": vm}));
        assert_eq!(r.status, 200, "destroy the hostile VM: {}", r.text);
        common::wait_until("the hostile supervisor exits", 30, || {
            !Path::new(&format!("/proc/{sup}")).exists()
        });
        if attacked <= bound(before) {
            return Ok(());
        }
        let after = self.good_p99();
        eprintln!("hostile {behaviour}: good exec p99 after the hostile VM is gone {after:?}");
        let idle = before.max(after);
        if attacked <= bound(idle) {
            return Ok(());
        }
        Err(format!(
            "good VM p99 {attacked:?} > {:?} (before {before:?}, after {after:?})",
            bound(idle)
        ))
    }
}

/// Asserts a hostile call failed with a stable code within the control deadline.
fn typed_failure(what: &str, (status, body, took): (u16, Value, Duration)) -> String {
    eprintln!(
        "  {what}: {status} {} in {took:?}",
        truncate(&body["error"].to_string(), 160)
    );
    assert!(status >= 400, "{what}: {body}");
    let code = body["error"]["code"].as_str().unwrap_or("").to_string();
    assert!(!code.is_empty(), "{what}: no error code: {body}");
    assert!(took < Duration::from_secs(45), "{what} took {took:?}");
    code
}

fn truncate(s: &str, n: usize) -> String {
    s.chars().take(n).collect()
}

/// The control variant: the guest answers with its own `not_found`, so the session works.
fn control(h: &Harness, vm: &str, n: usize) {
    let (status, body, took) = h.hostile_exec(vm, "control", n);
    assert_eq!(status, 404, "control call after the attack: {body}");
    assert_eq!(body["error"]["code"], "not_found", "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("harness-control")),
        "{body}"
    );
    assert!(took < Duration::from_secs(45));
}

fn variants(h: &Harness, vm: &str, names: &[&str]) {
    for (i, v) in names.iter().enumerate() {
        typed_failure(v, h.hostile_exec(vm, v, i));
        control(h, vm, i);
    }
}

#[test]
fn test_hostile_guest_flood_of_pings_and_settings_keeps_supervisor_bounded() {
    Harness::start().run("flood", |h, vm| {
        std::thread::sleep(Duration::from_secs(2));
        let flooded = h.stat("flooded");
        eprintln!("  flooded {flooded} bytes");
        assert!(flooded > 64 << 10, "the flood really ran: {flooded} bytes");
        // The flooded VM's own calls still get through (or fail typed, if the host gave up
        // the session).
        let (status, body, _) = h.hostile_exec(vm, "control", 0);
        if status != 404 {
            typed_failure("call during the flood", (status, body, Duration::ZERO));
        }
    });
}

#[test]
fn test_hostile_guest_oversized_frames_fail_their_call_typed() {
    Harness::start().run("oversized", |h, vm| {
        variants(
            h,
            vm,
            &["frame-too-large", "endless-headers", "body-too-large"],
        )
    });
}

#[test]
fn test_hostile_guest_malformed_frames_fail_their_call_typed() {
    Harness::start().run("malformed", |h, vm| {
        variants(
            h,
            vm,
            &[
                "garbage-body",
                "bad-hpack",
                "bad-escape",
                "data-on-stream-0",
            ],
        )
    });
}

#[test]
fn test_hostile_guest_forged_and_unsolicited_responses_fail_typed() {
    Harness::start().run("forged", |h, vm| {
        variants(h, vm, &["wrong-type", "unsolicited", "push-promise"])
    });
}

#[test]
fn test_hostile_guest_responses_on_other_streams_never_reach_other_calls() {
    Harness::start().run("other-streams", |h, vm| {
        // A forged answer on finished streams first: the call still gets its own answer.
        control_of(h, vm, "closed-stream");
        variants(h, vm, &["idle-stream", "even-stream"]);
    });
}

/// `variant` answers the control reply on its own stream: the call must get exactly it.
fn control_of(h: &Harness, vm: &str, variant: &str) {
    for n in 0..2 {
        let (status, body, _) = h.hostile_exec(vm, variant, n);
        assert_eq!(status, 404, "{variant}: {body}");
        assert!(
            body["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("harness-control")),
            "{variant}: {body}"
        );
    }
}

#[test]
fn test_hostile_guest_endless_file_read_ends_with_a_typed_error() {
    Harness::start().run("endless-read", |h, vm| {
        // Through the CLI: a read loop that follows the guest's `eof` would never end.
        let started = Instant::now();
        let mut child =
            h.d.env
                .cmd()
                .args(["vm", "read", vm, "endless.txt"])
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .expect("spawn vm read");
        let status = loop {
            if let Some(s) = child.try_wait().expect("wait") {
                break Some(s);
            }
            if started.elapsed() > Duration::from_secs(40) {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        let mut err = String::new();
        if let Some(mut e) = child.stderr.take() {
            use std::io::Read;
            let _ = e.read_to_string(&mut err);
        }
        eprintln!(
            "  vm read of an endless file: {status:?} after {:?}: {}",
            started.elapsed(),
            err.trim()
        );
        let status = status.expect("the CLI read of an endless file ended");
        assert!(!status.success(), "an endless file read cannot succeed");
        // Through the service: a chunk larger than asked for is refused.
        for n in 0..8 {
            let r = h.d.call(
                &h.token,
                "vm_read_file",
                json!({"vm_id": vm, "path": "endless.txt", "max_bytes": 16, "offset": n}),
            );
            if n == 0 {
                eprintln!("  vm_read_file: {} {}", r.status, truncate(&r.text, 200));
            }
            assert!(r.status >= 400, "{}", truncate(&r.text, 200));
            assert!(r.text.len() < 64 * 1024, "answer of {} bytes", r.text.len());
        }
    });
}

#[test]
fn test_hostile_guest_megabyte_error_strings_are_cut_at_the_host() {
    Harness::start().run("mega-error", |h, vm| {
        std::thread::scope(|s| {
            // Six at once: with the good VM's sampler that is within the token's cap of 8
            // long-polls (an exec that waits for its result is one).
            let calls: Vec<_> = (0..6)
                .map(|n| {
                    let variant = if n % 2 == 0 { "visible" } else { "hidden" };
                    s.spawn(move || (variant, h.hostile_exec(vm, variant, n)))
                })
                .collect();
            let mut visible = 0;
            for c in calls {
                let (variant, (status, body, took)) = c.join().expect("call");
                let text = body.to_string();
                typed_failure(variant, (status, body.clone(), took));
                assert!(
                    text.len() < 64 * 1024,
                    "a guest error reached the client at {} bytes",
                    text.len()
                );
                assert!(!text.contains('\u{1b}'), "terminal escapes passed through");
                if body["error"]["code"] == "invalid_argument" {
                    visible += 1;
                    let m = body["error"]["message"].as_str().unwrap_or("");
                    assert!(
                        m.ends_with(" bytes]"),
                        "cut and marked: {}",
                        truncate(m, 200)
                    );
                }
            }
            assert_eq!(visible, 3, "the guest's own code reached the client");
        });
        // Six megabytes every half second: played back to back, moving them costs the host
        // CPU that shows in the other VM's p99 (2-3x on this 2-core host; docs/security.md).
        std::thread::sleep(Duration::from_millis(500));
    });
}

#[test]
fn test_hostile_guest_reconnect_storm_keeps_supervisor_bounded() {
    Harness::start().run("reconnect-storm", |h, vm| {
        let before = h.stat("sessions");
        std::thread::sleep(Duration::from_secs(3));
        let storm = h.stat("sessions") - before;
        eprintln!("  storm: {storm} sessions in 3 s");
        // The supervisor backs off after short sessions (up to 1 s between them), so the
        // storm is throttled to about one handshake a second, but it runs.
        assert!(storm >= 2, "the storm really ran: {storm} sessions");
        for n in 0..3 {
            let (status, body, took) = h.hostile_exec(vm, "control", n);
            if status != 404 {
                typed_failure("call during the storm", (status, body, took));
            }
        }
    });
}

#[test]
fn test_hostile_guest_that_never_drains_fails_only_its_calls() {
    Harness::start().run("never-drains", |h, vm| {
        // Writes of 128 KiB pile up behind a guest that stopped reading; each would end at
        // its deadline, and ends when the VM is destroyed. Detached: nothing waits for them.
        let data = base64_of(&vec![b'w'; 128 * 1024]);
        let writers: Vec<_> = (0..6)
            .map(|n| {
                let body = json!({"vm_id": vm, "path": format!("f{n}"), "content_base64": data});
                let (addr, token) = (h.d.addr.clone(), h.token.clone());
                std::thread::spawn(move || post(&addr, &token, "vm_write_file", &body))
            })
            .collect();
        std::thread::sleep(Duration::from_secs(3));
        assert!(
            writers.iter().all(|w| !w.is_finished()),
            "the writes really wait on the guest (positive control)"
        );
        // The service and the supervisor still answer what they know themselves.
        let started = Instant::now();
        let r = h.d.call(&h.token, "vm_list", json!({}));
        assert_eq!(r.status, 200, "{}", r.text);
        let listed = r.body.to_string();
        assert!(listed.contains(vm), "{listed}");
        assert!(started.elapsed() < Duration::from_secs(10));
        // The writes stay pending behind the guest for the whole sampling.
        h.hold_while_sampling();
        assert!(
            writers.iter().all(|w| !w.is_finished()),
            "the writes waited on the guest for the whole sampling"
        );
    });
}

/// A tool call over its own connection, its answer dropped.
fn post(addr: &str, token: &str, tool: &str, body: &Value) {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect(addr) else {
        return;
    };
    let body = body.to_string();
    let req = format!(
        "POST /v1/tools/{tool} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {token}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    if s.write_all(req.as_bytes()).is_ok() {
        let mut sink = Vec::new();
        let _ = s.read_to_end(&mut sink);
    }
}

fn base64_of(data: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(data)
}
