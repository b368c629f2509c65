//! Files from outside the store, and other stores' models (an Ollama models directory),
//! added without storing their data twice where the file system allows: a reflink, else a
//! hard link, else a copy; every digest checked, in the same pass over the data. Also the
//! files callers pass open ([`PassedFile`]).

use std::fs::{self, File};
use std::io::Seek;
use std::path::Path;

use super::beneath::Dir;
use super::digest::Digest;
use super::name::ModelName;
use super::passed::{At, PassedFile};
use super::stream::{IdleClock, copy_hashed_aligned};
use super::temp::readable;
use super::{Pin, Store, StoreError, io_err};

impl Store {
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
                let size = source.metadata().map_err(io_err(format!("cannot read blob {}", layer.digest)))?.len();
                let (_, _, _, pin) = self.import_open(
                    &source,
                    size,
                    link,
                    &layer.digest.to_string(),
                    Some(&layer.digest),
                    &mut |_, _, _| {},
                )?;
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

    /// Adds a file on disk as a blob without storing its data twice where the file system
    /// allows: a reflink (copy-on-write clone) first, then a hard link, else a copy.
    /// With a hard link the store shares the file's inode, so editing the original in
    /// place would change the blob; [`Store::verify_blob`] detects that. With `expected`,
    /// a file that hashes to something else is refused and nothing is written.
    pub fn import_file(&self, path: &Path, expected: Option<&Digest>) -> Result<(Digest, u64), StoreError> {
        self.import_file_tracked(path, expected, &mut |_, _, _| {}).map(|(digest, size, _, _)| (digest, size))
    }

    /// [`Store::import_file`], also saying whether the blob is new to the store, and
    /// pinning it (before it is put in place); `reading` hears how far the file is read:
    /// what is done (`checking`: hashed only; `copying`), bytes done, bytes in all.
    pub(crate) fn import_file_tracked(
        &self,
        path: &Path,
        expected: Option<&Digest>,
        reading: &mut dyn FnMut(&str, u64, u64),
    ) -> Result<(Digest, u64, bool, Pin), StoreError> {
        // The file is outside the store, named by whoever asked: its links are theirs to
        // use. It is linked by its real path, so the store gets the file, not a link.
        let what = path.display().to_string();
        let open = || io_err(format!("cannot open {what}"));
        let real = fs::canonicalize(path).map_err(open())?;
        let (file, size) = super::passed::open_regular(&real, &what)?;
        self.import_open(&file, size, Some((None, &real)), &what, expected, reading)
    }

    /// Imports a file a caller passed open ([`PassedFile`]): a reflink where the file system
    /// allows, else a copy of the bytes it had when it was checked.
    pub(crate) fn import_passed(
        &self,
        passed: &PassedFile,
        reading: &mut dyn FnMut(&str, u64, u64),
    ) -> Result<(Digest, u64, bool, Pin), StoreError> {
        self.import_open(passed.file(), passed.size(), None, passed.name(), None, reading)
    }

    /// Imports the first `size` bytes of the open file `source`, which `link` names for a
    /// hard link (a directory of another store and a name in it, or an absolute path);
    /// `what` names it in errors. The file is read at positions of its own: its offset is
    /// left alone (a passed file shares it with its caller).
    ///
    /// One pass over the data: a reflink or a hard link is hashed once made (what is hashed
    /// is what gets named), and a copy is hashed as it is written.
    fn import_open(
        &self,
        source: &File,
        size: u64,
        link: Option<(Option<&Dir>, &Path)>,
        what: &str,
        expected: Option<&Digest>,
        reading: &mut dyn FnMut(&str, u64, u64),
    ) -> Result<(Digest, u64, bool, Pin), StoreError> {
        let blobs = self.blobs()?;
        let mut temp = self.temp_in(&blobs)?;
        let cloned = rustix::fs::ioctl_ficlone(temp.as_file(), source).is_ok();
        let linked = !cloned && link.is_some_and(|(dir, path)| temp.link_from(dir, path).is_ok());
        let (digest, length) = if cloned || linked {
            let mut placed = temp.as_file();
            placed.rewind().map_err(io_err("cannot read the imported blob"))?;
            Digest::of_reader(placed).map_err(io_err(format!("cannot read {what}")))?
        } else {
            if holds_blob_of_size(&blobs, size) {
                // Most likely the same file again (a model re-created with other
                // parameters): hashed first, read only, it needs no copy when it is.
                let checking = &mut |done| reading("checking", done, size);
                let (digest, _) = read_hashed(source, size, what, &mut |_| Ok(()), checking, &IdleClock::new())?;
                let pin = self.pin([digest]);
                if self.has_blob(&digest) && expected.is_none_or(|e| *e == digest) {
                    return Ok((digest, size, false, pin));
                }
            }
            temp.reset().map_err(io_err(format!("cannot write {}", temp.rel())))?;
            if self.direct_io() {
                // Where the file system has no direct I/O, the page cache.
                temp.direct();
            }
            // The disk is the slower part only while the hash waits for it.
            let hash_waits = temp.pace_by_hash();
            let rel = temp.rel();
            let mut write_failed = false;
            let mut write = |data: &[u8]| temp.append(data).inspect_err(|_| write_failed = true);
            let copying = &mut |done| reading("copying", done, size);
            let read = read_hashed(source, size, what, &mut write, copying, &hash_waits);
            read.map_err(|e| match e {
                StoreError::Io { source, .. } if write_failed => {
                    StoreError::Io { context: format!("cannot write {rel}"), source }
                }
                e => e,
            })?
        };
        if let Some(expected) = expected {
            if *expected != digest {
                return Err(StoreError::DigestMismatch { expected: *expected, actual: digest });
            }
        }
        let pin = self.pin([digest]);
        if self.has_blob(&digest) {
            return Ok((digest, length, false, pin));
        }
        if linked {
            // The caller's own file, on the disk already: only its new name is synced.
            temp.place(&blobs, &digest.file_name())?;
            blobs.sync().map_err(io_err("cannot sync blobs/"))?;
        } else {
            // The store's own copy: readable like every blob.
            readable(temp.as_file())?;
            self.name_blob(temp, &blobs, &digest)?;
        }
        Ok((digest, length, true, pin))
    }
}

/// Reads the first `size` bytes of `source` (at positions of its own) into `write`,
/// hashing them as they go ([`copy_hashed_aligned`]); `read` hears how far it is, and
/// `hash_waits` counts the hash's waits for `write`. A file shorter than `size` is an
/// error: it shrank since it was looked at.
fn read_hashed(
    source: &File,
    size: u64,
    what: &str,
    write: &mut (dyn FnMut(&[u8]) -> std::io::Result<()> + Send),
    read: &mut dyn FnMut(u64),
    hash_waits: &IdleClock,
) -> Result<(Digest, u64), StoreError> {
    let (digest, length) = copy_hashed_aligned(At::new(source, size), write, read, hash_waits)
        .map_err(|source| StoreError::Io { context: format!("cannot read {what}"), source })?;
    if length < size {
        return Err(StoreError::Invalid(format!(
            "{what} shrank while it was read: {length} of its {size} bytes were there"
        )));
    }
    Ok((digest, length))
}

/// Whether a blob in `blobs` has `size` bytes. A file of a size no blob has is new to the
/// store for sure, so it is copied as it is hashed, in one pass.
fn holds_blob_of_size(blobs: &Dir, size: u64) -> bool {
    let Ok(entries) = blobs.entries() else { return false };
    entries
        .iter()
        .filter(|entry| Digest::parse(&entry.name).is_ok_and(|d| d.file_name() == entry.name))
        .any(|entry| blobs.stat(&entry.name).ok().flatten().is_some_and(|meta| meta.len == size))
}
