//! HTTP to a runner over its private UNIX socket.
//!
//! The readiness check goes on a fresh connection ([`get`]); the API's requests go
//! through a [`Pool`], which keeps connections alive between them, so that a short
//! request does not pay for a new connection (connect, handshake, a connection task, and
//! llama-server handing the new socket to a thread) each time. llama-server closes a
//! connection once it streamed an answer, so the pool then opens the next one at once,
//! off the request's path: a chat's next turn starts on a connection that is ready.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper::{Method, Request, StatusCode};
use hyper_util::rt::TokioIo;

use crate::sync::lock;

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
    #[error("the runner did not answer within {}", crate::durations::human(*.0))]
    Timeout(Duration),
    /// The runner fell silent in the middle of its answer.
    #[error("the runner sent nothing for {} in the middle of its answer", crate::durations::human(*.0))]
    Stalled(Duration),
}

impl UpstreamError {
    /// Whether the runner is gone rather than slow or refusing: nothing listens on its
    /// socket (refused, missing), or it dropped a fresh connection before answering
    /// (closed, reset). A request that failed so got nothing from the runner, so it may
    /// be sent again to another runner.
    #[must_use]
    pub fn runner_gone(&self) -> bool {
        match self {
            Self::Connect { source, .. } => matches!(
                source.kind(),
                std::io::ErrorKind::ConnectionRefused
                    | std::io::ErrorKind::NotFound
                    | std::io::ErrorKind::ConnectionReset
                    | std::io::ErrorKind::ConnectionAborted
            ),
            Self::Http(e) => connection_lost(e),
            Self::Timeout(_) | Self::Stalled(_) => false,
        }
    }
}

/// A request that failed because its connection closed or broke before the answer began.
fn connection_lost(error: &hyper::Error) -> bool {
    use std::error::Error as _;

    if error.is_incomplete_message() || error.is_canceled() || error.is_closed() {
        return true;
    }
    let mut source = error.source();
    while let Some(cause) = source {
        if let Some(io) = cause.downcast_ref::<std::io::Error>() {
            return matches!(
                io.kind(),
                std::io::ErrorKind::ConnectionReset
                    | std::io::ErrorKind::BrokenPipe
                    | std::io::ErrorKind::ConnectionAborted
                    | std::io::ErrorKind::UnexpectedEof
            );
        }
        source = cause.source();
    }
    false
}

/// The most bytes of an answer [`get`] reads (`/health` answers a few bytes).
const GET_MAX: usize = 1 << 20;

/// `GET path` on the runner at `socket`, on a new connection; returns status and body
/// (at most 1 MiB of it).
pub async fn get(socket: &Path, path: &'static str, timeout: Duration) -> Result<(StatusCode, Bytes), UpstreamError> {
    let exchange = async {
        let (response, driver) = send(socket, Method::GET, path, Bytes::new()).await?;
        let status = response.status();
        let mut body = Vec::new();
        let mut stream = response.into_body();
        while let Some(frame) = stream.frame().await {
            if let Ok(data) = frame?.into_data() {
                body.extend_from_slice(&data[..data.len().min(GET_MAX - body.len())]);
            }
            if body.len() == GET_MAX {
                break;
            }
        }
        let body = Bytes::from(body);
        driver.abort();
        Ok((status, body))
    };
    tokio::time::timeout(timeout, exchange).await.map_err(|_| UpstreamError::Timeout(timeout))?
}

type Driver = tokio::task::JoinHandle<Result<(), hyper::Error>>;

/// An open connection to a runner: the request half and the task driving it.
#[derive(Debug)]
struct Connection {
    sender: SendRequest<Full<Bytes>>,
    driver: Driver,
    /// Requests sent on it so far.
    uses: u32,
    /// When it last finished a request.
    idle_since: Instant,
}

impl Connection {
    async fn open(socket: &Path) -> Result<Self, UpstreamError> {
        let stream = tokio::net::UnixStream::connect(socket)
            .await
            .map_err(|source| UpstreamError::Connect { socket: socket.display().to_string(), source })?;
        let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        Ok(Self { sender, driver: tokio::spawn(connection), uses: 0, idle_since: Instant::now() })
    }

    async fn send(
        &mut self,
        method: Method,
        path: &'static str,
        body: Bytes,
    ) -> Result<hyper::Response<hyper::body::Incoming>, hyper::Error> {
        self.uses += 1;
        let request = Request::builder()
            .method(method)
            .uri(path)
            .header("host", "runner")
            .header("content-type", "application/json")
            .body(Full::new(body))
            .expect("a literal path, method and headers make a valid request");
        self.sender.send_request(request).await
    }
}

/// Connects to the runner, sends one request, and returns the response (headers read,
/// body not yet) with the task that drives the connection.
async fn send(
    socket: &Path,
    method: Method,
    path: &'static str,
    body: Bytes,
) -> Result<(hyper::Response<hyper::body::Incoming>, Driver), UpstreamError> {
    let mut connection = Connection::open(socket).await?;
    match connection.send(method, path, body).await {
        Ok(response) => Ok((response, connection.driver)),
        Err(e) => {
            connection.driver.abort();
            Err(e.into())
        }
    }
}

/// A runner's response body, read as it arrives. Dropping it before its end closes the
/// connection, which makes llama-server cancel the generation; read to its end, the
/// connection goes back to its pool (if it came from one and may serve another request).
#[derive(Debug)]
pub struct BodyStream {
    body: hyper::body::Incoming,
    driver: Option<Driver>,
    /// Where the connection goes back once the body ended.
    give_back: Option<(Pool, PathBuf, SendRequest<Full<Bytes>>, u32)>,
    /// The pool that gets a new connection in place of this one once the body ended
    /// (llama-server closes a connection after a stream).
    replace: Option<(Pool, PathBuf)>,
    content_type: Option<hyper::header::HeaderValue>,
    /// The longest silence allowed between two pieces of the body.
    idle_timeout: Duration,
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
    /// The connection failed mid-body, or the runner sent nothing for the pool's stream
    /// idle timeout ([`UpstreamError::Stalled`]; the connection is then useless: the
    /// caller drops it, which closes it).
    pub async fn chunk(&mut self) -> Option<Result<Bytes, UpstreamError>> {
        loop {
            let Ok(frame) = tokio::time::timeout(self.idle_timeout, self.body.frame()).await else {
                return Some(Err(UpstreamError::Stalled(self.idle_timeout)));
            };
            let Some(frame) = frame else {
                self.ended();
                return None;
            };
            match frame {
                Ok(frame) => {
                    if let Ok(data) = frame.into_data() {
                        return Some(Ok(data));
                    }
                    // Trailers: nothing to forward.
                }
                Err(e) => return Some(Err(e.into())),
            }
        }
    }
}

impl BodyStream {
    /// The whole body has arrived: the connection may serve the next request.
    fn ended(&mut self) {
        // Without a pool to go back to, the driver stays for `drop` to end the connection.
        if let Some((pool, socket, sender, uses)) = self.give_back.take() {
            if let Some(driver) = self.driver.take() {
                pool.put(socket, Connection { sender, driver, uses, idle_since: Instant::now() });
            }
        }
        if let Some((pool, socket)) = self.replace.take() {
            tokio::spawn(async move { pool.open_spare(socket).await });
        }
    }
}

impl Drop for BodyStream {
    fn drop(&mut self) {
        // Before its end: ends the connection task, which closes the socket.
        if let Some(driver) = &self.driver {
            driver.abort();
        }
    }
}

/// Idle connections by runner socket, the most recently used last.
type Idle = HashMap<PathBuf, Vec<Connection>>;

/// Idle connections to runners, kept between requests. Cheap to clone (shared).
///
/// llama-server closes an idle connection after 5 s and any connection after 100
/// requests, and closes a connection once it streamed server-sent events; a connection is
/// therefore kept only after a plain (not `text/event-stream`) answer, reused only
/// within `Pool::MAX_IDLE` and below `Pool::MAX_USES`, and sent on only when it is
/// ready, so a request does not go out on a connection the runner is closing. After a
/// streamed answer a new connection is opened in its place, so the next request (a chat's
/// next turn) does not wait for one.
#[derive(Debug, Clone)]
pub struct Pool {
    idle: Arc<Mutex<Idle>>,
    /// How long a runner may fall silent in the middle of an answer.
    stream_idle_timeout: Duration,
}

impl Default for Pool {
    fn default() -> Self {
        Self::new(Self::DEFAULT_STREAM_IDLE_TIMEOUT)
    }
}

impl Pool {
    /// `[runner] stream_idle_timeout`'s default.
    pub const DEFAULT_STREAM_IDLE_TIMEOUT: Duration = Duration::from_secs(5 * 60);

    /// A pool whose answers fail once the runner sent nothing for `stream_idle_timeout`.
    #[must_use]
    pub fn new(stream_idle_timeout: Duration) -> Self {
        Self { idle: Arc::default(), stream_idle_timeout }
    }

    /// How long a connection may have been idle and still be used (llama-server: 5 s).
    const MAX_IDLE: Duration = Duration::from_secs(2);
    /// Requests per connection (llama-server closes after 100).
    const MAX_USES: u32 = 90;
    /// Idle connections kept per runner. llama-server serves each open connection on
    /// one of its few HTTP threads (`max(parallel + 2, cores - 1)`), and an idle one holds
    /// its thread until the 5 s timeout: with 16 kept, 8 concurrent clients fell from
    /// about 1600 to 40 requests/s. One kept connection serves a lone client without a
    /// new connection each time; connections beyond it close after their request.
    const MAX_PER_RUNNER: usize = 1;

    /// A kept connection to `socket` that can take a request now, if any.
    fn take(&self, socket: &Path) -> Option<Connection> {
        let mut idle = lock(&self.idle);
        let kept = idle.get_mut(socket)?;
        let mut found = None;
        while let Some(connection) = kept.pop() {
            if connection.idle_since.elapsed() < Self::MAX_IDLE
                && !connection.sender.is_closed()
                && !connection.driver.is_finished()
            {
                found = Some(connection);
                break;
            }
            connection.driver.abort();
        }
        if kept.is_empty() {
            idle.remove(socket);
        }
        found
    }

    /// Opens a connection to `socket` for the next request, unless one is kept already.
    /// A runner that went away in the meantime simply gets none.
    async fn open_spare(&self, socket: PathBuf) {
        if lock(&self.idle).contains_key(&socket) {
            return;
        }
        if let Ok(connection) = Connection::open(&socket).await {
            self.put(socket, connection);
        }
    }

    fn put(&self, socket: PathBuf, connection: Connection) {
        if connection.uses >= Self::MAX_USES || connection.sender.is_closed() {
            connection.driver.abort();
            return;
        }
        let mut idle = lock(&self.idle);
        // Runners come and go: forget connections to ones that closed them.
        idle.retain(|_, kept| {
            kept.retain(|c| c.idle_since.elapsed() < Self::MAX_IDLE && !c.driver.is_finished());
            !kept.is_empty()
        });
        let kept = idle.entry(socket).or_default();
        if kept.len() < Self::MAX_PER_RUNNER {
            kept.push(connection);
        } else {
            connection.driver.abort();
        }
    }

    /// `POST path` with a JSON body on the runner at `socket`, on a kept connection when
    /// one is ready, else a new one; returns the status once the headers arrive (within
    /// `timeout`) and the body as a stream. The connection is kept for the next request
    /// once the body was read to its end.
    ///
    /// # Errors
    /// The socket refused, the exchange failed, or no headers came in time.
    pub async fn post_json_stream(
        &self,
        socket: &Path,
        path: &'static str,
        body: impl Into<Bytes>,
        timeout: Duration,
    ) -> Result<(StatusCode, BodyStream), UpstreamError> {
        let body: Bytes = body.into();
        let exchange = async {
            let mut kept = self.take(socket);
            // A kept connection is ready at once unless the runner is closing it.
            if let Some(connection) = &mut kept {
                if connection.sender.ready().await.is_err() {
                    connection.driver.abort();
                    kept = None;
                }
            }
            let reused = kept.is_some();
            let mut connection = match kept {
                Some(connection) => connection,
                None => Connection::open(socket).await?,
            };
            let response = match connection.send(Method::POST, path, body.clone()).await {
                Ok(response) => response,
                // The runner closed a kept connection as the request went out (its idle
                // timeout): nothing reached it, so the request goes again on a new one.
                Err(e) if reused && connection_lost(&e) => {
                    connection.driver.abort();
                    connection = Connection::open(socket).await?;
                    match connection.send(Method::POST, path, body).await {
                        Ok(response) => response,
                        Err(e) => {
                            connection.driver.abort();
                            return Err(e.into());
                        }
                    }
                }
                Err(e) => {
                    connection.driver.abort();
                    return Err(e.into());
                }
            };
            let status = response.status();
            let content_type = response.headers().get(hyper::header::CONTENT_TYPE).cloned();
            let streamed = content_type.as_ref().is_some_and(|t| t.as_bytes().starts_with(b"text/event-stream"));
            let Connection { sender, driver, uses, .. } = connection;
            let (give_back, replace) = if streamed {
                (None, Some((self.clone(), socket.to_owned())))
            } else {
                (Some((self.clone(), socket.to_owned(), sender, uses)), None)
            };
            let body = response.into_body();
            let idle_timeout = self.stream_idle_timeout;
            Ok((status, BodyStream { body, driver: Some(driver), give_back, replace, content_type, idle_timeout }))
        };
        tokio::time::timeout(timeout, exchange).await.map_err(|_| UpstreamError::Timeout(timeout))?
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    /// A minimal HTTP/1.1 server on a UNIX socket that answers every request on a
    /// connection with `content_type`; counts the connections it accepted and those the
    /// client closed.
    fn serve(socket: &Path, content_type: &'static str) -> (Arc<AtomicUsize>, Arc<AtomicUsize>) {
        let listener = tokio::net::UnixListener::bind(socket).expect("bind");
        let accepted = Arc::new(AtomicUsize::new(0));
        let closed = Arc::new(AtomicUsize::new(0));
        let (count, ends) = (Arc::clone(&accepted), Arc::clone(&closed));
        tokio::spawn(async move {
            loop {
                let (mut stream, _) = listener.accept().await.expect("accept");
                count.fetch_add(1, Ordering::SeqCst);
                let ends = Arc::clone(&ends);
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    let mut chunk = [0u8; 4096];
                    loop {
                        // One request: the head, then a body of its content-length.
                        let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
                            match stream.read(&mut chunk).await {
                                Ok(0) | Err(_) => {
                                    ends.fetch_add(1, Ordering::SeqCst);
                                    return;
                                }
                                Ok(n) => buf.extend_from_slice(&chunk[..n]),
                            }
                            continue;
                        };
                        let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
                        let length: usize = head
                            .lines()
                            .find_map(|l| l.strip_prefix("content-length: "))
                            .map_or(0, |v| v.trim().parse().expect("length"));
                        while buf.len() < end + 4 + length {
                            match stream.read(&mut chunk).await {
                                Ok(0) | Err(_) => return,
                                Ok(n) => buf.extend_from_slice(&chunk[..n]),
                            }
                        }
                        buf.drain(..end + 4 + length);
                        let answer =
                            format!("HTTP/1.1 200 OK\r\ncontent-type: {content_type}\r\ncontent-length: 2\r\n\r\n{{}}");
                        if stream.write_all(answer.as_bytes()).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        (accepted, closed)
    }

    /// A `GET` reads at most [`GET_MAX`] bytes of an answer, however long the runner's
    /// (a health check answered with an endless body holds nothing more).
    #[tokio::test]
    async fn a_get_reads_at_most_its_bound() {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("runner.sock");
        let listener = tokio::net::UnixListener::bind(&socket).expect("bind");
        tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.expect("accept");
            let mut head = [0u8; 1024];
            let _ = stream.read(&mut head).await;
            let body = vec![b'x'; 3 * GET_MAX];
            let answer = format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n", body.len());
            let _ = stream.write_all(answer.as_bytes()).await;
            let _ = stream.write_all(&body).await;
        });
        let (status, body) = get(&socket, "/health", Duration::from_secs(5)).await.expect("get");
        assert_eq!((status, body.len()), (StatusCode::OK, GET_MAX));
    }

    /// Sends a request; returns once its answer's headers arrived.
    async fn start(pool: &Pool, socket: &Path) -> BodyStream {
        let (status, body) = pool
            .post_json_stream(socket, "/v1/completions", b"{}".to_vec(), Duration::from_secs(5))
            .await
            .expect("post");
        assert_eq!(status, StatusCode::OK);
        body
    }

    /// Sends a request and reads its whole answer.
    async fn post(pool: &Pool, socket: &Path) -> Bytes {
        let mut body = start(pool, socket).await;
        let mut all = Vec::new();
        while let Some(piece) = body.chunk().await {
            all.extend_from_slice(&piece.expect("piece"));
        }
        Bytes::from(all)
    }

    /// Waits up to 5 s for `condition` (the caller then asserts it).
    async fn until(condition: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while !condition() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    #[tokio::test]
    async fn a_plain_answer_read_to_its_end_leaves_the_connection_for_the_next_request() {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("runner.sock");
        let (accepted, _) = serve(&socket, "application/json");
        let pool = Pool::default();
        for _ in 0..5 {
            assert_eq!(post(&pool, &socket).await, Bytes::from_static(b"{}"));
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn a_streamed_answer_closes_its_connection_and_leaves_a_new_one_for_the_next_request() {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("runner.sock");
        let (accepted, closed) = serve(&socket, "text/event-stream");
        let pool = Pool::default();
        post(&pool, &socket).await;
        // Its replacement is opened after the stream, off the request's path.
        until(|| (accepted.load(Ordering::SeqCst), closed.load(Ordering::SeqCst)) == (2, 1)).await;
        assert_eq!(
            (accepted.load(Ordering::SeqCst), closed.load(Ordering::SeqCst)),
            (2, 1),
            "the streamed connection closed (llama-server closes it) and a spare is open"
        );
        // The next stream goes out on the spare: no connection is opened on its path.
        let body = start(&pool, &socket).await;
        assert_eq!(accepted.load(Ordering::SeqCst), 2, "the spare carried the request");
        drop(body);
    }

    #[tokio::test]
    async fn a_body_dropped_before_its_end_closes_its_connection_and_opens_no_other() {
        let dir = tempfile::tempdir().expect("tempdir");
        let plain = dir.path().join("plain.sock");
        let (accepted, closed) = serve(&plain, "application/json");
        let pool = Pool::default();
        drop(start(&pool, &plain).await);
        until(|| closed.load(Ordering::SeqCst) >= 1).await;
        assert_eq!(closed.load(Ordering::SeqCst), 1, "the dropped body's connection is closed");
        post(&pool, &plain).await;
        assert_eq!(accepted.load(Ordering::SeqCst), 2, "the next request needed a new connection");
    }

    #[tokio::test]
    async fn a_kept_connection_that_closed_is_replaced_by_a_new_one() {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("runner.sock");
        let (accepted, _) = serve(&socket, "application/json");
        let pool = Pool::default();
        post(&pool, &socket).await;
        // The kept connection ends (as when llama-server closes it after 5 s idle).
        {
            let mut idle = pool.idle.lock().expect("lock");
            let kept = idle.get_mut(socket.as_path()).expect("kept");
            kept[0].driver.abort();
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(post(&pool, &socket).await, Bytes::from_static(b"{}"));
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
    }

    /// A server on `socket` that reads one request head per connection and hands the
    /// stream to `answer`.
    fn serve_with(
        socket: &Path,
        answer: impl Fn(tokio::net::UnixStream) -> futures_util::future::BoxFuture<'static, ()> + Send + 'static,
    ) {
        let listener = tokio::net::UnixListener::bind(socket).expect("bind");
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let mut head = Vec::new();
                let mut byte = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") {
                    if stream.read(&mut byte).await.unwrap_or(0) == 0 {
                        break;
                    }
                    head.push(byte[0]);
                }
                tokio::spawn(answer(stream));
            }
        });
    }

    #[tokio::test]
    async fn a_runner_with_nothing_listening_or_that_drops_the_request_is_gone_and_a_slow_one_is_not() {
        let dir = tempfile::tempdir().expect("tempdir");
        let pool = Pool::default();
        let post = |socket: PathBuf, timeout: Duration| {
            let pool = pool.clone();
            async move { pool.post_json_stream(&socket, "/completion", b"{}".to_vec(), timeout).await.map(|_| ()) }
        };
        let missing = post(dir.path().join("missing.sock"), Duration::from_secs(5)).await.expect_err("no socket");
        assert!(missing.runner_gone(), "{missing}");
        // A socket file whose listener is gone (the process died): refused.
        let stale = dir.path().join("stale.sock");
        drop(std::os::unix::net::UnixListener::bind(&stale).expect("bind"));
        let refused = post(stale, Duration::from_secs(5)).await.expect_err("refused");
        assert!(refused.runner_gone(), "{refused}");
        // Accepted, then closed without an answer (the process died with the request).
        let closing = dir.path().join("closing.sock");
        serve_with(&closing, |stream| Box::pin(async move { drop(stream) }));
        let dropped = post(closing, Duration::from_secs(5)).await.expect_err("closed");
        assert!(dropped.runner_gone(), "{dropped}");
        // Alive but slow: a timeout, which says nothing of the runner's death.
        let slow = dir.path().join("slow.sock");
        serve_with(&slow, |stream| {
            Box::pin(async move {
                tokio::time::sleep(Duration::from_secs(60)).await;
                drop(stream);
            })
        });
        let timeout = post(slow, Duration::from_millis(100)).await.expect_err("slow");
        assert!(!timeout.runner_gone(), "{timeout}");
    }

    #[tokio::test]
    async fn a_stream_that_falls_silent_fails_after_the_idle_timeout() {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("silent.sock");
        serve_with(&socket, |mut stream| {
            Box::pin(async move {
                let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n";
                let _ = stream.write_all(format!("{head}5\r\nhello\r\n").as_bytes()).await;
                // Then nothing, the connection open.
                tokio::time::sleep(Duration::from_secs(60)).await;
            })
        });
        let pool = Pool::new(Duration::from_millis(200));
        let (status, mut body) = pool
            .post_json_stream(&socket, "/completion", b"{}".to_vec(), Duration::from_secs(5))
            .await
            .expect("headers");
        assert_eq!(status, StatusCode::OK);
        assert_eq!(body.chunk().await.expect("a piece").expect("data"), Bytes::from_static(b"hello"));
        let started = Instant::now();
        let error = body.chunk().await.expect("not the end").expect_err("silent");
        assert!(matches!(error, UpstreamError::Stalled(d) if d == Duration::from_millis(200)), "{error}");
        assert!(started.elapsed() >= Duration::from_millis(200));
        assert!(!error.runner_gone(), "a stall is told apart from a death");
        assert_eq!(error.to_string(), "the runner sent nothing for 200 ms in the middle of its answer");
    }
}
