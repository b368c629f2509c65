//! OpenAI's endpoints: `POST /v1/chat/completions`, `/v1/completions` and
//! `/v1/embeddings` pass through to the same endpoint of the leased runner, with only
//! the model's name rewritten to the runner's alias; `GET /v1/models` and
//! `GET /v1/models/{model}` list the store.
//!
//! The runner's answer is forwarded as it arrives (status kept, server-sent events
//! unchanged, `data: [DONE]` included). The response body holds the lease: it is
//! released when the body ends, or when the client goes away (which also closes the
//! connection to the runner, cancelling the generation).

use std::time::{Duration, SystemTime};

use axum::Json;
use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use serde_json::{Map, Value};

use super::error::ApiError;
use super::model_request;
use super::ollama_embed::{bad, internal, object, schedule_error};
use super::state::AppState;
use crate::scheduler::actor::Lease;
use crate::store::StoreError;
use crate::store::name::ModelName;
use crate::supervisor::upstream::BodyStream;

/// How long a runner may take to start answering (a non-streaming reply comes whole).
const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(600);

/// What a passed-through endpoint needs of the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Needs {
    Generation,
    Embedding,
}

/// `POST /v1/chat/completions`.
pub async fn chat_completions(State(state): State<AppState>, body: Bytes) -> Result<Response, ApiError> {
    pass_through(&state, &body, "/v1/chat/completions", Needs::Generation).await
}

/// `POST /v1/completions`.
pub async fn completions(State(state): State<AppState>, body: Bytes) -> Result<Response, ApiError> {
    pass_through(&state, &body, "/v1/completions", Needs::Generation).await
}

/// `POST /v1/embeddings`.
pub async fn embeddings(State(state): State<AppState>, body: Bytes) -> Result<Response, ApiError> {
    pass_through(&state, &body, "/v1/embeddings", Needs::Embedding).await
}

/// Leases a runner for the request's model and forwards the request to its `path`.
async fn pass_through(state: &AppState, body: &[u8], path: &'static str, needs: Needs) -> Result<Response, ApiError> {
    let mut request = object(body, path)?;
    let (name_text, name) = model_request::model_name(&request, false, path)?;
    let stream = request.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let model_request = model_request::build(state, name, &name_text, Map::new(), None, path).await?;
    match (needs, model_request.options.embedding.is_some()) {
        (Needs::Embedding, false) => return Err(bad(&format!("\"{name_text}\" does not support embeddings"), path)),
        (Needs::Generation, true) => return Err(bad(&format!("\"{name_text}\" does not support generate"), path)),
        _ => {}
    }
    request.insert("model".into(), Value::String(model_request.name.clone()));
    let body = serde_json::to_vec(&Value::Object(request)).expect("JSON values serialize");
    let lease = state.scheduler.acquire(model_request).await.map_err(|e| schedule_error(&e, path))?;
    let (status, upstream) = state
        .upstream
        .post_json_stream(lease.socket(), path, body, UPSTREAM_TIMEOUT)
        .await
        .map_err(|e| internal(&format!("the model runner did not answer: {e}"), path))?;
    // The runner answers a streaming request with server-sent events, anything else
    // (errors included) with JSON.
    let content_type = if stream && status.is_success() { "text/event-stream" } else { "application/json" };
    let forwarded = Forwarded { upstream, _lease: lease };
    let pieces = futures_util::stream::unfold(forwarded, |mut forwarded| async move {
        let piece = forwarded.upstream.chunk().await?;
        Some((piece, forwarded))
    });
    let mut response = Body::from_stream(pieces).into_response();
    *response.status_mut() = status;
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    if stream {
        headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    }
    Ok(response)
}

/// The runner's answer on its way to the client; dropping it closes the connection to
/// the runner and releases the lease.
struct Forwarded {
    upstream: BodyStream,
    _lease: Lease,
}

/// One model in OpenAI's shape.
#[derive(Debug, Serialize)]
struct OpenAiModel {
    id: String,
    object: &'static str,
    created: u64,
    owned_by: String,
}

impl OpenAiModel {
    fn new(name: &ModelName, modified: SystemTime) -> Self {
        Self {
            id: name.to_string(),
            object: "model",
            created: modified.duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_secs()),
            owned_by: name.namespace().to_owned(),
        }
    }
}

#[derive(Debug, Serialize)]
struct ModelList {
    object: &'static str,
    data: Vec<OpenAiModel>,
}

/// `GET /v1/models`: every model in the store, the most recently written first.
pub async fn models(State(state): State<AppState>) -> Result<Json<Value>, ApiError> {
    const PATH: &str = "/v1/models";
    let store = state.store;
    let listed = tokio::task::spawn_blocking(move || store.list())
        .await
        .map_err(|e| internal(&format!("the request task failed: {e}"), PATH))?
        .map_err(|e| internal(&e.to_string(), PATH))?;
    let mut listed = listed;
    listed.sort_by_key(|l| std::cmp::Reverse(l.modified));
    let data = listed.iter().map(|l| OpenAiModel::new(&l.name, l.modified)).collect();
    Ok(Json(serde_json::to_value(ModelList { object: "list", data }).expect("serializes")))
}

/// `GET /v1/models/{model}`: one model, or 404.
pub async fn model(State(state): State<AppState>, Path(name_text): Path<String>) -> Result<Json<Value>, ApiError> {
    let path = format!("/v1/models/{name_text}");
    let not_found = || ApiError::new(StatusCode::NOT_FOUND, format!("model '{name_text}' not found"), &path);
    let Ok(name) = ModelName::parse(&name_text) else { return Err(not_found()) };
    let store = state.store;
    let lookup = name.clone();
    let found = tokio::task::spawn_blocking(move || store.manifest(&lookup))
        .await
        .map_err(|e| internal(&format!("the request task failed: {e}"), &path))?;
    match found {
        Ok((_, _, modified)) => Ok(Json(serde_json::to_value(OpenAiModel::new(&name, modified)).expect("serializes"))),
        Err(StoreError::NotFound(_)) => Err(not_found()),
        Err(e) => Err(internal(&e.to_string(), &path)),
    }
}

#[cfg(test)]
mod tests {
    use axum::body::Body;
    use axum::http::{Method, Request, StatusCode};
    use serde_json::Value;
    use tower::ServiceExt;

    use crate::http::router;
    use crate::http::state::{absent_backend, for_tests};

    async fn call(method: Method, path: &str, body: &str) -> (StatusCode, Value) {
        let (_dir, state) = for_tests(absent_backend());
        let request = Request::builder()
            .method(method)
            .uri(path)
            .header("content-type", "application/json")
            .body(Body::from(body.to_owned()))
            .expect("request");
        let response = router(state).oneshot(request).await.expect("infallible");
        let status = response.status();
        let body = axum::body::to_bytes(response.into_body(), 1 << 20).await.expect("body");
        (status, serde_json::from_slice(&body).expect("json"))
    }

    #[tokio::test]
    async fn requests_without_a_usable_model_are_refused_in_openais_shape() {
        for path in ["/v1/chat/completions", "/v1/completions", "/v1/embeddings"] {
            for (body, status, message) in [
                ("{}", StatusCode::BAD_REQUEST, "model is required"),
                (r#"{"model":3}"#, StatusCode::BAD_REQUEST, "model must be a string"),
                ("{nope", StatusCode::BAD_REQUEST, "invalid JSON"),
                ("[]", StatusCode::BAD_REQUEST, "the request body must be a JSON object"),
                (r#"{"model":"ghost"}"#, StatusCode::NOT_FOUND, "model 'ghost' not found"),
            ] {
                let (got, json) = call(Method::POST, path, body).await;
                assert_eq!(got, status, "{path} {body}: {json}");
                let text = json["error"]["message"].as_str().expect("message");
                assert!(text.starts_with(message), "{path} {body}: {json}");
                assert_eq!(json["error"]["code"], status.as_u16(), "{json}");
                assert!(json["error"]["type"].is_string(), "{json}");
            }
        }
    }

    #[tokio::test]
    async fn an_empty_store_lists_no_models_and_finds_none() {
        let (status, json) = call(Method::GET, "/v1/models", "").await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(json, serde_json::json!({ "object": "list", "data": [] }));
        let (status, json) = call(Method::GET, "/v1/models/me/ghost:1", "").await;
        assert_eq!(status, StatusCode::NOT_FOUND);
        assert_eq!(json["error"]["message"], "model 'me/ghost:1' not found");
        assert_eq!(json["error"]["type"], "not_found_error");
    }
}
