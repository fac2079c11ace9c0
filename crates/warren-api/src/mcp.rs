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
//! - a session belongs to the workspace and credential that initialized it: every request
//!   naming it (POST, the GET stream, DELETE) from anyone else is refused before rmcp sees it
//!   (`sessions::bind`), and each tool call checks the owner again;
//! - a session ends within [`crate::ws::RECHECK`] of its token being revoked or expiring
//!   (`sessions::spawn_recheck`), its open event stream with it;
//! - a credential holds at most `http.max_mcp_sessions_per_token` sessions at once, a
//!   workspace at most [`MAX_SESSIONS_PER_WORKSPACE`], the service at most
//!   `http.max_mcp_sessions`, counted by `SessionSlot`s that live exactly as long as their
//!   session's handler (the refused `initialize` gets `quota_exceeded`);
//! - session ids are never logged (`sessions`).
//!
//! rmcp's own DNS-rebinding checks (`Host`/`Origin` allow-lists) are turned off: the guard in
//! [`crate::http`] is the single place that decides, for MCP and JSON alike.

mod sessions;

use std::sync::{Arc, OnceLock};
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

use self::sessions::{unauthenticated, Bindings, Owner, SessionCounts, SessionLimits, SessionSlot};
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
    let limits = SessionLimits::from_config(&service.config().http);
    let (router, bindings) = routes(service.clone(), Arc::new(SessionCounts::new(limits)));
    sessions::spawn_recheck(&bindings, service);
    router
}

/// The routes, and the session bindings their middleware keeps (for tests).
fn routes<S>(service: Arc<Service>, sessions: Arc<SessionCounts>) -> (Router<S>, Arc<Bindings>)
where
    S: Clone + Send + Sync + 'static,
{
    // The tool list is fixed for the service's life (`tools()` borrows from it): build the
    // MCP form once and share it between sessions.
    let tools: Arc<[Tool]> = service.tools().iter().map(mcp_tool).collect();

    let mut manager = LocalSessionManager::default();
    manager.session_config.keep_alive = Some(SESSION_IDLE_TIMEOUT);
    let manager = Arc::new(manager);
    let bindings = Arc::new(Bindings::new(manager.clone()));

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
        manager,
        config,
    );
    let router =
        Router::new()
            .route_service(PATH, mcp)
            .route_layer(axum::middleware::from_fn_with_state(
                bindings.clone(),
                sessions::bind,
            ));
    (router, bindings)
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

/// A tool result: the value as structured content and as compact JSON text (for clients that
/// only show text). Errors carry `{"error":{"code","message"}}` the same way, flagged `isError`.
fn tool_result(result: Result<Value, ApiError>) -> CallToolResult {
    match result {
        Ok(v) => CallToolResult::structured(v),
        Err(e) => CallToolResult::structured_error(e.body()),
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
    /// Binds the session to the initializing owner and counts it.
    fn open_session(&self, principal: Option<&Principal>) -> Result<(), ApiError> {
        let owner = Owner::of(principal.ok_or_else(unauthenticated)?);
        if let Some(slot) = self.slot.get() {
            // A repeated `initialize` in the same session: allowed only for its owner.
            return if slot.owner == owner {
                Ok(())
            } else {
                Err(session_not_yours())
            };
        }
        let slot = self.sessions.claim(owner)?;
        // Two concurrent `initialize`s of one session: the loser's slot drops here, uncounted.
        let _ = self.slot.set(slot);
        Ok(())
    }

    /// The caller of one tool call, checked against the session's owner (again: the
    /// middleware already refused requests naming a session the caller does not hold).
    fn caller<'a>(&self, extensions: &'a Extensions) -> Result<&'a Principal, ApiError> {
        let p = principal(extensions).ok_or_else(unauthenticated)?;
        match self.slot.get() {
            Some(slot) if slot.owner != Owner::of(p) => Err(session_not_yours()),
            _ => Ok(p),
        }
    }
}

fn session_not_yours() -> ApiError {
    ApiError::forbidden("this MCP session belongs to another caller")
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
        context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, McpError> {
        // A workspace limited to some images sees only those in `image`'s enum.
        match principal(&context.extensions) {
            Some(p) if p.policy.images.is_some() => Ok(ListToolsResult::with_all_items(
                self.service.tools_for(p).iter().map(mcp_tool).collect(),
            )),
            _ => Ok(ListToolsResult::with_all_items(self.tools.to_vec())),
        }
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
                let held = context
                    .extensions
                    .get::<http::request::Parts>()
                    .and_then(|parts| parts.extensions.get::<crate::caps::HeldSlot>())
                    .cloned();
                // The HTTP middleware claims every request's slot (`crate::http`); a router
                // served without it claims one here.
                let held = match held {
                    Some(held) => Ok(held),
                    None => self
                        .service
                        .caps()
                        .request(p)
                        .map(crate::caps::HeldSlot::new),
                };
                match held {
                    // Unknown names go through too: the service answers `unknown_tool`.
                    Ok(held) => self.service.call_to_end(p, &tool, args, held).await,
                    Err(e) => Err(e),
                }
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
    use http::{Method, StatusCode};
    use tower::ServiceExt;

    /// Test-only stand-in for `crate::http`'s authentication: the workspace named by this
    /// header becomes the principal, authenticated by the token named by [`TEST_TOKEN`]
    /// (default `t`); without it no principal is attached.
    const TEST_WORKSPACE: &str = "x-test-workspace";
    const TEST_TOKEN: &str = "x-test-token";
    const LEGACY_VERSION: &str = "2025-06-18";

    async fn attach_principal(mut req: Request, next: Next) -> axum::response::Response {
        let header = |h: &http::HeaderMap, name: &str| {
            h.get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        };
        let (ws, token) = (
            header(req.headers(), TEST_WORKSPACE),
            header(req.headers(), TEST_TOKEN),
        );
        if let Some(workspace) = ws {
            req.extensions_mut().insert(Principal {
                workspace,
                policy: crate::auth::Policy::default(),
                via: crate::auth::Via::Token {
                    token_id: token.unwrap_or_else(|| "t".into()),
                },
            });
        }
        next.run(req).await
    }

    struct Fixture {
        _dir: tempfile::TempDir,
        service: Arc<Service>,
        app: Router,
        sessions: Arc<SessionCounts>,
        bindings: Arc<Bindings>,
    }

    /// A service on a fresh state directory in `dir` (no VM is ever started).
    fn test_service(dir: &std::path::Path) -> Arc<Service> {
        let text = format!(
            "state_dir = {:?}\naccel = \"tcg\"\n[images.dev]\nid = \"{}\"\n",
            dir.join("state"),
            "0".repeat(64)
        );
        let cfg = crate::config::ServiceConfig::parse(std::path::Path::new("t.toml"), &text)
            .expect("config");
        Arc::new(Service::open(cfg, dir.join("no-supervisor")).expect("open the service"))
    }

    fn fixture() -> Fixture {
        let dir = tempfile::tempdir().expect("tempdir");
        let sessions = Arc::new(SessionCounts::default());
        let service = test_service(dir.path());
        let (app, bindings) = routes(service.clone(), sessions.clone());
        let app = app.layer(middleware::from_fn(attach_principal));
        Fixture {
            _dir: dir,
            service,
            app,
            sessions,
            bindings,
        }
    }

    /// Who sends a request: a workspace and the token it authenticates with.
    #[derive(Clone, Copy)]
    struct As<'a>(&'a str, &'a str);
    const A: As = As("ws-a", "t");

    /// One request to `/mcp`; returns the response with its body unread (a GET's stream
    /// never ends).
    async fn send(
        app: &Router,
        method: Method,
        who: Option<As<'_>>,
        session: Option<&str>,
        msg: Option<Value>,
    ) -> axum::response::Response {
        let mut req = http::Request::builder()
            .method(method)
            .uri(PATH)
            .header(http::header::HOST, "localhost")
            .header(http::header::CONTENT_TYPE, "application/json")
            .header(http::header::ACCEPT, "application/json, text/event-stream");
        if let Some(As(ws, token)) = who {
            req = req.header(TEST_WORKSPACE, ws).header(TEST_TOKEN, token);
        }
        if let Some(id) = session {
            req = req
                .header("mcp-session-id", id)
                .header("mcp-protocol-version", LEGACY_VERSION);
        }
        let body = msg.map(|m| Body::from(m.to_string())).unwrap_or_default();
        let req = req.body(body).expect("request");
        tokio::time::timeout(Duration::from_secs(20), app.clone().oneshot(req))
            .await
            .expect("response in time")
            .expect("infallible")
    }

    async fn body_text(resp: axum::response::Response) -> String {
        let body = tokio::time::timeout(
            Duration::from_secs(20),
            axum::body::to_bytes(resp.into_body(), 1 << 20),
        )
        .await
        .expect("body in time")
        .expect("body");
        String::from_utf8_lossy(&body).into_owned()
    }

    /// A refusal by the session middleware: its status and stable code.
    async fn refusal(resp: axum::response::Response) -> (StatusCode, String) {
        let status = resp.status();
        let text = body_text(resp).await;
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|_| panic!("{status}: {text}"));
        let code = v["error"]["code"].as_str().unwrap_or_default().to_string();
        (status, code)
    }

    /// POSTs one JSON-RPC message that must succeed; returns the session id header and the
    /// JSON-RPC reply (the last `data:` of the SSE body), if any.
    async fn post(
        app: &Router,
        who: As<'_>,
        session: Option<&str>,
        msg: Value,
    ) -> (Option<String>, Option<Value>) {
        let resp = send(app, Method::POST, Some(who), session, Some(msg)).await;
        let status = resp.status();
        let sid = resp
            .headers()
            .get("mcp-session-id")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let text = body_text(resp).await;
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

    fn initialize() -> Value {
        serde_json::json!({
            "jsonrpc": "2.0", "id": 1, "method": "initialize",
            "params": {
                "protocolVersion": LEGACY_VERSION,
                "capabilities": {},
                "clientInfo": {"name": "test", "version": "0"}
            }
        })
    }

    async fn open_session(app: &Router, who: As<'_>) -> String {
        let (sid, reply) = post(app, who, None, initialize()).await;
        let reply = reply.expect("initialize reply");
        assert_eq!(reply["result"]["serverInfo"]["name"], "warren", "{reply}");
        assert!(
            reply["result"]["capabilities"]["tools"].is_object(),
            "{reply}"
        );
        let sid = sid.expect("a session id");
        let note = serde_json::json!({"jsonrpc": "2.0", "method": "notifications/initialized"});
        post(app, who, Some(&sid), note).await;
        sid
    }

    fn call(id: u64, tool: &str, args: Value) -> Value {
        serde_json::json!({
            "jsonrpc": "2.0", "id": id, "method": "tools/call",
            "params": {"name": tool, "arguments": args}
        })
    }

    /// `vm_list` in the session must answer as the session's workspace.
    async fn assert_session_works(app: &Router, who: As<'_>, sid: &str) {
        let (_, ok) = post(
            app,
            who,
            Some(sid),
            call(9, "vm_list", serde_json::json!({})),
        )
        .await;
        let ok = ok.expect("reply");
        assert_eq!(ok["result"]["isError"], false, "{ok}");
        assert_eq!(
            ok["result"]["structuredContent"],
            serde_json::json!({"vms": []})
        );
    }

    #[tokio::test]
    async fn test_router_session_lists_tools_with_schemas() {
        let f = fixture();
        let sid = open_session(&f.app, A).await;
        let list = serde_json::json!({"jsonrpc": "2.0", "id": 2, "method": "tools/list"});
        let (_, reply) = post(&f.app, A, Some(&sid), list).await;
        let reply = reply.expect("tools/list reply");
        let tools = reply["result"]["tools"].as_array().expect("tools");
        let create = tools
            .iter()
            .find(|t| t["name"] == "vm_create")
            .expect("vm_create listed");
        assert_eq!(create["inputSchema"]["type"], "object", "{create}");
        assert!(create["outputSchema"].is_object(), "{create}");
    }

    /// Attack: every way to use another caller's session id (another workspace, another
    /// token of the same workspace, no principal) on each method, then the owner's session
    /// must still work; control: the owner's own GET stream and DELETE do take effect.
    #[tokio::test]
    async fn test_router_session_bound_to_its_owner_on_get_post_delete() {
        let f = fixture();
        let sid = open_session(&f.app, A).await;
        let others = [As("ws-b", "t"), As("ws-a", "t2")];
        for who in others {
            for method in [Method::GET, Method::DELETE, Method::POST] {
                let msg =
                    (method == Method::POST).then(|| call(3, "vm_list", serde_json::json!({})));
                let resp = send(&f.app, method.clone(), Some(who), Some(&sid), msg).await;
                assert_eq!(
                    refusal(resp).await,
                    (StatusCode::NOT_FOUND, "not_found".to_string()),
                    "{method} by {}/{}",
                    who.0,
                    who.1
                );
            }
        }
        let resp = send(&f.app, Method::GET, None, Some(&sid), None).await;
        assert_eq!(
            refusal(resp).await,
            (StatusCode::UNAUTHORIZED, "unauthenticated".to_string())
        );
        // The same answer as for an id nobody holds.
        let resp = send(&f.app, Method::GET, Some(A), Some("no-such-session"), None).await;
        assert_eq!(
            refusal(resp).await,
            (StatusCode::NOT_FOUND, "not_found".to_string())
        );

        // Nothing changed for the owner.
        assert_session_works(&f.app, A, &sid).await;
        assert_eq!(f.sessions.held("ws-a"), 1);

        // Control: the owner's stream opens, and its DELETE ends the session.
        let stream = send(&f.app, Method::GET, Some(A), Some(&sid), None).await;
        assert_eq!(stream.status(), StatusCode::OK);
        let ct = stream.headers().get(http::header::CONTENT_TYPE).cloned();
        assert_eq!(
            ct.as_ref().and_then(|v| v.to_str().ok()),
            Some("text/event-stream")
        );
        drop(stream);
        let del = send(&f.app, Method::DELETE, Some(A), Some(&sid), None).await;
        assert!(del.status().is_success(), "{}", del.status());
        assert_eq!(f.bindings.len(), 0, "the DELETE dropped the binding");
        let after = send(
            &f.app,
            Method::POST,
            Some(A),
            Some(&sid),
            Some(call(4, "vm_list", serde_json::json!({}))),
        )
        .await;
        assert_eq!(after.status(), StatusCode::NOT_FOUND);
    }

    /// A revoked token's session ends within the recheck: its open GET event stream ends,
    /// and its id is served no more. Control: another token's session of the same workspace
    /// goes on working. (Before, both stayed open until the session idled out.)
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn test_revoked_tokens_session_and_event_stream_end() {
        let f = fixture();
        let issue = || {
            let (info, _secret) = f
                .service
                .credentials()
                .issue("ws-r", None, &crate::auth::PolicyRequest::default())
                .expect("issue");
            info.id
        };
        let (gone, kept) = (issue(), issue());
        let (by_gone, by_kept) = (As("ws-r", &gone), As("ws-r", &kept));
        let sid_gone = open_session(&f.app, by_gone).await;
        let sid_kept = open_session(&f.app, by_kept).await;
        let stream = send(&f.app, Method::GET, Some(by_gone), Some(&sid_gone), None).await;
        assert_eq!(stream.status(), StatusCode::OK);
        sessions::spawn_recheck(&f.bindings, f.service.clone());
        // Control: a recheck of valid tokens ends nothing. The revocation comes after the
        // periodic recheck's first round, so a later round must see it.
        assert_eq!(f.bindings.end_lapsed(&f.service).await, 0);
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(f.bindings.len(), 2, "the first round ended nothing");
        f.service.credentials().revoke(&gone).expect("revoke");
        let started = std::time::Instant::now();
        let ended = tokio::time::timeout(
            crate::ws::RECHECK + Duration::from_secs(5),
            axum::body::to_bytes(stream.into_body(), 1 << 20),
        )
        .await;
        assert!(
            ended.is_ok(),
            "the revoked token's event stream stayed open"
        );
        eprintln!(
            "event stream ended {:?} after the revocation",
            started.elapsed()
        );
        let after = send(
            &f.app,
            Method::POST,
            Some(by_gone),
            Some(&sid_gone),
            Some(call(5, "vm_list", serde_json::json!({}))),
        )
        .await;
        assert_eq!(
            refusal(after).await,
            (StatusCode::NOT_FOUND, "not_found".to_string())
        );
        assert_eq!(
            f.bindings.len(),
            1,
            "only the other token's session is bound"
        );
        assert_session_works(&f.app, by_kept, &sid_kept).await;
    }

    /// A recheck that cannot read the tokens (a database error) ends no session: only a
    /// token known to have lapsed does. Control: once the table is back and the token
    /// revoked, its session ends.
    #[tokio::test]
    async fn test_a_failed_recheck_ends_no_session() {
        let f = fixture();
        let (info, _secret) = f
            .service
            .credentials()
            .issue("ws-r", None, &crate::auth::PolicyRequest::default())
            .expect("issue");
        let who = As("ws-r", &info.id);
        let sid = open_session(&f.app, who).await;
        let db = rusqlite::Connection::open(f._dir.path().join("state/warren.db")).expect("db");
        db.execute_batch("ALTER TABLE tokens RENAME TO tokens_away")
            .expect("hide the table");
        assert!(f.service.credentials().recheck_token(&info.id).is_err());
        assert_eq!(f.bindings.end_lapsed(&f.service).await, 0);
        db.execute_batch("ALTER TABLE tokens_away RENAME TO tokens")
            .expect("restore the table");
        assert_session_works(&f.app, who, &sid).await;
        f.service.credentials().revoke(&info.id).expect("revoke");
        assert_eq!(f.bindings.end_lapsed(&f.service).await, 1);
    }

    #[tokio::test]
    async fn test_router_two_session_ids_refused() {
        let f = fixture();
        let sid = open_session(&f.app, A).await;
        let req = http::Request::get(PATH)
            .header(http::header::HOST, "localhost")
            .header(http::header::ACCEPT, "text/event-stream")
            .header(TEST_WORKSPACE, "ws-a")
            .header("mcp-session-id", &sid)
            .header("mcp-session-id", &sid)
            .header("mcp-protocol-version", LEGACY_VERSION)
            .body(Body::empty())
            .expect("request");
        let resp = f.app.clone().oneshot(req).await.expect("infallible");
        assert_eq!(
            refusal(resp).await,
            (StatusCode::BAD_REQUEST, "invalid_argument".to_string())
        );
    }

    #[tokio::test]
    async fn test_router_unknown_tool_is_a_tool_error_with_code_in_text() {
        let f = fixture();
        let sid = open_session(&f.app, A).await;
        let (_, r) = post(
            &f.app,
            A,
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
        let sid = open_session(&f.app, A).await;
        assert_eq!(f.sessions.held("ws-a"), 1);
        let resp = send(&f.app, Method::DELETE, Some(A), Some(&sid), None).await;
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
        let resp = send(&f.app, Method::POST, None, None, Some(initialize())).await;
        assert!(resp.headers().get("mcp-session-id").is_none());
        assert_eq!(
            refusal(resp).await,
            (StatusCode::UNAUTHORIZED, "unauthenticated".to_string())
        );
        assert_eq!(f.bindings.len(), 0);
    }

    /// Defence in depth behind the middleware: the handler itself serves a session's tool
    /// calls only to the session's owner.
    #[test]
    fn test_handler_serves_only_the_session_owner() {
        let dir = tempfile::tempdir().expect("tempdir");
        let sessions = Arc::new(SessionCounts::default());
        let mcp = WarrenMcp {
            service: test_service(dir.path()),
            tools: Arc::from(Vec::new()),
            sessions: sessions.clone(),
            slot: OnceLock::new(),
        };
        let token = |ws: &str, t: &str| Principal {
            workspace: ws.into(),
            policy: crate::auth::Policy::default(),
            via: crate::auth::Via::Token { token_id: t.into() },
        };
        mcp.open_session(Some(&token("ws-a", "t"))).expect("open");
        assert!(mcp.caller(&parts_with(Some(token("ws-a", "t")))).is_ok());
        for other in [token("ws-b", "t"), token("ws-a", "t2")] {
            let e = mcp
                .caller(&parts_with(Some(other.clone())))
                .expect_err("not the owner");
            assert_eq!(e.code, "forbidden");
            let e = mcp.open_session(Some(&other)).expect_err("not the owner");
            assert_eq!(e.code, "forbidden");
        }
        let e = mcp.caller(&parts_with(None)).expect_err("no principal");
        assert_eq!(e.code, "unauthenticated");
        assert_eq!(sessions.held("ws-a"), 1);
    }
}
