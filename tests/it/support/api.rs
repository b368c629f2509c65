//! An in-process API over a temporary store holding `chat` (the tiny llama) and `embed`
//! (the tiny bert), with runners on the real llama-server.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::response::Response;

use corral::http::{AppState, router};
use corral::scheduler::actor::Scheduler;
use corral::scheduler::backend::SupervisorBackend;
use corral::scheduler::footprints::Footprints;
use corral::scheduler::keep_alive::{Clamp, KeepAlive};
use corral::scheduler::request::Defaults;
use corral::scheduler::types::Limits;
use corral::store::Store;
use corral::store::create::CreateSpec;
use corral::store::modelfile::Modelfile;
use corral::store::name::ModelName;
use corral::supervisor::child_log::LogSink;
use corral::supervisor::runner::SupervisorConfig;

use tower::ServiceExt;

use super::llama;

/// A store in `dir/models` holding `chat` (the tiny llama) and `embed` (the tiny bert).
pub fn demo_store(dir: &Path) -> Store {
    let store = Store::open(&dir.join("models")).expect("store");
    corral::demo_model::write_tiny_llama(&dir.join("tiny.gguf")).expect("llama");
    corral::demo_model::write_tiny_bert(&dir.join("bert.gguf")).expect("bert");
    for (name, file) in [("chat", "tiny.gguf"), ("embed", "bert.gguf")] {
        let modelfile = Modelfile::parse(&format!("FROM ./{file}\n")).expect("modelfile");
        let spec = CreateSpec::from_modelfile(&modelfile, dir).expect("spec");
        store.create(&ModelName::parse(name).expect("name"), &spec, &mut |_| {}).expect("create");
    }
    store
}

/// Runners of the real llama-server with their sockets in `dir`.
pub fn backend(dir: &Path) -> SupervisorBackend {
    SupervisorBackend {
        config: SupervisorConfig {
            llama_server: llama::bin_dir().join("llama-server"),
            runtime_dir: dir.to_owned(),
            inherited_env: vec![("PATH".into(), std::env::var_os("PATH").unwrap_or_default())],
            log_sink: LogSink::Tracing,
            cgroups: None,
            stop_grace: Duration::from_secs(10),
            worker_link_timeout: Duration::from_secs(3),
        },
        load_timeout: Duration::from_secs(60),
        devices: Arc::default(),
        probe: None,
        projections: None,
    }
}

/// Three runners at most, a queue of 16, the default keep-alive of 5 minutes.
pub fn limits() -> Limits {
    Limits {
        max_loaded: 3,
        max_queue: 16,
        default_keep_alive: KeepAlive::For(Duration::from_secs(300)),
        clamp: Clamp::default(),
        partial_offload: true,
    }
}

/// An API over [`demo_store`] with real runners and 4 GiB of host memory.
pub fn state(dir: &Path) -> AppState {
    let store = demo_store(dir);
    let (scheduler, handle) =
        Scheduler::new(Arc::new(backend(dir)), Vec::new(), 4 << 30, limits(), Footprints::in_memory());
    tokio::spawn(scheduler.run());
    AppState::for_tests(store, handle, Defaults { num_ctx: 512, parallel: 1 })
}

/// Sends a request with a JSON body through the router, in-process.
pub async fn send(state: &AppState, method: &str, path: &str, body: &str) -> Response {
    let request = Request::builder()
        .method(method)
        .uri(path)
        .header("content-type", "application/json")
        .body(Body::from(body.to_owned()))
        .expect("request");
    router(state.clone()).oneshot(request).await.expect("infallible")
}

/// Status, content type and body text of a request.
pub async fn call(state: &AppState, method: &str, path: &str, body: &str) -> (StatusCode, String, String) {
    let response = send(state, method, path, body).await;
    let status = response.status();
    let content_type =
        response.headers().get("content-type").map(|v| v.to_str().expect("ascii").to_owned()).unwrap_or_default();
    let bytes = axum::body::to_bytes(response.into_body(), 1 << 24).await.expect("body");
    (status, content_type, String::from_utf8(bytes.to_vec()).expect("utf-8"))
}

/// Waits (10 s at most) until no request holds a runner: a lease's release is sent when
/// it drops and reaches the scheduler shortly after.
pub async fn leases_reach_zero(state: &AppState) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let loaded = state.scheduler.loaded().await.expect("loaded");
        if loaded.iter().all(|m| m.leases == 0) {
            return;
        }
        assert!(Instant::now() < deadline, "a lease was not released: {loaded:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The GGUF file `model` runs in `store`.
pub fn model_blob(store: &Store, model: &str) -> std::path::PathBuf {
    let name = ModelName::parse(model).expect("name");
    let defaults = Defaults { num_ctx: 512, parallel: 1 };
    let overrides = corral::scheduler::request::LoadOverrides::default();
    corral::scheduler::request::build(store, &name, &overrides, None, false, defaults).expect("request").files.model
}

/// Makes `fake-llama-server` behave as `behaviour` when it runs `model` (it reads
/// `<blob>.fake.json`).
pub fn fake_behaviour(store: &Store, model: &str, behaviour: &serde_json::Value) {
    let mut beside = model_blob(store, model).into_os_string();
    beside.push(".fake.json");
    std::fs::write(beside, behaviour.to_string()).expect("the fake's behaviour");
}

/// The names in the store's blob directory, sorted.
pub fn blob_files(state: &AppState) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(state.store.blobs_dir())
        .expect("blobs/")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}
