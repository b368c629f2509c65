//! Failed loads by their class at both edges. On corrald with the real llama-server: a
//! model whose weights are not a usable GGUF is a bad model, HTTP 422 and D-Bus
//! `org.corral.Corral1.Error.BadModel`, whether llama.cpp finds it out (an architecture
//! it does not know) or corral's own reader does (random bytes where the weights were).
//! Through the API in-process with `fake-llama-server` runners, for what the real one
//! cannot do on demand: each other class's status (out of memory 507, no progress 504, a
//! crash 502, anything else 500).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use corral::dbus::proxy::ManagerProxy;
use corral::gguf::reader::GgufFile;
use corral::gguf::{GgufWriter, TensorType};
use corral::http::AppState;
use corral::scheduler::actor::Scheduler;
use corral::scheduler::footprints::Footprints;
use corral::scheduler::request::Defaults;
use corral::store::Store;
use serde_json::{Value, json};
use zbus::proxy::CacheProperties;

use crate::support::api::{backend, call, demo_store, fake_behaviour, limits, model_blob};
use crate::support::dbus::BusDaemon;
use crate::support::http;

/// The most a load (and its failure) may take, however loaded the machine.
const WAIT: Duration = Duration::from_secs(120);

async fn within<T>(what: &str, future: impl Future<Output = T>) -> T {
    tokio::time::timeout(WAIT, future).await.unwrap_or_else(|_| panic!("timed out waiting for {what}"))
}

/// The store's blob of `model`'s weights.
fn blob(dir: &Path, model: &str) -> PathBuf {
    model_blob(&Store::open(&dir.join("models")).expect("store"), model)
}

/// `POST path` with `body` on corrald's UNIX socket.
async fn post(daemon: &BusDaemon, path: &'static str, body: &'static str) -> http::Response {
    let socket = daemon.socket();
    let call = tokio::task::spawn_blocking(move || http::unix(&socket, "POST", path, Some(body)));
    within(path, call).await.expect("the request's thread")
}

fn error_of(response: &http::Response) -> String {
    response.json()["error"].as_str().unwrap_or_else(|| panic!("an error: {}", response.body)).to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_whose_file_is_not_a_gguf_is_a_bad_model_over_http_and_d_bus() {
    let daemon = BusDaemon::start("[scheduler]\nnum_ctx = 512\n");
    let connection = daemon.connect().await;
    let manager =
        ManagerProxy::builder(&connection).cache_properties(CacheProperties::No).build().await.expect("manager");

    // llama.cpp finds out: a GGUF that corral reads (and plans with), of an architecture
    // llama.cpp does not know, where the weights were; llama-server exits with
    // `unknown model architecture`.
    let chat = blob(daemon.path(), "chat");
    let mut gguf = GgufWriter::new();
    gguf.add_metadata("general.architecture", "corral-unknown").expect("metadata");
    gguf.add_tensor("token_embd.weight", &[8, 4], TensorType::F32, &[0.5; 32]).expect("tensor");
    gguf.write_file(&chat).expect("overwrite the blob");
    GgufFile::open(&chat).expect("corral's reader takes it");
    let response = post(&daemon, "/api/generate", r#"{"model":"chat","prompt":"hi","stream":false}"#).await;
    assert_eq!(response.status, 422, "{}", response.body);
    let error = error_of(&response);
    assert!(error.starts_with("model 'chat:latest' failed to load: ") && error.contains("bad model file"), "{error}");
    // The same failure through D-Bus (the first failure is retried at once, no back-off).
    let err = within("Load", manager.load("chat", HashMap::new())).await.expect_err("a bad model").to_string();
    assert!(err.starts_with("org.corral.Corral1.Error.BadModel: model 'chat:latest' failed to load: "), "{err}");
    assert!(manager.loaded_models().await.expect("LoadedModels").is_empty());

    // corral's own reader finds out first: random bytes where the weights were. The
    // manifest is touched so that no details read before stand in for the file.
    let embed = blob(daemon.path(), "embed");
    let noise: Vec<u8> = (0..4096_u32).map(|i| u8::try_from((i * 131 + 7) % 251).expect("a byte")).collect();
    std::fs::write(&embed, noise).expect("overwrite the blob");
    let manifest = daemon.path().join("models/manifests/registry.ollama.ai/library/embed/latest");
    let later = SystemTime::now() + Duration::from_secs(5);
    std::fs::File::options().write(true).open(&manifest).expect("manifest").set_modified(later).expect("touch");
    let response = post(&daemon, "/api/embed", r#"{"model":"embed","input":"hi"}"#).await;
    assert_eq!(response.status, 422, "{}", response.body);
    let error = error_of(&response);
    assert!(error.contains("is not a usable GGUF file"), "{error}");
    let err = within("Load", manager.load("embed", HashMap::new())).await.expect_err("a bad model").to_string();
    assert!(err.starts_with("org.corral.Corral1.Error.BadModel: ") && err.contains("not a usable GGUF"), "{err}");
}

/// The status and error of `/api/generate` for `chat` when its runner (the fake, or
/// `program` in the test's directory) behaves as `behaviour` while loading, with a load
/// timeout of `load_timeout`.
async fn failed_load(behaviour: &Value, load_timeout: Duration, program: Option<&str>) -> (u16, String) {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = demo_store(dir.path());
    fake_behaviour(&store, "chat", behaviour);
    let runtime = dir.path().join("run");
    std::fs::create_dir(&runtime).expect("runtime dir");
    let mut backend = backend(&runtime);
    backend.config.llama_server =
        program.map_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_fake-llama-server")), |p| dir.path().join(p));
    backend.load_timeout = load_timeout;
    let (scheduler, handle) = Scheduler::new(Arc::new(backend), Vec::new(), 4 << 30, limits(), Footprints::in_memory());
    tokio::spawn(scheduler.run());
    let state = AppState::for_tests(store, handle, Defaults { num_ctx: 512, parallel: 1 });
    let body = json!({"model": "chat", "prompt": "hi", "stream": false}).to_string();
    let (status, _, text) = within("/api/generate", call(&state, "POST", "/api/generate", &body)).await;
    let error: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"));
    (status.as_u16(), error["error"].as_str().unwrap_or_else(|| panic!("an error: {text}")).to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_class_of_failed_load_has_its_http_status() {
    let long = Duration::from_secs(60);
    // The fake exits 0 ms after its start, in the middle of a load of 60 s.
    let exits = |extra: Value| {
        let mut behaviour = json!({"load_ms": 60_000, "exit_after_ms": 0});
        behaviour.as_object_mut().expect("object").extend(extra.as_object().expect("object").clone());
        behaviour
    };
    let cases = [
        (json!({"oom": true}), long, 507, "(out of memory)"),
        (json!({"hang": true}), Duration::from_secs(1), 504, "made no progress for 1 s while loading"),
        (exits(json!({"exit_signal": 6})), long, 502, "(killed)"),
        (exits(json!({"exit_code": 3})), long, 502, "(crashed)"),
        (
            exits(json!({"errors": ["llama_model_load: error loading model: unknown model architecture: 'x'"]})),
            long,
            422,
            "(bad model file)",
        ),
        (exits(json!({"errors": ["error: invalid argument: --bogus"]})), long, 500, "(invalid argument)"),
    ];
    for (behaviour, timeout, status, said) in cases {
        let (got, error) = failed_load(&behaviour, timeout, None).await;
        assert_eq!(got, status, "{behaviour}: {error}");
        assert!(
            error.starts_with("model 'chat:latest' failed to load: ") && error.contains(said),
            "{behaviour}: {error}"
        );
    }
    // Anything else: llama-server cannot even be started.
    let (got, error) = failed_load(&json!({}), long, Some("no-such-llama-server")).await;
    assert_eq!(got, 500, "{error}");
    assert!(error.contains("cannot start llama-server"), "{error}");
}
