//! The view model of `corralctl top`: what corrald said over D-Bus (as typed updates,
//! decoded in [`super::bus`]) folded into one state, and that state turned into rows and
//! memory bars. Pure: no IO, no clock (the time is passed in), no terminal.

use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::Serialize;

use crate::ctl::output::{expires, size};
use crate::gpu::HostMemory;

/// How many events are kept (the view shows as many as fit).
pub const EVENTS_KEPT: usize = 200;

/// A GPU as the Manager's `Gpus` property lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Gpu {
    /// Stable id.
    pub id: String,
    /// Product name.
    pub name: String,
    /// cuda, rocm or vulkan.
    pub driver: String,
    /// Bytes in all.
    pub total: u64,
    /// Bytes corral could use at start (the rest was taken by other processes).
    pub usable: u64,
}

/// One property of a Manager, as read or signalled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ManagerProp {
    /// corrald's version.
    Version(String),
    /// The GPUs found at start.
    Gpus(Vec<Gpu>),
    /// Host memory corral may use, in bytes.
    HostMemory(u64),
    /// Requests waiting for a load.
    QueueDepth(u32),
    /// The most waiting requests.
    MaxQueue(u32),
    /// The most runners.
    MaxLoadedModels(u32),
}

/// One property of a Model object, as read or signalled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelProp {
    /// Full name.
    Name(String),
    /// The name as Ollama shows it.
    ShortName(String),
    /// stopped, loading, ready, unloading or failed.
    State(String),
    /// Why the last load or run failed.
    LastError(String),
    /// The llama-server process.
    Pid(u32),
    /// Layers on GPUs.
    GpuLayers(u32),
    /// All layers.
    TotalLayers(u32),
    /// Bytes on GPUs.
    VramBytes(u64),
    /// Bytes in host memory.
    RamBytes(u64),
    /// Microseconds since the epoch when an idle model unloads; 0 for not at all.
    ExpiresAt(u64),
    /// Requests holding it.
    ActiveRequests(u32),
    /// Generated tokens per second in its last answer, in tenths (0 before one).
    TokensPerSecond(u32),
}

/// Something corrald announced with a signal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Signal {
    /// `ModelLoaded`.
    Loaded {
        /// The model.
        name: String,
        /// Its runner.
        pid: u32,
    },
    /// `ModelUnloaded`.
    Unloaded {
        /// The model.
        name: String,
        /// expired, evicted, requested, reloaded, crashed or shutdown.
        reason: String,
    },
    /// `OffloadReported`.
    Offload {
        /// The model.
        name: String,
        /// Layers on GPUs.
        gpu_layers: u32,
        /// All layers.
        total_layers: u32,
        /// Bytes on GPUs.
        vram: u64,
        /// Bytes in host memory.
        ram: u64,
    },
    /// `JobFinished`.
    JobFinished {
        /// The job's object path.
        job: String,
        /// Whether it did what it was asked.
        success: bool,
        /// What went wrong.
        error: String,
    },
}

/// A change to fold into the [`State`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Update {
    /// A full read follows: forget the model objects (corrald may have restarted).
    Reset,
    /// Manager properties.
    Manager(Vec<ManagerProp>),
    /// A model object's properties (a new object, or changed ones).
    Model {
        /// Its object path.
        path: String,
        /// What changed.
        props: Vec<ModelProp>,
    },
    /// A model object went away (its model was deleted).
    ModelRemoved {
        /// Its object path.
        path: String,
    },
    /// A signal.
    Signal(Signal),
    /// This host's memory now (from `/proc/meminfo`).
    Host(HostMemory),
}

/// A model as the objects describe it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ModelEntry {
    /// Full name.
    pub name: String,
    /// Short name.
    pub short_name: String,
    /// State.
    pub state: String,
    /// Why the last load or run failed.
    pub last_error: String,
    /// The llama-server process; 0 when not ready.
    pub pid: u32,
    /// Layers on GPUs.
    pub gpu_layers: u32,
    /// All layers.
    pub total_layers: u32,
    /// Bytes on GPUs.
    pub vram_bytes: u64,
    /// Bytes in host memory.
    pub ram_bytes: u64,
    /// Microseconds since the epoch; 0 for not at all.
    pub expires_at: u64,
    /// Requests holding it.
    pub active_requests: u32,
    /// Generated tokens per second in its last answer, in tenths; 0 before one.
    pub speed_tenths: u32,
}

impl ModelEntry {
    fn set(&mut self, prop: ModelProp) {
        match prop {
            ModelProp::Name(v) => self.name = v,
            ModelProp::ShortName(v) => self.short_name = v,
            ModelProp::State(v) => self.state = v,
            ModelProp::LastError(v) => self.last_error = v,
            ModelProp::Pid(v) => self.pid = v,
            ModelProp::GpuLayers(v) => self.gpu_layers = v,
            ModelProp::TotalLayers(v) => self.total_layers = v,
            ModelProp::VramBytes(v) => self.vram_bytes = v,
            ModelProp::RamBytes(v) => self.ram_bytes = v,
            ModelProp::ExpiresAt(v) => self.expires_at = v,
            ModelProp::ActiveRequests(v) => self.active_requests = v,
            ModelProp::TokensPerSecond(v) => self.speed_tenths = v,
        }
    }

    /// Whether `top` lists it: it has a runner, or its last load failed.
    #[must_use]
    pub fn shown(&self) -> bool {
        !self.state.is_empty() && self.state != "stopped"
    }

    fn label(&self) -> &str {
        if self.short_name.is_empty() { &self.name } else { &self.short_name }
    }
}

/// One line of the event log.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Event {
    /// When it arrived.
    #[serde(serialize_with = "rfc3339")]
    pub at: SystemTime,
    /// What happened, for people.
    pub text: String,
    /// Whether it is bad news (a crash, a failed load or job).
    pub bad: bool,
}

fn rfc3339<S: serde::Serializer>(at: &SystemTime, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&humantime::format_rfc3339_seconds(*at).to_string())
}

/// Everything `top` knows.
#[derive(Debug, Clone, Default, Serialize)]
pub struct State {
    /// corrald's version.
    pub version: String,
    /// GPUs found at start.
    pub gpus: Vec<Gpu>,
    /// Host memory corral may use.
    pub host_limit: u64,
    /// This host's memory, when it could be read.
    #[serde(skip)]
    pub host: Option<HostMemory>,
    /// Requests waiting for a load.
    pub queue_depth: u32,
    /// The most waiting requests.
    pub max_queue: u32,
    /// The most runners.
    pub max_loaded_models: u32,
    /// Model objects by path.
    #[serde(skip)]
    pub models: BTreeMap<String, ModelEntry>,
    /// Newest first.
    pub events: VecDeque<Event>,
    /// The selected model's object path.
    #[serde(skip)]
    pub selected: Option<String>,
    /// The status line: the outcome of the last key.
    #[serde(skip)]
    pub status: String,
    /// Whether the help is shown.
    #[serde(skip)]
    pub help: bool,
}

/// A row of the models table, as text.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Row {
    /// Object path (not shown).
    #[serde(skip)]
    pub path: String,
    /// Short name.
    pub name: String,
    /// State.
    pub state: String,
    /// Process id, "-" without one.
    pub pid: String,
    /// Where its layers are: "GPU 5/5", "CPU", "-" while loading.
    pub place: String,
    /// GPU memory.
    pub vram: String,
    /// Host memory.
    pub ram: String,
    /// Requests holding it.
    pub active: u32,
    /// Generated tokens per second in its last answer: "12.5", "-" before one.
    pub speed: String,
    /// When it unloads: "in 4m 59s", "-".
    pub until: String,
    /// Why it failed, if it did.
    pub error: String,
    /// Whether it is the selected row.
    #[serde(skip)]
    pub selected: bool,
}

/// A memory bar: a device's bytes split into corral's runners, other processes and free.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Bar {
    /// "host", or the GPU's id.
    pub label: String,
    /// What it is ("NVIDIA …", "host memory").
    pub detail: String,
    /// Bytes in all.
    pub total: u64,
    /// Bytes held by corral's runners.
    pub corral: u64,
    /// Bytes held by other processes.
    pub other: u64,
    /// Bytes free.
    pub free: u64,
}

impl Bar {
    fn new(label: String, detail: String, total: u64, corral: u64, other: u64) -> Self {
        // Measurements taken at different times may overlap; the bar never exceeds total.
        let corral = corral.min(total);
        let other = other.min(total - corral);
        Self { label, detail, total, corral, other, free: total - corral - other }
    }

    /// Cells of `width` for (corral, other, free), each rounded, summing to `width`.
    #[must_use]
    pub fn cells(&self, width: u16) -> (u16, u16, u16) {
        if self.total == 0 {
            return (0, 0, width);
        }
        let scale = |bytes: u64| -> u16 {
            let cells = (u128::from(bytes) * u128::from(width) + u128::from(self.total) / 2) / u128::from(self.total);
            u16::try_from(cells).unwrap_or(width).min(width)
        };
        let corral = scale(self.corral).max(u16::from(self.corral > 0).min(width));
        let other = scale(self.other).min(width - corral);
        (corral, other, width - corral - other)
    }

    /// "corral 1 GiB · other 2 GiB · free 5 GiB of 8 GiB".
    #[must_use]
    pub fn summary(&self) -> String {
        format!(
            "corral {} · other {} · free {} of {}",
            size(self.corral),
            size(self.other),
            size(self.free),
            size(self.total)
        )
    }
}

impl State {
    /// Folds `update` in; signals become events stamped `now`.
    pub fn apply(&mut self, update: Update, now: SystemTime) {
        match update {
            Update::Manager(props) => {
                for prop in props {
                    match prop {
                        ManagerProp::Version(v) => self.version = v,
                        ManagerProp::Gpus(v) => self.gpus = v,
                        ManagerProp::HostMemory(v) => self.host_limit = v,
                        ManagerProp::QueueDepth(v) => self.queue_depth = v,
                        ManagerProp::MaxQueue(v) => self.max_queue = v,
                        ManagerProp::MaxLoadedModels(v) => self.max_loaded_models = v,
                    }
                }
            }
            Update::Model { path, props } => {
                let entry = self.models.entry(path).or_default();
                let was_loading = entry.state == "loading";
                for prop in props {
                    entry.set(prop);
                }
                // A failed load has no signal of its own: its state says so. (A runner
                // that crashed also ends "failed", from "ready": ModelUnloaded tells that.)
                if entry.state == "failed" && was_loading {
                    let text = format!("{} failed to load: {}", entry.label(), entry.last_error);
                    self.log(now, text, true);
                }
            }
            Update::Reset => self.models.clear(),
            Update::ModelRemoved { path } => {
                self.models.remove(&path);
            }
            Update::Signal(signal) => self.signal(signal, now),
            Update::Host(host) => self.host = Some(host),
        }
        self.keep_selection();
    }

    fn signal(&mut self, signal: Signal, now: SystemTime) {
        let (text, bad) = match signal {
            Signal::Loaded { name, pid } => (format!("loaded {} (pid {pid})", self.short(&name)), false),
            Signal::Unloaded { name, reason } => {
                let short = self.short(&name);
                if reason == "crashed" {
                    let why = self
                        .models
                        .values()
                        .find(|m| m.name == name || m.short_name == name)
                        .map(|m| m.last_error.clone())
                        .filter(|e| !e.is_empty());
                    (format!("{short} crashed{}", why.map(|w| format!(": {w}")).unwrap_or_default()), true)
                } else {
                    (format!("unloaded {short}: {}", reason_text(&reason)), false)
                }
            }
            Signal::Offload { name, gpu_layers, total_layers, vram, ram } => (
                format!(
                    "{}: {gpu_layers}/{total_layers} layers on GPUs, {} GPU memory, {} host memory",
                    self.short(&name),
                    size(vram),
                    size(ram)
                ),
                false,
            ),
            Signal::JobFinished { job, success, error } => {
                let n = job.rsplit('/').next().unwrap_or(&job).to_owned();
                if success { (format!("job {n} finished"), false) } else { (format!("job {n} failed: {error}"), true) }
            }
        };
        self.log(now, text, bad);
    }

    fn log(&mut self, at: SystemTime, text: String, bad: bool) {
        self.events.push_front(Event { at, text, bad });
        self.events.truncate(EVENTS_KEPT);
    }

    /// The short name of the model `name` (full or short), as the objects know it.
    fn short(&self, name: &str) -> String {
        self.models.values().find(|m| m.name == name).map_or_else(|| name.to_owned(), |m| m.label().to_owned())
    }

    /// The paths of the models listed, in name order.
    fn shown_paths(&self) -> Vec<&String> {
        let mut shown: Vec<(&String, &ModelEntry)> = self.models.iter().filter(|(_, m)| m.shown()).collect();
        shown.sort_by(|a, b| a.1.label().cmp(b.1.label()));
        shown.into_iter().map(|(p, _)| p).collect()
    }

    /// The paths of models with a runner, whose unsignalled counters are worth reading.
    #[must_use]
    pub fn live_paths(&self) -> Vec<String> {
        self.models.iter().filter(|(_, m)| m.shown() && m.state != "failed").map(|(p, _)| p.clone()).collect()
    }

    /// A selection that vanished moves to the first row; none is kept when there are no rows.
    fn keep_selection(&mut self) {
        let shown = self.shown_paths();
        let keep = self.selected.as_ref().is_some_and(|s| shown.contains(&s));
        if !keep {
            self.selected = shown.first().map(|p| (*p).clone());
        }
    }

    /// Moves the selection `down` (or up) one row, stopping at the ends.
    pub fn move_selection(&mut self, down: bool) {
        let shown = self.shown_paths();
        let at = self.selected.as_ref().and_then(|s| shown.iter().position(|p| *p == s));
        let next = match at {
            None => 0,
            Some(i) if down => (i + 1).min(shown.len().saturating_sub(1)),
            Some(i) => i.saturating_sub(1),
        };
        self.selected = shown.get(next).map(|p| (*p).clone());
    }

    /// The selected model's full name.
    #[must_use]
    pub fn selected_name(&self) -> Option<String> {
        let entry = self.models.get(self.selected.as_ref()?)?;
        Some(if entry.name.is_empty() { entry.short_name.clone() } else { entry.name.clone() })
    }

    /// The rows of the models table.
    #[must_use]
    pub fn rows(&self, now: SystemTime) -> Vec<Row> {
        self.shown_paths()
            .into_iter()
            .map(|path| {
                let m = &self.models[path];
                let ready = m.state == "ready";
                Row {
                    path: path.clone(),
                    name: m.label().to_owned(),
                    state: m.state.clone(),
                    pid: if m.pid == 0 { "-".to_owned() } else { m.pid.to_string() },
                    place: place(m),
                    vram: if ready || m.vram_bytes > 0 { size(m.vram_bytes) } else { "-".to_owned() },
                    ram: if ready || m.ram_bytes > 0 { size(m.ram_bytes) } else { "-".to_owned() },
                    active: m.active_requests,
                    speed: if m.speed_tenths == 0 {
                        "-".to_owned()
                    } else {
                        format!("{}.{}", m.speed_tenths / 10, m.speed_tenths % 10)
                    },
                    until: expires(m.expires_at, now),
                    error: m.last_error.clone(),
                    selected: self.selected.as_ref() == Some(path),
                }
            })
            .collect()
    }

    /// Host memory first, then each GPU.
    ///
    /// GPUs: other processes held what corral could not use at start (`Gpus` is read
    /// once); corral's share of several GPUs is split in proportion to what each had
    /// free, as llama.cpp splits layers by default, until corrald reports per-device use.
    #[must_use]
    pub fn bars(&self) -> Vec<Bar> {
        let mut bars = Vec::new();
        let ram: u64 = self.models.values().map(|m| m.ram_bytes).sum();
        if let Some(host) = self.host {
            let used = host.total_bytes.saturating_sub(host.available_bytes);
            bars.push(Bar::new(
                "host".to_owned(),
                format!("corral may use {}", size(self.host_limit)),
                host.total_bytes,
                ram,
                used.saturating_sub(ram),
            ));
        } else {
            bars.push(Bar::new("host".to_owned(), "corral's share".to_owned(), self.host_limit, ram, 0));
        }
        let vram: u64 = self.models.values().map(|m| m.vram_bytes).sum();
        let usable: u64 = self.gpus.iter().map(|g| g.usable).sum();
        for gpu in &self.gpus {
            let share = if usable == 0 {
                0
            } else {
                u64::try_from(u128::from(vram) * u128::from(gpu.usable) / u128::from(usable)).unwrap_or(u64::MAX)
            };
            bars.push(Bar::new(
                gpu.id.clone(),
                format!("{} ({})", gpu.name, gpu.driver),
                gpu.total,
                share,
                gpu.total.saturating_sub(gpu.usable),
            ));
        }
        bars
    }

    /// The header: version, loaded models, queue.
    #[must_use]
    pub fn header(&self) -> String {
        let loaded = self.models.values().filter(|m| m.shown() && m.state != "failed").count();
        format!(
            "corrald {} · {loaded} of {} loaded · queue {} of {}",
            self.version, self.max_loaded_models, self.queue_depth, self.max_queue
        )
    }
}

/// Where a model's layers are.
fn place(m: &ModelEntry) -> String {
    if m.state != "ready" || m.total_layers == 0 {
        "-".to_owned()
    } else if m.gpu_layers == 0 || m.vram_bytes == 0 {
        // What sits on a device is what its memory shows: llama.cpp's RPC-enabled build
        // reports layers "offloaded" on a host without GPUs.
        "CPU".to_owned()
    } else if m.gpu_layers >= m.total_layers {
        format!("GPU {}/{}", m.gpu_layers, m.total_layers)
    } else {
        format!("split {}/{}", m.gpu_layers, m.total_layers)
    }
}

/// A `ModelUnloaded` reason for people.
fn reason_text(reason: &str) -> &str {
    match reason {
        "expired" => "keep-alive expired",
        "evicted" => "evicted to make room",
        "requested" => "unload requested",
        "reloaded" => "reloaded with new options",
        "shutdown" => "corrald stopped",
        other => other,
    }
}

/// `at` as "15:04:05" (UTC).
#[must_use]
pub fn clock(at: SystemTime) -> String {
    let secs = at.duration_since(UNIX_EPOCH).unwrap_or(Duration::ZERO).as_secs() % 86_400;
    format!("{:02}:{:02}:{:02}", secs / 3600, secs / 60 % 60, secs % 60)
}

#[cfg(test)]
pub(crate) mod tests {
    use std::time::{Duration, UNIX_EPOCH};

    use super::{Bar, Gpu, ManagerProp, ModelProp, Signal, State, Update, clock};
    use crate::gpu::HostMemory;

    const GIB: u64 = 1 << 30;

    /// A state with two GPUs, a ready model, a loading one and a stopped one.
    pub(crate) fn sample() -> State {
        let now = UNIX_EPOCH + Duration::from_secs(1_000);
        let mut s = State::default();
        s.apply(
            Update::Manager(vec![
                ManagerProp::Version("0.1.0".into()),
                ManagerProp::Gpus(vec![
                    Gpu {
                        id: "GPU-0".into(),
                        name: "Big".into(),
                        driver: "cuda".into(),
                        total: 24 * GIB,
                        usable: 20 * GIB,
                    },
                    Gpu {
                        id: "GPU-1".into(),
                        name: "Small".into(),
                        driver: "cuda".into(),
                        total: 8 * GIB,
                        usable: 4 * GIB,
                    },
                ]),
                ManagerProp::HostMemory(16 * GIB),
                ManagerProp::QueueDepth(2),
                ManagerProp::MaxQueue(512),
                ManagerProp::MaxLoadedModels(3),
            ]),
            now,
        );
        s.apply(Update::Host(HostMemory { total_bytes: 32 * GIB, available_bytes: 20 * GIB }), now);
        let model = |short: &str, state: &str| {
            vec![
                ModelProp::Name(format!("registry.ollama.ai/library/{short}")),
                ModelProp::ShortName(short.into()),
                ModelProp::State(state.into()),
            ]
        };
        let mut ready = model("tiny:latest", "ready");
        ready.extend([
            ModelProp::Pid(4242),
            ModelProp::GpuLayers(5),
            ModelProp::TotalLayers(5),
            ModelProp::VramBytes(6 * GIB),
            ModelProp::RamBytes(GIB),
            ModelProp::ExpiresAt(1_299_500_000),
            ModelProp::ActiveRequests(1),
            ModelProp::TokensPerSecond(125),
        ]);
        s.apply(Update::Model { path: "/m/tiny".into(), props: ready }, now);
        s.apply(Update::Model { path: "/m/big".into(), props: model("big:q4", "loading") }, now);
        let mut cpu = model("cpu:latest", "ready");
        cpu.extend([ModelProp::GpuLayers(5), ModelProp::TotalLayers(5), ModelProp::RamBytes(0)]);
        s.apply(Update::Model { path: "/m/cpu".into(), props: cpu }, now);
        s.apply(Update::Model { path: "/m/idle".into(), props: model("idle:latest", "stopped") }, now);
        s.apply(
            Update::Signal(Signal::Loaded { name: "registry.ollama.ai/library/tiny:latest".into(), pid: 4242 }),
            now,
        );
        s
    }

    #[test]
    fn rows_list_models_with_a_runner_in_name_order_and_select_the_first() {
        let s = sample();
        let rows = s.rows(UNIX_EPOCH + Duration::from_secs(1_000));
        let names: Vec<&str> = rows.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(names, ["big:q4", "cpu:latest", "tiny:latest"], "stopped models are not listed");
        assert!(rows[2].selected && !rows[0].selected, "the first model listed stays selected as others come");
        assert_eq!(rows[1].place, "CPU", "layers reported offloaded with no GPU memory sit on the CPU");
        let tiny = &rows[2];
        assert_eq!(
            (tiny.state.as_str(), tiny.pid.as_str(), tiny.place.as_str(), tiny.vram.as_str(), tiny.ram.as_str()),
            ("ready", "4242", "GPU 5/5", "6.0 GiB", "1.0 GiB")
        );
        assert_eq!((tiny.active, tiny.until.as_str()), (1, "in 4m 59s"));
        assert_eq!((rows[0].pid.as_str(), rows[0].place.as_str(), rows[0].vram.as_str()), ("-", "-", "-"));
    }

    #[test]
    fn the_selection_moves_within_the_rows_and_follows_removals() {
        let mut s = sample();
        let now = UNIX_EPOCH;
        for _ in 0..3 {
            s.move_selection(false);
        }
        assert_eq!(s.selected.as_deref(), Some("/m/big"), "stops at the top");
        for _ in 0..3 {
            s.move_selection(true);
        }
        assert_eq!(s.selected.as_deref(), Some("/m/tiny"), "stops at the bottom");
        assert_eq!(s.selected_name().as_deref(), Some("registry.ollama.ai/library/tiny:latest"));
        s.apply(Update::Model { path: "/m/tiny".into(), props: vec![ModelProp::State("stopped".into())] }, now);
        assert_eq!(s.selected.as_deref(), Some("/m/big"), "an unloaded selection moves to a listed row");
        s.apply(Update::ModelRemoved { path: "/m/big".into() }, now);
        assert_eq!(s.selected.as_deref(), Some("/m/cpu"));
        s.apply(Update::ModelRemoved { path: "/m/cpu".into() }, now);
        assert_eq!(s.selected, None);

        let mut s = sample();
        s.apply(Update::Reset, now);
        assert!(s.rows(now).is_empty() && s.selected.is_none(), "a reset forgets the models");
        assert!(!s.events.is_empty() && s.max_queue == 512, "and keeps the rest");
        assert_eq!(s.selected_name(), None);
    }

    #[test]
    fn signals_and_failures_become_events_newest_first() {
        let mut s = sample();
        let now = UNIX_EPOCH + Duration::from_secs(3_725);
        let full = "registry.ollama.ai/library/tiny:latest";
        s.apply(Update::Signal(Signal::Unloaded { name: full.into(), reason: "evicted".into() }), now);
        s.apply(
            // As corrald signals a crash: the error, the state, then ModelUnloaded.
            Update::Model {
                path: "/m/tiny".into(),
                props: vec![ModelProp::LastError("killed by OOM".into()), ModelProp::State("failed".into())],
            },
            now,
        );
        s.apply(Update::Signal(Signal::Unloaded { name: full.into(), reason: "crashed".into() }), now);
        s.apply(
            Update::Model {
                path: "/m/big".into(),
                props: vec![ModelProp::LastError("no memory".into()), ModelProp::State("failed".into())],
            },
            now,
        );
        s.apply(
            Update::Signal(Signal::Offload { name: full.into(), gpu_layers: 3, total_layers: 5, vram: GIB, ram: 0 }),
            now,
        );
        let texts: Vec<(&str, bool)> = s.events.iter().map(|e| (e.text.as_str(), e.bad)).collect();
        assert_eq!(
            texts,
            [
                ("tiny:latest: 3/5 layers on GPUs, 1.0 GiB GPU memory, 0 B host memory", false),
                ("big:q4 failed to load: no memory", true),
                ("tiny:latest crashed: killed by OOM", true),
                ("unloaded tiny:latest: evicted to make room", false),
                ("loaded tiny:latest (pid 4242)", false),
            ]
        );
        assert_eq!(clock(now), "01:02:05");
        for _ in 0..300 {
            s.apply(Update::Signal(Signal::Loaded { name: "x".into(), pid: 1 }), now);
        }
        assert_eq!(s.events.len(), super::EVENTS_KEPT);
    }

    #[test]
    fn bars_split_each_device_into_corral_other_and_free() {
        let s = sample();
        let bars = s.bars();
        let parts: Vec<(&str, u64, u64, u64, u64)> =
            bars.iter().map(|b| (b.label.as_str(), b.total, b.corral, b.other, b.free)).collect();
        assert_eq!(
            parts,
            [
                ("host", 32 * GIB, GIB, 11 * GIB, 20 * GIB),
                // 6 GiB of runners split 20:4 between the GPUs.
                ("GPU-0", 24 * GIB, 5 * GIB, 4 * GIB, 15 * GIB),
                ("GPU-1", 8 * GIB, GIB, 4 * GIB, 3 * GIB),
            ]
        );
        assert_eq!(bars[0].summary(), "corral 1.0 GiB · other 11.0 GiB · free 20.0 GiB of 32.0 GiB");
        assert_eq!(s.header(), "corrald 0.1.0 · 3 of 3 loaded · queue 2 of 512", "loading counts, as in LoadedModels");
    }

    #[test]
    fn bar_cells_add_up_and_show_any_use() {
        let bar = Bar::new("x".into(), String::new(), 100, 1, 50);
        assert_eq!(bar.cells(10), (1, 5, 4), "a little use still shows as one cell");
        assert_eq!(Bar::new("x".into(), String::new(), 0, 0, 0).cells(7), (0, 0, 7));
        let over = Bar::new("x".into(), String::new(), 10, 30, 30);
        assert_eq!((over.corral, over.other, over.free), (10, 0, 0), "overlapping measurements are capped");
        assert_eq!(over.cells(4), (4, 0, 0));
    }
}
