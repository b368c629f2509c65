//! `/api/chat` and `/api/generate` against the real llama-server on the tiny llama:
//! Ollama's NDJSON stream and single-object replies, the final fields, named errors,
//! loading and unloading with an empty prompt, and a client that goes away mid-stream.

use axum::body::Body;
use axum::http::{Request, StatusCode};
use corral::http::{AppState, router};
use http_body_util::BodyExt;
use serde_json::Value;
use tower::ServiceExt;

use crate::support::api::{call, leases_reach_zero, send, state};

/// Status, content type, and the body's NDJSON lines (one, for a plain JSON reply).
async fn post(state: &AppState, path: &str, body: &str) -> (StatusCode, String, Vec<Value>) {
    let (status, content_type, text) = call(state, "POST", path, body).await;
    let lines = text.lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}"))).collect();
    (status, content_type, lines)
}

fn assert_final(last: &Value, reason: &str, eval_count: u64) {
    assert_eq!(last["done"], true, "{last}");
    assert_eq!(last["done_reason"], reason, "{last}");
    assert_eq!(last["eval_count"], eval_count, "{last}");
    assert!(last["prompt_eval_count"].as_u64().is_some_and(|n| n > 0), "{last}");
    for field in ["total_duration", "load_duration", "prompt_eval_duration", "eval_duration"] {
        assert!(last[field].is_u64(), "{field}: {last}");
    }
    assert!(last["total_duration"].as_u64() >= last["load_duration"].as_u64(), "{last}");
    assert!(humantime::parse_rfc3339(last["created_at"].as_str().expect("created_at")).is_ok(), "{last}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_streams_ndjson_and_answers_whole() {
    let dir = tempfile::tempdir().expect("tempdir");
    let state = state(dir.path());
    let request = r#"{"model":"chat","messages":[{"role":"user","content":"hello"}],"options":{"num_predict":8,"temperature":0,"seed":1}}"#;
    let (status, ctype, lines) = post(&state, "/api/chat", request).await;
    assert_eq!(status, StatusCode::OK, "{lines:?}");
    assert_eq!(ctype, "application/x-ndjson");
    let (last, chunks) = lines.split_last().expect("lines");
    assert_eq!(chunks.len(), 8, "one line per token: {lines:?}");
    for chunk in chunks {
        assert_eq!(chunk["done"], false, "{chunk}");
        assert_eq!(chunk["model"], "chat:latest");
        assert_eq!(chunk["message"]["role"], "assistant");
        assert!(chunk["message"]["content"].as_str().is_some_and(|c| !c.is_empty()), "{chunk}");
    }
    assert_eq!(lines.iter().filter(|l| l["done"] == true).count(), 1);
    assert_final(last, "length", 8);
    assert_eq!(last["message"]["content"], "");
    let streamed: String = chunks.iter().map(|c| c["message"]["content"].as_str().unwrap_or_default()).collect();

    let whole = request.replace("\"options\"", "\"stream\":false,\"options\"");
    let (status, ctype, lines) = post(&state, "/api/chat", &whole).await;
    assert_eq!(status, StatusCode::OK, "{lines:?}");
    assert_eq!(ctype, "application/json");
    assert_eq!(lines.len(), 1);
    assert_final(&lines[0], "length", 8);
    assert_eq!(lines[0]["message"]["content"], streamed.as_str(), "greedy with a seed gives the same text");

    // Both answers' tokens are counted in /metrics.
    let request = Request::get("/metrics").body(Body::empty()).expect("request");
    let response = router(state.clone()).oneshot(request).await.expect("infallible");
    let text =
        String::from_utf8(response.into_body().collect().await.expect("body").to_bytes().to_vec()).expect("utf-8");
    assert!(text.lines().any(|l| l == "corral_generated_tokens_total 16"), "{text}");
    assert!(text.lines().any(|l| l.starts_with("corral_prompt_tokens_total ") && !l.ends_with(" 0")), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generate_streams_templated_and_raw_and_answers_whole() {
    let dir = tempfile::tempdir().expect("tempdir");
    let state = state(dir.path());
    for raw in [false, true] {
        let request = format!(
            r#"{{"model":"chat","prompt":"once upon","system":"be brief","raw":{raw},"options":{{"num_predict":8}}}}"#
        );
        let (status, ctype, lines) = post(&state, "/api/generate", &request).await;
        assert_eq!(status, StatusCode::OK, "raw {raw}: {lines:?}");
        assert_eq!(ctype, "application/x-ndjson");
        let (last, chunks) = lines.split_last().expect("lines");
        assert_eq!(chunks.len(), 8, "raw {raw}: {lines:?}");
        assert!(chunks.iter().all(|c| c["done"] == false && c["response"].as_str().is_some_and(|r| !r.is_empty())));
        assert_final(last, "length", 8);
        assert_eq!(last["response"], "");

        let whole = request.replace("\"options\"", "\"stream\":false,\"options\"");
        let (status, _, lines) = post(&state, "/api/generate", &whole).await;
        assert_eq!(status, StatusCode::OK, "raw {raw}: {lines:?}");
        assert_eq!(lines.len(), 1);
        assert_final(&lines[0], "length", 8);
        assert!(lines[0]["response"].as_str().is_some_and(|r| !r.is_empty()));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_prompt_loads_and_keep_alive_zero_unloads() {
    let dir = tempfile::tempdir().expect("tempdir");
    let state = state(dir.path());
    let (status, _, lines) = post(&state, "/api/generate", r#"{"model":"chat"}"#).await;
    assert_eq!(status, StatusCode::OK, "{lines:?}");
    assert_eq!((lines[0]["done"].clone(), lines[0]["done_reason"].clone()), (Value::Bool(true), "load".into()));
    let loaded = state.scheduler.loaded().await.expect("loaded");
    assert_eq!(loaded.len(), 1);
    leases_reach_zero(&state).await;

    let (status, _, lines) = post(&state, "/api/chat", r#"{"model":"chat","messages":[],"keep_alive":0}"#).await;
    assert_eq!(status, StatusCode::OK, "{lines:?}");
    assert_eq!(lines[0]["done_reason"], "unload");
    assert_eq!(lines[0]["message"]["content"], "");
    assert!(state.scheduler.loaded().await.expect("loaded").is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_generation_requests_are_named_and_load_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let state = state(dir.path());
    let cases = [
        ("/api/chat", "not json", StatusCode::BAD_REQUEST, "invalid JSON"),
        ("/api/chat", r#"{"messages":[]}"#, StatusCode::BAD_REQUEST, "model is required"),
        ("/api/generate", r#"{"prompt":"x"}"#, StatusCode::BAD_REQUEST, "model is required"),
        ("/api/chat", r#"{"model":"chat","messages":"hi"}"#, StatusCode::BAD_REQUEST, "messages must be a list"),
        (
            "/api/chat",
            r#"{"model":"chat","messages":[{"role":"user","content":3}]}"#,
            StatusCode::BAD_REQUEST,
            "each message",
        ),
        ("/api/chat", r#"{"model":"nope","messages":[]}"#, StatusCode::NOT_FOUND, "model 'nope' not found"),
        ("/api/generate", r#"{"model":"nope","prompt":"x"}"#, StatusCode::NOT_FOUND, "model 'nope' not found"),
        ("/api/generate", r#"{"model":"chat","prompt":5}"#, StatusCode::BAD_REQUEST, "prompt must be a string"),
        ("/api/generate", r#"{"model":"chat","prompt":"x","stream":"yes"}"#, StatusCode::BAD_REQUEST, "stream must be"),
        (
            "/api/generate",
            r#"{"model":"chat","prompt":"x","options":{"temperature":"hot"}}"#,
            StatusCode::BAD_REQUEST,
            "invalid option temperature",
        ),
        ("/api/generate", r#"{"model":"embed","prompt":"x"}"#, StatusCode::BAD_REQUEST, "does not support generate"),
    ];
    for (path, body, status, message) in cases {
        let (got, _, reply) = post(&state, path, body).await;
        assert_eq!(got, status, "{path} {body}: {reply:?}");
        let error = reply.first().and_then(|r| r["error"].as_str()).unwrap_or_default();
        assert!(error.contains(message), "{path} {body}: {error}");
    }
    assert!(state.scheduler.loaded().await.expect("loaded").is_empty(), "no bad request loaded a model");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_goes_away_mid_stream_releases_the_runner() {
    let dir = tempfile::tempdir().expect("tempdir");
    let state = state(dir.path());
    let response =
        send(&state, "POST", "/api/generate", r#"{"model":"chat","prompt":"go on","options":{"num_predict":400}}"#)
            .await;
    assert_eq!(response.status(), StatusCode::OK);
    let mut body = response.into_body();
    let first = body.frame().await.expect("a frame").expect("no error").into_data().expect("data");
    let first: Value = serde_json::from_slice(first.split(|b| *b == b'\n').next().expect("a line")).expect("json");
    assert_eq!(first["done"], false, "{first}");
    let loaded = state.scheduler.loaded().await.expect("loaded");
    assert_eq!(loaded[0].leases, 1, "the stream holds the runner");
    drop(body);
    leases_reach_zero(&state).await;
    // The runner is still good for the next request.
    let (status, _, lines) =
        post(&state, "/api/generate", r#"{"model":"chat","prompt":"x","stream":false,"options":{"num_predict":2}}"#)
            .await;
    assert_eq!(status, StatusCode::OK, "{lines:?}");
    assert_final(&lines[0], "length", 2);
}
