//! Listing the models: every manifest file four levels below `manifests/`, parsed, sorted
//! by name; what cannot be read is skipped with a warning.
//!
//! The listing is kept in memory ([`Index`]) with each manifest file's identity (inode,
//! size, modification time) and its config blob's facts, so that a listing reads no file:
//! a change made through this store (or a clone) drops it, and one older than
//! [`REVALIDATE_AFTER`] is checked against the directory tree (one `stat` a manifest; only
//! the manifests whose identity changed are read again), so that changes made behind
//! corrald's back (an Ollama directory used as is) show within that time. Blobs never
//! change under their digest, so the config read once stays true.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Instant, SystemTime};

use super::beneath::{Dir, Kind};
use super::digest::Digest;
use super::manifest::{Manifest, ModelConfig};
use super::manifests::{FileId, file_id, read_manifest_file};
use super::name::ModelName;
use super::show::BlobFacts;
use super::{Store, StoreError, fs_err, vanished};
use crate::sync::lock;

/// How long a listing is trusted without looking at the directory tree, when nothing
/// changed through this store: what another program wrote shows after at most this long.
pub const REVALIDATE_AFTER: std::time::Duration = std::time::Duration::from_secs(1);

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
    /// Its config blob's facts (format, family, size, quantization); empty ones when the
    /// blob cannot be read, as Ollama lists such a model.
    pub config: ModelConfig,
}

/// The listing kept between calls (see the module documentation).
#[derive(Debug, Default)]
pub(super) struct Index {
    /// The store's change count when the walk began, and when it ended; `None`: never built.
    pub(super) built: Option<(u64, Instant)>,
    /// Every model listed, by name, with its manifest file's identity.
    pub(super) entries: HashMap<ModelName, (FileId, Arc<Listed>)>,
    /// Whether the entries changed since they were last saved or loaded
    /// (`saved_listing.rs`).
    pub(super) unsaved: bool,
    /// Whether the entries are the saved listing, not yet checked by a walk: trusted only
    /// for [`REVALIDATE_AFTER`], watched or not (inotify saw nothing while corrald was down).
    pub(super) unchecked: bool,
    /// Manifests read (parsed, hashed, config read) so far: what tests check.
    reads: u64,
    /// Walks of the tree so far, and the saved listing if one was loaded: the listing's
    /// generation (the same count, the same listing; `/api/tags` keeps its body by it),
    /// and what tests check.
    pub(super) walks: u64,
    /// The blob facts read so far, by manifest digest ([`Store::blob_facts`]); saved with
    /// the entries, for the digests they name.
    pub(super) facts: HashMap<Digest, BlobFacts>,
}

impl Index {
    /// Makes the next listing walk the tree (the entries stay, to spare the reads).
    pub(super) fn forget(&mut self) {
        self.built = None;
    }
}

impl Store {
    /// Every model, sorted by name. Files that are not valid manifests are skipped with a
    /// warning; entries that vanish while the listing runs (a concurrent delete) are left out.
    /// From the in-memory index when it is current (no file read), else the tree is walked
    /// and only new or changed manifests are read.
    pub fn list(&self) -> Result<Vec<Listed>, StoreError> {
        Ok(self.list_shared()?.iter().map(|l| Listed::clone(l)).collect())
    }

    /// [`Store::list`] without copying the entries: what the listings of a large store use.
    pub fn list_shared(&self) -> Result<Vec<Arc<Listed>>, StoreError> {
        Ok(self.list_generation()?.1)
    }

    /// [`Store::list_shared`] and the index's generation it was made from: the count of
    /// walks of the tree, so that the same generation means the same listing (a view
    /// can keep what it made of one).
    pub fn list_generation(&self) -> Result<(u64, Vec<Arc<Listed>>), StoreError> {
        // What other programs changed counts as a change (when inotify reports it).
        self.notice_outside_changes();
        let mut index = lock(&self.index);
        if !self.is_current(&index) {
            // The count is read before the walk: a change that lands during it makes the
            // next listing walk again.
            let count = *self.changes.borrow();
            let saved_was_wrong = self.refresh(&mut index)?;
            index.built = Some((self.counted(count, saved_was_wrong), Instant::now()));
        }
        let generation = index.walks;
        let mut listed: Vec<Arc<Listed>> = index.entries.values().map(|(_, l)| Arc::clone(l)).collect();
        drop(index);
        listed.sort_by(|a, b| a.name.cmp(&b.name));
        Ok((generation, listed))
    }

    /// The index's generation when it is current and free, without touching the disk
    /// (inotify's queue aside); `None` when a listing would walk the tree, or one is.
    /// For the async threads: a view that kept what it made of this generation is done.
    #[must_use]
    pub fn current_generation(&self) -> Option<u64> {
        self.notice_outside_changes();
        let index = self.index.try_lock().ok()?;
        self.is_current(&index).then_some(index.walks)
    }

    /// Whether `index` shows the tree as it is: built since the last change counted, and
    /// watched by inotify or younger than [`REVALIDATE_AFTER`].
    fn is_current(&self, index: &Index) -> bool {
        let count = *self.changes.borrow();
        let watched = self.watching() && !index.unchecked;
        index.built.is_some_and(|(at, when)| at == count && (watched || when.elapsed() < REVALIDATE_AFTER))
    }

    /// The [`BlobFacts`] of the listed model `listed`: kept by its manifest's digest (and
    /// taken from the saved listing at start), else read from its details (the GGUF
    /// header: blocking) and kept. A model whose details cannot be read (its weights
    /// missing or damaged) has empty facts, not kept: the blobs may come later.
    pub fn blob_facts(&self, listed: &Listed) -> BlobFacts {
        if let Some(kept) = lock(&self.index).facts.get(&listed.digest) {
            return kept.clone();
        }
        match self.details(&listed.name) {
            // Kept under the digest the details were read from: the manifest may have
            // changed since it was listed.
            Ok(details) => {
                let facts = details.blob_facts();
                let mut index = lock(&self.index);
                index.facts.insert(details.digest, facts.clone());
                index.unsaved = true;
                // Bounded by the models listed: those of manifests gone (models deleted or
                // rewritten) go once they are as many as the rest.
                if index.facts.len() > 2 * index.entries.len() + 16 {
                    let Index { facts: kept, entries, .. } = &mut *index;
                    let named: HashSet<Digest> = entries.values().map(|(_, listed)| listed.digest).collect();
                    kept.retain(|digest, _| named.contains(digest));
                }
                facts
            }
            Err(e) => {
                tracing::debug!(corral_model = %listed.name, error = %e, "cannot read the details of {}: {e}", listed.name);
                BlobFacts::default()
            }
        }
    }

    /// How many manifests the index has read since the store was opened (a listing that
    /// finds the index current reads none).
    #[must_use]
    pub fn manifests_read(&self) -> u64 {
        lock(&self.index).reads
    }

    /// The index's generation: how many times listings have walked the tree since the
    /// store was opened, plus one for a saved listing loaded (a walk that finds it right
    /// does not count).
    #[must_use]
    pub fn tree_walks(&self) -> u64 {
        lock(&self.index).walks
    }

    /// Checks the saved listing taken at start ([`Store::load_listing`]) against the tree,
    /// if it was not yet: one walk, which reads only the manifests changed since it was
    /// saved. Blocks: for the blocking threads.
    pub fn check_listing(&self) -> Result<(), StoreError> {
        // The walk works on a copy, so that listings meanwhile get the saved one at once.
        let (count, mut checked) = {
            let index = lock(&self.index);
            if !index.unchecked {
                return Ok(());
            }
            let copy =
                Index { entries: index.entries.clone(), unchecked: true, walks: index.walks, ..Index::default() };
            (*self.changes.borrow(), copy)
        };
        let saved_was_wrong = self.refresh(&mut checked)?;
        let count = self.counted(count, saved_was_wrong);
        let mut index = lock(&self.index);
        // Unless a listing walked meanwhile (the saved one had expired).
        if index.unchecked {
            index.entries = checked.entries;
            // Found right, the saved listing keeps its generation: views made of it hold.
            if saved_was_wrong {
                index.walks = checked.walks;
            }
            index.reads += checked.reads;
            index.unsaved |= checked.unsaved;
            index.unchecked = false;
            index.built = Some((count, Instant::now()));
        }
        Ok(())
    }

    /// The change count a walk that began at `count` brings the index up to. A walk that
    /// found the saved listing wrong (changes made while corrald was down) counts as a
    /// change, so that the views following the store look again; the walk itself already
    /// shows it, unless another change landed meanwhile.
    fn counted(&self, count: u64, saved_was_wrong: bool) -> u64 {
        if !saved_was_wrong {
            return count;
        }
        self.changed();
        let now = *self.changes.borrow();
        if now == count + 1 { now } else { count }
    }

    /// Walks the tree: keeps the entries whose manifest file is unchanged, reads the others.
    /// Returns whether it checked a saved listing and found it wrong.
    fn refresh(&self, index: &mut Index) -> Result<bool, StoreError> {
        index.walks += 1;
        let checking = std::mem::take(&mut index.unchecked);
        let mut seen: HashMap<ModelName, (FileId, Arc<Listed>)> = HashMap::with_capacity(index.entries.len());
        let mut reads = 0;
        let walked = self.walk_manifests(&mut |dir, parts, tag| {
            let name = match ModelName::parse(&format!("{}/{}/{}:{tag}", parts[0], parts[1], parts[2])) {
                Ok(name) => name,
                Err(e) => {
                    tracing::warn!(error = %e, "skipping a manifest with an invalid name");
                    return;
                }
            };
            let path = dir.rel(tag);
            let id = match dir.stat(tag) {
                Ok(Some(meta)) if meta.kind == Kind::File => file_id(&meta),
                Ok(_) => return,
                Err(e) if vanished(&e) => return,
                Err(e) => return tracing::warn!(path, error = %e, "skipping an unreadable manifest"),
            };
            if let Some((known, listed)) = index.entries.remove(&name) {
                if known == id {
                    seen.insert(name, (id, listed));
                    return;
                }
            }
            reads += 1;
            let read = dir.open(tag).map_err(fs_err("read", path.clone())).and_then(|f| read_manifest_file(f, &path));
            match read {
                Ok((bytes, modified)) => match Manifest::parse(&bytes) {
                    Ok(manifest) => {
                        let listed = Listed {
                            size: manifest.size(),
                            digest: Digest::of(&bytes),
                            config: self.model_config(&manifest),
                            name: name.clone(),
                            modified,
                            manifest,
                        };
                        seen.insert(name, (id, Arc::new(listed)));
                    }
                    Err(source) => {
                        let e = StoreError::Manifest { name: name.to_string(), source };
                        tracing::warn!(error = %e, "skipping an unreadable manifest");
                    }
                },
                Err(StoreError::Io { source, .. }) if vanished(&source) => {}
                Err(e) => tracing::warn!(error = %e, "skipping an unreadable manifest"),
            }
        });
        if let Err(e) = walked {
            // Not checked after all: the saved listing stays trusted only briefly.
            index.unchecked = checking;
            return Err(e);
        }
        // Entries left over are models gone since the last walk.
        let differs = reads > 0 || !index.entries.is_empty();
        index.unsaved |= differs;
        index.entries = seen;
        index.reads += reads;
        Ok(checking && differs)
    }

    /// Calls `visit` with the model directory, the registry, namespace and model, and the
    /// tag of every file four levels below `manifests/`. Names starting with `.` are
    /// skipped, links are skipped with a warning, and a directory that vanishes on the
    /// way (a concurrent delete) is skipped; one that cannot be read is skipped with a
    /// warning. Only `manifests/` itself must be readable.
    /// Each directory is watched (where the store watches) before its entries are read.
    fn walk_manifests(&self, visit: &mut dyn FnMut(&Dir, [&str; 3], &str)) -> Result<(), StoreError> {
        // The names of `dir`'s subdirectories (it is watched first), opened one at a time
        // as the walk reaches them: holding them all open made a walk take one descriptor
        // per model, and a store of more models than the descriptor limit lost models.
        fn subdirs(store: &Store, dir: &Dir) -> std::io::Result<Vec<String>> {
            store.watch_dir(dir);
            let mut out = Vec::new();
            for entry in dir.entries()? {
                if entry.name.starts_with('.') {
                    continue;
                }
                match entry.kind {
                    Kind::Dir => out.push(entry.name),
                    Kind::Symlink => {
                        tracing::warn!(path = dir.rel(&entry.name), "skipping a symbolic link among the manifests");
                    }
                    _ => {}
                }
            }
            Ok(out)
        }
        // Below `manifests/`, a directory that cannot be read is skipped.
        fn subdirs_or_none(store: &Store, dir: &Dir) -> Vec<String> {
            subdirs(store, dir).unwrap_or_else(|e| {
                if !vanished(&e) {
                    tracing::warn!(dir = dir.path(), error = %e, "skipping an unreadable manifest directory");
                }
                Vec::new()
            })
        }
        fn open(dir: &Dir, name: &str) -> Option<Dir> {
            match dir.dir(name) {
                Ok(sub) => Some(sub),
                Err(e) if vanished(&e) => None,
                Err(e) => {
                    tracing::warn!(path = dir.rel(name), error = %e, "skipping a manifest directory");
                    None
                }
            }
        }
        let manifests = self.manifests()?;
        let registries = subdirs(self, &manifests).map_err(fs_err("read", "manifests".to_owned()))?;
        for registry in registries {
            let Some(registry_dir) = open(&manifests, &registry) else { continue };
            for namespace in subdirs_or_none(self, &registry_dir) {
                let Some(namespace_dir) = open(&registry_dir, &namespace) else { continue };
                for model in subdirs_or_none(self, &namespace_dir) {
                    let Some(model_dir) = open(&namespace_dir, &model) else { continue };
                    self.watch_dir(&model_dir);
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
}

#[cfg(test)]
impl Store {
    /// Makes the index look `by` older than it is.
    pub(super) fn age_index(&self, by: std::time::Duration) {
        let mut index = lock(&self.index);
        if let Some((at, when)) = index.built {
            index.built = Some((at, when.checked_sub(by).unwrap_or(when)));
        }
    }
}

#[cfg(test)]
pub(super) mod tests {
    use std::time::{Duration, Instant};

    use super::super::Store;
    use super::super::manifest::{self, Layer, Manifest};
    use super::super::name::ModelName;

    pub(in crate::store) fn name(s: &str) -> ModelName {
        ModelName::parse(s).expect("name")
    }

    /// A model whose config says it is a llama, written through the store.
    pub(in crate::store) fn add_model(store: &Store, model: &str, weights: &[u8]) -> Manifest {
        let layer = |media_type: &str, data: &[u8]| {
            let (digest, size) = store.write_blob(data, None).expect("blob");
            Layer { media_type: media_type.into(), digest, size, from: None }
        };
        let config = br#"{"model_format":"gguf","model_family":"llama","file_type":"F16"}"#;
        let m = Manifest::new(layer(manifest::CONFIG_MEDIA_TYPE, config), vec![layer(manifest::MODEL, weights)])
            .expect("weights");
        store.write_manifest(&name(model), &m).expect("manifest");
        m
    }

    #[test]
    fn the_blob_facts_kept_are_bounded_by_the_models_listed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::open(dir.path()).expect("open");
        let weights = crate::demo_model::tiny_llama_bytes().expect("the tiny llama");
        let (digest, size) = store.write_blob(&weights[..], None).expect("weights");
        let weights = Layer { media_type: manifest::MODEL.into(), digest, size, from: None };
        // One model rewritten again and again, each time another manifest (its config
        // differs), each manifest's facts read.
        for i in 0..60 {
            let config = format!(r#"{{"model_format":"gguf","model_family":"llama","model_type":"{i}M"}}"#);
            let (digest, size) = store.write_blob(config.as_bytes(), None).expect("config");
            let config = Layer { media_type: manifest::CONFIG_MEDIA_TYPE.into(), digest, size, from: None };
            let m = Manifest::new(config, vec![weights.clone()]).expect("manifest");
            store.write_manifest(&name("m"), &m).expect("write");
            let listed = store.list().expect("list");
            assert_eq!(store.blob_facts(&listed[0]).context_length, 2048);
            let kept = crate::sync::lock(&store.index).facts.len();
            assert!(kept <= 2 + 16, "{kept} manifests' facts kept for one model");
        }
    }

    #[test]
    fn a_listing_reads_no_file_once_indexed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::open(dir.path()).expect("open");
        let m = add_model(&store, "a", b"weights of a");
        let first = store.list().expect("list");
        assert_eq!(first.len(), 1);
        assert_eq!((first[0].config.model_family.as_str(), first[0].config.file_type.as_str()), ("llama", "F16"));
        assert_eq!(store.manifests_read(), 1);
        // Every blob gone (the weights' GGUF header and the config included): a listing
        // that read any of them would now show empty details or fail.
        for layer in m.blobs() {
            std::fs::remove_file(store.blob_path(&layer.digest)).expect("remove a blob");
        }
        let again = store.list().expect("list");
        assert_eq!(again, first, "listed from the index");
        assert_eq!(store.manifests_read(), 1, "no manifest read again");
    }

    pub(in crate::store) fn listed_names(store: &Store) -> Vec<String> {
        store.list().expect("list").iter().map(|l| l.name.to_string()).collect()
    }

    #[test]
    fn changes_through_the_store_show_at_once_and_only_they_are_read() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::open(dir.path()).expect("open");
        add_model(&store, "a", b"weights of a");
        assert_eq!(store.list().expect("list").len(), 1);
        add_model(&store, "b", b"weights of b");
        assert_eq!(listed_names(&store), ["a:latest", "b:latest"]);
        assert_eq!(store.manifests_read(), 2, "the unchanged manifest of a is not read again");
        store.delete(&name("a")).expect("delete");
        assert_eq!(listed_names(&store), ["b:latest"]);
        assert_eq!(store.manifests_read(), 2);
    }

    #[test]
    fn a_manifest_written_by_another_program_shows_within_the_revalidation_time() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::open(dir.path()).expect("open");
        add_model(&store, "a", b"weights of a");
        assert_eq!(store.list().expect("list").len(), 1);
        // Another program (Ollama on the same directory) adds a tag behind corrald's back.
        let copy = store.manifest_path(&name("a:other"));
        std::fs::copy(store.manifest_path(&name("a")), &copy).expect("copy the manifest");
        let deadline = Instant::now() + super::REVALIDATE_AFTER + Duration::from_secs(10);
        while store.list().expect("list").len() < 2 {
            assert!(Instant::now() < deadline, "the new manifest never showed");
            std::thread::sleep(Duration::from_millis(50));
        }
        assert_eq!(store.manifests_read(), 2, "only the new manifest was read");
    }
}
