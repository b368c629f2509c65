//! The one way a handler reaches a runner: a lease from the scheduler, then a request on
//! the runner's socket, retried once on a fresh load when the leased runner turns out
//! dead before anything came back.
//!
//! A runner can die in the instant before the scheduler hears of it (a crash, an OOM
//! kill): the scheduler then still leases it, and the request finds its socket refusing
//! or closing. Nothing was sent to the client yet and nothing was generated, so the
//! request tells the scheduler the runner is dead (it takes it out of service and
//! stops it), takes a new lease (a fresh load), and sends once more. A second failure
//! is the client's error. Every proxied route goes through [`send`].

use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::http::StatusCode;
use serde_json::Value;

use super::error::{self, ApiError, internal};
use super::state::AppState;
use crate::scheduler::handle::{Handle, Lease};
use crate::scheduler::types::ModelRequest;
use crate::supervisor::upstream::{BodyStream, UpstreamError};

/// A request on its way: the lease held while its answer is read, the answer's status
/// and body, and how long it waited for the runner (loads included).
pub(super) struct Answer {
    pub lease: Lease,
    pub status: StatusCode,
    pub body: BodyStream,
    pub waited: Duration,
}

/// Leases a runner for `request` and posts `body` to its `upstream_path`; returns once
/// the answer's headers arrived (within `timeout`).
pub(super) async fn send(
    state: &AppState,
    request: ModelRequest,
    upstream_path: &'static str,
    body: Vec<u8>,
    timeout: Duration,
    path: &str,
) -> Result<Answer, ApiError> {
    let started = Instant::now();
    // Shared, not copied, between the two tries.
    let body = Bytes::from(body);
    let retry = request.clone();
    let lease = state.scheduler.acquire(request).await.map_err(|e| error::schedule(&e, path))?;
    let lease = match state.upstream.post_json_stream(lease.socket(), upstream_path, body.clone(), timeout).await {
        Ok((status, body)) => return Ok(Answer { lease, status, body, waited: started.elapsed() }),
        Err(e) if e.runner_gone() => {
            tracing::warn!(
                corral_model = %retry.name,
                runner = lease.runner(),
                path,
                error = %e,
                "the leased runner is gone; loading {} again for the request",
                retry.name
            );
            state.scheduler.report_dead(lease).await;
            state.scheduler.acquire(retry).await.map_err(|e| error::schedule(&e, path))?
        }
        Err(e) => return Err(unanswered(&e, path)),
    };
    let (status, body) = state
        .upstream
        .post_json_stream(lease.socket(), upstream_path, body, timeout)
        .await
        .map_err(|e| unanswered(&e, path))?;
    Ok(Answer { lease, status, body, waited: started.elapsed() })
}

/// The runner failed before its answer began.
pub(super) fn unanswered(error: &UpstreamError, path: &str) -> ApiError {
    internal(format!("the model runner did not answer: {error}"), path)
}

/// The most of a runner's refusal that is read: its error is a line or two.
const MAX_REFUSAL: usize = 1 << 20;

/// A runner's refusal (an answer whose status is not a success) read whole: its JSON, or
/// null when it is none, is cut short, or passes [`MAX_REFUSAL`].
pub(super) async fn refusal(body: BodyStream) -> Value {
    json_answer(body, MAX_REFUSAL).await
}

/// A runner's answer read whole as JSON: null when it is none, is cut short, or passes
/// `max` bytes.
pub(super) async fn json_answer(mut body: BodyStream, max: usize) -> Value {
    let mut reply = Vec::new();
    while let Some(piece) = body.chunk().await {
        match piece {
            Ok(piece) if reply.len() + piece.len() <= max => reply.extend_from_slice(&piece),
            _ => return Value::Null,
        }
    }
    serde_json::from_slice(&reply).unwrap_or(Value::Null)
}

/// How long a request whose runner died under it waits to learn why (the runner reaped,
/// the workers it used checked) before it answers with what it has.
const FATE_WAIT: Duration = Duration::from_secs(5);

/// The runner failed in the middle of its answer. One that fell silent is stopped (the
/// scheduler replaces it for the next request): a runner that stalls once holds its
/// slots and would stall the next client too. One that broke off is asked after: the
/// message says why it ended (a worker that went down is named), within [`FATE_WAIT`].
pub(super) async fn failed_mid_answer(scheduler: &Handle, lease: Option<Lease>, error: &UpstreamError) -> String {
    match (error, lease) {
        (UpstreamError::Stalled(_), Some(lease)) => {
            tracing::error!(runner = lease.runner(), error = %error, "the model runner fell silent mid-answer; stopping it");
            scheduler.report_dead(lease).await;
        }
        (error, Some(lease)) if error.runner_gone() => {
            let runner = lease.runner();
            drop(lease);
            if let Ok(Some(fate)) = tokio::time::timeout(FATE_WAIT, scheduler.fate(runner)).await {
                return format!("the model runner failed mid-answer: {fate}");
            }
        }
        _ => {}
    }
    format!("the model runner failed mid-answer: {error}")
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use serde_json::{Value, json};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::json_answer;
    use crate::supervisor::upstream::Pool;

    /// A runner's answer is read only up to its bound: past it, the answer is null, not
    /// held (a runner's error that echoed a whole request would otherwise be kept whole).
    #[tokio::test]
    async fn a_runners_answer_is_read_at_most_to_its_bound() {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("runner.sock");
        let listener = tokio::net::UnixListener::bind(&socket).expect("bind");
        let body = json!({ "error": { "message": "x".repeat(4096) } }).to_string();
        let served = body.clone();
        tokio::spawn(async move {
            for _ in 0..2 {
                let (mut stream, _) = listener.accept().await.expect("accept");
                let mut head = [0u8; 4096];
                let _ = stream.read(&mut head).await;
                let answer = format!("HTTP/1.1 400 Bad Request\r\ncontent-length: {}\r\n\r\n{served}", served.len());
                let _ = stream.write_all(answer.as_bytes()).await;
            }
        });
        let pool = Pool::new(Duration::from_secs(5));
        for (max, whole) in [(body.len(), true), (body.len() - 1, false)] {
            let (_, answer) =
                pool.post_json_stream(&socket, "/x", b"{}".to_vec(), Duration::from_secs(5)).await.expect("post");
            let read = json_answer(answer, max).await;
            assert_eq!(read != Value::Null, whole, "read within {max} bytes");
        }
    }
}
