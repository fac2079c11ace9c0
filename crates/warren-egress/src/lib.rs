//! Warren's fail-closed egress for one VM: policy, DNS resolver, transparent TCP proxy with
//! SNI/Host decisions, TLS interception with host-held secret substitution in request headers,
//! and interception rules answered by host commands.
//!
//! The caller creates the VM's network namespace and nftables redirects, binds the listening
//! sockets inside that namespace ([`bind_tcp_in`], [`bind_udp_in`]), chooses where outbound
//! connections come from ([`Outbound`]), and starts the service with
//! [`Egress::new`] + [`Egress::spawn`]. See `docs/egress.md` for the semantics.

#![forbid(unsafe_code)]

pub mod bench;
mod ca;
mod config;
mod conns;
mod decision_log;
mod egress;
mod error;
#[doc(hidden)]
pub mod fuzzing;
mod host_ca;
mod http1;
mod intercept;
mod outbound;
mod pace;
mod policy;
pub mod presets;
mod proxy;
mod request;
mod resolver;
mod sniff;
pub mod standin;
mod sys;

pub use ca::generate_ca;
pub use config::{
    CaMaterial, EgressConfig, InterceptRule, SecretSource, SecretSpec, UpstreamRoots,
    DEFAULT_RULE_TIMEOUT,
};
pub use conns::{
    DNS_SOCKET_BUFFER, HANDSHAKE_TIMEOUT, IDLE_LIMIT, MAX_CONNECTIONS, MAX_DNS_TCP_CONNECTIONS,
    RELAY_SOCKET_BUFFER,
};
pub use egress::{Egress, EgressHandle, Listeners};
pub use error::{ConfigError, EgressError, SecretError};
pub use host_ca::{
    load_host_cas, load_host_cas_from, HostCas, HOST_CA_BUNDLES, LOCAL_ANCHOR_DIRS,
    MAX_EXTRA_CERTS, MAX_EXTRA_PEM, MAX_HOST_BUNDLE,
};
pub use http1::{MAX_HEAD, MAX_INTERCEPT_REQUEST};
pub use intercept::MAX_RESPONSE;
pub use outbound::{NetnsWorkerHandle, Outbound, CONNECT_TIMEOUT};
pub use policy::{
    is_always_denied, normalize_name, DenyReason, DomainPattern, EgressMode, EgressPolicy,
    ALWAYS_DENIED,
};
pub use proxy::{FIRST_BYTES_WAIT, SNIFF_TIMEOUT};
pub use resolver::{MAX_TTL, MIN_RECORD_TTL, UPSTREAM_TIMEOUT};
pub use sys::netns::{bind_tcp_in, bind_udp_in, run_in_netns};
