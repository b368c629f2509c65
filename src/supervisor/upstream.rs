//! HTTP to a runner over its private UNIX socket.
//!
//! One request on a fresh connection: the readiness check, and the API's non-streaming
//! calls. A pool of kept-alive connections for the streaming API builds on the same
//! transport.

use std::path::Path;
use std::time::Duration;

use axum::body::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request, StatusCode};
use hyper_util::rt::TokioIo;

/// Why a request to a runner failed.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    /// The socket refused or is missing.
    #[error("cannot connect to {socket}: {source}")]
    Connect {
        /// The runner's socket.
        socket: String,
        /// The cause.
        source: std::io::Error,
    },
    /// The HTTP exchange failed.
    #[error("request to the runner failed: {0}")]
    Http(#[from] hyper::Error),
    /// No answer in time.
    #[error("the runner did not answer within {0:?}")]
    Timeout(Duration),
}

/// `GET path` on the runner at `socket`, on a new connection; returns status and body.
pub async fn get(socket: &Path, path: &'static str, timeout: Duration) -> Result<(StatusCode, Bytes), UpstreamError> {
    request(socket, Method::GET, path, Bytes::new(), timeout).await
}

/// `POST path` with a JSON body on the runner at `socket`, on a new connection; returns
/// status and body.
pub async fn post_json(
    socket: &Path,
    path: &'static str,
    body: Vec<u8>,
    timeout: Duration,
) -> Result<(StatusCode, Bytes), UpstreamError> {
    request(socket, Method::POST, path, Bytes::from(body), timeout).await
}

async fn request(
    socket: &Path,
    method: Method,
    path: &'static str,
    body: Bytes,
    timeout: Duration,
) -> Result<(StatusCode, Bytes), UpstreamError> {
    let exchange = async {
        let stream = tokio::net::UnixStream::connect(socket)
            .await
            .map_err(|source| UpstreamError::Connect { socket: socket.display().to_string(), source })?;
        let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        let driver = tokio::spawn(connection);
        let request = Request::builder()
            .method(method)
            .uri(path)
            .header("host", "runner")
            .header("content-type", "application/json")
            .body(Full::new(body))
            .expect("a literal path, method and headers make a valid request");
        let response = sender.send_request(request).await?;
        let status = response.status();
        let body = response.into_body().collect().await?.to_bytes();
        driver.abort();
        Ok((status, body))
    };
    tokio::time::timeout(timeout, exchange).await.map_err(|_| UpstreamError::Timeout(timeout))?
}
