//! HTTP overhead: corrald in front of llama-server against a client talking to
//! llama-server directly, on the tiny model, side by side in one run.
//!
//! - **direct**: llama-server started with exactly the argv and environment corrald gave
//!   its child (read from `/proc/PID/cmdline` and `environ`), except that it listens on a
//!   loopback TCP port, as a client would use it.
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

mod common;

use std::time::{Duration, Instant};

use common::{Client, Corrald, env_or, kib_to_mib, median, memory, ms, pin, wait_ready, write_config};
use hyper::body::Bytes;

const MODEL: &str = "chat";

/// The pause before each stream of the "after a pause" rows: longer than corrald keeps an
/// idle connection to a runner (2 s).
const PAUSE: Duration = Duration::from_millis(2500);

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
        let (d, c) = (median(&self.direct), median(&self.corral));
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
    let rounds: usize = env_or("CORRAL_BENCH_ROUNDS", 30);
    let tokens: u64 = env_or("CORRAL_BENCH_TOKENS", 256);
    let pinned = std::env::var("CORRAL_BENCH_PIN").map_or(true, |v| v != "0");
    let cpus = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
    let pinned = pinned && cpus >= 2;
    let last_cpu = (cpus - 1).to_string();

    let llama_server = common::llama_bin_dir().join("llama-server");
    let dir = tempfile::tempdir().expect("tempdir");
    common::tiny_store(dir.path(), MODEL);

    let corral_port = common::free_port();
    let config = write_config(dir.path(), corral_port, &llama_server, "[scheduler]\nkeep_alive = \"1h\"\n");
    if pinned {
        pin(std::process::id(), "0");
    }
    // CORRAL_BENCH_CORRALD names another build, to compare two versions.
    let mut daemon = Corrald::start(dir.path(), &config, &[]);
    let daemon_pid = daemon.pid();

    // The client is single-threaded, so it stays on one CPU and its own cost is the same
    // for both sides.
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    runtime.block_on(wait_ready(corral_port, "/api/version", &mut daemon.process));
    std::thread::sleep(Duration::from_millis(500));
    let idle = memory(daemon_pid);

    let chat = |model: &str, stream: bool| common::chat_body(model, tokens, stream);
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
    let (direct, direct_port, alias, _) =
        runtime.block_on(common::direct_beside(&daemon, pinned.then_some(last_cpu.as_str())));
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
    for (state, m) in [("idle after start", idle), ("model loaded", loaded), ("after the traffic", after)] {
        println!("  {state:<20} | {:6.2} MiB | {:6.2} MiB | {}", m.rss_mib(), kib_to_mib(m.hwm), m.threads);
    }
    println!("  target: idle VmRSS <= 10 MiB");
    drop(direct);
    daemon.stop();
}
