//! `org.corral.Corral1.Manager` at `/org/corral/Corral1`.

use std::collections::HashMap;
use std::sync::Arc;

use zbus::object_server::SignalEmitter;
use zbus::zvariant::{ObjectPath, OwnedObjectPath, OwnedValue};
use zbus::{Connection, interface};

use super::error::Error;
use super::job::{self, Work};
use super::{Shared, TEXT, lock, model_path, options, reply_fits, texts};
use crate::scheduler::device_use;
use crate::scheduler::keep_alive::KeepAlive;
use crate::scheduler::request;
use crate::scheduler::types::ScheduleError;
use crate::store::PassedFile;
use crate::store::create::CreateSpec;
use crate::store::modelfile::Modelfile;
use crate::store::name::ModelName;

/// One model in `ListModels`: name, object path, digest, size, state.
type Listed = (String, OwnedObjectPath, String, u64, String);

/// An upper bound of `ListModels`' reply: per model a structure's padding (7), its texts,
/// and the size (8).
fn list_bytes_at_most(listed: &[Listed]) -> usize {
    let model = |(name, path, digest, _, state): &Listed| {
        15 + texts(&mut [name.len(), path.len(), digest.len(), state.len()].into_iter())
    };
    TEXT + listed.iter().map(model).sum::<usize>()
}

pub(super) struct Manager {
    shared: Arc<Shared>,
}

impl Manager {
    pub(super) fn new(shared: Arc<Shared>) -> Self {
        Self { shared }
    }
}

#[interface(name = "org.corral.Corral1.Manager")]
impl Manager {
    /// Every model in the store: (name, object path, digest, size, state), the most
    /// recently created or pulled first (as `ollama list`).
    ///
    /// Refused with `LimitsExceeded` when the reply would not fit in one message of the
    /// system bus (many tens of thousands of models).
    #[zbus(out_args("models"))]
    async fn list_models(&self) -> Result<Vec<Listed>, Error> {
        let store = self.shared.context.store.clone();
        let mut listed = blocking(move || store.list_shared()).await??;
        // Newest first; equal times by name, so the order is stable (each name written once).
        listed.sort_by_cached_key(|m| (std::cmp::Reverse(m.modified), m.name.to_string()));
        let models = lock(&self.shared.models);
        let listed: Vec<Listed> = listed
            .iter()
            .map(|m| {
                let short = m.name.to_string();
                let state = models.get(&short).map_or("stopped", |d| lock(d).state);
                (short.clone(), model_path(&short), m.digest.to_string(), m.size, state.to_owned())
            })
            .collect();
        let what = format!("the listing's {} models", listed.len());
        reply_fits(list_bytes_at_most(&listed), &what, "GetModel finds one model")
            .map_err(|e| Error::LimitsExceeded(e.to_string()))?;
        Ok(listed)
    }

    /// The object path of a stored model.
    #[zbus(out_args("model"))]
    async fn get_model(&self, name: &str) -> Result<OwnedObjectPath, Error> {
        let parsed = ModelName::parse(name)?;
        let store = self.shared.context.store.clone();
        let short = parsed.to_string();
        blocking(move || store.manifest(&parsed)).await?.map_err(|e| Error::from(e).naming(name))?;
        Ok(model_path(&short))
    }

    /// Loads a model; returns once it is ready.
    #[zbus(out_args("model"))]
    async fn load(&self, name: &str, options: HashMap<String, OwnedValue>) -> Result<OwnedObjectPath, Error> {
        load(&self.shared, name, &options).await
    }

    /// Unloads a model; returns once its processes are reaped. `NotLoaded` for a stored
    /// model that is not loaded, `NoSuchModel` for a name the store does not have.
    async fn unload(&self, name: &str) -> Result<(), Error> {
        unload(&self.shared, &ModelName::parse(name)?.to_string()).await.map_err(|e| e.naming(name))
    }

    /// Starts a pull; returns the job.
    #[zbus(out_args("job"))]
    async fn pull(
        &self,
        name: &str,
        options: HashMap<String, OwnedValue>,
        #[zbus(connection)] connection: &Connection,
    ) -> Result<OwnedObjectPath, Error> {
        self.writable()?;
        let (name_parsed, registry) = self.transfer(name, &options)?;
        job::start(&self.shared, connection, name, Work::Pull { name: name_parsed, registry }).await
    }

    /// Starts a push; returns the job.
    #[zbus(out_args("job"))]
    async fn push(
        &self,
        name: &str,
        options: HashMap<String, OwnedValue>,
        #[zbus(connection)] connection: &Connection,
    ) -> Result<OwnedObjectPath, Error> {
        let (name_parsed, registry) = self.transfer(name, &options)?;
        job::start(&self.shared, connection, name, Work::Push { name: name_parsed, registry }).await
    }

    /// Starts creating a model from a Modelfile; returns the job.
    #[zbus(out_args("job"))]
    async fn create(
        &self,
        name: &str,
        modelfile: &str,
        #[zbus(connection)] connection: &Connection,
    ) -> Result<OwnedObjectPath, Error> {
        self.start_create(name, modelfile, HashMap::new(), connection).await
    }

    /// Starts creating a model from a Modelfile whose local files the caller passes open;
    /// returns the job. Each `FROM` or `ADAPTER` value that is a key of `files` is read from
    /// that descriptor (a regular file open for reading), so corrald needs no access to the
    /// caller's paths and the bytes move once, hashed as they are copied.
    #[zbus(out_args("job"))]
    async fn create_with_files(
        &self,
        name: &str,
        modelfile: &str,
        files: HashMap<String, zbus::zvariant::OwnedFd>,
        #[zbus(connection)] connection: &Connection,
    ) -> Result<OwnedObjectPath, Error> {
        self.start_create(name, modelfile, files, connection).await
    }

    /// Starts copying a model; returns the job.
    #[zbus(out_args("job"))]
    async fn copy(
        &self,
        source: &str,
        destination: &str,
        #[zbus(connection)] connection: &Connection,
    ) -> Result<OwnedObjectPath, Error> {
        let from = ModelName::parse(source)?;
        let to = ModelName::parse(destination)?;
        self.writable()?;
        job::start(&self.shared, connection, source, Work::Copy { from, to }).await
    }

    /// Starts deleting a model; returns the job.
    #[zbus(out_args("job"))]
    async fn delete(&self, name: &str, #[zbus(connection)] connection: &Connection) -> Result<OwnedObjectPath, Error> {
        let parsed = ModelName::parse(name)?;
        self.writable()?;
        job::start(&self.shared, connection, name, Work::Delete { name: parsed }).await
    }

    /// A model became ready.
    #[zbus(signal)]
    pub(super) async fn model_loaded(
        emitter: &SignalEmitter<'_>,
        name: &str,
        model: ObjectPath<'_>,
        pid: u32,
    ) -> zbus::Result<()>;

    /// A model's runner stopped and was reaped.
    #[zbus(signal)]
    pub(super) async fn model_unloaded(
        emitter: &SignalEmitter<'_>,
        name: &str,
        model: ObjectPath<'_>,
        reason: &str,
    ) -> zbus::Result<()>;

    /// What a loaded runner placed where.
    #[zbus(signal)]
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn offload_reported(
        emitter: &SignalEmitter<'_>,
        name: &str,
        model: ObjectPath<'_>,
        gpu_layers: u32,
        total_layers: u32,
        vram_bytes: u64,
        ram_bytes: u64,
    ) -> zbus::Result<()>;

    /// A job ended.
    #[zbus(signal)]
    pub(super) async fn job_finished(
        emitter: &SignalEmitter<'_>,
        job: ObjectPath<'_>,
        success: bool,
        error: &str,
    ) -> zbus::Result<()>;

    #[zbus(property(emits_changed_signal = "const"))]
    #[allow(clippy::unused_self)] // zbus calls getters on the object
    fn version(&self) -> &str {
        crate::VERSION
    }

    /// Superseded by `Devices`; kept for compatibility. Not signalled: workers come and go.
    #[zbus(property(emits_changed_signal = "false"))]
    fn gpus(&self) -> Vec<(String, String, String, u64, u64)> {
        self.shared
            .context
            .fleet
            .inventory()
            .online()
            .map(|(_, g)| g)
            .map(|g| (g.id.clone(), g.name.clone(), g.backend.as_str().to_owned(), g.total_bytes, g.free_bytes))
            .collect()
    }

    /// Every device, the host last: (kind, name, description, total, usable, used by
    /// corral). The use is asked of the scheduler on each get: it changes with every load.
    #[zbus(property(emits_changed_signal = "false"))]
    async fn devices(&self) -> zbus::fdo::Result<Vec<(String, String, String, u64, u64, u64)>> {
        let stats = self.shared.context.scheduler.stats().await.map_err(|e| zbus::fdo::Error::Failed(e.to_string()))?;
        Ok(device_use::usage(&self.shared.context.fleet.inventory(), &stats.loaded)
            .into_iter()
            .map(|d| (d.kind.to_owned(), d.name, d.description, d.total_bytes, d.usable_bytes, d.used_bytes))
            .collect())
    }

    /// Every configured worker: (name, address, "up" or "down", its devices' ids, why it is
    /// down, the last check's connection time in µs, since when in its state in µs since
    /// the epoch). Signalled when a worker's state, devices or error change.
    #[zbus(property)]
    fn workers(&self) -> Vec<WorkerRow> {
        workers_property(&self.shared.context.fleet.now().workers)
    }

    #[zbus(property(emits_changed_signal = "const"))]
    fn host_memory(&self) -> u64 {
        self.shared.context.fleet.inventory().host.available_bytes
    }

    #[zbus(property)]
    fn loaded_models(&self) -> Vec<String> {
        // From the runners' view itself, not the copy kept to signal changes: a reply that
        // waited for that view to show its effect ([`Shared::settled`]) is then never
        // followed by an older `LoadedModels`.
        lock(&self.shared.runners).names()
    }

    /// Asked of the scheduler on each get: it changes with every request.
    #[zbus(property(emits_changed_signal = "false"))]
    async fn queue_depth(&self) -> zbus::fdo::Result<u32> {
        let stats = self.shared.context.scheduler.stats().await.map_err(|e| zbus::fdo::Error::Failed(e.to_string()))?;
        Ok(u32::try_from(stats.queue_depth).unwrap_or(u32::MAX))
    }

    #[zbus(property)]
    fn max_loaded_models(&self) -> u32 {
        u32::try_from(lock(&self.shared.limits).max_loaded).unwrap_or(u32::MAX)
    }

    #[zbus(property)]
    fn max_queue(&self) -> u32 {
        u32::try_from(lock(&self.shared.limits).max_queue).unwrap_or(u32::MAX)
    }

    #[zbus(property)]
    fn default_keep_alive(&self) -> i64 {
        match lock(&self.shared.limits).default_keep_alive {
            KeepAlive::Forever => -1,
            KeepAlive::For(d) => i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        }
    }
}

impl Manager {
    /// `Create` and `CreateWithFiles`: checks everything, then starts the job.
    async fn start_create(
        &self,
        name: &str,
        modelfile: &str,
        files: HashMap<String, zbus::zvariant::OwnedFd>,
        connection: &Connection,
    ) -> Result<OwnedObjectPath, Error> {
        let model = ModelName::parse(name)?;
        self.writable()?;
        let modelfile = Modelfile::parse(modelfile).map_err(|e| Error::InvalidArgument(format!("Modelfile: {e}")))?;
        // The descriptors' checks and the paths' lookups are file system calls: off the
        // runtime, where a slow file system holds a blocking thread, not a worker.
        let spec = blocking(move || {
            let opened = files
                .into_iter()
                .map(|(key, fd)| PassedFile::new(fd.into(), &key).map(|file| (key, file)))
                .collect::<Result<HashMap<_, _>, _>>()?;
            // Relative paths would be relative to the daemon, not to the caller: there is none.
            CreateSpec::from_modelfile_passing(&modelfile, std::path::Path::new("/"), &opened)
        })
        .await??;
        job::start(&self.shared, connection, name, Work::Create { name: model, spec: Box::new(spec) }).await
    }

    fn writable(&self) -> Result<(), Error> {
        if self.shared.context.read_only {
            return Err(Error::ReadOnly("the model store is read-only ([store] read_only = true)".into()));
        }
        Ok(())
    }

    /// A pull's or push's model and registry client: the shared one, or with `insecure`
    /// one that speaks plain HTTP to the model's registry.
    fn transfer(
        &self,
        name: &str,
        options: &HashMap<String, OwnedValue>,
    ) -> Result<(ModelName, crate::store::registry::Registry), Error> {
        options::only(options, &["insecure"])?;
        let parsed = ModelName::parse(name)?;
        let shared = &self.shared.context.registry;
        let registry = if options::flag(options, "insecure")? {
            shared.allowing_insecure(parsed.registry())
        } else {
            shared.clone()
        };
        Ok((parsed, registry))
    }
}

/// Loads `given` with the caller's `options`; resolves once it is ready. Shared by the
/// manager's and the model's Load.
pub(super) async fn load(
    shared: &Shared,
    given: &str,
    options: &HashMap<String, OwnedValue>,
) -> Result<OwnedObjectPath, Error> {
    let name = ModelName::parse(given)?;
    let (options, keep_alive) = options::load_options(options)?;
    let (store, defaults) = (shared.context.store.clone(), shared.context.defaults);
    let request = blocking(move || request::build(&store, &name, &options, keep_alive, false, defaults))
        .await?
        .map_err(|e| Error::from(e).naming(given))?;
    let short = request.name.clone();
    let path = model_path(&short);
    // The model stays loaded for its keep-alive once this lease is dropped.
    let runner = match shared.context.scheduler.acquire(request).await {
        Ok(lease) => lease.runner(),
        Err(e) => {
            // A failed load is over when the reply goes: the views no longer show it loading.
            shared.settled(|runners| !runners.loading(&short)).await;
            return Err(e.into());
        }
    };
    shared.settled(|runners| runners.loaded(runner, &short)).await;
    Ok(path)
}

/// Unloads the model named `short`; resolves once its runners are reaped and the views
/// show it stopped. Shared by the manager's and the model's Unload.
pub(super) async fn unload(shared: &Shared, short: &str) -> Result<(), Error> {
    if let Err(e) = shared.context.scheduler.unload_model(short).await {
        // Not loaded: say whether there is such a model at all.
        let stored = lock(&shared.models).contains_key(short);
        return Err(match e {
            ScheduleError::NotLoaded(_) if !stored => Error::NoSuchModel(format!("model '{short}' not found")),
            e => e.into(),
        });
    }
    shared.settled(|runners| runners.none_of(short)).await;
    Ok(())
}

/// Runs store work on the blocking pool.
pub(super) async fn blocking<T: Send + 'static>(work: impl FnOnce() -> T + Send + 'static) -> Result<T, Error> {
    tokio::task::spawn_blocking(work).await.map_err(|e| Error::Failed(format!("a store task failed: {e}")))
}

/// One worker in `Workers`: name, address, state, devices, last error, rtt and since (µs).
type WorkerRow = (String, String, String, Vec<String>, String, u64, u64);

/// The `Workers` property's value.
pub(super) fn workers_property(workers: &[crate::workers::WorkerStatus]) -> Vec<WorkerRow> {
    let micros = |d: std::time::Duration| u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
    workers
        .iter()
        .map(|w| {
            (
                w.name.clone(),
                w.address.clone(),
                if w.up { "up" } else { "down" }.to_owned(),
                w.devices.clone(),
                w.last_error.clone(),
                w.rtt.map_or(0, micros),
                w.since.duration_since(std::time::UNIX_EPOCH).map_or(0, micros),
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use zbus::DBusError;
    use zbus::zvariant::serialized::Context;
    use zbus::zvariant::{LE, to_bytes};

    use super::super::{MAX_REPLY, model_path, reply_fits};
    use super::{Error, Listed, list_bytes_at_most};

    /// `ListModels`' bound is never below what zvariant writes, for names and states of
    /// every length (padding of every remainder), and not far above it.
    #[test]
    fn the_listing_is_never_larger_than_its_bound_and_the_bound_not_far_above_it() {
        for count in [0, 1, 2, 7] {
            let listed: Vec<Listed> = (0..count)
                .map(|i| {
                    let name = format!("m{}:{}", "x".repeat(i * 3), "t".repeat(i));
                    let state = ["stopped", "ready", "loading"][i % 3].to_owned();
                    (name.clone(), model_path(&name), format!("sha256:{}", "a".repeat(64)), u64::MAX, state)
                })
                .collect();
            let written = to_bytes(Context::new_dbus(LE, 0), &listed).expect("serialize").len();
            let bound = list_bytes_at_most(&listed);
            assert!(written <= bound, "{count}: {written} bytes written, bound {bound}");
            assert!(bound <= 2 * written.max(8), "{count}: {written} bytes written, bound {bound}");
        }
    }

    /// A reply over the bus's message limit is refused with `LimitsExceeded`, which says
    /// what it would hold and what to ask instead.
    #[test]
    fn a_reply_over_the_limit_is_refused_with_limits_exceeded() {
        assert!(reply_fits(MAX_REPLY, "the listing's 9 models", "GetModel").is_ok());
        let refused = reply_fits(MAX_REPLY + 1, "the listing's 9 models", "GetModel finds one model")
            .expect_err("over the limit");
        assert_eq!(refused.name().as_str(), "org.freedesktop.DBus.Error.LimitsExceeded");
        let error = Error::LimitsExceeded(refused.to_string());
        assert_eq!(error.name().as_str(), "org.corral.Corral1.Error.LimitsExceeded");
        let text = error.description().unwrap_or_default().to_owned();
        assert!(text.contains("the listing's 9 models") && text.contains("GetModel finds one model"), "{text}");
    }
}
