//! The listing's index kept in corrald's state directory between runs, so that the first
//! walk after a start reads only the manifests changed while corrald was down: at 1 000
//! models, reading every manifest and config blob again is most of that walk's system
//! calls. A cache, never the truth: each entry counts only while its manifest file keeps
//! the identity (inode, size, modification time) it had when it was read, exactly as the
//! in-memory index between two walks; a missing, damaged or foreign file is ignored.
//!
//! The file is corrald's own, but it is read as the store's manifests are: each entry
//! passes the checks a manifest read from the store passes, or is left out.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use serde::{Deserialize, Serialize};

use super::Store;
use super::digest::Digest;
use super::limits::MANIFEST_MAX;
use super::list::Listed;
use super::manifest::{Layer, Manifest, ModelConfig};
use super::manifests::FileId;
use super::name::ModelName;
use super::show::{BlobFacts, CAPABILITIES, listed_facts};
use crate::state_file::{self, PendingWrite};
use crate::sync::lock;

const WHAT: &str = "saved model listing";

/// A model of a saved listing: its manifest file's identity (inode, size, modification
/// time), and what a listing shows of it.
pub type Entry = ((u64, u64, SystemTime), Arc<Listed>);

/// What a saved listing holds: its models, and the blob facts of the manifests they name
/// ([`Store::blob_facts`]).
#[derive(Debug, Default, PartialEq)]
pub struct Saved {
    /// The models.
    pub entries: Vec<Entry>,
    /// By manifest digest, sorted; only digests some entry names.
    pub facts: Vec<(Digest, BlobFacts)>,
}

/// What `bytes` (a saved listing) holds for the store at `root`. Each model is checked as
/// a manifest read from the store is: a name that parses, a weights layer, a manifest no
/// larger than the store reads, config facts within their bounds, times that a clock
/// can hold; blob facts name only capabilities corral knows, each once, and a digest
/// some model has. What fails a check is left out; another store's listing holds nothing.
///
/// # Errors
/// Bytes that are not a saved listing.
pub fn parse(bytes: &[u8], root: &Path) -> Result<Saved, serde_json::Error> {
    Ok(serde_json::from_slice::<SavedListing>(bytes)?.checked(root).unwrap_or_default())
}

/// The saved listing `saved` for the store at `root`, as [`Store::save_listing`] writes it.
#[must_use]
pub fn to_bytes(root: &Path, saved: &Saved) -> Vec<u8> {
    serde_json::to_vec(&SavedListing::new(root, &saved.entries, saved.facts.iter().map(|(d, f)| (d, f))))
        .expect("a listing always serializes")
}

/// The file's content.
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct SavedListing {
    /// The store it describes, as configured: another store's listing is not used.
    store: PathBuf,
    models: Vec<SavedModel>,
    /// Absent from files written before the blob facts were kept: none then.
    #[serde(default)]
    facts: Vec<SavedFacts>,
}

/// One manifest's [`BlobFacts`].
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct SavedFacts {
    /// The manifest's digest.
    digest: Digest,
    context_length: u64,
    capabilities: Vec<String>,
}

impl SavedFacts {
    /// The facts, if each capability is one corral names, named once.
    fn into_facts(self) -> Option<(Digest, BlobFacts)> {
        let mut capabilities = Vec::with_capacity(self.capabilities.len().min(CAPABILITIES.len()));
        for name in &self.capabilities {
            let known = CAPABILITIES.into_iter().find(|c| c == name)?;
            if capabilities.contains(&known) {
                return None;
            }
            capabilities.push(known);
        }
        Some((self.digest, BlobFacts { context_length: self.context_length, capabilities }))
    }
}

/// One model: what [`Listed`] holds, and its manifest file's identity.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct SavedModel {
    name: String,
    /// The manifest file's inode, size and modification time.
    file: (u64, u64, Time),
    /// The digest of the manifest's bytes.
    digest: Digest,
    modified: Time,
    config_layer: Layer,
    layers: Vec<Layer>,
    /// The config blob's facts.
    config: ModelConfig,
}

/// A time as seconds and nanoseconds since 1970 (earlier ones count as 1970, as the
/// store's file identities do).
type Time = (u64, u32);

fn time_of(time: SystemTime) -> Time {
    let since = time.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default();
    (since.as_secs(), since.subsec_nanos())
}

/// `None` past what `SystemTime` holds (the file may be damaged: a time from it must not
/// overflow).
fn time_from((secs, nanos): Time) -> Option<SystemTime> {
    SystemTime::UNIX_EPOCH.checked_add(Duration::new(secs, nanos.min(999_999_999)))
}

impl SavedListing {
    /// The listing of `entries`, with the `facts` of the manifests they name.
    fn new<'a>(root: &Path, entries: &[Entry], facts: impl Iterator<Item = (&'a Digest, &'a BlobFacts)>) -> Self {
        let mut models: Vec<SavedModel> = entries.iter().map(|(id, listed)| SavedModel::of(*id, listed)).collect();
        models.sort_by(|a, b| a.name.cmp(&b.name));
        let named: HashSet<Digest> = entries.iter().map(|(_, listed)| listed.digest).collect();
        let mut facts: Vec<SavedFacts> = facts
            .filter(|(digest, _)| named.contains(digest))
            .map(|(digest, f)| SavedFacts {
                digest: *digest,
                context_length: f.context_length,
                capabilities: f.capabilities.iter().map(|c| (*c).to_owned()).collect(),
            })
            .collect();
        facts.sort_by_key(|f| f.digest);
        Self { store: root.to_owned(), models, facts }
    }

    /// What passes the store's checks (see [`parse`]); `None` if the listing is another
    /// store's (or none: a missing or damaged file's default names no store).
    fn checked(self, root: &Path) -> Option<Saved> {
        if self.store != root {
            return None;
        }
        let entries: Vec<Entry> = self.models.into_iter().filter_map(SavedModel::into_entry).collect();
        let named: HashSet<Digest> = entries.iter().map(|(_, listed)| listed.digest).collect();
        let mut facts: Vec<(Digest, BlobFacts)> =
            self.facts.into_iter().filter_map(SavedFacts::into_facts).filter(|(d, _)| named.contains(d)).collect();
        facts.sort_by_key(|f| f.0);
        facts.dedup_by(|a, b| a.0 == b.0);
        Some(Saved { entries, facts })
    }
}

impl SavedModel {
    fn of(id: FileId, listed: &Listed) -> Self {
        let (ino, len, mtime) = id;
        Self {
            name: listed.name.to_string(),
            file: (ino, len, time_of(mtime)),
            digest: listed.digest,
            modified: time_of(listed.modified),
            config_layer: listed.manifest.config().clone(),
            layers: listed.manifest.layers().to_vec(),
            config: listed.config.clone(),
        }
    }

    /// The entry, checked as a manifest read from the store is; `None` when any check
    /// fails (see [`parse`]).
    fn into_entry(self) -> Option<Entry> {
        // What the layers' texts alone would take in the manifest file (a digest is 71
        // bytes): a manifest larger than the store reads is not taken from here either.
        let text = |l: &Layer| l.media_type.len() + l.from.as_ref().map_or(0, String::len) + 71;
        let manifest_bytes = std::iter::once(&self.config_layer).chain(&self.layers).map(text).sum::<usize>();
        if manifest_bytes as u64 > MANIFEST_MAX {
            return None;
        }
        let name = ModelName::parse(&self.name).ok()?;
        let manifest = Manifest::new(self.config_layer, self.layers).ok()?;
        let config = listed_facts(self.config).ok()?;
        let (ino, len, mtime) = self.file;
        let listed = Listed {
            name,
            digest: self.digest,
            size: manifest.size(),
            modified: time_from(self.modified)?,
            manifest,
            config,
        };
        Some(((ino, len, time_from(mtime)?), Arc::new(listed)))
    }
}

impl Store {
    /// Takes the listing saved at `path` as the index, before it is first built: listings
    /// show it at once, for at most a second (`REVALIDATE_AFTER`) or until
    /// [`Store::check_listing`] has walked the tree, which then reads only the manifests
    /// whose file changed since. Returns how many entries were taken (none from another
    /// store's file, or once built).
    #[must_use = "how many models the listing shows until it is checked"]
    pub fn load_listing(&self, path: &Path) -> usize {
        let Some(saved) = state_file::load::<SavedListing>(path, WHAT).checked(&self.root) else { return 0 };
        let mut index = lock(&self.index);
        if index.built.is_some() || !index.entries.is_empty() {
            return 0;
        }
        index.entries = saved.entries.into_iter().map(|entry| (entry.1.name.clone(), entry)).collect();
        index.facts.extend(saved.facts);
        index.unsaved = false;
        index.unchecked = true;
        index.walks += 1;
        index.built = Some((*self.changes.borrow(), Instant::now()));
        index.entries.len()
    }

    /// Saves the index at `path` if it changed since it was loaded or last saved (the
    /// write is atomic; a failure is logged). Blocks: for the blocking threads.
    pub fn save_listing(&self, path: &Path) {
        let (entries, facts): (Vec<Entry>, Vec<(Digest, BlobFacts)>) = {
            let mut index = lock(&self.index);
            if !index.unsaved || index.unchecked || index.built.is_none() {
                return;
            }
            index.unsaved = false;
            let entries = index.entries.values().map(|(id, listed)| (*id, Arc::clone(listed))).collect();
            (entries, index.facts.iter().map(|(d, f)| (*d, f.clone())).collect())
        };
        let listing = SavedListing::new(&self.root, &entries, facts.iter().map(|(d, f)| (d, f)));
        PendingWrite::compact(path.to_owned(), &listing, WHAT).write();
    }
}

#[cfg(test)]
mod tests {
    use std::fs;

    use super::super::Store;
    use super::super::list::tests::{add_model, listed_names as names, name};
    use super::super::show::BlobFacts;
    use super::{Saved, parse, to_bytes};

    #[test]
    fn a_saved_listing_answers_at_once_and_one_walk_checks_it_reading_only_what_changed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (root, saved) = (dir.path().join("store"), dir.path().join("state/listing.json"));
        let before = Store::open(&root).expect("open");
        for (model, weights) in
            [("kept", &b"k"[..]), ("rewritten", b"r"), ("removed", b"x"), ("host.example/a/b:v1", b"h")]
        {
            add_model(&before, model, weights);
        }
        let listed_before = before.list().expect("list");
        before.save_listing(&saved);
        assert!(saved.is_file(), "a listing that changed is saved");

        // While corrald is down: one model rewritten, one removed, one added.
        add_model(&before, "rewritten", b"r2");
        before.delete(&name("removed")).expect("delete");
        add_model(&before, "added", b"a");

        let after = Store::open(&root).expect("reopen");
        assert_eq!(after.load_listing(&saved), 4);
        assert_eq!(after.list().expect("list"), listed_before, "the saved listing, as it was saved");
        // The saved listing is the index's first generation; no file read.
        assert_eq!((after.manifests_read(), after.tree_walks()), (0, 1));
        let mut changes = after.changes();
        changes.mark_unchanged();
        after.check_listing().expect("check");
        assert!(changes.has_changed().expect("open"), "a saved listing found wrong counts as a change");
        assert_eq!(after.manifests_read(), 2, "only the rewritten and the added manifest are read");
        assert_eq!(names(&after), ["host.example/a/b:v1", "added:latest", "kept:latest", "rewritten:latest"]);
        assert_eq!(after.list().expect("list"), Store::open(&root).expect("a third").list().expect("walked"));
        after.check_listing().expect("checked once");
        assert_eq!(after.tree_walks(), 2, "one walk: a new generation, as the listing changed");

        // Saved again, it lists the same; found right, it is not written again.
        after.save_listing(&saved);
        let third = Store::open(&root).expect("third");
        assert_eq!(third.load_listing(&saved), 4);
        let mut changes = third.changes();
        changes.mark_unchanged();
        third.check_listing().expect("check");
        assert!(!changes.has_changed().expect("open"), "a saved listing found right is no change");
        assert_eq!((third.manifests_read(), third.tree_walks()), (0, 1), "found right: the same generation");
        fs::remove_file(&saved).expect("remove");
        third.save_listing(&saved);
        assert!(!saved.exists(), "nothing changed since it was loaded: not written");
    }

    #[test]
    fn blob_facts_are_read_once_per_manifest_and_kept_with_the_saved_listing() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (root, saved) = (dir.path().join("store"), dir.path().join("state/listing.json"));
        let store = Store::open(&root).expect("open");
        let weights = crate::demo_model::tiny_llama_bytes().expect("the tiny llama");
        // Two names, one manifest; and a model whose weights are no GGUF.
        add_model(&store, "one", &weights);
        add_model(&store, "two", &weights);
        add_model(&store, "broken", b"not a gguf");
        let listed = store.list().expect("list");
        let [broken, one, two] = [0, 1, 2].map(|i| &listed[i]);
        assert_eq!(one.digest, two.digest);
        let facts = store.blob_facts(one);
        assert_eq!(facts, BlobFacts { context_length: 2048, capabilities: vec!["completion"] });
        assert_eq!(store.blob_facts(broken), BlobFacts::default(), "unreadable: empty facts");

        // The weights made unreadable: the second name shows the facts read for the first.
        let weights_path = store.blob_path(&one.manifest.model().digest);
        fs::write(&weights_path, vec![0x55; weights.len()]).expect("overwrite");
        assert_eq!(store.blob_facts(two), facts);

        // After a restart, from the saved listing; the broken model's were not kept.
        store.save_listing(&saved);
        let again = Store::open(&root).expect("reopen");
        assert_eq!(again.load_listing(&saved), 3);
        let listed = again.list().expect("list");
        assert_eq!(again.blob_facts(&listed[2]), facts, "kept across the restart");
        let text = fs::read_to_string(&saved).expect("the saved listing");
        let value: serde_json::Value = serde_json::from_str(&text).expect("json");
        assert_eq!(value["facts"].as_array().map(Vec::len), Some(1), "{text}");
    }

    #[test]
    fn a_saved_listing_of_another_store_damaged_or_loaded_late_is_not_used() {
        let dir = tempfile::tempdir().expect("tempdir");
        let saved = dir.path().join("listing.json");
        let one = Store::open(&dir.path().join("one")).expect("open");
        add_model(&one, "m", b"w");
        one.list().expect("list");
        one.save_listing(&saved);
        let other = Store::open(&dir.path().join("two")).expect("open");
        assert_eq!(other.load_listing(&saved), 0, "another store's listing");
        assert!(other.list().expect("list").is_empty());

        let late = Store::open(&dir.path().join("one")).expect("open");
        late.list().expect("built first");
        assert_eq!(late.load_listing(&saved), 0, "once built, the index is not replaced");

        // Entries that fail the store's own checks are left out, the rest taken.
        let text = fs::read_to_string(&saved).expect("read");
        let mut value: serde_json::Value = serde_json::from_str(&text).expect("json");
        let good = value["models"][0].clone();
        let mut bad_name = good.clone();
        bad_name["name"] = "../../etc:x".into();
        let mut no_weights = good.clone();
        no_weights["layers"] = serde_json::json!([]);
        let mut long_fact = good.clone();
        long_fact["config"]["model_family"] = "x".repeat(100_000).into();
        // A time no clock holds: this panicked in an addition before it was checked.
        let mut far_time = good.clone();
        far_time["modified"] = serde_json::json!([u64::MAX, 0]);
        let mut far_file_time = good.clone();
        far_file_time["file"][2] = serde_json::json!([u64::MAX, 999_999_999]);
        // A manifest larger than the store would read (MANIFEST_MAX).
        let mut huge_manifest = good.clone();
        huge_manifest["layers"][0]["from"] = "x".repeat(4 << 20).into();
        value["models"] =
            serde_json::json!([bad_name, no_weights, long_fact, far_time, far_file_time, huge_manifest, good]);
        // Blob facts: those of a digest no model has, naming a capability corral does not
        // know, or one twice are left out.
        let digest = good["digest"].clone();
        let facts = |capabilities: serde_json::Value| serde_json::json!({"digest": digest, "context_length": 4096, "capabilities": capabilities});
        let mut elsewhere = facts(serde_json::json!(["completion"]));
        elsewhere["digest"] = format!("sha256:{}", "0".repeat(64)).into();
        value["facts"] = serde_json::json!([
            elsewhere,
            facts(serde_json::json!(["completion", "flying"])),
            facts(serde_json::json!(["tools", "tools"])),
            facts(serde_json::json!(["completion", "tools"])),
        ]);
        let bytes = serde_json::to_vec(&value).expect("json");
        let root = dir.path().join("one");
        let taken = parse(&bytes, &root).expect("a listing");
        assert_eq!(taken.entries.len(), 1, "only the valid entry");
        let kept = BlobFacts { context_length: 4096, capabilities: vec!["completion", "tools"] };
        assert_eq!(taken.facts, [(taken.entries[0].1.digest, kept)], "only the valid facts");
        assert_eq!(parse(&bytes, &dir.path().join("two")).expect("a listing"), Saved::default(), "another store's");
        let again = parse(&to_bytes(&root, &taken), &root).expect("written, it parses");
        assert_eq!(again, taken, "written and read back, the same entry and facts");
        fs::write(&saved, &bytes).expect("write");
        let fresh = Store::open(&root).expect("open");
        assert_eq!(fresh.load_listing(&saved), 1, "only the valid entry");

        for damaged in [&b"{ not json"[..], b"{\"store\":\"x\",\"models\":[],\"extra\":1}", b""] {
            fs::write(&saved, damaged).expect("write");
            let fresh = Store::open(&dir.path().join("one")).expect("open");
            assert_eq!(fresh.load_listing(&saved), 0, "{}", String::from_utf8_lossy(damaged));
            assert_eq!(names(&fresh), ["m:latest"], "the store is listed by walking it");
        }
    }
}
