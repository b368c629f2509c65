//! The sockets the API is served on: adopted from systemd, or bound from `[server] listen`.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::serve::ListenerExt as _;
use hyper_util::rt::{TokioIo, TokioTimer};
use nix::sys::socket::{AddressFamily, SockType, SockaddrLike, SockaddrStorage, getsockname, getsockopt, sockopt};
use tokio_io_timeout::TimeoutWriter;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tower::ServiceExt as _;

use super::safety::{Peer, Transport, is_loopback};
use crate::config::ListenAddr;
use crate::systemd::HTTP_FD_NAME;

/// A listening socket ready to serve.
#[derive(Debug)]
pub enum Listener {
    /// TCP.
    Tcp(tokio::net::TcpListener),
    /// A UNIX stream socket.
    Unix {
        /// The socket.
        listener: tokio::net::UnixListener,
        /// Set when corral bound the path itself (not when systemd passed it): removes it on drop.
        owned: Option<SocketFile>,
    },
}

/// A socket file corral created, removed when dropped (at shutdown, or when a later bind fails).
#[derive(Debug)]
pub struct SocketFile(PathBuf);

impl Drop for SocketFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Why the API cannot listen.
#[derive(Debug, thiserror::Error)]
pub enum ListenError {
    /// Binding an address failed (in use, no permission, ...).
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: ListenAddr,
        /// The cause.
        source: io::Error,
    },
    /// A socket passed by systemd is unusable.
    #[error("socket {name:?} passed by systemd is not usable: {reason}")]
    Adopt {
        /// Its `FileDescriptorName=`.
        name: String,
        /// What is wrong with it.
        reason: String,
    },
    /// systemd passed sockets, but none for the API.
    #[error("systemd passed sockets named {names:?} but none named \"{HTTP_FD_NAME}\"")]
    NoHttpSocket {
        /// The names it passed.
        names: Vec<String>,
    },
}

impl Listener {
    /// A readable name for logs and the status line.
    #[must_use]
    pub fn describe(&self) -> String {
        match self {
            Self::Tcp(l) => l.local_addr().map_or_else(|_| "tcp".to_owned(), |a| a.to_string()),
            Self::Unix { listener, .. } => listener
                .local_addr()
                .ok()
                .and_then(|a| a.as_pathname().map(|p| p.display().to_string()))
                .unwrap_or_else(|| "unix".to_owned()),
        }
    }

    /// Serves `router` until `shutdown` is cancelled, then finishes open requests; each
    /// connection within `timeouts`.
    pub async fn serve(self, router: Router, timeouts: Timeouts, shutdown: CancellationToken) -> io::Result<()> {
        // Every request learns its connection's kind: the Host rule and the store-change
        // rule depend on it.
        match self {
            Self::Tcp(l) => {
                // Streams write small frames: each goes out at once, not after the last one's ACK.
                let l = l.tap_io(|tcp| {
                    if let Err(e) = tcp.set_nodelay(true) {
                        tracing::debug!(error = %e, "cannot set TCP_NODELAY on a connection");
                    }
                });
                serve_on(l, router, timeouts, shutdown, |tcp: &tokio::net::TcpStream| Transport::Tcp {
                    // Unknown counts as loopback: the stricter rule.
                    loopback: tcp.local_addr().map_or(true, |a| is_loopback(a.ip())),
                })
                .await;
            }
            Self::Unix { listener, owned } => {
                serve_on(listener, router, timeouts, shutdown, |unix: &tokio::net::UnixStream| {
                    let peer = unix.peer_cred().ok().map(|c| Peer { uid: c.uid(), gid: c.gid(), pid: c.pid() });
                    Transport::Unix { peer }
                })
                .await;
                drop(owned);
            }
        }
        Ok(())
    }
}

/// How long a client may keep its connection waiting (`[server]`).
#[derive(Debug, Clone, Copy)]
pub struct Timeouts {
    /// A connection that has not sent a whole request head this long after it opened
    /// (or after its last answer) is closed (`header_timeout`).
    pub header: Duration,
    /// A connection whose client takes none of the answer's bytes for this long is
    /// closed (`send_timeout`): a client that stops reading would otherwise hold its
    /// request, and the runner's slot serving it, for as long as it stays connected.
    pub send: Duration,
}

impl Timeouts {
    /// The configured ones.
    #[must_use]
    pub fn of(server: &crate::config::ServerConfig) -> Self {
        Self { header: server.header_timeout, send: server.send_timeout }
    }
}

/// The largest request head (request line and headers) a client may send; a larger one
/// is answered 431 and its connection closed. Without it, hyper's read buffer bounds the
/// head (about 400 KiB by default; 1 MiB with the reads set here).
pub const MAX_HEAD: usize = 64 << 10;

/// The most a connection reads from its socket at once (hyper's read buffer). An upload's
/// body arrives in pieces this large: at 1 MiB instead of hyper's default of about
/// 400 KiB, half as many reads and runtime wake-ups per GiB, and about 5 % less CPU time.
const MAX_READ: usize = 1 << 20;

/// The accept loop: one task per connection, served by hyper's HTTP/1 with a timer for
/// the header timeout (which `axum::serve` does not set) and its socket's writes timed
/// (hyper has no timeout for them); each request carries what `transport` says of its
/// connection. On `shutdown` it stops accepting, asks every connection to finish its
/// request in progress, and waits.
async fn serve_on<L>(
    mut listener: L,
    router: Router,
    timeouts: Timeouts,
    shutdown: CancellationToken,
    transport: impl Fn(&L::Io) -> Transport,
) where
    L: axum::serve::Listener,
{
    let connections = TaskTracker::new();
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new()).header_read_timeout(timeouts.header).max_header_size(MAX_HEAD).max_buf_size(MAX_READ);
    loop {
        // Accept errors are logged and retried by `accept` (after a second when out of files).
        let (io, _) = tokio::select! {
            accepted = listener.accept() => accepted,
            () = shutdown.cancelled() => break,
        };
        let router = router.clone();
        let transport = transport(&io);
        let service = hyper::service::service_fn(move |request: hyper::Request<hyper::body::Incoming>| {
            let mut request = request.map(Body::new);
            request.extensions_mut().insert(transport);
            router.clone().oneshot(request)
        });
        // A write that stays pending (the socket's buffers full) for `send` fails with
        // `TimedOut`, which ends the connection and drops its request.
        let mut io = TimeoutWriter::new(io);
        io.set_timeout(Some(timeouts.send));
        let connection = http.serve_connection(TokioIo::new(Box::pin(io)), service);
        let shutdown = shutdown.clone();
        connections.spawn(async move {
            let mut connection = std::pin::pin!(connection);
            let result = tokio::select! {
                result = connection.as_mut() => result,
                () = shutdown.cancelled() => {
                    connection.as_mut().graceful_shutdown();
                    connection.await
                }
            };
            match result {
                Err(e) if stopped_reading(&e) => tracing::info!(
                    corral_event = "send_timeout",
                    "closed an HTTP connection whose client took none of its answer for {} s \
                     ([server] send_timeout)",
                    timeouts.send.as_secs_f64()
                ),
                Err(e) => tracing::debug!(error = %e, "an HTTP connection ended with an error"),
                Ok(()) => {}
            }
        });
    }
    drop(listener);
    connections.close();
    connections.wait().await;
}

/// Whether a connection ended because its client stopped reading (the timed writes'
/// error, somewhere in hyper's chain of causes).
fn stopped_reading(error: &hyper::Error) -> bool {
    let mut cause = std::error::Error::source(error);
    while let Some(e) = cause {
        if e.downcast_ref::<io::Error>().is_some_and(|e| e.kind() == io::ErrorKind::TimedOut) {
            return true;
        }
        cause = e.source();
    }
    false
}

/// Turns the sockets systemd passed into listeners: all those named `http`, TCP or UNIX.
pub fn adopt(sockets: Vec<(String, OwnedFd)>) -> Result<Vec<Listener>, ListenError> {
    let mut names = Vec::new();
    let mut listeners = Vec::new();
    for (name, fd) in sockets {
        if name == HTTP_FD_NAME {
            listeners.push(adopt_one(&name, fd)?);
        } else {
            tracing::warn!(fd_name = %name, "ignoring a socket passed by systemd with an unknown name");
            names.push(name);
        }
    }
    if listeners.is_empty() && !names.is_empty() {
        return Err(ListenError::NoHttpSocket { names });
    }
    Ok(listeners)
}

fn adopt_one(name: &str, fd: OwnedFd) -> Result<Listener, ListenError> {
    let fail = |reason: String| ListenError::Adopt { name: name.to_owned(), reason };
    let kind = getsockopt(&fd, sockopt::SockType).map_err(|e| fail(format!("not a socket ({e})")))?;
    if kind != SockType::Stream {
        return Err(fail(format!("a {kind:?} socket, expected a stream socket (ListenStream=)")));
    }
    if !getsockopt(&fd, sockopt::AcceptConn).map_err(|e| fail(e.to_string()))? {
        return Err(fail("not listening (Accept=yes is not supported)".to_owned()));
    }
    let family = getsockname::<SockaddrStorage>(fd.as_raw_fd()).map_err(|e| fail(e.to_string()))?.family();
    let set_nonblocking = |r: io::Result<()>| r.map_err(|e| fail(e.to_string()));
    match family {
        Some(AddressFamily::Inet | AddressFamily::Inet6) => {
            let std = std::net::TcpListener::from(fd);
            set_nonblocking(std.set_nonblocking(true))?;
            tokio::net::TcpListener::from_std(std).map(Listener::Tcp).map_err(|e| fail(e.to_string()))
        }
        Some(AddressFamily::Unix) => {
            let std = std::os::unix::net::UnixListener::from(fd);
            set_nonblocking(std.set_nonblocking(true))?;
            tokio::net::UnixListener::from_std(std)
                .map(|listener| Listener::Unix { listener, owned: None })
                .map_err(|e| fail(e.to_string()))
        }
        other => Err(fail(format!("address family {other:?}, expected TCP or UNIX"))),
    }
}

/// Binds every configured address; on any failure nothing stays bound.
pub async fn bind(addrs: &[ListenAddr]) -> Result<Vec<Listener>, ListenError> {
    let mut listeners = Vec::with_capacity(addrs.len());
    for addr in addrs {
        let fail = |source| ListenError::Bind { addr: addr.clone(), source };
        let listener = match addr {
            ListenAddr::Tcp(a) => Listener::Tcp(tokio::net::TcpListener::bind(a).await.map_err(fail)?),
            ListenAddr::Unix(path) => {
                remove_stale_socket(path).map_err(fail)?;
                let listener = tokio::net::UnixListener::bind(path).map_err(fail)?;
                Listener::Unix { listener, owned: Some(SocketFile(path.clone())) }
            }
        };
        listeners.push(listener);
    }
    Ok(listeners)
}

/// Removes a socket file left by an earlier run, but never one that something still serves.
fn remove_stale_socket(path: &Path) -> io::Result<()> {
    use std::os::unix::fs::FileTypeExt;
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
        Ok(meta) if !meta.file_type().is_socket() => {
            Err(io::Error::new(io::ErrorKind::AlreadyExists, "the path exists and is not a socket"))
        }
        Ok(_) => match std::os::unix::net::UnixStream::connect(path) {
            Ok(_) => Err(io::Error::new(io::ErrorKind::AddrInUse, "another process is serving this socket")),
            Err(_) => std::fs::remove_file(path),
        },
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::OwnedFd;
    use std::time::Duration;

    use super::{ListenAddr, ListenError, Listener, adopt, bind};

    #[tokio::test]
    async fn adopts_tcp_and_unix_listeners_named_http() {
        let dir = tempfile::tempdir().expect("tempdir");
        let tcp = std::net::TcpListener::bind("127.0.0.1:0").expect("tcp");
        let unix = std::os::unix::net::UnixListener::bind(dir.path().join("s")).expect("unix");
        let listeners =
            adopt(vec![("http".into(), OwnedFd::from(tcp)), ("http".into(), OwnedFd::from(unix))]).expect("adopted");
        assert!(matches!(listeners[0], Listener::Tcp(_)));
        assert!(matches!(listeners[1], Listener::Unix { owned: None, .. }));
        assert!(listeners[1].describe().ends_with("/s"));
    }

    #[tokio::test]
    async fn refuses_sockets_that_cannot_serve() {
        let udp = std::net::UdpSocket::bind("127.0.0.1:0").expect("udp");
        let err = adopt(vec![("http".into(), OwnedFd::from(udp))]).expect_err("udp");
        assert!(err.to_string().contains("expected a stream socket"), "{err}");

        let file = std::fs::File::open("/dev/null").expect("file");
        let err = adopt(vec![("http".into(), OwnedFd::from(file))]).expect_err("file");
        assert!(err.to_string().contains("not a socket"), "{err}");

        let tcp = std::net::TcpListener::bind("127.0.0.1:0").expect("tcp");
        let err = adopt(vec![("metrics".into(), OwnedFd::from(tcp))]).expect_err("name");
        assert!(matches!(err, ListenError::NoHttpSocket { .. }), "{err}");
    }

    /// The status line of the answer to `request`, sent raw on `stream`.
    async fn status_line<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(
        mut stream: S,
        request: &str,
    ) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        stream.write_all(request.as_bytes()).await.expect("write");
        let mut reply = Vec::new();
        stream.read_to_end(&mut reply).await.expect("read");
        let reply = String::from_utf8_lossy(&reply).into_owned();
        reply.lines().next().unwrap_or_default().to_owned()
    }

    #[tokio::test]
    async fn http_1_1_over_tcp_needs_a_host_but_unix_sockets_do_not() {
        let (dir, state) = crate::http::state::for_tests(crate::http::state::absent_backend());
        let sock = dir.path().join("api.sock");
        let listeners = bind(&[ListenAddr::Tcp("127.0.0.1:0".parse().expect("addr")), ListenAddr::Unix(sock.clone())])
            .await
            .expect("bind");
        let Listener::Tcp(tcp) = &listeners[0] else { panic!("tcp first") };
        let addr = tcp.local_addr().expect("addr");
        let shutdown = tokio_util::sync::CancellationToken::new();
        for listener in listeners {
            let timeouts = super::Timeouts::of(&crate::config::ServerConfig::default());
            tokio::spawn(listener.serve(crate::http::router(state.clone()), timeouts, shutdown.clone()));
        }
        let tcp = || async { tokio::net::TcpStream::connect(addr).await.expect("connect") };
        let close = "Connection: close\r\n";
        let no_host = format!("GET /api/version HTTP/1.1\r\n{close}\r\n");
        assert_eq!(status_line(tcp().await, &no_host).await, "HTTP/1.1 400 Bad Request");
        let with_host = format!("GET /api/version HTTP/1.1\r\nHost: localhost\r\n{close}\r\n");
        assert_eq!(status_line(tcp().await, &with_host).await, "HTTP/1.1 200 OK");
        let old = "GET /api/version HTTP/1.0\r\n\r\n";
        assert_eq!(status_line(tcp().await, old).await, "HTTP/1.0 200 OK");
        let unix = tokio::net::UnixStream::connect(&sock).await.expect("connect");
        assert_eq!(status_line(unix, &no_host).await, "HTTP/1.1 200 OK");
        shutdown.cancel();
    }

    /// A client that stops reading is let go after `send_timeout`: its connection closes
    /// and the answer's body (which holds a runner's slot) is dropped.
    #[tokio::test]
    async fn a_client_that_stops_reading_is_let_go_after_the_send_timeout() {
        use std::sync::Arc;
        use std::sync::atomic::{AtomicBool, Ordering};
        use tokio::io::{AsyncReadExt, AsyncWriteExt};

        /// Says when the body that owns it is dropped.
        struct Guard(Arc<AtomicBool>);
        impl Drop for Guard {
            fn drop(&mut self) {
                self.0.store(true, Ordering::SeqCst);
            }
        }
        let dropped = Arc::new(AtomicBool::new(false));
        let endless = {
            let dropped = Arc::clone(&dropped);
            move || async move {
                let (guard, chunk) = (Guard(dropped), axum::body::Bytes::from(vec![b'x'; 64 << 10]));
                axum::body::Body::from_stream(futures_util::stream::repeat_with(move || {
                    let _owned = &guard;
                    Ok::<_, std::convert::Infallible>(chunk.clone())
                }))
            }
        };
        let router = axum::Router::new().route("/endless", axum::routing::get(endless));
        let mut listeners = bind(&[ListenAddr::Tcp("127.0.0.1:0".parse().expect("addr"))]).await.expect("bind");
        let Some(Listener::Tcp(tcp)) = listeners.first() else { panic!("tcp") };
        let addr = tcp.local_addr().expect("addr");
        let shutdown = tokio_util::sync::CancellationToken::new();
        let timeouts = super::Timeouts { header: Duration::from_secs(10), send: Duration::from_secs(1) };
        tokio::spawn(listeners.remove(0).serve(router, timeouts, shutdown.clone()));

        let mut client = tokio::net::TcpStream::connect(addr).await.expect("connect");
        client.write_all(b"GET /endless HTTP/1.1\r\nHost: localhost\r\n\r\n").await.expect("request");
        // It reads nothing: once the socket's buffers are full, a second later, the server
        // lets the answer go.
        tokio::time::timeout(Duration::from_secs(60), async {
            while !dropped.load(Ordering::SeqCst) {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
        .expect("the answer dropped once its client stopped reading");
        // And the connection is closed: what was buffered drains, then the stream ends.
        let mut sink = vec![0; 1 << 20];
        let drained = tokio::time::timeout(Duration::from_secs(60), async {
            while client.read(&mut sink).await.is_ok_and(|n| n > 0) {}
        });
        drained.await.expect("the connection closed");
        shutdown.cancel();
    }

    #[tokio::test]
    async fn binding_an_address_in_use_names_it() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("tcp");
        let addr = ListenAddr::Tcp(taken.local_addr().expect("addr"));
        let err = bind(std::slice::from_ref(&addr)).await.expect_err("in use");
        assert!(err.to_string().starts_with(&format!("cannot listen on {addr}: ")), "{err}");
    }

    #[tokio::test]
    async fn a_stale_unix_socket_is_replaced_but_a_live_one_is_not() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("api.sock");
        drop(std::os::unix::net::UnixListener::bind(&path).expect("stale"));
        let listeners = bind(&[ListenAddr::Unix(path.clone())]).await.expect("stale socket replaced");
        let err = bind(&[ListenAddr::Unix(path.clone())]).await.expect_err("live socket kept");
        assert!(err.to_string().contains("another process is serving"), "{err}");
        drop(listeners);
        assert!(!path.exists(), "the socket file goes with its listener");

        // A failure later in the list leaves nothing bound, and no socket file behind.
        let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("tcp");
        let addrs = [ListenAddr::Unix(path.clone()), ListenAddr::Tcp(taken.local_addr().expect("addr"))];
        bind(&addrs).await.expect_err("second address in use");
        assert!(!path.exists(), "no socket file left after a failed start");

        let file = dir.path().join("plain");
        std::fs::write(&file, "x").expect("write");
        let err = bind(&[ListenAddr::Unix(file)]).await.expect_err("not a socket");
        assert!(err.to_string().contains("not a socket"), "{err}");
    }
}
