//! Uploading a model's blobs: for each, `HEAD` to skip one the registry has, `POST` to start
//! an upload, one monolithic `PUT` that streams the file (opened through the store) with
//! its digest. Small blobs go beside the others.

use std::collections::HashSet;
use std::fs::File;
use std::io::{self, Read};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use futures_util::stream::{self, FuturesUnordered, StreamExt};
use reqwest::header::{CONTENT_LENGTH, CONTENT_TYPE, LOCATION};
use reqwest::{Body, StatusCode};

use super::protocol::Remote;
use super::{PROGRESS_INTERVAL, Progress, RegistryError, SMALL_LAYERS_AT_ONCE, WRITE_CHUNK, is_large};
use crate::durations::human;
use crate::store::Store;
use crate::store::manifest::Layer;

impl Remote {
    /// Uploads the blobs of `layers` the registry lacks, reporting progress one blob after
    /// the other in their order. Each small one (a config, a template: mostly its three
    /// round trips) goes up beside the others, up to [`SMALL_LAYERS_AT_ONCE`] at a time,
    /// and is reported when its turn comes; the first that fails fails the push at once.
    pub(super) async fn push_blobs(
        &self,
        store: &Store,
        layers: &[Layer],
        progress: &mut (impl FnMut(Progress) + Send),
    ) -> Result<(), RegistryError> {
        let mut waiting = layers
            .iter()
            .enumerate()
            .filter(|(_, layer)| !is_large(layer))
            .map(|(i, layer)| self.push_quietly(store, i, layer));
        let mut running: FuturesUnordered<_> = waiting.by_ref().take(SMALL_LAYERS_AT_ONCE).collect();
        let mut pushed = HashSet::new();
        for (i, layer) in layers.iter().enumerate() {
            if is_large(layer) {
                let mut large = std::pin::pin!(self.push_blob(store, layer, progress));
                loop {
                    tokio::select! {
                        result = &mut large => break result?,
                        Some(end) = running.next() => ended(end, &mut pushed, &mut running, &mut waiting)?,
                    }
                }
                continue;
            }
            progress(Progress::blob("pushing", layer.digest, layer.size, 0));
            while !pushed.contains(&i) {
                let end = running.next().await.expect("a small blob not pushed yet is on its way");
                ended(end, &mut pushed, &mut running, &mut waiting)?;
            }
            progress(Progress::blob("pushing", layer.digest, layer.size, layer.size));
        }
        Ok(())
    }

    /// [`Remote::push_blob`] without progress, for the `i`th blob.
    async fn push_quietly(&self, store: &Store, i: usize, layer: &Layer) -> (usize, Result<(), RegistryError>) {
        (i, self.push_blob(store, layer, &mut |_| {}).await)
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
                .upload_client()?
                .put(target.clone())
                .header(CONTENT_TYPE, "application/octet-stream")
                .header(CONTENT_LENGTH, size)
                .body(Body::wrap_stream(file_stream(file, Arc::clone(&sent)))))
        });
        let mut report = |done| progress(Progress::blob("pushing", digest, size, done));
        let response = self.watch_upload(&what, upload, size, &sent, &mut report).await?;
        // A refusal's body is read for its message, within the same bound.
        let bound = self.config().read_timeout;
        tokio::time::timeout(bound, self.expect(&what, response, &[StatusCode::CREATED]))
            .await
            .map_err(|_| self.silent(&what, format!("its answer did not end within {}", human(bound))))??;
        progress(Progress::blob("pushing", digest, size, size));
        Ok(())
    }

    /// Awaits a blob's upload, reporting the bytes taken so far every [`PROGRESS_INTERVAL`]:
    /// a registry that takes none of them for `read_timeout`, or does not answer within
    /// `read_timeout` of taking the last (as Go's `ResponseHeaderTimeout`, the wait of
    /// Docker's and containerd's pushes), fails the push. The last bytes may still be in
    /// the sockets' buffers then (a few MiB), which no client sees leave.
    async fn watch_upload<T>(
        &self,
        what: &str,
        upload: impl Future<Output = Result<T, RegistryError>>,
        size: u64,
        sent: &AtomicU64,
        progress: &mut impl FnMut(u64),
    ) -> Result<T, RegistryError> {
        let bound = self.config().read_timeout;
        let mut upload = std::pin::pin!(upload);
        let mut ticker = tokio::time::interval(PROGRESS_INTERVAL);
        let mut last = (0, tokio::time::Instant::now());
        loop {
            tokio::select! {
                result = &mut upload => return result,
                _ = ticker.tick() => {
                    let now = sent.load(Ordering::Relaxed);
                    progress(now);
                    if now != last.0 {
                        last = (now, tokio::time::Instant::now());
                    } else if last.1.elapsed() >= bound {
                        return Err(self.silent(what, if now < size {
                            format!("the registry took {now} of {size} bytes, then none for {}", human(bound))
                        } else {
                            format!("no answer within {} of the last of its {size} bytes", human(bound))
                        }));
                    }
                }
            }
        }
    }

    /// The error of an upload the registry let stall: `detail` says where.
    fn silent(&self, what: &str, detail: String) -> RegistryError {
        RegistryError::Transport { registry: self.registry.clone(), what: what.to_owned(), detail }
    }
}

/// One small blob's end in [`Remote::push_blobs`]: its error, or it is recorded and the
/// next one waiting starts.
fn ended<F: Future>(
    (i, result): (usize, Result<(), RegistryError>),
    pushed: &mut HashSet<usize>,
    running: &mut FuturesUnordered<F>,
    waiting: &mut impl Iterator<Item = F>,
) -> Result<(), RegistryError> {
    result?;
    pushed.insert(i);
    running.extend(waiting.next());
    Ok(())
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
