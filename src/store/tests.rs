//! The store on a real file system: crash debris, digests, sharing and removal of blobs.

use std::fs;

use super::digest::Digest;
use super::manifest::{self, Layer, Manifest};
use super::name::ModelName;
use super::{Store, StoreError};

fn name(s: &str) -> ModelName {
    ModelName::parse(s).expect("name")
}

/// A model of two blobs (weights, template) plus a config, all written through the store.
fn add_model(store: &Store, model: &str, weights: &[u8], template: &[u8]) -> Manifest {
    let layer = |media_type: &str, data: &[u8]| {
        let (digest, size) = store.write_blob(data, None).expect("blob");
        Layer { media_type: media_type.into(), digest, size, from: None }
    };
    let m = Manifest::new(
        layer(manifest::CONFIG_MEDIA_TYPE, b"{}"),
        vec![layer(manifest::MODEL, weights), layer(manifest::TEMPLATE, template)],
    );
    store.write_manifest(&name(model), &m).expect("manifest");
    m
}

#[test]
fn open_creates_the_layout_and_removes_crash_debris() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(dir.path()).expect("open");
    assert!(dir.path().join("blobs").is_dir() && dir.path().join("manifests").is_dir());
    add_model(&store, "m", b"weights", b"t");
    let debris = [dir.path().join("blobs/.tmp-abc"), dir.path().join("manifests/registry.ollama.ai/library/m/.tmp-x")];
    for path in &debris {
        fs::write(path, b"half").expect("debris");
    }
    let partial = dir.path().join(format!("blobs/{}-partial", Digest::of(b"x").file_name()));
    fs::write(&partial, b"resumable").expect("partial");
    let store = Store::open(dir.path()).expect("reopen");
    assert!(debris.iter().all(|p| !p.exists()), "temporary files are removed");
    assert!(partial.exists(), "partial downloads are kept for resuming");
    assert_eq!(store.list().expect("list").len(), 1);
}

#[test]
fn a_blob_that_does_not_match_its_digest_leaves_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(dir.path()).expect("open");
    let expected = Digest::of(b"what was announced");
    let err = store.write_blob(&b"something else"[..], Some(&expected)).expect_err("mismatch");
    assert!(matches!(err, StoreError::DigestMismatch { .. }), "{err}");
    assert!(err.to_string().contains(&expected.to_string()));
    assert_eq!(fs::read_dir(store.blobs_dir()).expect("read").count(), 0, "no blob, no temporary file");
    let (digest, size) = store.write_blob(&b"what was announced"[..], Some(&expected)).expect("match");
    assert_eq!((digest, size), (expected, 18));
    let mode =
        std::os::unix::fs::PermissionsExt::mode(&fs::metadata(store.blob_path(&digest)).expect("meta").permissions());
    assert_eq!(mode & 0o777, 0o644);
    assert_eq!(fs::read(store.blob_path(&digest)).expect("blob"), b"what was announced");
}

#[test]
fn an_imported_file_is_stored_once_and_verified() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(&dir.path().join("store")).expect("open");
    let file = dir.path().join("model.gguf");
    crate::demo_model::write_tiny_llama(&file).expect("model");
    let (digest, size) = store.import_file(&file, None).expect("import");
    assert_eq!(size, fs::metadata(&file).expect("meta").len());
    assert_eq!(fs::read(store.blob_path(&digest)).expect("blob"), fs::read(&file).expect("file"));
    store.verify_blob(&digest).expect("verified");
    // Same file system: the blob shares the file's data. Where reflinks work the blob is a
    // clone (its own inode); elsewhere (ext4 here) it is a hard link (the same inode).
    let probe = dir.path().join("probe");
    let reflinks = reflink_copy::reflink(&file, &probe).is_ok();
    let same_inode = {
        use std::os::unix::fs::MetadataExt;
        fs::metadata(&file).expect("meta").ino() == fs::metadata(store.blob_path(&digest)).expect("meta").ino()
    };
    assert!(reflinks || same_inode, "the import copied the data instead of sharing it");
    assert_eq!(store.import_file(&file, None).expect("again").0, digest, "importing twice is a no-op");
    let missing = store.import_file(&dir.path().join("nope.gguf"), None).expect_err("missing");
    assert!(missing.to_string().contains("nope.gguf"), "{missing}");
}

#[test]
fn a_manifest_naming_a_missing_blob_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(dir.path()).expect("open");
    let ghost = Layer { media_type: manifest::MODEL.into(), digest: Digest::of(b"ghost"), size: 5, from: None };
    let (config, _) = store.write_blob(&b"{}"[..], None).expect("config");
    let config = Layer { media_type: manifest::CONFIG_MEDIA_TYPE.into(), digest: config, size: 2, from: None };
    let err = store.write_manifest(&name("m"), &Manifest::new(config, vec![ghost])).expect_err("missing");
    assert!(matches!(err, StoreError::MissingBlob(_)), "{err}");
    assert!(store.list().expect("list").is_empty());
}

#[test]
fn list_copy_and_delete_share_and_free_blobs() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(dir.path()).expect("open");
    let a = add_model(&store, "a:1", b"shared weights", b"template a");
    let b = add_model(&store, "ns/b:2", b"shared weights", b"template b");
    store.copy(&name("a:1"), &name("localhost:5000/x/a-copy")).expect("copy");
    let listed = store.list().expect("list");
    let names: Vec<String> = listed.iter().map(|l| l.name.to_string()).collect();
    assert_eq!(names, ["localhost:5000/x/a-copy:latest", "a:1", "ns/b:2"], "sorted by full name");
    let copy = listed.iter().find(|l| l.name.model() == "a-copy").expect("copy listed");
    let original = listed.iter().find(|l| l.name.model() == "a").expect("a listed");
    assert_eq!(copy.digest, original.digest, "a copy is the same manifest");
    assert_eq!(original.size, a.size());

    // Deleting a frees nothing its copy still uses.
    assert!(store.delete(&name("a:1")).expect("delete a").is_empty());
    // Deleting the copy frees the template only: b shares the weights and the config.
    let freed = store.delete(&name("localhost:5000/x/a-copy")).expect("delete copy");
    assert_eq!(freed, vec![a.layers[1].digest]);
    assert!(!dir.path().join("manifests/localhost:5000").exists(), "empty directories go too");
    assert!(store.has_blob(&b.layers[0].digest));
    let freed = store.delete(&name("ns/b:2")).expect("delete b");
    assert_eq!(freed.len(), 3);
    assert_eq!(fs::read_dir(store.blobs_dir()).expect("blobs").count(), 0);

    let err = store.delete(&name("ns/b:2")).expect_err("gone");
    assert_eq!(err.to_string(), "model \"ns/b:2\" not found");
    assert!(matches!(store.copy(&name("nope"), &name("x")), Err(StoreError::NotFound(_))));
}

#[test]
fn a_pinned_blob_survives_the_deletion_of_its_last_model() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(dir.path()).expect("open");
    let m = add_model(&store, "a", b"weights", b"t");
    let weights = m.layers[0].digest;
    let pin = store.pin([weights]);
    let freed = store.delete(&name("a")).expect("delete");
    assert!(!freed.contains(&weights) && store.has_blob(&weights), "an operation in progress still needs it");
    assert_eq!(freed.len(), 2);
    drop(pin);
}

#[test]
fn unreadable_manifests_are_skipped_in_listings_and_named_when_asked_for() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(dir.path()).expect("open");
    add_model(&store, "good", b"w", b"t");
    let bad = dir.path().join("manifests/registry.ollama.ai/library/bad");
    fs::create_dir_all(&bad).expect("mkdir");
    fs::write(bad.join("latest"), b"{ not json").expect("write");
    fs::write(dir.path().join("manifests/stray-file"), b"x").expect("write");
    let listed = store.list().expect("list");
    assert_eq!(listed.len(), 1);
    let err = store.manifest(&name("bad")).expect_err("bad");
    assert!(err.to_string().starts_with("bad:latest: invalid manifest"), "{err}");
}

#[test]
fn an_ollama_directory_is_used_read_only_or_imported() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ollama = Store::open(&dir.path().join("ollama")).expect("open");
    let good = add_model(&ollama, "good", b"good weights", b"t");
    let bad = add_model(&ollama, "bad", b"bad weights", b"t");
    // Damage one blob of "bad" in place.
    fs::write(ollama.blob_path(&bad.layers[0].digest), b"bit rot").expect("damage");

    let read_only = Store::open_read_only(&dir.path().join("ollama")).expect("read-only");
    assert_eq!(read_only.list().expect("list").len(), 2);
    assert!(
        Store::open_read_only(&dir.path().join("nowhere"))
            .expect_err("no store")
            .to_string()
            .contains("is not a model store")
    );

    let ours = Store::open(&dir.path().join("ours")).expect("open");
    let imported = ours.import_store(&read_only).expect("import");
    assert_eq!(imported, [name("good")]);
    assert!(ours.has_blob(&good.layers[0].digest));
    assert!(!ours.has_blob(&bad.layers[0].digest), "a damaged blob is not imported");
    assert!(!ours.has_blob(&Digest::of(b"bit rot")), "nor stored under the digest of its damage");
    assert_eq!(ours.manifest(&name("good")).expect("manifest").1, ollama.manifest(&name("good")).expect("manifest").1);
    assert!(matches!(ours.manifest(&name("bad")), Err(StoreError::NotFound(_))));
}
