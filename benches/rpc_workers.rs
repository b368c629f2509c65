//! A model split across two worker hosts against the same model on one local device.
//!
//! Each worker is an upstream `rpc-server` in a network namespace of its own, joined to the
//! head's namespace by a veth pair (`tests/it/support/netns.rs`); corrald and the real
//! llama-server run in the head's namespace, and the benchmark drives corrald over its HTTP
//! API on a UNIX socket (`/api/generate`), so the figures are what a client sees.  The local
//! device is one `rpc-server` on loopback in the head's namespace (a device with no network
//! between it and llama-server).
//!
//! The model is a synthetic llama of about 290 MiB whose feed-forward tensors (12 MiB each)
//! are above `rpc-server`'s tensor-cache threshold (10 MiB, `HASH_THRESHOLD` in
//! ggml-rpc.cpp): with `-c`, a load whose tensors the worker has cached sends their hashes
//! instead of their bytes.
//!
//! Latency is added on the head's side of each veth: `tc netem delay` where the kernel has
//! netem; where it has not (`CONFIG_NET_SCH_NETEM` unset, as on the Firecracker VMs), a
//! relay in the head's namespace (this binary, run as `rpc_workers relay LISTEN TARGET
//! MICROS`) holds each chunk the head sends for that long before it goes on over the veth.
//! Either way a round trip to a worker takes that much longer; the benchmark says which.
//!
//! For each setup: the time of a first load (the workers' cache empty), of a load once the
//! model was unloaded (cache warm), then time to first token and tokens per second of
//! streamed answers.  Run with `cargo bench --bench rpc_workers` as root (namespaces).
//! A measurement: nothing is asserted about time.

#![allow(clippy::print_stdout, reason = "a benchmark reports on stdout")]
#![allow(clippy::cast_precision_loss, reason = "durations and sizes as floating point for the table")]

#[allow(dead_code, reason = "the tests' HTTP client; only part of it is used here")]
#[path = "../tests/it/support/http.rs"]
mod http;
#[allow(dead_code, reason = "the tests' namespace fixtures; only part of them is used here")]
#[path = "../tests/it/support/netns.rs"]
mod netns;
#[allow(dead_code, reason = "the tests' rpc-server process; only part of it is used here")]
#[path = "../tests/it/support/rpc_process.rs"]
mod rpc_process;
#[path = "../tests/it/support/setup.rs"]
mod setup;

use std::fmt::Write as _;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddrV4, TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use corral::demo_model::{LlamaShape, Weights, write_llama};
use corral::store::Store;
use corral::store::create::CreateSpec;
use corral::store::modelfile::Modelfile;
use corral::store::name::ModelName;
use netns::{Link, Netns, NsRpcServer};

/// Where every rpc-server listens (each in its namespace, or on the head's loopback).
const PORT: u16 = 50052;

/// Streamed answers per setup, and tokens in each.
const ANSWERS: usize = 5;
const TOKENS: u32 = 64;

/// How long corrald may take to answer, and a request to end.
const START_TIMEOUT: Duration = Duration::from_secs(60);
const REQUEST_TIMEOUT: Duration = Duration::from_secs(300);

/// About 290 MiB of F16 weights; each feed-forward tensor 1536 × 4096 × 2 bytes = 12 MiB.
const SHAPE: LlamaShape = LlamaShape {
    name: "corral-bench-rpc-llama",
    n_layer: 6,
    n_embd: 1536,
    n_ff: 4096,
    n_head: 12,
    n_head_kv: 4,
    context: 2048,
    weights: Weights::RandomBits,
};

/// How the added latency is made.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Delayer {
    Netem,
    Relay,
}

/// One setup of the table.
struct Setup {
    label: String,
    split: bool,
    delay: Duration,
    cache: bool,
    relay: bool,
}

/// What one setup measured.
struct Row {
    label: String,
    cold_load: Duration,
    warm_load: Duration,
    ttft: Vec<Duration>,
    rate: Vec<f64>,
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("relay") {
        relay(&args[2], &args[3], Duration::from_micros(args[4].parse().expect("micros")));
        return;
    }
    // The directory of llama-server and rpc-server, built once into a cache.
    let bin = setup::run("setup-llama-server.sh");
    let dir = tempfile::tempdir().expect("tempdir");
    let model_bytes = make_model(dir.path());
    let delayer = probe_netem();
    println!(
        "model: {} MiB; added latency by {}",
        model_bytes >> 20,
        if delayer == Delayer::Netem { "tc netem" } else { "a delaying relay (this kernel has no netem)" }
    );
    let relay = delayer == Delayer::Relay;
    let mut setups = vec![
        Setup {
            label: "local device (loopback)".into(),
            split: false,
            delay: Duration::ZERO,
            cache: true,
            relay: false,
        },
        Setup {
            label: "2 workers, veth, no cache".into(),
            split: true,
            delay: Duration::ZERO,
            cache: false,
            relay: false,
        },
        Setup { label: "2 workers, veth".into(), split: true, delay: Duration::ZERO, cache: true, relay: false },
    ];
    if relay {
        let label = "2 workers, veth, relay +0 ms".into();
        setups.push(Setup { label, split: true, delay: Duration::ZERO, cache: true, relay });
    }
    for micros in [200, 2000] {
        let label = format!("2 workers, veth +{} ms", micros as f64 / 1000.0);
        setups.push(Setup { label, split: true, delay: Duration::from_micros(micros), cache: true, relay });
    }
    let rows: Vec<Row> = setups.iter().map(|s| measure(dir.path(), &bin, model_bytes, s)).collect();
    print_table(&rows);
}

/// Writes the model into a store in `dir` as `bench`; its size.
fn make_model(dir: &Path) -> u64 {
    let file = dir.join("bench.gguf");
    write_llama(&file, &SHAPE).expect("write the model");
    let store = Store::open(&dir.join("models")).expect("store");
    let spec =
        CreateSpec::from_modelfile(&Modelfile::parse("FROM ./bench.gguf\n").expect("modelfile"), dir).expect("spec");
    store.create(&ModelName::parse("bench").expect("name"), &spec, &mut |_| {}).expect("create");
    let bytes = std::fs::metadata(&file).expect("model").len();
    std::fs::remove_file(&file).expect("the store has its copy");
    bytes
}

/// Whether this kernel has netem: tried on a link between two namespaces of its own.
fn probe_netem() -> Delayer {
    let (a, b) = (Netns::new(), Netns::new());
    let link = Link::new(&a, &b);
    match link.set_delay(Duration::from_micros(200)) {
        Ok(()) => Delayer::Netem,
        Err(e) => {
            println!("no netem: {e}");
            Delayer::Relay
        }
    }
}

/// Sets up the hosts of `setup`, runs corrald on them and measures.
fn measure(dir: &Path, bin: &Path, model_bytes: u64, setup: &Setup) -> Row {
    let head = Netns::new();
    let rpc_server = bin.join("rpc-server");
    let mut caches = Vec::new();
    let mut cache_dir = || {
        let cache = tempfile::tempdir_in(dir).expect("cache dir");
        let path = cache.path().to_owned();
        caches.push(cache);
        setup.cache.then_some(path)
    };
    // Dropped explicitly below, in this order after corrald: relays, servers, links, hosts.
    let mut relays: Vec<Process> = Vec::new();
    let mut servers = Vec::new();
    let mut links = Vec::new();
    let mut hosts = Vec::new();
    let mut addresses = Vec::new();
    if setup.split {
        for _ in 0..2 {
            let host = Netns::new();
            let link = Link::new(&head, &host);
            let endpoint = SocketAddrV4::new(link.worker_addr(), PORT);
            servers.push(NsRpcServer::start(&host, &rpc_server, endpoint, cache_dir().as_deref()));
            if setup.relay {
                let (process, port) = start_relay(&head, endpoint, setup.delay);
                relays.push(process);
                addresses.push(format!("127.0.0.1:{port}"));
            } else {
                link.set_delay(setup.delay).expect("netem");
                addresses.push(endpoint.to_string());
            }
            links.push(link);
            hosts.push(host);
        }
    } else {
        let endpoint = SocketAddrV4::new([127, 0, 0, 1].into(), PORT);
        servers.push(NsRpcServer::start(&head, &rpc_server, endpoint, cache_dir().as_deref()));
        addresses.push(endpoint.to_string());
    }
    // Split: each worker gets 85 % of the model's weights: it needs about 120 % with its
    // context and compute buffers on one device, about 65 % on each of two.
    let memory =
        if setup.split { format!("memory = \"{}MiB\"\n", (model_bytes * 85 / 100) >> 20) } else { String::new() };
    let workers = addresses.iter().fold(String::new(), |mut text, a| {
        let _ = write!(text, "[[workers]]\naddress = \"{a}\"\n{memory}");
        text
    });
    let corrald = Corrald::start(dir, bin, &head, &workers);

    let cold_load = corrald.load();
    corrald.unload();
    let warm_load = corrald.load();
    let placed = corrald.devices();
    let (mut ttft, mut rate) = (Vec::new(), Vec::new());
    for _ in 0..ANSWERS {
        let (first, tokens_per_second) = corrald.stream();
        ttft.push(first);
        rate.push(tokens_per_second);
    }
    println!(
        "{}: loads {cold_load:.2?} then {warm_load:.2?}, on {placed:?}; first token {ttft:.2?}; {rate:.1?} tokens/s",
        setup.label
    );
    drop(corrald);
    drop(relays);
    drop(servers);
    drop(links);
    drop(hosts);
    Row { label: setup.label.clone(), cold_load, warm_load, ttft, rate }
}

/// A child killed and reaped on drop.
struct Process(Child);

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts this binary as a relay in `head` to `target`, delaying what the head sends by
/// `delay`; the relay and its loopback port.
fn start_relay(head: &Netns, target: SocketAddrV4, delay: Duration) -> (Process, u16) {
    let mut cmd = head.command(std::env::current_exe().expect("this binary"));
    cmd.args(["relay", "127.0.0.1:0", &target.to_string(), &delay.as_micros().to_string()]);
    let mut child = cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::inherit()).spawn().expect("relay");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout")).read_line(&mut line).expect("the relay's port");
    let port = line.trim().parse().unwrap_or_else(|e| panic!("relay said {line:?}: {e}"));
    (Process(child), port)
}

/// The relay: accepts on `listen`, prints its port, and joins each connection to `target`,
/// holding each chunk towards the target for `delay` (towards the client, none): a link
/// whose round trip takes `delay` longer, as netem on the head's side of the veth makes it.
fn relay(listen: &str, target: &str, delay: Duration) {
    let listener = TcpListener::bind(listen).expect("bind");
    println!("{}", listener.local_addr().expect("addr").port());
    std::io::stdout().flush().expect("flush");
    for client in listener.incoming() {
        let Ok(client) = client else { continue };
        let Ok(upstream) = TcpStream::connect(target) else { continue };
        for stream in [&client, &upstream] {
            stream.set_nodelay(true).expect("nodelay");
        }
        let (mut from_client, mut to_upstream) =
            (client.try_clone().expect("clone"), upstream.try_clone().expect("clone"));
        let (mut from_upstream, mut to_client) = (upstream, client);
        std::thread::spawn(move || {
            let _ = std::io::copy(&mut from_upstream, &mut to_client);
            let _ = to_client.shutdown(std::net::Shutdown::Write);
        });
        let (tx, rx) = mpsc::channel::<(Instant, Vec<u8>)>();
        std::thread::spawn(move || {
            let mut buf = vec![0; 256 * 1024];
            while let Ok(n) = from_client.read(&mut buf) {
                if n == 0 || tx.send((Instant::now() + delay, buf[..n].to_vec())).is_err() {
                    break;
                }
            }
        });
        std::thread::spawn(move || {
            for (due, chunk) in rx {
                // Sleep to just before it is due, then spin: sleeps overshoot by tens of µs.
                let early = due.checked_sub(Duration::from_micros(100));
                if let Some(wake) = early.filter(|w| *w > Instant::now()) {
                    std::thread::sleep(wake - Instant::now());
                }
                while Instant::now() < due {
                    std::hint::spin_loop();
                }
                if to_upstream.write_all(&chunk).is_err() {
                    break;
                }
            }
            let _ = to_upstream.shutdown(std::net::Shutdown::Write);
        });
    }
}

/// corrald in the head's namespace, on a UNIX socket.
struct Corrald {
    process: Process,
    socket: PathBuf,
    dirs: tempfile::TempDir,
}

impl Corrald {
    fn start(dir: &Path, bin: &Path, head: &Netns, workers: &str) -> Self {
        let dirs = tempfile::tempdir_in(dir).expect("corrald's dirs");
        let socket = dirs.path().join("corral.sock");
        let config = format!(
            "[server]\nlisten = [\"{}\"]\n[store]\npath = \"{}\"\n[runner]\nllama_server = \"{}\"\n\
             [scheduler]\nnum_ctx = 2048\n[worker_health]\ninterval = \"1s\"\n\
             [gpu]\nfixed = true\nhost_memory = \"8GiB\"\nreserve = \"0B\"\n{workers}",
            socket.display(),
            dir.join("models").display(),
            bin.join("llama-server").display(),
        );
        // Checked every second, as in the tests: a worker a runner holds is judged by the
        // runner's own connection, so the checks cost the measured runs nothing.
        let path = dirs.path().join("corral.toml");
        std::fs::write(&path, config).expect("write config");
        let log = std::fs::File::create(dirs.path().join("corrald.log")).expect("log");
        let child = head
            .command(env!("CARGO_BIN_EXE_corrald"))
            .args(["--log-target", "stderr", "--config"])
            .arg(&path)
            .env("STATE_DIRECTORY", dirs.path().join("state"))
            .env("RUNTIME_DIRECTORY", dirs.path().join("run"))
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn corrald");
        let corrald = Self { process: Process(child), socket, dirs };
        let deadline = Instant::now() + START_TIMEOUT;
        while UnixStream::connect(&corrald.socket).is_err() {
            assert!(Instant::now() < deadline, "corrald does not listen:\n{}", corrald.log());
            std::thread::sleep(Duration::from_millis(50));
        }
        corrald
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dirs.path().join("corrald.log")).unwrap_or_default()
    }

    fn request(&self, method: &str, path: &str, body: Option<&serde_json::Value>) -> http::Response {
        let body = body.map(serde_json::Value::to_string);
        let reply = http::unix(&self.socket, method, path, body.as_deref());
        assert_eq!(reply.status, 200, "{method} {path}: {}\n{}", reply.body, self.log());
        reply
    }

    /// Loads the model (a one-token answer); corrald's `load_duration`.
    fn load(&self) -> Duration {
        let body =
            serde_json::json!({"model": "bench", "prompt": "hi", "stream": false, "options": {"num_predict": 1}});
        let reply = self.request("POST", "/api/generate", Some(&body)).json();
        Duration::from_nanos(reply["load_duration"].as_u64().expect("load_duration"))
    }

    fn unload(&self) {
        self.request("POST", "/api/generate", Some(&serde_json::json!({"model": "bench", "keep_alive": 0})));
        let deadline = Instant::now() + REQUEST_TIMEOUT;
        while !self.request("GET", "/api/ps", None).body.contains("\"models\":[]") {
            assert!(Instant::now() < deadline, "not unloaded:\n{}", self.log());
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The loaded model's devices and their bytes, as `/api/ps` lists them.
    fn devices(&self) -> Vec<String> {
        let ps = self.request("GET", "/api/ps", None).json();
        let devices = ps["models"][0]["devices"].as_array().cloned().unwrap_or_default();
        devices
            .iter()
            .map(|d| format!("{} {} MiB", d["name"].as_str().unwrap_or("?"), d["bytes"].as_u64().unwrap_or(0) >> 20))
            .collect()
    }

    /// One streamed answer of [`TOKENS`] tokens: the time to its first token, and its
    /// tokens per second (`eval_count` over `eval_duration`, llama.cpp's own timing).
    fn stream(&self) -> (Duration, f64) {
        let body =
            serde_json::json!({"model": "bench", "prompt": "Once upon a time", "options": {"num_predict": TOKENS}})
                .to_string();
        let mut stream = UnixStream::connect(&self.socket).expect("connect");
        stream.set_read_timeout(Some(REQUEST_TIMEOUT)).expect("timeout");
        let asked = Instant::now();
        let head = format!(
            "POST /api/generate HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\n\r\n{body}",
            body.len()
        );
        stream.write_all(head.as_bytes()).expect("send");
        let (mut raw, mut first) = (Vec::new(), None);
        let mut buf = [0; 16 * 1024];
        loop {
            let n = stream.read(&mut buf).expect("read the answer");
            if n == 0 {
                break;
            }
            raw.extend_from_slice(&buf[..n]);
            if first.is_none() && String::from_utf8_lossy(&raw).contains("\"done\":false") {
                first = Some(asked.elapsed());
            }
        }
        let reply = http::parse(&raw);
        let last: serde_json::Value =
            serde_json::from_str(reply.body.lines().last().expect("a last line")).expect("the last line is JSON");
        let count = last["eval_count"].as_f64().expect("eval_count");
        let nanos = last["eval_duration"].as_f64().expect("eval_duration");
        (first.expect("a streamed token"), count / nanos * 1e9)
    }
}

impl Drop for Corrald {
    fn drop(&mut self) {
        // SIGTERM, so that it stops its runner; the process guard kills what is left.
        let pid = nix::unistd::Pid::from_raw(i32::try_from(self.process.0.id()).expect("pid"));
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(30);
        while matches!(self.process.0.try_wait(), Ok(None)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

fn median<T: Copy + PartialOrd>(values: &[T]) -> T {
    let mut sorted = values.to_vec();
    sorted.sort_by(|a, b| a.partial_cmp(b).expect("comparable"));
    sorted[sorted.len() / 2]
}

/// The table for `docs/benchmarks.md`, with ratios against the local device.
fn print_table(rows: &[Row]) {
    let local = &rows[0];
    let (local_ttft, local_rate) = (median(&local.ttft).as_secs_f64(), median(&local.rate));
    println!();
    println!("| setup | first load | load, cache warm | time to first token | tokens/s |");
    println!("| --- | --- | --- | --- | --- |");
    for row in rows {
        let (ttft, rate) = (median(&row.ttft).as_secs_f64(), median(&row.rate));
        println!(
            "| {} | {:.2} s | {:.2} s | {:.1} ms (×{:.2}) | {:.1} (×{:.2}) |",
            row.label,
            row.cold_load.as_secs_f64(),
            row.warm_load.as_secs_f64(),
            ttft * 1000.0,
            ttft / local_ttft,
            rate,
            rate / local_rate
        );
    }
}
