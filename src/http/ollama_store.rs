//! Ollama's endpoints that write the store: `/api/blobs/<digest>` (HEAD and POST),
//! `/api/create`, `/api/pull` and `/api/push`.
//!
//! Uploads stream straight into the store (no body limit on that route: weights are
//! large). Create, pull and push answer with NDJSON progress ending in `success`, or with
//! one JSON object when the request says `"stream": false`. An error found before
//! anything was written is a plain JSON error with a 400 or 404; one after the stream
//! started ends the stream with `{"error": "..."}`. A client that goes away during a
//! pull or push cancels it.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::time::SystemTime;

use axum::Json;
use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{head, post};
use futures_util::StreamExt;
use serde::Serialize;
use serde_json::{Map, Value, json};
use tokio::sync::mpsc;

use super::error::{self, ApiError, StoreWork, bad, opaque};
use super::json_body::json_object;
use super::state::AppState;
use crate::store::create::{CreateSpec, Source};
use crate::store::digest::Digest;
use crate::store::modelfile::Message;
use crate::store::name::ModelName;
use crate::store::registry::{Progress, Registry};
use crate::store::{Store, StoreError};

/// The routes of this module whose bodies are JSON.
pub(super) fn routes() -> Router<AppState> {
    Router::new().route("/api/create", post(create)).route("/api/pull", post(pull)).route("/api/push", post(push))
}

/// Blob uploads: raw bytes of any type.
pub(super) fn blob_routes() -> Router<AppState> {
    Router::new()
        .route("/api/blobs/{digest}", head(head_blob).post(post_blob))
        // Uploads are weights, far larger than the limit on JSON bodies; they stream to disk.
        .route_layer(DefaultBodyLimit::disable())
}

const BLOBS: &str = "/api/blobs";

fn parse_digest(text: &str) -> Result<Digest, ApiError> {
    Digest::parse(text).map_err(|e| bad(e.to_string(), BLOBS))
}

/// `HEAD /api/blobs/<digest>`: 200 if the store has the blob, else 404.
async fn head_blob(State(state): State<AppState>, Path(digest): Path<String>) -> Result<StatusCode, ApiError> {
    let digest = parse_digest(&digest)?;
    let store = state.store.clone();
    let present = tokio::task::spawn_blocking(move || store.claim_blob(&digest, SystemTime::now()))
        .await
        .map_err(|_| opaque(BLOBS))?;
    Ok(if present { StatusCode::OK } else { StatusCode::NOT_FOUND })
}

/// `POST /api/blobs/<digest>` with the raw bytes: 201 when stored, 200 when the store
/// already had it, 400 when the data does not hash to `digest` (and nothing is kept).
///
/// The body is read here, on the async workers, and copied into the batches of the
/// file's pipeline ([`TempFile::into_pipeline`](crate::store::TempFile::into_pipeline)),
/// each hashed and then written on the blocking pool, each stage up to
/// [`DEPTH`](crate::store::stream::DEPTH) batches behind the one before. A client that
/// stalls holds no thread, and its body fails after `[server] body_idle_timeout`, which
/// drops the partial file. At most `[server] max_uploads` run at once.
async fn post_blob(
    State(state): State<AppState>,
    Path(digest): Path<String>,
    body: Body,
) -> Result<StatusCode, ApiError> {
    let digest = parse_digest(&digest)?;
    let store = state.store.clone();
    // A file operation: on the blocking pool, as in `head_blob`, not on an async worker.
    let claiming = store.clone();
    if blocking(move || Ok(claiming.claim_blob(&digest, SystemTime::now()))).await? {
        return Ok(StatusCode::OK);
    }
    let _permit = state.safety.upload_permit(BLOBS)?;
    let opened = store.clone();
    let file = blocking(move || opened.upload_blob_file()).await?;
    let mut upload = file.into_pipeline();
    let mut data = body.into_data_stream();
    while let Some(chunk) = data.next().await {
        // A failed body (the client went away, or sent nothing for too long) ends the
        // upload; dropping it removes the partial file.
        let chunk = chunk.map_err(|e| bad(format!("the upload failed: {e}"), BLOBS))?;
        if !upload.push(&chunk).await {
            break;
        }
    }
    let (file, hasher) = upload.finish().await.map_err(|e| match e.downcast::<StoreError>() {
        Ok(e) => upload_error(&e),
        Err(_) => opaque(BLOBS),
    })?;
    blocking(move || {
        let (actual, _) = hasher.finish();
        if actual != digest {
            return Err(StoreError::DigestMismatch { expected: digest, actual });
        }
        if store.has_blob(&actual) { Ok(()) } else { store.commit_blob(file, &actual) }
    })
    .await?;
    Ok(StatusCode::CREATED)
}

/// Runs store work on the blocking pool; its error as an upload's.
async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, StoreError> + Send + 'static,
) -> Result<T, ApiError> {
    match tokio::task::spawn_blocking(work).await {
        Ok(result) => result.map_err(|e| upload_error(&e)),
        Err(e) => {
            tracing::error!(error = %e, "a blob upload task panicked");
            Err(opaque(BLOBS))
        }
    }
}

fn upload_error(error: &StoreError) -> ApiError {
    error::store(error, StoreWork::Upload, "", BLOBS)
}

/// One line of a progress stream.
enum Event<P> {
    Progress(P),
    Failed(ApiError),
}

/// The reply to a streaming request, given the first event and the rest. The first event
/// decides: a failure before any progress is a plain JSON error.
async fn reply<P: Serialize + Send + 'static>(
    mut rx: mpsc::UnboundedReceiver<Event<P>>,
    stream: bool,
    path: &str,
) -> Response {
    if !stream {
        while let Some(event) = rx.recv().await {
            if let Event::Failed(error) = event {
                return error.into_response();
            }
        }
        return Json(json!({"status": "success"})).into_response();
    }
    let first = match rx.recv().await {
        Some(Event::Failed(error)) => return error.into_response(),
        Some(first) => first,
        None => return opaque(path).into_response(),
    };
    let lines = futures_util::stream::unfold((Some(first), rx), |(pending, mut rx)| async move {
        let event = match pending {
            Some(event) => event,
            None => rx.recv().await?,
        };
        let value = match event {
            Event::Progress(p) => serde_json::to_value(p).unwrap_or(Value::Null),
            // The same message as a plain error would carry, server paths removed.
            Event::Failed(error) => json!({ "error": error.message() }),
        };
        let mut line = value.to_string().into_bytes();
        line.push(b'\n');
        Some((Ok::<_, Infallible>(Bytes::from(line)), (None, rx)))
    });
    let mut response = Body::from_stream(lines).into_response();
    response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/x-ndjson"));
    response
}

/// `stream` of a request: true unless the request says `false`.
pub(super) fn stream_flag(request: &Map<String, Value>, path: &str) -> Result<bool, ApiError> {
    match request.get("stream") {
        None | Some(Value::Null) => Ok(true),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(bad("invalid type for \"stream\": expected a boolean", path)),
    }
}

fn optional_string(request: &Map<String, Value>, field: &str, path: &str) -> Result<Option<String>, ApiError> {
    match request.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(bad(format!("invalid type for \"{field}\": expected a string"), path)),
    }
}

/// The model name of a request (`model`, or Ollama's older `name`): as given, and parsed.
pub(super) fn model_name(request: &Map<String, Value>, path: &str) -> Result<(String, ModelName), ApiError> {
    let given = match optional_string(request, "model", path)? {
        Some(s) if !s.is_empty() => s,
        _ => optional_string(request, "name", path)?.unwrap_or_default(),
    };
    if given.is_empty() {
        return Err(bad("model is required", path));
    }
    let name = ModelName::parse(&given).map_err(|e| bad(e.to_string(), path))?;
    Ok((given, name))
}

/// A `{name: digest}` object of `files` or `adapters`, in order.
fn digests(request: &Map<String, Value>, field: &str, path: &str) -> Result<Vec<(String, Digest)>, ApiError> {
    match request.get(field) {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Object(map)) => map
            .iter()
            .map(|(name, digest)| {
                let text = digest
                    .as_str()
                    .ok_or_else(|| bad(format!("invalid digest for \"{name}\" in \"{field}\""), path))?;
                Digest::parse(text).map(|d| (name.clone(), d)).map_err(|e| bad(e.to_string(), path))
            })
            .collect(),
        Some(_) => Err(bad(format!("invalid type for \"{field}\": expected an object"), path)),
    }
}

/// The create request as a spec; `from` is the model name as given, for messages.
pub(super) fn create_spec(request: &Map<String, Value>) -> Result<(CreateSpec, String), ApiError> {
    const PATH: &str = "/api/create";
    let files = digests(request, "files", PATH)?;
    let adapters = digests(request, "adapters", PATH)?;
    let from_text = optional_string(request, "from", PATH)?.filter(|s| !s.is_empty());
    let from = if let Some(from) = &from_text {
        match Digest::parse(from) {
            Ok(digest) if from.starts_with("sha256") => Source::Blob(digest),
            _ => Source::Model(ModelName::parse(from).map_err(|e| bad(e.to_string(), PATH))?),
        }
    } else {
        let weights = files
            .iter()
            .find(|(name, _)| std::path::Path::new(name).extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf")))
            .or_else(|| files.first())
            .ok_or_else(|| bad("neither 'from' nor 'files' was specified", PATH))?;
        Source::Blob(weights.1)
    };
    let licenses = match request.get("license") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| v.as_str().map(str::to_owned).ok_or_else(|| bad("invalid type for \"license\"", PATH)))
            .collect::<Result<_, _>>()?,
        Some(_) => return Err(bad("invalid type for \"license\": expected a string or a list", PATH)),
    };
    let parameters: BTreeMap<String, Value> = match request.get("parameters") {
        None | Some(Value::Null) => BTreeMap::new(),
        Some(Value::Object(map)) => map.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
        Some(_) => return Err(bad("invalid type for \"parameters\": expected an object", PATH)),
    };
    let messages: Vec<Message> = match request.get("messages") {
        None | Some(Value::Null) => Vec::new(),
        Some(value) => {
            serde_json::from_value(value.clone()).map_err(|e| bad(format!("invalid \"messages\": {e}"), PATH))?
        }
    };
    let spec = CreateSpec {
        from,
        adapters: adapters.into_iter().map(|(_, d)| Source::Blob(d)).collect(),
        template: optional_string(request, "template", PATH)?,
        system: optional_string(request, "system", PATH)?,
        licenses,
        parameters,
        messages,
    };
    Ok((spec, from_text.unwrap_or_default()))
}

/// `POST /api/create` (Ollama's JSON API): a model from uploaded blobs or another model.
async fn create(State(state): State<AppState>, body: Bytes) -> Response {
    const PATH: &str = "/api/create";
    let prepared = json_object(PATH, &body).and_then(|request| {
        let (_, name) = model_name(&request, PATH)?;
        let (spec, from) = create_spec(&request)?;
        Ok((name, spec, from, stream_flag(&request, PATH)?))
    });
    let (name, spec, from, stream) = match prepared {
        Ok(prepared) => prepared,
        Err(e) => return e.into_response(),
    };
    let place = match state.safety.store_job_permit(PATH) {
        Ok(place) => place,
        Err(e) => return e.into_response(),
    };
    let (tx, rx) = mpsc::unbounded_channel();
    let store: Store = state.store.clone();
    tokio::task::spawn_blocking(move || {
        // Held until the create ends, which a client going away does not stop.
        let _place = place;
        let progress_tx = tx.clone();
        let mut progress = |step: Progress| {
            let _ = progress_tx.send(Event::Progress(step));
        };
        match store.create(&name, &spec, &mut progress) {
            // The store's own progress ends with "success": the stream carries it once.
            Ok(digest) => tracing::info!(corral_event = "create", corral_model = %name, %digest, "created {name}"),
            Err(e) => {
                let _ = tx.send(Event::Failed(error::store(&e, StoreWork::Write, &from, PATH)));
            }
        }
    });
    reply(rx, stream, PATH).await
}

/// The registry client for a pull or push: the daemon's shared one (concurrent pulls of a
/// blob share one download; `[store] insecure_registries` speak plain HTTP), or, when the
/// request says `insecure` for a registry the configuration does not list, one for this
/// request with plain HTTP to that registry (sharing the daemon's downloads and their bound).
fn registry_for(
    shared: &Registry,
    request: &Map<String, Value>,
    name: &ModelName,
    path: &str,
) -> Result<Registry, ApiError> {
    let insecure = match request.get("insecure") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(bad("invalid type for \"insecure\": expected a boolean", path)),
    };
    if !insecure {
        return Ok(shared.clone());
    }
    Ok(shared.allowing_insecure(name.registry()))
}

/// Pull or push.
#[derive(Clone, Copy)]
enum Transfer {
    Pull,
    Push,
}

async fn transfer(state: AppState, body: &[u8], kind: Transfer) -> Response {
    let path = match kind {
        Transfer::Pull => "/api/pull",
        Transfer::Push => "/api/push",
    };
    let prepared = json_object(path, body).and_then(|request| {
        let (given, name) = model_name(&request, path)?;
        let registry = registry_for(&state.registry, &request, &name, path)?;
        Ok((given, name, registry, stream_flag(&request, path)?))
    });
    let (given, name, registry, stream) = match prepared {
        Ok(prepared) => prepared,
        Err(e) => return e.into_response(),
    };
    let place = match state.safety.store_job_permit(path) {
        Ok(place) => place,
        Err(e) => return e.into_response(),
    };
    let store = state.store.clone();
    if matches!(kind, Transfer::Push) {
        let (store, name) = (store.clone(), name.clone());
        match tokio::task::spawn_blocking(move || store.manifest(&name)).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => return error::store(&e, StoreWork::Write, &given, path).into_response(),
            Err(_) => return opaque(path).into_response(),
        }
    }
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        // Held until the transfer ends, or is dropped with its client.
        let _place = place;
        let progress_tx = tx.clone();
        let progress = move |p: Progress| {
            let _ = progress_tx.send(Event::Progress(p));
        };
        let work = async {
            match kind {
                Transfer::Pull => registry.pull(&store, &name, progress).await,
                Transfer::Push => registry.push(&store, &name, progress).await,
            }
        };
        // The reply holds the receiver: a client that goes away drops it, and the transfer
        // is dropped with it (a download keeps what arrived for a resume; no manifest).
        let result = tokio::select! {
            result = work => result,
            () = tx.closed() => {
                tracing::info!(corral_model = %name, path, "the client went away: the transfer of {name} is cancelled");
                return;
            }
        };
        match result {
            Ok(digest) => tracing::info!(corral_model = %name, %digest, path, "the transfer of {name} finished"),
            Err(e) => {
                let _ = tx.send(Event::Failed(error::registry(&e, &given, path)));
            }
        }
    });
    reply(rx, stream, path).await
}

/// `POST /api/pull {model, insecure?, stream?}`.
async fn pull(State(state): State<AppState>, body: Bytes) -> Response {
    transfer(state, &body, Transfer::Pull).await
}

/// `POST /api/push {model, insecure?, stream?}`.
async fn push(State(state): State<AppState>, body: Bytes) -> Response {
    transfer(state, &body, Transfer::Push).await
}
