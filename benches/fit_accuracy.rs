//! Exact fit: Ollama's formula, corral's projection and what llama.cpp allocated, per device.
//!
//! Two local `rpc-server`s are the devices (`RPC0`, `RPC1`); corrald, with a fixed
//! inventory, caps them through `[[workers]] memory` so that each model is placed whole on
//! one device, split over both, or partly offloaded (some layers on the CPU). For each
//! model and placement the benchmark loads the model through corrald (a generate of one
//! token), reads the planned and actual bytes per device from `/metrics`, and computes
//! beside them, for the same load (the same layers on the same devices):
//!
//! - Ollama's estimate, as its `llm/memory.go` (`estimateGPULayers`) and
//!   `fs/ggml/ggml.go` (`GraphSize`, the `llama` case) compute it, at the last version of
//!   the file (ollama/ollama f560bd07^, 2025-11; Ollama has since dropped it for its
//!   engine's layouts): rewritten here, see [`ollama`].
//! - corral's old crude estimate (`scheduler::policy::estimate`: weights + f16 KV + a
//!   tenth of the weights, at least 256 MiB), shared over the devices by layers.
//!
//! It also times llama.cpp's projection: corrald's own runs of `llama-fit-params` (its
//! planning) and of llama-server's dry run (the exact plan) for the load, from its debug
//! log; one more uncached dry run with the child's arguments, and a cached lookup, both
//! through `scheduler::projections::CachedProjections` as corrald uses it.
//!
//! Run with `cargo bench --bench fit_accuracy` (after `scripts/setup-llama-server.sh`).
//! It is a measurement: nothing is asserted about accuracy or time, only that the
//! capacities forced the placement each row is named after.

#![allow(clippy::print_stdout, reason = "a benchmark reports on stdout")]
#![allow(clippy::cast_precision_loss, reason = "MiB-sized figures and percentages")]

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use corral::demo_model::{LlamaShape, Weights};
use corral::gguf::GgufValue;
use corral::gguf::metadata::ModelInfo;
use corral::gguf::reader::GgufFile;
use corral::projection::{DryRun, ProjectionCache, Projector};
use corral::scheduler::backend::{ProjectedRow, Projecting, Projections};
use corral::scheduler::projections::CachedProjections;
use corral::store::Store;
use corral::store::create::CreateSpec;
use corral::store::modelfile::Modelfile;
use corral::store::name::ModelName;
use corral::supervisor::command::{DevicePlan, INHERITED_VARIABLES, LoadOptions, ModelFiles, Placement, PlannedDevice};
use corral::supervisor::logparse::{self, BufferKind, LogEvent};

const MIB: u64 = 1 << 20;

/// How long corrald may take to listen, and a load to answer.
const START_TIMEOUT: Duration = Duration::from_secs(60);
const LOAD_TIMEOUT: Duration = Duration::from_secs(300);

/// Context per request, and request slots, as corrald's defaults give the child.
const NUM_CTX: u64 = 2048;
const PARALLEL: u64 = 1;

/// A model of the benchmark and the worker capacities that force each placement.
struct Model {
    name: &'static str,
    shape: LlamaShape,
    /// (placement, each worker's `memory`).
    cases: [(&'static str, &'static str); 3],
}

fn models() -> [Model; 2] {
    [
        Model {
            name: "rig",
            shape: LlamaShape::rig(),
            // 170 MiB on one device; 140 MiB each holds it only split.
            cases: [("whole", "200MiB"), ("split", "140MiB"), ("partial", "40MiB")],
        },
        Model {
            name: "wide",
            // 24 layers of 12 MiB (768-wide, feed-forward 2048, 6 heads of 128 over 2 KV
            // heads): 289 MiB of F16, a KV cache of 48 MiB at 2048.
            shape: LlamaShape {
                name: "corral-bench-wide-llama",
                n_layer: 24,
                n_embd: 768,
                n_ff: 2048,
                n_head: 6,
                n_head_kv: 2,
                context: 4096,
                weights: Weights::RandomBits,
            },
            cases: [("whole", "400MiB"), ("split", "240MiB"), ("partial", "80MiB")],
        },
    ]
}

fn llama_bin_dir() -> PathBuf {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/setup-llama-server.sh");
    let out = Command::new("bash").arg(&script).stderr(Stdio::inherit()).output().expect("run setup script");
    assert!(out.status.success(), "setup-llama-server.sh failed");
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port()
}

/// A child stopped (SIGTERM, up to 30 s, then SIGKILL) and reaped on drop.
struct Process(Child);

impl Drop for Process {
    fn drop(&mut self) {
        let pid = nix::unistd::Pid::from_raw(i32::try_from(self.0.id()).expect("pid"));
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.0.try_wait().expect("wait").is_none() {
            if Instant::now() > deadline {
                let _ = self.0.kill();
                let _ = self.0.wait();
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// `rpc-server` on a free loopback port, once it accepts connections (within 30 s).
fn rpc_server(bin: &Path) -> (Process, String) {
    let port = free_port();
    let child = Command::new(bin.join("rpc-server"))
        .args(["-H", "127.0.0.1", "-p", &port.to_string()])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn rpc-server");
    let mut process = Process(child);
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(process.0.try_wait().expect("wait").is_none(), "rpc-server on port {port} exited");
        assert!(Instant::now() < deadline, "rpc-server on port {port} does not listen");
        std::thread::sleep(Duration::from_millis(50));
    }
    (process, format!("127.0.0.1:{port}"))
}

/// corrald with its stderr (debug for the child's lines and the projector) collected.
struct Corrald {
    process: Process,
    port: u16,
    stderr: Arc<Mutex<String>>,
}

impl Corrald {
    fn start(dir: &Path, bin: &Path, workers: &[String], memory: &str) -> Self {
        let port = free_port();
        let workers: Vec<String> =
            workers.iter().map(|w| format!("[[workers]]\naddress = \"{w}\"\nmemory = \"{memory}\"")).collect();
        let config = format!(
            "[server]\nlisten = [\"127.0.0.1:{port}\"]\n[store]\npath = \"{}\"\n[runner]\nllama_server = \"{}\"\n\
             [scheduler]\nnum_ctx = {NUM_CTX}\nnum_parallel = {PARALLEL}\n\
             [gpu]\nfixed = true\nhost_memory = \"8GiB\"\nreserve = \"0B\"\n{}\n",
            dir.join("models").display(),
            bin.join("llama-server").display(),
            workers.join("\n"),
        );
        let path = dir.join("corral.toml");
        std::fs::write(&path, config).expect("write config");
        let state = tempfile::tempdir_in(dir).expect("state dir").keep();
        let mut child = Command::new(env!("CARGO_BIN_EXE_corrald"))
            .args(["--log-target", "stderr", "--config"])
            .arg(&path)
            .env("STATE_DIRECTORY", state.join("state"))
            .env("RUNTIME_DIRECTORY", state.join("run"))
            .env("RUST_LOG", "info,llama-server=debug,corral::projection=debug")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn corrald");
        let stderr = Arc::new(Mutex::new(String::new()));
        let mut pipe = child.stderr.take().expect("stderr");
        let sink = Arc::clone(&stderr);
        std::thread::spawn(move || {
            let mut chunk = [0_u8; 8192];
            while let Ok(n) = pipe.read(&mut chunk) {
                if n == 0 {
                    break;
                }
                sink.lock().expect("stderr").push_str(&String::from_utf8_lossy(&chunk[..n]));
            }
        });
        let mut corrald = Self { process: Process(child), port, stderr };
        let deadline = Instant::now() + START_TIMEOUT;
        while get(port, "/api/version").is_none() {
            assert!(corrald.process.0.try_wait().expect("wait").is_none(), "corrald exited:\n{}", corrald.log());
            assert!(Instant::now() < deadline, "corrald does not answer:\n{}", corrald.log());
            std::thread::sleep(Duration::from_millis(50));
        }
        corrald
    }

    fn log(&self) -> String {
        self.stderr.lock().expect("stderr").clone()
    }

    /// The llama-server child's command line.
    fn child_argv(&self) -> Vec<String> {
        let mut children = Vec::new();
        for task in std::fs::read_dir(format!("/proc/{}/task", self.process.0.id())).expect("tasks") {
            let listed = std::fs::read_to_string(task.expect("task").path().join("children")).unwrap_or_default();
            children.extend(listed.split_whitespace().map(|p| p.parse::<u32>().expect("pid")));
        }
        assert_eq!(children.len(), 1, "corrald runs one child: {children:?}");
        let argv = std::fs::read(format!("/proc/{}/cmdline", children[0])).expect("cmdline");
        argv.split(|b| *b == 0).filter(|a| !a.is_empty()).map(|a| String::from_utf8_lossy(a).into_owned()).collect()
    }
}

/// A minimal HTTP/1.1 exchange (`Connection: close`); `None` when the connection fails.
fn exchange(port: u16, method: &str, path: &str, body: Option<&str>) -> Option<(u16, String)> {
    use std::io::Write;
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream.set_read_timeout(Some(LOAD_TIMEOUT)).ok()?;
    let body = body.unwrap_or("");
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .ok()?;
    let mut response = Vec::new();
    stream.read_to_end(&mut response).ok()?;
    let response = String::from_utf8_lossy(&response).into_owned();
    let (head, rest) = response.split_once("\r\n\r\n")?;
    let status = head.split_whitespace().nth(1)?.parse().ok()?;
    let body =
        if head.to_ascii_lowercase().contains("transfer-encoding: chunked") { dechunk(rest) } else { rest.into() };
    Some((status, body))
}

fn dechunk(mut rest: &str) -> String {
    let mut body = String::new();
    while let Some((size, tail)) = rest.split_once("\r\n") {
        let Ok(size) = usize::from_str_radix(size.trim(), 16) else { break };
        if size == 0 || tail.len() < size {
            break;
        }
        body.push_str(&tail[..size]);
        rest = tail[size..].trim_start_matches("\r\n");
    }
    body
}

fn get(port: u16, path: &str) -> Option<String> {
    exchange(port, "GET", path, None).filter(|(status, _)| *status == 200).map(|(_, body)| body)
}

/// Device → (planned, actual) bytes of the one runner, from `/metrics`.
fn plan_and_actual(port: u16) -> BTreeMap<String, (u64, u64)> {
    let metrics = get(port, "/metrics").expect("/metrics");
    let mut devices: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    for line in metrics.lines().filter(|l| l.starts_with("corral_runner_device_memory_bytes{")) {
        let (labels, value) = line.rsplit_once(' ').expect("a value");
        let label = |name: &str| {
            let start = labels.find(&format!("{name}=\"")).expect("label") + name.len() + 2;
            labels[start..].split('"').next().expect("closed").to_owned()
        };
        let value: u64 = value.parse().expect("bytes");
        let entry = devices.entry(label("device")).or_default();
        if label("kind") == "planned" {
            entry.0 = value;
        } else {
            entry.1 = value;
        }
    }
    devices
}

/// What the model file says, as Ollama's formula reads it.
struct Facts {
    /// Bytes of each block's tensors (`blk.N.*`).
    blocks: Vec<u64>,
    /// `output_norm` and `output` (or `token_embd` when there is no `output`).
    output: u64,
    embedding: u64,
    heads: u64,
    heads_kv: u64,
    head_k: u64,
    head_v: u64,
    vocab: u64,
    /// The file's size, which corral's crude estimate takes as the weights.
    file: u64,
    /// corral's f16 KV cache bytes (`ModelInfo::kv_cache_bytes`).
    kv_corral: u64,
}

fn facts(path: &Path) -> Facts {
    let file = GgufFile::open(path).expect("read gguf");
    let info = ModelInfo::from_file(&file).expect("model info");
    let bytes = |type_id: u32, elements: u64| match type_id {
        0 => elements * 4,
        1 => elements * 2,
        other => panic!("the benchmark's models are F32 and F16 only, not type {other}"),
    };
    let n_layer = usize::try_from(info.block_count.expect("block count")).expect("layers");
    let mut blocks = vec![0; n_layer];
    let mut groups: BTreeMap<&str, u64> = BTreeMap::new();
    for t in file.tensors() {
        let size = bytes(t.type_id, t.element_count());
        match t.name.strip_prefix("blk.").and_then(|rest| rest.split('.').next()) {
            Some(n) => blocks[n.parse::<usize>().expect("block")] += size,
            None => *groups.entry(t.name.split('.').next().expect("name")).or_default() += size,
        }
    }
    let output = groups.get("output_norm").copied().unwrap_or(0)
        + groups.get("output").or_else(|| groups.get("token_embd")).copied().unwrap_or(0);
    let heads = info.head_count.as_ref().expect("heads").max();
    let embedding = info.embedding_length.expect("embedding");
    let vocab = match file.get("tokenizer.ggml.tokens") {
        Some(GgufValue::Array(tokens)) => tokens.len() as u64,
        _ => panic!("no vocabulary"),
    };
    Facts {
        blocks,
        output,
        embedding,
        heads,
        heads_kv: info.head_count_kv.as_ref().expect("KV heads").max(),
        head_k: info.key_length.unwrap_or(embedding / heads),
        head_v: info.value_length.unwrap_or(embedding / heads),
        vocab,
        file: std::fs::metadata(path).expect("size").len(),
        kv_corral: info.kv_cache_bytes(NUM_CTX, PARALLEL),
    }
}

/// Ollama's memory estimate for a llama, rewritten from its `llm/memory.go`
/// (`estimateGPULayers`) and `fs/ggml/ggml.go` (`GraphSize`, case `llama`), at
/// ollama/ollama f560bd077fcf4e30a4bf584b3b1501015105d63b^ (the last version of that
/// estimate), for the same layers on the same devices as corral's load. Per device:
///
/// - `MinimumMemory()`: 457 MiB on every device given a layer (CUDA's context, by
///   Ollama's reckoning; 512 MiB on Metal), and one more layer (`blk.0` with its KV) "as a
///   buffer";
/// - each block's tensors plus its KV cache, f16: `2 × ctx × np × (head_k + head_v) ×
///   heads_kv` bytes a layer;
/// - `output_norm` + `output` on the device that takes the output layer;
/// - the graph, with `batch = min(ctx, 512)` (Ollama's `num_batch`) and `context = ctx ×
///   np`: for a full offload
///   `max(4·batch·(1 + 4·embd + context·(1 + heads)), 4·batch·(embd + vocab))`,
///   for a partial one `4·batch·embd + max(4·batch·(1 + embd + max(context, embd)) +
///   embd²·9/16 + 4·context·(batch·heads + head_dim·heads_kv), 4·batch·(embd + vocab) +
///   embd·vocab·105/128)`; a split always takes the partial one, on every device.
///
/// The host is Ollama's "overflow": the layers (with their KV) and output left off the
/// devices; its CPU graph is not counted.
mod ollama {
    use super::{Facts, MIB, NUM_CTX, PARALLEL};

    /// What Ollama reserves on each device besides the model (`ml.DeviceInfo.MinimumMemory`).
    pub const MINIMUM_MEMORY: u64 = 457 * MIB;
    /// Ollama's default `num_batch`.
    const NUM_BATCH: u64 = 512;

    /// (full offload graph, partial offload graph).
    fn graph(f: &Facts) -> (u64, u64) {
        let context = NUM_CTX * PARALLEL;
        let batch = NUM_CTX.min(NUM_BATCH);
        let (embd, heads, heads_kv, vocab) = (f.embedding, f.heads, f.heads_kv, f.vocab);
        let head_dim = embd / heads;
        let full = (4 * batch * (1 + 4 * embd + context * (1 + heads))).max(4 * batch * (embd + vocab));
        let partial = 4 * batch * embd
            + (4 * batch * (1 + embd + context.max(embd))
                + embd * embd * 9 / 16
                + 4 * context * (batch * heads + head_dim * heads_kv))
                .max(4 * batch * (embd + vocab) + embd * vocab * 105 / 128);
        (full, partial)
    }

    /// A layer's f16 KV cache.
    pub fn kv_per_layer(f: &Facts) -> u64 {
        2 * NUM_CTX * PARALLEL * (f.head_k + f.head_v) * f.heads_kv
    }

    /// Ollama's bytes for each device in `blocks` (the blocks it holds; the output layer on
    /// `output_on`), and for the host.
    pub fn estimate(f: &Facts, blocks: &[Vec<usize>], output_on: Option<usize>) -> (Vec<u64>, u64) {
        let kv = kv_per_layer(f);
        let (full, partial) = graph(f);
        let on_devices: usize = blocks.iter().map(Vec::len).sum();
        let fully = on_devices == f.blocks.len() && output_on.is_some();
        let used = blocks.iter().filter(|b| !b.is_empty()).count();
        let graph = if fully && used == 1 { full } else { partial };
        let spare = f.blocks[0] + kv;
        let devices = blocks
            .iter()
            .enumerate()
            .map(|(d, held)| {
                if held.is_empty() && output_on != Some(d) {
                    return 0;
                }
                let layers: u64 = held.iter().map(|&i| f.blocks[i] + kv).sum();
                let output = if output_on == Some(d) { f.output } else { 0 };
                MINIMUM_MEMORY + spare + layers + output + graph
            })
            .collect();
        let on: Vec<usize> = blocks.iter().flatten().copied().collect();
        let host = (0..f.blocks.len()).filter(|i| !on.contains(i)).map(|i| f.blocks[i] + kv).sum::<u64>()
            + if output_on.is_none() { f.output } else { 0 };
        (devices, host)
    }
}

/// The layers llama.cpp puts on each device of the child's `--device` list, by its rule
/// (`llama_model::load_tensors` in b11434: the last `-ngl` layers are offloaded, and split
/// at the cumulative, normalised `-ts` points), with index `n_layer` the output layer;
/// the rest are on the CPU. (Its `layer N assigned to device` lines need more than
/// `-lv 4`.)
fn assignment(child: &[String], n_layer: usize) -> Vec<Vec<usize>> {
    let devices = value_of(child, "--device").map_or(0, |d| d.split(',').count());
    let all = i64::try_from(n_layer).expect("layers") + 1;
    let ngl = match value_of(child, "-ngl") {
        None | Some("all" | "auto") => all,
        Some(n) => n.parse().expect("-ngl"),
    };
    let mut splits: Vec<f32> = match value_of(child, "-ts") {
        Some(ts) => ts.split(',').map(|s| s.parse().expect("-ts")).collect(),
        None => vec![1.0; devices],
    };
    let mut sum = 0.0;
    for s in &mut splits {
        sum += *s;
        *s = sum;
    }
    for s in &mut splits {
        *s /= sum;
    }
    let start = (all - ngl).max(0);
    let active = if devices == 0 { 0 } else { ngl.min(all) };
    let mut layers = vec![Vec::new(); devices];
    for il in 0..all {
        if il < start || il - start >= active {
            continue;
        }
        #[allow(clippy::cast_possible_truncation, reason = "layer counts")]
        let point = (il - start) as f32 / active as f32;
        let device = splits.iter().take(devices).filter(|s| **s <= point).count();
        layers[device].push(usize::try_from(il).expect("index"));
    }
    layers
}

/// What llama.cpp allocated on each device, from the child's buffer lines in corrald's
/// log: device → (weights, KV cache and outputs, compute). A worker's buffers are named
/// after its endpoint (`RPC0[127.0.0.1:PORT]`); its device is `RPC` and its place in
/// `--rpc`.
fn buffers(log: &str, child: &[String]) -> BTreeMap<String, [u64; 3]> {
    let rpc: Vec<&str> = value_of(child, "--rpc").map(|r| r.split(',').collect()).unwrap_or_default();
    let mut devices: BTreeMap<String, [u64; 3]> = BTreeMap::new();
    for line in log.lines().filter(|l| l.contains(" buffer size = ") && l.contains(" pid=")) {
        let Some((_, message)) = line.split_once(" DEBUG ") else { continue };
        let message = message.rsplit_once(" corral_model=").map_or(message, |(m, _)| m);
        let Some(LogEvent::Buffer { buffer, kind, bytes, .. }) = logparse::parse_line(message).event else { continue };
        let device = if logparse::is_host_buffer(&buffer) {
            "Host".to_owned()
        } else {
            let endpoint = buffer.split_once('[').and_then(|(_, e)| e.strip_suffix(']')).unwrap_or(&buffer);
            rpc.iter().position(|e| *e == endpoint).map_or(buffer.clone(), |i| format!("RPC{i}"))
        };
        let slot = match kind {
            BufferKind::Model => 0,
            BufferKind::Compute => 2,
            _ => 1,
        };
        devices.entry(device).or_default()[slot] += bytes;
    }
    devices
}

/// corrald's projections, as its projectors logged them (`llama-fit-params projected in
/// X`, `llama-server's dry run projected in X`).
fn logged_projections(log: &str) -> Vec<Duration> {
    log.lines()
        .filter_map(|line| {
            line.split_once("llama-fit-params projected in ")
                .or_else(|| line.split_once("llama-server's dry run projected in "))
                .map(|(_, rest)| rest)
        })
        .filter_map(|rest| {
            let mut words = rest.split_whitespace();
            let value: f64 = words.next()?.parse().ok()?;
            match words.next()? {
                "ms" => Some(Duration::from_secs_f64(value / 1000.0)),
                "s" => Some(Duration::from_secs_f64(value)),
                _ => None,
            }
        })
        .collect()
}

/// The `llama-fit-params` arguments of the child's load: its argv without llama-server's
/// own flags (as `supervisor::command::projection` builds them).
fn projection_args(child: &[String]) -> Vec<OsString> {
    let mut kept = Vec::new();
    let mut words = child.iter().skip(1);
    while let Some(word) = words.next() {
        match word.as_str() {
            "--host" | "-a" | "-lv" => {
                words.next();
            }
            "--no-webui" | "--offline" | "--metrics" => {}
            _ => kept.push(OsString::from(word)),
        }
    }
    kept
}

fn value_of<'a>(argv: &'a [String], flag: &str) -> Option<&'a str> {
    argv.iter().position(|a| a == flag).and_then(|i| argv.get(i + 1)).map(String::as_str)
}

/// (uncached, cached) time of the exact plan's projection (llama-server's dry run)
/// through corrald's cache, with the child's `argv`, and what it projects on each device.
fn time_projection(
    runtime: &tokio::runtime::Runtime,
    bin: &Path,
    argv: &[String],
) -> (Duration, Duration, Vec<ProjectedRow>) {
    let model_args = projection_args(argv);
    let env: Vec<(OsString, OsString)> =
        std::env::vars_os().filter(|(k, _)| INHERITED_VARIABLES.iter().any(|allowed| k == allowed)).collect();
    let model = PathBuf::from(&model_args[model_args.iter().position(|a| a == "-m").expect("-m") + 1]);
    let files = ModelFiles { model, projector: None, adapters: Vec::new() };
    let sockets = tempfile::tempdir().expect("socket directory");
    let projections = CachedProjections::new(
        Projector { program: bin.join("llama-fit-params"), timeout: Duration::from_secs(60) },
        DryRun {
            llama_server: bin.join("llama-server"),
            socket_dir: sockets.path().to_owned(),
            timeout: Duration::from_secs(60),
        },
        ProjectionCache::in_memory(),
    );
    // Each worker has one device: RPCi is the i-th of `--rpc`, its buffer `RPC0[address]`.
    let workers: Vec<&str> = value_of(argv, "--rpc").map(|r| r.split(',').collect()).unwrap_or_default();
    let devices = value_of(argv, "--device")
        .map(|d| d.split(',').map(str::to_owned).collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .map(|name| {
            let worker = name.strip_prefix("RPC").and_then(|i| i.parse::<usize>().ok()).and_then(|i| workers.get(i));
            let buffer = worker.map_or_else(|| name.clone(), |w| format!("RPC0[{w}]"));
            PlannedDevice { name, buffer, share: 1 }
        })
        .collect();
    let placement = Placement { plan: Some(DevicePlan { devices, layers: None }), ..Placement::default() };
    let options = LoadOptions::default();
    runtime.block_on(async {
        let mut times = Vec::new();
        let mut rows = Vec::new();
        for _ in 0..2 {
            let start = Instant::now();
            rows = projections
                .project(&files, &options, &placement, model_args.clone(), env.clone(), Projecting::Exact { runner: 1 })
                .await
                .expect("llama-server's dry run projects the load");
            times.push(start.elapsed());
        }
        (times[0], times[1], rows)
    })
}

struct Row {
    model: &'static str,
    placement: &'static str,
    device: String,
    layers: String,
    actual: u64,
    planned: u64,
    ollama: u64,
    crude: u64,
    /// llama.cpp's buffers there: weights, KV cache and outputs, compute.
    buffers: [u64; 3],
    /// The projection's compute there (llama-server's dry run, as corrald takes it).
    projected_compute: u64,
}

struct Timing {
    model: &'static str,
    placement: &'static str,
    corrald: Vec<Duration>,
    uncached: Duration,
    cached: Duration,
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / MIB as f64
}

fn error(estimate: u64, actual: u64) -> String {
    if actual == 0 {
        return "–".into();
    }
    format!("{:+.1} %", (estimate as f64 - actual as f64) / actual as f64 * 100.0)
}

fn ms(d: Duration) -> String {
    if d < Duration::from_millis(1) {
        format!("{:.1} µs", d.as_secs_f64() * 1e6)
    } else {
        format!("{:.0} ms", d.as_secs_f64() * 1e3)
    }
}

#[allow(clippy::too_many_lines, reason = "one measurement, step by step")]
fn main() {
    let bin = llama_bin_dir();
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(&dir.path().join("models")).expect("store");
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    let models = models();
    let mut all_facts = Vec::new();
    for model in &models {
        let file = dir.path().join(format!("{}.gguf", model.name));
        corral::demo_model::write_llama(&file, &model.shape).expect("write model");
        let modelfile = Modelfile::parse(&format!("FROM ./{}.gguf\n", model.name)).expect("modelfile");
        let spec = CreateSpec::from_modelfile(&modelfile, dir.path()).expect("spec");
        store.create(&ModelName::parse(model.name).expect("name"), &spec, &mut |_| {}).expect("create");
        all_facts.push(facts(&file));
        std::fs::remove_file(&file).expect("remove the written copy");
    }
    let workers: Vec<(Process, String)> = (0..2).map(|_| rpc_server(&bin)).collect();
    let endpoints: Vec<String> = workers.iter().map(|(_, e)| e.clone()).collect();

    let mut rows = Vec::new();
    let mut timings = Vec::new();
    for (model, f) in models.iter().zip(&all_facts) {
        let n_layer = f.blocks.len();
        for (placement, memory) in model.cases {
            let corrald = Corrald::start(dir.path(), &bin, &endpoints, memory);
            let request = serde_json::json!({
                "model": model.name, "prompt": "hi", "stream": false, "options": {"num_predict": 1}
            });
            let (status, body) =
                exchange(corrald.port, "POST", "/api/generate", Some(&request.to_string())).expect("generate answered");
            assert_eq!(status, 200, "{} {placement}: {body}\n{}", model.name, corrald.log());
            let devices = plan_and_actual(corrald.port);
            let argv = corrald.child_argv();
            let log = corrald.log();
            let allocated = buffers(&log, &argv);
            // An rpc-server serves one client at a time: the projection waits for the child to go.
            drop(corrald);
            let (uncached, cached, projected) = time_projection(&runtime, &bin, &argv);
            timings.push(Timing { model: model.name, placement, corrald: logged_projections(&log), uncached, cached });
            let compute = |device: &str| projected.iter().find(|r| r.name == device).map_or(0, |r| r.compute);
            // llama.cpp's device names, in the order of the plan's `--device`.
            let names: Vec<String> =
                value_of(&argv, "--device").map(|d| d.split(',').map(str::to_owned).collect()).unwrap_or_default();
            let assigned = assignment(&argv, n_layer);
            let blocks: Vec<Vec<usize>> =
                assigned.iter().map(|l| l.iter().copied().filter(|i| *i < n_layer).collect()).collect();
            let output_on = assigned.iter().position(|l| l.contains(&n_layer));
            // The capacities must have forced the placement the row is named after.
            let offloaded: usize = assigned.iter().map(Vec::len).sum();
            let placed = match (names.len(), offloaded == n_layer + 1) {
                (1, true) => "whole",
                (2, true) => "split",
                _ => "partial",
            };
            assert_eq!(placed, placement, "{}: {argv:?}", model.name);
            let (ollama, ollama_host) = ollama::estimate(f, &blocks, output_on);
            // corral's crude estimate, as the old scheduler planned: the whole footprint,
            // shared over the devices by their layers (the blocks and the output layer).
            let crude = corral::scheduler::policy::estimate(f.file, f.kv_corral, 0);
            let all_layers = (n_layer + 1) as u64;
            let share = |layers: usize| crude.vram * layers as u64 / all_layers;
            let mut on_devices = 0;
            for (d, name) in names.iter().enumerate() {
                let layers = blocks[d].len() + usize::from(output_on == Some(d));
                on_devices += layers;
                let (planned, actual) = devices.get(name).copied().unwrap_or_default();
                rows.push(Row {
                    model: model.name,
                    placement,
                    device: name.clone(),
                    layers: layers.to_string(),
                    actual,
                    planned,
                    ollama: ollama[d],
                    crude: share(layers),
                    buffers: allocated.get(name).copied().unwrap_or_default(),
                    projected_compute: compute(name),
                });
            }
            let (planned, actual) = devices.get("Host").copied().unwrap_or_default();
            rows.push(Row {
                model: model.name,
                placement,
                device: "Host".into(),
                layers: (n_layer + 1 - on_devices).to_string(),
                actual,
                planned,
                ollama: ollama_host,
                crude: crude.ram + share(n_layer + 1 - on_devices),
                buffers: allocated.get("Host").copied().unwrap_or_default(),
                projected_compute: compute("Host"),
            });
        }
    }
    drop(workers);

    println!(
        "exact fit on the rig: two rpc-servers, -c {NUM_CTX} -np {PARALLEL}, MiB; error = (estimate - actual) / actual"
    );
    println!(
        "| model | placement | device | layers | actual | corral's projection (planned) | error | Ollama's formula | error | \
         Ollama less its 457 MiB floor | error | corral's old estimate | error |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    for r in &rows {
        let floorless = r.ollama.saturating_sub(if r.device == "Host" { 0 } else { ollama::MINIMUM_MEMORY });
        println!(
            "| {} | {} | {} | {} | {:.2} | {:.2} | {} | {:.2} | {} | {:.2} | {} | {:.2} | {} |",
            r.model,
            r.placement,
            r.device,
            r.layers,
            mib(r.actual),
            mib(r.planned),
            error(r.planned, r.actual),
            mib(r.ollama),
            error(r.ollama, r.actual),
            mib(floorless),
            error(floorless, r.actual),
            mib(r.crude),
            error(r.crude, r.actual),
        );
    }
    println!();
    println!("where the projection errs: llama.cpp's buffers and the projection's compute buffer, MiB");
    println!(
        "| model | placement | device | weights | KV + outputs | compute | projected compute | projected rest | \
         rest - (weights + KV) |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    for r in &rows {
        let [weights, kv, compute] = r.buffers;
        let rest = r.planned.saturating_sub(r.projected_compute);
        println!(
            "| {} | {} | {} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:+.2} |",
            r.model,
            r.placement,
            r.device,
            mib(weights),
            mib(kv),
            mib(compute),
            mib(r.projected_compute),
            mib(rest),
            mib(rest) - mib(weights + kv),
        );
    }
    println!();
    println!(
        "projection time: corrald's own runs (its log: llama-fit-params for planning, llama-server's dry run for \
         the plan), then one more uncached dry run and a cached lookup"
    );
    println!("| model | placement | corrald's projections | uncached | cached |");
    println!("| --- | --- | --- | --- | --- |");
    for t in &timings {
        let logged: Vec<String> = t.corrald.iter().map(|d| ms(*d)).collect();
        println!("| {} | {} | {} | {} | {} |", t.model, t.placement, logged.join(", "), ms(t.uncached), ms(t.cached));
    }
    for (model, f) in models.iter().zip(&all_facts) {
        let crude = corral::scheduler::policy::estimate(f.file, f.kv_corral, 0);
        println!(
            "{}: {} blocks, {:.2} MiB of weights in the file, f16 KV {:.2} MiB (Ollama {:.2}), corral's old estimate \
             {:.2} MiB + {:.0} MiB host",
            model.name,
            f.blocks.len(),
            mib(f.file),
            mib(f.kv_corral),
            mib(ollama::kv_per_layer(f) * f.blocks.len() as u64),
            mib(crude.vram),
            mib(crude.ram),
        );
    }
}
