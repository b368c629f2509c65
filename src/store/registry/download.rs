//! The shared, resumable blob downloads: one task per blob and store, in ranged parts.
//!
//! A [`Registry`](super::Registry) keeps a map of downloads in flight, keyed by store and
//! digest. A pull that needs a blob already being downloaded waits on that download instead
//! of starting its own: it sees the same progress and gets the same result. The download runs
//! in its own task and stops (keeping its progress for a resume) when the last pull waiting
//! on it is dropped.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use crate::sync::lock;
use std::time::Duration;

use futures_util::{StreamExt, TryStreamExt, stream};
use reqwest::StatusCode;
use reqwest::header::RANGE;
use tokio::sync::watch;

use super::partial::Partial;
use super::protocol::Remote;
use super::{BlobStatus, Inner, RegistryError, blocking};
use crate::store::Store;
use crate::store::digest::Digest;
use crate::store::manifest::Layer;
use crate::store::stream::Batch;

/// How often a running download records its progress on disk.
const CHECKPOINT_INTERVAL: Duration = Duration::from_secs(1);

type InflightKey = (PathBuf, Digest);
/// A download's state for its waiters, and a channel whose sender goes when the download
/// task ends (its files settled: put in place, kept for a resume, or removed).
type Tracked = (Arc<watch::Sender<BlobStatus>>, watch::Receiver<()>);
pub(super) type Inflight = HashMap<InflightKey, Tracked>;

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
        if let Some((sender, settled)) = inflight.get(&key) {
            return Joined { status: sender.subscribe(), settled: settled.clone() };
        }
        let (sender, receiver) =
            watch::channel(BlobStatus { total: layer.size, started: false, completed: 0, done: None });
        let sender = Arc::new(sender);
        let (ended, settled) = watch::channel(());
        inflight.insert(key.clone(), (Arc::clone(&sender), settled.clone()));
        drop(inflight);
        let task = Download {
            _ended: ended,
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
        if inflight.get(&self.key).is_some_and(|(s, _)| Arc::ptr_eq(s, &self.sender)) {
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
    let mut batch = Batch::default();
    let mut flight = None;
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
            batch.push(data.clone());
        }
        if !batch.is_empty() && (ended || batch.is_full()) {
            // One batch is written (and hashed) while the next one arrives.
            land(&mut flight, partial, sender, at).await?;
            flight = Some(Flight::start(partial, *at, std::mem::take(&mut batch)));
        }
        if ended {
            land(&mut flight, partial, sender, at).await?;
        }
        match chunk {
            Ok(Some(_)) => {}
            Ok(None) if received == expected => return Ok(()),
            Ok(None) => return Err(truncated(received, "the answer ended early".to_owned())),
            Err(e) => return Err(truncated(received, body_error(&e, remote.config().read_timeout))),
        }
    }
}

/// A batch being written to a partial download on a blocking thread, and hashed: where it
/// arrived if the hash has got to it, else on another blocking thread.
struct Flight {
    len: u64,
    writing: tokio::task::JoinHandle<Result<u64, RegistryError>>,
    hashing: Option<tokio::task::JoinHandle<Result<(), RegistryError>>>,
}

impl Flight {
    fn start(partial: &Arc<Partial>, offset: u64, batch: Batch) -> Self {
        let len = batch.len() as u64;
        let hashing = (!partial.hash_here(offset, &batch)).then(|| {
            let (target, shared) = (Arc::clone(partial), batch.clone());
            tokio::task::spawn_blocking(move || target.hash_at(offset, &shared))
        });
        let target = Arc::clone(partial);
        let writing = tokio::task::spawn_blocking(move || target.write_at(offset, &batch));
        Self { len, writing, hashing }
    }
}

/// Waits for the batch in flight, if any; `*at` moves past it once it is written.
async fn land(
    flight: &mut Option<Flight>,
    partial: &Arc<Partial>,
    sender: &watch::Sender<BlobStatus>,
    at: &mut u64,
) -> Result<(), RegistryError> {
    let Some(Flight { len, writing, hashing }) = flight.take() else { return Ok(()) };
    let failed = || RegistryError::io("a file operation failed", std::io::Error::other("a blocking task failed"));
    let hashing = async {
        match hashing {
            Some(hashing) => hashing.await.map_err(|_| failed()).and_then(|r| r),
            None => Ok(()),
        }
    };
    let (written, hashed) = tokio::join!(writing, hashing);
    let written = written.map_err(|_| failed()).and_then(|r| r);
    let completed = match written {
        Ok(completed) => completed,
        Err(e) => {
            // The batch may have been hashed without being written.
            partial.distrust_hash();
            return Err(e);
        }
    };
    hashed?;
    *at += len;
    partial.report(sender, completed);
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::parse_content_range;

    #[test]
    fn content_ranges_parse() {
        assert_eq!(parse_content_range("bytes 0-99/1000"), Some((0, 99, Some(1000))));
        assert_eq!(parse_content_range("bytes 5-9/*"), Some((5, 9, None)));
        for bad in ["bytes */1000", "0-99/1000", "bytes 0-/1000", "bytes a-b/c", "bytes 9-5/10", "bytes 0-10/10"] {
            assert_eq!(parse_content_range(bad), None, "{bad}");
        }
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
    }
}
