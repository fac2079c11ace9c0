//! Fuzz targets: one function per parser that a guest, a tenant or an operator's file feeds,
//! each taking arbitrary bytes and asserting the parser's invariants (beyond not panicking).
//!
//! The fuzz binaries in `fuzz/` (outside the workspace, built with libFuzzer by
//! `scripts/fuzz`) call these functions; the `corpus_replay` test replays every file of
//! `fuzz/corpus/<target>/` through them in the ordinary test run. See `docs/fuzzing.md`.
#![forbid(unsafe_code)]

#[cfg(feature = "api")]
pub mod api;
#[cfg(feature = "egress")]
pub mod egress;
#[cfg(feature = "protocol")]
pub mod protocol;

/// A fuzz target: its name (the corpus directory and the fuzz binary) and its function.
pub type Target = (&'static str, fn(&[u8]));

/// Every target this build has.
pub const TARGETS: &[Target] = &[
    #[cfg(feature = "protocol")]
    ("framing", protocol::framing),
    #[cfg(feature = "protocol")]
    ("guest_messages", protocol::guest_messages),
    #[cfg(feature = "egress")]
    ("http1", egress::http1),
    #[cfg(feature = "egress")]
    ("tls_client_hello", egress::tls_client_hello),
    #[cfg(feature = "egress")]
    ("dns_query", egress::dns_query),
    #[cfg(feature = "api")]
    ("configs", api::configs),
    #[cfg(feature = "api")]
    ("api_json", api::api_json),
];
