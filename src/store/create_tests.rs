//! Creating models from GGUF files, blobs and other models, and showing them.

use std::collections::HashMap;
use std::fs;
use std::path::Path;

use serde_json::json;

use super::create::{CreateSpec, Source, human_count};
use super::digest::Digest;
use super::manifest;
use super::modelfile::Modelfile;
use super::name::ModelName;
use super::show::ModelDetails;
use super::{PassedFile, Progress, Store, StoreError};

fn name(s: &str) -> ModelName {
    ModelName::parse(s).expect("name")
}

fn setup() -> (tempfile::TempDir, Store) {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(&dir.path().join("store")).expect("open");
    crate::demo_model::write_tiny_llama(&dir.path().join("tiny.gguf")).expect("model");
    (dir, store)
}

fn create(store: &Store, model: &str, modelfile: &str, base: &Path) -> Result<(Digest, Vec<String>), StoreError> {
    let mf = Modelfile::parse(modelfile).expect("modelfile");
    let spec = CreateSpec::from_modelfile(&mf, base)?;
    let mut statuses = Vec::new();
    let digest = store.create(&name(model), &spec, &mut |s| statuses.push(s.status))?;
    Ok((digest, statuses))
}

/// Everything in the blob directory, to prove that a failure wrote nothing.
fn blob_files(store: &Store) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(store.blobs_dir())
        .expect("blobs")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[test]
fn a_model_from_a_gguf_and_a_modelfile_shows_everything_it_was_given() {
    let (dir, store) = setup();
    let (digest, statuses) = create(
        &store,
        "tiny:chat",
        "FROM ./tiny.gguf\nTEMPLATE \"\"\"{{ .Prompt }}\"\"\"\nSYSTEM Be brief.\nPARAMETER temperature 0.2\nPARAMETER stop <|im_end|>\nLICENSE MIT\nMESSAGE user hello\n",
        dir.path(),
    )
    .expect("create");
    assert_eq!(statuses.first().map(String::as_str), Some("parsing GGUF"));
    assert_eq!(statuses.last().map(String::as_str), Some("success"));
    assert!(statuses.contains(&"writing manifest".to_owned()));

    let shown = store.show(&name("tiny:chat"), false).expect("show");
    assert_eq!(shown.digest, digest);
    assert_eq!(shown.config.model_format, "gguf");
    assert_eq!(shown.config.model_family, "llama");
    assert_eq!(shown.config.file_type, "F16");
    assert_eq!(shown.config.model_type, human_count(shown.info.parameter_count));
    assert_eq!(shown.template.as_deref(), Some("{{ .Prompt }}"));
    assert_eq!(shown.system.as_deref(), Some("Be brief."));
    assert_eq!(shown.licenses, ["MIT"]);
    assert_eq!(shown.messages.len(), 1);
    assert_eq!(json!(shown.parameters), json!({"temperature": 0.2, "stop": ["<|im_end|>"]}));
    assert_eq!(shown.model_info["general.architecture"], "llama");
    assert_eq!(shown.model_info["llama.block_count"], 4);
    assert!(shown.parameters_text().contains("stop                           \"<|im_end|>\""));
    let layer_types: Vec<&str> = shown.manifest.layers().iter().map(|l| l.media_type.as_str()).collect();
    assert_eq!(
        layer_types,
        [
            manifest::MODEL,
            manifest::TEMPLATE,
            manifest::SYSTEM,
            manifest::LICENSE,
            manifest::PARAMS,
            manifest::MESSAGES
        ]
    );
    assert_eq!(shown.manifest.model().from.as_deref(), Some("tiny.gguf"));

    // The Modelfile show prints recreates the same layers.
    let (_, _) = create(&store, "again", &shown.modelfile(&store).expect("modelfile"), dir.path()).expect("recreate");
    let again = store.show(&name("again"), false).expect("show");
    let digests = |m: &manifest::Manifest| m.layers().iter().map(|l| l.digest).collect::<Vec<_>>();
    assert_eq!(digests(&again.manifest), digests(&shown.manifest));
}

#[test]
fn a_model_from_another_inherits_and_overrides() {
    let (dir, store) = setup();
    create(&store, "base", "FROM ./tiny.gguf\nSYSTEM one\nPARAMETER temperature 0.5\nPARAMETER top_k 10\n", dir.path())
        .expect("base");
    let (_, statuses) =
        create(&store, "derived", "FROM base\nSYSTEM two\nPARAMETER temperature 0.9\n", dir.path()).expect("derived");
    assert!(statuses.iter().any(|s| s.starts_with("using existing layer sha256:")), "{statuses:?}");
    let base = store.show(&name("base"), false).expect("show");
    let derived = store.show(&name("derived"), false).expect("show");
    assert_eq!(derived.system.as_deref(), Some("two"));
    assert_eq!(json!(derived.parameters), json!({"temperature": 0.9, "top_k": 10}), "merged, the new value winning");
    assert_eq!(derived.manifest.model(), base.manifest.model(), "the weights are shared");
    // Deleting the base keeps what the derived model uses.
    store.delete(&name("base")).expect("delete");
    store.show(&name("derived"), false).expect("still complete");
}

#[test]
fn a_model_from_an_uploaded_blob() {
    let (dir, store) = setup();
    let (digest, _) = store.write_blob(&fs::read(dir.path().join("tiny.gguf")).expect("read"), None).expect("upload");
    create(&store, "from-blob", &format!("FROM {digest}\n"), dir.path()).expect("create");
    assert_eq!(store.show(&name("from-blob"), false).expect("show").manifest.model().digest, digest);
}

/// A Modelfile whose `instruction` has a value one byte over the cap of a text layer.
fn big_text(instruction: &str) -> String {
    format!("FROM ./tiny.gguf\n{instruction} \"\"\"{}\"\"\"\n", "x".repeat((1 << 20) + 1))
}

#[test]
fn bad_inputs_are_named_and_change_nothing() {
    let (dir, store) = setup();
    fs::write(dir.path().join("garbage.gguf"), b"this is not a gguf file").expect("write");
    // A FIFO no one writes to (opening it for reading would wait for a writer forever), a
    // device that never ends, a directory.
    nix::unistd::mkfifo(&dir.path().join("pipe.gguf"), nix::sys::stat::Mode::S_IRWXU).expect("mkfifo");
    std::os::unix::fs::symlink("/dev/zero", dir.path().join("zero.gguf")).expect("symlink");
    fs::create_dir(dir.path().join("dir.gguf")).expect("mkdir");
    create(&store, "keep", "FROM ./tiny.gguf\n", dir.path()).expect("a model that must stay");
    let before = blob_files(&store);
    let cases = [
        ("FROM ./missing.gguf\n", "missing.gguf"),
        ("FROM ./garbage.gguf\n", "garbage.gguf is not a usable GGUF file"),
        ("FROM ./pipe.gguf\n", "pipe.gguf: a pipe, not a regular file"),
        ("FROM ./zero.gguf\n", "zero.gguf: a character device, not a regular file"),
        ("FROM ./dir.gguf\n", "dir.gguf: a directory, not a regular file"),
        ("FROM ./tiny.gguf\nADAPTER ./pipe.gguf\n", "pipe.gguf: a pipe, not a regular file"),
        ("FROM ./tiny.gguf\nADAPTER ./tiny.gguf\n", "tiny.gguf is a model, expected an adapter"),
        ("FROM ./tiny.gguf\nADAPTER ./garbage.gguf\n", "garbage.gguf is not a usable GGUF file"),
        ("FROM nosuchmodel\n", "model 'nosuchmodel:latest' not found"),
        (&format!("FROM {}\n", Digest::of(b"never uploaded")), "is missing from the store"),
        ("FROM ./tiny.gguf\nADAPTER somemodel\n", "an adapter must be a GGUF file or a blob digest"),
        (&big_text("SYSTEM"), "the system prompt is 1.0 MiB (1048577 bytes), more than the limit of 1 MiB"),
        (&big_text("TEMPLATE"), "the template is 1.0 MiB (1048577 bytes)"),
        (&big_text("LICENSE"), "the license is 1.0 MiB (1048577 bytes)"),
        (&big_text("MESSAGE user"), "the messages is"),
        (
            &format!("FROM ./tiny.gguf\n{}", "LICENSE \"\"\"{}\"\"\"\n".replace("{}", &"x".repeat(1 << 20)).repeat(4)),
            "more than the limit of 4 MiB for one model's text, JSON and config layers together",
        ),
        (
            &format!("FROM ./tiny.gguf\n{}", "LICENSE \"\"\"{}\"\"\"\n".replace("{}", &"x".repeat(1 << 20)).repeat(5)),
            "the text, JSON and config layers of the model is 5 MiB (5242880 bytes), more than the limit of 4 MiB",
        ),
        (&format!("FROM ./tiny.gguf\n{}", "LICENSE MIT\n".repeat(65)), "65 licenses; a model takes at most 64"),
        (&format!("FROM ./tiny.gguf\n{}", "ADAPTER ./tiny.gguf\n".repeat(65)), "65 adapters; a model takes at most 64"),
    ];
    for (modelfile, message) in cases {
        let err = create(&store, "new", modelfile, dir.path()).expect_err(modelfile).to_string();
        assert!(err.contains(message), "{modelfile:?}: {err}");
        assert!(matches!(store.manifest(&name("new")), Err(StoreError::NotFound(_))), "{modelfile:?} left a manifest");
        assert_eq!(blob_files(&store), before, "{modelfile:?} changed the blobs");
    }
    store.show(&name("keep"), false).expect("the existing model is unharmed");
}

#[test]
fn replacing_a_model_frees_what_only_the_old_version_used() {
    let (dir, store) = setup();
    create(&store, "m", "FROM ./tiny.gguf\nSYSTEM old\n", dir.path()).expect("v1");
    let old_system = store
        .show(&name("m"), false)
        .expect("show")
        .manifest
        .layers_of(manifest::SYSTEM)
        .next()
        .expect("system")
        .digest;
    create(&store, "m", "FROM ./tiny.gguf\nSYSTEM new\n", dir.path()).expect("v2");
    assert!(!store.has_blob(&old_system), "the old system prompt is gone");
    assert_eq!(store.show(&name("m"), false).expect("show").system.as_deref(), Some("new"));
}

#[test]
fn sources_are_told_apart() {
    let dir = tempfile::tempdir().expect("tempdir");
    fs::write(dir.path().join("weights"), b"x").expect("write");
    let d = Digest::of(b"x");
    assert_eq!(Source::parse(&d.to_string(), dir.path()).expect("digest"), Source::Blob(d));
    assert_eq!(Source::parse("./a.gguf", dir.path()).expect("path"), Source::File(dir.path().join("./a.gguf")));
    assert_eq!(Source::parse("/abs/x.gguf", dir.path()).expect("path"), Source::File("/abs/x.gguf".into()));
    assert_eq!(Source::parse("weights", dir.path()).expect("existing file"), Source::File(dir.path().join("weights")));
    assert_eq!(Source::parse("llama3.2:3b", dir.path()).expect("name"), Source::Model(name("llama3.2:3b")));
    assert!(Source::parse("sha256:12", dir.path()).expect_err("bad digest").to_string().contains("invalid digest"));
    assert!(Source::parse("bad name!", dir.path()).expect_err("bad name").to_string().contains("invalid model name"));
}

#[test]
fn parameter_counts_read_like_ollamas() {
    for (n, s) in
        [(999, "999"), (225_856, "225.86K"), (137_000_000, "137M"), (3_212_749_824, "3.2B"), (8_030_261_248, "8B")]
    {
        assert_eq!(human_count(n), s);
    }
}

#[test]
fn details_are_read_once_until_the_manifest_changes() {
    let (dir, store) = setup();
    create(&store, "cached", "FROM ./tiny.gguf\nSYSTEM one\n", dir.path()).expect("create");
    let first = store.details(&name("cached")).expect("details");
    let again = store.details(&name("cached")).expect("details");
    assert!(std::sync::Arc::ptr_eq(&first, &again), "the second read comes from the cache");
    // The cache holds what show reads, but the GGUF metadata (requests do not need it).
    let shown = store.show(&name("cached"), false).expect("show");
    assert!(first.model_info.is_empty() && !shown.model_info.is_empty());
    assert_eq!(*first, ModelDetails { model_info: serde_json::Map::new(), ..shown }, "the cache holds what show reads");

    // A replaced model is read again, also through a clone of the store.
    create(&store, "cached", "FROM ./tiny.gguf\nSYSTEM two\n", dir.path()).expect("replace");
    let replaced = store.clone().details(&name("cached")).expect("details");
    assert_eq!(replaced.system.as_deref(), Some("two"));
    assert!(!std::sync::Arc::ptr_eq(&first, &replaced));

    store.delete(&name("cached")).expect("delete");
    assert!(matches!(store.details(&name("cached")), Err(StoreError::NotFound(_))));
    assert_eq!(crate::sync::lock(&store.details).held(), (0, 0), "a deleted model's details are let go");
}

/// Copies of a model with a large system prompt, each read: the cache keeps within its
/// bound, letting the details read longest ago go, which are read again when asked for.
#[test]
fn the_details_cache_keeps_within_its_bytes() {
    let (dir, store) = setup();
    let system = "s".repeat(900 << 10);
    create(&store, "big", &format!("FROM ./tiny.gguf\nSYSTEM \"\"\"{system}\"\"\"\n"), dir.path()).expect("create");
    let copies = super::show::DETAILS_CACHE_MAX / (900 << 10) + 8;
    for i in 0..copies {
        store.copy(&name("big"), &name(&format!("big{i}"))).expect("copy");
        assert_eq!(store.details(&name(&format!("big{i}"))).expect("details").system.as_deref(), Some(system.as_str()));
    }
    let (models, bytes) = crate::sync::lock(&store.details).held();
    assert!(bytes <= super::show::DETAILS_CACHE_MAX, "{bytes} bytes");
    assert!(models < copies && models > copies - 16, "{models} of {copies} kept");
    let first = store.details(&name("big0")).expect("read again");
    assert_eq!(first.system.as_deref(), Some(system.as_str()));
    assert!(std::sync::Arc::ptr_eq(&first, &store.details(&name("big0")).expect("cached again")));
}

/// A manifest the store would refuse to read back (over 4 MiB) is never written: the
/// write is refused, naming the model, the size and the cap, and the model's manifest
/// stays as it was.
#[test]
fn a_manifest_over_its_cap_is_not_written() {
    let (dir, store) = setup();
    let (digest, _) = create(&store, "keep", "FROM ./tiny.gguf\nLICENSE MIT\n", dir.path()).expect("create");
    let (manifest, _, _) = store.manifest(&name("keep")).expect("manifest");
    let mut license = manifest.layers().iter().find(|l| l.media_type == manifest::LICENSE).expect("license").clone();
    // Within the layers' bound (`manifest::LAYERS_MAX`), long in their `from`.
    license.from = Some("x".repeat(70_000));
    let layers: Vec<_> = std::iter::once(manifest.model().clone()).chain(std::iter::repeat_n(license, 63)).collect();
    let huge = manifest::Manifest::new(manifest.config().clone(), layers).expect("a manifest");
    let err = store.write_manifest(&name("keep"), &huge).expect_err("over the cap").to_string();
    assert!(err.starts_with("the manifest of keep:latest is 4.2 MiB"), "{err}");
    assert!(err.ends_with("more than the limit of 4 MiB for a manifest"), "{err}");
    assert_eq!(store.manifest(&name("keep")).expect("still there").1, digest);
}

/// `path` opened and passed, as D-Bus `CreateWithFiles` hands it over, named `key`.
fn passed(path: &Path, key: &str) -> PassedFile {
    PassedFile::new(fs::File::open(path).expect("open").into(), key).expect("a regular file")
}

fn create_passing(
    store: &Store,
    model: &str,
    modelfile: &str,
    files: &[(&str, PassedFile)],
) -> Result<(Digest, Vec<Progress>), StoreError> {
    let files: HashMap<String, PassedFile> = files.iter().map(|(k, f)| ((*k).to_owned(), f.clone())).collect();
    let spec =
        CreateSpec::from_modelfile_passing(&Modelfile::parse(modelfile).expect("modelfile"), Path::new("/"), &files)?;
    let mut steps = Vec::new();
    let digest = store.create(&name(model), &spec, &mut |p| steps.push(p))?;
    Ok((digest, steps))
}

#[test]
fn a_passed_file_makes_the_model_its_path_makes_without_a_path_to_read() {
    let (dir, store) = setup();
    let (by_path, _) = create(&store, "by-path", "FROM ./tiny.gguf\n", dir.path()).expect("by path");
    let path = dir.path().join("tiny.gguf");
    let file = passed(&path, "/home/someone/tiny.gguf");
    let size = fs::metadata(&path).expect("size").len();
    // The daemon could not reach the caller's path: here there is none at all.
    let moved = dir.path().join("elsewhere.gguf");
    fs::rename(&path, &moved).expect("move the file away");
    let (by_fd, steps) =
        create_passing(&store, "by-fd", "FROM /home/someone/tiny.gguf\n", &[("/home/someone/tiny.gguf", file)])
            .expect("by descriptor");
    assert_eq!(by_fd, by_path, "the same layers, named from the same file name");
    // The path's create stored the weights: this one only checked them.
    let checked: Vec<&Progress> = steps.iter().filter(|p| p.status == "checking tiny.gguf").collect();
    assert_eq!(checked.last().map(|p| (p.total, p.completed)), Some((Some(size), Some(size))), "{steps:?}");
    let (weights, _) = Digest::of_reader(fs::File::open(&moved).expect("open")).expect("hash");
    assert!(steps.iter().any(|p| p.status == format!("using existing layer {weights}")), "{steps:?}");
    assert_eq!(steps.last().map(|p| p.status.as_str()), Some("success"));
}

#[test]
fn a_bad_passed_file_is_named_and_changes_nothing() {
    type Case<'a> = (&'a str, Vec<(&'a str, PassedFile)>, &'a str);
    let (dir, store) = setup();
    create(&store, "keep", "FROM ./tiny.gguf\n", dir.path()).expect("a model that must stay");
    let before = blob_files(&store);
    fs::write(dir.path().join("garbage.gguf"), b"this is not a gguf file").expect("write");
    crate::demo_model::write_tiny_bert(&dir.path().join("bert.gguf")).expect("bert");
    let tiny = || passed(&dir.path().join("tiny.gguf"), "/c/tiny.gguf");
    let cases: Vec<Case<'_>> = vec![
        ("FROM /c/tiny.gguf\n", vec![("/c/other.gguf", tiny())], "/c/other.gguf: passed for no FROM or ADAPTER line"),
        (
            "FROM /c/garbage.gguf\n",
            vec![("/c/garbage.gguf", passed(&dir.path().join("garbage.gguf"), "/c/garbage.gguf"))],
            "/c/garbage.gguf is not a usable GGUF file",
        ),
        (
            "FROM /c/tiny.gguf\nADAPTER /c/tiny.gguf\n",
            vec![("/c/tiny.gguf", tiny())],
            "/c/tiny.gguf is a model, expected an adapter",
        ),
        (
            "FROM keep\nADAPTER /c/bert.gguf\n",
            vec![("/c/bert.gguf", passed(&dir.path().join("bert.gguf"), "/c/bert.gguf"))],
            "/c/bert.gguf is a model, expected an adapter",
        ),
    ];
    for (modelfile, files, message) in cases {
        let err = create_passing(&store, "new", modelfile, &files).expect_err(modelfile).to_string();
        assert!(err.contains(message), "{modelfile:?}: {err}");
        assert!(matches!(store.manifest(&name("new")), Err(StoreError::NotFound(_))), "{modelfile:?} left a manifest");
        assert_eq!(blob_files(&store), before, "{modelfile:?} changed the blobs");
    }
    store.show(&name("keep"), false).expect("the existing model is unharmed");
}

#[test]
fn a_passed_file_that_shrinks_or_changes_after_its_check_fails_the_create_and_leaves_nothing() {
    let (dir, store) = setup();
    let before = blob_files(&store);
    let path = dir.path().join("tiny.gguf");
    let bytes = fs::read(&path).expect("read");
    // Shorter than when it was checked: the copy stops short.
    let shrinking = passed(&path, "/c/tiny.gguf");
    fs::OpenOptions::new().write(true).open(&path).expect("open").set_len(bytes.len() as u64 / 2).expect("truncate");
    let err = create_passing(&store, "new", "FROM /c/tiny.gguf\n", &[("/c/tiny.gguf", shrinking)])
        .expect_err("shrank")
        .to_string();
    assert!(
        err.contains(&format!(
            "/c/tiny.gguf shrank while it was read: {} of its {} bytes",
            bytes.len() / 2,
            bytes.len()
        )),
        "{err}"
    );
    assert_eq!(blob_files(&store), before, "a failed copy leaves nothing");
    // The same length but other bytes: what is stored is checked again, and taken back.
    fs::write(&path, &bytes).expect("restore");
    let changing = passed(&path, "/c/tiny.gguf");
    let mut other = b"not a gguf at all".to_vec();
    other.resize(bytes.len(), b'.');
    let spec = CreateSpec::from_modelfile_passing(
        &Modelfile::parse("FROM /c/tiny.gguf\n").expect("modelfile"),
        Path::new("/"),
        &HashMap::from([("/c/tiny.gguf".to_owned(), changing)]),
    )
    .expect("spec");
    let mut swapped = false;
    let err = store
        .create(&name("new"), &spec, &mut |p| {
            // Once the header was checked, before the copy.
            if p.status == "parsing GGUF" && !swapped {
                fs::write(&path, &other).expect("swap the bytes");
                swapped = true;
            }
        })
        .expect_err("changed")
        .to_string();
    assert!(err.contains("/c/tiny.gguf is not a usable GGUF file"), "{err}");
    assert_eq!(blob_files(&store), before, "the changed copy is taken back");
    assert!(matches!(store.manifest(&name("new")), Err(StoreError::NotFound(_))));
}

#[test]
fn a_file_the_store_holds_is_hashed_without_a_copy_and_a_new_one_is_copied_as_it_is_hashed() {
    let (dir, store) = setup();
    let path = dir.path().join("tiny.gguf");
    let size = fs::metadata(&path).expect("size").len();
    let done = |steps: &[Progress], status: &str| {
        steps.iter().filter(|p| p.status == status && p.completed == Some(size) && p.total == Some(size)).count()
    };
    let file = || [("/c/tiny.gguf", passed(&path, "/c/tiny.gguf"))];
    let (_, steps) = create_passing(&store, "first", "FROM /c/tiny.gguf\nSYSTEM one\n", &file()).expect("first");
    // No blob of its size: copied as it is read, in one pass.
    assert_eq!((done(&steps, "copying tiny.gguf"), done(&steps, "checking tiny.gguf")), (1, 0), "{steps:?}");
    assert!(steps.iter().any(|p| p.status.starts_with("creating new layer sha256:")), "{steps:?}");

    let before = blob_files(&store);
    let (_, steps) = create_passing(&store, "second", "FROM /c/tiny.gguf\nSYSTEM two\n", &file()).expect("second");
    // A blob of its size: hashed first, found, never copied.
    assert_eq!((done(&steps, "copying tiny.gguf"), done(&steps, "checking tiny.gguf")), (0, 1), "{steps:?}");
    assert!(!steps.iter().any(|p| p.status.starts_with("copying ")), "{steps:?}");
    assert!(steps.iter().any(|p| p.status.starts_with("using existing layer sha256:")), "{steps:?}");
    assert_eq!(blob_files(&store).len(), before.len() + 2, "only the new system prompt and config: {before:?}");

    // The same size, other bytes: checked, not found, then copied.
    let mut other = fs::read(&path).expect("read");
    let last = other.len() - 1;
    other[last] ^= 0xff;
    let changed = dir.path().join("changed.gguf");
    fs::write(&changed, &other).expect("write");
    let files = [("/c/changed.gguf", passed(&changed, "/c/changed.gguf"))];
    let (_, steps) = create_passing(&store, "third", "FROM /c/changed.gguf\n", &files).expect("third");
    let size_steps = |status: &str| steps.iter().any(|p| p.status == status && p.completed == Some(size));
    assert!(size_steps("checking changed.gguf") && size_steps("copying changed.gguf"), "{steps:?}");
    assert!(steps.iter().any(|p| p.status.starts_with("creating new layer sha256:")), "{steps:?}");
}
