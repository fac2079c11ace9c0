//! The boot phase `clock`: is the kernel's timer sound?
//!
//! Without a TSC-deadline timer (TCG never has one) Linux calibrates the local APIC timer at
//! boot: it counts how far the timer moves while the TSC moves 100 ms, in a polling loop. If
//! the host holds the VMM's CPU up during that loop (a loaded host), both clocks keep running
//! while the loop does not, and the kernel measures nonsense: too little, and it turns the
//! timer off, leaving CPU 0 without any timer (the first sleep never ends: the VM hangs with
//! a silent console); too much, and every timer fires late by the same factor. The
//! calibration is not repeated and cannot be corrected from user space, so the agent looks
//! at the result before anything runs and stops the boot ([`CLOCK_FAILED_LINE`]) for the
//! host to boot the VM again.
//!
//! The result is read from `/proc/timer_list` (CPU 0's tick device: its name and the `mult`
//! and `shift` that turn nanoseconds into timer counts). The VMM's APIC timer clock comes
//! from the host on the kernel command line ([`APIC_BUS_ARG`]).
//!
//! [`CLOCK_FAILED_LINE`]: warren_protocol::CLOCK_FAILED_LINE
//! [`APIC_BUS_ARG`]: warren_protocol::APIC_BUS_ARG

use std::io::Read;

use warren_protocol::APIC_BUS_ARG;

const TIMER_LIST: &str = "/proc/timer_list";
/// More than the file holds at boot, even with many vCPUs.
const TIMER_LIST_LIMIT: u64 = 1 << 20;
/// Linux divides the APIC bus clock by 16 for its periodic/one-shot timer (`APIC_DIVISOR`).
const APIC_DIVISOR: u128 = 16;
/// How far the kernel's measurement may be off: a clean boot under TCG measures 0.95-1.10
/// (the polling loop overshoots); beyond this the timers are late or early by a quarter.
const LOWEST_RATIO: f64 = 0.8;
const HIGHEST_RATIO: f64 = 1.25;

/// CPU 0's tick device as `/proc/timer_list` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TickDevice {
    /// `<NULL>` when the CPU has none.
    pub name: String,
    pub mult: Option<u64>,
    pub shift: Option<u32>,
}

/// Why the boot is stopped.
#[derive(Debug, thiserror::Error)]
pub enum ClockError {
    #[error(
        "the kernel has no timer on CPU 0 ({0}): it turned the local APIC timer off after \
         calibrating it while the host held the VM's CPU up; the VM would hang at its first sleep"
    )]
    NoTimer(String),
    #[error(
        "the kernel measured the local APIC timer's clock at {measured_khz} kHz, the VMM runs \
         it at {expected_khz} kHz (the host held the VM's CPU up while the kernel calibrated \
         it): a timer set for 1 s would fire after {ratio:.2} s"
    )]
    Miscalibrated {
        measured_khz: u64,
        expected_khz: u64,
        ratio: f64,
    },
    #[error("malformed {APIC_BUS_ARG}={0}")]
    BadArgument(String),
    #[error("{TIMER_LIST} lists {0}")]
    Unreadable(String),
    #[error("read {TIMER_LIST}")]
    Read(#[source] std::io::Error),
}

impl ClockError {
    /// Whether another boot may pass: a calibration a host stall disturbed, not a listing or
    /// an argument the next boot would find the same.
    pub fn transient(&self) -> bool {
        matches!(
            self,
            ClockError::NoTimer(_) | ClockError::Miscalibrated { .. }
        )
    }
}

/// The phase: checks CPU 0's timer against the rate named on `cmdline`. A kernel without
/// `/proc/timer_list` cannot be checked and boots as it is.
pub fn check(cmdline: &str) -> Result<(), ClockError> {
    let expected_khz = bus_khz(cmdline)?;
    let text = match std::fs::File::open(TIMER_LIST) {
        Ok(f) => {
            let mut s = String::new();
            f.take(TIMER_LIST_LIMIT)
                .read_to_string(&mut s)
                .map_err(ClockError::Read)?;
            s
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(ClockError::Read(e)),
    };
    verdict(parse(&text), expected_khz)
}

/// The APIC bus rate the host named, if it named one.
fn bus_khz(cmdline: &str) -> Result<Option<u64>, ClockError> {
    let prefix = format!("{APIC_BUS_ARG}=");
    match cmdline
        .split_whitespace()
        .find_map(|a| a.strip_prefix(prefix.as_str()))
    {
        None => Ok(None),
        Some(v) => match v.parse::<u64>() {
            Ok(n) if n > 0 => Ok(Some(n)),
            _ => Err(ClockError::BadArgument(v.to_string())),
        },
    }
}

/// CPU 0's tick device, or `None` when the listing has no section for it.
pub fn parse(text: &str) -> Option<TickDevice> {
    let mut lines = text.lines().map(str::trim);
    lines.find(|l| *l == "Per CPU device: 0")?;
    let name = lines
        .next()?
        .strip_prefix("Clock Event Device:")?
        .trim()
        .to_string();
    let mut dev = TickDevice {
        name,
        mult: None,
        shift: None,
    };
    for l in lines.take_while(|l| !l.is_empty() && !l.starts_with("Tick Device:")) {
        let Some((key, value)) = l.split_once(':') else {
            continue;
        };
        match key.trim() {
            "mult" => dev.mult = value.trim().parse().ok(),
            "shift" => dev.shift = value.trim().parse().ok(),
            _ => {}
        }
    }
    Some(dev)
}

/// Judges CPU 0's tick device against the VMM's APIC bus rate.
pub fn verdict(dev: Option<TickDevice>, expected_khz: Option<u64>) -> Result<(), ClockError> {
    let Some(dev) = dev else {
        return Err(ClockError::Unreadable("no tick device for CPU 0".into()));
    };
    if dev.name == "<NULL>" || dev.name.is_empty() {
        return Err(ClockError::NoTimer(format!("tick device {}", dev.name)));
    }
    // Only the calibrated kind is checked: `lapic-deadline` counts TSC cycles, which the
    // kernel was told (or measured against a reference), not this loop.
    let (Some(expected_khz), "lapic") = (expected_khz, dev.name.as_str()) else {
        return Ok(());
    };
    let (Some(mult), Some(shift)) = (dev.mult, dev.shift) else {
        return Err(ClockError::Unreadable(format!(
            "CPU 0's {} without its mult and shift",
            dev.name
        )));
    };
    // counts = ns * mult >> shift, so the timer's rate is mult * 1e9 >> shift per second.
    let measured_hz = (u128::from(mult) * 1_000_000_000 * APIC_DIVISOR) >> shift.min(127);
    let measured_khz = u64::try_from(measured_hz / 1000).unwrap_or(u64::MAX);
    let ratio = measured_khz as f64 / expected_khz as f64;
    if (LOWEST_RATIO..=HIGHEST_RATIO).contains(&ratio) {
        Ok(())
    } else {
        Err(ClockError::Miscalibrated {
            measured_khz,
            expected_khz,
            ratio,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// CPU 0's part of `/proc/timer_list` from a clean TCG boot (Debian's 6.12 kernel).
    fn listing(device: &str, mult: u64) -> String {
        format!(
            "Timer List Version: v0.10\nHRTIMER_MAX_CLOCK_BASES: 8\nnow at 7820143254 nsecs\n\n\
             cpu: 0\n clock 0:\n  .base:       ffff\n\n\
             Tick Device: mode:     1\nBroadcast device\nClock Event Device: <NULL>\n\
             tick_broadcast_mask: 0\ntick_broadcast_oneshot_mask: 0\n\n\
             Tick Device: mode:     1\nPer CPU device: 0\nClock Event Device: {device}\n \
             max_delta_ns:   35436439133\n min_delta_ns:   1000\n mult:           {mult}\n \
             shift:          32\n mode:           3\n next_event:     7820000000 nsecs\n \
             set_next_event: lapic_next_event\n shutdown:       lapic_timer_shutdown\n\n"
        )
    }

    #[test]
    fn test_clean_boot_passes() {
        // mult 260279313 << 32: 60.6 MHz counts, a bus of 969 MHz against QEMU's 1 GHz.
        let dev = parse(&listing("lapic", 260_279_313)).expect("cpu 0");
        assert_eq!(dev.name, "lapic");
        assert_eq!(dev.shift, Some(32));
        verdict(Some(dev), Some(1_000_000)).expect("sound");
    }

    #[test]
    fn test_timer_turned_off_is_refused() {
        let dev = parse(&listing("<NULL>", 0)).expect("cpu 0");
        let e = verdict(Some(dev), Some(1_000_000)).expect_err("no timer");
        assert!(matches!(e, ClockError::NoTimer(_)), "{e}");
        assert!(e.transient());
        // A listing without CPU 0 is not something another boot changes.
        let e = verdict(parse("Tick Device: mode: 1\nBroadcast device\n"), None).expect_err("x");
        assert!(matches!(e, ClockError::Unreadable(_)), "{e}");
        assert!(!e.transient());
    }

    #[test]
    fn test_late_and_early_timers_are_refused() {
        // A measurement half again too high: every timer 1.5 times late.
        let late = parse(&listing("lapic", 402_653_184)).expect("cpu 0");
        match verdict(Some(late), Some(1_000_000)) {
            Err(ClockError::Miscalibrated { ratio, .. }) => assert!(ratio > 1.4, "{ratio}"),
            other => panic!("{other:?}"),
        }
        let early = parse(&listing("lapic", 134_217_728)).expect("cpu 0");
        assert!(matches!(
            verdict(Some(early), Some(1_000_000)),
            Err(ClockError::Miscalibrated { .. })
        ));
        // Without the host's rate only the timer's presence is checked.
        let late = parse(&listing("lapic", 402_653_184)).expect("cpu 0");
        verdict(Some(late), None).expect("unchecked rate");
    }

    #[test]
    fn test_deadline_timer_rate_is_not_checked() {
        let dev = parse(&listing("lapic-deadline", 5)).expect("cpu 0");
        verdict(Some(dev), Some(1_000_000)).expect("tsc deadline");
    }

    #[test]
    fn test_bus_argument() {
        assert_eq!(bus_khz("a b").expect("none"), None);
        assert_eq!(
            bus_khz("x warren.apic_bus_khz=1000000 y").expect("some"),
            Some(1_000_000)
        );
        for bad in [
            "warren.apic_bus_khz=",
            "warren.apic_bus_khz=0",
            "warren.apic_bus_khz=1e9",
        ] {
            assert!(bus_khz(bad).is_err(), "{bad}");
        }
    }
}
