//! Errors as HTTP responses, in the shape the client expects: Ollama's
//! `{"error": "..."}` on `/api/*` and elsewhere, OpenAI's
//! `{"error": {"message", "type", "code"}}` on `/v1/*`.
//!
//! Every message passes [`crate::redact::for_client`] on its way out: core errors name
//! the files they failed on, which is for the journal (where the original is logged),
//! not for clients.

use axum::Json;
use axum::http::{HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// An error reply.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    message: String,
    openai: bool,
    header: Option<(HeaderName, HeaderValue)>,
}

impl ApiError {
    /// An error for a request to `path`, whose prefix decides the body's shape.
    pub fn new(status: StatusCode, message: impl Into<String>, path: &str) -> Self {
        let message = crate::redact::for_client(message.into(), path);
        Self { status, message, openai: path.starts_with("/v1/"), header: None }
    }

    /// An error whose message holds nothing of the server's but the request's own URL
    /// path (404, 405), which is shown as sent.
    pub fn about_url(status: StatusCode, message: impl Into<String>, path: &str) -> Self {
        Self { status, message: message.into(), openai: path.starts_with("/v1/"), header: None }
    }

    /// The status.
    #[must_use]
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The message the client sees.
    #[must_use]
    pub fn message(&self) -> &str {
        &self.message
    }

    /// Adds a header to the reply (`Retry-After` on a busy server).
    #[must_use]
    pub fn with_header(mut self, name: HeaderName, value: HeaderValue) -> Self {
        self.header = Some((name, value));
        self
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = if self.openai {
            let kind = match self.status {
                StatusCode::NOT_FOUND => "not_found_error",
                s if s.is_server_error() => "server_error",
                _ => "invalid_request_error",
            };
            json!({ "error": { "message": self.message, "type": kind, "code": self.status.as_u16() } })
        } else {
            json!({ "error": self.message })
        };
        let mut response = (self.status, Json(body)).into_response();
        if let Some((name, value)) = self.header {
            response.headers_mut().insert(name, value);
        }
        response
    }
}
