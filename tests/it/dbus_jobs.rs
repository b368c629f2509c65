//! Store work over D-Bus: Create, Copy, Delete, Push and Pull return a job at once; the
//! job's properties and signals tell how it went, and model objects follow the store.

use std::collections::HashMap;
use std::time::Duration;

use corral::dbus::proxy::{JobProxy, ManagerProxy};
use futures_util::StreamExt;
use zbus::fdo::ObjectManagerProxy;
use zbus::zvariant::OwnedObjectPath;

use crate::support::dbus::BusDaemon;
use crate::support::registry::DockerRegistry;

const WAIT: Duration = Duration::from_secs(60);

/// Follows a job to its end; returns (success, error) from its Finished signal, checked
/// against its properties.
async fn finish(connection: &zbus::Connection, path: &OwnedObjectPath) -> (bool, String) {
    let job = JobProxy::builder(connection)
        .path(path)
        .expect("path")
        .cache_properties(zbus::proxy::CacheProperties::No)
        .build()
        .await
        .expect("job");
    let mut finished = job.receive_finished().await.expect("subscribe");
    // Subscribed first, then checked: a job that ended meanwhile is read from its state.
    let state = job.state().await.expect("State");
    let (success, error) = if state == "running" {
        let signal = tokio::time::timeout(WAIT, finished.next()).await.expect("Finished in time").expect("a signal");
        let args = signal.args().expect("args");
        (args.success, args.error.clone())
    } else {
        (state == "succeeded", job.error().await.expect("Error"))
    };
    assert_eq!(job.state().await.expect("State"), if success { "succeeded" } else { "failed" });
    assert_eq!(job.error().await.expect("Error"), error);
    (success, error)
}

async fn model_paths(objects: &ObjectManagerProxy<'_>) -> Vec<String> {
    let managed = objects.get_managed_objects().await.expect("GetManagedObjects");
    let mut paths: Vec<String> = managed
        .into_iter()
        .filter(|(_, ifaces)| ifaces.keys().any(|i| i.as_str() == "org.corral.Corral1.Model"))
        .map(|(path, _)| path.to_string())
        .collect();
    paths.sort();
    paths
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_copy_and_delete_run_as_jobs_and_model_objects_follow() {
    let daemon = BusDaemon::start("");
    let connection = daemon.connect().await;
    let manager = ManagerProxy::new(&connection).await.expect("manager");
    let objects = ObjectManagerProxy::builder(&connection)
        .destination("org.corral.Corral1")
        .expect("destination")
        .path("/org/corral/Corral1")
        .expect("path")
        .build()
        .await
        .expect("object manager");
    let mut added = objects.receive_interfaces_added().await.expect("subscribe");
    let mut removed = objects.receive_interfaces_removed().await.expect("subscribe");
    let mut job_finished = manager.receive_job_finished().await.expect("subscribe");
    assert_eq!(
        model_paths(&objects).await,
        ["/org/corral/Corral1/models/chat_3alatest", "/org/corral/Corral1/models/embed_3alatest"]
    );

    // Create from a Modelfile naming a GGUF file by its absolute path.
    let gguf = daemon.path().join("tiny.gguf");
    let modelfile = format!("FROM {}\nSYSTEM You are terse.\nPARAMETER temperature 0.1\n", gguf.display());
    let job = manager.create("me/terse:v1", &modelfile).await.expect("Create");
    assert_eq!(finish(&connection, &job).await, (true, String::new()));
    let signal = tokio::time::timeout(WAIT, job_finished.next()).await.expect("in time").expect("JobFinished");
    assert_eq!(signal.args().expect("args").job, job);
    let new_path = "/org/corral/Corral1/models/me_2fterse_3av1";
    // Jobs appear under the object manager too; the model follows.
    loop {
        let signal = tokio::time::timeout(WAIT, added.next()).await.expect("in time").expect("InterfacesAdded");
        let args = signal.args().expect("args");
        if args.object_path.as_str() == new_path {
            assert!(args.interfaces_and_properties.contains_key("org.corral.Corral1.Model"));
            break;
        }
    }
    let listed = manager.list_models().await.expect("ListModels");
    assert!(listed.iter().any(|(name, path, ..)| name == "me/terse:v1" && path.as_str() == new_path), "{listed:?}");
    let job_proxy = JobProxy::builder(&connection)
        .path(&job)
        .expect("path")
        .cache_properties(zbus::proxy::CacheProperties::No)
        .build()
        .await
        .expect("job");
    assert_eq!(job_proxy.kind().await.expect("Kind"), "create");
    assert_eq!(job_proxy.model().await.expect("Model"), "me/terse:v1");
    assert_eq!(job_proxy.status().await.expect("Status"), "success");
    let err = job_proxy.cancel().await.expect_err("finished");
    assert!(err.to_string().contains("Error.Failed: the job has already ended (succeeded)"), "{err}");

    // Copy, then delete the copy.
    let job = manager.copy("me/terse:v1", "terse2").await.expect("Copy");
    assert_eq!(finish(&connection, &job).await, (true, String::new()));
    assert!(manager.get_model("terse2").await.is_ok());
    let job = manager.delete("terse2").await.expect("Delete");
    assert_eq!(finish(&connection, &job).await, (true, String::new()));
    let err = manager.get_model("terse2").await.expect_err("deleted");
    assert!(err.to_string().contains("NoSuchModel"), "{err}");
    loop {
        let signal = tokio::time::timeout(WAIT, removed.next()).await.expect("in time").expect("InterfacesRemoved");
        if signal.args().expect("args").object_path.as_str() == "/org/corral/Corral1/models/terse2_3alatest" {
            break;
        }
    }

    // Failures end the job with an error and leave the store as it was.
    let before = manager.list_models().await.expect("ListModels");
    let missing = daemon.path().join("missing.gguf");
    let job = manager.create("broken", &format!("FROM {}\n", missing.display())).await.expect("Create");
    let (success, error) = finish(&connection, &job).await;
    assert!(!success && error.contains("missing.gguf"), "{error}");
    let job = manager.copy("nope", "nope2").await.expect("Copy");
    let (success, error) = finish(&connection, &job).await;
    assert!(!success && error.contains("model 'nope:latest' not found") || error.contains("nope"), "{error}");
    let job = manager.delete("nope").await.expect("Delete");
    assert!(!finish(&connection, &job).await.0);
    assert_eq!(manager.list_models().await.expect("ListModels"), before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_and_pull_through_a_registry_report_progress() {
    let registry = DockerRegistry::start();
    let daemon = BusDaemon::with_store(&format!("insecure_registries = [\"{}\"]", registry.host()), "");
    let connection = daemon.connect().await;
    let manager = ManagerProxy::new(&connection).await.expect("manager");
    let remote = format!("{}/corral/chat:v1", registry.host());
    let job = manager.copy("chat", &remote).await.expect("Copy");
    assert!(finish(&connection, &job).await.0);

    let job = manager.push(&remote, HashMap::new()).await.expect("Push");
    assert_eq!(finish(&connection, &job).await, (true, String::new()));
    let job = manager.delete(&remote).await.expect("Delete");
    assert!(finish(&connection, &job).await.0);

    // Pull it back, watching the progress properties change.
    let job = manager.pull(&remote, HashMap::new()).await.expect("Pull");
    let proxy = JobProxy::builder(&connection).path(&job).expect("path").build().await.expect("job");
    let mut statuses = proxy.receive_status_changed().await;
    assert_eq!(finish(&connection, &job).await, (true, String::new()));
    assert_eq!(proxy.kind().await.expect("Kind"), "pull");
    assert_eq!(proxy.status().await.expect("Status"), "success");
    let first = tokio::time::timeout(WAIT, statuses.next()).await.expect("in time").expect("a change");
    assert!(!first.get().await.expect("value").is_empty());
    assert!(manager.get_model(&remote).await.is_ok());

    // A model the registry does not have: the job fails and says why.
    let job = manager.pull(&format!("{}/corral/nope:v1", registry.host()), HashMap::new()).await.expect("Pull");
    let (success, error) = finish(&connection, &job).await;
    assert!(!success && error.contains("nope"), "{error}");
}

/// Exit on idle counts a D-Bus job as work in flight: a socket-activated corrald with a
/// one-second idle limit stays up while a pull waits on its registry, and exits once
/// the job has ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_job_keeps_an_idle_daemon_up() {
    use crate::support::bus::PrivateBus;
    use crate::support::corrald::{Corrald, IDLE_CHECKS, free_port, write_config};
    use crate::support::dbus::{ensure_users, policy};
    use crate::support::notify::NotifyListener;
    use crate::support::registry::{Action, Gate, Proxy};

    ensure_users();
    let bus = PrivateBus::start(&policy());
    let registry = DockerRegistry::start();
    let proxy = Proxy::start(registry.addr());
    let gate = Gate::new();
    let held = gate.clone();
    proxy.rule(move |_| Action::Hold(held.clone()));

    let dir = tempfile::tempdir().expect("tempdir");
    let config = format!(
        "[server]\nexit_on_idle = \"1s\"\n[store]\npath = \"{}\"\ninsecure_registries = [\"{}\"]\n[dbus]\nbus = \"system\"\n",
        dir.path().join("models").display(),
        proxy.host()
    );
    let config = write_config(dir.path(), "corral.toml", &config);
    let notify = NotifyListener::start();
    let tcp = format!("127.0.0.1:{}", free_port());
    let corrald = Corrald::socket_activated(
        std::slice::from_ref(&tcp),
        &["--config", config.to_str().expect("utf-8")],
        notify.path(),
        &[("DBUS_SYSTEM_BUS_ADDRESS", bus.address()), ("RUST_LOG", IDLE_CHECKS)],
    );
    // The first connection starts it.
    let addr: std::net::SocketAddr = tcp.parse().expect("addr");
    let version = tokio::task::spawn_blocking(move || crate::support::http::tcp(addr, "GET", "/api/version"))
        .await
        .expect("request");
    assert_eq!(version.status, 200);
    notify.wait_for("READY", "1", WAIT);
    corrald.wait_stderr("serving D-Bus", WAIT);

    let connection = zbus::connection::Builder::address(bus.address()).expect("address").build().await.expect("bus");
    let manager = ManagerProxy::new(&connection).await.expect("manager");
    let job = manager.pull(&format!("{}/corral/held:v1", proxy.host()), HashMap::new()).await.expect("Pull");
    tokio::time::timeout(WAIT, gate.arrivals(1)).await.expect("the pull reached the registry");

    // Three idle checks (every 2 s) pass the 1 s limit while the job runs.
    let since = corrald.idle_checks();
    let corrald = tokio::task::spawn_blocking(move || {
        corrald.wait_idle_checks(since, 3, WAIT);
        corrald
    })
    .await
    .expect("wait for idle checks");
    assert!(!corrald.stderr().contains("corral_event=\"idle\""), "exited with a job running:\n{}", corrald.stderr());
    let (success, error) = {
        gate.open();
        finish(&connection, &job).await
    };
    assert!(!success && error.contains("held"), "the registry has no such model: {error}");
    drop(connection);
    let mut corrald = corrald;
    let status = tokio::task::spawn_blocking(move || {
        let status = corrald.wait_exit(WAIT);
        (status, corrald.stderr())
    })
    .await
    .expect("wait");
    assert!(status.0.success(), "a clean exit: {}\n{}", status.0, status.1);
    assert!(status.1.contains("corral_event=\"idle\""), "{}", status.1);
}

/// At most `[dbus] max_jobs` store jobs run at once: with two pulls held at the registry,
/// every kind of job is refused with Busy naming the key, before it starts and without
/// touching the store; once one job ends, the next is taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_past_max_jobs_are_refused_until_one_ends() {
    use crate::support::registry::{Action, Gate, Proxy};

    let registry = DockerRegistry::start();
    let proxy = Proxy::start(registry.addr());
    let gate = Gate::new();
    let held = gate.clone();
    proxy.rule(move |_| Action::Hold(held.clone()));
    let daemon = BusDaemon::with_store(&format!("insecure_registries = [\"{}\"]", proxy.host()), "max_jobs = 2\n");
    let connection = daemon.connect().await;
    let manager = ManagerProxy::new(&connection).await.expect("manager");
    let before = manager.list_models().await.expect("ListModels");

    let first = manager.pull(&format!("{}/corral/one:v1", proxy.host()), HashMap::new()).await.expect("Pull");
    let second = manager.pull(&format!("{}/corral/two:v1", proxy.host()), HashMap::new()).await.expect("Pull");
    tokio::time::timeout(WAIT, gate.arrivals(2)).await.expect("both pulls reached the registry");

    let gguf = daemon.path().join("tiny.gguf");
    let refusals = [
        manager.pull(&format!("{}/corral/three:v1", proxy.host()), HashMap::new()).await,
        manager.push("chat", HashMap::new()).await,
        manager.create("made", &format!("FROM {}\n", gguf.display())).await,
        manager.copy("chat", "chat2").await,
        manager.delete("chat").await,
    ];
    for refused in refusals {
        let err = refused.expect_err("past max_jobs").to_string();
        assert!(err.contains("org.corral.Corral1.Error.Busy") && err.contains("[dbus] max_jobs"), "{err}");
        assert!(err.contains("2 store jobs are already running"), "{err}");
    }
    assert_eq!(proxy.seen().len(), 2, "a refused pull never reached the registry");
    assert_eq!(manager.list_models().await.expect("ListModels"), before, "refused jobs changed nothing");

    // One ends (cancelled): the next job is taken and runs to its end.
    let job = JobProxy::builder(&connection).path(&first).expect("path").build().await.expect("job");
    let mut finished = job.receive_finished().await.expect("subscribe");
    job.cancel().await.expect("Cancel");
    tokio::time::timeout(WAIT, finished.next()).await.expect("Finished in time").expect("a signal");
    let copy = manager.copy("chat", "chat2").await.expect("Copy once a job ended");
    assert_eq!(finish(&connection, &copy).await, (true, String::new()));
    assert!(manager.get_model("chat2").await.is_ok());

    gate.open();
    let (success, error) = finish(&connection, &second).await;
    assert!(!success && error.contains("two"), "the registry has no such model: {error}");
}

/// The Status, Total and Completed of every change of `job`'s properties seen on `changes`,
/// up to its `success` or failure.
async fn job_steps(signals: &mut zbus::MessageStream, job: &OwnedObjectPath) -> Vec<(String, u64, u64)> {
    let mut steps = Vec::new();
    loop {
        let message =
            tokio::time::timeout(WAIT, signals.next()).await.expect("in time").expect("a signal").expect("ok");
        if message.header().path().map(zbus::zvariant::ObjectPath::as_str) != Some(job.as_str()) {
            continue;
        }
        let (_, changed, _): (String, HashMap<String, zbus::zvariant::OwnedValue>, Vec<String>) =
            message.body().deserialize().expect("PropertiesChanged");
        let text = |key: &str| changed.get(key).and_then(|v| String::try_from(v.clone()).ok());
        let number = |key: &str| changed.get(key).and_then(|v| u64::try_from(v).ok()).unwrap_or(0);
        if let Some(status) = text("Status") {
            steps.push((status, number("Total"), number("Completed")));
        }
        if matches!(text("State").as_deref(), Some("succeeded" | "failed")) {
            return steps;
        }
    }
}

/// `CreateWithFiles` reads the Modelfile's files from descriptors the caller passes: a file
/// with no path left anywhere makes the same model its path makes, the job showing the copy
/// in bytes; every descriptor that is not a regular file open for reading, and every key no
/// line names, is refused before a job starts, naming it; a file that is no GGUF fails its
/// job. None of it changes the store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_with_files_reads_the_descriptors_passed_and_refuses_what_cannot_be_read() {
    use zbus::zvariant::Fd;

    let daemon = BusDaemon::start("");
    let connection = daemon.connect().await;
    let manager = ManagerProxy::new(&connection).await.expect("manager");
    let rule = zbus::MatchRule::builder()
        .msg_type(zbus::message::Type::Signal)
        .interface("org.freedesktop.DBus.Properties")
        .expect("interface")
        .member("PropertiesChanged")
        .expect("member")
        .build();
    let mut changes = zbus::MessageStream::for_match_rule(rule, &connection, None).await.expect("subscribe");

    let work = tempfile::tempdir().expect("tempdir");
    let gguf = work.path().join("tiny.gguf");
    // Not the weights the store holds already: a blob new to it.
    let extra = vec![("corral.test".to_owned(), corral::gguf::GgufValue::U32(15))];
    std::fs::write(&gguf, corral::demo_model::tiny_llama_bytes_with(extra).expect("a GGUF")).expect("write");
    let size = std::fs::metadata(&gguf).expect("size").len();
    let modelfile = |from: &str| format!("FROM {from}\nSYSTEM You are terse.\n");
    let file = std::fs::File::open(&gguf).expect("open");
    // Moved away: corrald can only read it through the descriptor.
    let moved = work.path().join("moved.gguf");
    std::fs::rename(&gguf, &moved).expect("move");
    let key = "/home/someone/tiny.gguf";
    let job = manager
        .create_with_files("by-fd", &modelfile(key), HashMap::from([(key, Fd::from(&file))]))
        .await
        .expect("CreateWithFiles");
    let steps = job_steps(&mut changes, &job).await;
    assert_eq!(finish(&connection, &job).await, (true, String::new()));
    assert!(steps.contains(&("copying tiny.gguf".to_owned(), size, size)), "{steps:?}");
    assert_eq!(steps.last().map(|s| s.0.as_str()), Some("success"), "{steps:?}");
    std::fs::rename(&moved, &gguf).expect("move back");
    let job = manager.create("by-path", &modelfile(&gguf.display().to_string())).await.expect("Create");
    assert_eq!(finish(&connection, &job).await, (true, String::new()));
    let listed = manager.list_models().await.expect("ListModels");
    let digest = |name: &str| listed.iter().find(|m| m.0 == name).map(|m| m.2.clone()).expect(name);
    assert_eq!(digest("by-fd:latest"), digest("by-path:latest"), "the same model as from the path");

    // What cannot be read as a file is refused before any job, naming the key.
    let (socket, _peer) = std::os::unix::net::UnixStream::pair().expect("socket pair");
    let fifo = work.path().join("fifo");
    rustix::fs::mknodat(rustix::fs::CWD, &fifo, rustix::fs::FileType::Fifo, rustix::fs::Mode::from(0o600), 0)
        .expect("mkfifo");
    let pipe = rustix::fs::open(&fifo, rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::NONBLOCK, 0.into())
        .expect("open the FIFO");
    let dir = std::fs::File::open(work.path()).expect("dir");
    let zero = std::fs::File::open("/dev/zero").expect("/dev/zero");
    std::fs::write(work.path().join("garbage.gguf"), b"this is not a GGUF file").expect("write");
    let write_only =
        std::fs::OpenOptions::new().write(true).open(work.path().join("garbage.gguf")).expect("write-only");
    let path_only =
        rustix::fs::open(work.path().join("garbage.gguf"), rustix::fs::OFlags::PATH, 0.into()).expect("O_PATH");
    let before = manager.list_models().await.expect("ListModels");
    let refused: Vec<(Fd<'_>, &str)> = vec![
        (Fd::from(&socket), "a socket, not a regular file"),
        (Fd::from(&pipe), "a pipe, not a regular file"),
        (Fd::from(&dir), "a directory, not a regular file"),
        (Fd::from(&zero), "a character device, not a regular file"),
        (Fd::from(&write_only), "open for writing only"),
        (Fd::from(&path_only), "opened with O_PATH"),
    ];
    for (fd, why) in refused {
        let err = manager
            .create_with_files("bad", &modelfile(key), HashMap::from([(key, fd)]))
            .await
            .expect_err(why)
            .to_string();
        assert!(
            err.contains("Error.InvalidArgument") && err.contains("tiny.gguf: ") && err.contains(why),
            "{why}: {err}"
        );
    }
    let err = manager
        .create_with_files("bad", &modelfile(key), HashMap::from([("/other.gguf", Fd::from(&file))]))
        .await
        .expect_err("a key no line names")
        .to_string();
    assert!(
        err.contains("Error.InvalidArgument") && err.contains("other.gguf: passed for no FROM or ADAPTER line"),
        "{err}"
    );

    // A file that is no GGUF is read, found wrong, and fails its job.
    let garbage = std::fs::File::open(work.path().join("garbage.gguf")).expect("open");
    let job = manager
        .create_with_files(
            "bad",
            &modelfile("/c/garbage.gguf"),
            HashMap::from([("/c/garbage.gguf", Fd::from(&garbage))]),
        )
        .await
        .expect("CreateWithFiles");
    let (success, error) = finish(&connection, &job).await;
    assert!(!success && error.contains("garbage.gguf is not a usable GGUF file"), "{error}");
    assert_eq!(manager.list_models().await.expect("ListModels"), before, "refusals changed the store");
}
