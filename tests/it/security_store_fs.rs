//! The store's file-system safety and its races, through the real HTTP API and the real
//! registry client against Debian's `docker-registry`: links planted in the store are
//! refused (never read, written or deleted through), a failed pull holds only the bytes
//! that arrived, garbage collection takes what nothing uses and never what a running pull
//! holds, and concurrent copies, deletes and listings answer no false 500.
//!
//! No test sleeps to synchronise: each waits for a condition under a deadline.

use std::fs;
use std::os::unix::fs::{MetadataExt, symlink};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use axum::http::StatusCode;
use corral::store::digest::Digest;
use corral::store::manifest::{MODEL, SYSTEM, TEMPLATE};
use corral::store::name::ModelName;
use corral::store::registry::{Registry, RegistryConfig, RegistryError};
use corral::store::{Store, StoreError};

use crate::support::api::{call, demo_store, state};
use crate::support::container::{poll_until, poll_until_async};
use crate::support::corrald::{Corrald, write_config};
use crate::support::llama;
use crate::support::notify::NotifyListener;
use crate::support::registry::{Action, DockerRegistry, Gate, Proxy};

const DEADLINE: Duration = Duration::from_secs(60);
const SECRET: &[u8] = b"root:$6$not-for-your-eyes";

async fn within<T>(what: &str, future: impl Future<Output = T>) -> T {
    tokio::time::timeout(DEADLINE, future).await.unwrap_or_else(|_| panic!("{what} took longer than {DEADLINE:?}"))
}

/// A directory outside the store with a secret file in it.
fn outside() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("tempdir");
    let secret = dir.path().join("shadow");
    fs::write(&secret, SECRET).expect("secret");
    (dir, secret)
}

fn name(text: &str) -> ModelName {
    ModelName::parse(text).expect("name")
}

fn model_dir(store: &Store, model: &str) -> PathBuf {
    store.manifest_path(&name(model)).parent().expect("parent").to_owned()
}

/// Checks an API error: not a success, a clear refusal, and nothing of the secret.
fn assert_refused(what: &str, (status, _, body): &(StatusCode, String, String)) {
    assert!(!status.is_success(), "{what}: {status} {body}");
    assert!(body.contains("symbolic link"), "{what}: {status} {body}");
    assert!(!body.contains("not-for-your-eyes"), "{what} disclosed the secret: {body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn links_planted_in_the_store_are_refused_through_the_api() {
    let dir = tempfile::tempdir().expect("tempdir");
    let state = state(dir.path());
    let store = state.store.clone();
    let (elsewhere, secret) = outside();

    // A manifest directory that is a link to a directory elsewhere holding a manifest.
    let target = elsewhere.path().join("evil");
    fs::create_dir(&target).expect("mkdir");
    fs::write(target.join("latest"), store.manifest_bytes(&name("chat")).expect("manifest")).expect("plant");
    symlink(&target, model_dir(&store, "evil")).expect("symlink");
    // A manifest that is a link to the secret.
    symlink(&secret, model_dir(&store, "chat").join("leak")).expect("symlink");
    // A model whose system prompt layer is a link to the secret.
    let (status, _, body) =
        call(&state, "POST", "/api/create", r#"{"model": "leaky", "from": "chat", "system": "hello"}"#).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let (leaky, _, _) = store.manifest(&name("leaky")).expect("leaky");
    let system = leaky.layers_of(SYSTEM).next().expect("system layer").digest;
    fs::remove_file(store.blob_path(&system)).expect("remove");
    symlink(&secret, store.blob_path(&system)).expect("symlink");

    for model in ["evil", "chat:leak", "leaky"] {
        let request = format!(r#"{{"model": "{model}"}}"#);
        assert_refused(&format!("show {model}"), &call(&state, "POST", "/api/show", &request).await);
    }
    assert_refused("delete evil", &call(&state, "DELETE", "/api/delete", r#"{"model": "evil"}"#).await);
    assert_refused("delete chat:leak", &call(&state, "DELETE", "/api/delete", r#"{"model": "chat:leak"}"#).await);
    let copy = call(&state, "POST", "/api/copy", r#"{"source": "chat", "destination": "evil:copied"}"#).await;
    assert_refused("copy into evil", &copy);
    let create =
        call(&state, "POST", "/api/create", r#"{"model": "evil:made", "from": "chat", "stream": false}"#).await;
    assert!(!create.0.is_success() || create.2.contains("symbolic link"), "create into evil: {create:?}");
    assert!(create.2.contains("symbolic link"), "create into evil: {create:?}");

    let (status, _, body) = call(&state, "GET", "/api/tags", "").await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let tags: serde_json::Value = serde_json::from_str(&body).expect("json");
    let mut names: Vec<&str> =
        tags["models"].as_array().expect("models").iter().map(|m| m["name"].as_str().expect("name")).collect();
    names.sort_unstable();
    assert_eq!(names, ["chat:latest", "embed:latest", "leaky:latest"], "links are not listed");

    // Nothing was written, read or deleted through any link.
    let mut planted: Vec<String> = fs::read_dir(&target)
        .expect("read")
        .map(|e| e.expect("e").file_name().to_string_lossy().into_owned())
        .collect();
    planted.sort();
    assert_eq!(planted, ["latest"], "nothing was written into the linked directory");
    assert_eq!(fs::read(&secret).expect("secret"), SECRET, "the secret is untouched");

    // Deleting the model whose layer is a link removes the link, never the file.
    let (status, _, body) = call(&state, "DELETE", "/api/delete", r#"{"model": "leaky"}"#).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert!(fs::symlink_metadata(store.blob_path(&system)).is_err(), "the link went with its model");
    assert_eq!(fs::read(&secret).expect("secret"), SECRET, "the secret is untouched");
}

/// A registry with `test/tiny:v1` pushed to it from a source store.
struct World {
    registry: DockerRegistry,
    dir: tempfile::TempDir,
    source: Store,
    name: ModelName,
}

impl World {
    async fn new() -> Self {
        let _ = tracing_subscriber::fmt().with_max_level(tracing::Level::DEBUG).with_test_writer().try_init();
        let registry = DockerRegistry::start();
        let dir = tempfile::tempdir().expect("tempdir");
        let source = demo_store(&dir.path().join("source"));
        let name = name(&format!("{}/test/tiny:v1", registry.host()));
        source.copy(&ModelName::parse("chat").expect("name"), &name).expect("copy");
        let client = client(&[registry.host()], |_| {});
        within("push", client.push(&source, &name, |_| {})).await.expect("push");
        Self { registry, dir, source, name }
    }

    fn weights(&self) -> (Digest, u64) {
        let (manifest, _, _) = self.source.manifest(&self.name).expect("manifest");
        let model = manifest.layers_of(MODEL).next().expect("weights");
        (model.digest, model.size)
    }

    fn store(&self, dir: &str) -> Store {
        Store::open(&self.dir.path().join(dir)).expect("store")
    }

    /// The model's name on `proxy`.
    fn on(proxy: &Proxy) -> ModelName {
        name(&format!("{}/test/tiny:v1", proxy.host()))
    }
}

fn client(hosts: &[String], tweak: impl FnOnce(&mut RegistryConfig)) -> Registry {
    let mut config = RegistryConfig {
        insecure: hosts.to_vec(),
        part_size: 64 << 10,
        max_parts: 1,
        part_attempts: 1,
        retry_delay: Duration::from_millis(10),
        connect_timeout: Duration::from_secs(10),
        read_timeout: Duration::from_secs(30),
        request_timeout: Duration::from_secs(30),
        max_downloads: 16,
    };
    tweak(&mut config);
    Registry::new(config)
}

fn partial_path(store: &Store, digest: &Digest) -> PathBuf {
    store.blobs_dir().join(format!("{}-partial", digest.file_name()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_pull_holds_only_the_bytes_that_arrived() {
    let world = World::new().await;
    let (weights, size) = world.weights();
    let proxy = Proxy::start(world.registry.addr());
    let cut = 100_000;
    assert!(size > 3 * cut, "the weights ({size} bytes) must be far larger than what arrives");
    let digest = weights.to_string();
    proxy.rule(move |seen| if seen.is_blob_get(&digest) { Action::Cut(cut) } else { Action::Pass });
    let store = world.store("dest");
    let client = client(&[proxy.host()], |c| c.part_size = 64 << 20);

    let error = within("pull", client.pull(&store, &World::on(&proxy), |_| {})).await.expect_err("cut");
    assert!(matches!(error, RegistryError::Truncated { .. }), "{error:?}");
    let meta = fs::metadata(partial_path(&store, &weights)).expect("the partial is kept for a resume");
    assert_eq!(meta.len(), cut, "the partial file is as long as what arrived, not the announced {size}");
    assert!(meta.blocks() * 512 <= cut + (64 << 10), "{} bytes on disk", meta.blocks() * 512);

    // The resume completes it.
    proxy.rule(|_| Action::Pass);
    within("resume", client.pull(&store, &World::on(&proxy), |_| {})).await.expect("resumed pull");
    store.verify_blob(&weights).expect("whole");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn links_planted_as_partial_downloads_are_refused_by_a_pull() {
    let world = World::new().await;
    let (weights, size) = world.weights();
    let (elsewhere, secret) = outside();
    let store = world.store("dest");
    let client = client(&[world.registry.host()], |_| {});
    let partial = partial_path(&store, &weights);
    let record = store.blobs_dir().join(format!("{}-partial.json", weights.file_name()));

    for planted in [&partial, &record] {
        symlink(&secret, planted).expect("symlink");
        let error = within("pull", client.pull(&store, &world.name, |_| {})).await.expect_err("refused");
        let message = error.to_string();
        assert!(message.contains("symbolic link") && message.contains("-partial"), "{message}");
        assert!(!message.contains(&elsewhere.path().display().to_string()), "{message}");
        assert_eq!(fs::read(&secret).expect("secret"), SECRET, "nothing was written through {}", planted.display());
        assert!(fs::symlink_metadata(planted).expect("still there").file_type().is_symlink(), "not deleted");
        assert!(store.manifest(&world.name).is_err(), "no model");
        fs::remove_file(planted).expect("remove the link");
    }
    // A hard link to a file elsewhere, with a record claiming it holds data: never written
    // into, nor resumed from; the pull starts a file of its own.
    let victim = elsewhere.path().join("victim");
    fs::write(&victim, SECRET).expect("victim");
    fs::hard_link(&victim, &partial).expect("hard link");
    let claim = serde_json::json!({ "digest": weights.to_string(), "size": size, "done": [[0, SECRET.len()]] });
    fs::write(&record, claim.to_string()).expect("record");
    within("pull", client.pull(&store, &world.name, |_| {})).await.expect("pull");
    store.verify_blob(&weights).expect("whole");
    assert_eq!(fs::read(&victim).expect("victim"), SECRET, "the hard-linked file is untouched");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blob_planted_as_a_link_is_never_pushed() {
    let world = World::new().await;
    let (_elsewhere, secret) = outside();
    let proxy = Proxy::start(world.registry.addr());
    // A model of the source store, named on the proxy, whose template is a link to the secret.
    let local = World::on(&proxy);
    let (status, body) = {
        let modelfile = format!("FROM chat\nTEMPLATE \"{{{{ .Prompt }}}} {}\"\n", proxy.host());
        let spec = corral::store::create::CreateSpec::from_modelfile(
            &corral::store::modelfile::Modelfile::parse(&modelfile).expect("modelfile"),
            world.dir.path(),
        )
        .expect("spec");
        match world.source.create(&local, &spec, &mut |_| {}) {
            Ok(d) => (true, d.to_string()),
            Err(e) => (false, e.to_string()),
        }
    };
    assert!(status, "{body}");
    let (manifest, _, _) = world.source.manifest(&local).expect("manifest");
    let template = manifest.layers_of(TEMPLATE).next().expect("template").digest;
    fs::remove_file(world.source.blob_path(&template)).expect("remove");
    symlink(&secret, world.source.blob_path(&template)).expect("symlink");

    let client = client(&[proxy.host()], |_| {});
    let error = within("push", client.push(&world.source, &local, |_| {})).await.expect_err("refused");
    assert!(matches!(&error, RegistryError::Store(e) if matches!(**e, StoreError::Refused { .. })), "{error:?}");
    assert!(error.to_string().contains("symbolic link"), "{error}");
    let uploads: Vec<_> = proxy.seen().into_iter().filter(|s| s.method == "PUT" || s.method == "PATCH").collect();
    assert!(uploads.is_empty(), "data was sent: {uploads:?}");
    assert_eq!(fs::read(&secret).expect("secret"), SECRET);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_collection_spares_a_running_pull_and_takes_its_partials_once_it_stopped() {
    let world = World::new().await;
    let (weights, size) = world.weights();
    let proxy = Proxy::start(world.registry.addr());
    let gate = Gate::new();
    let (held, digest) = (gate.clone(), weights.to_string());
    let third = (2 * (64 << 10), 3 * (64 << 10) - 1);
    assert!(size > 3 * (64 << 10));
    proxy.rule(move |seen| {
        if seen.is_blob_get(&digest) && seen.byte_range() == Some(third) {
            Action::Hold(held.clone())
        } else {
            Action::Pass
        }
    });
    let store = world.store("dest");
    let client = client(&[proxy.host()], |_| {});
    let pull = {
        let (client, store, name) = (client.clone(), store.clone(), World::on(&proxy));
        tokio::spawn(async move { client.pull(&store, &name, |_| {}).await })
    };
    within("the third part's request", gate.arrivals(1)).await;
    // The first two parts are written (their writes may still run when the third is asked for).
    let partial = partial_path(&store, &weights);
    poll_until_async(DEADLINE, "the first two parts written", || {
        let len = fs::metadata(&partial).map_or(0, |m| m.len());
        async move { if len == 2 * (64 << 10) { Ok(()) } else { Err(format!("{len} bytes")) } }
    })
    .await;

    // Everything counts as old: only what the pull holds protects its files.
    let later = SystemTime::now() + Duration::from_secs(86_400);
    let collected = store.collect_garbage(Duration::ZERO, later).expect("gc");
    assert_eq!(collected.files(), 0, "a running pull lost files: {collected:?}");
    assert_eq!(fs::metadata(&partial).expect("partial").len(), 2 * (64 << 10));

    // The pull goes away: its partial files are stale, and go once old enough.
    pull.abort();
    let _ = pull.await;
    assert_eq!(store.collect_garbage(Duration::from_secs(3600), SystemTime::now()).expect("gc").partials, 0);
    // The stopped download records its progress, then lets go of its files.
    let mut partials = 0;
    poll_until_async(DEADLINE, "the partial files to be collected", || {
        partials += store.collect_garbage(Duration::ZERO, later).expect("gc").partials;
        let collected = partials;
        async move { if collected >= 2 { Ok(()) } else { Err(format!("{collected} collected")) } }
    })
    .await;
    let left: Vec<_> = fs::read_dir(store.blobs_dir()).expect("read").map(|e| e.expect("e").file_name()).collect();
    assert!(left.iter().all(|f| !f.to_string_lossy().contains("partial")), "{left:?}");

    // A new pull starts over and succeeds.
    gate.open();
    proxy.rule(|_| Action::Pass);
    within("pull again", client.pull(&store, &World::on(&proxy), |_| {})).await.expect("pull");
    store.verify_blob(&weights).expect("whole");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_api_copies_deletes_and_listings_answer_no_false_500() {
    let dir = tempfile::tempdir().expect("tempdir");
    let state = state(dir.path());
    let mut tasks = tokio::task::JoinSet::new();
    for t in 0..4 {
        let state = state.clone();
        tasks.spawn(async move {
            let mut bad = Vec::new();
            for r in 0..40 {
                let a = format!("ns{}/m{}:{}", r % 3, (t + r) % 3, r % 2);
                let b = format!("ns{}/m{}:{}", (r + 1) % 3, (t + r + 1) % 3, r % 2);
                let requests = [
                    ("POST", "/api/copy", format!(r#"{{"source": "chat", "destination": "{a}"}}"#)),
                    ("POST", "/api/copy", format!(r#"{{"source": "{a}", "destination": "{b}"}}"#)),
                    ("GET", "/api/tags", String::new()),
                    ("DELETE", "/api/delete", format!(r#"{{"model": "{a}"}}"#)),
                    ("POST", "/api/show", format!(r#"{{"model": "{b}"}}"#)),
                    ("DELETE", "/api/delete", format!(r#"{{"model": "{b}"}}"#)),
                    ("GET", "/v1/models", String::new()),
                ];
                for (method, path, body) in requests {
                    let (status, _, text) = call(&state, method, path, &body).await;
                    if status != StatusCode::OK && status != StatusCode::NOT_FOUND {
                        bad.push(format!("{method} {path} {body}: {status} {text}"));
                    }
                }
            }
            bad
        });
    }
    let mut bad = Vec::new();
    while let Some(result) = tasks.join_next().await {
        bad.extend(result.expect("join"));
    }
    assert!(bad.is_empty(), "{} false errors, first: {:?}", bad.len(), &bad[..bad.len().min(5)]);
    // The store is consistent: what is listed is whole, and the only models left are the demo's and copies.
    for listed in state.store.list().expect("list") {
        for layer in listed.manifest.blobs() {
            state.store.verify_blob(&layer.digest).expect("whole");
        }
    }
}

/// corrald on the store in `dir` (`[store]` keys `store_extra` added), once it is ready,
/// and its port.
fn ready_on_store(dir: &Path, store_extra: &str) -> (Corrald, u16) {
    let port = crate::support::corrald::free_port();
    let config = write_config(
        dir,
        "corral.toml",
        &format!(
            "[server]\nlisten = [\"127.0.0.1:{port}\"]\n[store]\npath = \"{}\"\n{store_extra}[runner]\n\
             llama_server = \"{}\"\n[gpu]\nfixed = true\nhost_memory = \"4GiB\"\n",
            dir.join("models").display(),
            llama::bin_dir().join("llama-server").display(),
        ),
    );
    let notify = NotifyListener::start();
    let corrald = Corrald::start(&["--config", config.to_str().expect("utf-8")], Some(notify.path()));
    notify.wait_for("READY", "1", DEADLINE);
    (corrald, port)
}

#[test]
fn corrald_collects_garbage_at_start_and_logs_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = demo_store(dir.path());
    let (unused, _) = store.write_blob(&b"uploaded and never used"[..], None).expect("blob");
    let stale = Digest::of(b"a pull that stopped long ago");
    let partial = store.blobs_dir().join(format!("{}-partial", stale.file_name()));
    fs::write(&partial, b"half").expect("partial");
    let (chat, _, _) = store.manifest(&name("chat")).expect("chat");
    drop(store);
    let (corrald, _) = ready_on_store(dir.path(), "gc_grace = \"0s\"\n");
    corrald.wait_stderr("garbage collection removed 1 unused blobs, 1 stale partial downloads", DEADLINE);
    assert!(corrald.stderr().contains("corral_event=\"gc\""), "{}", corrald.stderr());
    let blobs = dir.path().join("models/blobs");
    assert!(!blobs.join(unused.file_name()).exists() && !Path::new(&partial).exists());
    for layer in chat.blobs() {
        assert!(blobs.join(layer.digest.file_name()).is_file(), "a model's blob was collected");
    }
}

#[test]
fn corrald_removes_interrupted_writes_at_the_top_before_ready_and_below_it_after() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = demo_store(dir.path());
    let top = store.blobs_dir().join(".tmp-interrupted");
    let nested = dir.path().join("models/manifests/registry.ollama.ai/library/chat/.tmp-older");
    drop(store);
    fs::write(&top, b"half").expect("debris");
    fs::write(&nested, b"half").expect("debris");
    let (corrald, _) = ready_on_store(dir.path(), "");
    assert!(!top.exists(), "a write's temporary file is gone by READY=1");
    poll_until(DEADLINE, "the temporary file below a model's directory to go", || {
        if nested.exists() { Err(corrald.stderr()) } else { Ok(()) }
    });
    corrald.wait_stderr("removing a temporary file left by an interrupted write", DEADLINE);
}

/// What is left in the store's `unsynced/` (nothing if it is not there).
fn notes_left(dir: &Path) -> Vec<String> {
    fs::read_dir(dir.join("models/unsynced"))
        .map(|d| d.map(|e| e.expect("entry").file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default()
}

/// Before `READY=1`, corrald deals with the notes of blobs an earlier run named and did
/// not sync: a note from an earlier boot (the machine stopped first) removes its blob, one
/// from this boot (only corrald stopped; the page cache holds the bytes) gets its blob
/// synced and kept.
#[test]
fn corrald_removes_or_syncs_the_blobs_an_earlier_run_left_unsynced() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = demo_store(dir.path());
    let (earlier, _) = store.write_blob(&b"named by a boot that ended before its sync"[..], None).expect("blob");
    let (this, _) = store.write_blob(&b"named by this boot; corrald stopped first"[..], None).expect("blob");
    drop(store);
    let notes = dir.path().join("models/unsynced");
    fs::create_dir(&notes).expect("notes");
    let boot_id = fs::read_to_string("/proc/sys/kernel/random/boot_id").expect("this boot's id");
    fs::write(notes.join(earlier.file_name()), "00000000-0000-0000-0000-000000000000\n").expect("note");
    fs::write(notes.join(this.file_name()), boot_id).expect("note");
    let (corrald, port) = ready_on_store(dir.path(), "");
    let blobs = dir.path().join("models/blobs");
    assert!(!blobs.join(earlier.file_name()).exists(), "removed by READY=1");
    assert!(blobs.join(this.file_name()).is_file(), "kept");
    let head = |digest: &Digest| {
        let path = format!("/api/blobs/{digest}");
        crate::support::http::tcp(([127, 0, 0, 1], port).into(), "HEAD", &path).status
    };
    assert_eq!((head(&earlier), head(&this)), (404, 200), "{}", corrald.stderr());
    poll_until(DEADLINE, "the notes to go", || {
        let left = notes_left(dir.path());
        if left.is_empty() { Ok(()) } else { Err(format!("{left:?}")) }
    });
    corrald.wait_stderr("the machine stopped before a new blob reached the disk", DEADLINE);
    let stderr = corrald.stderr();
    assert!(stderr.contains("removed=1") && stderr.contains("resynced=1"), "{stderr}");
}

/// A blob uploaded just before corrald is told to stop is on the disk when it exits:
/// the stop waits for the syncs still running, so no note outlives a clean stop.
#[test]
fn a_clean_stop_waits_for_new_blobs_to_sync() {
    let dir = tempfile::tempdir().expect("tempdir");
    drop(demo_store(dir.path()));
    let (mut corrald, port) = ready_on_store(dir.path(), "sync_before_reply = false\n");
    let data: Vec<u8> = (0..64u32 << 20).map(|i| (i % 251) as u8).collect();
    let digest = Digest::of(&data);
    let file = dir.path().join("upload");
    fs::write(&file, &data).expect("upload file");
    let url = format!("http://127.0.0.1:{port}/api/blobs/{digest}");
    let uploaded = std::process::Command::new("curl")
        .args(["-sS", "-f", "-o", "/dev/null", "-w", "%{http_code}", "-T"])
        .arg(&file)
        .args(["-X", "POST", &url])
        .output()
        .expect("run curl");
    assert_eq!(String::from_utf8_lossy(&uploaded.stdout), "201", "{}", String::from_utf8_lossy(&uploaded.stderr));
    corrald.signal(nix::sys::signal::Signal::SIGTERM);
    assert!(corrald.wait_exit(DEADLINE).success(), "{}", corrald.stderr());
    assert_eq!(notes_left(dir.path()), Vec::<String>::new(), "a note outlived the stop");
    let blob = dir.path().join("models/blobs").join(digest.file_name());
    assert_eq!(Digest::of(&fs::read(blob).expect("the blob")), digest);
}

/// A file passed open (D-Bus `CreateWithFiles`) is bounded by the disk, as an upload is: a
/// sparse file claiming far more than the store's file system holds is copied until the
/// disk is full, then the create fails naming the cause, keeps nothing, and gives the
/// space back.
#[test]
fn a_passed_file_larger_than_the_disk_fails_the_create_and_gives_the_space_back() {
    use corral::store::PassedFile;
    use corral::store::create::CreateSpec;
    use corral::store::modelfile::Modelfile;
    use std::collections::HashMap;

    let disk = crate::support::registry::SmallDisk::mount(1 << 20);
    let store = Store::open(&disk.path().join("store")).expect("a store on the small disk");
    let free = |path: &Path| {
        let stat = nix::sys::statvfs::statvfs(path).expect("statvfs");
        stat.blocks_available() * stat.fragment_size()
    };
    let before = free(disk.path());
    let (dir, _) = outside();
    let path = dir.path().join("huge.gguf");
    corral::demo_model::write_tiny_llama(&path).expect("a GGUF");
    // A valid header, then 64 MiB of holes: nothing on the caller's disk, all on the store's.
    fs::OpenOptions::new().write(true).open(&path).expect("open").set_len(64 << 20).expect("sparse");
    let key = "/home/someone/huge.gguf";
    let passed = PassedFile::new(fs::File::open(&path).expect("open").into(), key).expect("a regular file");
    let files = HashMap::from([(key.to_owned(), passed)]);
    let modelfile = Modelfile::parse(&format!("FROM {key}\n")).expect("modelfile");
    let spec = CreateSpec::from_modelfile_passing(&modelfile, Path::new("/"), &files).expect("spec");

    let err = store.create(&name("huge"), &spec, &mut |_| {}).expect_err("the disk is full").to_string();
    assert!(err.contains("cannot write") && err.contains("No space left on device"), "{err}");
    assert!(matches!(store.manifest(&name("huge")), Err(StoreError::NotFound(_))), "a manifest was written");
    let left: Vec<_> = fs::read_dir(store.blobs_dir()).expect("blobs").map(|e| e.expect("entry").file_name()).collect();
    assert!(left.is_empty(), "the failed copy left {left:?}");
    assert!(free(disk.path()) + (64 << 10) >= before, "the space came back: {} of {before}", free(disk.path()));
}
