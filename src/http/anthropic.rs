//! Anthropic's Messages API: `POST /v1/messages` and `/v1/messages/count_tokens` pass
//! through to the same endpoints of the leased runner, as OpenAI's do
//! ([`openai::pass_through`]): the model's name rewritten, the runner's answer and its
//! events forwarded as they come. corral's own errors, and the runner's refusals, come in
//! Anthropic's shape (`{"type": "error", "error": {"type", "message"}}`), which is what
//! Anthropic's clients read.

use axum::body::Bytes;
use axum::extract::State;
use axum::response::Response;

use super::error::ApiError;
use super::openai::{self, Needs};
use super::state::AppState;

/// `POST /v1/messages`.
pub async fn messages(State(state): State<AppState>, body: Bytes) -> Result<Response, ApiError> {
    openai::pass_through(&state, &body, "/v1/messages", Needs::Generation).await
}

/// `POST /v1/messages/count_tokens`: the runner tokenizes the request as its chat
/// template renders it, so the model is loaded as for a message.
pub async fn count_tokens(State(state): State<AppState>, body: Bytes) -> Result<Response, ApiError> {
    openai::pass_through(&state, &body, "/v1/messages/count_tokens", Needs::Generation).await
}
