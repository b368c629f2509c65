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
    )
    .expect("weights");
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
    assert!(!debris[0].exists(), "temporary files at the top are removed at once");
    assert!(debris[1].exists(), "those below a model's directory are left for later");
    store.remove_nested_temporaries().expect("the later sweep");
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
    let err =
        store.write_manifest(&name("m"), &Manifest::new(config, vec![ghost]).expect("weights")).expect_err("missing");
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
    assert_eq!(freed, vec![a.layers()[1].digest]);
    assert!(!dir.path().join("manifests/localhost:5000").exists(), "empty directories go too");
    assert!(store.has_blob(&b.layers()[0].digest));
    let freed = store.delete(&name("ns/b:2")).expect("delete b");
    assert_eq!(freed.len(), 3);
    assert_eq!(fs::read_dir(store.blobs_dir()).expect("blobs").count(), 0);

    let err = store.delete(&name("ns/b:2")).expect_err("gone");
    assert_eq!(err.to_string(), "model 'ns/b:2' not found");
    assert!(matches!(store.copy(&name("nope"), &name("x")), Err(StoreError::NotFound(_))));
}

#[test]
fn a_pinned_blob_survives_the_deletion_of_its_last_model() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(dir.path()).expect("open");
    let m = add_model(&store, "a", b"weights", b"t");
    let weights = m.layers()[0].digest;
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
    fs::write(ollama.blob_path(&bad.layers()[0].digest), b"bit rot").expect("damage");

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
    assert!(ours.has_blob(&good.layers()[0].digest));
    assert!(!ours.has_blob(&bad.layers()[0].digest), "a damaged blob is not imported");
    assert!(!ours.has_blob(&Digest::of(b"bit rot")), "nor stored under the digest of its damage");
    assert_eq!(ours.manifest(&name("good")).expect("manifest").1, ollama.manifest(&name("good")).expect("manifest").1);
    assert!(matches!(ours.manifest(&name("bad")), Err(StoreError::NotFound(_))));
}

/// A directory outside the store holding a secret file and a directory, for links to point at.
fn outside() -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().expect("tempdir");
    let secret = dir.path().join("secret");
    fs::write(&secret, b"root:$6$secret").expect("secret");
    (dir, secret)
}

fn assert_refused<T: std::fmt::Debug>(result: Result<T, StoreError>, what: &str) {
    match result {
        Err(e @ StoreError::Refused { .. }) => {
            assert!(e.to_string().contains("symbolic link"), "{what}: {e}");
            assert!(!e.to_string().contains("/tmp"), "{what}: no absolute path in {e}");
        }
        other => panic!("{what}: expected a refusal, got {other:?}"),
    }
}

/// What every request asks (a model's details, from the cache once read, and its weights'
/// path for a runner) is answered with one path lookup where openat2 is there: links planted
/// after the first read are refused all the same, with openat2 and without.
#[test]
fn links_planted_after_a_models_first_use_are_refused_on_every_path() {
    use std::os::unix::fs::symlink;
    for openat2 in [true, false] {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::open(dir.path()).expect("open");
        if !openat2 {
            store.dir.without_openat2();
        }
        let gguf = crate::demo_model::tiny_llama_bytes().expect("model");
        let weights = add_model(&store, "good", &gguf, b"template").model().digest;
        let mode = if openat2 { "with openat2" } else { "walking" };
        let use_it = || store.details(&name("good")).and_then(|_| store.blob_file(&weights));
        assert_eq!(use_it().expect("first use"), store.blob_path(&weights), "{mode}");
        assert!(std::sync::Arc::ptr_eq(
            &store.details(&name("good")).expect("a"),
            &store.details(&name("good")).expect("b")
        ));
        let (elsewhere, _) = outside();
        // Each planted in turn, as a link to a copy of what was there, then put back.
        let manifest_file = dir.path().join("manifests/registry.ollama.ai/library/good/latest");
        let model_dir = dir.path().join("manifests/registry.ollama.ai/library/good");
        let library = dir.path().join("manifests/registry.ollama.ai/library");
        let blob = store.blob_path(&weights);
        let blobs = dir.path().join("blobs");
        for (planted, what) in [
            (&manifest_file, "a linked manifest"),
            (&model_dir, "a linked model directory"),
            (&library, "a linked directory on the way"),
            (&blob, "linked weights"),
            (&blobs, "a linked blobs directory"),
        ] {
            let moved = elsewhere.path().join("moved");
            fs::rename(planted, &moved).expect("move");
            symlink(&moved, planted).expect("symlink");
            assert_refused(use_it(), &format!("{what}, {mode}"));
            fs::remove_file(planted).expect("remove the link");
            fs::rename(&moved, planted).expect("put back");
            assert_eq!(use_it().expect("back"), blob, "{what} put back, {mode}");
        }
        fs::remove_file(&manifest_file).expect("remove");
        assert!(matches!(store.details(&name("good")), Err(StoreError::NotFound(_))), "{mode}");
    }
}

#[test]
fn links_planted_in_the_store_are_refused_never_followed() {
    use std::os::unix::fs::symlink;
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(dir.path()).expect("open");
    let m = add_model(&store, "good", b"weights", b"template");
    let (elsewhere, secret) = outside();

    // A manifest directory that is a link to a directory elsewhere holding a manifest.
    let target = elsewhere.path().join("models");
    fs::create_dir(&target).expect("mkdir");
    fs::write(target.join("latest"), fs::read(store.manifest_path(&name("good"))).expect("read")).expect("plant");
    symlink(&target, dir.path().join("manifests/registry.ollama.ai/library/evil")).expect("symlink");
    assert_refused(store.manifest(&name("evil")), "read through a linked directory");
    assert_refused(store.delete(&name("evil")), "delete through a linked directory");
    assert_refused(store.copy(&name("evil"), &name("x")), "copy from a linked directory");
    assert_refused(store.copy(&name("good"), &name("evil:new")), "copy into a linked directory");
    assert_refused(store.write_manifest(&name("evil:new"), &m), "write into a linked directory");
    assert_refused(store.details(&name("evil")), "show through a linked directory");
    assert!(!target.join("new").exists(), "nothing was written through the link");
    assert!(target.join("latest").exists(), "nothing was deleted through the link");

    // A manifest file that is a link to a file elsewhere.
    symlink(&secret, dir.path().join("manifests/registry.ollama.ai/library/good/leak")).expect("symlink");
    assert_refused(store.manifest(&name("good:leak")), "read a linked manifest");
    assert_refused(store.manifest_bytes(&name("good:leak")), "read a linked manifest's bytes");
    assert_refused(store.details(&name("good:leak")), "show a linked manifest");
    assert_refused(store.delete(&name("good:leak")), "delete a linked manifest");
    let names: Vec<String> = store.list().expect("list").iter().map(|l| l.name.to_string()).collect();
    assert_eq!(names, ["good:latest"], "links are not listed");

    // A blob that is a link: not a blob, never read, and replaced (not written through) by
    // a write of the real data.
    let linked = Digest::of(b"real data");
    symlink(&secret, store.blob_path(&linked)).expect("symlink");
    assert!(!store.has_blob(&linked));
    assert_refused(store.open_blob(&linked), "open a linked blob");
    assert_refused(store.read_blob(&linked, super::limits::SmallBlob::Config), "read a linked blob");
    assert_refused(store.verify_blob(&linked), "verify a linked blob");
    assert_refused(store.blob_file(&linked), "hand a linked blob to a runner");
    store.write_blob(&b"real data"[..], Some(&linked)).expect("write replaces the link");
    assert_eq!(fs::read(store.blob_path(&linked)).expect("blob"), b"real data");

    // A model whose text layer is a link to a secret: show refuses it.
    let template = m.layers()[1].digest;
    fs::remove_file(store.blob_path(&template)).expect("remove");
    symlink(&secret, store.blob_path(&template)).expect("symlink");
    let copied = store.copy(&name("good"), &name("copy"));
    assert!(matches!(copied, Err(StoreError::MissingBlob(d)) if d == template), "a link is no blob: {copied:?}");
    // Deleting the model removes the link itself, never the file it points to.
    store.delete(&name("good")).expect("delete");
    assert!(fs::symlink_metadata(store.blob_path(&template)).is_err(), "the link is gone");
    assert_eq!(fs::read(&secret).expect("secret"), b"root:$6$secret", "the target is untouched");

    // `blobs/` itself a link: the store does not open.
    let other = tempfile::tempdir().expect("tempdir");
    symlink(elsewhere.path(), other.path().join("blobs")).expect("symlink");
    assert_refused(Store::open(other.path()), "open a store whose blobs/ is a link");
    assert_refused(Store::open_read_only(other.path()), "open a store whose blobs/ is a link read-only");
    assert_eq!(fs::read_dir(elsewhere.path()).expect("read").count(), 2, "nothing was made through blobs/");
}

#[test]
fn a_fifo_planted_as_a_blob_is_refused_without_waiting() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(dir.path()).expect("open");
    let digest = Digest::of(b"fifo");
    nix::unistd::mkfifo(&store.blob_path(&digest), nix::sys::stat::Mode::S_IRWXU).expect("fifo");
    let e = store.read_blob(&digest, super::limits::SmallBlob::Config).expect_err("a FIFO");
    assert!(matches!(e, StoreError::Refused { .. }) && e.to_string().contains("not a regular file"), "{e}");
}

#[test]
fn garbage_collection_removes_unused_blobs_and_stale_partials_once_old_enough() {
    use std::time::{Duration, SystemTime};
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(dir.path()).expect("open");
    let model = add_model(&store, "kept", b"weights", b"template");
    let (uploaded, uploaded_size) = store.write_blob(&b"uploaded, never used"[..], None).expect("upload");
    let stale = Digest::of(b"a pull that stopped");
    let blobs = dir.path().join("blobs");
    fs::write(blobs.join(format!("{}-partial", stale.file_name())), b"half").expect("partial");
    fs::write(blobs.join(format!("{}-partial.json", stale.file_name())), b"{}").expect("record");
    fs::write(blobs.join(".tmp-debris"), b"x").expect("debris");
    fs::write(dir.path().join("manifests/.tmp-debris"), b"y").expect("debris");
    let (elsewhere, secret) = outside();
    let linked = Digest::of(b"linked");
    std::os::unix::fs::symlink(&secret, store.blob_path(&linked)).expect("symlink");
    // A manifest that does not parse still keeps what it names.
    let kept_by_broken = store.write_blob(&b"named by a broken manifest"[..], None).expect("blob").0;
    let broken = dir.path().join("manifests/registry.ollama.ai/library/broken");
    fs::create_dir_all(&broken).expect("mkdir");
    fs::write(broken.join("latest"), format!("{{\"layers\": [\"{kept_by_broken}\"")).expect("broken manifest");

    let grace = Duration::from_secs(3600);
    let now = SystemTime::now();
    assert_eq!(store.collect_garbage(grace, now).expect("gc"), super::gc::Collected::default(), "all too young");

    // Two hours later.
    let now = now + Duration::from_secs(7200);
    let pinned = store.pin([uploaded]);
    let collected = store.collect_garbage(grace, now).expect("gc");
    assert_eq!((collected.blobs, collected.partials, collected.temporaries), (0, 2, 2), "{collected:?}");
    assert!(store.has_blob(&uploaded), "a pinned blob stays");
    drop(pinned);
    let collected = store.collect_garbage(grace, now).expect("gc");
    assert_eq!(collected, super::gc::Collected { blobs: 1, partials: 0, temporaries: 0, bytes: uploaded_size });
    assert!(!store.has_blob(&uploaded));
    for layer in model.blobs() {
        store.verify_blob(&layer.digest).expect("what a model uses stays");
    }
    assert!(store.has_blob(&kept_by_broken), "what a broken manifest names stays");
    assert!(fs::symlink_metadata(store.blob_path(&linked)).is_ok(), "a link is left alone");
    assert_eq!(fs::read(&secret).expect("secret"), b"root:$6$secret");
    let mut left: Vec<String> =
        fs::read_dir(&blobs).expect("read").map(|e| e.expect("e").file_name().to_string_lossy().into_owned()).collect();
    left.sort();
    let mut expected: Vec<String> =
        model.blobs().map(|l| l.digest.file_name()).chain([kept_by_broken.file_name(), linked.file_name()]).collect();
    expected.sort();
    assert_eq!(left, expected);
    drop(elsewhere);
}

#[test]
fn garbage_collection_leaves_alone_what_a_running_upload_or_create_uses() {
    use std::time::{Duration, SystemTime};
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(&dir.path().join("store")).expect("open");
    // Everything counts as old: only pins and writes in progress protect.
    let later = SystemTime::now() + Duration::from_secs(86_400);

    // An upload whose data is still arriving (its file, as `POST /api/blobs` opens it, half
    // written): its temporary file stays.
    let mut upload = store.upload_blob_file().expect("the upload's file");
    upload.append(b"first half, ").expect("write");
    let collected = store.collect_garbage(Duration::ZERO, later).expect("gc");
    assert_eq!(collected.files(), 0, "{collected:?}");
    upload.append(b"second half").expect("write");
    let digest = Digest::of(b"first half, second half");
    store.commit_blob(upload, &digest).expect("the upload's blob");
    assert_eq!(store.read_blob(&digest, super::limits::SmallBlob::Config).expect("blob"), b"first half, second half");

    // Creates running beside collections that run as often as they can.
    let file = dir.path().join("tiny.gguf");
    crate::demo_model::write_tiny_llama(&file).expect("model");
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let collector = {
        let (store, stop) = (store.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut rounds = 0;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                store.collect_garbage(Duration::ZERO, later).expect("gc");
                rounds += 1;
            }
            rounds
        })
    };
    for i in 0..20 {
        let modelfile = super::modelfile::Modelfile::parse(&format!(
            "FROM {}\nSYSTEM \"\"\"system {i}\"\"\"\nPARAMETER num_ctx {}\n",
            file.display(),
            512 + i
        ))
        .expect("modelfile");
        let spec = super::create::CreateSpec::from_modelfile(&modelfile, dir.path()).expect("spec");
        store.create(&name(&format!("m{i}")), &spec, &mut |_| {}).expect("create beside a collection");
        store.show(&name(&format!("m{i}")), false).expect("every blob of the new model is there");
    }
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    assert!(collector.join().expect("join") > 0);
    for listed in store.list().expect("list") {
        for layer in listed.manifest.blobs() {
            store.verify_blob(&layer.digest).expect("consistent");
        }
    }
}

#[test]
fn concurrent_copies_deletes_and_listings_of_models_sharing_blobs_never_fail() {
    use std::sync::{Arc, Barrier};
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(dir.path()).expect("open");
    add_model(&store, "base", b"shared weights", b"shared template");
    let threads = 6;
    let rounds = 150;
    let barrier = Arc::new(Barrier::new(threads));
    let workers: Vec<_> = (0..threads)
        .map(|t| {
            let (store, barrier) = (store.clone(), barrier.clone());
            std::thread::spawn(move || {
                barrier.wait();
                let mut failures = Vec::new();
                for r in 0..rounds {
                    // Names that collide between threads, in namespaces whose directories
                    // come and go.
                    let a = name(&format!("ns{}/m{}:{}", r % 3, (t + r) % 4, r % 2));
                    let b = name(&format!("ns{}/m{}:{}", (r + 1) % 3, (t + r + 1) % 4, r % 2));
                    let results = [
                        store.copy(&name("base"), &a).map(drop),
                        store.copy(&a, &b).map(drop),
                        store.list().map(drop),
                        store.delete(&a).map(drop),
                        store.manifest(&b).map(drop),
                        store.delete(&b).map(drop),
                    ];
                    for result in results {
                        match result {
                            Ok(()) | Err(StoreError::NotFound(_)) => {}
                            Err(e) => failures.push(e.to_string()),
                        }
                    }
                }
                failures
            })
        })
        .collect();
    let failures: Vec<String> = workers.into_iter().flat_map(|w| w.join().expect("join")).collect();
    assert!(failures.is_empty(), "{} failures, first: {:?}", failures.len(), &failures[..failures.len().min(5)]);
    // Consistent: every manifest's blobs are there, and no blob is left that none names.
    let listed = store.list().expect("list");
    let mut used = std::collections::BTreeSet::new();
    for model in &listed {
        for layer in model.manifest.blobs() {
            store.verify_blob(&layer.digest).expect("a listed model's blob");
            used.insert(layer.digest.file_name());
        }
    }
    let on_disk: std::collections::BTreeSet<String> = fs::read_dir(store.blobs_dir())
        .expect("read")
        .map(|e| e.expect("e").file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(on_disk, used, "blobs left behind by deletes");
    for model in listed {
        store.delete(&model.name).expect("delete what is left");
    }
    assert_eq!(fs::read_dir(store.blobs_dir()).expect("read").count(), 0);
    assert_eq!(fs::read_dir(store.manifests_dir()).expect("read").count(), 0, "empty directories go");
}

#[tokio::test(start_paused = true)]
async fn garbage_collection_runs_at_start_and_again_every_interval() {
    use std::time::{Duration, Instant};
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(dir.path()).expect("open");
    let gone = |digest: Digest| {
        let store = store.clone();
        async move {
            // Real time for the deadline: the collection runs on the blocking pool.
            let deadline = Instant::now() + Duration::from_secs(30);
            while store.has_blob(&digest) {
                assert!(Instant::now() < deadline, "blob {digest} was not collected");
                // A virtual minute: the paused clock jumps to the next timer when idle.
                tokio::time::sleep(Duration::from_secs(60)).await;
            }
        }
    };
    let (first, _) = store.write_blob(&b"unused at start"[..], None).expect("blob");
    let task = tokio::spawn(super::gc::run(store.clone(), Some(Duration::from_secs(3600)), Duration::ZERO));
    gone(first).await;
    // Written after the first collection: only a later, periodic one takes it.
    let (second, _) = store.write_blob(&b"unused later"[..], None).expect("blob");
    gone(second).await;
    task.abort();
}

#[test]
fn a_blob_claimed_by_a_client_gets_a_new_grace_before_garbage_collection() {
    use std::time::{Duration, SystemTime};
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(dir.path()).expect("open");
    let (blob, _) = store.write_blob(&b"uploaded long ago, never used"[..], None).expect("upload");
    let grace = Duration::from_secs(3600);
    let later = SystemTime::now() + Duration::from_secs(7200);
    // A client asks for it two hours after the upload (HEAD /api/blobs), then creates a model.
    assert!(store.claim_blob(&blob, later), "the blob is there");
    let collected = store.collect_garbage(grace, later + Duration::from_secs(60)).expect("gc");
    assert_eq!(collected.blobs, 0, "a blob just claimed is kept: {collected:?}");
    assert!(store.has_blob(&blob));
    // Unclaimed for longer than the grace, it goes.
    let collected = store.collect_garbage(grace, later + Duration::from_secs(2 * 3600)).expect("gc");
    assert_eq!(collected.blobs, 1, "{collected:?}");
    assert!(!store.claim_blob(&blob, later), "gone");
}

/// Whether `file` is open for direct I/O.
fn is_direct(file: &fs::File) -> bool {
    rustix::fs::fcntl_getfl(file).expect("flags").contains(rustix::fs::OFlags::DIRECT)
}

/// An aligned run of `len` bytes, each a function of its position from `seed`.
fn aligned_data(len: usize, seed: usize) -> (Vec<u8>, std::ops::Range<usize>) {
    let mut buffer = vec![0u8; len + super::stream::ALIGN];
    let start = buffer.as_ptr().align_offset(super::stream::ALIGN);
    for (i, byte) in buffer[start..start + len].iter_mut().enumerate() {
        *byte = (i + seed).wrapping_mul(2_654_435_761).to_le_bytes()[1];
    }
    (buffer, start..start + len)
}

/// A new blob file in `store`, open for direct I/O.
fn direct_blob_file(store: &Store) -> super::TempFile {
    let mut temp = store.temp_blob_file().expect("temp");
    assert!(temp.direct(), "the test's file system (that of the temporary directory) has direct I/O");
    temp
}

/// `[store] direct_io = false`: uploads and pulls write through the page cache only.
#[test]
fn blobs_are_written_with_direct_io_unless_the_store_is_set_without() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(dir.path()).expect("store");
    assert!(store.direct_io());
    assert!(is_direct(store.upload_blob_file().expect("file").as_file()), "an upload's file, by default");
    let without = store.with_direct_io(false);
    assert!(!without.direct_io());
    assert!(!is_direct(without.upload_blob_file().expect("file").as_file()), "an upload's file, direct_io off");
}

/// A blob file open for direct I/O takes aligned batches that way, and its tail (not a
/// whole block) through the page cache; what is committed is exactly what was appended.
#[test]
fn a_direct_blob_file_takes_aligned_batches_directly_and_the_tail_through_the_cache() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(dir.path()).expect("open");
    let mut temp = direct_blob_file(&store);
    let (first, first_at) = aligned_data(super::stream::BATCH, 0);
    let (second, second_at) = aligned_data(3 * super::stream::ALIGN, 7);
    let (tail, tail_at) = aligned_data(1000, 9);
    let mut expected = Vec::new();
    for (buffer, at) in [(&first, first_at), (&second, second_at)] {
        temp.append(&buffer[at.clone()]).expect("an aligned append");
        expected.extend_from_slice(&buffer[at]);
        assert!(is_direct(temp.as_file()), "aligned data goes on directly");
    }
    temp.append(&tail[tail_at.clone()]).expect("the tail");
    expected.extend_from_slice(&tail[tail_at]);
    assert!(!is_direct(temp.as_file()), "the tail goes through the page cache");
    let digest = Digest::of(&expected);
    store.commit_blob(temp, &digest).expect("commit");
    assert_eq!(fs::read(store.blob_path(&digest)).expect("read the blob"), expected);
}

/// A direct write the kernel refuses for its alignment (`EINVAL`, as on a device with
/// blocks over 4 KiB) turns direct I/O off and writes the same bytes through the page
/// cache, also after part of them went: what is committed is what was appended. Any other
/// error of the direct write fails the append.
#[test]
fn a_direct_write_refused_for_its_alignment_is_written_through_the_cache() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(dir.path()).expect("open");
    let mut temp = direct_blob_file(&store);
    let (first, first_at) = aligned_data(2 * super::stream::ALIGN, 1);
    let (second, second_at) = aligned_data(super::stream::ALIGN, 2);
    temp.append_with(&first[first_at.clone()], |file, data, at| {
        // Half of it lands before the refusal.
        std::os::unix::fs::FileExt::write_all_at(file, &data[..super::stream::ALIGN], at)?;
        Err(std::io::Error::from_raw_os_error(libc::EINVAL))
    })
    .expect("refused directly, written through the cache");
    assert!(!is_direct(temp.as_file()), "direct I/O is off after the refusal");
    temp.append(&second[second_at.clone()]).expect("the next append");
    let mut expected = first[first_at].to_vec();
    expected.extend_from_slice(&second[second_at]);
    let digest = Digest::of(&expected);
    store.commit_blob(temp, &digest).expect("commit");
    assert_eq!(fs::read(store.blob_path(&digest)).expect("read the blob"), expected);

    let mut temp = direct_blob_file(&store);
    let (data, at) = aligned_data(super::stream::ALIGN, 3);
    let error = temp
        .append_with(&data[at], |_, _, _| Err(std::io::Error::from_raw_os_error(libc::ENOSPC)))
        .expect_err("a full disk fails the append");
    assert_eq!(error.raw_os_error(), Some(libc::ENOSPC));
}

/// An upload's direct writes that keep its writer busy for whole windows in a row (a disk
/// slower than the data, made here by a direct write that takes its time) send the rest through
/// the page cache; writes that leave the writer waiting for data stay direct. Either way
/// the blob is what was appended.
#[test]
fn a_blob_file_whose_disk_is_the_slower_part_takes_the_rest_through_the_cache() {
    use std::os::unix::fs::FileExt;
    use std::time::Duration;

    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(dir.path()).expect("open");
    let (batch, at) = aligned_data(super::stream::PIPELINE_BATCH, 5);
    // The windows' worth of batches that may make the disk the slower part, and one more.
    let window = usize::try_from(super::stream::PACE_WINDOW).expect("fits") / super::stream::PIPELINE_BATCH;
    let batches = window * super::stream::SLOW_WINDOWS as usize + 1;
    let expected = batch[at.clone()].repeat(batches);
    let digest = Digest::of(&expected);
    // Margins wide enough for a loaded machine: a slow write lasts far longer than the
    // loop's gap between two writes, a pause far longer than a real 4 MiB write.
    for (slow_disk, pause_between) in [(true, Duration::ZERO), (false, Duration::from_millis(40))] {
        let mut temp = direct_blob_file(&store);
        for i in 0..batches {
            std::thread::sleep(pause_between);
            temp.append_with(&batch[at.clone()], |file, data, offset| {
                file.write_all_at(data, offset)?;
                if slow_disk {
                    std::thread::sleep(Duration::from_millis(20));
                }
                Ok(())
            })
            .expect("append");
            if i < batches - 2 {
                assert!(is_direct(temp.as_file()), "batch {i}: a window not yet full");
            }
        }
        assert_eq!(is_direct(temp.as_file()), !slow_disk, "slow disk {slow_disk}");
        store.commit_blob(temp, &digest).expect("commit");
        assert_eq!(fs::read(store.blob_path(&digest)).expect("read the blob"), expected);
        fs::remove_file(store.blob_path(&digest)).expect("remove");
    }
}

/// Data that is not aligned for direct I/O (where it sits in memory, or its length) turns
/// direct I/O off for the rest of the file, and is written all the same.
#[test]
fn unaligned_data_in_a_direct_blob_file_is_written_through_the_cache() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(dir.path()).expect("open");
    let (buffer, at) = aligned_data(2 * super::stream::ALIGN + 1, 3);
    // Misplaced in memory (one byte past a block's start), or not whole blocks long.
    for (from, split) in [(at.start + 1, at.start + 1), (at.start, at.start + 4095)] {
        let mut temp = direct_blob_file(&store);
        let mut expected = Vec::new();
        for piece in [from..split, split..at.end] {
            temp.append(&buffer[piece.clone()]).expect("append");
            expected.extend_from_slice(&buffer[piece]);
        }
        assert!(!is_direct(temp.as_file()));
        let digest = Digest::of(&expected);
        store.commit_blob(temp, &digest).expect("commit");
        assert_eq!(fs::read(store.blob_path(&digest)).expect("read the blob"), expected);
    }
}
