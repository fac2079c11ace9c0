//! Host specifics: cgroups and process confinement. The only place in this crate with
//! `unsafe` (in `process`, for `pre_exec`).

pub mod cgroup;
pub mod process;
pub mod tap;
