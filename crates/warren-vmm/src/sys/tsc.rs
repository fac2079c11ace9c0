//! The host's time stamp counter, read directly: `rdtsc` is an instruction std exposes only
//! as an `unsafe` intrinsic, and no safe wrapper crate is worth a dependency for one read.

/// The current TSC value of the CPU this thread runs on.
pub fn read() -> u64 {
    // SAFETY: `rdtsc` only reads a counter register; it touches no memory, and every x86_64
    // CPU has it (the crate builds for x86_64 hosts only).
    unsafe { core::arch::x86_64::_rdtsc() }
}
