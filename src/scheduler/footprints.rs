//! Learned footprints: what each (weights, load options) really used the last time it
//! was loaded, kept in the state directory so that the next fit decision, even after a
//! restart, uses it instead of the conservative estimate.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::policy::Footprint;
pub use crate::state_file::PendingWrite;

/// What the warnings call this file's data.
const WHAT: &str = "learned footprints";

/// The file's record of one footprint.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
struct Stored {
    vram: u64,
    ram: u64,
}

/// Footprints by runner key, optionally backed by a file.
#[derive(Debug, Default)]
pub struct Footprints {
    path: Option<PathBuf>,
    map: BTreeMap<String, Stored>,
}

impl Footprints {
    /// Footprints kept in memory only (tests, read-only state).
    #[must_use]
    pub fn in_memory() -> Self {
        Self::default()
    }

    /// Footprints persisted at `path`; a missing or unreadable file starts empty (with a
    /// warning for an unreadable one: the estimates then apply until models load again).
    #[must_use]
    pub fn load(path: PathBuf) -> Self {
        let map = crate::state_file::load(&path, WHAT);
        Self { path: Some(path), map }
    }

    /// The footprint learned for `key`.
    #[must_use]
    pub fn get(&self, key: &str) -> Option<Footprint> {
        self.map.get(key).map(|s| Footprint { vram: s.vram, ram: s.ram })
    }

    /// Records a measurement; returns the file write to do (off the scheduler's task), if any.
    pub fn record(&mut self, key: &str, footprint: Footprint) -> Option<PendingWrite> {
        self.map.insert(key.to_owned(), Stored { vram: footprint.vram, ram: footprint.ram });
        let path = self.path.clone()?;
        Some(PendingWrite::new(path, &self.map, WHAT))
    }
}

#[cfg(test)]
mod tests {
    use super::{Footprint, Footprints};

    #[test]
    fn footprints_survive_a_restart_and_a_damaged_file_is_ignored() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("state/footprints.json");
        let mut book = Footprints::load(path.clone());
        assert_eq!(book.get("k"), None);
        book.record("k", Footprint { vram: 10, ram: 20 }).expect("a write").write();
        assert_eq!(Footprints::load(path.clone()).get("k"), Some(Footprint { vram: 10, ram: 20 }));
        std::fs::write(&path, b"{ damaged").expect("damage");
        assert_eq!(Footprints::load(path).get("k"), None);
        assert!(Footprints::in_memory().record("k", Footprint::default()).is_none());
    }
}
