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
        (r#"{"model":"embed","input":"x","truncate":"no"}"#, StatusCode::BAD_REQUEST, "truncate must be true or false"),
        (
            r#"{"model":"embed","input":"x","dimensions":-1}"#,
            StatusCode::BAD_REQUEST,
            "dimensions must be a non-negative",
        ),
        (
            r#"{"model":"embed","input":"x","dimensions":1.5}"#,
            StatusCode::BAD_REQUEST,
            "dimensions must be a non-negative",
        ),
        (
            r#"{"model":"embed","input":"x","dimensions":"8"}"#,
            StatusCode::BAD_REQUEST,
            "dimensions must be a non-negative",
        ),
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

fn vector(reply: &Value, i: usize) -> Vec<f64> {
    let numbers = reply["embeddings"][i].as_array().unwrap_or_else(|| panic!("no vector {i}: {reply}"));
    numbers.iter().map(|n| n.as_f64().expect("a number")).collect()
}

fn norm(v: &[f64]) -> f64 {
    v.iter().map(|x| x * x).sum::<f64>().sqrt()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_input_longer_than_the_context_is_cut_to_fit_unless_truncate_is_off() {
    let dir = tempfile::tempdir().expect("tempdir");
    let state = state(dir.path());
    // About 800 tokens for the tiny bert, whose context (and so its batch) is 512.
    let long = "hello world ".repeat(400);
    let body = json!({ "model": "embed", "input": ["hello world", long] }).to_string();
    let (status, reply) = post(&state, "/api/embed", &body).await;
    assert_eq!(status, StatusCode::OK, "{reply}");
    assert_eq!((vector(&reply, 0).len(), vector(&reply, 1).len()), (64, 64), "{reply}");
    let evaluated = reply["prompt_eval_count"].as_u64().expect("prompt_eval_count");
    assert!((500..=516).contains(&evaluated), "two tokens and 510 or so of the long one: {evaluated}");
    // The model was loaded to count the long input's tokens: that wait is the load.
    assert!(reply["load_duration"].as_u64().is_some_and(|ns| ns > 5_000_000), "{}", reply["load_duration"]);
    let (_, alone) = post(&state, "/api/embed", r#"{"model":"embed","input":"hello world"}"#).await;
    assert_eq!(vector(&alone, 0), vector(&reply, 0), "a short input is embedded as it is");

    let body = json!({ "model": "embed", "input": ["hello world", long], "truncate": false }).to_string();
    let (status, refused) = post(&state, "/api/embed", &body).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{refused}");
    assert_eq!(refused["error"], "the input length exceeds the context length");
    // Below the limit nothing is cut, with or without truncate.
    let fits = json!({ "model": "embed", "input": "hello world ".repeat(100), "truncate": false }).to_string();
    let (status, fits) = post(&state, "/api/embed", &fits).await;
    assert_eq!(status, StatusCode::OK, "{fits}");
    assert!(fits["prompt_eval_count"].as_u64().is_some_and(|n| (200..=202).contains(&n)), "{fits}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_embedding_models_batch_holds_an_input_as_long_as_its_context() {
    use corral::gguf::GgufValue;
    use corral::store::create::CreateSpec;
    use corral::store::modelfile::Modelfile;
    use corral::store::name::ModelName;

    let dir = tempfile::tempdir().expect("tempdir");
    let state = state(dir.path());
    // The tiny llama made an embedding model (mean pooling): a 2048-token context, and
    // llama-server's own physical batch of 512 tokens unless corral sets one (the tiny
    // bert's context is 512 tokens, too few to tell).
    let extra = vec![("llama.pooling_type".to_owned(), GgufValue::U32(1))];
    let bytes = corral::demo_model::tiny_llama_bytes_with(extra).expect("a tiny llama");
    std::fs::write(dir.path().join("pooled.gguf"), bytes).expect("write");
    let spec = CreateSpec::from_modelfile(&Modelfile::parse("FROM ./pooled.gguf\n").expect("modelfile"), dir.path())
        .expect("spec");
    state.store.create(&ModelName::parse("pooled").expect("name"), &spec, &mut |_| {}).expect("create");
    let input = "hello world ".repeat(400);
    let body = json!({ "model": "pooled", "input": input, "truncate": false, "options": { "num_ctx": 2048 } });
    let body = body.to_string();
    let (status, reply) = post(&state, "/api/embed", &body).await;
    assert_eq!(status, StatusCode::OK, "{reply}");
    assert!(reply["prompt_eval_count"].as_u64().is_some_and(|n| n > 512), "embedded whole: {reply}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dimensions_keep_a_vectors_first_numbers_normalized() {
    let dir = tempfile::tempdir().expect("tempdir");
    let state = state(dir.path());
    let (_, full) = post(&state, "/api/embed", r#"{"model":"embed","input":["hello world","the model"]}"#).await;
    let (status, cut) =
        post(&state, "/api/embed", r#"{"model":"embed","input":["hello world","the model"],"dimensions":16}"#).await;
    assert_eq!(status, StatusCode::OK, "{cut}");
    for i in 0..2 {
        let (full, cut) = (vector(&full, i), vector(&cut, i));
        assert_eq!(cut.len(), 16);
        assert!((norm(&cut) - 1.0).abs() < 1e-6, "normalized: {}", norm(&cut));
        let scale = norm(&full[..16]);
        for (a, b) in cut.iter().zip(&full[..16]) {
            assert!((a - b / scale).abs() < 1e-6, "{a} against {b} / {scale}");
        }
    }
    for whole in [0, 64, 1000] {
        let body = json!({ "model": "embed", "input": ["hello world"], "dimensions": whole }).to_string();
        let (status, reply) = post(&state, "/api/embed", &body).await;
        assert_eq!(status, StatusCode::OK, "{reply}");
        assert_eq!(vector(&reply, 0), vector(&full, 0), "dimensions {whole} keep them all");
    }
}
