//! The D-Bus interface against corrald serving the real llama-server: Load and Unload
//! reply when the effect is real, and every change is signalled with its reason.

use std::collections::HashMap;
use std::time::Duration;

use corral::dbus::proxy::{ManagerProxy, ModelProxy};
use futures_util::StreamExt;
use zbus::fdo::{PropertiesChanged, PropertiesProxy};
use zbus::proxy::CacheProperties;
use zbus::zvariant::{ObjectPath, Value};

use crate::support::dbus::BusDaemon;

const WAIT: Duration = Duration::from_secs(60);

fn alive(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
}

async fn within<T>(what: &str, future: impl Future<Output = T>) -> T {
    tokio::time::timeout(WAIT, future).await.unwrap_or_else(|_| panic!("timed out waiting for {what}"))
}

/// A proxy that reads every property from the daemon (no cache), so that a read right
/// after a reply shows what the daemon shows then.
async fn model<'a>(connection: &zbus::Connection, path: &'a ObjectPath<'a>) -> ModelProxy<'a> {
    ModelProxy::builder(connection)
        .path(path)
        .expect("path")
        .cache_properties(CacheProperties::No)
        .build()
        .await
        .expect("model")
}

async fn uncached_manager(connection: &zbus::Connection) -> ManagerProxy<'static> {
    ManagerProxy::builder(connection).cache_properties(CacheProperties::No).build().await.expect("manager")
}

/// Every PropertiesChanged of `path`, in order (signals are queued; property streams are not).
async fn changes(connection: &zbus::Connection, path: &ObjectPath<'_>) -> PropertiesChangedStream {
    let proxy = PropertiesProxy::builder(connection)
        .destination("org.corral.Corral1")
        .expect("destination")
        .path(path.to_owned())
        .expect("path")
        .build()
        .await
        .expect("properties");
    proxy.receive_properties_changed().await.expect("subscribe")
}

type PropertiesChangedStream = zbus::fdo::PropertiesChangedStream;

/// corrald's object manager at the root.
async fn object_manager(connection: &zbus::Connection) -> zbus::fdo::ObjectManagerProxy<'static> {
    zbus::fdo::ObjectManagerProxy::builder(connection)
        .destination("org.corral.Corral1")
        .and_then(|b| b.path("/org/corral/Corral1"))
        .expect("proxy")
        .build()
        .await
        .expect("proxy")
}

/// The values property `name` takes in the next changes, until `last`.
async fn values_until(stream: &mut PropertiesChangedStream, name: &str, last: &str) -> Vec<String> {
    let mut seen = Vec::new();
    while seen.last().map(String::as_str) != Some(last) {
        let signal: PropertiesChanged =
            within(&format!("{name} to become {last}"), stream.next()).await.expect("a signal");
        let args = signal.args().expect("args");
        if let Some(value) = args.changed_properties().get(name) {
            seen.push(String::try_from(value.try_clone().expect("clone")).expect("a string"));
        }
    }
    seen
}

fn keep_alive(value: &str) -> HashMap<&str, Value<'_>> {
    HashMap::from([("keep_alive", Value::from(value))])
}

/// The next value of the manager's `LoadedModels` in its PropertiesChanged.
async fn loaded_models_change(stream: &mut PropertiesChangedStream) -> Vec<String> {
    loop {
        let signal = within("LoadedModels to change", stream.next()).await.expect("a signal");
        let args = signal.args().expect("args");
        if let Some(value) = args.changed_properties().get("LoadedModels") {
            return Vec::<String>::try_from(value.try_clone().expect("clone")).expect("strings");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_and_unload_reply_when_done_and_signal_every_change() {
    let daemon = BusDaemon::start("");
    let connection = daemon.connect().await;
    let manager = uncached_manager(&connection).await;
    let path = manager.get_model("chat").await.expect("GetModel");
    let model = model(&connection, &path).await;
    assert_eq!(model.state().await.expect("State"), "stopped");
    assert_eq!(model.name().await.expect("Name"), "registry.ollama.ai/library/chat:latest");
    assert_eq!(model.details().await.expect("Details")["family"], "llama");

    // Subscribed before acting, so that nothing is missed.
    let mut loaded = manager.receive_model_loaded().await.expect("subscribe");
    let mut unloaded = manager.receive_model_unloaded().await.expect("subscribe");
    let mut offload = manager.receive_offload_reported().await.expect("subscribe");
    let mut model_changes = changes(&connection, &path).await;
    let mut manager_changes = changes(&connection, &ObjectPath::from_static_str_unchecked("/org/corral/Corral1")).await;

    let returned = within("Load", manager.load("chat", keep_alive("10m"))).await.expect("Load");
    assert_eq!(returned, path);
    // The reply came once the model was ready: its runner answers now.
    assert_eq!(model.state().await.expect("State"), "ready");
    let pid = model.pid().await.expect("Pid");
    assert!(pid > 0 && alive(pid), "pid {pid}");
    let health = crate::support::http::tcp(([127, 0, 0, 1], daemon.port).into(), "GET", "/api/ps").json();
    assert_eq!(health["models"][0]["name"], "chat:latest", "{health}");
    assert!(model.total_layers().await.expect("TotalLayers") > 0);
    assert!(model.vram_bytes().await.expect("VramBytes") + model.ram_bytes().await.expect("RamBytes") > 0);
    let expires = model.expires_at().await.expect("ExpiresAt");
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("epoch").as_micros();
    let in_ten_minutes = now + 600 * 1_000_000;
    assert!(u128::from(expires) > now && u128::from(expires) <= in_ten_minutes + 5_000_000, "{expires} vs {now}");
    assert_eq!(model.active_requests().await.expect("ActiveRequests"), 0);
    assert_eq!(manager.loaded_models().await.expect("LoadedModels"), ["chat:latest"]);

    let signal = within("ModelLoaded", loaded.next()).await.expect("a signal");
    let args = signal.args().expect("args");
    assert_eq!((args.name.as_str(), args.model.as_str(), args.pid), ("chat:latest", path.as_str(), pid));
    let signal = within("OffloadReported", offload.next()).await.expect("a signal");
    let args = signal.args().expect("args");
    assert_eq!(args.name, "chat:latest");
    assert!(args.total_layers > 0 && args.gpu_layers <= args.total_layers, "{} {}", args.gpu_layers, args.total_layers);
    assert_eq!(values_until(&mut model_changes, "State", "ready").await, ["loading", "ready"]);
    assert_eq!(loaded_models_change(&mut manager_changes).await, ["chat:latest"]);

    // Unload replies once the child is reaped.
    within("Unload", model.unload()).await.expect("Unload");
    assert!(!alive(pid), "llama-server {pid} still exists after Unload returned");
    assert_eq!(model.state().await.expect("State"), "stopped");
    assert_eq!(model.pid().await.expect("Pid"), 0);
    let signal = within("ModelUnloaded", unloaded.next()).await.expect("a signal");
    let args = signal.args().expect("args");
    assert_eq!((args.name.as_str(), args.reason.as_str()), ("chat:latest", "requested"));
    assert_eq!(values_until(&mut model_changes, "State", "stopped").await, ["unloading", "stopped"]);
    assert!(loaded_models_change(&mut manager_changes).await.is_empty());
    assert!(manager.loaded_models().await.expect("LoadedModels").is_empty());

    // Unloading what is not loaded is an error that says so.
    let err = model.unload().await.expect_err("not loaded");
    assert!(err.to_string().contains("org.corral.Corral1.Error.NotLoaded"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expiry_eviction_and_crash_are_signalled_with_their_reasons() {
    let daemon = BusDaemon::start("[scheduler]\nmax_loaded_models = 1\n");
    let connection = daemon.connect().await;
    let manager = uncached_manager(&connection).await;
    let mut unloaded = manager.receive_model_unloaded().await.expect("subscribe");
    let mut next_unload = async || {
        let signal = within("ModelUnloaded", unloaded.next()).await.expect("a signal");
        let args = signal.args().expect("args");
        (args.name.clone(), args.reason.clone())
    };

    // Expiry: a keep-alive of one second.
    manager.load("chat", keep_alive("1s")).await.expect("Load");
    assert_eq!(next_unload().await, ("chat:latest".to_owned(), "expired".to_owned()));

    // Eviction: one model at most, so loading the other evicts the first.
    manager.load("chat", keep_alive("10m")).await.expect("Load chat");
    let embed_path = manager.load("embed", keep_alive("10m")).await.expect("Load embed");
    assert_eq!(next_unload().await, ("chat:latest".to_owned(), "evicted".to_owned()));
    assert_eq!(manager.loaded_models().await.expect("LoadedModels"), ["embed:latest"]);

    // A crash: the runner is killed behind corrald's back.
    let embed = model(&connection, &embed_path).await;
    let pid = embed.pid().await.expect("Pid");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(pid).expect("pid")),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("kill");
    assert_eq!(next_unload().await, ("embed:latest".to_owned(), "crashed".to_owned()));
    assert_eq!(embed.state().await.expect("State"), "failed");
    let reason = embed.last_error().await.expect("LastError");
    assert!(reason.contains("signal") || reason.contains("SIGKILL") || reason.contains("killed"), "{reason}");
    // The next Load tries again and clears the error.
    manager.load("embed", HashMap::new()).await.expect("Load after a crash");
    assert_eq!(embed.state().await.expect("State"), "ready");
    assert_eq!(embed.last_error().await.expect("LastError"), "");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_calls_get_named_errors_and_change_nothing() {
    // Too little memory for any model: loads fail with InsufficientMemory.
    let daemon = BusDaemon::start("[gpu]\nfixed = true\nhost_memory = \"1KiB\"\n");
    let connection = daemon.connect().await;
    let manager = uncached_manager(&connection).await;
    let before = manager.list_models().await.expect("ListModels");
    let cases: Vec<(&str, zbus::Result<_>, &str)> = vec![
        ("unknown model", manager.load("nope", HashMap::new()).await.map(drop), "NoSuchModel: model 'nope' not found"),
        ("invalid name", manager.load("../etc", HashMap::new()).await.map(drop), "InvalidName"),
        ("GetModel unknown", manager.get_model("nope").await.map(drop), "NoSuchModel"),
        (
            "option of the wrong type",
            manager.load("chat", HashMap::from([("num_ctx", Value::from("big"))])).await.map(drop),
            "InvalidArgument: invalid option num_ctx",
        ),
        (
            "bad keep_alive",
            manager.load("chat", keep_alive("soon")).await.map(drop),
            "InvalidArgument: option keep_alive",
        ),
        (
            "does not fit",
            manager.load("chat", HashMap::new()).await.map(drop),
            "InsufficientMemory: model 'chat:latest' needs",
        ),
        ("unload not loaded", manager.unload("chat").await, "NotLoaded"),
        (
            "unknown pull option",
            manager.pull("chat", HashMap::from([("insecur", Value::Bool(true))])).await.map(drop),
            "InvalidArgument: unknown option insecur; known: insecure",
        ),
        (
            "pull option of the wrong type",
            manager.pull("chat", HashMap::from([("insecure", Value::from("yes"))])).await.map(drop),
            "InvalidArgument: option insecure must be a boolean",
        ),
        ("copy to an invalid name", manager.copy("chat", "a b").await.map(drop), "InvalidName"),
        (
            "a Modelfile without FROM",
            manager.create("new", "SYSTEM hi\n").await.map(drop),
            "InvalidArgument: Modelfile:",
        ),
    ];
    for (what, result, expected) in cases {
        let err = result.expect_err(what).to_string();
        assert!(err.contains("org.corral.Corral1.Error."), "{what}: {err}");
        assert!(err.contains(expected), "{what}: expected {expected:?} in {err}");
    }
    assert_eq!(manager.list_models().await.expect("ListModels"), before, "the store changed");
    assert!(manager.loaded_models().await.expect("LoadedModels").is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_signals_the_new_limits() {
    let daemon = BusDaemon::start("[scheduler]\nmax_loaded_models = 1\nmax_queue = 5\nkeep_alive = \"1m\"\n");
    let connection = daemon.connect().await;
    let manager = uncached_manager(&connection).await;
    assert_eq!(manager.max_loaded_models().await.expect("MaxLoadedModels"), 1);
    assert_eq!(manager.max_queue().await.expect("MaxQueue"), 5);
    assert_eq!(manager.default_keep_alive().await.expect("DefaultKeepAlive"), 60);
    assert_eq!(manager.queue_depth().await.expect("QueueDepth"), 0);
    assert!(manager.gpus().await.expect("Gpus").is_empty());
    assert!(manager.host_memory().await.expect("HostMemory") > 0);
    assert_eq!(manager.version().await.expect("Version"), env!("CARGO_PKG_VERSION"));

    let mut manager_changes = changes(&connection, &ObjectPath::from_static_str_unchecked("/org/corral/Corral1")).await;
    let config = daemon.path().join("corral.toml");
    let text = std::fs::read_to_string(&config).expect("config");
    let text = text
        .replace("max_loaded_models = 1", "max_loaded_models = 2")
        .replace("keep_alive = \"1m\"", "keep_alive = \"2m\"");
    std::fs::write(&config, text).expect("write");
    daemon.corrald.signal(nix::sys::signal::Signal::SIGHUP);
    let mut seen: HashMap<String, zbus::zvariant::OwnedValue> = HashMap::new();
    while !(seen.contains_key("MaxLoadedModels") && seen.contains_key("DefaultKeepAlive")) {
        let signal = within("the new limits", manager_changes.next()).await.expect("a signal");
        let args = signal.args().expect("args");
        for (name, value) in args.changed_properties() {
            seen.insert(name.to_string(), value.try_to_owned().expect("owned"));
        }
    }
    assert_eq!(u32::try_from(&seen["MaxLoadedModels"]).expect("u"), 2);
    assert_eq!(i64::try_from(&seen["DefaultKeepAlive"]).expect("x"), 120);
    assert_eq!(manager.max_loaded_models().await.expect("MaxLoadedModels"), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_loads_a_full_queue_and_a_read_only_store_are_named() {
    // A runner that cannot start: LoadFailed, and the model shows why.
    let daemon = BusDaemon::with("", std::path::Path::new("/bin/false"), "");
    let connection = daemon.connect().await;
    let manager = uncached_manager(&connection).await;
    let err = manager.load("chat", HashMap::new()).await.expect_err("cannot load").to_string();
    assert!(err.contains("org.corral.Corral1.Error.LoadFailed: model 'chat:latest' failed to load"), "{err}");
    let path = manager.get_model("chat").await.expect("GetModel");
    let chat = model(&connection, &path).await;
    assert_eq!(chat.state().await.expect("State"), "failed");
    assert!(!chat.last_error().await.expect("LastError").is_empty());
    drop(daemon);

    // No room in the queue at all: Busy.
    let daemon = BusDaemon::start("[scheduler]\nmax_queue = 0\n");
    let connection = daemon.connect().await;
    let manager = uncached_manager(&connection).await;
    let err = manager.load("chat", HashMap::new()).await.expect_err("queue full").to_string();
    assert!(err.contains("org.corral.Corral1.Error.Busy: server busy"), "{err}");
    assert!(manager.loaded_models().await.expect("LoadedModels").is_empty());
    drop(daemon);

    // A read-only store: every change is refused before a job starts; a push may read it.
    let daemon = BusDaemon::with_store("read_only = true", "");
    let connection = daemon.connect().await;
    let manager = uncached_manager(&connection).await;
    let before = manager.list_models().await.expect("ListModels");
    let refused = [
        manager.pull("chat", HashMap::new()).await,
        manager.create("new", "FROM chat\n").await,
        manager.copy("chat", "copy").await,
        manager.delete("chat").await,
    ];
    for result in refused {
        let err = result.expect_err("read-only").to_string();
        assert!(err.contains("org.corral.Corral1.Error.ReadOnly: the model store is read-only"), "{err}");
    }
    assert_eq!(manager.list_models().await.expect("ListModels"), before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_object_tree_shows_every_object_with_what_get_all_gives() {
    let daemon = BusDaemon::start("");
    let connection = daemon.connect().await;
    let manager = uncached_manager(&connection).await;
    let mut finished = manager.receive_job_finished().await.expect("subscribe");
    // A ready model (its runner's fields and memory), stopped ones, and a finished job.
    within("Load", manager.load("chat", keep_alive("10m"))).await.expect("Load");
    let job = manager.copy("chat", "chat-copy").await.expect("Copy");
    let signal = within("JobFinished", finished.next()).await.expect("a signal");
    assert!(signal.args().expect("args").success);
    let copy = manager.get_model("chat-copy").await.expect("GetModel");
    let objects = object_manager(&connection).await;
    // The follower shows the copy once the store's change reaches it.
    let tree = crate::support::container::poll_until_async(WAIT, "the copy in the object tree", || async {
        let tree = objects.get_managed_objects().await.map_err(|e| e.to_string())?;
        if tree.contains_key(&copy) { Ok(tree) } else { Err(format!("{:?}", tree.keys())) }
    })
    .await;
    let mut paths: Vec<String> = tree.keys().map(ToString::to_string).collect();
    paths.sort();
    let mut expected: Vec<String> = manager
        .list_models()
        .await
        .expect("ListModels")
        .into_iter()
        .map(|(_, path, ..)| path.to_string())
        .chain([job.to_string()])
        .collect();
    expected.sort();
    assert_eq!(paths, expected);

    for (path, interfaces) in &tree {
        let properties = PropertiesProxy::builder(&connection)
            .destination("org.corral.Corral1")
            .and_then(|b| b.path(path.clone()))
            .expect("proxy")
            .build()
            .await
            .expect("proxy");
        assert_eq!(interfaces.len(), 1, "{path}: {:?}", interfaces.keys());
        for (interface, shown) in interfaces {
            let all = properties.get_all(interface.as_ref()).await.expect("GetAll");
            assert_eq!(shown, &all, "{path} {interface}");
        }
    }
    // A model's explicit properties are in neither, and each is read with Get.
    let chat_path = manager.get_model("chat").await.expect("GetModel");
    let chat = &tree[&chat_path]["org.corral.Corral1.Model"];
    let mut names: Vec<&str> = chat.keys().map(String::as_str).collect();
    names.sort_unstable();
    assert_eq!(
        names,
        [
            "Capabilities",
            "ContextLength",
            "Details",
            "Digest",
            "GpuLayers",
            "LastError",
            "ModifiedAt",
            "Name",
            "Pid",
            "RamBytes",
            "SharedWith",
            "ShortName",
            "Size",
            "State",
            "TotalLayers",
            "VramBytes",
        ]
    );
    assert_eq!(String::try_from(chat["State"].try_clone().expect("clone")).expect("s"), "ready");
    // The live fields are read from the scheduler, not left empty: the ready model shows its runner.
    let chat = model(&connection, &chat_path).await;
    assert!(chat.expires_at().await.expect("ExpiresAt") > 0);
    let memory = chat.memory().await.expect("Memory");
    assert!(memory.iter().any(|(_, _, actual)| *actual > 0), "{memory:?}");
    assert!(chat.modelfile().await.expect("Modelfile").contains("FROM "));
    let job_props = &tree[&job]["org.corral.Corral1.Job"];
    assert_eq!(String::try_from(job_props["State"].try_clone().expect("clone")).expect("s"), "succeeded");
}

/// corrald shows its saved listing on the bus at once after a restart, then what one walk
/// of the store finds changed while it was down: a model removed goes, one added comes
/// (the walk counts as a change of the store, which the object tree follows).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_restart_the_bus_shows_what_changed_in_the_store_while_corrald_was_down() {
    let mut daemon = BusDaemon::start("");
    let model_objects = |connection: zbus::Connection| async move {
        let objects = object_manager(&connection).await;
        let tree = objects.get_managed_objects().await.map_err(|e| e.to_string())?;
        let mut names: Vec<String> = tree
            .keys()
            .filter_map(|k| k.as_str().strip_prefix("/org/corral/Corral1/models/").map(str::to_owned))
            .collect();
        names.sort();
        Ok::<_, String>(names)
    };
    assert_eq!(model_objects(daemon.connect().await).await.expect("tree"), ["chat_3alatest", "embed_3alatest"]);

    daemon.stop();
    let saved = std::fs::read_to_string(daemon.path().join("state/listing.json")).expect("the saved listing");
    assert!(saved.contains("\"embed:latest\""), "{saved}");
    let library = daemon.path().join("models/manifests/registry.ollama.ai/library");
    std::fs::remove_dir_all(library.join("embed")).expect("rm");
    std::fs::create_dir(library.join("outside")).expect("mkdir");
    std::fs::copy(library.join("chat/latest"), library.join("outside/latest")).expect("copy the manifest");

    daemon.start_again();
    let connection = daemon.connect().await;
    crate::support::container::poll_until_async(WAIT, "the object tree to show the store as it is", || {
        let connection = connection.clone();
        async move {
            let names = model_objects(connection).await?;
            if names == ["chat_3alatest", "outside_3alatest"] { Ok(()) } else { Err(format!("{names:?}")) }
        }
    })
    .await;
    // It stays so: the saved listing, once checked, is no longer what the tree shows.
    let later = model_objects(connection.clone()).await.expect("tree");
    assert_eq!(later, ["chat_3alatest", "outside_3alatest"]);
    let path = ObjectPath::try_from("/org/corral/Corral1/models/outside_3alatest").expect("path");
    let outside = model(&connection, &path).await;
    assert_eq!(outside.short_name().await.expect("ShortName"), "outside:latest");
}

/// A model's facts from its blobs (`ContextLength`, `Capabilities`) are read once per
/// manifest, not once per name or start: a second name for the same manifest, and both
/// after a restart, show them without reading the weights again (here made unreadable
/// first, so a read would show none). Its
/// texts are read when asked for, from the manifest as it is: a new system prompt written
/// into the store shows at the next `Get`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_manifests_facts_are_read_once_and_a_models_texts_when_asked_for() {
    use corral::store::Store;
    use corral::store::manifest::{self, Layer, Manifest};
    use corral::store::name::ModelName;

    let mut daemon = BusDaemon::start("");
    let connection = daemon.connect().await;
    let manager = uncached_manager(&connection).await;
    let chat_path = manager.get_model("chat").await.expect("GetModel");
    let chat = model(&connection, &chat_path).await;
    let context_length = chat.context_length().await.expect("ContextLength");
    let capabilities = chat.capabilities().await.expect("Capabilities");
    assert!(context_length > 0 && capabilities.contains(&"completion".to_owned()), "{context_length} {capabilities:?}");

    // The weights made unreadable behind corrald's back, then the same manifest under a
    // second name (as `ollama cp` or another program would write it).
    let store = Store::open(&daemon.path().join("models")).expect("store");
    let (manifest, ..) = store.manifest(&ModelName::parse("chat").expect("name")).expect("chat's manifest");
    let weights = store.blob_path(&manifest.model().digest);
    let original = std::fs::read(&weights).expect("the weights");
    std::fs::write(&weights, vec![0x55; original.len()]).expect("overwrite the weights");
    store.write_manifest(&ModelName::parse("second").expect("name"), &manifest).expect("write");
    let second_path = ObjectPath::try_from("/org/corral/Corral1/models/second_3alatest").expect("path");
    let objects = object_manager(&connection).await;
    crate::support::container::poll_until_async(WAIT, "the second name's object", || async {
        let tree = objects.get_managed_objects().await.map_err(|e| e.to_string())?;
        if tree.contains_key(&second_path) { Ok(()) } else { Err(format!("{:?}", tree.keys())) }
    })
    .await;
    let second = model(&connection, &second_path).await;
    assert_eq!(second.context_length().await.expect("ContextLength"), context_length);
    assert_eq!(second.capabilities().await.expect("Capabilities"), capabilities);

    // Kept with the saved listing: after a restart, still not read again.
    daemon.stop();
    daemon.start_again();
    let connection = daemon.connect().await;
    for path in [&chat_path, &second_path] {
        let shown = model(&connection, path).await;
        assert_eq!(shown.context_length().await.expect("ContextLength"), context_length, "{path}");
        assert_eq!(shown.capabilities().await.expect("Capabilities"), capabilities, "{path}");
    }
    let chat = model(&connection, &chat_path).await;

    // A new system prompt for chat: the texts follow the manifest, read when asked for
    // (with the weights, which must read again).
    std::fs::write(&weights, &original).expect("the weights back");
    assert_eq!(chat.system().await.expect("System"), "");
    let (digest, size) = store.write_blob(&b"you are terse"[..], None).expect("write a blob");
    let mut layers = manifest.layers().to_vec();
    layers.push(Layer { media_type: manifest::SYSTEM.to_owned(), digest, size, from: None });
    let terse = Manifest::new(manifest.config().clone(), layers).expect("manifest");
    store.write_manifest(&ModelName::parse("chat").expect("name"), &terse).expect("write");
    crate::support::container::poll_until_async(WAIT, "chat's new system prompt", || async {
        let system = chat.system().await.map_err(|e| e.to_string())?;
        if system == "you are terse" { Ok(()) } else { Err(system) }
    })
    .await;
    let modelfile = chat.modelfile().await.expect("Modelfile");
    assert!(modelfile.contains("SYSTEM") && modelfile.contains("you are terse"), "{modelfile}");
}

/// Another program (Ollama on the same directory) adds and removes a model with plain
/// file operations: the model's object comes and goes without any listing asked for
/// (inotify reports the change), and `/api/tags` shows it at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_another_program_writes_or_removes_comes_and_goes_on_the_bus() {
    let daemon = BusDaemon::start("");
    let connection = daemon.connect().await;
    let objects = object_manager(&connection).await;
    let path = ObjectPath::try_from("/org/corral/Corral1/models/outside_3alatest").expect("path");
    let shown = |want: bool| {
        let (objects, path) = (&objects, &path);
        crate::support::container::poll_until_async(WAIT, "the object tree to follow the store", move || async move {
            let tree = objects.get_managed_objects().await.map_err(|e| e.to_string())?;
            let keys: Vec<String> = tree.keys().map(ToString::to_string).collect();
            if keys.iter().any(|k| k == path.as_str()) == want { Ok(keys) } else { Err(format!("{keys:?}")) }
        })
    };
    let library = daemon.path().join("models/manifests/registry.ollama.ai/library");
    let before = shown(false).await;
    assert!(before.iter().any(|k| k.ends_with("/chat_3alatest")), "{before:?}");

    std::fs::create_dir(library.join("outside")).expect("mkdir");
    std::fs::copy(library.join("chat/latest"), library.join("outside/latest")).expect("copy the manifest");
    shown(true).await;
    let outside = model(&connection, &path).await;
    assert_eq!(outside.short_name().await.expect("ShortName"), "outside:latest");
    let tags = crate::support::http::tcp(([127, 0, 0, 1], daemon.port).into(), "GET", "/api/tags");
    assert!(tags.body.contains("\"outside:latest\""), "{}", tags.body);

    std::fs::remove_dir_all(library.join("outside")).expect("rm");
    shown(false).await;
    let tags = crate::support::http::tcp(([127, 0, 0, 1], daemon.port).into(), "GET", "/api/tags");
    assert!(!tags.body.contains("\"outside:latest\""), "{}", tags.body);
}
