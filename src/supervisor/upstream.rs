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
        let (response, driver) = send(socket, method, path, body).await?;
        let status = response.status();
        let body = response.into_body().collect().await?.to_bytes();
        driver.abort();
        Ok((status, body))
    };
    tokio::time::timeout(timeout, exchange).await.map_err(|_| UpstreamError::Timeout(timeout))?
}

/// Connects to the runner, sends one request, and returns the response (headers read,
/// body not yet) with the task that drives the connection.
async fn send(
    socket: &Path,
    method: Method,
    path: &'static str,
    body: Bytes,
) -> Result<(hyper::Response<hyper::body::Incoming>, tokio::task::JoinHandle<Result<(), hyper::Error>>), UpstreamError>
{
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
    match sender.send_request(request).await {
        Ok(response) => Ok((response, driver)),
        Err(e) => {
            driver.abort();
            Err(e.into())
        }
    }
}

/// A runner's response body, read as it arrives. Dropping it closes the connection,
/// which makes llama-server cancel the generation.
#[derive(Debug)]
pub struct BodyStream {
    body: hyper::body::Incoming,
    driver: tokio::task::JoinHandle<Result<(), hyper::Error>>,
    content_type: Option<hyper::header::HeaderValue>,
}

impl BodyStream {
    /// The runner's `Content-Type` for this body, if it sent one.
    #[must_use]
    pub fn content_type(&self) -> Option<&hyper::header::HeaderValue> {
        self.content_type.as_ref()
    }

    /// The next piece of the body as the runner sent it; `None` at its end.
    ///
    /// # Errors
    /// The connection failed mid-body.
    pub async fn chunk(&mut self) -> Option<Result<Bytes, hyper::Error>> {
        loop {
            match self.body.frame().await? {
                Ok(frame) => {
                    if let Ok(data) = frame.into_data() {
                        return Some(Ok(data));
                    }
                    // Trailers: nothing to forward.
                }
                Err(e) => return Some(Err(e)),
            }
        }
    }
}

impl Drop for BodyStream {
    fn drop(&mut self) {
        // Ends the connection task, which closes the socket.
        self.driver.abort();
    }
}

/// `POST path` with a JSON body on the runner at `socket`, on a new connection; returns
/// the status once the headers arrive (within `timeout`) and the body as a stream.
///
/// # Errors
/// The socket refused, the exchange failed, or no headers came in time.
pub async fn post_json_stream(
    socket: &Path,
    path: &'static str,
    body: Vec<u8>,
    timeout: Duration,
) -> Result<(StatusCode, BodyStream), UpstreamError> {
    let exchange = async {
        let (response, driver) = send(socket, Method::POST, path, Bytes::from(body)).await?;
        let status = response.status();
        let content_type = response.headers().get(hyper::header::CONTENT_TYPE).cloned();
        Ok((status, BodyStream { body: response.into_body(), driver, content_type }))
    };
    tokio::time::timeout(timeout, exchange).await.map_err(|_| UpstreamError::Timeout(timeout))?
}
