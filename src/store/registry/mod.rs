//! Pulling models from, and pushing them to, a registry that speaks the OCI distribution
//! protocol the way Ollama's registry does (`registry.ollama.ai`, or any Docker registry v2).
//!
//! # Pull
//!
//! 1. `GET /v2/<namespace>/<model>/manifests/<tag>` with `Accept:` the v2 manifest type. The
//!    bytes are parsed and checked with [`Manifest::parse`]; a bad manifest fails the pull
//!    before anything is written. The bytes are kept to be written verbatim at the end.
//! 2. Every blob the manifest names is pinned ([`Store::pin`]), so that deleting another
//!    model that shares a blob cannot remove it while the pull runs.
//! 3. Each blob not already in the store is downloaded in ranged parts (`Range: bytes=a-b`,
//!    [`RegistryConfig::part_size`] each, [`RegistryConfig::max_parts`] at a time), its size
//!    taken from the manifest. Every answer is checked: `206` with exactly the asked
//!    `Content-Range`, or `200` only when the whole blob was asked for. The data goes into
//!    `blobs/sha256-<hex>-partial` at each part's offset.
//! 4. The whole blob's SHA-256 is checked before it is renamed to `blobs/sha256-<hex>`; data
//!    that hashes to anything else is deleted and the pull fails naming the digest.
//! 5. The manifest is written last ([`Store::write_manifest_bytes`]).
//!
//! Progress is reported as Ollama's `/api/pull` stream reports it: `pulling manifest`, then
//! `pulling <12 hex digits>` with `digest`, `total` and `completed` for each blob, then
//! `verifying sha256 digest`, `writing manifest` and `success`.
//!
//! # Resuming
//!
//! Next to the partial data file, `blobs/sha256-<hex>-partial.json` records which byte ranges
//! of it are written. It is replaced atomically (a `.tmp-` file renamed over it), after the
//! data file is synced, about once a second while a download runs and whenever one stops
//! (an error, or every waiter gone). A later pull of the same blob, in this process or after
//! a restart, fetches only the ranges the record does not cover; within a pull, a part whose
//! transfer breaks off is retried from the first byte that did not arrive. A record that does
//! not match the blob (another size, a missing data file) is ignored and the download starts
//! over. Neither name starts with `.tmp-`, so [`Store::open`] keeps them. The data file grows
//! as data arrives: nothing is reserved from the size the registry announced. Partial files of
//! blobs that nobody pulls any more are removed by garbage collection ([`super::gc`]) once
//! they are older than its grace age; a running download pins its blob, so a collection
//! never touches its files. A link planted in place of either file is refused.
//!
//! # Shared downloads
//!
//! A [`Registry`] keeps a map of downloads in flight, keyed by store and digest. A pull that
//! needs a blob already being downloaded waits on that download instead of starting its own:
//! it sees the same progress and gets the same result. The download runs in its own task and
//! stops (keeping its progress for a resume) when the last pull waiting on it is dropped.
//!
//! # Authentication
//!
//! A `401` with `WWW-Authenticate: Bearer realm="…",service="…",scope="…"` makes the client
//! `GET` the realm with `service` and `scope` as query parameters, anonymously, and use the
//! `token` (or `access_token`) of the JSON answer as `Authorization: Bearer`, retrying the
//! request once; the token is reused for the rest of the pull or push. The realm must be an
//! `https` URL, or a plain `http` one on the registry's own host and port (an insecure
//! registry's own token service): a token is never fetched over plain HTTP from elsewhere.
//! Basic authentication is not supported.
//!
//! # Push
//!
//! For each blob: `HEAD /v2/<repo>/blobs/<digest>` (present: skipped), otherwise
//! `POST /v2/<repo>/blobs/uploads/` and a monolithic `PUT <Location>&digest=<digest>` that
//! streams the file. Then `PUT /v2/<repo>/manifests/<tag>` with the manifest's bytes as stored.

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, BufReader, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use futures_util::{StreamExt, TryStreamExt, stream};
use reqwest::header::{ACCEPT, CONTENT_LENGTH, CONTENT_TYPE, LOCATION, RANGE, WWW_AUTHENTICATE};
use reqwest::{Body, Client, RequestBuilder, Response, StatusCode, Url};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use super::beneath::{self, Dir};
use super::digest::Digest;
use super::limits;
use super::manifest::{Layer, MANIFEST_MEDIA_TYPE, Manifest};
use super::name::ModelName;
use super::{Pin, Store, StoreError};

/// The most a manifest may weigh; real ones are a few KB.
const MAX_MANIFEST_BYTES: usize = 4 << 20;
/// The most a token service's answer may weigh.
const MAX_TOKEN_BYTES: usize = 64 << 10;
/// How much of an error answer's body goes into an error message.
const EXCERPT_BYTES: usize = 300;
/// Downloaded data is written in pieces of about this size.
const WRITE_CHUNK: usize = 1 << 20;
/// How often a running download records its progress on disk.
const CHECKPOINT_INTERVAL: Duration = Duration::from_secs(1);
/// How often progress is reported while bytes flow.
const PROGRESS_INTERVAL: Duration = Duration::from_millis(100);

/// How to talk to registries. No global state: every [`Registry`] carries its own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegistryConfig {
    /// Registries spoken to over plain HTTP, as `host[:port]` exactly as model names write
    /// them (`localhost:5000`). Every other registry is spoken to over HTTPS.
    pub insecure: Vec<String>,
    /// How long establishing a connection may take.
    pub connect_timeout: Duration,
    /// How long a transfer may go without a byte before it counts as stalled (and is retried).
    pub read_timeout: Duration,
    /// The limit on small requests as a whole: manifests, tokens, existence checks, upload starts.
    pub request_timeout: Duration,
    /// Blobs are downloaded in ranged parts of at most this many bytes.
    pub part_size: u64,
    /// How many parts of one blob are downloaded at once.
    pub max_parts: usize,
    /// How many times a part is tried before the pull fails (1: no retry). A retry asks only
    /// for the bytes that did not arrive; what did is kept.
    pub part_attempts: u32,
    /// The wait before the first retry of a part; doubled for each further one.
    pub retry_delay: Duration,
}

impl Default for RegistryConfig {
    fn default() -> Self {
        Self {
            insecure: Vec::new(),
            connect_timeout: Duration::from_secs(30),
            read_timeout: Duration::from_secs(60),
            request_timeout: Duration::from_secs(60),
            part_size: 64 << 20,
            max_parts: 8,
            part_attempts: 4,
            retry_delay: Duration::from_secs(1),
        }
    }
}

/// One progress event of a pull or push, in the shape of Ollama's `/api/pull` stream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Progress {
    /// What is happening: `pulling manifest`, `pulling <12 hex digits>`, `verifying sha256
    /// digest`, `writing manifest`, `success`; for a push `retrieving manifest`, `pushing <12
    /// hex digits>`, `pushing manifest`, `success`.
    pub status: String,
    /// The blob being transferred.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<Digest>,
    /// The blob's size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total: Option<u64>,
    /// How much of it is in place.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completed: Option<u64>,
}

impl Progress {
    /// A step with no blob attached.
    #[must_use]
    pub fn step(status: &str) -> Self {
        Self { status: status.to_owned(), digest: None, total: None, completed: None }
    }

    /// A blob transfer: `<verb> <12 hex digits of the digest>`.
    #[must_use]
    pub fn blob(verb: &str, digest: Digest, total: u64, completed: u64) -> Self {
        Self {
            status: format!("{verb} {}", &digest.hex()[..12]),
            digest: Some(digest),
            total: Some(total),
            completed: Some(completed),
        }
    }
}

/// Why a pull or push failed. Each message names the registry, the model or blob and what
/// went wrong. Cheap to clone, so that every pull sharing a download gets the same error.
#[derive(Debug, Clone, thiserror::Error)]
pub enum RegistryError {
    /// The registry does not have the model (or one of its blobs).
    #[error("{what} not found on registry {registry}")]
    NotFound {
        /// The registry host.
        registry: String,
        /// `model <repo>:<tag>` or `blob <digest> of <repo>:<tag>`.
        what: String,
    },
    /// The registry refused access, even after the token exchange.
    #[error("registry {registry} refused access to {what}: {reason}")]
    Unauthorized {
        /// The registry host.
        registry: String,
        /// What was asked for.
        what: String,
        /// Why, as far as the registry or its token service said.
        reason: String,
    },
    /// The registry failed (a 5xx answer).
    #[error("registry {registry} failed with HTTP {status} for {what}: {body}")]
    Server {
        /// The registry host.
        registry: String,
        /// What was asked for.
        what: String,
        /// The HTTP status.
        status: u16,
        /// The start of the answer's body.
        body: String,
    },
    /// Any other answer the protocol does not expect.
    #[error("registry {registry} answered HTTP {status} for {what}: {body}")]
    UnexpectedStatus {
        /// The registry host.
        registry: String,
        /// What was asked for.
        what: String,
        /// The HTTP status.
        status: u16,
        /// The start of the answer's body.
        body: String,
    },
    /// An HTTPS request was answered in plain HTTP: the registry serves only HTTP, which
    /// the client must allow (rustls reports it as an invalid TLS content type).
    #[error(
        "registry {registry} answered in plain HTTP, not HTTPS, for {what}: if it serves only HTTP, \
         use --insecure (`\"insecure\": true` in the API)"
    )]
    PlainHttp {
        /// The registry host.
        registry: String,
        /// What was asked for.
        what: String,
    },
    /// The registry could not be reached or the request failed before an answer.
    #[error("cannot reach registry {registry} for {what}: {detail}")]
    Transport {
        /// The registry host.
        registry: String,
        /// What was asked for.
        what: String,
        /// The cause, with its chain.
        detail: String,
    },
    /// A blob's transfer broke off (connection closed or reset, or stalled) before all of it
    /// arrived. What did arrive is kept for the next attempt.
    #[error(
        "the download of {what} from registry {registry} broke off after {received} of {expected} bytes \
         (range {first}-{last}): {detail}; what arrived is kept and a new pull resumes from there"
    )]
    Truncated {
        /// The registry host.
        registry: String,
        /// `blob <digest> of <repo>:<tag>`.
        what: String,
        /// Bytes that arrived in the attempt that broke off.
        received: u64,
        /// Bytes that attempt asked for.
        expected: u64,
        /// The first byte asked for.
        first: u64,
        /// The last byte asked for.
        last: u64,
        /// The cause.
        detail: String,
    },
    /// A downloaded blob's data does not hash to its digest. It was deleted.
    #[error(
        "blob {digest} from registry {registry} is corrupt: its data hashes to {actual}; \
         the download was deleted, pull again"
    )]
    DigestMismatch {
        /// The registry host.
        registry: String,
        /// The digest the manifest names.
        digest: Digest,
        /// What the data hashed to.
        actual: Digest,
    },
    /// The manifest is not one this store can use.
    #[error("registry {registry} sent a bad manifest for {model}: {reason}")]
    BadManifest {
        /// The registry host.
        registry: String,
        /// `<repo>:<tag>`.
        model: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A ranged request was answered with the wrong status, `Content-Range` or length.
    #[error("registry {registry} answered a ranged request for {what} wrongly: {detail}")]
    BadRange {
        /// The registry host.
        registry: String,
        /// `blob <digest> of <repo>:<tag>`.
        what: String,
        /// What was wrong.
        detail: String,
    },
    /// The registry broke the protocol in some other way (no upload location, a token realm
    /// that is not a URL...).
    #[error("registry {registry}: {detail}")]
    Protocol {
        /// The registry host.
        registry: String,
        /// What was wrong.
        detail: String,
    },
    /// The disk holding the store is full. Nothing half-written was kept.
    #[error("the disk is full: {context}; free some space and try again")]
    DiskFull {
        /// What could not be written, and where.
        context: String,
    },
    /// A pull waited on a download that stopped without a result.
    #[error("the download of blob {digest} stopped unexpectedly; try again")]
    Interrupted {
        /// The blob.
        digest: Digest,
    },
    /// The store failed.
    #[error(transparent)]
    Store(Arc<StoreError>),
    /// A file operation failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done, with the path.
        context: String,
        /// The cause.
        source: Arc<io::Error>,
    },
    /// The HTTP client could not be set up.
    #[error("cannot set up the HTTP client: {0}")]
    Client(String),
}

impl RegistryError {
    /// Whether trying the same transfer again may help.
    fn is_transient(&self) -> bool {
        matches!(self, Self::Truncated { .. } | Self::Transport { .. } | Self::Server { .. })
    }

    /// Whether the partial download must go (its data is wrong, or it holds space the disk lacks).
    fn discards_partial(&self) -> bool {
        matches!(self, Self::DigestMismatch { .. } | Self::DiskFull { .. })
    }

    fn io(context: impl Into<String>, source: io::Error) -> Self {
        Self::Io { context: context.into(), source: Arc::new(source) }
    }
}

impl From<StoreError> for RegistryError {
    fn from(error: StoreError) -> Self {
        match error {
            StoreError::Io { context, source } if is_disk_full(&source) => Self::DiskFull { context },
            other => Self::Store(Arc::new(other)),
        }
    }
}

fn is_disk_full(error: &io::Error) -> bool {
    matches!(error.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT))
}

/// An error and its causes, `: `-separated.
fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

/// Whether a TLS handshake failed because the server answered in plain HTTP: its first
/// byte (`H` of `HTTP/1.1`) is no TLS record type.
fn answered_in_plain_http(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut source = Some(error);
    while let Some(cause) = source {
        if let Some(rustls::Error::InvalidMessage(rustls::InvalidMessage::InvalidContentType)) = cause.downcast_ref() {
            return true;
        }
        // An io::Error's `source` skips the error it wraps: look at that one too.
        if let Some(inner) = cause.downcast_ref::<io::Error>().and_then(io::Error::get_ref) {
            if answered_in_plain_http(inner) {
                return true;
            }
        }
        source = cause.source();
    }
    false
}

/// The state of a blob download, as pulls waiting on it see it.
#[derive(Debug, Clone)]
struct BlobStatus {
    total: u64,
    /// Whether the download knows how much it resumed from (until then `completed` means nothing).
    started: bool,
    completed: u64,
    done: Option<Result<(), RegistryError>>,
}

type InflightKey = (PathBuf, Digest);
type Inflight = HashMap<InflightKey, Arc<watch::Sender<BlobStatus>>>;

/// A registry client: the configuration, one HTTP client, and the downloads in flight.
/// Create one and share it (it is cheap to clone); pulls through the same `Registry` share
/// downloads of the same blob into the same store.
#[derive(Debug, Clone)]
pub struct Registry {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    config: RegistryConfig,
    /// Built on first use: building reads and parses every system CA certificate, which a
    /// daemon that never pulls should not pay for at start (time, and memory it touches).
    client: OnceLock<Result<Client, String>>,
    inflight: Mutex<Inflight>,
}

impl Inner {
    fn client(&self) -> Result<&Client, RegistryError> {
        let built = self.client.get_or_init(|| {
            Client::builder()
                .connect_timeout(self.config.connect_timeout)
                .read_timeout(self.config.read_timeout)
                .user_agent(concat!("corral/", env!("CARGO_PKG_VERSION")))
                .build()
                .map_err(|e| chain(&e))
        });
        built.as_ref().map_err(|e| RegistryError::Client(e.clone()))
    }
}

impl Registry {
    /// A client with this configuration; its HTTP client is built when first needed.
    #[must_use]
    pub fn new(config: RegistryConfig) -> Self {
        Self { inner: Arc::new(Inner { config, client: OnceLock::new(), inflight: Mutex::default() }) }
    }

    /// The configuration.
    #[must_use]
    pub fn config(&self) -> &RegistryConfig {
        &self.inner.config
    }

    /// This client, or for a registry host it does not already speak plain HTTP to, a new
    /// one that does (a client's `insecure` request). The new one shares no downloads.
    #[must_use]
    pub fn allowing_insecure(&self, host: &str) -> Registry {
        if self.inner.config.insecure.iter().any(|h| h == host) {
            return self.clone();
        }
        let mut config = self.inner.config.clone();
        config.insecure.push(host.to_owned());
        Self::new(config)
    }

    /// Pulls `name` into `store` (see the module documentation), reporting progress as it
    /// goes. Returns the digest of the manifest.
    pub async fn pull(
        &self,
        store: &Store,
        name: &ModelName,
        mut progress: impl FnMut(Progress) + Send,
    ) -> Result<Digest, RegistryError> {
        let remote = Arc::new(self.inner.remote(name)?);
        progress(Progress::step("pulling manifest"));
        let bytes = remote.manifest().await?;
        let manifest = Manifest::parse(&bytes).map_err(|e| RegistryError::BadManifest {
            registry: remote.registry.clone(),
            model: remote.model.clone(),
            reason: e.to_string(),
        })?;
        // A text or config layer the store would refuse to read is refused before anything is stored.
        limits::check_manifest(&manifest).map_err(|e| RegistryError::BadManifest {
            registry: remote.registry.clone(),
            model: remote.model.clone(),
            reason: e.to_string(),
        })?;
        let pin = store.pin(manifest.blobs().map(|l| l.digest));
        for layer in manifest.blobs() {
            if store.has_blob(&layer.digest) {
                progress(Progress::blob("pulling", layer.digest, layer.size, layer.size));
                continue;
            }
            let mut status = self.inner.join_download(&remote, store, layer);
            loop {
                let now = status.borrow_and_update().clone();
                if now.started || now.done.is_some() {
                    progress(Progress::blob("pulling", layer.digest, now.total, now.completed));
                }
                if let Some(done) = now.done {
                    done?;
                    break;
                }
                if status.changed().await.is_err() {
                    return Err(RegistryError::Interrupted { digest: layer.digest });
                }
            }
        }
        // Every new blob was checked against its digest before it was put in place.
        progress(Progress::step("verifying sha256 digest"));
        progress(Progress::step("writing manifest"));
        let (store, name) = (store.clone(), name.clone());
        let digest = blocking(move || {
            let digest = store.write_manifest_bytes(&name, &bytes, &manifest)?;
            drop(pin);
            Ok(digest)
        })
        .await?;
        progress(Progress::step("success"));
        Ok(digest)
    }

    /// Pushes `name` from `store` to its registry (see the module documentation), reporting
    /// progress as it goes. Returns the digest of the manifest.
    pub async fn push(
        &self,
        store: &Store,
        name: &ModelName,
        mut progress: impl FnMut(Progress) + Send,
    ) -> Result<Digest, RegistryError> {
        let remote = self.inner.remote(name)?;
        progress(Progress::step("retrieving manifest"));
        let bytes = store.manifest_bytes(name)?;
        let manifest = Manifest::parse(&bytes)
            .map_err(|source| RegistryError::from(StoreError::Manifest { name: name.to_string(), source }))?;
        let _pin = store.pin(manifest.blobs().map(|l| l.digest));
        for layer in manifest.blobs() {
            remote.push_blob(store, layer, &mut progress).await?;
        }
        progress(Progress::step("pushing manifest"));
        let what = format!("the manifest of {}", remote.model);
        let url = remote.url(&format!("manifests/{}", name.tag()))?;
        let response = remote
            .send(&what, || {
                Ok(remote
                    .client()?
                    .put(url.clone())
                    .header(CONTENT_TYPE, MANIFEST_MEDIA_TYPE)
                    .body(bytes.clone())
                    .timeout(remote.config().request_timeout))
            })
            .await?;
        remote.expect(&what, response, &[StatusCode::CREATED, StatusCode::OK]).await?;
        progress(Progress::step("success"));
        Ok(Digest::of(&bytes))
    }
}

impl Inner {
    fn remote(self: &Arc<Self>, name: &ModelName) -> Result<Remote, RegistryError> {
        let registry = name.registry().to_owned();
        let insecure = self.config.insecure.iter().any(|h| h.eq_ignore_ascii_case(&registry));
        let scheme = if insecure { "http" } else { "https" };
        let base = format!("{scheme}://{registry}/v2/{}/", name.repository());
        let base = Url::parse(&base).map_err(|e| RegistryError::Protocol {
            registry: registry.clone(),
            detail: format!("cannot make a URL of {base}: {e}"),
        })?;
        Ok(Remote {
            inner: Arc::clone(self),
            model: format!("{}:{}", name.repository(), name.tag()),
            registry,
            base,
            token: Mutex::default(),
        })
    }

    fn lock_inflight(&self) -> std::sync::MutexGuard<'_, Inflight> {
        self.inflight.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Waits on the download of `layer` into `store`, starting it unless one is in flight.
    fn join_download(
        self: &Arc<Self>,
        remote: &Arc<Remote>,
        store: &Store,
        layer: &Layer,
    ) -> watch::Receiver<BlobStatus> {
        let key = (store.root().to_owned(), layer.digest);
        let mut inflight = self.lock_inflight();
        if let Some(sender) = inflight.get(&key) {
            return sender.subscribe();
        }
        let (sender, receiver) =
            watch::channel(BlobStatus { total: layer.size, started: false, completed: 0, done: None });
        let sender = Arc::new(sender);
        inflight.insert(key.clone(), Arc::clone(&sender));
        drop(inflight);
        let task = Download {
            inner: Arc::clone(self),
            key,
            sender,
            remote: Arc::clone(remote),
            store: store.clone(),
            layer: layer.clone(),
        };
        tokio::spawn(task.run());
        receiver
    }
}

/// One blob download, run in its own task for every pull that waits on it.
struct Download {
    inner: Arc<Inner>,
    key: InflightKey,
    sender: Arc<watch::Sender<BlobStatus>>,
    remote: Arc<Remote>,
    store: Store,
    layer: Layer,
}

impl Download {
    async fn run(self) {
        let outcome = self.download().await;
        // Out of the map first: a pull that starts from now on starts afresh (and finds the
        // blob in place if this download succeeded) rather than getting this result.
        self.forget();
        if let Some(outcome) = outcome {
            self.sender.send_modify(|status| {
                if outcome.is_ok() {
                    status.completed = status.total;
                }
                status.done = Some(outcome);
            });
        }
    }

    /// Takes this download out of the map of those in flight.
    fn forget(&self) {
        self.forget_locked(&mut self.inner.lock_inflight());
    }

    fn forget_locked(&self, inflight: &mut Inflight) {
        if inflight.get(&self.key).is_some_and(|s| Arc::ptr_eq(s, &self.sender)) {
            inflight.remove(&self.key);
        }
    }

    /// Downloads, or returns `None` when every waiting pull went away first.
    async fn download(&self) -> Option<Result<(), RegistryError>> {
        if self.store.has_blob(&self.layer.digest) {
            return Some(Ok(()));
        }
        let what = format!("blob {} of {}", self.layer.digest, self.remote.model);
        let (store, layer, registry) = (self.store.clone(), self.layer.clone(), self.remote.registry.clone());
        let partial = match blocking(move || Partial::open(store, &layer, registry, what)).await {
            Ok(partial) => Arc::new(partial),
            Err(e) => return Some(Err(e)),
        };
        let resumed = partial.completed();
        if resumed > 0 {
            tracing::info!(digest = %self.layer.digest, resumed, total = self.layer.size, "resuming a download");
        }
        self.sender.send_modify(|status| {
            status.started = true;
            status.completed = resumed;
        });
        let mut work = Box::pin(fetch_blob(Arc::clone(&self.remote), Arc::clone(&partial), Arc::clone(&self.sender)));
        let outcome = loop {
            tokio::select! {
                outcome = &mut work => break Some(outcome),
                () = self.sender.closed() => {
                    if self.forget_if_unwatched() {
                        break None;
                    }
                }
            }
        };
        drop(work);
        // Progress is kept for a resume, unless there is none (a data file the blob's size
        // and nothing in it is only in the way) or the data is wrong or holds space the disk lacks.
        let keep = match &outcome {
            Some(Ok(())) => return outcome,
            Some(Err(e)) => !e.discards_partial() && partial.completed() > 0,
            None => partial.completed() > 0,
        };
        let saved = Arc::clone(&partial);
        let result = if keep {
            blocking(move || saved.checkpoint()).await
        } else {
            blocking(move || {
                saved.remove();
                Ok(())
            })
            .await
        };
        if let Err(e) = result {
            tracing::warn!(digest = %self.layer.digest, error = %e, "cannot record a download's progress");
        }
        outcome
    }

    /// Takes the download out of the map if no pull waits on it any more (checked under the
    /// map's lock, so that no pull can join it after that).
    fn forget_if_unwatched(&self) -> bool {
        let mut inflight = self.inner.lock_inflight();
        if self.sender.receiver_count() > 0 {
            return false;
        }
        self.forget_locked(&mut inflight);
        true
    }
}

impl Drop for Download {
    fn drop(&mut self) {
        // Also when the task panicked: the pulls waiting on it then see `Interrupted`.
        self.forget();
    }
}

/// Fetches the missing parts of a partial blob, then verifies it and puts it in place.
async fn fetch_blob(
    remote: Arc<Remote>,
    partial: Arc<Partial>,
    sender: Arc<watch::Sender<BlobStatus>>,
) -> Result<(), RegistryError> {
    let config = remote.config();
    let mut parts = Vec::new();
    for (start, end) in partial.missing() {
        let mut at = start;
        while at < end {
            let stop = end.min(at.saturating_add(config.part_size.max(1)));
            parts.push((at, stop));
            at = stop;
        }
    }
    let fetches = stream::iter(parts).map(Ok).try_for_each_concurrent(config.max_parts.max(1), |(start, end)| {
        fetch_part(&remote, &partial, &sender, start, end)
    });
    let checkpoints = async {
        let mut ticker = tokio::time::interval(CHECKPOINT_INTERVAL);
        ticker.tick().await;
        loop {
            ticker.tick().await;
            let partial = Arc::clone(&partial);
            if let Err(e) = blocking(move || partial.checkpoint()).await {
                return e;
            }
        }
    };
    tokio::select! {
        outcome = fetches => outcome?,
        error = checkpoints => return Err(error),
    }
    blocking(move || partial.commit()).await
}

/// Fetches `start..end` of a blob, retrying from the first missing byte when a transfer fails.
async fn fetch_part(
    remote: &Remote,
    partial: &Arc<Partial>,
    sender: &watch::Sender<BlobStatus>,
    start: u64,
    end: u64,
) -> Result<(), RegistryError> {
    let config = remote.config();
    let mut at = start;
    let mut attempt = 1;
    loop {
        match fetch_range(remote, partial, sender, &mut at, end).await {
            Ok(()) => return Ok(()),
            Err(e) if e.is_transient() && attempt < config.part_attempts => {
                let delay = config.retry_delay.saturating_mul(1 << (attempt - 1).min(16));
                tracing::warn!(digest = %partial.digest, error = %e, attempt, ?delay, "retrying a part of a download");
                tokio::time::sleep(delay).await;
                attempt += 1;
            }
            Err(e) => return Err(e),
        }
    }
}

/// One ranged GET of `*at..end`, written to the partial file as it arrives; `*at` moves
/// past every byte written.
async fn fetch_range(
    remote: &Remote,
    partial: &Arc<Partial>,
    sender: &watch::Sender<BlobStatus>,
    at: &mut u64,
    end: u64,
) -> Result<(), RegistryError> {
    let what = &partial.what;
    let bad_range =
        |detail: String| RegistryError::BadRange { registry: remote.registry.clone(), what: what.clone(), detail };
    let (first, last) = (*at, end - 1);
    let expected = end - first;
    let url = remote.url(&format!("blobs/{}", partial.digest))?;
    let mut response = remote
        .send(what, || Ok(remote.client()?.get(url.clone()).header(RANGE, format!("bytes={first}-{last}"))))
        .await?;
    match response.status() {
        StatusCode::PARTIAL_CONTENT => {
            let header = response.headers().get(reqwest::header::CONTENT_RANGE).and_then(|v| v.to_str().ok());
            match header.and_then(parse_content_range) {
                Some((a, b, total)) if a == first && b == last && total.is_none_or(|t| t == partial.size) => {}
                _ => {
                    return Err(bad_range(format!(
                        "asked for bytes {first}-{last} of {}, got 206 with Content-Range {}",
                        partial.size,
                        header.unwrap_or("(none)")
                    )));
                }
            }
        }
        StatusCode::OK if first == 0 && end == partial.size => {}
        StatusCode::OK => {
            return Err(bad_range(format!(
                "asked for bytes {first}-{last} of {}, got 200 (the whole blob): the server ignores Range",
                partial.size
            )));
        }
        StatusCode::RANGE_NOT_SATISFIABLE => {
            return Err(bad_range(format!(
                "asked for bytes {first}-{last}, got 416 (range not satisfiable): the blob is not {} bytes long",
                partial.size
            )));
        }
        _ => return Err(remote.fail(what, response).await),
    }
    if let Some(length) = response.content_length() {
        if length != expected {
            return Err(bad_range(format!("asked for {expected} bytes ({first}-{last}), got Content-Length {length}")));
        }
    }
    let mut received = 0u64;
    let mut buffer = Vec::with_capacity(WRITE_CHUNK);
    let truncated = |received: u64, detail: String| RegistryError::Truncated {
        registry: remote.registry.clone(),
        what: what.clone(),
        received,
        expected,
        first,
        last,
        detail,
    };
    loop {
        let chunk = response.chunk().await;
        let ended = !matches!(chunk, Ok(Some(_)));
        if let Ok(Some(data)) = &chunk {
            let len = data.len() as u64;
            if received + len > expected {
                return Err(bad_range(format!("asked for {expected} bytes ({first}-{last}), got more")));
            }
            received += len;
            buffer.extend_from_slice(data);
        }
        if !buffer.is_empty() && (ended || buffer.len() >= WRITE_CHUNK) {
            let data = std::mem::replace(&mut buffer, Vec::with_capacity(WRITE_CHUNK));
            let (written, offset, target) = (data.len() as u64, *at, Arc::clone(partial));
            let completed = blocking(move || target.write_at(offset, &data)).await?;
            *at += written;
            partial.report(sender, completed);
        }
        match chunk {
            Ok(Some(_)) => {}
            Ok(None) if received == expected => return Ok(()),
            Ok(None) => return Err(truncated(received, "the answer ended early".to_owned())),
            Err(e) => return Err(truncated(received, body_error(&e, remote.config().read_timeout))),
        }
    }
}

/// Why a body stopped: a stall, or the root cause (`end of file before message length
/// reached`, `Connection reset by peer`) without reqwest's and hyper's wrappers.
fn body_error(error: &reqwest::Error, read_timeout: Duration) -> String {
    if error.is_timeout() {
        return format!("no data arrived for {}", crate::durations::human(read_timeout));
    }
    let mut cause: &dyn std::error::Error = error;
    while let Some(next) = cause.source() {
        cause = next;
    }
    cause.to_string()
}

/// `bytes <first>-<last>/<total or *>`, a range that exists: `first <= last < total`.
#[must_use]
pub fn parse_content_range(value: &str) -> Option<(u64, u64, Option<u64>)> {
    let rest = value.trim().strip_prefix("bytes ")?;
    let (range, total) = rest.split_once('/')?;
    let (first, last) = range.split_once('-')?;
    let total = if total.trim() == "*" { None } else { Some(total.trim().parse().ok()?) };
    let (first, last) = (first.trim().parse().ok()?, last.trim().parse().ok()?);
    (first <= last && total.is_none_or(|total| last < total)).then_some((first, last, total))
}

/// Byte ranges `[start, end)`, sorted, disjoint and not touching.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Ranges(Vec<(u64, u64)>);

impl Ranges {
    fn insert(&mut self, start: u64, end: u64) {
        if start >= end {
            return;
        }
        self.0.push((start, end));
        self.0.sort_unstable();
        let mut merged: Vec<(u64, u64)> = Vec::with_capacity(self.0.len());
        for &(s, e) in &self.0 {
            match merged.last_mut() {
                Some(last) if s <= last.1 => last.1 = last.1.max(e),
                _ => merged.push((s, e)),
            }
        }
        self.0 = merged;
    }

    /// From a record on disk: clamped to `size`, sorted and merged.
    fn from_record(ranges: &[(u64, u64)], size: u64) -> Self {
        let mut out = Self::default();
        for &(s, e) in ranges {
            out.insert(s.min(size), e.min(size));
        }
        out
    }

    fn covered(&self) -> u64 {
        self.0.iter().map(|(s, e)| e - s).sum()
    }

    fn missing(&self, size: u64) -> Vec<(u64, u64)> {
        let mut gaps = Vec::new();
        let mut at = 0;
        for &(s, e) in &self.0 {
            if s > at {
                gaps.push((at, s));
            }
            at = at.max(e);
        }
        if at < size {
            gaps.push((at, size));
        }
        gaps
    }
}

/// The record of a partial download, `blobs/sha256-<hex>-partial.json`.
#[derive(Debug, Serialize, Deserialize)]
struct Record {
    digest: Digest,
    size: u64,
    /// Byte ranges `[start, end)` of the data file that hold the blob's data.
    done: Vec<(u64, u64)>,
}

/// A blob being downloaded: its data file and the record of what is in it.
#[derive(Debug)]
struct Partial {
    store: Store,
    digest: Digest,
    size: u64,
    registry: String,
    what: String,
    /// `blobs/`, opened once: the files below are reached without following links.
    blobs: Dir,
    data_name: String,
    record_name: String,
    /// For messages.
    data_path: PathBuf,
    file: File,
    done: Mutex<Ranges>,
    dirty: AtomicBool,
    reported: Mutex<Option<Instant>>,
    /// Serializes the record's writes with the end of the download, and is set at the end
    /// (put in place, or removed): a checkpoint still running then must not write a record.
    finished: Mutex<bool>,
    /// Keeps garbage collection away from the partial files while the download runs.
    _pin: Pin,
}

/// The most a partial download's record may weigh; real ones are a few hundred bytes.
const MAX_RECORD_BYTES: u64 = 1 << 20;

impl Partial {
    /// Opens the partial download of `layer`, resuming what a record describes, or starts
    /// one. The data file grows as data arrives: nothing is reserved from the size the
    /// registry announced, so a download that fails holds only what arrived.
    fn open(store: Store, layer: &Layer, registry: String, what: String) -> Result<Self, RegistryError> {
        // Pinned before any file is touched, so that a collection never races this download.
        let pin = store.pin([layer.digest]);
        let blobs = store.blobs()?;
        let data_name = format!("{}-partial", layer.digest.file_name());
        let record_name = format!("{}-partial.json", layer.digest.file_name());
        let data_path = store.blobs_dir().join(&data_name);
        let resumed = Self::resumable(&blobs, &data_name, &record_name, layer)?;
        let (file, done) = if let Some((file, done)) = resumed {
            (file, done)
        } else {
            match blobs.remove_file(&record_name) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => {
                    return Err(refused_or(&blobs, &record_name, e, |e| {
                        Self::write_error(&data_path, &what, layer.size, e)
                    }));
                }
            }
            let fail = |e| refused_or(&blobs, &data_name, e, |e| Self::write_error(&data_path, &what, layer.size, e));
            // A new file, never one that was there: a hard link planted under this name must
            // not be emptied and written; a symbolic link is refused and left alone.
            let file = match blobs.open_rw(&data_name, false, false) {
                Ok(_) => blobs.remove_file(&data_name).and_then(|()| blobs.create_new(&data_name, 0o644)),
                Err(e) if e.kind() == io::ErrorKind::NotFound => blobs.create_new(&data_name, 0o644),
                Err(e) => Err(e),
            }
            .map_err(fail)?;
            (file, Ranges::default())
        };
        Ok(Self {
            digest: layer.digest,
            size: layer.size,
            registry,
            what,
            blobs,
            data_name,
            record_name,
            data_path,
            file,
            done: Mutex::new(done),
            dirty: AtomicBool::new(false),
            reported: Mutex::default(),
            finished: Mutex::new(false),
            store,
            _pin: pin,
        })
    }

    /// The data file and the ranges a valid record describes, if there are both. A link
    /// in place of either is refused.
    fn resumable(
        blobs: &Dir,
        data_name: &str,
        record_name: &str,
        layer: &Layer,
    ) -> Result<Option<(File, Ranges)>, RegistryError> {
        let refusal = |name: &str, e: io::Error| refused_or(blobs, name, e, |e| RegistryError::io("", e));
        let record = match blobs.open(record_name) {
            Ok(file) => file,
            Err(e) if beneath::refusal(&e).is_some() => return Err(refusal(record_name, e)),
            Err(_) => return Ok(None),
        };
        let mut bytes = Vec::new();
        if record.take(MAX_RECORD_BYTES).read_to_end(&mut bytes).is_err() {
            return Ok(None);
        }
        let Ok(record) = serde_json::from_slice::<Record>(&bytes) else { return Ok(None) };
        if record.digest != layer.digest || record.size != layer.size {
            return Ok(None);
        }
        let file = match blobs.open_rw(data_name, false, false) {
            Ok(file) => file,
            Err(e) if beneath::refusal(&e).is_some() => return Err(refusal(data_name, e)),
            Err(_) => return Ok(None),
        };
        let Ok(meta) = file.metadata() else { return Ok(None) };
        let done = Ranges::from_record(&record.done, layer.size);
        // The file holds at least every recorded byte, and never more than the blob.
        // It is the store's own, too: a hard link planted here is not resumed into.
        if meta.len() > layer.size || done.0.last().is_some_and(|&(_, end)| end > meta.len()) || meta.nlink() != 1 {
            return Ok(None);
        }
        Ok(Some((file, done)))
    }

    fn write_error(path: &Path, what: &str, size: u64, error: io::Error) -> RegistryError {
        if is_disk_full(&error) {
            let dir = path.parent().unwrap_or(path);
            RegistryError::DiskFull { context: format!("no room for {what} ({size} bytes) in {}", dir.display()) }
        } else {
            RegistryError::io(format!("cannot write {}", path.display()), error)
        }
    }

    fn completed(&self) -> u64 {
        self.done.lock().unwrap_or_else(PoisonError::into_inner).covered()
    }

    fn missing(&self) -> Vec<(u64, u64)> {
        self.done.lock().unwrap_or_else(PoisonError::into_inner).missing(self.size)
    }

    /// Writes data at `offset` and records it. Returns how much of the blob is now in place.
    fn write_at(&self, offset: u64, data: &[u8]) -> Result<u64, RegistryError> {
        self.file
            .write_all_at(data, offset)
            .map_err(|e| Self::write_error(&self.data_path, &self.what, self.size, e))?;
        let mut done = self.done.lock().unwrap_or_else(PoisonError::into_inner);
        done.insert(offset, offset + data.len() as u64);
        self.dirty.store(true, Ordering::SeqCst);
        Ok(done.covered())
    }

    /// Tells the waiting pulls how far the download is, at most every `PROGRESS_INTERVAL`.
    fn report(&self, sender: &watch::Sender<BlobStatus>, completed: u64) {
        let mut reported = self.reported.lock().unwrap_or_else(PoisonError::into_inner);
        if completed == self.size || reported.is_none_or(|at| at.elapsed() >= PROGRESS_INTERVAL) {
            *reported = Some(Instant::now());
            sender.send_modify(|status| status.completed = status.completed.max(completed));
        }
    }

    /// Records on disk which ranges are written: the data first synced, then the record
    /// replaced atomically, so it never claims data that a crash could lose.
    fn checkpoint(&self) -> Result<(), RegistryError> {
        let finished = self.finished.lock().unwrap_or_else(PoisonError::into_inner);
        if *finished || !self.dirty.swap(false, Ordering::SeqCst) {
            return Ok(());
        }
        let done = self.done.lock().unwrap_or_else(PoisonError::into_inner).clone();
        let result = self.write_record(&done);
        if result.is_err() {
            self.dirty.store(true, Ordering::SeqCst);
        }
        drop(finished);
        result
    }

    fn write_record(&self, done: &Ranges) -> Result<(), RegistryError> {
        let record_path = self.data_path.with_file_name(&self.record_name);
        let fail = |e: io::Error| Self::write_error(&record_path, &self.what, self.size, e);
        self.file.sync_data().map_err(fail)?;
        let record = Record { digest: self.digest, size: self.size, done: done.0.clone() };
        let mut temp = self.store.temp_in(&self.blobs)?;
        let json = serde_json::to_vec(&record).expect("a record always serializes");
        temp.write_all(&json).and_then(|()| temp.as_file().sync_all()).map_err(fail)?;
        temp.place(&self.blobs, &self.record_name)?;
        Ok(())
    }

    /// Checks the whole blob against its digest and, if it matches, puts it in place.
    fn commit(&self) -> Result<(), RegistryError> {
        let completed = self.completed();
        if completed != self.size {
            return Err(RegistryError::Protocol {
                registry: self.registry.clone(),
                detail: format!("{}: only {completed} of {} bytes arrived", self.what, self.size),
            });
        }
        let read_error = |e| RegistryError::io(format!("cannot read {}", self.data_path.display()), e);
        self.file.sync_all().map_err(|e| Self::write_error(&self.data_path, &self.what, self.size, e))?;
        // Read back through the file this download wrote, not by its name.
        let mut reader = &self.file;
        reader.seek(SeekFrom::Start(0)).map_err(read_error)?;
        let (actual, _) = Digest::of_reader(BufReader::with_capacity(WRITE_CHUNK, reader)).map_err(read_error)?;
        if actual != self.digest {
            return Err(RegistryError::DigestMismatch { registry: self.registry.clone(), digest: self.digest, actual });
        }
        let mut finished = self.finished.lock().unwrap_or_else(PoisonError::into_inner);
        *finished = true;
        let blob = self.digest.file_name();
        self.blobs.rename(&self.data_name, &self.blobs, &blob).map_err(|e| {
            RegistryError::io(
                format!("cannot move the download into place as {}", self.store.blob_path(&self.digest).display()),
                e,
            )
        })?;
        let _ = self.blobs.remove_file(&self.record_name);
        self.blobs.sync().map_err(|e| RegistryError::io(format!("cannot sync {}", self.store.blobs_dir().display()), e))
    }

    /// Deletes the data file and the record (or links of those names: never what they point to).
    fn remove(&self) {
        let mut finished = self.finished.lock().unwrap_or_else(PoisonError::into_inner);
        *finished = true;
        for name in [&self.data_name, &self.record_name] {
            if let Err(e) = self.blobs.remove_file(name) {
                if e.kind() != io::ErrorKind::NotFound {
                    tracing::warn!(path = self.blobs.rel(name), error = %e, "cannot remove a partial download");
                }
            }
        }
    }
}

/// The store's refusal of `name` in `dir` (a link, or not a file), or `other` for any other error.
fn refused_or(
    dir: &Dir,
    name: &str,
    error: io::Error,
    other: impl FnOnce(io::Error) -> RegistryError,
) -> RegistryError {
    match beneath::refusal(&error) {
        Some(refusal) => StoreError::Refused { path: dir.rel(name), reason: refusal.reason() }.into(),
        None => other(error),
    }
}

/// Runs file work on the blocking pool.
async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, RegistryError> + Send + 'static,
) -> Result<T, RegistryError> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| RegistryError::io("a file operation failed", io::Error::other(e.to_string())))?
}

/// One registry repository, as seen by one pull or push: where it is and the token to use.
#[derive(Debug)]
struct Remote {
    inner: Arc<Inner>,
    /// `host[:port]`.
    registry: String,
    /// `<repo>:<tag>`, for messages.
    model: String,
    /// `<scheme>://<host>/v2/<repo>/`.
    base: Url,
    token: Mutex<Option<String>>,
}

/// A token service's answer.
#[derive(Debug, Deserialize)]
struct TokenReply {
    #[serde(default)]
    token: Option<String>,
    #[serde(default)]
    access_token: Option<String>,
}

impl Remote {
    fn client(&self) -> Result<&Client, RegistryError> {
        self.inner.client()
    }

    fn config(&self) -> &RegistryConfig {
        &self.inner.config
    }

    fn url(&self, rest: &str) -> Result<Url, RegistryError> {
        let url = format!("{}{rest}", self.base);
        Url::parse(&url).map_err(|e| RegistryError::Protocol {
            registry: self.registry.clone(),
            detail: format!("cannot make a URL of {url}: {e}"),
        })
    }

    /// A request that got no answer: a plain-HTTP answer to HTTPS is named as such.
    fn transport(&self, what: String, error: &reqwest::Error) -> RegistryError {
        if answered_in_plain_http(error) {
            return RegistryError::PlainHttp { registry: self.registry.clone(), what };
        }
        RegistryError::Transport { registry: self.registry.clone(), what, detail: chain(error) }
    }

    fn unauthorized(&self, what: &str, reason: String) -> RegistryError {
        RegistryError::Unauthorized { registry: self.registry.clone(), what: what.to_owned(), reason }
    }

    /// Sends a request, with the token if there is one. On 401 with a Bearer challenge it
    /// gets a token and sends the request once more; `build` makes the request each time.
    async fn send(
        &self,
        what: &str,
        build: impl Fn() -> Result<RequestBuilder, RegistryError>,
    ) -> Result<Response, RegistryError> {
        let mut renewed = false;
        loop {
            let mut request = build()?;
            let token = self.token.lock().unwrap_or_else(PoisonError::into_inner).clone();
            if let Some(token) = token {
                request = request.bearer_auth(token);
            }
            let response = request.send().await.map_err(|e| self.transport(what.to_owned(), &e))?;
            if response.status() != StatusCode::UNAUTHORIZED {
                return Ok(response);
            }
            if renewed {
                let body = excerpt(response).await;
                return Err(
                    self.unauthorized(what, format!("HTTP 401 even with the token its token service issued: {body}"))
                );
            }
            let header = response.headers().get(WWW_AUTHENTICATE).and_then(|v| v.to_str().ok()).map(str::to_owned);
            let Some(challenge) = header.as_deref().and_then(Challenge::parse) else {
                let body = excerpt(response).await;
                let header = header.map_or_else(|| "none".to_owned(), |h| format!("\"{h}\""));
                return Err(self.unauthorized(
                    what,
                    format!("HTTP 401 without a Bearer challenge (WWW-Authenticate: {header}): {body}"),
                ));
            };
            let token = self.fetch_token(what, &challenge).await?;
            *self.token.lock().unwrap_or_else(PoisonError::into_inner) = Some(token);
            renewed = true;
        }
    }

    /// Gets an anonymous token from the challenge's realm.
    async fn fetch_token(&self, what: &str, challenge: &Challenge) -> Result<String, RegistryError> {
        let realm = Url::parse(&challenge.realm).map_err(|e| {
            self.unauthorized(what, format!("its token service \"{}\" is not a URL: {e}", challenge.realm))
        })?;
        let same_host = realm.host_str() == self.base.host_str()
            && realm.port_or_known_default() == self.base.port_or_known_default();
        if realm.scheme() != "https" && !(realm.scheme() == "http" && same_host) {
            return Err(self.unauthorized(
                what,
                format!("refusing its token service {realm}: it must use HTTPS or be on the registry's own host"),
            ));
        }
        let mut url = realm.clone();
        {
            let mut query = url.query_pairs_mut();
            if let Some(service) = &challenge.service {
                query.append_pair("service", service);
            }
            if let Some(scope) = &challenge.scope {
                query.append_pair("scope", scope);
            }
        }
        let response = self
            .client()?
            .get(url)
            .timeout(self.config().request_timeout)
            .send()
            .await
            .map_err(|e| self.transport(format!("a token for {what} from {realm}"), &e))?;
        let status = response.status();
        if !status.is_success() {
            let body = excerpt(response).await;
            return Err(self.unauthorized(what, format!("its token service {realm} answered HTTP {status}: {body}")));
        }
        let bytes = read_capped(response, MAX_TOKEN_BYTES)
            .await
            .map_err(|detail| self.unauthorized(what, format!("cannot read the answer of {realm}: {detail}")))?;
        let reply: TokenReply = serde_json::from_slice(&bytes)
            .map_err(|e| self.unauthorized(what, format!("its token service {realm} sent no token JSON: {e}")))?;
        reply
            .token
            .filter(|t| !t.is_empty())
            .or(reply.access_token.filter(|t| !t.is_empty()))
            .ok_or_else(|| self.unauthorized(what, format!("its token service {realm} sent no token")))
    }

    /// The error for an answer the protocol does not expect.
    async fn fail(&self, what: &str, response: Response) -> RegistryError {
        let status = response.status();
        let body = excerpt(response).await;
        let (registry, what) = (self.registry.clone(), what.to_owned());
        match status.as_u16() {
            404 => RegistryError::NotFound { registry, what },
            401 | 403 => RegistryError::Unauthorized { registry, what, reason: format!("HTTP {status}: {body}") },
            500..=599 => RegistryError::Server { registry, what, status: status.as_u16(), body },
            code => RegistryError::UnexpectedStatus { registry, what, status: code, body },
        }
    }

    /// The answer if its status is one of `ok`, else the error for it.
    async fn expect(&self, what: &str, response: Response, ok: &[StatusCode]) -> Result<Response, RegistryError> {
        if ok.contains(&response.status()) { Ok(response) } else { Err(self.fail(what, response).await) }
    }

    /// The manifest's bytes, as the registry sent them.
    async fn manifest(&self) -> Result<Vec<u8>, RegistryError> {
        let what = format!("model {}", self.model);
        let tag = self.model.rsplit_once(':').map_or("latest", |(_, tag)| tag);
        let url = self.url(&format!("manifests/{tag}"))?;
        let response = self
            .send(&what, || {
                Ok(self
                    .client()?
                    .get(url.clone())
                    .header(ACCEPT, MANIFEST_MEDIA_TYPE)
                    .timeout(self.config().request_timeout))
            })
            .await?;
        let response = self.expect(&what, response, &[StatusCode::OK]).await?;
        let announced = response
            .headers()
            .get("docker-content-digest")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| Digest::parse(v).ok());
        let bad = |reason: String| RegistryError::BadManifest {
            registry: self.registry.clone(),
            model: self.model.clone(),
            reason,
        };
        let bytes = read_capped(response, MAX_MANIFEST_BYTES).await.map_err(bad)?;
        if let Some(announced) = announced {
            let actual = Digest::of(&bytes);
            if announced != actual {
                return Err(bad(format!("the registry says its digest is {announced}, but it hashes to {actual}")));
            }
        }
        Ok(bytes)
    }

    /// Uploads one blob unless the registry has it.
    async fn push_blob(
        &self,
        store: &Store,
        layer: &Layer,
        progress: &mut (impl FnMut(Progress) + Send),
    ) -> Result<(), RegistryError> {
        let (digest, size) = (layer.digest, layer.size);
        let what = format!("blob {digest} of {}", self.model);
        progress(Progress::blob("pushing", digest, size, 0));
        let url = self.url(&format!("blobs/{digest}"))?;
        let timeout = self.config().request_timeout;
        let response = self.send(&what, || Ok(self.client()?.head(url.clone()).timeout(timeout))).await?;
        match response.status() {
            StatusCode::OK => {
                progress(Progress::blob("pushing", digest, size, size));
                return Ok(());
            }
            StatusCode::NOT_FOUND => {}
            _ => return Err(self.fail(&what, response).await),
        }
        let start = self.url("blobs/uploads/")?;
        let response = self
            .send(&what, || Ok(self.client()?.post(start.clone()).header(CONTENT_LENGTH, 0).timeout(timeout)))
            .await?;
        let response = self.expect(&what, response, &[StatusCode::ACCEPTED]).await?;
        let location =
            response.headers().get(LOCATION).and_then(|v| v.to_str().ok()).ok_or_else(|| RegistryError::Protocol {
                registry: self.registry.clone(),
                detail: format!("the upload of {what} was accepted without a Location to send it to"),
            })?;
        let mut target = response.url().join(location).map_err(|e| RegistryError::Protocol {
            registry: self.registry.clone(),
            detail: format!("the upload location \"{location}\" for {what} is not a URL: {e}"),
        })?;
        target.query_pairs_mut().append_pair("digest", &digest.to_string());
        let sent = Arc::new(AtomicU64::new(0));
        let upload = self.send(&what, || {
            // Opened through the store: a link planted as the blob is refused, never sent.
            let file = store.open_blob(&digest)?;
            sent.store(0, Ordering::Relaxed);
            Ok(self
                .client()?
                .put(target.clone())
                .header(CONTENT_TYPE, "application/octet-stream")
                .header(CONTENT_LENGTH, size)
                .body(Body::wrap_stream(file_stream(file, Arc::clone(&sent)))))
        });
        let mut upload = Box::pin(upload);
        let mut ticker = tokio::time::interval(PROGRESS_INTERVAL);
        let response = loop {
            tokio::select! {
                response = &mut upload => break response?,
                _ = ticker.tick() => progress(Progress::blob("pushing", digest, size, sent.load(Ordering::Relaxed))),
            }
        };
        self.expect(&what, response, &[StatusCode::CREATED]).await?;
        progress(Progress::blob("pushing", digest, size, size));
        Ok(())
    }
}

/// A file's contents as a stream of chunks read on the blocking pool, counted into `sent`.
fn file_stream(
    file: File,
    sent: Arc<AtomicU64>,
) -> impl futures_util::Stream<Item = io::Result<Vec<u8>>> + Send + 'static {
    stream::try_unfold(file, move |mut file| {
        let sent = Arc::clone(&sent);
        async move {
            let (file, chunk) = tokio::task::spawn_blocking(move || {
                let mut chunk = vec![0; WRITE_CHUNK];
                let n = file.read(&mut chunk)?;
                chunk.truncate(n);
                Ok::<_, io::Error>((file, chunk))
            })
            .await
            .map_err(io::Error::other)??;
            if chunk.is_empty() {
                return Ok(None);
            }
            sent.fetch_add(chunk.len() as u64, Ordering::Relaxed);
            Ok(Some((chunk, file)))
        }
    })
}

/// The start of an answer's body, on one line, for an error message.
async fn excerpt(mut response: Response) -> String {
    let mut data = Vec::new();
    while data.len() <= EXCERPT_BYTES {
        match response.chunk().await {
            Ok(Some(chunk)) => data.extend_from_slice(&chunk),
            _ => break,
        }
    }
    let cut = data.len() > EXCERPT_BYTES;
    data.truncate(EXCERPT_BYTES);
    let text = String::from_utf8_lossy(&data);
    let text = text.split_whitespace().collect::<Vec<_>>().join(" ");
    if text.is_empty() {
        "(empty body)".to_owned()
    } else if cut {
        format!("{text}…")
    } else {
        text
    }
}

/// A whole body of at most `max` bytes.
async fn read_capped(mut response: Response, max: usize) -> Result<Vec<u8>, String> {
    let mut data = Vec::new();
    while let Some(chunk) = response.chunk().await.map_err(|e| chain(&e))? {
        data.extend_from_slice(&chunk);
        if data.len() > max {
            return Err(format!("the answer is larger than {max} bytes"));
        }
    }
    Ok(data)
}

/// `WWW-Authenticate: Bearer realm="…",service="…",scope="…"`.
#[derive(Debug, PartialEq, Eq)]
struct Challenge {
    realm: String,
    service: Option<String>,
    scope: Option<String>,
}

impl Challenge {
    fn parse(header: &str) -> Option<Self> {
        let (scheme, mut rest) = header.trim().split_once(char::is_whitespace)?;
        if !scheme.eq_ignore_ascii_case("bearer") {
            return None;
        }
        let (mut realm, mut service, mut scope) = (None, None, None);
        loop {
            rest = rest.trim_start_matches(|c: char| c == ',' || c.is_whitespace());
            if rest.is_empty() {
                break;
            }
            let (key, after) = rest.split_once('=')?;
            let after = after.trim_start();
            let (value, remaining) = if let Some(quoted) = after.strip_prefix('"') {
                let mut value = String::new();
                let mut end = None;
                let mut chars = quoted.char_indices();
                while let Some((i, c)) = chars.next() {
                    match c {
                        '\\' => value.extend(chars.next().map(|(_, c)| c)),
                        '"' => {
                            end = Some(i + 1);
                            break;
                        }
                        c => value.push(c),
                    }
                }
                (value, &quoted[end?..])
            } else {
                let end = after.find(',').unwrap_or(after.len());
                (after[..end].trim().to_owned(), &after[end..])
            };
            match key.trim().to_ascii_lowercase().as_str() {
                "realm" => realm = Some(value),
                "service" => service = Some(value),
                "scope" => scope = Some(value),
                _ => {}
            }
            rest = remaining;
        }
        Some(Self { realm: realm?, service, scope })
    }
}

/// Parses a `WWW-Authenticate` header as the client does before it asks for a token:
/// `(realm, service, scope)` of a Bearer challenge, `None` for anything else.  The entry
/// point of the `registry_headers` fuzz target.
#[must_use]
pub fn parse_bearer_challenge(header: &str) -> Option<(String, Option<String>, Option<String>)> {
    Challenge::parse(header).map(|c| (c.realm, c.service, c.scope))
}

#[cfg(test)]
mod tests {
    use super::{Challenge, Progress, Ranges, parse_content_range};
    use crate::store::digest::Digest;

    #[test]
    fn bearer_challenges_parse() {
        let c = Challenge::parse(
            r#"Bearer realm="https://auth.example/token",service="registry.example",scope="repository:library/m:pull""#,
        )
        .expect("challenge");
        assert_eq!(c.realm, "https://auth.example/token");
        assert_eq!(c.service.as_deref(), Some("registry.example"));
        assert_eq!(c.scope.as_deref(), Some("repository:library/m:pull"));
        let c = Challenge::parse(r#"bearer  scope="a:b:pull,push", realm=http://h/t , x="q\"uote""#).expect("loose");
        assert_eq!(c.realm, "http://h/t");
        assert_eq!(c.scope.as_deref(), Some("a:b:pull,push"));
        assert_eq!(c.service, None);
        for bad in ["Basic realm=\"x\"", "Bearer service=\"s\"", "Bearer", "Bearer realm=\"unterminated"] {
            assert_eq!(Challenge::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn content_ranges_parse() {
        assert_eq!(parse_content_range("bytes 0-99/1000"), Some((0, 99, Some(1000))));
        assert_eq!(parse_content_range("bytes 5-9/*"), Some((5, 9, None)));
        for bad in ["bytes */1000", "0-99/1000", "bytes 0-/1000", "bytes a-b/c", "bytes 9-5/10", "bytes 0-10/10"] {
            assert_eq!(parse_content_range(bad), None, "{bad}");
        }
    }

    #[test]
    fn ranges_merge_and_leave_gaps() {
        let mut r = Ranges::default();
        r.insert(10, 20);
        r.insert(30, 40);
        r.insert(20, 25);
        r.insert(5, 5);
        assert_eq!(r.0, vec![(10, 25), (30, 40)]);
        assert_eq!(r.covered(), 25);
        assert_eq!(r.missing(50), vec![(0, 10), (25, 30), (40, 50)]);
        r.insert(0, 50);
        assert_eq!(r.missing(50), vec![]);
        assert_eq!(Ranges::from_record(&[(40, 80), (0, 10), (5, 12)], 50).0, vec![(0, 12), (40, 50)]);
    }

    #[test]
    fn progress_has_ollamas_shape() {
        let d = Digest::of(b"x");
        let json = serde_json::to_value(Progress::blob("pulling", d, 10, 4)).expect("json");
        assert_eq!(json["status"], format!("pulling {}", &d.hex()[..12]));
        assert_eq!(json["digest"], d.to_string());
        assert_eq!((json["total"].as_u64(), json["completed"].as_u64()), (Some(10), Some(4)));
        let json = serde_json::to_value(Progress::step("success")).expect("json");
        assert_eq!(json, serde_json::json!({"status": "success"}));
    }
    proptest::proptest! {
        /// A range written as a server sends it parses back; one that does not exist
        /// (backwards, or past the end) is refused.
        #[test]
        fn content_ranges_round_trip(first in 0u64..u64::MAX, len in 0u64..1 << 40, past in 1u64..1 << 40, star: bool) {
            let last = first.saturating_add(len);
            let total = last.checked_add(past);
            let written = format!("bytes {first}-{last}/{}", total.map_or("*".to_owned(), |t| t.to_string()));
            let expected = if star || total.is_none() { None } else { total };
            let written = if star { format!("bytes {first}-{last}/*") } else { written };
            proptest::prop_assert_eq!(parse_content_range(&written), Some((first, last, expected)));
            if first < last {
                proptest::prop_assert_eq!(parse_content_range(&format!("bytes {last}-{first}/*")), None);
            }
            proptest::prop_assert_eq!(parse_content_range(&format!("bytes {first}-{last}/{last}")), None);
        }

        /// Inserted ranges stay sorted, disjoint and not touching; what is covered and what
        /// is missing add up to the size, and every inserted byte is covered.
        #[test]
        fn byte_ranges_merge_and_gaps_complete_them(
            inserts in proptest::collection::vec((0u64..1000, 0u64..200), 0..20),
            size in 0u64..1300,
        ) {
            let mut r = Ranges::default();
            for &(start, len) in &inserts {
                r.insert(start, start + len);
            }
            for pair in r.0.windows(2) {
                proptest::prop_assert!(pair[0].0 < pair[0].1 && pair[0].1 < pair[1].0, "{:?}", r.0);
            }
            for &(start, len) in &inserts {
                proptest::prop_assert!(len == 0 || r.0.iter().any(|&(s, e)| s <= start && start + len <= e));
            }
            let clamped = Ranges::from_record(&r.0, size);
            let gaps = clamped.missing(size);
            let missing: u64 = gaps.iter().map(|(s, e)| e - s).sum();
            proptest::prop_assert_eq!(clamped.covered() + missing, size);
            let mut whole = clamped.clone();
            for (s, e) in gaps {
                whole.insert(s, e);
            }
            proptest::prop_assert!(whole.missing(size).is_empty());
        }
    }
}
