//! Ollama's model-management endpoints: `/api/tags`, `/api/ps`, `/api/show`,
//! `/api/copy` and `/api/delete`, in Ollama's shapes field by field.
//!
//! Store work is synchronous file-system work and runs on the blocking pool. Bad input
//! is a 400 that names the problem, an unknown model a 404 in Ollama's wording
//! (`model 'x' not found`), and a store failure a 500 whose cause goes to the log.

use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use axum::Json;
use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use serde::Serialize;
use serde_json::{Map, Value};
use tokio::time::Instant;

use super::error::{self, ApiError, StoreWork, bad};
use super::json_body::json_object;
use super::state::AppState;
use crate::gpu::Inventory;
use crate::scheduler::device_use::{HOST_NAME, model_devices};
use crate::scheduler::keep_alive::KeepAlive;
use crate::scheduler::types::LoadedModel;
use crate::store::manifest::ModelConfig;
use crate::store::name::ModelName;
use crate::store::{Store, StoreError};
use crate::sync::lock;

/// How far away Ollama puts "forever": the largest Go duration, about 292 years.
const FOREVER: Duration = crate::durations::LONGEST;

/// The routes of this module that read.
pub(super) fn routes() -> Router<AppState> {
    Router::new().route("/api/tags", get(tags)).route("/api/ps", get(ps)).route("/api/show", post(show))
}

/// The routes of this module that change the store (`[server] store_changes` applies).
pub(super) fn store_routes() -> Router<AppState> {
    Router::new().route("/api/copy", post(copy)).route("/api/delete", delete(delete_model))
}

/// `details` of `/api/tags`, `/api/ps` and `/api/show`, from the config blob.
#[derive(Debug, Default, Serialize)]
struct Details {
    parent_model: String,
    format: String,
    family: String,
    families: Option<Vec<String>>,
    parameter_size: String,
    quantization_level: String,
}

impl From<ModelConfig> for Details {
    fn from(config: ModelConfig) -> Self {
        Self {
            parent_model: String::new(),
            format: config.model_format,
            family: config.model_family,
            families: config.model_families,
            parameter_size: config.model_type,
            quantization_level: config.file_type,
        }
    }
}

#[derive(Debug, Serialize)]
struct Tags {
    models: Vec<TagsModel>,
}

#[derive(Debug, Serialize)]
struct TagsModel {
    name: String,
    model: String,
    modified_at: String,
    size: u64,
    digest: String,
    details: Details,
}

#[derive(Debug, Serialize)]
struct Ps {
    models: Vec<PsModel>,
}

#[derive(Debug, Serialize)]
struct PsModel {
    name: String,
    model: String,
    size: u64,
    size_vram: u64,
    digest: String,
    details: Details,
    expires_at: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    context_length: Option<u64>,
    /// corral's own: the other models served by the same llama-server process (same
    /// weights and load options); absent when none.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    shared_with: Vec<String>,
    /// corral's own: where its memory is, device by device, the host last.
    devices: Vec<PsDevice>,
}

/// One device of a `/api/ps` entry.
#[derive(Debug, Serialize)]
struct PsDevice {
    /// The device's stable id (`host` for host memory), as D-Bus and `/metrics` name it.
    name: String,
    /// `cuda`, `rocm`, `vulkan`, `rpc` or `host`.
    kind: &'static str,
    /// Bytes of the model there.
    bytes: u64,
}

#[derive(Debug, Serialize)]
struct Show {
    modelfile: String,
    parameters: String,
    template: String,
    details: Details,
    model_info: Map<String, Value>,
    capabilities: Vec<&'static str>,
    modified_at: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    license: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    system: Option<String>,
}

/// `GET|HEAD /api/tags`: every model in the store, the most recently written first.
///
/// The body is kept with the store index's generation it was made from: while no model
/// changed, a listing is that body again, answered on the async thread without touching
/// the disk (at 1 000 models, making it takes about a millisecond and 300 KB of
/// allocations; clients such as web UIs poll it).
async fn tags(State(state): State<AppState>) -> Result<Response, ApiError> {
    if let Some(body) = kept_tags(&state) {
        return Ok(json_body(body));
    }
    let (store, cache) = (state.store.clone(), std::sync::Arc::clone(&state.tags));
    // The store's index: the tree is walked only when it changed (`store::list`).
    let body = blocking(move || make_tags(&store, &cache)).await.map_err(|e| e.into_api("/api/tags", ""))?;
    Ok(json_body(body))
}

/// The kept `/api/tags` body, if the store's index is current and it was made from it.
fn kept_tags(state: &AppState) -> Option<Bytes> {
    let generation = state.store.current_generation()?;
    lock(&state.tags).as_ref().filter(|(at, _)| *at == generation).map(|(_, body)| body.clone())
}

/// Makes `/api/tags`' body from the store's listing and keeps it in `cache`.
fn make_tags(store: &Store, cache: &Mutex<Option<(u64, Bytes)>>) -> Result<Bytes, StoreError> {
    let (generation, mut listed) = store.list_generation()?;
    listed.sort_by_key(|l| std::cmp::Reverse(l.modified));
    let models = listed
        .iter()
        .map(|l| {
            let name = l.name.to_string();
            TagsModel {
                model: name.clone(),
                name,
                modified_at: rfc3339(l.modified),
                size: l.size,
                digest: l.digest.hex(),
                details: l.config.clone().into(),
            }
        })
        .collect();
    let body = Bytes::from(serde_json::to_vec(&Tags { models }).expect("a listing always serializes"));
    *lock(cache) = Some((generation, body.clone()));
    Ok(body)
}

/// Makes and keeps `/api/tags`' body before `READY=1`, when the store opened with the
/// listing the last run saved (nothing to read from disk): the first listing after a
/// restart is then answered as every later one, not made while the checks that follow
/// `READY=1` hold both cores (3 to 10 ms at 1 000 models against 0.1). Blocking: about a
/// millisecond at 1 000 models. Without a current listing (the first start on a store)
/// it does nothing, as making one would walk the tree.
pub fn keep_tags_ready(state: &AppState) {
    if state.store.current_generation().is_none() {
        return;
    }
    if let Err(e) = make_tags(&state.store, &state.tags) {
        tracing::debug!(error = %e, "cannot make the listing's body before READY=1: {e}");
    }
}

/// A JSON body made before, answered as [`Json`] answers.
fn json_body(body: Bytes) -> Response {
    ([(axum::http::header::CONTENT_TYPE, "application/json")], body).into_response()
}

/// `GET /api/ps`: the loaded models, the latest to expire first.
async fn ps(State(state): State<AppState>) -> Result<Json<Ps>, ApiError> {
    const PATH: &str = "/api/ps";
    let loaded = state.scheduler.loaded().await.map_err(|e| error::scheduler_view(&e, PATH))?;
    let (now, wall) = (Instant::now(), SystemTime::now());
    let (store, inventory) = (state.store.clone(), state.fleet.inventory());
    let mut models = blocking(move || {
        // An entry for each model a runner serves: models with the same weights and load
        // options share one.
        Ok(loaded
            .iter()
            .flat_map(|m| m.names.iter().map(move |name| (m, name)))
            .map(|(m, name)| ps_model(&store, &inventory, m, name, now, wall))
            .collect::<Vec<(SystemTime, PsModel)>>())
    })
    .await
    .map_err(|e| e.into_api(PATH, ""))?;
    models.sort_by_key(|m| std::cmp::Reverse(m.0));
    Ok(Json(Ps { models: models.into_iter().map(|(_, m)| m).collect() }))
}

/// One `/api/ps` entry, with when it expires for sorting.
fn ps_model(
    store: &Store,
    inventory: &Inventory,
    m: &LoadedModel,
    name: &str,
    now: Instant,
    wall: SystemTime,
) -> (SystemTime, PsModel) {
    let expires = match (m.expires_at, m.keep_alive) {
        (Some(at), _) => wall + at.saturating_duration_since(now),
        // Busy: it expires its keep-alive after the last request ends.
        (None, KeepAlive::For(d)) => wall + d,
        (None, KeepAlive::Forever) => wall + FOREVER,
    };
    // The details the model's requests use, cached per manifest file (one `stat`).
    let (digest, details) = match ModelName::parse(name).map_err(|e| e.to_string()).and_then(|name| {
        let details = store.details(&name).map_err(|e| e.to_string())?;
        Ok((details.digest.hex(), Details::from(details.config.clone())))
    }) {
        Ok(found) => found,
        Err(e) => {
            // Deleted from the store while loaded: still listed, without its store facts.
            tracing::debug!(corral_model = %name, error = %e, "{name} is loaded but not in the store");
            (String::new(), Details::default())
        }
    };
    let devices: Vec<PsDevice> = model_devices(inventory, &m.placement, m.footprint)
        .into_iter()
        .map(|(kind, name, bytes)| PsDevice { name, kind, bytes })
        .collect();
    let model = PsModel {
        name: name.to_owned(),
        model: name.to_owned(),
        size: m.footprint.total(),
        // Ollama's "in VRAM": on any offload device, RPC devices included.
        size_vram: devices.iter().filter(|d| d.kind != HOST_NAME).map(|d| d.bytes).sum(),
        digest,
        details,
        expires_at: rfc3339(expires),
        context_length: Some(u64::from(m.context_length)),
        shared_with: m.names.iter().filter(|n| *n != name).cloned().collect(),
        devices,
    };
    (expires, model)
}

/// `POST /api/show` `{model, verbose?}`.
async fn show(State(state): State<AppState>, body: Bytes) -> Result<Json<Show>, ApiError> {
    const PATH: &str = "/api/show";
    let request = json_object(PATH, &body)?;
    let (given, name) = model_name(PATH, &request, &["model", "name"])?;
    let verbose = match request.get("verbose") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(bad("invalid type for \"verbose\": expected true or false", PATH)),
    };
    let store = state.store.clone();
    let shown = blocking(move || {
        let details = store.show(&name, verbose)?;
        let (_, _, modified) = store.manifest(&name)?;
        let capabilities = details.capabilities();
        let template = details.template.clone().unwrap_or_default();
        Ok(Show {
            // A model the syntax cannot express gets comments saying why, and no FROM: fed
            // back to create, it is refused rather than read as another model.
            modelfile: details.modelfile(&store).unwrap_or_else(|e| {
                tracing::warn!(corral_model = %details.name, error = %e, "cannot write the Modelfile of {}", details.name);
                e.to_string().lines().fold(String::new(), |out, line| out + "# " + line + "\n")
            }),
            parameters: details.parameters_text(),
            template,
            details: Details::from(details.config.clone()),
            capabilities,
            modified_at: rfc3339(modified),
            license: (!details.licenses.is_empty()).then(|| details.licenses.join("\n")),
            system: details.system.clone(),
            model_info: details.model_info,
        })
    })
    .await
    .map_err(|e| e.into_api(PATH, &given))?;
    Ok(Json(shown))
}

/// `POST /api/copy` `{source, destination}`: 200 with no body.
async fn copy(State(state): State<AppState>, body: Bytes) -> Result<StatusCode, ApiError> {
    const PATH: &str = "/api/copy";
    let request = json_object(PATH, &body)?;
    let (given, source) = model_name(PATH, &request, &["source"])?;
    let (_, destination) = model_name(PATH, &request, &["destination"])?;
    let store = state.store.clone();
    blocking(move || store.copy(&source, &destination)).await.map_err(|e| e.into_api(PATH, &given))?;
    Ok(StatusCode::OK)
}

/// `DELETE /api/delete` `{model}` (or Ollama's older `name`): 200 with no body.
async fn delete_model(State(state): State<AppState>, body: Bytes) -> Result<StatusCode, ApiError> {
    const PATH: &str = "/api/delete";
    let request = json_object(PATH, &body)?;
    let (given, name) = model_name(PATH, &request, &["model", "name"])?;
    let store = state.store.clone();
    let name_text = name.to_string();
    let removed = blocking(move || store.delete(&name)).await.map_err(|e| e.into_api(PATH, &given))?;
    tracing::info!(corral_event = "delete", corral_model = %name_text, blobs_removed = removed.len(), "deleted {name_text}");
    // A deleted model does not stay loaded: its runners unload (once their requests end).
    // None loaded is the common case, not an error.
    let _ = state.scheduler.unload_model(&name_text).await;
    Ok(StatusCode::OK)
}

/// RFC 3339 in UTC, with nanoseconds (Go's `time.Time` JSON form, less the zone offset).
fn rfc3339(time: SystemTime) -> String {
    humantime::format_rfc3339(time).to_string()
}

/// Why a blocking store call failed.
enum Failure {
    Store(StoreError),
    Panicked(tokio::task::JoinError),
}

impl Failure {
    /// The reply: `given` is the model name as the client wrote it.
    fn into_api(self, path: &str, given: &str) -> ApiError {
        match self {
            Failure::Store(e) => error::store(&e, StoreWork::Read, given, path),
            Failure::Panicked(e) => {
                tracing::error!(path, error = %e, "a store task panicked");
                error::opaque(path)
            }
        }
    }
}

/// Runs store work on the blocking pool.
async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, StoreError> + Send + 'static,
) -> Result<T, Failure> {
    match tokio::task::spawn_blocking(work).await {
        Ok(result) => result.map_err(Failure::Store),
        Err(e) => Err(Failure::Panicked(e)),
    }
}

/// The first of `fields` that is set, as written and as a valid model name.
pub(super) fn model_name(
    path: &str,
    request: &Map<String, Value>,
    fields: &[&str],
) -> Result<(String, ModelName), ApiError> {
    for field in fields {
        match request.get(*field) {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) if s.is_empty() => {}
            Some(Value::String(s)) => {
                let name = ModelName::parse(s).map_err(|e| bad(e.to_string(), path))?;
                return Ok((s.clone(), name));
            }
            Some(_) => return Err(bad(format!("invalid type for \"{field}\": expected a string"), path)),
        }
    }
    Err(bad(format!("{} is required", fields[0]), path))
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;
    use std::sync::Arc;
    use std::time::{Duration, SystemTime};

    use axum::body::Body;
    use axum::http::{Method, Request, StatusCode};
    use serde_json::{Value, json};
    use tower::ServiceExt;

    use super::super::router;
    use super::super::state::{AppState, absent_backend, for_tests};
    use crate::scheduler::backend::{Backend, BoxFuture, LiveRunner, StartRequest};
    use crate::scheduler::policy::Footprint;
    use crate::scheduler::request::{self, Defaults};
    use crate::store::create::CreateSpec;
    use crate::store::digest::Digest;
    use crate::store::modelfile::Modelfile;
    use crate::store::name::ModelName;

    /// Creates `name` in the state's store from `modelfile` (relative to the temp dir).
    fn create(dir: &tempfile::TempDir, state: &AppState, name: &str, modelfile: &str) {
        let spec =
            CreateSpec::from_modelfile(&Modelfile::parse(modelfile).expect("modelfile"), dir.path()).expect("spec");
        state.store.create(&ModelName::parse(name).expect("name"), &spec, &mut |_| {}).expect("create");
    }

    fn with_tiny() -> (tempfile::TempDir, AppState) {
        let (dir, state) = for_tests(absent_backend());
        create(&dir, &state, "tiny", "FROM ./tiny.gguf\n");
        (dir, state)
    }

    /// The status and the body (JSON, or `Value::Null` when empty).
    async fn call(state: &AppState, method: Method, path: &str, body: &str) -> (StatusCode, Value) {
        let request = Request::builder().method(method).uri(path).body(Body::from(body.to_owned())).expect("request");
        let response = router(state.clone()).oneshot(request).await.expect("infallible");
        let status = response.status();
        let bytes = axum::body::to_bytes(response.into_body(), 64 << 20).await.expect("body");
        let json = if bytes.is_empty() { Value::Null } else { serde_json::from_slice(&bytes).expect("json body") };
        (status, json)
    }

    fn keys(v: &Value) -> Vec<&str> {
        let mut keys: Vec<&str> = v.as_object().expect("object").keys().map(String::as_str).collect();
        keys.sort_unstable();
        keys
    }

    fn manifest_digest(state: &AppState, name: &str) -> String {
        let path = state.store.manifest_path(&ModelName::parse(name).expect("name"));
        Digest::of(&std::fs::read(path).expect("manifest")).hex()
    }

    fn assert_tiny_details(details: &Value) {
        assert_eq!(
            keys(details),
            ["families", "family", "format", "parameter_size", "parent_model", "quantization_level"]
        );
        assert_eq!(details["parent_model"], "");
        assert_eq!(details["format"], "gguf");
        assert_eq!(details["family"], "llama");
        assert_eq!(details["quantization_level"], "F16");
        assert!(!details["parameter_size"].as_str().expect("string").is_empty(), "{details}");
    }

    fn assert_rfc3339(value: &Value) -> SystemTime {
        humantime::parse_rfc3339(value.as_str().expect("a string")).expect("RFC 3339")
    }

    #[tokio::test]
    async fn tags_answers_its_kept_body_until_a_model_changes() {
        let (dir, state) = with_tiny();
        let (_, first) = call(&state, Method::GET, "/api/tags", "").await;
        let walks = state.store.tree_walks();
        let kept = state.tags.lock().expect("lock").clone().expect("the body is kept");
        // Unchanged: the same body, the same bytes, no walk of the tree.
        let (_, again) = call(&state, Method::GET, "/api/tags", "").await;
        assert_eq!(again, first);
        assert_eq!(state.store.tree_walks(), walks);
        assert!(
            state
                .tags
                .lock()
                .expect("lock")
                .as_ref()
                .is_some_and(|(g, b)| *g == kept.0 && b.as_ptr() == kept.1.as_ptr())
        );
        // A model created, then one deleted: each listing shows the store as it is.
        create(&dir, &state, "other", "FROM ./tiny.gguf\n");
        let (_, body) = call(&state, Method::GET, "/api/tags", "").await;
        let names = |body: &Value| -> Vec<String> {
            body["models"]
                .as_array()
                .expect("models")
                .iter()
                .map(|m| m["name"].as_str().expect("name").to_owned())
                .collect()
        };
        assert_eq!(names(&body), ["other:latest", "tiny:latest"]);
        state.store.delete(&ModelName::parse("tiny").expect("name")).expect("delete");
        let (_, body) = call(&state, Method::GET, "/api/tags", "").await;
        assert_eq!(names(&body), ["other:latest"]);
    }

    #[tokio::test]
    async fn tags_lists_every_model_in_ollamas_shape_newest_first() {
        let (dir, state) = with_tiny();
        std::thread::sleep(Duration::from_millis(20));
        create(&dir, &state, "me/other:1", "FROM ./tiny.gguf\nSYSTEM hi\n");
        let (status, body) = call(&state, Method::GET, "/api/tags", "").await;
        assert_eq!(status, StatusCode::OK);
        let models = body["models"].as_array().expect("models");
        let names: Vec<&str> = models.iter().map(|m| m["name"].as_str().expect("name")).collect();
        assert_eq!(names, ["me/other:1", "tiny:latest"]);
        let tiny = &models[1];
        assert_eq!(keys(tiny), ["details", "digest", "model", "modified_at", "name", "size"]);
        assert_eq!(tiny["model"], "tiny:latest");
        assert_eq!(tiny["digest"], manifest_digest(&state, "tiny"));
        assert_eq!(tiny["digest"].as_str().expect("digest").len(), 64, "hex, no prefix");
        assert!(tiny["size"].as_u64().expect("size") > 0);
        assert!(assert_rfc3339(&tiny["modified_at"]) <= SystemTime::now());
        assert_tiny_details(&tiny["details"]);
    }

    #[tokio::test]
    async fn tags_read_no_blob_once_the_model_is_listed() {
        let (_dir, state) = with_tiny();
        let (status, first) = call(&state, Method::GET, "/api/tags", "").await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(first["models"][0]["details"]["family"], "llama", "{first}");
        // Every blob gone, the GGUF weights and the config included: a listing that read
        // any of them would now fail or show empty details.
        let (manifest, _, _) = state.store.manifest(&ModelName::parse("tiny").expect("name")).expect("manifest");
        for layer in manifest.blobs() {
            std::fs::remove_file(state.store.blob_path(&layer.digest)).expect("remove a blob");
        }
        let (status, again) = call(&state, Method::GET, "/api/tags", "").await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(again, first);
    }

    #[tokio::test]
    async fn the_listing_body_is_made_before_ready_from_a_current_index_only() {
        let (_dir, mut state) = with_tiny();
        // A store just opened, its index never built: making the body would walk the
        // tree, so nothing is made.
        state.store = crate::store::Store::open(state.store.root()).expect("the store again");
        super::keep_tags_ready(&state);
        assert!(state.tags.lock().expect("lock").is_none());
        assert_eq!(state.store.manifests_read(), 0, "no manifest read");
        // Once listed (as a saved listing is at start), the body is made from the index.
        let (_, listed) = call(&state, Method::GET, "/api/tags", "").await;
        *state.tags.lock().expect("lock") = None;
        let reads = state.store.manifests_read();
        super::keep_tags_ready(&state);
        let (_, made) = state.tags.lock().expect("lock").clone().expect("the body is made");
        assert_eq!(serde_json::from_slice::<Value>(&made).expect("json"), listed);
        assert_eq!(state.store.manifests_read(), reads, "made without reading a manifest");
    }

    #[tokio::test]
    async fn tags_of_an_empty_store_head_and_a_wrong_method() {
        let (_dir, state) = for_tests(absent_backend());
        assert_eq!(call(&state, Method::GET, "/api/tags", "").await, (StatusCode::OK, json!({"models": []})));
        assert_eq!(call(&state, Method::HEAD, "/api/tags", "").await, (StatusCode::OK, Value::Null));
        let (status, body) = call(&state, Method::POST, "/api/tags", "{}").await;
        assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);
        assert_eq!(body, json!({"error": "method not allowed on /api/tags"}));
    }

    #[tokio::test]
    async fn ps_with_nothing_loaded_is_empty() {
        let (_dir, state) = with_tiny();
        assert_eq!(call(&state, Method::GET, "/api/ps", "").await, (StatusCode::OK, json!({"models": []})));
    }

    /// A backend whose runners are ready at once and measure 100 bytes of VRAM and 50 of RAM.
    struct Immediate;

    struct Runner;

    impl LiveRunner for Runner {
        fn socket(&self) -> PathBuf {
            PathBuf::from("/nonexistent.sock")
        }
        fn measured(&self) -> Option<Footprint> {
            Some(Footprint { vram: 100, ram: 50 })
        }
        fn pid(&self) -> u32 {
            4242
        }
        fn stop(self: Box<Self>) -> BoxFuture<'static, ()> {
            Box::pin(async {})
        }
        fn exited(&mut self) -> BoxFuture<'_, String> {
            Box::pin(std::future::pending())
        }
    }

    impl Backend for Immediate {
        fn start(
            &self,
            _: StartRequest,
        ) -> BoxFuture<'static, Result<Box<dyn LiveRunner>, crate::scheduler::failure::LoadFailure>> {
            Box::pin(async { Ok(Box::new(Runner) as Box<dyn LiveRunner>) })
        }
    }

    #[tokio::test]
    async fn ps_shows_a_loaded_model_in_ollamas_shape() {
        let (dir, state) = for_tests(Arc::new(Immediate));
        create(&dir, &state, "tiny", "FROM ./tiny.gguf\n");
        let name = ModelName::parse("tiny").expect("name");
        let defaults = Defaults { num_ctx: 1024, parallel: 2 };
        let model_request =
            request::build(&state.store, &name, &request::LoadOverrides::default(), None, false, defaults)
                .expect("request");
        drop(state.scheduler.acquire(model_request).await.expect("loaded"));
        let loaded = state.scheduler.loaded().await.expect("loaded");
        let (status, body) = call(&state, Method::GET, "/api/ps", "").await;
        assert_eq!(status, StatusCode::OK);
        let models = body["models"].as_array().expect("models");
        assert_eq!(models.len(), 1, "{body}");
        let m = &models[0];
        assert_eq!(
            keys(m),
            ["context_length", "details", "devices", "digest", "expires_at", "model", "name", "size", "size_vram"]
        );
        assert_eq!(m["name"], "tiny:latest");
        assert_eq!(m["model"], "tiny:latest");
        assert_eq!(m["size"], loaded[0].footprint.total());
        assert_eq!(m["size_vram"], 0, "no GPU: all in host memory");
        assert_eq!(m["devices"], json!([{"name": "host", "kind": "host", "bytes": loaded[0].footprint.total()}]));
        assert_eq!(m["digest"], manifest_digest(&state, "tiny"));
        assert_eq!(m["context_length"], 1024, "per slot, not num_ctx × parallel");
        assert_tiny_details(&m["details"]);
        let left = assert_rfc3339(&m["expires_at"]).duration_since(SystemTime::now()).expect("in the future");
        assert!(left > Duration::from_secs(290) && left <= Duration::from_secs(300), "{left:?}");

        // Deleting the model unloads it too; the reply comes once its runner is gone.
        let (status, _) = call(&state, Method::DELETE, "/api/delete", r#"{"model": "tiny"}"#).await;
        assert_eq!(status, StatusCode::OK);
        assert!(
            state.scheduler.loaded().await.expect("loaded").is_empty(),
            "the runner of a deleted model is unloaded"
        );
    }

    #[tokio::test]
    async fn ps_lists_a_model_on_a_worker_device_with_its_host_part() {
        use crate::gpu::{Backend as Kind, Gpu, HostMemory, Inventory};
        use crate::scheduler::actor::Scheduler;
        use crate::scheduler::footprints::Footprints;
        use crate::scheduler::policy::GpuView;

        let (dir, mut state) = for_tests(absent_backend());
        let limits = super::super::state::test_limits();
        // One RPC device of 1 GiB: the runner (100 bytes of VRAM, 50 of RAM) goes there.
        let gpus = vec![GpuView { index: 0, name: "RPC0".into(), worker: None, usable: 1 << 30 }];
        let (scheduler, handle) = Scheduler::new(Arc::new(Immediate), gpus, 1 << 30, limits, Footprints::in_memory());
        tokio::spawn(scheduler.run());
        state.scheduler = handle;
        let inventory = Inventory {
            gpus: vec![Gpu {
                index: 0,
                id: "rpc:127.0.0.1:50052#0".into(),
                name: "worker".into(),
                backend: Kind::Rpc,
                total_bytes: 1 << 30,
                free_bytes: 1 << 30,
                driver: None,
                compute: None,
                endpoint: Some("127.0.0.1:50052".into()),
            }],
            host: HostMemory { total_bytes: 1 << 30, available_bytes: 1 << 30 },
            offline: std::collections::BTreeSet::new(),
        };
        state.fleet = crate::workers::FleetView::fixed(crate::workers::Fleet::new(inventory, &[], SystemTime::now()));
        create(&dir, &state, "tiny", "FROM ./tiny.gguf\n");
        let name = ModelName::parse("tiny").expect("name");
        let defaults = Defaults { num_ctx: 1024, parallel: 1 };
        let model_request =
            request::build(&state.store, &name, &request::LoadOverrides::default(), None, false, defaults)
                .expect("request");
        drop(state.scheduler.acquire(model_request).await.expect("loaded"));
        let (status, body) = call(&state, Method::GET, "/api/ps", "").await;
        assert_eq!(status, StatusCode::OK);
        let m = &body["models"][0];
        assert_eq!(
            m["devices"],
            json!([
                {"name": "rpc:127.0.0.1:50052#0", "kind": "rpc", "bytes": 100},
                {"name": "host", "kind": "host", "bytes": 50},
            ]),
            "{body}"
        );
        assert_eq!((m["size"].as_u64(), m["size_vram"].as_u64()), (Some(150), Some(100)), "{body}");
    }

    #[test]
    fn forever_is_about_292_years_away() {
        let text = super::rfc3339(SystemTime::now() + super::FOREVER);
        assert!(text.starts_with("23"), "{text}");
        assert!(humantime::parse_rfc3339(&text).is_ok());
    }

    #[tokio::test]
    async fn show_has_ollamas_fields() {
        let (_dir, state) = with_tiny();
        for body in [r#"{"model": "tiny"}"#, r#"{"model": "tiny:latest", "verbose": true}"#, r#"{"name": "tiny"}"#] {
            let (status, shown) = call(&state, Method::POST, "/api/show", body).await;
            assert_eq!(status, StatusCode::OK, "{body}: {shown}");
            assert_eq!(
                keys(&shown),
                ["capabilities", "details", "model_info", "modelfile", "modified_at", "parameters", "template"]
            );
            assert!(shown["modelfile"].as_str().expect("modelfile").contains("\nFROM "), "{shown}");
            assert_eq!(shown["parameters"], "");
            assert_eq!(shown["capabilities"], json!(["completion"]));
            assert_eq!(shown["model_info"]["general.architecture"], "llama");
            assert_rfc3339(&shown["modified_at"]);
            assert_tiny_details(&shown["details"]);
        }
    }

    #[tokio::test]
    async fn show_includes_license_system_and_template_when_present() {
        let (dir, state) = for_tests(absent_backend());
        create(
            &dir,
            &state,
            "chat",
            "FROM ./tiny.gguf\nTEMPLATE \"\"\"{{ .Prompt }}{{ .Tools }}\"\"\"\nSYSTEM Be brief.\nLICENSE MIT\nPARAMETER temperature 0.2\n",
        );
        let (status, shown) = call(&state, Method::POST, "/api/show", r#"{"model": "chat"}"#).await;
        assert_eq!(status, StatusCode::OK, "{shown}");
        assert_eq!(shown["license"], "MIT");
        assert_eq!(shown["system"], "Be brief.");
        assert_eq!(shown["template"], "{{ .Prompt }}{{ .Tools }}");
        assert_eq!(shown["capabilities"], json!(["completion", "tools"]));
        assert!(shown["parameters"].as_str().expect("parameters").starts_with("temperature "), "{shown}");
    }

    #[tokio::test]
    async fn bad_requests_name_the_problem() {
        let (_dir, state) = with_tiny();
        let (show, copy, delete) = ("/api/show", "/api/copy", "/api/delete");
        let (bad, missing) = (StatusCode::BAD_REQUEST, StatusCode::NOT_FOUND);
        let cases: &[(Method, &str, &str, StatusCode, &str)] = &[
            (Method::POST, show, "", bad, "missing request body"),
            (Method::POST, show, "{not json", bad, "invalid JSON in the request body"),
            (Method::POST, show, "[1]", bad, "the request body must be a JSON object"),
            (Method::POST, show, "{}", bad, "model is required"),
            (Method::POST, show, r#"{"model": ""}"#, bad, "model is required"),
            (Method::POST, show, r#"{"model": 5}"#, bad, "invalid type for \"model\""),
            (Method::POST, show, r#"{"model": "tiny", "verbose": "yes"}"#, bad, "invalid type for \"verbose\""),
            (Method::POST, show, r#"{"model": "bad name!"}"#, bad, "invalid model name"),
            (Method::POST, show, r#"{"model": "nope"}"#, missing, "model 'nope' not found"),
            (Method::POST, copy, "{oops", bad, "invalid JSON in the request body"),
            (Method::POST, copy, r#"{"destination": "x"}"#, bad, "source is required"),
            (Method::POST, copy, r#"{"source": "tiny"}"#, bad, "destination is required"),
            (
                Method::POST,
                copy,
                r#"{"source": "tiny", "destination": "a/b/c/d"}"#,
                bad,
                "invalid model name 'a/b/c/d'",
            ),
            (Method::POST, copy, r#"{"source": "nope", "destination": "x"}"#, missing, "model 'nope' not found"),
            (Method::DELETE, delete, "", bad, "missing request body"),
            (Method::DELETE, delete, "nope", bad, "invalid JSON in the request body"),
            (Method::DELETE, delete, "{}", bad, "model is required"),
            (Method::DELETE, delete, r#"{"model": "-x"}"#, bad, "invalid model name"),
            (Method::DELETE, delete, r#"{"model": "nope"}"#, missing, "model 'nope' not found"),
        ];
        for (method, path, body, expected, message) in cases {
            let (status, reply) = call(&state, method.clone(), path, body).await;
            assert_eq!(status, *expected, "{method} {path} {body}: {reply}");
            assert_eq!(keys(&reply), ["error"], "{reply}");
            let error = reply["error"].as_str().expect("error text");
            assert!(error.starts_with(message), "{method} {path} {body}: {error}");
        }
        let (status, _) = call(&state, Method::GET, delete, "").await;
        assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);
    }

    #[tokio::test]
    async fn copy_then_delete_twice() {
        let (_dir, state) = with_tiny();
        let (status, body) =
            call(&state, Method::POST, "/api/copy", r#"{"source": "tiny", "destination": "me/copy:v2"}"#).await;
        assert_eq!((status, body), (StatusCode::OK, Value::Null));
        assert_eq!(manifest_digest(&state, "me/copy:v2"), manifest_digest(&state, "tiny"), "the same manifest");
        let (_, tags) = call(&state, Method::GET, "/api/tags", "").await;
        assert_eq!(tags["models"].as_array().expect("models").len(), 2);

        let (status, body) = call(&state, Method::DELETE, "/api/delete", r#"{"model": "tiny"}"#).await;
        assert_eq!((status, body), (StatusCode::OK, Value::Null));
        let (status, body) = call(&state, Method::DELETE, "/api/delete", r#"{"model": "tiny"}"#).await;
        assert_eq!((status, body), (StatusCode::NOT_FOUND, json!({"error": "model 'tiny' not found"})));
        let (status, shown) = call(&state, Method::POST, "/api/show", r#"{"model": "me/copy:v2"}"#).await;
        assert_eq!(status, StatusCode::OK, "the copy keeps the shared blobs: {shown}");

        let (status, _) = call(&state, Method::DELETE, "/api/delete", r#"{"name": "me/copy:v2"}"#).await;
        assert_eq!(status, StatusCode::OK, "Ollama's older field");
        assert_eq!(call(&state, Method::GET, "/api/tags", "").await, (StatusCode::OK, json!({"models": []})));
    }
}
