//! HTTP overhead: corrald in front of llama-server against a client talking to
//! llama-server directly, on the tiny model, side by side in one run.
//!
//! - **direct**: llama-server started with exactly the argv corrald gave its child (read
//!   from `/proc/PID/cmdline`), except that it listens on a loopback TCP port, as a client
//!   would use it.
//! - **corral**: `corrald` as cargo builds it for the benchmark (`target/release/corrald`,
//!   the bench profile, which is the release profile) on a loopback TCP port, with a store
//!   holding the tiny model (`PARAMETER num_thread 1`) and a keep-alive of one hour, so the
//!   model stays loaded throughout.
//!
//! Measured, alternating the sides in every round (medians over rounds):
//!
//! - time to the first content-bearing frame of a streamed chat: `/v1/chat/completions`
//!   on both sides (corral passes it through), and corral's Ollama `/api/chat` against
//!   direct `/v1/chat/completions` (the endpoint corral calls for it);
//! - the same first-frame time for a stream that follows a pause of [`PAUSE`] (fewer
//!   rounds): longer than corrald keeps a spare connection to its runner, so this is a
//!   chat's next turn after the user thought for a moment;
//! - streaming tokens/s after the first token, with a fixed token count (`max_tokens`,
//!   `ignore_eos`); the count reported in the usage / `eval_count` is checked on both sides;
//! - tiny-request round trips/s: `/v1/completions` with `max_tokens: 1`, non-streaming, on
//!   1 and 8 keep-alive connections;
//! - corrald's RSS (`VmRSS`, `VmHWM`) and thread count: idle after start, and after the traffic.
//!
//! By default both llama-servers are pinned to the last CPU (and run with `-t 1`), and
//! corrald and this client to CPU 0, as in the peer measurements; `CORRAL_BENCH_PIN=0`
//! leaves every process free to use every CPU. `CORRAL_BENCH_ROUNDS` sets the rounds
//! (default 30), `CORRAL_BENCH_TOKENS` the streamed tokens (default 256), and
//! `CORRAL_BENCH_CORRALD` another corrald binary to measure (to compare two versions).
//!
//! Run with `cargo bench --bench http_overhead` (after `scripts/setup-llama-server.sh`).

#![allow(clippy::print_stdout, reason = "a benchmark reports on stdout")]

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes_ext::find;
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;

use corral::store::Store;
use corral::store::create::CreateSpec;
use corral::store::modelfile::Modelfile;
use corral::store::name::ModelName;

const MODEL: &str = "chat";

/// The pause before each stream of the "after a pause" rows: longer than corrald keeps an
/// idle connection to a runner (2 s).
const PAUSE: Duration = Duration::from_millis(2500);

fn llama_bin_dir() -> PathBuf {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/setup-llama-server.sh");
    let out = Command::new("bash").arg(&script).stderr(Stdio::inherit()).output().expect("run setup script");
    assert!(out.status.success(), "setup-llama-server.sh failed");
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}

/// `path` as a quoted TOML string.
fn toml_string(path: &Path) -> String {
    toml::Value::String(path.to_str().expect("a UTF-8 temporary path").to_owned()).to_string()
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port()
}

/// Pins every thread of `pid` to `cpus` (a `taskset` list such as "0" or "1").
fn pin(pid: u32, cpus: &str) {
    let status = Command::new("taskset")
        .args(["-a", "-c", "-p", cpus, &pid.to_string()])
        .stdout(Stdio::null())
        .status()
        .expect("run taskset");
    assert!(status.success(), "taskset -p {cpus} {pid} failed");
}

/// A child process killed and reaped on drop.
struct Process(Child);

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `VmRSS`, `VmHWM` (KiB) and `Threads` of `pid`.
fn memory(pid: u32) -> (u64, u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("read status");
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {name} in /proc/{pid}/status"))
    };
    (field("VmRSS:"), field("VmHWM:"), field("Threads:"))
}

/// Small byte-search helpers for reading answers without parsing every chunk.
mod bytes_ext {
    /// The first position of `needle` in `hay` at or after `from`.
    pub fn find(hay: &[u8], needle: &[u8], from: usize) -> Option<usize> {
        hay.get(from..)?.windows(needle.len()).position(|w| w == needle).map(|p| p + from)
    }
}

/// Whether `data` holds a non-empty `"content":"…"` (an SSE delta or an Ollama message).
fn has_content(data: &[u8]) -> bool {
    const MARK: &[u8] = b"\"content\":\"";
    let mut from = 0;
    while let Some(at) = find(data, MARK, from) {
        let next = at + MARK.len();
        if data.get(next).is_some_and(|b| *b != b'"') {
            return true;
        }
        from = next;
    }
    false
}

/// The number after the last `"key":` in `data`.
fn last_number(data: &[u8], key: &str) -> Option<u64> {
    let mark = format!("\"{key}\":");
    let mut at = None;
    let mut from = 0;
    while let Some(found) = find(data, mark.as_bytes(), from) {
        at = Some(found + mark.len());
        from = found + 1;
    }
    let digits: String = data[at?..].iter().map(|b| char::from(*b)).take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

/// One kept-alive HTTP/1.1 connection, opened again when the server closed it
/// (llama-server closes a connection after a streamed answer, and after 100 requests).
struct Client {
    sender: SendRequest<Full<Bytes>>,
    port: u16,
    host: String,
}

impl Client {
    async fn connect(port: u16) -> Self {
        let stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.expect("connect");
        stream.set_nodelay(true).expect("nodelay");
        let (sender, connection) =
            hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.expect("handshake");
        tokio::spawn(connection);
        Self { sender, port, host: format!("127.0.0.1:{port}") }
    }

    /// Opens a new connection if the server closed this one.
    async fn reopen_if_closed(&mut self) {
        if self.sender.is_closed() || self.sender.ready().await.is_err() {
            *self = Self::connect(self.port).await;
        }
    }

    async fn post(&mut self, path: &str, body: &Bytes) -> hyper::Response<hyper::body::Incoming> {
        self.reopen_if_closed().await;
        let host = self.host.clone();
        let request = || {
            hyper::Request::post(path)
                .header("host", &host)
                .header("content-type", "application/json")
                .body(Full::new(body.clone()))
                .expect("request")
        };
        let response = match self.sender.send_request(request()).await {
            Ok(response) => response,
            // The server closed the connection as the request went out (a keep-alive limit):
            // nothing was processed, so send it again on a new one.
            Err(e) if e.is_canceled() || e.is_incomplete_message() => {
                *self = Self::connect(self.port).await;
                self.sender.send_request(request()).await.unwrap_or_else(|e| panic!("{} {path}: {e}", self.host))
            }
            Err(e) => panic!("{} {path}: {e}", self.host),
        };
        assert!(response.status().is_success(), "{path}: {}", response.status());
        response
    }

    async fn get(&mut self, path: &str) -> bool {
        if self.sender.ready().await.is_err() {
            return false;
        }
        let request =
            hyper::Request::get(path).header("host", &self.host).body(Full::new(Bytes::new())).expect("request");
        match self.sender.send_request(request).await {
            Ok(response) => {
                let ok = response.status().is_success();
                let _ = response.into_body().collect().await;
                ok
            }
            Err(_) => false,
        }
    }

    /// Streams `body` to `path`; returns the time to the first content frame, the time
    /// from it to the end, and the token count `count_key` reports.
    async fn stream(&mut self, path: &str, body: &Bytes, count_key: &str) -> (Duration, Duration, u64) {
        // llama-server closes the connection after a stream, so every stream starts on a
        // new connection, on both sides, opened before the clock starts.
        *self = Self::connect(self.port).await;
        let start = Instant::now();
        let mut response = self.post(path, body).await.into_body();
        let mut first = None;
        let mut all = Vec::with_capacity(64 << 10);
        while let Some(frame) = response.frame().await {
            let frame = frame.expect("body");
            if let Ok(data) = frame.into_data() {
                if first.is_none() && has_content(&data) {
                    first = Some(start.elapsed());
                }
                all.extend_from_slice(&data);
            }
        }
        let total = start.elapsed();
        let first = first.unwrap_or_else(|| panic!("{path}: no content in {}", String::from_utf8_lossy(&all)));
        let count = last_number(&all, count_key)
            .unwrap_or_else(|| panic!("{path}: no {count_key} in {}", String::from_utf8_lossy(&all)));
        (first, total.saturating_sub(first), count)
    }

    async fn tiny(&mut self, body: &Bytes) {
        let response = self.post("/v1/completions", body).await;
        let bytes = response.into_body().collect().await.expect("body").to_bytes();
        assert!(find(&bytes, b"\"choices\"", 0).is_some(), "{}", String::from_utf8_lossy(&bytes));
    }
}

/// Requests per second of `total` tiny requests over `clients` connections to `port`.
async fn tiny_rate(port: u16, clients: usize, total: usize, body: &Bytes) -> f64 {
    let mut connections = Vec::with_capacity(clients);
    for _ in 0..clients {
        let mut client = Client::connect(port).await;
        client.tiny(body).await; // the connection is open and warm before the clock starts
        connections.push(client);
    }
    let start = Instant::now();
    let tasks: Vec<_> = connections
        .into_iter()
        .map(|mut client| {
            let body = body.clone();
            let share = total / clients;
            tokio::spawn(async move {
                for _ in 0..share {
                    client.tiny(&body).await;
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.expect("client task");
    }
    #[allow(clippy::cast_precision_loss, reason = "request counts are small")]
    let rate = (total / clients * clients) as f64 / start.elapsed().as_secs_f64();
    rate
}

async fn wait_ready(port: u16, path: &str, process: &mut Process) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        assert!(process.0.try_wait().expect("wait").is_none(), "the server on port {port} exited");
        if let Ok(stream) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await {
            if let Ok((sender, connection)) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await {
                tokio::spawn(connection);
                let mut client = Client { sender, port, host: format!("127.0.0.1:{port}") };
                if client.get(path).await {
                    return;
                }
            }
        }
        assert!(Instant::now() < deadline, "the server on port {port} did not become ready");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn median(mut samples: Vec<f64>) -> f64 {
    samples.sort_by(f64::total_cmp);
    samples[samples.len() / 2]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Median samples of one measure on both sides.
struct Pair {
    name: &'static str,
    unit: &'static str,
    direct: Vec<f64>,
    corral: Vec<f64>,
    /// Whether a higher value is better (a rate) or a lower one (a latency).
    higher_better: bool,
    target: &'static str,
}

impl Pair {
    fn new(name: &'static str, unit: &'static str, higher_better: bool, target: &'static str) -> Self {
        Self { name, unit, direct: Vec::new(), corral: Vec::new(), higher_better, target }
    }

    fn print(&self) {
        let (d, c) = (median(self.direct.clone()), median(self.corral.clone()));
        let spread = |v: &[f64]| {
            let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
            let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            format!("{lo:.2}..{hi:.2}")
        };
        let delta = if self.higher_better { String::new() } else { format!("{:+.3}", c - d) };
        println!(
            "| {} | {d:.3} {u} ({}) | {c:.3} {u} ({}) | {delta} | {:.3} | {} |",
            self.name,
            spread(&self.direct),
            spread(&self.corral),
            c / d,
            self.target,
            u = self.unit,
        );
    }
}

#[allow(clippy::too_many_lines, reason = "one linear script of a benchmark")]
fn main() {
    let rounds: usize = std::env::var("CORRAL_BENCH_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(30);
    let tokens: u64 = std::env::var("CORRAL_BENCH_TOKENS").ok().and_then(|v| v.parse().ok()).unwrap_or(256);
    let pinned = std::env::var("CORRAL_BENCH_PIN").map_or(true, |v| v != "0");
    let cpus = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
    let pinned = pinned && cpus >= 2;
    let last_cpu = (cpus - 1).to_string();

    let llama_server = llama_bin_dir().join("llama-server");
    // Cargo builds the binary with the benchmark (bench profile: release settings);
    // CORRAL_BENCH_CORRALD names another build, to compare two versions.
    let corrald = std::env::var_os("CORRAL_BENCH_CORRALD")
        .map_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_corrald")), PathBuf::from);
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(&dir.path().join("models")).expect("store");
    corral::demo_model::write_tiny_llama(&dir.path().join("tiny.gguf")).expect("model");
    let modelfile = Modelfile::parse("FROM ./tiny.gguf\nPARAMETER num_thread 1\n").expect("modelfile");
    let spec = CreateSpec::from_modelfile(&modelfile, dir.path()).expect("spec");
    store.create(&ModelName::parse(MODEL).expect("name"), &spec, &mut |_| {}).expect("create");

    let corral_port = free_port();
    let config = dir.path().join("corral.toml");
    std::fs::write(
        &config,
        format!(
            "[server]\nlisten = [\"127.0.0.1:{corral_port}\"]\n[store]\npath = {}\n[runner]\nllama_server = {}\n\
             [scheduler]\nkeep_alive = \"1h\"\n",
            toml_string(&dir.path().join("models")),
            toml_string(&llama_server),
        ),
    )
    .expect("config");
    if pinned {
        pin(std::process::id(), "0");
    }
    let mut daemon = Command::new(&corrald);
    daemon.arg("--config").arg(&config).args(["--log-target", "stderr"]);
    daemon.env("STATE_DIRECTORY", dir.path().join("state")).env("RUNTIME_DIRECTORY", dir.path().join("run"));
    daemon.env("RUST_LOG", "error").stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::inherit());
    let mut daemon = Process(daemon.spawn().expect("start corrald"));
    let daemon_pid = daemon.0.id();

    // The client is single-threaded, so it stays on one CPU and its own cost is the same
    // for both sides.
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    runtime.block_on(wait_ready(corral_port, "/api/version", &mut daemon));
    std::thread::sleep(Duration::from_millis(500));
    let idle = memory(daemon_pid);

    let chat = |model: &str, stream: bool| {
        Bytes::from(
            serde_json::json!({
                "model": model,
                "messages": [{"role": "user", "content": "Tell me a story about a corral."}],
                "stream": stream,
                "stream_options": {"include_usage": true},
                "max_tokens": tokens,
                "ignore_eos": true,
                "temperature": 0.8, "top_k": 40, "top_p": 0.9, "min_p": 0.0, "seed": 7,
            })
            .to_string(),
        )
    };
    let ollama_chat = Bytes::from(
        serde_json::json!({
            "model": MODEL,
            "messages": [{"role": "user", "content": "Tell me a story about a corral."}],
            "stream": true,
            "options": {"num_predict": tokens, "temperature": 0.8, "top_k": 40, "top_p": 0.9, "min_p": 0.0, "seed": 7},
        })
        .to_string(),
    );
    let tiny = |model: &str| {
        Bytes::from(
            serde_json::json!({"model": model, "prompt": "hi", "max_tokens": 1, "temperature": 0.0}).to_string(),
        )
    };

    // Load the model through corrald, then start the direct llama-server with its child's argv.
    runtime.block_on(async {
        let mut client = Client::connect(corral_port).await;
        client.tiny(&tiny(MODEL)).await;
    });
    // Any of corrald's threads may have spawned the child.
    let mut children = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{daemon_pid}/task")).expect("read tasks") {
        let listed = std::fs::read_to_string(task.expect("task").path().join("children")).unwrap_or_default();
        children.extend(listed.split_whitespace().map(|p| p.parse::<u32>().expect("pid")));
    }
    assert_eq!(children.len(), 1, "corrald runs one child: {children:?}");
    let child_pid = children[0];
    let argv: Vec<String> = std::fs::read(format!("/proc/{child_pid}/cmdline"))
        .expect("read cmdline")
        .split(|b| *b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    let alias = argv.iter().position(|a| a == "-a").map(|i| argv[i + 1].clone()).expect("-a ALIAS in the argv");
    let direct_port = free_port();
    let mut direct_args = argv[1..].to_vec();
    let host = direct_args.iter().position(|a| a == "--host").expect("--host in the argv");
    direct_args[host + 1] = "127.0.0.1".into();
    direct_args.extend(["--port".into(), direct_port.to_string()]);
    let mut direct = Process(
        Command::new(&argv[0])
            .args(&direct_args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start llama-server"),
    );
    let mut direct_stderr = direct.0.stderr.take().expect("stderr");
    std::thread::spawn(move || {
        let mut sink = [0u8; 4096];
        while matches!(direct_stderr.read(&mut sink), Ok(n) if n > 0) {}
    });
    runtime.block_on(wait_ready(direct_port, "/health", &mut direct));
    if pinned {
        pin(daemon_pid, "0");
        pin(child_pid, &last_cpu);
        pin(direct.0.id(), &last_cpu);
    }
    let loaded = memory(daemon_pid);

    let mut ttft = Pair::new("TTFT /v1/chat/completions", "ms", false, "added <= 0.2 ms");
    let mut ttft_api = Pair::new("TTFT /api/chat (direct: /v1/chat)", "ms", false, "added <= 0.2 ms");
    let mut ttft_paused =
        Pair::new("TTFT /v1/chat/completions after a pause", "ms", false, "none (a new runner connection)");
    let mut rate = Pair::new("streaming /v1/chat/completions", "tok/s", true, ">= 0.99x");
    let mut rate_api = Pair::new("streaming /api/chat (direct: /v1/chat)", "tok/s", true, ">= 0.99x");
    let mut tiny1 = Pair::new("tiny /v1/completions, 1 client", "req/s", true, ">= 0.85x");
    let mut tiny8 = Pair::new("tiny /v1/completions, 8 clients", "req/s", true, ">= 0.95x");
    let tiny_total = 200;

    runtime.block_on(async {
        let mut to_direct = Client::connect(direct_port).await;
        let mut to_corral = Client::connect(corral_port).await;
        let (direct_chat, corral_chat) = (chat(&alias, true), chat(MODEL, true));
        let (direct_tiny, corral_tiny) = (tiny(&alias), tiny(MODEL));
        #[allow(clippy::cast_precision_loss, reason = "token counts are small")]
        let per_second = |n: u64, d: Duration| (n - 1) as f64 / d.as_secs_f64();
        // Round 0 warms both sides up and is not counted.
        for round in 0..=rounds {
            // Alternate which side goes first, so neither always follows the other.
            let order: [bool; 2] = if round % 2 == 0 { [true, false] } else { [false, true] };
            for is_direct in order {
                let (first, rest, count) = if is_direct {
                    to_direct.stream("/v1/chat/completions", &direct_chat, "completion_tokens").await
                } else {
                    to_corral.stream("/v1/chat/completions", &corral_chat, "completion_tokens").await
                };
                assert_eq!(count, tokens, "streamed token count");
                let (ttft_side, rate_side) =
                    if is_direct { (&mut ttft.direct, &mut rate.direct) } else { (&mut ttft.corral, &mut rate.corral) };
                if round > 0 {
                    ttft_side.push(ms(first));
                    rate_side.push(per_second(count, rest));
                }
                let (first, rest, count) = if is_direct {
                    to_direct.stream("/v1/chat/completions", &direct_chat, "completion_tokens").await
                } else {
                    to_corral.stream("/api/chat", &ollama_chat, "eval_count").await
                };
                assert_eq!(count, tokens, "streamed token count");
                let (ttft_side, rate_side) = if is_direct {
                    (&mut ttft_api.direct, &mut rate_api.direct)
                } else {
                    (&mut ttft_api.corral, &mut rate_api.corral)
                };
                if round > 0 {
                    ttft_side.push(ms(first));
                    rate_side.push(per_second(count, rest));
                }
            }
        }
        // Fewer rounds after a pause: each waits PAUSE.
        for round in 0..=rounds.div_ceil(3) {
            let order: [bool; 2] = if round % 2 == 0 { [true, false] } else { [false, true] };
            for is_direct in order {
                tokio::time::sleep(PAUSE).await;
                let (first, _, count) = if is_direct {
                    to_direct.stream("/v1/chat/completions", &direct_chat, "completion_tokens").await
                } else {
                    to_corral.stream("/v1/chat/completions", &corral_chat, "completion_tokens").await
                };
                assert_eq!(count, tokens, "streamed token count");
                if round > 0 {
                    if is_direct { &mut ttft_paused.direct } else { &mut ttft_paused.corral }.push(ms(first));
                }
            }
        }
        // Fewer rounds of the throughput runs: each is 200 requests.
        for round in 0..=rounds.div_ceil(3) {
            let order: [bool; 2] = if round % 2 == 0 { [true, false] } else { [false, true] };
            for is_direct in order {
                let (port, body) = if is_direct { (direct_port, &direct_tiny) } else { (corral_port, &corral_tiny) };
                let one = tiny_rate(port, 1, tiny_total, body).await;
                let eight = tiny_rate(port, 8, tiny_total, body).await;
                if round > 0 {
                    let (a, b) = if is_direct {
                        (&mut tiny1.direct, &mut tiny8.direct)
                    } else {
                        (&mut tiny1.corral, &mut tiny8.corral)
                    };
                    a.push(one);
                    b.push(eight);
                }
            }
        }
    });
    let after = memory(daemon_pid);
    let kib = |k: u64| {
        #[allow(clippy::cast_precision_loss, reason = "KiB counts are small")]
        let mib = k as f64 / 1024.0;
        mib
    };

    println!(
        "http overhead, tiny model, {rounds} rounds alternating, {tokens} streamed tokens, {}, {cpus} CPUs",
        if pinned { "llama-servers pinned to the last CPU, corrald and client to CPU 0" } else { "unpinned" }
    );
    println!("| measure | direct (median, min..max) | corral (median, min..max) | added | corral/direct | target |");
    println!("| --- | --- | --- | --- | --- | --- |");
    for pair in [&ttft, &ttft_api, &ttft_paused, &rate, &rate_api, &tiny1, &tiny8] {
        pair.print();
    }
    println!();
    println!("corrald memory (child not counted) | VmRSS | VmHWM | threads");
    for (state, (rss, hwm, threads)) in
        [("idle after start", idle), ("model loaded", loaded), ("after the traffic", after)]
    {
        println!("  {state:<20} | {:6.2} MiB | {:6.2} MiB | {threads}", kib(rss), kib(hwm));
    }
    println!("  target: idle VmRSS <= 10 MiB");
    drop(direct);
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(daemon_pid).expect("pid")),
        nix::sys::signal::Signal::SIGTERM,
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while daemon.0.try_wait().expect("wait").is_none() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
}
