//! What the scheduler speaks: a [`ModelRequest`], the [`Limits`] it works within, why a
//! request got no runner ([`ScheduleError`]), what it reports ([`LoadedModel`], [`Stats`])
//! and the [`Notice`]s views follow. Plain data: the loop that owns the state is
//! [`actor`](super::actor), its address [`Handle`](super::handle::Handle).

use std::time::Duration;

use tokio::time::Instant;

use super::failure::FailureClass;
use super::keep_alive::{Clamp, KeepAlive};
use super::key::RunnerKey;
use super::policy::{Footprint, Placement, RunnerId};
use crate::supervisor::command::{LoadOptions, ModelFiles};
use crate::supervisor::logparse::Offload;
use crate::supervisor::runner::DeviceMemory;

/// What a request asks for.
#[derive(Debug, Clone)]
pub struct ModelRequest {
    /// Runners are shared by requests with equal keys: the weights, adapters, projector
    /// and load options (a difference in any of them needs another runner). A runner of
    /// the same weights under another key is replaced, since its load options changed.
    pub key: RunnerKey,
    /// The model's display name.
    pub name: String,
    /// Its files.
    pub files: ModelFiles,
    /// Load options.
    pub options: LoadOptions,
    /// What it is expected to need (learned from earlier loads, or estimated).
    pub need: Footprint,
    /// The layers llama.cpp can offload (blocks and output layer; 0 when unknown).
    pub layers: u32,
    /// The client's keep-alive, if it sent one.
    pub keep_alive: Option<KeepAlive>,
    /// Never evicted once loaded.
    pub pinned: bool,
}

/// Scheduler limits and defaults.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// Most runners at once.
    pub max_loaded: usize,
    /// Most requests waiting for a load.
    pub max_queue: usize,
    /// The keep-alive when neither the client nor the runner has one.
    pub default_keep_alive: KeepAlive,
    /// Bounds on what clients ask for.
    pub clamp: Clamp,
    /// Whether a model too big for the GPUs may run partly on the CPU.
    pub partial_offload: bool,
}

/// Why a request got no runner.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScheduleError {
    /// The queue of requests waiting for a load is full.
    #[error("server busy: {0} requests are already waiting for a model to load")]
    QueueFull(usize),
    /// Even with every evictable model unloaded it would not fit.
    #[error(
        "model '{model}' needs {} of memory, but at most {} can be made available{}{}",
        crate::units::bytes(*.needed),
        crate::units::bytes(*.available),
        rooms(.devices, *.host),
        down_workers(.down)
    )]
    InsufficientMemory {
        /// The model.
        model: String,
        /// Bytes needed: on one device, or in host memory when there are none.
        needed: u64,
        /// Bytes that could be freed there (0: only the count of models stands in the way).
        available: u64,
        /// Each device with the bytes that could be made available on it.
        devices: Vec<(String, u64)>,
        /// The host memory that could be made available.
        host: u64,
        /// The workers that are down, each with why: their devices were not counted.
        down: Vec<String>,
    },
    /// The runner failed to start.
    #[error("model '{model}' failed to load: {reason}")]
    LoadFailed {
        /// The model.
        model: String,
        /// The kind of failure, for the edges to map (HTTP status, D-Bus error name).
        class: FailureClass,
        /// Why.
        reason: String,
    },
    /// The model crashed recently; loads wait before trying again.
    #[error(
        "model '{model}' failed {failures} times in a row, the last time with: {reason}; retrying in {}",
        crate::durations::human(*retry_in)
    )]
    BackingOff {
        /// The model.
        model: String,
        /// Consecutive failures.
        failures: u32,
        /// The last reason.
        reason: String,
        /// Time left before a new attempt.
        retry_in: Duration,
    },
    /// As many models as one runner serves already share the runner this model would
    /// share (the same weights and load options).
    #[error(
        "model '{model}' would share the runner that already serves {limit} models with the same weights and \
         load options ({first}, …), the most one runner serves; use one of their names, or stop one of them"
    )]
    TooManyNames {
        /// The model.
        model: String,
        /// The most names one runner serves.
        limit: usize,
        /// The first of the names it serves.
        first: String,
    },
    /// No model by that name is loaded.
    #[error("model '{0}' is not loaded")]
    NotLoaded(String),
    /// The scheduler stopped.
    #[error("the scheduler is shutting down")]
    ShuttingDown,
}

/// A loaded model as reported to `/api/ps`, D-Bus and `/metrics`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadedModel {
    /// The runner's id.
    pub id: RunnerId,
    /// The model's display name: the first model it was loaded for.
    pub name: String,
    /// Every model it serves, `name` first: models whose requests have the same key
    /// (the same weights and load options) share one runner.
    pub names: Vec<String>,
    /// Its key.
    pub key: RunnerKey,
    /// `loading`, `ready` or `unloading`.
    pub state: &'static str,
    /// Where it runs.
    pub placement: Placement,
    /// Its memory (measured once loaded).
    pub footprint: Footprint,
    /// Requests holding it.
    pub leases: u32,
    /// When it will be unloaded if no request comes (none while busy, or forever).
    pub expires_at: Option<Instant>,
    /// Its keep-alive.
    pub keep_alive: KeepAlive,
    /// The child's pid, once started.
    pub pid: Option<u32>,
    /// Its context per request slot (`num_ctx`).
    pub context_length: u32,
    /// The layers it placed on GPUs, once ready (when llama-server said).
    pub offload: Option<Offload>,
    /// Each device's memory, planned and actual, once ready.
    pub devices: Vec<DeviceMemory>,
}

/// Counters since start, for `/metrics`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    /// Loads started.
    pub loads: u64,
    /// Loads that failed.
    pub load_failures: u64,
    /// Total time of successful loads, in milliseconds.
    pub load_millis: u64,
    /// Runners stopped (expired, evicted, reloaded or asked to).
    pub unloads: u64,
    /// Runners chosen to make room (unloaded at once or drained).
    pub evictions: u64,
    /// Runners that died on their own.
    pub crashes: u64,
    /// Leases granted.
    pub leases: u64,
    /// Requests refused because the queue was full.
    pub queue_full: u64,
}

/// The scheduler's numbers now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stats {
    /// Counters since start.
    pub counters: Counters,
    /// Requests waiting for a load.
    pub queue_depth: usize,
    /// The runners.
    pub loaded: Vec<LoadedModel>,
}

/// ` (RPC0: 200 MiB, RPC1: 180 MiB; host: 2 GiB)`: each device's room, for the message.
fn rooms(devices: &[(String, u64)], host: u64) -> String {
    let devices: Vec<String> =
        devices.iter().map(|(name, bytes)| format!("{name}: {}", crate::units::bytes(*bytes))).collect();
    let devices = if devices.is_empty() { String::new() } else { format!("{}; ", devices.join(", ")) };
    format!(" ({devices}host memory: {})", crate::units::bytes(host))
}

/// The workers that are down, for the end of a message.
fn down_workers(down: &[String]) -> String {
    if down.is_empty() { String::new() } else { format!("; down, so not counted: {}", down.join("; ")) }
}

/// Why a runner stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnloadReason {
    /// Its keep-alive ran out (or was zero).
    Expired,
    /// It made room for another model.
    Evicted,
    /// Someone asked (an unload, or the model was deleted).
    Requested,
    /// The same weights were asked for with other load options.
    Reloaded,
    /// It died on its own.
    Crashed,
    /// A worker it used went down.
    WorkerDown,
    /// The daemon is stopping.
    Shutdown,
}

impl UnloadReason {
    /// The reason as D-Bus and the journal name it.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Expired => "expired",
            Self::Evicted => "evicted",
            Self::Requested => "requested",
            Self::Reloaded => "reloaded",
            Self::Crashed => "crashed",
            Self::WorkerDown => "worker-down",
            Self::Shutdown => "shutdown",
        }
    }
}

/// What changed in the scheduler, for views that follow it (D-Bus properties and
/// signals). Sent after the change; a view that falls behind reads
/// [`Handle::stats`](super::handle::Handle::stats).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Notice {
    /// A runner started loading.
    Loading {
        /// The runner.
        runner: RunnerId,
        /// The model's display name.
        name: String,
    },
    /// A runner is ready.
    Ready {
        /// The runner.
        runner: RunnerId,
        /// The model's display name.
        name: String,
        /// The child's pid.
        pid: u32,
        /// What it uses, measured (or the estimate when nothing could be measured).
        footprint: Footprint,
        /// The layers it placed on GPUs, as llama-server reported them.
        offload: Option<Offload>,
    },
    /// A load failed; the runner is gone.
    LoadFailed {
        /// The runner.
        runner: RunnerId,
        /// The model's display name.
        name: String,
        /// Why.
        reason: String,
    },
    /// The models a runner serves changed: another model with the same weights and load
    /// options now shares it, or a model moved to a runner of its own.
    Serving {
        /// The runner.
        runner: RunnerId,
        /// Every model it serves now, the first one it was loaded for first.
        names: Vec<String>,
    },
    /// A runner is being stopped.
    Unloading {
        /// The runner.
        runner: RunnerId,
        /// The model's display name.
        name: String,
    },
    /// A runner is gone and its child reaped.
    Unloaded {
        /// The runner.
        runner: RunnerId,
        /// The model's display name.
        name: String,
        /// Why it stopped.
        reason: UnloadReason,
        /// For a crash, what happened.
        detail: Option<String>,
    },
    /// New limits apply.
    Reconfigured(Limits),
}
