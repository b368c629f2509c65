//! A JSON file in the state directory that a task owns in memory: read once at start
//! (missing or damaged, it starts empty), and written whole, off that task, with an atomic
//! rename, so that a crash leaves either the old file or the new one.
//!
//! The learned footprints and the projection cache both keep their state this way.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::Serialize;
use serde::de::DeserializeOwned;

/// The largest state file read: far above what the bounded caches write (1024 entries of
/// a few hundred bytes), so a larger one is damage, not data.
const MAX_FILE: u64 = 16 << 20;

/// Reads `path` as JSON; a missing file gives the default, an unreadable, oversized or
/// damaged one gives the default with a warning naming `what` (the data is a cache: the
/// daemon goes on without it).
#[must_use]
pub fn load<T: DeserializeOwned + Default>(path: &Path, what: &str) -> T {
    let read = || -> std::io::Result<Vec<u8>> {
        let mut bytes = Vec::new();
        std::io::Read::read_to_end(&mut std::io::Read::take(std::fs::File::open(path)?, MAX_FILE + 1), &mut bytes)?;
        if bytes.len() as u64 > MAX_FILE {
            return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, format!("larger than {MAX_FILE} bytes")));
        }
        Ok(bytes)
    };
    match read() {
        Ok(bytes) => serde_json::from_slice(&bytes).unwrap_or_else(|e| {
            tracing::warn!(path = %path.display(), error = %e, "ignoring unreadable {what}");
            T::default()
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => T::default(),
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "cannot read {what}; starting without them");
            T::default()
        }
    }
}

/// A snapshot of the state to write, taken on the owning task; [`PendingWrite::write`]
/// does the IO (on the blocking pool).
#[derive(Debug)]
pub struct PendingWrite {
    path: PathBuf,
    bytes: Vec<u8>,
    what: &'static str,
}

impl PendingWrite {
    /// The snapshot of `value` for `path`; `what` names the data in a failure's warning.
    ///
    /// # Panics
    ///
    /// When `value` does not serialize to JSON, which for the plain data kept here (maps
    /// and lists of numbers and strings) is a bug.
    #[must_use]
    pub fn new<T: Serialize>(path: PathBuf, value: &T, what: &'static str) -> Self {
        Self::of(path, serde_json::to_vec_pretty(value), what)
    }

    /// [`PendingWrite::new`] without the indentation: for a file read before `READY=1`,
    /// whose size grows with the store.
    ///
    /// # Panics
    ///
    /// As [`PendingWrite::new`].
    #[must_use]
    pub fn compact<T: Serialize>(path: PathBuf, value: &T, what: &'static str) -> Self {
        Self::of(path, serde_json::to_vec(value), what)
    }

    fn of(path: PathBuf, bytes: serde_json::Result<Vec<u8>>, what: &'static str) -> Self {
        let bytes = bytes.unwrap_or_else(|e| panic!("{what} do not serialize: {e}"));
        Self { path, bytes, what }
    }

    /// Writes it atomically (temporary file, sync, rename); failures are logged, not fatal.
    pub fn write(self) {
        if let Err(e) = write_atomic(&self.path, &self.bytes) {
            tracing::warn!(path = %self.path.display(), error = %e, "cannot save {}", self.what);
        }
    }
}

fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or_else(|| Path::new("."));
    std::fs::create_dir_all(dir)?;
    let mut temp = tempfile::Builder::new().prefix(".tmp-").tempfile_in(dir)?;
    temp.write_all(bytes)?;
    temp.as_file().sync_all()?;
    temp.persist(path).map_err(|e| e.error)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::{MAX_FILE, PendingWrite, load};

    #[test]
    fn an_oversized_file_is_ignored_without_reading_it_all() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("x.json");
        // Valid JSON past the bound: a string of MAX_FILE bytes.
        let mut text = String::from("{\"a\":\"");
        text.push_str(&"x".repeat(usize::try_from(MAX_FILE).expect("small")));
        text.push_str("\"}");
        std::fs::write(&path, text).expect("write");
        assert_eq!(load::<BTreeMap<String, String>>(&path, "things"), BTreeMap::new());
    }

    #[test]
    fn a_written_value_loads_back_and_a_missing_or_damaged_file_is_the_default() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("deep/state/x.json");
        assert_eq!(load::<BTreeMap<String, u64>>(&path, "things"), BTreeMap::new());
        let value = BTreeMap::from([("a".to_owned(), 1_u64)]);
        PendingWrite::new(path.clone(), &value, "things").write();
        assert_eq!(load::<BTreeMap<String, u64>>(&path, "things"), value);
        // Nothing left beside it: the temporary file was renamed.
        let names: Vec<_> = std::fs::read_dir(path.parent().expect("dir")).expect("list").collect();
        assert_eq!(names.len(), 1);
        std::fs::write(&path, b"{ damaged").expect("damage");
        assert_eq!(load::<BTreeMap<String, u64>>(&path, "things"), BTreeMap::new());
        // A directory where the file should be: read fails, default; the write fails, logged.
        let blocked = dir.path().join("blocked");
        std::fs::create_dir(&blocked).expect("mkdir");
        assert_eq!(load::<BTreeMap<String, u64>>(&blocked, "things"), BTreeMap::new());
        PendingWrite::new(blocked.clone(), &value, "things").write();
        assert!(blocked.is_dir());
    }
}
