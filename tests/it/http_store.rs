//! The store-writing HTTP API: blob uploads, `/api/create`, and `/api/pull` + `/api/push`
//! against a real registry (Debian's `docker-registry`).

use std::fs;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{Method, Request, StatusCode};
use corral::config::ServerConfig;
use corral::http::{AppState, LocalNames, Safety, router};
use corral::store::digest::Digest;
use corral::store::manifest::Manifest;
use corral::store::name::ModelName;
use serde_json::{Value, json};
use tower::ServiceExt;

use crate::support::api::{blob_files, state};
use crate::support::registry::DockerRegistry;

const DEADLINE: Duration = Duration::from_secs(120);

/// Sends a request and returns the status and the body's bytes.
async fn send(state: &AppState, method: Method, path: &str, body: Body) -> (StatusCode, Vec<u8>) {
    let request = Request::builder().method(method).uri(path).body(body).expect("request");
    let response = tokio::time::timeout(DEADLINE, router(state.clone()).oneshot(request))
        .await
        .expect("in time")
        .expect("infallible");
    let status = response.status();
    let bytes =
        tokio::time::timeout(DEADLINE, axum::body::to_bytes(response.into_body(), 1 << 24)).await.expect("in time");
    (status, bytes.expect("body").to_vec())
}

/// A JSON POST whose reply is one JSON value.
async fn post(state: &AppState, path: &str, body: &Value) -> (StatusCode, Value) {
    let (status, bytes) = send(state, Method::POST, path, Body::from(body.to_string())).await;
    (status, serde_json::from_slice(&bytes).unwrap_or(Value::Null))
}

/// A JSON POST whose reply is an NDJSON stream: the status and every line.
async fn post_stream(state: &AppState, path: &str, body: &Value) -> (StatusCode, Vec<Value>) {
    let (status, bytes) = send(state, Method::POST, path, Body::from(body.to_string())).await;
    let lines = String::from_utf8(bytes)
        .expect("utf-8")
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}")))
        .collect();
    (status, lines)
}

fn blob_path(digest: &Digest) -> String {
    format!("/api/blobs/{digest}")
}

/// The request body in several chunks and without a `Content-Length`.
fn chunked(data: &[u8]) -> Body {
    let chunks: Vec<Result<Bytes, std::io::Error>> = data.chunks(4096).map(|c| Ok(Bytes::copy_from_slice(c))).collect();
    Body::from_stream(futures_util::stream::iter(chunks))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blobs_are_checked_uploaded_once_and_refused_when_wrong() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut state = state(dir.path());
    // A tiny body limit: uploads are exempt from it (chunked, so the size is unknown up front).
    state.safety =
        Arc::new(Safety::new(&ServerConfig { max_body: 1024, ..ServerConfig::default() }, LocalNames::system()));
    let data: Vec<u8> = (0..300_000u32).map(|i| i.wrapping_mul(2_654_435_761).to_le_bytes()[2]).collect();
    let digest = Digest::of(&data);
    let path = blob_path(&digest);

    assert_eq!(send(&state, Method::HEAD, &path, Body::empty()).await.0, StatusCode::NOT_FOUND);
    let before = blob_files(&state);

    // The wrong data for the digest: 400, and nothing is kept.
    let (status, body) = send(&state, Method::POST, &path, chunked(&data[..data.len() - 1])).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{}", String::from_utf8_lossy(&body));
    let error: Value = serde_json::from_slice(&body).expect("json");
    assert!(error["error"].as_str().expect("error").contains("digest mismatch"), "{error}");
    assert_eq!(blob_files(&state), before, "nothing stored, no temporary file left");
    assert_eq!(send(&state, Method::HEAD, &path, Body::empty()).await.0, StatusCode::NOT_FOUND);

    let (status, _) = send(&state, Method::POST, &path, chunked(&data)).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(fs::read(state.store.blob_path(&digest)).expect("blob"), data);
    assert_eq!(send(&state, Method::HEAD, &path, Body::empty()).await.0, StatusCode::OK);
    let (status, _) = send(&state, Method::POST, &path, chunked(&data)).await;
    assert_eq!(status, StatusCode::OK, "already there");
    // With a Content-Length far over the body limit, an upload is still taken.
    let other = b"a second blob, bigger than the 1 KiB limit ".repeat(64);
    let other_path = blob_path(&Digest::of(&other));
    let request = Request::post(other_path.as_str())
        .header(axum::http::header::CONTENT_LENGTH, other.len())
        .body(Body::from(other.clone()))
        .expect("request");
    let response = router(state.clone()).oneshot(request).await.expect("infallible");
    assert_eq!(response.status(), StatusCode::CREATED);

    for bad in ["/api/blobs/sha256:abc", "/api/blobs/md5:00", "/api/blobs/nope"] {
        for method in [Method::HEAD, Method::POST] {
            let (status, _) = send(&state, method.clone(), bad, Body::from("x")).await;
            assert_eq!(status, StatusCode::BAD_REQUEST, "{method} {bad}");
        }
    }
}

/// Uploads the tiny llama as a blob (after deleting `chat`, which holds it); returns its digest.
async fn upload_tiny(state: &AppState) -> Digest {
    state.store.delete(&ModelName::parse("chat").expect("name")).expect("delete chat");
    let data = corral::demo_model::tiny_llama_bytes().expect("tiny llama");
    let digest = Digest::of(&data);
    let (status, _) = send(state, Method::POST, &blob_path(&digest), Body::from(data)).await;
    assert_eq!(status, StatusCode::CREATED);
    digest
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_from_an_uploaded_blob_streams_statuses_and_shows() {
    let dir = tempfile::tempdir().expect("tempdir");
    let state = state(dir.path());
    let digest = upload_tiny(&state).await;
    let request = json!({
        "model": "mine",
        "files": {"tiny.gguf": digest.to_string()},
        "system": "Be brief.",
        "parameters": {"temperature": 0.25, "stop": ["<end>"]},
    });
    let (status, lines) = post_stream(&state, "/api/create", &request).await;
    assert_eq!(status, StatusCode::OK);
    assert!(lines.len() > 1, "{lines:?}");
    assert!(lines.iter().all(|l| l["status"].is_string()), "{lines:?}");
    assert_eq!(lines.last(), Some(&json!({"status": "success"})));
    let successes = lines.iter().filter(|l| l["status"] == "success").count();
    assert_eq!(successes, 1, "success is streamed once: {lines:?}");

    let (status, shown) = post(&state, "/api/show", &json!({"model": "mine"})).await;
    assert_eq!(status, StatusCode::OK, "{shown}");
    assert_eq!(shown["system"], "Be brief.");
    let parameters = shown["parameters"].as_str().expect("parameters");
    assert!(parameters.contains("temperature") && parameters.contains("<end>"), "{parameters}");
    let (manifest, _, _) = state.store.manifest(&ModelName::parse("mine").expect("name")).expect("manifest");
    assert!(manifest.blobs().any(|l| l.digest == digest), "the uploaded blob is the weights");

    // From a model, with the legacy `name` and no streaming: one object.
    let (status, reply) =
        post(&state, "/api/create", &json!({"name": "derived", "from": "mine", "system": "Be long.", "stream": false}))
            .await;
    assert_eq!((status, reply), (StatusCode::OK, json!({"status": "success"})));
    let (_, shown) = post(&state, "/api/show", &json!({"model": "derived"})).await;
    assert_eq!(shown["system"], "Be long.");
    assert!(shown["parameters"].as_str().expect("parameters").contains("temperature"), "inherited: {shown}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_errors_are_plain_json_and_write_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let state = state(dir.path());
    let missing = Digest::of(b"never uploaded");
    let text = Digest::of(b"not a gguf");
    let (status, _) = send(&state, Method::POST, &blob_path(&text), Body::from("not a gguf")).await;
    assert_eq!(status, StatusCode::CREATED);
    let before = blob_files(&state);
    let cases = [
        (json!({"from": "chat"}), StatusCode::BAD_REQUEST, "model is required"),
        (json!({"model": "x"}), StatusCode::BAD_REQUEST, "neither 'from' nor 'files'"),
        (json!({"model": "x", "from": "nope"}), StatusCode::NOT_FOUND, "model 'nope' not found"),
        (json!({"model": "x", "files": {"a.gguf": missing.to_string()}}), StatusCode::BAD_REQUEST, "missing"),
        (json!({"model": "x", "files": {"a.gguf": "sha256:12"}}), StatusCode::BAD_REQUEST, "invalid digest"),
        (json!({"model": "x", "files": {"a.gguf": text.to_string()}}), StatusCode::BAD_REQUEST, "GGUF"),
        (json!({"model": "bad name!", "from": "chat"}), StatusCode::BAD_REQUEST, "invalid model name"),
    ];
    for (request, expected, message) in cases {
        for stream in [true, false] {
            let mut request = request.clone();
            request["stream"] = json!(stream);
            let (status, reply) = post(&state, "/api/create", &request).await;
            assert_eq!(status, expected, "{request}: {reply}");
            let error = reply["error"].as_str().unwrap_or_default();
            assert!(error.contains(message), "{request}: {error}");
        }
    }
    assert!(state.store.manifest(&ModelName::parse("x").expect("name")).is_err(), "no model created");
    assert_eq!(blob_files(&state), before, "no blob written");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_and_pull_through_the_api() {
    let registry = DockerRegistry::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let state = state(dir.path());
    let model = format!("{}/corral/chat:v1", registry.host());
    let name = ModelName::parse(&model).expect("name");
    let (status, _) = post(&state, "/api/copy", &json!({"source": "chat", "destination": model})).await;
    assert_eq!(status, StatusCode::OK);
    let before_manifest = fs::read(state.store.manifest_path(&name)).expect("manifest");
    let parsed = Manifest::parse(&before_manifest).expect("parse");
    let before_blobs: Vec<(Digest, Vec<u8>)> =
        parsed.blobs().map(|l| (l.digest, fs::read(state.store.blob_path(&l.digest)).expect("blob"))).collect();

    let (status, lines) = post_stream(&state, "/api/push", &json!({"model": model, "insecure": true})).await;
    assert_eq!(status, StatusCode::OK, "{lines:?}");
    assert!(lines.iter().all(|l| l.get("error").is_none()), "{lines:?}");
    assert_eq!(lines.last(), Some(&json!({"status": "success"})));

    // Delete both local names, so the blobs go too, and pull it back.
    for local in [model.as_str(), "chat"] {
        let (status, _) =
            send(&state, Method::DELETE, "/api/delete", Body::from(json!({"model": local}).to_string())).await;
        assert_eq!(status, StatusCode::OK, "{local}");
    }
    assert!(before_blobs.iter().all(|(d, _)| !state.store.has_blob(d)), "the blobs went with the model");

    let (status, lines) = post_stream(&state, "/api/pull", &json!({"model": model, "insecure": true})).await;
    assert_eq!(status, StatusCode::OK, "{lines:?}");
    assert!(lines.iter().all(|l| l.get("error").is_none()), "{lines:?}");
    assert_eq!(lines.first().map(|l| l["status"].clone()), Some(json!("pulling manifest")));
    assert!(lines.iter().any(|l| l["digest"].is_string() && l["total"].is_u64()), "{lines:?}");
    assert_eq!(lines.last(), Some(&json!({"status": "success"})));
    assert_eq!(fs::read(state.store.manifest_path(&name)).expect("manifest"), before_manifest);
    for (digest, bytes) in &before_blobs {
        assert_eq!(&fs::read(state.store.blob_path(digest)).expect("blob"), bytes, "{digest}");
    }

    // Not streamed: one object.
    let (status, reply) = post(&state, "/api/pull", &json!({"model": model, "insecure": true, "stream": false})).await;
    assert_eq!((status, reply), (StatusCode::OK, json!({"status": "success"})));

    // Errors: an unknown model on the registry, a local model that is not there.
    let unknown = format!("{}/corral/nope:v1", registry.host());
    let (status, reply) =
        post(&state, "/api/pull", &json!({"model": unknown, "insecure": true, "stream": false})).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{reply}");
    let (status, lines) = post_stream(&state, "/api/pull", &json!({"model": unknown, "insecure": true})).await;
    assert_eq!(status, StatusCode::OK, "streamed: {lines:?}");
    assert!(lines.last().is_some_and(|l| l["error"].is_string()), "{lines:?}");
    let (status, reply) = post(&state, "/api/push", &json!({"model": unknown, "insecure": true})).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{reply}");
    assert_eq!(reply["error"], format!("model '{unknown}' not found"));
    let (status, _) = post(&state, "/api/pull", &json!({})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
}
