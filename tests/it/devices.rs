//! Devices are a list: two real `rpc-server`s configured as `[[workers]]` are devices
//! beside the host, in D-Bus `Devices`, `/metrics` and `corralctl status`, with the
//! capacity `memory` gives them; a worker nobody listens for is logged as down and left
//! out while corrald starts.  A load shows where its memory is in every view.

use std::net::SocketAddr;

use corral::dbus::proxy::{ManagerProxy, ModelProxy};
use zbus::proxy::CacheProperties;

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
    assert!(down[0].contains("corral_worker=\"gone\"") && down[0].contains("Failed to connect"), "{log}");

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
    assert!(!metrics.contains(&format!("127.0.0.1:{gone}")), "the down worker is left out: {metrics}");

    // corralctl status lists the devices.
    let status = ctl(&daemon, &["status"]);
    assert!(status.contains(&format!("one (rpc:127.0.0.1:{one}#0):")), "{status}");
    assert!(status.contains("0 B used, 200.0 MiB usable of 200.0 MiB"), "{status}");
    assert!(status.contains("host memory:"), "{status}");
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
