//! Load latency: the supervisor's spawn-to-ready against llama-server's own
//! spawn-to-healthy, on the tiny model, alternating in one run.
//!
//! "Direct" is what a minimal launcher must do at least: spawn llama-server on a UNIX
//! socket, read its stderr until the `listening on` line, and get 200 from `/health`.
//! "corral" is `supervisor::runner::load` doing the same plus log parsing, journal
//! forwarding, the load report and process containment.
//!
//! Run with `cargo bench --bench load_latency` (after `scripts/setup-llama-server.sh`);
//! `CORRAL_BENCH_ROUNDS` sets the number of rounds (default 30).

#![allow(clippy::print_stdout, reason = "a benchmark reports on stdout")]

mod common;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{env_or, ms};

use corral::supervisor::child_log::LogSink;
use corral::supervisor::command::{LoadOptions, ModelFiles, Placement};
use corral::supervisor::runner::{self, RunnerSpec, SupervisorConfig};

/// Spawn llama-server directly and wait until it is healthy; returns the elapsed time.
fn direct(llama_server: &Path, model: &Path, socket: &Path) -> Duration {
    let _ = std::fs::remove_file(socket);
    let start = Instant::now();
    let mut child = Command::new(llama_server)
        .args(["-m"])
        .arg(model)
        .arg("--host")
        .arg(socket)
        .args([
            "-a",
            "tiny",
            "-lv",
            "4",
            "--no-webui",
            "--offline",
            "--metrics",
            "-c",
            "512",
            "-np",
            "1",
            "-fa",
            "auto",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn llama-server");
    let mut lines = BufReader::new(child.stderr.take().expect("stderr")).lines();
    loop {
        let line = lines.next().expect("llama-server exited before listening").expect("read");
        if line.contains("listening on") {
            break;
        }
    }
    let mut stream = std::os::unix::net::UnixStream::connect(socket).expect("connect");
    std::io::Write::write_all(&mut stream, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .expect("send");
    let mut response = String::new();
    std::io::Read::read_to_string(&mut stream, &mut response).expect("read");
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    let elapsed = start.elapsed();
    // llama-server can miss a SIGTERM that comes right after it became ready, so the stop
    // is bounded here as in the supervisor: SIGTERM, a short wait, SIGKILL.
    let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id()).expect("pid"));
    let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
    std::thread::spawn(move || for _ in lines {});
    let deadline = Instant::now() + Duration::from_secs(2);
    while child.try_wait().expect("wait").is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    elapsed
}

fn main() {
    let rounds: usize = env_or("CORRAL_BENCH_ROUNDS", 30);
    let bin = common::llama_bin_dir();
    let llama_server = bin.join("llama-server");
    let dir = tempfile::tempdir().expect("tempdir");
    let model = dir.path().join("tiny-llama.gguf");
    corral::demo_model::write_tiny_llama(&model).expect("write model");
    let config = SupervisorConfig {
        llama_server: llama_server.clone(),
        runtime_dir: dir.path().to_owned(),
        inherited_env: vec![("PATH".into(), std::env::var_os("PATH").unwrap_or_default())],
        log_sink: LogSink::Tracing,
        cgroups: None,
        stop_grace: Duration::from_secs(2),
        worker_link_timeout: Duration::from_secs(3),
    };
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("runtime");
    let mut direct_samples = Vec::with_capacity(rounds);
    let mut corral_samples = Vec::with_capacity(rounds);
    // One warm-up of each, so the page cache holds the binary and the model for both.
    let socket = dir.path().join("direct.sock");
    direct(&llama_server, &model, &socket);
    for round in 0..=rounds {
        let spec = RunnerSpec {
            id: u64::try_from(round).expect("id"),
            model: "tiny".into(),
            files: ModelFiles { model: model.clone(), projector: None, adapters: Vec::new() },
            options: LoadOptions { num_ctx: 512, ..LoadOptions::default() },
            placement: Placement::default(),
            load_timeout: Duration::from_secs(60),
            memory_max: None,
            planned: Vec::new(),
        };
        let (elapsed, reported) = runtime.block_on(async {
            let start = Instant::now();
            let runner = runner::load(&config, &spec).await.expect("load");
            let elapsed = start.elapsed();
            let reported = runner.load_time();
            runner.stop().await;
            (elapsed, reported)
        });
        assert!(reported <= elapsed);
        if round > 0 {
            corral_samples.push(elapsed);
            direct_samples.push(direct(&llama_server, &model, &socket));
        }
    }
    let median = |samples: &[Duration]| {
        Duration::from_secs_f64(common::median(&samples.iter().map(Duration::as_secs_f64).collect::<Vec<_>>()))
    };
    let (d, c) = (median(&direct_samples), median(&corral_samples));
    println!("load latency, tiny model, {rounds} rounds alternating (median, min..max)");
    println!(
        "  direct llama-server spawn -> listening -> /health 200: {:7.2} ms  ({:.2}..{:.2})",
        ms(d),
        ms(*direct_samples.iter().min().expect("samples")),
        ms(*direct_samples.iter().max().expect("samples"))
    );
    println!(
        "  corral supervisor runner::load -> ready:               {:7.2} ms  ({:.2}..{:.2})",
        ms(c),
        ms(*corral_samples.iter().min().expect("samples")),
        ms(*corral_samples.iter().max().expect("samples"))
    );
    println!("  overhead: {:+.2} ms, ratio corral/direct: {:.3}", ms(c) - ms(d), ms(c) / ms(d));
}
