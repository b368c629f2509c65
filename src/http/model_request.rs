//! What the model-using handlers share: reading the model's name (and a flag) from a
//! request body, building the scheduler's request off the async threads.

use std::sync::Arc;

use serde_json::{Map, Value};

use super::error::{self, ApiError, bad};
use super::state::AppState;
use crate::scheduler::keep_alive::KeepAlive;
use crate::scheduler::request::{self, LoadOverrides, RequestError};
use crate::scheduler::types::ModelRequest;
use crate::store::name::ModelName;
use crate::store::show::ModelDetails;

/// The model a request names (`model`, or Ollama's older `name` when `legacy_name`), as
/// given and parsed.
pub(super) fn model_name(
    request: &Map<String, Value>,
    legacy_name: bool,
    path: &str,
) -> Result<(String, ModelName), ApiError> {
    let value = request.get("model").or_else(|| if legacy_name { request.get("name") } else { None });
    let text = match value {
        Some(Value::String(s)) if !s.trim().is_empty() => s.clone(),
        Some(Value::String(_) | Value::Null) | None => return Err(bad("model is required", path)),
        Some(_) => return Err(bad("model must be a string", path)),
    };
    let name = ModelName::parse(&text).map_err(|e| bad(e.to_string(), path))?;
    Ok((text, name))
}

/// The client's `options` (an object, or none; the load options in it are read by
/// [`load_options`], the rest are sampling options) and `keep_alive` (Ollama's forms,
/// read by the request parser, as D-Bus reads its own).
pub(super) fn options_and_keep_alive(
    request: &Map<String, Value>,
    path: &str,
) -> Result<(Map<String, Value>, Option<KeepAlive>), ApiError> {
    let options = match request.get("options") {
        None | Some(Value::Null) => Map::new(),
        Some(Value::Object(map)) => map.clone(),
        Some(_) => return Err(bad("options must be an object", path)),
    };
    let keep_alive = request::keep_alive(request, "keep_alive").map_err(|e| bad(e.to_string(), path))?;
    Ok((options, keep_alive))
}

/// A model's details ([`Store::details_async`](crate::store::Store::details_async)).
pub(super) async fn details(
    state: &AppState,
    name: &ModelName,
    given: &str,
    path: &str,
) -> Result<Arc<ModelDetails>, ApiError> {
    state.store.details_async(name).await.map_err(|e| error::request(RequestError::Store(e), given, path))
}

/// The typed load options of a body's `options`, through the request parser's JSON
/// adapter: a bad one is a 400 naming it.
pub(super) fn load_options(options: &Map<String, Value>, given: &str, path: &str) -> Result<LoadOverrides, ApiError> {
    LoadOverrides::parse(options).map_err(|e| error::request(e, given, path))
}

/// The scheduler's request for `name` with the client's options.
pub(super) async fn build(
    state: &AppState,
    name: ModelName,
    given: &str,
    options: Map<String, Value>,
    keep_alive: Option<KeepAlive>,
    path: &str,
) -> Result<ModelRequest, ApiError> {
    let shown = details(state, &name, given, path).await?;
    let options = load_options(&options, given, path)?;
    request::from_details(&state.store, &shown, &options, keep_alive, false, state.defaults)
        .map_err(|e| error::request(e, given, path))
}

/// A request's `field` as a boolean, `default` when it is absent or null.
pub(super) fn boolean(request: &Map<String, Value>, field: &str, default: bool, path: &str) -> Result<bool, ApiError> {
    match request.get(field) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(bad(format!("{field} must be true or false"), path)),
    }
}
