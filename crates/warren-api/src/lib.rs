//! warrend: Warren's authenticated multi-workspace service.
//!
//! One implementation ([`service::Service::call`]) behind two transports: JSON over
//! `POST /v1/tools/{tool}` and MCP over Streamable HTTP at `/mcp` ([`http`], [`mcp`]). Callers
//! are workspaces holding bearer tokens ([`auth`]) or local users on the UNIX socket
//! (SO_PEERCRED). Every VM, job and file operation checks that the caller's workspace owns the
//! VM; creation and execution are idempotent through durable receipts ([`receipts`]).
#![forbid(unsafe_code)]

pub mod activation;
pub mod admission;
pub mod auth;
pub mod broker;
pub mod broker_ws;
pub mod caps;
pub mod config;
mod conn;
mod egress;
pub mod error;
#[doc(hidden)]
pub mod fuzzing;
pub mod hostpath;
pub mod http;
pub mod job_ws;
pub mod loopback;
pub mod loopback_peer;
pub mod mcp;
pub mod openapi;
mod peer_owner;
pub mod receipts;
pub mod serve;
pub mod service;
pub mod streams;
mod subuid;
pub mod tools;
pub mod ws;

pub use error::ApiError;
pub use service::Service;
