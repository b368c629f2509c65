//! Big model load: corrald loading a 1 GiB model (request to ready) against llama-server's
//! own start with the same arguments, with the page cache warm and cold, and what the
//! projection step (`llama-fit-params`, then llama-server's own dry run) costs on a first load.
//!
//! - The model: a random-weight llama of about 1 GiB (`CORRAL_BENCH_LAYERS`, default 10
//!   layers of 2048 wide, feed-forward 6144, F16), written once into the benchmark's
//!   temporary directory and created in corrald's store (a hard link, no copy).
//! - **corral**: `POST /api/generate` with an empty prompt (Ollama's "load the model") until
//!   the answer; then `keep_alive: 0` unloads it, waited for on `/api/ps`.
//! - **direct**: llama-server started with exactly the argv and environment corrald gave
//!   its child (read from `/proc`), listening on a loopback TCP port: spawn until
//!   `/health` answers 200.
//! - **cold**: `sync` and `echo 3 > /proc/sys/vm/drop_caches` (root) before each load, so the
//!   weights come from the disk; **warm**: the file stays cached.
//! - **projection**: the first load of a fresh corrald (no projection cached; the file
//!   mapped once before by an untimed load, as the warm loads find it) against the
//!   warm loads after it, and `llama-fit-params` and llama-server's dry run each run alone
//!   on the same arguments; then a corrald restarted on the same state directory (the
//!   projections read from `projections.json`).
//!
//! `CORRAL_BENCH_ROUNDS` (default 5) rounds of each, alternating sides. Target: corral's
//! load within 5 ms of direct, plus the projection on a first load only. Run with
//! `cargo bench --bench big_load` (as root, for the cold rows).

#![allow(clippy::print_stdout, reason = "a benchmark reports on stdout")]

mod common;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::{Client, Corrald, env_or, median, ms, start_direct};
use corral::demo_model::{LlamaShape, Weights};
use corral::store::Store;
use corral::store::create::CreateSpec;
use corral::store::modelfile::Modelfile;
use corral::store::name::ModelName;
use hyper::body::Bytes;

const MODEL: &str = "big";

/// Empties the page cache (root only); `false` when it cannot.
fn drop_caches() -> bool {
    let _ = Command::new("sync").status();
    std::fs::write("/proc/sys/vm/drop_caches", "3\n").is_ok()
}

/// Reads `path` whole, so its pages are cached.
fn warm(path: &Path) {
    let mut file = std::fs::File::open(path).expect("open the model");
    std::io::copy(&mut file, &mut std::io::sink()).expect("read the model");
}

/// corrald's load of the model: request to answer.
async fn corral_load(port: u16) -> Duration {
    let mut client = Client::connect(port).await;
    let body = Bytes::from(format!("{{\"model\":\"{MODEL}\",\"prompt\":\"\",\"keep_alive\":\"1h\"}}"));
    let start = Instant::now();
    let response = client.post("/api/generate", &body).await;
    drop(http_body_util::BodyExt::collect(response.into_body()).await.expect("body"));
    start.elapsed()
}

/// Unloads the model; returns once `/api/ps` is empty.
async fn corral_unload(port: u16) {
    let mut client = Client::connect(port).await;
    let body = Bytes::from(format!("{{\"model\":\"{MODEL}\",\"keep_alive\":0}}"));
    drop(client.post("/api/generate", &body).await);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let ps = client.get_body("/api/ps").await.expect("/api/ps");
        let json: serde_json::Value = serde_json::from_slice(&ps).expect("json");
        if json["models"].as_array().is_some_and(Vec::is_empty) {
            return;
        }
        assert!(Instant::now() < deadline, "the model was not unloaded");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// llama-server started as corrald's child was, on a TCP port: spawn to `/health` 200.
async fn direct_load(child: &common::ChildCommand) -> Duration {
    let port = common::free_port();
    let start = Instant::now();
    let (mut process, _) = start_direct(child, port);
    wait_until_healthy(port, &mut process).await;
    let elapsed = start.elapsed();
    process.stop(Duration::from_secs(5));
    elapsed
}

/// `/health` polled every millisecond (finer than `common::wait_ready`'s 5 ms, which
/// would round the direct side up).
async fn wait_until_healthy(port: u16, process: &mut common::Process) {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        assert!(process.0.try_wait().expect("wait").is_none(), "llama-server exited");
        if let Ok(stream) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await {
            drop(stream);
            break;
        }
        assert!(Instant::now() < deadline, "llama-server did not listen");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let mut client = Client::connect(port).await;
    while !client.get("/health").await {
        assert!(Instant::now() < deadline, "llama-server did not become healthy");
        tokio::time::sleep(Duration::from_millis(1)).await;
        client = Client::connect(port).await;
    }
}

fn cell(samples: &[f64]) -> String {
    let lo = samples.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = samples.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    format!("{:.1} ms ({lo:.1}..{hi:.1})", median(samples))
}

#[allow(clippy::too_many_lines, reason = "one linear script of a benchmark")]
fn main() {
    let rounds: usize = env_or("CORRAL_BENCH_ROUNDS", 5);
    let layers: u32 = env_or("CORRAL_BENCH_LAYERS", 10);
    let bin = common::llama_bin_dir();
    let llama_server = bin.join("llama-server");
    let fit_params = common::llama_fit_params(&bin);
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("big.gguf");
    let shape = LlamaShape {
        name: "corral-bench-big-llama",
        n_layer: layers,
        n_embd: 2048,
        n_ff: 6144,
        n_head: 16,
        n_head_kv: 16,
        context: 4096,
        weights: Weights::RandomBits,
    };
    let written = Instant::now();
    corral::demo_model::write_llama(&file, &shape).expect("write the model");
    #[allow(clippy::cast_precision_loss, reason = "a size in GiB for people")]
    let gib = std::fs::metadata(&file).expect("size").len() as f64 / f64::from(1 << 30);
    println!("model: {gib:.2} GiB written in {:.1} s", written.elapsed().as_secs_f64());
    let store = Store::open(&dir.path().join("models")).expect("store");
    let modelfile = Modelfile::parse("FROM ./big.gguf\n").expect("modelfile");
    let spec = CreateSpec::from_modelfile(&modelfile, dir.path()).expect("spec");
    store.create(&ModelName::parse(MODEL).expect("name"), &spec, &mut |_| {}).expect("create");
    drop(store);
    let port = common::free_port();
    let extra = format!("llama_fit_params = {}\n", common::toml_string(&fit_params));
    let config = common::write_config(dir.path(), port, &llama_server, "");
    let text = std::fs::read_to_string(&config).expect("config");
    std::fs::write(&config, text.replace("[runner]\n", &format!("[runner]\n{extra}"))).expect("config");
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    let can_drop = drop_caches();
    warm(&file);
    // The first llama-server to map a file just read into the page cache starts about
    // 25-40 ms slower than the ones after it, corral or not. One untimed load and unload
    // takes that first mapping, so that the timed first load below differs from the warm
    // ones by the projection alone; its projections are then forgotten.
    let primer = Corrald::start(dir.path(), &config, &[]);
    runtime.block_on(corral_load(port));
    runtime.block_on(corral_unload(port));
    primer.stop();
    std::fs::remove_file(dir.path().join("state/projections.json")).expect("forget the projections");

    // A fresh corrald: the first load runs llama-fit-params, then llama-server's dry run.
    let daemon = Corrald::start(dir.path(), &config, &[]);
    let first = ms(runtime.block_on(corral_load(port)));
    let (_, child) = daemon.child_argv();
    let argv = child.argv.clone();
    runtime.block_on(corral_unload(port));
    // llama-fit-params alone, with the model-shaping arguments of the runner's command line.
    let mut fit_args: Vec<String> = Vec::new();
    let mut i = 1;
    while i < argv.len() {
        let flag = argv[i].as_str();
        let takes_value = i + 1 < argv.len() && !argv[i + 1].starts_with('-');
        if ["-m", "-c", "-np", "-ngl", "-ts", "--device", "-fa", "-b", "-ub", "-ctk", "-ctv"].contains(&flag) {
            fit_args.push(flag.to_owned());
            if takes_value {
                fit_args.push(argv[i + 1].clone());
            }
        }
        i += if takes_value { 2 } else { 1 };
    }
    let mut projection_alone = Vec::new();
    for _ in 0..rounds {
        let start = Instant::now();
        let out = Command::new(&fit_params)
            .args(&fit_args)
            .args(["--fit-print", "on"])
            .output()
            .expect("run llama-fit-params");
        assert!(out.status.success(), "llama-fit-params {fit_args:?}: {}", String::from_utf8_lossy(&out.stderr));
        projection_alone.push(ms(start.elapsed()));
    }
    // llama-server's own dry run alone (the exact plan's projection), the same arguments.
    let sockets = tempfile::tempdir().expect("socket directory");
    let dry_run = corral::projection::DryRun {
        llama_server: llama_server.clone(),
        socket_dir: sockets.path().to_owned(),
        timeout: Duration::from_secs(60),
    };
    let dry_args: Vec<std::ffi::OsString> = fit_args.iter().map(std::ffi::OsString::from).collect();
    let mut dry_run_alone = Vec::new();
    for round in 0..rounds {
        let start = Instant::now();
        runtime.block_on(dry_run.project(&dry_args, &[], round as u64, &[])).expect("llama-server's dry run");
        dry_run_alone.push(ms(start.elapsed()));
    }

    let mut warm_corral = Vec::new();
    let mut warm_direct = Vec::new();
    let mut cold_corral = Vec::new();
    let mut cold_direct = Vec::new();
    runtime.block_on(async {
        for round in 0..rounds {
            for is_direct in if round % 2 == 0 { [true, false] } else { [false, true] } {
                if is_direct {
                    warm_direct.push(ms(direct_load(&child).await));
                } else {
                    warm_corral.push(ms(corral_load(port).await));
                    corral_unload(port).await;
                }
            }
        }
        if can_drop {
            for round in 0..rounds {
                for is_direct in if round % 2 == 0 { [true, false] } else { [false, true] } {
                    assert!(drop_caches(), "drop_caches");
                    if is_direct {
                        cold_direct.push(ms(direct_load(&child).await));
                    } else {
                        cold_corral.push(ms(corral_load(port).await));
                        corral_unload(port).await;
                    }
                }
            }
        }
    });
    daemon.stop();
    warm(&file);
    // Restarted on the same state: the projection comes from projections.json.
    let daemon = Corrald::start(dir.path(), &config, &[]);
    let after_restart = ms(runtime.block_on(corral_load(port)));
    runtime.block_on(corral_unload(port));
    daemon.stop();

    println!(
        "big model load: {gib:.2} GiB llama ({layers} layers), CPU, {rounds} rounds alternating; median (min..max)"
    );
    println!("runner argv: {}", argv[1..].join(" "));
    println!();
    println!(
        "| page cache | direct llama-server: spawn -> /health 200 | corral: request -> loaded | corral - direct | target |"
    );
    println!("| --- | --- | --- | --- | --- |");
    println!(
        "| warm | {} | {} | {:+.1} ms | <= +5 ms |",
        cell(&warm_direct),
        cell(&warm_corral),
        median(&warm_corral) - median(&warm_direct)
    );
    if can_drop {
        println!(
            "| cold | {} | {} | {:+.1} ms | <= +5 ms |",
            cell(&cold_direct),
            cell(&cold_corral),
            median(&cold_corral) - median(&cold_direct)
        );
    } else {
        println!("| cold | not measured: cannot write /proc/sys/vm/drop_caches (not root?) | | | |");
    }
    println!();
    println!("| projection (llama-fit-params to plan, llama-server's dry run for the plan) | time |");
    println!("| --- | --- |");
    println!("| first load of a fresh corrald (projection made), warm cache | {first:.1} ms |");
    println!("| warm loads after it (projection cached in memory), median | {:.1} ms |", median(&warm_corral));
    println!(
        "| first load minus the cached ones: what the projection costs a first load | {:+.1} ms |",
        first - median(&warm_corral)
    );
    println!("| llama-fit-params alone, same arguments, median | {} |", cell(&projection_alone));
    println!("| llama-server's dry run alone, same arguments, median | {} |", cell(&dry_run_alone));
    println!("| first load after a restart (projection from projections.json) | {after_restart:.1} ms |");
}
