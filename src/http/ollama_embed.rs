//! Ollama's embedding endpoints: `POST /api/embed` (one or many inputs) and the legacy
//! `POST /api/embeddings` (one prompt). The scheduler leases a runner started with
//! `--embeddings`; the request goes to its `/v1/embeddings`.
//!
//! As in Ollama, an input longer than the runner embeds at once (its context, and its
//! physical batch, which must hold an input whole) is cut to what fits unless the client
//! asks for `truncate: false`, and `dimensions` keeps a vector's first numbers,
//! normalized again.

use std::time::{Duration, Instant};

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};

use super::error::{self, ApiError, bad, internal};
use super::json_body::json_object;
use super::model_request;
use super::runner_call;
use super::state::AppState;
use super::stream_scan::TokenPrefix;
use crate::scheduler::handle::Lease;
use crate::scheduler::types::ModelRequest;

/// How long one embedding call to a runner may take.
const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(600);

/// The most inputs one `/api/embed` takes, as OpenAI's embeddings endpoint: each comes
/// back as a vector of thousands of numbers, which corral holds to reshape the answer
/// (a 4 MiB request of a million one-letter inputs asked for tens of GB).
const MAX_INPUTS: usize = 2048;

/// The most bytes of a runner's embeddings answer read (2048 inputs of 8192 dimensions
/// come to about 400 MB of JSON).
const MAX_REPLY: usize = 512 << 20;

/// The tokens a tokenizer may add around an input (a BOS and an EOS, or BERT's CLS and
/// SEP), kept free when an input is cut to fit.
const SPECIAL_TOKENS: u32 = 2;

/// llama-server's physical batch when none is set (`-ub`).
const DEFAULT_UBATCH: u32 = 512;

/// The most bytes of the text `/detokenize` gives back for an input cut to fit.
const MAX_DETOKENIZED: usize = 64 << 20;

/// A runner's `/v1/embeddings` answer, read into what `/api/embed` gives back.
#[derive(Deserialize)]
struct Reply {
    data: Vec<Embedding>,
    #[serde(default)]
    usage: Usage,
}

#[derive(Deserialize)]
struct Embedding {
    index: u64,
    embedding: Vec<f64>,
}

#[derive(Default, Deserialize)]
struct Usage {
    #[serde(default)]
    prompt_tokens: u64,
}

#[derive(Serialize)]
struct EmbedResponse {
    model: String,
    embeddings: Vec<Vec<f64>>,
    total_duration: u64,
    load_duration: u64,
    prompt_eval_count: u64,
}

/// `POST /api/embed`.
pub async fn embed(State(state): State<AppState>, body: Bytes) -> Result<Response, ApiError> {
    const PATH: &str = "/api/embed";
    let started = Instant::now();
    let request = json_object(PATH, &body)?;
    let inputs = inputs(&request, PATH)?;
    let truncate = model_request::boolean(&request, "truncate", true, PATH)?;
    let dimensions = match request.get("dimensions") {
        None | Some(Value::Null) => None,
        Some(value) => match value.as_u64() {
            Some(0) => None,
            Some(n) => Some(usize::try_from(n).unwrap_or(usize::MAX)),
            None => return Err(bad("dimensions must be a non-negative integer", PATH)),
        },
    };
    let (model, mut embeddings, load, prompt_tokens) = run(&state, &request, inputs, truncate, PATH).await?;
    if let Some(dimensions) = dimensions {
        for vector in &mut embeddings {
            if dimensions < vector.len() {
                vector.truncate(dimensions);
                normalize(vector);
            }
        }
    }
    let response = EmbedResponse {
        model,
        embeddings,
        total_duration: nanos(started.elapsed()),
        load_duration: nanos(load),
        prompt_eval_count: prompt_tokens,
    };
    Ok(Json(response).into_response())
}

/// `POST /api/embeddings` (legacy): `{model, prompt}` → `{embedding}`.
pub async fn embeddings(State(state): State<AppState>, body: Bytes) -> Result<Response, ApiError> {
    const PATH: &str = "/api/embeddings";
    let request = json_object(PATH, &body)?;
    let prompt = match request.get("prompt") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => return Err(bad("prompt must be a string", PATH)),
    };
    let (_, embeddings, _, _) = run(&state, &request, prompt.into_iter().collect(), true, PATH).await?;
    let embedding = embeddings.into_iter().next().unwrap_or_default();
    Ok(Json(json!({ "embedding": embedding })).into_response())
}

/// `/api/embed`'s `input`: a string or a list of strings (none only loads the model).
pub(super) fn inputs(request: &Map<String, Value>, path: &str) -> Result<Vec<String>, ApiError> {
    match request.get("input") {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::String(s)) => Ok(vec![s.clone()]),
        Some(Value::Array(items)) if items.len() > MAX_INPUTS => {
            Err(bad(format!("input holds {} items; one request takes at most {MAX_INPUTS}", items.len()), path))
        }
        Some(Value::Array(items)) => items
            .iter()
            .map(|i| i.as_str().map(str::to_owned))
            .collect::<Option<_>>()
            .ok_or_else(|| bad("input must be a string or a list of strings", path)),
        Some(_) => Err(bad("input must be a string or a list of strings", path)),
    }
}

/// Loads the model (if needed) and embeds `inputs` (cut to fit, if `truncate`); returns
/// the model's name, the vectors, the time spent waiting for the runner, and the prompt
/// tokens.
async fn run(
    state: &AppState,
    request: &Map<String, Value>,
    inputs: Vec<String>,
    truncate: bool,
    path: &str,
) -> Result<(String, Vec<Vec<f64>>, Duration, u64), ApiError> {
    let (name_text, name) = model_request::model_name(request, true, path)?;
    let (options, keep_alive) = model_request::options_and_keep_alive(request, path)?;
    let model_request = model_request::build(state, name, &name_text, options, keep_alive, path).await?;
    if model_request.options.embedding.is_none() {
        return Err(bad(format!("\"{name_text}\" does not support embeddings"), path));
    }
    let model = model_request.name.clone();
    if inputs.is_empty() {
        // Ollama's way to load a model without using it.
        let waited = Instant::now();
        drop(state.scheduler.acquire(model_request).await.map_err(|e| error::schedule(&e, path))?);
        return Ok((model, Vec::new(), waited.elapsed(), 0));
    }
    let (inputs, fitting) = fit(state, &model_request, inputs, truncate, path).await?;
    let body = serde_json::to_vec(&json!({ "input": inputs })).expect("strings serialize");
    let answer = runner_call::send(state, model_request, "/v1/embeddings", body, UPSTREAM_TIMEOUT, path).await?;
    let (lease, status, mut upstream) = (answer.lease, answer.status, answer.body);
    // A load waited for while fitting the inputs counts as the load.
    let load = answer.waited + fitting;
    let mut reply = Vec::new();
    while let Some(piece) = upstream.chunk().await {
        match piece {
            Ok(piece) if reply.len() + piece.len() > MAX_REPLY => {
                drop(upstream);
                drop(lease);
                let limit = bytesize::ByteSize::b(MAX_REPLY as u64).display().iec();
                return Err(internal(format!("the model runner's answer is larger than {limit}"), path));
            }
            Ok(piece) => reply.extend_from_slice(&piece),
            Err(e) => {
                drop(upstream);
                let message = runner_call::failed_mid_answer(&state.scheduler, Some(lease), &e).await;
                return Err(internal(&message, path));
            }
        }
    }
    drop(lease);
    if !status.is_success() {
        let reply: Value = serde_json::from_slice(&reply).unwrap_or(Value::Null);
        return Err(error::runner_refused(status, &reply, path));
    }
    // Hundreds of megabytes of numbers are read off the async workers.
    let reply = tokio::task::spawn_blocking(move || serde_json::from_slice::<Reply>(&reply))
        .await
        .map_err(|e| internal(format!("reading the model runner's answer failed: {e}"), path))?
        .map_err(|e| internal(format!("the model runner sent an unreadable answer: {e}"), path))?;
    let mut data: Vec<(u64, Vec<f64>)> = reply.data.into_iter().map(|e| (e.index, e.embedding)).collect();
    data.sort_by_key(|(index, _)| *index);
    if data.len() != inputs.len() {
        return Err(internal("the model runner returned the wrong number of embeddings", path));
    }
    Ok((model, data.into_iter().map(|(_, v)| v).collect(), load, reply.usage.prompt_tokens))
}

/// `inputs`, each cut to the tokens the runner embeds at once when it has more (Ollama's
/// `truncate`), or a 400 when it has more and `truncate` is off. Only an input with at
/// least as many bytes as that can have as many tokens (a token is at least a byte, and
/// the space some tokenizers put first is within [`SPECIAL_TOKENS`]): the others, nearly
/// all, cost nothing. The long ones are counted by the runner's `/tokenize` as far as
/// the limit, and cut with its `/detokenize`. Also returns how long it waited for the
/// runner (a load).
async fn fit(
    state: &AppState,
    request: &ModelRequest,
    inputs: Vec<String>,
    truncate: bool,
    path: &str,
) -> Result<(Vec<String>, Duration), ApiError> {
    let options = &request.options;
    let batch = options.num_batch.unwrap_or(DEFAULT_UBATCH);
    let limit = usize::try_from(options.num_ctx.min(batch).saturating_sub(SPECIAL_TOKENS)).unwrap_or(usize::MAX);
    if inputs.iter().all(|input| input.len() < limit) {
        return Ok((inputs, Duration::ZERO));
    }
    let waited = Instant::now();
    let lease = state.scheduler.acquire(request.clone()).await.map_err(|e| error::schedule(&e, path))?;
    let waited = waited.elapsed();
    let mut fitted = Vec::with_capacity(inputs.len());
    for input in inputs {
        if input.len() < limit {
            fitted.push(input);
            continue;
        }
        let Some(first) = first_tokens(state, &lease, &input, limit, path).await? else {
            fitted.push(input);
            continue;
        };
        if !truncate {
            // Ollama's words.
            return Err(bad("the input length exceeds the context length", path));
        }
        let reply = ask(state, &lease, "/detokenize", &json!({ "tokens": first }), path).await?;
        let text = runner_call::json_answer(reply, MAX_DETOKENIZED).await;
        let text = text["content"].as_str().ok_or_else(|| internal("the model runner could not detokenize", path))?;
        fitted.push(text.to_owned());
    }
    Ok((fitted, waited))
}

/// The first `limit` tokens of `input` when it has more, as the runner tokenizes it.
async fn first_tokens(
    state: &AppState,
    lease: &Lease,
    input: &str,
    limit: usize,
    path: &str,
) -> Result<Option<Vec<u32>>, ApiError> {
    let mut answer = ask(state, lease, "/tokenize", &json!({ "content": input }), path).await?;
    let mut tokens = TokenPrefix::new(limit);
    while let Some(piece) = answer.chunk().await {
        let piece = piece.map_err(|e| runner_call::unanswered(&e, path))?;
        if tokens.feed(&piece) {
            // Dropping the answer closes its connection: the rest is never read.
            break;
        }
    }
    tokens.finish().map_err(|why| internal(format!("the model runner's tokens could not be read: {why}"), path))
}

/// Posts `body` to the leased runner's `upstream_path`; its answer if it succeeded.
async fn ask(
    state: &AppState,
    lease: &Lease,
    upstream_path: &'static str,
    body: &Value,
    path: &str,
) -> Result<crate::supervisor::upstream::BodyStream, ApiError> {
    let body = serde_json::to_vec(body).expect("JSON values serialize");
    let (status, answer) = state
        .upstream
        .post_json_stream(lease.socket(), upstream_path, body, UPSTREAM_TIMEOUT)
        .await
        .map_err(|e| runner_call::unanswered(&e, path))?;
    if !status.is_success() {
        let reply = runner_call::refusal(answer).await;
        return Err(error::runner_refused(status, &reply, path));
    }
    Ok(answer)
}

/// Scales `vector` to length 1 (a zero vector stays as it is).
fn normalize(vector: &mut [f64]) {
    let norm = vector.iter().map(|x| x * x).sum::<f64>().sqrt();
    if norm > 0.0 {
        for x in vector {
            *x /= norm;
        }
    }
}

pub(super) fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}
