//! OpenAI's endpoints: `POST /v1/chat/completions`, `/v1/completions`, `/v1/responses`
//! and `/v1/embeddings` pass through to the same endpoint of the leased runner, with only
//! the model's name rewritten to the runner's alias ([`pass_through`], which Anthropic's
//! endpoints use too); `GET /v1/models` and `GET /v1/models/{model}` list the store.
//!
//! The runner's answer is forwarded as it arrives (status kept, server-sent events
//! unchanged, `data: [DONE]` included). The response body holds the lease: it is
//! released when the body ends, or when the client goes away (which also closes the
//! connection to the runner, cancelling the generation).

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use axum::Json;
use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use serde_json::{Map, Value};

use super::error::{self, ApiError, StoreWork, bad, internal};
use super::json_body::json_object;
use super::model_request;
use super::runner_call;
use super::state::{AppState, Tokens};
use super::stream_scan::{EventScanner, JsonTail};
use crate::scheduler::handle::{Handle, Lease};
use crate::store::name::ModelName;
use crate::supervisor::upstream::BodyStream;

/// How long a runner may take to start answering (a non-streaming reply comes whole).
const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(600);

/// What a passed-through endpoint needs of the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Needs {
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

/// `POST /v1/responses` (OpenAI's Responses API; llama-server keeps no responses, so a
/// `previous_response_id` is the runner's error to give).
pub async fn responses(State(state): State<AppState>, body: Bytes) -> Result<Response, ApiError> {
    pass_through(&state, &body, "/v1/responses", Needs::Generation).await
}

/// `POST /v1/embeddings`.
pub async fn embeddings(State(state): State<AppState>, body: Bytes) -> Result<Response, ApiError> {
    pass_through(&state, &body, "/v1/embeddings", Needs::Embedding).await
}

/// Leases a runner for the request's model and forwards the request to its `path`.
pub(super) async fn pass_through(
    state: &AppState,
    body: &[u8],
    path: &'static str,
    needs: Needs,
) -> Result<Response, ApiError> {
    let mut request = json_object(path, body)?;
    let (name_text, name) = model_request::model_name(&request, false, path)?;
    let stream = request.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let model_request = model_request::build(state, name, &name_text, Map::new(), None, path).await?;
    match (needs, model_request.options.embedding.is_some()) {
        (Needs::Embedding, false) => return Err(bad(format!("\"{name_text}\" does not support embeddings"), path)),
        (Needs::Generation, true) => return Err(bad(format!("\"{name_text}\" does not support generate"), path)),
        _ => {}
    }
    request.insert("model".into(), Value::String(model_request.name.clone()));
    let body = serde_json::to_vec(&Value::Object(request)).expect("JSON values serialize");
    let runner_call::Answer { lease, status, body: upstream, .. } =
        runner_call::send(state, model_request, path, body, UPSTREAM_TIMEOUT, path).await?;
    if !status.is_success() && !error::reads_runners_errors(path) {
        let reply = runner_call::refusal(upstream).await;
        drop(lease);
        return Err(error::passed_refusal(status, &reply, path));
    }
    // The runner's own content type; should it send none, what it sends for such a
    // request: server-sent events for a streaming one, else (errors included) JSON.
    let content_type = upstream.content_type().cloned().unwrap_or_else(|| {
        HeaderValue::from_static(if stream && status.is_success() { "text/event-stream" } else { "application/json" })
    });
    let events = content_type.as_bytes().starts_with(b"text/event-stream");
    let usage = Usage::new(events, Arc::clone(&state.tokens));
    let forwarded = Forwarded {
        upstream: Some(upstream),
        usage: status.is_success().then_some(usage),
        lease: Some(lease),
        scheduler: state.scheduler.clone(),
        events,
        path,
    };
    let pieces = futures_util::stream::unfold(forwarded, |mut forwarded| async move {
        let piece = forwarded.upstream.as_mut()?.chunk().await?;
        match piece {
            Ok(bytes) => {
                if let Some(usage) = &mut forwarded.usage {
                    usage.observe(&bytes);
                }
                Some((Ok(bytes), forwarded))
            }
            Err(e) => {
                forwarded.upstream = None;
                let message = runner_call::failed_mid_answer(&forwarded.scheduler, forwarded.lease.take(), &e).await;
                if forwarded.events {
                    // An event stream ends with an error event the client can read.
                    Some((Ok(Bytes::from(error::stream_error_event(&message, forwarded.path))), forwarded))
                } else {
                    // A JSON answer cut short cannot be mended: the connection is broken off.
                    Some((Err(std::io::Error::other(message)), forwarded))
                }
            }
        }
    });
    let mut response = Body::from_stream(pieces).into_response();
    *response.status_mut() = status;
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, content_type);
    if stream {
        headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    }
    Ok(response)
}

/// The runner's answer on its way to the client; dropping it closes the connection to
/// the runner, releases the lease and counts the answer's tokens.
struct Forwarded {
    /// None once the answer failed (the stream then ends).
    upstream: Option<BodyStream>,
    usage: Option<Usage>,
    lease: Option<Lease>,
    scheduler: Handle,
    /// Server-sent events (an error can still be told in the stream).
    events: bool,
    /// The client's path, which decides the shape of that error.
    path: &'static str,
}

impl Drop for Forwarded {
    fn drop(&mut self) {
        if let Some(usage) = self.usage.take() {
            usage.record();
        }
    }
}

/// How much of a JSON answer's end is kept to find its `usage` (it comes after the
/// choices or embeddings; only the end is needed, so large answers are not held).
const JSON_TAIL: usize = 64 * 1024;

/// Counts an answer's tokens for `/metrics` as its pieces pass by, unchanged and
/// undelayed: from `usage` (a JSON answer's, or the latest in a stream's events), else a
/// stream's `timings`; the answer's tokens never fewer than its streamed pieces of text.
#[derive(Debug)]
pub(super) struct Usage {
    /// How the answer is read: as events, or as a JSON answer's last bytes.
    scan: Scan,
    prompt: Option<u64>,
    completion: Option<u64>,
    timings: Option<(u64, u64)>,
    pieces: u64,
    tokens: Arc<Tokens>,
}

#[derive(Debug)]
enum Scan {
    Events(EventScanner),
    Json(JsonTail),
}

impl Usage {
    pub(super) fn new(events: bool, tokens: Arc<Tokens>) -> Self {
        let scan = if events { Scan::Events(EventScanner::default()) } else { Scan::Json(JsonTail::new(JSON_TAIL)) };
        Self { scan, prompt: None, completion: None, timings: None, pieces: 0, tokens }
    }

    pub(super) fn observe(&mut self, bytes: &[u8]) {
        let events = match &mut self.scan {
            Scan::Json(tail) => return tail.feed(bytes),
            Scan::Events(scanner) => scanner.feed(bytes),
        };
        for event in events {
            self.usage(&event["usage"]);
            // Anthropic's `message_start`, the Responses API's `response.completed`.
            self.usage(&event["message"]["usage"]);
            self.usage(&event["response"]["usage"]);
            if let Some(timings) = event.get("timings") {
                if let (Some(p), Some(n)) = (timings["prompt_n"].as_u64(), timings["predicted_n"].as_u64()) {
                    self.timings = Some((p, n));
                }
            }
            let choice = &event["choices"][0];
            let text = (choice["delta"]["content"].as_str())
                .or(choice["text"].as_str())
                // Anthropic's `content_block_delta`, the Responses API's `….delta`.
                .or(event["delta"]["text"].as_str())
                .or(event["delta"].as_str());
            if text.is_some_and(|t| !t.is_empty()) {
                self.pieces += 1;
            }
        }
    }

    /// Reads a `usage` object in OpenAI's chat and completions shape (`prompt_tokens`,
    /// `completion_tokens`) or Anthropic's and the Responses API's (`input_tokens`,
    /// `output_tokens`; Anthropic counts the prompt's cached tokens apart, in
    /// `cache_read_input_tokens`). A count it lacks keeps the one seen before.
    fn usage(&mut self, usage: &Value) {
        if usage.is_object() {
            let input = usage["input_tokens"]
                .as_u64()
                .map(|n| n.saturating_add(usage["cache_read_input_tokens"].as_u64().unwrap_or(0)));
            self.prompt = usage["prompt_tokens"].as_u64().or(input).or(self.prompt);
            self.completion =
                usage["completion_tokens"].as_u64().or(usage["output_tokens"].as_u64()).or(self.completion);
        }
    }

    /// Adds the answer's tokens to the totals (once: it consumes the counter).
    pub(super) fn record(mut self) {
        if let Scan::Json(tail) = &self.scan {
            if let Some(usage) = tail.last_field("usage") {
                self.usage(&usage);
            }
        }
        let (timed_prompt, timed_completion) = self.timings.unzip();
        let prompt = self.prompt.or(timed_prompt).unwrap_or(0);
        // Each streamed piece is at least a token, so the pieces bound the count from below:
        // a stream cut short after Anthropic's first count (0) still counts what it sent.
        let completion = self.completion.or(timed_completion).unwrap_or(0).max(self.pieces);
        self.tokens.record(prompt, completion);
    }
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
    let store = state.store.clone();
    let listed = tokio::task::spawn_blocking(move || store.list())
        .await
        .map_err(|e| internal(format!("the request task failed: {e}"), PATH))?
        .map_err(|e| internal(e.to_string(), PATH))?;
    let mut listed = listed;
    listed.sort_by_key(|l| std::cmp::Reverse(l.modified));
    let data = listed.iter().map(|l| OpenAiModel::new(&l.name, l.modified)).collect();
    Ok(Json(serde_json::to_value(ModelList { object: "list", data }).expect("serializes")))
}

/// `GET /v1/models/{model}`: one model, or 404.
pub async fn model(State(state): State<AppState>, Path(name_text): Path<String>) -> Result<Json<Value>, ApiError> {
    let path = format!("/v1/models/{name_text}");
    let Ok(name) = ModelName::parse(&name_text) else { return Err(error::model_not_found(&name_text, &path)) };
    let store = state.store.clone();
    let lookup = name.clone();
    let found = tokio::task::spawn_blocking(move || store.manifest(&lookup))
        .await
        .map_err(|e| internal(format!("the request task failed: {e}"), &path))?;
    match found {
        Ok((_, _, modified)) => Ok(Json(serde_json::to_value(OpenAiModel::new(&name, modified)).expect("serializes"))),
        Err(e) => Err(error::store(&e, StoreWork::Request, &name_text, &path)),
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
        for path in ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings"] {
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

    #[test]
    fn usage_is_counted_from_events_split_anywhere_and_from_a_json_tail() {
        use std::sync::Arc;

        use super::Usage;
        use crate::http::state::Tokens;

        let stream = concat!(
            "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n",
            "data: {\"choices\":[{\"delta\":{\"content\":\"b\"}}]}\n\n",
            "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":9}}\n\n",
            "data: [DONE]\n\n",
        );
        let tokens = Arc::new(Tokens::default());
        let mut usage = Usage::new(true, Arc::clone(&tokens));
        for piece in stream.as_bytes().chunks(5) {
            usage.observe(piece);
        }
        usage.record();
        assert_eq!(tokens.totals(), (5, 9), "usage wins over counting pieces");

        let tokens = Arc::new(Tokens::default());
        let mut usage = Usage::new(true, Arc::clone(&tokens));
        usage.observe(&stream.as_bytes()[..100]);
        usage.record();
        assert_eq!(tokens.totals(), (0, 2), "a stream cut short counts its pieces of text");

        let tokens = Arc::new(Tokens::default());
        let mut usage = Usage::new(false, Arc::clone(&tokens));
        let padding = "x".repeat(200_000);
        let body = format!(
            "{{\"choices\":[{{\"text\":\"{padding} \\\"usage\\\":\"}}],\"usage\":{{\"prompt_tokens\":3,\"completion_tokens\":4}},\"id\":\"x\"}}"
        );
        for piece in body.as_bytes().chunks(4096) {
            usage.observe(piece);
        }
        usage.record();
        assert_eq!(tokens.totals(), (3, 4));
    }

    #[tokio::test]
    async fn anthropics_endpoints_refuse_in_anthropics_shape() {
        for path in ["/v1/messages", "/v1/messages/count_tokens"] {
            for (body, status, kind, message) in [
                ("{}", StatusCode::BAD_REQUEST, "invalid_request_error", "model is required"),
                ("{nope", StatusCode::BAD_REQUEST, "invalid_request_error", "invalid JSON"),
                (r#"{"model":"ghost"}"#, StatusCode::NOT_FOUND, "not_found_error", "model 'ghost' not found"),
            ] {
                let (got, json) = call(Method::POST, path, body).await;
                assert_eq!(got, status, "{path} {body}: {json}");
                assert_eq!(json["type"], "error", "{path} {body}: {json}");
                assert_eq!(json["error"]["type"], kind, "{path} {body}: {json}");
                let text = json["error"]["message"].as_str().expect("message");
                assert!(text.starts_with(message), "{path} {body}: {json}");
            }
        }
    }

    /// Counts what `pieces` of an answer (events or JSON) say, as `/metrics` would.
    fn counted(events: bool, pieces: &[&[u8]]) -> (u64, u64) {
        use std::sync::Arc;

        use super::Usage;
        use crate::http::state::Tokens;

        let tokens = Arc::new(Tokens::default());
        let mut usage = Usage::new(events, Arc::clone(&tokens));
        for piece in pieces {
            usage.observe(piece);
        }
        usage.record();
        tokens.totals()
    }

    #[test]
    fn anthropics_and_the_responses_apis_usage_is_counted() {
        // As llama-server streams them: the prompt's cached tokens apart in Anthropic's
        // `message_start`, the answer's count in `message_delta`.
        let anthropic = concat!(
            "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":",
            "{\"cache_read_input_tokens\":19,\"input_tokens\":1,\"output_tokens\":0}}}\n\n",
            "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,",
            "\"delta\":{\"type\":\"text_delta\",\"text\":\"f\"}}\n\n",
            "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,",
            "\"delta\":{\"type\":\"text_delta\",\"text\":\" first\"}}\n\n",
            "event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"max_tokens\"},",
            "\"usage\":{\"output_tokens\":3}}\n\n",
            "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
        );
        let split: Vec<&[u8]> = anthropic.as_bytes().chunks(7).collect();
        assert_eq!(counted(true, &split), (20, 3));
        let cut = &anthropic.as_bytes()[..anthropic.find("event: message_delta").expect("in the stream")];
        assert_eq!(counted(true, &[cut]), (20, 2), "a stream cut short counts its pieces of text");

        let responses = concat!(
            "event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"f\"}\n\n",
            "event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"s\"}\n\n",
            "event: response.output_text.done\ndata: {\"type\":\"response.output_text.done\",\"text\":\"fs\"}\n\n",
            "event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"usage\":",
            "{\"input_tokens\":20,\"output_tokens\":3,\"input_tokens_details\":{\"cached_tokens\":19}}}}\n\n",
        );
        assert_eq!(counted(true, &[responses.as_bytes()]), (20, 3));
        let cut = &responses.as_bytes()[..responses.find("event: response.completed").expect("in the stream")];
        assert_eq!(counted(true, &[cut]), (0, 2), "deltas are pieces of text; the whole text is not");

        let message = br#"{"type":"message","content":[],"usage":{"cache_read_input_tokens":0,"input_tokens":20,"output_tokens":8}}"#;
        assert_eq!(counted(false, &[message]), (20, 8));
        let response =
            br#"{"object":"response","output":[],"usage":{"input_tokens":20,"output_tokens":8,"total_tokens":28}}"#;
        assert_eq!(counted(false, &[response]), (20, 8));
        assert_eq!(counted(false, &[br#"{"input_tokens":20}"#]), (0, 0), "a count of tokens generates none");
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
