//! Devices are a list: two real `rpc-server`s configured as `[[workers]]` are devices
//! beside the host, in D-Bus `Devices`, `/metrics` and `corralctl status`, with the
//! capacity `memory` gives them; a worker nobody listens for is logged as down and left
//! out while corrald starts.  A load shows where its memory is in every view.

use std::net::SocketAddr;
use std::time::Duration;

use corral::dbus::proxy::{ManagerProxy, ModelProxy};
use zbus::proxy::CacheProperties;

use crate::support::container::{poll_until, poll_until_async};
use crate::support::corrald::free_port;
use crate::support::dbus::BusDaemon;
use crate::support::http;
use crate::support::llama::RpcServer;

const CORRALCTL: &str = env!("CARGO_BIN_EXE_corralctl");
const MIB: u64 = 1024 * 1024;

type Row = (String, String, String, u64, u64, u64);

fn ctl(daemon: &BusDaemon, args: &[&str]) -> String {
    let mut command = vec![CORRALCTL];
    command.extend_from_slice(args);
    let out = daemon.bus.run_as(None, &command);
    assert!(out.status.success(), "corralctl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).expect("utf-8")
}

fn get(daemon: &BusDaemon, path: &str) -> http::Response {
    let response = http::tcp(SocketAddr::from(([127, 0, 0, 1], daemon.port)), "GET", path);
    assert_eq!(response.status, 200, "{path}: {}", response.body);
    response
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_are_devices_in_every_view_and_a_down_worker_is_left_out() {
    let (one, two, gone) = (free_port(), free_port(), free_port());
    let _one = RpcServer::start(one);
    let _two = RpcServer::start(two);
    let extra = format!(
        "[scheduler]\nnum_ctx = 512\n[gpu]\nfixed = true\nhost_memory = \"4GiB\"\nreserve = \"0\"\n\
         [[workers]]\naddress = \"127.0.0.1:{one}\"\nname = \"one\"\nmemory = \"200MiB\"\n\
         [[workers]]\naddress = \"127.0.0.1:{two}\"\nmemory = \"200MiB\"\n\
         [[workers]]\naddress = \"127.0.0.1:{gone}\"\nname = \"gone\"\n"
    );
    let daemon = tokio::task::spawn_blocking(move || BusDaemon::start(&extra)).await.expect("start");

    // The worker without a server: logged once, with the reason, and left out.
    let log = daemon.corrald.stderr();
    let down: Vec<&str> = log.lines().filter(|l| l.contains("corral_event=\"worker-down\"")).collect();
    assert_eq!(down.len(), 1, "{log}");
    assert!(down[0].contains("corral_worker=\"gone\"") && down[0].contains("cannot connect"), "{log}");

    // D-Bus: the two workers' devices in order, capped at 200 MiB, then the host.
    let connection = daemon.connect().await;
    let manager =
        ManagerProxy::builder(&connection).cache_properties(CacheProperties::No).build().await.expect("manager");
    let devices: Vec<Row> = manager.devices().await.expect("Devices");
    let row = |kind: &str, name: String, description: String, total: u64| {
        (kind.to_owned(), name, description, total, total, 0)
    };
    assert_eq!(
        devices,
        [
            row("rpc", format!("rpc:127.0.0.1:{one}#0"), "one".into(), 200 * MIB),
            row("rpc", format!("rpc:127.0.0.1:{two}#0"), format!("127.0.0.1:{two}"), 200 * MIB),
            row("host", "host".into(), "host memory".into(), 4096 * MIB),
        ]
    );
    // Gpus, kept for compatibility, lists the same devices without the host.
    let gpus = manager.gpus().await.expect("Gpus");
    assert_eq!(gpus.iter().map(|g| g.2.as_str()).collect::<Vec<_>>(), ["rpc", "rpc"], "{gpus:?}");

    // /metrics: three unique series per device.
    let metrics = get(&daemon, "/metrics").body;
    for (device, kind) in [(format!("rpc:127.0.0.1:{one}#0"), "rpc"), ("host".to_owned(), "host")] {
        let total = if kind == "host" { 4096 * MIB } else { 200 * MIB };
        for (state, value) in [("total", total), ("usable", total), ("used", 0)] {
            let line =
                format!("corral_device_memory_bytes{{device=\"{device}\",kind=\"{kind}\",state=\"{state}\"}} {value}");
            assert!(metrics.lines().any(|l| l == line), "missing {line:?} in\n{metrics}");
        }
    }
    let series: Vec<&str> = metrics.lines().filter(|l| l.starts_with("corral_device_memory_bytes{")).collect();
    assert_eq!(series.len(), 9, "{metrics}");
    assert!(!series.iter().any(|l| l.contains(&format!("127.0.0.1:{gone}"))), "the down worker is left out: {metrics}");
    // ... and shown down among the workers, the others up.
    assert_workers_shown(&manager, &metrics, [one, two, gone]).await;

    // corralctl status lists the devices.
    let status = ctl(&daemon, &["status"]);
    assert!(status.contains(&format!("one (rpc:127.0.0.1:{one}#0):")), "{status}");
    assert!(status.contains("0 B used, 200.0 MiB usable of 200.0 MiB"), "{status}");
    assert!(status.contains("host memory:"), "{status}");
    assert!(
        status.contains("Workers:") && status.contains(&format!("gone (127.0.0.1:{gone}): down: cannot connect")),
        "{status}"
    );
    let json: serde_json::Value = serde_json::from_str(&ctl(&daemon, &["--json", "status"])).expect("JSON");
    assert_eq!(json["devices"][1]["description"], format!("127.0.0.1:{two}"), "{json}");
    assert_eq!(json["devices"][2]["kind"], "host", "{json}");

    // A load: what each view says is where its memory is adds up to its size.
    let loaded = ctl(&daemon, &["load", "chat"]);
    assert!(loaded.contains("is ready"), "{loaded}");
    let path = manager.get_model("chat").await.expect("GetModel");
    let model = ModelProxy::builder(&connection)
        .path(path)
        .expect("path")
        .cache_properties(CacheProperties::No)
        .build()
        .await
        .expect("model");
    let shares = model.devices().await.expect("Model.Devices");
    let size: u64 = shares.iter().map(|s| s.2).sum();
    assert!(size > 0, "{shares:?}");
    let used: Vec<Row> = manager.devices().await.expect("Devices");
    assert_eq!(used.iter().map(|d| d.5).sum::<u64>(), size, "the only runner's use: {used:?} vs {shares:?}");
    for (name, kind, bytes) in &shares {
        let device = used.iter().find(|d| &d.1 == name).unwrap_or_else(|| panic!("{name} not in {used:?}"));
        assert_eq!((&device.0, device.5), (kind, *bytes), "{used:?}");
    }
    let ps = get(&daemon, "/api/ps").json();
    let entry = &ps["models"][0];
    let listed: Vec<(String, String, u64)> = entry["devices"]
        .as_array()
        .expect("devices")
        .iter()
        .map(|d| {
            let text = |k: &str| d[k].as_str().expect("string").to_owned();
            (text("name"), text("kind"), d["bytes"].as_u64().expect("bytes"))
        })
        .collect();
    assert_eq!(listed, shares, "{ps}");
    let on_devices: u64 = shares.iter().filter(|s| s.1 != "host").map(|s| s.2).sum();
    assert_eq!(entry["size_vram"], on_devices, "{ps}");
    let table = ctl(&daemon, &["ps"]);
    assert!(table.lines().next().is_some_and(|h| h.contains("PLACEMENT")), "{table}");
    assert!(table.lines().nth(1).is_some_and(|r| r.starts_with("chat:latest") && r.contains('%')), "{table}");
    assert!(table.lines().all(|l| l.chars().count() <= 80), "{table}");
}

/// `/metrics` and D-Bus `Workers` show workers `one` and (unnamed) `two` up, `gone` down.
async fn assert_workers_shown(manager: &ManagerProxy<'_>, metrics: &str, [one, two, gone]: [u16; 3]) {
    for (worker, address, up) in [("one", one, 1), ("gone", gone, 0)] {
        let line = format!("corral_worker_up{{worker=\"{worker}\",address=\"127.0.0.1:{address}\"}} {up}");
        assert!(metrics.lines().any(|l| l == line), "missing {line:?} in\n{metrics}");
    }
    let workers = manager.workers().await.expect("Workers");
    let rows: Vec<(&str, &str, usize)> = workers.iter().map(|w| (w.0.as_str(), w.2.as_str(), w.3.len())).collect();
    let unnamed = format!("127.0.0.1:{two}");
    assert_eq!(rows, [("one", "up", 1), (unnamed.as_str(), "up", 1), ("gone", "down", 0)], "{workers:?}");
    assert!(workers[2].4.contains("cannot connect") && workers[0].4.is_empty(), "{workers:?}");
}

/// The D-Bus `Workers` property as (name, state) pairs, and the rpc devices of `Devices`.
async fn fleet_now(manager: &ManagerProxy<'_>) -> (Vec<(String, String)>, Vec<String>) {
    let workers = manager.workers().await.expect("Workers").into_iter().map(|w| (w.0, w.2)).collect();
    let devices = manager.devices().await.expect("Devices").into_iter().filter(|d| d.0 == "rpc").map(|d| d.1).collect();
    (workers, devices)
}

/// Polls the fleet until `want` holds, for at most 30 s (checks run every second).
async fn wait_fleet(manager: &ManagerProxy<'_>, what: &str, want: impl Fn(&[(String, String)], &[String]) -> bool) {
    poll_until_async(Duration::from_secs(30), what, || async {
        let (workers, devices) = fleet_now(manager).await;
        if want(&workers, &devices) { Ok(()) } else { Err(format!("workers {workers:?}, devices {devices:?}")) }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_joins_when_it_comes_up_leaves_when_it_dies_and_comes_back() {
    let port = free_port();
    let extra = format!(
        "[scheduler]\nnum_ctx = 512\n[gpu]\nfixed = true\nhost_memory = \"4GiB\"\nreserve = \"0\"\n\
         [worker_health]\ninterval = \"1s\"\ntimeout = \"1s\"\n\
         [[workers]]\naddress = \"127.0.0.1:{port}\"\nname = \"late\"\nmemory = \"200MiB\"\n"
    );
    let daemon = tokio::task::spawn_blocking(move || BusDaemon::start(&extra)).await.expect("start");
    let connection = daemon.connect().await;
    let manager =
        ManagerProxy::builder(&connection).cache_properties(CacheProperties::No).build().await.expect("manager");
    let (workers, devices) = fleet_now(&manager).await;
    assert_eq!(workers, [("late".to_owned(), "down".to_owned())]);
    assert!(devices.is_empty(), "{devices:?}");

    // It comes up: checked within a second, its device joins, a load goes there.
    let mut server = RpcServer::start(port);
    wait_fleet(&manager, "the worker joins", |w, d| w[0].1 == "up" && d.len() == 1).await;
    let loaded = ctl(&daemon, &["load", "chat"]);
    assert!(loaded.contains("is ready"), "{loaded}");
    let on_worker = |ps: &serde_json::Value| {
        ps["models"][0]["devices"].as_array().is_some_and(|d| d.iter().any(|d| d["kind"] == "rpc"))
    };
    let ps = get(&daemon, "/api/ps").json();
    assert!(on_worker(&ps), "placed on the worker: {ps}");

    // It dies: the runner that used it is gone, the worker is down, its device left out.
    server.kill();
    wait_fleet(&manager, "the worker leaves", |w, d| w[0].1 == "down" && d.is_empty()).await;
    poll_until(Duration::from_secs(30), "the runner to be reaped", || {
        let ps = get(&daemon, "/api/ps").json();
        if ps["models"].as_array().is_some_and(Vec::is_empty) { Ok(()) } else { Err(ps.to_string()) }
    });
    let log = daemon.corrald.stderr();
    let events = |event: &str| log.lines().filter(|l| l.contains(&format!("corral_event=\"{event}\""))).count();
    assert_eq!((events("worker-up"), events("worker-down")), (1, 2), "down at start, up, down: {log}");

    // Back on the same port: used again, by itself.
    let _server = RpcServer::start(port);
    wait_fleet(&manager, "the worker is back", |w, d| w[0].1 == "up" && d.len() == 1).await;
    let loaded = ctl(&daemon, &["load", "chat"]);
    assert!(loaded.contains("is ready"), "{loaded}");
    assert!(on_worker(&get(&daemon, "/api/ps").json()), "on the worker again");
    let metrics = get(&daemon, "/metrics").body;
    assert!(metrics.contains("corral_worker_up{worker=\"late\",address=\"127.0.0.1:"), "{metrics}");
}
