//! MCP over Streamable HTTP at [`PATH`]: a thin adapter from rmcp's [`ServerHandler`] onto
//! [`Service::call`], so MCP and `POST /v1/tools/{tool}` run the same code and answer with the
//! same error codes.
//!
//! How a tool call travels:
//! 1. [`crate::http`] guards the request (no `Origin`, `Host` allowlist, body limit),
//!    authenticates it and inserts the caller's [`Principal`] into the request's extensions.
//! 2. rmcp's [`StreamableHttpService`] parses the JSON-RPC message and moves the rest of that
//!    same HTTP request (its [`http::request::Parts`], extensions included) into the message's
//!    extensions, which become [`RequestContext::extensions`]. This holds for every POST,
//!    stateful or stateless, so the principal is always the one of the request that carried
//!    this particular call, never one cached from the session's `initialize`.
//! 3. `WarrenMcp::call_tool` takes the principal from there and calls [`Service::call`]; the
//!    result, or the [`ApiError`] body, goes back as structured content and as compact JSON text.
//!
//! Sessions (the pre-2026-07-28 protocol; newer clients are served statelessly) live in rmcp's
//! in-memory [`LocalSessionManager`], one `WarrenMcp` per session. Invariants:
//! - a session ends after [`SESSION_IDLE_TIMEOUT`] without traffic, on `DELETE`, or at shutdown;
//! - a session belongs to the workspace that initialized it: calls from another are refused;
//! - a workspace holds at most [`MAX_SESSIONS_PER_WORKSPACE`] sessions at once, counted by
//!   `SessionSlot`s that live exactly as long as their session's handler.
//!
//! rmcp's own DNS-rebinding checks (`Host`/`Origin` allow-lists) are turned off: the guard in
//! [`crate::http`] is the single place that decides, for MCP and JSON alike.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use axum::Router;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, Extensions, Implementation,
    InitializeRequestParams, InitializeResult, ListToolsResult, PaginatedRequestParams,
    ServerCapabilities, ServerConfig, Tool,
};
use rmcp::service::RequestContext;
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use rmcp::{ErrorData as McpError, RoleServer, ServerHandler};
use serde_json::Value;

use crate::auth::Principal;
use crate::error::ApiError;
use crate::service::{Service, ToolDef};

/// Where MCP is served.
pub const PATH: &str = "/mcp";

/// A session without any traffic for this long is closed. rmcp counts idle time between the
/// session's messages, so this must exceed the longest single tool call (a `vm_create` booting
/// under TCG takes minutes); agents idle for longer re-initialize, as the protocol expects.
pub const SESSION_IDLE_TIMEOUT: Duration = Duration::from_secs(15 * 60);

/// Sessions one workspace may hold at once: generous for several agents, small enough that
/// one workspace cannot fill the service's memory with sessions it never closes.
pub const MAX_SESSIONS_PER_WORKSPACE: usize = 64;

/// Sent to clients at `initialize`; models read it as the server's usage notes.
const INSTRUCTIONS: &str = "Warren runs commands in private Linux microVMs. \
Create one with vm_create, run commands with vm_exec (give wait_ms to wait for short commands), \
and read a job's output with vm_job_output: pass the next_cursor of the previous page and keep \
reading until state is \"completed\". Files move with vm_read_file and vm_write_file (every \
read returns the file's version; pass it as expected_version to write or vm_edit_file only \
if nobody changed the file since); vm_glob and vm_grep search /workspace; \
vm_destroy frees the VM. vm_create and vm_exec take a request_id: retrying with the same one \
never creates or runs anything twice. Failures carry a stable error code in \
structuredContent.error.code.";

/// The `/mcp` routes. Merge them into a router whose middleware authenticates every request
/// and inserts the [`Principal`] into its extensions; without it every call is refused.
pub fn router<S>(service: Arc<Service>) -> Router<S>
where
    S: Clone + Send + Sync + 'static,
{
    routes(service, Arc::new(SessionCounts::default()))
}

fn routes<S>(service: Arc<Service>, sessions: Arc<SessionCounts>) -> Router<S>
where
    S: Clone + Send + Sync + 'static,
{
    // The tool list is fixed for the service's life (`tools()` borrows from it): build the
    // MCP form once and share it between sessions.
    let tools: Arc<[Tool]> = service.tools().iter().map(mcp_tool).collect();

    let mut manager = LocalSessionManager::default();
    manager.session_config.keep_alive = Some(SESSION_IDLE_TIMEOUT);

    let config = StreamableHttpServerConfig::default()
        // Our guard enforces the Host allowlist and refuses any Origin (see module docs).
        .disable_allowed_hosts()
        .disable_allowed_origins()
        // The same limit as the HTTP layer's, so both refuse the same bodies.
        .with_max_request_body_bytes(service.config().http.max_body_bytes);

    let mcp = StreamableHttpService::new(
        move || {
            Ok(WarrenMcp {
                service: service.clone(),
                tools: tools.clone(),
                sessions: sessions.clone(),
                slot: OnceLock::new(),
            })
        },
        Arc::new(manager),
        config,
    );
    Router::new().route_service(PATH, mcp)
}

/// A [`ToolDef`] as MCP lists it.
fn mcp_tool(def: &ToolDef) -> Tool {
    Tool::new(
        def.name,
        def.description,
        Arc::new(def.input_schema.clone()),
    )
    .with_raw_output_schema(Arc::new(def.output_schema.clone()))
}

/// The principal our authentication middleware attached to the HTTP request that carried
/// this message.
fn principal(extensions: &Extensions) -> Option<&Principal> {
    extensions
        .get::<http::request::Parts>()?
        .extensions
        .get::<Principal>()
}

fn unauthenticated() -> ApiError {
    ApiError::new(
        "unauthenticated",
        "the request carried no authenticated principal",
    )
}

/// A tool result: the value as structured content and as compact JSON text (for clients that
/// only show text). Errors carry `{"error":{"code","message"}}` the same way, flagged `isError`.
fn tool_result(result: Result<Value, ApiError>) -> CallToolResult {
    match result {
        Ok(v) => CallToolResult::structured(v),
        Err(e) => CallToolResult::structured_error(e.body()),
    }
}

/// Live sessions per workspace.
#[derive(Debug, Default)]
struct SessionCounts {
    /// Workspace -> sessions it holds; entries at zero are removed. Guards only this map;
    /// never held across an await.
    per_workspace: Mutex<HashMap<String, usize>>,
}

impl SessionCounts {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, usize>> {
        // The map stays consistent even if a holder panicked: every update is one statement.
        self.per_workspace.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Counts one more session for `workspace`, unless it already holds the maximum.
    fn claim(self: &Arc<Self>, workspace: &str) -> Result<SessionSlot, ApiError> {
        let mut map = self.lock();
        let n = map.entry(workspace.to_string()).or_insert(0);
        if *n >= MAX_SESSIONS_PER_WORKSPACE {
            return Err(ApiError::new(
                "quota_exceeded",
                format!(
                    "workspace {workspace} already holds {MAX_SESSIONS_PER_WORKSPACE} MCP sessions; \
                     close some (HTTP DELETE) or let them expire"
                ),
            ));
        }
        *n += 1;
        Ok(SessionSlot {
            counts: self.clone(),
            workspace: workspace.to_string(),
        })
    }

    #[cfg(test)]
    fn held(&self, workspace: &str) -> usize {
        self.lock().get(workspace).copied().unwrap_or(0)
    }
}

/// One session's place in [`SessionCounts`], released when the session's handler is dropped
/// (rmcp drops it when the session ends, however it ends).
#[derive(Debug)]
struct SessionSlot {
    counts: Arc<SessionCounts>,
    /// The workspace that initialized the session and alone may use it.
    workspace: String,
}

impl Drop for SessionSlot {
    fn drop(&mut self) {
        let mut map = self.counts.lock();
        if let Some(n) = map.get_mut(&self.workspace) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                map.remove(&self.workspace);
            }
        }
    }
}

/// The MCP server: one per session, or one per request for stateless clients.
struct WarrenMcp {
    service: Arc<Service>,
    tools: Arc<[Tool]>,
    sessions: Arc<SessionCounts>,
    /// Set by `initialize`; stateless requests never have one.
    slot: OnceLock<SessionSlot>,
}

impl WarrenMcp {
    /// Binds the session to the initializing workspace and counts it.
    fn open_session(&self, principal: Option<&Principal>) -> Result<(), ApiError> {
        let p = principal.ok_or_else(unauthenticated)?;
        if let Some(slot) = self.slot.get() {
            // A repeated `initialize` in the same session: allowed only for its owner.
            return if slot.workspace == p.workspace {
                Ok(())
            } else {
                Err(session_not_yours())
            };
        }
        let slot = self.sessions.claim(&p.workspace)?;
        // Two concurrent `initialize`s of one session: the loser's slot drops here, uncounted.
        let _ = self.slot.set(slot);
        Ok(())
    }

    /// The caller of one tool call, checked against the session's owner.
    fn caller<'a>(&self, extensions: &'a Extensions) -> Result<&'a Principal, ApiError> {
        let p = principal(extensions).ok_or_else(unauthenticated)?;
        match self.slot.get() {
            Some(slot) if slot.workspace != p.workspace => Err(session_not_yours()),
            _ => Ok(p),
        }
    }
}

fn session_not_yours() -> ApiError {
    ApiError::forbidden("this MCP session belongs to another workspace")
}

impl ServerHandler for WarrenMcp {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(Implementation::new("warren", env!("CARGO_PKG_VERSION")))
            .with_instructions(INSTRUCTIONS)
    }

    async fn initialize(
        &self,
        request: InitializeRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<InitializeResult, McpError> {
        if let Err(e) = self.open_session(principal(&context.extensions)) {
            tracing::info!(code = e.code, "MCP session refused");
            return Err(McpError::invalid_request(e.to_string(), Some(e.body())));
        }
        // What the default `initialize` does.
        context.peer.set_peer_info(request.clone());
        self.negotiate_initialize(&request)
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, McpError> {
        Ok(ListToolsResult::with_all_items(self.tools.to_vec()))
    }

    /// Lets rmcp check `Mcp-Param-*` headers against the called tool's input schema.
    fn get_tool(&self, name: &str) -> Option<Tool> {
        self.tools.iter().find(|t| t.name == name).cloned()
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, McpError> {
        let tool = request.name;
        let result = match self.caller(&context.extensions) {
            Ok(p) => {
                let args = Value::Object(request.arguments.unwrap_or_default());
                // Unknown names go through too: the service answers `unknown_tool`.
                self.service.call(p, &tool, args).await
            }
            Err(e) => {
                tracing::warn!(tool = %tool, code = e.code, "MCP tool call refused");
                Err(e)
            }
        };
        Ok(tool_result(result).into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts_with(principal: Option<Principal>) -> Extensions {
        let mut req = http::Request::new(());
        if let Some(p) = principal {
            req.extensions_mut().insert(p);
        }
        let (parts, ()) = req.into_parts();
        let mut ext = Extensions::new();
        ext.insert(parts);
        ext
    }

    #[test]
    fn test_principal_from_http_parts_found() {
        let ext = parts_with(Some(Principal::local(1000)));
        assert_eq!(principal(&ext), Some(&Principal::local(1000)));
    }

    #[test]
    fn test_principal_missing_from_parts_none() {
        assert_eq!(principal(&parts_with(None)), None);
        assert_eq!(principal(&Extensions::new()), None);
    }

    #[test]
    fn test_tool_result_ok_structured_and_compact_text() {
        let v = serde_json::json!({"vm_id": "vm-1", "n": [1, 2]});
        let r = tool_result(Ok(v.clone()));
        assert_eq!(r.is_error, Some(false));
        assert_eq!(r.structured_content, Some(v));
        let text = r.content[0].as_text().map(|t| t.text.clone());
        assert_eq!(text.as_deref(), Some(r#"{"n":[1,2],"vm_id":"vm-1"}"#));
    }

    #[test]
    fn test_tool_result_err_carries_code_as_structure_and_text() {
        let e = ApiError::new("unknown_tool", "no tool \"x\"");
        let r = tool_result(Err(e.clone()));
        assert_eq!(r.is_error, Some(true));
        assert_eq!(r.structured_content, Some(e.body()));
        let text = r.content[0].as_text().map(|t| t.text.clone());
        assert_eq!(text, Some(e.body().to_string()));
        assert!(text.is_some_and(|t| t.contains(r#""code":"unknown_tool""#)));
    }

    // --- The router, driven with JSON-RPC over HTTP as a client would. ---

    use axum::body::Body;
    use axum::extract::Request;
    use axum::middleware::{self, Next};
    use tower::ServiceExt;

    /// Test-only stand-in for `crate::http`'s authentication: the workspace named by this
    /// header becomes the principal; without it no principal is attached.
    const TEST_WORKSPACE: &str = "x-test-workspace";
    const LEGACY_VERSION: &str = "2025-06-18";

    async fn attach_principal(mut req: Request, next: Next) -> axum::response::Response {
        let ws = req
            .headers()
            .get(TEST_WORKSPACE)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        if let Some(workspace) = ws {
            req.extensions_mut().insert(Principal {
                workspace,
                policy: crate::auth::Policy::default(),
                via: crate::auth::Via::Token {
                    token_id: "t".into(),
                },
            });
        }
        next.run(req).await
    }

    struct Fixture {
        _dir: tempfile::TempDir,
        app: Router,
        sessions: Arc<SessionCounts>,
    }

    fn fixture() -> Fixture {
        let dir = tempfile::tempdir().expect("tempdir");
        let text = format!(
            "state_dir = {:?}\naccel = \"tcg\"\n[images.dev]\nid = \"{}\"\n",
            dir.path().join("state"),
            "0".repeat(64)
        );
        let cfg = crate::config::ServiceConfig::parse(std::path::Path::new("t.toml"), &text)
            .expect("config");
        let service =
            Service::open(cfg, dir.path().join("no-supervisor")).expect("open the service");
        let sessions = Arc::new(SessionCounts::default());
        let app = routes(Arc::new(service), sessions.clone())
            .layer(middleware::from_fn(attach_principal));
        Fixture {
            _dir: dir,
            app,
            sessions,
        }
    }

    /// POSTs one JSON-RPC message; returns the session id header and the JSON-RPC reply
    /// (the last `data:` of the SSE body), if any.
    async fn post(
        app: &Router,
        workspace: Option<&str>,
        session: Option<&str>,
        msg: Value,
    ) -> (Option<String>, Option<Value>) {
        let mut req = http::Request::post(PATH)
            .header(http::header::HOST, "localhost")
            .header(http::header::CONTENT_TYPE, "application/json")
            .header(http::header::ACCEPT, "application/json, text/event-stream");
        if let Some(ws) = workspace {
            req = req.header(TEST_WORKSPACE, ws);
        }
        if let Some(id) = session {
            req = req
                .header("mcp-session-id", id)
                .header("mcp-protocol-version", LEGACY_VERSION);
        }
        let req = req.body(Body::from(msg.to_string())).expect("request");
        let resp = tokio::time::timeout(Duration::from_secs(20), app.clone().oneshot(req))
            .await
            .expect("response in time")
            .expect("infallible");
        let status = resp.status();
        let sid = resp
            .headers()
            .get("mcp-session-id")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let body = tokio::time::timeout(
            Duration::from_secs(20),
            axum::body::to_bytes(resp.into_body(), 1 << 20),
        )
        .await
        .expect("body in time")
        .expect("body");
        let text = String::from_utf8_lossy(&body);
        assert!(status.is_success(), "{status}: {text}");
        let reply = text
            .lines()
            .filter_map(|l| l.strip_prefix("data:"))
            .map(str::trim)
            .filter(|d| !d.is_empty())
            .filter_map(|d| serde_json::from_str::<Value>(d).ok())
            .next_back();
        (sid, reply)
    }

    async fn open_session(app: &Router, workspace: &str) -> String {
        let init = serde_json::json!({
            "jsonrpc": "2.0", "id": 1, "method": "initialize",
            "params": {
                "protocolVersion": LEGACY_VERSION,
                "capabilities": {},
                "clientInfo": {"name": "test", "version": "0"}
            }
        });
        let (sid, reply) = post(app, Some(workspace), None, init).await;
        let reply = reply.expect("initialize reply");
        assert_eq!(reply["result"]["serverInfo"]["name"], "warren", "{reply}");
        assert!(
            reply["result"]["capabilities"]["tools"].is_object(),
            "{reply}"
        );
        let sid = sid.expect("a session id");
        let note = serde_json::json!({"jsonrpc": "2.0", "method": "notifications/initialized"});
        post(app, Some(workspace), Some(&sid), note).await;
        sid
    }

    fn call(id: u64, tool: &str, args: Value) -> Value {
        serde_json::json!({
            "jsonrpc": "2.0", "id": id, "method": "tools/call",
            "params": {"name": tool, "arguments": args}
        })
    }

    #[tokio::test]
    async fn test_router_session_lists_tools_with_schemas() {
        let f = fixture();
        let sid = open_session(&f.app, "ws-a").await;
        let list = serde_json::json!({"jsonrpc": "2.0", "id": 2, "method": "tools/list"});
        let (_, reply) = post(&f.app, Some("ws-a"), Some(&sid), list).await;
        let reply = reply.expect("tools/list reply");
        let tools = reply["result"]["tools"].as_array().expect("tools");
        let create = tools
            .iter()
            .find(|t| t["name"] == "vm_create")
            .expect("vm_create listed");
        assert_eq!(create["inputSchema"]["type"], "object", "{create}");
        assert!(create["outputSchema"].is_object(), "{create}");
    }

    #[tokio::test]
    async fn test_router_call_uses_principal_of_each_request() {
        let f = fixture();
        let sid = open_session(&f.app, "ws-a").await;

        let (_, ok) = post(
            &f.app,
            Some("ws-a"),
            Some(&sid),
            call(2, "vm_list", serde_json::json!({})),
        )
        .await;
        let ok = ok.expect("reply");
        assert_eq!(ok["result"]["isError"], false, "{ok}");
        assert_eq!(
            ok["result"]["structuredContent"],
            serde_json::json!({"vms": []})
        );

        // The same session, but a request without a principal: refused, not served as ws-a.
        let (_, none) = post(
            &f.app,
            None,
            Some(&sid),
            call(3, "vm_list", serde_json::json!({})),
        )
        .await;
        let none = none.expect("reply");
        assert_eq!(none["result"]["isError"], true, "{none}");
        assert_eq!(
            none["result"]["structuredContent"]["error"]["code"],
            "unauthenticated"
        );

        // Another workspace presenting ws-a's session id.
        let (_, other) = post(
            &f.app,
            Some("ws-b"),
            Some(&sid),
            call(4, "vm_list", serde_json::json!({})),
        )
        .await;
        let other = other.expect("reply");
        assert_eq!(
            other["result"]["structuredContent"]["error"]["code"], "forbidden",
            "{other}"
        );
    }

    #[tokio::test]
    async fn test_router_unknown_tool_is_a_tool_error_with_code_in_text() {
        let f = fixture();
        let sid = open_session(&f.app, "ws-a").await;
        let (_, r) = post(
            &f.app,
            Some("ws-a"),
            Some(&sid),
            call(2, "no_such_tool", serde_json::json!({})),
        )
        .await;
        let r = r.expect("reply");
        assert_eq!(r["result"]["isError"], true, "{r}");
        assert_eq!(
            r["result"]["structuredContent"]["error"]["code"],
            "unknown_tool"
        );
        let text = r["result"]["content"][0]["text"]
            .as_str()
            .unwrap_or_default();
        assert!(text.contains(r#""code":"unknown_tool""#), "{text}");
    }

    #[tokio::test]
    async fn test_router_session_delete_releases_its_slot() {
        let f = fixture();
        let sid = open_session(&f.app, "ws-a").await;
        assert_eq!(f.sessions.held("ws-a"), 1);
        let req = http::Request::delete(PATH)
            .header(http::header::HOST, "localhost")
            .header(TEST_WORKSPACE, "ws-a")
            .header("mcp-session-id", &sid)
            .header("mcp-protocol-version", LEGACY_VERSION)
            .body(Body::empty())
            .expect("request");
        let resp = f.app.clone().oneshot(req).await.expect("infallible");
        assert!(resp.status().is_success(), "{}", resp.status());
        // The session's handler is dropped by its worker task, just after the DELETE returns.
        for _ in 0..100 {
            if f.sessions.held("ws-a") == 0 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("the session's slot was not released");
    }

    #[tokio::test]
    async fn test_router_initialize_without_principal_refused() {
        let f = fixture();
        let init = serde_json::json!({
            "jsonrpc": "2.0", "id": 1, "method": "initialize",
            "params": {
                "protocolVersion": LEGACY_VERSION,
                "capabilities": {},
                "clientInfo": {"name": "test", "version": "0"}
            }
        });
        let (_, reply) = post(&f.app, None, None, init).await;
        let reply = reply.expect("reply");
        assert_eq!(
            reply["error"]["data"]["error"]["code"], "unauthenticated",
            "{reply}"
        );
    }

    #[test]
    fn test_session_counts_over_limit_refused_and_released_on_drop() {
        let counts = Arc::new(SessionCounts::default());
        let slots: Vec<_> = (0..MAX_SESSIONS_PER_WORKSPACE)
            .map(|_| counts.claim("ws-a").expect("under the limit"))
            .collect();
        let refused = counts.claim("ws-a").expect_err("at the limit");
        assert_eq!(refused.code, "quota_exceeded");
        // Other workspaces are unaffected.
        let other = counts.claim("ws-b").expect("another workspace");
        drop(slots);
        assert_eq!(counts.held("ws-a"), 0);
        assert_eq!(counts.held("ws-b"), 1);
        drop(other);
        assert!(counts.lock().is_empty());
    }
}
