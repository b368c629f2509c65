//! Many clients: streaming throughput and fairness through corrald against the same
//! clients straight to llama-server, and corrald holding many idle connections.
//!
//! - **streams**: corrald with `[scheduler] num_parallel = 4` on the tiny llama
//!   (`PARAMETER num_thread 1`, kept loaded), and llama-server started again with exactly
//!   the argv and environment corrald gave its child (`-np 4`), listening on a loopback TCP port. For 1, 8,
//!   64 and 256 concurrent clients (`CORRAL_BENCH_CLIENTS`), each side in turn
//!   (`CORRAL_BENCH_ROUNDS` rounds, default 3, alternating which goes first): every client
//!   streams `/v1/chat/completions` of `CORRAL_BENCH_TOKENS` (default 32) tokens
//!   (`max_tokens` + `ignore_eos`), each on a new connection (llama-server closes one after
//!   a stream), until `max(2 × clients, 32)` requests are done. Measured: tokens/s over the
//!   round's wall time (the reported `completion_tokens` summed, checked equal to the asked
//!   count), requests lost (any error, or a wrong count), and time to the first content
//!   frame (p50, p99) over all requests: queueing included, so p99 shows fairness.
//!   Pinned as in `http_overhead`: both llama-servers on the last CPU, corrald and the
//!   client on CPU 0 (`CORRAL_BENCH_PIN=0` leaves them free).
//! - **idle connections**: `CORRAL_BENCH_IDLE` (default 10 000) keep-alive connections to
//!   corrald, each after one `GET /api/version`, left open; corrald's RSS and open files
//!   before and after (RSS per connection), a request on a new connection (`/api/version`,
//!   `/api/tags`, a streamed chat's first token) before and while they are open, and
//!   whether the idle ones still answer. corrald closes an idle connection after `[server]
//!   header_timeout`; the benchmark sets it to 5 minutes so they stay for the measurement.
//!
//! Targets: tokens/s ≥ 0.95× direct at every level, no request lost; 10 000 idle
//! connections held with corrald still answering at its usual speed. Run with
//! `cargo bench --bench many_clients`.

#![allow(clippy::print_stdout, reason = "a benchmark reports on stdout")]

mod common;

use std::time::{Duration, Instant};

use common::{Client, Corrald, env_or, median, memory, ms, percentile, pin, stream_once};
use hyper::body::Bytes;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const MODEL: &str = "chat";

/// One side's round at one level.
#[derive(Default)]
struct Round {
    tokens: u64,
    wall: Duration,
    lost: usize,
    ttft: Vec<f64>,
    first_error: Option<String>,
}

/// `clients` concurrent clients streaming `body` to `port` until `total` requests are done.
async fn round(port: u16, clients: usize, total: usize, body: &Bytes, tokens: u64) -> Round {
    let next = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let start = Instant::now();
    let tasks: Vec<_> = (0..clients)
        .map(|_| {
            let (next, body) = (std::sync::Arc::clone(&next), body.clone());
            tokio::spawn(async move {
                let mut mine = Round::default();
                while next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) < total {
                    match stream_once(port, "/v1/chat/completions", &body, "completion_tokens").await {
                        Ok((first, _, count)) if count == tokens => {
                            mine.tokens += count;
                            mine.ttft.push(ms(first));
                        }
                        Ok((_, _, count)) => {
                            mine.lost += 1;
                            mine.first_error.get_or_insert(format!("{count} tokens instead of {tokens}"));
                        }
                        Err(e) => {
                            mine.lost += 1;
                            mine.first_error.get_or_insert(e);
                        }
                    }
                }
                mine
            })
        })
        .collect();
    let mut all = Round::default();
    for task in tasks {
        let mine = task.await.expect("client task");
        all.tokens += mine.tokens;
        all.lost += mine.lost;
        all.ttft.extend(mine.ttft);
        if all.first_error.is_none() {
            all.first_error = mine.first_error;
        }
    }
    all.wall = start.elapsed();
    all
}

/// Opens `count` connections to `port`, each after one `GET /api/version` answered; the
/// connections, and how many failed.
async fn open_idle(port: u16, count: usize) -> (Vec<tokio::net::TcpStream>, usize) {
    let mut open = Vec::with_capacity(count);
    let mut failed = 0;
    for _ in 0..count {
        match one_request(None, port).await {
            Ok(stream) => open.push(stream),
            Err(_) => failed += 1,
        }
    }
    (open, failed)
}

/// `GET /api/version` on `stream` (a new connection when `None`), its whole answer read;
/// the connection, kept alive.
async fn one_request(stream: Option<tokio::net::TcpStream>, port: u16) -> std::io::Result<tokio::net::TcpStream> {
    let mut stream = match stream {
        Some(stream) => stream,
        None => tokio::net::TcpStream::connect(("127.0.0.1", port)).await?,
    };
    stream.write_all(format!("GET /api/version HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n").as_bytes()).await?;
    let mut answer = Vec::with_capacity(512);
    let mut buf = [0u8; 1024];
    loop {
        let n = stream.read(&mut buf).await?;
        if n == 0 {
            return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "closed"));
        }
        answer.extend_from_slice(&buf[..n]);
        if let Some(head) = common::find(&answer, b"\r\n\r\n", 0) {
            let text = String::from_utf8_lossy(&answer[..head]).to_ascii_lowercase();
            let length: usize = text
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0);
            if answer.len() >= head + 4 + length {
                if !text.starts_with("http/1.1 200") {
                    return Err(std::io::Error::other(text));
                }
                return Ok(stream);
            }
        }
    }
}

/// What a new client sees: the median ms of `rounds` GETs of `/api/version` and of
/// `/api/tags` on new connections, and of ten streamed chats' first token.
async fn responsiveness(port: u16, chat: &Bytes, rounds: usize) -> (f64, f64, f64) {
    let version = fresh_gets(port, "/api/version", rounds).await;
    let tags = fresh_gets(port, "/api/tags", rounds).await;
    let mut ttft = Vec::new();
    for _ in 0..TTFT_ROUNDS {
        ttft.push(ms(stream_once(port, "/v1/chat/completions", chat, "completion_tokens").await.expect("chat").0));
    }
    (version, tags, median(&ttft))
}

/// Streamed chats timed by [`responsiveness`].
const TTFT_ROUNDS: usize = 10;

/// Median ms of `rounds` calls of GET `path` on new connections.
async fn fresh_gets(port: u16, path: &str, rounds: usize) -> f64 {
    let mut samples = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        let start = Instant::now();
        let mut client = Client::connect(port).await;
        assert!(client.get(path).await, "GET {path}");
        samples.push(ms(start.elapsed()));
    }
    median(&samples)
}

#[allow(clippy::too_many_lines, reason = "one linear script of a benchmark")]
fn main() {
    let levels: Vec<usize> = std::env::var("CORRAL_BENCH_CLIENTS")
        .unwrap_or_else(|_| "1,8,64,256".to_owned())
        .split(',')
        .map(|n| n.trim().parse().expect("a number of clients"))
        .collect();
    let rounds: usize = env_or("CORRAL_BENCH_ROUNDS", 3);
    let tokens: u64 = env_or("CORRAL_BENCH_TOKENS", 32);
    let idle: usize = env_or("CORRAL_BENCH_IDLE", 10_000);
    let pinned = std::env::var("CORRAL_BENCH_PIN").map_or(true, |v| v != "0");
    let cpus = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
    let pinned = pinned && cpus >= 2;
    let last_cpu = (cpus - 1).to_string();
    // Every connection is a file, on both ends; corrald inherits the limit (and raises its
    // soft limit to the hard one, as under systemd with LimitNOFILE=65536).
    let nofile = common::raise_nofile(65_536);
    assert!(nofile > u64::try_from(idle).expect("count") + 1000, "the open-files limit {nofile} is too low");

    let llama_server = common::llama_bin_dir().join("llama-server");
    let dir = tempfile::tempdir().expect("tempdir");
    common::tiny_store(dir.path(), MODEL);
    let port = common::free_port();
    let config =
        common::write_config(dir.path(), port, &llama_server, "[scheduler]\nkeep_alive = \"1h\"\nnum_parallel = 4\n");
    let config_text = std::fs::read_to_string(&config).expect("config");
    std::fs::write(&config, config_text.replace("[store]", "header_timeout = \"5min\"\n[store]")).expect("config");
    if pinned {
        pin(std::process::id(), "0");
    }
    let daemon = Corrald::start(dir.path(), &config, &[]);
    let daemon_pid = daemon.pid();
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    let chat = |model: &str| common::chat_body(model, tokens, true);
    runtime.block_on(async {
        let mut client = Client::connect(port).await;
        let (_, _, count) = client.stream("/v1/chat/completions", &chat(MODEL), "completion_tokens").await;
        assert_eq!(count, tokens);
    });
    let (direct, direct_port, alias, argv) =
        runtime.block_on(common::direct_beside(&daemon, pinned.then_some(last_cpu.as_str())));
    assert!(argv.windows(2).any(|w| w[0] == "-np" && w[1] == "4"), "the runner has 4 slots: {argv:?}");
    let (direct_body, corral_body) = (chat(&alias), chat(MODEL));

    println!(
        "many clients: tiny llama, num_parallel 4, {tokens} tokens a stream, {rounds} rounds alternating, {}, {cpus} CPUs",
        if pinned { "llama-servers pinned to the last CPU, corrald and client to CPU 0" } else { "unpinned" }
    );
    println!();
    println!(
        "| clients | requests | direct tok/s | corral tok/s | corral/direct | lost (direct / corral) | \
         TTFT p50 direct / corral | TTFT p99 direct / corral |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- |");
    for &clients in &levels {
        let total = (2 * clients).max(32);
        let (mut d_rates, mut c_rates, mut d_ttft, mut c_ttft) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let (mut d_lost, mut c_lost) = (0, 0);
        let mut errors = Vec::new();
        runtime.block_on(async {
            // One untimed round each, to warm both up at this level.
            round(direct_port, clients, clients, &direct_body, tokens).await;
            round(port, clients, clients, &corral_body, tokens).await;
            for r in 0..rounds {
                for is_direct in if r % 2 == 0 { [true, false] } else { [false, true] } {
                    let (p, body) = if is_direct { (direct_port, &direct_body) } else { (port, &corral_body) };
                    let result = round(p, clients, total, body, tokens).await;
                    #[allow(clippy::cast_precision_loss, reason = "token counts are small")]
                    let rate = result.tokens as f64 / result.wall.as_secs_f64();
                    let (rates, ttft, lost) = if is_direct {
                        (&mut d_rates, &mut d_ttft, &mut d_lost)
                    } else {
                        (&mut c_rates, &mut c_ttft, &mut c_lost)
                    };
                    rates.push(rate);
                    ttft.extend(result.ttft);
                    *lost += result.lost;
                    errors.extend(
                        result.first_error.map(|e| format!("{}: {e}", if is_direct { "direct" } else { "corral" })),
                    );
                }
            }
        });
        let (d, c) = (median(&d_rates), median(&c_rates));
        let p = |v: &[f64], q: f64| if v.is_empty() { f64::NAN } else { percentile(v, q) };
        println!(
            "| {clients} | {} | {d:.0} | {c:.0} | {:.3} | {d_lost} / {c_lost} | {:.2} / {:.2} ms | {:.2} / {:.2} ms |",
            total * rounds,
            c / d,
            p(&d_ttft, 50.0),
            p(&c_ttft, 50.0),
            p(&d_ttft, 99.0),
            p(&c_ttft, 99.0),
        );
        for e in errors {
            println!("  first error: {e}");
        }
    }
    println!("target: corral/direct >= 0.95 at every level, 0 lost");
    drop(direct);

    // Idle connections.
    let before = memory(daemon_pid);
    let fds_before = common::open_fds(daemon_pid);
    let rounds_fresh = 50;
    let (version_before, tags_before, ttft_before) = runtime.block_on(responsiveness(port, &corral_body, rounds_fresh));
    let start = Instant::now();
    let (open, failed) = runtime.block_on(open_idle(port, idle));
    let opened_in = start.elapsed();
    std::thread::sleep(Duration::from_millis(500));
    let held = memory(daemon_pid);
    let fds_held = common::open_fds(daemon_pid);
    let (version_held, tags_held, ttft_held) = runtime.block_on(responsiveness(port, &corral_body, rounds_fresh));
    let still = runtime.block_on(async {
        // Every hundredth idle connection asked again: still open, still answering.
        let mut still = 0;
        let mut checked = 0;
        let mut kept = Vec::with_capacity(open.len());
        for (i, stream) in open.into_iter().enumerate() {
            if i % 100 == 0 {
                checked += 1;
                if let Ok(stream) = one_request(Some(stream), port).await {
                    still += 1;
                    kept.push(stream);
                }
            } else {
                kept.push(stream);
            }
        }
        (still, checked, kept)
    });
    let (still, checked, kept) = still;
    let per_connection =
        (held.rss.saturating_sub(before.rss) * 1024) / u64::try_from(kept.len().max(1)).expect("count");
    println!();
    println!(
        "idle keep-alive connections: {} open ({failed} failed) in {:.2} s; {still} of {checked} asked again answered",
        kept.len(),
        opened_in.as_secs_f64()
    );
    println!("| corrald | before | with the connections open |");
    println!("| --- | --- | --- |");
    println!("| VmRSS | {:.2} MiB | {:.2} MiB |", before.rss_mib(), held.rss_mib());
    println!("| RssAnon | {:.2} MiB | {:.2} MiB |", common::kib_to_mib(before.anon), common::kib_to_mib(held.anon));
    println!("| open files | {fds_before} | {fds_held} |");
    println!("| threads | {} | {} |", before.threads, held.threads);
    println!(
        "| GET /api/version, new connection (median of {rounds_fresh}) | {version_before:.3} ms | {version_held:.3} ms |"
    );
    println!("| GET /api/tags, new connection (median of {rounds_fresh}) | {tags_before:.3} ms | {tags_held:.3} ms |");
    println!("| streamed chat TTFT (median of {TTFT_ROUNDS}) | {ttft_before:.3} ms | {ttft_held:.3} ms |");
    println!("RSS per idle connection: {per_connection} bytes");
    drop(kept);
    daemon.stop();
}
