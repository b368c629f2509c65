//! Many models: how corrald's listings and its start grow with the number of stored
//! models (10, 100, 1 000 by default; `CORRAL_BENCH_MODELS=10,100,1000`).
//!
//! The store holds the tiny llama once (one GGUF blob, one config, one template) and one
//! manifest per model naming them (`mNNNN:latest`, each in its own directory, as `ollama
//! pull` lays them out), written straight into `manifests/`. For each size, corrald starts
//! on a private session bus (`dbus-daemon --session`, `[dbus] bus = "session"`) and the
//! benchmark measures, against the floor of the same kind of call that does no work:
//!
//! - exec → `READY=1` (median of `CORRAL_BENCH_STARTS`, default 7, starts), with D-Bus and
//!   with `[dbus] bus = "off"`; the floor is the empty store; and with D-Bus, `READY=1` →
//!   the bus name taken (corrald serves every model's object first, after `READY=1`);
//! - `GET /api/tags` (the first after start, the median of `CORRAL_BENCH_ROUNDS`, default
//!   30, then of `CORRAL_BENCH_PAUSED`, default 5, each after 1.2 s of quiet, against
//!   `GET /api/version` after as long), `GET /api/ps`
//!   (one model loaded), `POST /api/show` of one model; floor: `GET /api/version`;
//! - D-Bus `Manager.ListModels`, `ObjectManager.GetManagedObjects` (every model object with
//!   the properties `GetAll` gives, its explicit ones left out: the object tree) and
//!   `Introspect` of the models' node (the child list a tree walker reads first); floor:
//!   `Peer.Ping` to corrald, and for the object tree, whose reply is most of a megabyte at
//!   1 000 models, a reply of as many bytes (one string) from another connection on the
//!   same bus.
//!
//! `CORRAL_BENCH_BUS_ADDRESS` (with `CORRAL_BENCH_BUS_PID`) measures through a bus started
//! elsewhere instead, such as dbus-broker.
//!
//! Targets: a listing of 1 000 models within 5 ms; start growing by at most 1 ms per 100
//! models. Run with `cargo bench --bench many_models`.

#![allow(clippy::print_stdout, reason = "a benchmark reports on stdout")]

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::{Client, Corrald, Process, cpu_ms, env_or, free_port, median, ms, percentile, write_config};
use hyper::body::Bytes;

const BUS_NAME: &str = "org.corral.Corral1";
const ROOT: &str = "/org/corral/Corral1";
const MODELS: &str = "/org/corral/Corral1/models";

/// Replies with a string as long as the object tree's reply: the floor of moving that many
/// bytes over the bus.
struct Floor(String);

#[zbus::interface(name = "org.corral.BenchFloor")]
impl Floor {
    fn reply(&self) -> String {
        self.0.clone()
    }
}

/// A private session bus, killed on drop; or (`CORRAL_BENCH_BUS_ADDRESS`) one started
/// elsewhere, such as dbus-broker, whose CPU time is read from `CORRAL_BENCH_BUS_PID`.
struct Bus {
    /// Held to kill it on drop.
    _process: Option<Process>,
    pid: u32,
    address: String,
}

impl Bus {
    fn start(dir: &Path) -> Self {
        if let Ok(address) = std::env::var("CORRAL_BENCH_BUS_ADDRESS") {
            let pid = env_or("CORRAL_BENCH_BUS_PID", 0);
            assert!(pid > 0, "CORRAL_BENCH_BUS_ADDRESS needs CORRAL_BENCH_BUS_PID, the bus's process");
            return Self { _process: None, pid, address };
        }
        let (process, address) = common::session_bus(dir);
        Self { pid: process.pid(), _process: Some(process), address }
    }
}

/// Adds models `from..to` to the store at `root`: manifests naming the blobs of `template`.
fn add_models(root: &Path, template: &[u8], from: usize, to: usize) {
    for i in from..to {
        let dir = root.join(format!("manifests/registry.ollama.ai/library/m{i:04}"));
        std::fs::create_dir_all(&dir).expect("model directory");
        std::fs::write(dir.join("latest"), template).expect("manifest");
    }
}

/// Times `$call` (an expression that awaits) `$rounds` times after one untimed run; the
/// samples in ms.
/// What one size's calls measured: single times in ms, samples of ms, the object tree's
/// reply size and the CPU ms each end spent per reply (corrald, the bus daemon).
struct Calls {
    first_tags: f64,
    tags: Vec<f64>,
    paused_tags: Vec<f64>,
    paused_floor: Vec<f64>,
    ps: Vec<f64>,
    show: Vec<f64>,
    list: Vec<f64>,
    first_tree: f64,
    tree: Vec<f64>,
    tree_bytes: usize,
    floor_tree: Vec<f64>,
    tree_cpu: (f64, f64),
    introspect: Vec<f64>,
    floor_http: Vec<f64>,
    floor_bus: Vec<f64>,
}

macro_rules! time {
    ($rounds:expr, $call:expr) => {{
        $call;
        let mut samples = Vec::with_capacity($rounds);
        for _ in 0..$rounds {
            let start = Instant::now();
            $call;
            samples.push(ms(start.elapsed()));
        }
        samples
    }};
}

/// One row: median (p99) of `samples`.
fn cell(samples: &[f64]) -> String {
    format!("{:.3} ({:.3})", median(samples), percentile(samples, 99.0))
}

/// How long, from now, until the bus at `address` shows corrald's name.
async fn name_taken(address: &str) -> Duration {
    let start = Instant::now();
    let connection =
        zbus::connection::Builder::address(address).expect("address").build().await.expect("connect to the bus");
    let dbus = zbus::fdo::DBusProxy::new(&connection).await.expect("bus proxy");
    while !dbus.name_has_owner(BUS_NAME.try_into().expect("name")).await.expect("NameHasOwner") {
        assert!(start.elapsed() < Duration::from_secs(60), "corrald never took its bus name");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    start.elapsed()
}

#[allow(clippy::too_many_lines, reason = "one linear script of a benchmark")]
fn main() {
    let sizes: Vec<usize> = std::env::var("CORRAL_BENCH_MODELS")
        .unwrap_or_else(|_| "10,100,1000".to_owned())
        .split(',')
        .map(|n| n.trim().parse().expect("a number of models"))
        .collect();
    let rounds: usize = env_or("CORRAL_BENCH_ROUNDS", 30);
    let starts: usize = env_or("CORRAL_BENCH_STARTS", 7);
    let paused: usize = env_or("CORRAL_BENCH_PAUSED", 5);
    let llama_server = common::llama_bin_dir().join("llama-server");
    let dir = tempfile::tempdir().expect("tempdir");
    let root = dir.path().join("models");
    // The first model through the store (blobs, config, template), the rest as copies of its manifest.
    common::tiny_store(dir.path(), "m0000");
    let template = std::fs::read(root.join("manifests/registry.ollama.ai/library/m0000/latest")).expect("manifest");
    let bus = Bus::start(dir.path());
    let port = free_port();
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");

    // exec → READY=1 of each start; with the bus, also READY=1 → the bus name taken (the
    // model objects are served first, after READY=1), from a connection made after READY=1.
    let start_ms = |config: &Path, bus_name: bool| {
        let (mut ready, mut named) = (Vec::with_capacity(starts), Vec::with_capacity(starts));
        for _ in 0..starts {
            let daemon = Corrald::start(dir.path(), config, &[("DBUS_SESSION_BUS_ADDRESS", &bus.address)]);
            ready.push(ms(daemon.ready_after));
            if bus_name {
                named.push(ms(runtime.block_on(name_taken(&bus.address))));
            }
            daemon.stop();
        }
        (ready, named)
    };
    let with_bus = write_config(dir.path(), port, &llama_server, "[dbus]\nbus = \"session\"\n");
    let config_off = dir.path().join("off.toml");
    std::fs::write(
        &config_off,
        std::fs::read_to_string(&with_bus).expect("config").replace("bus = \"session\"", "bus = \"off\""),
    )
    .expect("config");

    // The floor of start: the empty store (the first model's manifest moved aside).
    let first_manifest = root.join("manifests/registry.ollama.ai/library/m0000/latest");
    let aside = dir.path().join("m0000.latest");
    std::fs::rename(&first_manifest, &aside).expect("move aside");
    let (empty_bus, _) = start_ms(&with_bus, false);
    let (empty_off, _) = start_ms(&config_off, false);
    std::fs::rename(&aside, &first_manifest).expect("move back");

    println!("many models: the tiny llama under N names, {rounds} rounds a call, {starts} starts a size");
    println!("times in ms: median (p99); floors: empty store for start, /api/version for HTTP, Peer.Ping for D-Bus");
    println!();
    println!(
        "| models | start, D-Bus | start, no bus | bus name after READY | first /api/tags | /api/tags | /api/tags after 1.2 s | floor: /api/version after 1.2 s | /api/ps | /api/show | \
         ListModels | GetManagedObjects (first) | GetManagedObjects | its bytes | CPU per reply: corrald, bus daemon | \
         floor: as many bytes | Introspect models | floor HTTP | floor D-Bus |"
    );
    println!(
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
    );
    println!("| 0 | {} | {} | | | | | | | | | | | | | | | | |", cell(&empty_bus), cell(&empty_off));
    let mut have = 1;
    let mut growth = Vec::new();
    for &size in &sizes {
        add_models(&root, &template, have, size);
        have = have.max(size);
        let (start_bus, named) = start_ms(&with_bus, true);
        let (start_off, _) = start_ms(&config_off, false);
        let daemon = Corrald::start(dir.path(), &with_bus, &[("DBUS_SESSION_BUS_ADDRESS", &bus.address)]);
        let row = runtime.block_on(async {
            let mut http = Client::connect(port).await;
            let first_start = Instant::now();
            let tags = http.get_body("/api/tags").await.expect("/api/tags");
            let first_tags = ms(first_start.elapsed());
            let listed = serde_json::from_slice::<serde_json::Value>(&tags).expect("json")["models"]
                .as_array()
                .map_or(0, Vec::len);
            assert_eq!(listed, size, "/api/tags lists every model");
            let floor_http = time!(rounds, assert!(http.get("/api/version").await));
            // The body is read, not decoded: the benchmark's own JSON parsing is not corrald's cost.
            let tags = time!(rounds, assert!(http.get("/api/tags").await));
            // After a pause longer than the second within which a store that is not watched
            // trusts its listing without looking at its tree.
            // Its floor: `/api/version` after the same quiet (waking a machine that idled).
            let (mut paused_tags, mut paused_floor) = (Vec::with_capacity(paused), Vec::with_capacity(paused));
            for _ in 0..paused {
                for (path, samples) in [("/api/tags", &mut paused_tags), ("/api/version", &mut paused_floor)] {
                    tokio::time::sleep(Duration::from_millis(1200)).await;
                    let start = Instant::now();
                    assert!(http.get(path).await);
                    samples.push(ms(start.elapsed()));
                }
            }
            // One model loaded, for /api/ps.
            let load =
                Bytes::from_static(br#"{"model":"m0000","prompt":"hi","stream":false,"options":{"num_predict":1}}"#);
            drop(http.post("/api/generate", &load).await);
            let mut http = Client::connect(port).await;
            let ps = time!(rounds, assert!(http.get("/api/ps").await));
            let show_body = Bytes::from(format!("{{\"model\":\"m{:04}\"}}", size / 2));
            let show = time!(rounds, {
                let response = http.post("/api/show", &show_body).await;
                drop(http_body_util::BodyExt::collect(response.into_body()).await.expect("body"));
            });

            // The name is taken once the model objects are served.
            name_taken(&bus.address).await;
            let connection = zbus::connection::Builder::address(bus.address.as_str())
                .expect("address")
                .build()
                .await
                .expect("connect to the bus");
            let call = |path: &'static str, interface: &'static str, method: &'static str| {
                let connection = connection.clone();
                async move {
                    connection
                        .call_method(Some(BUS_NAME), path, Some(interface), method, &())
                        .await
                        .unwrap_or_else(|e| panic!("{interface}.{method}: {e}"))
                }
            };
            let floor_bus = time!(rounds, drop(call(ROOT, "org.freedesktop.DBus.Peer", "Ping").await));
            // Each answer is checked once; the timed calls only wait for it (the benchmark's
            // own decoding is not corrald's cost).
            let reply = call(ROOT, "org.corral.Corral1.Manager", "ListModels").await;
            let models: Vec<(String, zbus::zvariant::OwnedObjectPath, String, u64, String)> =
                reply.body().deserialize().expect("ListModels' answer");
            assert_eq!(models.len(), size);
            let list = time!(rounds, drop(call(ROOT, "org.corral.Corral1.Manager", "ListModels").await));
            let tree_once = || async { call(ROOT, "org.freedesktop.DBus.ObjectManager", "GetManagedObjects").await };
            let first_tree_start = Instant::now();
            let reply = tree_once().await;
            let first_tree = ms(first_tree_start.elapsed());
            let objects: zbus::fdo::ManagedObjects = reply.body().deserialize().expect("objects");
            let models = objects
                .keys()
                .filter(|path| path.as_str().starts_with(concat!("/org/corral/Corral1/models", "/")))
                .count();
            assert_eq!(models, size, "an object per model");
            let tree_bytes = reply.data().len();
            // What each end spends on it: the bus daemon relays one message at a time, so its
            // CPU time per reply is a floor of the call's time (it checks every value it relays).
            let (corrald_before, bus_before) = (cpu_ms(daemon.pid()), cpu_ms(bus.pid));
            let tree = time!(rounds, drop(tree_once().await));
            #[allow(clippy::cast_precision_loss, reason = "a few rounds")]
            let calls = (rounds + 1) as f64;
            let tree_cpu = ((cpu_ms(daemon.pid()) - corrald_before) / calls, (cpu_ms(bus.pid) - bus_before) / calls);
            // The floor of so large a reply: as many bytes, as one string, from another
            // connection on the same bus (what the bus daemon and the two ends cost to move them).
            let floor_connection = zbus::connection::Builder::address(bus.address.as_str())
                .expect("address")
                .serve_at("/floor", Floor("x".repeat(tree_bytes)))
                .expect("serve")
                .build()
                .await
                .expect("connect to the bus");
            let floor_name = floor_connection.unique_name().expect("a unique name").to_owned();
            let floor_reply = || {
                connection.call_method(Some(floor_name.as_ref()), "/floor", Some("org.corral.BenchFloor"), "Reply", &())
            };
            let floor_tree = time!(rounds, drop(floor_reply().await.expect("the floor's reply")));
            let introspect_once = || call(MODELS, "org.freedesktop.DBus.Introspectable", "Introspect");
            let xml: String = introspect_once().await.body().deserialize().expect("xml");
            assert_eq!(xml.matches("<node name=").count(), size, "a node per model");
            let introspect = time!(rounds, drop(introspect_once().await));
            Calls {
                first_tags,
                tags,
                paused_tags,
                paused_floor,
                ps,
                show,
                list,
                first_tree,
                tree,
                tree_bytes,
                floor_tree,
                tree_cpu,
                introspect,
                floor_http,
                floor_bus,
            }
        });
        let (tree_corrald_cpu, tree_bus_cpu) = row.tree_cpu;
        println!(
            "| {size} | {} | {} | {} | {:.3} | {} | {} | {} | {} | {} | {} | {:.3} | {} | {} | \
             {tree_corrald_cpu:.1}, {tree_bus_cpu:.1} | {} | {} | {} | {} |",
            cell(&start_bus),
            cell(&start_off),
            cell(&named),
            row.first_tags,
            cell(&row.tags),
            cell(&row.paused_tags),
            cell(&row.paused_floor),
            cell(&row.ps),
            cell(&row.show),
            cell(&row.list),
            row.first_tree,
            cell(&row.tree),
            row.tree_bytes,
            cell(&row.floor_tree),
            cell(&row.introspect),
            cell(&row.floor_http),
            cell(&row.floor_bus),
        );
        growth.push((
            size,
            median(&start_bus),
            median(&start_off),
            median(&row.tags),
            median(&row.list),
            median(&row.tree),
            tree_bus_cpu,
        ));
        daemon.stop();
    }
    println!();
    let (empty_bus, empty_off) = (median(&empty_bus), median(&empty_off));
    for (size, bus, off, tags, list, tree, tree_bus_cpu) in growth {
        #[allow(clippy::cast_precision_loss, reason = "a few thousand models")]
        let hundreds = size as f64 / 100.0;
        println!(
            "{size} models: start +{:.3} ms per 100 models with D-Bus, +{:.3} without (target <= 1); \
             /api/tags {tags:.3} ms, ListModels {list:.3} ms (target <= 5 ms at 1 000); \
             GetManagedObjects {tree:.3} ms, of which the bus daemon's own CPU {tree_bus_cpu:.1} ms",
            (bus - empty_bus) / hundreds,
            (off - empty_off) / hundreds,
        );
    }
}
