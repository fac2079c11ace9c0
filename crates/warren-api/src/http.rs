//! The HTTP side: `POST /v1/tools/{tool}`, the OpenAPI document, and MCP at `/mcp`, behind the
//! same guards (no browser origins, a `Host` allowlist, a body limit), authentication
//! (bearer tokens over TCP, SO_PEERCRED on the local socket) and the per-credential cap on
//! requests in flight (`crate::caps`). Connection limits are `crate::conn`'s.

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::connect_info::{ConnectInfo, Connected};
use axum::extract::rejection::{BytesRejection, QueryRejection};
use axum::extract::ws::rejection::WebSocketUpgradeRejection;
use axum::extract::ws::WebSocketUpgrade;
use axum::extract::{Path, Query, Request, State};
use axum::http::{header, HeaderMap, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use tokio::net::UnixListener;

use crate::auth::{Principal, Via, LOCAL_PREFIX};
use crate::error::ApiError;
use crate::service::Service;

/// Header with which root on the local socket acts as another workspace.
pub const WORKSPACE_HEADER: &str = "x-warren-workspace";

/// Which listener a request came through.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Door {
    Tcp,
    Unix,
}

#[derive(Clone)]
struct AppState {
    service: Arc<Service>,
    door: Door,
    allowed_hosts: Arc<Vec<String>>,
    max_body: usize,
}

/// The caller's uid on the local socket.
#[derive(Clone, Copy, Debug)]
pub struct PeerUid(pub Option<u32>);

impl Connected<axum::serve::IncomingStream<'_, UnixListener>> for PeerUid {
    fn connect_info(stream: axum::serve::IncomingStream<'_, UnixListener>) -> Self {
        PeerUid(stream.io().peer_cred().ok().map(|c| c.uid()))
    }
}

/// `e` as a response: its status and JSON body, plus `WWW-Authenticate` for `401`.
pub(crate) fn error_response(e: &ApiError) -> Response {
    let mut r = (e.status(), Json(e.body())).into_response();
    if e.code == "unauthenticated" {
        r.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            header::HeaderValue::from_static("Bearer"),
        );
    }
    r
}

/// The router for the TCP listener, accepting `allowed_hosts` as `Host` values.
pub fn tcp_router(service: Arc<Service>, allowed_hosts: Vec<String>) -> Router {
    let st = AppState {
        allowed_hosts: Arc::new(allowed_hosts),
        max_body: service.config().http.max_body_bytes,
        service,
        door: Door::Tcp,
    };
    routes(st)
}

/// The router for the local UNIX socket (serve it with `ConnectInfo<PeerUid>`).
pub fn unix_router(service: Arc<Service>) -> Router {
    let st = AppState {
        allowed_hosts: Arc::new(vec![]),
        max_body: service.config().http.max_body_bytes,
        service,
        door: Door::Unix,
    };
    routes(st)
}

fn routes(st: AppState) -> Router {
    let max = st.max_body;
    Router::new()
        .route("/v1/tools/{tool}", post(call_tool))
        .route("/v1/openapi.json", get(openapi))
        .route("/v1/host/shares", get(host_shares))
        .route("/v1/vms/{vm_id}/streams/{port}", get(stream_port))
        .route("/v1/vms/{vm_id}/copy/{direction}", get(stream_copy))
        .route("/v1/vms/{vm_id}/jobs/{job_id}/{what}", get(job_stream))
        .merge(crate::mcp::router(st.service.clone()))
        .method_not_allowed_fallback(|| async {
            error_response(&ApiError::new(
                "method_not_allowed",
                "tools take POST with a JSON body; the OpenAPI document takes GET",
            ))
        })
        .fallback(|| async {
            error_response(&ApiError::new(
                "not_found",
                "no such endpoint; tools are at POST /v1/tools/{tool} and MCP at /mcp",
            ))
        })
        // Outermost last: guard (origin, host, declared size), then the streaming body
        // limit, then authentication, then the caller's cap on requests in flight.
        .layer(middleware::from_fn_with_state(st.clone(), limit_in_flight))
        .layer(middleware::from_fn_with_state(st.clone(), authenticate))
        .layer(tower_http::limit::RequestBodyLimitLayer::new(max))
        .layer(middleware::from_fn_with_state(st.clone(), guard))
        .with_state(st)
}

/// Refuses browser requests and unexpected `Host`s before anything else looks at them.
async fn guard(State(st): State<AppState>, req: Request, next: Next) -> Response {
    if req.headers().contains_key(header::ORIGIN) {
        return error_response(&ApiError::forbidden(
            "requests carrying an Origin header (browsers) are refused",
        ));
    }
    if st.door == Door::Tcp {
        let host = req
            .headers()
            .get(header::HOST)
            .and_then(|h| h.to_str().ok())
            .map(str::to_ascii_lowercase);
        let ok = host
            .as_ref()
            .is_some_and(|h| st.allowed_hosts.iter().any(|a| a == h));
        if !ok {
            return error_response(&ApiError::forbidden(format!(
                "Host {:?} is not served here",
                host.unwrap_or_default()
            )));
        }
    }
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    if declared.is_some_and(|n| n > st.max_body) {
        return error_response(&too_large(st.max_body));
    }
    next.run(req).await
}

fn too_large(max: usize) -> ApiError {
    ApiError::new(
        "payload_too_large",
        format!("request bodies are limited to {max} bytes"),
    )
}

/// Resolves the caller to a principal and attaches it to the request.
async fn authenticate(State(st): State<AppState>, mut req: Request, next: Next) -> Response {
    let principal = match st.door {
        Door::Tcp => bearer(&st, req.headers()),
        Door::Unix => {
            let uid = req
                .extensions()
                .get::<ConnectInfo<PeerUid>>()
                .and_then(|c| c.0 .0);
            local(&st, uid, req.headers())
        }
    };
    match principal {
        Ok(p) => {
            req.extensions_mut().insert(p);
            next.run(req).await
        }
        Err(e) => error_response(&e),
    }
}

/// Counts the request against its credential's cap on requests in flight until its response
/// body ends. An MCP GET (a session's event stream, open for the session's life, and rmcp
/// accepts several per session) counts against the credential's long-poll cap instead, so
/// streams can neither starve its requests nor hold the listener's connections.
async fn limit_in_flight(State(st): State<AppState>, mut req: Request, next: Next) -> Response {
    let stream = req.method() == Method::GET && req.uri().path() == crate::mcp::PATH;
    let Some(p) = req.extensions().get::<Principal>() else {
        return next.run(req).await;
    };
    let claimed = if stream {
        st.service.caps().long_poll(p)
    } else {
        st.service.caps().request(p)
    };
    let slot = match claimed {
        Ok(slot) => slot,
        Err(e) => {
            tracing::info!(workspace = %p.workspace, code = e.code, "request over the caller's cap");
            let mut r = error_response(&e);
            r.headers_mut()
                .insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
            return r;
        }
    };
    let slot = crate::caps::HeldSlot::new(slot);
    req.extensions_mut().insert(slot.clone());
    next.run(req)
        .await
        .map(|b| Body::new(crate::conn::Guarded::new(b, slot)))
}

fn bearer(st: &AppState, h: &HeaderMap) -> Result<Principal, ApiError> {
    let unauth = |m: &str| ApiError::new("unauthenticated", m);
    let v = h
        .get(header::AUTHORIZATION)
        .ok_or_else(|| unauth("missing Authorization: Bearer header"))?
        .to_str()
        .map_err(|_| unauth("malformed Authorization header"))?;
    let token = v
        .strip_prefix("Bearer ")
        .or_else(|| v.strip_prefix("bearer "))
        .ok_or_else(|| unauth("Authorization must use the Bearer scheme"))?;
    st.service.credentials().authenticate(token.trim())
}

fn local(st: &AppState, uid: Option<u32>, h: &HeaderMap) -> Result<Principal, ApiError> {
    let uid = uid.ok_or_else(|| ApiError::new("unauthenticated", "no peer credentials"))?;
    let Some(name) = h.get(WORKSPACE_HEADER) else {
        return Ok(Principal::local(uid));
    };
    if uid != 0 {
        return Err(ApiError::forbidden(
            "only root may act as another workspace",
        ));
    }
    let name = name
        .to_str()
        .map_err(|_| ApiError::invalid("malformed workspace header"))?;
    if let Some(n) = name.strip_prefix(LOCAL_PREFIX) {
        let u = n
            .parse::<u32>()
            .map_err(|_| ApiError::invalid(format!("{name:?} is not a local workspace")))?;
        return Ok(Principal::local(u));
    }
    crate::auth::validate_workspace(name)?;
    let policy = st
        .service
        .credentials()
        .policy(name)?
        .ok_or_else(|| ApiError::new("not_found", format!("no workspace {name}")))?;
    Ok(Principal {
        workspace: name.to_string(),
        policy,
        via: Via::Local { uid },
    })
}

async fn call_tool(
    State(st): State<AppState>,
    Extension(p): Extension<Principal>,
    Extension(held): Extension<crate::caps::HeldSlot>,
    Path(tool): Path<String>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let json = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("application/json"));
    if !json {
        return error_response(&ApiError::new(
            "unsupported_media_type",
            "send the arguments as Content-Type: application/json",
        ));
    }
    let body = match body {
        Ok(b) => b,
        Err(e) if e.status() == StatusCode::PAYLOAD_TOO_LARGE => {
            return error_response(&too_large(st.max_body))
        }
        Err(e) => return error_response(&ApiError::invalid(e.body_text())),
    };
    let args: serde_json::Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => return error_response(&ApiError::invalid(format!("malformed JSON: {e}"))),
    };
    if !args.is_object() {
        return error_response(&ApiError::invalid("the body must be a JSON object"));
    }
    match st.service.call_to_end(&p, &tool, args, held).await {
        Ok(v) => (StatusCode::OK, Json(v)).into_response(),
        Err(e) => error_response(&e),
    }
}

/// `GET /v1/host/shares`: the (device, inode) of every host directory a VM of this service
/// can write, for `vm cp` to keep its host side out of them (no paths: the identities tell
/// another workspace nothing it could use).
async fn host_shares(State(st): State<AppState>) -> Response {
    match st.service.writable_shares() {
        Ok(ids) => {
            let shares: Vec<serde_json::Value> = ids
                .into_iter()
                .map(|(dev, ino)| serde_json::json!({"dev": dev, "ino": ino}))
                .collect();
            (
                StatusCode::OK,
                Json(serde_json::json!({ "shares": shares })),
            )
                .into_response()
        }
        Err(e) => error_response(&e),
    }
}

async fn openapi(State(st): State<AppState>, Extension(p): Extension<Principal>) -> Response {
    Json(crate::openapi::document(&st.service.tools_for(&p))).into_response()
}

/// `GET /v1/vms/{vm_id}/streams/{port}` (WebSocket): `crate::ws`.
async fn stream_port(
    State(st): State<AppState>,
    Extension(p): Extension<Principal>,
    Path((vm_id, port)): Path<(String, String)>,
    ws: Result<WebSocketUpgrade, WebSocketUpgradeRejection>,
) -> Response {
    crate::ws::serve(
        st.service,
        p,
        vm_id,
        crate::ws::Request::Port(port),
        ws.ok(),
    )
    .await
}

#[derive(serde::Deserialize)]
struct CopyQuery {
    path: Option<String>,
}

/// `GET /v1/vms/{vm_id}/copy/{in|out}?path=P` (WebSocket): a tar archive into the guest
/// directory `P`, or of the guest path `P`.
async fn stream_copy(
    State(st): State<AppState>,
    Extension(p): Extension<Principal>,
    Path((vm_id, direction)): Path<(String, String)>,
    query: Result<Query<CopyQuery>, QueryRejection>,
    ws: Result<WebSocketUpgrade, WebSocketUpgradeRejection>,
) -> Response {
    let path = match query {
        Ok(Query(q)) => q.path,
        Err(e) => return error_response(&ApiError::invalid(e.body_text())),
    };
    let req = match direction.as_str() {
        "in" => crate::ws::Request::CopyIn(path),
        "out" => crate::ws::Request::CopyOut(path),
        _ => {
            return error_response(&ApiError::new(
                "not_found",
                "copies are /v1/vms/{vm_id}/copy/in or /copy/out",
            ))
        }
    };
    crate::ws::serve(st.service, p, vm_id, req, ws.ok()).await
}

/// `GET /v1/vms/{vm_id}/jobs/{job_id}/output` and `.../terminal` (WebSocket): a job's live
/// output, or an interactive job's terminal (`crate::job_ws`).
async fn job_stream(
    State(st): State<AppState>,
    Extension(p): Extension<Principal>,
    Path((vm_id, job_id, what)): Path<(String, String, String)>,
    headers: HeaderMap,
    query: Result<Query<crate::job_ws::JobQuery>, QueryRejection>,
    ws: Result<WebSocketUpgrade, WebSocketUpgradeRejection>,
) -> Response {
    if what == "broker" {
        let token = headers
            .get(crate::broker_ws::TOKEN_HEADER)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        return crate::broker_ws::serve(st.service, p, vm_id, job_id, token, ws.ok()).await;
    }
    let kind = match what.as_str() {
        "output" => crate::job_ws::Kind::Output,
        "terminal" => crate::job_ws::Kind::Terminal,
        _ => {
            return error_response(&ApiError::new(
                "not_found",
                "job streams are /v1/vms/{vm_id}/jobs/{job_id}/output, /terminal or /broker",
            ))
        }
    };
    let query = match query {
        Ok(Query(q)) => q,
        Err(e) => return error_response(&ApiError::invalid(e.body_text())),
    };
    crate::job_ws::serve(st.service, p, vm_id, job_id, kind, query, ws.ok()).await
}
