//! `/v1/*` against the real llama-server: OpenAI's chat completions, completions and
//! responses (whole and as server-sent events), embeddings, the model list, and errors in
//! OpenAI's shape; Anthropic's messages and their token count, errors in Anthropic's shape.

use axum::body::Body;
use axum::http::{Request, StatusCode};
use corral::http::{AppState, router};
use http_body_util::BodyExt;
use serde_json::Value;
use tower::ServiceExt;

use crate::support::api::{call, leases_reach_zero, state};

async fn json(state: &AppState, method: &str, path: &str, body: &str) -> (StatusCode, Value) {
    let (status, _, text) = call(state, method, path, body).await;
    (status, serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}")))
}

/// The `data:` payloads of a server-sent event stream.
fn events(text: &str) -> Vec<&str> {
    text.lines().filter_map(|l| l.strip_prefix("data:")).map(str::trim).collect()
}

fn assert_openai_error(status: StatusCode, json: &Value, expected: StatusCode, message: &str) {
    assert_eq!(status, expected, "{json}");
    let text = json["error"]["message"].as_str().unwrap_or_else(|| panic!("no message: {json}"));
    assert!(text.contains(message), "{message:?} in {json}");
    assert_eq!(json["error"]["code"], expected.as_u16(), "{json}");
    assert!(json["error"]["type"].is_string(), "{json}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_completions_whole_and_streamed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let state = state(dir.path());
    let request =
        r#"{"model":"chat","messages":[{"role":"user","content":"hello"}],"max_tokens":8,"temperature":0,"seed":1}"#;
    let (status, ctype, text) = call(&state, "POST", "/v1/chat/completions", request).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    assert!(ctype.starts_with("application/json"), "{ctype}");
    let reply: Value = serde_json::from_str(&text).expect("json");
    assert_eq!(reply["object"], "chat.completion", "{reply}");
    assert_eq!(reply["model"], "chat:latest", "{reply}");
    let content = reply["choices"][0]["message"]["content"].as_str().expect("content");
    assert!(!content.is_empty(), "{reply}");
    assert_eq!(reply["usage"]["completion_tokens"], 8, "{reply}");
    assert_eq!(reply["choices"][0]["finish_reason"], "length", "{reply}");
    leases_reach_zero(&state).await;

    let streamed = request.replace("\"max_tokens\"", "\"stream\":true,\"max_tokens\"");
    let (status, ctype, text) = call(&state, "POST", "/v1/chat/completions", &streamed).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    assert_eq!(ctype, "text/event-stream");
    let data = events(&text);
    let (last, chunks) = data.split_last().expect("events");
    assert_eq!(*last, "[DONE]", "{text}");
    let chunks: Vec<Value> = chunks.iter().map(|c| serde_json::from_str(c).expect("chunk")).collect();
    assert!(chunks.iter().all(|c| c["object"] == "chat.completion.chunk" && c["model"] == "chat:latest"), "{text}");
    let joined: String = chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect::<String>();
    assert_eq!(joined, content, "greedy with a seed gives the same text");
    leases_reach_zero(&state).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_whole_and_streamed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let state = state(dir.path());
    let request = r#"{"model":"chat","prompt":"once upon","max_tokens":8}"#;
    let (status, reply) = json(&state, "POST", "/v1/completions", request).await;
    assert_eq!(status, StatusCode::OK, "{reply}");
    assert_eq!(reply["model"], "chat:latest", "{reply}");
    assert!(reply["choices"][0]["text"].as_str().is_some_and(|t| !t.is_empty()), "{reply}");
    assert_eq!(reply["usage"]["completion_tokens"], 8, "{reply}");

    let streamed = request.replace("\"max_tokens\"", "\"stream\":true,\"max_tokens\"");
    let (status, ctype, text) = call(&state, "POST", "/v1/completions", &streamed).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    assert_eq!(ctype, "text/event-stream");
    let data = events(&text);
    assert_eq!(data.last().copied(), Some("[DONE]"), "{text}");
    assert!(data.len() > 1, "{text}");
    leases_reach_zero(&state).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embeddings_pass_through() {
    let dir = tempfile::tempdir().expect("tempdir");
    let state = state(dir.path());
    let (status, reply) = json(&state, "POST", "/v1/embeddings", r#"{"model":"embed","input":["a","b c"]}"#).await;
    assert_eq!(status, StatusCode::OK, "{reply}");
    assert_eq!(reply["object"], "list", "{reply}");
    assert_eq!(reply["model"], "embed:latest", "{reply}");
    let data = reply["data"].as_array().expect("data");
    assert_eq!(data.len(), 2, "{reply}");
    for item in data {
        assert_eq!(item["embedding"].as_array().map(Vec::len), Some(64), "{item}");
    }
    leases_reach_zero(&state).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_list_and_get() {
    let dir = tempfile::tempdir().expect("tempdir");
    let state = state(dir.path());
    let (status, list) = json(&state, "GET", "/v1/models", "").await;
    assert_eq!(status, StatusCode::OK, "{list}");
    assert_eq!(list["object"], "list");
    let mut ids: Vec<&str> = list["data"].as_array().expect("data").iter().filter_map(|m| m["id"].as_str()).collect();
    ids.sort_unstable();
    assert_eq!(ids, ["chat:latest", "embed:latest"], "{list}");
    for model in list["data"].as_array().expect("data") {
        assert_eq!(model["object"], "model", "{model}");
        assert_eq!(model["owned_by"], "library", "{model}");
        assert!(model["created"].as_u64().is_some_and(|c| c > 1_600_000_000), "{model}");
    }

    let (status, model) = json(&state, "GET", "/v1/models/chat", "").await;
    assert_eq!(status, StatusCode::OK, "{model}");
    assert_eq!(model["id"], "chat:latest");
    assert_eq!(model["object"], "model");
    let (status, model) = json(&state, "GET", "/v1/models/ghost:1", "").await;
    assert_openai_error(status, &model, StatusCode::NOT_FOUND, "model 'ghost:1' not found");
    assert_eq!(model["error"]["type"], "not_found_error");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_come_in_openais_shape() {
    let dir = tempfile::tempdir().expect("tempdir");
    let state = state(dir.path());
    let cases = [
        ("/v1/chat/completions", r#"{"messages":[]}"#, StatusCode::BAD_REQUEST, "model is required"),
        (
            "/v1/chat/completions",
            r#"{"model":"ghost","messages":[]}"#,
            StatusCode::NOT_FOUND,
            "model 'ghost' not found",
        ),
        ("/v1/chat/completions", "{not json", StatusCode::BAD_REQUEST, "invalid JSON"),
        (
            "/v1/chat/completions",
            r#"{"model":"embed","messages":[{"role":"user","content":"x"}]}"#,
            StatusCode::BAD_REQUEST,
            "does not support generate",
        ),
        ("/v1/completions", r#"{"model":"embed","prompt":"x"}"#, StatusCode::BAD_REQUEST, "does not support generate"),
        ("/v1/embeddings", r#"{"model":"chat","input":"x"}"#, StatusCode::BAD_REQUEST, "does not support embeddings"),
        ("/v1/embeddings", r#"{"input":"x"}"#, StatusCode::BAD_REQUEST, "model is required"),
    ];
    for (path, body, expected, message) in cases {
        let (status, reply) = json(&state, "POST", path, body).await;
        assert_openai_error(status, &reply, expected, message);
    }
    // None of these loaded anything.
    assert!(state.scheduler.loaded().await.expect("loaded").is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_goes_away_mid_stream_releases_the_runner() {
    let dir = tempfile::tempdir().expect("tempdir");
    let state = state(dir.path());
    for (path, request, first_bytes) in [
        (
            "/v1/completions",
            r#"{"model":"chat","prompt":"once upon","max_tokens":100000,"stream":true}"#,
            &b"data:"[..],
        ),
        (
            "/v1/messages",
            r#"{"model":"chat","max_tokens":100000,"stream":true,"messages":[{"role":"user","content":"x"}]}"#,
            &b"event: message_start"[..],
        ),
    ] {
        let request =
            Request::post(path).header("content-type", "application/json").body(Body::from(request)).expect("request");
        let response = router(state.clone()).oneshot(request).await.expect("infallible");
        assert_eq!(response.status(), StatusCode::OK, "{path}");
        let mut body = response.into_body();
        let first = body.frame().await.expect("a first piece").expect("no error");
        assert!(first.data_ref().is_some_and(|d| d.starts_with(first_bytes)), "{path}: {first:?}");
        let loaded = state.scheduler.loaded().await.expect("loaded");
        assert_eq!(loaded.iter().map(|m| m.leases).sum::<u32>(), 1, "{path}: the body holds the lease: {loaded:?}");
        drop(body);
        leases_reach_zero(&state).await;
    }
}

/// The `corral_*_tokens_total` counters.
async fn token_totals(state: &AppState) -> (u64, u64) {
    let (_, _, text) = call(state, "GET", "/metrics", "").await;
    let value = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name).and_then(|v| v.trim().parse().ok()))
            .unwrap_or_else(|| panic!("no {name} in {text}"))
    };
    (value("corral_prompt_tokens_total "), value("corral_generated_tokens_total "))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_runners_status_and_content_type_pass_through_and_tokens_are_counted() {
    let dir = tempfile::tempdir().expect("tempdir");
    let state = state(dir.path());
    // The runner's own header, parameter included (corral's default would be bare).
    let request = r#"{"model":"chat","messages":[{"role":"user","content":"hi"}],"max_tokens":8}"#;
    let (status, ctype, text) = call(&state, "POST", "/v1/chat/completions", request).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    assert_eq!(ctype, "application/json; charset=utf-8");
    let (prompt, generated) = token_totals(&state).await;
    assert_eq!(generated, 8, "from the answer's usage");
    assert!(prompt > 0);

    // A stream whose last event carries usage, and one whose has only timings.
    let streamed = r#"{"model":"chat","prompt":"once upon","max_tokens":5,"stream":true}"#;
    let (status, ctype, text) = call(&state, "POST", "/v1/completions", streamed).await;
    assert_eq!((status, ctype.as_str()), (StatusCode::OK, "text/event-stream"), "{text}");
    assert_eq!(token_totals(&state).await.1, 13);
    let chat = r#"{"model":"chat","messages":[{"role":"user","content":"hi"}],"max_tokens":3,"stream":true}"#;
    let (status, _, text) = call(&state, "POST", "/v1/chat/completions", chat).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    assert_eq!(token_totals(&state).await.1, 16);
    let (status, _, text) = call(&state, "POST", "/v1/embeddings", r#"{"model":"embed","input":"a b"}"#).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let (after, generated) = token_totals(&state).await;
    assert_eq!(generated, 16, "embeddings generate nothing");
    assert!(after > prompt, "but their input counts");

    // The runner's refusal keeps its status and type.
    let wrong = r#"{"model":"chat","messages":"nope"}"#;
    let (status, ctype, text) = call(&state, "POST", "/v1/chat/completions", wrong).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{text}");
    assert_eq!(ctype, "application/json; charset=utf-8");
    assert!(text.contains("messages"), "{text}");
    leases_reach_zero(&state).await;
}

/// The text of a Responses API answer, whole.
fn response_text(reply: &Value) -> &str {
    reply["output"][0]["content"][0]["text"].as_str().unwrap_or_else(|| panic!("no text in {reply}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_whole_and_streamed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let state = state(dir.path());
    let request = r#"{"model":"chat","input":"hello","max_output_tokens":8,"temperature":0,"seed":1}"#;
    let (status, reply) = json(&state, "POST", "/v1/responses", request).await;
    assert_eq!(status, StatusCode::OK, "{reply}");
    assert_eq!((reply["object"].as_str(), reply["model"].as_str()), (Some("response"), Some("chat:latest")), "{reply}");
    let content = response_text(&reply).to_owned();
    assert!(!content.is_empty(), "{reply}");
    assert_eq!(reply["usage"]["output_tokens"], 8, "{reply}");
    assert_eq!(token_totals(&state).await.1, 8, "counted from the answer's usage");

    let streamed = request.replace("\"max_output_tokens\"", "\"stream\":true,\"max_output_tokens\"");
    let (status, ctype, text) = call(&state, "POST", "/v1/responses", &streamed).await;
    assert_eq!((status, ctype.as_str()), (StatusCode::OK, "text/event-stream"), "{text}");
    let data: Vec<Value> = events(&text).iter().map(|e| serde_json::from_str(e).expect("an event")).collect();
    let kinds: Vec<&str> = data.iter().filter_map(|e| e["type"].as_str()).collect();
    assert_eq!((kinds.first(), kinds.last()), (Some(&"response.created"), Some(&"response.completed")), "{text}");
    let joined: String =
        data.iter().filter(|e| e["type"] == "response.output_text.delta").filter_map(|e| e["delta"].as_str()).collect();
    assert_eq!(joined, content, "greedy with a seed gives the same text");
    let completed = data.last().expect("events");
    assert_eq!(completed["response"]["model"], "chat:latest", "{completed}");
    assert_eq!(token_totals(&state).await.1, 16, "counted from the last event's usage");

    // The runner's refusals keep their status, in OpenAI's shape as it gives them.
    for (wrong, message) in [
        (r#"{"model":"chat","max_output_tokens":8}"#, "'input' is required"),
        (r#"{"model":"chat","input":"hi","previous_response_id":"resp_1"}"#, "previous_response_id"),
    ] {
        let (status, reply) = json(&state, "POST", "/v1/responses", wrong).await;
        assert_openai_error(status, &reply, StatusCode::BAD_REQUEST, message);
    }
    leases_reach_zero(&state).await;
}

/// An error in Anthropic's shape: `{"type": "error", "error": {"type", "message"}}`.
fn assert_anthropic_error(status: StatusCode, json: &Value, expected: StatusCode, kind: &str, message: &str) {
    assert_eq!(status, expected, "{json}");
    assert_eq!((json["type"].as_str(), json["error"]["type"].as_str()), (Some("error"), Some(kind)), "{json}");
    let text = json["error"]["message"].as_str().unwrap_or_else(|| panic!("no message: {json}"));
    assert!(text.contains(message), "{message:?} in {json}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_messages_whole_streamed_and_counted() {
    let dir = tempfile::tempdir().expect("tempdir");
    let state = state(dir.path());
    let request = r#"{"model":"chat","max_tokens":8,"temperature":0,"system":"be brief","messages":[{"role":"user","content":[{"type":"text","text":"hello"}]}]}"#;
    let (status, ctype, text) = call(&state, "POST", "/v1/messages", request).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    assert!(ctype.starts_with("application/json"), "{ctype}");
    let reply: Value = serde_json::from_str(&text).expect("json");
    assert_eq!((reply["type"].as_str(), reply["model"].as_str()), (Some("message"), Some("chat:latest")), "{reply}");
    assert_eq!(reply["stop_reason"], "max_tokens", "{reply}");
    let content = reply["content"][0]["text"].as_str().expect("text").to_owned();
    assert!(!content.is_empty(), "{reply}");
    assert_eq!(reply["usage"]["output_tokens"], 8, "{reply}");
    let (prompt, generated) = token_totals(&state).await;
    assert_eq!(generated, 8, "counted from the answer's usage");
    assert!(prompt > 0);

    let streamed = request.replace("\"max_tokens\"", "\"stream\":true,\"max_tokens\"");
    let (status, ctype, text) = call(&state, "POST", "/v1/messages", &streamed).await;
    assert_eq!((status, ctype.as_str()), (StatusCode::OK, "text/event-stream"), "{text}");
    let names: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("event:")).map(str::trim).collect();
    assert_eq!((names.first(), names.last()), (Some(&"message_start"), Some(&"message_stop")), "{text}");
    let data: Vec<Value> = events(&text).iter().map(|e| serde_json::from_str(e).expect("an event")).collect();
    assert_eq!(data[0]["message"]["model"], "chat:latest", "{text}");
    let joined: String = data.iter().filter_map(|e| e["delta"]["text"].as_str()).collect();
    assert_eq!(joined, content, "greedy gives the same text");
    let (after, generated) = token_totals(&state).await;
    assert_eq!(generated, 16, "counted from message_delta's usage");
    assert!(after >= prompt * 2, "the cached part of the prompt counts too: {prompt} then {after}");

    let count = r#"{"model":"chat","messages":[{"role":"user","content":"hello"}]}"#;
    let (status, reply) = json(&state, "POST", "/v1/messages/count_tokens", count).await;
    assert_eq!(status, StatusCode::OK, "{reply}");
    assert!(reply["input_tokens"].as_u64().is_some_and(|n| n > 0), "{reply}");
    assert_eq!(token_totals(&state).await.1, 16, "a count generates nothing");
    leases_reach_zero(&state).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_errors_come_in_anthropics_shape() {
    let dir = tempfile::tempdir().expect("tempdir");
    let state = state(dir.path());
    let user = r#"[{"role":"user","content":"x"}]"#;
    let cases = [
        (
            "/v1/messages",
            format!(r#"{{"max_tokens":8,"messages":{user}}}"#),
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "model is required",
        ),
        (
            "/v1/messages",
            format!(r#"{{"model":"ghost","messages":{user}}}"#),
            StatusCode::NOT_FOUND,
            "not_found_error",
            "model 'ghost' not found",
        ),
        ("/v1/messages", "{not json".to_owned(), StatusCode::BAD_REQUEST, "invalid_request_error", "invalid JSON"),
        (
            "/v1/messages",
            format!(r#"{{"model":"embed","messages":{user}}}"#),
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "does not support generate",
        ),
        (
            "/v1/messages/count_tokens",
            format!(r#"{{"model":7,"messages":{user}}}"#),
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "model must be a string",
        ),
    ];
    for (path, body, expected, kind, message) in &cases {
        let (status, reply) = json(&state, "POST", path, body).await;
        assert_anthropic_error(status, &reply, *expected, kind, message);
    }
    // None of these loaded anything.
    assert!(state.scheduler.loaded().await.expect("loaded").is_empty());

    // The runner's refusals keep their status and message, reshaped for Anthropic's
    // clients (llama-server answers every endpoint in OpenAI's shape).
    for path in ["/v1/messages", "/v1/messages/count_tokens"] {
        let (status, reply) = json(&state, "POST", path, r#"{"model":"chat","max_tokens":8}"#).await;
        assert_anthropic_error(
            status,
            &reply,
            StatusCode::INTERNAL_SERVER_ERROR,
            "api_error",
            "'messages' is required",
        );
    }
    leases_reach_zero(&state).await;
}
