//! A real registry (Debian's `docker-registry`, the CNCF distribution registry) on loopback,
//! a proxy in front of it that records requests and misbehaves on demand, and a tiny tmpfs
//! for a disk that fills up.

use std::fmt::Write as _;
use std::fs;
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::watch;

use super::http;

/// The registry's binary, from the `docker-registry` package.
const BINARY: &str = "/usr/bin/docker-registry";

/// How long the registry may take to start answering.
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// A `docker-registry serve` on `127.0.0.1:<free port>`, its storage in a temporary
/// directory. Dropping it kills it.
pub struct DockerRegistry {
    child: Child,
    addr: SocketAddr,
    dir: tempfile::TempDir,
}

impl DockerRegistry {
    /// Starts one; a port taken between choosing and binding it is retried with another.
    pub fn start() -> Self {
        assert!(
            Path::new(BINARY).is_file(),
            "{BINARY} is missing: install the docker-registry package (scripts/setup-system.sh)"
        );
        let mut last = String::new();
        for _ in 0..5 {
            match Self::try_start() {
                Ok(registry) => return registry,
                Err(e) => last = e,
            }
        }
        panic!("docker-registry did not start: {last}");
    }

    fn try_start() -> Result<Self, String> {
        let dir = tempfile::tempdir().expect("tempdir");
        let addr = SocketAddr::from(([127, 0, 0, 1], crate::support::corrald::free_port()));
        let config = dir.path().join("config.yml");
        let storage = dir.path().join("storage");
        fs::write(
            &config,
            format!(
                "version: 0.1\n\
                 log:\n  level: warn\n  accesslog:\n    disabled: true\n\
                 storage:\n  filesystem:\n    rootdirectory: {}\n  delete:\n    enabled: true\n  \
                 maintenance:\n    uploadpurging:\n      enabled: false\n\
                 http:\n  addr: {addr}\n",
                storage.display()
            ),
        )
        .expect("write the registry config");
        let log = dir.path().join("registry.log");
        let log_file = fs::File::create(&log).expect("registry log");
        let child = Command::new(BINARY)
            .arg("serve")
            .arg(&config)
            .stdin(Stdio::null())
            .stdout(log_file.try_clone().expect("log"))
            .stderr(log_file)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run {BINARY}: {e}"));
        let mut registry = Self { child, addr, dir };
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Some(status) = registry.child.try_wait().expect("wait") {
                return Err(format!("it exited ({status}): {}", fs::read_to_string(&log).unwrap_or_default()));
            }
            if let Ok(stream) = std::net::TcpStream::connect(addr) {
                stream.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
                let response = http::request(stream, "GET", "/v2/", None);
                if response.status == 200 {
                    return Ok(registry);
                }
            }
            if Instant::now() > deadline {
                let _ = registry.child.kill();
                return Err(format!(
                    "no answer within {START_TIMEOUT:?}: {}",
                    fs::read_to_string(&log).unwrap_or_default()
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Its address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `127.0.0.1:<port>`, as a model name writes the registry.
    pub fn host(&self) -> String {
        self.addr.to_string()
    }

    /// Where it keeps its data.
    pub fn storage(&self) -> PathBuf {
        self.dir.path().join("storage")
    }
}

impl Drop for DockerRegistry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A request the proxy saw.
#[derive(Debug, Clone)]
pub struct Seen {
    /// `GET`, `HEAD`...
    pub method: String,
    /// The path and query.
    pub path: String,
    /// The `Range` header.
    pub range: Option<String>,
    /// The `Authorization` header.
    pub authorization: Option<String>,
    /// The `Connection` header.
    pub connection: Option<String>,
}

impl Seen {
    /// Whether this is a GET of a blob.
    pub fn is_blob_get(&self, digest: &str) -> bool {
        self.method == "GET" && self.path.ends_with(&format!("/blobs/{digest}"))
    }

    /// The `Range` header as `(first, last)`.
    pub fn byte_range(&self) -> Option<(u64, u64)> {
        let (first, last) = self.range.as_deref()?.strip_prefix("bytes=")?.split_once('-')?;
        Some((first.parse().ok()?, last.parse().ok()?))
    }
}

/// What the proxy does with a request.
#[derive(Clone)]
pub enum Action {
    /// Passes it through.
    Pass,
    /// Passes it through but sends only this many bytes of the body (with the whole
    /// `Content-Length` promised), then closes the connection.
    Cut(u64),
    /// Passes it through with the body byte at this offset flipped.
    Corrupt(usize),
    /// Passes it through without its `Range` header.
    DropRange,
    /// Passes it through with this many bytes more after the body, sent without a
    /// `Content-Length` (the body ends where the connection closes).
    Overlong(usize),
    /// Passes it through promising a `Content-Length` this many bytes more (or fewer) than
    /// the body it sends.
    Misstate(i64),
    /// Waits until the gate opens, then passes it through.
    Hold(Gate),
    /// Passes it through but sends only this many bytes of the body, then nothing more
    /// until the client goes (counted in [`Proxy::stalled`] once the bytes are sent, in
    /// [`Proxy::abandoned`] once the client closed the connection).
    Stall(u64),
    /// Passes it through with a `Location` that names the registry made to name the proxy
    /// (an upload's start, so that its `PUT` comes through the proxy too).
    Relocate,
    /// Reads the request's body at this many bytes a second (a registry taking an upload
    /// slowly), then passes it through. The pace is kept from the body's start, so a late
    /// wakeup on a busy machine is caught up rather than slowing the whole read.
    SlowBody(u64),
    /// Reads this many bytes of the request's body, then nothing more until the client goes
    /// (counted in [`Proxy::abandoned`] then).
    StallBody(usize),
    /// Answers this instead.
    Respond {
        /// The status.
        status: u16,
        /// Extra headers.
        headers: Vec<(String, String)>,
        /// The body.
        body: String,
    },
}

/// A gate that requests can wait on until the test opens it.
#[derive(Clone)]
pub struct Gate {
    open: Arc<watch::Sender<bool>>,
    arrived: Arc<watch::Sender<usize>>,
}

impl Gate {
    /// A closed gate.
    pub fn new() -> Self {
        Self { open: Arc::new(watch::channel(false).0), arrived: Arc::new(watch::channel(0).0) }
    }

    /// Opens it for good.
    pub fn open(&self) {
        self.open.send_replace(true);
    }

    /// Waits until `n` requests in all have come to the gate.
    pub async fn arrivals(&self, n: usize) {
        let mut arrived = self.arrived.subscribe();
        let _ = arrived.wait_for(|a| *a >= n).await;
    }

    async fn wait(&self) {
        self.arrived.send_modify(|a| *a += 1);
        let mut open = self.open.subscribe();
        let _ = open.wait_for(|open| *open).await;
    }
}

type Rule = Arc<dyn Fn(&Seen) -> Action + Send + Sync>;

struct ProxyState {
    upstream: SocketAddr,
    client: reqwest::Client,
    seen: Mutex<Vec<Seen>>,
    rule: Mutex<Rule>,
    /// Held or stalled requests whose client closed the connection while they waited.
    abandoned: std::sync::atomic::AtomicUsize,
    /// Stalled answers whose bytes are sent.
    stalled: std::sync::atomic::AtomicUsize,
}

/// A hand-written HTTP/1.1 proxy on `127.0.0.1:<free port>` in front of a registry, one
/// request per connection (so that a cut is a real end of the connection, after exactly the
/// bytes chosen). It records every request and applies the rule set with [`Proxy::rule`]
/// (pass everything by default).
pub struct Proxy {
    addr: SocketAddr,
    state: Arc<ProxyState>,
    task: tokio::task::JoinHandle<()>,
}

impl Proxy {
    /// Starts one in front of `upstream`. Must be called inside a tokio runtime.
    pub fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the proxy");
        listener.set_nonblocking(true).expect("nonblocking");
        let addr = listener.local_addr().expect("proxy address");
        let listener = tokio::net::TcpListener::from_std(listener).expect("tokio listener");
        let state = Arc::new(ProxyState {
            upstream,
            client: reqwest::Client::builder().redirect(reqwest::redirect::Policy::none()).build().expect("client"),
            seen: Mutex::default(),
            rule: Mutex::new(Arc::new(|_: &Seen| Action::Pass)),
            abandoned: std::sync::atomic::AtomicUsize::new(0),
            stalled: std::sync::atomic::AtomicUsize::new(0),
        });
        let shared = Arc::clone(&state);
        let task = tokio::spawn(async move {
            let mut connections = tokio::task::JoinSet::new();
            while let Ok((socket, _)) = listener.accept().await {
                connections.spawn(serve(Arc::clone(&shared), socket));
            }
        });
        Self { addr, state, task }
    }

    /// `127.0.0.1:<port>`, as a model name writes the registry.
    pub fn host(&self) -> String {
        self.addr.to_string()
    }

    /// Sets what to do with each request from now on.
    pub fn rule(&self, rule: impl Fn(&Seen) -> Action + Send + Sync + 'static) {
        *self.state.rule.lock().unwrap_or_else(PoisonError::into_inner) = Arc::new(rule);
    }

    /// How many held or stalled requests their client gave up (closed the connection) while
    /// they waited.
    pub fn abandoned(&self) -> usize {
        self.state.abandoned.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// How many stalled answers have sent the bytes they send.
    pub fn stalled(&self) -> usize {
        self.state.stalled.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Every request seen so far, in order.
    pub fn seen(&self) -> Vec<Seen> {
        self.state.seen.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// Forgets the requests seen so far.
    pub fn clear(&self) {
        self.state.seen.lock().unwrap_or_else(PoisonError::into_inner).clear();
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        // Aborting the accept loop drops its JoinSet, which aborts every connection.
        self.task.abort();
    }
}

/// One request's head read off a connection, with the start of its body.
struct Incoming {
    method: String,
    path: String,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
    length: usize,
}

impl Incoming {
    /// Reads the rest of the body (to `length`), at most `rate` bytes a second since this
    /// call began when given. `None` when the client went.
    async fn read_body(&mut self, socket: &mut TcpStream, rate: Option<u64>) -> Option<()> {
        let (started, before) = (tokio::time::Instant::now(), self.body.len());
        while self.body.len() < self.length {
            let mut buf = vec![0; (64 << 10).min(self.length - self.body.len())];
            let n = socket.read(&mut buf).await.ok()?;
            if n == 0 {
                return None;
            }
            self.body.extend_from_slice(&buf[..n]);
            if let Some(rate) = rate {
                // Until the time the bytes taken so far are due at `rate` (at once when late).
                let taken = u128::try_from(self.body.len() - before).unwrap_or(u128::MAX);
                let due = u64::try_from(taken * 1_000_000_000 / u128::from(rate.max(1))).unwrap_or(u64::MAX);
                tokio::time::sleep_until(started + Duration::from_nanos(due)).await;
            }
        }
        Some(())
    }
}

async fn read_head(socket: &mut TcpStream) -> Option<Incoming> {
    let mut data = Vec::new();
    let head_end = loop {
        if let Some(at) = data.windows(4).position(|w| w == b"\r\n\r\n") {
            break at;
        }
        if socket.read_buf(&mut data).await.ok()? == 0 {
            return None;
        }
    };
    let head = String::from_utf8_lossy(&data[..head_end]).into_owned();
    let mut lines = head.split("\r\n");
    let mut request_line = lines.next()?.split(' ');
    let (method, path) = (request_line.next()?.to_owned(), request_line.next()?.to_owned());
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let length: usize =
        headers.iter().find(|(n, _)| n == "content-length").and_then(|(_, v)| v.parse().ok()).unwrap_or(0);
    let body = data.split_off(head_end + 4);
    Some(Incoming { method, path, headers, body, length })
}

async fn serve(state: Arc<ProxyState>, mut socket: TcpStream) {
    let Some(mut request) = read_head(&mut socket).await else { return };
    let header = |name: &str| request.headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.clone());
    let seen = Seen {
        method: request.method.clone(),
        path: request.path.clone(),
        range: header("range"),
        authorization: header("authorization"),
        connection: header("connection"),
    };
    state.seen.lock().unwrap_or_else(PoisonError::into_inner).push(seen.clone());
    let rule = Arc::clone(&state.rule.lock().unwrap_or_else(PoisonError::into_inner));
    let action = rule(&seen);
    if !take_body(&state, &mut socket, &mut request, &action).await {
        return;
    }
    match &action {
        Action::Respond { status, headers, body } => {
            let mut head = status_line(*status);
            for (name, value) in headers {
                let _ = write!(head, "{name}: {value}\r\n");
            }
            let _ = write!(head, "Content-Length: {}\r\nConnection: close\r\n\r\n", body.len());
            let _ = socket.write_all(head.as_bytes()).await;
            let _ = socket.write_all(body.as_bytes()).await;
            let _ = socket.shutdown().await;
            return;
        }
        Action::Hold(gate) => {
            // A client that goes away while held is seen going (and nothing is forwarded).
            tokio::select! {
                biased;
                () = gate.wait() => {}
                () = closed_by_peer(&mut socket) => {
                    state.abandoned.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    return;
                }
            }
        }
        _ => {}
    }
    let url = format!("http://{}{}", state.upstream, request.path);
    let method = reqwest::Method::from_bytes(request.method.as_bytes()).expect("method");
    let mut forward = state.client.request(method, url).body(request.body);
    for (name, value) in &request.headers {
        let skip = matches!(name.as_str(), "host" | "connection" | "content-length")
            || (name == "range" && matches!(action, Action::DropRange));
        if !skip {
            forward = forward.header(name, value);
        }
    }
    let upstream = forward.send().await.expect("forward to the registry");
    let mut head = status_line(upstream.status().as_u16());
    let promised = upstream.content_length();
    for (name, value) in upstream.headers() {
        let mut value = value.to_str().unwrap_or_default().to_owned();
        if name == "location" && matches!(action, Action::Relocate) {
            value = value.replace(&state.upstream.to_string(), &socket.local_addr().expect("address").to_string());
        }
        if !matches!(name.as_str(), "transfer-encoding" | "connection" | "content-length") {
            let _ = write!(head, "{name}: {value}\r\n");
        }
    }
    let is_head = request.method == "HEAD";
    let mut data = upstream.bytes().await.expect("the registry's answer").to_vec();
    let length = if is_head { promised.unwrap_or(0) } else { data.len() as u64 };
    let promise = match action {
        Action::Overlong(_) => String::new(),
        Action::Misstate(delta) => format!("Content-Length: {}\r\n", length.saturating_add_signed(delta)),
        _ => format!("Content-Length: {length}\r\n"),
    };
    let _ = write!(head, "{promise}Connection: close\r\n\r\n");
    match action {
        Action::Cut(n) | Action::Stall(n) => data.truncate(usize::try_from(n).unwrap_or(usize::MAX)),
        Action::Overlong(n) => data.resize(data.len() + n, b'x'),
        Action::Corrupt(at) => {
            if let Some(byte) = data.get_mut(at) {
                *byte ^= 0xff;
            }
        }
        _ => {}
    }
    if is_head {
        data.clear();
    }
    let _ = socket.write_all(head.as_bytes()).await;
    let _ = socket.write_all(&data).await;
    if matches!(action, Action::Stall(_)) {
        state.stalled.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        closed_by_peer(&mut socket).await;
        state.abandoned.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        return;
    }
    let _ = socket.shutdown().await;
}

/// Reads `request`'s body as `action` says; false when the request ends there (the client
/// went, or the body stalls until it goes).
async fn take_body(state: &ProxyState, socket: &mut TcpStream, request: &mut Incoming, action: &Action) -> bool {
    if matches!(action, Action::SlowBody(_) | Action::StallBody(_)) {
        // A fixed, small receive buffer: the sender's view of what was taken then lags the
        // proxy's reads by a fraction of a MiB (autotuning would let the kernel take MiBs).
        nix::sys::socket::setsockopt(&*socket, nix::sys::socket::sockopt::RcvBuf, &(64 << 10)).expect("SO_RCVBUF");
    }
    match *action {
        Action::SlowBody(rate) => request.read_body(socket, Some(rate)).await.is_some(),
        Action::StallBody(n) => {
            request.length = request.length.min(n);
            if request.read_body(socket, None).await.is_some() {
                closed_by_peer(socket).await;
                state.abandoned.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
            false
        }
        _ => request.read_body(socket, None).await.is_some(),
    }
}

/// Resolves when the client closes its end (one request per connection: nothing more
/// is expected from it).
async fn closed_by_peer(socket: &mut TcpStream) {
    let mut byte = [0u8; 1];
    while matches!(socket.read(&mut byte).await, Ok(n) if n > 0) {}
}

fn status_line(status: u16) -> String {
    let reason = reqwest::StatusCode::from_u16(status).ok().and_then(|s| s.canonical_reason()).unwrap_or("Whatever");
    format!("HTTP/1.1 {status} {reason}\r\n")
}

/// A tmpfs of a few KB, mounted on a temporary directory (the tests run as root);
/// unmounted when dropped.
pub struct SmallDisk {
    mount: PathBuf,
    _dir: tempfile::TempDir,
}

impl SmallDisk {
    /// Mounts one of `size` bytes.
    pub fn mount(size: u64) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let mount = dir.path().join("disk");
        fs::create_dir(&mount).expect("mount point");
        let output = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size},mode=0755"), "corral-test-disk"])
            .arg(&mount)
            .output()
            .expect("run mount");
        assert!(output.status.success(), "mount a tmpfs: {}", String::from_utf8_lossy(&output.stderr));
        Self { mount, _dir: dir }
    }

    /// Where it is mounted.
    pub fn path(&self) -> &Path {
        &self.mount
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let unmounted = Command::new("umount").arg(&self.mount).status().is_ok_and(|s| s.success());
        if !unmounted {
            let _ = Command::new("umount").arg("-l").arg(&self.mount).status();
        }
    }
}
