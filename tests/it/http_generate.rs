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
        // A raw prompt is sent as it is: with a system prompt it is refused (below).
        let system = if raw { "" } else { r#""system":"be brief","# };
        let request =
            format!(r#"{{"model":"chat","prompt":"once upon",{system}"raw":{raw},"options":{{"num_predict":8}}}}"#);
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

/// A `keep_alive` of more seconds than Go's longest duration (about 292 years) is forever,
/// as Ollama reads it; the scheduler, which once added it to a clock and panicked when
/// the model went idle, goes on serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keep_alive_past_any_clock_is_forever_and_the_scheduler_goes_on() {
    use corral::scheduler::keep_alive::KeepAlive;
    let dir = tempfile::tempdir().expect("tempdir");
    let state = state(dir.path());
    for keep_alive in ["1e19", "18446744073709551615", "9223372037"] {
        let body = format!(r#"{{"model":"chat","keep_alive":{keep_alive}}}"#);
        let (status, _, lines) = post(&state, "/api/generate", &body).await;
        assert_eq!(status, StatusCode::OK, "{keep_alive}: {lines:?}");
        // Idle now: the scheduler works out when it expires.
        leases_reach_zero(&state).await;
        let loaded = state.scheduler.loaded().await.expect("the scheduler answers");
        assert_eq!(loaded.len(), 1, "{keep_alive}");
        assert_eq!((loaded[0].keep_alive, loaded[0].expires_at), (KeepAlive::Forever, None), "{keep_alive}");
    }
    let request = Request::get("/api/ps").body(Body::empty()).expect("request");
    let response = router(state.clone()).oneshot(request).await.expect("infallible");
    let ps: Value =
        serde_json::from_slice(&response.into_body().collect().await.expect("body").to_bytes()).expect("json");
    let expires = ps["models"][0]["expires_at"].as_str().expect("expires_at");
    assert!(expires.starts_with("23"), "forever, as Ollama shows it (292 years on): {ps}");
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
        ("/api/chat", r#"{"model":"chat","messages":[],"format":3}"#, StatusCode::BAD_REQUEST, "invalid format"),
        ("/api/generate", r#"{"model":"chat","prompt":"x","format":"xml"}"#, StatusCode::BAD_REQUEST, "invalid format"),
        ("/api/chat", r#"{"model":"chat","messages":[],"think":"max"}"#, StatusCode::BAD_REQUEST, "invalid think"),
        ("/api/chat", r#"{"model":"chat","messages":[],"tools":{"a":1}}"#, StatusCode::BAD_REQUEST, "invalid tools"),
        (
            "/api/chat",
            r#"{"model":"chat","messages":[{"role":"user","content":"x","images":["iVBORw0KGgo="]}]}"#,
            StatusCode::BAD_REQUEST,
            "model chat does not support images",
        ),
        (
            "/api/generate",
            r#"{"model":"chat","prompt":"x","images":["iVBORw0KGgo="]}"#,
            StatusCode::BAD_REQUEST,
            "model chat does not support images",
        ),
        (
            "/api/generate",
            r#"{"model":"chat","prompt":"x","format":"json","images":["iVBORw0KGgo="]}"#,
            StatusCode::BAD_REQUEST,
            "format cannot be combined with images",
        ),
        (
            "/api/generate",
            r#"{"model":"chat","prompt":"x","images":["%%%"]}"#,
            StatusCode::BAD_REQUEST,
            "invalid image 0: not base64",
        ),
        (
            "/api/generate",
            r#"{"model":"chat","prompt":"x","template":"{{ if .System }}"}"#,
            StatusCode::BAD_REQUEST,
            "invalid template",
        ),
        ("/api/generate", r#"{"model":"chat","prompt":"x","template":7}"#, StatusCode::BAD_REQUEST, "template must be"),
    ];
    assert_refused_by_name(&state, &cases).await;
}

/// Sends each `(path, body)`, expects its status and an error containing its words, and
/// that none of them loaded a model.
async fn assert_refused_by_name(state: &AppState, cases: &[(&str, &str, StatusCode, &str)]) {
    for &(path, body, status, message) in cases {
        let (got, _, reply) = post(state, path, body).await;
        assert_eq!(got, status, "{path} {body}: {reply:?}");
        let error = reply.first().and_then(|r| r["error"].as_str()).unwrap_or_default();
        assert!(error.contains(message), "{path} {body}: {error}");
    }
    assert!(state.scheduler.loaded().await.expect("loaded").is_empty(), "no bad request loaded a model");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_suffixes_raw_prompts_and_logprobs_are_named_and_load_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let state = state(dir.path());
    let cases = [
        ("/api/generate", r#"{"model":"chat","prompt":"x","suffix":7}"#, StatusCode::BAD_REQUEST, "suffix must be"),
        (
            "/api/generate",
            r#"{"model":"chat","prompt":"x","suffix":"y","images":["iVBORw0KGgo="]}"#,
            StatusCode::BAD_REQUEST,
            "images cannot be combined with a suffix",
        ),
        (
            "/api/generate",
            r#"{"model":"chat","prompt":"x","raw":true,"system":"be brief"}"#,
            StatusCode::BAD_REQUEST,
            "raw mode does not support template, system, or context",
        ),
        (
            "/api/generate",
            r#"{"model":"chat","prompt":"x","raw":true,"template":"{{ .Prompt }}"}"#,
            StatusCode::BAD_REQUEST,
            "raw mode does not support template, system, or context",
        ),
        (
            "/api/generate",
            r#"{"model":"chat","prompt":"x","raw":true,"context":[1,2]}"#,
            StatusCode::BAD_REQUEST,
            "raw mode does not support template, system, or context",
        ),
        ("/api/chat", r#"{"model":"chat","messages":[],"logprobs":1}"#, StatusCode::BAD_REQUEST, "logprobs must be"),
        (
            "/api/chat",
            r#"{"model":"chat","messages":[],"logprobs":true,"top_logprobs":21}"#,
            StatusCode::BAD_REQUEST,
            "top_logprobs must be between 0 and 20",
        ),
        (
            "/api/generate",
            r#"{"model":"chat","prompt":"x","top_logprobs":-1}"#,
            StatusCode::BAD_REQUEST,
            "top_logprobs must be between 0 and 20",
        ),
    ];
    assert_refused_by_name(&state, &cases).await;
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn format_constrains_the_answer_to_json() {
    let dir = tempfile::tempdir().expect("tempdir");
    let state = state(dir.path());
    // A closed schema: the runner's grammar leaves the random weights one way to end.
    let schema =
        r#"{"type":"object","properties":{"ok":{"type":"boolean"}},"required":["ok"],"additionalProperties":false}"#;
    for (path, body) in [
        ("/api/chat", format!(r#"{{"model":"chat","messages":[{{"role":"user","content":"hi"}}],"format":{schema}"#)),
        ("/api/generate", format!(r#"{{"model":"chat","prompt":"hi","format":{schema}"#)),
        ("/api/generate", format!(r#"{{"model":"chat","prompt":"hi","raw":true,"format":{schema}"#)),
    ] {
        let body = format!(r#"{body},"stream":false,"options":{{"num_predict":64,"seed":1}}}}"#);
        let (status, _, lines) = post(&state, path, &body).await;
        assert_eq!(status, StatusCode::OK, "{path} {body}: {lines:?}");
        let text = lines[0]["message"]["content"].as_str().or(lines[0]["response"].as_str()).expect("text");
        let parsed: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{path}: {e}: {text:?}"));
        assert!(parsed["ok"].is_boolean(), "{path}: {parsed}");
        assert_eq!(lines[0]["done_reason"], "stop", "{path}: the grammar ended it: {lines:?}");
    }
    // "json": any object; the first token is its opening brace whatever the weights say.
    let body = r#"{"model":"chat","messages":[{"role":"user","content":"hi"}],"format":"json","stream":false,"options":{"num_predict":4}}"#;
    let (status, _, lines) = post(&state, "/api/chat", body).await;
    assert_eq!(status, StatusCode::OK, "{lines:?}");
    let text = lines[0]["message"]["content"].as_str().expect("content");
    assert!(text.trim_start().starts_with('{'), "{text:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tools_tool_results_and_think_reach_the_runner() {
    let dir = tempfile::tempdir().expect("tempdir");
    let state = state(dir.path());
    let body = r#"{"model":"chat","think":false,"stream":false,"options":{"num_predict":4},
        "tools":[{"type":"function","function":{"name":"weather","description":"the weather","parameters":{"type":"object","properties":{"city":{"type":"string"}}}}}],
        "messages":[{"role":"user","content":"weather in Oslo?"},
            {"role":"assistant","content":"","tool_calls":[{"function":{"name":"weather","arguments":{"city":"Oslo"}}}]},
            {"role":"tool","tool_name":"weather","content":"rain"}]}"#;
    let (status, _, lines) = post(&state, "/api/chat", body).await;
    assert_eq!(status, StatusCode::OK, "{lines:?}");
    assert_final(&lines[0], "length", 4);
    let streamed = body.replace(r#""stream":false"#, r#""stream":true"#);
    let (status, _, lines) = post(&state, "/api/chat", &streamed).await;
    assert_eq!(status, StatusCode::OK, "{lines:?}");
    assert_final(lines.last().expect("lines"), "length", 4);
    let (status, _, lines) = post(
        &state,
        "/api/generate",
        r#"{"model":"chat","prompt":"x","think":true,"stream":false,"options":{"num_predict":2}}"#,
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{lines:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_template_renders_the_prompt() {
    let dir = tempfile::tempdir().expect("tempdir");
    let state = state(dir.path());
    let body = r#"{"model":"chat","prompt":"once upon","system":"be brief","stream":false,
        "template":"{{ if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ end }}<|im_start|>user\n{{ .Prompt }}<|im_end|>\n<|im_start|>assistant\n",
        "options":{"num_predict":3}}"#;
    let (status, _, lines) = post(&state, "/api/generate", body).await;
    assert_eq!(status, StatusCode::OK, "{lines:?}");
    assert_final(&lines[0], "length", 3);
    // The runner counted the rendered prompt, which is longer than the bare one.
    let bare = r#"{"model":"chat","prompt":"once upon","raw":true,"stream":false,"options":{"num_predict":3}}"#;
    let (_, _, bare) = post(&state, "/api/generate", bare).await;
    assert!(lines[0]["prompt_eval_count"].as_u64() > bare[0]["prompt_eval_count"].as_u64(), "{lines:?} vs {bare:?}");
    // Trim markers next to characters of several bytes, as non-English templates have
    // them (gtmpl alone failed these with a syntax error).
    let body = r#"{"model":"chat","prompt":"once upon","system":"be brief","stream":false,
        "template":"«{{- .System -}}» 用户： {{- .Prompt }}\n助手：","options":{"num_predict":3}}"#;
    let (status, _, lines) = post(&state, "/api/generate", body).await;
    assert_eq!(status, StatusCode::OK, "{lines:?}");
    assert_final(&lines[0], "length", 3);
}

/// Adds `coder` to the store: the tiny llama with fill-in-the-middle tokens named in its
/// metadata, as code models' GGUFs name theirs.
fn add_coder(state: &AppState, dir: &std::path::Path) {
    use corral::gguf::GgufValue;
    use corral::store::create::CreateSpec;
    use corral::store::modelfile::Modelfile;
    use corral::store::name::ModelName;

    let fim = ["fim_pre", "fim_suf", "fim_mid"].iter().zip([3, 4, 2]);
    let extra = fim.map(|(key, id)| (format!("tokenizer.ggml.{key}_token_id"), GgufValue::U32(id))).collect();
    let bytes = corral::demo_model::tiny_llama_bytes_with(extra).expect("a tiny llama");
    std::fs::write(dir.join("coder.gguf"), bytes).expect("write");
    let spec =
        CreateSpec::from_modelfile(&Modelfile::parse("FROM ./coder.gguf\n").expect("modelfile"), dir).expect("spec");
    state.store.create(&ModelName::parse("coder").expect("name"), &spec, &mut |_| {}).expect("create");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_suffix_fills_in_the_middle_on_a_model_with_the_tokens_for_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let state = state(dir.path());
    add_coder(&state, dir.path());
    let fill = |suffix: &str, stream: bool| {
        format!(
            r#"{{"model":"coder","prompt":"once upon","suffix":"{suffix}","stream":{stream},"options":{{"num_predict":4}}}}"#
        )
    };
    let (status, ctype, lines) = post(&state, "/api/generate", &fill("the end", true)).await;
    assert_eq!((status, ctype.as_str()), (StatusCode::OK, "application/x-ndjson"), "{lines:?}");
    let (last, chunks) = lines.split_last().expect("lines");
    assert_eq!(chunks.len(), 4, "{lines:?}");
    assert!(chunks.iter().all(|c| c["response"].as_str().is_some_and(|r| !r.is_empty())), "{lines:?}");
    assert_final(last, "length", 4);

    // The suffix reaches the runner: a longer one is a longer prompt, and both are
    // longer than the prompt alone.
    let (status, _, short) = post(&state, "/api/generate", &fill("the end", false)).await;
    assert_eq!(status, StatusCode::OK, "{short:?}");
    assert_final(&short[0], "length", 4);
    let (_, _, long) = post(&state, "/api/generate", &fill("the end of the story is here", false)).await;
    let bare = r#"{"model":"coder","prompt":"once upon","raw":true,"stream":false,"options":{"num_predict":4}}"#;
    let (_, _, bare) = post(&state, "/api/generate", bare).await;
    let evaluated = |lines: &[Value]| lines[0]["prompt_eval_count"].as_u64().expect("prompt_eval_count");
    assert!(evaluated(&long) > evaluated(&short), "{long:?} vs {short:?}");
    assert!(evaluated(&short) > evaluated(&bare), "{short:?} vs {bare:?}");

    // A raw prompt is sent as it is, the suffix left out (as Ollama does).
    let raw = r#"{"model":"coder","prompt":"once upon","suffix":"the end","raw":true,"stream":false,"options":{"num_predict":4}}"#;
    let (status, _, raw) = post(&state, "/api/generate", raw).await;
    assert_eq!(status, StatusCode::OK, "{raw:?}");
    assert_eq!(evaluated(&raw), evaluated(&bare), "{raw:?} vs {bare:?}");

    // A request template gets the suffix as `.Suffix`.
    let templated = r#"{"model":"coder","prompt":"once upon","suffix":"the end","stream":false,
        "template":"{{ .Prompt }} ... {{ .Suffix }} {{ .Suffix }}","options":{"num_predict":4}}"#;
    let (status, _, templated) = post(&state, "/api/generate", templated).await;
    assert_eq!(status, StatusCode::OK, "{templated:?}");
    assert!(evaluated(&templated) > evaluated(&bare) + 4, "{templated:?} vs {bare:?}");
    leases_reach_zero(&state).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_suffix_on_a_model_without_the_tokens_for_it_is_refused_by_name() {
    let dir = tempfile::tempdir().expect("tempdir");
    let state = state(dir.path());
    let body = r#"{"model":"chat","prompt":"once upon","suffix":"the end","stream":false}"#;
    let (status, _, reply) = post(&state, "/api/generate", body).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{reply:?}");
    let error = reply[0]["error"].as_str().unwrap_or_default();
    assert!(error.starts_with("\"chat:latest\" does not support insert"), "{error}");
    assert!(error.contains("prefix token is missing"), "llama.cpp's reason: {error}");
    // The model itself serves on.
    let (status, _, lines) = post(&state, "/api/generate", r#"{"model":"chat","prompt":"x","stream":false}"#).await;
    assert_eq!(status, StatusCode::OK, "{lines:?}");
    leases_reach_zero(&state).await;
}

/// Each line's `logprobs` entries, in order.
fn logprobs_of(lines: &[Value]) -> Vec<Value> {
    lines.iter().filter_map(|l| l["logprobs"].as_array()).flatten().cloned().collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logprobs_come_with_each_token_when_asked_for() {
    let dir = tempfile::tempdir().expect("tempdir");
    let state = state(dir.path());
    let chat = r#"{"model":"chat","messages":[{"role":"user","content":"hi"}],"logprobs":true,"top_logprobs":2,"options":{"num_predict":4}}"#;
    let raw = r#"{"model":"chat","prompt":"once upon","raw":true,"logprobs":true,"top_logprobs":2,"options":{"num_predict":4}}"#;
    for (path, body, text) in [("/api/chat", chat, "/message/content"), ("/api/generate", raw, "/response")] {
        let (status, _, lines) = post(&state, path, body).await;
        assert_eq!(status, StatusCode::OK, "{path}: {lines:?}");
        let (last, chunks) = lines.split_last().expect("lines");
        assert!(last.get("logprobs").is_none(), "{path}: the final line has none: {last}");
        // Each streamed line carries the entries of its own text.
        for line in chunks {
            let said = line.pointer(text).and_then(Value::as_str).expect("text");
            let tokens: String = logprobs_of(std::slice::from_ref(line))
                .iter()
                .map(|e| e["token"].as_str().expect("a token").to_owned())
                .collect();
            assert_eq!(tokens, said, "{path}: {line}");
        }
        let entries = logprobs_of(chunks);
        assert_eq!(entries.len(), 4, "{path}: one entry a token: {lines:?}");
        for entry in &entries {
            assert!(entry["logprob"].as_f64().is_some_and(|p| p <= 0.0), "{path}: {entry}");
            assert!(entry["bytes"].as_array().is_some_and(|b| !b.is_empty()), "{path}: {entry}");
            assert!(entry.get("id").is_none(), "{path}: Ollama's shape: {entry}");
            let top = entry["top_logprobs"].as_array().unwrap_or_else(|| panic!("{path}: {entry}"));
            assert_eq!(top.len(), 2, "{path}: {entry}");
            assert!(top[0]["logprob"].as_f64() >= top[1]["logprob"].as_f64(), "{path}: likeliest first: {entry}");
        }

        // Whole, the same entries in one list; without top_logprobs, none of those.
        let whole = body.replace("\"top_logprobs\":2", "\"stream\":false");
        let (status, _, whole) = post(&state, path, &whole).await;
        assert_eq!(status, StatusCode::OK, "{path}: {whole:?}");
        let entries = whole[0]["logprobs"].as_array().unwrap_or_else(|| panic!("{path}: {whole:?}"));
        assert_eq!(entries.len(), 4, "{path}: {whole:?}");
        assert!(entries.iter().all(|e| e.get("top_logprobs").is_none()), "{path}: {whole:?}");

        // Not asked for, none.
        let plain = body.replace("\"logprobs\":true,", "");
        let (_, _, plain) = post(&state, path, &plain).await;
        assert!(logprobs_of(&plain).is_empty(), "{path}: {plain:?}");
    }
    leases_reach_zero(&state).await;
}
