//! Where a download's data lands: each part fills aligned batch buffers as the data arrives
//! (copied from the HTTP client's pieces, or read straight into them by `plain_http`'s
//! blocking reads), one writer thread writes each batch to the partial file, and one hash thread
//! then moves the blob's hash on (see [`Partial::hash_written`]) and gives the buffer back.
//!
//! Three stages on their own threads, because on a pull every one of them is a large cost
//! and they overlap: receiving (the copy out of the socket), writing (with direct I/O a
//! wait on the disk, no CPU), hashing (SHA-256, the most CPU of all). With the hash beside
//! the receiving, as before, a pull of 1 GiB from a local registry took 1.2–1.4 s here; in
//! stages 0.8–1.05 s, against 0.66–0.72 s for `curl` writing the same blob to a file
//! without hashing or syncing it (`docs/benchmarks.md`). A batch is hashed after it is
//! written, so the hash never covers data the file does not hold.
//!
//! The buffers are few and reused (a semaphore counts them): memory stays bounded, and a
//! reused buffer costs no page faults. The two threads' waits tell the download whether
//! its data arrives slower than it can be written and hashed
//! ([`Landing::take_idle_share`]), which is when more parts at once help: not when the
//! CPU (the hash busy) or the disk (the writer busy) is the limit.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, watch};

use super::partial::Partial;
use super::{BlobStatus, RegistryError, joined};
use crate::store::stream::{ALIGN, Aligned, IdleClock, PIPELINE_BATCH};
use crate::sync::lock;

/// A buffer being filled for `offset`, or on its way through the stages.
struct Slot {
    offset: u64,
    buffer: Aligned,
    /// Counts the buffer as in use until it is back in the pool.
    _permit: OwnedSemaphorePermit,
}

impl Slot {
    /// How much more this batch takes: it ends on a block boundary of the file, so that
    /// every batch after a part's first is written with direct I/O.
    fn room(&self) -> usize {
        room(self.offset, self.buffer.len())
    }

    fn len(&self) -> usize {
        self.buffer.len()
    }

    fn is_empty(&self) -> bool {
        self.buffer.is_empty()
    }
}

/// A part's batch being filled: copied into from an async body ([`Filling::push`]), or read
/// into straight from a socket ([`Filling::room`]).
pub(super) struct Filling {
    feed: Feed,
    slot: Option<Slot>,
}

impl Filling {
    pub(super) fn new(feed: Feed) -> Self {
        Self { feed, slot: None }
    }

    /// Copies `data`, which belongs at `*at` plus what is being filled, into batches,
    /// handing each full one on (`*at` moves past it); `false` once the writing stopped.
    pub(super) async fn push(&mut self, mut data: &[u8], at: &mut u64) -> bool {
        while !data.is_empty() {
            self.ready(*at).await;
            let room = self.room().expect("a batch is being filled");
            let (now, later) = data.split_at(data.len().min(room.len()));
            room[..now.len()].copy_from_slice(now);
            data = later;
            if !self.filled(now.len(), at) {
                return false;
            }
        }
        true
    }

    /// Takes a buffer for the data at `at` unless one is being filled, once one is free.
    pub(super) async fn ready(&mut self, at: u64) {
        if self.slot.is_none() {
            self.slot = Some(self.feed.slot(at).await);
        }
    }

    /// The free room of the batch being filled ([`Filling::ready`]), to read into; data read
    /// into it counts once [`Filling::filled`] says so. `None` when no batch is being filled.
    pub(super) fn room(&mut self) -> Option<&mut [u8]> {
        let slot = self.slot.as_mut()?;
        let room = slot.room();
        Some(&mut slot.buffer.spare()[..room])
    }

    /// Counts `n` bytes read into [`Filling::room`], handing the batch on once full
    /// (`*at` moves past it); `false` once the writing stopped.
    pub(super) fn filled(&mut self, n: usize, at: &mut u64) -> bool {
        let Some(slot) = &mut self.slot else { return n == 0 };
        slot.buffer.filled(n);
        slot.room() > 0 || self.hand_on(at)
    }

    /// Hands on the batch being filled, if it holds anything (`*at` moves past it);
    /// `false` if the writing stopped.
    pub(super) fn hand_on(&mut self, at: &mut u64) -> bool {
        let Some(slot) = self.slot.take().filter(|slot| !slot.is_empty()) else { return true };
        let len = slot.len() as u64;
        if self.feed.to_writer.send(slot).is_err() {
            return false;
        }
        *at += len;
        true
    }
}

/// What a part needs to hand batches to a [`Landing`]: its buffers and its writer. The
/// writer runs until every feed and the landing itself are gone.
#[derive(Clone)]
pub(super) struct Feed {
    to_writer: mpsc::UnboundedSender<Slot>,
    permits: Arc<Semaphore>,
    pool: Arc<Mutex<Vec<Aligned>>>,
}

impl Feed {
    /// An empty buffer for the data at `offset`, once one is free.
    async fn slot(&self, offset: u64) -> Slot {
        let permit = Arc::clone(&self.permits).acquire_owned().await.expect("the semaphore is never closed");
        // Not `Aligned::default()`: that one has no room and no alignment.
        let reused = lock(&self.pool).pop();
        let buffer = match reused {
            Some(buffer) => buffer,
            None => Aligned::new(),
        };
        Slot { offset, buffer, _permit: permit }
    }
}

/// How much more a batch for the data at `offset` takes when it holds `filled` bytes: up
/// to [`PIPELINE_BATCH`] bytes, ending on a block boundary of the file.
fn room(offset: u64, filled: usize) -> usize {
    let head = usize::try_from(offset % ALIGN as u64).unwrap_or(0);
    PIPELINE_BATCH - head - filled
}

/// The writer and hash threads of one download, and its buffers.
pub(super) struct Landing {
    feed: Feed,
    writer: tokio::task::JoinHandle<Result<(), RegistryError>>,
    hasher: tokio::task::JoinHandle<Result<(), RegistryError>>,
    /// How long the writer and the hash thread waited for batches.
    idle: [Arc<IdleClock>; 2],
    /// When [`Landing::take_idle_share`] last looked, and each thread's idle time then.
    last_look: Mutex<(Instant, [u64; 2])>,
}

impl Landing {
    /// Starts the threads for `partial`, with at most `buffers` batch buffers at once.
    pub(super) fn start(partial: &Arc<Partial>, sender: &Arc<watch::Sender<BlobStatus>>, buffers: usize) -> Self {
        let (to_writer, mut to_write) = mpsc::unbounded_channel::<Slot>();
        let (to_hasher, mut to_hash) = mpsc::unbounded_channel::<Slot>();
        let pool: Arc<Mutex<Vec<Aligned>>> = Arc::default();
        let idle = [Arc::new(IdleClock::new()), Arc::new(IdleClock::new())];
        // The disk is the slower part only while the hash waits for it.
        partial.pace_beside(Arc::clone(&idle[1]));
        let (target, sender, waited) = (Arc::clone(partial), Arc::clone(sender), Arc::clone(&idle[0]));
        let writer = tokio::task::spawn_blocking(move || {
            while let Some(slot) = waited.around(|| to_write.blocking_recv()) {
                let completed = target.write_at(slot.offset, slot.buffer.data())?;
                target.report(&sender, completed);
                if to_hasher.send(slot).is_err() {
                    break;
                }
            }
            Ok(())
        });
        let (target, returned, waited) = (Arc::clone(partial), Arc::clone(&pool), Arc::clone(&idle[1]));
        let hasher = tokio::task::spawn_blocking(move || {
            while let Some(Slot { offset, mut buffer, _permit }) = waited.around(|| to_hash.blocking_recv()) {
                target.hash_written(offset, buffer.data())?;
                buffer.clear();
                lock(&returned).push(buffer);
            }
            Ok(())
        });
        Self {
            feed: Feed { to_writer, permits: Arc::new(Semaphore::new(buffers.max(2))), pool },
            writer,
            hasher,
            idle,
            last_look: Mutex::new((Instant::now(), [0, 0])),
        }
    }

    /// A feed for one more part.
    pub(super) fn feed(&self) -> Feed {
        self.feed.clone()
    }

    /// Allows one more buffer, for one more part at once.
    pub(super) fn widen(&self) {
        self.feed.permits.add_permits(1);
    }

    /// The share of the time since the last call that both threads waited for data: the
    /// smaller of the writer's and the hash thread's.
    pub(super) fn take_idle_share(&self) -> f64 {
        let (now, idle) = (Instant::now(), [self.idle[0].total(), self.idle[1].total()]);
        let (then, idle_then) = std::mem::replace(&mut *lock(&self.last_look), (now, idle));
        let elapsed = now.duration_since(then).as_secs_f64();
        if elapsed == 0.0 {
            return 0.0;
        }
        let share = |i: usize| Duration::from_nanos(idle[i].saturating_sub(idle_then[i])).as_secs_f64() / elapsed;
        share(0).min(share(1))
    }

    /// Waits until every buffer handed on is written and hashed (and every [`Feed`] is gone:
    /// the parts have stopped).
    ///
    /// # Errors
    /// The first write or read-back that failed.
    pub(super) async fn finish(self) -> Result<(), RegistryError> {
        let Self { feed, writer, hasher, .. } = self;
        drop(feed);
        let written = joined(writer.await);
        let hashed = joined(hasher.await);
        written.and(hashed)
    }
}

#[cfg(test)]
mod tests {
    use super::{ALIGN, PIPELINE_BATCH, room};

    #[test]
    fn batches_end_on_block_boundaries() {
        assert_eq!(room(0, 0), PIPELINE_BATCH);
        assert_eq!(room(64 << 20, 1000), PIPELINE_BATCH - 1000);
        // A part resumed mid-block: its first batch ends where the next block starts, and
        // every batch after it starts on a block boundary.
        for offset in [1u64, 30_000, (64 << 20) + 4095] {
            let end = offset + room(offset, 0) as u64;
            assert_eq!(end % ALIGN as u64, 0, "{offset}");
            assert!(end - offset <= PIPELINE_BATCH as u64 && end - offset > (PIPELINE_BATCH - ALIGN) as u64);
        }
    }
}
