//! `org.corral.Corral1.Model`: one object per stored model.
//!
//! The object's data lives behind a mutex that [`follow`](super::follow) updates before
//! it emits `PropertiesChanged`; a method call in progress (a Load waiting for the model)
//! never blocks those updates.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use zbus::interface;
use zbus::zvariant::OwnedValue;

use super::error::Error;
use super::{Shared, lock, manager};
use crate::scheduler::types::LoadedModel;
use crate::store::Store;
use crate::store::name::ModelName;

/// What a model object shows; `State` and the runner fields follow the scheduler.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct ModelData {
    pub name: String,
    pub short_name: String,
    pub digest: String,
    pub size: u64,
    pub details: HashMap<String, String>,
    pub facts: Facts,
    pub state: &'static str,
    pub last_error: String,
    pub pid: u32,
    pub gpu_layers: u32,
    pub total_layers: u32,
    pub vram_bytes: u64,
    pub ram_bytes: u64,
    /// The other models served by the same llama-server process.
    pub shared_with: Vec<String>,
}

/// What the store says about a model besides its size and details: read when the
/// store changes, like the rest of [`ModelData`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct Facts {
    pub system: String,
    pub parameters: String,
    pub context_length: u64,
    pub capabilities: Vec<String>,
    pub modelfile: String,
    /// Microseconds since the epoch.
    pub modified_at: u64,
}

impl ModelData {
    /// Whether the views show a runner for it (loading, ready or unloading): a model
    /// without one has nothing to ask the scheduler about, which keeps an object tree walk
    /// (every property of every model) from asking it once per stored model.
    pub fn has_runner(&self) -> bool {
        !matches!(self.state, "stopped" | "failed")
    }
}

impl Facts {
    /// The facts of the stored model `name` (whose manifest was written at `modified`); a
    /// model whose details cannot be read shows empty ones (its weights may be missing).
    pub fn read(store: &Store, name: &ModelName, modified: SystemTime) -> Self {
        let modified_at = epoch_micros(modified);
        let details = match store.details(name) {
            Ok(details) => details,
            Err(e) => {
                tracing::debug!(corral_model = %name, error = %e, "cannot read the details of {name} for D-Bus");
                return Self { modified_at, ..Self::default() };
            }
        };
        Self {
            system: details.system.clone().unwrap_or_default(),
            parameters: details.parameters_text(),
            context_length: details.info.context_length.unwrap_or(0),
            capabilities: details.capabilities().into_iter().map(str::to_owned).collect(),
            // What the syntax cannot express comes as comments, as in /api/show.
            modelfile: details
                .modelfile(store)
                .unwrap_or_else(|e| e.to_string().lines().fold(String::new(), |out, line| out + "# " + line + "\n")),
            modified_at,
        }
    }
}

/// A model's data as shown now: replaced whole on each change, so that a reader (the
/// object tree) takes the current one without copying it.
pub(super) type Shown = Arc<Mutex<Arc<ModelData>>>;

pub(super) struct Model {
    pub shared: Arc<Shared>,
    pub data: Shown,
}

impl Model {
    fn get<T>(&self, read: impl FnOnce(&ModelData) -> T) -> T {
        read(&lock(&self.data))
    }

    /// The properties read from the scheduler, for this model alone.
    async fn live(&self) -> zbus::fdo::Result<Live> {
        let data = Arc::clone(&lock(&self.data));
        let loaded = if data.has_runner() { loaded(&self.shared).await? } else { Vec::new() };
        Ok(Live::of(&self.shared, &loaded, &data))
    }
}

#[interface(name = "org.corral.Corral1.Model")]
impl Model {
    /// As Manager.Load for this model; returns once it is ready.
    async fn load(&self, options: HashMap<String, OwnedValue>) -> Result<(), Error> {
        let name = self.get(|d| d.short_name.clone());
        manager::load(&self.shared, &name, &options).await.map(drop)
    }

    /// As Manager.Unload for this model; returns once its processes are reaped.
    async fn unload(&self) -> Result<(), Error> {
        let name = self.get(|d| d.short_name.clone());
        manager::unload(&self.shared, &name).await
    }

    #[zbus(property(emits_changed_signal = "const"))]
    fn name(&self) -> String {
        self.get(|d| d.name.clone())
    }

    #[zbus(property(emits_changed_signal = "const"))]
    fn short_name(&self) -> String {
        self.get(|d| d.short_name.clone())
    }

    #[zbus(property)]
    fn digest(&self) -> String {
        self.get(|d| d.digest.clone())
    }

    #[zbus(property)]
    fn size(&self) -> u64 {
        self.get(|d| d.size)
    }

    #[zbus(property)]
    fn details(&self) -> HashMap<String, String> {
        self.get(|d| d.details.clone())
    }

    #[zbus(property)]
    fn system(&self) -> String {
        self.get(|d| d.facts.system.clone())
    }

    #[zbus(property)]
    fn parameters(&self) -> String {
        self.get(|d| d.facts.parameters.clone())
    }

    #[zbus(property)]
    fn context_length(&self) -> u64 {
        self.get(|d| d.facts.context_length)
    }

    #[zbus(property)]
    fn capabilities(&self) -> Vec<String> {
        self.get(|d| d.facts.capabilities.clone())
    }

    #[zbus(property)]
    fn modelfile(&self) -> String {
        self.get(|d| d.facts.modelfile.clone())
    }

    #[zbus(property)]
    fn modified_at(&self) -> u64 {
        self.get(|d| d.facts.modified_at)
    }

    #[zbus(property)]
    fn state(&self) -> String {
        self.get(|d| d.state.to_owned())
    }

    #[zbus(property)]
    fn last_error(&self) -> String {
        self.get(|d| d.last_error.clone())
    }

    #[zbus(property)]
    fn pid(&self) -> u32 {
        self.get(|d| d.pid)
    }

    #[zbus(property)]
    fn gpu_layers(&self) -> u32 {
        self.get(|d| d.gpu_layers)
    }

    #[zbus(property)]
    fn total_layers(&self) -> u32 {
        self.get(|d| d.total_layers)
    }

    #[zbus(property)]
    fn vram_bytes(&self) -> u64 {
        self.get(|d| d.vram_bytes)
    }

    #[zbus(property)]
    fn ram_bytes(&self) -> u64 {
        self.get(|d| d.ram_bytes)
    }

    /// The other models served by the same runner (same weights and load options).
    #[zbus(property)]
    fn shared_with(&self) -> Vec<String> {
        self.get(|d| d.shared_with.clone())
    }

    /// Read from the scheduler on each get: it changes with every request.
    #[zbus(property(emits_changed_signal = "false"))]
    async fn expires_at(&self) -> zbus::fdo::Result<u64> {
        Ok(self.live().await?.expires_at)
    }

    #[zbus(property(emits_changed_signal = "false"))]
    fn tokens_per_second(&self) -> f64 {
        self.shared.context.tokens.speed(&self.get(|d| d.short_name.clone()))
    }

    #[zbus(property(emits_changed_signal = "false"))]
    async fn active_requests(&self) -> zbus::fdo::Result<u32> {
        Ok(self.live().await?.active_requests)
    }

    /// Where its runner's memory is, read from the scheduler on each get.
    #[zbus(property(emits_changed_signal = "false"))]
    async fn devices(&self) -> zbus::fdo::Result<Vec<(String, String, u64)>> {
        Ok(self.live().await?.devices)
    }

    /// Its runner's memory on each device by llama.cpp's name: planned before the load
    /// (0 when there was no plan for that device) and what llama.cpp allocated there.
    #[zbus(property(emits_changed_signal = "false"))]
    async fn memory(&self) -> zbus::fdo::Result<Vec<(String, u64, u64)>> {
        Ok(self.live().await?.memory)
    }
}

/// What the scheduler knows now, asked once: `ExpiresAt`, `ActiveRequests`, `Devices` and
/// `Memory` of each model come from it.
pub(super) async fn loaded(shared: &Shared) -> zbus::fdo::Result<Vec<LoadedModel>> {
    shared.context.scheduler.loaded().await.map_err(|e| zbus::fdo::Error::Failed(e.to_string()))
}

/// A model's properties that change with every request, so are read when asked.
#[derive(Debug, Default)]
pub(super) struct Live {
    pub expires_at: u64,
    pub tokens_per_second: f64,
    pub active_requests: u32,
    pub devices: Vec<(String, String, u64)>,
    pub memory: Vec<(String, u64, u64)>,
}

impl Live {
    /// `data`'s live properties from `loaded` (the scheduler's runners).
    pub fn of(shared: &Shared, loaded: &[LoadedModel], data: &ModelData) -> Self {
        let name = &data.short_name;
        let tokens_per_second = shared.context.tokens.speed(name);
        // A model without a runner has nothing to ask the scheduler about.
        if !data.has_runner() {
            return Self { tokens_per_second, ..Self::default() };
        }
        let serving = || loaded.iter().filter(|m| m.names.contains(name));
        let now = tokio::time::Instant::now();
        let expires_at = serving()
            .filter_map(|m| m.expires_at)
            .min()
            .map_or(0, |at| epoch_micros(SystemTime::now() + at.saturating_duration_since(now)));
        let active_requests = serving().map(|m| m.leases).sum();
        let (devices, memory) = serving().next().map_or_else(Default::default, |runner| {
            let devices =
                crate::gpu::model_devices(&shared.context.fleet.inventory(), &runner.placement, runner.footprint)
                    .into_iter()
                    .map(|(kind, device, bytes)| (device, kind.to_owned(), bytes))
                    .collect();
            let memory = runner.devices.iter().map(|d| (d.device.clone(), d.planned.unwrap_or(0), d.actual)).collect();
            (devices, memory)
        });
        Self { expires_at, tokens_per_second, active_requests, devices, memory }
    }
}

fn epoch_micros(time: SystemTime) -> u64 {
    let since = time.duration_since(SystemTime::UNIX_EPOCH).unwrap_or(Duration::ZERO);
    u64::try_from(since.as_micros()).unwrap_or(u64::MAX)
}
