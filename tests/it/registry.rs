//! `corral::store::registry` against a real registry (Debian's `docker-registry`), with a
//! proxy in front of it where a test needs the registry to misbehave: cut a transfer, corrupt
//! a byte, ignore `Range`, demand a token, fail, or hold a request until the test lets it go.
//!
//! No test sleeps to synchronise: each waits for a condition (a progress event, a request
//! the proxy saw) under a deadline.

use std::collections::BTreeMap;
use std::fs;
use std::future::Future;
use std::path::Path;
use std::time::Duration;

use corral::store::Store;
use corral::store::digest::Digest;
use corral::store::manifest::{CONFIG_MEDIA_TYPE, Layer, MODEL, Manifest, ModelConfig, RootFs, TEMPLATE};
use corral::store::name::ModelName;
use corral::store::registry::{Progress, Registry, RegistryConfig, RegistryError};
use tokio::sync::mpsc;

use crate::support::container::poll_until_async;
use crate::support::registry::{Action, DockerRegistry, Gate, Proxy, Seen, SmallDisk};

/// The most any one step may take, however loaded the machine.
const DEADLINE: Duration = Duration::from_secs(60);

/// The part size of most tests: small, so that the tiny model's weights come in several parts.
const PART: u64 = 64 << 10;

/// Awaits `future`, failing the test if it takes longer than [`DEADLINE`].
async fn within<T>(what: &str, future: impl Future<Output = T>) -> T {
    tokio::time::timeout(DEADLINE, future).await.unwrap_or_else(|_| panic!("{what} took longer than {DEADLINE:?}"))
}

/// A registry with models pushed to it from a source store, and a place for other stores.
struct World {
    registry: DockerRegistry,
    dir: tempfile::TempDir,
    source: Store,
}

/// A model as it was published: its manifest's bytes and every blob's bytes.
#[derive(Debug, PartialEq, Eq)]
struct Snapshot {
    manifest: Vec<u8>,
    blobs: BTreeMap<Digest, Vec<u8>>,
}

impl World {
    fn new() -> Self {
        let _ = tracing_subscriber::fmt().with_max_level(tracing::Level::DEBUG).with_test_writer().try_init();
        let registry = DockerRegistry::start();
        let dir = tempfile::tempdir().expect("tempdir");
        let source = Store::open(&dir.path().join("source")).expect("source store");
        Self { registry, dir, source }
    }

    /// A proxy in front of the registry, an empty store to pull into, and `model` named on
    /// the proxy.
    fn behind_proxy(&self, model: &str) -> (Proxy, Store, ModelName) {
        let proxy = Proxy::start(self.registry.addr());
        let name = name_on(&proxy.host(), model);
        (proxy, self.store("dest"), name)
    }

    /// A store of its own below the test's directory.
    fn store(&self, name: &str) -> Store {
        Store::open(&self.dir.path().join(name)).expect("store")
    }

    /// Creates `model` (`namespace/model:tag`) in the source store from the tiny GGUF, a
    /// template and a config blob, and pushes it. Returns what was pushed.
    async fn publish(&self, model: &str, template: &str) -> (Manifest, Snapshot) {
        let name = name_on(&self.registry.host(), model);
        let manifest = create_model(&self.source, &name, template);
        let client = client(&[self.registry.host()], |_| {});
        let mut events = Vec::new();
        let digest = within("push", client.push(&self.source, &name, |p| events.push(p))).await.expect("push");
        let snapshot = snapshot(&self.source, &name);
        assert_eq!(digest, Digest::of(&snapshot.manifest));
        (manifest, snapshot)
    }
}

/// A client that speaks plain HTTP to `hosts`, with small parts.
fn client(hosts: &[String], tweak: impl FnOnce(&mut RegistryConfig)) -> Registry {
    let mut config = RegistryConfig {
        insecure: hosts.to_vec(),
        part_size: PART,
        max_parts: 4,
        part_attempts: 3,
        retry_delay: Duration::from_millis(10),
        connect_timeout: Duration::from_secs(10),
        read_timeout: Duration::from_secs(30),
        request_timeout: Duration::from_secs(30),
        max_downloads: 16,
    };
    tweak(&mut config);
    Registry::new(config)
}

fn name_on(host: &str, model: &str) -> ModelName {
    ModelName::parse(&format!("{host}/{model}")).expect("model name")
}

/// A model made with the store's API: the tiny llama GGUF, a template, a config blob.
fn create_model(store: &Store, name: &ModelName, template: &str) -> Manifest {
    let dir = tempfile::tempdir().expect("tempdir");
    let gguf = dir.path().join("tiny.gguf");
    corral::demo_model::write_tiny_llama(&gguf).expect("write the tiny model");
    let (model, model_size) =
        store.write_blob(&fs::read(&gguf).expect("read the tiny model"), None).expect("model blob");
    let (template_digest, template_size) = store.write_blob(template.as_bytes(), None).expect("template blob");
    let config = ModelConfig {
        model_format: "gguf".into(),
        model_family: "llama".into(),
        model_families: Some(vec!["llama".into()]),
        model_type: "tiny".into(),
        file_type: "F16".into(),
        os: "linux".into(),
        architecture: "amd64".into(),
        rootfs: RootFs { kind: "layers".into(), diff_ids: vec![model, template_digest] },
    };
    let config = serde_json::to_vec(&config).expect("config JSON");
    let (config_digest, config_size) = store.write_blob(&config[..], None).expect("config blob");
    let layer = |media_type: &str, digest, size| Layer { media_type: media_type.into(), digest, size, from: None };
    let manifest = Manifest::new(
        layer(CONFIG_MEDIA_TYPE, config_digest, config_size),
        vec![layer(MODEL, model, model_size), layer(TEMPLATE, template_digest, template_size)],
    )
    .expect("a manifest with weights");
    store.write_manifest(name, &manifest).expect("write the manifest");
    manifest
}

fn snapshot(store: &Store, name: &ModelName) -> Snapshot {
    let manifest = fs::read(store.manifest_path(name)).expect("read the manifest");
    let parsed = Manifest::parse(&manifest).expect("parse the manifest");
    let blobs =
        parsed.blobs().map(|l| (l.digest, fs::read(store.blob_path(&l.digest)).expect("read a blob"))).collect();
    Snapshot { manifest, blobs }
}

/// The names of the files in the store's `blobs/`.
fn blob_files(store: &Store) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(store.blobs_dir())
        .expect("read blobs/")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// Checks that a failed pull left nothing of the model behind but (at most) resumable partials.
fn assert_nothing_written(store: &Store, name: &ModelName, manifest: &Manifest, partials_allowed: bool) {
    assert!(!store.manifest_path(name).exists(), "a manifest was written");
    assert!(matches!(store.manifest(name), Err(corral::store::StoreError::NotFound(_))));
    for layer in manifest.blobs() {
        assert!(!store.has_blob(&layer.digest), "blob {} is visible", layer.digest);
    }
    for file in blob_files(store) {
        assert!(
            partials_allowed && file.contains("-partial"),
            "unexpected file {file} in blobs/ (partials allowed: {partials_allowed})"
        );
    }
}

/// The GETs of a blob the proxy saw, as `(first, last)` byte ranges.
fn blob_ranges(seen: &[Seen], digest: &Digest) -> Vec<(u64, u64)> {
    let digest = digest.to_string();
    seen.iter()
        .filter(|s| s.is_blob_get(&digest))
        .map(|s| s.byte_range().unwrap_or_else(|| panic!("a blob GET without a Range: {s:?}")))
        .collect()
}

/// Makes the proxy answer the first GET of the blob `digest` with `action`, and pass
/// everything else.
fn on_the_first_get_of(proxy: &Proxy, digest: &Digest, action: Action) {
    let first_get = std::sync::atomic::AtomicBool::new(true);
    let (digest, action) = (digest.to_string(), std::sync::Mutex::new(Some(action)));
    proxy.rule(move |seen| {
        let first = seen.is_blob_get(&digest) && first_get.swap(false, std::sync::atomic::Ordering::SeqCst);
        let taken = if first { action.lock().ok().and_then(|mut a| a.take()) } else { None };
        taken.unwrap_or(Action::Pass)
    });
}

/// `PART`-sized ranges covering `start..size`.
fn parts_from(start: u64, size: u64) -> Vec<(u64, u64)> {
    let mut parts = Vec::new();
    let mut at = start;
    while at < size {
        let end = size.min(at + PART);
        parts.push((at, end - 1));
        at = end;
    }
    parts
}

fn statuses(events: &[Progress]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for e in events {
        if out.last() != Some(&e.status) {
            out.push(e.status.clone());
        }
    }
    out
}

fn short(digest: &Digest) -> String {
    digest.hex()[..12].to_owned()
}

/// Checks a successful pull's progress: Ollama's steps in order, and every blob complete.
fn assert_pull_progress(events: &[Progress], manifest: &Manifest) {
    let mut expected = vec!["pulling manifest".to_owned()];
    expected.extend(manifest.blobs().map(|l| format!("pulling {}", short(&l.digest))));
    expected.extend(["verifying sha256 digest", "writing manifest", "success"].map(String::from));
    assert_eq!(statuses(events), expected);
    for layer in manifest.blobs() {
        let last = events.iter().rev().find(|e| e.digest == Some(layer.digest)).expect("progress of a blob");
        assert_eq!((last.total, last.completed), (Some(layer.size), Some(layer.size)), "{}", layer.digest);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pushed_model_deleted_and_pulled_back_is_byte_identical() {
    let world = World::new();
    let name = name_on(&world.registry.host(), "test/tiny:v1");
    let manifest = create_model(&world.source, &name, "{{ .Prompt }}");
    let published = snapshot(&world.source, &name);
    let client = client(&[world.registry.host()], |_| {});

    let mut events = Vec::new();
    let pushed = within("push", client.push(&world.source, &name, |p| events.push(p))).await.expect("push");
    assert_eq!(pushed, Digest::of(&published.manifest));
    let mut expected = vec!["retrieving manifest".to_owned()];
    expected.extend(manifest.blobs().map(|l| format!("pushing {}", short(&l.digest))));
    expected.extend(["pushing manifest", "success"].map(String::from));
    assert_eq!(statuses(&events), expected);
    // The registry holds the data itself.
    let on_registry = world.registry.storage().join("docker/registry/v2/blobs/sha256");
    let model = manifest.model();
    let stored = on_registry.join(&model.digest.hex()[..2]).join(model.digest.hex()).join("data");
    assert_eq!(fs::read(stored).expect("blob on the registry"), published.blobs[&model.digest]);

    let removed = world.source.delete(&name).expect("delete");
    assert_eq!(removed.len(), 3, "every blob goes with the only model using it");
    assert!(manifest.blobs().all(|l| !world.source.has_blob(&l.digest)));

    let mut events = Vec::new();
    let pulled = within("pull", client.pull(&world.source, &name, |p| events.push(p))).await.expect("pull");
    assert_eq!(pulled, Digest::of(&published.manifest));
    assert_eq!(snapshot(&world.source, &name), published);
    assert_pull_progress(&events, &manifest);
    let expected_files: Vec<String> = {
        let mut files: Vec<String> = manifest.blobs().map(|l| l.digest.file_name()).collect();
        files.sort();
        files
    };
    assert_eq!(blob_files(&world.source), expected_files, "no partial files are left");

    // A second push finds every blob on the registry and uploads none.
    let mut events = Vec::new();
    within("push again", client.push(&world.source, &name, |p| events.push(p))).await.expect("push again");
    for layer in manifest.blobs() {
        let of_blob: Vec<_> = events.iter().filter(|e| e.digest == Some(layer.digest)).collect();
        assert_eq!(of_blob.len(), 2, "a blob the registry has is reported as done at once: {of_blob:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transfer_cut_short_is_resumed_from_the_first_missing_byte() {
    let world = World::new();
    let (manifest, published) = world.publish("test/tiny:v1", "{{ .Prompt }}").await;
    let model = manifest.model().clone();
    assert!(model.size > 3 * PART, "the tiny model is {} bytes, too small to come in parts", model.size);
    let proxy = Proxy::start(world.registry.addr());
    let cut = 30_000;
    on_the_first_get_of(&proxy, &model.digest, Action::Cut(cut));
    let store = world.store("dest");
    let name = name_on(&proxy.host(), "test/tiny:v1");
    let client = client(&[proxy.host()], |c| c.max_parts = 1);

    let mut events = Vec::new();
    within("pull", client.pull(&store, &name, |p| events.push(p))).await.expect("pull");

    let mut expected = vec![(0, PART - 1), (cut, PART - 1)];
    expected.extend(parts_from(PART, model.size));
    assert_eq!(blob_ranges(&proxy.seen(), &model.digest), expected, "the retry asks only for what did not arrive");
    assert_eq!(snapshot(&store, &name), published);
    assert_pull_progress(&events, &manifest);
}

/// The GETs of a blob the proxy saw: each range and the request's `Connection` header.
fn blob_gets(seen: &[Seen], digest: &Digest) -> Vec<((u64, u64), Option<String>)> {
    let digest = digest.to_string();
    seen.iter()
        .filter(|s| s.is_blob_get(&digest))
        .map(|s| (s.byte_range().expect("a blob GET with a Range"), s.connection.clone()))
        .collect()
}

/// Over plain HTTP a part is read by corral's own reader (one request per connection,
/// `Connection: close`, the body read straight into the store's buffers). A registry that
/// sends a blob elsewhere, as those in front of object storage do, is left to the HTTP
/// client, which follows redirects, for that part and every part after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parts_over_plain_http_are_read_directly_and_redirected_ones_by_the_http_client() {
    let world = World::new();
    let (manifest, published) = world.publish("test/tiny:v1", "{{ .Prompt }}").await;
    let model = manifest.model().clone();
    let proxy = Proxy::start(world.registry.addr());
    let name = name_on(&proxy.host(), "test/tiny:v1");
    let client = client(&[proxy.host()], |c| c.max_parts = 1);
    let close = Some("close".to_owned());

    let store = world.store("direct");
    within("pull", client.pull(&store, &name, |_| {})).await.expect("pull");
    assert_eq!(snapshot(&store, &name), published);
    let direct: Vec<_> = parts_from(0, model.size).into_iter().map(|range| (range, close.clone())).collect();
    assert_eq!(blob_gets(&proxy.seen(), &model.digest), direct);

    proxy.clear();
    let (digest, upstream) = (model.digest.to_string(), world.registry.host());
    proxy.rule(move |seen| {
        if seen.is_blob_get(&digest) {
            let location = format!("http://{upstream}{}", seen.path);
            Action::Respond { status: 307, headers: vec![("Location".into(), location)], body: String::new() }
        } else {
            Action::Pass
        }
    });
    let store = world.store("redirected");
    within("pull", client.pull(&store, &name, |_| {})).await.expect("a redirected pull");
    assert_eq!(snapshot(&store, &name), published);
    // The first part asked directly, then by the client, which followed the redirect to the
    // registry itself, as it did for every part after it.
    let mut expected = vec![((0, PART - 1), close)];
    expected.extend(parts_from(0, model.size).into_iter().map(|range| (range, None)));
    assert_eq!(blob_gets(&proxy.seen(), &model.digest), expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pull_cut_short_fails_clearly_and_resumes_after_a_restart() {
    let world = World::new();
    let (manifest, published) = world.publish("test/tiny:v1", "{{ .Prompt }}").await;
    let model = manifest.model().clone();
    let proxy = Proxy::start(world.registry.addr());
    let cut = 100_000;
    let digest = model.digest.to_string();
    proxy.rule(move |seen| if seen.is_blob_get(&digest) { Action::Cut(cut) } else { Action::Pass });
    let root = world.dir.path().join("dest");
    let name = name_on(&proxy.host(), "test/tiny:v1");

    // A daemon whose pull breaks off (no retries).
    {
        let store = Store::open(&root).expect("store");
        let client = client(&[proxy.host()], |c| {
            c.part_size = 1 << 20;
            c.part_attempts = 1;
        });
        let error = within("pull", client.pull(&store, &name, |_| {})).await.expect_err("a cut transfer fails");
        assert!(matches!(error, RegistryError::Truncated { received: 100_000, .. }), "{error:?}");
        let message = error.to_string();
        for part in [
            format!("blob {} of test/tiny:v1", model.digest),
            format!("registry {}", proxy.host()),
            format!("broke off after {cut} of {} bytes", model.size),
            "resumes".to_owned(),
        ] {
            assert!(message.contains(&part), "{message:?} lacks {part:?}");
        }
        assert_nothing_written(&store, &name, &manifest, true);
        let partial = store.blobs_dir().join(format!("{}-partial", model.digest.file_name()));
        assert!(partial.is_file(), "the partial download is kept");
    }

    // The daemon restarts: a new store and client on the same directory; the registry behaves.
    proxy.rule(|_| Action::Pass);
    proxy.clear();
    let store = Store::open(&root).expect("store reopened");
    let client = client(&[proxy.host()], |c| c.part_size = 1 << 20);
    let mut events = Vec::new();
    within("resumed pull", client.pull(&store, &name, |p| events.push(p))).await.expect("resumed pull");
    assert_eq!(blob_ranges(&proxy.seen(), &model.digest), vec![(cut, model.size - 1)], "only the missing bytes");
    let first = events.iter().find(|e| e.digest == Some(model.digest)).expect("progress of the weights");
    assert_eq!(first.completed, Some(cut), "progress starts from what was already there");
    assert_eq!(snapshot(&store, &name), published);
    assert_pull_progress(&events, &manifest);
    assert!(blob_files(&store).iter().all(|f| !f.contains("partial")), "{:?}", blob_files(&store));
}

/// A published model behind a proxy that holds the request for its weights' third part
/// at `gate` (downloads go one part at a time with `max_parts = 1`).
struct Held {
    manifest: Manifest,
    published: Snapshot,
    model: Layer,
    proxy: Proxy,
    gate: Gate,
}

async fn hold_the_third_part(world: &World) -> Held {
    let (manifest, published) = world.publish("test/tiny:v1", "{{ .Prompt }}").await;
    let model = manifest.model().clone();
    let proxy = Proxy::start(world.registry.addr());
    let gate = Gate::new();
    let (held, digest) = (gate.clone(), model.digest.to_string());
    proxy.rule(move |seen| {
        if seen.is_blob_get(&digest) && seen.byte_range() == Some((2 * PART, 3 * PART - 1)) {
            Action::Hold(held.clone())
        } else {
            Action::Pass
        }
    });
    Held { manifest, published, model, proxy, gate }
}

/// Waits until the stopped download's record in `store` says the first two parts arrived.
async fn wait_for_the_first_two_parts(store: &Store, digest: &Digest) {
    let record = store.blobs_dir().join(format!("{}-partial.json", digest.file_name()));
    let recorded = serde_json::json!([[0, 2 * PART]]);
    poll_until_async(DEADLINE, "the record of what arrived", || {
        let done = fs::read(&record).ok().and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok());
        let arrived = done.as_ref().is_some_and(|d| d["done"] == recorded);
        async move { if arrived { Ok(()) } else { Err(format!("{done:?}")) } }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pull_given_up_stops_its_download_and_keeps_what_arrived() {
    let world = World::new();
    let Held { manifest, published, model, proxy, gate } = hold_the_third_part(&world).await;
    let store = world.store("dest");
    let name = name_on(&proxy.host(), "test/tiny:v1");
    let client = client(&[proxy.host()], |c| c.max_parts = 1);
    let (sender, _events) = mpsc::unbounded_channel();
    let pull = spawn_pull(&client, &store, &name, 1, &sender);
    within("the third part's request", gate.arrivals(1)).await;

    // The only pull goes away (a client hanging up): the download stops and records the
    // two parts that arrived.
    pull.abort();
    assert!(pull.await.expect_err("aborted").is_cancelled());
    wait_for_the_first_two_parts(&store, &model.digest).await;
    assert_nothing_written(&store, &name, &manifest, true);

    // The next pull starts a new download (the stopped one is gone) from the third part.
    proxy.rule(|_| Action::Pass);
    gate.open();
    proxy.clear();
    let mut events = Vec::new();
    within("pull again", client.pull(&store, &name, |p| events.push(p))).await.expect("pull again");
    assert_eq!(blob_ranges(&proxy.seen(), &model.digest), parts_from(2 * PART, model.size));
    assert_eq!(snapshot(&store, &name), published);
    assert_pull_progress(&events, &manifest);
}

/// A part whose body stops coming is given up after `read_timeout` without a byte and
/// retried from the first missing byte; a pull given up while a part stalls ends that
/// transfer at once (the connection is closed), not after the stall's timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_transfer_is_retried_and_one_given_up_ends_at_once() {
    let world = World::new();
    let (manifest, published) = world.publish("test/tiny:v1", "{{ .Prompt }}").await;
    let model = manifest.model().clone();
    let proxy = Proxy::start(world.registry.addr());
    let name = name_on(&proxy.host(), "test/tiny:v1");
    let stall = 30_000;
    on_the_first_get_of(&proxy, &model.digest, Action::Stall(stall));
    let store = world.store("retried");
    let quick = client(&[proxy.host()], |c| {
        c.max_parts = 1;
        c.read_timeout = Duration::from_millis(500);
    });
    within("pull", quick.pull(&store, &name, |_| {})).await.expect("a pull past a stall");
    let mut expected = vec![(0, PART - 1), (stall, PART - 1)];
    expected.extend(parts_from(PART, model.size));
    assert_eq!(blob_ranges(&proxy.seen(), &model.digest), expected, "the retry asks only for what did not arrive");
    assert_eq!(snapshot(&store, &name), published);
    assert_eq!(proxy.abandoned(), 1, "the stalled connection was closed");

    // A stall far longer than the test, given up: the transfer ends with the pull.
    let digest = model.digest.to_string();
    proxy.rule(move |seen| if seen.is_blob_get(&digest) { Action::Stall(stall) } else { Action::Pass });
    let store = world.store("given-up");
    let client = client(&[proxy.host()], |c| {
        c.max_parts = 1;
        c.read_timeout = Duration::from_secs(3600);
    });
    let (sender, _events) = mpsc::unbounded_channel();
    let pull = spawn_pull(&client, &store, &name, 1, &sender);
    poll_until_async(DEADLINE, "the stalled answer", || {
        let stalled = proxy.stalled();
        async move { if stalled == 2 { Ok(()) } else { Err(format!("{stalled} stalled")) } }
    })
    .await;
    pull.abort();
    assert!(pull.await.expect_err("aborted").is_cancelled());
    poll_until_async(DEADLINE, "the stalled connection closed", || {
        let abandoned = proxy.abandoned();
        async move { if abandoned == 2 { Ok(()) } else { Err(format!("{abandoned} closed")) } }
    })
    .await;

    // The next pull resumes after what corral had received: the stalled bytes, or none of
    // them where the pull was given up while they were still in the socket (the proxy
    // counts them sent, not read); the blob is whole either way.
    proxy.rule(|_| Action::Pass);
    proxy.clear();
    within("pull again", client.pull(&store, &name, |_| {})).await.expect("pull again");
    let ranges = blob_ranges(&proxy.seen(), &model.digest);
    let resumed = ranges.first().map(|r| r.0);
    assert!(resumed == Some(stall) || resumed == Some(0), "{ranges:?}");
    assert_eq!(ranges, parts_from(resumed.unwrap_or(0), model.size));
    assert_eq!(snapshot(&store, &name), published);
}

/// A download runs one part at a time while the CPU keeps up with it, and more at once
/// when the data arrives slower than it can be hashed: here the first part is held back, so
/// the hash waits, and the next parts come at once. What they wrote ahead of the hash is
/// read back for it once the first part arrives: the blob is whole and checked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parts_come_at_once_while_the_hash_waits_for_data_and_the_blob_is_still_checked() {
    let world = World::new();
    let (manifest, published) = world.publish("test/tiny:v1", "{{ .Prompt }}").await;
    let model = manifest.model().clone();
    assert!(model.size > 3 * PART, "the tiny model is {} bytes, too small to come in parts", model.size);
    let proxy = Proxy::start(world.registry.addr());
    let gate = Gate::new();
    let (held, digest) = (gate.clone(), model.digest.to_string());
    proxy.rule(move |seen| {
        if seen.is_blob_get(&digest) && seen.byte_range() == Some((0, PART - 1)) {
            Action::Hold(held.clone())
        } else {
            Action::Pass
        }
    });
    let store = world.store("dest");
    let name = name_on(&proxy.host(), "test/tiny:v1");
    let client = client(&[proxy.host()], |c| c.max_parts = 3);
    let (sender, _events) = mpsc::unbounded_channel();
    let pull = spawn_pull(&client, &store, &name, 1, &sender);
    within("the first part's request", gate.arrivals(1)).await;

    // Every part is asked for while the first is held.
    let every_part = parts_from(0, model.size);
    poll_until_async(DEADLINE, "the other parts asked for", || {
        let asked = blob_ranges(&proxy.seen(), &model.digest);
        let missing: Vec<_> = every_part.iter().filter(|p| !asked.contains(p)).copied().collect();
        async move { if missing.is_empty() { Ok(()) } else { Err(format!("not asked yet: {missing:?}")) } }
    })
    .await;
    gate.open();
    let (result, events) = within("pull", pull).await.expect("the pull's task");
    result.expect("pull");
    let mut asked = blob_ranges(&proxy.seen(), &model.digest);
    asked.sort_unstable();
    assert_eq!(asked, every_part, "each part asked for once");
    assert_eq!(snapshot(&store, &name), published);
    assert_pull_progress(&events, &manifest);
}

/// At most `max_downloads` blobs are downloaded at once, over every pull: with one allowed
/// and the first pull's weights held by the registry, a second pull into another store asks
/// for nothing until that download has ended, then gets its blob whole. The same holds for
/// pulls whose requests say `insecure` for a registry the configuration does not list (each
/// gets its own `allowing_insecure` client, as the HTTP and D-Bus APIs make them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_download_past_the_bound_waits_for_one_to_end() {
    for listed in [true, false] {
        let world = World::new();
        let held = HeldWeights::publish(&world, listed, |c| {
            c.max_downloads = 1;
            c.max_parts = 1;
        })
        .await;
        let HeldWeights { published, model, proxy, gate, name, .. } = &held;
        let (first, second) = (world.store("first"), world.store("second"));
        let (sender, mut events) = mpsc::unbounded_channel();
        let one = spawn_pull(&held.pull_client(), &first, name, 1, &sender);
        within("the first pull's request for its weights", gate.arrivals(1)).await;
        let two = spawn_pull(&held.pull_client(), &second, name, 2, &sender);
        within("the second pull's manifest", async {
            while events.recv().await.expect("a pull ended early") != (2, Progress::step("pulling manifest")) {}
        })
        .await;
        // Without the bound, its request for the weights comes to the gate at once.
        let asked = tokio::time::timeout(Duration::from_millis(500), gate.arrivals(2)).await;
        assert!(
            asked.is_err(),
            "listed: {listed}: the second download asked while the only one allowed ran: {:?}",
            proxy.seen()
        );
        assert!(
            std::iter::from_fn(|| events.try_recv().ok()).all(|(id, p)| id != 2 || p.digest != Some(model.digest)),
            "the waiting download reports no progress"
        );

        gate.open();
        for (pull, store) in [(one, &first), (two, &second)] {
            let (result, _) = within("pull", pull).await.expect("the pull's task");
            result.expect("pull");
            assert_eq!(snapshot(store, name), *published);
        }
        let every_part = parts_from(0, model.size);
        let one_after_the_other: Vec<_> = every_part.iter().chain(&every_part).copied().collect();
        assert_eq!(
            blob_ranges(&proxy.seen(), &model.digest),
            one_after_the_other,
            "listed: {listed}: the second began once the first ended"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_blob_is_refused_and_nothing_is_written() {
    let world = World::new();
    let (manifest, _) = world.publish("test/tiny:v1", "{{ .Prompt }}").await;
    let model = manifest.model().clone();
    let proxy = Proxy::start(world.registry.addr());
    let digest = model.digest.to_string();
    proxy.rule(move |seen| if seen.is_blob_get(&digest) { Action::Corrupt(1000) } else { Action::Pass });
    let store = world.store("dest");
    let name = name_on(&proxy.host(), "test/tiny:v1");
    let client = client(&[proxy.host()], |_| {});

    let error = within("pull", client.pull(&store, &name, |_| {})).await.expect_err("corrupt data");
    assert!(matches!(&error, RegistryError::DigestMismatch { digest, .. } if *digest == model.digest), "{error:?}");
    let message = error.to_string();
    assert!(message.contains(&format!("blob {} from registry {}", model.digest, proxy.host())), "{message}");
    assert!(message.contains("corrupt"), "{message}");
    assert_nothing_written(&store, &name, &manifest, false);

    // The next pull starts over and succeeds.
    proxy.rule(|_| Action::Pass);
    within("pull again", client.pull(&store, &name, |_| {})).await.expect("pull again");
    store.verify_blob(&model.digest).expect("the weights are intact");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_model_is_not_found() {
    let world = World::new();
    world.publish("test/tiny:v1", "{{ .Prompt }}").await;
    let store = world.store("dest");
    let client = client(&[world.registry.host()], |_| {});
    for model in ["test/nothere:v1", "test/tiny:nosuchtag"] {
        let name = name_on(&world.registry.host(), model);
        let error = within("pull", client.pull(&store, &name, |_| {})).await.expect_err("not found");
        assert!(matches!(error, RegistryError::NotFound { .. }), "{error:?}");
        assert_eq!(error.to_string(), format!("model {model} not found on registry {}", world.registry.host()));
    }
    assert!(store.list().expect("list").is_empty());
    assert!(blob_files(&store).is_empty());
}

/// A proxy that demands a Bearer token (`good`) and whose token service answers `token`.
fn demand_token(proxy: &Proxy, realm: String, token: Action) {
    proxy.rule(move |seen| {
        if seen.path.starts_with("/token") {
            return token.clone();
        }
        if seen.authorization.as_deref() == Some("Bearer good") {
            return Action::Pass;
        }
        Action::Respond {
            status: 401,
            headers: vec![(
                "WWW-Authenticate".into(),
                format!(r#"Bearer realm="{realm}",service="test-registry",scope="repository:test/tiny:pull""#),
            )],
            body: r#"{"errors":[{"code":"UNAUTHORIZED"}]}"#.into(),
        }
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_is_fetched_on_401_and_used() {
    let world = World::new();
    let (manifest, published) = world.publish("test/tiny:v1", "{{ .Prompt }}").await;
    let proxy = Proxy::start(world.registry.addr());
    let grant = Action::Respond { status: 200, headers: vec![], body: r#"{"token":"good","expires_in":300}"#.into() };
    demand_token(&proxy, format!("http://{}/token", proxy.host()), grant);
    let store = world.store("dest");
    let name = name_on(&proxy.host(), "test/tiny:v1");
    let client = client(&[proxy.host()], |_| {});

    let mut events = Vec::new();
    within("pull", client.pull(&store, &name, |p| events.push(p))).await.expect("pull with a token");
    assert_eq!(snapshot(&store, &name), published);
    assert_pull_progress(&events, &manifest);
    let seen = proxy.seen();
    let tokens: Vec<&Seen> = seen.iter().filter(|s| s.path.starts_with("/token")).collect();
    assert_eq!(tokens.len(), 1, "one token serves the whole pull: {seen:#?}");
    assert_eq!(tokens[0].path, "/token?service=test-registry&scope=repository%3Atest%2Ftiny%3Apull");
    assert_eq!(tokens[0].authorization, None, "the token is asked for anonymously");
    let after: Vec<&Seen> = seen.iter().skip_while(|s| !s.path.starts_with("/token")).skip(1).collect();
    assert!(!after.is_empty() && after.iter().all(|s| s.authorization.as_deref() == Some("Bearer good")), "{after:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_token_is_unauthorized() {
    let world = World::new();
    let (manifest, _) = world.publish("test/tiny:v1", "{{ .Prompt }}").await;
    let proxy = Proxy::start(world.registry.addr());
    let refuse = Action::Respond { status: 403, headers: vec![], body: "no pulls for you".into() };
    let realm = format!("http://{}/token", proxy.host());
    demand_token(&proxy, realm.clone(), refuse);
    let store = world.store("dest");
    let name = name_on(&proxy.host(), "test/tiny:v1");
    let client = client(&[proxy.host()], |_| {});

    let error = within("pull", client.pull(&store, &name, |_| {})).await.expect_err("refused");
    assert!(matches!(error, RegistryError::Unauthorized { .. }), "{error:?}");
    let message = error.to_string();
    for part in [
        format!("registry {} refused access to model test/tiny:v1", proxy.host()),
        format!("token service {realm}"),
        "403".to_owned(),
        "no pulls for you".to_owned(),
    ] {
        assert!(message.contains(&part), "{message:?} lacks {part:?}");
    }
    assert_nothing_written(&store, &name, &manifest, false);

    // A token the registry then refuses all the same.
    let wrong = Action::Respond { status: 200, headers: vec![], body: r#"{"access_token":"wrong"}"#.into() };
    demand_token(&proxy, realm, wrong);
    let error = within("pull", client.pull(&store, &name, |_| {})).await.expect_err("refused");
    assert!(error.to_string().contains("401 even with the token"), "{error}");

    // A token service elsewhere, over plain HTTP, is not asked at all.
    proxy.clear();
    let elsewhere = format!("http://localhost:{}/token", proxy.host().rsplit_once(':').expect("port").1);
    demand_token(&proxy, elsewhere, Action::Pass);
    let error = within("pull", client.pull(&store, &name, |_| {})).await.expect_err("refused");
    assert!(error.to_string().contains("must use HTTPS or be on the registry's own host"), "{error}");
    assert!(proxy.seen().iter().all(|s| !s.path.starts_with("/token")));
    assert_nothing_written(&store, &name, &manifest, false);
}

/// A manifest, or a token service's answer, past its cap (4 MiB; 64 KiB) is refused once
/// the cap is passed, naming it; nothing is written. Exactly at the cap is read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_past_their_cap_are_refused_naming_it() {
    let world = World::new();
    let (manifest, _) = world.publish("test/tiny:v1", "{{ .Prompt }}").await;
    let (proxy, store, name) = world.behind_proxy("test/tiny:v1");
    let client = client(&[proxy.host()], |_| {});
    for (size, expected) in [(4 << 20, "invalid manifest"), ((4 << 20) + 1, "the answer is larger than 4194304 bytes")]
    {
        // JSON whitespace: only its length matters.
        let body = " ".repeat(size);
        answer_manifests_with(&proxy, body);
        let error = within("pull", client.pull(&store, &name, |_| {})).await.expect_err("a huge manifest");
        assert!(matches!(error, RegistryError::BadManifest { .. }) && error.to_string().contains(expected), "{error}");
    }
    let realm = format!("http://{}/token", proxy.host());
    for (size, expected) in [(64 << 10, "sent no token JSON"), ((64 << 10) + 1, "larger than 65536 bytes")] {
        let huge = Action::Respond { status: 200, headers: vec![], body: " ".repeat(size) };
        demand_token(&proxy, realm.clone(), huge);
        let error = within("pull", client.pull(&store, &name, |_| {})).await.expect_err("a huge token answer");
        assert!(matches!(error, RegistryError::Unauthorized { .. }) && error.to_string().contains(expected), "{error}");
    }
    assert_nothing_written(&store, &name, &manifest, false);
}

/// Makes the proxy answer every manifest request with `body` (200), and pass the rest.
fn answer_manifests_with(proxy: &Proxy, body: String) {
    proxy.rule(move |seen| {
        if seen.path.contains("/manifests/") {
            Action::Respond { status: 200, headers: vec![], body: body.clone() }
        } else {
            Action::Pass
        }
    });
}

/// `manifest` with the layer `digest` declared `size` bytes long.
fn resized(manifest: &[u8], digest: &Digest, size: u64) -> String {
    let mut manifest: serde_json::Value = serde_json::from_slice(manifest).expect("the manifest's JSON");
    for layer in manifest["layers"].as_array_mut().expect("layers") {
        if layer["digest"] == digest.to_string() {
            layer["size"] = size.into();
        }
    }
    manifest.to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_errors_and_bad_answers_are_named() {
    let world = World::new();
    let (manifest, published) = world.publish("test/tiny:v1", "{{ .Prompt }}").await;
    let model = manifest.model().clone();
    let (proxy, store, name) = world.behind_proxy("test/tiny:v1");
    let client = client(&[proxy.host()], |c| {
        c.part_attempts = 2;
        c.max_parts = 1;
    });

    // A 500 on the manifest.
    let body = format!("storage exploded: {}", "x".repeat(1000));
    proxy.rule(move |_| Action::Respond { status: 500, headers: vec![], body: body.clone() });
    let error = within("pull", client.pull(&store, &name, |_| {})).await.expect_err("500");
    assert!(matches!(error, RegistryError::Server { status: 500, .. }), "{error:?}");
    let message = error.to_string();
    assert!(message.starts_with(&format!("registry {} failed with HTTP 500 for model test/tiny:v1", proxy.host())));
    assert!(message.contains("storage exploded") && message.len() < 600, "a short excerpt: {message}");

    // A 503 on a blob, every time: retried, then named.
    let digest = model.digest.to_string();
    proxy.clear();
    proxy.rule(move |seen| {
        if seen.is_blob_get(&digest) {
            Action::Respond { status: 503, headers: vec![], body: "try later".into() }
        } else {
            Action::Pass
        }
    });
    let error = within("pull", client.pull(&store, &name, |_| {})).await.expect_err("503");
    assert!(error.to_string().contains(&format!("HTTP 503 for blob {} of test/tiny:v1: try later", model.digest)));
    assert_eq!(blob_ranges(&proxy.seen(), &model.digest), [(0, PART - 1), (0, PART - 1)], "tried twice, then given up");

    // A manifest that is not one.
    answer_manifests_with(&proxy, r#"{"schemaVersion":1}"#.into());
    let error = within("pull", client.pull(&store, &name, |_| {})).await.expect_err("bad manifest");
    assert!(matches!(error, RegistryError::BadManifest { .. }), "{error:?}");
    assert!(error.to_string().starts_with(&format!("registry {} sent a bad manifest for test/tiny:v1", proxy.host())));

    // A manifest that declares its model layer exabytes long: the download's parts are
    // cut as they start (listed whole, they were more than memory holds and the pull
    // aborted the daemon), and the pull ends at the blob's real end, named.
    let exabytes = resized(&published.manifest, &model.digest, u64::MAX);
    answer_manifests_with(&proxy, exabytes);
    let error = within("pull", client.pull(&store, &name, |_| {})).await.expect_err("exabytes");
    assert!(matches!(error, RegistryError::BadRange { .. }), "{error:?}");
    let message = error.to_string();
    assert!(message.contains(&format!("blob {} of test/tiny:v1", model.digest)), "{message}");
    assert!(
        message.ends_with(&format!(
            "asked for bytes 0-{} of {}, got 206 with Content-Range bytes 0-{}/{}",
            PART - 1,
            u64::MAX,
            PART - 1,
            model.size
        )),
        "{message}"
    );

    // A server that ignores Range.
    let digest = model.digest.to_string();
    proxy.rule(move |seen| if seen.is_blob_get(&digest) { Action::DropRange } else { Action::Pass });
    let error = within("pull", client.pull(&store, &name, |_| {})).await.expect_err("no ranges");
    assert!(matches!(error, RegistryError::BadRange { .. }), "{error:?}");
    assert!(error.to_string().contains("the server ignores Range"), "{error}");

    // A blob's body longer than the range asked for (no Content-Length, more bytes than
    // asked before the connection closes): refused once it passes the range, not stored.
    let digest = model.digest.to_string();
    proxy.rule(move |seen| if seen.is_blob_get(&digest) { Action::Overlong(10) } else { Action::Pass });
    let error = within("pull", client.pull(&store, &name, |_| {})).await.expect_err("too long");
    assert!(matches!(error, RegistryError::BadRange { .. }), "{error:?}");
    let message = error.to_string();
    assert!(message.contains(&format!("blob {} of test/tiny:v1", model.digest)), "{message}");
    assert!(message.ends_with(&format!("asked for {PART} bytes (0-{}), got more", PART - 1)), "{message}");

    // A Content-Length that is not the range's length, one byte more or fewer than the
    // bytes sent: refused before the body is read, whichever way it is wrong.
    for delta in [1, -1] {
        let digest = model.digest.to_string();
        proxy.rule(move |seen| if seen.is_blob_get(&digest) { Action::Misstate(delta) } else { Action::Pass });
        let error = within("pull", client.pull(&store, &name, |_| {})).await.expect_err("wrong length");
        assert!(matches!(error, RegistryError::BadRange { .. }), "{delta}: {error:?}");
        let claimed = PART.saturating_add_signed(delta);
        assert!(
            error
                .to_string()
                .ends_with(&format!("asked for {PART} bytes (0-{}), got Content-Length {claimed}", PART - 1)),
            "{delta}: {error}"
        );
    }

    // No manifest and no visible blob after all that.
    assert!(!store.manifest_path(&name).exists());
    assert!(!store.has_blob(&model.digest));

    // And nothing lost: the same pull from a registry that answers well completes, the
    // blob's bytes the published ones.
    proxy.rule(|_| Action::Pass);
    within("pull", client.pull(&store, &name, |_| {})).await.expect("a good pull after the bad answers");
    assert_eq!(
        Digest::of_reader(fs::File::open(store.blob_path(&model.digest)).expect("blob")).expect("hash").0,
        model.digest
    );
    assert!(store.manifest_path(&name).exists());
}

/// A manifest of a thousand adapters (each a blob to fetch and an argument of the runner's
/// command line) is refused before any blob is asked for, and nothing is written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_manifest_of_a_thousand_adapters_is_refused_before_any_blob() {
    let world = World::new();
    let (manifest, published) = world.publish("test/tiny:v1", "{{ .Prompt }}").await;
    let model = manifest.model().clone();
    let (proxy, store, name) = world.behind_proxy("test/tiny:v1");
    let client = client(&[proxy.host()], |_| {});
    let mut adapters: serde_json::Value = serde_json::from_slice(&published.manifest).expect("the manifest's JSON");
    let adapter = serde_json::json!({
        "mediaType": corral::store::manifest::ADAPTER, "digest": model.digest.to_string(), "size": model.size,
    });
    adapters["layers"].as_array_mut().expect("layers").extend(std::iter::repeat_n(adapter, 1000));
    let adapters = adapters.to_string();
    answer_manifests_with(&proxy, adapters);
    let error = within("pull", client.pull(&store, &name, |_| {})).await.expect_err("a thousand adapters");
    assert!(matches!(error, RegistryError::BadManifest { .. }), "{error:?}");
    assert!(error.to_string().ends_with("the manifest lists 1002 layers; a model has at most 256"), "{error}");
    assert!(!proxy.seen().iter().any(|s| s.path.contains("/blobs/")), "a blob was asked for: {:?}", proxy.seen());
    assert_nothing_written(&store, &name, &manifest, false);
}

/// Progress events tagged with the pull they come from.
type Events = mpsc::UnboundedReceiver<(usize, Progress)>;

/// Holds every request for the blob `digest` at the gate returned, until it opens.
fn hold_gets_of(proxy: &Proxy, digest: &Digest) -> Gate {
    let gate = Gate::new();
    let (held, digest) = (gate.clone(), digest.to_string());
    proxy.rule(move |seen| if seen.is_blob_get(&digest) { Action::Hold(held.clone()) } else { Action::Pass });
    gate
}

/// A published `test/tiny:v1` behind a proxy that holds every GET of its weights until
/// `gate` opens, and a client of the proxy's registry: one that lists it among the
/// registries spoken to in plain HTTP (`listed`), or one that lists none, from which each
/// pull takes a client of its own as a request saying `insecure` does.
struct HeldWeights {
    manifest: Manifest,
    published: Snapshot,
    model: Layer,
    proxy: Proxy,
    gate: Gate,
    name: ModelName,
    client: Registry,
}

impl HeldWeights {
    async fn publish(world: &World, listed: bool, tweak: impl FnOnce(&mut RegistryConfig)) -> Self {
        let (manifest, published) = world.publish("test/tiny:v1", "{{ .Prompt }}").await;
        let model = manifest.model().clone();
        let proxy = Proxy::start(world.registry.addr());
        let gate = hold_gets_of(&proxy, &model.digest);
        let name = name_on(&proxy.host(), "test/tiny:v1");
        let hosts = if listed { vec![proxy.host()] } else { Vec::new() };
        let client = client(&hosts, tweak);
        Self { manifest, published, model, proxy, gate, name, client }
    }

    /// The client one pull uses (`Registry::allowing_insecure`, as the HTTP and D-Bus APIs
    /// call it for a request saying `insecure`).
    fn pull_client(&self) -> Registry {
        self.client.allowing_insecure(&self.proxy.host())
    }
}

/// Starts a pull in its own task, its progress sent to `events` tagged with `id`.
fn spawn_pull(
    client: &Registry,
    store: &Store,
    name: &ModelName,
    id: usize,
    events: &mpsc::UnboundedSender<(usize, Progress)>,
) -> tokio::task::JoinHandle<(Result<Digest, RegistryError>, Vec<Progress>)> {
    let (client, store, name, events) = (client.clone(), store.clone(), name.clone(), events.clone());
    tokio::spawn(async move {
        let mut mine = Vec::new();
        let result = client
            .pull(&store, &name, |p| {
                mine.push(p.clone());
                let _ = events.send((id, p));
            })
            .await;
        (result, mine)
    })
}

/// Waits until each of `ids` reported progress on `digest`.
async fn wait_for_progress(events: &mut Events, ids: &[usize], digest: Digest) {
    let mut waiting: Vec<usize> = ids.to_vec();
    within("progress on a held blob", async {
        while !waiting.is_empty() {
            let (id, progress) = events.recv().await.expect("a pull ended early");
            if progress.digest == Some(digest) {
                waiting.retain(|w| *w != id);
            }
        }
    })
    .await;
}

/// Two pulls of one model into one store share one download, also where each request says
/// `insecure` for a registry the configuration does not list.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_pulls_of_the_same_model_share_one_download() {
    for listed in [true, false] {
        let world = World::new();
        let held = HeldWeights::publish(&world, listed, |c| c.part_size = 64 << 20).await;
        let HeldWeights { manifest, published, model, proxy, gate, name, .. } = &held;
        let store = world.store("dest");

        let (sender, mut events) = mpsc::unbounded_channel();
        let first = spawn_pull(&held.pull_client(), &store, name, 1, &sender);
        let second = spawn_pull(&held.pull_client(), &store, name, 2, &sender);
        // Both wait on the weights, whose only GET the proxy holds.
        wait_for_progress(&mut events, &[1, 2], model.digest).await;
        gate.open();
        let (first, first_events) = within("first pull", first).await.expect("join");
        let (second, second_events) = within("second pull", second).await.expect("join");
        let digest = Digest::of(&published.manifest);
        assert_eq!(first.expect("first pull"), digest);
        assert_eq!(second.expect("second pull"), digest);
        assert_pull_progress(&first_events, manifest);
        assert_pull_progress(&second_events, manifest);
        let ranges = blob_ranges(&proxy.seen(), &model.digest);
        assert_eq!(ranges, vec![(0, model.size - 1)], "listed: {listed}: one download, shared");
        let manifest_gets = proxy.seen().iter().filter(|s| s.path.contains("/manifests/")).count();
        assert_eq!(manifest_gets, 2, "each pull fetched the manifest");
        assert_eq!(snapshot(&store, name), *published);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_model_keeps_the_blobs_a_running_pull_shares() {
    let world = World::new();
    let (a, _) = world.publish("test/tiny:a", "A {{ .Prompt }}").await;
    let (b, published_b) = world.publish("test/tiny:b", "B {{ .Prompt }}").await;
    let weights = a.model().digest;
    assert_eq!(b.model().digest, weights, "the two models share their weights");
    let template_b = b.layers_of(TEMPLATE).next().expect("template").digest;
    let proxy = Proxy::start(world.registry.addr());
    let store = world.store("dest");
    let client = client(&[proxy.host()], |_| {});
    let name_a = name_on(&proxy.host(), "test/tiny:a");
    let name_b = name_on(&proxy.host(), "test/tiny:b");
    within("pull a", client.pull(&store, &name_a, |_| {})).await.expect("pull a");

    let gate = hold_gets_of(&proxy, &template_b);
    let (sender, mut events) = mpsc::unbounded_channel();
    let pull_b = spawn_pull(&client, &store, &name_b, 1, &sender);
    wait_for_progress(&mut events, &[1], template_b).await;

    // b's pull holds the shared weights; deleting a removes only what is a's alone.
    let removed = store.delete(&name_a).expect("delete a");
    assert!(!removed.contains(&weights), "the shared weights were removed: {removed:?}");
    assert_eq!(removed.len(), 2, "a's template and config go: {removed:?}");
    assert!(store.has_blob(&weights));

    gate.open();
    let (result, events_b) = within("pull b", pull_b).await.expect("join");
    assert_eq!(result.expect("pull b"), Digest::of(&published_b.manifest));
    assert_pull_progress(&events_b, &b);
    assert_eq!(snapshot(&store, &name_b), published_b);
    store.verify_blob(&weights).expect("the weights are intact");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_fails_clearly_and_leaves_the_store_consistent() {
    let world = World::new();
    let (manifest, _) = world.publish("test/tiny:v1", "{{ .Prompt }}").await;
    let model = manifest.model().clone();
    let disk = SmallDisk::mount(64 << 10);
    assert!(model.size > 64 << 10, "the weights must not fit");
    let root = disk.path().join("store");
    let store = Store::open(&root).expect("store on the small disk");
    let name = name_on(&world.registry.host(), "test/tiny:v1");
    let client = client(&[world.registry.host()], |_| {});

    let error = within("pull", client.pull(&store, &name, |_| {})).await.expect_err("the disk is full");
    assert!(matches!(error, RegistryError::DiskFull { .. }), "{error:?}");
    let message = error.to_string();
    assert!(message.starts_with("the disk is full"), "{message}");
    assert!(message.contains(&model.digest.to_string()) && message.contains(&root.display().to_string()), "{message}");
    assert_nothing_written(&store, &name, &manifest, false);

    drop(store);
    let store = Store::open(&root).expect("the store opens again");
    assert!(store.list().expect("list").is_empty());
    for file in blob_files(&store) {
        let digest = Digest::parse(&file).unwrap_or_else(|_| panic!("{file} is not a blob"));
        store.verify_blob(&digest).expect("every blob left is whole");
    }
    let free = Path::new(disk.path());
    assert!(nix_free_bytes(free) > 32 << 10, "the failed download gave its space back");
}

/// Free bytes on the file system holding `path`.
fn nix_free_bytes(path: &Path) -> u64 {
    let stat = nix::sys::statvfs::statvfs(path).expect("statvfs");
    stat.blocks_available() * stat.fragment_size()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_pull_whose_client_goes_away_is_cancelled_and_resumable() {
    use http_body_util::BodyExt;

    let world = World::new();
    let Held { manifest, published, model, proxy, gate } = hold_the_third_part(&world).await;
    let api_dir = tempfile::tempdir().expect("tempdir");
    let mut state = crate::support::api::state(api_dir.path());
    state.store = world.store("dest");
    state.registry = client(&[proxy.host()], |c| c.max_parts = 1);
    let name = name_on(&proxy.host(), "test/tiny:v1");
    let request = serde_json::json!({ "model": name.to_string() }).to_string();
    let response = crate::support::api::send(&state, "POST", "/api/pull", &request).await;
    assert_eq!(response.status(), axum::http::StatusCode::OK);
    let mut body = response.into_body();
    let first = body.frame().await.expect("a first line").expect("no error").into_data().expect("data");
    assert!(first.starts_with(b"{\"status\":\"pulling manifest\"}"), "{first:?}");
    within("the third part's request", gate.arrivals(1)).await;

    // The client hangs up: the download stops, records the two parts that arrived, and
    // no manifest is written.
    drop(body);
    wait_for_the_first_two_parts(&state.store, &model.digest).await;
    // The pull ends on its own, moments after its client: its small layers (downloaded
    // beside the weights, so in place by now) go once it has.
    poll_until_async(DEADLINE, "the pull given up to take back its blobs", || {
        let visible: Vec<String> =
            manifest.blobs().filter(|l| state.store.has_blob(&l.digest)).map(|l| l.digest.to_string()).collect();
        async move { if visible.is_empty() { Ok(()) } else { Err(format!("still in place: {visible:?}")) } }
    })
    .await;
    assert_nothing_written(&state.store, &name, &manifest, true);

    // A new pull through the API resumes from the third part.
    proxy.rule(|_| Action::Pass);
    gate.open();
    proxy.clear();
    let (status, _, text) = crate::support::api::call(&state, "POST", "/api/pull", &request).await;
    assert_eq!(status, axum::http::StatusCode::OK, "{text}");
    assert!(text.trim_end().ends_with("{\"status\":\"success\"}"), "{text}");
    assert_eq!(blob_ranges(&proxy.seen(), &model.digest), parts_from(2 * PART, model.size));
    assert_eq!(snapshot(&state.store, &name), published);
}

/// Pulls, pushes and creates over HTTP past `[server] max_store_jobs` are refused with 503
/// and `Retry-After` while the others run, whatever the route; a place is free again once a
/// transfer ends with its client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_store_jobs_past_the_bound_wait_for_a_place() {
    use http_body_util::BodyExt;

    let world = World::new();
    let Held { published, proxy, gate, .. } = hold_the_third_part(&world).await;
    let api_dir = tempfile::tempdir().expect("tempdir");
    let mut state = crate::support::api::state(api_dir.path());
    state.store = world.store("dest");
    state.registry = client(&[proxy.host()], |c| c.max_parts = 1);
    let config = corral::config::ServerConfig { max_store_jobs: 1, ..corral::config::ServerConfig::default() };
    state.safety = std::sync::Arc::new(corral::http::Safety::new(&config, corral::http::LocalNames::system()));
    let name = name_on(&proxy.host(), "test/tiny:v1");
    let request = serde_json::json!({ "model": name.to_string() }).to_string();
    let held = crate::support::api::send(&state, "POST", "/api/pull", &request).await;
    assert_eq!(held.status(), axum::http::StatusCode::OK);
    within("the third part's request", gate.arrivals(1)).await;

    let create = serde_json::json!({ "model": "other", "from": "chat" }).to_string();
    for (path, body) in [("/api/pull", &request), ("/api/push", &request), ("/api/create", &create)] {
        let refused = crate::support::api::send(&state, "POST", path, body).await;
        assert_eq!(refused.status(), axum::http::StatusCode::SERVICE_UNAVAILABLE, "{path}");
        assert!(refused.headers().contains_key("retry-after"), "{path}");
        let text = String::from_utf8_lossy(&refused.into_body().collect().await.expect("body").to_bytes()).into_owned();
        let expected = "1 pulls, pushes and creates are already running, the most [server] max_store_jobs allows";
        assert!(text.contains(expected), "{path}: {text}");
    }

    // Its client goes away: the pull ends, and its place is free for the next one.
    drop(held);
    proxy.rule(|_| Action::Pass);
    gate.open();
    poll_until_async(DEADLINE, "a pull given a place", || async {
        let (status, _, text) = crate::support::api::call(&state, "POST", "/api/pull", &request).await;
        if status == axum::http::StatusCode::OK { Ok(()) } else { Err(format!("{status}: {text}")) }
    })
    .await;
    assert_eq!(snapshot(&state.store, &name), published);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_push_whose_client_goes_away_is_cancelled_before_its_manifest() {
    let world = World::new();
    let proxy = Proxy::start(world.registry.addr());
    let gate = Gate::new();
    let held = gate.clone();
    // Every blob upload waits at the gate.
    proxy.rule(
        move |seen| if seen.path.contains("/blobs/uploads/") { Action::Hold(held.clone()) } else { Action::Pass },
    );
    let api_dir = tempfile::tempdir().expect("tempdir");
    let mut state = crate::support::api::state(api_dir.path());
    state.store = world.store("local");
    state.registry = client(&[proxy.host()], |_| {});
    let name = name_on(&proxy.host(), "test/tiny:v1");
    create_model(&state.store, &name, "{{ .Prompt }}");
    let request = serde_json::json!({ "model": name.to_string() }).to_string();
    let response = crate::support::api::send(&state, "POST", "/api/push", &request).await;
    assert_eq!(response.status(), axum::http::StatusCode::OK);
    within("the first upload", gate.arrivals(1)).await;

    // The client hangs up while a blob is on its way; then the gate opens: nothing of
    // the push goes on, so the registry never gets the manifest.
    drop(response);
    // The held upload's connection closes: the push was dropped, and nothing of it can
    // run any more, whatever the gate does next.
    poll_until_async(DEADLINE, "the push to be given up", || {
        let abandoned = proxy.abandoned();
        async move { if abandoned > 0 { Ok(()) } else { Err("no connection abandoned".to_owned()) } }
    })
    .await;
    gate.open();
    let seen = proxy.seen();
    assert!(!seen.iter().any(|s| s.path.contains("/manifests/")), "{seen:?}");
    let status = reqwest::get(format!("http://{}/v2/test/tiny/manifests/v1", world.registry.host()))
        .await
        .expect("ask the registry")
        .status();
    assert_eq!(status, reqwest::StatusCode::NOT_FOUND);
}

/// Publishes `model` made of two large layers (weights and an adapter of 9 MiB each, bytes
/// that do not repeat) and a config, so that a pull downloads both layers at once.
async fn publish_two_large_layers(world: &World, model: &str) -> (Manifest, Snapshot) {
    let name = name_on(&world.registry.host(), model);
    let manifest = two_large_layers(&world.source, &name, 9 << 20);
    let client = client(&[world.registry.host()], |_| {});
    within("push", client.push(&world.source, &name, |_| {})).await.expect("push");
    (manifest, snapshot(&world.source, &name))
}

/// Writes `name` into `store`: two large layers (weights and an adapter of `size` bytes
/// each, bytes that do not repeat) and a config.
fn two_large_layers(store: &Store, name: &ModelName, size: usize) -> Manifest {
    use corral::store::manifest::ADAPTER;
    let mut seed = 0x2545_f491_4f6c_dd1d_u64;
    let mut large = || {
        let bytes: Vec<u8> = (0..size)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                seed.to_le_bytes()[0]
            })
            .collect();
        let (digest, size) = store.write_blob(&bytes[..], None).expect("a large blob");
        (digest, size)
    };
    let (weights, weights_size) = large();
    let (adapter, adapter_size) = large();
    let (config, config_size) = store.write_blob(&b"{\"model_format\":\"gguf\"}"[..], None).expect("config");
    let layer = |media_type: &str, digest, size| Layer { media_type: media_type.into(), digest, size, from: None };
    let manifest = Manifest::new(
        layer(CONFIG_MEDIA_TYPE, config, config_size),
        vec![layer(MODEL, weights, weights_size), layer(ADAPTER, adapter, adapter_size)],
    )
    .expect("a manifest");
    store.write_manifest(name, &manifest).expect("write the manifest");
    manifest
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn layers_download_at_once_and_report_progress_one_after_the_other() {
    let world = World::new();
    let (manifest, published) = publish_two_large_layers(&world, "test/two:v1").await;
    let (weights, adapter, config) =
        (manifest.layers()[0].digest, manifest.layers()[1].digest, manifest.config().digest);
    let proxy = Proxy::start(world.registry.addr());
    // Every request for the weights waits: the adapter's and the config's only start if
    // layers run at once. The config, small and last, need not wait for the large ones.
    let gate = hold_gets_of(&proxy, &weights);
    let store = world.store("dest");
    let name = name_on(&proxy.host(), "test/two:v1");
    let client = client(&[proxy.host()], |c| c.part_size = 1 << 20);
    let (sender, _events) = mpsc::unbounded_channel();
    let pull = spawn_pull(&client, &store, &name, 1, &sender);
    within("the weights' request", gate.arrivals(1)).await;
    poll_until_async(DEADLINE, "the adapter's and the config's requests while the weights wait", || {
        let seen = proxy.seen();
        let missing: Vec<&str> = [(adapter, "the adapter"), (config, "the config")]
            .into_iter()
            .filter(|(digest, _)| !seen.iter().any(|s| s.is_blob_get(&digest.to_string())))
            .map(|(_, what)| what)
            .collect();
        async move { if missing.is_empty() { Ok(()) } else { Err(format!("no request for {missing:?}")) } }
    })
    .await;
    gate.open();
    let (result, events) = within("pull", pull).await.expect("the pull task");
    result.expect("pull");
    assert_eq!(snapshot(&store, &name), published);
    // One blob after the other, each complete: the progress a sequential pull shows.
    assert_pull_progress(&events, &manifest);
    for layer in manifest.blobs() {
        let mine: Vec<u64> =
            events.iter().filter(|e| e.digest == Some(layer.digest)).filter_map(|e| e.completed).collect();
        assert!(mine.windows(2).all(|w| w[0] <= w[1]), "progress of {} goes back: {mine:?}", layer.digest);
    }
}

/// Makes the proxy hold every `HEAD` of the blob `digest` (a push's first request for a
/// blob; its upload's `PUT` goes where the registry's `Location` says, past the proxy)
/// until the gate opens.
fn hold_heads_of(proxy: &Proxy, digest: &Digest) -> Gate {
    let gate = Gate::new();
    let (held, digest) = (gate.clone(), digest.to_string());
    proxy.rule(move |seen| {
        let first = seen.method == "HEAD" && seen.path.ends_with(&format!("/blobs/{digest}"));
        if first { Action::Hold(held.clone()) } else { Action::Pass }
    });
    gate
}

/// Whether the registry behind `world` holds the blob `digest` of `test/two`.
async fn registry_has(world: &World, digest: &Digest) -> bool {
    let url = format!("http://{}/v2/test/two/blobs/{digest}", world.registry.host());
    reqwest::Client::new().head(url).send().await.expect("ask the registry").status() == reqwest::StatusCode::OK
}

/// `test/two:v1` of [`two_large_layers`] (of `size` bytes each) in the source store, named
/// on a proxy in front of the registry, to be pushed.
fn two_large_layers_to_push(world: &World, size: usize) -> (Proxy, ModelName, Manifest) {
    let proxy = Proxy::start(world.registry.addr());
    let name = name_on(&proxy.host(), "test/two:v1");
    let manifest = two_large_layers(&world.source, &name, size);
    (proxy, name, manifest)
}

/// A push uploads its small blobs (here the config, last in the manifest) while a large one
/// goes up, and still reports one blob after the other, in the manifest's order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_push_uploads_small_blobs_beside_large_ones_and_reports_them_in_order() {
    let world = World::new();
    let (proxy, name, manifest) = two_large_layers_to_push(&world, 9 << 20);
    let (weights, config) = (manifest.layers()[0].digest, manifest.config().digest);
    let gate = hold_heads_of(&proxy, &weights);
    let client = client(&[proxy.host()], |_| {});
    let push = {
        let (client, store, name) = (client.clone(), world.source.clone(), name.clone());
        tokio::spawn(async move {
            let mut events = Vec::new();
            let result = client.push(&store, &name, |p| events.push(p)).await;
            (result, events)
        })
    };
    within("the weights' first request", gate.arrivals(1)).await;
    poll_until_async(DEADLINE, "the config on the registry while the weights wait", || async {
        if registry_has(&world, &config).await { Ok(()) } else { Err("no config on the registry".to_owned()) }
    })
    .await;
    gate.open();
    let (result, events) = within("push", push).await.expect("the push task");
    result.expect("push");
    let mut expected = vec!["retrieving manifest".to_owned()];
    expected.extend(manifest.blobs().map(|l| format!("pushing {}", short(&l.digest))));
    expected.extend(["pushing manifest", "success"].map(String::from));
    assert_eq!(statuses(&events), expected);
    for layer in manifest.blobs() {
        let last = events.iter().rev().find(|e| e.digest == Some(layer.digest)).expect("progress of a blob");
        assert_eq!((last.total, last.completed), (Some(layer.size), Some(layer.size)), "{}", layer.digest);
    }
    assert_pulls_back(&world, &client, &name).await;
}

/// What went up is the model: pulled back into another store, byte for byte.
async fn assert_pulls_back(world: &World, client: &Registry, name: &ModelName) {
    let store = world.store("dest");
    within("pull", client.pull(&store, name, |_| {})).await.expect("pull");
    assert_eq!(snapshot(&store, name), snapshot(&world.source, name));
}

/// A small blob the registry refuses fails the push at once, while a large one is still
/// on its way, naming the blob; the registry gets no manifest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_blob_refused_fails_the_push_while_a_large_one_goes_up() {
    let world = World::new();
    let (proxy, name, manifest) = two_large_layers_to_push(&world, 9 << 20);
    let (weights, config) = (manifest.layers()[0].digest.to_string(), manifest.config().digest);
    let gate = Gate::new();
    let (held, refused) = (gate.clone(), config.to_string());
    proxy.rule(move |seen| match seen.method.as_str() {
        "HEAD" if seen.path.ends_with(&weights) => Action::Hold(held.clone()),
        "HEAD" if seen.path.ends_with(&refused) => {
            Action::Respond { status: 403, headers: vec![], body: String::new() }
        }
        _ => Action::Pass,
    });
    let client = client(&[proxy.host()], |_| {});
    // The weights' first request stays held until the gate opens: the push ends without it.
    let error = within("push", client.push(&world.source, &name, |_| {})).await.expect_err("a refused blob");
    let message = error.to_string();
    assert!(message.contains(&format!("blob {config} of test/two")) && message.contains("403"), "{message}");
    // The weights' upload never got past its first request: the push did not wait for it.
    assert!(!registry_has(&world, &manifest.layers()[0].digest).await, "the weights went up");
    gate.open();
    assert!(!proxy.seen().iter().any(|s| s.path.contains("/manifests/")), "a manifest was sent");
    let status = reqwest::get(format!("http://{}/v2/test/two/manifests/v1", world.registry.host()))
        .await
        .expect("ask the registry")
        .status();
    assert_eq!(status, reqwest::StatusCode::NOT_FOUND);
}

/// [`two_large_layers_to_push`] of 32 MiB each (many times what the sockets' buffers
/// hold), the weights' upload coming through the proxy, which does `upload` with it.
fn push_through_the_proxy(world: &World, upload: Action) -> (Proxy, ModelName, Manifest) {
    let (proxy, name, manifest) = two_large_layers_to_push(world, 32 << 20);
    let weights = manifest.layers()[0].digest.to_string();
    proxy.rule(move |seen| match seen.method.as_str() {
        "POST" if seen.path.contains("/blobs/uploads/") => Action::Relocate,
        "PUT" if seen.path.contains(&format!("digest={}", weights.replace(':', "%3A"))) => upload.clone(),
        _ => Action::Pass,
    });
    (proxy, name, manifest)
}

/// The weights' `PUT` as the proxy saw it (it came through the proxy).
fn weights_put(proxy: &Proxy, manifest: &Manifest) -> bool {
    let weights = manifest.layers()[0].digest.to_string().replace(':', "%3A");
    proxy.seen().iter().any(|s| s.method == "PUT" && s.path.contains(&weights))
}

/// An upload that lasts longer than the read timeout goes through while the registry keeps
/// taking its data: the timeout bounds a silence, not a transfer (reqwest's own read
/// timeout, running from the request's start to its answer, failed it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_push_slower_than_the_read_timeout_goes_through_while_the_registry_takes_its_data() {
    let world = World::new();
    // 32 MiB at 8 MiB a second: 4 s. What the sockets' buffers hold when the last byte is
    // handed over (about 4 MiB) leaves in half a second, well within the timeout.
    let slow = Action::SlowBody(8 << 20);
    let (proxy, name, manifest) = push_through_the_proxy(&world, slow);
    let read_timeout = Duration::from_secs(2);
    let client = client(&[proxy.host()], |c| c.read_timeout = read_timeout);
    let started = std::time::Instant::now();
    let mut events = Vec::new();
    within("push", client.push(&world.source, &name, |p| events.push(p))).await.expect("a slow push");
    assert!(weights_put(&proxy, &manifest), "the weights' upload did not come through the proxy");
    assert!(started.elapsed() > 2 * read_timeout, "the upload was not slow: {:?}", started.elapsed());
    let weights = manifest.layers()[0].digest;
    let taken: Vec<u64> = events.iter().filter(|e| e.digest == Some(weights)).filter_map(|e| e.completed).collect();
    assert!(taken.windows(2).all(|w| w[0] <= w[1]) && taken.last() == Some(&manifest.layers()[0].size), "{taken:?}");
    assert_pulls_back(&world, &client, &name).await;
}

/// A registry that stops taking an upload's data fails the push once the read timeout has
/// passed without any, naming the blob and how far it got; a registry that takes it all and
/// never answers fails it the same way. No manifest is sent, and the connection is closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upload_the_registry_stops_taking_or_never_answers_fails_after_the_read_timeout() {
    let world = World::new();
    let never = Gate::new();
    for (upload, expected) in [
        (Action::StallBody(1 << 20), "then none for 1 s"),
        (Action::Hold(never.clone()), "no answer within 1 s of the last of its 33554432 bytes"),
    ] {
        let (proxy, name, manifest) = push_through_the_proxy(&world, upload);
        let client = client(&[proxy.host()], |c| c.read_timeout = Duration::from_secs(1));
        let error = within("push", client.push(&world.source, &name, |_| {})).await.expect_err("a stalled push");
        let message = error.to_string();
        let weights = manifest.layers()[0].digest;
        assert!(message.contains(&format!("blob {weights} of test/two")) && message.contains(expected), "{message}");
        assert!(weights_put(&proxy, &manifest), "the weights' upload did not come through the proxy");
        assert!(!proxy.seen().iter().any(|s| s.path.contains("/manifests/") && s.method == "PUT"), "a manifest");
        poll_until_async(DEADLINE, "the stalled upload's connection closed", || async {
            if proxy.abandoned() == 1 { Ok(()) } else { Err(format!("{} abandoned", proxy.abandoned())) }
        })
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_layer_that_fails_fails_the_pull_and_takes_back_the_others() {
    let world = World::new();
    let (manifest, _) = publish_two_large_layers(&world, "test/two:v1").await;
    let (weights, adapter) = (manifest.layers()[0].digest, manifest.layers()[1].digest);
    let proxy = Proxy::start(world.registry.addr());
    // The adapter's first parts wait until the weights are in place; its later parts come
    // corrupt.
    let (gate, released) = (Gate::new(), std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false)));
    let (held, later, digest) = (gate.clone(), std::sync::Arc::clone(&released), adapter.to_string());
    proxy.rule(move |seen| match seen.is_blob_get(&digest) {
        true if later.load(std::sync::atomic::Ordering::SeqCst) => Action::Corrupt(1000),
        true => Action::Hold(held.clone()),
        false => Action::Pass,
    });
    let store = world.store("dest");
    let name = name_on(&proxy.host(), "test/two:v1");
    let client = client(&[proxy.host()], |c| c.part_size = 1 << 20);

    let pull = {
        let (client, store, name) = (client.clone(), store.clone(), name.clone());
        tokio::spawn(async move { client.pull(&store, &name, |_| {}).await })
    };
    poll_until_async(DEADLINE, "the weights in place", || {
        let placed = store.has_blob(&weights);
        async move { if placed { Ok(()) } else { Err("not yet".to_owned()) } }
    })
    .await;
    released.store(true, std::sync::atomic::Ordering::SeqCst);
    gate.open();
    let error = within("pull", pull).await.expect("the pull task").expect_err("a corrupt layer");
    assert!(matches!(&error, RegistryError::DigestMismatch { digest, .. } if *digest == adapter), "{error:?}");
    // The weights arrived whole beside the adapter and were put in place: the failed pull
    // takes them back, and the corrupt adapter's data is gone.
    assert_nothing_written(&store, &name, &manifest, false);
}
