//! The rig: local `rpc-server`s are llama.cpp devices (`RPC0`, `RPC1`, in the order of
//! `--rpc`) and the rig's random-weight llama (`LlamaShape::rig`: 16 layers, 121 MiB) is
//! split across them or placed whole on one, on the real `llama-server` and
//! `llama-fit-params`, without a GPU.
//!
//! What these tests measured on b11434 (the figures are in `docs/benchmarks.md`, "Projection
//! accuracy on the rig"):
//!
//! * `llama-fit-params --fit-print on` prints each figure as the buffer's size rounded down
//!   to whole MiB, with one exception: in a split, the device that holds the output layer
//!   gets a compute projection above the real buffer (31 MiB against 27.04), because the
//!   tool reserves the graph for a whole micro-batch of outputs (512) where llama-server
//!   reserves for one output per slot (4).
//! * llama-server's own `--fit` dry run (corral's projection of an exact plan) reserves
//!   the graph as the load does: its compute buffer lines are the load's to the hundredth
//!   of a MiB on every device, the output layer's included.
//! * llama.cpp names a device's buffers by the worker's own device and its endpoint:
//!   `RPC0[127.0.0.1:PORT]` for both workers (each has one device, its `RPC0`), while the
//!   client calls the devices `RPC0` and `RPC1`.
//! * A worker over its cgroup's memory limit is killed by the kernel's OOM killer (an
//!   allocation never fails, only touched pages count), and llama-server aborts with
//!   `Remote RPC server crashed or returned malformed response`: a lost worker, not an
//!   out-of-memory line.  A worker whose allocation really fails (an address-space limit)
//!   makes the load fail with `unable to allocate RPC0[127.0.0.1:PORT] buffer`.

use std::io::{ErrorKind, Read, Write};
use std::os::unix::net::UnixStream;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use corral::demo_model::{LlamaShape, write_llama};
use corral::supervisor::logparse::{BufferKind, ErrorClass, LoadReport};
use nix::sys::signal::Signal;

use crate::support::llama::{self, LlamaServer, MemoryLimit, RpcServer};

const MIB: u64 = 1 << 20;

/// How long `llama-fit-params` may take (0.1–1.2 s measured).
const FIT_TIMEOUT: Duration = Duration::from_secs(60);

/// The rig's llama in a fresh temporary directory (about 1.3 s in a debug build).
fn rig_model() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("rig-llama.gguf");
    write_llama(&path, &LlamaShape::rig()).expect("write the rig's llama");
    (dir, path)
}

/// `--rpc A,B` for these workers.
fn rpc_arg(workers: &[&RpcServer]) -> String {
    workers.iter().map(|w| w.endpoint()).collect::<Vec<_>>().join(",")
}

/// One line of `llama-fit-params --fit-print on`: a device's projection in MiB.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Projection {
    device: String,
    model: u64,
    context: u64,
    compute: u64,
}

/// Runs `llama-fit-params -m MODEL ARGS --fit-print on` (bounded) and parses its lines.
fn fit_print(model: &Path, args: &[&str]) -> Vec<Projection> {
    let mut cmd = Command::new(llama::fit_params());
    cmd.arg("-m").arg(model).args(args).args(["--fit-print", "on"]);
    let out = crate::support::container::output_within(&mut cmd, FIT_TIMEOUT);
    let (status, stdout, stderr) =
        (out.status, String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr));
    assert!(status.success(), "llama-fit-params {args:?}: {status}\n{stdout}\n{stderr}");
    stdout
        .lines()
        .map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let mib = |i: usize| -> u64 {
                fields
                    .get(i)
                    .and_then(|f| f.parse().ok())
                    .unwrap_or_else(|| panic!("not `NAME model context compute`: {line:?}"))
            };
            assert_eq!(fields.len(), 4, "not `NAME model context compute`: {line:?}");
            Projection { device: fields[0].to_owned(), model: mib(1), context: mib(2), compute: mib(3) }
        })
        .collect()
}

/// What llama-server reported for one device, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Actual {
    model: u64,
    context: u64,
    compute: u64,
}

impl Actual {
    /// The buffers whose name `matches`, from the report of a load: model weights; the KV
    /// cache, recurrent state and output buffer as context; compute.
    fn of(report: &LoadReport, matches: impl Fn(&str) -> bool) -> Self {
        let sum = |kinds: &[BufferKind]| -> u64 {
            report.buffers().filter(|(key, _)| matches(&key.buffer) && kinds.contains(&key.kind)).map(|(_, b)| b).sum()
        };
        Self {
            model: sum(&[BufferKind::Model]),
            context: sum(&[BufferKind::Kv, BufferKind::RecurrentState, BufferKind::Output]),
            compute: sum(&[BufferKind::Compute]),
        }
    }
}

/// The report of everything the server printed so far.
fn report_of(lines: &[String]) -> LoadReport {
    let mut report = LoadReport::new();
    for line in lines {
        let _ = report.feed(line);
    }
    report
}

/// The buffer name llama.cpp gives a worker's (only) device.
fn rpc_buffer(worker: &RpcServer) -> String {
    format!("RPC0[{}]", worker.endpoint())
}

#[test]
fn llama_server_s_dry_run_projects_each_device_as_the_load_allocates_it() {
    let (_dir, model) = rig_model();
    let (a, b) = (RpcServer::start_free(), RpcServer::start_free());
    let rpc = rpc_arg(&[&a, &b]);
    // A partial offload whose second device holds one block and the output layer, with 4
    // slots: where llama-fit-params' compute is furthest off.
    let args =
        ["--rpc", &rpc, "--device", "RPC0,RPC1", "-ngl", "4", "-ts", "2,2", "--fit", "off", "-c", "2048", "-np", "4"];
    let sockets = tempfile::tempdir().expect("socket directory");
    let dry_run = corral::projection::DryRun {
        llama_server: llama::bin_dir().join("llama-server"),
        socket_dir: sockets.path().to_owned(),
        timeout: FIT_TIMEOUT,
    };
    let buffers = [("RPC0".to_owned(), rpc_buffer(&a)), ("RPC1".to_owned(), rpc_buffer(&b))];
    let mut full_args = vec![std::ffi::OsString::from("-m"), model.clone().into_os_string()];
    full_args.extend(args.iter().map(std::ffi::OsString::from));
    let started = Instant::now();
    let dry = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
        .block_on(dry_run.project(&full_args, &[], 1, &buffers))
        .expect("the dry run projects the load");
    eprintln!("the dry run took {:?}: {dry:?}", started.elapsed());
    assert_eq!(std::fs::read_dir(sockets.path()).expect("read").count(), 0, "its socket is removed");
    let fit = fit_print(&model, &args);

    let server = LlamaServer::start(&model, &args);
    let report = report_of(&server.stderr_lines());
    let actual = [
        ("RPC0", Actual::of(&report, |name| name == rpc_buffer(&a))),
        ("RPC1", Actual::of(&report, |name| name == rpc_buffer(&b))),
        ("Host", Actual::of(&report, corral::supervisor::logparse::is_host_buffer)),
    ];
    for (device, actual) in actual {
        let projected = if device == "Host" { dry.host() } else { dry.device(device).expect("a row") };
        eprintln!("{device}: dry run {projected:?}, llama-server {actual:?}");
        assert_eq!(projected.compute, actual.compute, "{device}: the compute is the load's own");
        assert_eq!(projected.model, actual.model / MIB * MIB, "{device}: the model in whole MiB, rounded down");
        assert_eq!(projected.context, actual.context / MIB * MIB, "{device}: the context in whole MiB, rounded down");
    }
    // llama-fit-params, for comparison, is more than 4 MiB high on the output layer's device.
    let on_b = actual[1].1.compute;
    let fit_b = projection(&fit, "RPC1").compute * MIB;
    assert!(fit_b > on_b + 4 * MIB, "llama-fit-params: {fit_b} bytes of compute on RPC1, llama-server {on_b}");
}

/// A row of the accuracy table, printed for `docs/benchmarks.md`.
#[allow(clippy::cast_precision_loss, reason = "sizes of a few hundred MiB, printed with two decimals")]
fn print_row(device: &str, projection: &Projection, actual: Actual) {
    let mib = |b: u64| b as f64 / MIB as f64;
    let projected = projection.model + projection.context + projection.compute;
    let real = mib(actual.model + actual.context + actual.compute);
    eprintln!(
        "| {device} | {} / {} / {} | {:.2} / {:.2} / {:.2} | {:+.1} % |",
        projection.model,
        projection.context,
        projection.compute,
        mib(actual.model),
        mib(actual.context),
        mib(actual.compute),
        (projected as f64 - real) / real * 100.0
    );
}

/// The projection is the real size rounded down to whole MiB.
fn assert_floor(what: &str, projected_mib: u64, actual_bytes: u64) {
    assert_eq!(
        projected_mib,
        actual_bytes / MIB,
        "{what}: projected {projected_mib} MiB, llama-server {actual_bytes} bytes"
    );
}

/// The per-device total is within 5 % of the real one.
fn assert_total_within_5_percent(what: &str, projection: &Projection, actual: Actual) {
    let projected = (projection.model + projection.context + projection.compute) * MIB;
    let real = actual.model + actual.context + actual.compute;
    assert!(projected.abs_diff(real) * 20 <= real, "{what}: projected {projected} bytes, llama-server {real}");
}

/// The projection of every device by name.
fn projection<'a>(projections: &'a [Projection], device: &str) -> &'a Projection {
    projections.iter().find(|p| p.device == device).unwrap_or_else(|| panic!("no {device} in {projections:?}"))
}

#[test]
fn a_split_across_two_workers_is_projected_as_llama_server_allocates_it() {
    let (_dir, model) = rig_model();
    let (a, b) = (RpcServer::start_free(), RpcServer::start_free());
    let rpc = rpc_arg(&[&a, &b]);
    let args = ["--rpc", &rpc, "--device", "RPC0,RPC1", "-ngl", "99", "-ts", "1,1", "--fit", "off", "-c", "2048"];

    let started = Instant::now();
    let projections = fit_print(&model, &args);
    eprintln!("llama-fit-params took {:?}: {projections:?}", started.elapsed());
    let devices: Vec<&str> = projections.iter().map(|p| p.device.as_str()).collect();
    assert_eq!(devices, ["RPC0", "RPC1", "Host"]);

    let mut server = LlamaServer::start(&model, &args);
    let stderr = server.stderr_lines();
    let report = report_of(&stderr);
    let (buffer_a, buffer_b) = (rpc_buffer(&a), rpc_buffer(&b));
    let names: std::collections::BTreeSet<&str> = report.buffers().map(|(key, _)| key.buffer.as_str()).collect();
    assert_eq!(
        names,
        [buffer_a.as_str(), buffer_b.as_str(), "CPU", "CPU_Mapped"].into_iter().collect(),
        "each worker's device is its own RPC0, named with its endpoint"
    );
    let offload = report.offload().expect("an offload line");
    assert_eq!((offload.gpu_layers, offload.total_layers), (17, 17), "16 layers and the output layer");

    let on_a = Actual::of(&report, |name| name == buffer_a);
    let on_b = Actual::of(&report, |name| name == buffer_b);
    let host = Actual::of(&report, corral::supervisor::logparse::is_host_buffer);
    let (rpc0, rpc1, host_projection) =
        (projection(&projections, "RPC0"), projection(&projections, "RPC1"), projection(&projections, "Host"));
    for (device, p, actual) in [("RPC0", rpc0, on_a), ("RPC1", rpc1, on_b), ("Host", host_projection, host)] {
        print_row(device, p, actual);
    }
    // -ts 1,1 over 17 layers: 9 repeating layers on RPC0, 7 and the output layer on RPC1.
    assert!(on_a.model > on_b.model && on_b.model > 0, "{on_a:?} {on_b:?}");
    for (device, p, actual) in [("RPC0", rpc0, on_a), ("RPC1", rpc1, on_b), ("Host", host_projection, host)] {
        assert_floor(&format!("{device} model"), p.model, actual.model);
        assert_floor(&format!("{device} context"), p.context, actual.context);
    }
    // The host's few MiB lose up to 10 % to the rounding down; the devices' totals hold.
    assert_total_within_5_percent("RPC0", rpc0, on_a);
    assert_total_within_5_percent("RPC1", rpc1, on_b);
    assert_floor("RPC0 compute", rpc0.compute, on_a.compute);
    assert_floor("Host compute", host_projection.compute, host.compute);
    // The device with the output layer: llama-fit-params reserves the graph for 512 outputs,
    // llama-server for 4 (one per slot), so the projection is above, by at most 5 MiB here.
    let over = (rpc1.compute * MIB).checked_sub(on_b.compute).expect("RPC1's compute projection is an upper bound");
    assert!(over < 5 * MIB, "RPC1 compute: projected {} MiB, llama-server {} bytes", rpc1.compute, on_b.compute);

    // The split works: a completion and a chat (the tiny llama's vocabulary and template)
    // turn out tokens.
    let answer = server.post_json("/completion", &serde_json::json!({"prompt": "hello world", "n_predict": 8}));
    assert_eq!(answer["tokens_predicted"], 8, "{answer}");
    let chat = server.post_json(
        "/v1/chat/completions",
        &serde_json::json!({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}),
    );
    assert_eq!(chat["usage"]["completion_tokens"], 4, "{chat}");
    let status = server.stop();
    assert!(status.success(), "{status}");
}

#[test]
fn a_model_whole_on_one_worker_is_projected_as_llama_server_allocates_it() {
    let (_dir, model) = rig_model();
    let (a, b) = (RpcServer::start_free(), RpcServer::start_free());
    let rpc = rpc_arg(&[&a, &b]);
    let args = ["--rpc", &rpc, "--device", "RPC1", "-ngl", "99", "--fit", "off", "-c", "2048"];

    let projections = fit_print(&model, &args);
    let devices: Vec<&str> = projections.iter().map(|p| p.device.as_str()).collect();
    assert_eq!(devices, ["RPC1", "Host"], "only the device named");

    let server = LlamaServer::start(&model, &args);
    let report = report_of(&server.stderr_lines());
    let buffer_b = rpc_buffer(&b);
    assert!(
        report
            .buffers()
            .all(|(key, _)| key.buffer == buffer_b || corral::supervisor::logparse::is_host_buffer(&key.buffer))
    );
    let on_b = Actual::of(&report, |name| name == buffer_b);
    let host = Actual::of(&report, corral::supervisor::logparse::is_host_buffer);
    let (rpc1, host_projection) = (projection(&projections, "RPC1"), projection(&projections, "Host"));
    print_row("RPC1", rpc1, on_b);
    print_row("Host", host_projection, host);
    // Every weight but the token embeddings (0.60 MiB, kept on the host) is on the device.
    assert!(on_b.model > 120 * MIB, "{on_b:?}");
    for (device, p, actual) in [("RPC1", rpc1, on_b), ("Host", host_projection, host)] {
        assert_floor(&format!("{device} model"), p.model, actual.model);
        assert_floor(&format!("{device} context"), p.context, actual.context);
        assert_floor(&format!("{device} compute"), p.compute, actual.compute);
    }
    assert_total_within_5_percent("RPC1", rpc1, on_b);
}

/// llama.cpp's lines for a broken worker connection: the abort, and the transport's error,
/// in either order (the abort is printed at once, the error through the log thread); the
/// failure message is the first of them.  The transport's error is a failed send or a
/// failed receive, depending on where the client was in its exchange when the worker went.
fn assert_worker_lost_lines(report: &LoadReport, stderr: &str) {
    const ABORT: &str = "Remote RPC server crashed or returned malformed response";
    assert!(stderr.lines().any(|l| l.contains("ggml-rpc.cpp:") && l.ends_with(ABORT)), "stderr:\n{stderr}");
    let message = report.failure_message().expect("a failure line");
    assert!(
        message.ends_with(ABORT)
            || message.starts_with("send failed (bytes_sent=")
            || message.starts_with("recv failed (bytes_recv="),
        "{message}"
    );
}

/// The share of worker B in the split above: 53.13 MiB of weights, 14 MiB of KV cache and
/// 27.04 MiB of compute buffer.  Half of it cannot hold the weights.
const HALF_OF_B: u64 = 48 * MIB;

#[test]
fn a_worker_over_its_memory_cgroup_is_oom_killed_and_the_load_fails_as_a_lost_worker() {
    let (_dir, model) = rig_model();
    let a = RpcServer::start_free();
    let mut b = RpcServer::start_limited(MemoryLimit::Cgroup(HALF_OF_B));
    let rpc = rpc_arg(&[&a, &b]);
    let args = ["--rpc", &rpc, "--device", "RPC0,RPC1", "-ngl", "99", "-ts", "1,1", "--fit", "off", "-c", "2048"];

    let failed = LlamaServer::start_to_fail(&model, &args);
    let stderr = failed.stderr.join("\n");
    eprintln!("llama-server ended ({}) after {:?}", failed.status, failed.took);
    // The worker was killed by the OOM killer as its weights arrived.
    let worker = b.wait_exit(Duration::from_secs(10)).expect("the worker is gone");
    assert_eq!(worker.signal(), Some(Signal::SIGKILL as i32), "{worker}; worker output:\n{}", b.output());
    assert!(b.oom_kills().is_some_and(|n| n >= 1), "no OOM kill in {:?}", b.cgroup());
    // llama-server aborts, and says only that the worker went.
    assert_eq!(failed.status.signal(), Some(Signal::SIGABRT as i32), "{}; stderr:\n{stderr}", failed.status);
    let report = report_of(&failed.stderr);
    assert_eq!(report.failure_class(), Some(ErrorClass::WorkerLost), "stderr:\n{stderr}");
    assert_worker_lost_lines(&report, &stderr);
    assert!(!report.model_loaded(), "stderr:\n{stderr}");
}

#[test]
fn a_worker_whose_allocation_fails_makes_the_load_fail_out_of_memory_naming_its_buffer() {
    let (_dir, model) = rig_model();
    let a = RpcServer::start_free();
    // 40 MiB of address space: rpc-server itself maps about 9 MiB, its weights need 53 MiB.
    let mut b = RpcServer::start_limited(MemoryLimit::AddressSpace(40 * 1024));
    let rpc = rpc_arg(&[&a, &b]);
    let args = ["--rpc", &rpc, "--device", "RPC0,RPC1", "-ngl", "99", "-ts", "1,1", "--fit", "off", "-c", "2048"];

    let failed = LlamaServer::start_to_fail(&model, &args);
    let stderr = failed.stderr.join("\n");
    eprintln!("llama-server ended ({}) after {:?}", failed.status, failed.took);
    assert_eq!(failed.status.code(), Some(1), "a load error, no crash; stderr:\n{stderr}");
    let report = report_of(&failed.stderr);
    assert_eq!(report.failure_class(), Some(ErrorClass::OutOfMemory), "stderr:\n{stderr}");
    let message = report.failure_message().expect("a failure line");
    assert!(message.contains(&format!("failed to allocate {} buffer", rpc_buffer(&b))), "{message}");
    // The worker lives on: only its allocation failed.
    assert_eq!(b.wait_exit(Duration::ZERO), None, "worker output:\n{}", b.output());
    assert!(b.output().contains("failed to allocate buffer"), "worker output:\n{}", b.output());
}

/// A streamed `POST /completion` on the server's socket, read as it comes.
struct Stream {
    socket: UnixStream,
    received: Vec<u8>,
}

impl Stream {
    fn open(server: &LlamaServer, body: &serde_json::Value) -> Self {
        let mut socket = UnixStream::connect(server.socket()).expect("connect to llama-server");
        socket.set_read_timeout(Some(Duration::from_secs(60))).expect("read timeout");
        let body = body.to_string();
        let head = format!(
            "POST /completion HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\n\r\n",
            body.len()
        );
        socket.write_all(head.as_bytes()).and_then(|()| socket.write_all(body.as_bytes())).expect("send");
        Self { socket, received: Vec::new() }
    }

    fn events(&self) -> usize {
        String::from_utf8_lossy(&self.received).matches("data: ").count()
    }

    /// Reads until `n` events arrived (each read bounded by the socket's timeout).
    fn wait_events(&mut self, n: usize) {
        let mut buf = [0; 4096];
        while self.events() < n {
            let read = self.socket.read(&mut buf).expect("read the stream");
            assert!(read > 0, "the stream ended early: {}", String::from_utf8_lossy(&self.received));
            self.received.extend_from_slice(&buf[..read]);
        }
    }

    /// Reads to the end: `Ok` on a closed connection, else the error's kind.
    fn finish(&mut self) -> Result<(), ErrorKind> {
        let mut rest = Vec::new();
        let result = self.socket.read_to_end(&mut rest).map(drop).map_err(|e| e.kind());
        self.received.extend_from_slice(&rest);
        result
    }
}

#[test]
fn a_worker_killed_under_a_streamed_completion_crashes_llama_server_as_a_lost_worker() {
    let (_dir, model) = rig_model();
    let (a, mut b) = (RpcServer::start_free(), RpcServer::start_free());
    let rpc = rpc_arg(&[&a, &b]);
    let args = ["--rpc", &rpc, "--device", "RPC0,RPC1", "-ngl", "99", "-ts", "1,1", "--fit", "off", "-c", "2048"];
    let mut server = LlamaServer::start(&model, &args);

    let mut stream =
        Stream::open(&server, &serde_json::json!({"prompt": "hello world", "n_predict": 1500, "stream": true}));
    stream.wait_events(5);
    let killed = Instant::now();
    let worker = b.kill();
    assert_eq!(worker.signal(), Some(Signal::SIGKILL as i32));

    let status = server.wait_exit(Duration::from_secs(60)).expect("llama-server ends once its worker is gone");
    let took = killed.elapsed();
    let ending = stream.finish();
    let text = String::from_utf8_lossy(&stream.received).into_owned();
    eprintln!(
        "llama-server ended ({status}) {took:?} after the worker's SIGKILL; the client read {} events, then {ending:?}",
        stream.events()
    );
    let stderr = server.stderr();
    assert_eq!(status.signal(), Some(Signal::SIGABRT as i32), "{status}; stderr:\n{stderr}");
    // The client's stream breaks off: no last event, no end of the chunked body.
    assert!(!text.contains("\"stop\":true") && !text.ends_with("0\r\n\r\n"), "{text}");
    let report = report_of(&server.stderr_lines());
    assert!(report.model_loaded(), "it was loaded");
    assert_eq!(report.failure_class(), Some(ErrorClass::WorkerLost), "stderr:\n{stderr}");
    assert_worker_lost_lines(&report, &stderr);
}
