//! Host specifics: cgroups and process confinement. The only place in this crate with
//! `unsafe` (in `process` and `share_seccomp`, for `pre_exec`; in `vmm_file`, for the
//! `F_SETLEASE` fcntl no safe wrapper offers; in `tsc`, for the `rdtsc` intrinsic; in
//! `accounts`, for the user database's enumeration).

pub mod accounts;
pub mod cgroup;
pub mod clone_ram;
pub mod private_file;
pub mod process;
pub mod share_seccomp;
pub mod tap;
pub mod tsc;
pub mod view;
pub mod vmm_file;
