//! Projections already asked for, by [`ProjectionKey`], kept in the state directory next
//! to the learned footprints so that a restart does not ask llama.cpp again.
//!
//! Owned by one task (the scheduler's): reads are in memory, and a change returns the
//! file write to do elsewhere ([`PendingWrite`]), as the footprints do.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::key::ProjectionKey;
use super::parse::Projection;
use crate::state_file::PendingWrite;

/// The most projections kept; recording one more drops the one recorded longest ago.
pub const MAX_ENTRIES: usize = 1024;

/// The file's format; a file of another version is ignored (the cache fills again).
const VERSION: u32 = 2;

/// What the warnings call this file's data.
const WHAT: &str = "cached memory projections";

/// Projections by key, optionally backed by a file.
#[derive(Debug, Default)]
pub struct ProjectionCache {
    path: Option<PathBuf>,
    /// Each projection with the order it was recorded in (higher is newer).
    map: BTreeMap<ProjectionKey, (u64, Projection)>,
    next: u64,
}

/// The file: the entries oldest first.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    version: u32,
    entries: Vec<Entry>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Entry {
    key: ProjectionKey,
    projection: Projection,
}

/// [`File`] as written, borrowing the cache's data.
#[derive(Serialize)]
struct FileRef<'a> {
    version: u32,
    entries: Vec<EntryRef<'a>>,
}

#[derive(Serialize)]
struct EntryRef<'a> {
    key: &'a ProjectionKey,
    projection: &'a Projection,
}

impl ProjectionCache {
    /// A cache kept in memory only (tests, read-only state).
    #[must_use]
    pub fn in_memory() -> Self {
        Self::default()
    }

    /// The cache persisted at `path`; a missing file starts empty, and so does an
    /// unreadable or damaged one or one of another version (with a warning): projections
    /// are then asked for again.
    #[must_use]
    pub fn load(path: PathBuf) -> Self {
        let file: File = crate::state_file::load(&path, WHAT);
        if file.version != VERSION && !file.entries.is_empty() {
            tracing::warn!(
                path = %path.display(),
                version = file.version,
                "ignoring {WHAT} of format {} (this corrald writes {VERSION})",
                file.version
            );
            return Self { path: Some(path), ..Self::default() };
        }
        let mut cache = Self { path: Some(path), ..Self::default() };
        let skip = file.entries.len().saturating_sub(MAX_ENTRIES);
        for entry in file.entries.into_iter().skip(skip) {
            cache.insert(entry.key, entry.projection);
        }
        cache
    }

    /// The projection recorded for `key`.
    #[must_use]
    pub fn get(&self, key: &ProjectionKey) -> Option<&Projection> {
        self.map.get(key).map(|(_, projection)| projection)
    }

    /// How many projections are kept.
    #[must_use]
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether none is.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Records a projection (the newest, dropping the oldest beyond [`MAX_ENTRIES`]);
    /// returns the file write to do off the owning task, or `None` when there is no file
    /// or the same projection was already recorded for `key`.
    pub fn record(&mut self, key: ProjectionKey, projection: Projection) -> Option<PendingWrite> {
        let unchanged = self.get(&key) == Some(&projection);
        self.insert(key, projection);
        if unchanged {
            return None;
        }
        let path = self.path.clone()?;
        let mut entries: Vec<(u64, EntryRef<'_>)> =
            self.map.iter().map(|(key, (order, projection))| (*order, EntryRef { key, projection })).collect();
        entries.sort_unstable_by_key(|(order, _)| *order);
        let file = FileRef { version: VERSION, entries: entries.into_iter().map(|(_, entry)| entry).collect() };
        Some(PendingWrite::new(path, &file, WHAT))
    }

    fn insert(&mut self, key: ProjectionKey, projection: Projection) {
        let order = self.next;
        self.next += 1;
        self.map.insert(key, (order, projection));
        if self.map.len() > MAX_ENTRIES {
            // The oldest: a scan of at most MAX_ENTRIES + 1, only when the cache is full.
            let oldest = self.map.iter().min_by_key(|(_, (order, _))| *order).map(|(key, _)| key.clone());
            if let Some(oldest) = oldest {
                self.map.remove(&oldest);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{MAX_ENTRIES, ProjectionCache};
    use crate::projection::key::key;
    use crate::projection::parse::Projection;

    fn projection(compute_mib: u32) -> Projection {
        Projection::parse(format!("RPC0 12 3 {compute_mib}\nHost 1 0 2\n").as_bytes()).expect("valid")
    }

    #[test]
    fn projections_survive_a_reload_and_a_damaged_file_starts_empty() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("state/projections.json");
        let mut cache = ProjectionCache::load(path.clone());
        assert!(cache.is_empty() && cache.get(&key(1)).is_none());
        cache.record(key(1), projection(10)).expect("a write").write();
        cache.record(key(2), projection(20)).expect("a write").write();
        // The same projection again changes nothing on disk.
        assert!(cache.record(key(2), projection(20)).is_none());
        let reloaded = ProjectionCache::load(path.clone());
        assert_eq!(reloaded.len(), 2);
        assert_eq!(reloaded.get(&key(1)), Some(&projection(10)));
        assert_eq!(reloaded.get(&key(2)), Some(&projection(20)));
        assert_eq!(reloaded.get(&key(3)), None);

        for damage in [
            &b"{ damaged"[..],
            b"{\"version\":99,\"entries\":[]}",
            b"{\"version\":1,\"entries\":[{\"key\":1,\"projection\":2}]}",
        ] {
            std::fs::write(&path, damage).expect("damage");
            assert!(ProjectionCache::load(path.clone()).is_empty());
        }
        assert!(ProjectionCache::in_memory().record(key(1), projection(1)).is_none());
    }

    #[test]
    fn a_file_of_another_version_is_ignored() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("projections.json");
        let mut cache = ProjectionCache::load(path.clone());
        cache.record(key(1), projection(10)).expect("a write").write();
        let text = std::fs::read_to_string(&path).expect("read").replace("\"version\": 2", "\"version\": 1");
        std::fs::write(&path, text).expect("write");
        assert!(ProjectionCache::load(path).is_empty());
    }

    #[test]
    fn the_cache_is_bounded_and_drops_the_oldest_first() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("projections.json");
        let mut cache = ProjectionCache::load(path.clone());
        let count = u32::try_from(MAX_ENTRIES).expect("fits") + 2;
        let mut last = None;
        for context in 0..count {
            last = cache.record(key(context), projection(context % 7));
        }
        last.expect("a write").write();
        assert_eq!(cache.len(), MAX_ENTRIES);
        assert!(cache.get(&key(0)).is_none() && cache.get(&key(1)).is_none());
        assert!(cache.get(&key(2)).is_some() && cache.get(&key(count - 1)).is_some());
        // Recording an old key again makes it the newest.
        cache.record(key(2), projection(6)).expect("changed");
        cache.record(key(count), projection(1)).expect("new").write();
        assert!(cache.get(&key(2)).is_some() && cache.get(&key(3)).is_none());
        let reloaded = ProjectionCache::load(path);
        assert_eq!(reloaded.len(), MAX_ENTRIES);
        assert_eq!(reloaded.get(&key(2)), Some(&projection(6)));
        assert!(reloaded.get(&key(3)).is_none());
    }
}
