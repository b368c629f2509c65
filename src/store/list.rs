//! Listing the models: every manifest file four levels below `manifests/`, parsed, sorted
//! by name; what cannot be read is skipped with a warning.

use std::time::SystemTime;

use super::beneath::{Dir, Kind};
use super::digest::Digest;
use super::manifest::Manifest;
use super::manifests::read_manifest_file;
use super::name::ModelName;
use super::{Store, StoreError, fs_err, vanished};

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
}

impl Store {
    /// Every model, sorted by name. Files that are not valid manifests are skipped with a
    /// warning; entries that vanish while the listing runs (a concurrent delete) are left out.
    pub fn list(&self) -> Result<Vec<Listed>, StoreError> {
        let mut listed = Vec::new();
        self.walk_manifests(&mut |dir, parts, tag| {
            let name = match ModelName::parse(&format!("{}/{}/{}:{tag}", parts[0], parts[1], parts[2])) {
                Ok(name) => name,
                Err(e) => {
                    tracing::warn!(error = %e, "skipping a manifest with an invalid name");
                    return;
                }
            };
            let path = dir.rel(tag);
            let read = dir.open(tag).map_err(fs_err("read", path.clone())).and_then(|f| read_manifest_file(f, &path));
            match read {
                Ok((bytes, modified)) => match Manifest::parse(&bytes) {
                    Ok(manifest) => listed.push(Listed {
                        size: manifest.size(),
                        digest: Digest::of(&bytes),
                        name,
                        modified,
                        manifest,
                    }),
                    Err(source) => {
                        let e = StoreError::Manifest { name: name.to_string(), source };
                        tracing::warn!(error = %e, "skipping an unreadable manifest");
                    }
                },
                Err(StoreError::Io { source, .. }) if vanished(&source) => {}
                Err(e) => tracing::warn!(error = %e, "skipping an unreadable manifest"),
            }
        })?;
        listed.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(listed)
    }

    /// Calls `visit` with the model directory, the registry, namespace and model, and the
    /// tag of every file four levels below `manifests/`. Names starting with `.` are
    /// skipped, links are skipped with a warning, and a directory that vanishes on the
    /// way (a concurrent delete) is skipped; one that cannot be read is skipped with a
    /// warning. Only `manifests/` itself must be readable.
    fn walk_manifests(&self, visit: &mut dyn FnMut(&Dir, [&str; 3], &str)) -> Result<(), StoreError> {
        fn subdirs(dir: &Dir) -> Vec<(String, Dir)> {
            let entries = match dir.entries() {
                Ok(entries) => entries,
                Err(e) => {
                    if !vanished(&e) {
                        tracing::warn!(dir = dir.path(), error = %e, "skipping an unreadable manifest directory");
                    }
                    return Vec::new();
                }
            };
            let mut out = Vec::new();
            for entry in entries {
                if entry.name.starts_with('.') {
                    continue;
                }
                match entry.kind {
                    Kind::Dir => {}
                    Kind::Symlink => {
                        tracing::warn!(path = dir.rel(&entry.name), "skipping a symbolic link among the manifests");
                        continue;
                    }
                    _ => continue,
                }
                match dir.dir(&entry.name) {
                    Ok(sub) => out.push((entry.name, sub)),
                    Err(e) if vanished(&e) => {}
                    Err(e) => tracing::warn!(path = dir.rel(&entry.name), error = %e, "skipping a manifest directory"),
                }
            }
            out
        }
        let manifests = self.manifests()?;
        manifests.entries().map_err(fs_err("read", "manifests".to_owned()))?;
        for (registry, registry_dir) in subdirs(&manifests) {
            for (namespace, namespace_dir) in subdirs(&registry_dir) {
                for (model, model_dir) in subdirs(&namespace_dir) {
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
