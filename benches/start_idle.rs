//! Start and idle: corrald's exec → `READY=1` and its resident memory when idle.
//!
//! - **start**: corrald on a store holding the tiny llama, started `CORRAL_BENCH_STARTS`
//!   times (default 20) with a notify socket of the benchmark's own (as systemd starts it),
//!   timed from just before `exec` to the `READY=1` datagram; with the shipped defaults
//!   (`[dbus] bus = "system"`, which this machine may not have: corrald then serves HTTP
//!   only) and with `[dbus] bus = "off"`. The floor is `systemd-notify --ready` started the
//!   same way (`--no-block`): a process that only execs and sends `READY=1`.
//! - **idle memory**: `VmRSS` at `READY=1` over the starts, the binary as the page cache
//!   holds it and, over as many more starts, read from disk each time (its pages dropped
//!   from the cache first, as after a boot); then `VmRSS` (and its anonymous part) at
//!   `READY=1`, one second later, after a model was loaded and unloaded (`keep_alive: 0`,
//!   then `/api/ps` empty), and after `CORRAL_BENCH_CYCLES` (default 10) more loads and
//!   unloads.
//!
//! - where the memory is: resident and anonymous KiB by mapping (`/proc/PID/smaps`) at
//!   `READY=1` and after the first load and unload.
//!
//! Targets: exec → READY ≤ 5 ms; idle RSS ≤ 8 MiB at READY and < 10 MiB after a load and
//! unload. Run with `cargo bench --bench start_idle`.

#![allow(clippy::print_stdout, reason = "a benchmark reports on stdout")]

mod common;

use std::os::unix::net::UnixDatagram;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{Client, Corrald, Memory, env_or, free_port, median, memory, ms, percentile, write_config};
use hyper::body::Bytes;

/// Drops `path`'s pages from the page cache (written to disk first), so that the next
/// `exec` reads it from disk.
fn drop_from_page_cache(path: &std::path::Path) {
    let file = std::fs::File::open(path).expect("open corrald's binary");
    file.sync_all().expect("sync corrald's binary");
    rustix::fs::fadvise(&file, 0, None, rustix::fs::Advice::DontNeed)
        .expect("drop corrald's binary from the page cache");
}

/// exec → READY=1 of `systemd-notify --ready`.
fn floor(dir: &std::path::Path) -> Duration {
    let path = dir.join("floor.sock");
    let _ = std::fs::remove_file(&path);
    let socket = UnixDatagram::bind(&path).expect("bind");
    socket.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    let start = Instant::now();
    // --no-block: it sends READY=1 and exits, without waiting for a barrier reply.
    let mut child = Command::new("systemd-notify")
        .args(["--ready", "--no-block"])
        .env("NOTIFY_SOCKET", &path)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .expect("run systemd-notify");
    let mut buf = [0u8; 256];
    let n = socket.recv(&mut buf).expect("READY=1 from systemd-notify");
    let elapsed = start.elapsed();
    assert!(buf[..n].starts_with(b"READY=1"), "{:?}", String::from_utf8_lossy(&buf[..n]));
    let _ = child.wait();
    elapsed
}

fn row(name: &str, m: Memory) {
    println!(
        "| {name} | {:.2} MiB | {:.2} MiB | {:.2} MiB | {} |",
        m.rss_mib(),
        common::kib_to_mib(m.anon),
        common::kib_to_mib(m.hwm),
        m.threads
    );
}

/// Where `pid`'s resident memory is: KiB resident and KiB anonymous per mapped file (or
/// `[heap]`, `[stack]`, `anonymous`), the largest first, from `/proc/PID/smaps`.
fn mappings(pid: u32) -> Vec<(String, u64, u64)> {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).expect("smaps");
    let mut by_name: std::collections::BTreeMap<String, (u64, u64)> = std::collections::BTreeMap::new();
    let mut current = String::new();
    for line in smaps.lines() {
        let mut fields = line.split_whitespace();
        let first = fields.next().unwrap_or_default();
        if first.contains('-') && !first.ends_with(':') {
            current = fields.nth(4).map_or_else(|| "anonymous".to_owned(), str::to_owned);
            continue;
        }
        let kib = fields.next().and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
        let entry = by_name.entry(current.clone()).or_default();
        match first {
            "Rss:" => entry.0 += kib,
            "Anonymous:" => entry.1 += kib,
            _ => {}
        }
    }
    let mut by_name: Vec<(String, u64, u64)> =
        by_name.into_iter().map(|(name, (rss, anon))| (name, rss, anon)).collect();
    by_name.sort_by_key(|entry| std::cmp::Reverse(entry.1));
    by_name
}

/// The eight largest of `mappings`, by file name.
fn describe(mappings: Vec<(String, u64, u64)>) -> String {
    let top: Vec<String> = mappings
        .into_iter()
        .take(8)
        .map(|(name, rss, anon)| format!("{} {rss} ({anon} anonymous)", name.rsplit('/').next().unwrap_or_default()))
        .collect();
    top.join(", ")
}

/// Loads `tiny` (one token) and unloads it; returns once `/api/ps` is empty.
async fn load_and_unload(port: u16) {
    let mut client = Client::connect(port).await;
    let load = Bytes::from_static(br#"{"model":"tiny","prompt":"hi","stream":false,"options":{"num_predict":1}}"#);
    drop(client.post("/api/generate", &load).await);
    let unload = Bytes::from_static(br#"{"model":"tiny","keep_alive":0}"#);
    drop(client.post("/api/generate", &unload).await);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let ps = client.get_body("/api/ps").await.expect("/api/ps");
        if serde_json::from_slice::<serde_json::Value>(&ps).expect("json")["models"]
            .as_array()
            .is_some_and(Vec::is_empty)
        {
            return;
        }
        assert!(Instant::now() < deadline, "the model was not unloaded");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn main() {
    let starts: usize = env_or("CORRAL_BENCH_STARTS", 20);
    let cycles: usize = env_or("CORRAL_BENCH_CYCLES", 10);
    let llama_server = common::llama_bin_dir().join("llama-server");
    let dir = tempfile::tempdir().expect("tempdir");
    common::tiny_store(dir.path(), "tiny");
    let port = free_port();
    let defaults = write_config(dir.path(), port, &llama_server, "");
    let off = dir.path().join("off.toml");
    std::fs::write(&off, std::fs::read_to_string(&defaults).expect("config") + "[dbus]\nbus = \"off\"\n")
        .expect("config");

    floor(dir.path());
    let mut floors = Vec::with_capacity(starts);
    let mut with_defaults = Vec::with_capacity(starts);
    let mut bus_off = Vec::with_capacity(starts);
    let mut at_ready = Vec::with_capacity(starts);
    for _ in 0..starts {
        floors.push(ms(floor(dir.path())));
        for (config, samples, shipped) in [(&defaults, &mut with_defaults, true), (&off, &mut bus_off, false)] {
            let daemon = Corrald::start(dir.path(), config, &[]);
            samples.push(ms(daemon.ready_after));
            if shipped {
                at_ready.push(memory(daemon.pid()));
            }
            daemon.stop();
        }
    }
    println!("start and idle: corrald on a store with the tiny llama, {starts} starts each, alternating");
    println!();
    println!("| exec -> READY=1 | median | p90 | min | corral - floor (median) | target |");
    println!("| --- | --- | --- | --- | --- | --- |");
    let min = |v: &[f64]| v.iter().copied().fold(f64::INFINITY, f64::min);
    println!(
        "| floor: systemd-notify --ready | {:.3} ms | {:.3} ms | {:.3} ms | | |",
        median(&floors),
        percentile(&floors, 90.0),
        min(&floors)
    );
    for (name, samples) in [("corrald, shipped defaults", &with_defaults), ("corrald, [dbus] bus = \"off\"", &bus_off)]
    {
        println!(
            "| {name} | {:.3} ms | {:.3} ms | {:.3} ms | {:+.3} ms | <= 5 ms |",
            median(samples),
            percentile(samples, 90.0),
            min(samples),
            median(samples) - median(&floors)
        );
    }

    // The same, each start with corrald's binary read from disk, as after a boot: its pages
    // dropped from the page cache first. Which pages a start maps depends on how the file
    // got into the cache (a file just written, by a linker or a package manager, is cached
    // in larger pieces than one read from disk, and every page of a piece the start
    // touches is mapped), so both are reported.
    let mut from_disk = Vec::with_capacity(starts);
    for _ in 0..starts {
        drop_from_page_cache(&common::corrald_binary());
        let daemon = Corrald::start(dir.path(), &defaults, &[]);
        from_disk.push(memory(daemon.pid()));
        daemon.stop();
    }

    // Memory over one daemon's life.
    let daemon = Corrald::start(dir.path(), &defaults, &[]);
    let pid = daemon.pid();
    let ready = memory(pid);
    let ready_mappings = mappings(pid);
    std::thread::sleep(Duration::from_secs(1));
    let settled = memory(pid);
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    runtime.block_on(load_and_unload(port));
    std::thread::sleep(Duration::from_secs(1));
    let once = memory(pid);
    let once_mappings = mappings(pid);
    for _ in 0..cycles {
        runtime.block_on(load_and_unload(port));
    }
    std::thread::sleep(Duration::from_secs(1));
    let many = memory(pid);
    daemon.stop();

    println!();
    for (how, samples) in [("binary as cached", &at_ready), ("binary read from disk", &from_disk)] {
        let rss: Vec<f64> = samples.iter().map(Memory::rss_mib).collect();
        println!(
            "VmRSS at READY=1 over the {starts} starts, {how}: median {:.2} MiB, max {:.2} MiB (target <= 8 MiB)",
            median(&rss),
            rss.iter().copied().fold(0.0, f64::max)
        );
    }
    println!();
    println!("| corrald (shipped defaults) | VmRSS | RssAnon | VmHWM | threads |");
    println!("| --- | --- | --- | --- | --- |");
    row("at READY=1", ready);
    row("idle 1 s after READY", settled);
    row("after a load and unload, 1 s idle", once);
    row(&format!("after {} loads and unloads, 1 s idle", cycles + 1), many);
    println!("targets: <= 8 MiB at READY, < 10 MiB after a load and unload");
    println!();
    println!("resident at READY=1, KiB: {}", describe(ready_mappings));
    println!("resident after a load and unload, KiB: {}", describe(once_mappings));
}
