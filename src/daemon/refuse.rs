//! With a rejected configuration: the connections systemd passed answered with 503.

use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::http::listeners;

/// With a rejected configuration: answers the connections systemd passed (the ones that
/// started this instance, and those that come while it lingers) with 503 and where to look,
/// until none came for a few seconds.  Without this, each waiting connection would start
/// corrald again, and five failed starts in ten seconds stop corrald.socket.
pub async fn refuse(sockets: Vec<(String, OwnedFd)>) {
    /// The quiet time before exiting: longer than the start limit's 10 s / 5 starts, so a
    /// steady client can never drive corrald.socket into its start limit.
    const QUIET: Duration = Duration::from_secs(3);
    /// The longest stay, well within systemd's start timeout.
    const LINGER: Duration = Duration::from_secs(30);
    if sockets.is_empty() {
        return;
    }
    let listeners = match listeners::adopt(sockets) {
        Ok(listeners) => listeners,
        Err(e) => {
            tracing::warn!(error = %e, "cannot answer the waiting connections: {e}");
            return;
        }
    };
    // The reason stays in the journal: a rejected value may be a secret (a token written
    // where a list belongs), and this answer goes to anyone who can reach the socket,
    // before any Host rule or token applies.
    let message = "corrald is not running: its configuration is rejected; an administrator can see why with \
                   `journalctl -u corrald` or `corrald --check-config`";
    let body = Arc::new(serde_json::json!({ "error": message }).to_string());
    let answered = Arc::new(AtomicU64::new(0));
    let router = axum::Router::new().fallback({
        let (body, answered) = (body.clone(), answered.clone());
        move || {
            answered.fetch_add(1, Ordering::Relaxed);
            let body = (*body).clone();
            async move {
                (
                    axum::http::StatusCode::SERVICE_UNAVAILABLE,
                    [(axum::http::header::CONTENT_TYPE, "application/json; charset=utf-8")],
                    body,
                )
            }
        }
    });
    let shutdown = CancellationToken::new();
    let mut servers = JoinSet::new();
    for listener in listeners {
        // Short answers only: a client that reads nothing of one is let go as soon.
        let timeouts = listeners::Timeouts { header: Duration::from_secs(5), send: Duration::from_secs(5) };
        servers.spawn(listener.serve(router.clone(), timeouts, shutdown.clone()));
    }
    let started = Instant::now();
    loop {
        let before = answered.load(Ordering::Relaxed);
        tokio::time::sleep(QUIET).await;
        if answered.load(Ordering::Relaxed) == before || started.elapsed() >= LINGER {
            break;
        }
    }
    shutdown.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(2), async { while servers.join_next().await.is_some() {} }).await;
    tracing::info!(
        answered = answered.load(Ordering::Relaxed),
        "answered {} waiting requests with the configuration error",
        answered.load(Ordering::Relaxed)
    );
}
