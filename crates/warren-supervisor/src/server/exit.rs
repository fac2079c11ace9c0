//! How a supervisor's VM ended: the reason written to `exit.json`, and whether the VM may be
//! booted again.

use super::*;

/// How the supervisor's wait ended: the VMM exited (its reason is read once the console is
/// drained), or a reason stated by whoever stopped it.
pub(super) enum Ended {
    Vmm(std::process::ExitStatus),
    Said(String),
}

/// Why the VMM ended on its own: its status, its last stderr line (from the log's tail
/// only, escaped and cut: `child_log::last_line`), the console tail.
pub(super) fn vmm_exit_reason(
    dir: &VmDir,
    status: std::process::ExitStatus,
    tail: &ConsoleTail,
) -> String {
    let mut reason = format!("the VMM exited unexpectedly ({})", describe_status(status));
    if let Some(l) = crate::child_log::last_line(&dir.qemu_stderr()) {
        reason.push_str(&format!(": {l}"));
    }
    reason.push_str(&tail.report(10));
    reason
}

/// How much CPU the VMM had used, for a guest that never answered: near none means it
/// never ran the guest (held before start, or stopped), a lot means the guest ran but
/// its agent never spoke.
pub(super) fn vmm_cpu_note(pid: Option<u32>) -> String {
    let Some(pid) = pid else {
        return String::new();
    };
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return " (the VMM is gone)".into();
    };
    // The fields after the command (which may hold spaces) are space-separated; utime and
    // stime are the 14th and 15th of the whole line.
    let Some(rest) = stat.rfind(')').map(|i| &stat[i + 1..]) else {
        return String::new();
    };
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok());
    let (Some(state), Some(u), Some(s)) = (f.first(), ticks(11), ticks(12)) else {
        return String::new();
    };
    let hz = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()
        .filter(|&hz| hz > 0)
        .unwrap_or(100);
    format!(
        " (the VMM is in state {state} and used {:.1}s of CPU)",
        (u + s) as f64 / hz as f64
    )
}

fn describe_status(s: std::process::ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    if let Some(sig) = s.signal() {
        let name = nix::sys::signal::Signal::try_from(sig)
            .map(|s| s.as_str().to_string())
            .unwrap_or_else(|_| sig.to_string());
        format!("killed by {name}")
    } else {
        format!("exit status {}", s.code().unwrap_or(-1))
    }
}

/// Whether the guest's agent stopped the boot over the kernel's timer
/// ([`warren_protocol::CLOCK_FAILED_LINE`], printed at the start of a line) in `console`.
pub(super) fn clock_failed(console: &str) -> bool {
    console
        .lines()
        .any(|l| l.starts_with(warren_protocol::CLOCK_FAILED_LINE))
}

pub(super) fn record_exit(dir: &VmDir, requested: bool, reason: String, boot_again: bool) {
    let rec = ExitRecord {
        requested,
        reason,
        boot_again,
        unix_time: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs(),
    };
    let tmp = dir.path().join("exit.json.tmp");
    let body = serde_json::to_vec_pretty(&rec).expect("invariant: record serialises");
    // Owner-only: the reason quotes QEMU's stderr and the guest's console.
    if warren_vmm::sys::private_file::create(&tmp, false)
        .and_then(|mut f| std::io::Write::write_all(&mut f, &body))
        .and_then(|_| std::fs::rename(&tmp, dir.exit_record()))
        .is_err()
    {
        tracing::error!("could not write the exit record");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hwm_kib() -> u64 {
        let s = std::fs::read_to_string("/proc/self/status").expect("status");
        s.lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("VmHWM")
    }

    /// The exit reason takes QEMU's last stderr line from the log's tail: a 1 GiB (sparse)
    /// `qemu.stderr` ending with a QEMU line costs no memory (it was read whole, +1 GiB).
    /// Positive control: the line is in the reason.
    #[test]
    fn test_exit_reason_reads_only_the_tail_of_qemu_stderr() {
        use std::io::Write;
        use std::os::unix::process::ExitStatusExt;
        let d = tempfile::tempdir().expect("tempdir");
        let dir = VmDir(d.path().to_path_buf());
        let f = std::fs::File::create(dir.qemu_stderr()).expect("create");
        f.set_len(1 << 30).expect("len");
        drop(f);
        std::fs::OpenOptions::new()
            .append(true)
            .open(dir.qemu_stderr())
            .expect("open")
            .write_all(b"\nqemu-system-x86_64: virtio-serial-bus: Unexpected port id 4660\n")
            .expect("write");
        let before = hwm_kib();
        let reason = vmm_exit_reason(
            &dir,
            std::process::ExitStatus::from_raw(1 << 8),
            &ConsoleTail::default(),
        );
        let grew = hwm_kib().saturating_sub(before);
        assert!(grew < 16 * 1024, "VmHWM grew by {grew} KiB");
        assert!(
            reason.starts_with(
                "the VMM exited unexpectedly (exit status 1): qemu-system-x86_64: \
                 virtio-serial-bus: Unexpected port id 4660"
            ),
            "{reason}"
        );
    }

    #[test]
    fn test_clock_failure_is_the_agents_line_only() {
        assert!(clock_failed(
            "early\nguest: clock failed: the kernel has no timer on CPU 0\n"
        ));
        assert!(clock_failed("guest: clock failed: x"));
        // Anywhere but at a line's start it is not the agent's verdict.
        assert!(!clock_failed("job said guest: clock failed: x\n"));
        assert!(!clock_failed("guest: secret failed: read /warren/secret\n"));
        assert!(!clock_failed(""));
    }
}
