//! The scheduler task: the one owner of models, runners, the queue, leases and timers.
//!
//! Everything else holds a [`Handle`] and sends messages. A request [`Handle::acquire`]s
//! a [`Lease`] on a ready runner (loading it first if needed) and releases it by dropping
//! the lease. Slow work (starting and stopping runners) runs in tasks that report back
//! as events, so the loop never waits on a process. Decisions come from
//! [`policy::decide`] on a snapshot of this state. What it is asked and answers is in
//! [`types`](super::types) and [`handle`](super::handle).
//!
//! Over 800 lines for a reason: one state and the handlers that change it, which read best together.
//! What RPC workers coming and going do to it is in its `workers` module.

use std::collections::{BTreeMap, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{broadcast, mpsc, oneshot};
use tokio::time::Instant;

use super::backend::{Backend, LiveRunner, Projected, StartRequest};
use super::failure::LoadFailure;
use super::footprints::Footprints;
use super::handle::{Command, Event, Handle, Lease, Reaped};
use super::keep_alive::{self, KeepAlive};
use super::key::RunnerKey;
use super::policy::{self, Decision, Footprint, GpuView, Need, Placement, RunnerId, RunnerView, Snapshot};
use super::types::{Counters, Limits, LoadedModel, ModelRequest, Notice, ScheduleError, Stats, UnloadReason};
use crate::supervisor::logparse::Offload;
use crate::supervisor::runner::DeviceMemory;

mod workers;

/// What a runner placed at `placement` takes: a partial one holds on its GPUs only their
/// shares, and the layers left on the CPU in host memory.
fn planned_footprint(placement: &Placement, need: Need) -> Footprint {
    match placement {
        Placement::Partial { shares, .. } => {
            let on_gpus = shares.iter().map(|(_, bytes)| *bytes).fold(0, u64::saturating_add);
            let footprint = need.footprint;
            Footprint { vram: on_gpus, ram: footprint.ram.saturating_add(footprint.vram.saturating_sub(on_gpus)) }
        }
        _ => need.footprint,
    }
}

type Reply = oneshot::Sender<Result<Lease, ScheduleError>>;

/// How a ready runner is stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stop {
    /// SIGTERM, then SIGKILL after the grace period.
    Graceful,
    /// SIGKILL now: its worker is gone, so it cannot finish anything.
    Now,
}

enum Phase {
    Loading { waiters: Vec<Reply> },
    Ready { stop: oneshot::Sender<Stop>, socket: PathBuf, pid: u32 },
    Unloading { waiters: Vec<oneshot::Sender<Result<(), ScheduleError>>> },
}

struct Entry {
    request: ModelRequest,
    /// The models it serves, `request.name` first.
    users: Vec<String>,
    phase: Phase,
    offload: Option<Offload>,
    /// Each device's memory, planned and actual, once ready.
    devices: Vec<DeviceMemory>,
    placement: Placement,
    footprint: Footprint,
    leases: u32,
    keep_alive: KeepAlive,
    idle_since: Instant,
    draining: bool,
    /// Why it is being taken out of service (the first reason given wins).
    unload_reason: Option<UnloadReason>,
    /// What more there is to say about it (the worker that went down).
    unload_detail: Option<String>,
    unload_waiters: Vec<oneshot::Sender<Result<(), ScheduleError>>>,
    /// The task loading it, until it is ready: aborted (the child killed with it) when a
    /// worker it loads onto goes down.
    load_task: Option<tokio::task::AbortHandle>,
}

/// The most models one runner serves (copies of one model, or Modelfiles over the same
/// weights with the same load options). Each model's D-Bus object lists the others it
/// shares with, so a join changes every one of them: the views' work grows with the
/// square of this number at each join.
pub(crate) const MAX_NAMES_PER_RUNNER: usize = 64;

/// `name` joined runner `id`, which now serves `users`, in the journal.
fn log_share(id: RunnerId, name: &str, users: &[String]) {
    tracing::info!(corral_event = "share", corral_model = %name, runner = id, "{name} shares the runner of {} (same weights and load options)", users[0]);
}

impl Entry {
    /// The refusal of model `name`, which would join this runner once it serves as many
    /// models as one may.
    fn too_many_names(&self, name: &str) -> ScheduleError {
        ScheduleError::TooManyNames {
            model: name.to_owned(),
            limit: MAX_NAMES_PER_RUNNER,
            first: self.main().to_owned(),
        }
    }

    /// The model it serves first (the one it was loaded for, unless that one moved on).
    fn main(&self) -> &str {
        self.users.first().unwrap_or(&self.request.name)
    }

    /// The models it serves, for messages: "tiny:latest", or "tiny:latest, tiny2:latest"
    /// for a shared runner.
    fn served(&self) -> String {
        if self.users.is_empty() { self.request.name.clone() } else { self.users.join(", ") }
    }
}

struct Failures {
    count: u32,
    until: Instant,
    reason: String,
}

/// The scheduler's state and loop.
pub struct Scheduler {
    backend: Arc<dyn Backend>,
    gpus: Vec<GpuView>,
    host_usable: u64,
    limits: Limits,
    runners: BTreeMap<RunnerId, Entry>,
    queue: VecDeque<(ModelRequest, Reply)>,
    failures: BTreeMap<RunnerKey, Failures>,
    next_id: RunnerId,
    commands: mpsc::Receiver<Command>,
    events: mpsc::UnboundedReceiver<Event>,
    events_tx: mpsc::UnboundedSender<Event>,
    learned: Footprints,
    /// llama.cpp's projection of each request key's footprint (`Err`: the estimate stands
    /// in, for the reason given); a key absent here and in `projecting` is not asked yet.
    projected: BTreeMap<RunnerKey, Result<Projected, String>>,
    projecting: Option<RunnerKey>,
    /// Models whose estimate was already reported as standing in for a projection.
    estimated: std::collections::BTreeSet<String>,
    counters: Counters,
    notices: broadcast::Sender<Notice>,
    /// The RPC workers: who is up, what to ask the monitor, whose fate is awaited.
    fleet: workers::FleetState,
}

impl Scheduler {
    /// A scheduler planning with `gpus` and `host_usable` bytes of host memory; run it with
    /// [`Scheduler::run`] on its own task.
    #[must_use]
    pub fn new(
        backend: Arc<dyn Backend>,
        gpus: Vec<GpuView>,
        host_usable: u64,
        limits: Limits,
        learned: Footprints,
    ) -> (Self, Handle) {
        let (commands_tx, commands) = mpsc::channel(64);
        let (events_tx, events) = mpsc::unbounded_channel();
        // Views that lag this far behind resynchronise from a snapshot.
        let (notices, _) = broadcast::channel(256);
        let scheduler = Self {
            backend,
            gpus,
            host_usable,
            limits,
            runners: BTreeMap::new(),
            queue: VecDeque::new(),
            failures: BTreeMap::new(),
            next_id: 1,
            commands,
            events,
            events_tx,
            learned,
            projected: BTreeMap::new(),
            projecting: None,
            estimated: std::collections::BTreeSet::new(),
            counters: Counters::default(),
            notices: notices.clone(),
            fleet: workers::FleetState::default(),
        };
        (scheduler, Handle { commands: commands_tx, notices })
    }

    /// Runs until [`Handle::shutdown`] (or every handle is gone), then stops all runners.
    pub async fn run(mut self) {
        let shutdown = loop {
            let next_expiry = self.next_expiry();
            tokio::select! {
                command = self.commands.recv() => match command {
                    Some(Command::Shutdown { reply }) => break Some(reply),
                    Some(command) => self.on_command(command),
                    None => break None,
                },
                Some(event) = self.events.recv() => self.on_event(event),
                () = sleep_until(next_expiry) => self.expire(Instant::now()),
            }
        };
        self.stop_all().await;
        if let Some(reply) = shutdown {
            let _ = reply.send(());
        }
    }

    fn on_command(&mut self, command: Command) {
        match command {
            Command::Acquire { request, reply } => self.acquire(*request, reply),
            Command::Unload { key, reply } => self.unload_by_key(&key, reply),
            Command::UnloadModel { name, reply } => {
                let _ = reply.send(self.unload_model(&name));
            }
            Command::Loaded { reply } => {
                let _ = reply.send(self.loaded_models());
            }
            Command::Stats { reply } => {
                let stats =
                    Stats { counters: self.counters, queue_depth: self.waiting(), loaded: self.loaded_models() };
                let _ = reply.send(stats);
            }
            Command::Reconfigure { limits } => {
                self.limits = limits.clone();
                self.notify(Notice::Reconfigured(limits));
                // A larger limit may let queued requests through; a lower one sheds runners.
                self.schedule();
            }
            Command::Dead { runner } => self.dead(runner),
            Command::Fleet { fleet, checked } => self.fleet_changed(*fleet, &checked),
            Command::Fate { runner, reply } => self.await_fate(runner, reply),
            Command::Ping { reply } => {
                let _ = reply.send(());
            }
            Command::Shutdown { .. } => unreachable!("handled by the loop"),
        }
    }

    fn acquire(&mut self, request: ModelRequest, reply: Reply) {
        let queue_full = self.waiting() >= self.limits.max_queue;
        // The fast path: a ready runner with this key that takes requests.
        if let Some((&id, entry)) = self.runners.iter_mut().find(|(_, e)| e.request.key == request.key && !e.draining) {
            let joined = !entry.users.contains(&request.name);
            if joined && !matches!(entry.phase, Phase::Unloading { .. }) {
                if entry.users.len() >= MAX_NAMES_PER_RUNNER {
                    let _ = reply.send(Err(entry.too_many_names(&request.name)));
                    return;
                }
                entry.users.push(request.name.clone());
            }
            let users = entry.users.clone();
            match &mut entry.phase {
                Phase::Ready { socket, .. } => {
                    entry.leases += 1;
                    self.counters.leases += 1;
                    entry.keep_alive = keep_alive::resolve(
                        request.keep_alive,
                        Some(entry.keep_alive),
                        self.limits.default_keep_alive,
                        self.limits.clamp,
                    );
                    let lease = Lease { runner: id, socket: socket.clone(), events: self.events_tx.clone() };
                    if joined {
                        self.shares(id, &request.name, users);
                    }
                    if reply.send(Ok(lease)).is_err() {
                        // The caller went away: its lease was dropped and released already.
                    }
                    return;
                }
                Phase::Loading { waiters } => {
                    if queue_full {
                        self.counters.queue_full += 1;
                        let _ = reply.send(Err(ScheduleError::QueueFull(self.limits.max_queue)));
                        if joined {
                            self.runners.get_mut(&id).expect("looked up above").users.retain(|n| *n != request.name);
                        }
                        return;
                    }
                    // A load already under way: join it.
                    waiters.push(reply);
                    if joined {
                        self.shares(id, &request.name, users);
                    }
                    return;
                }
                Phase::Unloading { .. } => {}
            }
        }
        if let Some(failure) = self.failures.get(&request.key) {
            let now = Instant::now();
            if failure.until > now {
                let _ = reply.send(Err(ScheduleError::BackingOff {
                    model: request.name.clone(),
                    failures: failure.count,
                    reason: failure.reason.clone(),
                    retry_in: failure.until - now,
                }));
                return;
            }
        }
        if self.waiting() >= self.limits.max_queue {
            self.counters.queue_full += 1;
            let _ = reply.send(Err(ScheduleError::QueueFull(self.limits.max_queue)));
            return;
        }
        // The same model with other load options: reload, i.e. retire its old runner. A
        // runner that serves other models too is theirs as well: it stays, and this model
        // gets a runner of its own (which makes room by the usual rules, reported as
        // evictions); it no longer counts as served by the old one.
        let stale: Vec<RunnerId> = self
            .runners
            .iter()
            .filter(|(_, e)| {
                e.request.key.weights == request.key.weights
                    && e.request.key != request.key
                    && !e.draining
                    && e.users.iter().all(|n| *n == request.name)
            })
            .map(|(id, _)| *id)
            .collect();
        for id in stale {
            tracing::info!(corral_event = "reload", corral_model = %request.name, runner = id, "reloading {} with other load options", request.name);
            self.retire(id, UnloadReason::Reloaded);
        }
        self.queue.push_back((request, reply));
        self.schedule();
    }

    /// Takes a runner out of service: unloads it now if idle, else once its requests end.
    fn retire(&mut self, id: RunnerId, reason: UnloadReason) {
        let Some(entry) = self.runners.get_mut(&id) else { return };
        entry.draining = true;
        entry.unload_reason.get_or_insert(reason);
        if entry.leases == 0 && matches!(entry.phase, Phase::Ready { .. }) {
            self.begin_unload(id, reason);
        }
    }

    /// A request found runner `id` dead before its own crash report came: out of service
    /// now, stopped (and reaped) once the requests holding it let go.
    fn dead(&mut self, id: RunnerId) {
        let Some(entry) = self.runners.get_mut(&id) else { return };
        if entry.draining || !matches!(entry.phase, Phase::Ready { .. }) {
            return;
        }
        tracing::warn!(corral_event = "crash", corral_model = %entry.request.name, runner = id, "{} does not answer on its socket; replacing it", entry.request.name);
        self.retire(id, UnloadReason::Crashed);
    }

    /// Applies a lower `max_loaded` at once: idle runners beyond it unload now, busy ones
    /// drain and go when their requests end.
    fn shed(&mut self) {
        let Some(Decision::MakeRoom { evict, drain }) = policy::shed(&self.snapshot()) else { return };
        self.counters.evictions += (evict.len() + drain.len()) as u64;
        for id in drain {
            self.retire(id, UnloadReason::Evicted);
        }
        for id in evict {
            self.begin_unload(id, UnloadReason::Evicted);
        }
    }

    /// Model `name` joined runner `id`, which now serves `users`.
    fn shares(&self, id: RunnerId, name: &str, users: Vec<String>) {
        log_share(id, name, &users);
        self.notify(Notice::Serving { runner: id, names: users });
    }

    /// Tells the views; nobody listening is fine.
    fn notify(&self, notice: Notice) {
        let _ = self.notices.send(notice);
    }

    /// Requests waiting for a load: queued, and joined to loads under way.
    fn waiting(&self) -> usize {
        let joined: usize = self
            .runners
            .values()
            .map(|e| if let Phase::Loading { waiters } = &e.phase { waiters.len() } else { 0 })
            .sum();
        self.queue.len() + joined
    }

    /// Works through the queue in order until a request has to wait for room.
    fn schedule(&mut self) {
        self.shed();
        while let Some((request, _)) = self.queue.front() {
            if self.queue.front().is_some_and(|(_, reply)| reply.is_closed()) {
                // The client went away while waiting: it must not drive evictions.
                self.queue.pop_front();
                continue;
            }
            // A runner for this key may have appeared (loading, or ready) meanwhile.
            if self
                .runners
                .values()
                .any(|e| e.request.key == request.key && !e.draining && !matches!(e.phase, Phase::Unloading { .. }))
            {
                let (request, reply) = self.queue.pop_front().expect("checked above");
                self.acquire(request, reply);
                continue;
            }
            let request = request.clone();
            let Some((footprint, per_device)) = self.need(&request) else { return };
            let need = Need { footprint, layers: request.layers, per_device };
            let snapshot = self.snapshot();
            match policy::decide(&snapshot, need) {
                // It would go on workers being checked: wait for the check (bounded by its
                // timeout) rather than load elsewhere, to stay there for its keep_alive, or
                // evict what did not need to go.
                Decision::Load(_) | Decision::MakeRoom { .. } if self.awaits_checked_workers(&snapshot, need) => {
                    return;
                }
                Decision::Load(placement) => {
                    let (request, reply) = self.queue.pop_front().expect("checked above");
                    let footprint = planned_footprint(&placement, need);
                    self.start(request, placement, footprint, reply);
                }
                Decision::MakeRoom { evict, drain } => {
                    self.counters.evictions += (evict.len() + drain.len()) as u64;
                    for id in drain {
                        if let Some(entry) = self.runners.get_mut(&id) {
                            entry.draining = true;
                            entry.unload_reason.get_or_insert(UnloadReason::Evicted);
                        }
                    }
                    for id in evict {
                        self.begin_unload(id, UnloadReason::Evicted);
                    }
                    return;
                }
                Decision::Wait => return,
                // Workers being checked may bring room back: wait for the check (bounded by its timeout).
                Decision::NoFit { .. } if self.checking_workers() => return,
                Decision::NoFit { needed, available, gpus, host } => {
                    let (request, reply) = self.queue.pop_front().expect("checked above");
                    let devices = gpus
                        .into_iter()
                        .map(|(index, room)| (self.gpus.get(index).map_or_else(String::new, |g| g.name.clone()), room))
                        .collect();
                    let model = request.name;
                    let error = ScheduleError::InsufficientMemory {
                        model: model.clone(),
                        needed,
                        available,
                        devices,
                        host,
                        down: self.down_workers(),
                    };
                    tracing::warn!(corral_event = "no_fit", corral_model = %model, "{error}");
                    let _ = reply.send(Err(error));
                }
            }
        }
    }

    /// What `request` needs: llama.cpp's projection, else what its last load measured,
    /// else the estimate (reported once per model). `None` while the projection is
    /// being made: the queue waits for it (a second or so, once per key).
    fn need(&mut self, request: &ModelRequest) -> Option<(Footprint, u64)> {
        match self.projected.get(&request.key) {
            Some(Ok(projected)) => return Some((projected.footprint, projected.per_device)),
            Some(Err(reason)) => {
                if self.estimated.insert(request.name.clone()) {
                    tracing::info!(corral_event = "estimate", corral_model = %request.name,
                        "{}: planning with an estimate, since llama.cpp's projection cannot be had: {reason}", request.name);
                }
            }
            None => {
                if self.projecting.is_none() {
                    self.projecting = Some(request.key.clone());
                    let projected = self.backend.project(&request.files, &request.options);
                    let events = self.events_tx.clone();
                    let key = request.key.clone();
                    tokio::spawn(async move {
                        let _ = events.send(Event::Projected { key, result: projected.await });
                    });
                }
                return None;
            }
        }
        Some((self.learned.get(&request.key).unwrap_or(request.need), 0))
    }

    fn start(&mut self, request: ModelRequest, placement: Placement, need: Footprint, reply: Reply) {
        let id = self.next_id;
        self.next_id += 1;
        let start = StartRequest {
            id,
            model: request.name.clone(),
            files: request.files.clone(),
            options: request.options.clone(),
            placement: placement.clone(),
            footprint: need,
            rooms: policy::rooms(&self.snapshot()),
        };
        tracing::info!(corral_event = "load", corral_model = %request.name, runner = id, ?placement, "loading {}", request.name);
        self.counters.loads += 1;
        let keep_alive =
            keep_alive::resolve(request.keep_alive, None, self.limits.default_keep_alive, self.limits.clamp);
        self.runners.insert(
            id,
            Entry {
                users: vec![request.name.clone()],
                offload: None,
                devices: Vec::new(),
                request,
                phase: Phase::Loading { waiters: vec![reply] },
                placement,
                footprint: need,
                leases: 0,
                keep_alive,
                idle_since: Instant::now(),
                draining: false,
                unload_reason: None,
                unload_detail: None,
                unload_waiters: Vec::new(),
                load_task: None,
            },
        );
        let name = self.runners[&id].request.name.clone();
        self.notify(Notice::Loading { runner: id, name: name.clone() });
        // This model is served by its new runner from now on, not by one it shared.
        let left: Vec<RunnerId> = self
            .runners
            .iter()
            .filter(|(other, e)| **other != id && e.users.len() > 1 && e.users.contains(&name))
            .map(|(other, _)| *other)
            .collect();
        for other in left {
            let entry = self.runners.get_mut(&other).expect("listed above");
            entry.users.retain(|n| *n != name);
            let names = entry.users.clone();
            self.notify(Notice::Serving { runner: other, names });
        }
        // Requests for this model queued behind others join the load now, in their order:
        // none waits for the queue's head while its model loads or runs.
        let key = self.runners[&id].request.key.clone();
        let (joining, rest): (VecDeque<_>, VecDeque<_>) =
            std::mem::take(&mut self.queue).into_iter().partition(|(queued, _)| queued.key == key);
        self.queue = rest;
        if let Some(entry) = self.runners.get_mut(&id).filter(|e| matches!(e.phase, Phase::Loading { .. })) {
            let mut joined = Vec::new();
            for (queued, reply) in joining {
                // Another model of the same weights and options shares the load.
                if !entry.users.contains(&queued.name) {
                    if entry.users.len() >= MAX_NAMES_PER_RUNNER {
                        let _ = reply.send(Err(entry.too_many_names(&queued.name)));
                        continue;
                    }
                    entry.users.push(queued.name.clone());
                    joined.push(queued.name);
                }
                if let Phase::Loading { waiters } = &mut entry.phase {
                    waiters.push(reply);
                }
            }
            // One notice for all who joined: the views update each name it lists.
            if !joined.is_empty() {
                let users = entry.users.clone();
                for name in &joined {
                    log_share(id, name, &users);
                }
                self.notify(Notice::Serving { runner: id, names: users });
            }
        }
        let backend = Arc::clone(&self.backend);
        let events = self.events_tx.clone();
        let task = tokio::spawn(async move {
            let result = backend.start(start).await;
            let _ = events.send(Event::Started { runner: id, result });
        });
        if let Some(entry) = self.runners.get_mut(&id) {
            entry.load_task = Some(task.abort_handle());
        }
    }

    fn on_event(&mut self, event: Event) {
        match event {
            Event::Started { runner, result } => self.started(runner, result),
            Event::Projected { key, result } => {
                self.projecting = None;
                // Bounded by the keys of models asked for; a failure is asked again after a restart.
                self.projected.insert(key, result);
                self.schedule();
            }
            Event::Released { runner } => {
                if let Some(entry) = self.runners.get_mut(&runner) {
                    entry.leases = entry.leases.saturating_sub(1);
                    if entry.leases == 0 {
                        entry.idle_since = Instant::now();
                        if entry.draining || entry.keep_alive.is_zero() {
                            self.begin_unload(runner, UnloadReason::Expired);
                        }
                    }
                }
                self.schedule();
            }
            Event::Stopped { runner } => {
                if let Some(entry) = self.runners.remove(&runner) {
                    self.counters.unloads += 1;
                    let reason = entry.unload_reason.unwrap_or(UnloadReason::Requested);
                    let served = entry.served();
                    tracing::info!(corral_event = "unload", corral_model = %entry.main(), runner, reason = reason.as_str(), "unloaded {served} ({})", entry.unload_detail.as_deref().unwrap_or(reason.as_str()));
                    let detail = entry.unload_detail.clone();
                    self.ended(
                        runner,
                        &entry.placement,
                        detail.clone().unwrap_or_else(|| format!("it was unloaded ({})", reason.as_str())),
                    );
                    self.notify(Notice::Unloaded { runner, name: entry.request.name.clone(), reason, detail });
                    let waiters = match entry.phase {
                        Phase::Unloading { waiters } => waiters,
                        _ => Vec::new(),
                    };
                    for waiter in waiters.into_iter().chain(entry.unload_waiters) {
                        let _ = waiter.send(Ok(()));
                    }
                }
                self.schedule();
            }
            Event::Crashed { runner, reason } => {
                if let Some(entry) = self.runners.remove(&runner) {
                    self.counters.crashes += 1;
                    let served = entry.served();
                    tracing::warn!(corral_event = "crash", corral_model = %entry.main(), runner, "{served} crashed: {reason}");
                    self.record_failure(&entry.request.key, reason.clone());
                    // A worker it used may be why: have them checked before planning on them again.
                    self.suspect(&entry.placement);
                    self.ended(runner, &entry.placement, format!("it crashed: {reason}"));
                    self.notify(Notice::Unloaded {
                        runner,
                        name: entry.request.name.clone(),
                        reason: UnloadReason::Crashed,
                        detail: Some(reason),
                    });
                    for waiter in entry.unload_waiters {
                        let _ = waiter.send(Ok(()));
                    }
                }
                self.schedule();
            }
        }
    }

    /// A load that failed (or was called off): its entry goes, its waiters get the reason.
    fn load_failed(&mut self, id: RunnerId, waiters: Vec<Reply>, failure: LoadFailure) {
        let Some(entry) = self.runners.remove(&id) else { return };
        let LoadFailure { class, reason } = failure;
        self.counters.load_failures += 1;
        tracing::warn!(corral_event = "load_failed", corral_model = %entry.request.name, runner = id, corral_class = class.as_str(), "{} failed to load ({}): {reason}", entry.request.name, class.as_str());
        self.record_failure(&entry.request.key, reason.clone());
        self.suspect(&entry.placement);
        self.notify(Notice::LoadFailed { runner: id, name: entry.request.name.clone(), reason: reason.clone() });
        for waiter in waiters {
            let _ = waiter.send(Err(ScheduleError::LoadFailed {
                model: entry.request.name.clone(),
                class,
                reason: reason.clone(),
            }));
        }
        // Asked to unload while it loaded: with the load failed, nothing is left.
        for waiter in entry.unload_waiters {
            let _ = waiter.send(Ok(()));
        }
    }

    fn started(&mut self, id: RunnerId, result: Result<Box<dyn LiveRunner>, LoadFailure>) {
        let Some(entry) = self.runners.get_mut(&id) else { return };
        entry.load_task = None;
        let waiters = match std::mem::replace(&mut entry.phase, Phase::Loading { waiters: Vec::new() }) {
            Phase::Loading { waiters } => waiters,
            other => {
                entry.phase = other;
                return;
            }
        };
        match result {
            Err(failure) => self.load_failed(id, waiters, failure),
            Ok(mut live) => {
                self.counters.load_millis += u64::try_from(entry.idle_since.elapsed().as_millis()).unwrap_or(u64::MAX);
                self.failures.remove(&entry.request.key);
                if let Some(measured) = live.measured() {
                    entry.footprint = measured;
                    if let Some(write) = self.learned.record(&entry.request.key, measured) {
                        tokio::task::spawn_blocking(move || write.write());
                    }
                }
                let socket = live.socket();
                let pid = live.pid();
                let offload = live.offload();
                let devices = live.devices();
                let (stop_tx, stop_rx) = oneshot::channel::<Stop>();
                let events = self.events_tx.clone();
                // The runner's own task: stop on request, report a crash otherwise.
                tokio::spawn(async move {
                    tokio::select! {
                        reason = live.exited() => {
                            let _ = events.send(Event::Crashed { runner: id, reason });
                        }
                        how = stop_rx => {
                            if how == Ok(Stop::Now) { live.kill().await } else { live.stop().await }
                            let _ = events.send(Event::Stopped { runner: id });
                        }
                    }
                });
                entry.phase = Phase::Ready { stop: stop_tx, socket: socket.clone(), pid };
                entry.offload = offload;
                entry.devices = devices;
                entry.idle_since = Instant::now();
                let ready = Notice::Ready {
                    runner: id,
                    name: entry.request.name.clone(),
                    pid,
                    footprint: entry.footprint,
                    offload,
                };
                let _ = self.notices.send(ready);
                for waiter in waiters {
                    entry.leases += 1;
                    self.counters.leases += 1;
                    let lease = Lease { runner: id, socket: socket.clone(), events: self.events_tx.clone() };
                    // A waiter that went away drops the lease at once, which releases it.
                    let _ = waiter.send(Ok(lease));
                }
            }
        }
        self.schedule();
    }

    fn record_failure(&mut self, key: &RunnerKey, reason: String) {
        let failure = self.failures.entry(key.clone()).or_insert(Failures {
            count: 0,
            until: Instant::now(),
            reason: String::new(),
        });
        failure.count += 1;
        // The first failure is retried at once; then 2 s, 4 s, … up to a minute.
        let backoff = if failure.count <= 1 {
            Duration::ZERO
        } else {
            Duration::from_secs(1 << failure.count.min(6)).min(Duration::from_secs(60))
        };
        failure.until = Instant::now() + backoff;
        failure.reason = reason;
    }

    fn unload_by_key(&mut self, key: &RunnerKey, reply: oneshot::Sender<Result<(), ScheduleError>>) {
        let Some((&id, entry)) = self.runners.iter_mut().find(|(_, e)| e.request.key == *key) else {
            let _ = reply.send(Err(ScheduleError::NotLoaded(key.to_string())));
            return;
        };
        entry.unload_waiters.push(reply);
        self.retire(id, UnloadReason::Requested);
    }

    /// Takes every runner serving `name` out of service, as one step; the answers come
    /// as each child is reaped.
    fn unload_model(&mut self, name: &str) -> Result<Vec<Reaped>, ScheduleError> {
        let ids: Vec<RunnerId> =
            self.runners.iter().filter(|(_, e)| e.users.iter().any(|n| n == name)).map(|(id, _)| *id).collect();
        if ids.is_empty() {
            return Err(ScheduleError::NotLoaded(name.to_owned()));
        }
        let mut reaped = Vec::with_capacity(ids.len());
        for id in ids {
            let (reply, answer) = oneshot::channel();
            self.runners.get_mut(&id).expect("listed above").unload_waiters.push(reply);
            self.retire(id, UnloadReason::Requested);
            reaped.push(answer);
        }
        Ok(reaped)
    }

    fn begin_unload(&mut self, id: RunnerId, reason: UnloadReason) {
        self.stop_runner(id, reason, Stop::Graceful);
    }

    /// Takes runner `id` out of service: a ready one is stopped (`how`), a loading one
    /// goes as soon as its load ends.
    fn stop_runner(&mut self, id: RunnerId, reason: UnloadReason, how: Stop) {
        let Some(entry) = self.runners.get_mut(&id) else { return };
        entry.unload_reason.get_or_insert(reason);
        if let Phase::Ready { .. } = entry.phase {
            let Phase::Ready { stop, .. } =
                std::mem::replace(&mut entry.phase, Phase::Unloading { waiters: Vec::new() })
            else {
                unreachable!("matched above")
            };
            let _ = stop.send(how);
            let name = entry.request.name.clone();
            self.notify(Notice::Unloading { runner: id, name });
        } else {
            entry.draining = true;
        }
    }

    fn next_expiry(&self) -> Option<Instant> {
        self.runners.values().filter_map(expiry).min()
    }

    fn expire(&mut self, now: Instant) {
        let due: Vec<RunnerId> =
            self.runners.iter().filter(|(_, e)| expiry(e).is_some_and(|at| at <= now)).map(|(id, _)| *id).collect();
        for id in due {
            self.begin_unload(id, UnloadReason::Expired);
        }
    }

    fn snapshot(&self) -> Snapshot {
        let now = Instant::now();
        let runners = self
            .runners
            .iter()
            .map(|(id, e)| RunnerView {
                id: *id,
                placement: e.placement.clone(),
                footprint: e.footprint,
                leases: e.leases,
                keep_alive: e.keep_alive,
                last_used: e.idle_since.min(now).into_std(),
                pinned: e.request.pinned,
                loading: matches!(e.phase, Phase::Loading { .. }),
                draining: e.draining || matches!(e.phase, Phase::Unloading { .. }),
            })
            .collect();
        Snapshot {
            gpus: self.usable_gpus(),
            host_usable: self.host_usable,
            runners,
            max_loaded: self.limits.max_loaded,
            partial_offload: self.limits.partial_offload,
        }
    }

    fn loaded_models(&self) -> Vec<LoadedModel> {
        self.runners
            .iter()
            .map(|(id, e)| LoadedModel {
                devices: e.devices.clone(),
                id: *id,
                name: e.request.name.clone(),
                names: e.users.clone(),
                key: e.request.key.clone(),
                state: match e.phase {
                    Phase::Loading { .. } => "loading",
                    Phase::Ready { .. } => "ready",
                    Phase::Unloading { .. } => "unloading",
                },
                placement: e.placement.clone(),
                footprint: e.footprint,
                leases: e.leases,
                expires_at: expiry(e),
                keep_alive: e.keep_alive,
                pid: if let Phase::Ready { pid, .. } = e.phase { Some(pid) } else { None },
                context_length: e.request.options.num_ctx,
                offload: e.offload,
            })
            .collect()
    }

    async fn stop_all(&mut self) {
        for (_, reply) in self.queue.drain(..) {
            let _ = reply.send(Err(ScheduleError::ShuttingDown));
        }
        let ids: Vec<RunnerId> = self.runners.keys().copied().collect();
        for id in &ids {
            self.begin_unload(*id, UnloadReason::Shutdown);
        }
        // Wait until every child is reaped (loads under way finish first, then stop).
        while !self.runners.is_empty() {
            match self.events.recv().await {
                Some(Event::Started { runner, result: Ok(live) }) => {
                    live.stop().await;
                    self.runners.remove(&runner);
                }
                Some(Event::Stopped { runner }) => {
                    if let Some(entry) = self.runners.remove(&runner) {
                        let name = entry.request.name;
                        self.notify(Notice::Unloaded { runner, name, reason: UnloadReason::Shutdown, detail: None });
                    }
                }
                Some(Event::Started { runner, result: Err(_) } | Event::Crashed { runner, .. }) => {
                    self.runners.remove(&runner);
                }
                Some(Event::Released { .. } | Event::Projected { .. }) => {}
                None => break,
            }
        }
    }
}

/// When an idle, ready runner is due to unload.
fn expiry(entry: &Entry) -> Option<Instant> {
    if entry.leases > 0 || !matches!(entry.phase, Phase::Ready { .. }) || entry.request.pinned {
        return None;
    }
    match entry.keep_alive {
        KeepAlive::Forever => None,
        // Past the clock's range (no client or key sets that: `durations::LONGEST`) is never.
        KeepAlive::For(d) => entry.idle_since.checked_add(d),
    }
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}
