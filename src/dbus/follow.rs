//! Keeps the D-Bus objects in step with the store and the scheduler: model objects come
//! and go with manifests; their state, runner fields and the manager's `LoadedModels`
//! follow the scheduler's notices; signals are emitted after the data changed.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};

use tokio::sync::broadcast::error::RecvError;
use zbus::Connection;
use zbus::object_server::{InterfaceRef, SignalEmitter};
use zbus::zvariant::ObjectPath;

use super::manager::{Manager, blocking};
use super::model::{Facts, Model, ModelData, ModelObject};
use super::{BUS_NAME, ROOT_PATH, Shared, lock, model_path};
use crate::config::BusKind;
use crate::scheduler::policy::{Footprint, RunnerId};
use crate::scheduler::types::{Notice, UnloadReason};
use crate::supervisor::logparse::Offload;

/// In a task (returned): serves an object per stored model, takes the bus name, then
/// follows changes.
pub(super) fn start(shared: Arc<Shared>, connection: Connection, bus: BusKind) -> tokio::task::JoinHandle<()> {
    // Subscribed before the first snapshot, so no change falls between them.
    let mut notices = shared.context.scheduler.subscribe();
    let mut store_changes = shared.context.store.changes();
    let mut fleet = shared.context.fleet.clone();
    let mut follower = Follower { shared, connection, workers: Vec::new() };
    follower.workers = follower.workers_shown();
    tokio::spawn(async move {
        follower.sync_store().await;
        follower.sync_runners().await;
        // Without the name the objects are still served on the connection's unique name;
        // HTTP is unaffected, so this is not a reason to stop.
        match follower.connection.request_name(BUS_NAME).await {
            Ok(()) => tracing::info!(?bus, name = BUS_NAME, "serving D-Bus"),
            Err(e) => tracing::warn!(name = BUS_NAME, error = %e, "cannot take the bus name {BUS_NAME}: {e}"),
        }
        follower.shared.applied.notify_waiters();
        loop {
            tokio::select! {
                notice = notices.recv() => {
                    if matches!(notice, Err(RecvError::Closed)) {
                        break;
                    }
                    // Replies wait until the whole change is applied ([`Shared::settled`]).
                    follower.shared.applying.store(true, std::sync::atomic::Ordering::SeqCst);
                    match notice {
                        Ok(notice) => follower.apply(notice).await,
                        Err(_) => follower.sync_runners().await,
                    }
                    follower.shared.applying.store(false, std::sync::atomic::Ordering::SeqCst);
                },
                changed = store_changes.changed() => {
                    if changed.is_err() {
                        break;
                    }
                    follower.sync_store().await;
                }
                () = fleet.changed() => follower.sync_workers().await,
            }
            // Replies waiting for the views to show their effect look again.
            follower.shared.applied.notify_waiters();
        }
    })
}

/// The runners as the views know them.
#[derive(Debug, Default)]
pub(super) struct Runners {
    by_id: BTreeMap<RunnerId, Runner>,
    /// The highest runner id seen: a lower one that is absent has come and gone.
    max_seen: RunnerId,
}

impl Runners {
    /// The models some runner serves (loading ones too), sorted: `LoadedModels`.
    pub(super) fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.by_id.values().flat_map(|r| r.names.iter().cloned()).collect();
        names.sort();
        names.dedup();
        names
    }

    /// Whether the views show runner `id` past loading (ready, unloading, or gone), and
    /// serving the model `name` (which may share it with others).
    pub(super) fn loaded(&self, id: RunnerId, name: &str) -> bool {
        self.by_id.get(&id).map_or(id <= self.max_seen, |r| r.state != "loading" && r.serves(name))
    }

    /// Whether the views show no runner serving the model `name`.
    pub(super) fn none_of(&self, name: &str) -> bool {
        !self.by_id.values().any(|r| r.serves(name))
    }

    /// Whether the views show a runner loading the model `name`.
    pub(super) fn loading(&self, name: &str) -> bool {
        self.by_id.values().any(|r| r.state == "loading" && r.serves(name))
    }

    /// The newest runner serving `name`.
    fn of(&self, name: &str) -> Option<&Runner> {
        self.by_id.values().rev().find(|r| r.serves(name))
    }

    fn insert(&mut self, id: RunnerId, runner: Runner) {
        self.max_seen = self.max_seen.max(id);
        self.by_id.insert(id, runner);
    }

    fn set_state(&mut self, id: RunnerId, state: &'static str) {
        if let Some(r) = self.by_id.get_mut(&id) {
            r.state = state;
        }
    }
}

/// A runner as the views know it.
#[derive(Debug, Default)]
struct Runner {
    /// The models it serves, the one it was loaded for first.
    names: Vec<String>,
    state: &'static str,
    pid: u32,
    footprint: Footprint,
    offload: Option<Offload>,
}

impl Runner {
    fn new(name: String, state: &'static str) -> Self {
        Self { names: vec![name], state, ..Self::default() }
    }

    fn serves(&self, name: &str) -> bool {
        self.names.iter().any(|n| n == name)
    }
}

struct Follower {
    shared: Arc<Shared>,
    connection: Connection,
    /// The workers as last signalled: (name, state, devices, error); a new round-trip
    /// time alone is not a change worth a signal.
    workers: Vec<(String, bool, Vec<String>, String)>,
}

impl Follower {
    async fn apply(&mut self, notice: Notice) {
        match notice {
            Notice::Loading { runner, name } => {
                lock(&self.shared.runners).insert(runner, Runner::new(name.clone(), "loading"));
                self.update(&name, |d| d.last_error.clear()).await;
            }
            Notice::Ready { runner, name, pid, footprint, offload } => {
                let names = {
                    let mut runners = lock(&self.shared.runners);
                    runners.set_state(runner, "ready");
                    match runners.by_id.get_mut(&runner) {
                        Some(r) => {
                            (r.pid, r.footprint, r.offload) = (pid, footprint, offload);
                            r.names.clone()
                        }
                        None => vec![name],
                    }
                };
                for name in names {
                    self.update(&name, |d| d.last_error.clear()).await;
                    self.announce_loaded(&name, pid, footprint, offload).await;
                }
            }
            Notice::Serving { runner, names } => {
                let (before, ready) = {
                    let mut runners = lock(&self.shared.runners);
                    match runners.by_id.get_mut(&runner) {
                        Some(r) => (
                            std::mem::replace(&mut r.names, names.clone()),
                            (r.state == "ready").then_some((r.pid, r.footprint, r.offload)),
                        ),
                        None => return,
                    }
                };
                for name in before.iter().chain(&names) {
                    self.update(name, |_| {}).await;
                }
                if let Some((pid, footprint, offload)) = ready {
                    for name in names.iter().filter(|n| !before.contains(n)) {
                        self.announce_loaded(name, pid, footprint, offload).await;
                    }
                }
            }
            Notice::LoadFailed { runner, name, reason } => {
                let names = lock(&self.shared.runners).by_id.remove(&runner).map_or_else(|| vec![name], |r| r.names);
                for name in names {
                    self.update(&name, |d| d.last_error.clone_from(&reason)).await;
                }
            }
            Notice::Unloading { runner, name } => {
                let names = {
                    let mut runners = lock(&self.shared.runners);
                    runners.set_state(runner, "unloading");
                    runners.by_id.get(&runner).map_or_else(|| vec![name], |r| r.names.clone())
                };
                for name in names {
                    self.update(&name, |_| {}).await;
                }
            }
            Notice::Unloaded { runner, name, reason, detail } => {
                let names = lock(&self.shared.runners).by_id.remove(&runner).map_or_else(|| vec![name], |r| r.names);
                let crashed = reason == UnloadReason::Crashed;
                let emitter = self.manager_emitter();
                for name in names {
                    self.update(&name, |d| {
                        if crashed {
                            d.last_error = detail.clone().unwrap_or_default();
                        }
                    })
                    .await;
                    let _ = Manager::model_unloaded(&emitter, &name, model_path(&name).as_ref(), reason.as_str()).await;
                }
            }
            Notice::Reconfigured(limits) => {
                *lock(&self.shared.limits) = limits;
                if let Ok(iface) = self.manager().await {
                    let manager = iface.get().await;
                    let emitter = iface.signal_emitter();
                    let _ = manager.max_loaded_models_changed(emitter).await;
                    let _ = manager.max_queue_changed(emitter).await;
                    let _ = manager.default_keep_alive_changed(emitter).await;
                }
            }
        }
    }

    /// `ModelLoaded` (and `OffloadReported` when llama-server said where the layers went)
    /// for a model now served by a ready runner.
    async fn announce_loaded(&self, name: &str, pid: u32, footprint: Footprint, offload: Option<Offload>) {
        let path = model_path(name);
        let emitter = self.manager_emitter();
        let _ = Manager::model_loaded(&emitter, name, ObjectPath::from(&path), pid).await;
        if let Some(o) = offload {
            let (vram, ram) = (footprint.vram, footprint.ram);
            let _ =
                Manager::offload_reported(&emitter, name, path.as_ref(), o.gpu_layers, o.total_layers, vram, ram).await;
        }
    }

    /// Changes a model's data (`edit`, then the runner fields from the runner serving it
    /// now), and signals what changed, on the model and in `LoadedModels`.
    async fn update(&self, name: &str, edit: impl FnOnce(&mut ModelData)) {
        let newest = lock(&self.shared.runners).of(name).map(|r| {
            let others: Vec<String> = r.names.iter().filter(|n| *n != name).cloned().collect();
            (r.state, r.pid, r.footprint, r.offload, others)
        });
        let entry = lock(&self.shared.models).get(name).cloned();
        if let Some(data) = entry {
            let before = Arc::clone(&lock(&data));
            let after = {
                let mut guard = lock(&data);
                let d = Arc::make_mut(&mut guard);
                edit(d);
                d.state = match &newest {
                    Some((state, ..)) => state,
                    None if !d.last_error.is_empty() => "failed",
                    None => "stopped",
                };
                d.shared_with = newest.as_ref().map(|(.., others)| others.clone()).unwrap_or_default();
                if let Some(("ready", pid, footprint, offload, _)) = newest {
                    (d.pid, d.vram_bytes, d.ram_bytes) = (pid, footprint.vram, footprint.ram);
                    d.gpu_layers = offload.map_or(0, |o| o.gpu_layers);
                    d.total_layers = offload.map_or(0, |o| o.total_layers);
                } else {
                    (d.pid, d.gpu_layers, d.total_layers, d.vram_bytes, d.ram_bytes) = (0, 0, 0, 0, 0);
                }
                Arc::clone(&guard)
            };
            emit_model_changes(&self.connection, name, &before, &after).await;
        }
        self.update_loaded().await;
    }

    async fn update_loaded(&self) {
        let names = lock(&self.shared.runners).names();
        let changed = {
            let mut loaded = lock(&self.shared.loaded);
            let changed = *loaded != names;
            *loaded = names;
            changed
        };
        if changed {
            if let Ok(iface) = self.manager().await {
                let _ = iface.get().await.loaded_models_changed(iface.signal_emitter()).await;
            }
        }
    }

    /// Reads the runners from the scheduler (at start, and after falling behind).
    /// The workers' state as `Workers` signals it.
    fn workers_shown(&self) -> Vec<(String, bool, Vec<String>, String)> {
        let fleet = self.shared.context.fleet.now();
        fleet.workers.into_iter().map(|w| (w.name, w.up, w.devices, w.last_error)).collect()
    }

    /// Signals `Workers` when a worker's state, devices or error changed.
    async fn sync_workers(&mut self) {
        let now = self.workers_shown();
        if now == self.workers {
            return;
        }
        self.workers = now;
        if let Ok(manager) = self.manager().await {
            let _ = manager.get().await.workers_changed(manager.signal_emitter()).await;
        }
    }

    async fn sync_runners(&mut self) {
        let Ok(loaded) = self.shared.context.scheduler.loaded().await else { return };
        {
            let mut runners = lock(&self.shared.runners);
            runners.by_id.clear();
            for m in loaded {
                let ready = m.state == "ready";
                let runner = Runner {
                    names: m.names,
                    state: m.state,
                    pid: m.pid.unwrap_or(0),
                    // What a runner placed where is only told once, when it gets ready.
                    footprint: if ready { m.footprint } else { Footprint::default() },
                    offload: m.offload,
                };
                runners.insert(m.id, runner);
            }
        }
        let names: Vec<String> = lock(&self.shared.models).keys().cloned().collect();
        for name in names {
            self.update(&name, |_| {}).await;
        }
        self.update_loaded().await;
    }

    /// Adds objects for new models, removes those of deleted ones, and updates the
    /// digest, size and details of replaced ones.
    async fn sync_store(&mut self) {
        let store = self.shared.context.store.clone();
        let listed = match blocking(move || {
            store.list().map(|listed| {
                listed
                    .into_iter()
                    .map(|m| {
                        // Kept by the manifest's digest: read once, not on each change or start.
                        let facts = Facts::new(store.blob_facts(&m), m.modified);
                        let config = m.config;
                        let details = HashMap::from([
                            ("format".to_owned(), config.model_format),
                            ("family".to_owned(), config.model_family),
                            ("parameter_size".to_owned(), config.model_type),
                            ("quantization_level".to_owned(), config.file_type),
                        ]);
                        (m.name, m.digest.to_string(), m.size, details, facts)
                    })
                    .collect::<Vec<_>>()
            })
        })
        .await
        {
            Ok(Ok(listed)) => listed,
            Ok(Err(e)) => return tracing::warn!(error = %e, "cannot list the store for D-Bus"),
            Err(e) => return tracing::warn!(error = ?e, "cannot list the store for D-Bus"),
        };
        let current: HashSet<String> = listed.iter().map(|(name, ..)| name.to_string()).collect();
        let gone: Vec<String> =
            lock(&self.shared.models).keys().filter(|name| !current.contains(*name)).cloned().collect();
        for name in gone {
            lock(&self.shared.models).remove(&name);
            let _ = self.connection.object_server().remove::<ModelObject, _>(model_path(&name)).await;
        }
        for (name, digest, size, details, facts) in listed {
            let short = name.to_string();
            let existing = lock(&self.shared.models).get(&short).cloned();
            if let Some(data) = existing {
                let before = Arc::clone(&lock(&data));
                let after = {
                    let mut guard = lock(&data);
                    let d = Arc::make_mut(&mut guard);
                    (d.digest, d.size, d.details, d.facts) = (digest, size, details, facts);
                    Arc::clone(&guard)
                };
                emit_model_changes(&self.connection, &short, &before, &after).await;
                continue;
            }
            let data = Arc::new(Mutex::new(Arc::new(ModelData {
                name: name.full(),
                short_name: short.clone(),
                digest,
                size,
                details,
                facts,
                state: "stopped",
                ..ModelData::default()
            })));
            lock(&self.shared.models).insert(short.clone(), Arc::clone(&data));
            let object = ModelObject(Model { shared: Arc::clone(&self.shared), data });
            if let Err(e) = self.connection.object_server().at(model_path(&short), object).await {
                tracing::warn!(corral_model = %short, error = %e, "cannot serve {short} on D-Bus");
            }
            // A model created while loaded (or re-created) shows its runner at once.
            self.update(&short, |_| {}).await;
        }
    }

    fn manager_emitter(&self) -> SignalEmitter<'static> {
        SignalEmitter::new(&self.connection, ROOT_PATH).expect("a valid path").into_owned()
    }

    async fn manager(&self) -> zbus::Result<InterfaceRef<Manager>> {
        self.connection.object_server().interface::<_, Manager>(ROOT_PATH).await
    }
}

/// PropertiesChanged for each model property that differs between `before` and `after`.
async fn emit_model_changes(connection: &Connection, name: &str, before: &ModelData, after: &ModelData) {
    if before == after {
        return;
    }
    let Ok(iface) = connection.object_server().interface::<_, ModelObject>(model_path(name)).await else { return };
    let object = iface.get().await;
    let model = &object.0;
    let e = iface.signal_emitter();
    // Each field its own signal: zbus emits one property per call.
    if before.digest != after.digest {
        let _ = model.digest_changed(e).await;
    }
    if before.size != after.size {
        let _ = model.size_changed(e).await;
    }
    if before.details != after.details {
        let _ = model.details_changed(e).await;
    }
    // The texts are read when asked for, from the manifest the digest names.
    if before.digest != after.digest {
        let _ = model.system_invalidate(e).await;
        let _ = model.parameters_invalidate(e).await;
        let _ = model.modelfile_invalidate(e).await;
    }
    if before.facts != after.facts {
        let _ = model.context_length_changed(e).await;
        let _ = model.capabilities_changed(e).await;
        let _ = model.modified_at_changed(e).await;
    }
    if before.last_error != after.last_error {
        let _ = model.last_error_changed(e).await;
    }
    if before.pid != after.pid {
        let _ = model.pid_changed(e).await;
    }
    if before.gpu_layers != after.gpu_layers {
        let _ = model.gpu_layers_changed(e).await;
    }
    if before.total_layers != after.total_layers {
        let _ = model.total_layers_changed(e).await;
    }
    if before.vram_bytes != after.vram_bytes {
        let _ = model.vram_bytes_changed(e).await;
    }
    if before.ram_bytes != after.ram_bytes {
        let _ = model.ram_bytes_changed(e).await;
    }
    if before.shared_with != after.shared_with {
        let _ = model.shared_with_changed(e).await;
    }
    // Last, so that a client reacting to the state reads the fields already changed.
    if before.state != after.state {
        let _ = model.state_changed(e).await;
    }
}
