//! Blobs: looked up, read, written (checked against their digest before they are named)
//! and verified.

use std::fs::File;
use std::io;
use std::path::PathBuf;
use std::time::SystemTime;

use super::beneath::Kind;
use super::digest::Digest;
use super::temp::{TempFile, readable};
use super::{Pin, Store, StoreError, fs_err, io_err, limits, vanished};

impl Store {
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
        // Every request asks this: one path lookup where it can be, else the walk (which
        // also says why a blob is refused).
        let name = digest.file_name();
        let regular = self.dir.quick_stat(&["blobs", &name]).is_some_and(|meta| meta.kind == Kind::File);
        if !regular {
            drop(self.open_blob(digest)?);
        }
        Ok(self.blobs_dir().join(name))
    }

    /// A new temporary file in `blobs/`, for data on its way to becoming a blob.
    pub fn temp_blob_file(&self) -> Result<TempFile, StoreError> {
        self.temp_in(&self.blobs()?)
    }

    /// [`Store::temp_blob_file`] for an upload's aligned batches: open for direct I/O where
    /// the file system has it and `[store] direct_io` is on.
    pub fn upload_blob_file(&self) -> Result<TempFile, StoreError> {
        let mut file = self.temp_blob_file()?;
        if self.direct_io() {
            // Where the file system has no direct I/O, the page cache.
            file.direct();
        }
        Ok(file)
    }

    /// Moves a fully written temporary file into place as blob `digest` (synced before,
    /// or after in the background: [`Store::with_blob_syncs`]).
    pub fn commit_blob(&self, temp: TempFile, digest: &Digest) -> Result<(), StoreError> {
        readable(temp.as_file())?;
        self.name_blob(temp, &self.blobs()?, digest)
    }

    /// Stores `data` (a config, a text layer: small, in memory) as a blob, unless the store
    /// has it. With `expected`, data that hashes to something else is refused and nothing
    /// is written.
    pub fn write_blob(&self, data: &[u8], expected: Option<&Digest>) -> Result<(Digest, u64), StoreError> {
        self.write_blob_pinned(data, expected).map(|(digest, size, _)| (digest, size))
    }

    /// [`Store::write_blob`], the blob pinned before it is put in place: an operation that
    /// will refer to it never loses it to a garbage collection in between.
    pub fn write_blob_pinned(&self, data: &[u8], expected: Option<&Digest>) -> Result<(Digest, u64, Pin), StoreError> {
        let digest = Digest::of(data);
        if let Some(expected) = expected {
            if *expected != digest {
                return Err(StoreError::DigestMismatch { expected: *expected, actual: digest });
            }
        }
        let pin = self.pin([digest]);
        if !self.has_blob(&digest) {
            let mut temp = self.temp_blob_file()?;
            temp.append(data).map_err(io_err(format!("cannot write {}", temp.rel())))?;
            self.commit_blob(temp, &digest)?;
        }
        Ok((digest, data.len() as u64, pin))
    }

    /// Checks that a blob still hashes to its name.
    pub fn verify_blob(&self, digest: &Digest) -> Result<(), StoreError> {
        let file = self.open_blob(digest)?;
        let (actual, _) = Digest::of_reader(io::BufReader::new(file))
            .map_err(io_err(format!("cannot read blob {digest} in the model store")))?;
        if actual == *digest { Ok(()) } else { Err(StoreError::DigestMismatch { expected: *digest, actual }) }
    }
}
