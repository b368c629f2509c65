//! New blobs synced after the reply (`[store] sync_before_reply = false`).
//!
//! A written and checked blob is named in `blobs/` at once and synced to the disk by a
//! thread of its own, so an upload, a create or a pull answers when its bytes are in the
//! page cache, as `curl -o` or `cp` would, instead of waiting for the disk: for a disk
//! slow to sync (on this project's VM, with a quick one, it saves nothing: docs/benchmarks.md).
//!
//! What makes that safe is a note, `unsynced/sha256-<hex>`, holding this boot's id
//! (`/proc/sys/kernel/random/boot_id`). It is on the disk before the blob is named, and
//! removed once the blob's bytes and name are. [`Store::recover_unsynced`], at corrald's
//! start, looks at the notes left:
//!
//! - from this boot: corrald stopped before the sync, the machine did not, so the page
//!   cache still holds the bytes; the sync is done now.
//! - from an earlier boot, or unreadable: the machine stopped before the sync, so the blob
//!   may hold less than its name says. It is removed; a model naming it is then missing
//!   a blob (its load says so), and pulling or creating it again brings the blob back.
//!
//! Without a boot id (no `/proc`), or with `sync_before_reply = true` (the default), a
//! blob is synced before it is named, as `containerd` does.

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, Read, Write};
use std::sync::mpsc::{Sender, SyncSender};
use std::sync::{Arc, Mutex};

use crate::sync::lock;

use super::beneath::{Dir, Kind};
use super::digest::Digest;
use super::temp::TempFile;
use super::{Store, StoreError, fs_err, io_err, vanished};

/// Where the notes are, below the store's root.
const NOTES: &str = "unsynced";

/// The most of a note that is read: a boot id is 36 characters and a newline.
const MAX_NOTE_BYTES: u64 = 64;

/// How a blob's data is made durable (the test hook: a disk that is slow or fails).
pub(super) type SyncData = Arc<dyn Fn(&File) -> io::Result<()> + Send + Sync>;

/// When new blobs reach the disk, and the syncs still to do.
pub(super) struct Unsynced {
    /// This boot's id, written in each note; `None` where it cannot be read.
    boot_id: Option<String>,
    /// Whether each new blob is synced before it is named (no notes then).
    before_reply: bool,
    shared: Arc<Shared>,
    /// The syncer's queue, once it is started: one thread per store, so that however many
    /// blobs arrive at once, their syncs hold one thread and no descriptor while they wait.
    /// It ends when the store's last clone is dropped.
    jobs: Mutex<Option<Sender<Job>>>,
}

/// What the syncer thread shares with the store.
struct Shared {
    /// The store's root.
    root: Arc<Dir>,
    /// The blobs named and not yet synced, with how many syncs of each are queued: the
    /// note goes with the last (a blob removed and written again meanwhile).
    pending: Mutex<HashMap<Digest, usize>>,
    sync_data: SyncData,
}

enum Job {
    /// Sync blob `digest` (by its name: whatever file holds it now), then drop its note.
    Sync(Digest),
    /// Answer once every sync queued before is done.
    Flush(SyncSender<()>),
}

impl std::fmt::Debug for Unsynced {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Unsynced")
            .field("boot_id", &self.boot_id)
            .field("before_reply", &self.before_reply)
            .field("pending", &lock(&self.shared.pending).len())
            .finish_non_exhaustive()
    }
}

impl Unsynced {
    /// For the store whose root is `root`, its blobs' data made durable by `sync_data`.
    pub(super) fn new(root: Arc<Dir>, before_reply: bool, boot_id: Option<String>, sync_data: SyncData) -> Self {
        let shared = Shared { root, pending: Mutex::default(), sync_data };
        Self { boot_id, before_reply, shared: Arc::new(shared), jobs: Mutex::default() }
    }

    /// Whether new blobs are named before they are synced (which needs the boot's id).
    fn in_background(&self) -> bool {
        !self.before_reply && self.boot_id.is_some()
    }
}

/// What [`Store::recover_unsynced`] found.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Recovered {
    /// Blobs this boot named and did not sync (corrald stopped first): synced now.
    pub resynced: Vec<Digest>,
    /// Blobs an earlier boot named and did not sync: removed.
    pub removed: Vec<Digest>,
}

impl Store {
    /// Sets when new blobs reach the disk: before the write that made them answers
    /// (`before_reply`), or after, in the background, where `boot_id` (this boot's id) is
    /// known. A new store syncs before the reply.
    #[must_use]
    pub fn with_blob_syncs(mut self, before_reply: bool, boot_id: Option<String>) -> Self {
        let sync_data = Arc::clone(&self.unsynced.shared.sync_data);
        self.unsynced = Arc::new(Unsynced::new(Arc::clone(&self.dir), before_reply, boot_id, sync_data));
        self
    }

    /// Whether new blobs are synced before the write that made them answers.
    pub(super) fn syncs_before_reply(&self) -> bool {
        !self.unsynced.in_background()
    }

    /// This boot's id, where it is known (whichever way blobs are synced).
    pub(super) fn boot_id(&self) -> Option<&str> {
        self.unsynced.boot_id.as_deref()
    }

    /// Names the written and checked `temp` blob `digest` in `blobs` ([`Store::name_new_blob`]).
    pub(super) fn name_blob(&self, mut temp: TempFile, blobs: &Dir, digest: &Digest) -> Result<(), StoreError> {
        self.name_new_blob(digest, blobs, |sync_first| {
            if sync_first {
                temp.sync().map_err(io_err(format!("cannot sync {}", temp.rel())))?;
            }
            temp.place(blobs, &digest.file_name())
        })
    }

    /// Names new blob `digest` in `blobs` with `place`, told whether to sync the data
    /// first: synced before the reply, `blobs/` is synced after; else the blob's note is
    /// on the disk before `place` runs, and the sync is queued after it.
    pub(super) fn name_new_blob<E: From<StoreError>>(
        &self,
        digest: &Digest,
        blobs: &Dir,
        place: impl FnOnce(bool) -> Result<(), E>,
    ) -> Result<(), E> {
        if self.syncs_before_reply() {
            place(true)?;
            return Ok(blobs.sync().map_err(io_err("cannot sync blobs/"))?);
        }
        self.note_unsynced(digest)?;
        if let Err(e) = place(false) {
            self.unsynced.shared.done(digest, true);
            return Err(e);
        }
        self.sync_later(*digest);
        Ok(())
    }

    /// Puts on the disk, before blob `digest` is named, that it is not synced yet.
    fn note_unsynced(&self, digest: &Digest) -> Result<(), StoreError> {
        let boot_id = self.unsynced.boot_id.as_deref().unwrap_or_default();
        let mut pending = lock(&self.unsynced.shared.pending);
        let count = pending.entry(*digest).or_default();
        if *count == 0 {
            let name = digest.file_name();
            let written = (|| {
                let notes = self.notes_dir()?;
                match notes.remove_file(&name) {
                    Err(e) if !vanished(&e) => return Err(e),
                    _ => {}
                }
                let mut note = notes.create_new(&name, 0o600)?;
                note.write_all(format!("{boot_id}\n").as_bytes())?;
                note.sync_all()?;
                notes.sync()
            })();
            if let Err(e) = written {
                pending.remove(digest);
                return Err(fs_err("write", format!("{NOTES}/{name}"))(e));
            }
        }
        *count += 1;
        Ok(())
    }

    /// `unsynced/`, made (and its name put on the disk) if it is not there.
    fn notes_dir(&self) -> io::Result<Dir> {
        match self.dir.dir(NOTES) {
            Err(e) if vanished(&e) => {
                let notes = self.dir.create_dir(NOTES)?;
                self.dir.sync()?;
                Ok(notes)
            }
            opened => opened,
        }
    }

    /// Queues the sync of blob `digest`, named and noted, for the store's syncer thread
    /// (started on first use); where no thread can be started, syncs it now.
    fn sync_later(&self, digest: Digest) {
        let mut jobs = lock(&self.unsynced.jobs);
        if jobs.is_none() {
            let (sender, queue) = std::sync::mpsc::channel();
            let shared = Arc::clone(&self.unsynced.shared);
            let spawned = std::thread::Builder::new().name("corral-blob-sync".into()).spawn(move || {
                for job in queue {
                    match job {
                        Job::Sync(digest) => shared.sync(&digest),
                        Job::Flush(done) => {
                            let _ = done.send(());
                        }
                    }
                }
            });
            match spawned {
                Ok(_) => *jobs = Some(sender),
                Err(e) => tracing::warn!(error = %e, "cannot start the thread that syncs new blobs; syncing here"),
            }
        }
        let queued = jobs.as_ref().is_some_and(|jobs| jobs.send(Job::Sync(digest)).is_ok());
        drop(jobs);
        if !queued {
            self.unsynced.shared.sync(&digest);
        }
    }

    /// Waits for every sync queued so far (corrald before it exits).
    pub fn wait_synced(&self) {
        let jobs = lock(&self.unsynced.jobs).clone();
        if let Some(jobs) = jobs {
            let (done, flushed) = std::sync::mpsc::sync_channel(1);
            if jobs.send(Job::Flush(done)).is_ok() {
                let _ = flushed.recv();
            }
        }
    }

    /// Deals with the notes an earlier run left (see the module's documentation): blobs
    /// this boot named are synced (in the background), blobs an earlier boot named are
    /// removed. Anything else in `unsynced/` is removed.
    pub fn recover_unsynced(&self) -> Result<Recovered, StoreError> {
        let notes = match self.dir.dir(NOTES) {
            Ok(notes) => notes,
            Err(e) if vanished(&e) => return Ok(Recovered::default()),
            Err(e) => return Err(fs_err("open", NOTES.to_owned())(e)),
        };
        let mut recovered = Recovered::default();
        let mut debris = Vec::new();
        for entry in notes.entries().map_err(fs_err("read", NOTES.to_owned()))? {
            let digest = Digest::parse(&entry.name).ok().filter(|d| d.file_name() == entry.name);
            match (entry.kind, digest) {
                (Kind::File, Some(digest)) => {
                    let this_boot =
                        self.unsynced.boot_id.as_deref().is_some_and(|id| read_note(&notes, &entry.name) == id);
                    if this_boot { &mut recovered.resynced } else { &mut recovered.removed }.push(digest);
                }
                _ => debris.push(entry),
            }
        }
        let blobs = self.blobs()?;
        for digest in &recovered.removed {
            let name = digest.file_name();
            match blobs.remove_file(&name) {
                Err(e) if !vanished(&e) => return Err(fs_err("remove", blobs.rel(&name))(e)),
                _ => tracing::warn!(
                    blob = %digest,
                    "the machine stopped before a new blob reached the disk: removed it (pull or create its model again)"
                ),
            }
        }
        // The blobs are gone from the disk before their notes are.
        blobs.sync().map_err(io_err("cannot sync blobs/"))?;
        for digest in &recovered.removed {
            let name = digest.file_name();
            notes.remove_file(&name).map_err(fs_err("remove", notes.rel(&name)))?;
        }
        for entry in debris {
            let removed =
                if entry.kind == Kind::Dir { notes.remove_dir(&entry.name) } else { notes.remove_file(&entry.name) };
            if let Err(e) = removed {
                tracing::warn!(path = notes.rel(&entry.name), error = %e, "cannot remove what is not a note");
            }
        }
        notes.sync().map_err(io_err(format!("cannot sync {NOTES}/")))?;
        for digest in &recovered.resynced {
            *lock(&self.unsynced.shared.pending).entry(*digest).or_default() += 1;
            self.sync_later(*digest);
        }
        Ok(recovered)
    }
}

impl Shared {
    /// Syncs blob `digest` and its name, then drops its note. A blob the disk would not
    /// take is removed: it may not hold what its name says.
    fn sync(&self, digest: &Digest) {
        let name = digest.file_name();
        let synced = self.root.dir("blobs").and_then(|blobs| {
            match blobs.open(&name) {
                Ok(file) => (self.sync_data)(&file)?,
                // Removed since: nothing to sync.
                Err(e) if vanished(&e) => {}
                Err(e) => return Err(e),
            }
            blobs.sync().map(|()| blobs)
        });
        let mut note_goes = true;
        if let Err(e) = synced {
            tracing::error!(blob = %digest, error = %e, "cannot sync a new blob to the disk; removing it");
            let removed = self.root.dir("blobs").and_then(|blobs| match blobs.remove_file(&name) {
                Err(e) if !vanished(&e) => Err(e),
                _ => blobs.sync(),
            });
            if let Err(e) = removed {
                // Its note stays, so the next start deals with it.
                tracing::error!(blob = %digest, error = %e, "cannot remove a blob that did not sync");
                note_goes = false;
            }
        }
        self.done(digest, note_goes);
    }

    /// One sync of `digest` ended (or will not run); the last one's note goes, unless
    /// `note_goes` is false (the blob is neither synced nor removed).
    fn done(&self, digest: &Digest, note_goes: bool) {
        let mut pending = lock(&self.pending);
        let Some(count) = pending.get_mut(digest) else { return };
        *count -= 1;
        if *count > 0 {
            return;
        }
        pending.remove(digest);
        if !note_goes {
            return;
        }
        let name = digest.file_name();
        let removed = self.root.dir(NOTES).and_then(|notes| {
            notes.remove_file(&name)?;
            notes.sync()
        });
        if let Err(e) = removed {
            tracing::warn!(note = format!("{NOTES}/{name}"), error = %e, "cannot remove a synced blob's note");
        }
    }
}

/// A note's boot id: at most [`MAX_NOTE_BYTES`] of it, empty if unreadable.
fn read_note(notes: &Dir, name: &str) -> String {
    let mut text = String::new();
    let read = notes.open(name).and_then(|file| file.take(MAX_NOTE_BYTES).read_to_string(&mut text));
    if read.is_err() {
        text.clear();
    }
    text.trim_end().to_owned()
}

#[cfg(test)]
impl Store {
    /// Blobs synced after the reply, for boot `boot_id`, by `sync_data` (a disk that takes
    /// its time, or fails).
    pub(super) fn with_background_syncs_by(
        mut self,
        boot_id: &str,
        sync_data: impl Fn(&File) -> io::Result<()> + Send + Sync + 'static,
    ) -> Self {
        let unsynced = Unsynced::new(Arc::clone(&self.dir), false, Some(boot_id.to_owned()), Arc::new(sync_data));
        self.unsynced = Arc::new(unsynced);
        self
    }
}

#[cfg(test)]
mod tests {
    use std::fs;
    use std::os::unix::fs::symlink;
    use std::path::Path;
    use std::sync::mpsc;

    use super::{NOTES, Recovered};
    use crate::store::digest::Digest;
    use crate::store::{Store, StoreError};

    fn note(root: &Path, digest: &Digest) -> std::path::PathBuf {
        root.join(NOTES).join(digest.file_name())
    }

    fn notes(root: &Path) -> Vec<String> {
        let mut names: Vec<String> = fs::read_dir(root.join(NOTES))
            .map(|dir| dir.map(|e| e.expect("entry").file_name().to_string_lossy().into_owned()).collect())
            .unwrap_or_default();
        names.sort();
        names
    }

    /// A new blob is named before its sync ends; its note, naming this boot, is on the
    /// disk until then and gone after.
    #[test]
    fn a_blob_synced_after_the_reply_is_noted_until_its_sync_ends() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (release, released) = mpsc::channel::<()>();
        let released = std::sync::Mutex::new(released);
        let store = Store::open(dir.path()).expect("store").with_background_syncs_by("boot-a", move |file| {
            let _ = crate::sync::lock(&released).recv();
            file.sync_data()
        });
        let data = b"weights".repeat(1000);
        let (digest, _) = store.write_blob(&data[..], None).expect("write");
        assert!(store.has_blob(&digest), "named before the sync ends");
        assert_eq!(fs::read_to_string(note(dir.path(), &digest)).expect("the note"), "boot-a\n");
        release.send(()).expect("release");
        store.wait_synced();
        assert!(notes(dir.path()).is_empty(), "the note goes once the blob is synced: {:?}", notes(dir.path()));
        assert_eq!(fs::read(store.blob_path(&digest)).expect("blob"), data);
    }

    /// A blob the disk would not take is removed, and its note with it: the store holds
    /// nothing its name does not vouch for.
    #[test]
    fn a_blob_the_disk_refuses_is_removed_with_its_note() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::open(dir.path())
            .expect("store")
            .with_background_syncs_by("boot-a", |_| Err(std::io::Error::from_raw_os_error(libc::EIO)));
        let (digest, _) = store.write_blob(&b"lost"[..], None).expect("write");
        store.wait_synced();
        assert!(!store.has_blob(&digest), "removed");
        assert!(notes(dir.path()).is_empty(), "{:?}", notes(dir.path()));
    }

    /// Synced before the reply (the setting, or no boot id to write in a note): no note
    /// is ever written.
    #[test]
    fn blobs_synced_before_the_reply_leave_no_note() {
        for (before_reply, boot_id) in [(true, Some("boot-a".to_owned())), (false, None)] {
            let dir = tempfile::tempdir().expect("tempdir");
            let store = Store::open(dir.path()).expect("store").with_blob_syncs(before_reply, boot_id.clone());
            assert!(store.syncs_before_reply(), "{before_reply} {boot_id:?}");
            let (digest, _) = store.write_blob(&b"kept"[..], None).expect("write");
            assert!(store.has_blob(&digest));
            assert!(!dir.path().join(NOTES).exists(), "{before_reply} {boot_id:?}");
        }
    }

    /// At start, a note from an earlier boot removes its blob (the machine stopped before
    /// the sync); one from this boot gets its blob synced and kept. What is not a note
    /// (another name, a link, a directory) is removed without being followed, and a note
    /// longer than a boot id counts as unreadable.
    #[test]
    fn notes_from_an_earlier_boot_remove_their_blobs_and_this_boots_get_synced() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path();
        let store = Store::open(root).expect("store");
        let blob = |text: &str| store.write_blob(text.as_bytes(), None).expect("write").0;
        let (earlier, this, long, kept) = (blob("earlier"), blob("this boot"), blob("long note"), blob("kept"));
        let vanished = Digest::of(b"never named");
        let notes_dir = root.join(NOTES);
        fs::create_dir(&notes_dir).expect("notes");
        fs::write(note(root, &earlier), "boot-0\n").expect("note");
        fs::write(note(root, &this), "boot-a\n").expect("note");
        fs::write(note(root, &vanished), "boot-a\n").expect("note");
        fs::write(note(root, &long), format!("boot-a\n{}", "x".repeat(100))).expect("note");
        fs::write(notes_dir.join("junk"), "boot-a\n").expect("junk");
        fs::write(notes_dir.join(kept.file_name().to_uppercase().replace("SHA256", "sha256")), "boot-0\n")
            .expect("upper-case name");
        symlink(store.blob_path(&kept), notes_dir.join(Digest::of(b"link").file_name())).expect("link");
        fs::create_dir(notes_dir.join("a-directory")).expect("dir");

        let (synced, syncs) = mpsc::channel();
        let store = Store::open(root).expect("open again").with_background_syncs_by("boot-a", move |file| {
            synced.send(()).expect("count");
            file.sync_data()
        });
        let mut recovered = store.recover_unsynced().expect("recover");
        recovered.removed.sort();
        recovered.resynced.sort();
        let mut removed = vec![earlier, long];
        removed.sort();
        let mut resynced = vec![this, vanished];
        resynced.sort();
        assert_eq!(recovered, Recovered { resynced, removed });
        store.wait_synced();
        assert_eq!(syncs.try_iter().count(), 1, "one blob to sync: the vanished one is not there");
        assert!(notes(root).is_empty(), "every note dealt with: {:?}", notes(root));
        assert!(!store.has_blob(&earlier) && !store.has_blob(&long), "removed");
        assert!(matches!(store.open_blob(&earlier), Err(StoreError::MissingBlob(d)) if d == earlier));
        assert_eq!(fs::read(store.blob_path(&this)).expect("kept"), b"this boot");
        assert_eq!(fs::read(store.blob_path(&kept)).expect("not followed"), b"kept");
        assert_eq!(store.recover_unsynced().expect("again"), Recovered::default(), "nothing left");
    }

    /// A link planted as `unsynced` itself is never followed: the start's recovery and a
    /// new blob's note are refused, naming it, and what the link points to stays as it was.
    #[test]
    fn a_link_planted_as_the_notes_directory_is_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let outside = tempfile::tempdir().expect("outside");
        let digest = Digest::of(b"a note's victim");
        fs::write(outside.path().join(digest.file_name()), "boot-0\n").expect("outside file");
        let store = Store::open(dir.path()).expect("store").with_background_syncs_by("boot-a", fs::File::sync_data);
        symlink(outside.path(), dir.path().join(NOTES)).expect("link");
        let refused = store.recover_unsynced().expect_err("a link is not the notes directory");
        assert!(refused.to_string().contains(NOTES), "{refused}");
        let refused = store.write_blob(&b"new"[..], None).expect_err("no note, so no blob");
        assert!(refused.to_string().contains(NOTES), "{refused}");
        assert!(!store.has_blob(&Digest::of(b"new")), "not named without its note");
        let left: Vec<_> =
            fs::read_dir(outside.path()).expect("outside").map(|e| e.expect("entry").file_name()).collect();
        assert_eq!(left, [std::ffi::OsString::from(digest.file_name())], "untouched");
        assert_eq!(fs::read_to_string(outside.path().join(digest.file_name())).expect("outside file"), "boot-0\n");
    }

    /// A store never written in the background has nothing to recover.
    #[test]
    fn a_store_without_notes_recovers_nothing() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::open(dir.path()).expect("store").with_blob_syncs(false, Some("boot-a".into()));
        assert_eq!(store.recover_unsynced().expect("recover"), Recovered::default());
        assert!(!dir.path().join(NOTES).exists(), "nothing made");
    }
}
