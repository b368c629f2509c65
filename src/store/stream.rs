//! Blob data on its way into the store: hashed and written in one pass, in stages on
//! threads of their own ([`Pipeline`] for uploads, `copy_hashed_aligned` for imports; a
//! pull's landing in `registry` uses the same buffers and clocks), written with direct I/O
//! while the disk keeps up ([`DirectPace`]), else sent to disk as it goes ([`Writeback`]),
//! so that the one sync before the blob is named waits only for the tail.

use std::fs::File;
use std::io::{self, Read};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::digest::{Digest, Hasher};
use crate::sync::lock;

/// How much of a blob is read back at a time to hash it (`registry::partial`): few
/// system calls, and a bounded amount in memory.
pub const BATCH: usize = 1 << 20;

/// How much is written between two starts of the disk writes ([`Writeback`]).
const WRITEBACK_STEP: u64 = 32 << 20;

/// Starts the disk writes of a file's dirty pages in the background every
/// `WRITEBACK_STEP` bytes written, so that writing to disk overlaps receiving instead of
/// all waiting for the final sync. Durability still comes from that final sync: this only
/// makes it short. A thread is started on the first step (small files never start one).
#[derive(Debug)]
pub struct Writeback {
    /// The same open file (a duplicate descriptor).
    file: Option<File>,
    since: u64,
    kick: Option<SyncSender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// An error a background sync saw: the file's one description reports a write-back
    /// error to one sync only, so it is kept here for [`Writeback::finish`].
    error: Arc<Mutex<Option<io::Error>>>,
}

impl Writeback {
    /// For writes to `file`.
    #[must_use]
    pub fn new(file: &File) -> Self {
        Self { file: file.try_clone().ok(), since: 0, kick: None, thread: None, error: Arc::default() }
    }

    /// One for `file` where `on`, else one that never syncs: for a blob synced after the
    /// reply (`store::unsynced`), whose pages are better left to the kernel until then.
    /// Syncs while it is written would make the note's sync, just before the blob is
    /// named, wait for them.
    #[must_use]
    pub fn new_if(on: bool, file: &File) -> Self {
        if on {
            Self::new(file)
        } else {
            Self { file: None, since: 0, kick: None, thread: None, error: Arc::default() }
        }
    }

    /// Counts `n` bytes written; starts a background sync each step.
    pub fn wrote(&mut self, n: usize) {
        self.since += n as u64;
        if self.since < WRITEBACK_STEP {
            return;
        }
        self.since = 0;
        if self.kick.is_none() {
            let Some(file) = self.file.take() else { return };
            let (kick, kicked) = std::sync::mpsc::sync_channel::<()>(1);
            let error = Arc::clone(&self.error);
            let spawned = std::thread::Builder::new().name("corral-writeback".into()).spawn(move || {
                while kicked.recv().is_ok() {
                    if let Err(e) = file.sync_data() {
                        lock(&error).get_or_insert(e);
                        return;
                    }
                }
            });
            match spawned {
                Ok(thread) => (self.kick, self.thread) = (Some(kick), Some(thread)),
                // No thread: the final sync does all the writing, as without this.
                Err(_) => return,
            }
        }
        if let Some(kick) = &self.kick {
            // A sync still running (or one asked for) will take these pages too.
            if let Err(TrySendError::Disconnected(())) = kick.try_send(()) {
                self.kick = None;
            }
        }
    }

    /// Waits for the background sync in progress, if any; the error one saw.
    pub fn finish(&mut self) -> io::Result<()> {
        self.kick = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        lock(&self.error).take().map_or(Ok(()), Err)
    }
}

impl Drop for Writeback {
    fn drop(&mut self) {
        // The thread ends after the sync it is running, if any; nobody waits for it.
        self.kick = None;
    }
}

/// How much a writer writes directly between two looks at the disk's pace
/// ([`DirectPace`]): 16 of the pipelines' batches.
pub const PACE_WINDOW: u64 = 64 << 20;

/// The share of a window's time spent in direct writes from which the window counts as
/// slow: the next batch was nearly always waiting for the write before it.
const SLOW_DISK_SHARE: f64 = 0.9;

/// How many slow windows in a row make the disk the slower part. One is not enough: where
/// direct writes run about as fast as the data comes (1.1 GB/s here in session 25),
/// windows take 0.56 to 1.0 of their time and one in six passes nine tenths, so nearly
/// every transfer of 1 GiB switched, and the page cache then made pulls 1.5-2x slower. Of
/// 144 such windows, 4 ran two slow in a row and 1 three; none four. A disk that is the
/// slower part keeps its windows above it (0.946-0.982 in session 23's hour).
pub const SLOW_WINDOWS: u32 = 4;

/// Whether direct writes keep up with the data coming in. A direct write waits for the
/// disk, one batch at a time, while a write through the page cache returns at once and
/// leaves the kernel to write back many batches together. Where the CPU is the slower
/// part, direct I/O saves a third of it (a quarter of an upload's time); where the disk
/// is, direct writes one after the other are slower than the kernel's write-back (in one
/// such hour, uploads at 0.52–0.55 of the `cp` + `fsync` floor with direct I/O and
/// 0.83–1.13 through the page cache: docs/benchmarks.md). So a writer starts with direct
/// I/O and, once direct writes took nearly all of the time of [`SLOW_WINDOWS`] windows in
/// a row, writes the rest of the transfer through the page cache. The final sync makes
/// both durable alike.
///
/// Where a stage beside the writer waits for it (a pull's hash thread, which takes each
/// batch from it; an import's or an upload's, which hands each batch to it:
/// `DirectPace::beside`), a window counts as slow only if that stage also waited for the
/// writer at least a fifth of it (`NEXT_WAIT_SHARE`). Where the disk and the hash are
/// about as fast as each other, the writer is busy nine tenths of many windows while the
/// CPU, not the disk, limits the transfer; the page cache's copy and write-back then cost
/// CPU the hash needed, and a pull of 1 GiB that left direct I/O took 1.16–1.90 s instead
/// of 0.92–0.99 s (docs/benchmarks.md, session 33). A disk that is the slower part leaves
/// the hash waiting.
#[derive(Debug, Default)]
pub struct DirectPace {
    /// The window's first write's start, the time spent writing since, and the bytes.
    window: Option<(Instant, Duration, u64)>,
    /// The slow windows just before this one, in a row.
    slow: u32,
    /// How long the stage beside the writer has waited for it, and how long it had when
    /// the window began.
    next: Option<(Arc<IdleClock>, u64)>,
}

/// The share of a window the stage beside the writer must have waited for it, for the
/// window to count as slow: the disk then writes at most four fifths as fast as that
/// stage goes.
const NEXT_WAIT_SHARE: f64 = 0.2;

impl DirectPace {
    /// Judges the windows by the waits of `next` as well: how long the stage that takes
    /// each batch from the writer, or hands each to it, waited for the writer.
    pub(super) fn beside(&mut self, next: Arc<IdleClock>) {
        self.next = Some((next, 0));
    }

    /// Runs `write`, a direct write of `n` bytes, and counts it (`DirectPace::wrote`):
    /// whether direct writes turned out to be the slower part with it.
    pub fn time(&mut self, n: usize, write: impl FnOnce() -> io::Result<()>) -> io::Result<bool> {
        let began = Instant::now();
        if self.window.is_none() {
            if let Some((next, from)) = &mut self.next {
                *from = next.total();
            }
        }
        write()?;
        let next_waited =
            self.next.as_ref().map(|(next, from)| Duration::from_nanos(next.total().saturating_sub(*from)));
        Ok(self.wrote(began, Instant::now(), n, next_waited))
    }

    /// Counts a direct write of `n` bytes that ran from `began` to `ended`, when the stage
    /// beside the writer, if there is one, has waited `next_waited` since the window began:
    /// `true` when it closes the last of [`SLOW_WINDOWS`] slow windows in a row.
    fn wrote(&mut self, began: Instant, ended: Instant, n: usize, next_waited: Option<Duration>) -> bool {
        let (start, busy, bytes) = self.window.get_or_insert((began, Duration::ZERO, 0));
        *busy += ended.saturating_duration_since(began);
        *bytes += n as u64;
        if *bytes < PACE_WINDOW {
            return false;
        }
        let elapsed = ended.saturating_duration_since(*start).as_secs_f64();
        let share = |of: Duration| if elapsed == 0.0 { 0.0 } else { of.as_secs_f64() / elapsed };
        let (busy, next_idle) = (share(*busy), next_waited.map(share));
        tracing::trace!(busy, next_idle, "a window of direct writes");
        self.window = None;
        let slow = busy >= SLOW_DISK_SHARE && next_idle.is_none_or(|idle| idle >= NEXT_WAIT_SHARE);
        self.slow = if slow { self.slow.saturating_add(1) } else { 0 };
        self.slow >= SLOW_WINDOWS
    }
}

/// Time a thread spent waiting for its work, read from another thread, a wait still
/// going on included.
#[derive(Debug)]
pub(super) struct IdleClock {
    origin: Instant,
    /// Nanoseconds of the waits that ended.
    ended: AtomicU64,
    /// When the wait going on began, in nanoseconds after `origin` plus one; 0: none.
    since: AtomicU64,
}

impl IdleClock {
    pub(super) fn new() -> Self {
        Self { origin: Instant::now(), ended: AtomicU64::new(0), since: AtomicU64::new(0) }
    }

    fn now(&self) -> u64 {
        u64::try_from(self.origin.elapsed().as_nanos()).unwrap_or(u64::MAX - 1) + 1
    }

    /// Runs `wait`, counting its time.
    pub(super) fn around<T>(&self, wait: impl FnOnce() -> T) -> T {
        let _waiting = self.waiting();
        wait()
    }

    /// Counts the time from now until the guard is dropped: a wait that is awaited.
    pub(super) fn waiting(&self) -> Waiting<'_> {
        self.since.store(self.now(), Ordering::Relaxed);
        Waiting(self)
    }

    /// Nanoseconds waited so far.
    pub(super) fn total(&self) -> u64 {
        let since = self.since.load(Ordering::Relaxed);
        let going_on = if since > 0 { self.now().saturating_sub(since) } else { 0 };
        self.ended.load(Ordering::Relaxed) + going_on
    }
}

/// A wait of an [`IdleClock`] going on, until dropped.
pub(super) struct Waiting<'a>(&'a IdleClock);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        let clock = self.0;
        let since = clock.since.swap(0, Ordering::Relaxed);
        clock.ended.fetch_add(clock.now().saturating_sub(since), Ordering::Relaxed);
    }
}

/// How many batches may wait for each of a [`Pipeline`]'s stages (the hash, the write):
/// how far receiving runs ahead of them.
pub const DEPTH: usize = 2;

/// The most batch buffers a [`Pipeline`] or `copy_hashed_aligned` makes: one being
/// filled, one being hashed, one being written, and [`DEPTH`] waiting for each of the last
/// two. With five, the stages waited on each other whenever the disk paused: an upload
/// took 7 % longer.
pub const BUFFERS: usize = 2 * DEPTH + 3;

/// The size of a [`Pipeline`]'s batch buffers. Each batch costs a trip to the blocking
/// pool and back (three thread wake-ups); at 4 MiB instead of [`BATCH`]'s 1 MiB an upload
/// takes about 9 % less CPU time. Its [`BUFFERS`] weigh 28 MiB.
pub const PIPELINE_BATCH: usize = 4 << 20;

/// Data arriving in order, copied into batches, each batch hashed and then written on the
/// blocking pool, each stage up to [`DEPTH`] batches behind the one before.
///
/// - Receiving, hashing and writing run at once, on three threads. SHA-256 is the most
///   work of a transfer (about 0.8 s per GiB here, as fast on data just read as on data
///   in memory), so it gets a thread of its own. The thread receiving is left the
///   network's copy and one more, and keeps up with the client. Hashing each chunk where it
///   arrived made receiving and hashing take turns on one core: a 1 GiB upload took 9 %
///   longer (median of 18 each, 1.26 s against 1.15 s).
/// - Each chunk is copied into one of the pipeline's own batch buffers, which the
///   writer hands back once written, and dropped at once, so the HTTP stack reads the next
///   chunk into the same memory. Keeping the chunks until written instead made every
///   read land in freshly allocated pages: about 130 000 page faults (and
///   zeroed pages) per GiB, a sixth of an upload's CPU time, against one copy.
/// - The buffers are aligned for direct I/O ([`ALIGN`]), so a writer can send them from memory
///   straight to disk ([`TempFile::direct`](super::TempFile::direct)).
pub struct Pipeline<W> {
    filling: Aligned,
    buffers: usize,
    to_hasher: Option<tokio::sync::mpsc::Sender<Aligned>>,
    written: tokio::sync::mpsc::UnboundedReceiver<Aligned>,
    hashing: tokio::task::JoinHandle<io::Result<Hasher>>,
    writing: tokio::task::JoinHandle<io::Result<W>>,
}

impl<W: Send + 'static> Pipeline<W> {
    /// Starts the hasher and the writer: `write` gets `sink` and each batch in order, on
    /// the blocking pool, one batch at a time, once it is hashed. Each stage keeps a
    /// blocking thread while batches are waiting for it ([`HashStage::run`]) and is a task
    /// that holds none when none is, so an upload whose client stalls holds no thread.
    /// `hash_waits` counts how long the hash waited for the writer (for its
    /// [`DirectPace`]). Dropping the pipeline lets it finish the batches already handed
    /// on, then drop `sink`.
    pub(super) fn start(
        sink: W,
        hash_waits: Arc<IdleClock>,
        write: impl FnMut(&mut W, &[u8]) -> io::Result<()> + Send + 'static,
    ) -> Self {
        let (to_hasher, unhashed) = tokio::sync::mpsc::channel::<Aligned>(DEPTH);
        let (to_writer, writes) = tokio::sync::mpsc::channel::<Aligned>(DEPTH);
        let (give_back, written) = tokio::sync::mpsc::unbounded_channel();
        let hashing = tokio::spawn(async move {
            let mut stage = HashStage { hasher: Hasher::default(), unhashed, to_writer };
            while let Some(batch) = stage.unhashed.recv().await {
                let (back, left) = tokio::task::spawn_blocking(move || {
                    let left = stage.run(batch);
                    (stage, left)
                })
                .await
                .map_err(|_| io::Error::other("a blob's hashing thread panicked"))?;
                stage = back;
                match left {
                    Left::Nothing => {}
                    Left::ForTheWriter(batch) => {
                        let sent = {
                            let _waiting = hash_waits.waiting();
                            stage.to_writer.send(batch).await
                        };
                        // Gone when the writing stopped, which `finish` reports.
                        if sent.is_err() {
                            break;
                        }
                    }
                    Left::WriterGone => break,
                }
            }
            Ok(stage.hasher)
        });
        let writing = tokio::spawn(async move {
            let mut stage = WriteStage { sink, write, writes, give_back };
            while let Some(batch) = stage.writes.recv().await {
                // The stage goes to the blocking thread and comes back.
                let (back, outcome) = tokio::task::spawn_blocking(move || {
                    let outcome = stage.run(batch);
                    (stage, outcome)
                })
                .await
                .map_err(|_| io::Error::other("a blob's writing thread panicked"))?;
                stage = back;
                outcome?;
            }
            Ok(stage.sink)
        });
        Self { filling: Aligned::new(), buffers: 1, to_hasher: Some(to_hasher), written, hashing, writing }
    }

    /// Copies `chunk` into the batch; hands each full batch on, waiting while the hash is
    /// [`DEPTH`] batches behind or every buffer is in use. `false` once the writing stopped
    /// (a failed write): [`Pipeline::finish`] tells why.
    pub async fn push(&mut self, chunk: &[u8]) -> bool {
        let mut rest = chunk;
        while !rest.is_empty() {
            let (now, later) = rest.split_at(rest.len().min(PIPELINE_BATCH - self.filling.len()));
            self.filling.extend(now);
            rest = later;
            if self.filling.len() == PIPELINE_BATCH && !self.send().await {
                return false;
            }
        }
        true
    }

    /// Hands the batch being filled to the hasher and takes an empty buffer: one
    /// the writer gave back, a new one while there are fewer than [`BUFFERS`], else the
    /// next one given back.
    async fn send(&mut self) -> bool {
        let Some(to_hasher) = &self.to_hasher else { return false };
        if to_hasher.send(std::mem::take(&mut self.filling)).await.is_err() {
            return false;
        }
        let next = match self.written.try_recv() {
            Ok(buffer) => Some(buffer),
            Err(_) if self.buffers < BUFFERS => {
                self.buffers += 1;
                Some(Aligned::new())
            }
            Err(_) => self.written.recv().await,
        };
        let Some(mut next) = next else { return false };
        next.clear();
        self.filling = next;
        true
    }

    /// Hashes and writes what is left and waits for both: the sink once every batch
    /// is written, and the hash of everything pushed.
    ///
    /// # Errors
    /// A write failed (or a thread panicked).
    pub async fn finish(mut self) -> io::Result<(W, Hasher)> {
        if let Some(to_hasher) = self.to_hasher.take() {
            if !self.filling.is_empty() {
                // A failed send means a failed write, which the writer returns below.
                let _ = to_hasher.send(std::mem::take(&mut self.filling)).await;
            }
        }
        let hashed = self.hashing.await.map_err(|_| io::Error::other("a blob's hasher panicked"))?;
        let written = self.writing.await.map_err(|_| io::Error::other("a blob's writer panicked"))??;
        Ok((written, hashed?))
    }
}

/// A [`Pipeline`]'s hash, with the batches it takes and where it hands them on.
struct HashStage {
    hasher: Hasher,
    unhashed: tokio::sync::mpsc::Receiver<Aligned>,
    to_writer: tokio::sync::mpsc::Sender<Aligned>,
}

/// What the hash left undone when it gave its thread back.
enum Left {
    /// Every batch that came is hashed and with the writer.
    Nothing,
    /// A hashed batch for which the writer had no room yet.
    ForTheWriter(Aligned),
    /// The writing stopped (a failed write, which `finish` reports).
    WriterGone,
}

impl HashStage {
    /// Hashes `batch` and then every batch already waiting, on the blocking thread it was
    /// called on, handing each to the writer while it has room. Going back to the runtime
    /// between batches instead cost the hash a wait for a runtime thread on every batch,
    /// where the cores are busy.
    fn run(&mut self, mut batch: Aligned) -> Left {
        loop {
            self.hasher.update(batch.data());
            match self.to_writer.try_send(batch) {
                Ok(()) => {}
                Err(tokio::sync::mpsc::error::TrySendError::Full(batch)) => return Left::ForTheWriter(batch),
                Err(tokio::sync::mpsc::error::TrySendError::Closed(_)) => return Left::WriterGone,
            }
            match self.unhashed.try_recv() {
                Ok(next) => batch = next,
                // None waiting, or none to come: the task's `recv` tells which.
                Err(_) => return Left::Nothing,
            }
        }
    }
}

/// A [`Pipeline`]'s writer: the sink, the function that writes to it, the batches it
/// takes and where it gives their buffers back.
struct WriteStage<W, F> {
    sink: W,
    write: F,
    writes: tokio::sync::mpsc::Receiver<Aligned>,
    give_back: tokio::sync::mpsc::UnboundedSender<Aligned>,
}

impl<W, F: FnMut(&mut W, &[u8]) -> io::Result<()>> WriteStage<W, F> {
    /// Writes `batch` and then every batch already waiting, on the blocking thread it was
    /// called on, as [`HashStage::run`] hashes.
    fn run(&mut self, mut batch: Aligned) -> io::Result<()> {
        loop {
            (self.write)(&mut self.sink, batch.data())?;
            // Gone only when the pipeline is: then the buffer is not needed.
            let _ = self.give_back.send(batch);
            match self.writes.try_recv() {
                Ok(next) => batch = next,
                Err(_) => return Ok(()),
            }
        }
    }
}

/// The alignment of a [`Pipeline`]'s buffers: enough for direct I/O (`O_DIRECT`) on any
/// block device Linux has (logical blocks of 512 or 4096 bytes).
pub const ALIGN: usize = 4096;

/// A batch buffer of [`PIPELINE_BATCH`] bytes whose data starts at an [`ALIGN`]ed address,
/// so that it can be written with direct I/O. Found inside a plain vector one alignment
/// larger (no unsafe allocation), zeroed once when made (pages the kernel hands out zeroed
/// anyway) so that a reader can read straight into its free room.
#[derive(Default)]
pub(super) struct Aligned {
    bytes: Vec<u8>,
    start: usize,
    /// How much of it holds data.
    len: usize,
}

impl Aligned {
    pub(super) fn new() -> Self {
        let bytes = vec![0u8; PIPELINE_BATCH + ALIGN];
        let start = bytes.as_ptr().align_offset(ALIGN).min(ALIGN);
        Self { bytes, start, len: 0 }
    }

    pub(super) fn data(&self) -> &[u8] {
        &self.bytes[self.start..self.start + self.len]
    }

    pub(super) fn len(&self) -> usize {
        self.len
    }

    pub(super) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Appends `data`, which fits.
    pub(super) fn extend(&mut self, data: &[u8]) {
        self.spare()[..data.len()].copy_from_slice(data);
        self.len += data.len();
    }

    /// The room after the data, to read into; [`Aligned::filled`] then counts what was.
    pub(super) fn spare(&mut self) -> &mut [u8] {
        let from = self.start + self.len;
        &mut self.bytes[from..self.start + PIPELINE_BATCH]
    }

    /// Counts `n` more bytes of [`Aligned::spare`] as data.
    pub(super) fn filled(&mut self, n: usize) {
        debug_assert!(self.len + n <= PIPELINE_BATCH);
        self.len += n;
    }

    pub(super) fn clear(&mut self) {
        self.len = 0;
    }
}

/// Reads `reader` to its end into recycled [`PIPELINE_BATCH`] buffers aligned for direct
/// I/O (at most [`BUFFERS`]), while a second thread hashes each full buffer and a third
/// hands it to `write`, in order, each up to [`DEPTH`] behind: a file's import as an
/// upload's [`Pipeline`] moves data, without the network. `progress` hears the bytes read
/// so far after each buffer; `hash_waits` counts how long the hash waited for the writer
/// (for its [`DirectPace`]). Returns the digest and length.
///
/// # Errors
/// A failed read, or the first failed write (which stops the reading).
pub(super) fn copy_hashed_aligned(
    mut reader: impl Read,
    mut write: impl FnMut(&[u8]) -> io::Result<()> + Send,
    mut progress: impl FnMut(u64),
    hash_waits: &IdleClock,
) -> io::Result<(Digest, u64)> {
    let (to_hasher, unhashed) = std::sync::mpsc::sync_channel::<Aligned>(DEPTH);
    let (to_writer, batches) = std::sync::mpsc::sync_channel::<Aligned>(DEPTH);
    let (give_back, written) = std::sync::mpsc::channel::<Aligned>();
    std::thread::scope(|scope| {
        let hashing = scope.spawn(move || {
            let mut hasher = Hasher::default();
            for batch in unhashed {
                hasher.update(batch.data());
                // Gone when the writing stopped, which its join returns.
                if hash_waits.around(|| to_writer.send(batch)).is_err() {
                    break;
                }
            }
            hasher
        });
        let writer = scope.spawn(move || {
            for batch in batches {
                write(batch.data())?;
                // Gone only when the reading stopped: then the buffer is not needed.
                let _ = give_back.send(batch);
            }
            Ok::<_, io::Error>(())
        });
        let (mut buffers, mut read_so_far) = (0, 0);
        let read = (|| loop {
            let mut batch = match written.try_recv() {
                Ok(batch) => batch,
                Err(_) if buffers < BUFFERS => {
                    buffers += 1;
                    Aligned::new()
                }
                // The writer stopped (a failed write, which its join returns).
                Err(_) => written.recv().map_err(|_| io::Error::other("the blob's writer stopped"))?,
            };
            batch.clear();
            while batch.len() < PIPELINE_BATCH {
                let n = match reader.read(batch.spare()) {
                    Ok(n) => n,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(e),
                };
                if n == 0 {
                    break;
                }
                batch.filled(n);
            }
            read_so_far += batch.len() as u64;
            let end = batch.len() < PIPELINE_BATCH;
            if !batch.is_empty() && to_hasher.send(batch).is_err() {
                return Err(io::Error::other("the blob's writer stopped"));
            }
            progress(read_so_far);
            if end {
                return Ok(());
            }
        })();
        drop(to_hasher);
        let hasher = hashing.join().map_err(|_| io::Error::other("a blob's hashing thread panicked"))?;
        writer.join().map_err(|_| io::Error::other("a blob's writing thread panicked"))??;
        read?;
        Ok(hasher.finish())
    })
}

#[cfg(test)]
mod tests {
    use std::io::Read;
    use std::sync::Arc;
    use std::sync::atomic::Ordering;
    use std::time::{Duration, Instant};

    use super::{
        ALIGN, Aligned, BUFFERS, DEPTH, DirectPace, HashStage, IdleClock, Left, PACE_WINDOW, PIPELINE_BATCH, Pipeline,
        SLOW_WINDOWS, WRITEBACK_STEP, WriteStage, Writeback, copy_hashed_aligned,
    };
    use crate::store::digest::{Digest, Hasher};

    /// A reader of `left` bytes, each a function of its position, at most 100 000 a read.
    struct Endless {
        at: u64,
        left: u64,
    }

    impl Read for Endless {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            let n = buf.len().min(usize::try_from(self.left).unwrap_or(usize::MAX)).min(100_000);
            for (i, b) in buf[..n].iter_mut().enumerate() {
                *b = ((self.at + i as u64).wrapping_mul(31) >> 3 & 0xff) as u8;
            }
            self.left -= n as u64;
            self.at += n as u64;
            Ok(n)
        }
    }

    /// A file written step by step has its write-back started from the first whole step on
    /// a thread of its own, and `finish` waits for it; one for a blob synced after the reply
    /// never starts one. The data stays as written either way.
    #[test]
    fn writeback_starts_at_the_first_step_and_only_where_asked() {
        let dir = tempfile::tempdir().expect("tempdir");
        let step = usize::try_from(WRITEBACK_STEP).expect("fits");
        for on in [true, false] {
            let path = dir.path().join(format!("written-{on}"));
            let file = std::fs::File::create(&path).expect("file");
            let mut writeback = Writeback::new_if(on, &file);
            let chunk: Vec<u8> = (0..step / 4).map(|i| i.to_le_bytes()[1]).collect();
            for i in 0..9 {
                std::os::unix::fs::FileExt::write_all_at(&file, &chunk, (i * chunk.len()) as u64).expect("write");
                writeback.wrote(chunk.len());
                assert_eq!(writeback.thread.is_some(), on && i >= 3, "on: {on}, after {} chunks", i + 1);
            }
            writeback.finish().expect("no write-back error");
            assert!(writeback.thread.is_none(), "finish waited for the thread");
            assert_eq!(std::fs::read(&path).expect("read"), chunk.repeat(9));
        }
    }

    /// Chunks of every size, across batch boundaries, come out written in order and
    /// hashed as the data, with at most `BUFFERS` batch buffers made.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_pipeline_writes_and_hashes_every_chunk_in_order_with_bounded_buffers() {
        let data: Vec<u8> =
            (0..3 * PIPELINE_BATCH + 12_345).map(|i| i.wrapping_mul(2_654_435_761).to_le_bytes()[1]).collect();
        let mut pipeline = Pipeline::start(
            (Vec::new(), 0usize),
            Arc::new(IdleClock::new()),
            |(out, batches): &mut (Vec<u8>, usize), batch: &[u8]| {
                assert!(batch.len() <= PIPELINE_BATCH, "a batch of {} bytes", batch.len());
                assert_eq!(batch.as_ptr().addr() % ALIGN, 0, "batches are aligned for direct I/O");
                out.extend_from_slice(batch);
                *batches += 1;
                Ok(())
            },
        );
        let mut at = 0;
        for size in [0, 1, 7, PIPELINE_BATCH - 8, PIPELINE_BATCH, 3, 400_000].into_iter().cycle() {
            let end = (at + size).min(data.len());
            assert!(pipeline.push(&data[at..end]).await);
            at = end;
            if at == data.len() {
                break;
            }
        }
        assert!(pipeline.buffers <= BUFFERS, "{} buffers", pipeline.buffers);
        let ((written, batches), hasher) = pipeline.finish().await.expect("finish");
        assert_eq!(written, data);
        assert_eq!(batches, 4);
        assert_eq!(hasher.finish(), (Digest::of(&data), data.len() as u64));
    }

    /// While the writer holds a batch, the hash waits to hand it the next ones, and that
    /// wait runs on the pipeline's clock (the one its writer's pace reads); once the writer
    /// goes on, every byte arrives and the clock stops.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_pipeline_clocks_the_hash_waiting_for_the_writer() {
        let (go, held) = std::sync::mpsc::channel::<()>();
        let mut held = Some(held);
        let clock = Arc::new(IdleClock::new());
        let mut pipeline = Pipeline::start(Vec::new(), Arc::clone(&clock), move |out: &mut Vec<u8>, batch: &[u8]| {
            if let Some(held) = held.take() {
                held.recv().map_err(std::io::Error::other)?;
            }
            out.extend_from_slice(batch);
            Ok(())
        });
        // The writer holds the first batch, `DEPTH` more wait for it, and the hash holds
        // the last one, waiting to hand it on.
        let chunk = vec![7u8; PIPELINE_BATCH];
        for _ in 0..DEPTH + 2 {
            assert!(pipeline.push(&chunk).await);
        }
        let waited = Duration::from_millis(50);
        let mut polls = 0;
        while Duration::from_nanos(clock.total()) < waited {
            polls += 1;
            assert!(polls < 10_000, "the hash's clock did not run while the writer was held");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        go.send(()).expect("the writer waits");
        let (written, hasher) = pipeline.finish().await.expect("finish");
        assert_eq!(written.len(), (DEPTH + 2) * PIPELINE_BATCH);
        assert_eq!(hasher.finish(), (Digest::of(&written), written.len() as u64));
        assert_eq!(clock.since.load(Ordering::Relaxed), 0, "a wait still counted after the pipeline finished");
        assert!(Duration::from_nanos(clock.total()) >= waited);
    }

    /// A batch of ten bytes of `byte`.
    fn ten(byte: u8) -> Aligned {
        let mut batch = Aligned::new();
        batch.extend(&[byte; 10]);
        batch
    }

    /// The hash keeps its thread while batches wait for it: one call hashes the batch it
    /// is given and every one queued, handing each to the writer while the writer has
    /// room; a batch that finds none goes back to the task, the ones after it stay queued.
    #[test]
    fn the_hash_stage_takes_every_waiting_batch_in_one_call() {
        let (to_hasher, unhashed) = tokio::sync::mpsc::channel(DEPTH + 2);
        let (to_writer, mut writes) = tokio::sync::mpsc::channel(DEPTH);
        let mut stage = HashStage { hasher: Hasher::default(), unhashed, to_writer };
        to_hasher.try_send(ten(2)).expect("room");
        assert!(matches!(stage.run(ten(1)), Left::Nothing));
        assert_eq!(stage.hasher.hashed(), 20, "the queued batch was hashed in the same call");
        // The writer's queue is full now.
        to_hasher.try_send(ten(4)).expect("room");
        let Left::ForTheWriter(left) = stage.run(ten(3)) else { panic!("the writer had no room") };
        assert_eq!(left.data(), [3; 10]);
        assert_eq!(stage.hasher.hashed(), 30, "the batch after the one left is not hashed yet");
        let handed: Vec<_> = [writes.try_recv(), writes.try_recv()].map(|b| b.expect("handed on").data()[0]).into();
        assert_eq!(handed, [1, 2]);
        drop(writes);
        let queued = stage.unhashed.try_recv().expect("still queued");
        assert!(matches!(stage.run(queued), Left::WriterGone));
        let mut all = Hasher::default();
        for byte in 1..=4 {
            all.update(&[byte; 10]);
        }
        assert_eq!(stage.hasher.finish(), all.finish());
    }

    /// The writer too writes every batch waiting for it in one call, giving each buffer
    /// back; a failed write stops it there, with the batches after it still queued.
    #[test]
    fn the_write_stage_takes_every_waiting_batch_in_one_call() {
        let (to_writer, writes) = tokio::sync::mpsc::channel(DEPTH);
        let (give_back, mut written) = tokio::sync::mpsc::unbounded_channel();
        let write = |out: &mut Vec<u8>, data: &[u8]| {
            if data[0] == 9 {
                return Err(std::io::Error::other("disk full"));
            }
            out.extend_from_slice(data);
            Ok(())
        };
        let mut stage = WriteStage { sink: Vec::new(), write, writes, give_back };
        to_writer.try_send(ten(2)).expect("room");
        to_writer.try_send(ten(3)).expect("room");
        stage.run(ten(1)).expect("written");
        assert_eq!(stage.sink, [[1; 10], [2; 10], [3; 10]].concat());
        assert_eq!((0..3).filter(|_| written.try_recv().is_ok()).count(), 3, "every buffer given back");
        to_writer.try_send(ten(5)).expect("room");
        let error = stage.run(ten(9)).expect_err("the write failed");
        assert_eq!(error.to_string(), "disk full");
        assert_eq!(stage.writes.try_recv().expect("still queued").data(), [5; 10]);
        assert_eq!(stage.sink.len(), 30);
    }

    /// A write that fails stops the pipeline: pushing says so, and the error comes back.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failed_write_stops_the_pipeline_and_is_reported() {
        let mut pipeline =
            Pipeline::start((), Arc::new(IdleClock::new()), |(), _: &[u8]| Err(std::io::Error::other("disk full")));
        let chunk = vec![1u8; PIPELINE_BATCH];
        let mut pushed = 0;
        while pipeline.push(&chunk).await {
            pushed += 1;
            assert!(pushed < 100, "the pipeline never noticed the failed write");
        }
        let Err(error) = pipeline.finish().await else { panic!("the write failed, finish did not say so") };
        assert_eq!(error.to_string(), "disk full");
    }

    /// A reader's bytes reach the writer whole, in order, in full aligned buffers (the
    /// last one shorter), at most `BUFFERS` of them reused; the hash and the progress are
    /// of every byte read.
    #[test]
    fn a_reader_is_copied_whole_in_aligned_recycled_buffers_and_hashed() {
        let len = (3 * PIPELINE_BATCH + 12_345) as u64;
        // Reads of at most 100 000 bytes: a batch is filled by many.
        let reader = Endless { at: 0, left: len };
        let expected: Vec<u8> = (0..len).map(|i| (i.wrapping_mul(31) >> 3 & 0xff) as u8).collect();
        let (mut out, mut addresses, mut sizes) = (Vec::new(), std::collections::HashSet::new(), Vec::new());
        let mut progress = Vec::new();
        let (digest, len) = copy_hashed_aligned(
            reader,
            |batch| {
                assert_eq!(batch.as_ptr().addr() % ALIGN, 0, "aligned for direct I/O");
                addresses.insert(batch.as_ptr().addr());
                sizes.push(batch.len());
                out.extend_from_slice(batch);
                Ok(())
            },
            |done| progress.push(done),
            &IdleClock::new(),
        )
        .expect("copied");
        assert_eq!((digest, len), (Digest::of(&expected), expected.len() as u64));
        assert!(out == expected, "every byte, in order");
        assert_eq!(sizes, [PIPELINE_BATCH, PIPELINE_BATCH, PIPELINE_BATCH, 12_345]);
        assert!(addresses.len() <= BUFFERS, "{} buffers", addresses.len());
        assert!(progress.is_sorted() && progress.last() == Some(&len), "{progress:?}");
    }

    /// The hash's waits to hand a batch to a writer that holds the one before run on the
    /// copy's clock (the one an import's pace reads): here the writer holds its first batch
    /// until that clock shows the hash has waited 50 ms for it, and never sees it if the
    /// clock stands still.
    #[test]
    fn a_copy_clocks_the_hash_waiting_for_the_writer() {
        let len = (2 * DEPTH + 3) * PIPELINE_BATCH;
        let reader = Endless { at: 0, left: len as u64 };
        let clock = IdleClock::new();
        let (mut held, mut written) = (true, 0);
        let (_, copied) = copy_hashed_aligned(
            reader,
            |batch| {
                let mut polls = 0;
                while held && Duration::from_nanos(clock.total()) < Duration::from_millis(50) {
                    polls += 1;
                    if polls > 10_000 {
                        return Err(std::io::Error::other("the hash's clock did not run while the writer held"));
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
                (held, written) = (false, written + batch.len());
                Ok(())
            },
            |_| {},
            &clock,
        )
        .expect("copied");
        assert_eq!((copied, written), (len as u64, len));
        assert_eq!(clock.since.load(Ordering::Relaxed), 0, "a wait still counted after the copy");
    }

    /// A failed write stops the reading, and its error is the one returned.
    #[test]
    fn a_failed_write_stops_the_copy_and_is_reported() {
        let reader = Endless { at: 0, left: 1 << 40 };
        let mut reads = 0;
        let error =
            copy_hashed_aligned(reader, |_| Err(std::io::Error::other("disk full")), |_| reads += 1, &IdleClock::new())
                .expect_err("the write failed");
        assert_eq!(error.to_string(), "disk full");
        // Every buffer filled, and one more read whose batch found the hasher gone.
        assert!(reads <= BUFFERS + 1, "the reading went on: {reads} batches");
    }

    /// Direct writes count as the slower part only after whole windows in a row in which
    /// they took at least nine tenths of the time; a window under it starts the count again.
    #[test]
    fn direct_writes_are_the_slower_part_when_they_fill_nine_tenths_of_windows_in_a_row() {
        let writes = usize::try_from(PACE_WINDOW).expect("fits") / PIPELINE_BATCH;
        let ms = Duration::from_millis;
        // `writes` writes of `busy` ms, one every 10 ms, from `start`: what each returns.
        let window = |pace: &mut DirectPace, start: Instant, busy: u64| -> Vec<bool> {
            (0..writes as u64)
                .map(|i| {
                    let began = start + ms(10 * i);
                    pace.wrote(began, began + ms(busy), PIPELINE_BATCH, None)
                })
                .collect()
        };
        let at = Instant::now();
        let mut pace = DirectPace::default();
        let judged = |last: bool| [vec![false; writes - 1], vec![last]].concat();
        let mut starts = (0..).map(|n| at + ms(1000 * n));
        let mut next = || starts.next().expect("endless");
        let slow_in_a_row = u64::from(SLOW_WINDOWS);
        // 144 ms of writes in 159 ms is slow; the last of `SLOW_WINDOWS` such windows in a
        // row makes the disk the slower part, judged at its end.
        for n in 1..slow_in_a_row {
            assert_eq!(window(&mut pace, next(), 9), judged(false), "window {n}");
        }
        assert_eq!(window(&mut pace, next(), 9), judged(true));
        // And each slow window after it.
        assert_eq!(window(&mut pace, next(), 10), judged(true));
        // 128 ms in 158 ms is not slow, and starts the count again; so does a third of the time.
        assert_eq!(window(&mut pace, next(), 8), judged(false));
        for n in 1..slow_in_a_row {
            assert_eq!(window(&mut pace, next(), 9), judged(false), "window {n} after a quick one");
        }
        assert_eq!(window(&mut pace, next(), 3), judged(false));
        for n in 1..slow_in_a_row {
            assert_eq!(window(&mut pace, next(), 9), judged(false), "window {n} after another");
        }
        assert_eq!(window(&mut pace, next(), 9), judged(true));
        // A window less than full judges nothing, however slow its writes.
        let whole = usize::try_from(PACE_WINDOW).expect("fits");
        let mut pace = DirectPace::default();
        let first = next();
        assert!(!pace.wrote(first, first + ms(1000), whole - 1, None));
        // Bytes of any size count: one write of a whole window, all busy, closes it.
        let (from, to) = (next(), next());
        assert!(!pace.wrote(from, to, 1, None), "closes the first window");
        for _ in 2..slow_in_a_row {
            let (from, to) = (next(), next());
            assert!(!pace.wrote(from, to, whole, None));
        }
        let (from, to) = (next(), next());
        assert!(pace.wrote(from, to, whole, None));
        // Writes that take no time never count as slow.
        let mut pace = DirectPace::default();
        assert!((0..2 * slow_in_a_row).all(|_| {
            let at = next();
            !pace.wrote(at, at, whole, None)
        }));
    }

    /// With a stage after the writer, a window of busy direct writes counts as slow only
    /// when that stage waited for the writer a fifth of it or more: a writer busy all the
    /// time while the hash after it never waits is not what holds the transfer back.
    #[test]
    fn busy_direct_writes_are_the_slower_part_only_while_the_stage_after_them_waits() {
        let whole = usize::try_from(PACE_WINDOW).expect("fits");
        let ms = Duration::from_millis;
        let mut at = Instant::now();
        // One window: a write of all of it, busy for 100 ms, the next stage waiting `waited` ms.
        let mut window = |pace: &mut DirectPace, waited: u64| {
            at += ms(1000);
            pace.wrote(at, at + ms(100), whole, Some(ms(waited)))
        };
        for (waited, slow) in [(0, false), (19, false), (21, true), (100, true)] {
            let mut pace = DirectPace::default();
            let judged: Vec<bool> = (0..SLOW_WINDOWS).map(|_| window(&mut pace, waited)).collect();
            assert_eq!(judged.last(), Some(&slow), "the next stage waited {waited} ms of 100");
        }
        // A window in which the next stage did not wait starts the count again.
        let mut pace = DirectPace::default();
        for _ in 1..SLOW_WINDOWS {
            assert!(!window(&mut pace, 50));
        }
        assert!(!window(&mut pace, 5), "the hash kept busy");
        for _ in 1..SLOW_WINDOWS {
            assert!(!window(&mut pace, 50));
        }
        assert!(window(&mut pace, 50));
    }

    /// `time` reads the next stage's clock over each window: a stage that waits through
    /// the writes makes slow writes the slower part, one that never waits does not.
    #[test]
    fn timed_writes_read_the_waits_of_the_stage_after_them() {
        let whole = usize::try_from(PACE_WINDOW).expect("fits");
        for waiting in [true, false] {
            let clock = Arc::new(IdleClock::new());
            let mut pace = DirectPace::default();
            pace.beside(Arc::clone(&clock));
            let judged: Vec<bool> = (0..SLOW_WINDOWS)
                .map(|_| {
                    let slow_write = || {
                        std::thread::sleep(Duration::from_millis(20));
                        Ok(())
                    };
                    // The next stage waits for the whole write, or not at all.
                    let write = || if waiting { clock.around(slow_write) } else { slow_write() };
                    pace.time(whole, write).expect("written")
                })
                .collect();
            assert_eq!(judged.last(), Some(&waiting), "the next stage waiting: {waiting}");
        }
    }
}
