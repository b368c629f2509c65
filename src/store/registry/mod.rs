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
//!    [`RegistryConfig::part_size`] each), its size taken from the manifest; up to three
//!    large blobs (8 MiB or more) of a model at once, and up to four small ones beside them
//!    (a config or a template is mostly its round trips). One part at a time while the CPU keeps
//!    up with the data, up to [`RegistryConfig::max_parts`] at once while the hash waits for
//!    it (`download.rs`). Every answer is checked: `206` with exactly the asked
//!    `Content-Range`, or `200` only when the whole blob was asked for. Over plain HTTP a
//!    part is read by a blocking thread straight into the batch buffers (`plain_http.rs`);
//!    a redirect, a `401` and everything over HTTPS go through the HTTP client. The data
//!    goes into `blobs/sha256-<hex>-partial` at each part's offset, in batches written on
//!    one thread and hashed on another right after (`landing.rs`, `partial.rs`).
//! 4. The whole blob's SHA-256 is checked before it is renamed to `blobs/sha256-<hex>`; data
//!    that hashes to anything else is deleted and the pull fails naming the digest. A pull
//!    that fails takes back the blobs it put in place for the model.
//! 5. The manifest is written last ([`Store::write_manifest_bytes`]).
//!
//! Progress is reported as Ollama's `/api/pull` stream reports it: `pulling manifest`, then
//! `pulling <12 hex digits>` with `digest`, `total` and `completed` for each blob (one blob
//! after the other, in the manifest's order, though they download together), then
//! `verifying sha256 digest`, `writing manifest` and `success`.
//!
//! # Resuming
//!
//! A download that stops keeps what arrived, with a record of it, next to the blob's place;
//! a later pull, in this process or after a restart, fetches only what is missing.
//!
//! # Shared downloads
//!
//! Pulls through one [`Registry`] that need the same blob in the same store wait on one
//! download, and see its progress and its result.
//!
//! # Authentication
//!
//! A `401` with a Bearer challenge is answered with an anonymous token from the challenge's
//! realm, over HTTPS or from the registry's own host. Basic authentication is not supported.
//!
//! # Push
//!
//! For each blob: `HEAD /v2/<repo>/blobs/<digest>` (present: skipped), otherwise
//! `POST /v2/<repo>/blobs/uploads/` and a monolithic `PUT <Location>&digest=<digest>` that
//! streams the file. Large blobs go one after the other; small ones, up to four at once,
//! beside them, and the first blob that fails fails the push. Progress is reported one blob
//! after the other, in the manifest's order. Then `PUT /v2/<repo>/manifests/<tag>` with the
//! manifest's bytes as stored, once every blob is up.
//!
//! # Where each part is
//!
//! - this file: the configuration, progress events, and [`Registry`] with the pull and the push;
//! - `protocol.rs`: one repository on a registry as the OCI distribution protocol speaks to
//!   it: its URLs, what its answers mean, the manifest;
//! - `auth.rs`: the token dance (Bearer challenges, the token service);
//! - `download.rs`: the shared, resumable blob downloads and their ranged requests;
//! - `plain_http.rs`: a ranged request over plain HTTP, its body read by blocking reads;
//! - `ranged.rs`: what an answer to a ranged request must be, and its errors;
//! - `landing.rs`: the batch buffers, the writer and hash threads of a download;
//! - `partial.rs`: a partial download on disk, the record of what is in it, the final check;
//! - `push.rs`: uploading a blob;
//! - `error.rs`: [`RegistryError`].

mod auth;
mod download;
mod error;
mod landing;
mod partial;
mod plain_http;
mod protocol;
mod push;
mod ranged;

use std::collections::BTreeSet;
use std::io;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use reqwest::header::CONTENT_TYPE;
use reqwest::{Client, StatusCode};
use tokio::sync::{Semaphore, watch};

pub use self::auth::parse_bearer_challenge;
use self::download::Inflight;
pub use self::error::RegistryError;
use self::error::chain;
pub use self::plain_http::{AnswerHead, parse_answer_head};
pub use self::ranged::parse_content_range;
use super::digest::Digest;
use super::limits;
use super::manifest::{Layer, MANIFEST_MEDIA_TYPE, Manifest};
use super::name::ModelName;
use super::progress::PROGRESS_INTERVAL;
pub use super::progress::Progress;
use super::{Store, StoreError};

/// Downloaded data is written, and uploaded data read, in pieces of about this size.
const WRITE_CHUNK: usize = 1 << 20;
/// How many large layers of a model a pull downloads at once.
const LAYERS_AT_ONCE: usize = 3;
/// How many small layers of a model a pull downloads, or a push uploads, at once beside its
/// large ones.
const SMALL_LAYERS_AT_ONCE: usize = 4;
/// Layers from this size on are large. A small one (a config, a template, a license) takes
/// longer to ask for than to fetch: started beside the large ones rather than after them,
/// its round trips pass while the weights download.
const CONCURRENT_LAYER: u64 = 8 << 20;
/// How corral names itself to registries, through either HTTP path.
const USER_AGENT: &str = concat!("corral/", env!("CARGO_PKG_VERSION"));

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
    /// The most parts of one blob downloaded at once: one to begin with, more while the
    /// data arrives slower than it is hashed.
    pub max_parts: usize,
    /// How many times a part is tried before the pull fails (1: no retry). A retry asks only
    /// for the bytes that did not arrive; what did is kept.
    pub part_attempts: u32,
    /// The wait before the first retry of a part; doubled for each further one.
    pub retry_delay: Duration,
    /// The most blobs downloaded at once, over every pull: a download holds two threads of
    /// the blocking pool (its writer and its hash) and, over plain HTTP, one per part, for
    /// as long as its registry keeps sending, so without a bound pulls from slow registries
    /// could take every thread the store's other work needs. One more waits, its progress
    /// not started, until one ends (or every pull waiting on it has gone).
    pub max_downloads: usize,
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
            max_downloads: 16,
        }
    }
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

/// A registry client: the configuration, one HTTP client, and the downloads in flight.
/// Create one and share it (it is cheap to clone); pulls through the same `Registry`, or
/// through those [`Registry::allowing_insecure`] makes from it, share downloads of the same
/// blob into the same store and one bound on downloads at once.
#[derive(Debug, Clone)]
pub struct Registry {
    inner: Arc<Inner>,
}

/// What a [`Registry`] shares with the ones [`Registry::allowing_insecure`] makes from it
/// (those differ only in the registries they speak plain HTTP to), so that a request saying
/// `insecure` neither passes the bound on downloads nor builds a client of its own.
#[derive(Debug)]
struct Inner {
    config: RegistryConfig,
    /// Built on first use: building reads and parses every system CA certificate, which a
    /// daemon that never pulls should not pay for at start (time, and memory it touches).
    /// One client speaks both HTTPS and plain HTTP: a blob's URL chooses.
    client: Arc<OnceLock<Result<Client, String>>>,
    /// The same without a read timeout, for a blob's upload ([`Inner::upload_client`]).
    upload_client: Arc<OnceLock<Result<Client, String>>>,
    inflight: Arc<Mutex<Inflight>>,
    /// One permit per download that may run ([`RegistryConfig::max_downloads`]).
    downloads: Arc<Semaphore>,
}

impl Inner {
    fn client(&self) -> Result<&Client, RegistryError> {
        Self::built(&self.client, || self.builder().read_timeout(self.config.read_timeout))
    }

    /// For a blob's `PUT`. reqwest's read timeout runs from a request's start to its
    /// answer's head, the body's upload included (reqwest issue 2784), so it would fail any
    /// upload that takes longer, however fast it goes; the push bounds that wait itself,
    /// by the upload's progress (`push::watch_upload`).
    fn upload_client(&self) -> Result<&Client, RegistryError> {
        Self::built(&self.upload_client, || self.builder())
    }

    fn builder(&self) -> reqwest::ClientBuilder {
        Client::builder().connect_timeout(self.config.connect_timeout).user_agent(USER_AGENT)
    }

    fn built(
        slot: &OnceLock<Result<Client, String>>,
        builder: impl FnOnce() -> reqwest::ClientBuilder,
    ) -> Result<&Client, RegistryError> {
        let built = slot.get_or_init(|| builder().build().map_err(|e| chain(&e)));
        built.as_ref().map_err(|e| RegistryError::Client(e.clone()))
    }
}

impl Registry {
    /// A client with this configuration; its HTTP client is built when first needed.
    #[must_use]
    pub fn new(config: RegistryConfig) -> Self {
        let downloads = Arc::new(Semaphore::new(config.max_downloads.max(1)));
        let inner = Inner {
            config,
            client: Arc::default(),
            upload_client: Arc::default(),
            inflight: Arc::default(),
            downloads,
        };
        Self { inner: Arc::new(inner) }
    }

    /// The configuration.
    #[must_use]
    pub fn config(&self) -> &RegistryConfig {
        &self.inner.config
    }

    /// This client, or for a registry host it does not already speak plain HTTP to, one
    /// that also does (a client's `insecure` request). It shares this one's HTTP client,
    /// its downloads in flight and its bound on them ([`RegistryConfig::max_downloads`]).
    #[must_use]
    pub fn allowing_insecure(&self, host: &str) -> Registry {
        if self.inner.config.insecure.iter().any(|h| h == host) {
            return self.clone();
        }
        let mut config = self.inner.config.clone();
        config.insecure.push(host.to_owned());
        let inner = &self.inner;
        let (client, upload_client) = (Arc::clone(&inner.client), Arc::clone(&inner.upload_client));
        let (inflight, downloads) = (Arc::clone(&inner.inflight), Arc::clone(&inner.downloads));
        Self { inner: Arc::new(Inner { config, client, upload_client, inflight, downloads }) }
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
        let layers: Vec<Layer> = manifest.blobs().cloned().collect();
        let mut taken = TakeBack {
            pin: Some(store.pin(layers.iter().map(|l| l.digest))),
            new: layers.iter().filter(|l| !store.has_blob(&l.digest)).map(|l| l.digest).collect(),
            store: store.clone(),
        };
        self.fetch_layers(&remote, store, &layers, &mut progress).await?;
        // Every new blob was checked against its digest before it was put in place.
        progress(Progress::step("verifying sha256 digest"));
        progress(Progress::step("writing manifest"));
        let (store, name, pin) = (store.clone(), name.clone(), taken.pin.take());
        let digest = blocking(move || {
            let digest = store.write_manifest_bytes(&name, &bytes, &manifest)?;
            drop(pin);
            Ok(digest)
        })
        .await?;
        taken.new.clear();
        progress(Progress::step("success"));
        Ok(digest)
    }

    /// Downloads the layers a store lacks, in order, up to [`LAYERS_AT_ONCE`] large and
    /// [`SMALL_LAYERS_AT_ONCE`] small ones at a time ([`starts_beside`]), reporting
    /// each layer's progress in turn (one after the other, as a sequential pull would). On
    /// failure, the other downloads are left (they stop unless another pull waits on them)
    /// and their end is waited for, so that what they put in place can be taken back.
    async fn fetch_layers(
        &self,
        remote: &Arc<protocol::Remote>,
        store: &Store,
        layers: &[Layer],
        progress: &mut (impl FnMut(Progress) + Send),
    ) -> Result<(), RegistryError> {
        let mut joined: Vec<Option<download::Joined>> = Vec::with_capacity(layers.len());
        let mut result = Ok(());
        for (i, layer) in layers.iter().enumerate() {
            while let Some(next) = layers.get(joined.len()).filter(|next| starts_beside(&layers[i..joined.len()], next))
            {
                let started = (!store.has_blob(&next.digest)).then(|| self.inner.join_download(remote, store, next));
                joined.push(started);
            }
            let Some(download) = joined[i].as_mut() else {
                progress(Progress::blob("pulling", layer.digest, layer.size, layer.size));
                continue;
            };
            result = follow(&mut download.status, layer, progress).await;
            joined[i] = None;
            if result.is_err() {
                break;
            }
        }
        if result.is_err() {
            let bound = self.inner.config.read_timeout;
            futures_util::future::join_all(joined.into_iter().flatten().map(|j| j.leave(bound))).await;
        }
        result
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
        let layers: Vec<Layer> = manifest.blobs().cloned().collect();
        remote.push_blobs(store, &layers, &mut progress).await?;
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

/// The blobs a pull brings, pinned while it runs and taken back (unless something else
/// uses them) if it fails or is given up before its manifest is written. A pull given up
/// does not wait for its downloads to end: one that ends after names its blob only if
/// another pull still wants it, and otherwise keeps the data for the next pull to check
/// ([`Store::name_if_wanted`]).
struct TakeBack {
    pin: Option<super::Pin>,
    new: BTreeSet<Digest>,
    store: Store,
}

impl Drop for TakeBack {
    fn drop(&mut self) {
        drop(self.pin.take());
        if !self.new.is_empty() {
            self.store.remove_unreferenced(std::mem::take(&mut self.new));
        }
    }
}

/// Reports one download's progress until it ends; its result.
async fn follow(
    status: &mut watch::Receiver<BlobStatus>,
    layer: &Layer,
    progress: &mut (impl FnMut(Progress) + Send),
) -> Result<(), RegistryError> {
    loop {
        let now = status.borrow_and_update().clone();
        if now.started || now.done.is_some() {
            progress(Progress::blob("pulling", layer.digest, now.total, now.completed));
        }
        if let Some(done) = now.done {
            return done;
        }
        if status.changed().await.is_err() {
            return Err(RegistryError::Interrupted { digest: layer.digest });
        }
    }
}

/// Whether `next` starts while `running` (the layers started and not yet followed, in the
/// manifest's order) download: while fewer than [`LAYERS_AT_ONCE`] of them are large, for a
/// large one, or fewer than [`SMALL_LAYERS_AT_ONCE`] small, for a small one.
fn starts_beside(running: &[Layer], next: &Layer) -> bool {
    let bound = if is_large(next) { LAYERS_AT_ONCE } else { SMALL_LAYERS_AT_ONCE };
    running.iter().filter(|layer| is_large(layer) == is_large(next)).count() < bound
}

/// Whether a transfer treats `layer` as large ([`CONCURRENT_LAYER`]): weights, not a
/// config or a template.
fn is_large(layer: &Layer) -> bool {
    layer.size >= CONCURRENT_LAYER
}

/// Runs file work on the blocking pool.
async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, RegistryError> + Send + 'static,
) -> Result<T, RegistryError> {
    joined(tokio::task::spawn_blocking(work).await)
}

/// The outcome of file work run on the blocking pool, a panic in it an error.
fn joined<T>(outcome: Result<Result<T, RegistryError>, tokio::task::JoinError>) -> Result<T, RegistryError> {
    outcome.map_err(|e| RegistryError::io("a file operation failed", io::Error::other(e.to_string())))?
}

#[cfg(test)]
mod tests {
    use super::{CONCURRENT_LAYER, LAYERS_AT_ONCE, Progress, SMALL_LAYERS_AT_ONCE, starts_beside};
    use crate::store::digest::Digest;
    use crate::store::manifest::Layer;

    fn layer(size: u64) -> Layer {
        Layer {
            media_type: "application/octet-stream".into(),
            digest: Digest::of(&size.to_le_bytes()),
            size,
            from: None,
        }
    }

    #[test]
    fn small_layers_start_beside_large_ones_each_kind_to_its_own_bound() {
        let (large, small) = (layer(CONCURRENT_LAYER), layer(CONCURRENT_LAYER - 1));
        // Nothing running: either kind starts.
        assert!(starts_beside(&[], &large) && starts_beside(&[], &small));
        // Ollama's order: the weights, then a license, a template, parameters and the config.
        let running = vec![large.clone(); LAYERS_AT_ONCE];
        assert!(!starts_beside(&running, &large), "a fourth large layer waits");
        assert!(starts_beside(&running, &small), "small layers do not wait for the large ones");
        let running = [vec![large.clone()], vec![small.clone(); SMALL_LAYERS_AT_ONCE]].concat();
        assert!(!starts_beside(&running, &small), "one small layer past the bound waits");
        assert!(starts_beside(&running, &large), "large layers do not wait for the small ones");
        let running = vec![large.clone(); LAYERS_AT_ONCE - 1];
        assert!(starts_beside(&running, &large));
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
}
