//! Garbage collection: what no model uses and no operation holds goes, once it is old
//! enough.
//!
//! Collected, in `blobs/`: blobs no manifest names (uploaded with `/api/blobs` and never
//! used by a create, or left by a crash between a blob and its manifest), partial
//! downloads (`-partial` and `-partial.json`) of pulls that no longer run, and temporary
//! files no write holds. Temporary files below `manifests/` go the same way.
//!
//! Never collected: anything pinned ([`Store::pin`]: every pull pins the blobs of its
//! manifest before it downloads, every create and copy the blobs it will name before it
//! writes, and a download its partial files while it runs), a temporary file a write in
//! this process holds, anything younger than the grace age (an upload followed shortly by
//! the create that uses it), and anything that is not a regular file (a link is never
//! followed, nor removed by a collection). The decision and the removal happen while the
//! pin table is held, so an operation either pinned first (and its files stay) or pins
//! after (and finds them gone, as it would after any delete).
//!
//! Age is the later of a file's modification and status change, so a blob hard-linked
//! into the store from an old file counts from when it arrived.

use std::time::{Duration, SystemTime};

use crate::sync::lock;

use super::beneath::{Dir, Kind};
use super::digest::Digest;
use super::{Store, StoreError, TEMP_PREFIX, vanished};

/// What one collection removed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Collected {
    /// Blobs no manifest names.
    pub blobs: usize,
    /// Partial download files (data and records).
    pub partials: usize,
    /// Temporary files.
    pub temporaries: usize,
    /// The bytes those files held (their lengths).
    pub bytes: u64,
}

impl Collected {
    /// Files removed in all.
    #[must_use]
    pub fn files(&self) -> usize {
        self.blobs + self.partials + self.temporaries
    }
}

/// What a file in `blobs/` is, by its name.
enum Role {
    Blob(Digest),
    Partial(Digest),
    Temporary,
}

fn role(name: &str) -> Option<Role> {
    if name.starts_with(TEMP_PREFIX) {
        return Some(Role::Temporary);
    }
    let ours = |text: &str| Digest::parse(text).ok().filter(|d| d.file_name() == text);
    if let Some(digest) = ours(name) {
        return Some(Role::Blob(digest));
    }
    let stem = name.strip_suffix("-partial").or_else(|| name.strip_suffix("-partial.json"))?;
    ours(stem).map(Role::Partial)
}

impl Store {
    /// Removes what no model uses and no operation holds, if it arrived at least `grace`
    /// before `now` (see the module documentation). Unused blobs are kept when a manifest
    /// cannot be read (nobody can tell then which are unused); the rest is still collected.
    pub fn collect_garbage(&self, grace: Duration, now: SystemTime) -> Result<Collected, StoreError> {
        let mut collected = Collected::default();
        let pins = lock(&self.pins);
        let referenced = match self.references() {
            Ok(referenced) => Some(referenced),
            Err(e) => {
                tracing::warn!(error = %e, "keeping unused blobs: cannot tell which are used");
                None
            }
        };
        let old = |arrived: SystemTime| now.duration_since(arrived).is_ok_and(|age| age >= grace);
        let blobs = self.blobs()?;
        let entries = blobs.entries().map_err(super::fs_err("read", "blobs".to_owned()))?;
        for entry in entries {
            if entry.kind != Kind::File {
                if entry.kind == Kind::Symlink {
                    tracing::warn!(path = blobs.rel(&entry.name), "leaving a symbolic link in the store alone");
                }
                continue;
            }
            let Some(role) = role(&entry.name) else { continue };
            let collectable = match &role {
                Role::Blob(digest) => {
                    referenced.as_ref().is_some_and(|r| !r.contains(digest)) && !pins.contains_key(digest)
                }
                Role::Partial(digest) => !pins.contains_key(digest),
                Role::Temporary => !self.is_live_temp(&entry.name),
            };
            if !collectable {
                continue;
            }
            if let Some(len) = remove_if_old(&blobs, &entry.name, &old) {
                collected.bytes += len;
                match role {
                    Role::Blob(_) => collected.blobs += 1,
                    Role::Partial(_) => collected.partials += 1,
                    Role::Temporary => collected.temporaries += 1,
                }
            }
        }
        let manifests = self.manifests()?;
        self.collect_temporaries(&manifests, 0, &old, &mut collected);
        drop(pins);
        Ok(collected)
    }

    fn is_live_temp(&self, name: &str) -> bool {
        lock(&self.temps).contains(name)
    }

    /// Removes old temporary files no write holds below `dir` (`manifests/`).
    fn collect_temporaries(
        &self,
        dir: &Dir,
        depth: usize,
        old: &dyn Fn(SystemTime) -> bool,
        collected: &mut Collected,
    ) {
        let Ok(entries) = dir.entries() else { return };
        for entry in entries {
            match entry.kind {
                Kind::File if entry.name.starts_with(TEMP_PREFIX) && !self.is_live_temp(&entry.name) => {
                    if let Some(len) = remove_if_old(dir, &entry.name, old) {
                        collected.temporaries += 1;
                        collected.bytes += len;
                    }
                }
                Kind::Dir if depth < 8 => {
                    if let Ok(sub) = dir.dir(&entry.name) {
                        self.collect_temporaries(&sub, depth + 1, old, collected);
                    }
                }
                _ => {}
            }
        }
    }
}

/// Removes regular file `name` of `dir` if `old` says it is; returns its length if removed.
fn remove_if_old(dir: &Dir, name: &str, old: &dyn Fn(SystemTime) -> bool) -> Option<u64> {
    let meta = dir.stat(name).ok().flatten()?;
    if meta.kind != Kind::File || !old(meta.arrived) {
        return None;
    }
    match dir.remove_file(name) {
        Ok(()) => {
            tracing::debug!(path = dir.rel(name), bytes = meta.len, "garbage collection removed a file");
            Some(meta.len)
        }
        Err(e) if vanished(&e) => None,
        Err(e) => {
            tracing::warn!(path = dir.rel(name), error = %e, "garbage collection cannot remove a file");
            None
        }
    }
}

/// Collects garbage once now, then every `interval` (never again when `None`), on the
/// blocking pool; each collection that removed something is logged as a `gc` event.
pub async fn run(store: Store, interval: Option<Duration>, grace: Duration) {
    loop {
        let one = store.clone();
        match tokio::task::spawn_blocking(move || one.collect_garbage(grace, SystemTime::now())).await {
            Ok(Ok(collected)) if collected.files() > 0 => tracing::info!(
                corral_event = "gc",
                corral_gc_blobs = collected.blobs,
                corral_gc_partials = collected.partials,
                corral_gc_temporaries = collected.temporaries,
                corral_gc_bytes = collected.bytes,
                "garbage collection removed {} unused blobs, {} stale partial downloads and {} temporary files \
                 ({} bytes)",
                collected.blobs,
                collected.partials,
                collected.temporaries,
                collected.bytes,
            ),
            Ok(Ok(_)) => tracing::debug!(corral_event = "gc", "garbage collection found nothing to remove"),
            Ok(Err(e)) => tracing::warn!(corral_event = "gc", error = %e, "garbage collection failed: {e}"),
            // Not started before the runtime shut down: corrald is stopping.
            Err(e) if e.is_cancelled() => return,
            Err(e) => tracing::error!(corral_event = "gc", error = %e, "garbage collection panicked"),
        }
        let Some(interval) = interval else { return };
        tokio::time::sleep(interval).await;
    }
}
