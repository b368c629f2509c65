//! The HTTP API: routes, and serving them on the adopted or bound listeners.
//!
//! Handlers are views: they hold no scheduling state of their own.

mod anthropic;
mod error;
mod json_body;
pub mod listeners;
pub(crate) mod metrics;
mod model_request;
mod ollama_embed;
mod ollama_generate;
mod ollama_models;
mod ollama_store;
mod ollama_translate;
mod openai;
pub mod parsers;
mod runner_call;
pub mod safety;
pub mod state;
mod stream_scan;

use axum::Json;
use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::http::{HeaderName, HeaderValue, StatusCode, Uri};
use axum::middleware::{from_fn, from_fn_with_state};
use axum::routing::{get, post};
use serde::Serialize;

pub use error::ApiError;
pub use ollama_models::keep_tags_ready;
pub use safety::{LocalNames, Safety};
pub use state::{AppState, Shared};

/// The Ollama version `/api/version` reports, for clients that gate features on it
/// (structured outputs need 0.5.0, tool streaming 0.8.0, `think` 0.9.0; some tools refuse
/// anything older than the Ollama they were written against). It is the release whose
/// API corral follows (the behaviour reference pins v0.31.1): a client that sees it may
/// use every request corral implements, and would meet the same API in that Ollama.
pub const OLLAMA_VERSION: &str = "0.31.1";

/// The header that carries [`crate::VERSION`].
pub const VERSION_HEADER: &str = "x-corral-version";

/// All routes of the API, serving `state`.
pub fn router(state: AppState) -> Router {
    let safety = state.safety.clone();
    // `get` also answers HEAD with the same status and headers and no body.
    Router::new()
        .route("/", get(root))
        .route("/api/version", get(version))
        .route("/metrics", get(metrics::metrics))
        .merge(ollama_models::routes())
        .merge(
            // The routes that change the store: `[server] store_changes` decides who may.
            ollama_models::store_routes()
                .merge(ollama_store::routes())
                .route_layer(from_fn_with_state(safety.clone(), safety::store_change)),
        )
        .route("/api/embed", post(ollama_embed::embed))
        .route("/api/embeddings", post(ollama_embed::embeddings))
        .route("/api/chat", post(ollama_generate::chat))
        .route("/api/generate", post(ollama_generate::generate))
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/v1/completions", post(openai::completions))
        .route("/v1/responses", post(openai::responses))
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        .route("/v1/embeddings", post(openai::embeddings))
        .route("/v1/models", get(openai::models))
        .route("/v1/models/{*model}", get(openai::model))
        // Every body above is JSON; uploads (merged below) are raw bytes.
        .route_layer(from_fn(safety::json_only))
        .merge(ollama_store::blob_routes().route_layer(from_fn_with_state(safety.clone(), safety::store_change)))
        // Last: it applies to the routes registered before it.
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(state)
        // Layers apply to the fallbacks too; the last one added runs first.
        .layer(DefaultBodyLimit::max(safety.body_limit()))
        .layer(from_fn_with_state(safety, safety::guard))
        .layer(from_fn(version_header))
}

/// Names corral and its version on every answer, refusals included.
async fn version_header(request: axum::extract::Request, next: axum::middleware::Next) -> axum::response::Response {
    let mut response = next.run(request).await;
    response.headers_mut().insert(HeaderName::from_static(VERSION_HEADER), HeaderValue::from_static(crate::VERSION));
    response
}

async fn root() -> &'static str {
    "corral is running"
}

/// `/api/version`: Ollama's shape, with corral's own version beside it.
#[derive(Serialize)]
struct Version {
    version: &'static str,
    corral_version: &'static str,
}

async fn version() -> Json<Version> {
    Json(Version { version: OLLAMA_VERSION, corral_version: crate::VERSION })
}

async fn not_found(uri: Uri) -> ApiError {
    ApiError::about_url(StatusCode::NOT_FOUND, format!("path {} not found", uri.path()), uri.path())
}

async fn method_not_allowed(uri: Uri) -> ApiError {
    ApiError::about_url(StatusCode::METHOD_NOT_ALLOWED, format!("method not allowed on {}", uri.path()), uri.path())
}

#[cfg(test)]
mod tests {
    use axum::body::Body;
    use axum::http::{Method, Request, StatusCode};
    use tower::ServiceExt;

    use super::router;
    use super::state::{absent_backend, for_tests};

    async fn call(method: Method, path: &str) -> (StatusCode, String, String) {
        let (_dir, state) = for_tests(absent_backend());
        let request = Request::builder().method(method).uri(path).body(Body::empty()).expect("request");
        let response = router(state).oneshot(request).await.expect("infallible");
        let status = response.status();
        let content_type =
            response.headers().get("content-type").map(|v| v.to_str().expect("ascii").to_owned()).unwrap_or_default();
        let body = axum::body::to_bytes(response.into_body(), 1 << 20).await.expect("body");
        (status, content_type, String::from_utf8(body.to_vec()).expect("utf-8"))
    }

    #[tokio::test]
    async fn root_says_corral_is_running() {
        let (status, ctype, body) = call(Method::GET, "/").await;
        assert_eq!(status, StatusCode::OK);
        assert!(ctype.starts_with("text/plain"), "{ctype}");
        assert_eq!(body, "corral is running");
    }

    #[tokio::test]
    async fn version_has_ollamas_shape() {
        let (status, ctype, body) = call(Method::GET, "/api/version").await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(ctype, "application/json");
        let json: serde_json::Value = serde_json::from_str(&body).expect("json");
        assert_eq!(json, serde_json::json!({ "version": "0.31.1", "corral_version": env!("CARGO_PKG_VERSION") }));
    }

    #[tokio::test]
    async fn head_answers_like_get_without_a_body() {
        for path in ["/", "/api/version"] {
            let (status, _, body) = call(Method::HEAD, path).await;
            assert_eq!(status, StatusCode::OK, "{path}");
            assert!(body.is_empty(), "{path}: {body}");
        }
    }

    #[tokio::test]
    async fn unknown_paths_get_a_json_404_in_ollamas_shape() {
        let (status, ctype, body) = call(Method::GET, "/api/nope").await;
        assert_eq!(status, StatusCode::NOT_FOUND);
        assert_eq!(ctype, "application/json");
        let json: serde_json::Value = serde_json::from_str(&body).expect("json");
        assert_eq!(json, serde_json::json!({ "error": "path /api/nope not found" }));
    }

    #[tokio::test]
    async fn unknown_openai_paths_get_openais_error_shape() {
        let (status, _, body) = call(Method::POST, "/v1/nope").await;
        assert_eq!(status, StatusCode::NOT_FOUND);
        let json: serde_json::Value = serde_json::from_str(&body).expect("json");
        assert_eq!(json["error"]["message"], "path /v1/nope not found");
        assert_eq!(json["error"]["type"], "not_found_error");
        assert_eq!(json["error"]["code"], 404);
    }

    #[tokio::test]
    async fn wrong_method_is_a_json_405() {
        let (status, _, body) = call(Method::DELETE, "/api/version").await;
        assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);
        let json: serde_json::Value = serde_json::from_str(&body).expect("json");
        assert_eq!(json, serde_json::json!({ "error": "method not allowed on /api/version" }));
    }
}
