//! The host TSC's rate, which every guest is told on its command line (`tsc_early_khz`):
//! under TCG QEMU hands the guest the host's counter, and under KVM the guest's counter runs
//! at the host's rate. `cpu MHz` in `/proc/cpuinfo` is that rate only on hosts without
//! frequency scaling (most VMs); elsewhere it is a core's current clock, and a guest told it
//! runs its clock and timers at the wrong speed (and its agent refuses the boot, see
//! `warren-guest::clock`). So the rate is measured against `CLOCK_MONOTONIC_RAW` once per
//! host boot and cached; `cpu MHz` is taken when it agrees within 0.1%, being then the
//! kernel's own figure to the kHz.

use std::sync::OnceLock;
use std::time::Duration;

use nix::time::{clock_gettime, ClockId};

use crate::error::VmmError;
use crate::sys::tsc;

/// How long the counter is watched: pairs of readings taken a few hundred nanoseconds apart
/// make the rate good to a few parts per million.
const WINDOW: Duration = Duration::from_millis(50);
/// A (clock, counter) pair whose clock readings are further apart was interrupted.
const PAIR_SLACK_NS: i64 = 20_000;

/// What is cached for one host boot.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Cached {
    boot_id: String,
    khz: u64,
}

/// The host TSC's rate in kHz (measured at most once per host boot, see the module docs).
pub fn host_tsc_khz() -> Result<u64, VmmError> {
    static MEMO: OnceLock<u64> = OnceLock::new();
    if let Some(k) = MEMO.get() {
        return Ok(*k);
    }
    let boot_id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map_err(|e| VmmError::io("read", "/proc/sys/kernel/random/boot_id", e))?
        .trim()
        .to_string();
    let dir = crate::accel::host_cache_dir();
    let cache = crate::accel::private_dir(&dir);
    let path = dir.join("host-tsc.json");
    let cached = cache
        .then(|| std::fs::read(&path).ok())
        .flatten()
        .and_then(|b| serde_json::from_slice::<Cached>(&b).ok())
        .filter(|c| c.boot_id == boot_id && c.khz > 0);
    let khz = match cached {
        Some(c) => c.khz,
        None => {
            let measured = measure()?;
            let khz = match cpuinfo_khz() {
                Some(k) if agrees(k, measured) => k,
                _ => measured,
            };
            if cache {
                store(&path, &Cached { boot_id, khz });
            }
            khz
        }
    };
    Ok(*MEMO.get_or_init(|| khz))
}

/// Whether `cpu MHz` is the counter's rate (within 0.1% of the measurement).
fn agrees(cpuinfo: u64, measured: u64) -> bool {
    cpuinfo.abs_diff(measured) * 1000 <= measured
}

/// Best effort: a cache that cannot be written costs the next process another 50 ms. `path`
/// is in a [`crate::accel::private_dir`].
fn store(path: &std::path::Path, c: &Cached) {
    let body = serde_json::to_vec(c).expect("invariant: the record serialises");
    if let Err(e) = crate::accel::write_private(path, &body) {
        tracing::debug!(error = %e, "caching the host TSC rate failed");
    }
}

fn now_ns() -> Result<i64, VmmError> {
    let t = clock_gettime(ClockId::CLOCK_MONOTONIC_RAW)
        .map_err(|e| VmmError::io("clock_gettime", "CLOCK_MONOTONIC_RAW", e.into()))?;
    Ok(t.tv_sec() * 1_000_000_000 + t.tv_nsec())
}

/// A counter reading and the clock at that moment, from the tightest of several tries.
fn pair() -> Result<(i64, u64), VmmError> {
    let mut best: Option<(i64, i64, u64)> = None;
    for _ in 0..64 {
        let a = now_ns()?;
        let c = tsc::read();
        let b = now_ns()?;
        let gap = b - a;
        if best.is_none_or(|(g, _, _)| gap < g) {
            best = Some((gap, a + gap / 2, c));
        }
    }
    match best {
        Some((gap, ns, c)) if gap <= PAIR_SLACK_NS => Ok((ns, c)),
        _ => Err(VmmError::io(
            "measure",
            "the host TSC",
            std::io::Error::other("every reading was interrupted"),
        )),
    }
}

fn measure() -> Result<u64, VmmError> {
    let (t0, c0) = pair()?;
    std::thread::sleep(WINDOW);
    let (t1, c1) = pair()?;
    let ns = u128::try_from(t1 - t0).unwrap_or(0);
    let counts = u128::from(c1.wrapping_sub(c0));
    if ns == 0 || counts == 0 {
        return Err(VmmError::io(
            "measure",
            "the host TSC",
            std::io::Error::other("the counter or the clock did not move"),
        ));
    }
    // counts per ns × 1e6 = kHz, rounded.
    Ok(u64::try_from((counts * 1_000_000 + ns / 2) / ns).unwrap_or(u64::MAX))
}

/// `cpu MHz` of the first CPU in `/proc/cpuinfo`, in kHz.
fn cpuinfo_khz() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    let mhz = info
        .lines()
        .find(|l| l.starts_with("cpu MHz"))?
        .split(':')
        .nth(1)?
        .trim()
        .parse::<f64>()
        .ok()?;
    Some((mhz * 1000.0).round() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_measured_rate_is_steady_and_plausible() {
        let a = measure().expect("measure");
        let b = measure().expect("measure");
        // Any x86_64 TSC runs between 100 MHz and 10 GHz; two measurements agree closely
        // (to 0.5% here, leaving room for a loaded host's slower readings).
        assert!((100_000..10_000_000).contains(&a), "{a} kHz");
        assert!(a.abs_diff(b) * 200 <= a, "{a} vs {b}");
    }

    #[test]
    fn test_cpuinfo_is_taken_only_when_it_agrees() {
        assert!(agrees(2_596_134, 2_596_200));
        // A core running at 1.2 GHz on a 2.6 GHz TSC: the measurement wins.
        assert!(!agrees(1_200_000, 2_596_134));
    }
}
