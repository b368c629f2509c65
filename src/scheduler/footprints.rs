//! Learned footprints: what each runner key (weights and load options) really used the
//! last time it was loaded, kept in the state directory so that the next fit decision,
//! even after a restart, uses it instead of the conservative estimate.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::key::RunnerKey;
use super::policy::Footprint;
pub use crate::state_file::PendingWrite;

/// What the warnings call this file's data.
const WHAT: &str = "learned footprints";

/// The file's format. Version 1 (no `version` field) was a map keyed by a formatted
/// string; a file of another version is logged and ignored (models are measured again).
pub const VERSION: u32 = 2;

/// The file's record of one footprint.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Stored {
    vram: u64,
    ram: u64,
}

/// The file: each key with its footprint.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    version: u32,
    entries: Vec<Entry>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Entry {
    key: RunnerKey,
    footprint: Stored,
}

/// [`File`] as written, borrowing the book's data.
#[derive(Serialize)]
struct FileRef<'a> {
    version: u32,
    entries: Vec<EntryRef<'a>>,
}

#[derive(Serialize)]
struct EntryRef<'a> {
    key: &'a RunnerKey,
    footprint: &'a Stored,
}

/// Footprints by runner key, optionally backed by a file.
#[derive(Debug, Default)]
pub struct Footprints {
    path: Option<PathBuf>,
    map: BTreeMap<RunnerKey, Stored>,
}

impl Footprints {
    /// Footprints kept in memory only (tests, read-only state).
    #[must_use]
    pub fn in_memory() -> Self {
        Self::default()
    }

    /// Footprints persisted at `path`; a missing file starts empty, and so does (with a
    /// warning) an unreadable one or one of another version: the estimates then apply
    /// until models load again.
    #[must_use]
    pub fn load(path: PathBuf) -> Self {
        let value: serde_json::Value = crate::state_file::load(&path, WHAT);
        let map = match value.get("version").and_then(serde_json::Value::as_u64) {
            _ if value.is_null() => BTreeMap::new(),
            Some(version) if version == u64::from(VERSION) => match serde_json::from_value::<File>(value) {
                Ok(file) => {
                    debug_assert_eq!(file.version, VERSION, "dispatched on above");
                    file.entries.into_iter().map(|e| (e.key, e.footprint)).collect()
                }
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "ignoring unreadable {WHAT}");
                    BTreeMap::new()
                }
            },
            version => {
                let version = version.unwrap_or(1);
                tracing::warn!(
                    path = %path.display(),
                    version,
                    "ignoring {WHAT} of format {version} (this corrald writes {VERSION}); models are measured again"
                );
                BTreeMap::new()
            }
        };
        Self { path: Some(path), map }
    }

    /// The footprint learned for `key`.
    #[must_use]
    pub fn get(&self, key: &RunnerKey) -> Option<Footprint> {
        self.map.get(key).map(|s| Footprint { vram: s.vram, ram: s.ram })
    }

    /// Records a measurement; returns the file write to do (off the scheduler's task), if any.
    pub fn record(&mut self, key: &RunnerKey, footprint: Footprint) -> Option<PendingWrite> {
        self.map.insert(key.clone(), Stored { vram: footprint.vram, ram: footprint.ram });
        let path = self.path.clone()?;
        let entries = self.map.iter().map(|(key, footprint)| EntryRef { key, footprint }).collect();
        Some(PendingWrite::new(path, &FileRef { version: VERSION, entries }, WHAT))
    }
}

#[cfg(test)]
mod tests {
    use super::{Footprint, Footprints, VERSION};
    use crate::scheduler::key::{RunnerKey, Weights};
    use crate::store::digest::Digest;
    use crate::supervisor::command::LoadOptions;

    fn key(model: &str) -> RunnerKey {
        RunnerKey::new(Weights::of(Digest::of(model.as_bytes())), &LoadOptions::default())
    }

    #[test]
    fn footprints_survive_a_restart_and_a_damaged_file_is_ignored() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("state/footprints.json");
        let mut book = Footprints::load(path.clone());
        let k = key("k");
        assert_eq!(book.get(&k), None);
        book.record(&k, Footprint { vram: 10, ram: 20 }).expect("a write").write();
        let other = RunnerKey { num_ctx: 8192, ..k.clone() };
        assert_eq!(Footprints::load(path.clone()).get(&k), Some(Footprint { vram: 10, ram: 20 }));
        assert_eq!(Footprints::load(path.clone()).get(&other), None, "another key");
        std::fs::write(&path, b"{ damaged").expect("damage");
        assert_eq!(Footprints::load(path).get(&k), None);
        assert!(Footprints::in_memory().record(&k, Footprint::default()).is_none());
    }

    #[test]
    fn the_file_is_versioned_and_an_old_or_unknown_version_is_ignored() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("footprints.json");
        let k = key("k");
        Footprints::load(path.clone()).record(&k, Footprint { vram: 1, ram: 2 }).expect("a write").write();
        let written: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).expect("read")).expect("json");
        assert_eq!(written["version"], VERSION);
        assert_eq!(written["entries"][0]["key"]["weights"]["model"], Digest::of(b"k").to_string());
        assert_eq!(written["entries"][0]["footprint"], serde_json::json!({"vram": 1, "ram": 2}));

        // Version 1: a map keyed by a formatted string, as earlier corrald wrote it.
        let old = format!(r#"{{"{}|ctx=4096|np=1": {{"vram": 1, "ram": 2}}}}"#, Digest::of(b"k").hex());
        std::fs::write(&path, old).expect("old");
        let book = Footprints::load(path.clone());
        assert_eq!(book.get(&k), None, "an old file is ignored");
        // A newer version, even a readable one, is ignored too.
        let mut newer = written.clone();
        newer["version"] = serde_json::json!(VERSION + 1);
        std::fs::write(&path, newer.to_string()).expect("newer");
        assert_eq!(Footprints::load(path.clone()).get(&k), None);
        // The current version with an entry that does not read: ignored, not a failure.
        let mut broken = written;
        broken["entries"][0]["key"]["num_ctx"] = serde_json::json!("big");
        std::fs::write(&path, broken.to_string()).expect("broken");
        assert_eq!(Footprints::load(path.clone()).get(&k), None);
        // And the next record rewrites the file in the current version.
        let mut book = Footprints::load(path.clone());
        book.record(&k, Footprint { vram: 3, ram: 4 }).expect("a write").write();
        assert_eq!(Footprints::load(path).get(&k), Some(Footprint { vram: 3, ram: 4 }));
    }
}
