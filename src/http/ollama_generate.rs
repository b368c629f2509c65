//! Ollama's generation endpoints: `POST /api/chat` and `POST /api/generate`.
//!
//! Both go to the leased runner's `/v1/chat/completions` (the model's own chat template
//! applies), except a `raw` generate, which sends the prompt as is to `/completion`.
//! The runner always streams; a streaming client gets Ollama's NDJSON as the tokens
//! arrive, a non-streaming one a single object once the runner is done. The lease is
//! held by the response body: a client that goes away drops it, which closes the
//! connection to the runner (cancelling the generation) and releases the runner.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use axum::Json;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value, json};

use super::error::{self, ApiError, bad, internal};
use super::json_body::json_object;
use super::model_request;
use super::ollama_embed::nanos;
use super::ollama_translate::{self as translate, ToolCalls};
use super::runner_call;
use super::state::{AppState, Tokens};
use super::stream_scan::EventScanner;
use crate::scheduler::handle::{Handle, Lease};
use crate::scheduler::keep_alive::KeepAlive;
use crate::scheduler::request;
use crate::scheduler::types::{ModelRequest, ScheduleError};
use crate::store::name::ModelName;
use crate::supervisor::upstream::BodyStream;

/// How long a runner may take to start answering a generation.
const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(600);
/// Where a streamed answer's error line is logged from when it had paths removed.
const PATH_STREAM: &str = "/api/chat and /api/generate (stream)";

/// A constrained answer is completed from the prompt `/apply-template` renders, which
/// has no place for images.
const FORMAT_WITH_IMAGES: &str = "format cannot be combined with images: send one or the other";

/// Which endpoint's shape the replies take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Chat,
    Generate,
}

/// `POST /api/chat`.
pub async fn chat(State(state): State<AppState>, body: Bytes) -> Result<Response, ApiError> {
    const PATH: &str = "/api/chat";
    let started = Instant::now();
    let request = json_object(PATH, &body)?;
    let (messages, images) = match request.get("messages") {
        None | Some(Value::Null) => (Vec::new(), false),
        Some(Value::Array(items)) => translate::messages(items, PATH)?,
        Some(_) => return Err(bad("messages must be a list of {role, content} objects", PATH)),
    };
    let schema = translate::format(&request, PATH)?;
    let mut fields = translate::think(&request, PATH)?;
    if let Some(tools) = translate::tools(&request, PATH)? {
        fields.insert("tools".into(), tools);
    }
    if images && schema.is_some() {
        return Err(bad(FORMAT_WITH_IMAGES, PATH));
    }
    let common = Common::parse(&request, PATH)?;
    let prepared = prepare(&state, &common, images, PATH).await?;
    if messages.is_empty() {
        return load_or_unload(&state, prepared.request, &common, Kind::Chat, started, PATH).await;
    }
    let mut messages = messages;
    if let Some(system) = prepared.system.filter(|_| !messages.iter().any(|m| m["role"] == "system")) {
        messages.insert(0, json!({ "role": "system", "content": system }));
    }
    let (route, body) = chat_route(&prepared.options, fields, messages, schema, PATH)?;
    run(&state, prepared.request, route, body, common.reply(Kind::Chat), started, PATH).await
}

/// `POST /api/generate`.
pub async fn generate(State(state): State<AppState>, body: Bytes) -> Result<Response, ApiError> {
    const PATH: &str = "/api/generate";
    let started = Instant::now();
    let request = json_object(PATH, &body)?;
    let prompt = string(&request, "prompt", PATH)?.unwrap_or_default();
    let system = string(&request, "system", PATH)?;
    let template = string(&request, "template", PATH)?.filter(|t| !t.is_empty());
    let suffix = string(&request, "suffix", PATH)?.filter(|s| !s.is_empty());
    let raw = model_request::boolean(&request, "raw", false, PATH)?;
    let legacy_context = matches!(request.get("context"), Some(Value::Array(tokens)) if !tokens.is_empty());
    if raw && (template.is_some() || system.as_deref().is_some_and(|s| !s.is_empty()) || legacy_context) {
        // Ollama's refusal, word for word: a raw prompt is sent as it is.
        return Err(bad("raw mode does not support template, system, or context", PATH));
    }
    let images = translate::images(request.get("images"), PATH)?;
    // A raw or templated prompt goes to /completion as it is.
    let direct = raw || template.is_some();
    if direct && !images.is_empty() {
        return Err(bad("images are not supported with raw or template; send them without either", PATH));
    }
    if suffix.is_some() && !images.is_empty() {
        return Err(bad("images cannot be combined with a suffix: send one or the other", PATH));
    }
    let schema = translate::format(&request, PATH)?;
    if !images.is_empty() && schema.is_some() {
        return Err(bad(FORMAT_WITH_IMAGES, PATH));
    }
    let fields = translate::think(&request, PATH)?;
    // Checked before anything loads, even when the prompt is empty.
    if let Some(template) = &template {
        translate::render_template(&state.templates, template, "", "", "", PATH).await?;
    }
    let common = Common::parse(&request, PATH)?;
    let prepared = prepare(&state, &common, !images.is_empty(), PATH).await?;
    if prompt.is_empty() {
        return load_or_unload(&state, prepared.request, &common, Kind::Generate, started, PATH).await;
    }
    // With a suffix, as in Ollama, the prompt and the suffix are all a template gets.
    let system = system.or(prepared.system).filter(|s| !s.is_empty() && suffix.is_none());
    if direct || suffix.is_some() {
        let mut body = sampling(&prepared.options, "n_predict", PATH)?;
        if let Some(schema) = schema {
            body.insert("json_schema".into(), schema);
        }
        body.insert("stream".into(), Value::Bool(true));
        let route = match (&template, suffix) {
            // A raw prompt is sent as it is, a suffix or not (as Ollama does).
            _ if raw => {
                body.insert("prompt".into(), Value::String(prompt));
                Route::Completion
            }
            (Some(template), suffix) => {
                let system = system.unwrap_or_default();
                let suffix = suffix.unwrap_or_default();
                let rendered =
                    translate::render_template(&state.templates, template, &system, &prompt, &suffix, PATH).await?;
                body.insert("prompt".into(), Value::String(rendered));
                Route::Completion
            }
            (None, suffix) => {
                body.insert("input_prefix".into(), Value::String(prompt));
                body.insert("input_suffix".into(), Value::String(suffix.unwrap_or_default()));
                Route::Infill
            }
        };
        return run(&state, prepared.request, route, body, common.reply(Kind::Generate), started, PATH).await;
    }
    let mut messages = Vec::new();
    if let Some(system) = system {
        messages.push(json!({ "role": "system", "content": system }));
    }
    let content = if images.is_empty() { Value::String(prompt) } else { translate::content_parts(&prompt, &images) };
    messages.push(json!({ "role": "user", "content": content }));
    let (route, body) = chat_route(&prepared.options, fields, messages, schema, PATH)?;
    run(&state, prepared.request, route, body, common.reply(Kind::Generate), started, PATH).await
}

/// Where a chat goes and with what: `/v1/chat/completions`, or, with a JSON schema to
/// follow, the model's template rendered by `/apply-template` and then `/completion`
/// (see [`translate::format`] for why).
pub(super) fn chat_route(
    options: &Map<String, Value>,
    fields: Map<String, Value>,
    messages: Vec<Value>,
    schema: Option<Value>,
    path: &str,
) -> Result<(Route, Map<String, Value>), ApiError> {
    if let Some(schema) = schema {
        let mut render = fields;
        render.insert("messages".into(), Value::Array(messages));
        let mut body = sampling(options, "n_predict", path)?;
        body.insert("json_schema".into(), schema);
        body.insert("stream".into(), Value::Bool(true));
        return Ok((Route::Rendered(Value::Object(render)), body));
    }
    let mut body = sampling(options, "max_tokens", path)?;
    body.extend(fields);
    body.insert("messages".into(), Value::Array(messages));
    body.insert("stream".into(), Value::Bool(true));
    body.insert("stream_options".into(), json!({ "include_usage": true }));
    Ok((Route::Chat, body))
}

/// The runner endpoint a generation goes to.
#[derive(Debug)]
pub(super) enum Route {
    /// `/v1/chat/completions`: the model's chat template applies.
    Chat,
    /// `/completion` with the prompt as it is.
    Completion,
    /// `/infill`: the prompt and the suffix around the model's own fill-in-the-middle
    /// tokens (a `suffix` on `/api/generate`).
    Infill,
    /// `/completion` with the prompt `/apply-template` renders from this request body.
    Rendered(Value),
}

/// The fields both endpoints share.
pub(super) struct Common {
    name_text: String,
    name: ModelName,
    pub(super) options: Map<String, Value>,
    keep_alive: Option<KeepAlive>,
    stream: bool,
    /// With `logprobs`, how many of the likeliest tokens each token's entry lists.
    logprobs: Option<usize>,
}

/// The most `top_logprobs` a request may ask for, as Ollama (and OpenAI) take.
const MAX_TOP_LOGPROBS: u64 = 20;

impl Common {
    pub(super) fn parse(request: &Map<String, Value>, path: &str) -> Result<Self, ApiError> {
        let (name_text, name) = model_request::model_name(request, true, path)?;
        let (options, keep_alive) = model_request::options_and_keep_alive(request, path)?;
        let stream = model_request::boolean(request, "stream", true, path)?;
        let logprobs = model_request::boolean(request, "logprobs", false, path)?;
        // Checked whether or not logprobs are asked for, as Ollama does.
        let top = match request.get("top_logprobs") {
            None | Some(Value::Null) => 0,
            Some(value) => match value.as_u64().filter(|n| *n <= MAX_TOP_LOGPROBS) {
                Some(n) => usize::try_from(n).unwrap_or(0),
                None => return Err(bad(format!("top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}"), path)),
            },
        };
        Ok(Self { name_text, name, options, keep_alive, stream, logprobs: logprobs.then_some(top) })
    }

    /// How the answer is to be given.
    fn reply(&self, kind: Kind) -> Reply {
        Reply { kind, stream: self.stream, logprobs: self.logprobs }
    }
}

/// How a generation's answer is given: its endpoint's shape, streamed or whole, with
/// each token's log probability or not.
#[derive(Debug, Clone, Copy)]
struct Reply {
    kind: Kind,
    stream: bool,
    logprobs: Option<usize>,
}

/// The scheduler's request, the model's parameters under the client's options, and the
/// model's default system prompt.
struct Prepared {
    request: ModelRequest,
    options: Map<String, Value>,
    system: Option<String>,
}

async fn prepare(state: &AppState, common: &Common, images: bool, path: &str) -> Result<Prepared, ApiError> {
    let details = model_request::details(state, &common.name, &common.name_text, path).await?;
    let options = &common.options;
    let load = model_request::load_options(options, &common.name_text, path)?;
    let request = request::from_details(&state.store, &details, &load, common.keep_alive, false, state.defaults)
        .map_err(|e| error::request(e, &common.name_text, path))?;
    let mut merged: Map<String, Value> = details.parameters.clone().into_iter().collect();
    merged.extend(options.clone());
    let prepared = Prepared { request, options: merged, system: details.system.clone() };
    if prepared.request.options.embedding.is_some() {
        return Err(bad(format!("\"{}\" does not support generate", common.name_text), path));
    }
    // Without a projector the runner cannot see images: refused before anything loads.
    if images && prepared.request.files.projector.is_none() {
        return Err(bad(format!("model {} does not support images", common.name_text), path));
    }
    Ok(prepared)
}

/// An empty prompt: load the model (or, with `keep_alive: 0`, unload it) and say so.
async fn load_or_unload(
    state: &AppState,
    request: ModelRequest,
    common: &Common,
    kind: Kind,
    started: Instant,
    path: &str,
) -> Result<Response, ApiError> {
    let model = request.name.clone();
    let (reason, load) = if common.keep_alive.is_some_and(KeepAlive::is_zero) {
        match state.scheduler.unload(&request.key).await {
            Ok(()) | Err(ScheduleError::NotLoaded(_)) => {}
            Err(e) => return Err(error::schedule(&e, path)),
        }
        ("unload", Duration::ZERO)
    } else {
        let waited = Instant::now();
        let lease = state.scheduler.acquire(request).await.map_err(|e| error::schedule(&e, path))?;
        drop(lease);
        ("load", waited.elapsed())
    };
    let mut reply = chunk(kind, &model, &Delta::default());
    reply.insert("done".into(), Value::Bool(true));
    reply.insert("done_reason".into(), Value::String(reason.into()));
    reply.insert("total_duration".into(), json!(nanos(started.elapsed())));
    reply.insert("load_duration".into(), json!(nanos(load)));
    Ok(Json(Value::Object(reply)).into_response())
}

/// Leases a runner, sends `body` to its `upstream_path`, and answers in Ollama's shape.
async fn run(
    state: &AppState,
    request: ModelRequest,
    route: Route,
    mut body: Map<String, Value>,
    reply: Reply,
    started: Instant,
    path: &str,
) -> Result<Response, ApiError> {
    let model = request.name.clone();
    let infill = matches!(route, Route::Infill);
    if let Some(top) = reply.logprobs {
        // llama-server gives a token's log probability only with at least one alternative
        // (the parser leaves out what was not asked for).
        if matches!(route, Route::Chat) {
            body.insert("logprobs".into(), Value::Bool(true));
            body.insert("top_logprobs".into(), json!(top.max(1)));
        } else {
            body.insert("n_probs".into(), json!(top.max(1)));
        }
    }
    let (lease, status, upstream, load) = match route {
        direct @ (Route::Chat | Route::Completion | Route::Infill) => {
            let upstream_path = match direct {
                Route::Chat => "/v1/chat/completions",
                Route::Infill => "/infill",
                _ => "/completion",
            };
            let body = serde_json::to_vec(&Value::Object(body)).expect("JSON values serialize");
            let answer = runner_call::send(state, request, upstream_path, body, UPSTREAM_TIMEOUT, path).await?;
            (answer.lease, answer.status, answer.body, answer.waited)
        }
        Route::Rendered(render) => {
            // The first request is the one that finds a dead runner (and retries).
            let render = serde_json::to_vec(&render).expect("JSON values serialize");
            let answer = runner_call::send(state, request, "/apply-template", render, UPSTREAM_TIMEOUT, path).await?;
            let (lease, status, mut rendered, load) = (answer.lease, answer.status, answer.body, answer.waited);
            let mut reply = Vec::new();
            while let Some(piece) = rendered.chunk().await {
                let piece = piece.map_err(|e| runner_call::unanswered(&e, path))?;
                reply.extend_from_slice(&piece);
            }
            let reply: Value = serde_json::from_slice(&reply).unwrap_or(Value::Null);
            let Some(prompt) = reply["prompt"].as_str().filter(|_| status.is_success()) else {
                let message =
                    reply["error"]["message"].as_str().unwrap_or("the model runner could not apply its template");
                return Err(bad(message, path));
            };
            body.insert("prompt".into(), Value::String(prompt.to_owned()));
            let body = serde_json::to_vec(&Value::Object(body)).expect("JSON values serialize");
            let (status, upstream) = state
                .upstream
                .post_json_stream(lease.socket(), "/completion", body, UPSTREAM_TIMEOUT)
                .await
                .map_err(|e| runner_call::unanswered(&e, path))?;
            (lease, status, upstream, load)
        }
    };
    if !status.is_success() {
        let reply = runner_call::refusal(upstream).await;
        drop(lease);
        if infill && status == StatusCode::NOT_IMPLEMENTED {
            // llama.cpp found no fill-in-the-middle tokens in the model's vocabulary.
            let why = reply["error"]["message"].as_str().unwrap_or_default();
            return Err(bad(format!("\"{model}\" does not support insert: {why}"), path));
        }
        return Err(error::runner_refused(status, &reply, path));
    }
    let generation = Generation {
        upstream: Some(upstream),
        lease: Some(lease),
        parser: Parser::with_logprobs(reply.logprobs),
        kind: reply.kind,
        model,
        started,
        load,
        finished: false,
        tokens: Arc::clone(&state.tokens),
        scheduler: state.scheduler.clone(),
    };
    if reply.stream {
        let lines = futures_util::stream::unfold(generation, |mut generation| async move {
            let out = generation.next_lines().await?;
            Some((Ok::<Bytes, Infallible>(out), generation))
        });
        let mut response = Body::from_stream(lines).into_response();
        response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/x-ndjson"));
        Ok(response)
    } else {
        whole(generation, path).await
    }
}

/// A non-streaming reply: the whole content and the final fields in one object.
async fn whole(mut generation: Generation, path: &str) -> Result<Response, ApiError> {
    let mut whole = Delta::default();
    let mut upstream = generation.upstream.take().expect("a new generation has its upstream");
    let mut last = false;
    loop {
        let events = match upstream.chunk().await {
            Some(Ok(piece)) => generation.parser.feed(&piece),
            Some(Err(e)) => {
                drop(upstream);
                let message = runner_call::failed_mid_answer(&generation.scheduler, generation.lease.take(), &e).await;
                return Err(internal(&message, path));
            }
            None if !last => {
                last = true;
                generation.parser.flush()
            }
            None => break,
        };
        for event in events {
            match event {
                Event::Content(text) => whole.content.push_str(&text),
                Event::Thinking(text) => whole.thinking.push_str(&text),
                Event::ToolCalls(calls) => whole.tool_calls.extend(calls),
                Event::Logprobs(entries) => whole.logprobs.extend(entries),
                Event::Error(message) => return Err(internal(&message, path)),
            }
        }
    }
    drop(upstream);
    generation.lease.take();
    let reply = generation.done(&whole);
    Ok(Json(Value::Object(reply)).into_response())
}

/// A streaming generation: the runner's connection, the lease, and the parse state.
/// Dropping it (the client went away) closes the connection and releases the runner.
struct Generation {
    upstream: Option<BodyStream>,
    lease: Option<Lease>,
    parser: Parser,
    kind: Kind,
    model: String,
    started: Instant,
    load: Duration,
    finished: bool,
    tokens: Arc<Tokens>,
    /// To report a runner that fell silent.
    scheduler: Handle,
}

impl Generation {
    /// The next NDJSON lines for the client; `None` once the final one was sent.
    async fn next_lines(&mut self) -> Option<Bytes> {
        if self.finished {
            return None;
        }
        let mut out = Vec::new();
        loop {
            let upstream = self.upstream.as_mut()?;
            match upstream.chunk().await {
                Some(Ok(piece)) => {
                    let (mut deltas, mut error): (Vec<Delta>, _) = (Vec::new(), None);
                    for event in self.parser.feed(&piece) {
                        let delta = match event {
                            Event::Content(content) => Delta { content, ..Delta::default() },
                            Event::Thinking(thinking) => Delta { thinking, ..Delta::default() },
                            Event::ToolCalls(tool_calls) => Delta { tool_calls, ..Delta::default() },
                            // A token's log probability goes with its text, which came just before.
                            Event::Logprobs(logprobs) => match deltas.last_mut() {
                                Some(last) if last.logprobs.is_empty() && last.tool_calls.is_empty() => {
                                    last.logprobs = logprobs;
                                    continue;
                                }
                                _ => Delta { logprobs, ..Delta::default() },
                            },
                            // What came before the error is sent first.
                            Event::Error(message) => {
                                error = Some(message);
                                break;
                            }
                        };
                        deltas.push(delta);
                    }
                    for delta in &deltas {
                        push_line(&mut out, &Value::Object(chunk(self.kind, &self.model, delta)));
                    }
                    if let Some(message) = error {
                        self.finish();
                        push_line(&mut out, &json!({ "error": crate::redact::for_client(message, PATH_STREAM) }));
                        return Some(Bytes::from(out));
                    }
                    if !out.is_empty() {
                        return Some(Bytes::from(out));
                    }
                }
                Some(Err(e)) => {
                    self.upstream = None;
                    let message = runner_call::failed_mid_answer(&self.scheduler, self.lease.take(), &e).await;
                    self.finish();
                    push_line(&mut out, &json!({ "error": crate::redact::for_client(message, PATH_STREAM) }));
                    return Some(Bytes::from(out));
                }
                None => {
                    // Tool calls the runner never closed with a finish reason go in the last line.
                    let mut last = Delta::default();
                    for event in self.parser.flush() {
                        if let Event::ToolCalls(calls) = event {
                            last.tool_calls.extend(calls);
                        }
                    }
                    self.finish();
                    push_line(&mut out, &Value::Object(self.done(&last)));
                    return Some(Bytes::from(out));
                }
            }
        }
    }

    fn finish(&mut self) {
        self.finished = true;
        self.upstream = None;
        self.lease = None;
    }

    /// The final object, with `delta` as the message or response.
    fn done(&self, delta: &Delta) -> Map<String, Value> {
        let p = &self.parser;
        self.tokens.record(p.prompt_tokens.unwrap_or(0), p.eval_tokens.unwrap_or(0));
        if let (Some(generated), Some(ns)) = (p.eval_tokens, p.eval_ns) {
            self.tokens.record_speed(&self.model, generated, Duration::from_nanos(ns));
        }
        let mut reply = chunk(self.kind, &self.model, delta);
        reply.insert("done".into(), Value::Bool(true));
        let reason = if p.finish_reason.as_deref() == Some("length") { "length" } else { "stop" };
        reply.insert("done_reason".into(), Value::String(reason.into()));
        reply.insert("total_duration".into(), json!(nanos(self.started.elapsed())));
        reply.insert("load_duration".into(), json!(nanos(self.load)));
        reply.insert("prompt_eval_count".into(), json!(p.prompt_tokens.unwrap_or(0)));
        reply.insert("prompt_eval_duration".into(), json!(p.prompt_ns.unwrap_or(0)));
        reply.insert("eval_count".into(), json!(p.eval_tokens.unwrap_or(0)));
        reply.insert("eval_duration".into(), json!(p.eval_ns.unwrap_or(0)));
        reply
    }
}

/// What one reply line carries of the answer.
#[derive(Debug, Default)]
struct Delta {
    content: String,
    thinking: String,
    tool_calls: Vec<Value>,
    /// Its tokens' log probabilities in Ollama's shape, when asked for.
    logprobs: Vec<Value>,
}

/// One non-final object: `message` for chat, `response` (and `thinking`) for generate.
fn chunk(kind: Kind, model: &str, delta: &Delta) -> Map<String, Value> {
    let mut object = Map::new();
    object.insert("model".into(), Value::String(model.to_owned()));
    object.insert("created_at".into(), Value::String(humantime::format_rfc3339_nanos(SystemTime::now()).to_string()));
    match kind {
        Kind::Chat => {
            let mut message = Map::new();
            message.insert("role".into(), Value::String("assistant".into()));
            message.insert("content".into(), Value::String(delta.content.clone()));
            if !delta.thinking.is_empty() {
                message.insert("thinking".into(), Value::String(delta.thinking.clone()));
            }
            if !delta.tool_calls.is_empty() {
                message.insert("tool_calls".into(), Value::Array(delta.tool_calls.clone()));
            }
            object.insert("message".into(), Value::Object(message));
        }
        Kind::Generate => {
            object.insert("response".into(), Value::String(delta.content.clone()));
            if !delta.thinking.is_empty() {
                object.insert("thinking".into(), Value::String(delta.thinking.clone()));
            }
        }
    }
    if !delta.logprobs.is_empty() {
        object.insert("logprobs".into(), Value::Array(delta.logprobs.clone()));
    }
    object.insert("done".into(), Value::Bool(false));
    object
}

fn push_line(out: &mut Vec<u8>, value: &Value) {
    serde_json::to_writer(&mut *out, value).expect("JSON values serialize");
    out.push(b'\n');
}

/// What the runner's stream said that the client sees as it comes.
#[derive(Debug, PartialEq)]
pub(super) enum Event {
    Content(String),
    Thinking(String),
    /// Tool calls, whole, in Ollama's shape: sent once the runner finished them.
    ToolCalls(Vec<Value>),
    /// The log probabilities of the tokens of the text just before, in Ollama's shape.
    Logprobs(Vec<Value>),
    Error(String),
}

/// Reads llama-server's server-sent events (from `/v1/chat/completions` or
/// `/completion`) and keeps what the final object needs.
#[derive(Debug, Default)]
pub(super) struct Parser {
    scanner: EventScanner,
    finish_reason: Option<String>,
    prompt_tokens: Option<u64>,
    eval_tokens: Option<u64>,
    prompt_ns: Option<u64>,
    eval_ns: Option<u64>,
    tool_calls: ToolCalls,
    /// With log probabilities asked for, how many of the likeliest tokens each lists.
    logprobs: Option<usize>,
}

impl Parser {
    /// A parser that gives each token's log probability, with its `top` likeliest
    /// alternatives, when `logprobs` is `Some(top)`.
    pub(super) fn with_logprobs(logprobs: Option<usize>) -> Self {
        Self { logprobs, ..Self::default() }
    }

    /// What is left at the end of the stream: tool calls without a finish reason.
    pub(super) fn flush(&mut self) -> Vec<Event> {
        if self.tool_calls.is_empty() { Vec::new() } else { vec![Event::ToolCalls(self.tool_calls.take())] }
    }

    pub(super) fn feed(&mut self, bytes: &[u8]) -> Vec<Event> {
        let mut events = Vec::new();
        for event in self.scanner.feed(bytes) {
            self.event(&event, &mut events);
        }
        events
    }

    fn event(&mut self, event: &Value, events: &mut Vec<Event>) {
        if let Some(error) = event.get("error") {
            let message = error["message"].as_str().or_else(|| error.as_str()).unwrap_or("the model runner failed");
            events.push(Event::Error(message.to_owned()));
            return;
        }
        // /v1/chat/completions
        if let Some(choice) = event["choices"].get(0) {
            let delta = &choice["delta"];
            if let Some(text) = delta["reasoning_content"].as_str().filter(|t| !t.is_empty()) {
                events.push(Event::Thinking(text.to_owned()));
            }
            if let Some(text) = delta["content"].as_str().filter(|t| !t.is_empty()) {
                events.push(Event::Content(text.to_owned()));
            }
            self.logprobs(&choice["logprobs"]["content"], events);
            self.tool_calls.add(&delta["tool_calls"]);
            if let Some(reason) = choice["finish_reason"].as_str() {
                self.finish_reason = Some(reason.to_owned());
                events.extend(self.flush());
            }
        }
        if let Some(usage) = event.get("usage").filter(|u| u.is_object()) {
            self.prompt_tokens = usage["prompt_tokens"].as_u64().or(self.prompt_tokens);
            self.eval_tokens = usage["completion_tokens"].as_u64().or(self.eval_tokens);
        }
        // /completion
        if event.get("choices").is_none() {
            if let Some(text) = event["content"].as_str().filter(|t| !t.is_empty()) {
                events.push(Event::Content(text.to_owned()));
            }
            self.logprobs(&event["completion_probabilities"], events);
            if event["stop"] == Value::Bool(true) {
                let limit = event["stop_type"] == "limit";
                self.finish_reason = Some(if limit { "length" } else { "stop" }.to_owned());
                self.prompt_tokens = event["tokens_evaluated"].as_u64().or(self.prompt_tokens);
                self.eval_tokens = event["tokens_predicted"].as_u64().or(self.eval_tokens);
            }
        }
        if let Some(timings) = event.get("timings").filter(|t| t.is_object()) {
            self.prompt_tokens = self.prompt_tokens.or(timings["prompt_n"].as_u64());
            self.eval_tokens = self.eval_tokens.or(timings["predicted_n"].as_u64());
            self.prompt_ns = timings["prompt_ms"].as_f64().map(ms_to_ns).or(self.prompt_ns);
            self.eval_ns = timings["predicted_ms"].as_f64().map(ms_to_ns).or(self.eval_ns);
        }
    }

    /// The runner's entries for an event's tokens (`/v1/chat/completions`' `logprobs.content`
    /// or `/completion`'s `completion_probabilities`: `{id, token, bytes, logprob,
    /// top_logprobs}`) in Ollama's shape, when they were asked for.
    fn logprobs(&self, entries: &Value, events: &mut Vec<Event>) {
        let (Some(top), Some(entries)) = (self.logprobs, entries.as_array()) else { return };
        let shaped: Vec<Value> = entries
            .iter()
            .map(|entry| {
                let mut shaped = token_logprob(entry);
                let alternatives = entry["top_logprobs"].as_array().map(Vec::as_slice).unwrap_or_default();
                if top > 0 {
                    let listed = alternatives.iter().take(top).map(|a| Value::Object(token_logprob(a))).collect();
                    shaped.insert("top_logprobs".into(), Value::Array(listed));
                }
                Value::Object(shaped)
            })
            .collect();
        if !shaped.is_empty() {
            events.push(Event::Logprobs(shaped));
        }
    }
}

/// One token's `{token, logprob, bytes}` as Ollama gives it (`bytes` left out when none).
fn token_logprob(entry: &Value) -> Map<String, Value> {
    let mut shaped = Map::new();
    shaped.insert("token".into(), Value::String(entry["token"].as_str().unwrap_or_default().to_owned()));
    shaped.insert("logprob".into(), json!(entry["logprob"].as_f64().unwrap_or(0.0)));
    if let Some(bytes) = entry["bytes"].as_array().filter(|b| !b.is_empty()) {
        shaped.insert("bytes".into(), Value::Array(bytes.clone()));
    }
    shaped
}

#[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
fn ms_to_ns(ms: f64) -> u64 {
    (ms.max(0.0) * 1e6) as u64
}

pub(super) fn string(request: &Map<String, Value>, field: &str, path: &str) -> Result<Option<String>, ApiError> {
    match request.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(bad(format!("{field} must be a string"), path)),
    }
}

/// Ollama's sampling options as llama-server's request fields; `limit` names the token
/// limit (`max_tokens` on the chat endpoint, `n_predict` on `/completion`).
pub(super) fn sampling(options: &Map<String, Value>, limit: &str, path: &str) -> Result<Map<String, Value>, ApiError> {
    let invalid = |name: &str, reason: &str| bad(format!("invalid option {name}: {reason}"), path);
    let mut body = Map::new();
    for name in ["temperature", "top_p", "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty"] {
        match options.get(name) {
            None | Some(Value::Null) => {}
            Some(v @ Value::Number(_)) => {
                body.insert(name.into(), v.clone());
            }
            Some(_) => return Err(invalid(name, "expected a number")),
        }
    }
    for name in ["top_k", "seed"] {
        match options.get(name) {
            None | Some(Value::Null) => {}
            Some(v) if v.is_i64() || v.is_u64() => {
                body.insert(name.into(), v.clone());
            }
            Some(_) => return Err(invalid(name, "expected an integer")),
        }
    }
    match options.get("stop") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => {
            body.insert("stop".into(), json!([s]));
        }
        Some(Value::Array(items)) if items.iter().all(Value::is_string) => {
            body.insert("stop".into(), Value::Array(items.clone()));
        }
        Some(_) => return Err(invalid("stop", "expected a string or a list of strings")),
    }
    match options.get("num_predict") {
        None | Some(Value::Null) => {}
        // Negative: no limit (Ollama's -1 and -2).
        Some(v) => match v.as_i64() {
            Some(n) if n < 0 => {}
            Some(n) => {
                body.insert(limit.into(), json!(n));
            }
            None => return Err(invalid("num_predict", "expected an integer")),
        },
    }
    Ok(body)
}

#[cfg(test)]
mod tests {
    use serde_json::{Map, Value, json};

    use super::{Event, Parser, Route, chat_route, sampling};

    #[test]
    fn chat_events_split_across_reads_parse_once() {
        let mut parser = Parser::default();
        let stream = concat!(
            "data: {\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":null}}]}\n\n",
            "data: {\"choices\":[{\"delta\":{\"content\":\"Hel\"}}]}\n\n",
            "data: {\"choices\":[{\"delta\":{\"content\":\"lo\"}}]}\n\n",
            "data: {\"choices\":[{\"delta\":{},\"finish_reason\":\"length\"}],",
            "\"timings\":{\"prompt_n\":3,\"prompt_ms\":1.5,\"predicted_n\":2,\"predicted_ms\":2.0}}\n\n",
            "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":4,\"completion_tokens\":2}}\n\n",
            "data: [DONE]\n\n",
        );
        let mut events = Vec::new();
        for piece in stream.as_bytes().chunks(7) {
            events.extend(parser.feed(piece));
        }
        assert_eq!(events, [Event::Content("Hel".into()), Event::Content("lo".into())]);
        assert_eq!(parser.finish_reason.as_deref(), Some("length"));
        assert_eq!((parser.prompt_tokens, parser.eval_tokens), (Some(4), Some(2)));
        assert_eq!((parser.prompt_ns, parser.eval_ns), (Some(1_500_000), Some(2_000_000)));
    }

    #[test]
    fn completion_events_and_errors() {
        let mut parser = Parser::default();
        let events = parser.feed(
            b"data: {\"content\":\"a\",\"stop\":false}\n\ndata: {\"content\":\"\",\"stop\":true,\"stop_type\":\"eos\",\
              \"tokens_predicted\":1,\"tokens_evaluated\":5,\"timings\":{\"prompt_ms\":1,\"predicted_ms\":1}}\n\n\
              data: {\"error\":{\"message\":\"boom\"}}\n\n",
        );
        assert_eq!(events, [Event::Content("a".into()), Event::Error("boom".into())]);
        assert_eq!(parser.finish_reason.as_deref(), Some("stop"));
        assert_eq!((parser.prompt_tokens, parser.eval_tokens), (Some(5), Some(1)));
    }

    #[test]
    fn log_probabilities_come_in_ollamas_shape_only_when_asked_for() {
        // As llama-server sends them: each token's entry and its likeliest alternatives.
        let entry = |token: &str, logprob: f64| json!({ "id": 7, "token": token, "bytes": [102], "logprob": logprob });
        let mut chosen = entry("f", -0.25);
        chosen["top_logprobs"] = json!([entry("f", -0.25), entry("g", -1.5), entry("h", -3.0)]);
        let chat = format!(
            "data: {}\n\n",
            json!({ "choices": [{ "delta": { "content": "f" }, "logprobs": { "content": [chosen.clone()] } }] })
        );
        let completion = format!("data: {}\n\n", json!({ "content": "f", "completion_probabilities": [chosen] }));
        let shaped = |top: Value| {
            let mut shaped = json!({ "token": "f", "logprob": -0.25, "bytes": [102] });
            if !top.is_null() {
                shaped["top_logprobs"] = top;
            }
            Event::Logprobs(vec![shaped])
        };
        for stream in [&chat, &completion] {
            let events = Parser::default().feed(stream.as_bytes());
            assert_eq!(events, [Event::Content("f".into())], "not asked for: none");
            let mut two = Parser::with_logprobs(Some(2));
            let top = json!([
                { "token": "f", "logprob": -0.25, "bytes": [102] },
                { "token": "g", "logprob": -1.5, "bytes": [102] },
            ]);
            assert_eq!(two.feed(stream.as_bytes()), [Event::Content("f".into()), shaped(top)]);
            let mut none = Parser::with_logprobs(Some(0));
            assert_eq!(none.feed(stream.as_bytes()), [Event::Content("f".into()), shaped(Value::Null)]);
        }
    }

    #[test]
    fn reasoning_and_tool_call_deltas_become_thinking_and_whole_tool_calls() {
        let mut parser = Parser::default();
        let events = parser.feed(
            concat!(
                "data: {\"choices\":[{\"delta\":{\"reasoning_content\":\"let me see\"}}]}\n\n",
                "data: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"index\":0,\"id\":\"x\",",
                "\"function\":{\"name\":\"add\",\"arguments\":\"{\\\"a\\\":\"}}]}}]}\n\n",
                "data: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"index\":0,",
                "\"function\":{\"arguments\":\"1}\"}}]}}]}\n\n",
                "data: {\"choices\":[{\"delta\":{},\"finish_reason\":\"tool_calls\"}]}\n\n",
            )
            .as_bytes(),
        );
        assert_eq!(
            events,
            [
                Event::Thinking("let me see".into()),
                Event::ToolCalls(vec![json!({ "function": { "index": 0, "name": "add", "arguments": { "a": 1 } } })])
            ]
        );
        assert!(parser.flush().is_empty(), "tool calls are sent once");
        // Calls the runner never closed come out at the end.
        let mut parser = Parser::default();
        let events = parser.feed(
            b"data: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"name\":\"f\"}}]}}]}\n\n",
        );
        assert!(events.is_empty());
        assert_eq!(
            parser.flush(),
            [Event::ToolCalls(vec![json!({ "function": { "index": 0, "name": "f", "arguments": {} } })])]
        );
    }

    #[test]
    fn chats_go_to_the_chat_endpoint_unless_a_schema_needs_the_rendered_prompt() {
        let options: Map<String, Value> = serde_json::from_value(json!({ "num_predict": 5 })).expect("map");
        let fields: Map<String, Value> =
            serde_json::from_value(json!({ "chat_template_kwargs": { "enable_thinking": false }, "tools": [] }))
                .expect("map");
        let messages = vec![json!({ "role": "user", "content": "hi" })];
        let (route, body) = chat_route(&options, fields.clone(), messages.clone(), None, "/api/chat").expect("ok");
        assert!(matches!(route, Route::Chat));
        assert_eq!(
            Value::Object(body),
            json!({
                "max_tokens": 5, "chat_template_kwargs": { "enable_thinking": false }, "tools": [],
                "messages": messages, "stream": true, "stream_options": { "include_usage": true }
            })
        );
        let schema = json!({ "type": "object" });
        let (route, body) =
            chat_route(&options, fields, messages.clone(), Some(schema.clone()), "/api/chat").expect("ok");
        let Route::Rendered(render) = route else { panic!("rendered: {route:?}") };
        assert_eq!(
            render,
            json!({ "chat_template_kwargs": { "enable_thinking": false }, "tools": [], "messages": messages })
        );
        assert_eq!(Value::Object(body), json!({ "n_predict": 5, "json_schema": schema, "stream": true }));
    }

    #[test]
    fn sampling_options_map_and_bad_ones_are_named() {
        let options: Map<String, Value> = serde_json::from_value(json!({
            "temperature": 0.5, "top_k": 4, "stop": "x", "num_predict": 8, "num_ctx": 64, "seed": 1
        }))
        .expect("map");
        let body = sampling(&options, "max_tokens", "/api/chat").expect("valid");
        assert_eq!(
            Value::Object(body),
            json!({ "temperature": 0.5, "top_k": 4, "stop": ["x"], "max_tokens": 8, "seed": 1 })
        );
        let unlimited: Map<String, Value> = serde_json::from_value(json!({ "num_predict": -1 })).expect("map");
        assert!(sampling(&unlimited, "n_predict", "/api/generate").expect("valid").is_empty());
        let wrong: Map<String, Value> = serde_json::from_value(json!({ "temperature": "hot" })).expect("map");
        assert!(sampling(&wrong, "max_tokens", "/api/chat").is_err());
    }
}
