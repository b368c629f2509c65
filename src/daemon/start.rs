//! Building the parts at start: the store, the scheduler and its runners, the HTTP state,
//! the D-Bus service, the preloads, and the process limits and cgroup tree they run in.

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;

use crate::cli::LogTarget;
use crate::config::{BusKind, Config, Loaded};
use crate::dbus;
use crate::gpu;
use crate::http::{self, listeners};
use crate::paths::Paths;
use crate::projection::{DryRun, ProjectionCache, Projector};
use crate::scheduler::actor::Scheduler;
use crate::scheduler::backend::Projections;
use crate::scheduler::backend::SupervisorBackend;
use crate::scheduler::footprints::Footprints;
use crate::scheduler::handle::Handle;
use crate::scheduler::keep_alive::{Clamp, KeepAlive};
use crate::scheduler::policy::GpuView;
use crate::scheduler::projections::CachedProjections;
use crate::scheduler::request;
use crate::scheduler::types::Limits;
use crate::store::Store;
use crate::store::name::ModelName;
use crate::store::registry::{Registry, RegistryConfig};
use crate::supervisor::cgroup::CgroupTree;
use crate::supervisor::child_log::LogSink;
use crate::supervisor::command::INHERITED_VARIABLES;
use crate::supervisor::runner::SupervisorConfig;
use crate::systemd::{JOURNAL_SOCKET, JournalWriter};
use crate::workers::{self, CheckSettings, Fleet, FleetView, Monitor};

/// The sockets systemd passed, or else the configured `[server] listen` addresses bound.
pub(super) async fn listen(
    sockets: Vec<(String, OwnedFd)>,
    config: &Config,
) -> Result<Vec<listeners::Listener>, listeners::ListenError> {
    if sockets.is_empty() { listeners::bind(&config.server.listen).await } else { listeners::adopt(sockets) }
}

/// The journal's first entry: version, configuration files and directories.
pub(super) fn log_start(loaded: &Loaded, paths: &Paths) {
    tracing::info!(
        corral_event = "start",
        version = crate::VERSION,
        config_files = ?loaded.files,
        state_directory = %paths.state.display(),
        runtime_directory = %paths.runtime.display(),
        "corrald {} starting",
        crate::VERSION,
    );
}

/// After `READY=1`: has inotify report other programs' changes to the manifests (so that
/// listings walk the tree only after a change), then, off the async threads and in one
/// task (one thread, not two, each with its own malloc arena), checks the listing the
/// store opened with against the tree (or builds it: [`open_store`]), saves it at
/// `listing` if it changed, and removes the temporary files an older version may have
/// left below the top of the store; garbage collection follows (at start, then every
/// `[store] gc_interval`). Each walks every model's directory, which before `READY=1`
/// would make start grow with the store, and one at a time they leave listings the
/// other core.
pub(super) fn after_ready(config: &Config, store: &Store, listing: PathBuf) {
    match store.watch_manifests().and_then(|()| crate::store::follow_outside_changes(store)) {
        Ok(()) => tracing::debug!("watching the manifests for other programs' changes"),
        Err(e) => tracing::info!(
            error = %e,
            "not watching the manifests ({e}); other programs' changes show in listings within a second"
        ),
    }
    let (store, sweep) = (store.clone(), !config.store.read_only);
    // Unused blobs and stale partial downloads go next, then every `[store] gc_interval`.
    let gc = config.store.gc_interval.filter(|_| sweep).map(|interval| (interval, config.store.gc_grace));
    tokio::spawn(async move {
        let indexed = store.clone();
        let done = tokio::task::spawn_blocking(move || {
            // The index first: a listing asked meanwhile answers from the saved one, or
            // (none saved) waits for this walk, never for the sweep.
            match indexed.check_listing().and_then(|()| indexed.list_shared()) {
                Ok(listed) => {
                    tracing::debug!(models = listed.len(), read = indexed.manifests_read(), "listed the models");
                    indexed.save_listing(&listing);
                }
                Err(e) => tracing::warn!(error = %e, "cannot list the models: {e}"),
            }
            if sweep {
                if let Err(e) = indexed.remove_nested_temporaries() {
                    tracing::warn!(error = %e, "cannot look for temporary files below the store's manifests: {e}");
                }
            }
        });
        match done.await {
            // Not started before the runtime shut down: corrald is stopping.
            Err(e) if e.is_cancelled() => return,
            Err(e) => tracing::error!(error = %e, "listing the models panicked"),
            Ok(()) => {}
        }
        if let Some((interval, grace)) = gc {
            crate::store::gc::run(store, Some(interval), grace).await;
        }
    });
}

/// Makes `/api/tags`' body before `READY=1` ([`http::keep_tags_ready`]), off the async
/// threads.
pub(super) async fn keep_tags_ready(state: &http::AppState) {
    let state = state.clone();
    if let Err(e) = tokio::task::spawn_blocking(move || http::keep_tags_ready(&state)).await {
        tracing::warn!(error = %e, "making the listing's body panicked");
    }
}

/// Where the listing's index is kept between runs.
pub(super) fn listing_file(paths: &Paths) -> PathBuf {
    paths.state.join("listing.json")
}

/// Saves the listing's index for the next start, if it changed since it was saved.
pub(super) async fn save_listing(store: Store, paths: &Paths) {
    let listing = listing_file(paths);
    if let Err(e) = tokio::task::spawn_blocking(move || store.save_listing(&listing)).await {
        tracing::warn!(error = %e, "saving the model listing panicked");
    }
}

/// Waits, at most `bound`, for the new blobs' syncs still running; a blob left unsynced
/// is synced by the next start (its note names this boot).
pub(super) async fn wait_synced(store: &Store, bound: Duration) {
    let store = store.clone();
    let waited = tokio::time::timeout(bound, tokio::task::spawn_blocking(move || store.wait_synced())).await;
    if waited.is_err() {
        tracing::warn!(
            timeout = ?bound,
            "new blobs still syncing after {}; the next start syncs them",
            crate::durations::human(bound)
        );
    }
}

/// Raises the soft limit on open files to the hard one: every connection, upload and
/// runner socket is a file, and the soft limit is often 1024 (systemd's default, kept
/// low for programs that still use `select`; corrald uses epoll).
pub(super) fn raise_open_files_limit() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => match setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
            Ok(()) => tracing::debug!(from = soft, to = hard, "raised the soft limit on open files"),
            Err(e) => tracing::debug!(soft, hard, error = %e, "cannot raise the soft limit on open files"),
        },
        Ok((soft, _)) => tracing::debug!(limit = soft, "the soft limit on open files is already the hard one"),
        Err(e) => tracing::debug!(error = %e, "cannot read the limit on open files"),
    }
}

/// Opens the model store (checking it, which reads the disk: off the async threads) with
/// the listing the last run saved, so that listings answer at once after `READY=1`
/// (about 5 ms of start at 1 000 models, against a walk of the tree of 40 to 60).
pub(super) async fn open_store(config: &Config, paths: &Paths) -> anyhow::Result<Store> {
    let store_path = config.store.path.clone().unwrap_or_else(|| paths.default_store());
    let (read_only, direct_io) = (config.store.read_only, config.store.direct_io);
    let sync_before_reply = config.store.sync_before_reply;
    let listing = listing_file(paths);
    tokio::task::spawn_blocking(move || {
        let store = if read_only { Store::open_read_only(&store_path) } else { Store::open(&store_path) }?;
        let store = store.with_direct_io(direct_io).with_blob_syncs(sync_before_reply, boot_id());
        if !read_only {
            let recovered = store.recover_unsynced()?;
            if !recovered.removed.is_empty() || !recovered.resynced.is_empty() {
                tracing::info!(
                    removed = recovered.removed.len(),
                    resynced = recovered.resynced.len(),
                    "dealt with the blobs an earlier run left unsynced"
                );
            }
        }
        let taken = store.load_listing(&listing);
        tracing::debug!(models = taken, "took the saved listing");
        Ok::<_, crate::store::StoreError>(store)
    })
    .await
    .context("the store check panicked")?
    .context("cannot open the model store")
}

/// This boot's id, which tells the next start whether a blob left unsynced is still in
/// the page cache (`store::unsynced`); `None` where the kernel does not say.
fn boot_id() -> Option<String> {
    let id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    Some(id.trim().to_owned()).filter(|id| !id.is_empty())
}

/// What the HTTP handlers share, from the configuration at start.
pub(super) fn app_state(config: &Config, store: Store, scheduler: Handle, fleet: FleetView) -> http::AppState {
    let registry = Registry::new(RegistryConfig {
        insecure: config.store.insecure_registries.clone(),
        ..RegistryConfig::default()
    });
    http::AppState::from(http::Shared {
        store,
        scheduler,
        safety: Arc::new(http::Safety::new(&config.server, http::LocalNames::system())),
        defaults: request::Defaults { num_ctx: config.scheduler.num_ctx, parallel: config.scheduler.num_parallel },
        registry,
        tokens: Arc::default(),
        upstream: crate::supervisor::upstream::Pool::new(config.runner.stream_idle_timeout),
        templates: crate::prompt_template::Renderer::default(),
        fleet,
        tags: Arc::default(),
    })
}

/// Serves the D-Bus interface, unless `[dbus] bus = "off"`. Without a bus (or the right
/// to own the name) corrald still serves HTTP: D-Bus is a view, and a missing bus on a
/// development machine must not stop the daemon.
pub(super) async fn serve_dbus(config: &Config, state: &http::AppState) -> Option<dbus::Service> {
    if config.dbus.bus == BusKind::Off {
        return None;
    }
    let limits = limits(config, state.fleet.inventory().gpus.len());
    let context = dbus::Context {
        store: state.store.clone(),
        scheduler: state.scheduler.clone(),
        registry: state.registry.clone(),
        defaults: state.defaults,
        fleet: state.fleet.clone(),
        limits,
        read_only: config.store.read_only,
        max_jobs: config.dbus.max_jobs,
        tokens: Arc::clone(&state.tokens),
    };
    match dbus::serve(config.dbus.bus, context).await {
        Ok(service) => {
            // "serving D-Bus" follows once the name is taken (`dbus::serve`).
            tracing::debug!(bus = ?config.dbus.bus, "connected to D-Bus");
            Some(service)
        }
        Err(e) => {
            tracing::warn!(bus = ?config.dbus.bus, error = %e, "cannot serve D-Bus; serving HTTP only");
            None
        }
    }
}

/// Starts the scheduler on the memory inventory and the workers that answer the first
/// check, with llama-server runners, and the workers' health monitor; returns the
/// scheduler's handle, the views' copy of the fleet and the scheduler's task.
pub(super) async fn start_scheduler(
    config: &Config,
    paths: &Paths,
    cgroups: Option<CgroupTree>,
    log_target: LogTarget,
) -> anyhow::Result<(Handle, FleetView, tokio::task::JoinHandle<()>)> {
    let gpu_config = config.gpu.clone();
    let (probe, local) = tokio::task::spawn_blocking(move || {
        let probe: Arc<dyn gpu::MemoryProbe> = Arc::from(gpu::probe(&gpu_config, &gpu::Roots::system()));
        let inventory = probe.inventory();
        (probe, inventory)
    })
    .await
    .context("the memory probe panicked")?;
    // The workers are asked through llama-server, as the runners will see them.
    let checks = CheckSettings {
        tcp_table: gpu::Roots::system().proc.join("net/tcp"),
        llama_server: config.runner.llama_server.clone(),
        timeout: config.worker_health.timeout,
        list_timeout: gpu::rpc::ASK_TIMEOUT,
        reserve: config.gpu.reserve,
    };
    let fleet = Fleet::new(local, &config.workers, std::time::SystemTime::now());
    let fleet = workers::first_round(fleet, &config.workers, &checks).await;
    let inventory = &fleet.inventory;
    std::fs::create_dir_all(&paths.runtime)
        .with_context(|| format!("cannot create the runtime directory {}", paths.runtime.display()))?;
    let log_sink = match log_target {
        LogTarget::Journal => LogSink::Journal(Arc::new(
            JournalWriter::new(Path::new(JOURNAL_SOCKET)).context("cannot open the journal socket")?,
        )),
        _ => LogSink::Tracing,
    };
    let inherited_env =
        std::env::vars_os().filter(|(k, _)| INHERITED_VARIABLES.iter().any(|allowed| k == allowed)).collect();
    let backend = SupervisorBackend {
        config: SupervisorConfig {
            llama_server: config.runner.llama_server.clone(),
            runtime_dir: paths.runtime.clone(),
            inherited_env,
            log_sink,
            cgroups,
            stop_grace: Duration::from_secs(10),
            worker_link_timeout: config.worker_health.timeout,
        },
        load_timeout: config.scheduler.load_timeout,
        devices: Arc::new(std::sync::RwLock::new(SupervisorBackend::device_ids(&inventory.gpus))),
        probe: Some(probe),
        projections: Projector::from_config(&config.runner, std::env::var_os("PATH").as_deref()).ok().map(
            |projector| {
                let cache = ProjectionCache::load(paths.state.join("projections.json"));
                let dry_run = DryRun {
                    llama_server: config.runner.llama_server.clone(),
                    socket_dir: paths.runtime.clone(),
                    timeout: config.runner.projection_timeout,
                };
                Arc::new(CachedProjections::new(projector, dry_run, cache)) as Arc<dyn Projections>
            },
        ),
    };
    let gpus = GpuView::all(inventory);
    let limits = limits(config, gpus.len());
    let max_loaded = limits.max_loaded;
    let online = inventory.online().count();
    tracing::info!(
        gpus = online,
        host_bytes = inventory.host.available_bytes,
        max_loaded,
        "scheduling on {} and {} of host memory",
        crate::units::count(online, "device", "devices"),
        crate::units::bytes(inventory.host.available_bytes)
    );
    let learned = Footprints::load(paths.state.join("footprints.json"));
    let (scheduler, handle) = Scheduler::new(Arc::new(backend), gpus, inventory.host.available_bytes, limits, learned);
    let (views, view) = tokio::sync::watch::channel(fleet.clone());
    let scheduler = if config.workers.is_empty() {
        scheduler
    } else {
        let (nudge, nudges) = workers::nudges();
        let scheduler = scheduler.with_workers(&fleet, nudge);
        let monitor = Monitor {
            fleet,
            workers: config.workers.clone(),
            settings: checks,
            interval: config.worker_health.interval,
            views,
            scheduler: handle.clone(),
            nudges,
        };
        tokio::spawn(monitor.run());
        scheduler
    };
    let task = tokio::spawn(scheduler.run());
    Ok((handle, FleetView::new(view), task))
}

/// The scheduler's limits from the configuration (applied again on reload).
pub(super) fn limits(config: &Config, gpu_count: usize) -> Limits {
    Limits {
        max_loaded: match config.scheduler.max_loaded_models {
            0 => (3 * gpu_count).max(3),
            n => usize::try_from(n).unwrap_or(usize::MAX),
        },
        max_queue: usize::try_from(config.scheduler.max_queue).unwrap_or(usize::MAX),
        default_keep_alive: KeepAlive::For(config.scheduler.keep_alive),
        clamp: Clamp { min: config.scheduler.keep_alive_min, max: config.scheduler.keep_alive_max },
        partial_offload: config.scheduler.partial_offload,
    }
}

/// Loads the models configured with `preload = true`, in the background.
pub(super) fn preload(config: &Config, store: &Store, scheduler: &Handle) {
    let defaults = request::Defaults { num_ctx: config.scheduler.num_ctx, parallel: config.scheduler.num_parallel };
    for (name, policy) in config.models.iter().filter(|(_, p)| p.preload) {
        let (name_text, store, scheduler) = (name.clone(), store.clone(), scheduler.clone());
        let keep_alive = policy.keep_alive.map(KeepAlive::For);
        let pinned = policy.pinned;
        tokio::spawn(async move {
            let built = tokio::task::spawn_blocking(move || {
                let name = ModelName::parse(&name_text).map_err(|e| e.to_string())?;
                request::build(&store, &name, &request::LoadOverrides::default(), keep_alive, pinned, defaults)
                    .map_err(|e| e.to_string())
            })
            .await;
            let outcome = match built {
                Ok(Ok(request)) => scheduler.acquire(request).await.map(drop).map_err(|e| e.to_string()),
                Ok(Err(e)) => Err(e),
                Err(e) => Err(e.to_string()),
            };
            if let Err(e) = outcome {
                tracing::error!(corral_event = "preload", error = %e, "cannot preload a model: {e}");
            }
        });
    }
}

/// Under systemd, takes over the delegated cgroup subtree (moving the daemon into its
/// `daemon` leaf) and kills runners an earlier instance left behind; elsewhere, runners
/// use process groups and a parent-death signal.
pub(super) fn take_cgroup_tree() -> Option<CgroupTree> {
    match CgroupTree::adopt_if_service() {
        Ok(Some(tree)) => {
            match tree.kill_stale() {
                Ok(stale) if !stale.is_empty() => {
                    tracing::warn!(?stale, "killed runners left by an earlier instance");
                }
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, "cannot clean up runners of an earlier instance"),
            }
            tracing::info!(cgroup = %tree.root().display(), "runners get their own cgroups");
            Some(tree)
        }
        Ok(None) => {
            tracing::info!("no delegated cgroup tree; runners use process groups");
            None
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot take over the delegated cgroup tree; runners use process groups");
            None
        }
    }
}
