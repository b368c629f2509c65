//! Scheduler: decision latency and end-to-end throughput.
//!
//! 1. **Decisions**: `policy::decide` on snapshots of 20 runners of mixed size and state
//!    (idle, busy, pinned, loading; spread over GPUs where there are several) on 0, 1 and
//!    4 GPUs, for each kind of outcome: a load that fits, evicting idle runners, draining
//!    busy ones, the count limit, and no fit (every candidate tried: the slowest path).
//!    Also the same with the snapshot cloned first (as the actor builds one per
//!    decision), and one round trip through the `Handle` on the fast path (a ready
//!    runner among 20) next to a bare channel echo, its floor.
//! 2. **End to end**: the scheduler task on a multi-thread runtime with an in-process
//!    fake backend (no processes: the scheduler's own cost), 10 000 concurrent acquires
//!    over 20 models whose memory holds about 5 at a time, each lease held for a short
//!    deterministic time; also uniform or 1/rank popularity, 1 ms loads, no holds, and
//!    memory for all 20. Every request must get an answer, and the fake checks that the
//!    memory budget and the count limit are never exceeded. Besides wall time and
//!    latency it reports CPU time per request and how many requests were overtaken by a
//!    later one for the same model.
//! 3. Optionally, the same on the real `SupervisorBackend` with `fake-llama-server`
//!    processes (200 requests over 5 models, 2 at a time), when that binary is built.
//!
//! Run with `cargo bench --bench scheduler`. `CORRAL_BENCH_ITERATIONS` sets the decisions
//! timed per case (default 50 000), `CORRAL_BENCH_REQUESTS` the end-to-end requests
//! (default 10 000); `CORRAL_FAKE_LLAMA_SERVER` points at the fake (by default it is
//! looked for next to this benchmark's build, then in `target/release` and
//! `target/debug`; build it with `cargo build --release --bin fake-llama-server`).

#![allow(clippy::print_stdout, reason = "a benchmark reports on stdout")]

use std::collections::{BTreeMap, BTreeSet};
use std::hint::black_box;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use corral::scheduler::actor::Scheduler;
use corral::scheduler::backend::{Backend, BoxFuture, LiveRunner, StartRequest, SupervisorBackend};
use corral::scheduler::footprints::Footprints;
use corral::scheduler::keep_alive::{Clamp, KeepAlive};
use corral::scheduler::policy::{self, Decision, Footprint, GpuView, Placement, RunnerView, Snapshot};
use corral::scheduler::types::{Limits, ModelRequest, ScheduleError};
use corral::supervisor::child_log::LogSink;
use corral::supervisor::command::{LoadOptions, ModelFiles};
use corral::supervisor::runner::SupervisorConfig;

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

/// The target for one decision.
const TARGET: Duration = Duration::from_micros(50);

// ---------------------------------------------------------------------------------------
// Numbers

struct Spread {
    p50: Duration,
    p99: Duration,
    max: Duration,
}

fn spread(mut samples: Vec<Duration>) -> Spread {
    assert!(!samples.is_empty(), "no samples");
    samples.sort_unstable();
    let n = samples.len();
    Spread { p50: samples[n / 2], p99: samples[(n * 99 / 100).min(n - 1)], max: samples[n - 1] }
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Bytes in GiB, to a MiB.
fn gib(bytes: u64) -> f64 {
    f64::from(u32::try_from(bytes / MIB).unwrap_or(u32::MAX)) / 1024.0
}

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// A small deterministic generator (64-bit LCG, high bits out).
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        self.0 >> 33
    }
}

// ---------------------------------------------------------------------------------------
// 1. Decisions

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Case {
    Fits,
    EvictIdle,
    DrainBusy,
    CountLimit,
    NoFit,
}

impl Case {
    const ALL: [Self; 5] = [Self::Fits, Self::EvictIdle, Self::DrainBusy, Self::CountLimit, Self::NoFit];

    fn label(self) -> &'static str {
        match self {
            Self::Fits => "load (fits)",
            Self::EvictIdle => "evict idle",
            Self::DrainBusy => "drain busy",
            Self::CountLimit => "count limit",
            Self::NoFit => "no fit (all tried)",
        }
    }

    fn expected(self, decision: &Decision) -> bool {
        match (self, decision) {
            (Self::Fits, Decision::Load(_)) | (Self::NoFit, Decision::NoFit { .. }) => true,
            (Self::EvictIdle, Decision::MakeRoom { evict, drain }) => !evict.is_empty() && drain.is_empty(),
            (Self::DrainBusy, Decision::MakeRoom { drain, .. }) => !drain.is_empty(),
            (Self::CountLimit, Decision::MakeRoom { evict, drain }) => evict.len() == 1 && drain.is_empty(),
            _ => false,
        }
    }
}

/// 20 runners: 1..4 GiB of weights and 256 MiB of host memory each; every third busy,
/// the first pinned, the last loading (unless `loading` is false); keep-alives of 30 s,
/// 5 min and forever; last uses spread over three minutes; on several GPUs every fifth
/// one is spread over all of them.
fn runners(gpus: usize, now: Instant, loading: bool) -> Vec<RunnerView> {
    (0..20u64)
        .map(|i| {
            let vram = (1 + i % 4) * GIB;
            let slot = usize::try_from(i).expect("small");
            let placement = match gpus {
                0 => Placement::Cpu,
                1 => Placement::Gpu(0),
                n if i % 5 == 4 => {
                    let share = vram / u64::try_from(n).expect("small");
                    Placement::Spread((0..n).map(|g| (g, share)).collect())
                }
                n => Placement::Gpu(slot % n),
            };
            let keep_alive = match i % 7 {
                0 => KeepAlive::For(Duration::from_secs(30)),
                3 => KeepAlive::Forever,
                _ => KeepAlive::For(Duration::from_secs(300)),
            };
            RunnerView {
                id: i + 1,
                placement,
                footprint: Footprint { vram, ram: 256 * MIB },
                leases: u32::from(i % 3 == 0),
                keep_alive,
                last_used: now.checked_sub(Duration::from_secs((i * 7) % 20 * 10)).unwrap_or(now),
                pinned: i == 0,
                loading: loading && i == 19,
                draining: false,
            }
        })
        .collect()
}

/// Host memory a runner takes: everything on the CPU, its host part on GPUs.
fn host_part(r: &RunnerView) -> u64 {
    if r.placement == Placement::Cpu { r.footprint.total() } else { r.footprint.ram }
}

/// A snapshot of the 20 runners on `gpus` GPUs sized so that `case` comes out, and the need.
fn scenario(gpus: usize, case: Case) -> (Snapshot, Footprint) {
    let now = Instant::now() + Duration::from_secs(3600);
    let runners = runners(gpus, now, case != Case::NoFit);
    let idle_total: u64 =
        runners.iter().filter(|r| !r.pinned && !r.loading && r.leases == 0).map(|r| r.footprint.total()).sum();
    let need_vram = match case {
        Case::Fits | Case::CountLimit => 2 * GIB,
        Case::EvictIdle => 3 * GIB,
        // More than every idle runner frees: busy ones must drain as well.
        Case::DrainBusy => idle_total + GIB,
        Case::NoFit => 1000 * GIB,
    };
    // Room beyond what the runners use: none where something must go, plenty otherwise.
    let extra = match case {
        Case::Fits | Case::CountLimit => need_vram + GIB,
        Case::EvictIdle | Case::DrainBusy | Case::NoFit => 0,
    };
    let host_used: u64 = runners.iter().map(host_part).sum();
    let gpu_views = (0..gpus)
        .map(|index| {
            let used: u64 = runners.iter().map(|r| r.placement.vram_on(index, r.footprint.vram)).sum();
            GpuView { index, name: format!("gpu{index}"), worker: None, usable: used + extra }
        })
        .collect();
    let host_usable = if gpus == 0 { host_used + extra } else { host_used + 64 * GIB };
    let max_loaded = if case == Case::CountLimit { 20 } else { 32 };
    (
        Snapshot { gpus: gpu_views, host_usable, runners, max_loaded, partial_offload: false },
        Footprint { vram: need_vram, ram: 0 },
    )
}

struct DecisionRow {
    gpus: usize,
    case: Case,
    decide: Spread,
    with_clone: Spread,
}

fn time_decisions(gpus: usize, case: Case, iterations: usize) -> DecisionRow {
    let (snapshot, need) = scenario(gpus, case);
    let decision = policy::decide(&snapshot, need);
    assert!(case.expected(&decision), "{gpus} GPUs, {case:?}: unexpected {decision:?}");
    // Warm-up.
    for _ in 0..iterations / 10 {
        black_box(policy::decide(black_box(&snapshot), black_box(need)));
    }
    let mut decide = Vec::with_capacity(iterations);
    for _ in 0..iterations {
        let start = Instant::now();
        let decision = policy::decide(black_box(&snapshot), black_box(need));
        decide.push(start.elapsed());
        black_box(decision);
    }
    let mut with_clone = Vec::with_capacity(iterations);
    for _ in 0..iterations {
        let start = Instant::now();
        let copy = black_box(&snapshot).clone();
        let decision = policy::decide(&copy, black_box(need));
        with_clone.push(start.elapsed());
        black_box((decision, copy));
    }
    DecisionRow { gpus, case, decide: spread(decide), with_clone: spread(with_clone) }
}

/// What timing itself costs: two clock reads.
fn clock_cost() -> Duration {
    let samples = (0..100_000)
        .map(|_| {
            let start = Instant::now();
            start.elapsed()
        })
        .collect();
    spread(samples).p50
}

// ---------------------------------------------------------------------------------------
// Backends

/// Loads and unloads as the fake (or real) backend saw them, and the memory in use.
#[derive(Default)]
struct Stats {
    loads: AtomicU64,
    failed: AtomicU64,
    stops: AtomicU64,
    live: AtomicU64,
    max_live: AtomicU64,
    live_bytes: AtomicU64,
    max_live_bytes: AtomicU64,
}

impl Stats {
    fn begin(&self, bytes: u64) {
        let live = self.live.fetch_add(1, Ordering::SeqCst) + 1;
        self.max_live.fetch_max(live, Ordering::SeqCst);
        let used = self.live_bytes.fetch_add(bytes, Ordering::SeqCst) + bytes;
        self.max_live_bytes.fetch_max(used, Ordering::SeqCst);
    }

    fn end(&self, bytes: u64) {
        self.live.fetch_sub(1, Ordering::SeqCst);
        self.live_bytes.fetch_sub(bytes, Ordering::SeqCst);
    }

    fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::SeqCst)
    }
}

/// An in-process runner: no process, no socket; loads and stops take a fixed time.
struct InstantBackend {
    load: Duration,
    stop: Duration,
}

struct InstantRunner {
    id: u64,
    stop: Duration,
}

impl Backend for InstantBackend {
    fn start(
        &self,
        request: StartRequest,
    ) -> BoxFuture<'static, Result<Box<dyn LiveRunner>, corral::scheduler::failure::LoadFailure>> {
        let (load, stop) = (self.load, self.stop);
        Box::pin(async move {
            if !load.is_zero() {
                tokio::time::sleep(load).await;
            }
            Ok(Box::new(InstantRunner { id: request.id, stop }) as Box<dyn LiveRunner>)
        })
    }
}

impl LiveRunner for InstantRunner {
    fn socket(&self) -> PathBuf {
        PathBuf::from(format!("/run/corral/runner-{}.sock", self.id))
    }

    fn measured(&self) -> Option<Footprint> {
        None
    }

    fn pid(&self) -> u32 {
        u32::try_from(self.id).unwrap_or(u32::MAX)
    }

    fn stop(self: Box<Self>) -> BoxFuture<'static, ()> {
        Box::pin(async move {
            if !self.stop.is_zero() {
                tokio::time::sleep(self.stop).await;
            }
        })
    }

    fn exited(&mut self) -> BoxFuture<'_, String> {
        Box::pin(std::future::pending())
    }
}

/// Wraps a backend to count its loads and stops and the memory its runners hold (by the
/// need of each model), from the start of a load to the end of its stop.
struct Counted {
    inner: Arc<dyn Backend>,
    sizes: BTreeMap<String, u64>,
    stats: Arc<Stats>,
}

struct CountedRunner {
    inner: Box<dyn LiveRunner>,
    bytes: u64,
    stats: Arc<Stats>,
}

impl Backend for Counted {
    fn start(
        &self,
        request: StartRequest,
    ) -> BoxFuture<'static, Result<Box<dyn LiveRunner>, corral::scheduler::failure::LoadFailure>> {
        let bytes = self.sizes.get(&request.model).copied().unwrap_or(0);
        let stats = Arc::clone(&self.stats);
        stats.begin(bytes);
        let load = self.inner.start(request);
        Box::pin(async move {
            match load.await {
                Ok(inner) => {
                    stats.loads.fetch_add(1, Ordering::SeqCst);
                    Ok(Box::new(CountedRunner { inner, bytes, stats }) as Box<dyn LiveRunner>)
                }
                Err(reason) => {
                    stats.failed.fetch_add(1, Ordering::SeqCst);
                    stats.end(bytes);
                    Err(reason)
                }
            }
        })
    }
}

impl LiveRunner for CountedRunner {
    fn socket(&self) -> PathBuf {
        self.inner.socket()
    }

    fn measured(&self) -> Option<Footprint> {
        self.inner.measured()
    }

    fn pid(&self) -> u32 {
        self.inner.pid()
    }

    fn stop(self: Box<Self>) -> BoxFuture<'static, ()> {
        let Self { inner, bytes, stats } = *self;
        Box::pin(async move {
            inner.stop().await;
            stats.stops.fetch_add(1, Ordering::SeqCst);
            stats.end(bytes);
        })
    }

    fn exited(&mut self) -> BoxFuture<'_, String> {
        self.inner.exited()
    }
}

// ---------------------------------------------------------------------------------------
// Requests

fn model_request(index: u64, need: u64, model_file: PathBuf) -> ModelRequest {
    ModelRequest {
        key: corral::scheduler::key::RunnerKey::new(
            corral::scheduler::key::Weights::of(corral::store::digest::Digest::of(&index.to_le_bytes())),
            &LoadOptions::default(),
        ),
        name: format!("model-{index:02}"),
        files: ModelFiles { model: model_file, projector: None, adapters: Vec::new() },
        options: LoadOptions::default(),
        need: Footprint { vram: need, ram: 0 },
        layers: 0,
        keep_alive: None,
        pinned: false,
    }
}

fn limits(max_loaded: usize, max_queue: usize) -> Limits {
    Limits {
        max_loaded,
        max_queue,
        default_keep_alive: KeepAlive::For(Duration::from_secs(300)),
        clamp: Clamp::default(),
        partial_offload: true,
    }
}

/// How long a request holds its lease.
#[derive(Debug, Clone, Copy)]
enum Hold {
    /// Drop it at once.
    None,
    /// Give the scheduler this many turns of the runtime first.
    Yields(u32),
    /// Sleep this long (tokio's timer: about a millisecond at least).
    Sleep(Duration),
}

impl Hold {
    fn pick(rng: &mut Lcg) -> Self {
        match rng.next() % 8 {
            0..=2 => Self::None,
            3..=5 => Self::Yields(u32::try_from(rng.next() % 4 + 1).expect("small")),
            _ => Self::Sleep(Duration::from_millis(1)),
        }
    }

    async fn wait(self) {
        match self {
            Self::None => {}
            Self::Yields(n) => {
                for _ in 0..n {
                    tokio::task::yield_now().await;
                }
            }
            Self::Sleep(d) => tokio::time::sleep(d).await,
        }
    }
}

/// `count` (model index, hold) pairs: the model drawn with weights 1/(rank+1) (a few
/// popular models, a long tail) when `skewed`, else uniformly.
fn workload(count: usize, models: usize, skewed: bool, seed: u64) -> Vec<(usize, Hold)> {
    let weights: Vec<u64> = (1..=models as u64).map(|rank| if skewed { 27_720 / rank } else { 1 }).collect();
    let total: u64 = weights.iter().sum();
    let mut rng = Lcg(seed);
    (0..count)
        .map(|_| {
            let mut draw = rng.next() % total;
            let model = weights
                .iter()
                .position(|w| {
                    if draw < *w {
                        true
                    } else {
                        draw -= w;
                        false
                    }
                })
                .expect("within the total");
            (model, Hold::pick(&mut rng))
        })
        .collect()
}

// ---------------------------------------------------------------------------------------
// 2. End to end

struct Setup {
    label: String,
    backend: Arc<dyn Backend>,
    gpus: Vec<GpuView>,
    host_usable: u64,
    limits: Limits,
    /// Model `i`'s request.
    models: Vec<ModelRequest>,
    /// Memory and count bounds the fake checks.
    budget_bytes: u64,
    work: Vec<(usize, Hold)>,
    deadline: Duration,
}

struct E2eRow {
    label: String,
    requests: usize,
    wall: Duration,
    cpu: Duration,
    acquire: Spread,
    loads: u64,
    failed_loads: u64,
    evictions: u64,
    max_live: u64,
    max_loaded: usize,
    max_live_bytes: u64,
    budget_bytes: u64,
    errors: BTreeMap<String, usize>,
    runners_used: usize,
    overtaken: usize,
}

/// When a request asked, when it was answered, and the runner it got.
type Answer = (Instant, Instant, Result<u64, ScheduleError>);

/// Requests for a model answered more than 1 ms after a request for the same model that
/// asked more than 1 ms later (a request overtaken by a later one for the same model).
fn overtaken(work: &[(usize, Hold)], answers: &[Answer]) -> usize {
    let margin = Duration::from_millis(1);
    let mut by_model: BTreeMap<usize, Vec<(Instant, Instant)>> = BTreeMap::new();
    for ((model, _), (asked, answered, _)) in work.iter().zip(answers) {
        by_model.entry(*model).or_default().push((*asked, *answered));
    }
    by_model
        .values()
        .map(|times| {
            times
                .iter()
                .filter(|(asked, answered)| {
                    times.iter().any(|(later, sooner)| *later > *asked + margin && *sooner + margin < *answered)
                })
                .count()
        })
        .sum()
}

async fn end_to_end(setup: Setup) -> E2eRow {
    let stats = Arc::new(Stats::default());
    let sizes = setup.models.iter().map(|m| (m.name.clone(), m.need.total())).collect();
    let backend = Arc::new(Counted { inner: setup.backend, sizes, stats: Arc::clone(&stats) });
    let (scheduler, handle) =
        Scheduler::new(backend, setup.gpus, setup.host_usable, setup.limits.clone(), Footprints::in_memory());
    let scheduler = tokio::spawn(scheduler.run());
    let requests = setup.work.len();
    let answered = Arc::new(AtomicUsize::new(0));
    let cpu_before = cpu_time();
    let start = Instant::now();
    let tasks: Vec<tokio::task::JoinHandle<Answer>> = setup
        .work
        .iter()
        .map(|&(model, hold)| {
            let (handle, request, answered) = (handle.clone(), setup.models[model].clone(), Arc::clone(&answered));
            tokio::spawn(async move {
                let asked = Instant::now();
                let result = handle.acquire(request).await;
                let answered_at = Instant::now();
                answered.fetch_add(1, Ordering::SeqCst);
                let result = match result {
                    Ok(lease) => {
                        hold.wait().await;
                        Ok(lease.runner())
                    }
                    Err(e) => Err(e),
                };
                (asked, answered_at, result)
            })
        })
        .collect();
    let Ok(answers) = tokio::time::timeout(setup.deadline, futures_util::future::join_all(tasks)).await else {
        let loaded = handle.loaded().await.unwrap_or_default();
        let runners: Vec<String> =
            loaded.iter().map(|m| format!("{} {} leases {}", m.name, m.state, m.leases)).collect();
        panic!(
            "{}: hang: {} of {requests} requests answered after {:?}; loaded: {runners:?}",
            setup.label,
            answered.load(Ordering::SeqCst),
            setup.deadline
        );
    };
    let wall = start.elapsed();
    let cpu = cpu_time().saturating_sub(cpu_before);
    let evictions = Stats::get(&stats.stops);
    let mut latencies = Vec::with_capacity(requests);
    let mut errors = BTreeMap::new();
    let mut runners_used = BTreeSet::new();
    let answers: Vec<Answer> = answers.into_iter().map(|a| a.expect("a request task panicked")).collect();
    let overtaken = overtaken(&setup.work, &answers);
    for (asked, answered, result) in answers {
        latencies.push(answered - asked);
        match result {
            Ok(runner) => {
                runners_used.insert(runner);
            }
            Err(e) => {
                let kind = format!("{e:?}").split(['(', ' ', '{']).next().unwrap_or("?").to_owned();
                *errors.entry(kind).or_default() += 1;
            }
        }
    }
    assert_eq!(latencies.len(), requests, "every request got an answer");
    handle.shutdown().await;
    scheduler.await.expect("the scheduler task");
    assert_eq!(Stats::get(&stats.live), 0, "{}: runners left after shutdown", setup.label);
    assert_eq!(Stats::get(&stats.loads), Stats::get(&stats.stops), "{}: every load stopped", setup.label);
    E2eRow {
        label: setup.label,
        requests,
        wall,
        cpu,
        acquire: spread(latencies),
        loads: Stats::get(&stats.loads),
        failed_loads: Stats::get(&stats.failed),
        evictions,
        max_live: Stats::get(&stats.max_live),
        max_loaded: setup.limits.max_loaded,
        max_live_bytes: Stats::get(&stats.max_live_bytes),
        budget_bytes: setup.budget_bytes,
        errors,
        runners_used: runners_used.len(),
        overtaken,
    }
}

/// One end-to-end case with the in-process backend.
#[derive(Debug, Clone, Copy)]
struct Variant {
    skewed: bool,
    load: Duration,
    holds: bool,
    /// GPU memory: 20 GiB holds about 5 of the models, 80 GiB all of them.
    gpu_gib: u64,
    /// Most runners at once.
    max_loaded: usize,
}

/// 20 models of 2..6 GiB (4 on average) on one GPU.
fn in_process(requests: usize, v: Variant) -> Setup {
    let models: Vec<ModelRequest> =
        (0..20u64).map(|i| model_request(i, (2 + i % 5) * GIB, PathBuf::from(format!("/blobs/{i}")))).collect();
    let budget = v.gpu_gib * GIB;
    let mut work = workload(requests, 20, v.skewed, 0x5eed);
    if !v.holds {
        for (_, hold) in &mut work {
            *hold = Hold::None;
        }
    }
    Setup {
        label: format!(
            "{} GiB/{} max, {} load, {}, {}",
            v.gpu_gib,
            v.max_loaded,
            if v.load.is_zero() { "instant".to_owned() } else { format!("{} ms", v.load.as_millis()) },
            if v.skewed { "1/rank" } else { "uniform" },
            if v.holds { "held" } else { "no hold" }
        ),
        backend: Arc::new(InstantBackend { load: v.load, stop: v.load }),
        gpus: vec![GpuView { index: 0, name: "gpu0".into(), worker: None, usable: budget }],
        host_usable: 64 * GIB,
        limits: limits(v.max_loaded, requests + 1),
        models,
        budget_bytes: budget,
        work,
        deadline: Duration::from_secs(300),
    }
}

fn check(row: &E2eRow) {
    assert!(row.errors.is_empty(), "{}: errors {:?}", row.label, row.errors);
    assert!(row.max_live_bytes <= row.budget_bytes, "{}: memory budget exceeded", row.label);
    assert!(row.max_live <= row.max_loaded as u64, "{}: count limit exceeded", row.label);
    assert_eq!(row.failed_loads, 0, "{}: failed loads", row.label);
}

// ---------------------------------------------------------------------------------------
// 3. The real backend with fake-llama-server

fn find_fake() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("CORRAL_FAKE_LLAMA_SERVER") {
        return Some(PathBuf::from(path));
    }
    let exe = std::env::current_exe().ok();
    // target/<profile>/deps/scheduler-<hash>: the fake is in target/<profile>.
    let beside = exe.as_deref().and_then(Path::parent).and_then(Path::parent).map(|d| d.join("fake-llama-server"));
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    beside
        .into_iter()
        .chain(["release", "debug"].map(|profile| manifest.join("target").join(profile).join("fake-llama-server")))
        .find(|p| p.is_file())
}

fn with_fake(fake: &Path, dir: &Path, requests: usize) -> Setup {
    let runtime_dir = dir.join("run");
    std::fs::create_dir_all(&runtime_dir).expect("runtime dir");
    let config = SupervisorConfig {
        llama_server: fake.to_owned(),
        runtime_dir,
        inherited_env: vec![("PATH".into(), std::env::var_os("PATH").unwrap_or_default())],
        log_sink: LogSink::Tracing,
        cgroups: None,
        stop_grace: Duration::from_secs(10),
        worker_link_timeout: Duration::from_secs(3),
    };
    let models: Vec<ModelRequest> = (0..5)
        .map(|i| {
            let file = dir.join(format!("model-{i}.json"));
            std::fs::write(&file, "{}").expect("write the behaviour");
            model_request(i, GIB, file)
        })
        .collect();
    Setup {
        label: "SupervisorBackend, 5 models, 2 max, 1/rank, held".to_owned(),
        backend: Arc::new(SupervisorBackend {
            config,
            load_timeout: Duration::from_secs(30),
            devices: Arc::default(),
            probe: None,
            projections: None,
        }),
        gpus: Vec::new(),
        host_usable: 64 * GIB,
        // The fake reports about 1.4 MiB once loaded, so memory never binds: the count does.
        limits: limits(2, requests + 1),
        models,
        budget_bytes: 64 * GIB,
        work: workload(requests, 5, true, 0xfa6e),
        deadline: Duration::from_secs(300),
    }
}

// ---------------------------------------------------------------------------------------
// Fast path through the handle

/// Round trips of `acquire` for a ready model while 20 are loaded, the lease dropped after each.
async fn fast_path(iterations: usize) -> Spread {
    let backend = Arc::new(InstantBackend { load: Duration::ZERO, stop: Duration::ZERO });
    let (scheduler, handle) = Scheduler::new(
        backend,
        vec![GpuView { index: 0, name: "gpu0".into(), worker: None, usable: 80 * GIB }],
        64 * GIB,
        limits(32, 64),
        Footprints::in_memory(),
    );
    let scheduler = tokio::spawn(scheduler.run());
    let models: Vec<ModelRequest> =
        (0..20).map(|i| model_request(i, GIB, PathBuf::from(format!("/blobs/{i}")))).collect();
    for model in &models {
        drop(handle.acquire(model.clone()).await.expect("load"));
    }
    assert_eq!(handle.loaded().await.expect("loaded").len(), 20);
    let request = &models[10];
    for _ in 0..iterations / 10 {
        drop(handle.acquire(request.clone()).await.expect("warm-up"));
    }
    let mut samples = Vec::with_capacity(iterations);
    for _ in 0..iterations {
        let request = request.clone();
        let start = Instant::now();
        let lease = handle.acquire(request).await.expect("fast path");
        samples.push(start.elapsed());
        drop(lease);
    }
    handle.shutdown().await;
    scheduler.await.expect("the scheduler task");
    spread(samples)
}

/// The floor for a round trip: a bare task answering on a oneshot what comes through a
/// bounded mpsc channel, as the handle talks to the scheduler, with nothing done in between.
async fn echo_baseline(iterations: usize) -> Spread {
    let (tx, mut rx) = tokio::sync::mpsc::channel::<tokio::sync::oneshot::Sender<u64>>(64);
    let echo = tokio::spawn(async move {
        let mut n = 0;
        while let Some(reply) = rx.recv().await {
            n += 1;
            let _ = reply.send(n);
        }
    });
    let mut samples = Vec::with_capacity(iterations);
    for i in 0..iterations + iterations / 10 {
        let start = Instant::now();
        let (reply, answer) = tokio::sync::oneshot::channel();
        tx.send(reply).await.expect("echo task");
        black_box(answer.await.expect("echo"));
        if i >= iterations / 10 {
            samples.push(start.elapsed());
        }
    }
    drop(tx);
    echo.await.expect("echo task");
    spread(samples)
}

/// CPU time (user and system, all threads) this process used so far, from `/proc/self/stat`
/// (clock ticks of 10 ms).
fn cpu_time() -> Duration {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let fields: Vec<u64> = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest.split_whitespace().skip(11).take(2).filter_map(|f| f.parse().ok()).collect())
        .unwrap_or_default();
    Duration::from_millis(fields.iter().sum::<u64>() * 10)
}

// ---------------------------------------------------------------------------------------

fn print_decisions(rows: &[DecisionRow], iterations: usize, clock: Duration, round_trip: &Spread, echo: &Spread) {
    println!("decision latency: policy::decide, 20 runners, {iterations} decisions per case (µs)");
    println!("  (one clock read pair costs {:.3} µs and is included)", us(clock));
    println!(
        "  {:>4}  {:<20} {:>8} {:>8} {:>8}   {:>13} {:>8} {:>8}",
        "GPUs", "case", "p50", "p99", "max", "+clone: p50", "p99", "max"
    );
    for row in rows {
        println!(
            "  {:>4}  {:<20} {:>8.2} {:>8.2} {:>8.2}   {:>13.2} {:>8.2} {:>8.2}",
            row.gpus,
            row.case.label(),
            us(row.decide.p50),
            us(row.decide.p99),
            us(row.decide.max),
            us(row.with_clone.p50),
            us(row.with_clone.p99),
            us(row.with_clone.max)
        );
    }
    let worst = rows.iter().map(|r| r.decide.p99).max().unwrap_or_default();
    let worst_clone = rows.iter().map(|r| r.with_clone.p99).max().unwrap_or_default();
    println!(
        "  worst p99: {:.2} µs ({:.2} µs with the clone); target p99 < {:.0} µs: {}",
        us(worst),
        us(worst_clone),
        us(TARGET),
        if worst_clone < TARGET { "met" } else { "NOT met" }
    );
    println!(
        "  Handle::acquire round trip, fast path (ready runner among 20), {iterations} sequential: \
         p50 {:.2} µs, p99 {:.2} µs, max {:.2} µs",
        us(round_trip.p50),
        us(round_trip.p99),
        us(round_trip.max)
    );
    println!(
        "  floor: a bare mpsc -> oneshot echo task, same runtime: p50 {:.2} µs, p99 {:.2} µs, max {:.2} µs",
        us(echo.p50),
        us(echo.p99),
        us(echo.max)
    );
}

fn print_e2e_header() {
    println!(
        "  {:<50} {:>8} {:>8} {:>8} {:>6} {:>6} {:>6} {:>11} {:>8} {:>8} {:>8} {:>9}",
        "case",
        "wall ms",
        "req/s",
        "CPU µs/r",
        "loads",
        "evict",
        "max n",
        "max GiB",
        "p50 ms",
        "p99 ms",
        "max ms",
        "overtaken"
    );
}

fn print_e2e(row: &E2eRow) {
    let requests = f64::from(u32::try_from(row.requests).unwrap_or(u32::MAX));
    println!(
        "  {:<50} {:>8.1} {:>8.0} {:>8.1} {:>6} {:>6} {:>6} {:>11} {:>8.2} {:>8.2} {:>8.2} {:>9}",
        row.label,
        ms(row.wall),
        requests / row.wall.as_secs_f64(),
        us(row.cpu) / requests,
        row.loads,
        row.evictions,
        format!("{}/{}", row.max_live, row.max_loaded),
        format!("{:.1}/{:.1}", gib(row.max_live_bytes), gib(row.budget_bytes)),
        ms(row.acquire.p50),
        ms(row.acquire.p99),
        ms(row.acquire.max),
        row.overtaken,
    );
    assert_eq!(row.runners_used, usize::try_from(row.loads).unwrap_or(usize::MAX), "every runner served a request");
}

fn main() {
    let iterations = env_or("CORRAL_BENCH_ITERATIONS", 50_000).max(1);
    let requests = env_or("CORRAL_BENCH_REQUESTS", 10_000).max(1);
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("runtime");

    let clock = clock_cost();
    let rows: Vec<DecisionRow> = [0, 1, 4]
        .into_iter()
        .flat_map(|gpus| Case::ALL.map(|case| (gpus, case)))
        .map(|(gpus, case)| time_decisions(gpus, case, iterations))
        .collect();
    // Both from a spawned task, so that client and scheduler run on the runtime's workers.
    let round_trip = runtime.block_on(async { tokio::spawn(fast_path(iterations)).await.expect("fast path") });
    let echo = runtime.block_on(async { tokio::spawn(echo_baseline(iterations)).await.expect("echo") });
    print_decisions(&rows, iterations, clock, &round_trip, &echo);
    println!();

    println!(
        "end to end: {requests} concurrent acquires over 20 models of 2..6 GiB on one GPU, \
         multi-thread runtime, in-process backend"
    );
    print_e2e_header();
    let held = Variant { skewed: false, load: Duration::ZERO, holds: true, gpu_gib: 20, max_loaded: 8 };
    for variant in [
        held,
        Variant { skewed: true, ..held },
        Variant { skewed: true, load: Duration::from_millis(1), ..held },
        Variant { holds: false, ..held },
        Variant { gpu_gib: 80, max_loaded: 20, ..held },
    ] {
        let row = runtime.block_on(end_to_end(in_process(requests, variant)));
        print_e2e(&row);
        check(&row);
    }
    println!();

    match find_fake() {
        Some(fake) => {
            let dir = tempfile::tempdir().expect("tempdir");
            println!("end to end with processes: {}", fake.display());
            print_e2e_header();
            let row = runtime.block_on(end_to_end(with_fake(&fake, dir.path(), requests.min(200))));
            print_e2e(&row);
            check(&row);
        }
        None => println!(
            "end to end with processes: skipped, no fake-llama-server \
             (cargo build --release --bin fake-llama-server, or set CORRAL_FAKE_LLAMA_SERVER)"
        ),
    }
}
