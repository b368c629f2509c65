//! Ollama's embedding endpoints: `POST /api/embed` (one or many inputs) and the legacy
//! `POST /api/embeddings` (one prompt). The scheduler leases a runner started with
//! `--embeddings`; the request goes to its `/v1/embeddings`.

use std::time::{Duration, Instant};

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use serde_json::{Map, Value, json};

use super::error::ApiError;
use super::model_request;
use super::runner_call;
use super::state::AppState;
use crate::scheduler::failure::FailureClass;
use crate::scheduler::types::ScheduleError;

/// How long one embedding call to a runner may take.
const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(600);

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
    let request = object(&body, PATH)?;
    let inputs = inputs(&request, PATH)?;
    let (model, embeddings, load, prompt_tokens) = run(&state, &request, inputs, PATH).await?;
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
    let request = object(&body, PATH)?;
    let prompt = match request.get("prompt") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => return Err(bad("prompt must be a string", PATH)),
    };
    let (_, embeddings, _, _) = run(&state, &request, prompt.into_iter().collect(), PATH).await?;
    let embedding = embeddings.into_iter().next().unwrap_or_default();
    Ok(Json(json!({ "embedding": embedding })).into_response())
}

/// `/api/embed`'s `input`: a string or a list of strings (none only loads the model).
pub(super) fn inputs(request: &Map<String, Value>, path: &str) -> Result<Vec<String>, ApiError> {
    match request.get("input") {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::String(s)) => Ok(vec![s.clone()]),
        Some(Value::Array(items)) => items
            .iter()
            .map(|i| i.as_str().map(str::to_owned))
            .collect::<Option<_>>()
            .ok_or_else(|| bad("input must be a string or a list of strings", path)),
        Some(_) => Err(bad("input must be a string or a list of strings", path)),
    }
}

/// Loads the model (if needed) and embeds `inputs`; returns the model's name, the
/// vectors, the time spent waiting for the runner, and the prompt tokens.
async fn run(
    state: &AppState,
    request: &Map<String, Value>,
    inputs: Vec<String>,
    path: &str,
) -> Result<(String, Vec<Vec<f64>>, Duration, u64), ApiError> {
    let (name_text, name) = model_request::model_name(request, true, path)?;
    let (options, keep_alive) = model_request::options_and_keep_alive(request, path)?;
    let model_request = model_request::build(state, name, &name_text, options, keep_alive, path).await?;
    if model_request.options.embedding.is_none() {
        return Err(bad(&format!("\"{name_text}\" does not support embeddings"), path));
    }
    let model = model_request.name.clone();
    if inputs.is_empty() {
        // Ollama's way to load a model without using it.
        let waited = Instant::now();
        drop(state.scheduler.acquire(model_request).await.map_err(|e| schedule_error(&e, path))?);
        return Ok((model, Vec::new(), waited.elapsed(), 0));
    }
    let body = serde_json::to_vec(&json!({ "input": inputs })).expect("strings serialize");
    let answer = runner_call::send(state, model_request, "/v1/embeddings", body, UPSTREAM_TIMEOUT, path).await?;
    let (lease, status, mut upstream, load) = (answer.lease, answer.status, answer.body, answer.waited);
    let mut reply = Vec::new();
    while let Some(piece) = upstream.chunk().await {
        match piece {
            Ok(piece) => reply.extend_from_slice(&piece),
            Err(e) => {
                drop(upstream);
                let message = runner_call::failed_mid_answer(&state.scheduler, Some(lease), &e).await;
                return Err(internal(&message, path));
            }
        }
    }
    drop(lease);
    let reply: Value = serde_json::from_slice(&reply)
        .map_err(|e| internal(&format!("the model runner sent an unreadable answer: {e}"), path))?;
    if !status.is_success() {
        let message = reply["error"]["message"].as_str().unwrap_or("the model runner refused the request");
        return Err(ApiError::new(
            if status.is_client_error() { StatusCode::BAD_REQUEST } else { StatusCode::INTERNAL_SERVER_ERROR },
            message,
            path,
        ));
    }
    let mut data: Vec<(u64, Vec<f64>)> = reply["data"]
        .as_array()
        .map(|items| {
            items
                .iter()
                .filter_map(|item| {
                    let index = item["index"].as_u64()?;
                    let vector =
                        item["embedding"].as_array()?.iter().map(Value::as_f64).collect::<Option<Vec<f64>>>()?;
                    Some((index, vector))
                })
                .collect()
        })
        .unwrap_or_default();
    data.sort_by_key(|(index, _)| *index);
    if data.len() != inputs.len() {
        return Err(internal("the model runner returned the wrong number of embeddings", path));
    }
    let prompt_tokens = reply["usage"]["prompt_tokens"].as_u64().unwrap_or(0);
    Ok((model, data.into_iter().map(|(_, v)| v).collect(), load, prompt_tokens))
}

pub(super) fn object(body: &[u8], path: &str) -> Result<Map<String, Value>, ApiError> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(bad("the request body must be a JSON object", path)),
        Err(e) => Err(bad(&format!("invalid JSON: {e}"), path)),
    }
}

pub(super) fn bad(message: &str, path: &str) -> ApiError {
    ApiError::new(StatusCode::BAD_REQUEST, message, path)
}

pub(super) fn internal(message: &str, path: &str) -> ApiError {
    tracing::error!(path, "{message}");
    ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, message, path)
}

/// The scheduler's refusals as HTTP: busy is 503 with a `Retry-After`; a model that
/// cannot fit even with every other one unloaded 507 (the memory each device has is in
/// the message); a failed load by its class ([`load_failed_status`]); the rest 500.
pub(super) fn schedule_error(error: &ScheduleError, path: &str) -> ApiError {
    let status = match error {
        ScheduleError::QueueFull(_) | ScheduleError::BackingOff { .. } | ScheduleError::ShuttingDown => {
            return ApiError::new(StatusCode::SERVICE_UNAVAILABLE, error.to_string(), path)
                .with_header(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        ScheduleError::InsufficientMemory { .. } => StatusCode::INSUFFICIENT_STORAGE,
        ScheduleError::LoadFailed { class, .. } => load_failed_status(*class),
        ScheduleError::NotLoaded(_) => StatusCode::INTERNAL_SERVER_ERROR,
    };
    ApiError::new(status, error.to_string(), path)
}

/// A failed load's status by its class: out of memory 507 (as a model that cannot fit);
/// a bad model file 422 (the request is well formed, the model it names cannot be
/// used); no progress within the load timeout 504; a crash of llama-server 502 (the
/// process corrald fronts failed); anything else (llama-server could not be started)
/// 500.
#[must_use]
pub(super) fn load_failed_status(class: FailureClass) -> StatusCode {
    match class {
        FailureClass::OutOfMemory => StatusCode::INSUFFICIENT_STORAGE,
        FailureClass::BadModel => StatusCode::UNPROCESSABLE_ENTITY,
        FailureClass::Timeout => StatusCode::GATEWAY_TIMEOUT,
        FailureClass::Crashed => StatusCode::BAD_GATEWAY,
        FailureClass::Other => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

pub(super) fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use axum::http::StatusCode;

    use super::schedule_error;
    use crate::scheduler::failure::FailureClass;
    use crate::scheduler::types::ScheduleError;

    #[test]
    fn each_class_of_failed_load_has_its_status_and_the_reason_stays() {
        for (class, status) in [
            (FailureClass::OutOfMemory, StatusCode::INSUFFICIENT_STORAGE),
            (FailureClass::BadModel, StatusCode::UNPROCESSABLE_ENTITY),
            (FailureClass::Timeout, StatusCode::GATEWAY_TIMEOUT),
            (FailureClass::Crashed, StatusCode::BAD_GATEWAY),
            (FailureClass::Other, StatusCode::INTERNAL_SERVER_ERROR),
        ] {
            let error = ScheduleError::LoadFailed { model: "chat".into(), class, reason: "why".into() };
            let api = schedule_error(&error, "/api/chat");
            assert_eq!(api.status(), status, "{class:?}");
            assert_eq!(api.message(), "model 'chat' failed to load: why");
        }
        let refused = ScheduleError::InsufficientMemory {
            model: "chat".into(),
            needed: 2,
            available: 1,
            devices: Vec::new(),
            host: 1,
        };
        assert_eq!(schedule_error(&refused, "/api/chat").status(), StatusCode::INSUFFICIENT_STORAGE);
    }
}
