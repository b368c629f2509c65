//! Changes made to the manifests behind the store's back (another program writing the
//! same directory, as `ollama pull` does to an Ollama store used as is), noticed through
//! inotify instead of by walking the tree.
//!
//! With a watch on every manifest directory, a listing trusts its index until the kernel
//! reports a change below `manifests/`; without one, it walks the tree when the index is
//! older than [`REVALIDATE_AFTER`](super::list::REVALIDATE_AFTER). At 1 000 models that
//! walk takes about 15 ms, three times a listing's target, and a listing after a pause
//! always paid it. The walks add the watches themselves (`list.rs`): each directory is
//! watched before its entries are read, so whatever appears after the read is reported.
//!
//! inotify is not used where it would miss changes: on network and FUSE file systems it
//! reports only this machine's changes. Where a watch cannot be added (the user's limit,
//! `fs.inotify.max_user_watches`, reached), listings go back to the walks.

use std::io;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};

use rustix::event::{PollFd, PollFlags};
use rustix::fs::inotify::{self, CreateFlags, ReadFlags, WatchFlags};

use super::Store;
use super::beneath::Dir;
use crate::sync::lock;

/// What is watched in each directory: entries appearing, going, written or touched, and
/// the directory itself going. Reads and opens are not watched (listings read).
const EVENTS: WatchFlags = WatchFlags::CREATE
    .union(WatchFlags::DELETE)
    .union(WatchFlags::MOVED_FROM)
    .union(WatchFlags::MOVED_TO)
    .union(WatchFlags::MODIFY)
    .union(WatchFlags::CLOSE_WRITE)
    .union(WatchFlags::ATTRIB)
    .union(WatchFlags::DELETE_SELF)
    .union(WatchFlags::MOVE_SELF)
    .union(WatchFlags::ONLYDIR);

/// File systems whose other clients' changes inotify never reports (`statfs(2)`'s
/// `f_type`): NFS, SMB (three), Ceph, AFS (two), 9P, FUSE (sshfs, virtiofs, …), Coda,
/// GFS2, OCFS2, Lustre.
const REMOTE: [i128; 13] = [
    0x6969,
    0x517B,
    0xFF53_4D42,
    0xFE53_4D42,
    0x00C3_6400,
    0x5346_414F,
    0x6B41_4653,
    0x0102_1997,
    0x6573_5546,
    0x7375_7245,
    0x0116_1970,
    0x7461_636F,
    0x0BD0_0BD0,
];

/// Whether a file system of type `f_type` may change without this machine's kernel
/// knowing.
pub(super) fn is_remote(f_type: i128) -> bool {
    REMOTE.contains(&f_type)
}

/// An inotify instance watching the manifest directories.
#[derive(Debug)]
pub(super) struct Watch {
    fd: OwnedFd,
}

impl Watch {
    /// A new instance for the store whose root is `root`; an error names why there is none.
    pub(super) fn new(root: &Dir) -> io::Result<Self> {
        let f_type = i128::from(rustix::fs::fstatfs(root.as_fd())?.f_type);
        if is_remote(f_type) {
            return Err(io::Error::other(format!(
                "the store is on a network or FUSE file system (type {f_type:#x}), whose other clients' changes inotify does not report"
            )));
        }
        let fd = inotify::init(CreateFlags::NONBLOCK | CreateFlags::CLOEXEC)?;
        Ok(Self { fd })
    }

    /// Watches `dir`. Through `/proc/self/fd`, so that the watch is on the directory this
    /// handle opened (below the root, no link followed), not on whatever a path names now.
    pub(super) fn add(&self, dir: &Dir) -> io::Result<()> {
        let path = format!("/proc/self/fd/{}", dir.as_fd().as_raw_fd());
        inotify::add_watch(&self.fd, path.as_str(), EVENTS)?;
        Ok(())
    }

    /// Reads every event queued; whether any says something changed (an overflow of the
    /// queue counts: what it lost is unknown).
    pub(super) fn drain(&self) -> io::Result<bool> {
        let mut buffer = [MaybeUninit::<u8>::uninit(); 4096];
        let mut reader = inotify::Reader::new(&self.fd, &mut buffer);
        let mut changed = false;
        loop {
            match reader.next() {
                // A watch removed (its directory gone) is not a change of its own: the
                // deletion was reported to the parent.
                Ok(event) => changed |= event.events() != ReadFlags::IGNORED,
                Err(rustix::io::Errno::AGAIN) => return Ok(changed),
                Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// The instance's descriptor, to wait for events on.
    pub(super) fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl Store {
    /// Has inotify report the changes below `manifests/` (see the module documentation);
    /// the next listing walks the tree once, watching every directory as it goes. An
    /// error says why listings keep looking at the tree every second (`REVALIDATE_AFTER`)
    /// instead.
    pub fn watch_manifests(&self) -> io::Result<()> {
        let watch = Watch::new(&self.dir)?;
        let mut index = lock(&self.index);
        // A saved listing not yet checked is trusted only briefly, watched or not, and
        // the walk that checks it watches every directory.
        if !index.unchecked {
            index.forget();
        }
        *lock(&self.watch) = Some(watch);
        Ok(())
    }

    /// Whether inotify reports the changes below `manifests/`.
    #[must_use]
    pub fn watching(&self) -> bool {
        lock(&self.watch).is_some()
    }

    /// Reads what inotify reported; a change counts as a change to the store (the next
    /// listing walks the tree, the views that follow the store look again). A failure to
    /// read ends the watching.
    pub fn notice_outside_changes(&self) {
        let mut watch = lock(&self.watch);
        let Some(current) = watch.as_ref() else { return };
        match current.drain() {
            Ok(false) => return,
            Ok(true) => {}
            Err(e) => {
                tracing::warn!(error = %e, "cannot read inotify's events ({e}); listings look at the manifests every second again");
                *watch = None;
            }
        }
        drop(watch);
        self.changed();
    }

    /// Watches `dir`, during a walk, before its entries are read. Where it cannot, the
    /// watching ends: a directory unwatched would hide its changes.
    pub(super) fn watch_dir(&self, dir: &Dir) {
        let mut watch = lock(&self.watch);
        let Some(current) = watch.as_ref() else { return };
        if let Err(e) = current.add(dir) {
            // ENOSPC: the user's watches are all taken.
            let limit = if e.raw_os_error() == Some(libc::ENOSPC) { " (fs.inotify.max_user_watches)" } else { "" };
            tracing::warn!(
                dir = dir.path(),
                error = %e,
                "cannot watch a manifest directory: {e}{limit}; listings look at the manifests every second instead"
            );
            *watch = None;
        }
    }
}

/// Starts a thread that waits for inotify's events and notices them (see
/// [`Store::notice_outside_changes`]), so that the views following the store see other
/// programs' changes without waiting for a listing. The thread ends once the store is no
/// longer watching. (A thread blocked in `poll`, not a task: Tokio registers a descriptor
/// it does not own only through `unsafe`.)
pub fn follow_outside_changes(store: &Store) -> io::Result<()> {
    let fd = match lock(&store.watch).as_ref() {
        Some(watch) => watch.fd().try_clone_to_owned()?,
        None => return Ok(()),
    };
    let store = store.clone();
    std::thread::Builder::new().name("store-watch".into()).stack_size(256 << 10).spawn(move || {
        while store.watching() {
            let mut fds = [PollFd::new(&fd, PollFlags::IN)];
            match rustix::event::poll(&mut fds, None) {
                Ok(_) | Err(rustix::io::Errno::INTR) => store.notice_outside_changes(),
                Err(e) => return tracing::warn!(error = %e, "cannot wait for inotify's events: {e}"),
            }
        }
    })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::{Store, follow_outside_changes, is_remote};
    use crate::store::list::REVALIDATE_AFTER;
    use crate::store::list::tests::{add_model, listed_names as names, name};

    /// A store holding `a` and `b`, watched, its index built.
    fn watched_store(dir: &std::path::Path) -> Store {
        let store = Store::open(dir).expect("open");
        add_model(&store, "a", b"weights of a");
        add_model(&store, "b", b"weights of b");
        store.watch_manifests().expect("inotify on the test's file system");
        assert_eq!(names(&store), ["a:latest", "b:latest"]);
        store
    }

    #[test]
    fn a_watched_store_walks_its_tree_only_after_a_change() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = watched_store(dir.path());
        let walks = store.tree_walks();
        // Older than the time after which an unwatched store looks at its tree again.
        store.age_index(REVALIDATE_AFTER * 2);
        assert_eq!(names(&store), ["a:latest", "b:latest"]);
        assert_eq!(store.tree_walks(), walks, "nothing changed: no walk");
        // A change through the store walks once, then the index is trusted again.
        store.delete(&name("b")).expect("delete");
        assert_eq!(names(&store), ["a:latest"]);
        assert_eq!(store.tree_walks(), walks + 1);
        store.age_index(REVALIDATE_AFTER * 2);
        assert_eq!(names(&store), ["a:latest"]);
        assert_eq!(store.tree_walks(), walks + 1);
    }

    #[test]
    fn another_programs_changes_show_in_the_next_listing() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = watched_store(dir.path());
        let manifest_a = store.manifest_path(&name("a"));
        let manifest_b = store.manifest_path(&name("b"));
        // Each change below is made by plain file operations, as Ollama would make it,
        // and each listing follows at once: within the time an unwatched store trusts its
        // index without looking, so only inotify's report makes it look.
        let listed = names;
        // A new tag in a watched directory.
        std::fs::copy(&manifest_a, store.manifest_path(&name("a:other"))).expect("copy");
        assert_eq!(listed(&store), ["a:latest", "a:other", "b:latest"]);
        // A new namespace, model and tag: directories made after the last walk.
        let fresh = store.manifest_path(&name("someone/c"));
        std::fs::create_dir_all(fresh.parent().expect("parent")).expect("mkdir");
        std::fs::copy(&manifest_a, &fresh).expect("copy");
        assert_eq!(listed(&store), ["a:latest", "a:other", "b:latest", "someone/c:latest"]);
        // A second tag in the directory made behind the store's back: it is watched now.
        std::fs::copy(&manifest_a, store.manifest_path(&name("someone/c:v2"))).expect("copy");
        assert_eq!(listed(&store), ["a:latest", "a:other", "b:latest", "someone/c:latest", "someone/c:v2"]);
        // A manifest rewritten in place: the listing shows the new one.
        let digest = |store: &Store, model: &str| {
            store.list().expect("list").into_iter().find(|l| l.name == name(model)).expect("listed").digest
        };
        let b = digest(&store, "b");
        std::fs::write(&manifest_a, std::fs::read(&manifest_b).expect("read")).expect("rewrite");
        assert_eq!(digest(&store, "a"), b, "a now holds b's manifest");
        // A namespace removed.
        std::fs::remove_dir_all(fresh.parent().and_then(std::path::Path::parent).expect("namespace")).expect("rm");
        assert_eq!(listed(&store), ["a:latest", "a:other", "b:latest"]);
        assert!(store.watching(), "still watching after all of it");
    }

    #[test]
    fn the_follower_counts_another_programs_change_as_a_change_of_the_store() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = watched_store(dir.path());
        let changes = store.changes();
        let before = *changes.borrow();
        follow_outside_changes(&store).expect("the follower");
        std::fs::copy(store.manifest_path(&name("a")), store.manifest_path(&name("a:other"))).expect("copy");
        // No listing is made: the follower alone notices.
        let deadline = Instant::now() + Duration::from_secs(30);
        while *changes.borrow() == before {
            assert!(Instant::now() < deadline, "the change was never noticed");
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(names(&store), ["a:latest", "a:other", "b:latest"]);
    }

    #[test]
    fn a_watch_that_cannot_be_added_ends_the_watching_and_listings_walk_on_the_clock_again() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = watched_store(dir.path());
        // An instance that refuses every watch, as one past the user's limit does
        // (here: not an inotify descriptor at all, so the kernel says EINVAL).
        let refusing = std::fs::File::open(dir.path()).expect("open").into();
        *crate::sync::lock(&store.watch) = Some(super::Watch { fd: refusing });
        store.delete(&name("b")).expect("delete");
        assert_eq!(names(&store), ["a:latest"], "the listing itself is unharmed");
        assert!(!store.watching(), "a directory left unwatched ends the watching");
        // Now changes behind the store's back show once the index is old enough.
        std::fs::copy(store.manifest_path(&name("a")), store.manifest_path(&name("a:other"))).expect("copy");
        store.age_index(REVALIDATE_AFTER * 2);
        assert_eq!(names(&store), ["a:latest", "a:other"]);
    }

    #[test]
    fn network_and_fuse_file_systems_are_not_watched() {
        // NFS, CIFS, FUSE: other machines' (or the FUSE server's) changes go unreported.
        for remote in [0x6969, 0xFF53_4D42, 0x6573_5546] {
            assert!(is_remote(remote), "{remote:#x}");
        }
        // ext4, XFS, btrfs, tmpfs: every change goes through this kernel.
        for local in [0xEF53, 0x5846_5342, 0x9123_683E, 0x0102_1994] {
            assert!(!is_remote(local), "{local:#x}");
        }
    }
}
