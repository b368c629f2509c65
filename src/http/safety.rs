//! The checks every request passes before it reaches a route, from `[server]`:
//!
//! 1. **Host** (against DNS rebinding, where a public name of an attacker's page resolves
//!    to 127.0.0.1): on a connection that arrived at a loopback address (the accept loop
//!    marks each connection's [`Transport`]), or over a UNIX socket, the `Host` header
//!    (or the HTTP/2 authority) must name this machine as Ollama's rule has it:
//!    `localhost`, `*.localhost`, `*.local`, `*.internal`, the machine's hostname, or an
//!    IP address that is loopback, private, unspecified (`0.0.0.0`, which Ollama's clients
//!    send with `OLLAMA_HOST=0.0.0.0`), link-local or one of the machine's interfaces;
//!    with any port; or match `allowed_hosts`; otherwise 403. On a connection that
//!    arrived at any other address (a LAN or container address of a wildcard listener)
//!    any `Host` passes: the client reached the machine by its network address, which a
//!    rebinding page cannot make loopback. The hostname and the interfaces are read when
//!    needed through [`LocalNames`] (both change at run time). An HTTP/1.1 request over
//!    TCP without a `Host` is refused with 400, as HTTP/1.1 requires one; over a UNIX
//!    socket, or in HTTP/1.0, a request without any host is let through (such clients
//!    send none, and a browser always sends one, so a rebinding page cannot leave it
//!    out). Two `Host` headers are a 400 (which one a proxy in front believes is
//!    anyone's guess), and an absolute-form target (`POST http://evil.example/api/pull`)
//!    must pass the same rule: RFC 9112 makes the target's host win over the header.
//! 2. **Browsers** (against cross-site requests, which need no preflight when their body
//!    is `text/plain`, a form or `multipart/form-data`): a request that may change
//!    something (every method but GET, HEAD and OPTIONS: store writes, deletes, uploads,
//!    and the model-running routes, which cost compute) is refused with 403 when its
//!    `Origin` is not in `cors_origins`, or when it has no allowed `Origin` and
//!    `Sec-Fetch-Site` says `cross-site` or `same-site` (a page elsewhere; another port of
//!    `localhost` is the same site). `same-origin` and `none` (a user's own navigation)
//!    pass. Clients that are not browsers send neither header. The body's type is checked
//!    per route by [`json_only`].
//! 3. **CORS**: a preflight (`OPTIONS` with `Origin` and `Access-Control-Request-Method`)
//!    from an origin in `cors_origins` is answered here with 204 and the allowed methods
//!    and headers; other requests from such an origin get `Access-Control-Allow-Origin`
//!    echoing it. Other origins get no CORS headers (their preflight goes on to the
//!    router, which refuses `OPTIONS`), so the browser keeps the answer from the page.
//! 4. **Bearer tokens**: with `api_tokens` set, every request but `GET /` and `HEAD /`
//!    needs `Authorization: Bearer <token>` (or `x-api-key: <token>`, as Anthropic's
//!    clients send it), else 401 (with `store_changes = "token"`
//!    the tokens guard only the store changes over TCP, 7. below). Tokens are compared in constant
//!    time: the SHA-256 digests of the presented token and of every configured one are
//!    compared with an xor fold over all 32 bytes, for every token, without an early exit.
//! 5. **Body size** (except blob uploads, `/api/blobs/…`, which stream to disk): a
//!    `Content-Length` over `max_body` is refused with 413 at once; a
//!    body without a length is cut off at `max_body` by the extractors, whose plain-text
//!    413 is turned into the JSON error here.
//! 6. **Idle bodies**: a body that sends nothing for `body_idle_timeout` fails (its reader
//!    sees an error: an upload removes its partial file), and the answer is a 408.
//!
//! 7. **Store changes** ([`store_change`], on the routes that change the store: pull,
//!    push, create, copy, delete, blob uploads): `store_changes = "any"` lets them
//!    through as Ollama does; `"token"` wants a token from `api_tokens` over TCP (401
//!    without one); `"unix"` refuses them over TCP (403) and points to the UNIX socket
//!    and `corralctl`. Over the UNIX socket the peer's credentials (`SO_PEERCRED`) are
//!    logged with each change.
//!
//! Half-sent request heads are the accept loop's (`listeners`, `header_timeout`).

use std::net::IpAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes, HttpBody};
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Version, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::ApiError;
use crate::config::{ServerConfig, StoreChanges};

/// The kind of connection a request came on, put in its extensions by the accept loop
/// (`listeners`); requests made in-process have none.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// TCP: HTTP/1.1 requests must name a host.
    Tcp {
        /// Whether the connection arrived at a loopback address: only those are held to
        /// the Host rule (a rebinding page reaches the machine through loopback).
        loopback: bool,
    },
    /// A UNIX socket: no host is needed.
    Unix {
        /// The peer's credentials, when the kernel gave them (`SO_PEERCRED`).
        peer: Option<Peer>,
    },
}

/// Who is at the other end of a UNIX socket: the credentials of the process that connected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Peer {
    /// Its user id.
    pub uid: u32,
    /// Its group id.
    pub gid: u32,
    /// Its process id, when known.
    pub pid: Option<i32>,
}

/// What the Host rule asks about this machine: its hostname and its interfaces'
/// addresses, read when a request needs them (both change while corrald runs: DHCP,
/// VPNs, containers). `system()` asks the kernel; tests use `fixed`.
#[derive(Clone)]
pub struct LocalNames {
    hostname: Arc<dyn Fn() -> Option<String> + Send + Sync>,
    addresses: Arc<dyn Fn() -> Vec<IpAddr> + Send + Sync>,
}

impl std::fmt::Debug for LocalNames {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalNames").finish_non_exhaustive()
    }
}

impl LocalNames {
    /// The machine's own: `gethostname(2)` and `getifaddrs(3)`.
    #[must_use]
    pub fn system() -> Self {
        Self {
            hostname: Arc::new(|| nix::unistd::gethostname().ok().and_then(|h| h.into_string().ok())),
            addresses: Arc::new(|| {
                nix::ifaddrs::getifaddrs()
                    .map(|addrs| {
                        addrs
                            .filter_map(|a| a.address)
                            .filter_map(|a| {
                                a.as_sockaddr_in()
                                    .map(|v4| IpAddr::V4(v4.ip()))
                                    .or_else(|| a.as_sockaddr_in6().map(|v6| IpAddr::V6(v6.ip())))
                            })
                            .collect()
                    })
                    .unwrap_or_default()
            }),
        }
    }

    /// A fixed hostname and fixed interface addresses.
    #[must_use]
    pub fn fixed(hostname: &str, addresses: Vec<IpAddr>) -> Self {
        let hostname = hostname.to_owned();
        Self { hostname: Arc::new(move || Some(hostname.clone())), addresses: Arc::new(move || addresses.clone()) }
    }

    fn is_hostname(&self, host: &str) -> bool {
        (self.hostname)().is_some_and(|name| normalize_host(&name) == host)
    }

    fn is_interface(&self, ip: IpAddr) -> bool {
        (self.addresses)().into_iter().any(|a| a.to_canonical() == ip)
    }
}

/// The methods a preflight is told the API allows.
const ALLOW_METHODS: &str = "GET, HEAD, POST, PUT, DELETE, OPTIONS";
/// The request headers a preflight is told the API allows when it does not name any.
const ALLOW_HEADERS: &str = "Authorization, Content-Type, User-Agent, Accept, X-Requested-With, X-Api-Key";
/// How long a client refused for too many uploads is told to wait, in seconds.
const RETRY_AFTER: &str = "5";

/// The `[server]` settings the checks use, prepared once.
#[derive(Debug, Clone)]
pub struct Safety {
    /// Lower-cased `allowed_hosts`, IPv6 brackets removed.
    allowed_hosts: Vec<String>,
    /// The machine's hostname and addresses, for the Host rule.
    local: LocalNames,
    /// `store_changes`.
    store_changes: StoreChanges,
    /// `cors_origins` as written.
    cors_origins: Vec<String>,
    /// SHA-256 digests of `api_tokens`.
    token_digests: Vec<[u8; 32]>,
    /// `max_body`; 0 means no limit.
    max_body: u64,
    /// `body_idle_timeout`.
    body_idle_timeout: Duration,
    /// One place per blob upload in progress (`max_uploads`).
    uploads: Places,
    /// One place per pull, push or create in progress over HTTP (`max_store_jobs`).
    store_jobs: Places,
}

/// A bounded number of places, each held until its permit is dropped; one more is a 503
/// with `Retry-After` naming the configuration key.
/// Clones share the places.
#[derive(Debug, Clone)]
struct Places {
    permits: Arc<Semaphore>,
    max: u32,
    /// What runs, plural (`blob uploads`).
    what: &'static str,
    /// The key that sets `max`.
    key: &'static str,
}

impl Places {
    fn new(max: u32, what: &'static str, key: &'static str) -> Self {
        Self { permits: Arc::new(Semaphore::new(usize::try_from(max).unwrap_or(usize::MAX))), max, what, key }
    }

    fn take(&self, path: &str) -> Result<OwnedSemaphorePermit, ApiError> {
        Arc::clone(&self.permits).try_acquire_owned().map_err(|_| {
            super::error::busy(
                format!(
                    "{} {} are already running, the most {} allows; try again later",
                    self.max, self.what, self.key
                ),
                path,
                RETRY_AFTER,
            )
        })
    }
}

impl Safety {
    /// The checks `config` asks for, with `local` telling which names are this machine's.
    #[must_use]
    pub fn new(config: &ServerConfig, local: LocalNames) -> Self {
        Self {
            allowed_hosts: config.allowed_hosts.iter().map(|h| normalize_host(h)).collect(),
            local,
            store_changes: config.store_changes,
            cors_origins: config.cors_origins.clone(),
            token_digests: config.api_tokens.iter().map(|t| digest(t.as_bytes())).collect(),
            max_body: config.max_body,
            body_idle_timeout: config.body_idle_timeout,
            uploads: Places::new(config.max_uploads, "blob uploads", "[server] max_uploads"),
            store_jobs: Places::new(config.max_store_jobs, "pulls, pushes and creates", "[server] max_store_jobs"),
        }
    }

    /// The body limit for the extractors: `usize::MAX` when there is none.
    #[must_use]
    pub fn body_limit(&self) -> usize {
        if self.max_body == 0 { usize::MAX } else { usize::try_from(self.max_body).unwrap_or(usize::MAX) }
    }

    /// A place among the blob uploads in progress, held until dropped; a 503 with
    /// `Retry-After` when `max_uploads` are running.
    pub fn upload_permit(&self, path: &str) -> Result<OwnedSemaphorePermit, ApiError> {
        self.uploads.take(path)
    }

    /// A place among the pulls, pushes and creates in progress over HTTP, held until
    /// dropped (when the work ends); a 503 with `Retry-After` when `max_store_jobs` are
    /// running.
    pub fn store_job_permit(&self, path: &str) -> Result<OwnedSemaphorePermit, ApiError> {
        self.store_jobs.take(path)
    }

    /// Whether `host` (a `Host` value, port and brackets allowed) names this machine, as
    /// Ollama's rule has it, or is in `allowed_hosts`.
    fn host_allowed(&self, host: &str) -> bool {
        let host = normalize_host(host);
        // A zone (`fe80::1%eth0`) says which link, not which machine.
        let ip = host.split('%').next().and_then(|h| h.parse::<IpAddr>().ok()).map(|ip| ip.to_canonical());
        let local = match ip {
            Some(ip) => is_local_ip(ip) || self.local.is_interface(ip),
            None => {
                host == "localhost"
                    || [".localhost", ".local", ".internal"].iter().any(|tld| host.ends_with(tld))
                    || self.local.is_hostname(&host)
            }
        };
        local
            || self.allowed_hosts.iter().any(|pattern| {
                pattern == "*"
                    || *pattern == host
                    || pattern.strip_prefix('*').is_some_and(|suffix| suffix.starts_with('.') && host.ends_with(suffix))
            })
    }

    fn origin_allowed(&self, origin: &str) -> bool {
        self.cors_origins.iter().any(|pattern| match pattern.split_once('*') {
            None => pattern.eq_ignore_ascii_case(origin),
            Some(("", "")) => true,
            Some((prefix, suffix)) => {
                origin.len() >= prefix.len() + suffix.len()
                    && origin.get(..prefix.len()).is_some_and(|p| p.eq_ignore_ascii_case(prefix))
                    && origin.get(origin.len() - suffix.len()..).is_some_and(|s| s.eq_ignore_ascii_case(suffix))
            }
        })
    }

    /// Whether `presented` is one of the tokens, in time independent of where they differ.
    fn token_valid(&self, presented: &str) -> bool {
        let presented = digest(presented.as_bytes());
        let mut found = 0u8;
        for known in &self.token_digests {
            let diff = known.iter().zip(&presented).fold(0u8, |acc, (a, b)| acc | (a ^ b));
            found |= u8::from(diff == 0);
        }
        found == 1
    }
}

/// Addresses that are this machine or its own networks whatever the interfaces say:
/// loopback, private (RFC 1918, IPv6 unique local), unspecified and link-local.
fn is_local_ip(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4.is_loopback() || v4.is_private() || v4.is_unspecified() || v4.is_link_local(),
        IpAddr::V6(v6) => v6.is_loopback() || v6.is_unspecified() || v6.is_unique_local() || v6.is_unicast_link_local(),
    }
}

/// Whether a connection's local address is loopback (IPv4 mapped into IPv6 included, as
/// a dual-stack listener sees IPv4 clients).
#[must_use]
pub fn is_loopback(ip: IpAddr) -> bool {
    ip.to_canonical().is_loopback()
}

/// The token a request presents, if any: a bearer token, else an `x-api-key` (what
/// Anthropic's clients send their key in).
fn presented_token(headers: &HeaderMap) -> Option<&str> {
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")));
    bearer.or_else(|| headers.get(API_KEY).and_then(|v| v.to_str().ok())).map(str::trim)
}

/// The header Anthropic's API takes its key in.
const API_KEY: &str = "x-api-key";

fn digest(bytes: &[u8]) -> [u8; 32] {
    let mut out = [0u8; 32];
    out.copy_from_slice(&Sha256::digest(bytes));
    out
}

/// `host` without its port and IPv6 brackets, lower-cased: `"[::1]:80"` → `"::1"`.
fn normalize_host(host: &str) -> String {
    let host = host.trim();
    let name = if let Some(rest) = host.strip_prefix('[') {
        rest.split_once(']').map_or(rest, |(inside, _)| inside)
    } else {
        match host.rsplit_once(':') {
            // One colon: a name or IPv4 address with a port. More: a bare IPv6 address.
            Some((name, port)) if !name.contains(':') && port.bytes().all(|b| b.is_ascii_digit()) => name,
            _ => host,
        }
    };
    name.trim_end_matches('.').to_ascii_lowercase()
}

fn error(status: StatusCode, message: String, path: &str) -> Response {
    ApiError::new(status, message, path).into_response()
}

/// The Host rule (1. above): `Err` is the refusal.
fn check_host(safety: &Safety, request: &Request, path: &str) -> Result<(), ApiError> {
    let mut headers = request.headers().get_all(header::HOST).iter();
    let host = headers.next();
    if headers.next().is_some() {
        return Err(ApiError::new(StatusCode::BAD_REQUEST, "the request has more than one Host header", path));
    }
    let Ok(host) = host.map(HeaderValue::to_str).transpose() else {
        return Err(ApiError::new(StatusCode::BAD_REQUEST, "the Host header is not valid text", path));
    };
    let transport = request.extensions().get::<Transport>();
    // A connection to a network address of the machine: the client named it on purpose.
    let any_host = matches!(transport, Some(Transport::Tcp { loopback: false }));
    let allowed = |host: &str| any_host || safety.host_allowed(host);
    let refuse = |host: &str, what: &str| {
        let name = normalize_host(host);
        ApiError::new(
            StatusCode::FORBIDDEN,
            format!(
                "{what} \"{host}\" is not a name of this machine, and a connection to a loopback address must \
                 use one (against DNS rebinding); add \"{name}\" to [server] allowed_hosts to allow it"
            ),
            path,
        )
    };
    // An absolute-form target (or HTTP/2's :authority) names the host the client asked for.
    let target = request.uri().authority().map(|a| match a.port() {
        Some(port) => format!("{}:{port}", a.host()),
        None => a.host().to_owned(),
    });
    if let Some(target) = target.as_ref().filter(|target| !allowed(target)) {
        return Err(refuse(target, "the request target's host"));
    }
    match host {
        Some(host) if !allowed(host) => Err(refuse(host, "host")),
        None if target.is_none()
            && request.version() == Version::HTTP_11
            && matches!(transport, Some(Transport::Tcp { .. })) =>
        {
            Err(ApiError::new(StatusCode::BAD_REQUEST, "an HTTP/1.1 request needs a Host header", path))
        }
        Some(_) | None => Ok(()),
    }
}

/// Whether `method` may change something: everything but reading and preflights.
fn may_change(method: &Method) -> bool {
    !matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS)
}

/// Whether a browser sent the request: browsers add `Origin` to every request that may
/// change something, and `Sec-Fetch-*` to every request; other clients send neither.
fn from_browser(headers: &HeaderMap) -> bool {
    headers.contains_key(header::ORIGIN) || headers.keys().any(|name| name.as_str().starts_with("sec-fetch-"))
}

/// The browser rule (2. above): `Ok` with the request's allowed origin (for CORS), or
/// the refusal.
fn check_browser(safety: &Safety, request: &Request, path: &str) -> Result<Option<String>, ApiError> {
    let headers = request.headers();
    let mut origins = headers.get_all(header::ORIGIN).iter();
    let (origin, second) = (origins.next(), origins.next());
    let changes = may_change(request.method());
    let refuse = |message: String| Err(ApiError::new(StatusCode::FORBIDDEN, message, path));
    let Some(origin) = origin else {
        let site = headers.get("sec-fetch-site").map(|v| v.as_bytes().to_ascii_lowercase());
        if changes && matches!(site.as_deref(), Some(b"cross-site" | b"same-site")) {
            return refuse(format!(
                "a {} request from a web page of another site is not allowed here (Sec-Fetch-Site without an \
                 allowed Origin)",
                request.method()
            ));
        }
        return Ok(None);
    };
    let text = String::from_utf8_lossy(origin.as_bytes()).into_owned();
    let allowed = second.is_none() && origin.to_str().is_ok_and(|o| safety.origin_allowed(o));
    if allowed {
        return Ok(Some(text));
    }
    if changes {
        let what = if second.is_some() { "more than one Origin".to_owned() } else { format!("origin \"{text}\"") };
        return refuse(format!(
            "{what} is not allowed to send {} requests; add the origin to [server] cors_origins to allow it",
            request.method()
        ));
    }
    Ok(None)
}

/// The middleware: see the module's documentation for the order and the rules.
pub async fn guard(State(safety): State<Arc<Safety>>, request: Request, next: Next) -> Response {
    let path = request.uri().path().to_owned();

    if let Err(refusal) = check_host(&safety, &request, &path) {
        return refusal.into_response();
    }
    let origin = match check_browser(&safety, &request, &path) {
        Ok(origin) => origin,
        Err(refusal) => return refusal.into_response(),
    };
    let preflighted =
        request.method() == Method::OPTIONS && request.headers().contains_key(header::ACCESS_CONTROL_REQUEST_METHOD);
    if let Some(origin) = origin.as_ref().filter(|_| preflighted) {
        return preflight(origin, request.headers());
    }

    let open = path == "/" && matches!(*request.method(), Method::GET | Method::HEAD);
    // With `store_changes = "token"` the tokens guard the store changes only (`store_change`).
    if !open && !safety.token_digests.is_empty() && safety.store_changes != StoreChanges::Token {
        let refusal = match presented_token(request.headers()) {
            None => Some(
                "this server needs an API token: send \"Authorization: Bearer <token>\" (or \"x-api-key: <token>\")"
                    .to_owned(),
            ),
            Some(token) if !safety.token_valid(token) => Some("the API token is not valid".to_owned()),
            Some(_) => None,
        };
        if let Some(message) = refusal {
            return with_origin(unauthorized(message, &path), origin.as_deref());
        }
    }

    // Blob uploads stream to disk whatever their size; every other body is bounded.
    if safety.max_body != 0 && !path.starts_with("/api/blobs/") {
        let length = request
            .headers()
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if length.is_some_and(|n| n > safety.max_body) {
            return with_origin(too_large(&safety, &path), origin.as_deref());
        }
    }

    let idle = Arc::new(AtomicBool::new(false));
    let request = request.map(|body| {
        if body.is_end_stream() {
            body
        } else {
            Body::new(IdleBody { inner: body, timeout: safety.body_idle_timeout, sleep: None, idle: Arc::clone(&idle) })
        }
    });
    let mut response = next.run(request).await;
    let json =
        response.headers().get(header::CONTENT_TYPE).is_some_and(|v| v.as_bytes().starts_with(b"application/json"));
    if idle.load(Ordering::Relaxed) {
        let seconds = safety.body_idle_timeout.as_secs_f64();
        response = error(
            StatusCode::REQUEST_TIMEOUT,
            format!("the request body sent nothing for {seconds} s; [server] body_idle_timeout sets the limit"),
            &path,
        );
    } else if response.status() == StatusCode::PAYLOAD_TOO_LARGE && !json {
        response = too_large(&safety, &path);
    }
    with_origin(response, origin.as_deref())
}

/// A 401 asking for a bearer token.
fn unauthorized(message: String, path: &str) -> Response {
    let mut response = error(StatusCode::UNAUTHORIZED, message, path);
    response.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    response
}

/// The middleware of the routes that change the store (7. above): `store_changes` decides
/// who may over TCP; over the UNIX socket each change is logged with its peer.
pub async fn store_change(State(safety): State<Arc<Safety>>, request: Request, next: Next) -> Response {
    if !may_change(request.method()) {
        return next.run(request).await;
    }
    let path = request.uri().path().to_owned();
    let method = request.method().clone();
    match request.extensions().get::<Transport>().copied() {
        Some(Transport::Unix { peer }) => {
            tracing::info!(
                corral_event = "store_change",
                corral_transport = "unix",
                corral_peer_uid = peer.map(|p| p.uid),
                corral_peer_gid = peer.map(|p| p.gid),
                corral_peer_pid = peer.and_then(|p| p.pid),
                "{method} {path} over the UNIX socket by uid {}",
                peer.map_or_else(|| "unknown".to_owned(), |p| p.uid.to_string()),
            );
        }
        // TCP, and requests made in-process (which no network client can make), alike.
        _ => match safety.store_changes {
            StoreChanges::Any => {}
            StoreChanges::Token => match presented_token(request.headers()) {
                Some(token) if safety.token_valid(token) => {
                    tracing::info!(
                        corral_event = "store_change",
                        corral_transport = "tcp",
                        "{method} {path} with a token"
                    );
                }
                presented => {
                    let why = if presented.is_some() { "the API token is not valid" } else { "it has no API token" };
                    return unauthorized(
                        format!(
                            "changing the store over TCP needs a token from [server] api_tokens ([server] \
                             store_changes = \"token\") and {why}: send \"Authorization: Bearer <token>\", or use \
                             corralctl or the API's UNIX socket"
                        ),
                        &path,
                    );
                }
            },
            StoreChanges::Unix => {
                return error(
                    StatusCode::FORBIDDEN,
                    "changing the store over TCP is turned off here ([server] store_changes = \"unix\"): use \
                     corralctl, or the API's UNIX socket (for root and group corral)"
                        .to_owned(),
                    &path,
                );
            }
        },
    }
    next.run(request).await
}

/// The middleware of the routes whose body is JSON (all but blob uploads): the body's
/// `Content-Type` must be JSON (`application/json`, `application/*+json`) or absent.
/// `application/x-www-form-urlencoded`, what `curl -d` sends (and every example in
/// Ollama's documentation), is taken from clients that are not browsers; from a browser
/// it is what a cross-site form posts. Any other type is a 415 naming it.
pub async fn json_only(request: Request, next: Next) -> Response {
    if may_change(request.method()) {
        let headers = request.headers();
        for value in headers.get_all(header::CONTENT_TYPE) {
            let text = String::from_utf8_lossy(value.as_bytes());
            let essence = text.split(';').next().unwrap_or_default().trim().to_ascii_lowercase();
            let json =
                essence == "application/json" || (essence.starts_with("application/") && essence.ends_with("+json"));
            let form = essence == "application/x-www-form-urlencoded";
            if json || (form && !from_browser(headers)) {
                continue;
            }
            let message = if form {
                format!(
                    "a form body (\"{essence}\") is not accepted from a browser; send JSON with \"Content-Type: \
                     application/json\""
                )
            } else {
                format!("the request body's type \"{essence}\" is not JSON; send \"Content-Type: application/json\"")
            };
            return error(StatusCode::UNSUPPORTED_MEDIA_TYPE, message, request.uri().path());
        }
    }
    next.run(request).await
}

/// Why a body failed: it sent nothing for `body_idle_timeout`.
#[derive(Debug, thiserror::Error)]
#[error("the request body sent nothing for {0:?}")]
pub struct BodyIdle(Duration);

/// A request body that fails when it sends nothing for `timeout` while being read;
/// the time runs only while its reader waits (not while the handler works on a chunk).
struct IdleBody {
    inner: Body,
    timeout: Duration,
    sleep: Option<Pin<Box<tokio::time::Sleep>>>,
    /// Set when the timeout fired, for the guard to answer 408.
    idle: Arc<AtomicBool>,
}

impl HttpBody for IdleBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, axum::Error>>> {
        let this = self.get_mut();
        if this.idle.load(Ordering::Relaxed) {
            return Poll::Ready(Some(Err(axum::Error::new(BodyIdle(this.timeout)))));
        }
        if let Poll::Ready(frame) = Pin::new(&mut this.inner).poll_frame(cx) {
            this.sleep = None;
            return Poll::Ready(frame);
        }
        let timeout = this.timeout;
        let sleep = this.sleep.get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
        if sleep.as_mut().poll(cx).is_ready() {
            this.sleep = None;
            this.idle.store(true, Ordering::Relaxed);
            return Poll::Ready(Some(Err(axum::Error::new(BodyIdle(timeout)))));
        }
        Poll::Pending
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

fn too_large(safety: &Safety, path: &str) -> Response {
    let limit = bytesize::ByteSize::b(safety.max_body).display().iec();
    error(
        StatusCode::PAYLOAD_TOO_LARGE,
        format!("the request body is larger than {limit}; [server] max_body sets the limit"),
        path,
    )
}

fn preflight(origin: &str, headers: &HeaderMap) -> Response {
    let allow_headers =
        headers.get(header::ACCESS_CONTROL_REQUEST_HEADERS).cloned().unwrap_or(HeaderValue::from_static(ALLOW_HEADERS));
    let mut response = StatusCode::NO_CONTENT.into_response();
    let out = response.headers_mut();
    out.insert(header::ACCESS_CONTROL_ALLOW_METHODS, HeaderValue::from_static(ALLOW_METHODS));
    out.insert(header::ACCESS_CONTROL_ALLOW_HEADERS, allow_headers);
    out.insert(header::ACCESS_CONTROL_MAX_AGE, HeaderValue::from_static("600"));
    with_origin(response, Some(origin))
}

fn with_origin(mut response: Response, origin: Option<&str>) -> Response {
    if let Some(value) = origin.and_then(|o| HeaderValue::from_str(o).ok()) {
        let headers = response.headers_mut();
        headers.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, value);
        headers.append(header::VARY, HeaderValue::from_static("Origin"));
    }
    response
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use axum::body::Body;
    use axum::http::{Method, Request, StatusCode, header};
    use axum::response::Response;
    use tower::ServiceExt;

    use super::{LocalNames, Safety, Transport};
    use crate::config::{ServerConfig, StoreChanges};
    use crate::http::router;
    use crate::http::state::{absent_backend, for_tests};

    async fn send(config: &ServerConfig, request: Request<Body>) -> (Response, serde_json::Value) {
        let (_dir, mut state) = for_tests(absent_backend());
        state.safety = Arc::new(Safety::new(config, machine()));
        let response = router(state).oneshot(request).await.expect("infallible");
        let (parts, body) = response.into_parts();
        let bytes = axum::body::to_bytes(body, 1 << 20).await.expect("body");
        let json = serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null);
        (Response::from_parts(parts, Body::empty()), json)
    }

    fn get(path: &str) -> axum::http::request::Builder {
        Request::builder().method(Method::GET).uri(path)
    }

    async fn status_for_host(config: &ServerConfig, host: &str) -> (StatusCode, serde_json::Value) {
        let request = get("/api/version").header(header::HOST, host).body(Body::empty()).expect("request");
        let (response, json) = send(config, request).await;
        (response.status(), json)
    }

    /// A machine named `corral-box` with a public address among its interfaces.
    fn machine() -> LocalNames {
        LocalNames::fixed("Corral-Box", vec!["203.0.113.7".parse().expect("ip"), "2001:db8::7".parse().expect("ip")])
    }

    /// The status of `GET /api/version` with `Host: host` on a connection marked `transport`.
    async fn status_on(config: &ServerConfig, host: &str, transport: Option<Transport>) -> StatusCode {
        let mut request = get("/api/version").header(header::HOST, host).body(Body::empty()).expect("request");
        if let Some(transport) = transport {
            request.extensions_mut().insert(transport);
        }
        send(config, request).await.0.status()
    }

    #[tokio::test]
    async fn names_of_this_machine_are_allowed_on_loopback_public_names_are_refused() {
        let default = ServerConfig::default();
        let loopback = Some(Transport::Tcp { loopback: true });
        // Ollama's rule: what its clients send with OLLAMA_HOST=0.0.0.0, the hostname,
        // local TLDs, private, link-local and interface addresses; any port.
        for host in [
            "localhost:11434",
            "localhost",
            "LocalHost.",
            "127.0.0.1",
            "127.0.0.1:11434",
            "127.8.9.10",
            "[::1]:8080",
            "app.localhost",
            "0.0.0.0:11434",
            "0.0.0.0",
            "[::]:11434",
            "corral-box",
            "CORRAL-BOX:11434",
            "printer.local",
            "host.docker.internal:11434",
            "metadata.google.internal",
            "192.168.1.5",
            "10.0.0.1:11434",
            "172.16.0.1",
            "172.31.255.255",
            "169.254.1.1",
            "[fe80::1]:11434",
            "[fe80::1%25eth0]:11434",
            "[fd00::1]",
            "[::ffff:127.0.0.1]:11434",
            "[::ffff:192.168.1.5]",
            "203.0.113.7:11434",
            "[2001:db8::7]:11434",
        ] {
            assert_eq!(status_on(&default, host, loopback).await, StatusCode::OK, "{host}");
            assert_eq!(status_on(&default, host, None).await, StatusCode::OK, "{host} in-process");
        }
        let (status, json) = status_for_host(&default, "evil.example:11434").await;
        assert_eq!(status, StatusCode::FORBIDDEN);
        let message = json["error"].as_str().expect("error");
        assert!(message.contains("evil.example:11434") && message.contains("allowed_hosts"), "{message}");
        assert!(message.contains("DNS rebinding"), "{message}");
        // Public names and addresses, names that merely contain a local one, look-alikes.
        for host in [
            "evil.example",
            "localhost.evil.example",
            "local",
            "evil.localhost.example",
            "internal.example",
            "corral-box.evil.example",
            "xcorral-box",
            "8.8.8.8",
            "172.32.0.1",
            "100.64.0.1",
            "[2001:db8::8]",
            "203.0.113.8:11434",
            "[::ffff:8.8.8.8]",
        ] {
            assert_eq!(status_on(&default, host, loopback).await, StatusCode::FORBIDDEN, "{host}");
            let unix = Some(Transport::Unix { peer: None });
            assert_eq!(status_on(&default, host, unix).await, StatusCode::FORBIDDEN, "{host} over UNIX");
        }

        let config = ServerConfig {
            allowed_hosts: vec!["*.lan".into(), "Corral.Example".into(), "8.8.8.8".into()],
            ..ServerConfig::default()
        };
        for host in ["box.lan:11434", "a.b.lan", "corral.example", "8.8.8.8:80"] {
            assert_eq!(status_for_host(&config, host).await.0, StatusCode::OK, "{host}");
        }
        for host in ["lan", "evillan", "evil.example"] {
            assert_eq!(status_for_host(&config, host).await.0, StatusCode::FORBIDDEN, "{host}");
        }
        let any = ServerConfig { allowed_hosts: vec!["*".into()], ..ServerConfig::default() };
        assert_eq!(status_for_host(&any, "evil.example").await.0, StatusCode::OK);
    }

    #[tokio::test]
    async fn any_host_passes_on_a_connection_to_a_network_address() {
        let default = ServerConfig::default();
        let lan = Some(Transport::Tcp { loopback: false });
        for host in ["evil.example", "corral.example.org:11434", "8.8.8.8", "192.168.1.5:11434"] {
            assert_eq!(status_on(&default, host, lan).await, StatusCode::OK, "{host}");
        }
        // Still one Host, and an HTTP/1.1 request must have one.
        let two = get("/api/version").header(header::HOST, "a.example").header(header::HOST, "b.example");
        let mut two = two.body(Body::empty()).expect("request");
        two.extensions_mut().insert(Transport::Tcp { loopback: false });
        assert_eq!(send(&default, two).await.0.status(), StatusCode::BAD_REQUEST);
        let mut none = get("/api/version").body(Body::empty()).expect("request");
        none.extensions_mut().insert(Transport::Tcp { loopback: false });
        assert_eq!(send(&default, none).await.0.status(), StatusCode::BAD_REQUEST);
        // An absolute-form target naming another host is the client's business there too.
        let mut target =
            get("http://corral.example.org/api/version").header(header::HOST, "x").body(Body::empty()).expect("r");
        target.extensions_mut().insert(Transport::Tcp { loopback: false });
        assert_eq!(send(&default, target).await.0.status(), StatusCode::OK);
    }

    /// The status and error of a store change (a copy of a model that is not there, 404
    /// once let through) on `transport` with `token`.
    async fn copy_on(config: &ServerConfig, transport: Transport, token: Option<&str>) -> (StatusCode, String) {
        let mut builder = post("/api/copy").header(header::CONTENT_TYPE, "application/json");
        if let Some(token) = token {
            builder = builder.header(header::AUTHORIZATION, format!("Bearer {token}"));
        }
        let mut request = builder.body(Body::from(r#"{"source":"nope","destination":"x"}"#)).expect("request");
        request.extensions_mut().insert(transport);
        status_and_error(config, request).await
    }

    #[tokio::test]
    async fn store_changes_over_tcp_follow_the_mode_and_the_unix_socket_is_always_let_through() {
        let tcp = Transport::Tcp { loopback: true };
        let unix = Transport::Unix { peer: Some(super::Peer { uid: 1000, gid: 1000, pid: Some(42) }) };
        let tokens = vec!["s3cret".to_owned()];
        let any = ServerConfig::default();
        let token = ServerConfig { store_changes: StoreChanges::Token, api_tokens: tokens.clone(), ..any.clone() };
        let only_unix = ServerConfig { store_changes: StoreChanges::Unix, ..any.clone() };

        assert_eq!(copy_on(&any, tcp, None).await.0, StatusCode::NOT_FOUND);
        assert_eq!(copy_on(&any, unix, None).await.0, StatusCode::NOT_FOUND);

        let (status, error) = copy_on(&token, tcp, None).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{error}");
        assert!(error.contains("api_tokens") && error.contains("Bearer") && error.contains("UNIX socket"), "{error}");
        let (status, error) = copy_on(&token, tcp, Some("wrong")).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{error}");
        assert!(error.contains("not valid"), "{error}");
        assert_eq!(copy_on(&token, tcp, Some("s3cret")).await.0, StatusCode::NOT_FOUND);
        assert_eq!(copy_on(&token, unix, None).await.0, StatusCode::NOT_FOUND);
        // In this mode the tokens guard the changes only: reading and running stay open.
        let mut read = get("/api/version").header(header::HOST, "localhost").body(Body::empty()).expect("r");
        read.extensions_mut().insert(tcp);
        assert_eq!(send(&token, read).await.0.status(), StatusCode::OK);
        let mut show = post("/api/show").body(Body::from(r#"{"model":"nope"}"#)).expect("r");
        show.extensions_mut().insert(tcp);
        assert_eq!(send(&token, show).await.0.status(), StatusCode::NOT_FOUND);

        // Even a valid token (here the tokens guard every request) does not change over TCP.
        for (config, with) in
            [(only_unix.clone(), None), (ServerConfig { api_tokens: tokens, ..only_unix.clone() }, Some("s3cret"))]
        {
            let (status, error) = copy_on(&config, tcp, with).await;
            assert_eq!(status, StatusCode::FORBIDDEN, "{with:?}: {error}");
            assert!(error.contains("store_changes") && error.contains("corralctl"), "{error}");
        }
        assert_eq!(copy_on(&only_unix, unix, None).await.0, StatusCode::NOT_FOUND);
        // Every route that changes the store, and only those.
        for (method, path) in [
            (Method::POST, "/api/pull"),
            (Method::POST, "/api/push"),
            (Method::POST, "/api/create"),
            (Method::DELETE, "/api/delete"),
            (Method::POST, "/api/blobs/sha256:00"),
        ] {
            let mut request = Request::builder()
                .method(method.clone())
                .uri(path)
                .header(header::HOST, "localhost")
                .body(Body::from("{}"))
                .expect("request");
            request.extensions_mut().insert(tcp);
            assert_eq!(send(&only_unix, request).await.0.status(), StatusCode::FORBIDDEN, "{method} {path}");
        }
        let mut head = Request::builder()
            .method(Method::HEAD)
            .uri("/api/blobs/sha256:00")
            .header(header::HOST, "localhost")
            .body(Body::empty())
            .expect("request");
        head.extensions_mut().insert(tcp);
        assert_ne!(send(&only_unix, head).await.0.status(), StatusCode::FORBIDDEN, "HEAD reads");
    }

    #[test]
    fn loopback_local_addresses_include_ipv4_mapped_ones() {
        for ip in ["127.0.0.1", "127.1.2.3", "::1", "::ffff:127.0.0.1"] {
            assert!(super::is_loopback(ip.parse().expect("ip")), "{ip}");
        }
        for ip in ["0.0.0.0", "192.168.1.5", "::", "::ffff:192.168.1.5", "fe80::1"] {
            assert!(!super::is_loopback(ip.parse().expect("ip")), "{ip}");
        }
    }

    #[test]
    fn the_system_probe_knows_this_machine() {
        let local = LocalNames::system();
        let name = (local.hostname)().expect("a hostname");
        assert!(local.is_hostname(&super::normalize_host(&name)), "{name}");
        assert!(local.is_interface("127.0.0.1".parse().expect("ip")), "lo is an interface: {:?}", (local.addresses)());
    }

    #[tokio::test]
    async fn a_request_without_a_host_is_allowed() {
        let (response, _) =
            send(&ServerConfig::default(), get("/api/version").body(Body::empty()).expect("request")).await;
        assert_eq!(response.status(), StatusCode::OK);
    }

    fn preflight(origin: &str) -> Request<Body> {
        Request::builder()
            .method(Method::OPTIONS)
            .uri("/api/show")
            .header(header::HOST, "localhost:11434")
            .header(header::ORIGIN, origin)
            .header(header::ACCESS_CONTROL_REQUEST_METHOD, "POST")
            .header(header::ACCESS_CONTROL_REQUEST_HEADERS, "content-type")
            .body(Body::empty())
            .expect("request")
    }

    fn allow_origin(response: &Response) -> Option<&str> {
        response.headers().get(header::ACCESS_CONTROL_ALLOW_ORIGIN).map(|v| v.to_str().expect("ascii"))
    }

    #[tokio::test]
    async fn cors_preflight_and_headers_only_for_allowed_origins() {
        let default = ServerConfig::default();
        let (response, _) = send(&default, preflight("http://localhost:3000")).await;
        assert_eq!(response.status(), StatusCode::NO_CONTENT);
        assert_eq!(allow_origin(&response), Some("http://localhost:3000"));
        let methods = response.headers()[header::ACCESS_CONTROL_ALLOW_METHODS].to_str().expect("ascii");
        assert!(methods.contains("POST"), "{methods}");
        assert_eq!(response.headers()[header::ACCESS_CONTROL_ALLOW_HEADERS], "content-type");

        let (response, _) = send(&default, preflight("https://evil.example")).await;
        assert_ne!(response.status(), StatusCode::NO_CONTENT);
        assert!(response.headers().keys().all(|k| !k.as_str().starts_with("access-control-")), "{response:?}");

        let simple =
            |origin: &str| get("/api/version").header(header::ORIGIN, origin).body(Body::empty()).expect("request");
        let (response, _) = send(&default, simple("http://127.0.0.1:8080")).await;
        assert_eq!(allow_origin(&response), Some("http://127.0.0.1:8080"));
        let (response, _) = send(&default, simple("http://localhost.evil.example")).await;
        assert_eq!((response.status(), allow_origin(&response)), (StatusCode::OK, None));

        let any = ServerConfig { cors_origins: vec!["*".into()], ..ServerConfig::default() };
        let (response, _) = send(&any, preflight("https://evil.example")).await;
        assert_eq!(response.status(), StatusCode::NO_CONTENT);
        assert_eq!(allow_origin(&response), Some("https://evil.example"));
    }

    #[tokio::test]
    async fn tokens_guard_everything_but_the_root() {
        let config = ServerConfig { api_tokens: vec!["one".into(), "two".into()], ..ServerConfig::default() };
        let with = |auth: Option<&str>| {
            let builder = get("/api/version");
            let builder = match auth {
                Some(a) => builder.header(header::AUTHORIZATION, a),
                None => builder,
            };
            builder.body(Body::empty()).expect("request")
        };
        let (response, json) = send(&config, with(None)).await;
        assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
        assert_eq!(response.headers()[header::WWW_AUTHENTICATE], "Bearer");
        assert!(json["error"].as_str().expect("error").contains("Bearer"), "{json}");
        for wrong in ["Bearer three", "Bearer on", "Bearer onee", "Basic b25lOg==", "one"] {
            let (response, json) = send(&config, with(Some(wrong))).await;
            assert_eq!(response.status(), StatusCode::UNAUTHORIZED, "{wrong}");
            assert!(json["error"].is_string(), "{json}");
        }
        for right in ["Bearer one", "Bearer two"] {
            assert_eq!(send(&config, with(Some(right))).await.0.status(), StatusCode::OK, "{right}");
        }
        for method in [Method::GET, Method::HEAD] {
            let root = Request::builder().method(method.clone()).uri("/").body(Body::empty()).expect("request");
            assert_eq!(send(&config, root).await.0.status(), StatusCode::OK, "{method}");
        }
        let (response, json) = send(&config, Request::post("/v1/models").body(Body::empty()).expect("r")).await;
        assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
        assert!(json["error"]["message"].is_string(), "OpenAI's shape under /v1/: {json}");

        // Anthropic's clients send their key in `x-api-key`; a bearer token, when sent, is
        // the one that counts.
        let keyed = |key: &str, bearer: Option<&str>| {
            let builder = get("/api/version").header("x-api-key", key);
            let builder = match bearer {
                Some(b) => builder.header(header::AUTHORIZATION, b),
                None => builder,
            };
            builder.body(Body::empty()).expect("request")
        };
        assert_eq!(send(&config, keyed("two", None)).await.0.status(), StatusCode::OK);
        assert_eq!(send(&config, keyed("three", None)).await.0.status(), StatusCode::UNAUTHORIZED);
        assert_eq!(send(&config, keyed("one", Some("Bearer three"))).await.0.status(), StatusCode::UNAUTHORIZED);
        let (response, json) = send(&config, Request::post("/v1/messages").body(Body::empty()).expect("r")).await;
        assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
        assert_eq!(json["type"], "error", "Anthropic's shape under /v1/messages: {json}");
        assert_eq!(json["error"]["type"], "authentication_error", "{json}");
        assert!(json["error"]["message"].as_str().expect("a message").contains("x-api-key"), "{json}");
    }

    #[tokio::test]
    async fn bodies_over_the_limit_are_a_json_413() {
        let config = ServerConfig { max_body: 1024, ..ServerConfig::default() };
        let big = format!("{{\"model\": \"{}\"}}", "x".repeat(2048));
        let request = Request::post("/api/show")
            .header(header::CONTENT_TYPE, "application/json")
            .header(header::CONTENT_LENGTH, big.len())
            .body(Body::from(big.clone()))
            .expect("request");
        let (response, json) = send(&config, request).await;
        assert_eq!(response.status(), StatusCode::PAYLOAD_TOO_LARGE);
        assert!(json["error"].as_str().expect("error").contains("max_body"), "{json}");

        // Without a Content-Length the extractor stops reading at the limit.
        let stream = futures_util::stream::iter([Ok::<_, std::io::Error>(axum::body::Bytes::from(big))]);
        let request = Request::post("/api/show")
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from_stream(stream))
            .expect("request");
        let (response, json) = send(&config, request).await;
        assert_eq!(response.status(), StatusCode::PAYLOAD_TOO_LARGE);
        assert!(json["error"].as_str().expect("error").contains("max_body"), "{json}");

        let small = Request::post("/api/show")
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from("{\"model\": \"nope\"}"))
            .expect("request");
        assert_ne!(send(&config, small).await.0.status(), StatusCode::PAYLOAD_TOO_LARGE);
    }

    fn post(path: &str) -> axum::http::request::Builder {
        Request::builder().method(Method::POST).uri(path).header(header::HOST, "localhost:11434")
    }

    async fn status_and_error(config: &ServerConfig, request: Request<Body>) -> (StatusCode, String) {
        let (response, json) = send(config, request).await;
        let error = json["error"].as_str().or_else(|| json["error"]["message"].as_str()).unwrap_or_default();
        (response.status(), error.to_owned())
    }

    #[tokio::test]
    async fn browsers_from_other_origins_may_read_but_not_change_anything() {
        let config = ServerConfig::default();
        for (method, path) in [
            (Method::POST, "/api/copy"),
            (Method::POST, "/api/pull"),
            (Method::DELETE, "/api/delete"),
            (Method::PUT, "/api/anything"),
            (Method::POST, "/api/blobs/sha256:00"),
            (Method::POST, "/api/generate"),
            (Method::POST, "/v1/chat/completions"),
        ] {
            let request = Request::builder()
                .method(method.clone())
                .uri(path)
                .header(header::ORIGIN, "https://evil.example")
                .header(header::CONTENT_TYPE, "text/plain")
                .body(Body::from("{}"))
                .expect("request");
            let (status, error) = status_and_error(&config, request).await;
            assert_eq!(status, StatusCode::FORBIDDEN, "{method} {path}");
            assert!(error.contains("\"https://evil.example\"") && error.contains("cors_origins"), "{error}");
        }
        // Reading is fine (CORS keeps the answer from the page), and so is an allowed origin.
        let read = get("/api/version").header(header::ORIGIN, "https://evil.example").body(Body::empty());
        assert_eq!(send(&config, read.expect("request")).await.0.status(), StatusCode::OK);
        let allowed = post("/api/nope").header(header::ORIGIN, "http://localhost:3000").body(Body::empty());
        assert_eq!(send(&config, allowed.expect("request")).await.0.status(), StatusCode::NOT_FOUND);
        // Two origins are not one allowed origin.
        let two = post("/api/nope")
            .header(header::ORIGIN, "http://localhost:3000")
            .header(header::ORIGIN, "https://evil.example")
            .body(Body::empty());
        let (status, error) = status_and_error(&config, two.expect("request")).await;
        assert_eq!(status, StatusCode::FORBIDDEN, "{error}");
    }

    #[tokio::test]
    async fn sec_fetch_site_from_elsewhere_needs_an_allowed_origin() {
        let config = ServerConfig::default();
        for (site, expected) in [
            ("cross-site", StatusCode::FORBIDDEN),
            ("Cross-Site", StatusCode::FORBIDDEN),
            ("same-site", StatusCode::FORBIDDEN),
            ("same-origin", StatusCode::NOT_FOUND),
            ("none", StatusCode::NOT_FOUND),
        ] {
            let request = post("/api/nope").header("sec-fetch-site", site).body(Body::empty()).expect("request");
            let (status, error) = status_and_error(&config, request).await;
            assert_eq!(status, expected, "{site}: {error}");
            let with_origin = post("/api/nope")
                .header("sec-fetch-site", site)
                .header(header::ORIGIN, "http://127.0.0.1:8080")
                .body(Body::empty())
                .expect("request");
            assert_eq!(send(&config, with_origin).await.0.status(), StatusCode::NOT_FOUND, "{site} allowed origin");
        }
        let read = get("/api/version").header("sec-fetch-site", "cross-site").body(Body::empty()).expect("request");
        assert_eq!(send(&config, read).await.0.status(), StatusCode::OK);
    }

    #[tokio::test]
    async fn json_routes_take_json_and_forms_only_from_clients_that_are_not_browsers() {
        let config = ServerConfig::default();
        let show = |content_type: Option<&str>, browser: Option<(&str, &str)>| {
            let mut builder = post("/api/show");
            if let Some(value) = content_type {
                builder = builder.header(header::CONTENT_TYPE, value);
            }
            if let Some((name, value)) = browser {
                builder = builder.header(name, value);
            }
            builder.body(Body::from("{\"model\": \"nope\"}")).expect("request")
        };
        // Past the content check, the missing model is a 404.
        for accepted in [
            None,
            Some("application/json"),
            Some("Application/JSON; charset=utf-8"),
            Some("application/vnd.api+json"),
            Some("application/x-www-form-urlencoded"),
        ] {
            let (status, error) = status_and_error(&config, show(accepted, None)).await;
            assert_eq!(status, StatusCode::NOT_FOUND, "{accepted:?}: {error}");
        }
        let origin = Some(("origin", "http://localhost:3000"));
        let fetch = Some(("sec-fetch-mode", "cors"));
        for (refused, browser, named) in [
            ("text/plain", None, "\"text/plain\""),
            ("text/plain;charset=UTF-8", origin, "\"text/plain\""),
            ("multipart/form-data; boundary=x", None, "\"multipart/form-data\""),
            ("application/xml", None, "\"application/xml\""),
            ("", None, "\"\""),
            ("application/x-www-form-urlencoded", origin, "form body"),
            ("application/x-www-form-urlencoded", fetch, "form body"),
        ] {
            let (status, error) = status_and_error(&config, show(Some(refused), browser)).await;
            assert_eq!(status, StatusCode::UNSUPPORTED_MEDIA_TYPE, "{refused} {browser:?}: {error}");
            assert!(error.contains(named) && error.contains("application/json"), "{error}");
        }
        // Uploads are raw bytes, of any type; unknown paths and reads are not checked.
        let upload = post("/api/blobs/sha256:00").header(header::CONTENT_TYPE, "text/plain").body(Body::from("x"));
        assert_eq!(send(&config, upload.expect("request")).await.0.status(), StatusCode::BAD_REQUEST);
        let unknown = post("/api/nope").header(header::CONTENT_TYPE, "text/plain").body(Body::from("x"));
        assert_eq!(send(&config, unknown.expect("request")).await.0.status(), StatusCode::NOT_FOUND);
        let (status, error) = status_and_error(&config, {
            let r = post("/v1/chat/completions").header(header::CONTENT_TYPE, "text/plain").body(Body::from("{}"));
            r.expect("request")
        })
        .await;
        assert_eq!(status, StatusCode::UNSUPPORTED_MEDIA_TYPE, "OpenAI's shape under /v1/: {error}");
    }

    #[tokio::test]
    async fn two_hosts_and_absolute_targets_naming_other_hosts_are_refused() {
        let config = ServerConfig::default();
        let two = get("/api/version").header(header::HOST, "localhost").header(header::HOST, "evil.example");
        let (status, error) = status_and_error(&config, two.body(Body::empty()).expect("request")).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert!(error.contains("more than one Host"), "{error}");
        let two_local = get("/api/version").header(header::HOST, "localhost").header(header::HOST, "localhost");
        assert_eq!(send(&config, two_local.body(Body::empty()).expect("r")).await.0.status(), StatusCode::BAD_REQUEST);

        for target in ["http://evil.example/api/version", "http://localhost@evil.example:80/api/version"] {
            let request = get(target).header(header::HOST, "localhost").body(Body::empty()).expect("request");
            let (status, error) = status_and_error(&config, request).await;
            assert_eq!(status, StatusCode::FORBIDDEN, "{target}");
            assert!(error.contains("evil.example") && error.contains("allowed_hosts"), "{error}");
        }
        for target in ["http://localhost:11434/api/version", "http://[::1]/api/version"] {
            let request = get(target).header(header::HOST, "localhost").body(Body::empty()).expect("request");
            assert_eq!(send(&config, request).await.0.status(), StatusCode::OK, "{target}");
        }
    }

    #[tokio::test]
    async fn a_body_that_sends_nothing_for_the_idle_timeout_is_a_408() {
        let config =
            ServerConfig { body_idle_timeout: std::time::Duration::from_millis(200), ..ServerConfig::default() };
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<axum::body::Bytes, std::io::Error>>(1);
        tx.send(Ok(axum::body::Bytes::from_static(b"{\"model\""))).await.expect("send");
        let body = Body::from_stream(tokio_stream_of(rx));
        let request = post("/api/show").header(header::CONTENT_TYPE, "application/json").body(body).expect("request");
        let started = std::time::Instant::now();
        let (status, error) =
            tokio::time::timeout(std::time::Duration::from_secs(30), status_and_error(&config, request))
                .await
                .expect("answered once the body was idle");
        assert_eq!(status, StatusCode::REQUEST_TIMEOUT, "{error}");
        assert!(error.contains("body_idle_timeout"), "{error}");
        assert!(started.elapsed() >= std::time::Duration::from_millis(200));
        drop(tx);
    }

    /// A body stream fed by `rx`.
    fn tokio_stream_of<T: Send + 'static>(
        rx: tokio::sync::mpsc::Receiver<T>,
    ) -> impl futures_util::Stream<Item = T> + Send + 'static {
        futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|item| (item, rx)) })
    }

    #[test]
    fn uploads_beyond_the_cap_are_a_503_with_retry_after() {
        let safety = Safety::new(&ServerConfig { max_uploads: 2, ..ServerConfig::default() }, machine());
        let first = safety.upload_permit("/api/blobs").expect("first");
        let _second = safety.upload_permit("/api/blobs").expect("second");
        let refused = safety.upload_permit("/api/blobs").expect_err("third");
        assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert!(refused.message().contains("max_uploads"), "{}", refused.message());
        let response = axum::response::IntoResponse::into_response(refused);
        assert_eq!(response.headers()[header::RETRY_AFTER], "5");
        drop(first);
        let _again = safety.upload_permit("/api/blobs").expect("a place is free again");
    }
}
