//! Races under faults, through the API in-process with `fake-llama-server` runners: a
//! runner that dies as a request reaches it (or just before: killed, its crash not yet
//! seen), and one that falls silent in the middle of a stream.
//!
//! The store holds the tiny demo models; the fake takes its behaviour from
//! `<blob>.fake.json` beside the model's blob and appends each start to `<blob>.starts`.
//! No test sleeps to synchronise: each waits for a condition under a deadline.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use corral::http::AppState;
use corral::scheduler::actor::Scheduler;
use corral::scheduler::backend::SupervisorBackend;
use corral::scheduler::footprints::Footprints;
use corral::scheduler::request::Defaults;
use corral::supervisor::child_log::LogSink;
use corral::supervisor::runner::SupervisorConfig;
use corral::supervisor::upstream::Pool;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::{Value, json};

use crate::support::api::{call, demo_store, fake_behaviour, limits, model_blob};

/// The most any one step may take, however loaded the machine.
const DEADLINE: Duration = Duration::from_secs(60);

/// An API whose runners are the fake, over the demo store.
struct World {
    _dir: tempfile::TempDir,
    state: AppState,
}

impl World {
    /// `behaviour` for every model's fake; `max_loaded` runners at most.
    fn new(behaviour: &Value, max_loaded: usize) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = demo_store(dir.path());
        let runtime = dir.path().join("run");
        std::fs::create_dir(&runtime).expect("runtime dir");
        let defaults = Defaults { num_ctx: 512, parallel: 1 };
        for name in ["chat", "embed"] {
            fake_behaviour(&store, name, behaviour);
        }
        let backend = SupervisorBackend {
            config: SupervisorConfig {
                llama_server: PathBuf::from(env!("CARGO_BIN_EXE_fake-llama-server")),
                runtime_dir: runtime,
                inherited_env: vec![("PATH".into(), std::env::var_os("PATH").unwrap_or_default())],
                log_sink: LogSink::Tracing,
                cgroups: None,
                stop_grace: Duration::from_secs(10),
                worker_link_timeout: Duration::from_secs(3),
            },
            load_timeout: Duration::from_secs(30),
            devices: Arc::default(),
            probe: None,
            projections: None,
        };
        let limits = corral::scheduler::types::Limits { max_loaded, ..limits() };
        let (scheduler, handle) =
            Scheduler::new(Arc::new(backend), Vec::new(), 4 << 30, limits, Footprints::in_memory());
        tokio::spawn(scheduler.run());
        let state = AppState::for_tests(store, handle, defaults);
        Self { _dir: dir, state }
    }

    /// The pids of the fake's starts for `model`, in order.
    fn starts(&self, model: &str) -> Vec<i32> {
        let blob = model_blob(&self.state.store, model);
        let mut path = blob.into_os_string();
        path.push(".starts");
        std::fs::read_to_string(PathBuf::from(path))
            .unwrap_or_default()
            .lines()
            .map(|l| {
                let v: Value = serde_json::from_str(l).expect("a start line");
                i32::try_from(v["pid"].as_i64().expect("pid")).expect("pid")
            })
            .collect()
    }
}

/// A request, bounded by [`DEADLINE`].
async fn request(world: &World, path: &str, body: &Value) -> (u16, String) {
    let (status, _, text) = tokio::time::timeout(DEADLINE, call(&world.state, "POST", path, &body.to_string()))
        .await
        .unwrap_or_else(|_| panic!("{path} did not end within {DEADLINE:?}"));
    (status.as_u16(), text)
}

/// Polls `condition` every 20 ms until it holds, at most [`DEADLINE`].
async fn until(what: &str, mut condition: impl AsyncFnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while !condition().await {
        assert!(tokio::time::Instant::now() < deadline, "{what}: not within {DEADLINE:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// True while `pid` runs (exists and is not a zombie).
fn alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .is_ok_and(|stat| stat.rsplit_once(") ").is_some_and(|(_, rest)| !rest.starts_with('Z')))
}

/// Each proxied route, with a request that makes the runner generate (or embed).
fn routes() -> Vec<(&'static str, &'static str, Value)> {
    vec![
        (
            "chat",
            "/api/chat",
            json!({ "model": "chat", "messages": [{ "role": "user", "content": "hi" }], "stream": false }),
        ),
        ("chat", "/api/generate", json!({ "model": "chat", "prompt": "hi", "stream": false })),
        ("chat", "/api/generate", json!({ "model": "chat", "prompt": "hi", "raw": true, "stream": false })),
        ("chat", "/v1/chat/completions", json!({ "model": "chat", "messages": [{ "role": "user", "content": "hi" }] })),
        ("chat", "/v1/completions", json!({ "model": "chat", "prompt": "hi" })),
        ("chat", "/v1/responses", json!({ "model": "chat", "input": "hi" })),
        ("chat", "/v1/messages", json!({ "model": "chat", "messages": [{ "role": "user", "content": "hi" }] })),
        ("embed", "/api/embed", json!({ "model": "embed", "input": ["a", "b"] })),
        ("embed", "/v1/embeddings", json!({ "model": "embed", "input": "a" })),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runner_that_dies_as_a_request_reaches_it_is_replaced_by_a_fresh_load_on_every_route() {
    for (model, path, body) in routes() {
        // The first runner dies (SIGKILL) as the request reaches it, before answering.
        let world = World::new(&json!({ "crash_on_request": true, "exit_signal": 9, "first_start_only": true }), 3);
        let (status, text) = request(&world, path, &body).await;
        assert_eq!(status, 200, "{path}: {text}");
        let starts = world.starts(model);
        assert_eq!(starts.len(), 2, "{path}: one fresh load after the dead runner: {starts:?}");
        until("the dead runner is gone from the scheduler", async || {
            let loaded = world.state.scheduler.loaded().await.expect("loaded");
            loaded.len() == 1 && loaded[0].pid == u32::try_from(starts[1]).ok()
        })
        .await;
        assert!(!alive(starts[0]));
        drop(world);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_in_the_instant_after_a_runner_was_killed_gets_a_fresh_load() {
    let world = World::new(&json!({}), 1);
    let chat = json!({ "model": "chat", "messages": [{ "role": "user", "content": "hi" }], "stream": false });
    for round in 1..=5 {
        let (status, text) = request(&world, "/api/chat", &chat).await;
        assert_eq!(status, 200, "round {round}: {text}");
        let starts = world.starts("chat");
        assert_eq!(starts.len(), round, "{starts:?}");
        // Killed while idle, and asked again at once: whether the scheduler saw the crash
        // yet or not, the request gets a runner that answers.
        kill(Pid::from_raw(*starts.last().expect("a start")), Signal::SIGKILL).expect("kill the runner");
    }
    let (status, text) = request(&world, "/api/chat", &chat).await;
    assert_eq!(status, 200, "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runner_silent_mid_stream_ends_the_request_with_an_error_and_is_stopped() {
    let mut world = World::new(&json!({ "silent_after_tokens": 2, "first_start_only": true }), 3);
    world.state.upstream = Pool::new(Duration::from_secs(1));
    let body =
        json!({ "model": "chat", "messages": [{ "role": "user", "content": "hi" }], "options": { "num_predict": 8 } });
    let (status, text) = request(&world, "/api/chat", &body).await;
    assert_eq!(status, 200, "{text}");
    let lines: Vec<Value> = text.lines().map(|l| serde_json::from_str(l).expect("NDJSON")).collect();
    assert_eq!(lines.len(), 3, "two tokens, then the error: {text}");
    assert_eq!(lines[0]["message"]["content"], " t0");
    let error = lines[2]["error"].as_str().unwrap_or_else(|| panic!("an error line last: {text}"));
    assert!(error.contains("the runner sent nothing for 1 s in the middle of its answer"), "{error}");
    // The silent runner is stopped and reaped; the next request loads a fresh one.
    let first = world.starts("chat")[0];
    until("the silent runner is stopped", async || !alive(first)).await;
    let (status, text) = request(&world, "/api/chat", &body).await;
    assert_eq!(status, 200, "{text}");
    assert!(text.lines().last().is_some_and(|l| l.contains("\"done\":true")), "{text}");
    assert_eq!(world.starts("chat").len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runner_silent_mid_stream_ends_v1_streams_with_their_apis_error_event_and_waiting_answers_with_500() {
    let mut world = World::new(&json!({ "silent_after_tokens": 1 }), 3);
    world.state.upstream = Pool::new(Duration::from_secs(1));
    let body = json!({ "model": "chat", "messages": [{ "role": "user", "content": "hi" }], "stream": true });
    let (status, text) = request(&world, "/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{text}");
    let events: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
    assert_eq!(events.len(), 2, "one token, then the error: {text}");
    let error: Value = serde_json::from_str(events[1]).expect("a JSON event");
    let message = error["error"]["message"].as_str().unwrap_or_else(|| panic!("an error event: {text}"));
    assert!(message.contains("sent nothing for 1 s"), "{message}");
    assert_eq!(error["error"]["type"], "server_error");

    // Anthropic's and the Responses API's streams end with their own `error` event.
    let user = json!([{ "role": "user", "content": "hi" }]);
    for (path, body, pointer) in [
        ("/v1/messages", json!({ "model": "chat", "messages": user, "stream": true }), "/error/message"),
        ("/v1/responses", json!({ "model": "chat", "input": "hi", "stream": true }), "/message"),
    ] {
        let (status, text) = request(&world, path, &body).await;
        assert_eq!(status, 200, "{path}: {text}");
        let last = text.trim_end().rsplit("\n\n").next().unwrap_or_default();
        let data =
            last.strip_prefix("event: error\ndata: ").unwrap_or_else(|| panic!("{path}: an error event last: {text}"));
        let error: Value = serde_json::from_str(data).expect("a JSON event");
        assert_eq!(error["type"], "error", "{path}: {error}");
        let message = error.pointer(pointer).and_then(Value::as_str).unwrap_or_else(|| panic!("{path}: {error}"));
        assert!(message.contains("sent nothing for 1 s"), "{path}: {message}");
    }

    // A non-streaming Ollama answer had not begun: a 500 naming the stall.
    let body = json!({ "model": "chat", "prompt": "hi", "stream": false });
    let (status, text) = request(&world, "/api/generate", &body).await;
    assert_eq!(status, 500, "{text}");
    assert!(text.contains("sent nothing for 1 s"), "{text}");
}

/// corrald with two models loaded, then a reload that lowers `max_loaded_models` to 1:
/// the idle one beyond the limit goes at once, not when its 5-minute keep-alive ends.
#[test]
fn a_reload_that_lowers_max_loaded_models_unloads_idle_models_at_once() {
    use crate::support::corrald::{Corrald, write_config};
    use crate::support::http;
    use crate::support::notify::NotifyListener;

    let dir = tempfile::tempdir().expect("tempdir");
    demo_store(dir.path());
    let socket = dir.path().join("corral.sock");
    let config = |max_loaded: u32| {
        format!(
            "[server]\nlisten = [\"{}\"]\n[store]\npath = \"{}\"\n[runner]\nllama_server = \"{}\"\n[scheduler]\nmax_loaded_models = {max_loaded}\n[dbus]\nbus = \"off\"\n",
            socket.display(),
            dir.path().join("models").display(),
            env!("CARGO_BIN_EXE_fake-llama-server"),
        )
    };
    let path = write_config(dir.path(), "corral.toml", &config(2));
    let notify = NotifyListener::start();
    let corrald = Corrald::start(&["--config", path.to_str().expect("utf-8")], Some(notify.path()));
    notify.wait_for("READY", "1", DEADLINE);
    let load = http::unix(&socket, "POST", "/api/generate", Some(r#"{"model":"chat"}"#));
    assert_eq!(load.status, 200, "{}", load.body);
    let load = http::unix(&socket, "POST", "/api/embed", Some(r#"{"model":"embed","input":[]}"#));
    assert_eq!(load.status, 200, "{}", load.body);
    let loaded = || -> Vec<String> {
        let ps = http::unix(&socket, "GET", "/api/ps", None).json();
        ps["models"].as_array().expect("models").iter().map(|m| m["name"].as_str().expect("name").to_owned()).collect()
    };
    assert_eq!(loaded().len(), 2, "{:?}", loaded());

    write_config(dir.path(), "corral.toml", &config(1));
    corrald.signal(Signal::SIGHUP);
    corrald.wait_stderr("configuration reloaded", DEADLINE);
    let deadline = std::time::Instant::now() + DEADLINE;
    while loaded().len() > 1 {
        assert!(std::time::Instant::now() < deadline, "still {:?}:\n{}", loaded(), corrald.stderr());
        std::thread::sleep(Duration::from_millis(50));
    }
    // The least recently used one went, with the reason.
    assert_eq!(loaded(), ["embed:latest"]);
    assert!(corrald.stderr().contains("unloaded chat:latest (evicted)"), "{}", corrald.stderr());
}
