//! The daemon's lifecycle: listen, report ready, reload on SIGHUP, stop on SIGTERM.
//!
//! This is the composition root: it wires the configuration, the listeners and the
//! HTTP router together, owns the signal handlers and the watchdog, and keeps the
//! `STATUS=` line current.  Every lifecycle step is logged with a `corral_event`
//! field (`start`, `ready`, `reload`, `idle`, `stop`).
//!
//! With `[server] exit_on_idle` and sockets from systemd, it exits cleanly once nothing
//! has been loaded, queued or in flight for that long: the sockets stay with systemd, so
//! the next connection waits in their backlog and starts a new instance.

use std::os::fd::OwnedFd;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::Context;
use axum::body::{Body, HttpBody};
use axum::extract::{Request, State};
use axum::middleware::{Next, from_fn_with_state};
use axum::response::Response;
use futures_util::StreamExt;
use tokio::signal::unix::{SignalKind, signal};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::cli::LogTarget;
use crate::config::{BusKind, Config, ConfigSource, Loaded};
use crate::dbus;
use crate::gpu;
use crate::http::{self, listeners};
use crate::paths::Paths;
use crate::scheduler::actor::{Handle, Limits, Scheduler, Stats};
use crate::scheduler::backend::SupervisorBackend;
use crate::scheduler::footprints::Footprints;
use crate::scheduler::keep_alive::{Clamp, KeepAlive};
use crate::scheduler::policy::GpuView;
use crate::scheduler::request;
use crate::store::Store;
use crate::store::name::ModelName;
use crate::store::registry::{Registry, RegistryConfig};
use crate::supervisor::cgroup::CgroupTree;
use crate::supervisor::command::{Device, INHERITED_VARIABLES};
use crate::supervisor::runner::{LogSink, SupervisorConfig};
use crate::systemd::Notifier;
use crate::systemd::{JOURNAL_SOCKET, JournalWriter};

/// Everything the daemon starts from.
#[derive(Debug)]
pub struct Daemon {
    /// Where the configuration came from, to read it again on reload.
    pub source: ConfigSource,
    /// The configuration at start.
    pub loaded: Loaded,
    /// The working directories.
    pub paths: Paths,
    /// Sockets passed by systemd; when empty, `[server] listen` is bound instead.
    pub sockets: Vec<(String, OwnedFd)>,
    /// The service manager's notify socket.
    pub notifier: Notifier,
    /// The watchdog interval systemd asked for.
    pub watchdog: Option<Duration>,
    /// Where logs go: llama-server's lines follow the daemon's to the journal or stderr.
    pub log_target: LogTarget,
}

/// Runs the daemon until SIGTERM or SIGINT, then shuts down within `[server] shutdown_timeout`.
pub async fn run(daemon: Daemon) -> anyhow::Result<()> {
    let Daemon { source, loaded, paths, sockets, notifier, watchdog, log_target } = daemon;
    let mut loaded = loaded;
    // Handlers first: a signal that arrives during start-up must not kill the process.
    let mut sigterm = signal(SignalKind::terminate()).context("cannot handle SIGTERM")?;
    let mut sigint = signal(SignalKind::interrupt()).context("cannot handle SIGINT")?;
    let mut sighup = signal(SignalKind::hangup()).context("cannot handle SIGHUP")?;

    tracing::info!(
        corral_event = "start",
        version = http::VERSION,
        config_files = ?loaded.files,
        state_directory = %paths.state.display(),
        runtime_directory = %paths.runtime.display(),
        "corrald {} starting",
        http::VERSION,
    );

    // Taking the cgroup tree moves the daemon into its leaf; runners become its siblings.
    let cgroups = take_cgroup_tree();
    let store = open_store(&loaded.config, &paths).await?;
    // Listen before any runner starts: a start that fails to listen leaves nothing behind.
    let socket_activated = !sockets.is_empty();
    let listeners = if socket_activated {
        listeners::adopt(sockets)?
    } else {
        listeners::bind(&loaded.config.server.listen).await?
    };
    let (scheduler, inventory) = start_scheduler(&loaded.config, &paths, cgroups, log_target).await?;
    let gpu_count = inventory.gpus.len();
    preload(&loaded.config, &store, &scheduler);
    let names: Vec<String> = listeners.iter().map(listeners::Listener::describe).collect();
    let status_of = |models: usize| format!("serving on {}; {models} models loaded", names.join(", "));
    let mut models = 0;
    let mut status = status_of(models);

    let shutdown = CancellationToken::new();
    let mut servers = JoinSet::new();
    let requests = Requests::default();
    let state = app_state(&loaded.config, store.clone(), scheduler.clone());
    // Served before READY=1, so that a client started after the service finds the name.
    let bus = serve_dbus(&loaded.config, &state, inventory).await;
    let router = http::router(state).layer(from_fn_with_state(requests.clone(), count_requests));
    for listener in listeners {
        servers.spawn(listener.serve(router.clone(), shutdown.clone()));
    }
    // The sockets are listening and their accept loops are spawned: connections are served.
    notifier.ready(&status);
    tracing::info!(corral_event = "ready", listeners = ?names, socket_activated, "corrald ready: {status}");

    let mut watchdog_tick = watchdog.map(|interval| tokio::time::interval(interval / 2));
    let mut status_tick = tokio::time::interval(Duration::from_secs(2));
    if !socket_activated && loaded.config.server.exit_on_idle.is_some() {
        tracing::info!("server.exit_on_idle applies only when systemd passes the sockets; staying up");
    }
    let mut idle = IdleClock::new(Instant::now());
    let failure = loop {
        tokio::select! {
            _ = sigterm.recv() => break None,
            _ = sigint.recv() => break None,
            _ = sighup.recv() => {
                if reload(&source, &mut loaded, socket_activated, &notifier) {
                    scheduler.reconfigure(limits(&loaded.config, gpu_count)).await;
                }
                notifier.ready(&status);
            }
            () = tick(watchdog_tick.as_mut()) => notifier.watchdog(),
            // STATUS= follows the loaded models; the same tick watches for idleness.
            _ = status_tick.tick() => {
                let snapshot = scheduler.stats().await.ok();
                let now = snapshot.as_ref().map_or(models, |s| s.loaded.iter().filter(|m| m.state == "ready").count());
                if now != models {
                    models = now;
                    status = status_of(models);
                    notifier.status(&status);
                }
                let limit = loaded.config.server.exit_on_idle.filter(|_| socket_activated);
                if idle_exit_due(&mut idle, snapshot.as_ref(), &requests, bus.as_ref(), limit) {
                    break None;
                }
            }
            Some(result) = servers.join_next() => {
                break Some(match result {
                    Ok(Ok(())) => anyhow::anyhow!("an HTTP listener stopped unexpectedly"),
                    Ok(Err(e)) => anyhow::Error::new(e).context("an HTTP listener failed"),
                    Err(e) => anyhow::Error::new(e).context("an HTTP listener panicked"),
                });
            }
        }
    };

    notifier.stopping();
    tracing::info!(corral_event = "stop", "corrald stopping");
    shutdown.cancel();
    let grace = loaded.config.server.shutdown_timeout;
    if tokio::time::timeout(grace, async { while servers.join_next().await.is_some() {} }).await.is_err() {
        tracing::warn!(timeout = ?grace, "open connections did not finish in time; dropping them");
        servers.abort_all();
    }
    // Every runner is stopped and reaped before the daemon exits.
    scheduler.shutdown().await;
    if let Some(e) = failure {
        return Err(e);
    }
    tracing::info!("corrald stopped");
    Ok(())
}

/// Opens the model store (checking it, which reads the disk: off the async threads).
async fn open_store(config: &Config, paths: &Paths) -> anyhow::Result<Store> {
    let store_path = config.store.path.clone().unwrap_or_else(|| paths.default_store());
    let read_only = config.store.read_only;
    tokio::task::spawn_blocking(
        move || {
            if read_only { Store::open_read_only(&store_path) } else { Store::open(&store_path) }
        },
    )
    .await
    .context("the store check panicked")?
    .context("cannot open the model store")
}

/// The HTTP requests seen, for the idle check.
#[derive(Debug, Clone, Default)]
struct Requests {
    /// Requests whose response (streamed bodies included) has not finished.
    in_flight: Arc<AtomicUsize>,
    /// Requests started since the daemon started.
    started: Arc<AtomicU64>,
}

/// Counts a request as in flight until its response body is done or dropped.
async fn count_requests(State(requests): State<Requests>, request: Request, next: Next) -> Response {
    requests.started.fetch_add(1, Ordering::Relaxed);
    requests.in_flight.fetch_add(1, Ordering::Relaxed);
    let guard = InFlight(requests.in_flight);
    let response = next.run(request).await;
    // A body of known size is already complete; a streamed one (a chat, a pull) keeps the
    // request in flight until the stream ends or the client goes away.
    if response.body().size_hint().exact().is_some() {
        return response;
    }
    let (parts, body) = response.into_parts();
    let stream = body.into_data_stream().map(move |chunk| {
        let _held = &guard;
        chunk
    });
    Response::from_parts(parts, Body::from_stream(stream))
}

/// Ends a request's in-flight count when dropped.
#[derive(Debug)]
struct InFlight(Arc<AtomicUsize>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// What the daemon is doing at one idle check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Activity {
    /// Runners loaded, loading or unloading.
    runners: usize,
    /// Requests waiting for a load.
    queued: usize,
    /// HTTP requests not yet answered in full.
    in_flight: usize,
    /// HTTP requests started so far: a change means requests came and went between checks.
    started: u64,
}

/// Decides when the daemon has been idle for long enough to exit.
#[derive(Debug)]
struct IdleClock {
    /// Since when nothing has happened.
    since: Instant,
    /// The request count at the last check.
    started: u64,
}

impl IdleClock {
    fn new(now: Instant) -> Self {
        Self { since: now, started: 0 }
    }

    /// Records `activity` seen at `now`; true once nothing has been loaded, queued or in
    /// flight, and no request started, for `limit` (never when `limit` is `None`).
    fn observe(&mut self, activity: Activity, limit: Option<Duration>, now: Instant) -> bool {
        let busy =
            activity.runners > 0 || activity.queued > 0 || activity.in_flight > 0 || activity.started != self.started;
        self.started = activity.started;
        if busy {
            self.since = now;
        }
        limit.is_some_and(|limit| now.saturating_duration_since(self.since) >= limit)
    }
}

/// One idle check: true (and logged) when the daemon should exit for `limit`.  A scheduler
/// that does not answer counts as busy.
fn idle_exit_due(
    clock: &mut IdleClock,
    stats: Option<&Stats>,
    requests: &Requests,
    bus: Option<&dbus::Service>,
    limit: Option<Duration>,
) -> bool {
    let activity = Activity {
        runners: stats.map_or(usize::MAX, |s| s.loaded.len()),
        queued: stats.map_or(usize::MAX, |s| s.queue_depth),
        // D-Bus jobs (a pull, say) are work in flight like HTTP requests.
        in_flight: requests.in_flight.load(Ordering::Relaxed) + bus.map_or(0, dbus::Service::jobs_running),
        started: requests.started.load(Ordering::Relaxed),
    };
    if !clock.observe(activity, limit, Instant::now()) {
        return false;
    }
    let limit = limit.unwrap_or_default();
    tracing::info!(
        corral_event = "idle",
        idle_limit = ?limit,
        "nothing loaded or in flight for {}; exiting until the next connection",
        humantime::format_duration(limit)
    );
    true
}

/// What the HTTP handlers share, from the configuration at start.
fn app_state(config: &Config, store: Store, scheduler: Handle) -> http::AppState {
    let registry = Registry::new(RegistryConfig {
        insecure: config.store.insecure_registries.clone(),
        ..RegistryConfig::default()
    });
    http::AppState {
        store,
        scheduler,
        safety: Arc::new(http::Safety::new(&config.server)),
        defaults: request::Defaults { num_ctx: config.scheduler.num_ctx, parallel: config.scheduler.num_parallel },
        registry,
        tokens: Arc::default(),
        upstream: crate::supervisor::upstream::Pool::default(),
        templates: crate::prompt_template::Renderer::default(),
    }
}

/// Serves the D-Bus interface, unless `[dbus] bus = "off"`. Without a bus (or the right
/// to own the name) corrald still serves HTTP: D-Bus is a view, and a missing bus on a
/// development machine must not stop the daemon.
async fn serve_dbus(config: &Config, state: &http::AppState, inventory: gpu::Inventory) -> Option<dbus::Service> {
    if config.dbus.bus == BusKind::Off {
        return None;
    }
    let limits = limits(config, inventory.gpus.len());
    let context = dbus::Context {
        store: state.store.clone(),
        scheduler: state.scheduler.clone(),
        registry: state.registry.clone(),
        defaults: state.defaults,
        gpus: inventory.gpus,
        host_memory: inventory.host.available_bytes,
        limits,
        read_only: config.store.read_only,
    };
    match dbus::serve(config.dbus.bus, context).await {
        Ok(service) => {
            tracing::info!(bus = ?config.dbus.bus, name = dbus::BUS_NAME, "serving D-Bus");
            Some(service)
        }
        Err(e) => {
            tracing::warn!(bus = ?config.dbus.bus, error = %e, "cannot serve D-Bus; serving HTTP only");
            None
        }
    }
}

/// Starts the scheduler on the memory inventory, with llama-server runners; returns its
/// handle and the inventory.
async fn start_scheduler(
    config: &Config,
    paths: &Paths,
    cgroups: Option<CgroupTree>,
    log_target: LogTarget,
) -> anyhow::Result<(Handle, gpu::Inventory)> {
    let gpu_config = config.gpu.clone();
    let (probe, inventory) = tokio::task::spawn_blocking(move || {
        let probe: Arc<dyn gpu::MemoryProbe> = Arc::from(gpu::probe(&gpu_config, &gpu::Roots::system()));
        let inventory = probe.inventory();
        (probe, inventory)
    })
    .await
    .context("the memory probe panicked")?;
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
        },
        load_timeout: config.scheduler.load_timeout,
        devices: inventory.gpus.iter().map(|g| Device { backend: g.backend, id: g.id.clone() }).collect(),
        probe: Some(probe),
    };
    let gpus: Vec<GpuView> =
        inventory.gpus.iter().enumerate().map(|(index, g)| GpuView { index, usable: g.free_bytes }).collect();
    let limits = limits(config, gpus.len());
    let max_loaded = limits.max_loaded;
    tracing::info!(
        gpus = inventory.gpus.len(),
        host_bytes = inventory.host.available_bytes,
        max_loaded,
        "scheduling on {} GPU(s) and {} bytes of host memory",
        inventory.gpus.len(),
        inventory.host.available_bytes
    );
    let learned = Footprints::load(paths.state.join("footprints.json"));
    let (scheduler, handle) = Scheduler::new(Arc::new(backend), gpus, inventory.host.available_bytes, limits, learned);
    tokio::spawn(scheduler.run());
    Ok((handle, inventory))
}

/// The scheduler's limits from the configuration (applied again on reload).
fn limits(config: &Config, gpu_count: usize) -> Limits {
    Limits {
        max_loaded: match config.scheduler.max_loaded_models {
            0 => (3 * gpu_count).max(3),
            n => usize::try_from(n).unwrap_or(usize::MAX),
        },
        max_queue: usize::try_from(config.scheduler.max_queue).unwrap_or(usize::MAX),
        default_keep_alive: KeepAlive::For(config.scheduler.keep_alive),
        clamp: Clamp { min: config.scheduler.keep_alive_min, max: config.scheduler.keep_alive_max },
    }
}

/// Loads the models configured with `preload = true`, in the background.
fn preload(config: &Config, store: &Store, scheduler: &Handle) {
    let defaults = request::Defaults { num_ctx: config.scheduler.num_ctx, parallel: config.scheduler.num_parallel };
    for (name, policy) in config.models.iter().filter(|(_, p)| p.preload) {
        let (name_text, store, scheduler) = (name.clone(), store.clone(), scheduler.clone());
        let keep_alive = policy.keep_alive.map(KeepAlive::For);
        let pinned = policy.pinned;
        tokio::spawn(async move {
            let built = tokio::task::spawn_blocking(move || {
                let name = ModelName::parse(&name_text).map_err(|e| e.to_string())?;
                request::build(&store, &name, &serde_json::Map::new(), keep_alive, pinned, defaults)
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
fn take_cgroup_tree() -> Option<CgroupTree> {
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

/// Reads the configuration again; an invalid one is rejected and the current one kept.
/// Returns whether a new one was applied.
fn reload(source: &ConfigSource, current: &mut Loaded, socket_activated: bool, notifier: &Notifier) -> bool {
    notifier.reloading();
    match source.load() {
        Ok(new) => {
            if !socket_activated && new.config.server.listen != current.config.server.listen {
                tracing::warn!("server.listen changed; the new addresses take effect at the next start");
            }
            *current = new;
            tracing::info!(corral_event = "reload", config_files = ?current.files, "configuration reloaded");
            true
        }
        Err(e) => {
            tracing::error!(
                corral_event = "reload",
                error = %e,
                "configuration rejected, keeping the previous one: {e}"
            );
            false
        }
    }
}

/// Waits for the next watchdog tick, or forever when there is no watchdog.
async fn tick(interval: Option<&mut tokio::time::Interval>) {
    match interval {
        Some(interval) => {
            interval.tick().await;
        }
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::time::Instant;

    use super::{Activity, IdleClock};

    const QUIET: Activity = Activity { runners: 0, queued: 0, in_flight: 0, started: 0 };
    const LIMIT: Option<Duration> = Some(Duration::from_secs(60));

    fn at(start: Instant, secs: u64) -> Instant {
        start + Duration::from_secs(secs)
    }

    #[test]
    fn quiet_for_the_limit_exits_and_not_before() {
        let t0 = Instant::now();
        let mut clock = IdleClock::new(t0);
        assert!(!clock.observe(QUIET, LIMIT, at(t0, 30)));
        assert!(!clock.observe(QUIET, LIMIT, at(t0, 59)));
        assert!(clock.observe(QUIET, LIMIT, at(t0, 60)));
    }

    #[test]
    fn off_never_exits() {
        let t0 = Instant::now();
        let mut clock = IdleClock::new(t0);
        assert!(!clock.observe(QUIET, None, at(t0, 100_000)));
    }

    #[test]
    fn each_kind_of_activity_restarts_the_clock() {
        let busy =
            [Activity { runners: 1, ..QUIET }, Activity { queued: 1, ..QUIET }, Activity { in_flight: 1, ..QUIET }];
        for activity in busy {
            let t0 = Instant::now();
            let mut clock = IdleClock::new(t0);
            assert!(!clock.observe(activity, LIMIT, at(t0, 90)), "{activity:?} is not idle");
            assert!(!clock.observe(QUIET, LIMIT, at(t0, 149)), "{activity:?} restarted the clock at 90 s");
            assert!(clock.observe(QUIET, LIMIT, at(t0, 150)), "{activity:?}: idle 60 s after it ended");
        }
    }

    #[test]
    fn requests_that_came_and_went_between_checks_count() {
        let t0 = Instant::now();
        let mut clock = IdleClock::new(t0);
        assert!(!clock.observe(Activity { started: 3, ..QUIET }, LIMIT, at(t0, 70)));
        // The same count later: nothing new, so the clock runs from 70 s.
        assert!(!clock.observe(Activity { started: 3, ..QUIET }, LIMIT, at(t0, 129)));
        assert!(clock.observe(Activity { started: 3, ..QUIET }, LIMIT, at(t0, 130)));
    }

    #[test]
    fn an_unknown_scheduler_state_is_busy() {
        // When the scheduler does not answer, the daemon counts it as busy (usize::MAX).
        let t0 = Instant::now();
        let mut clock = IdleClock::new(t0);
        let unknown = Activity { runners: usize::MAX, queued: usize::MAX, ..QUIET };
        assert!(!clock.observe(unknown, LIMIT, at(t0, 1000)));
    }
}
