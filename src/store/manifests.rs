//! Manifests: written last and atomically, read from one open file, copied, and deleted
//! with the blobs no other manifest or running operation needs.

use crate::sync::lock;
use std::collections::BTreeSet;
use std::fs::File;
use std::io::{Read, Write};
use std::time::SystemTime;

use super::beneath::{self, Dir, Kind, Meta};
use super::digest::Digest;
use super::manifest::Manifest;
use super::name::ModelName;
use super::temp::readable;
use super::{Store, StoreError, fs_err, io_err, limits, vanished};

/// A manifest file's identity: inode, size, modification time. The listing and the
/// details cache keep what they read of a manifest until its identity changes.
pub(super) type FileId = (u64, u64, SystemTime);

/// The identity of the file `meta` describes.
pub(super) fn file_id(meta: &Meta) -> FileId {
    (meta.ino, meta.len, meta.modified)
}

impl Store {
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
        // What the store would refuse to read back is not written.
        if bytes.len() as u64 > limits::MANIFEST_MAX {
            return Err(limits::TooLarge::manifest(&name.to_string(), bytes.len() as u64).into());
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

    /// The manifest file's identity, without reading it.
    pub(crate) fn manifest_identity(&self, name: &ModelName) -> Result<FileId, StoreError> {
        // Every request asks this: one path lookup where it can be, else the walk.
        let parts = ["manifests", name.registry(), name.namespace(), name.model(), name.tag()];
        if let Some(meta) = self.dir.quick_stat(&parts).filter(|meta| meta.kind == Kind::File) {
            return Ok(file_id(&meta));
        }
        let not_found = || StoreError::NotFound(name.to_string());
        let [.., dir] = self.model_dirs(name)?.ok_or_else(not_found)?;
        let path = dir.rel(name.tag());
        match dir.stat(name.tag()).map_err(fs_err("read", path.clone()))? {
            None => Err(not_found()),
            Some(meta) if meta.kind == Kind::File => Ok(file_id(&meta)),
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
            lock(&self.details).remove(name);
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
    pub(super) fn remove_unreferenced(&self, candidates: BTreeSet<Digest>) -> Vec<Digest> {
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

    /// Every digest any file below `manifests/` names, found in its bytes: a manifest that
    /// does not parse still keeps its blobs. Fails when a manifest cannot be read, since
    /// then nobody can tell which blobs are unused.
    pub(super) fn references(&self) -> Result<BTreeSet<Digest>, StoreError> {
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
}

/// Reads a manifest file (at most [`limits::MANIFEST_MAX`]) and its modification time.
pub(super) fn read_manifest_file(file: File, path: &str) -> Result<(Vec<u8>, SystemTime), StoreError> {
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
