//! The service's error: a stable machine code, a message for humans, and the HTTP status both
//! transports derive from the code.

use http::StatusCode;
use serde::Serialize;
use warren_core::CoreError;

/// Every code a client can see. The list is part of the API: codes are only ever added.
pub const CODES: &[&str] = &[
    "invalid_argument",
    "unauthenticated",
    "forbidden",
    "not_found",
    "unknown_tool",
    "method_not_allowed",
    "conflict",
    "busy",
    "outcome_unknown",
    "quota_exceeded",
    "payload_too_large",
    "unsupported_media_type",
    "unavailable",
    "io_error",
    "integrity",
    "internal",
    "too_large",
    "untrusted_image",
];

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize)]
#[error("{code}: {message}")]
pub struct ApiError {
    pub code: &'static str,
    pub message: String,
}

impl ApiError {
    pub fn new(code: &'static str, message: impl Into<String>) -> ApiError {
        debug_assert!(CODES.contains(&code), "unlisted error code {code}");
        ApiError {
            code,
            message: message.into(),
        }
    }

    pub fn invalid(message: impl Into<String>) -> ApiError {
        ApiError::new("invalid_argument", message)
    }

    pub fn forbidden(message: impl Into<String>) -> ApiError {
        ApiError::new("forbidden", message)
    }

    pub fn conflict(message: impl Into<String>) -> ApiError {
        ApiError::new("conflict", message)
    }

    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError::new("internal", message)
    }

    /// The VM reference the caller may not see: the same answer whether it does not exist
    /// or belongs to another workspace.
    pub fn no_vm(id: &str) -> ApiError {
        ApiError::new("not_found", format!("no VM {id}"))
    }

    pub fn status(&self) -> StatusCode {
        match self.code {
            "invalid_argument" => StatusCode::BAD_REQUEST,
            "unauthenticated" => StatusCode::UNAUTHORIZED,
            "forbidden" | "untrusted_image" => StatusCode::FORBIDDEN,
            "not_found" | "unknown_tool" => StatusCode::NOT_FOUND,
            "method_not_allowed" => StatusCode::METHOD_NOT_ALLOWED,
            "conflict" | "busy" | "outcome_unknown" => StatusCode::CONFLICT,
            "quota_exceeded" => StatusCode::TOO_MANY_REQUESTS,
            "payload_too_large" => StatusCode::PAYLOAD_TOO_LARGE,
            "unsupported_media_type" => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unavailable" => StatusCode::SERVICE_UNAVAILABLE,
            "io_error" | "too_large" => StatusCode::UNPROCESSABLE_ENTITY,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The JSON body both transports send: `{"error":{"code":...,"message":...}}`.
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({ "error": { "code": self.code, "message": self.message } })
    }
}

impl From<CoreError> for ApiError {
    fn from(e: CoreError) -> ApiError {
        // The engine's codes are a subset of ours; anything unexpected is internal.
        let code = CODES
            .iter()
            .copied()
            .find(|c| *c == e.code())
            .unwrap_or("internal");
        if code == "internal" {
            // Internal details (paths, SQLite errors) go to the log, not to the client.
            // Escaped: the chain may carry a guest's text (no forged lines, no terminal
            // escapes in the log).
            tracing::error!(error = %escape_controls(&format_chain(&e)), "internal error");
            return ApiError::internal("internal error; see the service log");
        }
        ApiError::new(code, format_chain(&e))
    }
}

impl From<rusqlite::Error> for ApiError {
    fn from(e: rusqlite::Error) -> ApiError {
        tracing::error!(error = %e, "store error");
        ApiError::internal("internal error; see the service log")
    }
}

/// `s` with control characters escaped (`\n`, `\u{1b}`).
fn escape_controls(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

/// `e` and its sources, `: `-separated.
pub fn format_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let t = c.to_string();
        if !s.contains(&t) {
            s.push_str(": ");
            s.push_str(&t);
        }
        cur = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_escape_controls_guest_text_cannot_forge_log_lines() {
        assert_eq!(
            escape_controls("a\nforged\u{1b}[2J"),
            "a\\nforged\\u{1b}[2J"
        );
    }

    #[test]
    fn test_every_code_has_a_client_error_or_server_status() {
        for c in CODES {
            let s = ApiError::new(c, "x").status();
            assert!(s.is_client_error() || s.is_server_error(), "{c}");
        }
        assert_eq!(
            ApiError::new("quota_exceeded", "x").status(),
            StatusCode::TOO_MANY_REQUESTS
        );
    }

    #[test]
    fn test_core_not_found_keeps_code() {
        let e: ApiError = CoreError::VmNotFound("vm-1".into()).into();
        assert_eq!(e.code, "not_found");
    }
}
