//! The model store, in Ollama's layout: `manifests/<registry>/<namespace>/<model>/<tag>`
//! and `blobs/sha256-<hex>`, so an Ollama models directory works as is.
//!
//! Crash safety comes from the order of writes: a blob is written to a temporary file
//! in `blobs/`, synced, checked against its digest and only then renamed into place; a
//! manifest is written the same way, last, once every blob it names exists.  A crash at
//! any point leaves at worst a temporary file, removed by [`Store::open`].  A blob is
//! removed only when no manifest refers to it and no operation in progress has pinned it.
//!
//! The API is synchronous file-system work; async callers run it on the blocking pool.

pub mod create;
pub mod digest;
pub mod limits;
pub mod manifest;
pub mod modelfile;
pub mod name;
pub mod registry;
pub mod show;

use std::collections::{BTreeSet, HashMap};
use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::SystemTime;

use self::digest::{Digest, Hasher};
use self::manifest::{Manifest, ManifestError};
use self::name::ModelName;

/// Prefix of temporary files in the store; anything named so is debris from a crash.
const TEMP_PREFIX: &str = ".tmp-";

/// Why a store operation failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// No manifest by that name.
    #[error("model \"{0}\" not found")]
    NotFound(String),
    /// The destination of a copy or create already exists (when that matters).
    #[error("model \"{0}\" already exists")]
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
    pins: Arc<Mutex<HashMap<Digest, usize>>>,
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
        let mut pins = self.pins.lock().unwrap_or_else(PoisonError::into_inner);
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

impl Store {
    /// Opens (creating if needed) the store at `root` and removes temporary files a crash left.
    pub fn open(root: &Path) -> Result<Self, StoreError> {
        let store = Self::at(root);
        for dir in [store.blobs_dir(), store.manifests_dir()] {
            fs::create_dir_all(&dir).map_err(io_err(format!("cannot create {}", dir.display())))?;
        }
        remove_temporaries(&store.blobs_dir())?;
        remove_temporaries(&store.manifests_dir())?;
        Ok(store)
    }

    /// Opens an existing store without writing to it (an Ollama models directory used as
    /// is, perhaps on a read-only mount): listing, showing and loading work; every write
    /// fails with the file system's error.
    pub fn open_read_only(root: &Path) -> Result<Self, StoreError> {
        for dir in [root.join("blobs"), root.join("manifests")] {
            if !dir.is_dir() {
                return Err(StoreError::Io {
                    context: format!("{} is not a model store", root.display()),
                    source: io::Error::new(io::ErrorKind::NotFound, format!("{} is missing", dir.display())),
                });
            }
        }
        Ok(Self::at(root))
    }

    fn at(root: &Path) -> Self {
        Self {
            root: root.to_owned(),
            pins: Arc::default(),
            changes: Arc::new(tokio::sync::watch::Sender::new(0)),
            details: Arc::default(),
        }
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
        for listed in other.list()? {
            let _pin = self.pin(listed.manifest.blobs().map(|l| l.digest));
            let copied = listed
                .manifest
                .blobs()
                .try_for_each(|layer| self.import_file(&other.blob_path(&layer.digest), Some(&layer.digest)).map(drop));
            if let Err(e) = copied {
                tracing::warn!(model = %listed.name, error = %e, "not importing a model whose blobs are damaged");
                continue;
            }
            let bytes =
                fs::read(other.manifest_path(&listed.name)).map_err(io_err("cannot read a manifest to import"))?;
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

    /// Where a blob lives.
    #[must_use]
    pub fn blob_path(&self, digest: &Digest) -> PathBuf {
        self.blobs_dir().join(digest.file_name())
    }

    /// Where a model's manifest lives.
    #[must_use]
    pub fn manifest_path(&self, name: &ModelName) -> PathBuf {
        self.manifests_dir().join(name.manifest_path())
    }

    /// True when the blob is in the store.
    #[must_use]
    pub fn has_blob(&self, digest: &Digest) -> bool {
        self.blob_path(digest).is_file()
    }

    /// Pins blobs until the returned guard is dropped.
    #[must_use]
    pub fn pin(&self, digests: impl IntoIterator<Item = Digest>) -> Pin {
        let digests: Vec<Digest> = digests.into_iter().collect();
        let mut pins = self.pins.lock().unwrap_or_else(PoisonError::into_inner);
        for digest in &digests {
            *pins.entry(*digest).or_default() += 1;
        }
        Pin { pins: Arc::clone(&self.pins), digests }
    }

    /// A new temporary file in `blobs/`, for data on its way to becoming a blob.
    pub fn temp_blob_file(&self) -> Result<tempfile::NamedTempFile, StoreError> {
        tempfile::Builder::new()
            .prefix(TEMP_PREFIX)
            .tempfile_in(self.blobs_dir())
            .map_err(io_err(format!("cannot create a temporary file in {}", self.blobs_dir().display())))
    }

    /// Moves a fully written and synced temporary file into place as blob `digest`.
    pub fn commit_blob(&self, temp: tempfile::NamedTempFile, digest: &Digest) -> Result<(), StoreError> {
        let path = self.blob_path(digest);
        readable(temp.as_file())?;
        temp.as_file().sync_all().map_err(io_err(format!("cannot sync {}", temp.path().display())))?;
        temp.persist(&path)
            .map_err(|e| StoreError::Io { context: format!("cannot write {}", path.display()), source: e.error })?;
        sync_dir(&self.blobs_dir())
    }

    /// Streams `reader` into a blob, hashing as it goes. With `expected`, data that hashes
    /// to something else is discarded and nothing is written.
    pub fn write_blob(&self, mut reader: impl Read, expected: Option<&Digest>) -> Result<(Digest, u64), StoreError> {
        let mut temp = self.temp_blob_file()?;
        let mut hasher = Hasher::default();
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = reader.read(&mut buf).map_err(io_err("cannot read the blob's data"))?;
            if n == 0 {
                break;
            }
            hasher.update(&buf[..n]);
            temp.write_all(&buf[..n]).map_err(io_err(format!("cannot write {}", temp.path().display())))?;
        }
        let (digest, size) = hasher.finish();
        if let Some(expected) = expected {
            if *expected != digest {
                return Err(StoreError::DigestMismatch { expected: *expected, actual: digest });
            }
        }
        if !self.has_blob(&digest) {
            self.commit_blob(temp, &digest)?;
        }
        Ok((digest, size))
    }

    /// Adds a file on disk as a blob without storing its data twice where the file system
    /// allows: a reflink (copy-on-write clone) first, then a hard link, else a copy.
    /// With a hard link the store shares the file's inode, so editing the original in
    /// place would change the blob; [`Store::verify_blob`] detects that. With `expected`,
    /// a file that hashes to something else is refused and nothing is written.
    pub fn import_file(&self, path: &Path, expected: Option<&Digest>) -> Result<(Digest, u64), StoreError> {
        self.import_file_tracked(path, expected).map(|(digest, size, _)| (digest, size))
    }

    /// [`Store::import_file`], also saying whether the blob is new to the store.
    pub(crate) fn import_file_tracked(
        &self,
        path: &Path,
        expected: Option<&Digest>,
    ) -> Result<(Digest, u64, bool), StoreError> {
        let file = File::open(path).map_err(io_err(format!("cannot open {}", path.display())))?;
        let (digest, size) =
            Digest::of_reader(io::BufReader::new(file)).map_err(io_err(format!("cannot read {}", path.display())))?;
        if let Some(expected) = expected {
            if *expected != digest {
                return Err(StoreError::DigestMismatch { expected: *expected, actual: digest });
            }
        }
        if self.has_blob(&digest) {
            return Ok((digest, size, false));
        }
        // A unique temporary name (reserved by creating the file, then freed for the clone
        // or link to take): a crash leaves only debris that `open` removes.
        let temp_path = self
            .temp_blob_file()?
            .into_temp_path()
            .keep()
            .map_err(|e| StoreError::Io { context: "cannot reserve a temporary name".into(), source: e.error })?;
        let _ = fs::remove_file(&temp_path);
        let placed = reflink_copy::reflink(path, &temp_path).is_ok() || fs::hard_link(path, &temp_path).is_ok();
        if !placed {
            fs::copy(path, &temp_path).map_err(io_err(format!("cannot copy {}", path.display())))?;
            File::open(&temp_path).and_then(|f| f.sync_all()).map_err(io_err("cannot sync the copy"))?;
        }
        // Whatever was placed must still be what was hashed.
        let check = File::open(&temp_path).and_then(|f| Digest::of_reader(io::BufReader::new(f)));
        match check {
            Ok((actual, _)) if actual == digest => {}
            Ok((actual, _)) => {
                let _ = fs::remove_file(&temp_path);
                return Err(StoreError::DigestMismatch { expected: digest, actual });
            }
            Err(e) => {
                let _ = fs::remove_file(&temp_path);
                return Err(io_err("cannot read the imported blob")(e));
            }
        }
        fs::rename(&temp_path, self.blob_path(&digest)).map_err(io_err("cannot move the imported blob into place"))?;
        sync_dir(&self.blobs_dir())?;
        Ok((digest, size, true))
    }

    /// Checks that a blob still hashes to its name.
    pub fn verify_blob(&self, digest: &Digest) -> Result<(), StoreError> {
        let path = self.blob_path(digest);
        let file = File::open(&path).map_err(|_| StoreError::MissingBlob(*digest))?;
        let (actual, _) =
            Digest::of_reader(io::BufReader::new(file)).map_err(io_err(format!("cannot read {}", path.display())))?;
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
        let path = self.manifest_path(name);
        let dir = path.parent().expect("a manifest path has a parent").to_owned();
        fs::create_dir_all(&dir).map_err(io_err(format!("cannot create {}", dir.display())))?;
        let mut temp = tempfile::Builder::new()
            .prefix(TEMP_PREFIX)
            .tempfile_in(&dir)
            .map_err(io_err(format!("cannot create a temporary file in {}", dir.display())))?;
        temp.write_all(bytes).and_then(|()| temp.as_file().sync_all()).map_err(io_err("cannot write the manifest"))?;
        readable(temp.as_file())?;
        temp.persist(&path)
            .map_err(|e| StoreError::Io { context: format!("cannot write {}", path.display()), source: e.error })?;
        self.changed();
        sync_dir(&dir)?;
        Ok(Digest::of(bytes))
    }

    /// A model's manifest, the digest of its bytes, and when it was written.
    pub fn manifest(&self, name: &ModelName) -> Result<(Manifest, Digest, SystemTime), StoreError> {
        let path = self.manifest_path(name);
        let what = format!("the manifest of {name}");
        let bytes = match limits::read_file(&path, limits::MANIFEST_MAX, &what, "a manifest") {
            Ok(bytes) => bytes,
            Err(limits::ReadError::Open(e)) if e.kind() == io::ErrorKind::NotFound => {
                return Err(StoreError::NotFound(name.to_string()));
            }
            Err(limits::ReadError::Open(e) | limits::ReadError::Read(e)) => {
                return Err(io_err(format!("cannot read {}", path.display()))(e));
            }
            Err(limits::ReadError::TooLarge(e)) => return Err(e.into()),
        };
        let modified = fs::metadata(&path).and_then(|m| m.modified()).unwrap_or(SystemTime::UNIX_EPOCH);
        let manifest =
            Manifest::parse(&bytes).map_err(|source| StoreError::Manifest { name: name.to_string(), source })?;
        Ok((manifest, Digest::of(&bytes), modified))
    }

    /// Every model, sorted by name. Files that are not valid manifests are skipped with a warning.
    pub fn list(&self) -> Result<Vec<Listed>, StoreError> {
        let mut listed = Vec::new();
        for name in self.names()? {
            match self.manifest(&name) {
                Ok((manifest, digest, modified)) => {
                    listed.push(Listed { size: manifest.size(), name, digest, modified, manifest });
                }
                Err(e) => tracing::warn!(error = %e, "skipping an unreadable manifest"),
            }
        }
        Ok(listed)
    }

    /// The names of all manifests (four directory levels below `manifests/`).
    fn names(&self) -> Result<BTreeSet<ModelName>, StoreError> {
        let mut names = BTreeSet::new();
        let root = self.manifests_dir();
        let read = |dir: &Path| -> Result<Vec<(String, PathBuf, bool)>, StoreError> {
            let mut out = Vec::new();
            for entry in fs::read_dir(dir).map_err(io_err(format!("cannot read {}", dir.display())))? {
                let entry = entry.map_err(io_err(format!("cannot read {}", dir.display())))?;
                let name = entry.file_name().to_string_lossy().into_owned();
                if name.starts_with('.') {
                    continue;
                }
                let is_dir = entry.file_type().is_ok_and(|t| t.is_dir());
                out.push((name, entry.path(), is_dir));
            }
            Ok(out)
        };
        for (registry, registry_path, is_dir) in read(&root)? {
            if !is_dir {
                continue;
            }
            for (namespace, namespace_path, is_dir) in read(&registry_path)? {
                if !is_dir {
                    continue;
                }
                for (model, model_path, is_dir) in read(&namespace_path)? {
                    if !is_dir {
                        continue;
                    }
                    for (tag, _, is_dir) in read(&model_path)? {
                        if is_dir {
                            continue;
                        }
                        match ModelName::parse(&format!("{registry}/{namespace}/{model}:{tag}")) {
                            Ok(name) => {
                                names.insert(name);
                            }
                            Err(e) => tracing::warn!(error = %e, "skipping a manifest with an invalid name"),
                        }
                    }
                }
            }
        }
        Ok(names)
    }

    /// Copies a model under a new name (the manifest only; blobs are shared).
    pub fn copy(&self, from: &ModelName, to: &ModelName) -> Result<(), StoreError> {
        let (manifest, _, _) = self.manifest(from)?;
        let bytes = fs::read(self.manifest_path(from)).map_err(io_err("cannot read the source manifest"))?;
        let _pin = self.pin(manifest.blobs().map(|l| l.digest));
        self.write_manifest_bytes(to, &bytes, &manifest)?;
        Ok(())
    }

    /// Deletes a model; its blobs go too unless another manifest or a running operation
    /// needs them. Returns the blobs removed.
    pub fn delete(&self, name: &ModelName) -> Result<Vec<Digest>, StoreError> {
        let (manifest, _, _) = self.manifest(name)?;
        let path = self.manifest_path(name);
        fs::remove_file(&path).map_err(io_err(format!("cannot remove {}", path.display())))?;
        self.changed();
        // Empty model and namespace directories go with their last manifest.
        let mut dir = path.parent().map(Path::to_path_buf);
        while let Some(d) = dir {
            if d == self.manifests_dir() || fs::remove_dir(&d).is_err() {
                break;
            }
            dir = d.parent().map(Path::to_path_buf);
        }
        self.remove_unreferenced(manifest.blobs().map(|l| l.digest).collect())
    }

    /// Removes those of `candidates` that no manifest refers to and nothing has pinned.
    fn remove_unreferenced(&self, candidates: BTreeSet<Digest>) -> Result<Vec<Digest>, StoreError> {
        // Holding the pin table while deciding: an operation pins before it writes a
        // manifest, so a blob is either pinned here or named by a manifest on disk.
        let pins = self.pins.lock().unwrap_or_else(PoisonError::into_inner);
        let mut referenced = BTreeSet::new();
        for listed in self.list()? {
            referenced.extend(listed.manifest.blobs().map(|l| l.digest));
        }
        let mut removed = Vec::new();
        for digest in candidates {
            if referenced.contains(&digest) || pins.contains_key(&digest) {
                continue;
            }
            match fs::remove_file(self.blob_path(&digest)) {
                Ok(()) => removed.push(digest),
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(io_err(format!("cannot remove blob {digest}"))(e)),
            }
        }
        drop(pins);
        Ok(removed)
    }
}

/// Removes temporary files (`.tmp-*`) below `dir`: what a crash left mid-write.
fn remove_temporaries(dir: &Path) -> Result<(), StoreError> {
    for entry in fs::read_dir(dir).map_err(io_err(format!("cannot read {}", dir.display())))? {
        let entry = entry.map_err(io_err(format!("cannot read {}", dir.display())))?;
        let path = entry.path();
        if entry.file_name().to_string_lossy().starts_with(TEMP_PREFIX) {
            tracing::info!(path = %path.display(), "removing a temporary file left by an interrupted write");
            let _ = fs::remove_file(&path);
        } else if entry.file_type().is_ok_and(|t| t.is_dir()) {
            remove_temporaries(&path)?;
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

fn sync_dir(dir: &Path) -> Result<(), StoreError> {
    File::open(dir).and_then(|d| d.sync_all()).map_err(io_err(format!("cannot sync {}", dir.display())))
}

#[cfg(test)]
mod create_tests;
#[cfg(test)]
mod tests;
