//! The shared, resumable blob downloads: one task per blob and store, in ranged parts.
//!
//! A [`Registry`](super::Registry) keeps a map of downloads in flight, keyed by store and
//! digest. A pull that needs a blob already being downloaded waits on that download instead
//! of starting its own: it sees the same progress and gets the same result. The download runs
//! in its own task and stops (keeping its progress for a resume) when the last pull waiting
//! on it is dropped. A download of the same blob started while one that stopped so still
//! settles its files (records what arrived, or removes them) waits for that first.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use crate::sync::lock;
use std::time::Duration;

use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use reqwest::header::RANGE;
use tokio::sync::watch;

use super::landing::{Filling, Landing};
use super::partial::Partial;
use super::plain_http::{self, Fetched};
use super::protocol::Remote;
use super::ranged::{Asked, check_range_answer, writing_stopped};
use super::{BlobStatus, Inner, RegistryError, blocking};
use crate::store::Store;
use crate::store::digest::Digest;
use crate::store::manifest::Layer;

/// How often a running download records its progress on disk.
const CHECKPOINT_INTERVAL: Duration = Duration::from_secs(1);

/// How often a download looks whether more parts at once would help ([`wider`]).
const WIDEN_EVERY: Duration = Duration::from_millis(250);

/// Batch buffers a download has beyond one per part it runs at once: the writer's and the
/// hash's, and one waiting for each. Each is
/// [`PIPELINE_BATCH`](crate::store::stream::PIPELINE_BATCH): 20 MiB for one part at a time.
const LANDING_BUFFERS: usize = 4;

type InflightKey = (PathBuf, Digest);
/// A download's state for its waiters, and a channel whose sender goes when the download
/// task ends (its files settled: put in place, kept for a resume, or removed).
type Tracked = (Arc<watch::Sender<BlobStatus>>, watch::Receiver<()>);

/// The downloads of a [`Registry`](super::Registry).
#[derive(Debug, Default)]
pub(super) struct Inflight {
    /// Those pulls can join.
    running: HashMap<InflightKey, Tracked>,
    /// Those that stopped when their last pull went, until their files are settled: the
    /// next download of the blob waits for that before it opens them.
    settling: HashMap<InflightKey, Tracked>,
}

impl Inflight {
    /// Records a new download of `key`; returns the end of the one before it that still
    /// settles its files, for the new one to wait on.
    fn start(&mut self, key: &InflightKey, tracked: Tracked) -> Option<watch::Receiver<()>> {
        self.running.insert(key.clone(), tracked);
        self.settling.remove(key).map(|(_, settled)| settled)
    }

    /// The download `sender` of `key` no longer takes pulls; it settles its files.
    fn stop(&mut self, key: &InflightKey, sender: &Arc<watch::Sender<BlobStatus>>) {
        if self.running.get(key).is_some_and(|(s, _)| Arc::ptr_eq(s, sender)) {
            if let Some(tracked) = self.running.remove(key) {
                self.settling.insert(key.clone(), tracked);
            }
        }
    }

    /// The download `sender` of `key` has ended (or its files are settled): it goes from
    /// both maps, where a later download has not taken its place.
    fn end(&mut self, key: &InflightKey, sender: &Arc<watch::Sender<BlobStatus>>) {
        for map in [&mut self.running, &mut self.settling] {
            if map.get(key).is_some_and(|(s, _)| Arc::ptr_eq(s, sender)) {
                map.remove(key);
            }
        }
    }
}

/// A pull's hold on a download: its state, and a way to wait until it ended.
pub(super) struct Joined {
    pub(super) status: watch::Receiver<BlobStatus>,
    pub(super) settled: watch::Receiver<()>,
}

impl Joined {
    /// Stops waiting on the download (which stops when nobody else waits on it) and waits,
    /// at most `bound`, until its task has ended.
    pub(super) async fn leave(self, bound: Duration) {
        let Self { status, mut settled } = self;
        drop(status);
        let _ = tokio::time::timeout(bound, async { while settled.changed().await.is_ok() {} }).await;
    }
}

impl Inner {
    fn lock_inflight(&self) -> std::sync::MutexGuard<'_, Inflight> {
        lock(&self.inflight)
    }

    /// Waits on the download of `layer` into `store`, starting it unless one is in flight.
    pub(super) fn join_download(self: &Arc<Self>, remote: &Arc<Remote>, store: &Store, layer: &Layer) -> Joined {
        let key = (store.root().to_owned(), layer.digest);
        let mut inflight = self.lock_inflight();
        if let Some((sender, settled)) = inflight.running.get(&key) {
            return Joined { status: sender.subscribe(), settled: settled.clone() };
        }
        let (sender, receiver) =
            watch::channel(BlobStatus { total: layer.size, started: false, completed: 0, done: None });
        let sender = Arc::new(sender);
        let (ended, settled) = watch::channel(());
        let after = inflight.start(&key, (Arc::clone(&sender), settled.clone()));
        drop(inflight);
        let task = Download {
            _ended: ended,
            after,
            inner: Arc::clone(self),
            key,
            sender,
            remote: Arc::clone(remote),
            store: store.clone(),
            layer: layer.clone(),
        };
        tokio::spawn(task.run());
        Joined { status: receiver, settled }
    }
}

/// One blob download, run in its own task for every pull that waits on it.
struct Download {
    /// Dropped with the task, when its files are settled.
    _ended: watch::Sender<()>,
    /// The end of the download of this blob that stopped before this one started and
    /// still settled its files.
    after: Option<watch::Receiver<()>>,
    inner: Arc<Inner>,
    key: InflightKey,
    sender: Arc<watch::Sender<BlobStatus>>,
    remote: Arc<Remote>,
    store: Store,
    layer: Layer,
}

impl Download {
    async fn run(mut self) {
        let after = self.after.take();
        let outcome = self.download(after).await;
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
        self.inner.lock_inflight().end(&self.key, &self.sender);
    }

    /// Downloads, or returns `None` when every waiting pull went away first. Begins once
    /// the download before it (`after`) has settled its files; waits for that even when its
    /// pulls go meanwhile, so that a download after this one waiting on it waits for both.
    async fn download(&self, after: Option<watch::Receiver<()>>) -> Option<Result<(), RegistryError>> {
        if let Some(mut after) = after {
            while after.changed().await.is_ok() {}
        }
        if self.store.has_blob(&self.layer.digest) {
            return Some(Ok(()));
        }
        // Held until the files are settled: the threads it bounds run until then.
        let slot = Arc::clone(&self.inner.downloads).acquire_owned();
        let _slot = self.while_watched(slot).await?.expect("the semaphore is never closed");
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
        let landing = Landing::start(&partial, &self.sender, 1 + LANDING_BUFFERS);
        let fetched = self.while_watched(fetch_blob(&self.remote, &partial, &landing)).await;
        // Every batch handed on is written (and hashed) before the blob is checked or the
        // download's progress recorded; a failed write is the reason the parts stopped.
        let landed = landing.finish().await;
        let outcome = match (fetched, landed) {
            (None, _) => None,
            (Some(_), Err(e)) | (Some(Err(e)), Ok(())) => Some(Err(e)),
            (Some(Ok(())), Ok(())) => {
                let commit = || {
                    let checked = Arc::clone(&partial);
                    blocking(move || checked.commit())
                };
                match commit().await {
                    // No pull wanted the blob as it was to be named. One that joined since
                    // pinned it first: the blob is named for it. Else this download stops as
                    // one whose pulls all went, and the next one finds the data complete.
                    Err(RegistryError::Interrupted { .. }) if self.forget_if_unwatched() => None,
                    Err(RegistryError::Interrupted { .. }) => Some(commit().await),
                    outcome => Some(outcome),
                }
            }
        };
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

    /// `work`'s outcome, or `None` (and `work` dropped) once every pull waiting on this
    /// download has gone.
    async fn while_watched<T>(&self, work: impl Future<Output = T>) -> Option<T> {
        let mut work = std::pin::pin!(work);
        loop {
            tokio::select! {
                outcome = &mut work => return Some(outcome),
                () = self.sender.closed() => {
                    if self.forget_if_unwatched() {
                        return None;
                    }
                }
            }
        }
    }

    /// Takes the download out of the map if no pull waits on it any more (checked under the
    /// map's lock, so that no pull can join it after that), into those settling their files.
    fn forget_if_unwatched(&self) -> bool {
        let mut inflight = self.inner.lock_inflight();
        if self.sender.receiver_count() > 0 {
            return false;
        }
        inflight.stop(&self.key, &self.sender);
        true
    }
}

impl Drop for Download {
    fn drop(&mut self) {
        // Also when the task panicked: the pulls waiting on it then see `Interrupted`.
        self.forget();
    }
}

/// Fetches the missing parts of a partial blob into `landing`.
///
/// One part at a time to begin with, in order, so that every byte is hashed from memory
/// right after it is written. More parts run at once (up to `max_parts`) only while the
/// writer and the hash both wait for data more than half the time: then the data arrives
/// slower than it can be stored (a registry far away, a connection with a cap), and
/// parallel transfers help. Where the CPU or the disk is the limit instead (a registry
/// close by), more parts would only add work: what they write ahead of the hash is read
/// back later.
async fn fetch_blob(remote: &Remote, partial: &Arc<Partial>, landing: &Landing) -> Result<(), RegistryError> {
    let config = remote.config();
    let max_parts = config.max_parts.max(1);
    let part_size = config.part_size.max(1);
    // Cut as they are started, never listed whole: a manifest can declare a size of
    // exabytes, which listed whole is more parts than memory holds.
    let mut parts = partial.missing().into_iter().flat_map(move |(start, end)| {
        std::iter::successors(Some(start), move |at| Some(at.saturating_add(part_size)))
            .take_while(move |at| *at < end)
            .map(move |at| (at, end.min(at.saturating_add(part_size))))
    });
    let fetches = async {
        let mut running = FuturesUnordered::new();
        let mut width = 1;
        let mut widen = tokio::time::interval(WIDEN_EVERY);
        widen.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        widen.tick().await;
        loop {
            while running.len() < width {
                let Some((start, end)) = parts.next() else { break };
                running.push(fetch_part(remote, partial, landing, start, end));
            }
            if running.is_empty() {
                return Ok(());
            }
            tokio::select! {
                Some(outcome) = running.next() => outcome?,
                _ = widen.tick() => {
                    if wider(landing.take_idle_share(), width, max_parts) {
                        width += 1;
                        landing.widen();
                        tracing::debug!(digest = %partial.digest, width, "downloading more parts at once");
                    }
                }
            }
        }
    };
    let checkpoints = async {
        let mut ticker = tokio::time::interval(CHECKPOINT_INTERVAL);
        ticker.tick().await;
        loop {
            ticker.tick().await;
            let partial = Arc::clone(partial);
            if let Err(e) = blocking(move || partial.checkpoint()).await {
                return e;
            }
        }
    };
    tokio::select! {
        outcome = fetches => outcome,
        error = checkpoints => Err(error),
    }
}

/// Whether a download running `width` parts at once should run one more: while its writer
/// and its hash both waited for data more than half of the last [`WIDEN_EVERY`].
fn wider(idle_share: f64, width: usize, max_parts: usize) -> bool {
    idle_share > 0.5 && width < max_parts
}

/// Fetches `start..end` of a blob, retrying from the first missing byte when a transfer fails.
async fn fetch_part(
    remote: &Remote,
    partial: &Partial,
    landing: &Landing,
    start: u64,
    end: u64,
) -> Result<(), RegistryError> {
    let config = remote.config();
    let mut at = start;
    let mut attempt = 1;
    loop {
        match fetch_range(remote, partial, landing, &mut at, end).await {
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

/// One ranged GET of `*at..end`, handed to the landing in batches as it arrives; `*at`
/// moves past every byte handed on (each is written, or the download fails).
async fn fetch_range(
    remote: &Remote,
    partial: &Partial,
    landing: &Landing,
    at: &mut u64,
    end: u64,
) -> Result<(), RegistryError> {
    if remote.reads_direct() {
        match plain_http::fetch_range(remote, partial, landing.feed(), at, end).await? {
            Fetched::Landed => return Ok(()),
            Fetched::Elsewhere => {}
        }
    }
    let what = &partial.what;
    let asked = Asked { remote, what, first: *at, end };
    let (first, last) = (*at, end - 1);
    let expected = end - first;
    let url = remote.url(&format!("blobs/{}", partial.digest))?;
    let mut response = remote
        .send(what, || Ok(remote.client()?.get(url.clone()).header(RANGE, format!("bytes={first}-{last}"))))
        .await?;
    let content_range = response.headers().get(reqwest::header::CONTENT_RANGE).and_then(|v| v.to_str().ok());
    match check_range_answer(response.status(), content_range, response.content_length(), first, end, partial.size) {
        Ok(true) => {}
        Ok(false) => return Err(remote.fail(what, response).await),
        Err(detail) => return Err(asked.bad_range(detail)),
    }
    let mut received = 0u64;
    let mut filling = Filling::new(landing.feed());
    loop {
        let chunk = response.chunk().await;
        if let Ok(Some(data)) = &chunk {
            let len = data.len() as u64;
            if received + len > expected {
                return Err(asked.overlong());
            }
            received += len;
            if !filling.push(data, at).await {
                return Err(writing_stopped());
            }
        }
        // Whatever arrived is kept, also when the transfer broke off: a retry asks for the rest.
        if !matches!(chunk, Ok(Some(_))) && !filling.hand_on(at) {
            return Err(writing_stopped());
        }
        match chunk {
            Ok(Some(_)) => {}
            Ok(None) if received == expected => return Ok(()),
            Ok(None) => return Err(asked.truncated(received, "the answer ended early".to_owned())),
            Err(e) => return Err(asked.truncated(received, body_error(&e, remote.config().read_timeout))),
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

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use tokio::sync::watch;

    use super::{BlobStatus, Inflight, Tracked, wider};
    use crate::store::digest::Digest;

    fn tracked() -> (Tracked, watch::Sender<()>) {
        let status = Arc::new(watch::channel(BlobStatus { total: 1, started: false, completed: 0, done: None }).0);
        let (ended, settled) = watch::channel(());
        ((status, settled), ended)
    }

    /// A download started while one of the same blob that lost its last pull still settles
    /// its files (records what arrived, or removes them) waits for that one's end, and the
    /// first one's end takes only itself out of the maps.
    #[test]
    fn a_download_after_one_that_stopped_waits_until_its_files_are_settled() {
        let key = ("/store".into(), Digest::of(b"blob"));
        let mut inflight = Inflight::default();
        let ((first, first_settled), first_ended) = tracked();
        assert!(inflight.start(&key, (Arc::clone(&first), first_settled.clone())).is_none(), "nothing before it");
        inflight.stop(&key, &first);
        assert!(!inflight.running.contains_key(&key), "a stopped download takes no pull");

        let ((second, second_settled), _second_ended) = tracked();
        let after = inflight.start(&key, (Arc::clone(&second), second_settled)).expect("the first still settles");
        assert!(inflight.settling.is_empty(), "taken by the second");
        // What `Download::download` waits on ends when the first task does.
        assert!(after.has_changed().is_ok(), "the first's files are not settled yet");
        inflight.end(&key, &first);
        drop(first_ended);
        assert!(after.has_changed().is_err(), "the first has ended");
        assert!(inflight.running.get(&key).is_some_and(|(s, _)| Arc::ptr_eq(s, &second)), "the second runs on");
        inflight.end(&key, &second);
        assert!(inflight.running.is_empty() && inflight.settling.is_empty());
    }

    /// A download that stopped and then ended with no other started after it leaves nothing.
    #[test]
    fn a_stopped_download_that_ends_leaves_no_trace() {
        let key = ("/store".into(), Digest::of(b"blob"));
        let mut inflight = Inflight::default();
        let ((status, settled), _ended) = tracked();
        let _ = inflight.start(&key, (Arc::clone(&status), settled.clone()));
        inflight.stop(&key, &status);
        inflight.end(&key, &status);
        assert!(inflight.running.is_empty() && inflight.settling.is_empty());
    }

    #[test]
    fn more_parts_only_while_the_hash_mostly_waits_and_up_to_the_limit() {
        assert!(wider(0.9, 1, 8));
        assert!(wider(0.51, 7, 8));
        assert!(!wider(0.5, 1, 8), "busy half the time: the CPU or the disk is about the limit");
        assert!(!wider(0.1, 1, 8));
        assert!(!wider(1.0, 8, 8));
        assert!(!wider(1.0, 1, 1));
    }
}
