//! A partial download on disk: the data file, the record of what is in it, and the check
//! of the whole blob against its digest before it is put in place.
//!
//! Next to the partial data file, `blobs/sha256-<hex>-partial.json` records which byte ranges
//! of it are written. It is replaced atomically (a `.tmp-` file renamed over it), after the
//! data file is synced, about once a second while a download runs and whenever one stops
//! (an error, or every waiter gone). A later pull of the same blob, in this process or after
//! a restart, fetches only the ranges the record does not cover; within a pull, a part whose
//! transfer breaks off is retried from the first byte that did not arrive. A record that does
//! not match the blob (another size, a missing data file) is ignored and the download starts
//! over. Neither name starts with `.tmp-`, so [`Store::open`] keeps them. The data file grows
//! as data arrives: nothing is reserved from the size the registry announced. Partial files
//! of blobs that nobody pulls any more are removed by garbage collection
//! ([`crate::store::gc`]) once they are older than its grace age; a running download pins its
//! blob, so a collection never touches its files. A link planted in place of either file is
//! refused.
//!
//! The blob is hashed as its data arrives ([`super::landing`]): a batch written where the
//! hash has got to is hashed from memory, right after its write. Data written ahead of that
//! point (by a later part, or an earlier download) is read back once the hash reaches it;
//! with one part at a time, nothing is read back.
//!
//! Whole blocks at block-aligned offsets are written with direct I/O (`O_DIRECT`, through a
//! second descriptor of the same file, where the file system has it): from the batch's
//! memory straight to the disk, no copy into the page cache and no write-back after it.
//! The rest (a blob's last bytes, a part resumed mid-block) goes through the page cache.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use crate::sync::lock;

use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use super::error::is_disk_full;
use super::{BlobStatus, RegistryError};
use crate::store::beneath::{self, Dir};
use crate::store::digest::{Digest, Hasher};
use crate::store::manifest::Layer;
use crate::store::progress::Throttle;
use crate::store::stream::{ALIGN, BATCH, DirectPace, IdleClock, Writeback};
use crate::store::{Pin, Store, StoreError};

/// Byte ranges `[start, end)`, disjoint and not touching, by start: each insert and
/// lookup costs the log of their number (a planted record of tens of thousands of ranges
/// is filled gap by gap, each gap's bytes inserted as they land).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Ranges(BTreeMap<u64, u64>);

impl Ranges {
    fn insert(&mut self, start: u64, end: u64) {
        if start >= end {
            return;
        }
        let (mut start, mut end) = (start, end);
        // The range before that reaches `start`, and those after that `end` reaches, join.
        if let Some((&s, &e)) = self.0.range(..=start).next_back().filter(|&(_, &e)| e >= start) {
            start = s;
            end = end.max(e);
        }
        while let Some((&s, &e)) = self.0.range(start..).next().filter(|&(&s, _)| s <= end) {
            end = end.max(e);
            self.0.remove(&s);
        }
        self.0.insert(start, end);
    }

    /// From a record on disk: clamped to `size` (a record holds up to `MAX_RECORD_BYTES`
    /// of ranges, in whatever order its writer chose).
    fn from_record(ranges: &[(u64, u64)], size: u64) -> Self {
        let mut out = Self::default();
        for &(s, e) in ranges {
            out.insert(s.min(size), e.min(size));
        }
        out
    }

    /// The ranges in order, as a record keeps them.
    fn list(&self) -> Vec<(u64, u64)> {
        self.0.iter().map(|(&s, &e)| (s, e)).collect()
    }

    /// The end of the range that holds `at`, or `at` when none does.
    fn end_from(&self, at: u64) -> u64 {
        self.0.range(..=at).next_back().filter(|&(_, &e)| at < e).map_or(at, |(_, &e)| e)
    }

    fn covered(&self) -> u64 {
        self.0.iter().map(|(s, e)| e - s).sum()
    }

    fn missing(&self, size: u64) -> Vec<(u64, u64)> {
        let mut gaps = Vec::new();
        let mut at = 0;
        for (&s, &e) in &self.0 {
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
    /// The boot whose page cache holds those ranges, when they were not synced before the
    /// record was written (blobs synced after the reply): only that boot resumes from it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    unsynced_boot: Option<String>,
}

/// A blob being downloaded: its data file and the record of what is in it.
#[derive(Debug)]
pub(super) struct Partial {
    store: Store,
    pub(super) digest: Digest,
    pub(super) size: u64,
    registry: String,
    pub(super) what: String,
    /// `blobs/`, opened once: the files below are reached without following links.
    blobs: Dir,
    data_name: String,
    record_name: String,
    /// For messages.
    data_path: PathBuf,
    file: File,
    /// The same file opened for direct I/O, where the file system allows it.
    direct: Option<File>,
    /// Whether writes go direct: cleared when the device refuses a direct write's alignment
    /// (blocks over `ALIGN`), or once the disk turns out to be the slower part ([`DirectPace`]).
    direct_now: AtomicBool,
    /// Whether the direct writes keep up with the data.
    pace: Mutex<DirectPace>,
    done: Mutex<Ranges>,
    /// The hash of the data file's first bytes, as far as it has got.
    hashed: Mutex<Frontier>,
    writeback: Mutex<Writeback>,
    dirty: AtomicBool,
    reported: Mutex<Throttle>,
    /// Serializes the record's writes with the end of the download, and is set at the end
    /// (put in place, or removed): a checkpoint still running then must not write a record.
    finished: Mutex<bool>,
    /// Keeps garbage collection away from the partial files while the download runs; let
    /// go when they become the blob.
    pin: Mutex<Option<Pin>>,
}

/// The hash of a blob's first `at` bytes.
#[derive(Default)]
struct Frontier {
    hasher: Hasher,
    at: u64,
    /// What is written and will not come to [`Partial::hash_written`] (again): what an
    /// earlier download left, and every batch that came. Only this is read back: a batch
    /// written but still on its way to the hash is hashed from memory when it comes.
    passed: Ranges,
}

impl Frontier {
    /// Hashes `data`, the bytes at the frontier.
    fn take(&mut self, data: &[u8]) {
        self.hasher.update(data);
        self.at += data.len() as u64;
    }
}

impl std::fmt::Debug for Frontier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Frontier").field("at", &self.at).finish_non_exhaustive()
    }
}

/// The most a partial download's record may weigh; real ones are a few hundred bytes.
const MAX_RECORD_BYTES: u64 = 1 << 20;

impl Partial {
    /// Opens the partial download of `layer`, resuming what a record describes, or starts
    /// one. The data file grows as data arrives: nothing is reserved from the size the
    /// registry announced, so a download that fails holds only what arrived.
    pub(super) fn open(store: Store, layer: &Layer, registry: String, what: String) -> Result<Self, RegistryError> {
        // Pinned before any file is touched, so that a collection never races this download.
        let pin = store.pin([layer.digest]);
        let blobs = store.blobs()?;
        let data_name = format!("{}-partial", layer.digest.file_name());
        let record_name = format!("{}-partial.json", layer.digest.file_name());
        let data_path = store.blobs_dir().join(&data_name);
        let resumed = Self::resumable(&blobs, &data_name, &record_name, layer, store.boot_id())?;
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
        let direct = if store.direct_io() { open_direct(&file) } else { None };
        let done_before = done.clone();
        Ok(Self {
            digest: layer.digest,
            size: layer.size,
            registry,
            what,
            blobs,
            data_name,
            record_name,
            data_path,
            writeback: Mutex::new(Writeback::new_if(store.syncs_before_reply(), &file)),
            file,
            direct_now: AtomicBool::new(direct.is_some()),
            direct,
            pace: Mutex::default(),
            done: Mutex::new(done),
            hashed: Mutex::new(Frontier { passed: done_before, ..Frontier::default() }),
            dirty: AtomicBool::new(false),
            reported: Mutex::default(),
            finished: Mutex::new(false),
            store,
            pin: Mutex::new(Some(pin)),
        })
    }

    /// The data file and the ranges a valid record describes, if there are both, and the
    /// ranges are on the disk or in this boot's page cache (`boot_id`). A link in place of
    /// either is refused.
    fn resumable(
        blobs: &Dir,
        data_name: &str,
        record_name: &str,
        layer: &Layer,
        boot_id: Option<&str>,
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
        // Written after a boot that did not sync the data: the machine stopped since, so
        // the data file may hold less than the record says.
        if record.unsynced_boot.is_some_and(|boot| boot_id != Some(boot.as_str())) {
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
        if meta.len() > layer.size
            || done.0.last_key_value().is_some_and(|(_, &end)| end > meta.len())
            || meta.nlink() != 1
        {
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

    pub(super) fn completed(&self) -> u64 {
        lock(&self.done).covered()
    }

    pub(super) fn missing(&self) -> Vec<(u64, u64)> {
        lock(&self.done).missing(self.size)
    }

    /// Writes `data` at `offset` and records it: with direct I/O when it is whole blocks
    /// at a block's start, from memory aligned for it. Returns how much of the blob is now
    /// in place.
    pub(super) fn write_at(&self, offset: u64, data: &[u8]) -> Result<u64, RegistryError> {
        let fail = |e| Self::write_error(&self.data_path, &self.what, self.size, e);
        if !self.write_direct(offset, data).map_err(fail)? {
            self.file.write_all_at(data, offset).map_err(fail)?;
            lock(&self.writeback).wrote(data.len());
        }
        let mut done = lock(&self.done);
        done.insert(offset, offset + data.len() as u64);
        self.dirty.store(true, Ordering::SeqCst);
        Ok(done.covered())
    }

    /// Judges the disk's pace by the waits of `hash` too, the thread that takes each
    /// batch from the writer ([`DirectPace::beside`]).
    pub(super) fn pace_beside(&self, hash: Arc<IdleClock>) {
        lock(&self.pace).beside(hash);
    }

    /// Writes `data` at `offset` with direct I/O if it is whole blocks at a block's start,
    /// from memory aligned for it: `false` if it is not, or if the device refused it for
    /// its alignment (then every later write goes through the page cache; this one is
    /// positional, so writing it again writes it all). Once the disk turns out to be the
    /// slower part ([`DirectPace`]), later writes go through the page cache too.
    fn write_direct(&self, offset: u64, data: &[u8]) -> io::Result<bool> {
        self.write_direct_with(offset, data, FileExt::write_all_at)
    }

    /// [`Partial::write_direct`], the direct write done by `direct_write` (file, data,
    /// offset): tests make it as slow as a slow disk.
    fn write_direct_with(
        &self,
        offset: u64,
        data: &[u8],
        direct_write: impl FnOnce(&File, &[u8], u64) -> io::Result<()>,
    ) -> io::Result<bool> {
        let Some(direct) = self.direct.as_ref().filter(|_| self.direct_now.load(Ordering::Relaxed)) else {
            return Ok(false);
        };
        if offset % ALIGN as u64 != 0 || data.len() % ALIGN != 0 || data.as_ptr().align_offset(ALIGN) != 0 {
            return Ok(false);
        }
        // Only the download's writer thread writes: the lock is never waited for.
        match lock(&self.pace).time(data.len(), || direct_write(direct, data, offset)) {
            Ok(slower) => {
                if slower {
                    tracing::debug!(blob = %self.digest, "the disk is the slower part: the rest goes through the page cache");
                    self.direct_now.store(false, Ordering::Relaxed);
                }
                Ok(true)
            }
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                self.direct_now.store(false, Ordering::Relaxed);
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }

    /// Moves the hash on past `data`, just written at `offset`: reads back what passed
    /// before it if the hash has not got there yet, hashes `data` from memory if the hash
    /// is then at `offset`, and reads back what passed after it. What cannot be hashed yet
    /// (a gap not written yet) is hashed by a later call, at the latest by [`Partial::commit`].
    pub(super) fn hash_written(&self, offset: u64, data: &[u8]) -> Result<(), RegistryError> {
        let mut hashed = lock(&self.hashed);
        hashed.passed.insert(offset, offset + data.len() as u64);
        if hashed.at < offset && hashed.passed.end_from(hashed.at) >= offset {
            self.read_back(&mut hashed, offset)?;
        }
        if hashed.at == offset {
            hashed.take(data);
        }
        let passed = hashed.passed.end_from(hashed.at);
        self.read_back(&mut hashed, passed)
    }

    /// Moves the hash on to `end` with the data file's bytes.
    fn read_back(&self, hashed: &mut Frontier, end: u64) -> Result<(), RegistryError> {
        // Called after every batch, with nothing to read back when the parts come in order.
        if hashed.at >= end {
            return Ok(());
        }
        let mut buffer = vec![0u8; BATCH];
        while hashed.at < end {
            let want = usize::try_from(end - hashed.at).unwrap_or(BATCH).min(BATCH);
            let n = self
                .file
                .read_at(&mut buffer[..want], hashed.at)
                .map_err(|e| RegistryError::io(format!("cannot read {}", self.data_path.display()), e))?;
            if n == 0 {
                return Err(RegistryError::io(
                    format!("cannot read {}", self.data_path.display()),
                    io::Error::from(io::ErrorKind::UnexpectedEof),
                ));
            }
            hashed.hasher.update(&buffer[..n]);
            hashed.at += n as u64;
        }
        Ok(())
    }

    /// Tells the waiting pulls how far the download is, as often as its [`Throttle`] lets it.
    pub(super) fn report(&self, sender: &watch::Sender<BlobStatus>, completed: u64) {
        if lock(&self.reported).due(completed, self.size) {
            sender.send_modify(|status| status.completed = status.completed.max(completed));
        }
    }

    /// Records on disk which ranges are written, the record replaced atomically. Where
    /// blobs are synced before the reply, the data is synced first and then the record, so
    /// it never claims data that a crash could lose. Where they are synced after, neither
    /// is (a sync would make the download wait for the disk): the record names this boot,
    /// and a later boot does not resume from it.
    pub(super) fn checkpoint(&self) -> Result<(), RegistryError> {
        let finished = lock(&self.finished);
        if *finished || !self.dirty.swap(false, Ordering::SeqCst) {
            return Ok(());
        }
        let done = lock(&self.done).clone();
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
        let synced = self.store.syncs_before_reply();
        if synced {
            self.file.sync_data().map_err(fail)?;
        }
        let unsynced_boot = if synced { None } else { self.store.boot_id().map(str::to_owned) };
        let record = Record { digest: self.digest, size: self.size, done: done.list(), unsynced_boot };
        let mut temp = self.store.temp_in(&self.blobs)?;
        let json = serde_json::to_vec(&record).expect("a record always serializes");
        temp.write_all(&json).map_err(fail)?;
        if synced {
            temp.as_file().sync_all().map_err(fail)?;
        }
        temp.place(&self.blobs, &self.record_name)?;
        Ok(())
    }

    /// Checks the whole blob against its digest and, if it matches, puts it in place, while
    /// a pull pins it (else [`RegistryError::Interrupted`], the data kept for a resume).
    pub(super) fn commit(&self) -> Result<(), RegistryError> {
        let completed = self.completed();
        if completed != self.size {
            return Err(RegistryError::Protocol {
                registry: self.registry.clone(),
                detail: format!("{}: only {completed} of {} bytes arrived", self.what, self.size),
            });
        }
        // What the hash has not reached yet is read back through the file this download
        // wrote, not by its name.
        let mut hashed = lock(&self.hashed);
        self.read_back(&mut hashed, self.size)?;
        let (actual, _) = std::mem::take(&mut hashed.hasher).finish();
        drop(hashed);
        if actual != self.digest {
            return Err(RegistryError::DigestMismatch { registry: self.registry.clone(), digest: self.digest, actual });
        }
        let mut finished = lock(&self.finished);
        self.store.name_new_blob(&self.digest, &self.blobs, |sync_first| {
            if sync_first {
                let sync_error = |e| Self::write_error(&self.data_path, &self.what, self.size, e);
                lock(&self.writeback).finish().map_err(sync_error)?;
                self.file.sync_all().map_err(sync_error)?;
            }
            // Only for a pull still waiting (each pins its blobs): one given up has taken back
            // what it placed, and the data stays here, complete, for the next pull to check.
            let named = self.store.name_if_wanted(&mut lock(&self.pin), &self.digest, || {
                *finished = true;
                self.blobs.rename(&self.data_name, &self.blobs, &self.digest.file_name()).map_err(|e| {
                    let place = self.store.blob_path(&self.digest);
                    RegistryError::io(format!("cannot move the download into place as {}", place.display()), e)
                })?;
                let _ = self.blobs.remove_file(&self.record_name);
                Ok(())
            });
            named.unwrap_or(Err(RegistryError::Interrupted { digest: self.digest }))
        })
    }

    /// Deletes the data file and the record (or links of those names: never what they point to).
    pub(super) fn remove(&self) {
        let mut finished = lock(&self.finished);
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

/// `file` opened again for direct I/O, through `/proc/self/fd` (the same file, whatever its
/// name is now), or `None` where the file system refuses direct I/O.
fn open_direct(file: &File) -> Option<File> {
    use rustix::fs::{Mode, OFlags};
    use std::os::fd::AsRawFd;
    let path = format!("/proc/self/fd/{}", file.as_raw_fd());
    rustix::fs::open(path, OFlags::WRONLY | OFlags::DIRECT | OFlags::CLOEXEC, Mode::empty()).ok().map(File::from)
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

#[cfg(test)]
mod tests {
    use super::{Partial, Ranges};
    use crate::store::Store;
    use crate::store::digest::Digest;
    use crate::store::manifest::Layer;

    /// A pull's download writes whole blocks with direct I/O (on the temporary
    /// directory's file system, which has it) unless `[store] direct_io` is off.
    #[test]
    fn a_download_writes_directly_unless_the_store_is_set_without() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::open(dir.path()).expect("store");
        for (store, seed, direct) in [(store.clone(), "on", true), (store.with_direct_io(false), "off", false)] {
            let layer =
                Layer { media_type: "x".into(), digest: Digest::of(seed.as_bytes()), size: 1 << 20, from: None };
            let partial = Partial::open(store, &layer, "registry.example".into(), seed.into()).expect("partial");
            assert_eq!(partial.direct.is_some(), direct, "direct_io {seed}");
        }
    }

    /// A download's direct writes that keep its writer busy for a whole window (a disk
    /// slower than the data, made here by a direct write that takes its time) send the
    /// rest through the page cache; writes that leave the writer waiting stay direct.
    #[test]
    fn a_download_whose_disk_is_the_slower_part_writes_the_rest_through_the_page_cache() {
        use std::os::unix::fs::FileExt;
        use std::sync::atomic::Ordering;
        use std::time::Duration;

        use crate::store::stream::{Aligned, PACE_WINDOW, PIPELINE_BATCH, SLOW_WINDOWS};

        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::open(dir.path()).expect("store");
        let mut batch = Aligned::new();
        batch.spare().fill(7);
        batch.filled(PIPELINE_BATCH);
        // A window's worth of batches: 64 MiB, written again for each window it takes.
        let batches = PACE_WINDOW / PIPELINE_BATCH as u64;
        // Margins wide enough for a loaded machine: a slow write lasts far longer than the
        // loop's gap between two writes, a pause far longer than a real 4 MiB write.
        for (seed, slow_disk, pause_between) in [("slow", true, 0), ("quick", false, 40)] {
            let size = (batches + 1) * PIPELINE_BATCH as u64;
            let layer = Layer { media_type: "x".into(), digest: Digest::of(seed.as_bytes()), size, from: None };
            let partial =
                Partial::open(store.clone(), &layer, "registry.example".into(), seed.into()).expect("partial");
            for i in 0..batches * u64::from(SLOW_WINDOWS) {
                std::thread::sleep(Duration::from_millis(pause_between));
                let at = i % batches * PIPELINE_BATCH as u64;
                let wrote = partial.write_direct_with(at, batch.data(), |file, data, at| {
                    file.write_all_at(data, at)?;
                    if slow_disk {
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    Ok(())
                });
                assert!(wrote.expect("write"), "{seed}: batch {i} written directly");
            }
            assert_eq!(partial.direct_now.load(Ordering::Relaxed), !slow_disk, "{seed}");
            let next = partial.write_direct(batches * PIPELINE_BATCH as u64, batch.data()).expect("write");
            assert_eq!(next, !slow_disk, "{seed}: the next batch goes direct only while the disk keeps up");
        }
    }

    /// A download's progress, recorded while blobs are synced after the reply, is resumed
    /// in the same boot only: its data was not synced, so after a restart of the machine
    /// the download starts again. Progress recorded with the data synced resumes anywhere.
    #[test]
    fn unsynced_progress_is_resumed_in_the_same_boot_only() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::open(dir.path()).expect("store");
        let after_reply = |boot: &str| store.clone().with_background_syncs_by(boot, std::fs::File::sync_data);
        let data = vec![9u8; 2 << 20];
        let layer = Layer { media_type: "x".into(), digest: Digest::of(&data), size: data.len() as u64, from: None };
        let half = data.len() as u64 / 2;
        let open = |store: Store| Partial::open(store, &layer, "registry.example".into(), "x".into()).expect("open");
        let record = dir.path().join("blobs").join(format!("{}-partial.json", layer.digest.file_name()));

        let partial = open(after_reply("boot-a"));
        partial.write_at(0, &data[..data.len() / 2]).expect("write");
        partial.checkpoint().expect("checkpoint");
        drop(partial);
        let text = std::fs::read_to_string(&record).expect("record");
        assert!(text.contains(r#""unsynced_boot":"boot-a""#), "{text}");
        assert_eq!(open(after_reply("boot-a")).completed(), half, "the same boot resumes");
        assert_eq!(open(after_reply("boot-b")).completed(), 0, "a later boot starts again");

        let synced = store.clone().with_blob_syncs(true, Some("boot-b".into()));
        let partial = open(synced.clone());
        partial.write_at(0, &data[..data.len() / 2]).expect("write");
        partial.checkpoint().expect("checkpoint");
        drop(partial);
        let text = std::fs::read_to_string(&record).expect("record");
        assert!(!text.contains("unsynced_boot"), "{text}");
        assert_eq!(open(after_reply("boot-c")).completed(), half, "synced progress resumes in any boot");
    }

    /// A finished download, with blobs synced after the reply: the blob is named with its
    /// note on the disk, the note goes once the sync ends, and the data file and record
    /// are gone.
    #[test]
    fn a_finished_download_is_named_before_its_sync_and_noted_until_it_ends() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (release, released) = std::sync::mpsc::channel::<()>();
        let released = std::sync::Mutex::new(released);
        let store = Store::open(dir.path()).expect("store").with_background_syncs_by("boot-a", move |file| {
            let _ = crate::sync::lock(&released).recv();
            file.sync_data()
        });
        let data = vec![5u8; 3 << 20];
        let digest = Digest::of(&data);
        let layer = Layer { media_type: "x".into(), digest, size: data.len() as u64, from: None };
        let partial = Partial::open(store.clone(), &layer, "registry.example".into(), "x".into()).expect("partial");
        partial.write_at(0, &data).expect("write");
        let _pulled = store.pin([digest]);
        partial.commit().expect("commit");
        let blobs = dir.path().join("blobs");
        let note = dir.path().join("unsynced").join(digest.file_name());
        assert!(store.has_blob(&digest) && note.is_file(), "named, and noted until its sync ends");
        release.send(()).expect("release");
        store.wait_synced();
        assert!(!note.exists(), "the note goes with the sync");
        assert_eq!(std::fs::read(store.blob_path(&digest)).expect("blob"), data);
        let left: Vec<_> = std::fs::read_dir(&blobs).expect("blobs").map(|e| e.expect("entry").file_name()).collect();
        assert_eq!(left, [std::ffi::OsString::from(digest.file_name())], "no data file or record left");
    }

    /// A download that ends after every pull waiting on it was given up (nothing pins its
    /// blob) names nothing: those pulls have taken back what they placed. Its data and
    /// record stay, and the next pull that wants the blob names it without fetching again.
    /// A named blob is pinned only by that pull, so it can take it back (its pull given up
    /// too) while the download's files are still being let go.
    #[test]
    fn a_finished_download_nothing_pins_is_kept_for_the_next_pull_not_named() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::open(dir.path()).expect("store").with_blob_syncs(true, None);
        let data = vec![7u8; 1 << 20];
        let digest = Digest::of(&data);
        let layer = Layer { media_type: "x".into(), digest, size: data.len() as u64, from: None };
        let partial = Partial::open(store.clone(), &layer, "registry.example".into(), "x".into()).expect("partial");
        partial.write_at(0, &data).expect("write");
        let err = partial.commit().expect_err("nothing pins the blob");
        assert!(matches!(err, super::RegistryError::Interrupted { digest: d } if d == digest), "{err:?}");
        assert!(!store.has_blob(&digest), "named with no pull waiting");
        partial.checkpoint().expect("checkpoint");
        drop(partial);
        let again = Partial::open(store.clone(), &layer, "registry.example".into(), "x".into()).expect("partial");
        assert!(again.missing().is_empty(), "the data is kept: {:?}", again.missing());
        let pulled = store.pin([digest]);
        again.commit().expect("commit");
        assert_eq!(std::fs::read(store.blob_path(&digest)).expect("blob"), data);
        drop(pulled);
        assert_eq!(store.remove_unreferenced(std::collections::BTreeSet::from([digest])), [digest]);
        assert!(!store.has_blob(&digest));
        drop(again);
    }

    #[test]
    fn ranges_merge_and_leave_gaps() {
        let mut r = Ranges::default();
        r.insert(10, 20);
        r.insert(30, 40);
        r.insert(20, 25);
        r.insert(5, 5);
        assert_eq!(r.list(), vec![(10, 25), (30, 40)]);
        assert_eq!(r.covered(), 25);
        assert_eq!(r.missing(50), vec![(0, 10), (25, 30), (40, 50)]);
        r.insert(0, 50);
        assert_eq!(r.missing(50), vec![]);
        assert_eq!(Ranges::from_record(&[(40, 80), (0, 10), (5, 12)], 50).list(), vec![(0, 12), (40, 50)]);
    }

    /// A record holds as many ranges as fit in its 1 MiB cap, in any order: each is merged
    /// in at the cost of the log of their number, not a sort of all before it (170 000
    /// ranges took over four minutes in a test build that way).
    #[test]
    fn a_record_full_of_ranges_in_reverse_is_merged_whole() {
        let count: u64 = 60_000;
        let ranges: Vec<(u64, u64)> = (0..count).rev().map(|i| (3 * i, 3 * i + 2)).collect();
        let record =
            super::Record { digest: Digest::of(b"r"), size: 3 * count, done: ranges.clone(), unsynced_boot: None };
        assert!(
            serde_json::to_vec(&record).expect("json").len() < usize::try_from(super::MAX_RECORD_BYTES).expect("fits")
        );
        let mut merged = Ranges::from_record(&ranges, 3 * count);
        let list = merged.list();
        assert_eq!(list.len(), ranges.len());
        assert_eq!((list[0], list[list.len() - 1]), ((0, 2), (3 * count - 3, 3 * count - 1)));
        assert_eq!(merged.covered(), 2 * count);
        // Its gaps filled one by one, from the first, as a resumed download fills them
        // (each fill sorted the whole list again before).
        for (s, e) in merged.missing(3 * count) {
            assert_eq!(merged.end_from(s), s);
            merged.insert(s, e);
            assert_eq!(merged.end_from(s), merged.end_from(0));
        }
        assert_eq!(merged.list(), [(0, 3 * count)]);
    }

    proptest::proptest! {
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
            let list = r.list();
            for pair in list.windows(2) {
                proptest::prop_assert!(pair[0].0 < pair[0].1 && pair[0].1 < pair[1].0, "{:?}", list);
            }
            for &(start, len) in &inserts {
                proptest::prop_assert!(len == 0 || list.iter().any(|&(s, e)| s <= start && start + len <= e));
                proptest::prop_assert!(len == 0 || r.end_from(start) >= start + len);
            }
            let clamped = Ranges::from_record(&list, size);
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
