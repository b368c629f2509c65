//! A stand-in for llama.cpp's `llama-server`, for the supervisor's integration tests.
//!
//! Only for what the real server cannot be made to do on demand: hang while loading,
//! load slowly while printing progress, exit or die at a chosen moment, run out of memory
//! (the model's context, or the projector only while it is offloaded), ignore SIGTERM,
//! leave a grandchild behind, stream slowly or in large tokens. Everything else is tested
//! against the real `llama-server`.
//!
//! # Command line
//!
//! It accepts the command line corrald builds. Only `-m`, `--host`, `--mmproj` and
//! `--no-mmproj-offload` mean something here; any other flag is skipped, with the next
//! argument when that does not start with `-`.
//!
//! # Behaviour
//!
//! The supervisor clears the environment, so the behaviour comes from the model file:
//! the file `-m` names holds a JSON [`Behaviour`], for example
//! `{"load_ms": 3000, "progress_every_ms": 100}`. Missing keys take their defaults (a
//! load that succeeds at once); unknown keys are an error, so a typo in a test fails loudly.
//! A GGUF file (a model in corral's store) takes its behaviour from `<model>.fake.json`
//! beside it, or the defaults when there is none.
//!
//! # What the tests can observe
//!
//! * On every start, once the socket is bound (or failed to bind), one JSON line is
//!   appended to `<model>.starts`: `{"pid": 123, "grandchild": 124, "bound": true,
//!   "args": ["-m", …]}` (`grandchild` is `null` without one).
//! * stderr: llama.cpp-formatted lines (`0.00.001.142 I srv  load_model: …`), ending
//!   with `I srv  llama_server: listening on unix://<socket>` once loaded.
//! * HTTP on the UNIX socket `--host`, bound before the load as the real server does:
//!   `GET /health` answers 503 `{"error":{"code":503,"message":"Loading model",…}}`
//!   while loading and 200 `{"status":"ok"}` after; `POST /completion`
//!   (`{"n_predict": N, "stream": bool}`, N defaults to 16, negative is unlimited)
//!   produces one token every `stream_delay_ms`, as server-sent events `data: {…}` when
//!   streaming; `POST /v1/chat/completions` the same in OpenAI's chunks (`max_tokens`),
//!   ending with `data: [DONE]`; `POST /v1/embeddings` a vector `[i, 1]` per input.
//!
//! SIGTERM makes it print llama-server's `cleaning up before exit...` and exit 0, unless
//! `ignore_sigterm` is set.

use std::convert::Infallible;
use std::ffi::OsString;
use std::fmt::Write as _;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, LazyLock};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::Json;
use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use hyper::body::Frame;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde::Deserialize;
use serde_json::json;
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::mpsc;

/// What this run does; read from the model file. Every key is optional.
#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[allow(clippy::struct_excessive_bools, reason = "independent switches of a test double")]
struct Behaviour {
    /// How long the load takes, in milliseconds.
    load_ms: u64,
    /// Print a progress line this often while loading.
    progress_every_ms: Option<u64>,
    /// Go silent after the first lines and never finish loading.
    hang: bool,
    /// Exit this long after the start (while loading when shorter than `load_ms`).
    exit_after_ms: Option<u64>,
    /// Exit this long after the first `/health` that answered 200 (leave the client time
    /// to read the answer: 100 ms or more).
    exit_after_healthy_ms: Option<u64>,
    /// The exit code for the two above.
    exit_code: i32,
    /// Die by this signal instead of exiting (9: as the kernel's OOM killer does).
    exit_signal: Option<i32>,
    /// Error lines (the message, without timestamp and level) printed before exiting.
    errors: Vec<String>,
    /// At the end of the load, print llama.cpp's out-of-memory lines and exit 1.
    oom: bool,
    /// The same with the projector's lines, only when `--mmproj` is given without
    /// `--no-mmproj-offload`.
    oom_on_projector_offload: bool,
    /// Keep running on SIGTERM.
    ignore_sigterm: bool,
    /// Before loading, start `sleep 1000` (ignoring SIGTERM) in this process group.
    grandchild: bool,
    /// The time per token of `/completion`.
    stream_delay_ms: u64,
    /// Streamed tokens are this many bytes of text at least (padded with `x`): a stream
    /// that fills a client's socket buffers in a moment.
    token_bytes: usize,
    /// Die (as `exit_code`/`exit_signal` say) on the first generation request, before
    /// answering it: a runner that crashed just before a request reached it.
    crash_on_request: bool,
    /// Streamed answers send this many tokens, then nothing more, the connection open.
    silent_after_tokens: Option<u64>,
    /// The two switches above apply to the first start only (a replacement behaves).
    first_start_only: bool,
}

impl Default for Behaviour {
    fn default() -> Self {
        Self {
            load_ms: 0,
            progress_every_ms: None,
            hang: false,
            exit_after_ms: None,
            exit_after_healthy_ms: None,
            exit_code: 1,
            exit_signal: None,
            errors: Vec::new(),
            oom: false,
            oom_on_projector_offload: false,
            ignore_sigterm: false,
            grandchild: false,
            stream_delay_ms: 0,
            token_bytes: 0,
            crash_on_request: false,
            silent_after_tokens: None,
            first_start_only: false,
        }
    }
}

/// The flags that mean something here.
#[derive(Debug, Default)]
struct Args {
    model: Option<PathBuf>,
    host: Option<PathBuf>,
    mmproj: Option<PathBuf>,
    mmproj_offload: bool,
}

impl Args {
    fn parse(args: &[OsString]) -> Self {
        let mut parsed = Self { mmproj_offload: true, ..Self::default() };
        let mut i = 0;
        while i < args.len() {
            let value = args.get(i + 1).map(PathBuf::from);
            match args[i].to_str() {
                Some("-m" | "--model") => parsed.model = value,
                Some("--host") => parsed.host = value,
                Some("--mmproj") => parsed.mmproj = value,
                Some("--no-mmproj-offload") => {
                    parsed.mmproj_offload = false;
                    i += 1;
                    continue;
                }
                _ => {
                    // An unknown flag, and its value if it has one.
                    let has_value = args.get(i + 1).is_some_and(|a| !a.to_string_lossy().starts_with('-'));
                    i += if has_value { 2 } else { 1 };
                    continue;
                }
            }
            i += 2;
        }
        parsed
    }
}

static START: LazyLock<Instant> = LazyLock::new(Instant::now);

/// Prints one line in llama.cpp's format: `M.SS.mmm.uuu L message`.
fn log(level: char, message: &str) {
    let us = START.elapsed().as_micros();
    let (min, sec, ms, us) = (us / 60_000_000, us / 1_000_000 % 60, us / 1000 % 1000, us % 1000);
    let mut stderr = std::io::stderr().lock();
    let _ = writeln!(stderr, "{min}.{sec:02}.{ms:03}.{us:03} {level} {message}");
}

/// Prints the behaviour's error lines, then exits (or dies by its signal).
fn die(behaviour: &Behaviour) -> ! {
    for error in &behaviour.errors {
        log('E', error);
    }
    if let Some(signal) = behaviour.exit_signal.and_then(|s| Signal::try_from(s).ok()) {
        let _ = kill(Pid::this(), signal);
    }
    std::process::exit(behaviour.exit_code)
}

/// Prints the lines of a failed load and exits 1, as llama-server does.
fn fail_load(lines: &[String]) -> ! {
    for line in lines {
        log('E', line);
    }
    log('I', "srv    operator(): operator(): cleaning up before exit...");
    log('E', "srv  llama_server: exiting due to model loading error");
    std::process::exit(1)
}

struct Shared {
    behaviour: Behaviour,
    loaded: AtomicBool,
    healthy_once: AtomicBool,
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    LazyLock::force(&START);
    // Registered first: from now on SIGTERM is handled here, not by the default action.
    let mut sigterm = signal(SignalKind::terminate()).expect("SIGTERM handler");
    let command_line: Vec<OsString> = std::env::args_os().skip(1).collect();
    let args = Args::parse(&command_line);
    let Some(model) = args.model.clone() else {
        log('E', "srv  llama_server: fake-llama-server: no -m given");
        std::process::exit(1);
    };
    let behaviour = read_behaviour(&model);
    let grandchild = match &behaviour {
        Ok(b) if b.grandchild => Some(spawn_grandchild()),
        _ => None,
    };
    let socket = args.host.clone().unwrap_or_else(|| PathBuf::from("fake-llama-server.sock"));
    let listener = tokio::net::UnixListener::bind(&socket);
    let start = record_start(&model, grandchild, listener.is_ok(), &command_line);

    log('I', "srv  llama_server: initializing ...");
    log('I', "srv         start: setting address family to AF_UNIX");
    let listener = listener.unwrap_or_else(|e| {
        log('E', &format!("srv          init: couldn't bind HTTP server socket, hostname: {}: {e}", socket.display()));
        std::process::exit(1)
    });
    log('I', &format!("srv    load_model: loading model '{}'", model.display()));
    let behaviour = behaviour.unwrap_or_else(|e| {
        fail_load(&[format!("llama_model_load: error loading model: fake-llama-server: bad behaviour file: {e}")])
    });

    let mut behaviour = behaviour;
    if behaviour.first_start_only && start > 1 {
        behaviour.crash_on_request = false;
        behaviour.silent_after_tokens = None;
    }
    let shared = Arc::new(Shared { behaviour, loaded: AtomicBool::new(false), healthy_once: AtomicBool::new(false) });
    let router = Router::new()
        .route("/health", get(health))
        .route("/completion", post(completion))
        .route("/v1/chat/completions", post(chat_completions))
        // Anthropic's messages and OpenAI's responses pass through as chat does; the
        // fake answers them in chat's shape, which is all a pass-through's faults need.
        .route("/v1/messages", post(chat_completions))
        .route("/v1/responses", post(chat_completions))
        // Enough of OpenAI's completions for a pass-through: llama-server's own answer.
        .route("/v1/completions", post(completion))
        .route("/v1/embeddings", post(embeddings))
        .with_state(Arc::clone(&shared));
    tokio::spawn(async move { axum::serve(listener, router).await });
    let ignore_sigterm = shared.behaviour.ignore_sigterm;
    tokio::spawn(async move {
        while sigterm.recv().await.is_some() {
            if ignore_sigterm {
                log('W', "srv  llama_server: fake-llama-server: ignoring SIGTERM");
            } else {
                log('I', "srv    operator(): operator(): cleaning up before exit...");
                std::process::exit(0);
            }
        }
    });
    if let Some(ms) = shared.behaviour.exit_after_ms {
        let shared = Arc::clone(&shared);
        tokio::spawn(async move {
            tokio::time::sleep_until((*START + Duration::from_millis(ms)).into()).await;
            die(&shared.behaviour);
        });
    }

    load(&shared.behaviour, &model, &args).await;
    shared.loaded.store(true, Ordering::SeqCst);
    log('I', "srv  llama_server: model loaded");
    log('I', &format!("srv  llama_server: listening on unix://{}", socket.display()));
    // The task loop starts right after, as in llama-server.
    log('I', "srv  update_slots: all slots are idle");
    std::future::pending::<()>().await;
}

/// The load: delay, progress lines, hang or out-of-memory failures, then the buffer lines.
async fn load(behaviour: &Behaviour, model: &Path, args: &Args) {
    if behaviour.hang {
        std::future::pending::<()>().await;
    }
    log('I', "load_tensors: loading model tensors, this can take a while... (load_mode = mmap)");
    let done = *START + Duration::from_millis(behaviour.load_ms);
    while Instant::now() < done {
        let next =
            behaviour.progress_every_ms.map_or(done, |ms| (Instant::now() + Duration::from_millis(ms)).min(done));
        tokio::time::sleep_until(next.into()).await;
        if behaviour.progress_every_ms.is_some() {
            log('I', &format!("load_tensors: fake-llama-server: loading, {} ms", START.elapsed().as_millis()));
        }
    }
    log('I', "load_tensors: offloaded 0/5 layers to GPU");
    log('I', "load_tensors:   CPU_Mapped model buffer size =     0.43 MiB");
    log('I', "llama_kv_cache:        CPU KV buffer size =     1.00 MiB");
    if behaviour.oom {
        let model = model.display();
        fail_load(&[
            "llama_init_from_model: failed to initialize the context: std::bad_alloc".to_owned(),
            format!("cmn  common_init_: failed to create context with model '{model}'"),
            format!("srv    load_model: failed to create_context with model '{model}'"),
        ]);
    }
    if let Some(mmproj) = &args.mmproj {
        let mmproj = mmproj.display();
        log('I', &format!("srv    load_model: loading multimodal model '{mmproj}'"));
        if behaviour.oom_on_projector_offload && args.mmproj_offload {
            fail_load(&[
                "ggml_backend_cuda_buffer_type_alloc_buffer: allocating 1024.00 MiB on device 0: cudaMalloc failed: out of memory".to_owned(),
                "clip_encode: failed to allocate compute graph".to_owned(),
                "mtmd_init_from_file: error: std::bad_alloc".to_owned(),
                format!("srv    load_model: failed to load multimodal model, '{mmproj}'"),
            ]);
        }
    }
}

/// `sleep 1000` in this process group, ignoring SIGTERM (the disposition survives exec);
/// it keeps stderr, as a real helper process would.
fn spawn_grandchild() -> u32 {
    std::process::Command::new("sh")
        .args(["-c", "trap '' TERM; exec sleep 1000"])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("spawn the grandchild")
        .id()
}

/// The behaviour for `model`: its JSON, or for a GGUF file the JSON beside it.
fn read_behaviour(model: &Path) -> Result<Behaviour, String> {
    let bytes = std::fs::read(model).map_err(|e| e.to_string())?;
    let bytes = if bytes.starts_with(b"GGUF") {
        let mut beside = model.as_os_str().to_owned();
        beside.push(".fake.json");
        match std::fs::read(PathBuf::from(beside)) {
            Ok(bytes) => bytes,
            Err(_) => return Ok(Behaviour::default()),
        }
    } else {
        bytes
    };
    serde_json::from_slice::<Behaviour>(&bytes).map_err(|e| e.to_string())
}

/// Appends this start to `<model>.starts`; returns its number (1 for the first).
fn record_start(model: &Path, grandchild: Option<u32>, bound: bool, command_line: &[OsString]) -> usize {
    let args: Vec<String> = command_line.iter().map(|a| a.to_string_lossy().into_owned()).collect();
    let line = json!({ "pid": std::process::id(), "grandchild": grandchild, "bound": bound, "args": args });
    let mut path = model.as_os_str().to_owned();
    path.push(".starts");
    let mut file = std::fs::OpenOptions::new().create(true).append(true).open(path).expect("open the starts file");
    file.write_all(format!("{line}\n").as_bytes()).expect("write the starts file");
    drop(file);
    let mut path = model.as_os_str().to_owned();
    path.push(".starts");
    std::fs::read_to_string(path).map_or(1, |text| text.lines().count())
}

async fn health(State(shared): State<Arc<Shared>>) -> Response {
    if !shared.loaded.load(Ordering::SeqCst) {
        return loading();
    }
    let first = !shared.healthy_once.swap(true, Ordering::SeqCst);
    if let (Some(ms), true) = (shared.behaviour.exit_after_healthy_ms, first) {
        let shared = Arc::clone(&shared);
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(ms)).await;
            die(&shared.behaviour);
        });
    }
    Json(json!({ "status": "ok" })).into_response()
}

fn loading() -> Response {
    let body = json!({ "error": { "code": 503, "message": "Loading model", "type": "unavailable_error" } });
    (StatusCode::SERVICE_UNAVAILABLE, Json(body)).into_response()
}

#[derive(Deserialize)]
struct CompletionRequest {
    #[serde(default = "default_n_predict")]
    n_predict: i64,
    #[serde(default)]
    stream: bool,
}

fn default_n_predict() -> i64 {
    16
}

/// What every generating endpoint does first, as llama-server: 503 while loading, the
/// body read as JSON whatever its content type (400 if it is not), then the configured
/// crash.
fn accept<T: serde::de::DeserializeOwned>(shared: &Shared, body: &[u8]) -> Result<T, Box<Response>> {
    if !shared.loaded.load(Ordering::SeqCst) {
        return Err(Box::new(loading()));
    }
    let request = serde_json::from_slice(body).map_err(|e| {
        let body = json!({ "error": { "code": 400, "message": e.to_string(), "type": "invalid_request_error" } });
        Box::new((StatusCode::BAD_REQUEST, Json(body)).into_response())
    })?;
    if shared.behaviour.crash_on_request {
        die(&shared.behaviour);
    }
    Ok(request)
}

/// `POST /completion`; like llama-server, it reads the body as JSON whatever its content type.
async fn completion(State(shared): State<Arc<Shared>>, body: Bytes) -> Response {
    let request: CompletionRequest = match accept(&shared, &body) {
        Ok(request) => request,
        Err(refused) => return *refused,
    };
    let n = u64::try_from(request.n_predict).unwrap_or(u64::MAX);
    let delay = Duration::from_millis(shared.behaviour.stream_delay_ms);
    if !request.stream {
        let mut content = String::new();
        for i in 0..n {
            tokio::time::sleep(delay).await;
            let _ = write!(content, " t{i}");
        }
        return Json(json!({ "content": content, "tokens_predicted": n, "stop": true, "stop_type": "limit" }))
            .into_response();
    }
    let (silent_after, token_bytes) = (shared.behaviour.silent_after_tokens, shared.behaviour.token_bytes);
    events(
        move |i| {
            if i == n {
                let last =
                    json!({ "index": 0, "content": "", "stop": true, "tokens_predicted": n, "stop_type": "limit" });
                return Step::Last(vec![format!("data: {last}\n\n")]);
            }
            if silent_after == Some(i) {
                return Step::Silent;
            }
            let event = json!({ "index": 0, "content": token(i, token_bytes), "tokens": [i], "stop": false });
            Step::Send(format!("data: {event}\n\n"))
        },
        delay,
    )
}

#[derive(Deserialize)]
struct ChatRequest {
    #[serde(default = "default_n_predict")]
    max_tokens: i64,
    #[serde(default)]
    stream: bool,
}

/// `POST /v1/chat/completions`: the tokens of `/completion` in OpenAI's shape.
async fn chat_completions(State(shared): State<Arc<Shared>>, body: Bytes) -> Response {
    let request: ChatRequest = match accept(&shared, &body) {
        Ok(request) => request,
        Err(refused) => return *refused,
    };
    let n = u64::try_from(request.max_tokens).unwrap_or(u64::MAX);
    let delay = Duration::from_millis(shared.behaviour.stream_delay_ms);
    let usage = json!({ "prompt_tokens": 3, "completion_tokens": n, "total_tokens": n + 3 });
    if !request.stream {
        let mut content = String::new();
        for i in 0..n {
            tokio::time::sleep(delay).await;
            let _ = write!(content, " t{i}");
        }
        let choice =
            json!({ "index": 0, "message": { "role": "assistant", "content": content }, "finish_reason": "length" });
        return Json(json!({ "object": "chat.completion", "choices": [choice], "usage": usage })).into_response();
    }
    let (silent_after, token_bytes) = (shared.behaviour.silent_after_tokens, shared.behaviour.token_bytes);
    events(
        move |i| {
            let chunk = |delta: serde_json::Value, finish: serde_json::Value| {
                let choice = json!({ "index": 0, "delta": delta, "finish_reason": finish });
                format!("data: {}\n\n", json!({ "object": "chat.completion.chunk", "choices": [choice] }))
            };
            if i == n {
                let usage = json!({ "object": "chat.completion.chunk", "choices": [], "usage": usage.clone() });
                return Step::Last(vec![
                    chunk(json!({}), json!("length")),
                    format!("data: {usage}\n\n"),
                    "data: [DONE]\n\n".to_owned(),
                ]);
            }
            if silent_after == Some(i) {
                return Step::Silent;
            }
            Step::Send(chunk(json!({ "content": token(i, token_bytes) }), serde_json::Value::Null))
        },
        delay,
    )
}

/// The `i`-th streamed token: ` t<i>`, padded with `x` to `bytes`.
fn token(i: u64, bytes: usize) -> String {
    let mut text = format!(" t{i}");
    let padding = bytes.saturating_sub(text.len());
    text.extend(std::iter::repeat_n('x', padding));
    text
}

/// `POST /v1/embeddings`: a vector `[i, 1]` for the `i`-th input.
async fn embeddings(State(shared): State<Arc<Shared>>, body: Bytes) -> Response {
    if !shared.loaded.load(Ordering::SeqCst) {
        return loading();
    }
    if shared.behaviour.crash_on_request {
        die(&shared.behaviour);
    }
    let request: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    let inputs = match &request["input"] {
        serde_json::Value::Array(items) => items.len(),
        _ => 1,
    };
    let data: Vec<serde_json::Value> =
        (0..inputs).map(|i| json!({ "index": i, "object": "embedding", "embedding": [i, 1] })).collect();
    Json(json!({ "object": "list", "data": data, "usage": { "prompt_tokens": inputs, "total_tokens": inputs } }))
        .into_response()
}

/// What a stream sends at its `i`-th step.
enum Step {
    Send(String),
    Last(Vec<String>),
    /// Nothing more, the connection held open.
    Silent,
}

/// A server-sent event stream: `step(0)`, `step(1)`, … one every `delay`.
fn events(step: impl Fn(u64) -> Step + Send + 'static, delay: Duration) -> Response {
    let (tx, rx) = mpsc::channel(1);
    tokio::spawn(async move {
        for i in 0.. {
            tokio::time::sleep(delay).await;
            match step(i) {
                Step::Send(event) => {
                    if tx.send(Bytes::from(event)).await.is_err() {
                        return; // the client went away
                    }
                }
                Step::Last(events) => {
                    for event in events {
                        let _ = tx.send(Bytes::from(event)).await;
                    }
                    return;
                }
                Step::Silent => {
                    // Holds the stream open until the client goes away.
                    tx.closed().await;
                    return;
                }
            }
        }
    });
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .body(Body::new(Events(rx)))
        .expect("a response with a literal header is valid")
}

/// A response body fed by a channel: one frame per server-sent event.
struct Events(mpsc::Receiver<Bytes>);

impl hyper::body::Body for Events {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.get_mut().0.poll_recv(cx).map(|event| event.map(|bytes| Ok(Frame::data(bytes))))
    }
}
