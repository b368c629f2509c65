//! The handlers' pure steps, callable from outside: the entry points of the fuzz targets
//! (`fuzz/`). Each function runs the same parsing and translation functions, in the same
//! order, as its handler does before it touches the store, the scheduler or a runner;
//! what it returns is a summary to check properties on, not an API.
//!
//! A refusal is an [`ApiError`]; [`status`] says which status it would answer with.

use axum::response::IntoResponse;
use serde_json::{Map, Value, json};

pub use super::error::ApiError;
use super::error::bad;
use super::json_body::json_object;
use super::ollama_generate::{Common, chat_route, sampling, string};
use super::ollama_translate as translate;
use super::{ollama_generate, ollama_models, ollama_store, openai, stream_scan};
use crate::http::state::Tokens;

/// The status a refusal answers with.
#[must_use]
pub fn status(error: ApiError) -> u16 {
    error.into_response().status().as_u16()
}

/// `POST /api/chat`'s body: parsed, then translated into the runner's request.
/// Returns `{route, body}` as the handler would send it (less the model's own defaults).
pub fn chat(body: &[u8]) -> Result<Value, ApiError> {
    const PATH: &str = "/api/chat";
    let request = json_object(PATH, body)?;
    let messages = match request.get("messages") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(items)) => translate::messages(items, PATH)?.0,
        Some(_) => return Err(bad("messages must be a list of {role, content} objects", PATH)),
    };
    let schema = translate::format(&request, PATH)?;
    let mut fields = translate::think(&request, PATH)?;
    if let Some(tools) = translate::tools(&request, PATH)? {
        fields.insert("tools".into(), tools);
    }
    let common = Common::parse(&request, PATH)?;
    let (route, body) = chat_route(&common.options, fields, messages, schema, PATH)?;
    Ok(json!({ "route": format!("{route:?}"), "body": body }))
}

/// `POST /api/generate`'s body: parsed, then translated (the request `template` is left
/// to its own target, `request_template`).
pub fn generate(body: &[u8]) -> Result<Value, ApiError> {
    const PATH: &str = "/api/generate";
    let request = json_object(PATH, body)?;
    let prompt = string(&request, "prompt", PATH)?.unwrap_or_default();
    let system = string(&request, "system", PATH)?;
    let _template = string(&request, "template", PATH)?;
    let images = translate::images(request.get("images"), PATH)?;
    let schema = translate::format(&request, PATH)?;
    let fields = translate::think(&request, PATH)?;
    let common = Common::parse(&request, PATH)?;
    let mut completion = sampling(&common.options, "n_predict", PATH)?;
    completion.insert("prompt".into(), Value::String(prompt.clone()));
    let mut messages = Vec::new();
    if let Some(system) = system {
        messages.push(json!({ "role": "system", "content": system }));
    }
    let content = if images.is_empty() { Value::String(prompt) } else { translate::content_parts(&prompt, &images) };
    messages.push(json!({ "role": "user", "content": content }));
    let (route, body) = chat_route(&common.options, fields, messages, schema, PATH)?;
    Ok(json!({ "completion": completion, "route": format!("{route:?}"), "body": body }))
}

/// `POST /api/embed` and `/api/embeddings`' bodies: the model, options, keep-alive and
/// inputs.
pub fn embed(body: &[u8]) -> Result<Value, ApiError> {
    const PATH: &str = "/api/embed";
    let request = json_object(PATH, body)?;
    let inputs = super::ollama_embed::inputs(&request, PATH)?;
    let (given, name) = super::model_request::model_name(&request, false, PATH)?;
    let (options, keep_alive) = super::model_request::options_and_keep_alive(&request, PATH)?;
    Ok(json!({
        "given": given,
        "name": name.full(),
        "options": options,
        "keep_alive": keep_alive.map(|k| format!("{k:?}")),
        "inputs": inputs,
    }))
}

/// `POST /api/create`'s body: the name and the create spec.
pub fn create(body: &[u8]) -> Result<Value, ApiError> {
    const PATH: &str = "/api/create";
    let request = json_object(PATH, body)?;
    let (_, name) = ollama_store::model_name(&request, PATH)?;
    let (spec, from) = ollama_store::create_spec(&request)?;
    let stream = ollama_store::stream_flag(&request, PATH)?;
    Ok(json!({ "name": name.full(), "spec": format!("{spec:?}"), "from": from, "stream": stream }))
}

/// `POST /api/pull` and `/api/push`'s bodies: the name and `stream` (`insecure` is read
/// with the registry client it chooses).
pub fn transfer(body: &[u8]) -> Result<Value, ApiError> {
    const PATH: &str = "/api/pull";
    let request = json_object(PATH, body)?;
    let (given, name) = ollama_store::model_name(&request, PATH)?;
    let stream = ollama_store::stream_flag(&request, PATH)?;
    Ok(json!({ "given": given, "name": name.full(), "stream": stream }))
}

/// `POST /api/show`, `/api/copy` and `DELETE /api/delete`'s bodies: the names they name.
#[must_use]
pub fn model_bodies(body: &[u8]) -> Vec<Result<Value, ApiError>> {
    let names = |path: &str, fields: &[&[&str]]| -> Result<Value, ApiError> {
        let request = json_object(path, body)?;
        let mut out = Vec::new();
        for fields in fields {
            let (given, name) = ollama_models::model_name(path, &request, fields)?;
            out.push(json!([given, name.full()]));
        }
        Ok(Value::Array(out))
    };
    vec![
        names("/api/show", &[&["model", "name"]]),
        names("/api/copy", &[&["source"], &["destination"]]),
        names("/api/delete", &[&["model", "name"]]),
    ]
}

/// A runner's answer as the one stream scanner (`stream_scan`) reads it, fed in the
/// given pieces: the events of a server-sent event stream and the unfinished line; and,
/// read as a JSON answer, the tail kept (at most `keep` bytes) and its last `usage`.
#[must_use]
pub fn stream_scan(pieces: &[&[u8]], keep: usize) -> (Vec<Value>, Vec<u8>, Vec<u8>, Option<Value>) {
    let mut events = stream_scan::EventScanner::default();
    let mut tail = stream_scan::JsonTail::new(keep);
    let mut out = Vec::new();
    for piece in pieces {
        out.extend(events.feed(piece));
        tail.feed(piece);
    }
    (out, events.pending().to_vec(), tail.bytes().to_vec(), tail.last_field("usage"))
}

/// llama-server's event stream of a generation, as `/api/chat` and `/api/generate` read
/// it with each token's log probability and two likeliest asked for, fed in the given
/// pieces: each event the client would see, then the parser's state (the final counts,
/// and the unfinished line).
#[must_use]
pub fn generation_events(pieces: &[&[u8]]) -> (Vec<String>, String) {
    let mut parser = ollama_generate::Parser::with_logprobs(Some(2));
    let mut events: Vec<String> = pieces.iter().flat_map(|p| parser.feed(p)).map(|e| format!("{e:?}")).collect();
    events.extend(parser.flush().into_iter().map(|e| format!("{e:?}")));
    (events, format!("{parser:?}"))
}

/// What `/v1/*` counts of an answer passing through (`events`: an event stream, else
/// JSON), fed in the given pieces: the prompt and generated tokens recorded.
#[must_use]
pub fn openai_usage(events: bool, pieces: &[&[u8]]) -> (u64, u64) {
    let tokens = std::sync::Arc::new(Tokens::default());
    let mut usage = openai::Usage::new(events, std::sync::Arc::clone(&tokens));
    for piece in pieces {
        usage.observe(piece);
    }
    usage.record();
    tokens.totals()
}

/// Ollama's sampling options as llama-server's fields (both token-limit spellings).
pub fn options(options: &Map<String, Value>) -> Result<Value, ApiError> {
    Ok(json!([sampling(options, "max_tokens", "/api/chat")?, sampling(options, "n_predict", "/api/generate")?]))
}
