//! Temporary files in the store: where every blob and manifest is written before it is
//! renamed into place, tracked while they exist, and removed when a crash left them.

use std::collections::HashSet;
use std::fs::{self, File};
use std::io::{self, Write};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::{Arc, Mutex};

use crate::sync::lock;

use super::beneath::{Dir, Kind};
use super::stream::{ALIGN, DirectPace, IdleClock, Pipeline, Writeback};
use super::{Store, StoreError, fs_err, io_err, vanished};

/// Prefix of temporary files in the store; anything named so is debris from a crash
/// (or, while corrald runs, a write in progress: those are tracked, see [`Store::temps`]).
pub(super) const TEMP_PREFIX: &str = ".tmp-";

/// A temporary file in the store, removed when dropped unless it was put in place.
/// While it exists, garbage collection leaves it alone.
#[derive(Debug)]
pub struct TempFile {
    dir: Dir,
    name: String,
    pub(super) file: File,
    temps: Arc<Mutex<HashSet<String>>>,
    placed: bool,
    /// Where the next [`TempFile::append`] goes.
    written: u64,
    /// Sends what [`TempFile::append`] wrote through the page cache to disk as it goes.
    writeback: Option<Writeback>,
    /// Whether the write-back starts as the file is written (blobs synced before the
    /// reply), or the pages are left to the kernel until the blob's sync.
    sync_while_writing: bool,
    /// Whether the file is open for direct I/O ([`TempFile::direct`]).
    direct: bool,
    /// Whether direct writes keep up: when they do not, the rest goes through the page cache.
    pace: DirectPace,
}

impl TempFile {
    /// The open file.
    #[must_use]
    pub fn as_file(&self) -> &File {
        &self.file
    }

    /// Its path relative to the store's root, for messages.
    #[must_use]
    pub fn rel(&self) -> String {
        self.dir.rel(&self.name)
    }

    /// Appends `data` (the file is written only this way, or only through [`Write`]): with
    /// direct I/O while the file is open for it ([`TempFile::direct`]) and `data` is
    /// aligned for it, else through the page cache (and from then on: the tail of a file,
    /// or a device that wants larger alignments), starting those pages' way to disk as it
    /// goes. Either way the final sync before the blob is named makes it durable.
    pub fn append(&mut self, data: &[u8]) -> io::Result<()> {
        self.append_with(data, FileExt::write_all_at)
    }

    /// [`TempFile::append`], with the direct write done by `direct_write` (file, data,
    /// offset): tests make it refuse as a device with blocks over [`ALIGN`] would, which
    /// no device here can be made to do.
    pub(super) fn append_with(
        &mut self,
        data: &[u8],
        direct_write: impl FnOnce(&File, &[u8], u64) -> io::Result<()>,
    ) -> io::Result<()> {
        if self.direct {
            if self.append_direct(data, direct_write)? {
                return Ok(());
            }
            self.set_direct(false)?;
        }
        self.file.write_all_at(data, self.written)?;
        self.wrote(data.len());
        Ok(())
    }

    /// Appends `data` with direct I/O if it is aligned for it: `false` if it is not, or if
    /// the kernel refused it for its alignment (nothing then counts as written: the write
    /// is positional, so writing it again at the same offset writes it all).
    fn append_direct(
        &mut self,
        data: &[u8],
        direct_write: impl FnOnce(&File, &[u8], u64) -> io::Result<()>,
    ) -> io::Result<bool> {
        let aligned = |n: u64| n % ALIGN as u64 == 0;
        if !(aligned(data.as_ptr().addr() as u64) && aligned(data.len() as u64) && aligned(self.written)) {
            return Ok(false);
        }
        match self.pace.time(data.len(), || direct_write(&self.file, data, self.written)) {
            Ok(slower) => {
                self.written += data.len() as u64;
                if slower && self.set_direct(false).is_ok() {
                    tracing::debug!(
                        path = self.rel(),
                        "the disk is the slower part: the rest goes through the page cache"
                    );
                }
                Ok(true)
            }
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Opens the file for direct I/O, where its file system supports it (`true` if so):
    /// [`TempFile::append`] then writes aligned data from memory straight to disk. That
    /// saves copying it into the page cache and writing it back later, a third of an
    /// upload's CPU time, and leaves the cache to the models being run instead of filling it
    /// with the blob. Where the disk turns out to be the slower part ([`DirectPace`]), the
    /// rest goes through the page cache.
    pub fn direct(&mut self) -> bool {
        self.set_direct(true).is_ok()
    }

    fn set_direct(&mut self, on: bool) -> io::Result<()> {
        use rustix::fs::{OFlags, fcntl_getfl, fcntl_setfl};
        let flags = fcntl_getfl(&self.file)?;
        fcntl_setfl(&self.file, if on { flags | OFlags::DIRECT } else { flags - OFlags::DIRECT })?;
        self.direct = on;
        Ok(())
    }

    /// Moves past `n` bytes just written, and counts them for the write-back.
    fn wrote(&mut self, n: usize) {
        self.written += n as u64;
        let (file, on) = (&self.file, self.sync_while_writing);
        self.writeback.get_or_insert_with(|| Writeback::new_if(on, file)).wrote(n);
    }

    /// Syncs the file: what is written is on disk.
    pub(super) fn sync(&mut self) -> io::Result<()> {
        if let Some(mut writeback) = self.writeback.take() {
            writeback.finish()?;
        }
        self.file.sync_all()
    }

    /// Moves it into place as `to` in `target`: an atomic rename, which replaces a file
    /// (or a link, never followed) of that name.
    pub(super) fn place(mut self, target: &Dir, to: &str) -> Result<(), StoreError> {
        self.dir.rename(&self.name, target, to).map_err(fs_err("write", target.rel(to)))?;
        self.placed = true;
        Ok(())
    }

    /// Replaces the file under this name with a hard link to `source` (see
    /// [`Dir::link_from`]), opened without following it.
    pub(super) fn link_from(&mut self, source_dir: Option<&Dir>, source: &Path) -> io::Result<()> {
        self.dir.remove_file(&self.name)?;
        self.dir.link_from(source_dir, source, &self.name)?;
        self.file = self.dir.open(&self.name)?;
        (self.writeback, self.direct) = (None, false);
        Ok(())
    }

    /// Starts an upload into this file: a [`Pipeline`] that hashes each batch and then
    /// appends it ([`TempFile::append`]), the disk's pace judged by how long the hash
    /// waits for the writes ([`DirectPace`]). A failed write comes back from
    /// [`Pipeline::finish`] as a [`StoreError`] inside the I/O error.
    #[must_use]
    pub fn into_pipeline(mut self) -> Pipeline<Self> {
        let hash_waits = self.pace_by_hash();
        Pipeline::start(self, hash_waits, |file: &mut Self, data: &[u8]| {
            file.append(data).map_err(|source| {
                io::Error::other(StoreError::Io { context: format!("cannot write {}", file.rel()), source })
            })
        })
    }

    /// A clock for the hash that hands each batch to this file's writer: the disk's pace
    /// is judged by its waits too ([`DirectPace::beside`]), until [`TempFile::reset`].
    pub(super) fn pace_by_hash(&mut self) -> Arc<IdleClock> {
        let hash_waits = Arc::new(IdleClock::new());
        self.pace.beside(Arc::clone(&hash_waits));
        hash_waits
    }

    /// Starts over with a new empty file under this name.
    pub(super) fn reset(&mut self) -> io::Result<()> {
        match self.dir.remove_file(&self.name) {
            Ok(()) => {}
            Err(e) if vanished(&e) => {}
            Err(e) => return Err(e),
        }
        self.file = self.dir.create_new(&self.name, 0o600)?;
        (self.written, self.writeback, self.direct, self.pace) = (0, None, false, DirectPace::default());
        Ok(())
    }
}

impl Write for TempFile {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if self.direct {
            self.set_direct(false)?;
        }
        self.file.write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.file.flush()
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        if !self.placed {
            let _ = self.dir.remove_file(&self.name);
        }
        lock(&self.temps).remove(&self.name);
    }
}

impl Store {
    /// A new temporary file in `dir`, tracked until it is dropped or put in place.
    pub(super) fn temp_in(&self, dir: &Dir) -> Result<TempFile, StoreError> {
        let dir = dir.try_clone().map_err(fs_err("open", dir.path().to_owned()))?;
        for _ in 0..16 {
            let name: String = std::iter::repeat_with(fastrand::alphanumeric).take(12).collect::<String>();
            let name = format!("{TEMP_PREFIX}{name}");
            if !lock(&self.temps).insert(name.clone()) {
                continue;
            }
            match dir.create_new(&name, 0o600) {
                Ok(file) => {
                    let temps = Arc::clone(&self.temps);
                    let (placed, written, writeback, direct, pace) = (false, 0, None, false, DirectPace::default());
                    let sync_while_writing = self.syncs_before_reply();
                    return Ok(TempFile {
                        dir,
                        name,
                        file,
                        temps,
                        placed,
                        written,
                        writeback,
                        sync_while_writing,
                        direct,
                        pace,
                    });
                }
                Err(e) => {
                    lock(&self.temps).remove(&name);
                    if e.kind() != io::ErrorKind::AlreadyExists {
                        return Err(fs_err("create a temporary file in", dir.path().to_owned())(e));
                    }
                }
            }
        }
        Err(StoreError::Io {
            context: format!("cannot create a temporary file in {}", dir.path()),
            source: io::Error::from(io::ErrorKind::AlreadyExists),
        })
    }
}

/// How deep below `blobs/` and `manifests/` temporary files are looked for.
pub(super) const MAX_TEMP_DEPTH: usize = 8;

/// Removes temporary files (`.tmp-*`) in `dir`, and below it while `depth` is under
/// [`MAX_TEMP_DEPTH`]: what a crash left mid-write. Links are left alone, and never
/// descended into.
pub(super) fn remove_temporaries(dir: &Dir, depth: usize) -> Result<(), StoreError> {
    let entries = dir.entries().map_err(fs_err("read", dir.path().to_owned()))?;
    for entry in entries {
        if entry.name.starts_with(TEMP_PREFIX) && entry.kind == Kind::File {
            tracing::info!(path = dir.rel(&entry.name), "removing a temporary file left by an interrupted write");
            let _ = dir.remove_file(&entry.name);
        } else if entry.kind == Kind::Dir && depth < MAX_TEMP_DEPTH {
            match dir.dir(&entry.name) {
                Ok(sub) => remove_temporaries(&sub, depth + 1)?,
                Err(e) => tracing::warn!(path = dir.rel(&entry.name), error = %e, "cannot look for temporary files"),
            }
        }
    }
    Ok(())
}

/// Store files are world-readable like Ollama's (the service's `UMask=` narrows that):
/// temporary files start out private to their creator.
pub(super) fn readable(file: &File) -> Result<(), StoreError> {
    use std::os::unix::fs::PermissionsExt;
    file.set_permissions(fs::Permissions::from_mode(0o644)).map_err(io_err("cannot set a store file's mode"))
}
