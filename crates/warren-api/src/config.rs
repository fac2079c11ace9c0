//! `warren serve --config FILE`: the service's TOML configuration, strictly parsed and checked
//! before anything listens.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("{path}: {message}")]
    Invalid { path: PathBuf, message: String },
}

/// The whole file. Unknown keys anywhere fail parsing.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServiceConfig {
    /// Durable state: the database and VM directories.
    pub state_dir: PathBuf,
    /// Image store (default: `<state_dir>/images`).
    pub image_dir: Option<PathBuf>,
    /// `kvm`, `hvf`, `tcg` or `auto`.
    #[serde(default = "default_accel")]
    pub accel: String,
    /// Local control socket (default: `<state_dir>/warrend.sock`).
    pub socket: Option<PathBuf>,
    /// Its permission bits; callers are still identified by SO_PEERCRED (default 0o600).
    #[serde(default = "default_socket_mode")]
    pub socket_mode: u32,
    /// Seconds a VM may take to boot before creation fails.
    #[serde(default = "default_boot_timeout")]
    pub boot_timeout_secs: u64,
    /// Shapes with a current template at most (the least recently used past it are retired).
    #[serde(default = "default_max_templates")]
    pub max_templates: usize,
    #[serde(default)]
    pub http: HttpConfig,
    #[serde(default)]
    pub limits: LimitsConfig,
    /// Bootable images by name.
    pub images: BTreeMap<String, ImageConfig>,
    /// Host directories HTTP callers may name, each acting as one host uid.
    #[serde(default)]
    pub host_roots: Vec<HostRoot>,
    /// Host-held secrets per workspace, substituted by the egress into request headers of
    /// the named hosts; the guest only sees the placeholder. Values stay in the host files.
    #[serde(default)]
    pub secrets: Vec<SecretConfig>,
    /// Requests of a workspace's VMs answered by a host command instead of the upstream
    /// (for example an OAuth token refresh).
    #[serde(default)]
    pub intercepts: Vec<InterceptConfig>,
    /// The operator's egress address policy for every networked VM.
    #[serde(default)]
    pub egress: EgressSettings,
    /// Guest streams (`GET /v1/vms/{vm_id}/streams/{port}`): ports and limits.
    #[serde(default)]
    pub streams: StreamsConfig,
}

/// `[streams]`: which guest ports a caller may open streams to, and how many at once.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamsConfig {
    /// Inclusive port ranges; `[]` disables port streams (copies still work).
    #[serde(default = "default_stream_ports")]
    pub ports: Vec<[u16; 2]>,
    /// Open streams at once, host-wide.
    #[serde(default = "default_max_streams")]
    pub max_streams: usize,
    #[serde(default = "default_max_streams_per_workspace")]
    pub max_streams_per_workspace: usize,
    #[serde(default = "default_max_streams_per_vm")]
    pub max_streams_per_vm: usize,
    /// Bytes per second in each direction of one stream; 0 is unlimited.
    #[serde(default = "default_stream_rate")]
    pub rate_bytes: u64,
}

impl Default for StreamsConfig {
    fn default() -> Self {
        StreamsConfig {
            ports: default_stream_ports(),
            max_streams: default_max_streams(),
            max_streams_per_workspace: default_max_streams_per_workspace(),
            max_streams_per_vm: default_max_streams_per_vm(),
            rate_bytes: default_stream_rate(),
        }
    }
}

impl StreamsConfig {
    /// Whether a stream to `port` may be opened (never ports 0..=1024).
    pub fn allows_port(&self, port: u16) -> bool {
        port > crate::streams::LOWEST_STREAM_PORT - 1
            && self
                .ports
                .iter()
                .any(|[lo, hi]| (*lo..=*hi).contains(&port))
    }
}

fn default_stream_ports() -> Vec<[u16; 2]> {
    vec![[1025, 65535]]
}
fn default_max_streams() -> usize {
    32
}
fn default_max_streams_per_workspace() -> usize {
    8
}
fn default_max_streams_per_vm() -> usize {
    4
}
fn default_stream_rate() -> u64 {
    32 << 20
}

/// `[egress]`: what only the operator decides about the network of every VM the service
/// creates. Token holders choose names freely (with the network grant) but CIDRs only inside
/// their workspace's grant; the egress refuses always-denied ranges, `blocked_cidrs` and the
/// host's own addresses whatever any list says.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EgressSettings {
    /// IPv4 CIDRs (or addresses) no VM may reach, added to the always-denied ranges.
    #[serde(default)]
    pub blocked_cidrs: Vec<String>,
    /// Terminate every allowed TLS connection with the VM's CA, so each request's `Host` is
    /// held to its SNI (closes domain fronting to a co-hosted name; HTTP/1.1 only inside TLS,
    /// other protocols over TLS fail).
    #[serde(default)]
    pub intercept_all_tls: bool,
    /// Hosts behind TLS inspection (a corporate proxy re-signing HTTPS with a CA only the
    /// host trusts): the host's CA store is trusted too, upstream by the egress and in every
    /// guest's trust bundle (its certificates outside the public roots). Off by default.
    #[serde(default)]
    pub host_ca_store: bool,
    /// Header names besides `Authorization` in which placeholders are substituted, for
    /// secrets that name no `headers` of their own (`["x-api-key"]`).
    #[serde(default)]
    pub secret_headers: Vec<String>,
    /// Per workspace (`name = ["CIDR", ...]`), the ranges its callers may name in
    /// `egress.allow`. A workspace without an entry may allow no CIDR at all.
    #[serde(default)]
    pub cidr_grants: BTreeMap<String, Vec<String>>,
}

/// An IPv4 CIDR, or an address as a /32: the same reading as the egress's allow lists.
pub fn parse_cidr(s: &str) -> Option<ipnet::Ipv4Net> {
    s.parse::<ipnet::Ipv4Net>().ok().or_else(|| {
        s.parse::<std::net::Ipv4Addr>()
            .ok()
            .map(ipnet::Ipv4Net::from)
    })
}

/// One `[[intercepts]]` entry.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InterceptConfig {
    pub workspace: String,
    /// Host (SNI or `Host` header); wildcards as in the allow list.
    pub host: String,
    /// Exact request method, for example `POST`.
    pub method: String,
    /// Request-target prefix, starting with `/`.
    pub path_prefix: String,
    /// Absolute program path and arguments; gets the raw request on stdin and prints a raw
    /// HTTP response.
    pub command: Vec<String>,
    /// Host uid and gid the command runs as (never root).
    pub uid: u32,
    pub gid: u32,
    /// Timeout in seconds (default 60).
    #[serde(default = "default_intercept_timeout")]
    pub timeout_secs: u64,
}

fn default_intercept_timeout() -> u64 {
    60
}

/// One `[[secrets]]` entry.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SecretConfig {
    pub workspace: String,
    pub name: String,
    pub placeholder: String,
    pub hosts: Vec<String>,
    /// Host file with the value, re-read on each new connection (rotation needs no restart).
    pub file: PathBuf,
    /// The file is JSON and the value is the string at this JSON pointer.
    #[serde(default)]
    pub json_pointer: Option<String>,
    /// The only request headers the value is substituted into (default: `Authorization`
    /// and `[egress] secret_headers`).
    #[serde(default)]
    pub headers: Vec<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpConfig {
    /// Where the HTTP API listens (loopback by default).
    #[serde(default = "default_listen")]
    pub listen: SocketAddr,
    /// Accepted `Host` header values (default: the loopback names with the listen port).
    #[serde(default)]
    pub allowed_hosts: Vec<String>,
    /// Largest request body.
    #[serde(default = "default_max_body")]
    pub max_body_bytes: usize,
    /// Connections each listener (TCP, and the local socket) serves at once; more are
    /// accepted and closed at once (`crate::conn`).
    #[serde(default = "default_max_connections")]
    pub max_connections: usize,
    /// Connections one local uid may hold on a listener (the local socket, and loopback TCP
    /// connections, whose uid the kernel's socket table names); root also gets up to this
    /// many past `max_connections` (`crate::conn`).
    #[serde(default = "default_max_connections_per_uid")]
    pub max_connections_per_uid: usize,
    /// Seconds a client may take to send a complete request head (for HTTP/1 also the wait
    /// for the next request on a kept-alive connection).
    #[serde(default = "default_header_read_timeout")]
    pub header_read_timeout_secs: u64,
    /// Seconds a connection with no request in flight stays open.
    #[serde(default = "default_idle_timeout")]
    pub idle_timeout_secs: u64,
    /// Requests one credential (a token, or a local uid) may have in flight at once; more
    /// are answered `429 quota_exceeded` (`crate::caps`).
    #[serde(default = "default_max_requests_per_token")]
    pub max_requests_per_token: usize,
    /// Long-polls (`vm_exec` or `vm_job_output` with `wait_ms` > 0) one credential may have
    /// waiting at once.
    #[serde(default = "default_max_long_polls_per_token")]
    pub max_long_polls_per_token: usize,
    /// MCP sessions the service holds at once, all callers together.
    #[serde(default = "default_max_mcp_sessions")]
    pub max_mcp_sessions: usize,
    /// MCP sessions one credential may hold at once.
    #[serde(default = "default_max_mcp_sessions_per_token")]
    pub max_mcp_sessions_per_token: usize,
}

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig {
            listen: default_listen(),
            allowed_hosts: vec![],
            max_body_bytes: default_max_body(),
            max_connections: default_max_connections(),
            max_connections_per_uid: default_max_connections_per_uid(),
            header_read_timeout_secs: default_header_read_timeout(),
            idle_timeout_secs: default_idle_timeout(),
            max_requests_per_token: default_max_requests_per_token(),
            max_long_polls_per_token: default_max_long_polls_per_token(),
            max_mcp_sessions: default_max_mcp_sessions(),
            max_mcp_sessions_per_token: default_max_mcp_sessions_per_token(),
        }
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitsConfig {
    pub max_vms: Option<u64>,
    pub max_memory_mib: Option<u64>,
    pub max_storage_gib: Option<u64>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ImageConfig {
    /// The image id: SHA-256 of its manifest, 64 lowercase hex digits.
    pub id: String,
    #[serde(default)]
    pub default: bool,
    /// Smaller VMs are refused; also the default memory when `memory_mib` is unset.
    pub min_memory_mib: Option<u32>,
    /// Memory when `vm_create` names none.
    pub memory_mib: Option<u32>,
    /// `vm_create` restores VMs of this image from a template of their shape (built on the
    /// first create of a shape) instead of booting them (`docs/instant.md`).
    #[serde(default)]
    pub template: bool,
    /// Warm pool: this many restored VMs of the image's default shape kept ready for
    /// `vm_create` (implies `template`; refilled in the background, counted against the
    /// host limits).
    #[serde(default)]
    pub pool: u32,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostRoot {
    pub path: PathBuf,
    pub uid: u32,
    /// The workspaces whose token holders may name paths beneath it (`"*"`: every
    /// workspace). Required: a root is one workspace's files unless the operator says
    /// otherwise, never every token holder's by default.
    #[serde(default)]
    pub workspaces: Vec<String>,
    /// `uid = 0` is refused unless this is set: copies and shares of the root then run
    /// host git and virtiofsd as root over the tree.
    #[serde(default)]
    pub allow_root: bool,
}

impl HostRoot {
    /// Whether token holders of `workspace` may name paths beneath this root.
    pub fn admits(&self, workspace: &str) -> bool {
        self.workspaces.iter().any(|w| w == "*" || w == workspace)
    }
}

fn default_accel() -> String {
    "auto".into()
}
fn default_socket_mode() -> u32 {
    0o600
}
fn default_boot_timeout() -> u64 {
    120
}
fn default_max_templates() -> usize {
    warren_core::DEFAULT_MAX_TEMPLATES
}
fn default_listen() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 8090))
}
fn default_max_body() -> usize {
    1 << 20
}
/// Far below the descriptors the service raises its own limit to (its hard limit, 20,000 on
/// our hosts; at least 1,024 anywhere), so the cap bites first; ample for agents.
fn default_max_connections() -> usize {
    512
}
/// An eighth of the connection cap: room for a caller's requests and long-polls in flight
/// (32 + 8 by default), each on a connection of its own over HTTP/1.
fn default_max_connections_per_uid() -> usize {
    64
}
/// A real client sends its head in one write; 10 s tolerates a slow network.
fn default_header_read_timeout() -> u64 {
    10
}
/// Longer than a client's pause between calls; requests in flight (a long-poll, a boot, an
/// MCP event stream) never count as idle.
fn default_idle_timeout() -> u64 {
    60
}
/// Several agents' parallel calls behind one token, yet a sixteenth of the connection cap.
fn default_max_requests_per_token() -> usize {
    32
}
/// A few jobs followed at once; long-polls hold their slot for up to 30 s each.
fn default_max_long_polls_per_token() -> usize {
    8
}
fn default_max_mcp_sessions() -> usize {
    512
}
fn default_max_mcp_sessions_per_token() -> usize {
    16
}

/// Image names: what `vm_create.image` accepts.
pub fn valid_image_name(n: &str) -> bool {
    !n.is_empty()
        && n.len() <= 64
        && n.bytes().enumerate().all(|(i, b)| {
            b.is_ascii_lowercase() || b.is_ascii_digit() || (i > 0 && b"._-".contains(&b))
        })
}

/// `[http] listen` alone, every other key ignored (the systemd generator's read: a file not
/// yet configured, such as the package's with its placeholder image, still names the port).
#[derive(Deserialize)]
struct ListenOnly {
    #[serde(default)]
    http: Option<HttpListenOnly>,
}

#[derive(Deserialize)]
struct HttpListenOnly {
    #[serde(default = "default_listen")]
    listen: SocketAddr,
}

/// The configuration file's `[http] listen` (its default when absent), read without the
/// rest of the file's checks.
pub fn load_listen(path: &Path) -> Result<SocketAddr, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.into(),
        source,
    })?;
    let only: ListenOnly = toml::from_str(&text).map_err(|e| ConfigError::Parse {
        path: path.into(),
        message: e.to_string(),
    })?;
    Ok(only.http.map_or_else(default_listen, |h| h.listen))
}

impl ServiceConfig {
    pub fn load(path: &Path) -> Result<ServiceConfig, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.into(),
            source,
        })?;
        Self::parse(path, &text)
    }

    pub fn parse(path: &Path, text: &str) -> Result<ServiceConfig, ConfigError> {
        let cfg: ServiceConfig = toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: path.into(),
            message: e.to_string(),
        })?;
        cfg.validate().map_err(|message| ConfigError::Invalid {
            path: path.into(),
            message,
        })?;
        Ok(cfg)
    }

    fn validate(&self) -> Result<(), String> {
        let st = &self.streams;
        for [lo, hi] in &st.ports {
            if lo > hi || *lo < crate::streams::LOWEST_STREAM_PORT {
                return Err(format!(
                    "streams.ports [{lo}, {hi}]: ranges are [low, high] with low >= {}",
                    crate::streams::LOWEST_STREAM_PORT
                ));
            }
        }
        for (key, n) in [
            ("max_streams", st.max_streams),
            ("max_streams_per_workspace", st.max_streams_per_workspace),
            ("max_streams_per_vm", st.max_streams_per_vm),
        ] {
            if n > 4096 {
                return Err(format!("streams.{key} {n} is above 4096"));
            }
        }
        if self.images.is_empty() {
            return Err("no [images.<name>] table: configure at least one image".into());
        }
        for (name, img) in &self.images {
            if !valid_image_name(name) {
                return Err(format!(
                    "image name {name:?}: use 1-64 of a-z, 0-9, '.', '_', '-', starting with a letter or digit"
                ));
            }
            if img.id.len() != 64
                || !img
                    .id
                    .bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
            {
                return Err(format!(
                    "images.{name}.id {:?} is not an image id (64 lowercase hex digits; see `warren image list`)",
                    img.id
                ));
            }
            let range = warren_core::vm::MEMORY_MIB_RANGE;
            for m in [img.min_memory_mib, img.memory_mib].into_iter().flatten() {
                if !range.contains(&m) {
                    return Err(format!("images.{name}: memory {m} MiB outside {range:?}"));
                }
            }
            if let (Some(min), Some(m)) = (img.min_memory_mib, img.memory_mib) {
                if m < min {
                    return Err(format!(
                        "images.{name}: memory_mib {m} is below min_memory_mib {min}"
                    ));
                }
            }
        }
        let defaults = self.images.values().filter(|i| i.default).count();
        if defaults > 1 {
            return Err("more than one image has default = true".into());
        }
        if defaults == 0 && self.images.len() > 1 {
            return Err("mark one image with default = true".into());
        }
        if !(0..=0o777).contains(&self.socket_mode) {
            return Err(format!(
                "socket_mode {:o} is not a permission mode",
                self.socket_mode
            ));
        }
        if self.http.max_body_bytes < 1024 {
            return Err("http.max_body_bytes must be at least 1024".into());
        }
        self.validate_http_caps()?;
        for r in &self.host_roots {
            if !r.path.is_absolute() {
                return Err(format!(
                    "host_roots path {} is not absolute",
                    r.path.display()
                ));
            }
            // Copies and shares of a root run host git and virtiofsd as its uid: as root,
            // every access check passes and a guest writes root-owned files in the tree.
            if r.uid == 0 && !r.allow_root {
                return Err(format!(
                    "host_roots path {}: uid must not be root (name the uid that owns the \
                     tree, or set allow_root = true)",
                    r.path.display()
                ));
            }
            if r.workspaces.is_empty() {
                return Err(format!(
                    "host_roots path {}: name the workspaces whose token holders may use it \
                     (workspaces = [\"alice\"], or [\"*\"] for every workspace)",
                    r.path.display()
                ));
            }
            for w in &r.workspaces {
                if w != "*" && crate::auth::validate_workspace(w).is_err() {
                    return Err(format!(
                        "host_roots path {}: {w:?} is not a workspace name",
                        r.path.display()
                    ));
                }
            }
        }
        for (i, r) in self.intercepts.iter().enumerate() {
            let program_ok = r
                .command
                .first()
                .is_some_and(|p| std::path::Path::new(p).is_absolute());
            if !program_ok {
                return Err(format!(
                    "intercepts[{i}].command must start with an absolute program path"
                ));
            }
            if r.uid == 0 || r.gid == 0 {
                return Err(format!("intercepts[{i}]: uid and gid must not be root"));
            }
            if r.timeout_secs == 0 {
                return Err(format!("intercepts[{i}].timeout_secs must be positive"));
            }
        }
        let header_ok = |h: &String| {
            !h.is_empty()
                && h.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
        };
        if let Some(h) = self.egress.secret_headers.iter().find(|h| !header_ok(h)) {
            return Err(format!("egress.secret_headers: {h:?} is not a header name"));
        }
        for s in &self.secrets {
            if let Some(h) = s.headers.iter().find(|h| !header_ok(h)) {
                return Err(format!("secrets {}: {h:?} is not a header name", s.name));
            }
        }
        for c in &self.egress.blocked_cidrs {
            if parse_cidr(c).is_none() {
                return Err(format!(
                    "egress.blocked_cidrs: {c:?} is not an IPv4 CIDR or address"
                ));
            }
        }
        for (workspace, cidrs) in &self.egress.cidr_grants {
            if crate::auth::validate_workspace(workspace).is_err() {
                return Err(format!(
                    "egress.cidr_grants: {workspace:?} is not a workspace name"
                ));
            }
            if let Some(c) = cidrs.iter().find(|c| parse_cidr(c).is_none()) {
                return Err(format!(
                    "egress.cidr_grants.{workspace}: {c:?} is not an IPv4 CIDR or address"
                ));
            }
        }
        if self.limits.max_vms == Some(0) {
            return Err("limits.max_vms = 0 would refuse every VM".into());
        }
        Ok(())
    }

    /// The `[http]` connection and caller caps: each positive and bounded.
    fn validate_http_caps(&self) -> Result<(), String> {
        let h = &self.http;
        for (key, n, max) in [
            ("max_connections", h.max_connections, 1 << 16),
            (
                "max_connections_per_uid",
                h.max_connections_per_uid,
                1 << 16,
            ),
            ("max_requests_per_token", h.max_requests_per_token, 1 << 16),
            (
                "max_long_polls_per_token",
                h.max_long_polls_per_token,
                1 << 16,
            ),
            ("max_mcp_sessions", h.max_mcp_sessions, 1 << 20),
            (
                "max_mcp_sessions_per_token",
                h.max_mcp_sessions_per_token,
                1 << 20,
            ),
        ] {
            if n == 0 || n > max {
                return Err(format!("http.{key} = {n}: use 1 to {max}"));
            }
        }
        for (key, secs) in [
            ("header_read_timeout_secs", h.header_read_timeout_secs),
            ("idle_timeout_secs", h.idle_timeout_secs),
        ] {
            if secs == 0 || secs > 3600 {
                return Err(format!("http.{key} = {secs}: use 1 to 3600 seconds"));
            }
        }
        Ok(())
    }

    /// The default image's name.
    pub fn default_image(&self) -> &str {
        self.images
            .iter()
            .find(|(_, i)| i.default)
            .or_else(|| self.images.iter().next())
            .map(|(n, _)| n.as_str())
            .unwrap_or_default()
    }

    pub fn image_dir(&self) -> PathBuf {
        self.image_dir
            .clone()
            .unwrap_or_else(|| self.state_dir.join("images"))
    }

    pub fn socket_path(&self) -> PathBuf {
        self.socket
            .clone()
            .unwrap_or_else(|| self.state_dir.join("warrend.sock"))
    }

    /// `Host` header values accepted over HTTP.
    pub fn allowed_hosts(&self) -> Vec<String> {
        if !self.http.allowed_hosts.is_empty() {
            return self
                .http
                .allowed_hosts
                .iter()
                .map(|h| h.to_ascii_lowercase())
                .collect();
        }
        let port = self.http.listen.port();
        let mut v = vec![
            format!("127.0.0.1:{port}"),
            format!("localhost:{port}"),
            format!("[::1]:{port}"),
        ];
        let ip = self.http.listen.ip();
        if !ip.is_loopback() && !ip.is_unspecified() {
            v.push(self.http.listen.to_string());
        }
        v
    }

    pub fn host_limits(&self) -> warren_core::Limits {
        warren_core::Limits {
            max_vms: self.limits.max_vms,
            max_memory_mib: self.limits.max_memory_mib,
            max_storage_mib: self.limits.max_storage_gib.map(|g| g * 1024),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    fn parse(t: &str) -> Result<ServiceConfig, ConfigError> {
        ServiceConfig::parse(Path::new("t.toml"), t)
    }

    #[test]
    fn test_minimal_config_defaults() {
        let c = parse(&format!(
            "state_dir = \"/s\"\n[images.dev]\nid = \"{ID}\"\n"
        ))
        .expect("parse");
        assert_eq!(c.default_image(), "dev");
        assert_eq!(c.http.listen.to_string(), "127.0.0.1:8090");
        assert!(c.allowed_hosts().contains(&"localhost:8090".to_string()));
        assert_eq!(c.socket_path(), Path::new("/s/warrend.sock"));
        assert_eq!(c.http.max_connections, 512);
        assert_eq!(c.http.max_connections_per_uid, 64);
        assert_eq!(c.http.header_read_timeout_secs, 10);
        assert_eq!(c.http.max_requests_per_token, 32);
    }

    #[test]
    fn test_http_caps_parsed_and_zero_refused() {
        let base = format!("state_dir = \"/s\"\n[images.dev]\nid = \"{ID}\"\n");
        let c = parse(&format!(
            "{base}[http]\nmax_connections = 64\nheader_read_timeout_secs = 2\n\
             idle_timeout_secs = 5\nmax_requests_per_token = 4\nmax_long_polls_per_token = 2\n\
             max_mcp_sessions = 3\nmax_mcp_sessions_per_token = 1\n"
        ))
        .expect("caps");
        assert_eq!(
            (c.http.max_connections, c.http.header_read_timeout_secs),
            (64, 2)
        );
        assert_eq!(
            (c.http.max_mcp_sessions, c.http.max_mcp_sessions_per_token),
            (3, 1)
        );
        for bad in [
            "max_connections = 0",
            "max_connections_per_uid = 0",
            "idle_timeout_secs = 0",
            "max_long_polls_per_token = 0",
            "header_read_timeout_secs = 7200",
        ] {
            let e = parse(&format!("{base}[http]\n{bad}\n")).expect_err(bad);
            let key = bad.split(' ').next().unwrap_or_default();
            assert!(e.to_string().contains(key), "{bad}: {e}");
        }
        let e = parse(&format!("{base}[http]\nmax_conections = 5\n")).expect_err("typo");
        assert!(e.to_string().contains("max_conections"), "{e}");
    }

    /// A host root names the workspaces it is for; none named (the old form) or a name
    /// that is no workspace's is refused at startup, saying what to write.
    #[test]
    fn test_host_roots_name_their_workspaces() {
        let base = format!("state_dir = \"/s\"\n[images.dev]\nid = \"{ID}\"\n");
        let root = "[[host_roots]]\npath = \"/srv/repos\"\nuid = 1000\n";
        let e = parse(&format!("{base}{root}")).expect_err("no workspaces");
        assert!(e.to_string().contains("workspaces = [\"alice\"]"), "{e}");
        let e = parse(&format!("{base}{root}workspaces = [\"Not A Name\"]\n")).expect_err("bad");
        assert!(e.to_string().contains("is not a workspace name"), "{e}");
        let c = parse(&format!("{base}{root}workspaces = [\"alice\", \"bob\"]\n")).expect("ok");
        assert!(c.host_roots[0].admits("bob") && !c.host_roots[0].admits("carol"));
        let c = parse(&format!("{base}{root}workspaces = [\"*\"]\n")).expect("every");
        assert!(c.host_roots[0].admits("carol"));
        let as_root = "[[host_roots]]\npath = \"/srv/repos\"\nuid = 0\nworkspaces = [\"*\"]\n";
        let e = parse(&format!("{base}{as_root}")).expect_err("root");
        assert!(e.to_string().contains("uid must not be root"), "{e}");
        parse(&format!("{base}{as_root}allow_root = true\n")).expect("allowed");
    }

    #[test]
    fn test_unknown_keys_fail() {
        let e = parse(&format!(
            "state_dir = \"/s\"\nbogus = 1\n[images.dev]\nid = \"{ID}\"\n"
        ))
        .expect_err("unknown key");
        assert!(e.to_string().contains("bogus"), "{e}");
        let e = parse(&format!(
            "state_dir = \"/s\"\n[images.dev]\nid = \"{ID}\"\nsize = 3\n"
        ))
        .expect_err("unknown image key");
        assert!(e.to_string().contains("size"), "{e}");
    }

    #[test]
    fn test_malformed_ids_and_defaults_fail() {
        assert!(parse("state_dir = \"/s\"\n[images.dev]\nid = \"abc\"\n").is_err());
        assert!(parse(&format!(
            "state_dir = \"/s\"\n[images.a]\nid = \"{ID}\"\n[images.b]\nid = \"{ID}\"\n"
        ))
        .is_err());
        assert!(parse(&format!(
            "state_dir = \"/s\"\n[images.Bad]\nid = \"{ID}\"\n"
        ))
        .is_err());
        assert!(parse(&format!(
            "state_dir = \"/s\"\n[images.a]\nid = \"{ID}\"\nmin_memory_mib = 1024\nmemory_mib = 512\n"
        ))
        .is_err());
    }

    #[test]
    fn test_intercepts_and_json_secrets_checked() {
        let base = format!("state_dir = \"/s\"\n[images.dev]\nid = \"{ID}\"\n");
        let rule = |extra: &str| {
            format!(
                "{base}[[intercepts]]\nworkspace = \"w\"\nhost = \"a.example\"\nmethod = \"POST\"\n\
                 path_prefix = \"/t\"\n{extra}"
            )
        };
        let ok = parse(&rule("command = [\"/bin/hook\"]\nuid = 1000\ngid = 1000\n"))
            .expect("valid rule");
        assert_eq!(ok.intercepts[0].timeout_secs, 60);
        for (bad, word) in [
            ("command = [\"hook\"]\nuid = 1000\ngid = 1000\n", "absolute"),
            ("command = []\nuid = 1000\ngid = 1000\n", "absolute"),
            ("command = [\"/bin/hook\"]\nuid = 0\ngid = 1000\n", "root"),
            (
                "command = [\"/bin/hook\"]\nuid = 1000\ngid = 1000\ntimeout_secs = 0\n",
                "timeout",
            ),
            (
                "command = [\"/bin/hook\"]\nuid = 1000\ngid = 1000\nshell = true\n",
                "shell",
            ),
        ] {
            let e = parse(&rule(bad)).expect_err(bad);
            assert!(e.to_string().contains(word), "{bad}: {e}");
        }
        let c = parse(&format!(
            "{base}[[secrets]]\nworkspace = \"w\"\nname = \"n\"\nplaceholder = \"PLACEHOLDER1\"\n\
             hosts = [\"a.example\"]\nfile = \"/f.json\"\njson_pointer = \"/t\"\n\
             headers = [\"x-api-key\"]\n"
        ))
        .expect("JSON-field secret");
        assert_eq!(c.secrets[0].json_pointer.as_deref(), Some("/t"));
        assert_eq!(c.secrets[0].headers, ["x-api-key"]);
        let e = parse(&format!(
            "{base}[[secrets]]\nworkspace = \"w\"\nname = \"n\"\nplaceholder = \"PLACEHOLDER1\"\n\
             hosts = [\"a.example\"]\nfile = \"/f\"\nheaders = [\"x api key\"]\n"
        ))
        .expect_err("bad header name");
        assert!(e.to_string().contains("header name"), "{e}");
    }

    #[test]
    fn test_egress_settings_parsed_and_checked() {
        let base = format!("state_dir = \"/s\"\n[images.dev]\nid = \"{ID}\"\n");
        let c = parse(&format!(
            "{base}[egress]\nblocked_cidrs = [\"198.51.100.0/24\", \"192.0.2.1\"]\n\
             intercept_all_tls = true\nhost_ca_store = true\nsecret_headers = [\"x-api-key\"]\n\
             [egress.cidr_grants]\nci = [\"203.0.113.0/24\"]\n"
        ))
        .expect("egress settings");
        assert_eq!(c.egress.blocked_cidrs, ["198.51.100.0/24", "192.0.2.1"]);
        assert!(c.egress.intercept_all_tls && c.egress.host_ca_store);
        assert_eq!(c.egress.secret_headers, ["x-api-key"]);
        assert_eq!(c.egress.cidr_grants["ci"], ["203.0.113.0/24"]);
        let none = parse(&base).expect("defaults");
        assert!(none.egress.blocked_cidrs.is_empty() && none.egress.cidr_grants.is_empty());
        for (bad, word) in [
            (
                "[egress]\nblocked_cidrs = [\"example.com\"]\n",
                "blocked_cidrs",
            ),
            (
                "[egress]\nblocked_cidrs = [\"10.0.0.0/33\"]\n",
                "blocked_cidrs",
            ),
            ("[egress.cidr_grants]\nci = [\"nope\"]\n", "cidr_grants.ci"),
            (
                "[egress.cidr_grants]\n\"Bad Name\" = []\n",
                "workspace name",
            ),
            ("[egress]\nallow_cidrs = []\n", "allow_cidrs"),
        ] {
            let e = parse(&format!("{base}{bad}")).expect_err(bad);
            assert!(e.to_string().contains(word), "{bad}: {e}");
        }
    }
}
