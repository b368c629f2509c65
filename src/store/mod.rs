//! The model store, in Ollama's layout: `manifests/<registry>/<namespace>/<model>/<tag>`
//! and `blobs/sha256-<hex>`, so an Ollama models directory works as is.
//!
//! Crash safety comes from the order of writes: a blob is written to a temporary file
//! in `blobs/`, checked against its digest and only then renamed into place, synced
//! before or (with a note on the disk first) after the rename (`unsynced.rs`); a
//! manifest is written the same way, synced before its rename, last, once every blob it
//! names exists.  A crash at any point leaves at worst a temporary file, removed by
//! [`Store::open`], or a blob with a note, synced or removed by
//! [`Store::recover_unsynced`].  A blob is removed only when no manifest refers to it and
//! no operation in progress has pinned it.
//!
//! Every access below the root goes through `beneath.rs`: opened relative to a directory
//! descriptor, one component at a time, never following a symbolic link. A link planted
//! in the store is refused ([`StoreError::Refused`]), never read, written or deleted
//! through.
//!
//! Operations that race (a listing beside a delete, two deletes, a copy from a model
//! being deleted) treat an entry that vanished as what it is: a model not found, nothing
//! to do, or one entry fewer in a listing.
//!
//! The API is synchronous file-system work; async callers run it on the blocking pool.
//!
//! Where each part is: this file opens the store and pins blobs; `blobs.rs` reads and
//! writes blobs, `import.rs` adds files and other stores' models (`passed.rs`: files a caller passes open), `manifests.rs` writes,
//! reads, copies and deletes manifests, `list.rs` lists the models, `temp.rs` keeps the
//! temporary files, `unsynced.rs` syncs new blobs after the reply, `stream.rs` moves blob data in (hashed beside the write, one sync), `error.rs` holds [`StoreError`], `progress.rs` what long operations report; [`create`], [`show`], [`gc`] and
//! [`registry`] build on them.

mod beneath;
mod blobs;
pub mod create;
pub mod digest;
mod error;
pub mod gc;
mod import;
pub mod limits;
mod list;
pub mod manifest;
mod manifests;
pub mod modelfile;
pub mod name;
mod passed;
mod progress;
pub mod registry;
pub mod saved_listing;
pub mod show;
pub mod stream;
mod temp;
mod unsynced;
mod watch;

use std::collections::{HashMap, HashSet};
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use crate::sync::lock;

use self::beneath::{Dir, Kind};
use self::digest::Digest;
pub use self::error::StoreError;
use self::error::{fs_err, io_err, vanished};
pub use self::list::Listed;
use self::name::ModelName;
pub use self::passed::PassedFile;
pub use self::progress::Progress;
pub use self::temp::TempFile;
use self::temp::{MAX_TEMP_DEPTH, TEMP_PREFIX, remove_temporaries};
pub use self::unsynced::Recovered;
pub use self::watch::follow_outside_changes;

/// The model store. Cheap to clone; clones share the set of pinned blobs.
#[derive(Debug, Clone)]
pub struct Store {
    root: PathBuf,
    /// The root, opened once; everything below is reached from it without following links.
    dir: Arc<Dir>,
    pins: Arc<Mutex<HashMap<Digest, usize>>>,
    /// The temporary files being written now (by name): garbage collection leaves them alone.
    temps: Arc<Mutex<HashSet<String>>>,
    /// Held while manifest directories are made or removed, so that a write never puts
    /// its manifest into a directory a delete is removing.
    layout: Arc<Mutex<()>>,
    /// Counts manifest writes and removals, for views that follow the list of models.
    changes: Arc<tokio::sync::watch::Sender<u64>>,
    /// What requests read of a model, by name, with the manifest file it came from.
    details: Arc<Mutex<show::DetailsCache>>,
    /// The listing kept between calls (`list.rs`).
    index: Arc<Mutex<list::Index>>,
    /// inotify on the manifest directories, once asked for and where it works (`watch.rs`).
    watch: Arc<Mutex<Option<watch::Watch>>>,
    /// Whether blobs are written with direct I/O where the file system has it
    /// (`[store] direct_io`).
    direct_io: bool,
    /// When new blobs reach the disk, and the syncs running in the background
    /// (`unsynced.rs`).
    unsynced: Arc<unsynced::Unsynced>,
}

/// Keeps blobs from being removed while an operation that will refer to them runs.
#[derive(Debug)]
pub struct Pin {
    pins: Arc<Mutex<HashMap<Digest, usize>>>,
    digests: Vec<Digest>,
}

impl Pin {
    /// Takes this pin's counts out of `pins` (the table, locked); dropped after, it does nothing.
    fn release(&mut self, pins: &mut HashMap<Digest, usize>) {
        for digest in self.digests.drain(..) {
            if let Some(count) = pins.get_mut(&digest) {
                *count -= 1;
                if *count == 0 {
                    pins.remove(&digest);
                }
            }
        }
    }
}

impl Drop for Pin {
    fn drop(&mut self) {
        // Not after `release`, which may have run with the table locked by the caller.
        if !self.digests.is_empty() {
            let pins = Arc::clone(&self.pins);
            self.release(&mut lock(&pins));
        }
    }
}

impl Store {
    /// Opens (creating if needed) the store at `root` and removes temporary files a crash left.
    pub fn open(root: &Path) -> Result<Self, StoreError> {
        if let Err(source) = fs::create_dir_all(root) {
            let context = if root.exists() && !root.is_dir() {
                format!("{} is not a directory", root.display())
            } else {
                format!("cannot create {}", root.display())
            };
            return Err(StoreError::Io { context, source });
        }
        let store = Self::at(root)?;
        for name in ["blobs", "manifests"] {
            let dir = store.dir.create_dir(name).map_err(fs_err("create", name.to_owned()))?;
            // Every write's temporary file is made here, at the top: only these are looked
            // at now (a directory per model below would make start grow with the store).
            remove_temporaries(&dir, MAX_TEMP_DEPTH)?;
        }
        Ok(store)
    }

    /// Removes temporary files below the top of `manifests/` (to a depth of 8), which an
    /// older version's interrupted write may have left beside a manifest; no write makes
    /// them now, so this may run while the store is in use (corrald runs it after
    /// `READY=1`).
    pub fn remove_nested_temporaries(&self) -> Result<(), StoreError> {
        let manifests = self.dir.dir("manifests").map_err(fs_err("open", "manifests".to_owned()))?;
        for entry in manifests.entries().map_err(fs_err("read", "manifests".to_owned()))? {
            if entry.kind == Kind::Dir {
                match manifests.dir(&entry.name) {
                    Ok(sub) => remove_temporaries(&sub, 1)?,
                    Err(e) => {
                        tracing::warn!(path = manifests.rel(&entry.name), error = %e, "cannot look for temporary files");
                    }
                }
            }
        }
        Ok(())
    }

    /// Opens an existing store without writing to it (an Ollama models directory used as
    /// is, perhaps on a read-only mount): listing, showing and loading work; every write
    /// fails with the file system's error.
    pub fn open_read_only(root: &Path) -> Result<Self, StoreError> {
        let not_a_store =
            |source: io::Error| StoreError::Io { context: format!("{} is not a model store", root.display()), source };
        let store = Self::at(root).map_err(|e| match e {
            StoreError::Io { source, .. } => not_a_store(source),
            other => other,
        })?;
        for name in ["blobs", "manifests"] {
            store.dir.dir(name).map_err(|e| {
                if beneath::refusal(&e).is_some() {
                    fs_err("open", name.to_owned())(e)
                } else {
                    not_a_store(io::Error::new(e.kind(), format!("{name}/ is missing: {e}")))
                }
            })?;
        }
        Ok(store)
    }

    fn at(root: &Path) -> Result<Self, StoreError> {
        let dir = Dir::open_root(root).map_err(io_err(format!("cannot open the model store {}", root.display())))?;
        let dir = Arc::new(dir);
        Ok(Self {
            root: root.to_owned(),
            unsynced: Arc::new(unsynced::Unsynced::new(Arc::clone(&dir), true, None, Arc::new(fs::File::sync_data))),
            dir,
            pins: Arc::default(),
            temps: Arc::default(),
            layout: Arc::default(),
            changes: Arc::new(tokio::sync::watch::Sender::new(0)),
            details: Arc::default(),
            index: Arc::default(),
            watch: Arc::default(),
            direct_io: true,
        })
    }

    /// Writes blobs with direct I/O where the file system has it (`on`, the default) or
    /// through the page cache only (`[store] direct_io`), for clones made after this.
    #[must_use]
    pub fn with_direct_io(mut self, on: bool) -> Self {
        self.direct_io = on;
        self
    }

    /// Whether uploads and pulls write blobs with direct I/O where the file system has it.
    #[must_use]
    pub fn direct_io(&self) -> bool {
        self.direct_io
    }

    /// A receiver that sees a new value after each change to the set of models or their
    /// manifests (made through this store or its clones).
    #[must_use]
    pub fn changes(&self) -> tokio::sync::watch::Receiver<u64> {
        self.changes.subscribe()
    }

    fn changed(&self) {
        self.changes.send_modify(|n| *n += 1);
    }

    /// The store's root directory.
    #[must_use]
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// `blobs/`.
    #[must_use]
    pub fn blobs_dir(&self) -> PathBuf {
        self.root.join("blobs")
    }

    /// `manifests/`.
    #[must_use]
    pub fn manifests_dir(&self) -> PathBuf {
        self.root.join("manifests")
    }

    /// Where a blob lives (for other programs: llama-server, a Modelfile's `FROM`).
    #[must_use]
    pub fn blob_path(&self, digest: &Digest) -> PathBuf {
        self.blobs_dir().join(digest.file_name())
    }

    /// Where a model's manifest lives.
    #[must_use]
    pub fn manifest_path(&self, name: &ModelName) -> PathBuf {
        self.manifests_dir().join(name.manifest_path())
    }

    fn blobs(&self) -> Result<Dir, StoreError> {
        self.dir.dir("blobs").map_err(fs_err("open", "blobs".to_owned()))
    }

    fn manifests(&self) -> Result<Dir, StoreError> {
        self.dir.dir("manifests").map_err(fs_err("open", "manifests".to_owned()))
    }

    /// Pins blobs until the returned guard is dropped.
    #[must_use]
    pub fn pin(&self, digests: impl IntoIterator<Item = Digest>) -> Pin {
        let digests: Vec<Digest> = digests.into_iter().collect();
        let mut pins = lock(&self.pins);
        for digest in &digests {
            *pins.entry(*digest).or_default() += 1;
        }
        Pin { pins: Arc::clone(&self.pins), digests }
    }

    /// Runs `place` (which names the new blob `digest` from files `own` guards) only while
    /// something besides `own` pins `digest`, holding the pin table, and lets `own` go with
    /// it once `place` succeeds. An operation given up takes back what it placed under the
    /// same lock ([`Store::remove_unreferenced`]), so a blob is neither named after the last
    /// operation that wanted it has gone, nor kept by a pin of files that are gone. `None`
    /// when nothing else pins `digest`.
    pub(crate) fn name_if_wanted<T, E>(
        &self,
        own: &mut Option<Pin>,
        digest: &Digest,
        place: impl FnOnce() -> Result<T, E>,
    ) -> Option<Result<T, E>> {
        let mut pins = lock(&self.pins);
        let mine = own.as_ref().map_or(0, |pin| pin.digests.iter().filter(|d| *d == digest).count());
        if pins.get(digest).copied().unwrap_or(0) <= mine {
            return None;
        }
        let placed = place();
        if placed.is_ok() {
            if let Some(mut pin) = own.take() {
                pin.release(&mut pins);
            }
        }
        Some(placed)
    }
}

#[cfg(test)]
mod create_tests;
#[cfg(test)]
mod tests;
