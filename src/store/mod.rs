//! The model store, in Ollama's layout: `manifests/<registry>/<namespace>/<model>/<tag>`
//! and `blobs/sha256-<hex>`, so an Ollama models directory works as is.
//!
//! Crash safety comes from the order of writes: a blob is written to a temporary file
//! in `blobs/`, synced, checked against its digest and only then renamed into place; a
//! manifest is written the same way, last, once every blob it names exists.  A crash at
//! any point leaves at worst a temporary file, removed by [`Store::open`].  A blob is
//! removed only when no manifest refers to it and no operation in progress has pinned it.
//!
//! Every access below the root goes through [`beneath`]: opened relative to a directory
//! descriptor, one component at a time, never following a symbolic link. A link planted
//! in the store is refused ([`StoreError::Refused`]), never read, written or deleted
//! through.
//!
//! Operations that race (a listing beside a delete, two deletes, a copy from a model
//! being deleted) treat an entry that vanished as what it is: a model not found, nothing
//! to do, or one entry fewer in a listing.
//!
//! The API is synchronous file-system work; async callers run it on the blocking pool.

mod beneath;
pub mod create;
pub mod digest;
pub mod gc;
pub mod limits;
pub mod manifest;
pub mod modelfile;
pub mod name;
pub mod registry;
pub mod show;

use std::collections::{BTreeSet, HashMap, HashSet};
use std::fs::{self, File};
use std::io::{self, Read, Seek, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use self::beneath::{Dir, Kind};
use self::digest::{Digest, Hasher};
use self::manifest::{Manifest, ManifestError};
use self::name::ModelName;

use crate::sync::lock;

/// Prefix of temporary files in the store; anything named so is debris from a crash
/// (or, while corrald runs, a write in progress: those are tracked, see [`Store::temps`]).
const TEMP_PREFIX: &str = ".tmp-";

/// Why a store operation failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// No manifest by that name.
    #[error("model '{0}' not found")]
    NotFound(String),
    /// The destination of a copy or create already exists (when that matters).
    #[error("model '{0}' already exists")]
    Exists(String),
    /// Data did not match the digest it was announced with.
    #[error("digest mismatch: expected {expected}, got {actual}")]
    DigestMismatch {
        /// The announced digest.
        expected: Digest,
        /// What the data hashed to.
        actual: Digest,
    },
    /// A file is not a usable GGUF.
    #[error("{what} is not a usable GGUF file: {message}")]
    Gguf {
        /// The file or blob.
        what: String,
        /// What the reader found.
        message: String,
    },
    /// A request makes no sense (a wrong kind of file, a bad reference).
    #[error("{0}")]
    Invalid(String),
    /// A manifest refers to a blob the store does not have.
    #[error("blob {0} is missing from the store")]
    MissingBlob(Digest),
    /// A manifest in the store or from a registry is malformed.
    #[error("{name}: {source}")]
    Manifest {
        /// Whose manifest.
        name: String,
        /// What is wrong.
        source: ManifestError,
    },
    /// An entry of the store is not what the store keeps there: a symbolic link (never
    /// followed), or a FIFO or device where a file belongs. It is left alone.
    #[error("refusing {path} in the model store: {reason}")]
    Refused {
        /// The entry, relative to the store's root.
        path: String,
        /// What it is.
        reason: &'static str,
    },
    /// A blob or manifest is bigger than the store reads (see [`limits`]).
    #[error(transparent)]
    TooLarge(#[from] limits::TooLarge),
    /// The file system failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done, with the path.
        context: String,
        /// The cause.
        source: io::Error,
    },
}

fn io_err(context: impl Into<String>) -> impl FnOnce(io::Error) -> StoreError {
    let context = context.into();
    move |source| StoreError::Io { context, source }
}

/// The error for `action` on `path` (relative to the store's root): a refusal when the
/// entry is a link or of the wrong kind, else the file system's error.
fn fs_err(action: &str, path: String) -> impl FnOnce(io::Error) -> StoreError {
    let action = action.to_owned();
    move |source| match beneath::refusal(&source) {
        Some(refusal) => StoreError::Refused { path, reason: refusal.reason() },
        None => StoreError::Io { context: format!("cannot {action} {path} in the model store"), source },
    }
}

/// Whether an entry went away (or never was): a concurrent delete, not a failure.
fn vanished(error: &io::Error) -> bool {
    error.kind() == io::ErrorKind::NotFound
}

/// A model in a listing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listed {
    /// Its name.
    pub name: ModelName,
    /// The digest of its manifest file.
    pub digest: Digest,
    /// The total size of its blobs.
    pub size: u64,
    /// When the manifest was last written.
    pub modified: SystemTime,
    /// The manifest.
    pub manifest: Manifest,
}

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
    details: Arc<Mutex<HashMap<ModelName, show::Cached>>>,
}

/// Keeps blobs from being removed while an operation that will refer to them runs.
#[derive(Debug)]
pub struct Pin {
    pins: Arc<Mutex<HashMap<Digest, usize>>>,
    digests: Vec<Digest>,
}

impl Drop for Pin {
    fn drop(&mut self) {
        let mut pins = lock(&self.pins);
        for digest in &self.digests {
            if let Some(count) = pins.get_mut(digest) {
                *count -= 1;
                if *count == 0 {
                    pins.remove(digest);
                }
            }
        }
    }
}

/// A temporary file in the store, removed when dropped unless it was put in place.
/// While it exists, garbage collection leaves it alone.
#[derive(Debug)]
pub struct TempFile {
    dir: Dir,
    name: String,
    file: File,
    temps: Arc<Mutex<HashSet<String>>>,
    placed: bool,
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

    /// Moves it into place as `to` in `target`: an atomic rename, which replaces a file
    /// (or a link, never followed) of that name.
    fn place(mut self, target: &Dir, to: &str) -> Result<(), StoreError> {
        self.dir.rename(&self.name, target, to).map_err(fs_err("write", target.rel(to)))?;
        self.placed = true;
        Ok(())
    }

    /// Replaces the file under this name with a hard link to `source` (see
    /// [`Dir::link_from`]), opened without following it.
    fn link_from(&mut self, source_dir: Option<&Dir>, source: &Path) -> io::Result<()> {
        self.dir.remove_file(&self.name)?;
        self.dir.link_from(source_dir, source, &self.name)?;
        self.file = self.dir.open(&self.name)?;
        Ok(())
    }

    /// Starts over with a new empty file under this name.
    fn reset(&mut self) -> io::Result<()> {
        match self.dir.remove_file(&self.name) {
            Ok(()) => {}
            Err(e) if vanished(&e) => {}
            Err(e) => return Err(e),
        }
        self.file = self.dir.create_new(&self.name, 0o600)?;
        Ok(())
    }
}

impl Write for TempFile {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
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
            remove_temporaries(&dir, 0)?;
        }
        Ok(store)
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
        Ok(Self {
            root: root.to_owned(),
            dir: Arc::new(dir),
            pins: Arc::default(),
            temps: Arc::default(),
            layout: Arc::default(),
            changes: Arc::new(tokio::sync::watch::Sender::new(0)),
            details: Arc::default(),
        })
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

    /// Imports every model of another store (an Ollama models directory) into this one,
    /// sharing blob data where the file system allows and checking every digest.
    /// Returns the names imported; a model whose blobs are missing or corrupt is skipped
    /// with a warning and leaves nothing behind.
    pub fn import_store(&self, other: &Store) -> Result<Vec<ModelName>, StoreError> {
        let mut imported = Vec::new();
        let other_blobs = other.blobs()?;
        for listed in other.list()? {
            let mut pins = Vec::new();
            let copied = listed.manifest.blobs().try_for_each(|layer| {
                let source = other.open_blob(&layer.digest)?;
                let name = layer.digest.file_name();
                let link = Some((Some(&other_blobs), Path::new(&name)));
                let (_, _, _, pin) = self.import_open(source, link, &layer.digest.to_string(), Some(&layer.digest))?;
                pins.push(pin);
                Ok::<_, StoreError>(())
            });
            if let Err(e) = copied {
                tracing::warn!(corral_model = %listed.name, error = %e, "not importing {}: its blobs are damaged", listed.name);
                continue;
            }
            let (bytes, _) = match other.read_manifest(&listed.name) {
                Ok(found) => found,
                Err(StoreError::NotFound(_)) => continue,
                Err(e) => return Err(e),
            };
            self.write_manifest_bytes(&listed.name, &bytes, &listed.manifest)?;
            imported.push(listed.name);
        }
        Ok(imported)
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

    /// True when the blob is in the store (a regular file: a link of that name is not a blob).
    #[must_use]
    pub fn has_blob(&self, digest: &Digest) -> bool {
        self.blobs()
            .ok()
            .and_then(|blobs| blobs.stat(&digest.file_name()).ok().flatten())
            .is_some_and(|meta| meta.kind == Kind::File)
    }

    /// Whether the store has blob `digest`, as [`Store::has_blob`]; if it has, its
    /// modification time becomes `now`, so garbage collection counts its grace from this
    /// moment: a client told that a blob is present goes on to create a model from it
    /// without uploading it again, and the blob must still be there then.
    pub fn claim_blob(&self, digest: &Digest, now: SystemTime) -> bool {
        match self.open_blob(digest) {
            Ok(file) => {
                if let Err(e) = file.set_modified(now) {
                    tracing::warn!(%digest, error = %e, "cannot renew a blob's modification time");
                }
                true
            }
            Err(_) => false,
        }
    }

    /// Opens a blob for reading, refusing a link or anything but a regular file.
    pub fn open_blob(&self, digest: &Digest) -> Result<File, StoreError> {
        let blobs = self.blobs()?;
        let name = digest.file_name();
        blobs.open(&name).map_err(|e| {
            if vanished(&e) { StoreError::MissingBlob(*digest) } else { fs_err("read", blobs.rel(&name))(e) }
        })
    }

    /// A blob's bytes (for small blobs: configs, text layers).
    pub fn read_blob(&self, digest: &Digest, kind: limits::SmallBlob) -> Result<Vec<u8>, StoreError> {
        let mut budget = kind.limit();
        limits::read_small_blob(self.open_blob(digest)?, kind, digest, &mut budget).map_err(|e| match e {
            limits::ReadError::Read(source) => {
                StoreError::Io { context: format!("cannot read blob {digest} in the model store"), source }
            }
            limits::ReadError::TooLarge(e) => StoreError::TooLarge(e),
        })
    }

    /// A blob's size.
    pub fn blob_size(&self, digest: &Digest) -> Result<u64, StoreError> {
        let file = self.open_blob(digest)?;
        Ok(file.metadata().map_err(io_err(format!("cannot read blob {digest} in the model store")))?.len())
    }

    /// A blob's path for another program to open, once checked to be a regular file in
    /// the store (not a link to somewhere else).
    pub fn blob_file(&self, digest: &Digest) -> Result<PathBuf, StoreError> {
        drop(self.open_blob(digest)?);
        Ok(self.blob_path(digest))
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

    /// A new temporary file in `dir`, tracked until it is dropped or put in place.
    fn temp_in(&self, dir: &Dir) -> Result<TempFile, StoreError> {
        let dir = dir.try_clone().map_err(fs_err("open", dir.path().to_owned()))?;
        for _ in 0..16 {
            let name: String = std::iter::repeat_with(fastrand::alphanumeric).take(12).collect::<String>();
            let name = format!("{TEMP_PREFIX}{name}");
            if !lock(&self.temps).insert(name.clone()) {
                continue;
            }
            match dir.create_new(&name, 0o600) {
                Ok(file) => return Ok(TempFile { dir, name, file, temps: Arc::clone(&self.temps), placed: false }),
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

    /// A new temporary file in `blobs/`, for data on its way to becoming a blob.
    pub fn temp_blob_file(&self) -> Result<TempFile, StoreError> {
        self.temp_in(&self.blobs()?)
    }

    /// Moves a fully written temporary file into place as blob `digest` (syncing it first).
    pub fn commit_blob(&self, temp: TempFile, digest: &Digest) -> Result<(), StoreError> {
        readable(temp.as_file())?;
        temp.as_file().sync_all().map_err(io_err(format!("cannot sync {}", temp.rel())))?;
        let blobs = self.blobs()?;
        temp.place(&blobs, &digest.file_name())?;
        blobs.sync().map_err(io_err("cannot sync blobs/"))
    }

    /// Streams `reader` into a blob, hashing as it goes. With `expected`, data that hashes
    /// to something else is discarded and nothing is written.
    pub fn write_blob(&self, reader: impl Read, expected: Option<&Digest>) -> Result<(Digest, u64), StoreError> {
        self.write_blob_pinned(reader, expected).map(|(digest, size, _)| (digest, size))
    }

    /// [`Store::write_blob`], the blob pinned before it is put in place: an operation that
    /// will refer to it never loses it to a garbage collection in between.
    pub fn write_blob_pinned(
        &self,
        mut reader: impl Read,
        expected: Option<&Digest>,
    ) -> Result<(Digest, u64, Pin), StoreError> {
        let mut temp = self.temp_blob_file()?;
        let mut hasher = Hasher::default();
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = reader.read(&mut buf).map_err(io_err("cannot read the blob's data"))?;
            if n == 0 {
                break;
            }
            hasher.update(&buf[..n]);
            temp.write_all(&buf[..n]).map_err(io_err(format!("cannot write {}", temp.rel())))?;
        }
        let (digest, size) = hasher.finish();
        if let Some(expected) = expected {
            if *expected != digest {
                return Err(StoreError::DigestMismatch { expected: *expected, actual: digest });
            }
        }
        let pin = self.pin([digest]);
        if !self.has_blob(&digest) {
            self.commit_blob(temp, &digest)?;
        }
        Ok((digest, size, pin))
    }

    /// Adds a file on disk as a blob without storing its data twice where the file system
    /// allows: a reflink (copy-on-write clone) first, then a hard link, else a copy.
    /// With a hard link the store shares the file's inode, so editing the original in
    /// place would change the blob; [`Store::verify_blob`] detects that. With `expected`,
    /// a file that hashes to something else is refused and nothing is written.
    pub fn import_file(&self, path: &Path, expected: Option<&Digest>) -> Result<(Digest, u64), StoreError> {
        self.import_file_tracked(path, expected).map(|(digest, size, _, _)| (digest, size))
    }

    /// [`Store::import_file`], also saying whether the blob is new to the store, and
    /// pinning it (before it is put in place).
    pub(crate) fn import_file_tracked(
        &self,
        path: &Path,
        expected: Option<&Digest>,
    ) -> Result<(Digest, u64, bool, Pin), StoreError> {
        // The file is outside the store, named by whoever asked: its links are theirs to
        // use. It is linked by its real path, so the store gets the file, not a link.
        let real = fs::canonicalize(path).map_err(io_err(format!("cannot open {}", path.display())))?;
        let file = File::open(&real).map_err(io_err(format!("cannot open {}", path.display())))?;
        self.import_open(file, Some((None, &real)), &path.display().to_string(), expected)
    }

    /// Imports the open file `source`, which `link` names for a hard link (a directory of
    /// another store and a name in it, or an absolute path); `what` names it in errors.
    fn import_open(
        &self,
        mut source: File,
        link: Option<(Option<&Dir>, &Path)>,
        what: &str,
        expected: Option<&Digest>,
    ) -> Result<(Digest, u64, bool, Pin), StoreError> {
        let (digest, size) =
            Digest::of_reader(io::BufReader::new(&source)).map_err(io_err(format!("cannot read {what}")))?;
        if let Some(expected) = expected {
            if *expected != digest {
                return Err(StoreError::DigestMismatch { expected: *expected, actual: digest });
            }
        }
        let pin = self.pin([digest]);
        if self.has_blob(&digest) {
            return Ok((digest, size, false, pin));
        }
        let blobs = self.blobs()?;
        let mut temp = self.temp_in(&blobs)?;
        let cloned = rustix::fs::ioctl_ficlone(temp.as_file(), &source).is_ok();
        let linked = !cloned && link.is_some_and(|(dir, path)| temp.link_from(dir, path).is_ok());
        if !cloned && !linked {
            temp.reset().map_err(io_err(format!("cannot write {}", temp.rel())))?;
            source.rewind().map_err(io_err(format!("cannot read {what}")))?;
            io::copy(&mut source, &mut temp.file).map_err(io_err(format!("cannot copy {what}")))?;
        }
        if !linked {
            // The store's own copy: readable like every blob, and on disk before it is named.
            readable(temp.as_file())?;
            temp.as_file().sync_all().map_err(io_err("cannot sync the copy"))?;
        }
        // Whatever was placed must still be what was hashed.
        let mut placed = temp.as_file();
        placed.rewind().map_err(io_err("cannot read the imported blob"))?;
        let (actual, _) =
            Digest::of_reader(io::BufReader::new(placed)).map_err(io_err("cannot read the imported blob"))?;
        if actual != digest {
            return Err(StoreError::DigestMismatch { expected: digest, actual });
        }
        temp.place(&blobs, &digest.file_name())?;
        blobs.sync().map_err(io_err("cannot sync blobs/"))?;
        Ok((digest, size, true, pin))
    }

    /// Checks that a blob still hashes to its name.
    pub fn verify_blob(&self, digest: &Digest) -> Result<(), StoreError> {
        let file = self.open_blob(digest)?;
        let (actual, _) = Digest::of_reader(io::BufReader::new(file))
            .map_err(io_err(format!("cannot read blob {digest} in the model store")))?;
        if actual == *digest { Ok(()) } else { Err(StoreError::DigestMismatch { expected: *digest, actual }) }
    }

    /// Writes a model's manifest, atomically, after checking every blob it names exists.
    /// Returns the manifest's digest.
    pub fn write_manifest(&self, name: &ModelName, manifest: &Manifest) -> Result<Digest, StoreError> {
        self.write_manifest_bytes(name, &manifest.to_bytes(), manifest)
    }

    /// Writes manifest bytes as received (a pull keeps the registry's bytes verbatim).
    pub fn write_manifest_bytes(
        &self,
        name: &ModelName,
        bytes: &[u8],
        manifest: &Manifest,
    ) -> Result<Digest, StoreError> {
        if let Some(missing) = manifest.blobs().find(|l| !self.has_blob(&l.digest)) {
            return Err(StoreError::MissingBlob(missing.digest));
        }
        // Written and synced in `manifests/` itself, which is always there; only the
        // rename into the model's directory happens under the layout lock.
        let manifests = self.manifests()?;
        let mut temp = self.temp_in(&manifests)?;
        temp.write_all(bytes)
            .and_then(|()| temp.as_file().sync_all())
            .map_err(io_err(format!("cannot write the manifest of {name}")))?;
        readable(temp.as_file())?;
        let layout = lock(&self.layout);
        let mut dir = manifests;
        for part in [name.registry(), name.namespace(), name.model()] {
            dir = dir.create_dir(part).map_err(fs_err("create", dir.rel(part)))?;
        }
        temp.place(&dir, name.tag())?;
        drop(layout);
        self.changed();
        dir.sync().map_err(io_err(format!("cannot sync {}", dir.path())))?;
        Ok(Digest::of(bytes))
    }

    /// The directories `manifests/`, registry, namespace and model of `name`; `None` when
    /// one of them is not there.
    fn model_dirs(&self, name: &ModelName) -> Result<Option<[Dir; 4]>, StoreError> {
        let manifests = self.manifests()?;
        let open = |dir: &Dir, part: &str| match dir.dir(part) {
            Ok(d) => Ok(Some(d)),
            Err(e) if vanished(&e) => Ok(None),
            Err(e) => Err(fs_err("open", dir.rel(part))(e)),
        };
        let Some(registry) = open(&manifests, name.registry())? else { return Ok(None) };
        let Some(namespace) = open(&registry, name.namespace())? else { return Ok(None) };
        let Some(model) = open(&namespace, name.model())? else { return Ok(None) };
        Ok(Some([manifests, registry, namespace, model]))
    }

    /// A manifest file's bytes and when it was written, read from one open file.
    pub(crate) fn read_manifest(&self, name: &ModelName) -> Result<(Vec<u8>, SystemTime), StoreError> {
        let not_found = || StoreError::NotFound(name.to_string());
        let [.., dir] = self.model_dirs(name)?.ok_or_else(not_found)?;
        let file = match dir.open(name.tag()) {
            Ok(file) => file,
            Err(e) if vanished(&e) => return Err(not_found()),
            Err(e) => return Err(fs_err("read", dir.rel(name.tag()))(e)),
        };
        read_manifest_file(file, &dir.rel(name.tag()))
    }

    /// The manifest file's bytes, as stored (a push sends them verbatim).
    pub fn manifest_bytes(&self, name: &ModelName) -> Result<Vec<u8>, StoreError> {
        self.read_manifest(name).map(|(bytes, _)| bytes)
    }

    /// The manifest file's identity (inode, size, modification time), without reading it.
    pub(crate) fn manifest_identity(&self, name: &ModelName) -> Result<(u64, u64, SystemTime), StoreError> {
        let not_found = || StoreError::NotFound(name.to_string());
        let [.., dir] = self.model_dirs(name)?.ok_or_else(not_found)?;
        let path = dir.rel(name.tag());
        match dir.stat(name.tag()).map_err(fs_err("read", path.clone()))? {
            None => Err(not_found()),
            Some(meta) if meta.kind == Kind::File => Ok((meta.ino, meta.len, meta.modified)),
            Some(meta) => Err(StoreError::Refused {
                path,
                reason: if meta.kind == Kind::Symlink {
                    beneath::Refusal::Symlink.reason()
                } else {
                    beneath::Refusal::NotAFile.reason()
                },
            }),
        }
    }

    /// A model's manifest, the digest of its bytes, and when it was written.
    pub fn manifest(&self, name: &ModelName) -> Result<(Manifest, Digest, SystemTime), StoreError> {
        let (bytes, modified) = self.read_manifest(name)?;
        let manifest =
            Manifest::parse(&bytes).map_err(|source| StoreError::Manifest { name: name.to_string(), source })?;
        Ok((manifest, Digest::of(&bytes), modified))
    }

    /// Every model, sorted by name. Files that are not valid manifests are skipped with a
    /// warning; entries that vanish while the listing runs (a concurrent delete) are left out.
    pub fn list(&self) -> Result<Vec<Listed>, StoreError> {
        let mut listed = Vec::new();
        self.walk_manifests(&mut |dir, parts, tag| {
            let name = match ModelName::parse(&format!("{}/{}/{}:{tag}", parts[0], parts[1], parts[2])) {
                Ok(name) => name,
                Err(e) => {
                    tracing::warn!(error = %e, "skipping a manifest with an invalid name");
                    return;
                }
            };
            let path = dir.rel(tag);
            let read = dir.open(tag).map_err(fs_err("read", path.clone())).and_then(|f| read_manifest_file(f, &path));
            match read {
                Ok((bytes, modified)) => match Manifest::parse(&bytes) {
                    Ok(manifest) => listed.push(Listed {
                        size: manifest.size(),
                        digest: Digest::of(&bytes),
                        name,
                        modified,
                        manifest,
                    }),
                    Err(source) => {
                        let e = StoreError::Manifest { name: name.to_string(), source };
                        tracing::warn!(error = %e, "skipping an unreadable manifest");
                    }
                },
                Err(StoreError::Io { source, .. }) if vanished(&source) => {}
                Err(e) => tracing::warn!(error = %e, "skipping an unreadable manifest"),
            }
        })?;
        listed.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(listed)
    }

    /// Calls `visit` with the model directory, the registry, namespace and model, and the
    /// tag of every file four levels below `manifests/`. Names starting with `.` are
    /// skipped, links are skipped with a warning, and a directory that vanishes on the
    /// way (a concurrent delete) is skipped; one that cannot be read is skipped with a
    /// warning. Only `manifests/` itself must be readable.
    fn walk_manifests(&self, visit: &mut dyn FnMut(&Dir, [&str; 3], &str)) -> Result<(), StoreError> {
        fn subdirs(dir: &Dir) -> Vec<(String, Dir)> {
            let entries = match dir.entries() {
                Ok(entries) => entries,
                Err(e) => {
                    if !vanished(&e) {
                        tracing::warn!(dir = dir.path(), error = %e, "skipping an unreadable manifest directory");
                    }
                    return Vec::new();
                }
            };
            let mut out = Vec::new();
            for entry in entries {
                if entry.name.starts_with('.') {
                    continue;
                }
                match entry.kind {
                    Kind::Dir => {}
                    Kind::Symlink => {
                        tracing::warn!(path = dir.rel(&entry.name), "skipping a symbolic link among the manifests");
                        continue;
                    }
                    _ => continue,
                }
                match dir.dir(&entry.name) {
                    Ok(sub) => out.push((entry.name, sub)),
                    Err(e) if vanished(&e) => {}
                    Err(e) => tracing::warn!(path = dir.rel(&entry.name), error = %e, "skipping a manifest directory"),
                }
            }
            out
        }
        let manifests = self.manifests()?;
        manifests.entries().map_err(fs_err("read", "manifests".to_owned()))?;
        for (registry, registry_dir) in subdirs(&manifests) {
            for (namespace, namespace_dir) in subdirs(&registry_dir) {
                for (model, model_dir) in subdirs(&namespace_dir) {
                    let entries = match model_dir.entries() {
                        Ok(entries) => entries,
                        Err(e) if vanished(&e) => continue,
                        Err(e) => {
                            tracing::warn!(dir = model_dir.path(), error = %e, "skipping a manifest directory");
                            continue;
                        }
                    };
                    for entry in entries {
                        if entry.name.starts_with('.') {
                            continue;
                        }
                        match entry.kind {
                            Kind::File => visit(&model_dir, [&registry, &namespace, &model], &entry.name),
                            Kind::Symlink => tracing::warn!(
                                path = model_dir.rel(&entry.name),
                                "skipping a symbolic link among the manifests"
                            ),
                            _ => {}
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Every digest any file below `manifests/` names, found in its bytes: a manifest that
    /// does not parse still keeps its blobs. Fails when a manifest cannot be read, since
    /// then nobody can tell which blobs are unused.
    fn references(&self) -> Result<BTreeSet<Digest>, StoreError> {
        fn scan(dir: &Dir, depth: usize, found: &mut BTreeSet<Digest>) -> Result<(), StoreError> {
            let entries = match dir.entries() {
                Ok(entries) => entries,
                Err(e) if vanished(&e) => return Ok(()),
                Err(e) => return Err(fs_err("read", dir.path().to_owned())(e)),
            };
            for entry in entries {
                match entry.kind {
                    Kind::Dir if depth < 8 => match dir.dir(&entry.name) {
                        Ok(sub) => scan(&sub, depth + 1, found)?,
                        Err(e) if vanished(&e) => {}
                        Err(e) => return Err(fs_err("read", dir.rel(&entry.name))(e)),
                    },
                    Kind::File => {
                        let path = dir.rel(&entry.name);
                        let file = match dir.open(&entry.name) {
                            Ok(file) => file,
                            Err(e) if vanished(&e) => continue,
                            Err(e) => return Err(fs_err("read", path)(e)),
                        };
                        let mut bytes = Vec::new();
                        file.take(limits::MANIFEST_MAX)
                            .read_to_end(&mut bytes)
                            .map_err(io_err(format!("cannot read {path} in the model store")))?;
                        found.extend(digests_in(&bytes));
                    }
                    // A link is not the store's: what it points to refers to nothing here.
                    _ => {}
                }
            }
            Ok(())
        }
        let mut found = BTreeSet::new();
        scan(&self.manifests()?, 0, &mut found)?;
        Ok(found)
    }

    /// Copies a model under a new name (the manifest only; blobs are shared). A source
    /// deleted meanwhile is not found.
    pub fn copy(&self, from: &ModelName, to: &ModelName) -> Result<(), StoreError> {
        for _ in 0..3 {
            let (bytes, _) = self.read_manifest(from)?;
            let manifest =
                Manifest::parse(&bytes).map_err(|source| StoreError::Manifest { name: from.to_string(), source })?;
            // Pinned, the blobs stay; one already gone went with a delete of `from` that
            // ran after the read above.
            let _pin = self.pin(manifest.blobs().map(|l| l.digest));
            if manifest.blobs().all(|l| self.has_blob(&l.digest)) {
                self.write_manifest_bytes(to, &bytes, &manifest)?;
                return Ok(());
            }
            let (now, _) = self.read_manifest(from)?;
            if now == bytes {
                // Still the same manifest, and still incomplete: the store is damaged.
                let missing = manifest.blobs().find(|l| !self.has_blob(&l.digest)).expect("a blob is missing");
                return Err(StoreError::MissingBlob(missing.digest));
            }
        }
        Err(StoreError::NotFound(from.to_string()))
    }

    /// Deletes a model; its blobs go too unless another manifest or a running operation
    /// needs them. Returns the blobs removed. The blobs are cleaned up whatever happened to
    /// the manifest (a concurrent delete that removed it first makes this one not found).
    pub fn delete(&self, name: &ModelName) -> Result<Vec<Digest>, StoreError> {
        let (bytes, _) = self.read_manifest(name)?;
        let removed = self.remove_manifest(name);
        if removed.is_ok() {
            self.changed();
        }
        // Every digest the file names, so a manifest that does not parse is deleted too.
        let freed = self.remove_unreferenced(digests_in(&bytes).collect());
        removed.map(|()| freed)
    }

    /// Removes a manifest file, then the model, namespace and registry directories it
    /// leaves empty.
    fn remove_manifest(&self, name: &ModelName) -> Result<(), StoreError> {
        let _layout = lock(&self.layout);
        let not_found = || StoreError::NotFound(name.to_string());
        let dirs = self.model_dirs(name)?.ok_or_else(not_found)?;
        match dirs[3].remove_file(name.tag()) {
            Ok(()) => {}
            Err(e) if vanished(&e) => return Err(not_found()),
            Err(e) => return Err(fs_err("remove", dirs[3].rel(name.tag()))(e)),
        }
        let parts = [name.registry(), name.namespace(), name.model()];
        for level in (0..3).rev() {
            // Fails (and stops) while the directory still holds something.
            if dirs[level].remove_dir(parts[level]).is_err() {
                break;
            }
        }
        Ok(())
    }

    /// Removes those of `candidates` that no manifest refers to and nothing has pinned.
    /// Returns those removed. Never fails: a blob it cannot remove (or cannot tell is
    /// unused) stays, with a warning, for a garbage collection to look at again.
    fn remove_unreferenced(&self, candidates: BTreeSet<Digest>) -> Vec<Digest> {
        if candidates.is_empty() {
            return Vec::new();
        }
        // Holding the pin table while deciding: an operation pins before it writes a
        // manifest, so a blob is either pinned here or named by a manifest on disk.
        let pins = lock(&self.pins);
        let referenced = match self.references() {
            Ok(referenced) => referenced,
            Err(e) => {
                tracing::warn!(error = %e, "keeping blobs: cannot tell which are still used");
                return Vec::new();
            }
        };
        let blobs = match self.blobs() {
            Ok(blobs) => blobs,
            Err(e) => {
                tracing::warn!(error = %e, "cannot remove unused blobs");
                return Vec::new();
            }
        };
        let mut removed = Vec::new();
        for digest in candidates {
            if referenced.contains(&digest) || pins.contains_key(&digest) {
                continue;
            }
            // Removes the file, or a link of that name (never what it points to).
            match blobs.remove_file(&digest.file_name()) {
                Ok(()) => removed.push(digest),
                Err(e) if vanished(&e) => {}
                Err(e) => tracing::warn!(blob = %digest, error = %e, "cannot remove an unused blob"),
            }
        }
        drop(pins);
        removed
    }
}

/// Reads a manifest file (at most [`limits::MANIFEST_MAX`]) and its modification time.
fn read_manifest_file(file: File, path: &str) -> Result<(Vec<u8>, SystemTime), StoreError> {
    let modified = file.metadata().and_then(|m| m.modified()).unwrap_or(SystemTime::UNIX_EPOCH);
    let what = format!("{path} in the model store");
    let bytes = limits::read_capped(file, limits::MANIFEST_MAX, &what, "a manifest").map_err(|e| match e {
        limits::ReadError::Read(source) => StoreError::Io { context: format!("cannot read {what}"), source },
        limits::ReadError::TooLarge(e) => StoreError::TooLarge(e),
    })?;
    Ok((bytes, modified))
}

/// Every `sha256:<hex>` (or `sha256-<hex>`) in `bytes`.
fn digests_in(bytes: &[u8]) -> impl Iterator<Item = Digest> + '_ {
    const PREFIX: usize = "sha256:".len();
    (0..bytes.len().saturating_sub(PREFIX + 63)).filter_map(move |i| {
        let window = &bytes[i..i + PREFIX + 64];
        if !(window.starts_with(b"sha256:") || window.starts_with(b"sha256-")) {
            return None;
        }
        std::str::from_utf8(window).ok().and_then(|text| Digest::parse(text).ok())
    })
}

/// Removes temporary files (`.tmp-*`) below `dir`: what a crash left mid-write. Links are
/// left alone, and never descended into.
fn remove_temporaries(dir: &Dir, depth: usize) -> Result<(), StoreError> {
    let entries = dir.entries().map_err(fs_err("read", dir.path().to_owned()))?;
    for entry in entries {
        if entry.name.starts_with(TEMP_PREFIX) && entry.kind == Kind::File {
            tracing::info!(path = dir.rel(&entry.name), "removing a temporary file left by an interrupted write");
            let _ = dir.remove_file(&entry.name);
        } else if entry.kind == Kind::Dir && depth < 8 {
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
fn readable(file: &File) -> Result<(), StoreError> {
    use std::os::unix::fs::PermissionsExt;
    file.set_permissions(fs::Permissions::from_mode(0o644)).map_err(io_err("cannot set a store file's mode"))
}

#[cfg(test)]
mod create_tests;
#[cfg(test)]
mod tests;
