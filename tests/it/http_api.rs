//! The HTTP API against the real llama-server: embeddings through the scheduler, and
//! the errors clients get for bad requests.

use axum::body::Body;
use axum::http::{Request, StatusCode};
use corral::http::{AppState, router};
use serde_json::{Value, json};
use tower::ServiceExt;

use crate::support::api::{call, state};

async fn post(state: &AppState, path: &str, body: &str) -> (StatusCode, Value) {
    let (status, _, text) = call(state, "POST", path, body).await;
    (status, serde_json::from_str(&text).unwrap_or(Value::Null))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embed_returns_one_vector_per_input_and_the_legacy_endpoint_one() {
    let dir = tempfile::tempdir().expect("tempdir");
    let state = state(dir.path());
    let (status, body) = post(&state, "/api/embed", r#"{"model":"embed","input":["hello world","the model"]}"#).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["model"], "embed:latest");
    let vectors = body["embeddings"].as_array().expect("embeddings");
    assert_eq!(vectors.len(), 2);
    assert!(vectors.iter().all(|v| v.as_array().map(Vec::len) == Some(64)));
    assert_ne!(vectors[0], vectors[1]);
    assert!(body["prompt_eval_count"].as_u64().is_some_and(|n| n > 0));
    assert!(body["total_duration"].as_u64().is_some_and(|n| n >= body["load_duration"].as_u64().unwrap_or(0)));

    let (status, one) = post(&state, "/api/embeddings", r#"{"model":"embed","prompt":"hello world"}"#).await;
    assert_eq!(status, StatusCode::OK, "{one}");
    assert_eq!(one["embedding"], vectors[0], "the same text embeds the same");

    // /metrics counts the load and shows the runner.
    let request = Request::get("/metrics").body(Body::empty()).expect("request");
    let response = router(state.clone()).oneshot(request).await.expect("infallible");
    assert_eq!(response.status(), StatusCode::OK);
    let text = String::from_utf8(axum::body::to_bytes(response.into_body(), 1 << 20).await.expect("body").to_vec())
        .expect("utf-8");
    for line in ["corral_loads_total 1", "corral_loaded_models{state=\"ready\"} 1", "corral_requests_total 2"] {
        assert!(text.lines().any(|l| l == line), "{line:?} in\n{text}");
    }

    // An empty input loads the model and returns no vectors, as Ollama does.
    let (status, empty) = post(&state, "/api/embed", r#"{"model":"embed"}"#).await;
    assert_eq!((status, empty["embeddings"].clone()), (StatusCode::OK, json!([])));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_embedding_requests_are_named_and_load_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let state = state(dir.path());
    let cases = [
        ("not json", StatusCode::BAD_REQUEST, "invalid JSON"),
        ("[1,2]", StatusCode::BAD_REQUEST, "must be a JSON object"),
        (r#"{"input":"x"}"#, StatusCode::BAD_REQUEST, "model is required"),
        (r#"{"model":7,"input":"x"}"#, StatusCode::BAD_REQUEST, "model must be a string"),
        (r#"{"model":"../x","input":"x"}"#, StatusCode::BAD_REQUEST, "invalid model name"),
        (r#"{"model":"nope","input":"x"}"#, StatusCode::NOT_FOUND, "model 'nope' not found"),
        (r#"{"model":"embed","input":5}"#, StatusCode::BAD_REQUEST, "input must be a string or a list of strings"),
        (
            r#"{"model":"embed","input":["a",1]}"#,
            StatusCode::BAD_REQUEST,
            "input must be a string or a list of strings",
        ),
        (r#"{"model":"embed","input":"x","options":[]}"#, StatusCode::BAD_REQUEST, "options must be an object"),
        (
            r#"{"model":"embed","input":"x","options":{"num_ctx":"big"}}"#,
            StatusCode::BAD_REQUEST,
            "invalid option num_ctx",
        ),
        (r#"{"model":"embed","input":"x","keep_alive":"300"}"#, StatusCode::BAD_REQUEST, "invalid keep_alive"),
        (r#"{"model":"chat","input":"x"}"#, StatusCode::BAD_REQUEST, "does not support embeddings"),
    ];
    let many = json!({ "model": "embed", "input": vec!["a"; 2049] }).to_string();
    let many = (many.as_str(), StatusCode::BAD_REQUEST, "input holds 2049 items; one request takes at most 2048");
    for (body, status, message) in cases.into_iter().chain([many]) {
        let (got, reply) = post(&state, "/api/embed", body).await;
        assert_eq!(got, status, "{body}: {reply}");
        let error = reply["error"].as_str().unwrap_or_default();
        assert!(error.contains(message), "{body}: {error}");
    }
    assert!(state.scheduler.loaded().await.expect("loaded").is_empty(), "no bad request loaded a model");
}
