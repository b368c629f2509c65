//! Errors as HTTP responses, in the shape the client expects: Ollama's
//! `{"error": "..."}` on `/api/*` and elsewhere, Anthropic's
//! `{"type": "error", "error": {"type", "message"}}` on `/v1/messages` (and below it),
//! OpenAI's `{"error": {"message", "type", "code"}}` on the rest of `/v1/*`.
//!
//! Every message passes [`crate::redact::for_client`] on its way out: core errors name
//! the files they failed on, which is for the journal (where the original is logged),
//! not for clients.
//!
//! The one table from the core's errors to statuses is here too: [`schedule`],
//! [`request`], [`store`] (by the work that failed), [`registry`] and [`template`], with
//! the few shapes every handler answers in ([`bad`], [`internal`], [`busy`], …).

use axum::Json;
use axum::http::{HeaderName, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use crate::prompt_template::TemplateError;
use crate::scheduler::failure::FailureClass;
use crate::scheduler::request::RequestError;
use crate::scheduler::types::ScheduleError;
use crate::store::StoreError;
use crate::store::registry::RegistryError;

/// An error reply.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    message: String,
    shape: Shape,
    header: Option<(HeaderName, HeaderValue)>,
}

/// Whose error body a client of a path expects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Shape {
    Ollama,
    OpenAi,
    Anthropic,
}

impl Shape {
    fn of(path: &str) -> Self {
        if path == ANTHROPIC || path.strip_prefix(ANTHROPIC).is_some_and(|rest| rest.starts_with('/')) {
            Self::Anthropic
        } else if path.starts_with("/v1/") {
            Self::OpenAi
        } else {
            Self::Ollama
        }
    }
}

/// Anthropic's Messages API, whose clients read Anthropic's error shape.
const ANTHROPIC: &str = "/v1/messages";

impl ApiError {
    /// An error for a request to `path`, whose prefix decides the body's shape.
    pub fn new(status: StatusCode, message: impl Into<String>, path: &str) -> Self {
        let message = crate::redact::for_client(message.into(), path);
        Self { status, message, shape: Shape::of(path), header: None }
    }

    /// An error whose message holds nothing of the server's but the request's own URL
    /// path (404, 405), which is shown as sent.
    pub fn about_url(status: StatusCode, message: impl Into<String>, path: &str) -> Self {
        Self { status, message: message.into(), shape: Shape::of(path), header: None }
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

impl ApiError {
    /// The body in the shape the client of its path reads.
    fn body(&self) -> Value {
        match self.shape {
            Shape::Ollama => json!({ "error": self.message }),
            Shape::OpenAi => {
                let kind = match self.status {
                    StatusCode::NOT_FOUND => "not_found_error",
                    s if s.is_server_error() => "server_error",
                    _ => "invalid_request_error",
                };
                json!({ "error": { "message": self.message, "type": kind, "code": self.status.as_u16() } })
            }
            Shape::Anthropic => {
                // Anthropic's error types by status (its API's "Errors" page).
                let kind = match self.status {
                    StatusCode::UNAUTHORIZED => "authentication_error",
                    StatusCode::FORBIDDEN => "permission_error",
                    StatusCode::NOT_FOUND => "not_found_error",
                    StatusCode::PAYLOAD_TOO_LARGE => "request_too_large",
                    StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
                    StatusCode::SERVICE_UNAVAILABLE => "overloaded_error",
                    s if s.is_server_error() => "api_error",
                    _ => "invalid_request_error",
                };
                json!({ "type": "error", "error": { "type": kind, "message": self.message } })
            }
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, Json(self.body())).into_response();
        if let Some((name, value)) = self.header {
            response.headers_mut().insert(name, value);
        }
        response
    }
}

/// 400: the request itself is at fault; the message says how.
pub(super) fn bad(message: impl Into<String>, path: &str) -> ApiError {
    ApiError::new(StatusCode::BAD_REQUEST, message, path)
}

/// 500 with what failed (logged: it is the server's fault).
pub(super) fn internal(message: impl Into<String>, path: &str) -> ApiError {
    let message = message.into();
    tracing::error!(path, "{message}");
    ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, message, path)
}

/// 500 saying only "internal error": what failed (a task that panicked) is for the
/// journal, where the caller logs it.
pub(super) fn opaque(path: &str) -> ApiError {
    ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal error", path)
}

/// 404 in Ollama's wording, the name as the client wrote it.
pub(super) fn model_not_found(given: &str, path: &str) -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, format!("model '{given}' not found"), path)
}

/// 503 with a `Retry-After` of `seconds`: the server is busy, not broken.
pub(super) fn busy(message: impl Into<String>, path: &str, seconds: &'static str) -> ApiError {
    ApiError::new(StatusCode::SERVICE_UNAVAILABLE, message, path)
        .with_header(header::RETRY_AFTER, HeaderValue::from_static(seconds))
}

/// A runner's refusal (`status` not a success, `reply` its JSON body or null): its own
/// message, a 400 when it blamed the request, else a 500.
pub(super) fn runner_refused(status: StatusCode, reply: &Value, path: &str) -> ApiError {
    let status = if status.is_client_error() { StatusCode::BAD_REQUEST } else { StatusCode::INTERNAL_SERVER_ERROR };
    ApiError::new(status, refusal_message(reply), path)
}

/// The server-sent event that ends a passed-through stream whose runner failed mid-answer,
/// in the shape the client of `path` reads: Anthropic's and the Responses API's `error`
/// event, else the `data:` line with an error that OpenAI's clients raise on.
pub(super) fn stream_error_event(message: &str, path: &str) -> String {
    let error = ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, message, path);
    match error.shape {
        // Anthropic's `error` event carries its error body as it is.
        Shape::Anthropic => format!("event: error\ndata: {}\n\n", error.body()),
        _ if path == RESPONSES => {
            let event = json!({ "type": "error", "code": "server_error", "message": error.message, "param": null });
            format!("event: error\ndata: {event}\n\n")
        }
        _ => format!("data: {}\n\n", error.body()),
    }
}

/// OpenAI's Responses API, whose streams are named events.
const RESPONSES: &str = "/v1/responses";

/// Whether a client of `path` reads errors in OpenAI's shape, the one runners answer in.
pub(super) fn reads_runners_errors(path: &str) -> bool {
    Shape::of(path) == Shape::OpenAi
}

/// A runner's refusal of a request passed through to it, for a client that reads
/// another error shape ([`reads_runners_errors`]): the runner's status and message.
pub(super) fn passed_refusal(status: StatusCode, reply: &Value, path: &str) -> ApiError {
    ApiError::new(status, refusal_message(reply), path)
}

fn refusal_message(reply: &Value) -> &str {
    reply["error"]["message"].as_str().unwrap_or("the model runner refused the request")
}

/// The scheduler's refusals of a lease, a load or an unload as HTTP: busy is 503 with a
/// `Retry-After`; a model that cannot fit even with every other one unloaded 507 (the
/// memory each device has is in the message); a failed load by its class
/// ([`load_failed_status`]); the rest 500.
pub(super) fn schedule(error: &ScheduleError, path: &str) -> ApiError {
    let status = match error {
        ScheduleError::QueueFull(_)
        | ScheduleError::BackingOff { .. }
        | ScheduleError::ShuttingDown
        | ScheduleError::TooManyNames { .. } => {
            return busy(error.to_string(), path, "1");
        }
        ScheduleError::InsufficientMemory { .. } => StatusCode::INSUFFICIENT_STORAGE,
        ScheduleError::LoadFailed { class, .. } => load_failed_status(*class),
        ScheduleError::NotLoaded(_) => StatusCode::INTERNAL_SERVER_ERROR,
    };
    ApiError::new(status, error.to_string(), path)
}

/// A failed load's status by its class: out of memory 507 (as a model that cannot fit);
/// a bad model file 422 (the request is well formed, the model it names cannot be
/// used); no progress within the load timeout 504; a crash of llama-server 502 (the
/// process corrald fronts failed); anything else (llama-server could not be started)
/// 500.
#[must_use]
pub(super) fn load_failed_status(class: FailureClass) -> StatusCode {
    match class {
        FailureClass::OutOfMemory => StatusCode::INSUFFICIENT_STORAGE,
        FailureClass::BadModel => StatusCode::UNPROCESSABLE_ENTITY,
        FailureClass::Timeout => StatusCode::GATEWAY_TIMEOUT,
        FailureClass::Crashed => StatusCode::BAD_GATEWAY,
        FailureClass::Other => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

/// A view of the scheduler (`/api/ps`, `/metrics`) it could not give: 503, logged.
pub(super) fn scheduler_view(error: &ScheduleError, path: &str) -> ApiError {
    tracing::warn!(path, error = %error, "the scheduler did not answer");
    ApiError::new(StatusCode::SERVICE_UNAVAILABLE, error.to_string(), path)
}

/// A failed request build as HTTP: an unknown model is 404 in Ollama's wording (the
/// name as the client wrote it), a bad option 400, weights that are not a usable GGUF 422
/// (a bad model, as when llama-server refuses the file), anything else 500.
pub(super) fn request(error: RequestError, given: &str, path: &str) -> ApiError {
    match error {
        RequestError::Store(e) => store(&e, StoreWork::Request, given, path),
        RequestError::InvalidOption { .. } | RequestError::KeepAlive(_) => bad(error.to_string(), path),
    }
}

/// What the store was doing when it failed: the same error means a different thing
/// (and answers with a different status) to each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum StoreWork {
    /// Finding a model to serve (a request build, `/v1/models/{model}`).
    Request,
    /// Reading models to describe them (`/api/tags`, `/api/show`, `/api/copy`, `/api/delete`).
    Read,
    /// Writing a model from a client's spec (`/api/create`, a push's manifest).
    Write,
    /// Storing an uploaded blob (`/api/blobs`).
    Upload,
}

/// The store's errors as HTTP, by the work that failed (the one table: `given` is the
/// model name as the client wrote it, for a 404).
pub(super) fn store(error: &StoreError, work: StoreWork, given: &str, path: &str) -> ApiError {
    use StoreWork::{Read, Request, Upload, Write};
    let status = match (work, error) {
        (Request | Read | Write, StoreError::NotFound(_)) => return model_not_found(given, path),
        (Request, StoreError::Gguf { .. }) => StatusCode::UNPROCESSABLE_ENTITY,
        (Request, _) => return internal(error.to_string(), path),
        (Read, StoreError::Io { .. }) => {
            tracing::error!(path, error = %error, "the model store failed");
            return ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal error: the model store failed", path);
        }
        (Read, _) => {
            tracing::error!(path, error = %error, "a model in the store is unusable");
            StatusCode::INTERNAL_SERVER_ERROR
        }
        (
            Write,
            StoreError::Exists(_)
            | StoreError::DigestMismatch { .. }
            | StoreError::Gguf { .. }
            | StoreError::Invalid(_)
            | StoreError::TooLarge(_)
            | StoreError::MissingBlob(_),
        )
        | (Upload, StoreError::DigestMismatch { .. }) => StatusCode::BAD_REQUEST,
        (Write, StoreError::Manifest { .. } | StoreError::Refused { .. } | StoreError::Io { .. }) => {
            tracing::error!(path, error = %error, "the model store failed");
            StatusCode::INTERNAL_SERVER_ERROR
        }
        (Upload, _) => {
            tracing::error!(error = %error, "cannot store an uploaded blob");
            StatusCode::INTERNAL_SERVER_ERROR
        }
    };
    ApiError::new(status, error.to_string(), path)
}

/// A registry transfer's failure as HTTP: what the registry does not have 404, a model
/// the store does not have (a push) 404 in Ollama's wording, a refused login 401, the
/// rest 500.
pub(super) fn registry(error: &RegistryError, given: &str, path: &str) -> ApiError {
    match error {
        RegistryError::NotFound { .. } => ApiError::new(StatusCode::NOT_FOUND, error.to_string(), path),
        RegistryError::Store(e) if matches!(**e, StoreError::NotFound(_)) => model_not_found(given, path),
        RegistryError::Unauthorized { .. } => ApiError::new(StatusCode::UNAUTHORIZED, error.to_string(), path),
        _ => {
            tracing::warn!(path, error = %error, "a registry transfer failed");
            ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, error.to_string(), path)
        }
    }
}

/// A request template's refusal: the request's fault (400, naming the limit), except too
/// many renders at once (503, retry) and a render thread that could not start (500).
pub(super) fn template(error: &TemplateError, path: &str) -> ApiError {
    match error {
        TemplateError::Busy(_) => busy(error.to_string(), path, "1"),
        TemplateError::Thread(_) => internal(error.to_string(), path),
        _ => bad(error.to_string(), path),
    }
}

#[cfg(test)]
mod tests {
    use axum::http::StatusCode;
    use axum::response::IntoResponse;
    use serde_json::{Value, json};

    use super::{ApiError, schedule};
    use crate::scheduler::failure::FailureClass;
    use crate::scheduler::types::ScheduleError;

    #[test]
    fn each_class_of_failed_load_has_its_status_and_the_reason_stays() {
        for (class, status) in [
            (FailureClass::OutOfMemory, StatusCode::INSUFFICIENT_STORAGE),
            (FailureClass::BadModel, StatusCode::UNPROCESSABLE_ENTITY),
            (FailureClass::Timeout, StatusCode::GATEWAY_TIMEOUT),
            (FailureClass::Crashed, StatusCode::BAD_GATEWAY),
            (FailureClass::Other, StatusCode::INTERNAL_SERVER_ERROR),
        ] {
            let error = ScheduleError::LoadFailed { model: "chat".into(), class, reason: "why".into() };
            let api = schedule(&error, "/api/chat");
            assert_eq!(api.status(), status, "{class:?}");
            assert_eq!(api.message(), "model 'chat' failed to load: why");
        }
        let refused = ScheduleError::InsufficientMemory {
            model: "chat".into(),
            needed: 2,
            available: 1,
            devices: Vec::new(),
            host: 1,
            down: vec!["worker w (10.0.0.2:50052): cannot connect".into()],
        };
        assert_eq!(schedule(&refused, "/api/chat").status(), StatusCode::INSUFFICIENT_STORAGE);
        assert!(
            schedule(&refused, "/api/chat")
                .message()
                .ends_with("; down, so not counted: worker w (10.0.0.2:50052): cannot connect"),
            "a down worker is named"
        );
    }

    async fn body_of(error: ApiError) -> (StatusCode, Value) {
        let response = error.into_response();
        let status = response.status();
        let bytes = axum::body::to_bytes(response.into_body(), 1 << 20).await.expect("a body");
        (status, serde_json::from_slice(&bytes).expect("JSON"))
    }

    #[tokio::test]
    async fn each_api_gets_its_own_error_shape() {
        let openai = |kind: &str, code: u16| json!({ "error": { "message": "why", "type": kind, "code": code } });
        for (path, status, expected) in [
            ("/api/chat", StatusCode::NOT_FOUND, json!({ "error": "why" })),
            ("/", StatusCode::BAD_REQUEST, json!({ "error": "why" })),
            ("/v1/chat/completions", StatusCode::NOT_FOUND, openai("not_found_error", 404)),
            ("/v1/messagesx", StatusCode::BAD_REQUEST, openai("invalid_request_error", 400)),
            ("/v1/responses", StatusCode::SERVICE_UNAVAILABLE, openai("server_error", 503)),
        ] {
            assert_eq!(body_of(ApiError::new(status, "why", path)).await, (status, expected), "{path} {status}");
        }
        // Anthropic's error types by status, on its endpoints.
        for (path, status, kind) in [
            ("/v1/messages", StatusCode::NOT_FOUND, "not_found_error"),
            ("/v1/messages/count_tokens", StatusCode::BAD_REQUEST, "invalid_request_error"),
            ("/v1/messages", StatusCode::UNAUTHORIZED, "authentication_error"),
            ("/v1/messages", StatusCode::FORBIDDEN, "permission_error"),
            ("/v1/messages", StatusCode::PAYLOAD_TOO_LARGE, "request_too_large"),
            ("/v1/messages", StatusCode::TOO_MANY_REQUESTS, "rate_limit_error"),
            ("/v1/messages", StatusCode::SERVICE_UNAVAILABLE, "overloaded_error"),
            ("/v1/messages", StatusCode::INSUFFICIENT_STORAGE, "api_error"),
        ] {
            let expected = json!({ "type": "error", "error": { "type": kind, "message": "why" } });
            assert_eq!(body_of(ApiError::new(status, "why", path)).await, (status, expected), "{path} {status}");
        }
    }
}
